//! See `quotalease_sim::fuzzing::rules` (the ordinary suite replays this
//! target's corpus through it: tests/fuzz_corpus.rs).
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = quotalease_sim::fuzzing::rules(data);
});

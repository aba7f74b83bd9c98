//! See `quotalease_sim::fuzzing::lease_batch` (the ordinary suite replays this
//! target's corpus through it: tests/fuzz_corpus.rs).
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    quotalease_sim::fuzzing::lease_batch(data);
});

//! The HTTP check API's parsers: any query string and any JSON body are
//! accepted or refused, never a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;
use quotalease_gateway::http_api::fuzzing;

fuzz_target!(|data: &[u8]| {
    let _ = fuzzing::json(data);
    if let Ok(q) = std::str::from_utf8(data) {
        let _ = fuzzing::query(q);
    }
});

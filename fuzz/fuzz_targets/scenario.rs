//! Scenario files: any text gives a scenario or an error, never a panic;
//! an accepted scenario scales without a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;
use quotalease_sim::scenario::Scenario;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(sc) = Scenario::parse(text, "fuzz") {
        let _ = sc.scaled(0.1);
    }
});

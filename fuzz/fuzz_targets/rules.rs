//! The rules parser: any bytes give rules or errors naming a field, never
//! a panic; accepted rules round-trip through the wire form.
#![no_main]
use libfuzzer_sys::fuzz_target;
use quotalease_model::rules::RuleSet;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match RuleSet::parse(text, "fuzz", 1) {
        Ok(rules) => {
            let back = RuleSet::from_proto(&rules.to_proto());
            assert!(back.ok().map(|r| r.rules) == Some(rules.rules), "round trip");
        }
        Err(errs) => assert!(!errs.is_empty()),
    }
});

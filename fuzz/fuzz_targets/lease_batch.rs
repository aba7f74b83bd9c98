//! The lease protocol: any bytes, decoded as a `LeaseBatch`, handled by a
//! global allocator core and by a regional one, twice (duplicates): an
//! answer per item, never a panic (the ledgers' I2 debug assertions are on
//! in fuzz builds).
#![no_main]
use libfuzzer_sys::fuzz_target;
use prost::Message;
use quotalease_allocator::core::{AllocatorCore, CoreConfig};
use quotalease_allocator::regional::{RegionalConfig, RegionalCore};
use quotalease_model::rules::RuleSet;
use quotalease_proto::lease::LeaseBatch;

const RULES: &str = r#"
rules:
  - id: a
    match: { tenant: "*", route: "*" }
    rate: 100/s
    burst: 20
  - id: b
    match: { tenant: "t", route: /x }
    rate: 5/m
    burst: 5
    max_keys: 3
"#;

fuzz_target!(|data: &[u8]| {
    let Ok(batch) = LeaseBatch::decode(data) else {
        return;
    };
    let rules = RuleSet::parse(RULES, "fuzz", 7).expect("rules");
    let cfg = CoreConfig {
        no_predecessor: true,
        ledger_id: 9,
        ..CoreConfig::default()
    };
    let mut core = AllocatorCore::new(cfg, rules.clone(), 1, 1, 1_000);
    for t in [1_000u64, 2_000_000] {
        let reply = core.handle(t, &batch);
        assert!(reply.grants.len() == batch.items.len() || reply.grants.is_empty());
    }
    let mut regional = RegionalCore::new(RegionalConfig::default(), Some(rules), 1, 1, 1_000);
    for t in [1_000u64, 2_000_000] {
        let reply = regional.handle(t, &batch);
        assert!(reply.grants.len() == batch.items.len() || reply.grants.is_empty());
    }
});

//! The bodies of the fuzz targets (`fuzz/fuzz_targets/`), here so that the
//! ordinary suite replays the corpora through the same code
//! (`tests/fuzz_corpus.rs`). Each takes any bytes and must not panic; the
//! asserts are the targets' checks.

use prost::Message;
use quotalease_allocator::core::{AllocatorCore, CoreConfig};
use quotalease_allocator::regional::{RegionalConfig, RegionalCore};
use quotalease_model::rules::RuleSet;
use quotalease_proto::lease::LeaseBatch;

use crate::scenario::Scenario;

/// Rules files: rules or errors (never empty), and accepted rules
/// round-trip through the wire form. Returns whether they were accepted.
pub fn rules(data: &[u8]) -> bool {
    let Ok(text) = std::str::from_utf8(data) else {
        return false;
    };
    match RuleSet::parse(text, "fuzz", 1) {
        Ok(rules) => {
            let back = RuleSet::from_proto(&rules.to_proto());
            assert!(
                back.ok().map(|r| r.rules) == Some(rules.rules),
                "round trip"
            );
            true
        }
        Err(errs) => {
            assert!(!errs.is_empty());
            false
        }
    }
}

const LEASE_RULES: &str = r#"
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

/// Lease batches: decoded, handled twice (a duplicate) by a global core and
/// by a regional core; a grant per item or a refusal of the batch (the
/// ledgers' I2 debug assertions are on in test and fuzz builds).
pub fn lease_batch(data: &[u8]) {
    let Ok(batch) = LeaseBatch::decode(data) else {
        return;
    };
    let rules = RuleSet::parse(LEASE_RULES, "fuzz", 7).expect("rules");
    let cfg = CoreConfig {
        no_predecessor: true,
        ledger_id: 9,
        ..CoreConfig::default()
    };
    let mut core = AllocatorCore::new(cfg, rules.clone(), 1, 1, 1_000);
    let mut regional = RegionalCore::new(RegionalConfig::default(), Some(rules), 1, 1, 1_000);
    for t in [1_000u64, 2_000_000] {
        let reply = core.handle(t, &batch);
        assert!(reply.grants.len() == batch.items.len() || reply.grants.is_empty());
        let reply = regional.handle(t, &batch);
        assert!(reply.grants.len() == batch.items.len() || reply.grants.is_empty());
    }
}

/// Scenario files: a scenario or an error; an accepted one scales.
pub fn scenario(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(sc) = Scenario::parse(text, "fuzz") {
        let _ = sc.scaled(0.1);
    }
}

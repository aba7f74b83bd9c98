//! The fuzz targets' corpora (`fuzz/corpus/`, minimized after the runs in
//! docs/fuzzing.md) replayed in the ordinary suite, through the same
//! entry points and the same checks as `fuzz/fuzz_targets/`: any input
//! that ever crashed a target stays here as a regression.

use std::path::Path;

use prost::Message;
use quotalease_allocator::core::{AllocatorCore, CoreConfig};
use quotalease_allocator::regional::{RegionalConfig, RegionalCore};
use quotalease_model::rules::RuleSet;
use quotalease_proto::lease::LeaseBatch;

fn corpus(target: &str) -> Vec<Vec<u8>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target);
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "{}: an empty corpus", dir.display());
    files.iter().map(|f| std::fs::read(f).unwrap()).collect()
}

#[test]
fn rules_corpus() {
    let mut accepted = 0;
    for data in corpus("rules") {
        let Ok(text) = std::str::from_utf8(&data) else {
            continue;
        };
        match RuleSet::parse(text, "fuzz", 1) {
            Ok(rules) => {
                accepted += 1;
                let back = RuleSet::from_proto(&rules.to_proto());
                assert!(
                    back.ok().map(|r| r.rules) == Some(rules.rules),
                    "round trip: {text:?}"
                );
            }
            Err(errs) => assert!(!errs.is_empty()),
        }
    }
    assert!(accepted > 0, "the seeds (examples/*.yaml) parse");
}

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

#[test]
fn lease_batch_corpus() {
    let rules = RuleSet::parse(RULES, "fuzz", 7).expect("rules");
    for data in corpus("lease_batch") {
        let Ok(batch) = LeaseBatch::decode(data.as_slice()) else {
            continue;
        };
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
        let mut regional =
            RegionalCore::new(RegionalConfig::default(), Some(rules.clone()), 1, 1, 1_000);
        for t in [1_000u64, 2_000_000] {
            let reply = regional.handle(t, &batch);
            assert!(reply.grants.len() == batch.items.len() || reply.grants.is_empty());
        }
    }
}

#[test]
fn http_check_corpus() {
    use quotalease_gateway::http_api::fuzzing;
    for data in corpus("http_check") {
        let _ = fuzzing::json(&data);
        if let Ok(q) = std::str::from_utf8(&data) {
            let _ = fuzzing::query(q);
        }
    }
    assert!(fuzzing::query("tenant=a&route=/x&cost=2"));
    assert!(!fuzzing::query("tenant=a&bogus=1"));
    assert!(fuzzing::json(br#"{"tenant_id":"a","route_id":"/x"}"#));
}

#[test]
fn scenario_corpus() {
    for data in corpus("scenario") {
        let Ok(text) = std::str::from_utf8(&data) else {
            continue;
        };
        if let Ok(sc) = quotalease_sim::scenario::Scenario::parse(text, "fuzz") {
            let _ = sc.scaled(0.1);
        }
    }
}

//! The simulator replays exactly: the same scenario and seed give the same
//! report, byte for byte, and the invariants hold on a small run that has
//! every kind of fault. (The full scenarios run in release in
//! scripts/test.sh's seed sweep.)

use quotalease_sim::report::markdown;
use quotalease_sim::runner::{build_report, run_all};
use quotalease_sim::scenario::Scenario;

const SMALL: &str = r#"
name: small
duration_s: 6
warmup_s: 1
regions: 2
agents_per_region: 3
ttl_max_ms: 1000
lease_ttl_ms: 1000
rules: |
  rules:
    - id: hot
      match: { tenant: t0, route: /api }
      rate: 400/s
      burst: 200
      fail_policy: closed
      overrides: [per-tenant]
    - id: per-tenant
      match: { tenant: "*", route: /api }
      rate: 50/s
      burst: 20
      fail_policy: open
workloads:
  - { kind: hot, tenant: 0, rps: 1200 }
  - { kind: zipf, tenants: 30, s: 1.0, rps: 600 }
net:
  agent_parent: { median_ms: 0.5, p99_ms: 3, loss: 0.01, duplicate: 0.01 }
  regional_global: { median_ms: 10, p99_ms: 40, loss: 0.01, duplicate: 0.01 }
faults:
  clock_drift_ppm: 1000
  cuts:
    - { at_s: 2, for_s: 2, region: 1 }
  crashes:
    - { at_s: 3, node: agent/0, restart_after_s: 0.5 }
    - { at_s: 4, node: global, restart_after_s: 0.5 }
"#;

fn report(seed: u64) -> (String, Vec<String>) {
    let sc = Scenario::parse(SMALL, "small.yaml").expect("the test scenario is valid");
    let outcomes = run_all(&sc, seed).expect("the scenario runs");
    let failures = outcomes.iter().flat_map(|o| o.failures()).collect();
    (markdown(&build_report(&sc, seed, &outcomes)), failures)
}

#[test]
fn same_seed_same_bytes_and_invariants_hold() {
    let (a, fa) = report(11);
    let (b, fb) = report(11);
    assert_eq!(a, b, "two runs with seed 11 differ");
    assert!(fa.is_empty(), "invariant broken: {fa:?}");
    assert_eq!(fa, fb);
    // The run did something: the hot key has a row in the table.
    assert!(a.contains("| hot/t0/"), "no row for the hot key:\n{a}");
    let (c, fc) = report(12);
    assert!(fc.is_empty(), "invariant broken with seed 12: {fc:?}");
    assert_ne!(a, c, "another seed must give another run");
}

#[test]
fn a_sweep_index_is_the_same_for_any_number_of_jobs_and_names_every_seed() {
    use quotalease_sim::runner::sweep_indexed;
    let sc = Scenario::parse(SMALL, "small.yaml").expect("the test scenario is valid");
    let (failed_1, index_1) = sweep_indexed(&sc, 3, 5, 1).expect("sweep");
    let (failed_2, index_2) = sweep_indexed(&sc, 3, 5, 2).expect("sweep");
    assert!(failed_1.is_empty(), "{failed_1:?}");
    assert_eq!(failed_1.len(), failed_2.len());
    let (md_1, md_2) = (markdown(&index_1), markdown(&index_2));
    assert_eq!(md_1, md_2, "the index depends on --jobs");
    assert!(md_1.contains("3 of 3 seeds passed"), "{md_1}");
    // One row per seed for the hot key, and its spread over the three.
    for seed in 3..=5 {
        assert!(
            md_1.contains(&format!("\n| {seed} | small | hot/t0//api | ok |")),
            "seed {seed} missing:\n{md_1}"
        );
    }
    assert!(md_1.contains("| small | hot/t0//api | 3 |"), "{md_1}");
}

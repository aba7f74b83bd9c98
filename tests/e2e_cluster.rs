//! Ledgers scoped to a cluster (SPEC §2 "First start"), with real
//! processes: a staging agent that fails over to production's allocator
//! presents staging's ledger id; production refuses it (its cluster is
//! named in the error) and keeps serving its own agents. Before clusters,
//! that one message made production take its own ledger for lost and
//! grant nothing for the compiled `TTL_max` cap (60 s). A state directory
//! keeps its cluster: a start naming another is an error.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use common::*;

const RULES: &str = r#"
rules:
  - id: api
    match: { tenant: "*", route: /api }
    rate: 100/s
    burst: 100
    fail_policy: closed
"#;

fn allocator_of(cluster: &str, rules: &Path, state: &Path, listen: SocketAddr) -> Proc {
    allocator_with(rules, state, Some(listen), "2s", &["--cluster", cluster])
}

fn check(a: &Proc) -> u16 {
    check_acme(a, "/api")
}

#[test]
fn a_staging_agent_failing_over_to_production_is_refused_and_blanks_nothing() {
    let dir = tempdir("cluster");
    let rules = write_rules(&dir, RULES);
    let (s_addr, p_addr) = (free_addr(), free_addr());
    let staging = allocator_of("staging", &rules, &dir.join("staging"), s_addr);
    let prod = allocator_of("prod", &rules, &dir.join("prod"), p_addr);
    for a in [&staging, &prod] {
        wait_ok(a.http, "/readyz", Duration::from_secs(10));
    }
    // A staging agent whose second address is production's (a copied
    // config, a DNS mistake): it learns staging's ledger first.
    let s_agent = agent(
        "staging-a",
        &format!("http://{s_addr},http://{p_addr}"),
        None,
        &["--cluster", "staging"],
    );
    let p_agent = agent(
        "prod-a",
        &format!("http://{p_addr}"),
        None,
        &["--cluster", "prod"],
    );
    for a in [&s_agent, &p_agent] {
        wait_ok(a.http, "/readyz", Duration::from_secs(10));
    }
    assert_eq!(check(&s_agent), 200, "staging serves its agent");
    assert_eq!(check(&p_agent), 200, "production serves its agent");

    // Staging goes away: its agent turns to production.
    staging.kill9();
    let until = Instant::now() + Duration::from_secs(4);
    let (mut staging_ok, mut prod_ok, mut prod_asked) = (0, 0, 0);
    while Instant::now() < until {
        staging_ok += u32::from(check(&s_agent) == 200);
        prod_asked += 1;
        prod_ok += u32::from(check(&p_agent) == 200);
        std::thread::sleep(Duration::from_millis(20));
    }
    let (_, m) = http_get(prod.http, "/metrics");
    let refused = metric(&m, "quotalease_allocator_wrong_cluster_refusals_total");
    let lost = metric(&m, "quotalease_allocator_ledgers_lost_total");
    eprintln!(
        "staging agent admitted {staging_ok}; production's {prod_ok} of {prod_asked}; refusals {refused:?}, ledgers lost {lost:?}"
    );
    assert!(
        refused.unwrap_or(0.0) >= 1.0,
        "production saw the staging agent: {m}"
    );
    assert_eq!(
        lost,
        Some(0.0),
        "production did not take its ledger for lost"
    );
    // What the staging agent still admits comes from the lease staging
    // gave it before it died: production lends it nothing.
    let (_, kv) = http_get(prod.http, "/v1/keys?rule=api&tenant=acme&route=/api");
    let kv: serde_json::Value = serde_json::from_str(&kv).expect("json");
    let holders: Vec<&str> = kv["holders"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|h| h["holder"].as_str())
        .collect();
    assert!(
        holders.iter().all(|h| *h == "prod-a"),
        "production leased to {holders:?}"
    );
    assert!(
        prod_ok >= prod_asked / 2,
        "production kept serving its own agent: {prod_ok} of {prod_asked}"
    );
    assert!(s_agent.terminate().success());
    assert!(p_agent.terminate().success());
    assert!(prod.terminate().success());

    // The state directory keeps its cluster: another is refused at start,
    // naming the flag, and the directory is left as it was.
    let ledger = std::fs::read_to_string(dir.join("prod/ledger")).expect("ledger record");
    assert!(ledger.contains("cluster prod\n"), "{ledger}");
    let (ok, err) = run_to_end(
        &dir,
        &[
            "allocator",
            "--listen",
            "127.0.0.1:0",
            "--http",
            "127.0.0.1:0",
            "--rules",
            &rules.display().to_string(),
            "--state-dir",
            &dir.join("prod").display().to_string(),
            "--cluster",
            "staging",
        ],
    );
    assert!(!ok);
    assert!(
        err.contains("--cluster staging") && err.contains("cluster prod"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("prod/ledger")).unwrap(),
        ledger
    );
}

//! End to end: six agent processes started with the same `--agent-id`
//! (as sidecars that are all PID 1 in their containers would be with a
//! PID-based default) on one hot key. Before identities carried a
//! per-process instance nonce, their incarnation bumps made two of them
//! twins that shared sequence numbers, and the allocator's reply cache
//! handed one lease to both: measured +24 tokens over `B + R*T` with
//! B = 100. I1 is checked exactly over every window from the admission
//! logs.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;

const RULES: &str = r#"
rules:
  - id: hot
    match: { tenant: "*", route: /api/hot }
    rate: 100/s
    burst: 100
    fail_policy: lease_only
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_sharing_an_id_never_spend_one_lease_twice() {
    let dir = tempdir("shared-id");
    let rules = write_rules(&dir, RULES);
    let alloc = allocator(&rules, &dir.join("state"), None, "2s");
    wait_ok(alloc.http, "/readyz", Duration::from_secs(10));
    let n = 6;
    let logs: Vec<_> = (0..n).map(|i| dir.join(format!("adm-{i}.log"))).collect();
    let agents: Vec<Proc> = (0..n)
        .map(|i| agent("agent-1", &alloc.url(), Some(&logs[i]), &[]))
        .collect();
    for a in &agents {
        wait_ok(a.http, "/readyz", Duration::from_secs(10));
    }
    let stop = Arc::new(AtomicBool::new(false));
    let refs: Vec<&Proc> = agents.iter().collect();
    // 3 x R in total.
    let (sent, allowed, errors, tasks) = load_checks(
        &refs,
        2,
        300.0 / (2 * n) as f64,
        "acme",
        "/api/hot",
        stop.clone(),
    )
    .await;
    tokio::time::sleep(Duration::from_secs(6)).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.expect("client task");
    }
    let (_, metrics) = http_get(alloc.http, "/metrics");
    for a in agents {
        assert!(a.terminate().success());
    }
    assert_eq!(errors.load(Ordering::Relaxed), 0, "gRPC errors");
    // check_key_i1 asserts I1 over every window.
    let KeyCheck {
        admitted,
        t_s,
        bound,
        util,
    } = check_key_i1(
        &logs,
        ("hot", "acme", "/api/hot"),
        100,
        100,
        allowed.load(Ordering::Relaxed),
    );
    eprintln!(
        "shared id: sent {} admitted {admitted} over {t_s:.2}s, bound {bound:.0}, utilization {:.1}%",
        sent.load(Ordering::Relaxed),
        util * 100.0
    );
    assert!(admitted > 0, "the agents admitted nothing");
    assert_eq!(
        metric(&metrics, "quotalease_allocator_seq_conflict_messages_total"),
        Some(0.0),
        "distinct instances never collide on a sequence number"
    );
    assert!(
        metrics.contains("quotalease_allocator_shadow_violations_total{rule=\"hot\"} 0"),
        "shadow bucket alarm: {metrics}"
    );
}

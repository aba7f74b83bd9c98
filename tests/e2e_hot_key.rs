//! End to end: one hot key, R = 500/s, B = 100, three agents as child
//! processes, 24 concurrent clients asking 3x R for 10 s. I1 is checked
//! exactly over every window from the agents' admission logs (one machine,
//! one CLOCK_BOOTTIME); utilization must be at least 90% of B + R*T.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;

const RULES: &str = r#"
rules:
  - id: hot
    match: { tenant: "*", route: /api/hot }
    rate: 500/s
    burst: 100
    fail_policy: lease_only
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_key_keeps_the_bound_with_high_utilization() {
    let dir = tempdir("hot");
    let rules = write_rules(&dir, RULES);
    let alloc = allocator(&rules, &dir.join("state"), None, "2s");
    wait_ok(alloc.http, "/readyz", Duration::from_secs(10));
    let logs: Vec<_> = (0..3).map(|i| dir.join(format!("adm-{i}.log"))).collect();
    let agents: Vec<Proc> = (0..3)
        .map(|i| agent(&format!("hot-{i}"), &alloc.url(), Some(&logs[i]), &[]))
        .collect();
    for a in &agents {
        wait_ok(a.http, "/readyz", Duration::from_secs(10));
    }

    let run = Duration::from_secs(10);
    let clients_per_agent = 8;
    let per_client_rate = 1500.0 / (3 * clients_per_agent) as f64; // 3x R in total
    let stop = Arc::new(AtomicBool::new(false));
    let refs: Vec<&Proc> = agents.iter().collect();
    let (sent, allowed, errors, tasks) = load_checks(
        &refs,
        clients_per_agent,
        per_client_rate,
        "acme",
        "/api/hot",
        stop.clone(),
    )
    .await;
    tokio::time::sleep(run).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.expect("client task");
    }
    let (_, metrics) = http_get(alloc.http, "/metrics");
    // Renewal economy (SPEC §2): checks per allocator message for this key
    // >= min(100, B / (2 * agents using it)).
    let mut messages = 0u64;
    for a in &agents {
        let (_, m) = http_get(a.http, "/metrics");
        let line = m
            .lines()
            .find(|l| {
                l.starts_with("quotalease_agent_allocator_messages_by_rule_total{rule=\"hot\"}")
            })
            .unwrap_or_else(|| panic!("no per-rule message count: {m}"));
        messages += line.rsplit(' ').next().unwrap().parse::<u64>().unwrap();
    }
    for a in agents {
        assert!(a.terminate().success());
    }

    assert_eq!(errors.load(Ordering::Relaxed), 0, "gRPC errors");
    let key = ("hot", "acme", "/api/hot");
    let KeyCheck {
        admitted,
        t_s,
        bound,
        util,
    } = check_key_i1(&logs, key, 500, 100, allowed.load(Ordering::Relaxed));
    eprintln!(
        "hot key: sent {} admitted {admitted} over {t_s:.2}s, bound {bound:.0}, utilization {:.1}%",
        sent.load(Ordering::Relaxed),
        util * 100.0
    );
    assert!(util >= 0.90, "utilization {:.1}% < 90%", util * 100.0);
    let checks = sent.load(Ordering::Relaxed) as f64;
    let economy = checks / messages.max(1) as f64;
    let target = (100.0f64).min(100.0 / (2.0 * 3.0));
    eprintln!("renewal economy: {checks} checks / {messages} messages = {economy:.1} (target >= {target:.1})");
    assert!(
        economy >= target,
        "checks per message {economy:.1} < {target:.1}"
    );
    assert!(
        metrics.contains("quotalease_allocator_shadow_violations_total{rule=\"hot\"} 0"),
        "shadow bucket alarm: {metrics}"
    );
}

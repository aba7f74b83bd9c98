//! End to end, the classic cases and bad input, against real allocator and
//! agent processes on 127.0.0.1.

mod common;

use std::time::{Duration, Instant};

use common::*;
use quotalease_proto::v1::{CheckRequest, Reason};

const RULES: &str = r#"
rules:
  - id: orders
    match: { tenant: "*", route: /api/orders }
    rate: 60/m
    burst: 20
    fail_policy: lease_only
  - id: login
    match: { tenant: "*", route: /api/login }
    rate: 5/m
    burst: 5
    fail_policy: closed
  - id: open
    match: { tenant: "*", route: /api/open }
    rate: 10/s
    burst: 10
    fail_policy: open
  - id: daily
    match: { tenant: "*", route: /api/daily }
    rate: 1/d
    burst: 10
    fail_policy: lease_only
"#;

fn req(tenant: &str, route: &str, cost: u32, request_id: &str) -> CheckRequest {
    CheckRequest {
        tenant_id: tenant.into(),
        route_id: route.into(),
        cost,
        rule_version: 0,
        request_id: request_id.into(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orders_sixty_per_minute_burst_twenty_per_tenant() {
    let c = cluster("orders", RULES, 1);
    let mut cl = client(&c.agents[0]).await;
    let start = Instant::now();
    let mut allowed = 0;
    for _ in 0..30 {
        let r = cl
            .check(req("t1", "/api/orders", 1, ""))
            .await
            .unwrap()
            .into_inner();
        if r.allowed {
            allowed += 1;
            assert_eq!(r.rule_id, "orders");
        } else {
            assert_eq!(r.reason, Reason::OverLimit as i32);
            assert!(
                r.retry_after_ms >= 1 && r.retry_after_ms <= 1_000,
                "retry {}",
                r.retry_after_ms
            );
        }
    }
    // 20 of burst plus at most one per second that passed.
    let extra = start.elapsed().as_secs();
    assert!(
        allowed >= 20 && allowed <= 20 + extra,
        "allowed {allowed} in {:?}",
        start.elapsed()
    );
    // Another tenant has its own bucket.
    let r = cl
        .check(req("t2", "/api/orders", 1, ""))
        .await
        .unwrap()
        .into_inner();
    assert!(r.allowed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn login_five_per_minute_then_denied_with_a_finite_retry() {
    let c = cluster("login", RULES, 1);
    let mut cl = client(&c.agents[0]).await;
    let mut allowed = 0;
    let mut retry = Vec::new();
    for _ in 0..10 {
        let r = cl
            .check(req("alice", "/api/login", 1, ""))
            .await
            .unwrap()
            .into_inner();
        if r.allowed {
            allowed += 1;
        } else {
            assert_eq!(r.reason, Reason::OverLimit as i32);
            retry.push(r.retry_after_ms);
        }
    }
    assert_eq!(allowed, 5);
    // Metrics count checks by rule and result, never by tenant.
    let (_, m) = http_get(c.agents[0].http, "/metrics");
    assert!(
        m.contains("quotalease_agent_rule_checks_total{rule=\"login\",result=\"allowed\"} 5"),
        "{m}"
    );
    assert!(
        m.contains("quotalease_agent_rule_checks_total{rule=\"login\",result=\"over_limit\"} 5"),
        "{m}"
    );
    assert!(!m.contains("alice"), "a tenant value leaked into metrics");
    // One token comes back every 12 s.
    assert!(
        retry.iter().all(|&ms| (1..=12_000).contains(&ms)),
        "{retry:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundred_concurrent_against_burst_ten_at_one_per_day_pass_exactly_ten() {
    let c = cluster("daily", RULES, 3);
    let mut tasks = Vec::new();
    for i in 0..100 {
        let mut cl = client(&c.agents[i % 3]).await;
        tasks.push(tokio::spawn(async move {
            cl.check(req("acme", "/api/daily", 1, ""))
                .await
                .unwrap()
                .into_inner()
        }));
    }
    let mut allowed = 0;
    for t in tasks {
        let r = t.await.unwrap();
        if r.allowed {
            allowed += 1;
        } else {
            assert_eq!(r.reason, Reason::OverLimit as i32);
            assert!(
                r.retry_after_ms > 0 && r.retry_after_ms <= 86_400_000,
                "{}",
                r.retry_after_ms
            );
        }
    }
    assert_eq!(allowed, 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cost_above_burst_is_invalid_and_oversized_ids_are_invalid() {
    let c = cluster("invalid", RULES, 1);
    let mut cl = client(&c.agents[0]).await;
    let r = cl
        .check(req("t", "/api/login", 6, ""))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.reason, Reason::Invalid as i32);
    assert!(!r.allowed);
    assert_eq!(r.retry_after_ms, 0, "never an infinite retry time");
    let long = "x".repeat(257);
    let r = cl
        .check(req(&long, "/api/login", 1, ""))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.reason, Reason::Invalid as i32);
    let r = cl.check(req("t", &long, 1, "")).await.unwrap().into_inner();
    assert_eq!(r.reason, Reason::Invalid as i32);
    let r = cl
        .check(req("", "/api/login", 1, ""))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.reason, Reason::Invalid as i32);
    // Cost 0 means 1.
    let r = cl
        .check(req("t", "/api/login", 0, ""))
        .await
        .unwrap()
        .into_inner();
    assert!(r.allowed);
    // No rule matches: allowed, NO_RULE.
    let r = cl
        .check(req("t", "/elsewhere", 1, ""))
        .await
        .unwrap()
        .into_inner();
    assert!(r.allowed);
    assert_eq!(r.reason, Reason::NoRule as i32);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_request_id_charges_nothing() {
    let c = cluster("idem", RULES, 1);
    let mut cl = client(&c.agents[0]).await;
    let first = cl
        .check(req("bob", "/api/login", 1, "req-1"))
        .await
        .unwrap()
        .into_inner();
    assert!(first.allowed);
    for _ in 0..10 {
        let again = cl
            .check(req("bob", "/api/login", 1, "req-1"))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(again, first);
    }
    // Only one token of five was charged: four more distinct requests pass.
    let mut allowed = 0;
    for i in 0..6 {
        let r = cl
            .check(req("bob", "/api/login", 1, &format!("req-x{i}")))
            .await
            .unwrap()
            .into_inner();
        allowed += u32::from(r.allowed);
    }
    assert_eq!(allowed, 4);
    let (_, m) = http_get(c.agents[0].http, "/metrics");
    assert!(m.contains("quotalease_agent_replays_total 10"), "{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_without_allocator_starts_not_ready_and_applies_fail_policies() {
    let dir = tempdir("noalloc");
    let rules = write_rules(&dir, RULES);
    let dead = free_addr();
    let a = agent(
        "lonely",
        &format!("http://{dead}"),
        None,
        &["--rules", rules.to_str().unwrap()],
    );
    let (status, _) = http_get(a.http, "/readyz");
    assert_eq!(status, 503);
    let (status, _) = http_get(a.http, "/healthz");
    assert_eq!(status, 200);
    let mut cl = client(&a).await;
    // lease_only: a clean denial.
    let r = cl
        .check(req("t", "/api/orders", 1, ""))
        .await
        .unwrap()
        .into_inner();
    assert!(!r.allowed);
    assert_eq!(r.reason, Reason::FailureModeDenied as i32);
    // closed: UNAVAILABLE.
    let e = cl.check(req("t", "/api/login", 1, "")).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable);
    let (_, m) = http_get(a.http, "/metrics");
    assert!(
        m.contains("quotalease_agent_failure_mode_denied_total 2"),
        "{m}"
    );
    // open: admits through the emergency bucket (I3: r_e = R / holders =
    // 10/s, b_e = B / holders = 10 with one holder known), never above it.
    let start = std::time::Instant::now();
    let (mut allowed, mut denied) = (0u64, 0u64);
    while start.elapsed() < Duration::from_millis(1500) {
        let r = cl
            .check(req("t", "/api/open", 1, ""))
            .await
            .unwrap()
            .into_inner();
        if r.allowed {
            assert_eq!(r.reason, Reason::FailureModeAllowed as i32);
            allowed += 1;
        } else {
            assert_eq!(r.reason, Reason::FailureModeDenied as i32);
            denied += 1;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let bound = 10.0 + 10.0 * start.elapsed().as_secs_f64();
    assert!(allowed >= 10, "allowed {allowed}");
    assert!(
        allowed as f64 <= bound,
        "allowed {allowed} > b_e + r_e*T = {bound}"
    );
    assert!(denied > 0);
    let (_, m) = http_get(a.http, "/metrics");
    assert!(
        m.contains(&format!(
            "quotalease_agent_failure_mode_allowed_total {allowed}"
        )),
        "{m}"
    );
    // Without bootstrap rules: UNAVAILABLE until the allocator is reached.
    let b = agent("lonelier", &format!("http://{dead}"), None, &[]);
    let mut cl = client(&b).await;
    let e = cl.check(req("t", "/api/orders", 1, "")).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable);
}

#[test]
fn invalid_rules_file_exits_1_listing_every_error() {
    let dir = tempdir("badrules");
    let rules = write_rules(
        &dir,
        "rules:\n  - id: a\n    match: { tenant: \"*\" }\n    rate: 0/s\n    burst: 5\n  - id: b\n    match: { route: /x }\n    rate: 5/m\n    burst: -1\n",
    );
    for args in [
        vec!["rules", "validate", rules.to_str().unwrap()],
        vec![
            "allocator",
            "--listen",
            "127.0.0.1:0",
            "--http",
            "127.0.0.1:0",
            "--rules",
            rules.to_str().unwrap(),
        ],
    ] {
        let out = std::process::Command::new(BIN)
            .args(&args)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("rule a") && err.contains("rate"), "{err}");
        assert!(err.contains("rule b") && err.contains("burst"), "{err}");
    }
    let good = write_rules(&dir, RULES);
    let out = std::process::Command::new(BIN)
        .args(["rules", "validate", good.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("4 rule(s), valid"));
}

#[test]
fn bad_flags_give_one_line_errors() {
    let out = std::process::Command::new(BIN)
        .args([
            "agent",
            "--allocator",
            "http://127.0.0.1:1",
            "--lease-ttl",
            "soon",
        ])
        .output()
        .unwrap();
    assert_ne!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--lease-ttl"));
}

#[test]
fn absurd_or_zero_durations_are_clear_errors_not_panics() {
    for (flag, value) in [
        ("--fetch-timeout", "18446744073709551615s"),
        ("--fetch-timeout", "18446744073709551615m"),
        ("--renew-interval", "0ms"),
        ("--lease-ttl", "25h"),
    ] {
        let out = std::process::Command::new(BIN)
            .args(["agent", "--allocator", "http://127.0.0.1:1", flag, value])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flag} {value}: {stderr}");
        assert!(stderr.contains(flag), "{flag} {value}: {stderr}");
        assert!(!stderr.contains("panicked"), "{flag} {value}: {stderr}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocator_serves_a_keys_ledger() {
    let dir = tempdir("keys");
    let rules = write_rules(&dir, RULES);
    let alloc = allocator(&rules, &dir.join("state"), None, "2s");
    wait_ok(alloc.http, "/readyz", Duration::from_secs(10));
    let a = agent("keys-0", &alloc.url(), None, &[]);
    wait_ok(a.http, "/readyz", Duration::from_secs(10));
    let mut cl = client(&a).await;
    for _ in 0..3 {
        assert!(
            cl.check(req("zed", "/api/orders", 1, ""))
                .await
                .unwrap()
                .into_inner()
                .allowed
        );
    }
    let (status, body) = http_get(
        alloc.http,
        "/v1/keys?rule=orders&tenant=zed&route=/api/orders",
    );
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["burst"], 20);
    let avail = v["available"].as_u64().unwrap();
    let out = v["outstanding"].as_u64().unwrap();
    assert!(avail + out <= 20, "I2: {body}");
    assert!(avail <= 17, "{body}");
    assert_eq!(v["holders"][0]["holder"], "keys-0", "{body}");
    let (status, _) = http_get(alloc.http, "/v1/keys?tenant=zed");
    assert_eq!(status, 400);
    // SIGTERM: the agent releases its unused tokens on the way out.
    assert!(a.terminate().success());
    let (_, body) = http_get(
        alloc.http,
        "/v1/keys?rule=orders&tenant=zed&route=/api/orders",
    );
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["outstanding"], 0, "{body}");
    let (_, m) = http_get(alloc.http, "/metrics");
    assert!(!m.contains("quotalease_allocator_releases_total 0"), "{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_reload_on_change_and_bad_files_keep_the_last_good_rules() {
    let dir = tempdir("reload");
    let rules = write_rules(&dir, RULES);
    let alloc = allocator(&rules, &dir.join("state"), None, "2s");
    wait_ok(alloc.http, "/readyz", Duration::from_secs(10));
    let a = agent("reload-0", &alloc.url(), None, &[]);
    wait_ok(a.http, "/readyz", Duration::from_secs(10));
    let mut cl = client(&a).await;
    let v1 = cl
        .check(req("t", "/api/orders", 1, ""))
        .await
        .unwrap()
        .into_inner()
        .applied_rule_version;
    assert!(v1 > 0);
    // A new route appears: reloaded by the allocator, adopted by the agent.
    let more = format!("{RULES}  - id: search\n    match: {{ tenant: \"*\", route: /api/search }}\n    rate: 1/s\n    burst: 1\n");
    std::thread::sleep(Duration::from_millis(20));
    std::fs::write(&rules, &more).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let v2 = loop {
        let r = cl
            .check(req("t", "/api/search", 1, ""))
            .await
            .unwrap()
            .into_inner();
        if r.reason != Reason::NoRule as i32 {
            assert_eq!(r.rule_id, "search");
            break r.applied_rule_version;
        }
        assert!(
            Instant::now() < deadline,
            "the agent never saw the new rule"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(v2 > v1);
    // An invalid file is rejected whole; the last good rules keep serving.
    std::fs::write(&rules, "rules:\n  - id: broken\n    rate: nope\n").unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (_, m) = http_get(alloc.http, "/metrics");
    assert!(
        m.contains("quotalease_allocator_rules_reload_failures_total 1"),
        "{m}"
    );
    let r = cl
        .check(req("t2", "/api/search", 1, ""))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.rule_id, "search");
    assert_eq!(r.applied_rule_version, v2);
    assert!(
        m.contains("quotalease_allocator_agent_rule_version_lag{agent=\"reload-0\"} 0"),
        "{m}"
    );
}

fn gauge(metrics: &str, name: &str) -> u64 {
    metrics
        .lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {metrics}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_tenants_keeps_memory_bounded() {
    let dir = tempdir("flood");
    let rules = write_rules(
        &dir,
        r#"
rules:
  - id: open-api
    match: { tenant: "*", route: /api/flood }
    rate: 100/s
    burst: 10
    fail_policy: lease_only
  - id: capped
    match: { tenant: "*", route: /api/capped }
    rate: 1/m
    burst: 10
    max_keys: 50
    fail_policy: lease_only
"#,
    );
    let alloc = allocator(&rules, &dir.join("state"), None, "1s");
    wait_ok(alloc.http, "/readyz", Duration::from_secs(10));
    // max_keys: the first 50 tenants get buckets (not full again for a
    // minute, so the allocator keeps them), the rest are denied.
    let b = agent("flood-cap", &alloc.url(), None, &[]);
    wait_ok(b.http, "/readyz", Duration::from_secs(10));
    let mut cb = client(&b).await;
    let mut capped_ok = 0;
    for i in 0..100 {
        let r = cb
            .check(req(&format!("cap-{i}"), "/api/capped", 1, ""))
            .await
            .unwrap()
            .into_inner();
        capped_ok += u32::from(r.allowed);
    }
    assert_eq!(capped_ok, 50);
    let (_, m) = http_get(alloc.http, "/metrics");
    assert_eq!(
        gauge(&m, "quotalease_allocator_key_limit_refusals_total"),
        50
    );
    assert!(b.terminate().success());
    // A flood of random tenants through an agent that forgets idle keys fast.
    let a = agent(
        "flood-0",
        &alloc.url(),
        None,
        &["--idle-release", "1s", "--lease-ttl", "1s"],
    );
    wait_ok(a.http, "/readyz", Duration::from_secs(10));
    let mut cl = client(&a).await;
    for i in 0..1000 {
        let r = cl
            .check(req(&format!("rnd-{i}"), "/api/flood", 1, ""))
            .await
            .unwrap()
            .into_inner();
        assert!(r.allowed);
    }
    let (_, m) = http_get(alloc.http, "/metrics");
    assert!(gauge(&m, "quotalease_allocator_keys") <= 1050, "{m}");
    // Idle keys are released by the agent and, once full, dropped by the
    // allocator; only the 50 capped keys (not full for minutes) remain.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (_, am) = http_get(a.http, "/metrics");
        let (_, m) = http_get(alloc.http, "/metrics");
        let (agent_keys, alloc_keys) = (
            gauge(&am, "quotalease_agent_keys_held"),
            gauge(&m, "quotalease_allocator_keys"),
        );
        if agent_keys == 0 && alloc_keys == 50 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "keys not dropped: agent {agent_keys}, allocator {alloc_keys}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_emergency_bucket_is_configurable() {
    let dir = tempdir("emergency");
    let rules = write_rules(&dir, RULES);
    let dead = free_addr();
    let a = agent(
        "emergency",
        &format!("http://{dead}"),
        None,
        &[
            "--rules",
            rules.to_str().unwrap(),
            "--emergency-rate",
            "0.5",
            "--emergency-burst",
            "0.5",
        ],
    );
    let mut cl = client(&a).await;
    // open rule: 10/s burst 10 -> emergency 5/s burst 5.
    let start = Instant::now();
    let mut allowed = 0u64;
    while start.elapsed() < Duration::from_millis(1500) {
        allowed += u64::from(
            cl.check(req("t", "/api/open", 1, ""))
                .await
                .unwrap()
                .into_inner()
                .allowed,
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let bound = 5.0 + 5.0 * start.elapsed().as_secs_f64();
    assert!(
        allowed >= 5 && allowed as f64 <= bound,
        "allowed {allowed}, bound {bound:.1}"
    );
    // A bad fraction is refused naming the flag.
    let out = std::process::Command::new(BIN)
        .args([
            "agent",
            "--allocator",
            "http://127.0.0.1:1",
            "--emergency-rate",
            "2",
        ])
        .output()
        .unwrap();
    assert_ne!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--emergency-rate"));
}

//! The client against the real allocator core in process (the `testing`
//! feature): the bound, denials, the non-waiting check, clones, shutdown.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use quotalease_client::testing::InProcessAllocator;
use quotalease_client::{Client, Error, Key, Outcome};

const RULES: &str = r#"
rules:
  - id: api
    match: { tenant: "*", route: /api }
    rate: 10/s
    burst: 20
    fail_policy: closed
  - id: login
    match: { tenant: "*", route: /login }
    rate: 1/m
    burst: 2
    fail_policy: closed
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn clones_and_tasks_together_admit_at_most_b_plus_r_t() {
    let alloc = InProcessAllocator::from_yaml(RULES).expect("rules");
    let client = alloc.client("svc-a").expect("client");
    let admitted = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..16 {
        // Every task decides through its own clone: one set of leases.
        let c = client.clone();
        let admitted = admitted.clone();
        tasks.push(tokio::spawn(async move {
            let key = Key::new("t1", "/api");
            let until = Instant::now() + Duration::from_millis(1500);
            while Instant::now() < until {
                if c.check(&key, 1).await.allowed() {
                    admitted.fetch_add(1, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }));
    }
    for t in tasks {
        t.await.expect("task");
    }
    let elapsed = start.elapsed().as_secs_f64();
    let admitted = admitted.load(Ordering::Relaxed);
    // Every admission happened within [start, now]: the bound over it.
    let bound = 20.0 + 10.0 * elapsed;
    assert!(
        admitted as f64 <= bound,
        "{admitted} admitted in {elapsed:.3} s, bound {bound:.1}"
    );
    // Demand (16 tasks, one check every ~2 ms) is far above the rule: the
    // burst is admitted at once, and refill goes on being delivered.
    assert!(
        admitted >= 20 + 5,
        "{admitted} admitted in {elapsed:.3} s: the burst and the refill are delivered"
    );
    client.shutdown().await;
}

#[tokio::test]
async fn a_denial_names_its_rule_and_when_to_retry() {
    let alloc = InProcessAllocator::from_yaml(RULES).expect("rules");
    let client = alloc.client("svc-b").expect("client");
    let key = Key::new("t1", "/login");
    for i in 0..2 {
        let d = client.check(&key, 1).await;
        assert!(d.allowed(), "check {i}: {d:?}");
        assert_eq!(d.rule_id(), Some("login"));
    }
    let d = client.check(&key, 1).await;
    assert!(!d.allowed(), "{d:?}");
    assert_eq!(d.outcome(), &Outcome::OverLimit);
    assert_eq!(d.rule_id(), Some("login"));
    let retry = d.retry_after().expect("a denial says when to retry");
    // The next token of 1/m comes within a minute of the burst's first use.
    assert!(
        retry > Duration::ZERO && retry <= Duration::from_secs(60),
        "{retry:?}"
    );
    // The same denial from the non-waiting check.
    let d = client.try_check(&key, 1);
    assert!(!d.allowed(), "{d:?}");
    assert_eq!(d.outcome(), &Outcome::OverLimit);
    client.shutdown().await;
}

#[tokio::test]
async fn try_check_says_would_wait_then_decides_from_the_lease() {
    let alloc = InProcessAllocator::from_yaml(RULES).expect("rules");
    let client = alloc.client("svc-c").expect("client");
    let key = Key::new("t2", "/api");
    // Before its first answer from the allocator a client knows no rules
    // (no bootstrap rules here): the non-waiting check cannot decide then.
    assert!(client.ready(Duration::from_secs(5)).await, "ready");
    // A key never seen: no lease yet, nothing charged, a fetch started.
    let d = client.try_check(&key, 1);
    assert_eq!(d.outcome(), &Outcome::WouldWait, "{d:?}");
    assert!(!d.allowed());
    // Once a grant is in, the non-waiting check decides from the lease.
    let d = client.check(&key, 1).await;
    assert!(d.allowed(), "{d:?}");
    let mut from_lease = 0;
    for _ in 0..5 {
        let d = client.try_check(&key, 1);
        if d.allowed() {
            assert_eq!(d.outcome(), &Outcome::Ok);
            assert_eq!(d.rule_id(), Some("api"));
            from_lease += 1;
        }
    }
    assert!(
        from_lease > 0,
        "the lease held serves the synchronous check"
    );
    client.shutdown().await;
}

#[tokio::test]
async fn shutdown_gives_back_what_it_holds() {
    let alloc = InProcessAllocator::from_yaml(RULES).expect("rules");
    let client = alloc.client("svc-d").expect("client");
    let key = Key::new("t3", "/api");
    for _ in 0..3 {
        assert!(client.check(&key, 1).await.allowed());
    }
    let held = alloc.ledger("api", "t3", "/api").expect("leased");
    assert_eq!(held.holders, 1, "{held:?}");
    assert!(held.outstanding > 0, "{held:?}");
    client.shutdown().await;
    let after = alloc.ledger("api", "t3", "/api").expect("known");
    assert_eq!(after.holders, 0, "released: {after:?}");
    assert_eq!(after.outstanding, 0, "released: {after:?}");
    // What was not spent is back in the bucket: 20 less the 3 spent, plus
    // what refilled meanwhile (10/s), at most the burst.
    assert!(after.available >= 17 && after.available <= 20, "{after:?}");
}

#[tokio::test]
async fn unmatched_keys_pass_and_invalid_checks_name_their_field() {
    let alloc = InProcessAllocator::from_yaml(RULES).expect("rules");
    let client = alloc.client("svc-e").expect("client");
    let d = client.check(&Key::new("t1", "/elsewhere"), 1).await;
    assert!(d.allowed(), "{d:?}");
    assert_eq!(d.outcome(), &Outcome::NoRule);
    let d = client.try_check(&Key::new("", "/api"), 1);
    assert!(!d.allowed());
    match d.outcome() {
        Outcome::Invalid { field, .. } => assert!(field.contains("tenant"), "{field}"),
        other => panic!("expected an invalid tenant, got {other:?}"),
    }
    client.shutdown().await;
}

#[tokio::test]
async fn building_fails_with_the_setting_named() {
    assert_eq!(
        Client::builder().agent_id("x").build().err(),
        Some(Error::NoAllocator)
    );
    let dir = std::env::temp_dir().join(format!("ql-client-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let bad = dir.join("rules.yaml");
    std::fs::write(&bad, "rules:\n  - id: x\n    rate: fast\n").expect("write");
    match Client::builder()
        .allocator("http://127.0.0.1:1")
        .bootstrap_rules_file(&bad)
        .build()
    {
        Err(Error::Rules(msg)) => assert!(msg.contains("rate"), "{msg}"),
        other => panic!("expected a rules error, got {other:?}"),
    }
    let _ = std::fs::remove_dir_all(&dir);
    let alloc = InProcessAllocator::from_yaml(RULES).expect("rules");
    match Client::builder()
        .in_process(&alloc)
        .allocator("http://127.0.0.1:1")
        .build()
    {
        Err(Error::Invalid { field, .. }) => assert_eq!(field, "allocator"),
        other => panic!("expected the allocator setting named, got {other:?}"),
    }
}

#[test]
fn a_client_needs_a_runtime() {
    assert_eq!(
        Client::builder()
            .allocator("http://127.0.0.1:1")
            .build()
            .err(),
        Some(Error::NoRuntime)
    );
}

#[tokio::test]
async fn a_resolved_key_decides_from_the_lease_and_survives_a_rules_change() {
    let alloc = InProcessAllocator::from_yaml(RULES).expect("rules");
    let client = alloc.client("svc-f").expect("client");
    assert!(client.ready(Duration::from_secs(5)).await, "ready");
    let key = Key::new("t4", "/login");
    let hot = client.resolve(&key).expect("resolved");
    assert!(hot.is_current());
    // 1/m burst 2: two, then a denial, through the handle.
    let mut answers = Vec::new();
    for _ in 0..3 {
        answers.push(hot.check(1).await.allowed());
    }
    assert_eq!(answers, [true, true, false]);
    // A new rule set (version 2) raises the burst to 4; the client adopts
    // it with its next answer from the allocator.
    alloc
        .set_rules(&RULES.replace("burst: 2", "burst: 4"), 2)
        .expect("rules v2");
    let until = std::time::Instant::now() + Duration::from_secs(5);
    while hot.is_current() {
        assert!(std::time::Instant::now() < until, "rules v2 not adopted");
        let _ = client.check(&Key::new("t5", "/api"), 1).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The stale handle still answers, by the client's path under v2.
    let d = hot.check(1).await;
    assert_eq!(d.rule_version(), 2, "{d:?}");
    let fresh = client.resolve(&key).expect("resolved again");
    assert!(fresh.is_current());
    client.shutdown().await;
}

const MINUTE_AND_A_SECOND: Duration = Duration::from_secs(61);

#[tokio::test(start_paused = true)]
async fn a_slow_rule_under_tokio_s_paused_clock_takes_no_minute() {
    use quotalease_client::testing::TokioClock;
    let alloc = InProcessAllocator::from_yaml_with_clock(RULES, TokioClock::new()).expect("rules");
    let client = alloc.client("svc-g").expect("client");
    let key = Key::new("t6", "/login");
    let wall = Instant::now();
    // 1/m burst 2: two, then a denial naming a retry within the minute.
    for i in 0..2 {
        let d = client.check(&key, 1).await;
        assert!(d.allowed(), "check {i}: {d:?}");
    }
    let d = client.check(&key, 1).await;
    assert!(!d.allowed(), "{d:?}");
    let retry = d.retry_after().expect("a retry hint");
    assert!(retry <= Duration::from_secs(60), "{retry:?}");
    // A minute passes on tokio's clock: one token more, and only one. (The
    // bucket refills at R slowed by rho = 0.1 % (SPEC §2 "Clocks"): a
    // whole token takes 60.06 s, so the test lets 61 s pass.)
    tokio::time::advance(MINUTE_AND_A_SECOND).await;
    let d = client.check(&key, 1).await;
    assert!(d.allowed(), "after a minute: {d:?}");
    assert!(!client.check(&key, 1).await.allowed(), "only one refilled");
    // Ten simulated minutes: ten more, never eleven (the bucket's bound).
    let mut admitted = 0;
    for _ in 0..10 {
        tokio::time::advance(MINUTE_AND_A_SECOND).await;
        for _ in 0..3 {
            if client.check(&key, 1).await.allowed() {
                admitted += 1;
            }
        }
    }
    assert_eq!(admitted, 10);
    assert!(
        wall.elapsed() < Duration::from_secs(30),
        "simulated, not waited: {:?}",
        wall.elapsed()
    );
    client.shutdown().await;
}

#[tokio::test]
async fn a_manual_clock_moves_only_when_the_test_moves_it() {
    use quotalease_client::testing::ManualClock;
    let clock = ManualClock::new(5_000_000_000);
    let alloc = InProcessAllocator::from_yaml_with_clock(RULES, clock.clone()).expect("rules");
    let client = alloc.client("svc-h").expect("client");
    let key = Key::new("t7", "/api");
    // 10/s burst 20: the burst, then nothing while the clock stands still
    // (however long the test really takes).
    let mut admitted = 0;
    for _ in 0..40 {
        if client.check(&key, 1).await.allowed() {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 20);
    // 510 ms: five tokens (5.1 at R slowed by rho per tier, SPEC §2).
    clock.advance(510_000_000);
    let mut more = 0;
    for _ in 0..20 {
        if client.check(&key, 1).await.allowed() {
            more += 1;
        }
    }
    assert_eq!(more, 5);
    client.shutdown().await;
}

#[tokio::test]
async fn a_key_under_two_rules_is_charged_by_both_or_neither() {
    // Every tenant's calls (any route) share `tenant`; `/login` also has
    // its own slow rule. A login denied by `login` charges `tenant` nothing.
    const TWO: &str = r#"
rules:
  - id: tenant
    match: { tenant: "*" }
    rate: 1/m
    burst: 10
  - id: login
    match: { tenant: "*", route: /login }
    rate: 1/m
    burst: 2
"#;
    let alloc = InProcessAllocator::from_yaml(TWO).expect("rules");
    let client = alloc.client("svc-i").expect("client");
    let login = Key::new("t8", "/login");
    let mut logins = 0;
    for _ in 0..6 {
        let d = client.check(&login, 1).await;
        if d.allowed() {
            logins += 1;
        } else {
            assert_eq!(d.rule_id(), Some("login"), "{d:?}");
        }
    }
    assert_eq!(logins, 2);
    // The tenant's bucket lost the two admitted logins only: 8 left.
    let other = Key::new("t8", "/api");
    let mut rest = 0;
    for _ in 0..12 {
        let d = client.check(&other, 1).await;
        if d.allowed() {
            rest += 1;
        } else {
            assert_eq!(d.rule_id(), Some("tenant"), "{d:?}");
        }
    }
    assert_eq!(rest, 8);
    client.shutdown().await;
}

#[tokio::test]
async fn a_refusal_becomes_a_tonic_status() {
    let alloc = InProcessAllocator::from_yaml(RULES).expect("rules");
    let client = alloc.client("svc-j").expect("client");
    let key = Key::new("t9", "/login");
    for _ in 0..2 {
        let d = client.check(&key, 1).await;
        assert!(d.to_status().is_none(), "allowed: {d:?}");
    }
    let d = client.check(&key, 1).await;
    let status = d.to_status().expect("refused");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted);
    assert!(status.message().contains("rule login"), "{status:?}");
    let retry: u64 = status
        .metadata()
        .get("retry-after")
        .expect("retry-after")
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=60).contains(&retry), "{retry}");
    let invalid = client.try_check(&Key::new("", "/api"), 1);
    assert_eq!(
        invalid.to_status().expect("refused").code(),
        tonic::Code::InvalidArgument
    );
    client.shutdown().await;
}

#[tokio::test]
async fn fail_open_admits_through_an_emergency_bucket_of_the_size_asked() {
    // Nothing listens on port 1: the allocator is out of reach from the
    // start, and the bootstrap rule is fail-open.
    let rules = quotalease_client::RuleSet::parse(
        "rules:\n  - id: open\n    match: { tenant: \"*\", route: /api }\n    rate: 1/m\n    burst: 10\n    fail_policy: open\n",
        "rules",
        0,
    )
    .expect("rules");
    let client = Client::builder()
        .allocator("http://127.0.0.1:1")
        .bootstrap_rules(rules)
        .emergency_burst(0.5)
        .build()
        .expect("client");
    let key = Key::new("t10", "/api");
    let mut outcomes = Vec::new();
    for _ in 0..7 {
        outcomes.push(client.check(&key, 1).await.outcome().clone());
    }
    // Half the burst through the emergency bucket, counted as such; then
    // the bucket is empty (1/m refills nothing meanwhile).
    let allowed = outcomes
        .iter()
        .filter(|o| **o == Outcome::FailureModeAllowed)
        .count();
    assert_eq!(allowed, 5, "{outcomes:?}");
    assert!(
        outcomes[5..]
            .iter()
            .all(|o| *o != Outcome::FailureModeAllowed),
        "{outcomes:?}"
    );
    client.shutdown().await;
}

#[tokio::test]
async fn emergency_fractions_outside_zero_to_one_are_refused_by_name() {
    for (builder, field) in [
        (Client::builder().emergency_rate(1.5), "emergency_rate"),
        (Client::builder().emergency_burst(0.0), "emergency_burst"),
        (Client::builder().emergency_rate(f64::NAN), "emergency_rate"),
    ] {
        match builder.allocator("http://127.0.0.1:1").build() {
            Err(Error::Invalid { field: f, .. }) => assert_eq!(f, field),
            other => panic!("expected {field} named, got {other:?}"),
        }
    }
}

#[tokio::test]
async fn a_retry_with_the_same_request_id_is_charged_once() {
    let alloc = InProcessAllocator::from_yaml(RULES).expect("rules");
    let client = alloc.client("svc-k").expect("client");
    let key = Key::new("t11", "/login");
    // 1/m burst 2: the same request retried three times is one token.
    for _ in 0..3 {
        let d = client.check_with_id(&key, 1, "req-1").await;
        assert!(d.allowed(), "{d:?}");
    }
    assert!(client.check_with_id(&key, 1, "req-2").await.allowed());
    let d = client.check_with_id(&key, 1, "req-3").await;
    assert!(
        !d.allowed(),
        "the burst of 2 is spent by two requests: {d:?}"
    );
    // A replay answers as the first time, even now.
    assert!(client.check_with_id(&key, 1, "req-1").await.allowed());
    client.shutdown().await;
}

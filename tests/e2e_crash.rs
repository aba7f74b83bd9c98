//! End to end: the allocator is killed with SIGKILL mid-run and restarted.
//! Agents keep answering from their leases (no errors for `lease_only`),
//! the bound holds across the kill and the restart for every key, and
//! service resumes once the restarted allocator's start-up wait is over.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use quotalease_model::rules::Rate;
use quotalease_proto::v1::{CheckRequest, Reason};
use quotalease_sim::checker::worst_window;

const RULES: &str = r#"
rules:
  - id: crash
    match: { tenant: "*", route: /api/x }
    rate: 200/s
    burst: 50
    fail_policy: lease_only
"#;

/// Per phase: (allowed, failure-mode denied, other denied, errors).
#[derive(Default)]
struct Phase {
    allowed: AtomicU64,
    failure_denied: AtomicU64,
    denied: AtomicU64,
    errors: AtomicU64,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocator_sigkill_keeps_the_bound_and_service_resumes() {
    let dir = tempdir("crash");
    let rules = write_rules(&dir, RULES);
    let state = dir.join("state");
    let addr = free_addr();
    let alloc = allocator(&rules, &state, Some(addr), "1s");
    wait_ok(alloc.http, "/readyz", Duration::from_secs(10));
    let logs: Vec<_> = (0..3).map(|i| dir.join(format!("adm-{i}.log"))).collect();
    let agents: Vec<Proc> = (0..3)
        .map(|i| agent(&format!("crash-{i}"), &alloc.url(), Some(&logs[i]), &[]))
        .collect();
    for a in &agents {
        wait_ok(a.http, "/readyz", Duration::from_secs(10));
    }

    // Two keys: "hot" asks 2x R (always dry: stresses the bound), "calm"
    // asks R/2 (holds spare tokens in its leases when the allocator dies).
    let phases: Arc<Vec<(Phase, Phase)>> = Arc::new((0..3).map(|_| Default::default()).collect());
    let phase = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut tasks = Vec::new();
    for a in &agents {
        for (tenant, per_client) in [("hot", 400.0 / 12.0), ("calm", 100.0 / 12.0)] {
            for _ in 0..4 {
                let mut c = client(a).await;
                let (phases, phase, stop) = (phases.clone(), phase.clone(), stop.clone());
                tasks.push(tokio::spawn(async move {
                    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / per_client));
                    while !stop.load(Ordering::Relaxed) {
                        tick.tick().await;
                        let p = &phases[phase.load(Ordering::Relaxed) as usize];
                        let p = if tenant == "hot" { &p.0 } else { &p.1 };
                        let req = CheckRequest {
                            tenant_id: tenant.into(),
                            route_id: "/api/x".into(),
                            cost: 1,
                            ..Default::default()
                        };
                        match c.check(req).await {
                            Ok(r) => {
                                let r = r.into_inner();
                                if r.allowed {
                                    p.allowed.fetch_add(1, Ordering::Relaxed);
                                } else if r.reason == Reason::FailureModeDenied as i32 {
                                    p.failure_denied.fetch_add(1, Ordering::Relaxed);
                                } else {
                                    p.denied.fetch_add(1, Ordering::Relaxed);
                                }
                            }
                            Err(_) => {
                                p.errors.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                }));
            }
        }
    }
    // Phase 0: normal operation.
    tokio::time::sleep(Duration::from_secs(3)).await;
    // Phase 1: the allocator dies mid-run.
    phase.store(1, Ordering::Relaxed);
    alloc.kill9();
    let killed = Instant::now();
    tokio::time::sleep(Duration::from_secs(3)).await;
    // Phase 2: restarted on the same address with the same state directory.
    let alloc = allocator(&rules, &state, Some(addr), "1s");
    phase.store(2, Ordering::Relaxed);
    let restarted = Instant::now();
    tokio::time::sleep(Duration::from_secs(5)).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.expect("client");
    }
    let (_, metrics) = http_get(alloc.http, "/metrics");
    for a in agents {
        assert!(a.terminate().success());
    }

    let g = |p: &Phase| {
        (
            p.allowed.load(Ordering::Relaxed),
            p.failure_denied.load(Ordering::Relaxed),
            p.denied.load(Ordering::Relaxed),
            p.errors.load(Ordering::Relaxed),
        )
    };
    for (i, (hot, calm)) in phases.iter().enumerate() {
        eprintln!(
            "phase {i}: hot {:?} calm {:?} (allowed, failure-denied, denied, errors)",
            g(hot),
            g(calm)
        );
    }
    eprintln!(
        "killed for {:?}, restarted {:?} before the end",
        restarted - killed,
        restarted.elapsed()
    );
    // Agents kept answering: lease_only never errors.
    for (hot, calm) in phases.iter() {
        assert_eq!(g(hot).3 + g(calm).3, 0, "gRPC errors");
    }
    // While the allocator was gone, the calm key was still served from leases.
    assert!(
        g(&phases[1].1).0 > 0,
        "no admissions from leases after the kill"
    );
    // ... and once they expired, the fail policy answered.
    assert!(
        g(&phases[1].0).1 + g(&phases[1].1).1 > 0,
        "fail policy never applied"
    );
    // Service resumed after the restart.
    assert!(
        g(&phases[2].0).0 > 0 && g(&phases[2].1).0 > 0,
        "service did not resume"
    );

    // I1 across the kill and the restart, for every key, from the admission logs.
    let rate = Rate {
        tokens: 200,
        period_s: 1,
    };
    let adm = read_admissions(&logs);
    assert_eq!(adm.len(), 2, "{:?}", adm.keys().collect::<Vec<_>>());
    for (key, list) in adm {
        let mut list = list;
        let w = worst_window(&mut list, rate, 50);
        eprintln!("{key:?}: {} admitted, worst window {:?}", list.len(), w);
        assert!(w.held(), "I1 broken for {key:?}: {w:?}");
    }
    assert!(
        metrics.contains("quotalease_allocator_shadow_violations_total{rule=\"crash\"} 0"),
        "{metrics}"
    );
}

const OPEN_RULES: &str = r#"
rules:
  - id: open
    match: { tenant: "*", route: /api/open }
    rate: 100/s
    burst: 30
    fail_policy: open
"#;

/// With fail policy `open`, a cut-off agent admits through its emergency
/// bucket (SPEC §2 I3): admissions continue after the leases run out, and
/// the excess over I1 during the cut-off stays within the sum over agents of
/// `b_e + r_e * T`, where `b_e = B / holders` and
/// `r_e = max(recent admitted share, R / holders)` (so the sum of the `r_e`
/// is at most 2R: the shares sum to R at most, plus R).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_open_after_the_allocator_dies_stays_within_i3() {
    let dir = tempdir("crash-open");
    let rules = write_rules(&dir, OPEN_RULES);
    let alloc = allocator(&rules, &dir.join("state"), None, "1s");
    wait_ok(alloc.http, "/readyz", Duration::from_secs(10));
    let logs: Vec<_> = (0..3).map(|i| dir.join(format!("adm-{i}.log"))).collect();
    let agents: Vec<Proc> = (0..3)
        .map(|i| agent(&format!("open-{i}"), &alloc.url(), Some(&logs[i]), &[]))
        .collect();
    for a in &agents {
        wait_ok(a.http, "/readyz", Duration::from_secs(10));
    }
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let allowed_after = Arc::new(AtomicU64::new(0));
    let cut = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut tasks = Vec::new();
    for a in &agents {
        for _ in 0..4 {
            let mut c = client(a).await;
            let (stop, cut, allowed_after) = (stop.clone(), cut.clone(), allowed_after.clone());
            tasks.push(tokio::spawn(async move {
                // 2x R over 12 clients.
                let mut tick = tokio::time::interval(Duration::from_secs_f64(12.0 / 200.0));
                while !stop.load(Ordering::Relaxed) {
                    tick.tick().await;
                    let req = CheckRequest {
                        tenant_id: "acme".into(),
                        route_id: "/api/open".into(),
                        cost: 1,
                        ..Default::default()
                    };
                    let r = c.check(req).await.expect("open never errors").into_inner();
                    if r.allowed && cut.load(Ordering::Relaxed) {
                        allowed_after.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }));
        }
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let t_kill = quotalease_model::clock::BootClock::now();
    alloc.kill9();
    cut.store(true, Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.expect("client");
    }
    let t_end = quotalease_model::clock::BootClock::now();
    let mut fma = 0u64;
    for a in agents {
        let (_, m) = http_get(a.http, "/metrics");
        let line = m
            .lines()
            .find(|l| l.starts_with("quotalease_agent_failure_mode_allowed_total"))
            .expect("metric");
        fma += line.rsplit(' ').next().unwrap().parse::<u64>().unwrap();
        assert!(a.terminate().success());
    }
    assert!(fma > 0, "the emergency bucket never admitted");
    let adm = read_admissions(&logs);
    let list = adm
        .get(&(
            "open".to_string(),
            "acme".to_string(),
            "/api/open".to_string(),
        ))
        .expect("admissions");
    let after: u64 = list.iter().filter(|(t, _)| *t >= t_kill).map(|x| x.1).sum();
    let t_cut = (t_end - t_kill) as f64 / 1e9;
    // Leases held at the kill (<= B), plus sum of b_e (3 * B/3), plus sum of r_e * T.
    let bound = 30.0 + 30.0 + 2.0 * 100.0 * t_cut;
    eprintln!("after the kill: {after} admitted in {t_cut:.2}s ({fma} by the emergency buckets), I3 bound {bound:.0}");
    assert!(after as f64 <= bound, "I3: {after} > {bound}");
}

const POLICY_RULES: &str = r#"
rules:
  - id: lo
    match: { tenant: "*", route: /lo }
    rate: 50/s
    burst: 20
    fail_policy: lease_only
  - id: cl
    match: { tenant: "*", route: /cl }
    rate: 50/s
    burst: 20
    fail_policy: closed
  - id: op
    match: { tenant: "*", route: /op }
    rate: 50/s
    burst: 20
    fail_policy: open
"#;

/// Each fail policy on gRPC and HTTP once the allocator is dead and the
/// leases have run out, and recovery when it returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_fail_policy_after_the_leases_run_out_and_recovery() {
    let dir = tempdir("policies");
    let rules = write_rules(&dir, POLICY_RULES);
    let state = dir.join("state");
    let addr = free_addr();
    let alloc = allocator(&rules, &state, Some(addr), "1s");
    wait_ok(alloc.http, "/readyz", Duration::from_secs(10));
    let a = agent("policies-0", &alloc.url(), None, &["--lease-ttl", "1s"]);
    wait_ok(a.http, "/readyz", Duration::from_secs(10));
    let mut c = client(&a).await;
    let check = |route: &str| CheckRequest {
        tenant_id: "acme".into(),
        route_id: route.into(),
        cost: 1,
        ..Default::default()
    };
    for route in ["/lo", "/cl", "/op"] {
        assert!(c.check(check(route)).await.unwrap().into_inner().allowed);
    }
    alloc.kill9();
    // Leases last at most 1 s; wait them out.
    tokio::time::sleep(Duration::from_millis(1500)).await;

    // gRPC: lease_only denies, closed is UNAVAILABLE, open admits.
    let r = c.check(check("/lo")).await.unwrap().into_inner();
    assert!(!r.allowed);
    assert_eq!(r.reason, Reason::FailureModeDenied as i32);
    let e = c.check(check("/cl")).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable);
    let start = Instant::now();
    let mut open_ok = 0u64;
    while start.elapsed() < Duration::from_secs(1) {
        let r = c.check(check("/op")).await.unwrap().into_inner();
        if r.allowed {
            assert_eq!(r.reason, Reason::FailureModeAllowed as i32);
            open_ok += 1;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    // One holder known: b_e = B = 20, r_e = max(recent share, R) = R = 50/s.
    let bound = 20.0 + 50.0 * start.elapsed().as_secs_f64();
    assert!(
        open_ok > 0 && open_ok as f64 <= bound,
        "open admitted {open_ok}, bound {bound:.0}"
    );
    // HTTP: 429, 503, 200.
    let (st, body) = http_get(a.http, "/v1/check?tenant=acme&route=/lo");
    assert_eq!(st, 429, "{body}");
    let (st, body) = http_get(a.http, "/v1/check?tenant=acme&route=/cl");
    assert_eq!(st, 503, "{body}");
    assert!(body.contains("limiter_unavailable"), "{body}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (st, body) = http_get(a.http, "/v1/check?tenant=bob&route=/op");
    assert_eq!(st, 200, "{body}");

    // The allocator returns on the same address: every policy recovers.
    let alloc = allocator(&rules, &state, Some(addr), "1s");
    wait_ok(alloc.http, "/readyz", Duration::from_secs(10));
    let deadline = Instant::now() + Duration::from_secs(10);
    for route in ["/lo", "/cl", "/op"] {
        loop {
            match c.check(check(route)).await {
                Ok(r) if r.get_ref().allowed && r.get_ref().reason == Reason::Ok as i32 => break,
                _ => {}
            }
            assert!(Instant::now() < deadline, "{route} did not recover");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // The bucket refills from empty after the restart: HTTP too gets a
        // 200 once a token is there.
        loop {
            let (st, body) = http_get(a.http, &format!("/v1/check?tenant=acme&route={route}"));
            if st == 200 {
                break;
            }
            assert_eq!(st, 429, "{route}: {body}");
            assert!(Instant::now() < deadline, "{route} did not recover on HTTP");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

//! A short soak: steady load with churning tenants through a real
//! allocator and agent (three phases, each on new tenants, while the
//! agent releases idle keys). Checks what the 30-minute run in
//! docs/operations.md checks, without timing assertions: no errors, the
//! agent's memory does not grow with the tenants it has seen (its idle keys
//! are released), and I1 holds exactly for every key admitted.

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;

const RULES: &str = r#"
rules:
  - id: per-tenant
    match: { tenant: "*", route: /api }
    rate: 5/s
    burst: 5
    fail_policy: lease_only
"#;

/// Resident memory of `pid` in KiB.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS")
}

/// One phase of `quotalease bench` at the agent: (sent, errors).
fn phase(agent: &Proc, prefix: &str) -> (u64, u64) {
    let target = format!("http://{}", agent.grpc);
    let out = Command::new(BIN)
        .args([
            "bench",
            "--target",
            &target,
            "--interface",
            "check",
            "--rate",
            "1500",
            "--duration",
            "4s",
            "--keys",
            "uniform:3000",
            "--tenant-prefix",
            prefix,
            "--route",
            "/api",
        ])
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .output()
        .expect("run quotalease bench");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(out.status.code(), Some(0), "bench: {stdout}");
    let field = |k: &str| -> u64 {
        let line = stdout
            .lines()
            .find(|l| l.starts_with("sent="))
            .unwrap_or_else(|| panic!("no summary in {stdout}"));
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{k}=")))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {k}= in {line}"))
    };
    (field("sent"), field("errors"))
}

/// The agent's keys held, once it holds none or after 10 s more (the
/// count then).
fn keys_held_after_settling(a: &Proc) -> f64 {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (_, metrics) = http_get(a.http, "/metrics");
        let held = metric(&metrics, "quotalease_agent_keys_held").expect("keys held metric");
        if held == 0.0 || std::time::Instant::now() >= deadline {
            return held;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn churning_tenants_keep_memory_flat_without_errors_and_i1_holds() {
    // One malloc arena in the children (glibc; inherited through the
    // environment, this file's only test): glibc opens another arena, a
    // step of a few MiB of resident memory, when threads contend for one,
    // at a moment that depends on scheduling. The check is about what the
    // agent keeps per tenant; a CI run failed it with the agent's memory
    // +216, +2 236, +0 KiB after phases 1-3 (a one-time step, then flat),
    // which an arena opening under contention explains and a leak does
    // not (a leak grows every phase: +1 824 KiB over three with every key
    // kept).
    std::env::set_var("MALLOC_ARENA_MAX", "1");
    let dir = tempdir("soak");
    let rules = write_rules(&dir, RULES);
    let alloc = allocator(&rules, &dir.join("state"), None, "2s");
    wait_ok(alloc.http, "/readyz", Duration::from_secs(10));
    let log = dir.join("admissions.tsv");
    let a = agent("soak", &alloc.url(), Some(&log), &["--idle-release", "1s"]);
    wait_ok(a.http, "/readyz", Duration::from_secs(10));
    let pid = a.child.id();

    // QUOTALEASE_SOAK_PHASES=277 is the documented 30-minute run
    // (docs/operations.md "Soak"); the suite runs four.
    let phases: usize = std::env::var("QUOTALEASE_SOAK_PHASES")
        .ok()
        .map(|v| v.parse().expect("QUOTALEASE_SOAK_PHASES: a whole number"))
        .unwrap_or(4)
        .max(2);
    let alloc_pid = alloc.child.id();
    let mut rss = Vec::new();
    let mut alloc_rss = Vec::new();
    for i in 0..phases {
        let p = format!("p{i}-");
        let (sent, errors) = phase(&a, &p);
        assert!(sent > 1_000, "phase {p}: sent {sent}");
        assert_eq!(errors, 0, "phase {p}: errors");
        // Let idle keys go (idle release 1 s, then the release round trip),
        // and measure once the agent holds none of them (on a loaded
        // machine the last ones can take longer than the 2.5 s).
        std::thread::sleep(Duration::from_millis(2500));
        let held = keys_held_after_settling(&a);
        rss.push(rss_kib(pid));
        alloc_rss.push(rss_kib(alloc_pid));
        eprintln!(
            "phase {i}: sent {sent}, agent RSS {} KiB, allocator RSS {} KiB, keys held {held}",
            rss[i], alloc_rss[i]
        );
    }
    eprintln!("agent RSS after each phase (KiB): {rss:?}");
    eprintln!("allocator RSS after each phase (KiB): {alloc_rss:?}");
    let last = rss.len() - 1;
    // 12 000 tenants seen in all; memory after the last phase stays near the
    // first's. Measured here: +136 KiB over three phases with idle keys
    // released, +1 824 KiB with `--idle-release 600s` (every key kept).
    assert!(
        rss[last] <= rss[0] + 1024,
        "agent memory grew with the tenants seen: {rss:?} KiB"
    );
    let (_, metrics) = http_get(a.http, "/metrics");
    assert_eq!(
        metric(
            &metrics,
            "quotalease_agent_checks_total{result=\"unavailable\"}"
        ),
        Some(0.0),
        "no unavailable answers"
    );
    assert!(a.terminate().success(), "agent stops cleanly");
    let adm = read_admissions(&[log]);
    assert!(adm.len() > 1_000, "many keys admitted: {}", adm.len());
    let rate = quotalease_model::rules::Rate {
        tokens: 5,
        period_s: 1,
    };
    for (key, mut l) in adm {
        let w = quotalease_sim::checker::worst_window(&mut l, rate, 5);
        assert!(w.held(), "I1 broken for {key:?}: excess {}", w.excess);
    }
}

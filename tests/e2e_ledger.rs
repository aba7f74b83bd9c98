//! End to end, the global allocator's ledger (SPEC §2 "First start",
//! "Restarts"), with real processes: a bare first start serves full
//! buckets and locks its state directory; a lost state directory is
//! caught by the agents' ledger id instead of handing out the burst again;
//! a restart with a smaller `--ttl-max` waits the larger recorded one; a
//! corrupt ledger file is an error that grants nothing and keeps the file.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::*;

const SLOW: &str = r#"
rules:
  - id: login
    match: { tenant: "*", route: /api/login }
    rate: 5/m
    burst: 5
    fail_policy: closed
  - id: daily
    match: { tenant: "*", route: /api/daily }
    rate: 1/d
    burst: 10
    fail_policy: closed
"#;

fn check(a: &Proc, tenant: &str, route: &str) -> u16 {
    http_get(a.http, &format!("/v1/check?tenant={tenant}&route={route}")).0
}

/// `quotalease allocator ARGS` in `cwd`, its start line's addresses.
fn bare_allocator(cwd: &Path, args: &[&str]) -> Result<Proc, String> {
    let mut all: Vec<String> = [
        "allocator",
        "--listen",
        "127.0.0.1:0",
        "--http",
        "127.0.0.1:0",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    all.extend(args.iter().map(|s| s.to_string()));
    Proc::try_spawn_in("allocator", &all, Some(cwd))
}

/// A newcomer's bare `quotalease allocator --rules FILE` (no --state-dir):
/// the seeds' classic slow rules admit their whole burst at once (they
/// admitted 0 of 5 and 0 of 10 when every start was taken for a restart),
/// the ledger lands under the working directory, and a second allocator
/// on the same directory is refused with a clear error.
#[test]
fn a_bare_first_start_serves_full_buckets_and_locks_its_state_dir() {
    let dir = tempdir("ledger-bare");
    let rules = write_rules(&dir, SLOW);
    let rules_arg = rules.display().to_string();
    let alloc = bare_allocator(&dir, &["--rules", &rules_arg]).expect("allocator starts");
    wait_ok(alloc.http, "/readyz", Duration::from_secs(5));
    let a = agent("ledger-bare", &alloc.url(), None, &[]);
    wait_ok(a.http, "/readyz", Duration::from_secs(10));
    let logins = (0..8)
        .filter(|_| check(&a, "acme", "/api/login") == 200)
        .count();
    assert_eq!(logins, 5, "5/m burst 5 on a first start");
    let daily = (0..12)
        .filter(|_| check(&a, "acme", "/api/daily") == 200)
        .count();
    assert_eq!(daily, 10, "1/d burst 10 on a first start");

    let ledger = dir
        .join("quotalease-state")
        .join("127.0.0.1_0")
        .join("ledger");
    let text = std::fs::read_to_string(&ledger).expect("the ledger file");
    assert!(text.starts_with("quotalease-ledger 1\nid "), "{text:?}");

    // The same listen address in the same directory: the same state dir.
    let (ok, err) = run_to_end(
        &dir,
        &[
            "allocator",
            "--listen",
            "127.0.0.1:0",
            "--http",
            "127.0.0.1:0",
            "--rules",
            &rules_arg,
        ],
    );
    assert!(
        !ok,
        "a second allocator on a locked state dir must not start"
    );
    assert!(
        err.contains("in use by another allocator (locked)"),
        "{err}"
    );
    drop(a);
    drop(alloc);
}

const TEN: &str = r#"
rules:
  - id: orders
    match: { tenant: "*", route: /api/orders }
    rate: 10/s
    burst: 100
    fail_policy: lease_only
"#;

/// The state directory is lost while an agent holds leases (a new volume,
/// a new path): the restarted allocator creates a new ledger with full
/// buckets, and the agent's first request names the old ledger, so it
/// counts every key as fully leased out instead of handing out the burst
/// a second time (+95 tokens over `B + R*T` at 10/s burst 100 before).
/// I1 is checked exactly over the agent's admissions.
#[test]
fn a_lost_state_dir_is_caught_by_the_agents_ledger_id() {
    let dir = tempdir("ledger-lost");
    let rules = write_rules(&dir, TEN);
    let state = dir.join("state");
    let alloc = allocator(&rules, &state, None, "2s");
    wait_ok(alloc.http, "/readyz", Duration::from_secs(5));
    let listen = alloc.grpc;
    let log = dir.join("admissions.tsv");
    let a = agent("ledger-lost", &alloc.url(), Some(&log), &[]);
    wait_ok(a.http, "/readyz", Duration::from_secs(10));
    let mut allowed = 0u64;
    let started = Instant::now();
    while started.elapsed() < Duration::from_millis(1500) {
        allowed += u64::from(check(&a, "acme", "/api/orders") == 200);
    }
    assert!(allowed >= 100, "the burst passes first: {allowed}");

    alloc.kill9();
    std::fs::remove_dir_all(&state).expect("lose the state dir");
    let alloc = allocator(&rules, &state, Some(listen), "2s");
    let restarted = Instant::now();
    let mut after = 0u64;
    while restarted.elapsed() < Duration::from_secs(4) {
        after += u64::from(check(&a, "acme", "/api/orders") == 200);
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(a.terminate().success());
    // Within the agent's last lease only, not a second burst.
    assert!(after < 60, "admitted {after} after the restart");
    check_key_i1(
        &[log],
        ("orders", "acme", "/api/orders"),
        10,
        100,
        allowed + after,
    );
    let (_, metrics) = http_get(alloc.http, "/metrics");
    assert_eq!(
        metric(&metrics, "quotalease_allocator_ledgers_lost_total"),
        Some(1.0),
        "the allocator saw the agent's old ledger"
    );
    let (status, body) = http_get(alloc.http, "/readyz");
    assert_eq!(
        status, 503,
        "still waiting out the lost ledger's leases: {body}"
    );
    // A restart during that wait must wait the cap too: it is recorded.
    let text = std::fs::read_to_string(state.join("ledger")).expect("ledger");
    assert!(text.contains("ttl_max_ms 60000\n"), "{text}");
    drop(alloc);
}

/// A restart with a smaller `--ttl-max` keeps what may be leased under the
/// larger one recorded in the ledger out for that long (30 s leases may
/// still be out: it waited only the new value and admitted +54 before).
/// After a crash each leased key's phantom (its reservation: the burst
/// minus its floor) lasts the recorded 8 s, not the new 1 s.
#[test]
fn a_restart_with_a_smaller_ttl_max_waits_the_recorded_one() {
    let dir = tempdir("ledger-ttl");
    let rules = write_rules(&dir, TEN);
    let state = dir.join("state");
    let alloc = allocator(&rules, &state, None, "8s");
    wait_ok(alloc.http, "/readyz", Duration::from_secs(5));
    let listen = alloc.grpc;
    let a = agent("ledger-ttl", &alloc.url(), None, &["--lease-ttl", "8s"]);
    wait_ok(a.http, "/readyz", Duration::from_secs(10));
    let deadline = Instant::now() + Duration::from_secs(10);
    while check(&a, "acme", "/api/orders") != 200 {
        assert!(
            Instant::now() < deadline,
            "the first start's grace never ended"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(300));
    alloc.kill9();
    let alloc = allocator(&rules, &state, Some(listen), "1s");
    wait_ok(alloc.http, "/healthz", Duration::from_secs(5));
    // A 1 s phantom would be over by now; the recorded 8 s is not.
    std::thread::sleep(Duration::from_millis(2500));
    let (status, body) = http_get(
        alloc.http,
        "/v1/keys?rule=orders&tenant=acme&route=/api/orders",
    );
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    let phantom = v["holders"]
        .as_array()
        .unwrap()
        .iter()
        .find(|h| h["holder"] == "(predecessor)")
        .unwrap_or_else(|| panic!("the leased key has a phantom: {v}"));
    let left = phantom["expires_in_ms"].as_u64().unwrap();
    assert!(
        left > 4_000,
        "the phantom lasts the recorded 8 s: {left} ms left"
    );
    let text = std::fs::read_to_string(state.join("ledger")).expect("ledger");
    assert!(
        text.contains("ttl_max_ms 8000\n"),
        "the larger value stays recorded: {text}"
    );
    drop((a, alloc));
}

/// A corrupt ledger file or one from a newer version: a clear error naming
/// the file, nothing granted, and the file left as it was.
#[test]
fn a_corrupt_or_newer_ledger_is_an_error_that_keeps_the_file() {
    let dir = tempdir("ledger-bad");
    let rules = write_rules(&dir, TEN);
    let rules_arg = rules.display().to_string();
    for (text, says) in [
        (
            "quotalease-ledger 1\nid zz\nttl_max_ms 2000\nrules_version 5\n",
            "id: \"zz\" is not hex",
        ),
        ("quotalease-ledger 9\nid 1\n", "newer than this binary"),
        ("garbage", "not a quotalease ledger"),
    ] {
        let state = dir.join("state");
        std::fs::create_dir_all(&state).unwrap();
        std::fs::write(state.join("ledger"), text).unwrap();
        let state_arg = state.display().to_string();
        let (ok, err) = run_to_end(
            &dir,
            &[
                "allocator",
                "--listen",
                "127.0.0.1:0",
                "--http",
                "127.0.0.1:0",
                "--rules",
                &rules_arg,
                "--state-dir",
                &state_arg,
            ],
        );
        assert!(!ok, "{text:?} must not start an allocator");
        assert!(
            err.contains("ledger") && err.contains(says),
            "{text:?}: {err}"
        );
        assert_eq!(std::fs::read_to_string(state.join("ledger")).unwrap(), text);
    }
    // --ttl-max above the compiled cap names the flag.
    let (ok, err) = run_to_end(
        &dir,
        &[
            "allocator",
            "--listen",
            "127.0.0.1:0",
            "--http",
            "127.0.0.1:0",
            "--rules",
            &rules_arg,
            "--ttl-max",
            "2m",
        ],
    );
    assert!(!ok && err.contains("--ttl-max"), "{err}");
}

/// SIGTERM writes every key's state and a clean restart resumes it
/// instead of waiting out a phantom: right after the start's grace (at a
/// restart `TTL_max`, 2 s here, every start since runs are checked), a key
/// at rest has its
/// whole burst (`5/m burst 5`: five logins; it used to wait `TTL_max` and
/// then start from empty, 0 logins for a minute), and a used `1/d burst
/// 10` key with 3 spent admits exactly the 7 left across the old agent
/// (whose lease of then counts until it has expired) and a new one. The
/// checkpoint is consumed at start: a crash after it waits as before.
#[test]
fn a_clean_restart_resumes_every_key_from_its_checkpoint() {
    let dir = tempdir("ledger-clean");
    let rules = write_rules(&dir, SLOW);
    let state = dir.join("state");
    let alloc = allocator(&rules, &state, None, "2s");
    wait_ok(alloc.http, "/readyz", Duration::from_secs(5));
    let listen = alloc.grpc;
    let a = agent("ledger-clean-a", &alloc.url(), None, &[]);
    wait_ok(a.http, "/readyz", Duration::from_secs(10));
    let mut daily = 0;
    for _ in 0..3 {
        assert_eq!(check(&a, "acme", "/api/daily"), 200);
        daily += 1;
    }
    assert!(alloc.terminate().success(), "a clean stop");
    assert!(
        state.join("checkpoint").exists(),
        "SIGTERM wrote the checkpoint"
    );

    let alloc = allocator(&rules, &state, Some(listen), "2s");
    let started = Instant::now();
    // Every start waits three agent heartbeats before granting (requesters
    // that saw a newer copy of this state present its run first), and no
    // longer: no phantom's TTL_max wait on top.
    let (status, body) = http_get(alloc.http, "/readyz");
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("starting"), "{body}");
    wait_ok(alloc.http, "/readyz", Duration::from_secs(10));
    assert!(
        started.elapsed() < Duration::from_millis(3_900),
        "ready after {:?}",
        started.elapsed()
    );
    assert!(!state.join("checkpoint").exists(), "consumed at start");
    let b = agent("ledger-clean-b", &alloc.url(), None, &[]);
    wait_ok(b.http, "/readyz", Duration::from_secs(10));
    let logins = (0..6)
        .filter(|_| check(&b, "quiet", "/api/login") == 200)
        .count();
    assert_eq!(
        logins, 5,
        "a key at rest keeps its burst across a clean restart"
    );
    let until = Instant::now() + Duration::from_secs(5);
    while Instant::now() < until {
        for x in [&a, &b] {
            if check(x, "acme", "/api/daily") == 200 {
                daily += 1;
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        daily, 10,
        "the used key resumed its level: 3 before, 7 after, no more"
    );

    // A crash now finds no checkpoint: the keys resume from their
    // write-ahead reservations, with no start-up wait: the used key at its
    // floor (nothing left), a key at rest full.
    alloc.kill9();
    let alloc = allocator(&rules, &state, Some(listen), "2s");
    let started = Instant::now();
    wait_ok(alloc.http, "/readyz", Duration::from_secs(10));
    assert!(
        started.elapsed() < Duration::from_millis(3_900),
        "after a crash, ready after {:?}: only the start's grace",
        started.elapsed()
    );
    assert_ne!(check(&b, "acme", "/api/daily"), 200, "all 10 were used");
    let fresh = (0..6)
        .filter(|_| check(&b, "fresh", "/api/login") == 200)
        .count();
    assert_eq!(fresh, 5, "a key at rest keeps its burst across a crash");
    drop((a, b, alloc));
}

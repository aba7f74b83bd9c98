//! A start-up wait never looks like a limit (SPEC §2 "First start"), tried
//! as a new user would: allocator and agent started, a first request sent
//! at once, for a tenant that has spent nothing. Every start waits three
//! agent heartbeats before granting (requesters holding this ledger's
//! leases, or a newer copy of its state, present them first). Before, such
//! a request got `OVER_LIMIT` with a retry time. Now a request waits
//! through the wait up to its deadline, then is answered `STARTING` under
//! its rule's fail policy (a `lease_only` rule: denied with `STARTING`, and
//! on HTTP a 503; a `closed` rule: unavailable), never over limit; one
//! without a deadline (HTTP) waits at most a second.

mod common;

use std::time::{Duration, Instant};

use common::*;
use quotalease_proto::v1::{CheckRequest, Reason};

const RULES: &str = r#"
rules:
  - id: api
    match: { tenant: "*", route: /api }
    rate: 100/s
    burst: 100
    fail_policy: lease_only
  - id: strict
    match: { tenant: "*", route: /strict }
    rate: 100/s
    burst: 100
    fail_policy: closed
"#;

fn check_req(route: &str, timeout: Duration) -> tonic::Request<CheckRequest> {
    let mut r = tonic::Request::new(CheckRequest {
        tenant_id: "newcomer".into(),
        route_id: route.into(),
        cost: 1,
        ..Default::default()
    });
    r.set_timeout(timeout);
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_request_during_the_start_wait_is_told_starting_never_over_limit() {
    let dir = tempdir("starting");
    let rules = write_rules(&dir, RULES);
    let alloc = allocator(&rules, &dir.join("state"), None, "2s");
    let started = Instant::now();
    let a = agent("starting-a", &alloc.url(), None, &[]);
    wait_ok(a.http, "/readyz", Duration::from_secs(10));
    let mut c = client(&a).await;

    // Within the allocator's first 3 s: requests with a 300 ms deadline,
    // for a tenant that has spent nothing. Each is STARTING (or, once the
    // wait is over, admitted): never OVER_LIMIT.
    let (mut starting, mut closed_starting) = (0, 0);
    let mut at = Duration::ZERO;
    while started.elapsed() < Duration::from_millis(2_500) {
        let r = c
            .check(check_req("/api", Duration::from_millis(300)))
            .await
            .expect("answered before its deadline")
            .into_inner();
        assert_ne!(r.reason, Reason::OverLimit as i32, "{r:?}");
        if r.reason == Reason::Starting as i32 {
            assert!(!r.allowed);
            assert!(r.retry_after_ms > 0 && r.retry_after_ms <= 3_000, "{r:?}");
            starting += 1;
            at = started.elapsed();
        }
        // A closed rule: the fail policy's answer, unavailable, saying
        // why (or, once the wait is over, admitted).
        match c
            .check(check_req("/strict", Duration::from_millis(300)))
            .await
        {
            Err(e) => {
                assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
                assert!(e.message().contains("starting"), "{e:?}");
                closed_starting += 1;
            }
            Ok(r) => assert!(r.get_ref().allowed, "{r:?}"),
        }
    }
    assert!(
        starting > 0,
        "no answer said STARTING in the allocator's first 2.5 s"
    );
    assert!(closed_starting > 0, "no closed rule's answer said starting");
    // On HTTP (no deadline): a 503 naming STARTING if the wait outlasts
    // the agent's own bound, else, once the wait ends, served.
    let (status, body) = http_get(a.http, "/v1/check?tenant=newcomer&route=/api");
    assert!(
        status == 200 || (status == 503 && body.contains("STARTING")),
        "{status} {body}"
    );
    assert_ne!(status, 429, "{body}");
    // After the wait the tenant's whole burst is there.
    let served = (0..100)
        .filter(|_| http_get(a.http, "/v1/check?tenant=newcomer2&route=/api").0 == 200)
        .count();
    assert_eq!(served, 100, "the burst after the wait");
    eprintln!(
        "{starting} STARTING answers, the last {at:?} after the allocator started; HTTP during the wait: {status}"
    );
    assert!(a.terminate().success());
    drop(alloc);
}

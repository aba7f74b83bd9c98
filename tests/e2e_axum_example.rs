//! `examples/axum_tenant_limit.rs` run as two processes against one real
//! allocator process: both instances' admissions together stay within
//! `B + R*T` over every window (exact, from their admission logs, which
//! must agree with the 200s the test got), the burst and the refill are
//! delivered, and denials are 429 with `Retry-After` and the rate-limit
//! headers.

mod common;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;

const RULES: &str = r#"
rules:
  - id: orders
    match: { tenant: "*", route: /v1/orders }
    rate: 20/s
    burst: 40
    fail_policy: closed
"#;

/// GET /v1/orders as `tenant`: (status, lower-case headers).
fn get(addr: SocketAddr, tenant: &str) -> (u16, Vec<(String, String)>) {
    let (status, headers, _) = http_get_sending(addr, "/v1/orders", &[("x-tenant", tenant)]);
    (status, headers)
}

#[test]
fn two_instances_of_the_axum_example_share_one_global_limit() {
    let bin = example_bin("axum_tenant_limit");
    let dir = tempdir("e2e_axum_example");
    let rules = write_rules(&dir, RULES);
    let alloc = allocator(&rules, &dir.join("state"), None, "2s");
    let instances = [
        example(&bin, &alloc.url(), "orders-1", &dir),
        example(&bin, &alloc.url(), "orders-2", &dir),
    ];
    // Until the allocator's first-start wait is over, answers are 429
    // (STARTING under the rule's policy) or 503: wait for a first 200.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut ok = 0u64;
    while ok == 0 {
        assert!(Instant::now() < deadline, "no 200 within 20 s");
        let (status, _) = get(instances[0].addr, "acme");
        assert!(matches!(status, 200 | 429 | 503), "{status}");
        ok += u64::from(status == 200);
        std::thread::sleep(Duration::from_millis(50));
    }
    // Then 16 threads over both instances for 3 s, far above 20/s.
    let oks = Arc::new(AtomicU64::new(ok));
    let denials = Arc::new(AtomicU64::new(0));
    let addrs = [instances[0].addr, instances[1].addr];
    let threads: Vec<_> = (0..16)
        .map(|i| {
            let (oks, denials, addr) = (oks.clone(), denials.clone(), addrs[i % 2]);
            std::thread::spawn(move || {
                let until = Instant::now() + Duration::from_secs(3);
                while Instant::now() < until {
                    let (status, headers) = get(addr, "acme");
                    let h = |k: &str| headers.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
                    match status {
                        200 => {
                            oks.fetch_add(1, Ordering::Relaxed);
                        }
                        429 => {
                            let retry: u64 = h("retry-after")
                                .expect("Retry-After on a 429")
                                .parse()
                                .expect("seconds");
                            assert!(retry >= 1);
                            assert_eq!(
                                h("ratelimit-policy").as_deref(),
                                Some("\"orders\";q=40;w=2")
                            );
                            denials.fetch_add(1, Ordering::Relaxed);
                        }
                        other => panic!("unexpected status {other}"),
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("thread");
    }
    let (oks, denials) = (oks.load(Ordering::Relaxed), denials.load(Ordering::Relaxed));
    // SIGTERM: each instance stops, gives its leases back and flushes its
    // admission log.
    let logs: Vec<PathBuf> = instances.into_iter().map(Example::stop).collect();
    check_shared_limit(
        &logs,
        ("orders", "acme", "/v1/orders"),
        20,
        40,
        oks,
        denials,
    );
}

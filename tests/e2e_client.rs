//! The client crate (`quotalease-client`) against a real allocator process
//! over real gRPC on 127.0.0.1: two clients (two holders, as two service
//! processes would be) on one key stay within `B + R*T` and are delivered
//! the burst and the refill; shutdown gives their leases back.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use quotalease_client::{Client, Key, Outcome};

const RULES: &str = r#"
rules:
  - id: orders
    match: { tenant: "*", route: /orders }
    rate: 20/s
    burst: 40
    fail_policy: closed
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_clients_over_grpc_share_one_global_limit() {
    let dir = tempdir("e2e_client");
    let rules = write_rules(&dir, RULES);
    let alloc = allocator(&rules, &dir.join("state"), None, "2s");
    let clients: Vec<Client> = ["svc-a", "svc-b"]
        .iter()
        .map(|id| {
            Client::builder()
                .allocator(alloc.url())
                .agent_id(*id)
                .build()
                .expect("client")
        })
        .collect();
    for c in &clients {
        assert!(c.ready(Duration::from_secs(15)).await, "client ready");
    }
    let key = Key::new("acme", "/orders");
    // The allocator's start wait (SPEC §2 "First start") answers STARTING:
    // not a limit. Wait until the first grant.
    let opened = Instant::now() + Duration::from_secs(15);
    let start = loop {
        let asked = Instant::now();
        let d = clients[0].check(&key, 1).await;
        if d.allowed() {
            break asked;
        }
        assert!(
            matches!(
                d.outcome(),
                Outcome::Starting | Outcome::FailureModeDenied | Outcome::Unavailable(_)
            ),
            "before the first grant: {d:?}"
        );
        assert!(Instant::now() < opened, "no grant within 15 s: {d:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    // From here, 40 tasks over both clients for 2 s, far above 20/s.
    let admitted = Arc::new(AtomicU64::new(1));
    let mut tasks = Vec::new();
    for i in 0..40 {
        let c = clients[i % 2].clone();
        let (key, admitted) = (key.clone(), admitted.clone());
        tasks.push(tokio::spawn(async move {
            let until = Instant::now() + Duration::from_secs(2);
            while Instant::now() < until {
                let d = c.check(&key, 1).await;
                if d.allowed() {
                    admitted.fetch_add(1, Ordering::Relaxed);
                } else {
                    assert_eq!(d.outcome(), &Outcome::OverLimit, "{d:?}");
                    assert_eq!(d.rule_id(), Some("orders"));
                    assert!(d.retry_after().is_some(), "{d:?}");
                }
                tokio::time::sleep(Duration::from_millis(3)).await;
            }
        }));
    }
    for t in tasks {
        t.await.expect("task");
    }
    // Every admission happened within [start, now]: `start` is when the
    // first admitted check was asked.
    let elapsed = start.elapsed().as_secs_f64();
    let admitted = admitted.load(Ordering::Relaxed);
    let bound = 40.0 + 20.0 * elapsed;
    eprintln!("{admitted} admitted in {elapsed:.3} s, bound {bound:.1}");
    assert!(
        admitted as f64 <= bound,
        "{admitted} admitted in {elapsed:.3} s, bound {bound:.1}"
    );
    // The burst, and most of the refill, are delivered across both.
    assert!(
        admitted as f64 >= 40.0 + 0.5 * 20.0 * elapsed,
        "{admitted} admitted in {elapsed:.3} s: the burst and the refill are delivered"
    );
    for c in &clients {
        c.shutdown().await;
    }
}

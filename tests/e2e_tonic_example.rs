//! `examples/tonic_tenant_limit.rs` run as two processes against one real
//! allocator process, called by real tonic clients over HTTP/2 with
//! hundreds of calls in flight: both
//! instances' admissions together stay within `B + R*T` over every window
//! (exact, from their admission logs, which must agree with the calls
//! that succeeded), and refusals are `RESOURCE_EXHAUSTED` naming the rule,
//! with `retry-after` and the rate-limit headers as metadata.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use tonic::transport::Channel;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

const RULES: &str = r#"
rules:
  - id: health
    match: { tenant: "*", route: /grpc.health.v1.Health/Check }
    rate: 20/s
    burst: 40
    fail_policy: closed
"#;

/// One `Health/Check` call as `tenant`.
async fn call(client: &mut HealthClient<Channel>, tenant: &str) -> Result<(), tonic::Status> {
    let mut req = tonic::Request::new(HealthCheckRequest {
        service: String::new(),
    });
    req.metadata_mut()
        .insert("x-tenant", tenant.parse().expect("ascii"));
    client.check(req).await.map(|_| ())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_instances_of_the_tonic_example_share_one_global_limit() {
    let bin = example_bin("tonic_tenant_limit");
    let dir = tempdir("e2e_tonic_example");
    let rules = write_rules(&dir, RULES);
    let alloc = allocator(&rules, &dir.join("state"), None, "2s");
    let instances = [
        example(&bin, &alloc.url(), "health-1", &dir),
        example(&bin, &alloc.url(), "health-2", &dir),
    ];
    let mut clients = Vec::new();
    for inst in &instances {
        let channel = Channel::from_shared(format!("http://{}", inst.addr))
            .expect("url")
            .connect()
            .await
            .expect("connect");
        clients.push(HealthClient::new(channel));
    }
    // Until the allocator's first-start wait is over, calls are refused
    // (STARTING under the rule's policy, or UNAVAILABLE): wait for one OK.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut ok = 0u64;
    while ok == 0 {
        assert!(Instant::now() < deadline, "no OK within 20 s");
        match call(&mut clients[0], "acme").await {
            Ok(()) => ok += 1,
            Err(s) => assert!(
                matches!(
                    s.code(),
                    tonic::Code::ResourceExhausted | tonic::Code::Unavailable
                ),
                "{s:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Then 256 tasks over both instances for 3 s (hundreds of calls in
    // flight on two HTTP/2 connections), far above 20/s.
    let oks = Arc::new(AtomicU64::new(ok));
    let denials = Arc::new(AtomicU64::new(0));
    let tasks: Vec<_> = (0..256)
        .map(|i| {
            let (oks, denials) = (oks.clone(), denials.clone());
            let mut client = clients[i % 2].clone();
            tokio::spawn(async move {
                let until = Instant::now() + Duration::from_secs(3);
                while Instant::now() < until {
                    match call(&mut client, "acme").await {
                        Ok(()) => {
                            oks.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(s) => {
                            assert_eq!(s.code(), tonic::Code::ResourceExhausted, "{s:?}");
                            assert!(s.message().contains("rule health"), "{s:?}");
                            let md = s.metadata();
                            let retry: u64 = md
                                .get("retry-after")
                                .expect("retry-after on a refusal")
                                .to_str()
                                .expect("ascii")
                                .parse()
                                .expect("seconds");
                            assert!(retry >= 1);
                            assert_eq!(
                                md.get("ratelimit-policy").map(|v| v.to_str().unwrap()),
                                Some("\"health\";q=40;w=2")
                            );
                            denials.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("task");
    }
    let (oks, denials) = (oks.load(Ordering::Relaxed), denials.load(Ordering::Relaxed));
    drop(clients);
    let logs: Vec<_> = instances.into_iter().map(Example::stop).collect();
    check_shared_limit(
        &logs,
        ("health", "acme", "/grpc.health.v1.Health/Check"),
        20,
        40,
        oks,
        denials,
    );
}

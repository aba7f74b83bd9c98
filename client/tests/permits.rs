//! `Client::acquire` (issue 34): permits of concurrency rules through the
//! embedded agent against the real allocator core in process. Its own test
//! binary: the experimental switch is process-wide (the gate itself is
//! tested in the model and in tests/e2e_permits.rs).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use quotalease_client::testing::InProcessAllocator;
use quotalease_client::{AcquireError, Key};

const RULES: &str = r#"
rules:
  - id: model-calls
    match: { tenant: "*", route: /v1/generate }
    concurrency: 4
    permit_ttl: 10s
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn permits_across_two_clients_never_exceed_n_and_drop_releases() {
    let alloc = InProcessAllocator::from_yaml(RULES).expect("rules");
    let clients = [alloc.client("a").unwrap(), alloc.client("b").unwrap()];
    for c in &clients {
        assert!(c.ready(Duration::from_secs(5)).await, "ready");
    }
    let key = Key::new("acme", "/v1/generate");
    let held = Arc::new(AtomicU64::new(0));
    let most = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for i in 0..24u64 {
        let c = clients[(i % 2) as usize].clone();
        let (key, held, most) = (key.clone(), held.clone(), most.clone());
        tasks.push(tokio::spawn(async move {
            let permit = c.acquire(&key).await.expect("a permit");
            let now = held.fetch_add(1, Ordering::SeqCst) + 1;
            most.fetch_max(now, Ordering::SeqCst);
            assert!(permit.fencing_token() > 0);
            tokio::time::sleep(Duration::from_millis(10 + (i * 7) % 30)).await;
            held.fetch_sub(1, Ordering::SeqCst);
            drop(permit);
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let most = most.load(Ordering::SeqCst);
    assert!((2..=4).contains(&most), "{most} held at once, N = 4");

    // Four held: a fifth waits out its wait, holding nothing.
    let c = &clients[0];
    let mut four = Vec::new();
    for _ in 0..4 {
        four.push(c.acquire(&key).await.unwrap());
    }
    let r = c.acquire_with(&key, 1, Duration::from_millis(100)).await;
    // It says when to come back: nothing started here during its 100 ms
    // (the pace of starts is at least that drought), within 60 s.
    match r.unwrap_err() {
        AcquireError::Timeout { retry_after } => assert!(
            retry_after >= Duration::from_millis(100) && retry_after <= Duration::from_secs(60),
            "{retry_after:?}"
        ),
        e => panic!("{e:?}"),
    }
    // Renewal: held, the expiry moves no earlier; `expiring` resolves
    // before it.
    let mut p = four.pop().unwrap();
    let before = p.expires_in();
    assert!(before > Duration::ZERO);
    tokio::time::timeout(
        before,
        p.expiring(before.saturating_sub(Duration::from_millis(20))),
    )
    .await
    .expect("expiring resolves before the expiry");
    assert!(p.renew().unwrap() > Duration::ZERO);
    // Released by hand, then by dropping: the slots serve the next ones,
    // at the other client once the holder's next renewal (half a lease
    // TTL at most: about a second) gives them back.
    assert!(p.release());
    drop(four.pop());
    let wait = Duration::from_secs(5);
    let a = clients[1].acquire_with(&key, 1, wait).await.unwrap();
    let b = clients[1].acquire_with(&key, 1, wait).await.unwrap();
    assert!(a.fencing_token() > 0 && b.fencing_token() > 0);
    // More slots than N, and a key no concurrency rule selects.
    let r = c.acquire_with(&key, 5, Duration::from_millis(10)).await;
    assert!(
        matches!(r, Err(AcquireError::Invalid(ref why)) if why.starts_with("slots")),
        "{r:?}"
    );
    let r = c.acquire(&Key::new("acme", "/other")).await;
    assert_eq!(r.unwrap_err(), AcquireError::NoRule);
}

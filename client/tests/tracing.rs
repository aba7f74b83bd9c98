//! The `tracing` feature: the middleware's refusals as events. In a test
//! binary of its own: tracing caches a call site's interest process-wide,
//! and a test in another thread without the subscriber could hit the call
//! site first.

use std::convert::Infallible;
use std::sync::Arc;

use http::{Request, Response};
use quotalease_client::middleware::{HeaderKey, RateLimitLayer};
use quotalease_client::testing::InProcessAllocator;
use tower::{Layer, ServiceExt};

const RULES: &str = r#"
rules:
  - id: strict
    match: { tenant: "*", route: /strict }
    rate: 1/m
    burst: 5
    fail_policy: closed
"#;

/// A log sink for the `tracing` feature's test.
#[derive(Clone, Default)]
struct Sink(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Sink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test(flavor = "current_thread")]
async fn refusals_are_traced_with_their_key_and_rule() {
    let sink = Sink::default();
    let writer = sink.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let alloc = InProcessAllocator::from_yaml(RULES).expect("rules");
    let layer = RateLimitLayer::new(
        alloc.client("svc-t").expect("client"),
        HeaderKey::new("x-tenant"),
    );
    let svc = layer.layer(tower::service_fn(|_req: Request<String>| async {
        Ok::<_, Infallible>(Response::new(String::new()))
    }));
    let mut codes = Vec::new();
    for _ in 0..6 {
        let resp = svc
            .clone()
            .oneshot(
                Request::builder()
                    .uri("/strict")
                    .header("x-tenant", "acme")
                    .body(String::new())
                    .expect("request"),
            )
            .await
            .expect("infallible");
        codes.push(resp.status().as_u16());
    }
    assert_eq!(codes, [200, 200, 200, 200, 200, 429]);
    let log = String::from_utf8(sink.0.lock().unwrap().clone()).expect("utf-8");
    let denials: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("quotalease: rate limited"))
        .collect();
    assert_eq!(denials.len(), 1, "{log}");
    for field in [
        "tenant=\"acme\"",
        "route=\"/strict\"",
        "rule=\"strict\"",
        "OverLimit",
    ] {
        assert!(denials[0].contains(field), "{field} in {}", denials[0]);
    }
}

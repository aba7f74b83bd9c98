//! The added cost of `Service::call` through a rate-limit layer, side by
//! side in one run (issue 33 item 5): no layer; `tower_governor` (a local
//! limiter: each process its own bucket, no global limit); the quotalease
//! layer on a key that never binds (its leases always hold enough: the
//! in-memory path every admitted request takes). Each request is built
//! outside the timed part; each call is driven to completion on a
//! current-thread runtime, the same way for all three.
//!
//! `cargo bench -p quotalease-client --bench layer`

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Body;
use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use http::{Request, Response};
use quotalease_client::middleware::{HeaderKey, RateLimitLayer};
use quotalease_client::testing::InProcessAllocator;
use quotalease_client::Client;
use tower::{Layer, Service, ServiceExt};
use tower_governor::governor::GovernorConfigBuilder;
use tower_governor::key_extractor::GlobalKeyExtractor;
use tower_governor::GovernorLayer;

/// A rule the benchmark's key never reaches.
const RULES: &str = r#"
rules:
  - id: wide
    match: { tenant: "*", route: /v1/orders }
    rate: 100000000/s
    burst: 100000000
"#;

fn request() -> Request<Body> {
    Request::builder()
        .uri("/v1/orders")
        .header("x-tenant", "acme")
        .body(Body::empty())
        .expect("request")
}

async fn hello(_req: Request<Body>) -> Result<Response<Body>, Infallible> {
    Ok(Response::new(Body::empty()))
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let mut g = c.benchmark_group("service_call");

    let mut plain = tower::service_fn(hello);
    g.bench_function("no_layer", |b| {
        b.iter_batched(
            request,
            |req| rt.block_on(async { plain.ready().await.expect("ready").call(req).await }),
            BatchSize::SmallInput,
        )
    });

    let config = Arc::new(
        GovernorConfigBuilder::default()
            .key_extractor(GlobalKeyExtractor)
            .per_nanosecond(1)
            .burst_size(u32::MAX)
            .finish()
            .expect("governor config"),
    );
    let mut governed = GovernorLayer::new(config).layer(tower::service_fn(hello));
    g.bench_function("tower_governor_local_only", |b| {
        b.iter_batched(
            request,
            |req| rt.block_on(async { governed.ready().await.expect("ready").call(req).await }),
            BatchSize::SmallInput,
        )
    });

    let alloc = InProcessAllocator::from_yaml(RULES).expect("rules");
    let client = rt.block_on(async {
        let client = Client::builder()
            .in_process(&alloc)
            .agent_id("bench")
            .build()
            .expect("client");
        assert!(client.ready(std::time::Duration::from_secs(5)).await);
        client
    });
    let limited_client = client;
    let mut limited = RateLimitLayer::new(limited_client.clone(), HeaderKey::new("x-tenant"))
        .layer(tower::service_fn(hello));
    // The first calls open the key and fetch its lease.
    for _ in 0..1000 {
        let resp =
            rt.block_on(async { limited.ready().await.expect("ready").call(request()).await });
        assert!(resp.is_ok());
    }
    g.bench_function("quotalease_never_binding", |b| {
        b.iter_batched(
            request,
            |req| rt.block_on(async { limited.ready().await.expect("ready").call(req).await }),
            BatchSize::SmallInput,
        )
    });
    let mut quiet = RateLimitLayer::new(limited_client.clone(), HeaderKey::new("x-tenant"))
        .headers_on_admitted(false)
        .layer(tower::service_fn(hello));
    g.bench_function("quotalease_never_binding_no_headers", |b| {
        b.iter_batched(
            request,
            |req| rt.block_on(async { quiet.ready().await.expect("ready").call(req).await }),
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);

//! The tower layer against the real allocator core in process: the bound
//! under hundreds of requests in flight on several worker threads and two
//! holders, the answers' statuses and headers, and that readiness charges
//! nothing.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::{Request, Response, StatusCode};
use quotalease_client::middleware::{HeaderKey, RateLimitLayer};
use quotalease_client::testing::InProcessAllocator;
use tower::{Layer, Service, ServiceExt};

const RULES: &str = r#"
rules:
  - id: api
    match: { tenant: "*", route: /api }
    rate: 10/s
    burst: 20
    fail_policy: closed
  - id: strict
    match: { tenant: "*", route: /strict }
    rate: 1/m
    burst: 5
    fail_policy: closed
"#;

/// The limited service: answers 200 with an empty body.
fn service(
    layer: &RateLimitLayer<HeaderKey>,
) -> impl Service<Request<String>, Response = Response<String>, Error = Infallible, Future: Send>
       + Clone
       + Send
       + 'static {
    layer.layer(tower::service_fn(|_req: Request<String>| async {
        Ok::<_, Infallible>(Response::new(String::new()))
    }))
}

fn request(tenant: Option<&str>, path: &str) -> Request<String> {
    let mut b = Request::builder().uri(path);
    if let Some(t) = tenant {
        b = b.header("x-tenant", t);
    }
    b.body(String::new()).expect("request")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hundreds_in_flight_through_two_holders_stay_within_b_plus_r_t() {
    let alloc = InProcessAllocator::from_yaml(RULES).expect("rules");
    // Two holders (two services' worth of leases) on one allocator.
    let layers = [
        RateLimitLayer::new(
            alloc.client("svc-1").expect("client"),
            HeaderKey::new("x-tenant"),
        ),
        RateLimitLayer::new(
            alloc.client("svc-2").expect("client"),
            HeaderKey::new("x-tenant"),
        ),
    ];
    let ok = Arc::new(AtomicU64::new(0));
    let denied = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..300 {
        let svc = service(&layers[i % 2]);
        let (ok, denied) = (ok.clone(), denied.clone());
        tasks.push(tokio::spawn(async move {
            let until = Instant::now() + Duration::from_millis(1500);
            while Instant::now() < until {
                let resp = svc
                    .clone()
                    .oneshot(request(Some("t1"), "/api"))
                    .await
                    .expect("infallible");
                match resp.status() {
                    StatusCode::OK => {
                        assert!(resp.headers().contains_key("ratelimit-policy"));
                        ok.fetch_add(1, Ordering::Relaxed);
                    }
                    StatusCode::TOO_MANY_REQUESTS => {
                        let h = resp.headers();
                        let retry: u64 = h["retry-after"]
                            .to_str()
                            .expect("ascii")
                            .parse()
                            .expect("seconds");
                        assert!(retry >= 1, "{retry}");
                        assert_eq!(h["ratelimit-policy"], "\"api\";q=20;w=2");
                        assert!(
                            h["ratelimit"]
                                .to_str()
                                .expect("ascii")
                                .starts_with("\"api\";r=0;t="),
                            "{:?}",
                            h["ratelimit"]
                        );
                        denied.fetch_add(1, Ordering::Relaxed);
                    }
                    other => panic!("unexpected {other}"),
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }));
    }
    for t in tasks {
        t.await.expect("task");
    }
    let elapsed = start.elapsed().as_secs_f64();
    let (ok, denied) = (ok.load(Ordering::Relaxed), denied.load(Ordering::Relaxed));
    let bound = 20.0 + 10.0 * elapsed;
    eprintln!("{ok} admitted, {denied} denied in {elapsed:.3} s (bound {bound:.1})");
    assert!(
        ok as f64 <= bound,
        "{ok} admitted in {elapsed:.3} s, bound {bound:.1}"
    );
    assert!(ok >= 20, "{ok} admitted: the burst at least");
    assert!(denied > 10 * ok, "{denied} denied beside {ok} admitted");
}

#[tokio::test]
async fn polling_ready_charges_nothing_the_call_decides() {
    let alloc = InProcessAllocator::from_yaml(RULES).expect("rules");
    let layer = RateLimitLayer::new(
        alloc.client("svc-3").expect("client"),
        HeaderKey::new("x-tenant"),
    );
    let mut svc = service(&layer);
    for _ in 0..50 {
        // Polled ready, never called: no token is spent.
        let _ = svc.ready().await.expect("ready");
    }
    let mut statuses = Vec::new();
    for _ in 0..7 {
        let resp = svc
            .ready()
            .await
            .expect("ready")
            .call(request(Some("t2"), "/strict"))
            .await
            .expect("infallible");
        statuses.push(resp.status().as_u16());
    }
    // 1/m burst 5: five at once, then denials.
    assert_eq!(statuses, [200, 200, 200, 200, 200, 429, 429]);
}

#[tokio::test]
async fn requests_without_the_tenant_header_pass_unless_a_default_is_named() {
    let alloc = InProcessAllocator::from_yaml(RULES).expect("rules");
    let c = alloc.client("svc-4").expect("client");
    let open = service(&RateLimitLayer::new(c.clone(), HeaderKey::new("x-tenant")));
    for _ in 0..10 {
        let resp = open
            .clone()
            .oneshot(request(None, "/strict"))
            .await
            .expect("infallible");
        assert_eq!(resp.status(), StatusCode::OK);
        assert!(!resp.headers().contains_key("ratelimit-policy"));
    }
    let shared = service(&RateLimitLayer::new(
        c,
        HeaderKey::new("x-tenant").default_tenant("anonymous"),
    ));
    let mut ok = 0;
    for _ in 0..10 {
        let resp = shared
            .clone()
            .oneshot(request(None, "/strict"))
            .await
            .expect("infallible");
        ok += u32::from(resp.status() == StatusCode::OK);
    }
    assert_eq!(ok, 5, "the anonymous tenant's burst");
}

#[tokio::test]
async fn headers_on_admitted_can_be_off_and_an_invalid_key_is_a_bad_request() {
    let alloc = InProcessAllocator::from_yaml(RULES).expect("rules");
    let layer = RateLimitLayer::new(
        alloc.client("svc-5").expect("client"),
        HeaderKey::new("x-tenant"),
    )
    .headers_on_admitted(false);
    let svc = service(&layer);
    let resp = svc
        .clone()
        .oneshot(request(Some("t3"), "/api"))
        .await
        .expect("infallible");
    assert_eq!(resp.status(), StatusCode::OK);
    assert!(!resp.headers().contains_key("ratelimit"));
    let long = "a".repeat(300);
    let resp = svc
        .clone()
        .oneshot(request(Some(&long), "/api"))
        .await
        .expect("infallible");
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn grpc_refusals_are_trailers_only_with_resource_exhausted() {
    let alloc = InProcessAllocator::from_yaml(RULES).expect("rules");
    let layer = RateLimitLayer::new(
        alloc.client("svc-g").expect("client"),
        HeaderKey::new("x-tenant").route("/strict"),
    )
    .grpc();
    let svc = service(&layer);
    let mut statuses = Vec::new();
    let mut refused = None;
    for _ in 0..7 {
        let resp = svc
            .clone()
            .oneshot(request(Some("acme"), "/pkg.Orders/Create"))
            .await
            .expect("infallible");
        // gRPC answers HTTP 200 either way; the status rides in the headers.
        assert_eq!(resp.status(), StatusCode::OK);
        let grpc = resp
            .headers()
            .get("grpc-status")
            .map(|v| v.to_str().unwrap().to_owned());
        statuses.push(grpc.clone());
        if grpc.is_some() {
            refused = Some(resp);
        }
    }
    // 1/m burst 5: five pass (no grpc-status from the layer), two refused.
    assert_eq!(
        statuses.iter().filter(|s| s.is_none()).count(),
        5,
        "{statuses:?}"
    );
    assert_eq!(
        statuses
            .iter()
            .filter(|s| s.as_deref() == Some("8"))
            .count(),
        2,
        "{statuses:?}"
    );
    let resp = refused.expect("refused");
    let h = resp.headers();
    assert_eq!(h["content-type"], "application/grpc");
    let message = h["grpc-message"].to_str().expect("ascii");
    assert!(message.contains("rule strict"), "{message}");
    let retry: u64 = h["retry-after"].to_str().unwrap().parse().expect("seconds");
    assert!((1..=60).contains(&retry), "{retry}");
    assert_eq!(h["ratelimit-policy"], "\"strict\";q=5;w=300");
    assert!(
        h["ratelimit"].to_str().unwrap().contains("r=0"),
        "{:?}",
        h["ratelimit"]
    );
}

#[tokio::test]
async fn axum_route_templates_key_every_path_of_a_route_together() {
    use axum::routing::get;
    const TEMPLATES: &str = r#"
rules:
  - id: users
    match: { tenant: "*", route: "/users/{id}" }
    rate: 1/m
    burst: 3
    fail_policy: closed
  - id: unmatched
    match: { tenant: "*", route: "(unmatched)" }
    rate: 1/m
    burst: 2
    fail_policy: closed
"#;
    let alloc = InProcessAllocator::from_yaml(TEMPLATES).expect("rules");
    let layer = RateLimitLayer::new(
        alloc.client("svc-m").expect("client"),
        HeaderKey::new("x-tenant").matched_path(),
    );
    let app: axum::Router = axum::Router::new()
        .route("/users/{id}", get(|| async { "user" }))
        .layer(layer);
    let get_status = |path: String| {
        let app = app.clone();
        async move {
            let req = Request::builder()
                .uri(path)
                .header("x-tenant", "acme")
                .body(axum::body::Body::empty())
                .expect("request");
            app.oneshot(req).await.expect("infallible").status()
        }
    };
    // Five users' pages, one route: the route's burst of 3, then 429s.
    let mut codes = Vec::new();
    for id in 1..=5 {
        codes.push(get_status(format!("/users/{id}")).await.as_u16());
    }
    assert_eq!(codes, [200, 200, 200, 429, 429]);
    // Paths no route matches share one bucket per tenant: 404, 404, 429.
    let mut codes = Vec::new();
    for i in 1..=3 {
        codes.push(get_status(format!("/scan/{i}")).await.as_u16());
    }
    assert_eq!(codes, [404, 404, 429]);
}

#[tokio::test]
async fn the_headers_follow_a_rules_change() {
    let alloc = InProcessAllocator::from_yaml(RULES).expect("rules");
    let layer = RateLimitLayer::new(
        alloc.client("svc-r").expect("client"),
        HeaderKey::new("x-tenant"),
    );
    let svc = service(&layer);
    let policy = |resp: &Response<String>| {
        resp.headers()["ratelimit-policy"]
            .to_str()
            .unwrap()
            .to_owned()
    };
    let resp = svc
        .clone()
        .oneshot(request(Some("acme"), "/api"))
        .await
        .expect("infallible");
    assert_eq!(policy(&resp), "\"api\";q=20;w=2");
    // Version 2 raises the burst: the policy header says so once the
    // client has adopted it (the layer's cached rule headers are rebuilt).
    alloc
        .set_rules(&RULES.replace("burst: 20", "burst: 30"), 2)
        .expect("rules v2");
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        let resp = svc
            .clone()
            .oneshot(request(Some("acme"), "/api"))
            .await
            .expect("infallible");
        if resp.status() == StatusCode::OK && policy(&resp) == "\"api\";q=30;w=3" {
            break;
        }
        assert!(Instant::now() < until, "still {}", policy(&resp));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_tenant_header_that_is_not_ascii_is_limited_not_passed() {
    // Review finding: such a header made the request pass unlimited.
    let alloc = InProcessAllocator::from_yaml(RULES).expect("rules");
    let c = alloc.client("svc-x").expect("client");
    let svc = service(&RateLimitLayer::new(c, HeaderKey::new("x-tenant")));
    let mut ok = 0;
    for _ in 0..50 {
        let req = Request::builder()
            .uri("/strict")
            .header(
                "x-tenant",
                http::HeaderValue::from_bytes(b"evil\xff").unwrap(),
            )
            .body(String::new())
            .unwrap();
        let resp = svc.clone().oneshot(req).await.expect("infallible");
        ok += u32::from(resp.status() == StatusCode::OK);
    }
    assert_eq!(ok, 5, "{ok} of 50 admitted on a burst-5 rule");
}

//! End to end: Envoy's rate limit service API v3 on the agent's gRPC port,
//! with a tonic client over a real socket, and the shipped Envoy example.

mod common;

use std::time::Duration;

use common::*;
use quotalease_proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use quotalease_proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use quotalease_proto::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use quotalease_proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use quotalease_proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use quotalease_proto::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use tonic::transport::Channel;

const RULES: &str = r#"
rules:
  - id: login
    match: { tenant: "*", route: /api/login }
    rate: 5/m
    burst: 5
    fail_policy: closed
  - id: edge-orders
    domain: edge
    match: { tenant: "*", route: /api/orders }
    rate: 2/s
    burst: 2
    fail_policy: lease_only
"#;

fn descriptor(tenant: &str, route: &str, hits: Option<u64>) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: vec![
            Entry {
                key: "tenant".into(),
                value: tenant.into(),
            },
            Entry {
                key: "route".into(),
                value: route.into(),
            },
        ],
        limit: None,
        hits_addend: hits,
    }
}

fn request(domain: &str, descriptors: Vec<RateLimitDescriptor>) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.into(),
        descriptors,
        hits_addend: 0,
    }
}

async fn rls(p: &Proc) -> RateLimitServiceClient<Channel> {
    RateLimitServiceClient::connect(p.url())
        .await
        .expect("connect")
}

fn header<'a>(r: &'a RateLimitResponse, k: &str) -> Option<&'a str> {
    r.response_headers_to_add
        .iter()
        .find(|h| h.key.eq_ignore_ascii_case(k))
        .map(|h| h.value.as_str())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn should_rate_limit_over_a_real_socket() {
    let dir = tempdir("envoy");
    let rules = write_rules(&dir, RULES);
    let alloc = allocator(&rules, &dir.join("state"), None, "2s");
    wait_ok(alloc.http, "/readyz", Duration::from_secs(10));
    let a = agent("envoy-0", &alloc.url(), None, &[]);
    wait_ok(a.http, "/readyz", Duration::from_secs(10));
    let mut c = rls(&a).await;

    // Five logins pass, the sixth is over the limit with statuses and headers.
    for i in 0..5 {
        let r = c
            .should_rate_limit(request(
                "edge",
                vec![descriptor("alice", "/api/login", None)],
            ))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.overall_code, Code::Ok as i32, "login {i}");
        let st = &r.statuses[0];
        let limit = st.current_limit.as_ref().unwrap();
        assert_eq!((limit.name.as_str(), limit.requests_per_unit), ("login", 5));
        assert_eq!(limit.unit, Unit::Minute as i32);
        // SPEC §5: `limit_remaining` and the headers are one number, the
        // key's global estimate: the first login leaves 4 of 5 (the cold
        // lease holds 1 token, so a lease-only answer would say 0); never
        // more than is left (one token refills in 12 s).
        let left = st.limit_remaining;
        assert!(left + i <= 5, "login {i}: {left}");
        if i == 0 {
            assert!(left >= 3, "login 0: {left}");
        }
        assert_eq!(
            header(&r, "ratelimit-remaining"),
            Some(left.to_string().as_str())
        );
        assert_eq!(
            header(&r, "ratelimit"),
            Some(format!("\"login\";r={left};t=0").as_str())
        );
    }
    let r = c
        .should_rate_limit(request(
            "edge",
            vec![descriptor("alice", "/api/login", None)],
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.overall_code, Code::OverLimit as i32);
    assert_eq!(r.statuses[0].code, Code::OverLimit as i32);
    assert_eq!(r.statuses[0].limit_remaining, 0);
    let reset = r.statuses[0].duration_until_reset.unwrap();
    assert!(reset.seconds >= 1 && reset.seconds <= 12, "{reset:?}");
    assert_eq!(header(&r, "ratelimit-policy"), Some("\"login\";q=5;w=60"));
    assert!(header(&r, "ratelimit")
        .unwrap()
        .starts_with("\"login\";r=0;t="));
    assert_eq!(header(&r, "ratelimit-limit"), Some("5"));

    // A descriptor no rule matches is OK; overall is OVER_LIMIT if any is.
    let r = c
        .should_rate_limit(request(
            "edge",
            vec![
                descriptor("bob", "/unlimited", None),
                descriptor("alice", "/api/login", None),
            ],
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.statuses[0].code, Code::Ok as i32);
    assert_eq!(r.statuses[1].code, Code::OverLimit as i32);
    assert_eq!(r.overall_code, Code::OverLimit as i32);

    // The domain selects the namespace: edge-orders only applies to "edge".
    for _ in 0..5 {
        let r = c
            .should_rate_limit(request(
                "other",
                vec![descriptor("carol", "/api/orders", None)],
            ))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.overall_code, Code::Ok as i32);
        assert!(
            r.statuses[0].current_limit.is_none(),
            "no rule in domain other"
        );
    }
    // hits_addend is the cost: 2 of burst 2 pass, then 1 more is over.
    let r = c
        .should_rate_limit(request(
            "edge",
            vec![descriptor("carol", "/api/orders", Some(2))],
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.overall_code, Code::Ok as i32);
    let mut req = request("edge", vec![descriptor("carol", "/api/orders", None)]);
    req.hits_addend = 1;
    let r = c.should_rate_limit(req).await.unwrap().into_inner();
    assert_eq!(r.overall_code, Code::OverLimit as i32);
    // Above the burst: INVALID_ARGUMENT naming the field.
    let e = c
        .should_rate_limit(request(
            "edge",
            vec![descriptor("dave", "/api/orders", Some(3))],
        ))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(
        e.message().contains("descriptors[0].hits_addend"),
        "{}",
        e.message()
    );
    // 17 descriptors: refused.
    let many = (0..17)
        .map(|i| descriptor(&format!("t{i}"), "/x", None))
        .collect();
    let e = c
        .should_rate_limit(request("edge", many))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(e.message().contains("descriptors"), "{}", e.message());
    // An over-long tenant: INVALID_ARGUMENT naming the descriptor key.
    let e = c
        .should_rate_limit(request(
            "edge",
            vec![descriptor(&"x".repeat(300), "/api/login", None)],
        ))
        .await
        .unwrap_err();
    assert!(
        e.message().contains("descriptors[0].tenant"),
        "{}",
        e.message()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_closed_without_a_lease_is_unavailable() {
    let dir = tempdir("envoy-closed");
    let rules = write_rules(&dir, RULES);
    let dead = free_addr();
    let a = agent(
        "envoy-lonely",
        &format!("http://{dead}"),
        None,
        &["--rules", rules.to_str().unwrap()],
    );
    let mut c = rls(&a).await;
    let e = c
        .should_rate_limit(request(
            "edge",
            vec![descriptor("alice", "/api/login", None)],
        ))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable);
    // lease_only denies cleanly instead.
    let r = c
        .should_rate_limit(request(
            "edge",
            vec![descriptor("alice", "/api/orders", None)],
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.overall_code, Code::OverLimit as i32);
}

#[test]
fn shipped_envoy_example_uses_the_agent_with_failure_mode_deny() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/envoy/envoy.yaml"
    ))
    .expect("examples/envoy/envoy.yaml");
    let v: serde_yaml::Value = serde_yaml::from_str(&text).expect("valid YAML");
    let listeners = v["static_resources"]["listeners"]
        .as_sequence()
        .expect("listeners");
    let hcm = &listeners[0]["filter_chains"][0]["filters"][0]["typed_config"];
    let filters = hcm["http_filters"].as_sequence().expect("http_filters");
    let rl = filters
        .iter()
        .find(|f| f["name"] == "envoy.filters.http.ratelimit")
        .expect("a ratelimit filter");
    let cfg = &rl["typed_config"];
    assert_eq!(cfg["failure_mode_deny"], true);
    assert_eq!(cfg["rate_limit_service"]["transport_api_version"], "V3");
    let cluster_name = cfg["rate_limit_service"]["grpc_service"]["envoy_grpc"]["cluster_name"]
        .as_str()
        .expect("cluster name");
    // The named cluster exists, speaks HTTP/2 (gRPC) and points at the agent's default port.
    let clusters = v["static_resources"]["clusters"]
        .as_sequence()
        .expect("clusters");
    let cluster = clusters
        .iter()
        .find(|c| c["name"] == cluster_name)
        .expect("the rate limit cluster is defined");
    assert!(!cluster["typed_extension_protocol_options"]
        ["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]["explicit_http_config"]
        ["http2_protocol_options"]
        .is_null());
    let addr = &cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
        ["address"]["socket_address"];
    assert_eq!(addr["port_value"], 7080);
    // Descriptor keys match the agent's defaults.
    let actions = hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]["rate_limits"][0]
        ["actions"]
        .as_sequence()
        .expect("actions");
    let keys: Vec<&str> = actions
        .iter()
        .filter_map(|a| a["request_headers"]["descriptor_key"].as_str())
        .collect();
    assert_eq!(keys, ["tenant", "route"]);
}

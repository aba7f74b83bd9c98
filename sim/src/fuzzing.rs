//! The bodies of the fuzz targets (`fuzz/fuzz_targets/`), here so that the
//! ordinary suite replays the corpora through the same code
//! (`tests/fuzz_corpus.rs`). Each takes any bytes and must not panic; the
//! asserts are the targets' checks.

use prost::Message;
use quotalease_allocator::core::{AllocatorCore, CoreConfig};
use quotalease_allocator::regional::{RegionalConfig, RegionalCore};
use quotalease_model::rules::RuleSet;
use quotalease_proto::lease::LeaseBatch;

use crate::scenario::Scenario;

/// Rules files: rules or errors (never empty), and accepted rules
/// round-trip through the wire form. Returns whether they were accepted.
pub fn rules(data: &[u8]) -> bool {
    let Ok(text) = std::str::from_utf8(data) else {
        return false;
    };
    match RuleSet::parse(text, "fuzz", 1) {
        Ok(rules) => {
            let back = RuleSet::from_proto(&rules.to_proto());
            assert!(
                back.ok().map(|r| r.rules) == Some(rules.rules),
                "round trip"
            );
            true
        }
        Err(errs) => {
            assert!(!errs.is_empty());
            false
        }
    }
}

const LEASE_RULES: &str = r#"
rules:
  - id: a
    match: { tenant: "*", route: "*" }
    rate: 100/s
    burst: 20
  - id: b
    match: { tenant: "t", route: /x }
    rate: 5/m
    burst: 5
    max_keys: 3
"#;

/// Lease batches: decoded, handled twice (a duplicate) by a global core and
/// by a regional core; a grant per item or a refusal of the batch (the
/// ledgers' I2 debug assertions are on in test and fuzz builds).
pub fn lease_batch(data: &[u8]) {
    let Ok(batch) = LeaseBatch::decode(data) else {
        return;
    };
    let rules = RuleSet::parse(LEASE_RULES, "fuzz", 7).expect("rules");
    let cfg = CoreConfig {
        no_predecessor: true,
        ledger_id: 9,
        ..CoreConfig::default()
    };
    let mut core = AllocatorCore::new(cfg, rules.clone(), 1, 1, 1_000);
    let mut regional = RegionalCore::new(RegionalConfig::default(), Some(rules), 1, 1, 1_000);
    for t in [1_000u64, 2_000_000] {
        let reply = core.handle(t, &batch);
        assert!(reply.grants.len() == batch.items.len() || reply.grants.is_empty());
        let reply = regional.handle(t, &batch);
        assert!(reply.grants.len() == batch.items.len() || reply.grants.is_empty());
    }
}

/// Scenario files: a scenario or an error; an accepted one scales.
pub fn scenario(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(sc) = Scenario::parse(text, "fuzz") {
        let _ = sc.scaled(0.1);
    }
}

const GATEWAY_RULES: &str = r#"
rules:
  - id: orders
    match: { tenant: "*", route: /api/orders }
    rate: 60/m
    burst: 20
    fail_policy: lease_only
  - id: login
    match: { tenant: "*", route: /api/login }
    rate: 5/m
    burst: 5
    fail_policy: closed
  - id: open
    match: { tenant: "*", route: /open }
    rate: 100/s
    burst: 50
    fail_policy: open
  - id: watch
    match: { tenant: "*", route: /api/orders }
    rate: 1/s
    burst: 1
    shadow: true
  - id: edge
    domain: edge
    match: { tenant: "*" }
    rate: 10/s
    burst: 10
    max_keys: 100
"#;

/// A real agent over a real allocator core in one process (no network),
/// with the gateway's gRPC handlers, for the Check and ShouldRateLimit
/// fuzz bodies.
struct Gateway {
    rt: tokio::runtime::Runtime,
    check: quotalease_gateway::service::CheckService,
    envoy: quotalease_gateway::envoy::EnvoyService,
}

fn gateway() -> &'static Gateway {
    use quotalease_agent::agent::{Agent, AgentConfig};
    use quotalease_agent::transport::InProcess;
    use quotalease_allocator::server::Shared;
    static GATEWAY: std::sync::OnceLock<Gateway> = std::sync::OnceLock::new();
    GATEWAY.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("a tokio runtime");
        let rules = RuleSet::parse(GATEWAY_RULES, "fuzz", 7).expect("the fuzz rules parse");
        let cfg = CoreConfig {
            no_predecessor: true,
            ..CoreConfig::default()
        };
        let shared = Shared::new(cfg, rules.clone(), None);
        let agent = rt.block_on(async {
            let transport = InProcess::new(move |b| shared.handle(b));
            Agent::start(
                AgentConfig::default(),
                std::sync::Arc::new(transport),
                Some(rules),
            )
            .expect("the agent starts")
        });
        Gateway {
            rt,
            check: quotalease_gateway::service::CheckService::new(agent.clone()),
            envoy: quotalease_gateway::envoy::EnvoyService::new(agent, "tenant", "route"),
        }
    })
}

/// `quotalease.v1.RateLimiter/Check` requests, decoded and handled by the
/// real handler: an answer (an invalid request is a denial with reason
/// `INVALID`) or `UNAVAILABLE`, never another error.
pub fn check_request(data: &[u8]) {
    use quotalease_proto::v1::rate_limiter_server::RateLimiter;
    use quotalease_proto::v1::{CheckRequest, Reason};
    let Ok(req) = CheckRequest::decode(data) else {
        return;
    };
    let g = gateway();
    match g.rt.block_on(g.check.check(tonic::Request::new(req))) {
        Ok(resp) => {
            let resp = resp.into_inner();
            if resp.reason == Reason::Invalid as i32 {
                assert!(!resp.allowed, "an invalid request is never allowed");
            }
        }
        Err(status) => assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}"),
    }
}

/// Envoy's `ShouldRateLimit` requests, decoded and handled by the real
/// handler: a status per descriptor with `OVER_LIMIT` overall exactly when
/// one is, or `INVALID_ARGUMENT` (naming a field) / `UNAVAILABLE`.
pub fn should_rate_limit(data: &[u8]) {
    use quotalease_proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
    use quotalease_proto::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
    use quotalease_proto::envoy::service::ratelimit::v3::RateLimitRequest;
    let Ok(req) = RateLimitRequest::decode(data) else {
        return;
    };
    let descriptors = req.descriptors.len();
    let g = gateway();
    match g
        .rt
        .block_on(g.envoy.should_rate_limit(tonic::Request::new(req)))
    {
        Ok(resp) => {
            let resp = resp.into_inner();
            assert!(descriptors <= quotalease_gateway::envoy::MAX_DESCRIPTORS);
            assert_eq!(resp.statuses.len(), descriptors);
            let over = resp
                .statuses
                .iter()
                .any(|s| s.code == Code::OverLimit as i32);
            let want = if over { Code::OverLimit } else { Code::Ok };
            assert_eq!(resp.overall_code, want as i32);
        }
        Err(status) => match status.code() {
            tonic::Code::InvalidArgument => {
                assert!(
                    status.message().contains(':'),
                    "names the field: {status:?}"
                )
            }
            tonic::Code::Unavailable => {}
            other => panic!("unexpected {other:?}: {status:?}"),
        },
    }
}

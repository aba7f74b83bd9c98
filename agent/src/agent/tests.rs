//! Agent tests against a real allocator core in the same process (the
//! in-process transport skips only the network).

use super::*;
use crate::transport::InProcess;
use quotalease_allocator::core::CoreConfig;
use quotalease_allocator::server::Shared;

/// The in-process transport to `shared`.
fn in_process(shared: &Arc<Shared>) -> InProcess {
    let shared = shared.clone();
    InProcess::new(move |b| shared.handle(b))
}

const RULES: &str = r#"
rules:
  - id: wide
    match: { tenant: "*" }
    rate: 1/m
    burst: 5
    fail_policy: lease_only
  - id: narrow
    match: { tenant: "*", route: /narrow }
    rate: 1/m
    burst: 2
    fail_policy: lease_only
  - id: vip
    match: { tenant: vip, route: /narrow }
    rate: 1/m
    burst: 4
    overrides: [narrow]
  - id: watch
    match: { tenant: "*", route: /watched }
    rate: 1/m
    burst: 1
    shadow: true
"#;

const BULK: &str = r#"
rules:
  - id: bulk
    match: { tenant: "*" }
    rate: 1000/s
    burst: 1000
"#;

fn start() -> (Agent, Arc<Shared>) {
    start_with(RULES)
}

fn start_with(yaml: &str) -> (Agent, Arc<Shared>) {
    let rules = RuleSet::parse(yaml, "test", 1).expect("valid rules");
    let cfg = CoreConfig {
        no_predecessor: true,
        ..CoreConfig::default()
    };
    let shared = Shared::new(cfg, rules, None);
    let agent = Agent::start(AgentConfig::default(), Arc::new(in_process(&shared)), None)
        .expect("agent starts");
    (agent, shared)
}

fn input<'a>(tenant: &'a str, route: &'a str) -> CheckInput<'a> {
    CheckInput {
        tenant,
        route,
        cost: 1,
        request_id: "",
        domain: None,
    }
}

async fn wait_ready(a: &Agent) {
    for _ in 0..200 {
        if a.is_ready() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("agent not ready");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_rules_charge_all_or_none() {
    let (a, shared) = start();
    wait_ready(&a).await;
    // "narrow" (burst 2) and "wide" (burst 5) both match /narrow.
    for _ in 0..2 {
        let r = a.check(input("t", "/narrow")).await.unwrap();
        assert!(r.allowed);
    }
    let r = a.check(input("t", "/narrow")).await.unwrap();
    assert!(!r.allowed);
    assert_eq!(r.rule_id, "narrow");
    // The denial did not charge "wide": 3 of its 5 tokens are left.
    let mut ok = 0;
    for _ in 0..5 {
        ok += u32::from(a.check(input("t", "/other")).await.unwrap().allowed);
    }
    assert_eq!(ok, 3);
    let v = shared.with_core(|c| c.stats().shadow_violations.len());
    assert_eq!(v, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overrides_replace_a_rule_and_shadow_rules_never_deny() {
    let (a, _) = start();
    wait_ready(&a).await;
    // vip overrides narrow: 4 pass (wide allows 5).
    let mut ok = 0;
    for _ in 0..6 {
        ok += u32::from(a.check(input("vip", "/narrow")).await.unwrap().allowed);
    }
    assert_eq!(ok, 4);
    // watch is shadow with burst 1: never denies, reports SHADOW_OVER_LIMIT
    // once it is dry; wide still limits to 5.
    let mut reasons = Vec::new();
    let mut allowed = 0;
    for _ in 0..6 {
        let r = a.check(input("w", "/watched")).await.unwrap();
        allowed += u32::from(r.allowed);
        reasons.push(r.reason);
        tokio::time::sleep(Duration::from_millis(80)).await;
    }
    assert_eq!(allowed, 5, "{reasons:?}");
    assert!(
        reasons.contains(&(Reason::ShadowOverLimit as i32)),
        "{reasons:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fast_path_needs_a_lease_and_charges_nothing_without_one() {
    let (a, _) = start_with(BULK);
    wait_ready(&a).await;
    let i = input("f", "/other");
    assert_eq!(a.check_fast(&i), None, "cold key: no lease yet");
    assert!(a.check(i).await.unwrap().allowed);
    // Once a lease is held the fast path admits, naming the rule charged.
    let mut fast = None;
    for _ in 0..100 {
        fast = a.check_fast(&i);
        if fast.is_some() {
            break;
        }
        let _ = a.check(i).await;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let fast = fast.expect("the fast path admits once a lease is held");
    let rules = a.rules().unwrap();
    assert_eq!(rules.rules[fast.rule_index.unwrap()].id, "bulk");
    assert_eq!(fast.reason, Reason::Ok);
}

#[test]
fn keys_are_unambiguous() {
    use std::hash::BuildHasher;
    let h = foldhash::fast::FixedState::with_seed(7);
    let a = Lookup(KeyRef::new("r", "ab", "c"));
    let b = Lookup(KeyRef::new("r", "a", "bc"));
    assert_ne!(h.hash_one(a), h.hash_one(b));
    assert!(!papaya::Equivalent::equivalent(&a, &b.0.to_key_id()));
    assert!(papaya::Equivalent::equivalent(&a, &a.0.to_key_id()));
    assert_eq!(h.hash_one(a), h.hash_one(a.0.to_key_id()));
}

#[test]
fn validation_names_the_field() {
    let bad = |tenant: &str, route: &str, request_id: &str| {
        validate(&CheckInput {
            tenant,
            route,
            cost: 0,
            request_id,
            domain: None,
        })
    };
    assert_eq!(bad("t", "r", ""), Ok(1), "cost 0 means 1");
    let long = "y".repeat(257);
    assert!(matches!(
        bad("", "r", ""),
        Err(CheckError::Invalid {
            field: "tenant_id",
            ..
        })
    ));
    assert!(matches!(
        bad(&long, "r", ""),
        Err(CheckError::Invalid {
            field: "tenant_id",
            ..
        })
    ));
    assert!(matches!(
        bad("t", &long, ""),
        Err(CheckError::Invalid {
            field: "route_id",
            ..
        })
    ));
    assert!(matches!(
        bad("t", "r", &long),
        Err(CheckError::Invalid {
            field: "request_id",
            ..
        })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denial_names_the_rule_with_the_largest_retry() {
    let yaml = r#"
rules:
  - id: per-second
    match: { tenant: "*", route: /both }
    rate: 1/s
    burst: 1
  - id: per-minute
    match: { tenant: "*" }
    rate: 1/m
    burst: 1
"#;
    let (a, _) = start_with(yaml);
    wait_ready(&a).await;
    assert!(a.check(input("t", "/both")).await.unwrap().allowed);
    let r = a.check(input("t", "/both")).await.unwrap();
    assert!(!r.allowed);
    assert_eq!(r.rule_id, "per-minute", "{r:?}");
    assert!(
        r.retry_after_ms > 50_000 && r.retry_after_ms <= 60_000,
        "{r:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_behind_the_allocators_incarnation_record_catches_up() {
    use quotalease_proto::lease::{LeaseBatch, RequestHeader};
    let rules = RuleSet::parse(BULK, "test", 1).expect("valid rules");
    let shared = Shared::new(
        CoreConfig {
            no_predecessor: true,
            ..CoreConfig::default()
        },
        rules,
        None,
    );
    // The allocator saw this agent id with an incarnation from the future
    // (the agent's clock stepped back across a restart).
    let future = u64::MAX / 2;
    shared.handle(&LeaseBatch {
        header: Some(RequestHeader {
            agent_id: "stepped".into(),
            incarnation: future,
            seq: 1,
            protocol_version: quotalease_proto::PROTOCOL_VERSION,
            rules_version: 0,
        }),
        items: vec![],
        ttl_ms: 0,
    });
    let cfg = AgentConfig {
        agent_id: "stepped".into(),
        ..AgentConfig::default()
    };
    let a = Agent::start(cfg, Arc::new(in_process(&shared)), None).expect("agent starts");
    wait_ready(&a).await;
    assert!(a.inner.incarnation.load(Ordering::Acquire) > future);
    assert!(a.check(input("t", "/x")).await.unwrap().allowed);
}

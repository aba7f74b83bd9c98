//! The agent library against a real allocator core in the same process
//! (the in-process transport skips only the network), through the agent's
//! public API: checks, idempotent retries, fail policies, the core's
//! sans-IO face, identities and replies. (Moved out of the agent crate so
//! that it needs the allocator not even as a dev-dependency.)

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use quotalease_agent::agent::{Agent, AgentConfig, CheckError, CheckInput, Request, Step};
use quotalease_agent::renewal::PlanConfig;
use quotalease_agent::transport::{InProcess, LeaseFuture, Transport};
use quotalease_allocator::core::CoreConfig;
use quotalease_allocator::server::Shared;
use quotalease_model::clock::ClockSource;
use quotalease_model::rules::RuleSet;
use quotalease_proto::lease::{GrantStatus, LeaseBatch};
use quotalease_proto::v1::Reason;

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
    start_configured(yaml, AgentConfig::default())
}

/// An allocator with `yaml` (no predecessor: buckets start full) and an
/// agent with `cfg` in front of it.
fn start_configured(yaml: &str, cfg: AgentConfig) -> (Agent, Arc<Shared>) {
    let rules = RuleSet::parse(yaml, "test", 1).expect("valid rules");
    let core = CoreConfig {
        no_predecessor: true,
        ..CoreConfig::default()
    };
    let shared = Shared::new(core, rules, None);
    let agent = Agent::start(cfg, Arc::new(in_process(&shared)), None).expect("agent starts");
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
            instance: 0,
            ledger_id: 0,
            run_id: 0,
            record_seq: 0,
            cluster: String::new(),
            ledger_cluster: String::new(),
        }),
        items: vec![],
        ttl_ms: 0,
        shard: 0,
    });
    // The same identity (id and instance 0, as a protocol-1 agent sends)
    // catches up with the record.
    let cfg = AgentConfig {
        agent_id: "stepped".into(),
        instance: Some(0),
        ..AgentConfig::default()
    };
    let a = Agent::start(cfg, Arc::new(in_process(&shared)), None).expect("agent starts");
    wait_ready(&a).await;
    assert!(a.incarnation() > future);
    assert!(a.check(input("t", "/x")).await.unwrap().allowed);
    // A new process draws a new instance: it is a holder of its own and
    // needs no catching up.
    let cfg = AgentConfig {
        agent_id: "stepped".into(),
        ..AgentConfig::default()
    };
    let b = Agent::start(cfg, Arc::new(in_process(&shared)), None).expect("agent starts");
    wait_ready(&b).await;
    assert!(b.incarnation() < future);
    assert!(b.check(input("t", "/x")).await.unwrap().allowed);
}

/// The real allocator in process, behind a gate a test can slow down,
/// cut or make panic.
struct Gate {
    inner: InProcess,
    delay_ms: AtomicU64,
    down: AtomicBool,
    panic: AtomicBool,
}

impl Gate {
    fn new(shared: Arc<Shared>) -> Arc<Self> {
        Arc::new(Self {
            inner: in_process(&shared),
            delay_ms: AtomicU64::new(0),
            down: AtomicBool::new(false),
            panic: AtomicBool::new(false),
        })
    }
}

impl Transport for Gate {
    fn lease(&self, batch: LeaseBatch) -> LeaseFuture<'_> {
        Box::pin(async move {
            if self.panic.load(Ordering::Acquire) {
                panic!("test transport panics");
            }
            let d = self.delay_ms.load(Ordering::Acquire);
            if d > 0 {
                tokio::time::sleep(Duration::from_millis(d)).await;
            }
            if self.down.load(Ordering::Acquire) {
                return Err("test: allocator down".into());
            }
            self.inner.lease(batch).await
        })
    }
}

fn gated(yaml: &str, bootstrap: bool) -> (Agent, Arc<Gate>) {
    let rules = RuleSet::parse(yaml, "test", 1).expect("valid rules");
    let shared = Shared::new(
        CoreConfig {
            no_predecessor: true,
            ..CoreConfig::default()
        },
        rules.clone(),
        None,
    );
    let gate = Gate::new(shared);
    let agent = Agent::start(
        AgentConfig::default(),
        gate.clone(),
        bootstrap.then_some(rules),
    )
    .expect("agent starts");
    (agent, gate)
}

const SCARCE: &str = r#"
rules:
  - id: scarce
    match: { tenant: "*" }
    rate: 1/h
    burst: 2
    fail_policy: closed
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_of_a_request_still_waiting_is_answered_once_and_charged_once() {
    let (a, gate) = gated(SCARCE, false);
    wait_ready(&a).await;
    // The cold fetch takes a while: the gateway's retry arrives meanwhile.
    gate.delay_ms.store(100, Ordering::Release);
    let req = |id: &'static str| CheckInput {
        request_id: id,
        ..input("t", "/x")
    };
    let (first, retry) = tokio::join!(a.check(req("r1")), async {
        tokio::time::sleep(Duration::from_millis(20)).await;
        a.check(req("r1")).await
    });
    let (first, retry) = (first.unwrap(), retry.unwrap());
    assert!(first.allowed, "{first:?}");
    assert_eq!(first, retry, "the retry gets the first answer");
    assert_eq!(a.metrics().replays.get(), 1);
    // r1 was charged once: one of the two tokens is left for r2.
    let other = a.check(req("r2")).await.unwrap();
    assert!(
        other.allowed,
        "r1 must not have been charged twice: {other:?}"
    );
    let third = a.check(req("r3")).await.unwrap();
    assert!(!third.allowed, "burst 2: {third:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unavailable_answer_is_not_replayed_after_the_allocator_is_back() {
    let (a, gate) = gated(SCARCE, true);
    gate.down.store(true, Ordering::Release);
    let req = CheckInput {
        request_id: "r1",
        ..input("t", "/x")
    };
    let down = a.check(req).await;
    assert!(matches!(down, Err(CheckError::Unavailable(_))), "{down:?}");
    gate.down.store(false, Ordering::Release);
    wait_ready(&a).await;
    let back = a.check(req).await.expect("an answer");
    assert!(back.allowed, "decided afresh, not the cached 503: {back:?}");
    assert_eq!(a.metrics().replays.get(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_task_that_dies_makes_the_agent_not_ready() {
    let (a, gate) = gated(BULK, true);
    gate.panic.store(true, Ordering::Release);
    for _ in 0..200 {
        if a.metrics().renewal_task_failures.get() > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(a.metrics().renewal_task_failures.get() >= 1);
    gate.panic.store(false, Ordering::Release);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !a.is_ready(),
        "an agent whose renewal side died is not ready"
    );
    let text = a.metrics().render(0, 1, a.is_ready());
    let failures = a.metrics().renewal_task_failures.get();
    assert!(failures >= 1);
    assert!(text.contains(&format!(
        "quotalease_agent_renewal_task_failures_total {failures}"
    )));
}

const OPEN: &str = r#"
rules:
  - id: open
    match: { tenant: "*" }
    rate: 100/s
    burst: 100
    fail_policy: open
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_open_checks_of_new_keys_race_the_renewal_side_without_deadlock() {
    // Before, the first fail-open check of a new key during an outage took
    // the emergency lock and then the renewal state's, while the renewal
    // tick took them in the other order. Now the slow path has one lock
    // (the core's); this races the two for a while and must finish.
    let (a, gate) = gated(OPEN, true);
    gate.down.store(true, Ordering::Release);
    let tasks: Vec<_> = (0..4)
        .map(|w| {
            let a = a.clone();
            tokio::spawn(async move {
                let mut allowed = 0;
                for i in 0..300 {
                    let tenant = format!("w{w}-t{i}");
                    if a.check(input(&tenant, "/x")).await.unwrap().allowed {
                        allowed += 1;
                    }
                }
                allowed
            })
        })
        .collect();
    let all = async {
        let mut n = 0;
        for t in tasks {
            n += t.await.unwrap();
        }
        n
    };
    let allowed = tokio::time::timeout(Duration::from_secs(60), all)
        .await
        .expect("no deadlock between fail-open checks and the renewal side");
    assert_eq!(allowed, 1200, "every new key opens its emergency bucket");
    assert!(a.metrics().failure_mode_allowed.get() >= 1200);
}

#[test]
fn bad_settings_are_errors_naming_the_setting() {
    let zero = AgentConfig {
        plan: PlanConfig {
            renew_interval: Duration::ZERO,
            ..PlanConfig::default()
        },
        ..AgentConfig::default()
    };
    let e = Agent::new(zero, None, None).expect_err("zero renew interval");
    assert!(e.to_string().contains("--renew-interval"), "{e}");
    let absurd = AgentConfig {
        fetch_timeout: Duration::from_secs(u64::MAX),
        ..AgentConfig::default()
    };
    let e = Agent::new(absurd, None, None).expect_err("absurd fetch timeout");
    assert!(e.to_string().contains("--fetch-timeout"), "{e}");
}

/// A sans-IO agent on a manual clock, a real allocator core, the batch a
/// cold check sends, and that check, waiting.
fn cold_batch() -> (
    Agent,
    quotalease_allocator::core::AllocatorCore,
    LeaseBatch,
    u64,
    Request<'static>,
) {
    let rules = RuleSet::parse(BULK, "test", 1).expect("valid rules");
    let core = quotalease_allocator::core::AllocatorCore::new(
        CoreConfig {
            no_predecessor: true,
            ..CoreConfig::default()
        },
        rules.clone(),
        1,
        1,
        0,
    );
    let clock = quotalease_model::clock::ManualClock::new(1_000_000_000);
    let cfg = AgentConfig {
        clock: ClockSource::Manual(clock),
        instance: Some(42),
        ..AgentConfig::default()
    };
    let a = Agent::new(cfg, None, Some(rules)).expect("agent");
    let t = a.now();
    let mut req = a.request(input("t", "/x")).expect("valid");
    assert!(matches!(a.step(&mut req, t), Step::Wait(_)));
    let batch = next_batch(&a, t).expect("a renewal for the waiting key");
    assert_eq!(batch.header.as_ref().unwrap().instance, 42);
    (a, core, batch, t, req)
}

/// The first step at `t` of a request on tenant "t", route "/x".
fn step_at(a: &Agent, t: u64) -> Step {
    let mut req = a.request(input("t", "/x")).expect("valid");
    a.step(&mut req, t)
}

/// Pump the core at `t` as a driver would: the batch it sends, if any.
fn next_batch(a: &Agent, t: u64) -> Option<LeaseBatch> {
    let mut core = a.core();
    if core.poll_timeout().is_some_and(|at| at <= t) {
        core.handle_timeout(t);
    }
    core.poll_transmit().map(|tx| tx.batch)
}

#[test]
fn a_reply_that_does_not_answer_the_request_is_ignored() {
    // Grants for other items (more grants than items)...
    let (a, mut core, batch, t, _) = cold_batch();
    let seq = batch.header.as_ref().unwrap().seq;
    let mut reply = core.handle(t, &batch);
    assert_eq!(reply.grants[0].status, GrantStatus::Granted as i32);
    reply.grants.push(reply.grants[0].clone());
    a.core().handle_reply(t + 1, seq, reply);
    assert_eq!(a.metrics().mismatched_replies.get(), 1);
    assert_eq!(a.check_fast(&input("t", "/x")), None, "nothing installed");
    // ...or a reply to other content under the same seq (digest).
    let (a, mut core, batch, t, _) = cold_batch();
    let seq = batch.header.as_ref().unwrap().seq;
    let mut reply = core.handle(t, &batch);
    reply.request_digest ^= 1;
    a.core().handle_reply(t + 1, seq, reply);
    assert_eq!(a.metrics().mismatched_replies.get(), 1);
    assert_eq!(a.check_fast(&input("t", "/x")), None, "nothing installed");
    // The batch was given up on: the request parks again and the key is
    // asked for in a new batch.
    assert!(matches!(step_at(&a, t + 2), Step::Wait(_)));
    let again = next_batch(&a, t + 2).expect("asked again");
    assert!(again.header.as_ref().unwrap().seq > seq);
    // And a matching reply is applied: the waiting check's next round is
    // answered.
    let (a, mut core, batch, t, mut req) = cold_batch();
    let seq = batch.header.as_ref().unwrap().seq;
    let reply = core.handle(t, &batch);
    a.core().handle_reply(t + 1, seq, reply);
    assert_eq!(a.metrics().mismatched_replies.get(), 0);
    assert!(!matches!(a.step(&mut req, t + 2), Step::Wait(_)));
}

const TWO_RULES: &str = r#"
rules:
  - id: wide
    match: { tenant: "*" }
    rate: 1/m
    burst: 50
    fail_policy: lease_only
  - id: narrow
    match: { tenant: "*", route: /narrow }
    rate: 1/m
    burst: 3
    fail_policy: lease_only
"#;

/// Check through the slow path until the key's fast path admits.
async fn warm(a: &Agent, i: CheckInput<'_>) {
    for _ in 0..200 {
        if a.check_fast(&i).is_some() {
            return;
        }
        let _ = a.check(i).await;
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    panic!("the fast path never admitted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_handles_admit_from_held_leases_and_go_stale_on_rule_changes() {
    let (a, shared) = start_with(BULK);
    wait_ready(&a).await;
    let i = input("h", "/x");
    warm(&a, i).await;
    let h = a.resolve(&i).expect("a handle");
    let mut fast = 0;
    for _ in 0..10 {
        if a.check_handle(&h, 1, a.now()).is_some() {
            fast += 1;
        }
    }
    assert!(fast > 0, "a warm key admits through its handle");
    // A cost above the burst is the slow path's (INVALID there).
    assert!(a.check_handle(&h, 1001, a.now()).is_none());
    // The supplied-time fast path agrees with the clock-reading one.
    assert!(a.check_fast_at(&i, a.now()).is_some());
    // New rules: the handle is stale; check_fast sees the new version.
    let mut v2 = RuleSet::parse(BULK, "v2", 2).expect("valid");
    v2.version = 2;
    shared.with_core(|c| c.set_rules(v2, 0));
    let b = input("z", "/x");
    for _ in 0..200 {
        if a.check_fast(&b).is_some_and(|f| f.rule_version == 2) {
            break;
        }
        let _ = a.check(b).await;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(a.check_fast(&b).map(|f| f.rule_version), Some(2));
    assert!(
        a.check_handle(&h, 1, a.now()).is_none(),
        "stale after a rule change"
    );
    let h2 = a.resolve(&b).unwrap();
    let mut fast = 0;
    for _ in 0..10 {
        fast += usize::from(a.check_handle(&h2, 1, a.now()).is_some());
    }
    assert!(fast > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handles_and_the_slow_path_charge_all_or_none() {
    let (a, _shared) = start_with(TWO_RULES);
    wait_ready(&a).await;
    let i = input("h", "/narrow");
    let h = a.resolve(&i).expect("a handle");
    // Until narrow (burst 3 at 1/m) runs out: exactly 3, through the
    // handle when both leases hold tokens, else the slow path.
    let mut narrow = 0;
    for _ in 0..50 {
        if a.check_handle(&h, 1, a.now()).is_some() || a.check(i).await.unwrap().allowed {
            narrow += 1;
        } else {
            break;
        }
    }
    assert_eq!(narrow, 3);
    // `wide` (burst 50) was charged exactly once per admission: a route
    // charged only to it gets the other 47, so no refund went missing and
    // no denied request charged it.
    let other = input("h", "/other");
    let mut wide = 0;
    for _ in 0..100 {
        if a.check(other).await.unwrap().allowed {
            wide += 1;
        } else {
            break;
        }
    }
    assert_eq!(wide, 47);
}

const PER_TENANT_4: &str = r#"
rules:
  - id: per-tenant
    match: { tenant: "*" }
    rate: 1/m
    burst: 4
    fail_policy: lease_only
"#;

/// `check_fast` resolves a request shape once per thread and caches it
/// (agent/src/shapes.rs, 512 entries a thread, direct-mapped). With far
/// more shapes than entries, interleaved so that they keep evicting each
/// other, every admission still charges its own key: each of 1 500
/// tenants of a burst-4 rule (1/m: no refill during the test) is admitted
/// exactly 4 times, through the fast path or the slow one. The agent
/// leases the rule's keys ahead (`PlanConfig::central` off; served
/// centrally, a key holds no tokens for the fast path to take).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_shapes_charge_their_own_key_under_collisions() {
    const TENANTS: usize = 1_500;
    let mut cfg = AgentConfig::default();
    cfg.plan.central = false;
    let (a, _shared) = start_configured(PER_TENANT_4, cfg);
    wait_ready(&a).await;
    let a = Arc::new(a);
    let names: Arc<Vec<String>> = Arc::new((0..TENANTS).map(|i| format!("t-{i:05}")).collect());
    let fast = Arc::new(AtomicU64::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for part in 0..50 {
        let (a, names, fast) = (a.clone(), names.clone(), fast.clone());
        tasks.spawn(async move {
            let mine: Vec<usize> = (part..TENANTS).step_by(50).collect();
            let mut admitted = vec![0u32; mine.len()];
            let mut open: Vec<usize> = (0..mine.len()).collect();
            while !open.is_empty() {
                let mut still = Vec::new();
                for &j in &open {
                    let i = input(&names[mine[j]], "/x");
                    let allowed = if a.check_fast(&i).is_some() {
                        fast.fetch_add(1, Ordering::Relaxed);
                        true
                    } else {
                        a.check(i).await.expect("valid input").allowed
                    };
                    if allowed {
                        admitted[j] += 1;
                        still.push(j);
                    }
                    assert!(
                        admitted[j] <= 4,
                        "{} admitted {}",
                        names[mine[j]],
                        admitted[j]
                    );
                }
                open = still;
            }
            for (j, n) in admitted.iter().enumerate() {
                assert_eq!(*n, 4, "{} admitted {n} of its burst 4", names[mine[j]]);
            }
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.expect("a checking task panicked");
    }
    assert!(
        fast.load(Ordering::Relaxed) > 0,
        "some admissions came from the fast path (else the cache was not exercised)"
    );
}

/// A key the agent forgets (idle release) has its lease word retired; a
/// thread that cached its shape must not charge the retired word, and must
/// find the key's new slot once the slow path opens it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_shapes_follow_a_forgotten_key_to_its_new_slot() {
    let cfg = AgentConfig {
        plan: PlanConfig {
            idle_release: Duration::from_millis(200),
            ..PlanConfig::default()
        },
        ..AgentConfig::default()
    };
    let (a, _shared) = start_configured(BULK, cfg);
    wait_ready(&a).await;
    let rt = tokio::runtime::Handle::current();
    // One OS thread does every check, so one thread's shape cache is
    // followed through the whole story.
    std::thread::spawn(move || {
        let i = input("forgotten", "/x");
        let fast_after_slow = |what: &str| {
            for _ in 0..200 {
                if a.check_fast(&i).is_some() {
                    return;
                }
                assert!(rt.block_on(a.check(i)).expect("valid").allowed);
                std::thread::sleep(Duration::from_millis(2));
            }
            panic!("{what}: the fast path never admitted");
        };
        fast_after_slow("first open");
        assert_eq!(a.key_count(), 1);
        // Idle: released and forgotten (its word retired).
        for _ in 0..500 {
            if a.key_count() == 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(a.key_count(), 0, "the idle key was not forgotten");
        assert!(
            a.check_fast(&i).is_none(),
            "the cached shape charged a forgotten key's retired word"
        );
        fast_after_slow("after the key was forgotten");
        assert_eq!(a.key_count(), 1);
    })
    .join()
    .expect("the checking thread panicked");
}

/// Cold keys on 3 OS threads (fast path, then the slow path on a miss)
/// while the agent forgets idle keys (80 ms idle release): the table grows
/// to hundreds of keys, forgets them, shrinks and re-creates them, so
/// removals, retirements and resizes happen under the readers' lookups.
/// No thread crashes, every answer names the one rule, and no tenant is
/// admitted more than its own bucket holds (3 tokens; the refill over the
/// test is far below one): a lookup that found another key's slot would
/// charge another tenant's lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cold_keys_churn_through_the_table_while_idle_keys_are_forgotten() {
    const PER_TENANT: &str = r#"
rules:
  - id: per
    match: { tenant: "*" }
    rate: 1/h
    burst: 3
    fail_policy: lease_only
"#;
    const WIDE: usize = 600;
    const NARROW: usize = 8;
    const PHASES: usize = 6;
    const CHECKS: usize = 600;
    let cfg = AgentConfig {
        plan: PlanConfig {
            renew_interval: Duration::from_millis(10),
            idle_release: Duration::from_millis(80),
            ..PlanConfig::default()
        },
        ..AgentConfig::default()
    };
    let (a, _shared) = start_configured(PER_TENANT, cfg);
    wait_ready(&a).await;
    let a = Arc::new(a);
    let tenants = PHASES * WIDE;
    let admitted: Arc<Vec<AtomicU64>> = Arc::new((0..tenants).map(|_| AtomicU64::new(0)).collect());
    let rt = tokio::runtime::Handle::current();
    let threads: Vec<_> = (0..3u64)
        .map(|n| {
            let (a, admitted, rt) = (a.clone(), admitted.clone(), rt.clone());
            std::thread::spawn(move || {
                let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (n + 1);
                let (mut most, mut fewest_after_most) = (0usize, usize::MAX);
                for phase in 0..PHASES {
                    // Wide phases open many keys; narrow ones let most of
                    // them go idle (forgotten: the table shrinks).
                    let width = if phase % 2 == 0 { WIDE } else { NARROW };
                    for c in 0..CHECKS {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let t = phase * WIDE + (x % width as u64) as usize;
                        let tenant = format!("tenant-{t}");
                        let i = input(&tenant, "/x");
                        let allowed = match a.check_fast(&i) {
                            Some(_) => true,
                            None => {
                                let r = rt.block_on(a.check(i)).expect("valid");
                                assert!(r.allowed || r.rule_id == "per", "{r:?}");
                                r.allowed
                            }
                        };
                        if allowed {
                            let got = admitted[t].fetch_add(1, Ordering::Relaxed) + 1;
                            assert!(got <= 3, "{tenant} admitted {got} times (burst 3)");
                        }
                        if c % 40 == 39 {
                            // A narrow phase lasts well over the idle
                            // release (15 pauses of 15 ms).
                            let pause = if width == NARROW { 15 } else { 2 };
                            std::thread::sleep(Duration::from_millis(pause));
                            let k = a.key_count();
                            if k > most {
                                (most, fewest_after_most) = (k, usize::MAX);
                            }
                            fewest_after_most = fewest_after_most.min(k);
                        }
                    }
                }
                (most, fewest_after_most)
            })
        })
        .collect();
    let mut forgot_under_load = false;
    for t in threads {
        let (most, fewest) = t.join().expect("a checking thread panicked");
        assert!(most > NARROW, "the wide phases opened keys: {most}");
        forgot_under_load |= fewest < most;
    }
    assert!(forgot_under_load, "no key was forgotten while checks ran");
    // Every key goes idle, and is forgotten.
    for _ in 0..500 {
        if a.key_count() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(a.key_count(), 0, "idle keys were not all forgotten");
    let total: u64 = admitted.iter().map(|c| c.load(Ordering::Relaxed)).sum();
    assert!(total > 0);
}

const TWENTY: &str = r#"
rules:
  - id: twenty
    match: { tenant: "*" }
    rate: 20/m
    burst: 20
"#;

/// SPEC §5 "What the headers say": `remaining` is the key's global
/// remaining tokens as the agent estimates them, not its lease's few
/// tokens (a cold key's first lease is `burst / 16` = 1 token here), and
/// 0 on a denial.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remaining_is_the_keys_global_estimate_and_zero_on_a_denial() {
    let (a, _shared) = start_with(TWENTY);
    wait_ready(&a).await;
    let i = input("fresh", "/x");
    let mut remaining = Vec::new();
    for _ in 0..2 {
        let r = a.check(i).await.unwrap();
        assert!(r.allowed, "{r:?}");
        remaining.push(r.remaining);
    }
    // 2 of 20 spent: 18 left (a lease-only answer would say 0).
    assert!((15..=18).contains(&remaining[1]), "{remaining:?}");
    assert!(remaining[0] >= remaining[1], "{remaining:?}");
    // The fast path answers the same estimate.
    if let Some(f) = a.check_fast(&i) {
        assert!((14..=17).contains(&f.remaining), "{f:?}");
    }
    // Spend the rest: every answer stays within the burst and never
    // counts more than is left; the 429 says 0.
    let mut admitted = 2 + u64::from(a.check_fast(&i).is_some());
    let denied = loop {
        let r = a.check(i).await.unwrap();
        if !r.allowed {
            break r;
        }
        admitted += 1;
        assert!(admitted <= 21, "a 20-token burst admitted {admitted}");
        // At most one token refilled in the test's few seconds (20/m).
        assert!(r.remaining + admitted <= 21, "{admitted}: {r:?}");
    };
    assert_eq!(denied.reason, Reason::OverLimit as i32, "{denied:?}");
    assert_eq!(denied.remaining, 0, "{denied:?}");
}

/// SPEC §5: after another agent has spent 15 of a fresh key's 20, the
/// remaining here, after this agent's next renewal, is at most 5 plus
/// what refills in one renew interval.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_agents_spending_shows_in_remaining_after_a_renewal() {
    let rules = RuleSet::parse(TWENTY, "test", 1).expect("valid rules");
    let core = CoreConfig {
        no_predecessor: true,
        ..CoreConfig::default()
    };
    let shared = Shared::new(core, rules, None);
    let cfg = |id: &str| AgentConfig {
        agent_id: id.into(),
        ..AgentConfig::default()
    };
    let renew_interval = cfg("x").plan.renew_interval;
    let a = Agent::start(cfg("a"), Arc::new(in_process(&shared)), None).expect("agent a");
    let b = Agent::start(cfg("b"), Arc::new(in_process(&shared)), None).expect("agent b");
    wait_ready(&a).await;
    wait_ready(&b).await;
    let i = input("shared", "/x");
    // B holds the key first: nearly all of it is left.
    let r = b.check(i).await.unwrap();
    assert!(r.allowed && (15..=19).contains(&r.remaining), "{r:?}");
    for n in 0..15 {
        let r = a.check(i).await.unwrap();
        assert!(r.allowed, "a's check {n}: {r:?}");
    }
    // B's next check may still be answered from the lease (and bucket
    // report) it got before A spent; it makes B renew (its lease is used
    // up). Its answer after that renewal knows of A's 15.
    let _ = b.check(i).await.unwrap();
    tokio::time::sleep(4 * renew_interval).await;
    let r = b.check(i).await.unwrap();
    // 20/m over one renew interval, rounded up.
    let refill = (20 * renew_interval.as_millis() as u64).div_ceil(60_000);
    assert!(r.remaining <= 5 + refill, "{r:?}");
    if !r.allowed {
        assert_eq!(r.remaining, 0, "{r:?}");
    }
}

const BURSTY: &str = r#"
rules:
  - id: orders
    match: { tenant: "*", route: /api/orders }
    rate: 10/s
    burst: 20
    fail_policy: closed
"#;

/// A fresh key's whole burst is usable at once by one agent: 20 checks in
/// a quick sequence of a 10/s burst 20 rule all pass (under a real Envoy
/// 8 passed: the allocator destroyed 12 tokens that no longer fitted
/// under the counts of the agent's growing rate versions).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_keys_whole_burst_passes_in_a_quick_sequence() {
    let (a, shared) = start_with(BURSTY);
    wait_ready(&a).await;
    let mut seen = Vec::new();
    for _ in 0..20 {
        seen.push(a.check(input("t", "/api/orders")).await.unwrap().allowed);
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let shadow = shared.with_core(|c| c.stats().shadow_violations.len());
    assert_eq!(shadow, 0);
    assert!(seen.iter().all(|&x| x), "{seen:?}");
}

/// SPEC §4: `Check` on a rule that limits requests in flight only is
/// invalid (a permit is acquired, not checked), naming the rule; a rule
/// with both a rate and a concurrency charges its rate through a check;
/// requests no rule selects still pass as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_check_on_a_concurrency_only_rule_is_invalid() {
    let yaml = r#"
rules:
  - id: rate
    match: { tenant: "*", route: /rate }
    rate: 1/m
    burst: 2
  - id: model-calls
    match: { tenant: "*", route: /gen }
    concurrency: 4
  - id: both
    match: { tenant: "*", route: /both }
    rate: 1/m
    burst: 1
    concurrency: 2
"#;
    let rules = RuleSet::parse(yaml, "test", 1).expect("valid rules");
    let core = CoreConfig {
        no_predecessor: true,
        ..CoreConfig::default()
    };
    let shared = Shared::new(core, rules, None);
    let a = Agent::start(AgentConfig::default(), Arc::new(in_process(&shared)), None)
        .expect("agent starts");
    wait_ready(&a).await;
    for _ in 0..2 {
        match a.check(input("t", "/gen")).await {
            Err(CheckError::Invalid { field, reason }) => {
                assert_eq!(field, "route_id");
                assert!(reason.contains("rule model-calls"), "{reason}");
                assert!(reason.contains("acquire a permit"), "{reason}");
            }
            other => panic!("expected invalid, got {other:?}"),
        }
        assert!(a.check_fast(&input("t", "/gen")).is_none());
    }
    let r = a.check(input("t", "/both")).await.unwrap();
    assert!(r.allowed && r.rule_id == "both", "{r:?}");
    let r = a.check(input("t", "/both")).await.unwrap();
    assert!(
        !r.allowed,
        "the rate of a rule with both still limits: {r:?}"
    );
    let r = a.check(input("t", "/none")).await.unwrap();
    assert!(r.allowed && r.rule_id.is_empty(), "{r:?}");
    let r = a.check(input("t", "/rate")).await.unwrap();
    assert!(r.allowed && r.rule_id == "rate", "{r:?}");
}

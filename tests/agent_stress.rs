//! Multi-threaded stress of one agent against a real in-process allocator:
//! the concurrency the single-threaded simulator cannot exercise. Tokio
//! tasks on a 2-worker runtime plus OS threads on the fast path hammer a
//! few hot keys while the driver renews every 2 ms (cutting generations
//! and installing leases under the checks' CASes):
//!
//! * `multi_rule_refunds_keep_exact_accounting`: every request matches
//!   three rules and the last (tightest) one often cannot pay, so earlier
//!   charges are refunded — into the generation they came from, or dropped
//!   after a cut or an install;
//! * `fail_open_under_a_flapping_allocator_stays_bounded`: the transport
//!   drops calls or replies part of the time and goes down for stretches,
//!   so outages open and close emergency buckets while checks run.
//!
//! Checked exactly, per key: the admission log equals the admitted answers
//! (every rule of an admitted request charged once, a denied one none);
//! tokens admitted from leases <= fresh tokens the allocator granted this
//! agent (summed from its replies, and those sums equal the allocator's own
//! `tokens_granted`); I1 over every window (no outage); with outages,
//! admitted <= granted + what the emergency buckets opened could give.
//! A request id sent twice at once is answered once (both answers equal)
//! and charged once. Fixed iteration counts; no timing assertions.

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use quotalease_agent::agent::{Agent, AgentConfig, CheckError, CheckInput, EmergencyConfig};
use quotalease_agent::renewal::PlanConfig;
use quotalease_agent::transport::{LeaseFuture, Transport};
use quotalease_allocator::core::CoreConfig;
use quotalease_allocator::server::Shared;
use quotalease_model::key::KeyId;
use quotalease_model::rules::{Rate, RuleSet};
use quotalease_proto::lease::{GrantStatus, ItemKind, LeaseBatch};
use quotalease_proto::v1::{CheckResponse, Reason};

type Key = (String, String, String);
/// Lease id -> (key, tokens granted), and lease id -> spent reported.
type LeaseBooks = (BTreeMap<u64, (Key, u64)>, BTreeMap<u64, u64>);

/// The real allocator behind a transport that counts what it grants and,
/// when `flaky`, loses calls and replies and goes down for stretches.
struct Ledgered {
    shared: Arc<Shared>,
    flaky: bool,
    calls: AtomicU64,
    failures: AtomicU64,
    /// Fresh tokens (`tokens - carried`) granted per key, each batch
    /// counted once (a retry under the same seq is answered from the
    /// allocator's cache and grants nothing new).
    fresh: Mutex<(HashSet<u64>, BTreeMap<Key, u64>)>,
    /// Every lease granted: id -> (key, tokens), and the `spent` the agent
    /// reported on it (RENEW or RELEASE) in the first batch the allocator
    /// applied that named it.
    leases: Mutex<LeaseBooks>,
}

impl Ledgered {
    fn new(shared: Arc<Shared>, flaky: bool) -> Arc<Self> {
        Arc::new(Self {
            shared,
            flaky,
            calls: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            fresh: Mutex::new((HashSet::new(), BTreeMap::new())),
            leases: Mutex::new((BTreeMap::new(), BTreeMap::new())),
        })
    }
}

impl Transport for Ledgered {
    fn lease(&self, batch: LeaseBatch) -> LeaseFuture<'_> {
        Box::pin(async move {
            let n = self.calls.fetch_add(1, Ordering::Relaxed);
            // Let checks run between the send and the reply.
            tokio::task::yield_now().await;
            if n.is_multiple_of(5) {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            // Down for 30 calls out of every 120: both attempts of a batch
            // fail, the agent declares an outage, then heals.
            if self.flaky && (n / 30) % 4 == 3 {
                self.failures.fetch_add(1, Ordering::Relaxed);
                return Err("stress: allocator down".into());
            }
            let reply = self.shared.handle(&batch);
            let seq = batch.header.as_ref().map_or(0, |h| h.seq);
            {
                let mut f = self.fresh.lock();
                let mut l = self.leases.lock();
                if f.0.insert(seq) {
                    for (item, g) in batch.items.iter().zip(&reply.grants) {
                        let k = (
                            item.rule_id.clone(),
                            item.tenant.clone(),
                            item.route.clone(),
                        );
                        let applied = g.status == GrantStatus::Granted as i32
                            || g.status == GrantStatus::Released as i32;
                        // The first applied report closes the lease at the
                        // allocator (replaced or released); later ones name
                        // a lease it no longer holds.
                        if applied && item.lease_id != 0 {
                            l.1.entry(item.lease_id).or_insert(item.spent);
                        }
                        if item.kind == ItemKind::Renew as i32
                            && g.status == GrantStatus::Granted as i32
                        {
                            // A rate grant's tokens are an increment (its
                            // carry is a rest moved, not granted).
                            *f.1.entry(k.clone()).or_default() += if g.capacity > 0 {
                                g.tokens
                            } else {
                                g.tokens - g.carried
                            };
                            if g.lease_id != 0 {
                                l.0.insert(g.lease_id, (k, g.tokens));
                            }
                        }
                    }
                }
            }
            // The reply is lost on its way back: the agent retries under
            // the same seq and gets the cached answer.
            if self.flaky && n % 7 == 3 {
                self.failures.fetch_add(1, Ordering::Relaxed);
                return Err("stress: reply lost".into());
            }
            Ok(reply)
        })
    }
}

struct Setup {
    agent: Agent,
    shared: Arc<Shared>,
    transport: Arc<Ledgered>,
    rules: RuleSet,
    log: PathBuf,
}

fn setup(name: &str, yaml: &str, flaky: bool, rate_leases: bool) -> Setup {
    let rules = RuleSet::parse(yaml, "stress", 1).expect("valid rules");
    let shared = Shared::new(
        CoreConfig {
            no_predecessor: true,
            ..CoreConfig::default()
        },
        rules.clone(),
        None,
    );
    let transport = Ledgered::new(shared.clone(), flaky);
    let dir = std::env::temp_dir().join(format!("quotalease-stress-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let log = dir.join("admissions.tsv");
    let cfg = AgentConfig {
        agent_id: format!("stress-{name}"),
        lease_ttl: Duration::from_millis(300),
        plan: PlanConfig {
            renew_interval: Duration::from_millis(2),
            low_water: Duration::from_millis(3),
            idle_release: Duration::from_millis(150),
            rate_leases,
            ..PlanConfig::default()
        },
        fetch_timeout: Duration::from_millis(50),
        epsilon: Duration::from_millis(10),
        emergency: EmergencyConfig {
            rate_fraction: Some(0.5),
            burst_fraction: Some(0.5),
        },
        record_emergency: true,
        admission_log: Some(log.clone()),
        ..AgentConfig::default()
    };
    let agent = Agent::start(cfg, transport.clone(), Some(rules.clone())).expect("agent starts");
    Setup {
        agent,
        shared,
        transport,
        rules,
        log,
    }
}

/// One answered request: its (tenant, route, cost) and the answer.
#[derive(Clone, Debug)]
struct Answered {
    tenant: String,
    route: String,
    cost: u64,
    admitted: bool,
    reason: i32,
}

fn answered(
    tenant: &str,
    route: &str,
    cost: u32,
    r: &Result<CheckResponse, CheckError>,
) -> Answered {
    let (admitted, reason) = match r {
        Ok(resp) => (resp.allowed, resp.reason),
        Err(CheckError::Unavailable(_)) => (false, -1),
        Err(e @ CheckError::Invalid { .. }) => panic!("a valid request refused: {e:?}"),
    };
    Answered {
        tenant: tenant.into(),
        route: route.into(),
        cost: u64::from(cost),
        admitted,
        reason,
    }
}

const TENANTS: [&str; 3] = ["t0", "t1", "t2"];
const ROUTES: [&str; 2] = ["/a", "/b"];
const TASKS: usize = 6;
const PER_TASK: usize = 3_000;
const FAST_THREADS: usize = 2;
const PER_THREAD: usize = 20_000;

/// Drive the agent: tokio tasks on `check` (every 10th request sent twice
/// at once under one request id, from two tasks), and OS threads on
/// `check_fast`. Returns every answer (a duplicated id once).
async fn hammer(agent: &Agent, tag: &str) -> Vec<Answered> {
    let mut tasks = tokio::task::JoinSet::new();
    for w in 0..TASKS {
        let agent = agent.clone();
        let tag = tag.to_string();
        tasks.spawn(async move {
            let mut out = Vec::with_capacity(PER_TASK);
            for i in 0..PER_TASK {
                if i % 5 == 4 {
                    // Pace the run over ~1 s so leases renew and refill.
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                let tenant = TENANTS[(w + i) % TENANTS.len()];
                let route = ROUTES[(w + i / 3) % ROUTES.len()];
                let cost = 1 + (i % 3 == 0) as u32;
                if i % 10 == 0 {
                    let id = format!("{tag}-{w}-{i}");
                    let a2 = agent.clone();
                    let id2 = id.clone();
                    let twin = tokio::spawn(async move {
                        a2.check(CheckInput {
                            tenant,
                            route,
                            cost,
                            request_id: &id2,
                            domain: None,
                        })
                        .await
                    });
                    let first = agent
                        .check(CheckInput {
                            tenant,
                            route,
                            cost,
                            request_id: &id,
                            domain: None,
                        })
                        .await;
                    let second = twin.await.expect("twin task");
                    let (a, b) = (
                        answered(tenant, route, cost, &first),
                        answered(tenant, route, cost, &second),
                    );
                    if a.admitted && b.admitted {
                        assert_eq!(first, second, "{id}: one request id, two admissions");
                    }
                    // Admitted by either means charged once: a retry is
                    // decided afresh only after an answer that charged
                    // nothing (the allocator was unreachable).
                    out.push(if a.admitted { a } else { b });
                } else {
                    let r = agent
                        .check(CheckInput {
                            tenant,
                            route,
                            cost,
                            request_id: "",
                            domain: None,
                        })
                        .await;
                    out.push(answered(tenant, route, cost, &r));
                }
            }
            out
        });
    }
    let fast: Vec<_> = (0..FAST_THREADS)
        .map(|w| {
            let agent = agent.clone();
            std::thread::spawn(move || {
                let mut out = Vec::with_capacity(PER_THREAD);
                for i in 0..PER_THREAD {
                    let tenant = TENANTS[(w + 2 * i) % TENANTS.len()];
                    let route = ROUTES[(i / 5) % ROUTES.len()];
                    let input = CheckInput {
                        tenant,
                        route,
                        cost: 1,
                        request_id: "",
                        domain: None,
                    };
                    let r = agent.check_fast(&input);
                    out.push(Answered {
                        tenant: tenant.into(),
                        route: route.into(),
                        cost: 1,
                        admitted: r.is_some(),
                        reason: r.map_or(-1, |a| a.reason as i32),
                    });
                    if i % 16 == 0 {
                        std::thread::sleep(Duration::from_micros(300));
                    }
                }
                out
            })
        })
        .collect();
    let mut all = Vec::new();
    while let Some(r) = tasks.join_next().await {
        all.extend(r.expect("check task"));
    }
    for t in fast {
        all.extend(t.join().expect("fast-path thread"));
    }
    all
}

/// What the accounting found, per key.
#[derive(Debug, Default)]
struct PerKey {
    /// Admitted tokens according to the answers.
    answered: u64,
    /// Admitted requests charging this key, according to the answers.
    answered_n: u64,
    /// Admitted tokens of answers that were OK (all from leases).
    answered_ok: u64,
    /// (time, cost) lines of the admission log.
    logged: Vec<(u64, u64)>,
}

fn account(s: &Setup, all: &[Answered]) -> BTreeMap<Key, PerKey> {
    let mut keys: BTreeMap<Key, PerKey> = BTreeMap::new();
    for a in all.iter().filter(|a| a.admitted) {
        let charged = Agent::charged_rules(&s.rules, None, &a.tenant, &a.route).expect("matches");
        assert!(!charged.is_empty());
        for ri in charged {
            let r = &s.rules.rules[ri];
            let k = (
                r.id.clone(),
                r.tenant.key_part(&a.tenant).to_string(),
                r.route.key_part(&a.route).to_string(),
            );
            let e = keys.entry(k).or_default();
            e.answered += a.cost;
            e.answered_n += 1;
            if a.reason == Reason::Ok as i32 {
                e.answered_ok += a.cost;
            }
        }
    }
    let text = std::fs::read_to_string(&s.log).expect("admission log");
    for line in text.lines() {
        let f: Vec<&str> = line.split('\t').collect();
        assert_eq!(f.len(), 5, "admission log line {line:?}");
        let k = (f[1].to_string(), f[2].to_string(), f[3].to_string());
        keys.entry(k)
            .or_default()
            .logged
            .push((f[0].parse().expect("t"), f[4].parse().expect("cost")));
    }
    // All or none, once: the log (written once per charged rule of an
    // admitted request) and the answers agree key by key.
    for (k, e) in &keys {
        let logged: u64 = e.logged.iter().map(|l| l.1).sum();
        assert_eq!(
            (e.logged.len() as u64, logged),
            (e.answered_n, e.answered),
            "{k:?}: admission log (lines, tokens) vs admitted answers"
        );
    }
    // The transport's per-key sums are the allocator's own ledger total.
    let fresh = s.transport.fresh.lock();
    let total: u64 = fresh.1.values().sum();
    let (granted, violations) = s.shared.with_core(|c| {
        (
            c.stats().tokens_granted,
            c.stats().shadow_violations.clone(),
        )
    });
    assert_eq!(
        total, granted,
        "fresh grants seen vs the allocator's tokens_granted"
    );
    assert!(
        violations.is_empty(),
        "allocator shadow bucket: {violations:?}"
    );
    let now = s.shared.now();
    for k in keys.keys() {
        let id = KeyId::new(&k.0, &k.1, &k.2);
        let i2 = s.shared.with_core(|c| c.i2_holds(now, &id));
        assert_ne!(i2, Some(false), "{k:?}: I2 broken at the allocator");
    }
    keys
}

fn summary(name: &str, s: &Setup, all: &[Answered], opened: usize) {
    let admitted = all.iter().filter(|a| a.admitted).count();
    let fail_open = all
        .iter()
        .filter(|a| a.admitted && a.reason == Reason::FailureModeAllowed as i32)
        .count();
    let m = s.agent.metrics();
    eprintln!(
        "{name}: {} answers, {admitted} admitted ({fail_open} fail-open), {} calls ({} failed), {} emergency buckets, {} waits, {} renewal messages",
        all.len(),
        s.transport.calls.load(Ordering::Relaxed),
        s.transport.failures.load(Ordering::Relaxed),
        opened,
        m.waits.get(),
        m.messages.get(),
    );
}

fn fresh_of(s: &Setup, k: &Key) -> u64 {
    s.transport.fresh.lock().1.get(k).copied().unwrap_or(0)
}

/// What the allocator's books let this agent have spent on key `k`: per
/// lease, the spent count the agent reported when it renewed or released
/// it, or the whole lease if it never reported (it expired, or is still
/// held). Tokens admitted from leases can exceed this only if a charge
/// escaped a report (a refund into a generation already reported, say).
fn reported_bound(s: &Setup, k: &Key) -> u64 {
    let l = s.transport.leases.lock();
    l.0.iter()
        .filter(|(_, (key, _))| key == k)
        .map(|(id, (_, granted))| l.1.get(id).map_or(*granted, |&sp| sp.min(*granted)))
        .sum()
}

async fn wait_ready(a: &Agent) {
    for _ in 0..500 {
        if a.is_ready() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("agent not ready");
}

/// The last rule is the tightest, so it is the one that most often cannot
/// pay after the first two were charged: their charges are refunded.
const MULTI: &str = r#"
rules:
  - id: per-tenant
    match: { tenant: "*" }
    rate: 6000/s
    burst: 120
    fail_policy: lease_only
  - id: per-route
    match: { route: "*" }
    rate: 5000/s
    burst: 100
    fail_policy: lease_only
  - id: pair
    match: { tenant: "*", route: "*" }
    rate: 1500/s
    burst: 12
    fail_policy: lease_only
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_rule_refunds_keep_exact_accounting() {
    let s = setup("multi", MULTI, false, false);
    wait_ready(&s.agent).await;
    let all = hammer(&s.agent, "m").await;
    s.agent.shutdown().await;
    let keys = account(&s, &all);
    summary("multi", &s, &all, 0);
    assert_eq!(keys.len(), 3 + 2 + 6, "{:?}", keys.keys());
    let admitted = all.iter().filter(|a| a.admitted).count();
    assert!(
        admitted > 0 && admitted < all.len(),
        "{admitted} of {}",
        all.len()
    );
    let rate = |id: &str| s.rules.get(id).expect("rule").rate;
    for (k, e) in &keys {
        let fresh = fresh_of(&s, k);
        let bound = reported_bound(&s, k);
        assert!(
            e.answered <= bound && bound <= fresh,
            "{k:?}: admitted {} tokens; reported spent (or unreported leases) {bound}; granted {fresh}",
            e.answered
        );
        let rule = s.rules.get(&k.0).expect("rule");
        let mut log = e.logged.clone();
        let w = quotalease_sim::checker::worst_window(&mut log, rate(&k.0), rule.burst);
        assert!(
            w.held(),
            "{k:?}: I1 broken: {} admitted in [{}, {}] ns, excess {}",
            w.admitted,
            w.from_ns,
            w.to_ns,
            w.excess
        );
    }
    let _ = std::fs::remove_dir_all(s.log.parent().expect("dir"));
}

/// The same hammering with leases that carry a rate: the agent's lease
/// words refill themselves (GCRA) under the checks' CASes, renewals change
/// rates and capacities, refunds move arrival times back. A rate lease
/// reports nothing spent, so the check is the bound itself: I1 over every
/// window of every key, exactly, plus the log and the answers agreeing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_leases_keep_i1_under_multi_rule_refunds() {
    let s = setup("multi-rate", MULTI, false, true);
    wait_ready(&s.agent).await;
    let all = hammer(&s.agent, "r").await;
    s.agent.shutdown().await;
    let keys = account(&s, &all);
    summary("multi-rate", &s, &all, 0);
    assert_eq!(keys.len(), 3 + 2 + 6, "{:?}", keys.keys());
    let admitted = all.iter().filter(|a| a.admitted).count();
    assert!(
        admitted > 0 && admitted < all.len(),
        "{admitted} of {}",
        all.len()
    );
    let rates_granted = s.shared.with_core(|c| c.stats().rate_grants);
    assert!(rates_granted > 0, "no lease carried a rate");
    for (k, e) in &keys {
        let rule = s.rules.get(&k.0).expect("rule");
        let mut log = e.logged.clone();
        let w = quotalease_sim::checker::worst_window(&mut log, rule.rate, rule.burst);
        assert!(
            w.held(),
            "{k:?}: I1 broken: {} admitted in [{}, {}] ns, excess {}",
            w.admitted,
            w.from_ns,
            w.to_ns,
            w.excess
        );
    }
    let _ = std::fs::remove_dir_all(s.log.parent().expect("dir"));
}

const OPEN: &str = r#"
rules:
  - id: open-tenant
    match: { tenant: "*" }
    rate: 4000/s
    burst: 80
    fail_policy: open
  - id: open-pair
    match: { tenant: "*", route: "*" }
    rate: 1500/s
    burst: 12
    fail_policy: open
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_open_under_a_flapping_allocator_stays_bounded() {
    let s = setup("open", OPEN, true, false);
    wait_ready(&s.agent).await;
    let start = s.agent.now();
    let all = hammer(&s.agent, "o").await;
    let run_ns = s.agent.now() - start;
    let opened = s.agent.take_emergency_opened();
    s.agent.shutdown().await;
    let keys = account(&s, &all);
    summary("open", &s, &all, opened.len());
    assert!(
        s.transport.failures.load(Ordering::Relaxed) > 0,
        "the transport failed no call"
    );
    assert!(!opened.is_empty(), "no outage opened an emergency bucket");
    let fail_open = all
        .iter()
        .filter(|a| a.admitted && a.reason == Reason::FailureModeAllowed as i32)
        .count();
    assert!(fail_open > 0, "nothing admitted fail-open");
    // What every emergency bucket opened for a key could have given over
    // the whole run: b_e + r_e * T.
    let cap = |r: Rate, b: u64| {
        b + (u128::from(r.tokens) * u128::from(run_ns))
            .div_ceil(u128::from(r.period_s) * 1_000_000_000) as u64
    };
    for (k, e) in &keys {
        let fresh = fresh_of(&s, k);
        let bound = reported_bound(&s, k);
        assert!(
            e.answered_ok <= bound && bound <= fresh,
            "{k:?}: {} tokens admitted OK from leases; reported spent (or unreported leases) {bound}; granted {fresh}",
            e.answered_ok
        );
        let emergency: u64 = opened
            .iter()
            .filter(|o| (&o.rule_id, &o.tenant, &o.route) == (&k.0, &k.1, &k.2))
            .map(|o| cap(o.rate, o.burst))
            .sum();
        assert!(
            e.answered <= bound + emergency,
            "{k:?}: admitted {} tokens; leases {bound} + emergency at most {emergency}",
            e.answered
        );
    }
    let _ = std::fs::remove_dir_all(s.log.parent().expect("dir"));
}

//! The agent: answers checks from leased tokens and keeps leases topped up
//! in the background.
//!
//! The request path ([`Agent::check`]) matches rules, looks up each key's
//! [`Slot`] and takes tokens with one CAS per rule. Only when a lease is
//! missing or short does it leave the fast path: it marks the key as
//! waiting, wakes the renewal loop and waits (bounded by `fetch_timeout`)
//! for the grant. The renewal loop ([`Agent::start`]) plans renewals
//! with [`crate::renewal::plan`], batches every key due into one message,
//! and installs grants.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwapOption;
use parking_lot::Mutex;
use quotalease_model::bucket::TokenBucket;
use quotalease_model::clock::ClockSource;
use quotalease_model::key::{KeyId, KeyRef};
use quotalease_model::matching::{Matched, TooManyMatches, MAX_MATCHED};
use quotalease_model::protocol::{use_by_ns, MAX_ID_BYTES};
use quotalease_model::rules::{FailPolicy, Rate, Rule, RuleSet};
use quotalease_proto::lease::{
    Grant, GrantStatus, ItemKind, LeaseBatch, LeaseItem, LeaseReply, RequestHeader,
};
use quotalease_proto::v1::{CheckResponse, Reason};
use quotalease_proto::PROTOCOL_VERSION;
use tokio::sync::Notify;

use crate::idempotency::ReplayCache;
use crate::lease_table::{LeaseWord, Take};
use crate::metrics::{AgentMetrics, Counter, RuleCounterSet, RuleCounters};
use crate::renewal::{plan, KeyNow, Plan, PlanConfig, Usage};
use crate::transport::Transport;

/// Agent settings. Defaults are documented in docs/operations.md.
#[derive(Clone, Debug)]
pub struct AgentConfig {
    /// Identity sent to the allocator (unique per agent).
    pub agent_id: String,
    /// Lease lifetime requested (the allocator grants at most its TTL_max).
    pub lease_ttl: Duration,
    /// Renewal planning.
    pub plan: PlanConfig,
    /// How long a request waits for a missing lease, and the bound of one
    /// allocator call.
    pub fetch_timeout: Duration,
    /// Stall allowance subtracted from every lease deadline (`epsilon`).
    pub epsilon: Duration,
    /// Largest number of keys held; beyond it new keys are refused (the
    /// request answers with the rule's fail policy) until idle keys go.
    pub max_keys: usize,
    /// Request ids remembered for idempotent replays.
    pub replay_capacity: usize,
    /// Heartbeat to the allocator when nothing else is sent (rules refresh).
    pub heartbeat: Duration,
    /// Size of the fail-open emergency buckets.
    pub emergency: EmergencyConfig,
    /// Test-only: append every admission (time, key, cost) to this file.
    pub admission_log: Option<PathBuf>,
    /// Where the agent reads time: `CLOCK_BOOTTIME` by default; a driver
    /// that owns time (the simulator) sets a [`quotalease_model::clock::ManualClock`]
    /// before each call; `tests/turmoil_net.rs` reads turmoil's time.
    pub clock: ClockSource,
    /// Incarnation sent to the allocator; default: wall-clock ns at start.
    pub incarnation: Option<u64>,
    /// Remember every emergency bucket opened (for the simulator's I3 check).
    pub record_emergency: bool,
}

/// Size of the per-key emergency bucket of `open` rules (SPEC §2 I3, §6).
/// Defaults: rate `max(this agent's recent admitted rate, R / holders)`,
/// burst `B / holders`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EmergencyConfig {
    /// Fixed rate as a fraction of the rule's rate (instead of the default).
    pub rate_fraction: Option<f64>,
    /// Fixed burst as a fraction of the rule's burst (instead of the default).
    pub burst_fraction: Option<f64>,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            agent_id: format!("agent-{}", std::process::id()),
            lease_ttl: Duration::from_secs(2),
            plan: PlanConfig::default(),
            fetch_timeout: Duration::from_millis(250),
            epsilon: Duration::from_millis(50),
            max_keys: 1_000_000,
            replay_capacity: 100_000,
            heartbeat: Duration::from_secs(1),
            emergency: EmergencyConfig::default(),
            admission_log: None,
            clock: ClockSource::Boot,
            incarnation: None,
            record_emergency: false,
        }
    }
}

/// Why a check got no decision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CheckError {
    /// A field is invalid; the answer is `INVALID` (gRPC) or 400 (HTTP).
    Invalid {
        /// The field.
        field: &'static str,
        /// Why.
        reason: String,
    },
    /// Fail-closed with no lease, or no rules known yet: answer
    /// `UNAVAILABLE` / 503.
    Unavailable(String),
}

/// An admission decided on the fast path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FastAdmit {
    /// Tokens left in the most constrained lease charged.
    pub remaining: u64,
    /// Index (in the rule set) of that rule; None when no rule matched.
    pub rule_index: Option<usize>,
    /// Rule set version applied.
    pub rule_version: u64,
    /// OK, NO_RULE or SHADOW_OVER_LIMIT.
    pub reason: Reason,
}

impl FastAdmit {
    /// As a `quotalease.v1` response.
    pub fn to_response(&self, rules: &RuleSet) -> CheckResponse {
        CheckResponse {
            allowed: true,
            remaining: self.remaining,
            retry_after_ms: 0,
            rule_id: self
                .rule_index
                .and_then(|i| rules.rules.get(i))
                .map(|r| r.id.clone())
                .unwrap_or_default(),
            applied_rule_version: self.rule_version,
            reason: self.reason as i32,
        }
    }
}

/// One check.
#[derive(Clone, Copy, Debug)]
pub struct CheckInput<'a> {
    /// Tenant id.
    pub tenant: &'a str,
    /// Route id.
    pub route: &'a str,
    /// Cost; 0 means 1.
    pub cost: u32,
    /// Gateway request id for idempotent retries ("" = none).
    pub request_id: &'a str,
    /// Rule namespace (Envoy domain), if any.
    pub domain: Option<&'a str>,
}

// ---------------------------------------------------------------------------
// Keys and slots

/// Rounds a request waits for a grant before it is denied.
const MAX_ATTEMPTS: u32 = 2;
/// The same while the allocator is opening the key upstream.
const MAX_ATTEMPTS_OPENING: u32 = 4;

/// A [`KeyRef`] as a lease-table lookup: hashes like the table's [`KeyId`]
/// keys and compares part by part, so a lookup builds nothing. (papaya's
/// `Equivalent` and both key types are foreign here, hence the wrapper.)
#[derive(Clone, Copy, Debug, Hash)]
struct Lookup<'a>(KeyRef<'a>);

impl<'a> Lookup<'a> {
    /// The key of `rule` for a request on (tenant, route).
    #[inline]
    fn of(rule: &'a Rule, tenant: &'a str, route: &'a str) -> Self {
        Self(KeyRef::of(rule, tenant, route))
    }
}

impl papaya::Equivalent<KeyId> for Lookup<'_> {
    #[inline]
    fn equivalent(&self, k: &KeyId) -> bool {
        self.0 == *k
    }
}

/// Renewal-side state of a key (never touched by the request fast path).
#[derive(Debug, Default)]
struct SlotState {
    lease_id: u64,
    /// Tokens of the lease as the allocator records them.
    granted: u64,
    generation: u64,
    /// Tokens in the word at the last tick (for consumption accounting).
    baseline: u64,
    usage: Usage,
    in_flight: Option<InFlight>,
    /// Set when the allocator refused the key (unknown rule, key limit...).
    refused: Option<(GrantStatus, String)>,
}

#[derive(Clone, Copy, Debug)]
struct InFlight {
    seq: u64,
    generation: u64,
    tokens_at_send: u64,
    kind: ItemKind,
}

/// Source of slot ids: a slot removed from the table and created again for
/// the same key is a different slot, so a late refund cannot land in it.
static NEXT_SLOT_ID: AtomicU64 = AtomicU64::new(1);

/// One key held by the agent.
#[derive(Debug)]
pub struct Slot {
    /// The lease word (hot path).
    pub word: LeaseWord,
    id: u64,
    rule_id: String,
    tenant: String,
    route: String,
    dry_until_ns: AtomicU64,
    /// Sum of the costs of requests waiting for this key's next grant.
    waiting_cost: AtomicU64,
    /// Holders of this key at the allocator, as of the last grant.
    holders: AtomicU64,
    /// Fail-open emergency bucket of the current outage: (outage, bucket).
    emergency: Mutex<Option<(u64, TokenBucket)>>,
    /// Tokens asked for but denied since the last tick (demand the lease
    /// could not serve; counted off the fast path).
    denied: AtomicU64,
    /// The renewal loop may skip this key before this instant if its lease
    /// word still reads `seen_word` and nothing waits or was denied: the
    /// planner's answer cannot change before then (see `plan_all`).
    quiet_until_ns: AtomicU64,
    seen_word: AtomicU64,
    /// The allocator is still opening this (never leased) key upstream.
    opening: AtomicBool,
    parked: Notify,
    st: Mutex<SlotState>,
}

impl Slot {
    fn new(rule_id: &str, tenant: &str, route: &str) -> Self {
        Self {
            word: LeaseWord::new(),
            id: NEXT_SLOT_ID.fetch_add(1, Ordering::Relaxed),
            rule_id: rule_id.to_string(),
            tenant: tenant.to_string(),
            route: route.to_string(),
            dry_until_ns: AtomicU64::new(0),
            waiting_cost: AtomicU64::new(0),
            denied: AtomicU64::new(0),
            quiet_until_ns: AtomicU64::new(0),
            seen_word: AtomicU64::new(u64::MAX),
            opening: AtomicBool::new(false),
            holders: AtomicU64::new(1),
            emergency: Mutex::new(None),
            parked: Notify::new(),
            st: Mutex::new(SlotState::default()),
        }
    }
}

impl Slot {
    /// Take `cost` from this key's emergency bucket for outage `outage`,
    /// creating it on first use: rate `r_e = max(this agent's recent
    /// consumption, R / holders)`, burst `b_e = max(1, B / holders)` (SPEC §2
    /// I3, §6). Returns the tokens left, or None when it is empty.
    fn emergency_take(
        &self,
        rule: &Rule,
        cfg: &EmergencyConfig,
        outage: u64,
        cost: u64,
        t: u64,
        log: Option<&Mutex<Vec<EmergencyOpened>>>,
    ) -> Option<u64> {
        let mut e = self.emergency.lock();
        if e.as_ref().is_none_or(|(o, _)| *o != outage) {
            let recent_per_s = self.st.lock().usage.admitted_rate;
            let holders = self.holders.load(Ordering::Acquire).max(1);
            let r = rule.rate;
            let tokens = match cfg.rate_fraction {
                Some(f) => (r.tokens as f64 * f).ceil() as u64,
                None => {
                    let recent = (recent_per_s * r.period_s as f64).ceil() as u64;
                    recent.max(r.tokens / holders)
                }
            }
            .clamp(1, r.tokens);
            let burst = match cfg.burst_fraction {
                Some(f) => (rule.burst as f64 * f).ceil() as u64,
                None => rule.burst / holders,
            }
            .clamp(1, rule.burst);
            let rate = Rate {
                tokens,
                period_s: r.period_s,
            };
            if let Some(log) = log {
                log.lock().push(EmergencyOpened {
                    at_ns: t,
                    rule_id: self.rule_id.clone(),
                    tenant: self.tenant.clone(),
                    route: self.route.clone(),
                    rate,
                    burst,
                });
            }
            *e = Some((outage, TokenBucket::new_full(rate, burst, t)));
        }
        let (_, bucket) = e.as_mut().expect("created above");
        bucket.try_acquire(cost, t).ok()
    }

    fn emergency_refund(&self, cost: u64, t: u64) {
        if let Some((_, bucket)) = self.emergency.lock().as_mut() {
            bucket.refund(cost, t);
        }
    }

    /// A RELEASE item for this key.
    fn release_item(&self, lease_id: u64, spent: u64) -> LeaseItem {
        LeaseItem {
            rule_id: self.rule_id.clone(),
            tenant: self.tenant.clone(),
            route: self.route.clone(),
            kind: ItemKind::Release as i32,
            lease_id,
            spent,
            want: 0,
        }
    }
}

/// The lease table: key bytes to slot. A lock-free map (reads pin an epoch
/// guard, which writes only thread-local state), so concurrent checks on
/// one hot key share no written cache line except the lease word itself.
/// The hasher is seeded per process.
type Table = papaya::HashMap<KeyId, Arc<Slot>, foldhash::fast::RandomState>;

/// The rules a request matched (the one matcher, [`RuleSet::match_rules`]);
/// too many is an invalid `tenant_id`.
#[inline]
fn match_rules(
    rules: &RuleSet,
    domain: Option<&str>,
    tenant: &str,
    route: &str,
) -> Result<Matched, CheckError> {
    rules
        .match_rules(domain, tenant, route)
        .map_err(|e: TooManyMatches| CheckError::Invalid {
            field: TooManyMatches::FIELD,
            reason: e.to_string(),
        })
}

fn validate(input: &CheckInput<'_>) -> Result<u64, CheckError> {
    let check_id = |field: &'static str, v: &str, required: bool| {
        if required && v.is_empty() {
            return Err(CheckError::Invalid {
                field,
                reason: "must not be empty".into(),
            });
        }
        if v.len() > MAX_ID_BYTES {
            return Err(CheckError::Invalid {
                field,
                reason: format!("{} bytes, at most {MAX_ID_BYTES}", v.len()),
            });
        }
        Ok(())
    };
    check_id("tenant_id", input.tenant, true)?;
    check_id("route_id", input.route, false)?;
    check_id("request_id", input.request_id, false)?;
    if let Some(d) = input.domain {
        check_id("domain", d, false)?;
    }
    Ok(u64::from(input.cost.max(1)))
}

// ---------------------------------------------------------------------------
// The agent

struct Inner {
    cfg: AgentConfig,
    /// Grows only: wall-clock ns at start, raised above the allocator's
    /// record if that is higher (a clock stepped back across a restart).
    incarnation: AtomicU64,
    /// None when a driver moves the batches itself (the simulator).
    transport: Option<Arc<dyn Transport>>,
    rules: ArcSwapOption<RuleSet>,
    table: Table,
    connected: AtomicBool,
    /// The last allocator call failed (as opposed to: none made yet).
    down: AtomicBool,
    /// The allocator (a regional one) reports its own parent unreachable.
    parent_down: AtomicBool,
    /// When the last batch was sent (for heartbeats).
    last_sent_ns: AtomicU64,
    /// Rule set version of the last planning pass (a change visits every key).
    planned_version: AtomicU64,
    /// Slots that requests wait for since the last pass (a wake-up pass
    /// plans only these).
    wanted: Mutex<Vec<Arc<Slot>>>,
    /// Batches sent and not yet answered, by sequence number.
    pending: Mutex<BTreeMap<u64, Pending>>,
    /// Emergency buckets opened (only with `record_emergency`).
    emergency_log: Mutex<Vec<EmergencyOpened>>,
    /// Counts outages; an emergency bucket belongs to one outage.
    outage: AtomicU64,
    seq: AtomicU64,
    wake: Notify,
    stop: AtomicBool,
    stopped: Notify,
    late_releases: Mutex<Vec<LeaseItem>>,
    replays: ReplayCache<Result<CheckResponse, CheckError>>,
    metrics: AgentMetrics,
    admission_log: Option<Mutex<BufWriter<File>>>,
}

/// Working state of one planning pass.
struct PlanCtx {
    rules: Option<Arc<RuleSet>>,
    rules_changed: bool,
    idle_ns: u64,
    lead_ns: u64,
    releases: Vec<LeaseItem>,
    renews: Vec<(LeaseItem, Arc<Slot>)>,
    forget: Vec<KeyId>,
}

/// A batch on its way to the allocator.
#[derive(Debug)]
struct Pending {
    sent_ns: u64,
    items: Vec<LeaseItem>,
    slots: Vec<Arc<Slot>>,
    /// The driver gave up on it; a late reply only releases what it granted.
    abandoned: bool,
}

/// An emergency bucket opened for a fail-open key (SPEC §2 I3).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EmergencyOpened {
    /// Agent clock instant.
    pub at_ns: u64,
    /// Rule id.
    pub rule_id: String,
    /// Tenant part of the key.
    pub tenant: String,
    /// Route part of the key.
    pub route: String,
    /// `r_e`.
    pub rate: Rate,
    /// `b_e`.
    pub burst: u64,
}

/// One step of the slow path.
enum Step {
    Done(Result<CheckResponse, CheckError>),
    /// Wait for the next grant of `slot` (rule `rule_idx` could not pay).
    Park {
        slot: Arc<Slot>,
        rule_idx: usize,
    },
}

/// What [`Agent::check_at`] decided.
#[derive(Clone, Debug, PartialEq)]
pub enum CheckStep {
    /// The answer.
    Answer(Result<CheckResponse, CheckError>),
    /// The request waits for a grant: the driver sends what
    /// [`Agent::poll_renewal`] returns and calls `check_at` again with
    /// `attempt + 1` once a reply arrived or `fetch_timeout` passed.
    Wait,
}

/// A running agent. Cheap to clone.
#[derive(Clone)]
pub struct Agent {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("agent_id", &self.inner.cfg.agent_id)
            .field("keys", &self.inner.table.len())
            .finish()
    }
}

impl Agent {
    /// Start an agent and its renewal loop on the current tokio runtime.
    /// `bootstrap` rules (e.g. from `--rules`) are used until the
    /// allocator sends its own.
    pub fn start(
        cfg: AgentConfig,
        transport: Arc<dyn Transport>,
        bootstrap: Option<RuleSet>,
    ) -> std::io::Result<Agent> {
        let agent = Self::new(cfg, Some(transport), bootstrap)?;
        let bg = agent.clone();
        tokio::spawn(async move { bg.renewal_loop().await });
        Ok(agent)
    }

    /// An agent without a renewal task: the driver calls
    /// [`Agent::poll_renewal`], carries the batch, and feeds back
    /// [`Agent::on_reply`] or [`Agent::on_failure`] (the simulator does;
    /// [`Agent::start`] runs the tokio driver).
    pub fn new(
        cfg: AgentConfig,
        transport: Option<Arc<dyn Transport>>,
        bootstrap: Option<RuleSet>,
    ) -> std::io::Result<Agent> {
        let admission_log = match &cfg.admission_log {
            Some(p) => Some(Mutex::new(BufWriter::new(File::create(p)?))),
            None => None,
        };
        let incarnation = cfg.incarnation.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        });
        let inner = Arc::new(Inner {
            replays: ReplayCache::new(cfg.replay_capacity, 60_000_000_000),
            cfg,
            incarnation: AtomicU64::new(incarnation),
            transport,
            rules: ArcSwapOption::new(bootstrap.map(Arc::new)),
            table: Table::with_hasher(foldhash::fast::RandomState::default()),
            connected: AtomicBool::new(false),
            down: AtomicBool::new(false),
            parent_down: AtomicBool::new(false),
            last_sent_ns: AtomicU64::new(0),
            planned_version: AtomicU64::new(0),
            wanted: Mutex::new(Vec::new()),
            pending: Mutex::new(BTreeMap::new()),
            emergency_log: Mutex::new(Vec::new()),
            outage: AtomicU64::new(0),
            seq: AtomicU64::new(0),
            wake: Notify::new(),
            stop: AtomicBool::new(false),
            stopped: Notify::new(),
            late_releases: Mutex::new(Vec::new()),
            metrics: AgentMetrics::default(),
            admission_log,
        });
        if let Some(rules) = inner.rules.load_full() {
            inner
                .metrics
                .by_rule
                .store(Arc::new(RuleCounterSet::for_rules(
                    &rules,
                    &RuleCounterSet::default(),
                )));
        }
        Ok(Agent { inner })
    }

    /// The emergency buckets opened since the last call (only recorded
    /// with `record_emergency`).
    pub fn take_emergency_opened(&self) -> Vec<EmergencyOpened> {
        std::mem::take(&mut *self.inner.emergency_log.lock())
    }

    /// The indices (in `rules`) of the non-shadow rules a request on
    /// (tenant, route) is charged to, overrides applied.
    pub fn charged_rules(
        rules: &RuleSet,
        domain: Option<&str>,
        tenant: &str,
        route: &str,
    ) -> Result<Vec<usize>, CheckError> {
        let m = match_rules(rules, domain, tenant, route)?;
        Ok(m.indices()
            .iter()
            .map(|&i| i as usize)
            .filter(|&i| !rules.rules[i].shadow)
            .collect())
    }

    /// The agent's clock reading.
    #[inline]
    pub fn now(&self) -> u64 {
        self.inner.cfg.clock.now()
    }

    /// Whether the last allocator call succeeded and rules are known.
    pub fn is_ready(&self) -> bool {
        self.inner.connected.load(Ordering::Acquire) && self.inner.rules.load().is_some()
    }

    /// The rule set in force, if any.
    pub fn rules(&self) -> Option<Arc<RuleSet>> {
        self.inner.rules.load_full()
    }

    /// Counters.
    pub fn metrics(&self) -> &AgentMetrics {
        &self.inner.metrics
    }

    /// Number of keys held.
    pub fn key_count(&self) -> usize {
        self.inner.table.len()
    }

    /// Answer one check.
    pub async fn check(&self, input: CheckInput<'_>) -> Result<CheckResponse, CheckError> {
        let cost = match validate(&input) {
            Ok(c) => c,
            Err(e) => {
                self.inner.metrics.invalid.add(1);
                return Err(e);
            }
        };
        if !input.request_id.is_empty() {
            let t = self.now();
            if let Some(first) = self.inner.replays.get(
                input.request_id,
                input.tenant,
                input.route,
                input.cost.max(1),
                t,
            ) {
                self.inner.metrics.replays.add(1);
                return first;
            }
            let answer = self.decide(&input, cost).await;
            return self.inner.replays.put(
                input.request_id,
                input.tenant,
                input.route,
                input.cost.max(1),
                t,
                answer,
            );
        }
        self.decide(&input, cost).await
    }

    /// The in-process fast path, for gateways that link the agent: `Some`
    /// when every matched rule was charged from a held lease (or no rule
    /// matched); `None` when the slow path is needed (no lease, short lease,
    /// invalid input, no rules) — then nothing was charged. No lock, no
    /// allocation, no await: one CAS per matched rule.
    #[inline]
    pub fn check_fast(&self, input: &CheckInput<'_>) -> Option<FastAdmit> {
        let cost = validate(input).ok()?;
        let guard = self.inner.rules.load();
        let rules = guard.as_ref()?;
        self.fast_with(rules, input, cost, self.now())
    }

    #[inline]
    fn fast_with(
        &self,
        rules: &RuleSet,
        input: &CheckInput<'_>,
        cost: u64,
        t: u64,
    ) -> Option<FastAdmit> {
        let inner = &*self.inner;
        let m = match_rules(rules, input.domain, input.tenant, input.route).ok()?;
        if m.is_empty() {
            inner.metrics.no_rule.add(1);
            return Some(FastAdmit {
                remaining: 0,
                rule_index: None,
                rule_version: rules.version,
                reason: Reason::NoRule,
            });
        }
        for &i in m.indices() {
            let r = &rules.rules[i as usize];
            if !r.shadow && cost > r.burst {
                return None;
            }
        }
        let (remaining, rule_idx) = self.try_charge(rules, &m, input, cost, t).ok()?;
        let reason = self.charge_shadow(rules, &m, input, cost, t);
        inner.metrics.allowed.add(1);
        self.count_admitted(rules, &m);
        Some(FastAdmit {
            remaining,
            rule_index: Some(rule_idx),
            rule_version: rules.version,
            reason,
        })
    }

    #[tracing::instrument(level = "debug", name = "check", skip_all, fields(cost))]
    async fn decide(&self, input: &CheckInput<'_>, cost: u64) -> Result<CheckResponse, CheckError> {
        let inner = &*self.inner;
        let rules = match self.slow_prelude(input, cost, self.now())? {
            Ok(answer) => return Ok(answer),
            Err(rules) => rules,
        };
        let m = match_rules(&rules, input.domain, input.tenant, input.route)?;
        let mut attempt = 0;
        loop {
            match self.decide_step(&rules, &m, input, cost, attempt, self.now()) {
                Step::Done(answer) => return answer,
                Step::Park { slot, rule_idx } => {
                    attempt += 1;
                    let parked = slot.parked.notified();
                    tokio::pin!(parked);
                    parked.as_mut().enable();
                    self.register_wait(&rules, &m, input, cost, rule_idx, &slot, self.now());
                    let _ = tokio::time::timeout(inner.cfg.fetch_timeout, parked).await;
                }
            }
        }
    }

    /// The sans-IO form of [`Agent::check`] for drivers that own time and
    /// waiting (the simulator): decide at agent-clock instant `t`. Replays
    /// by request id are not handled here.
    pub fn check_at(&self, input: &CheckInput<'_>, attempt: u32, t: u64) -> CheckStep {
        let cost = match validate(input) {
            Ok(c) => c,
            Err(e) => {
                self.inner.metrics.invalid.add(1);
                return CheckStep::Answer(Err(e));
            }
        };
        let rules = match self.slow_prelude(input, cost, t) {
            Err(e) => return CheckStep::Answer(Err(e)),
            Ok(Ok(answer)) => return CheckStep::Answer(Ok(answer)),
            Ok(Err(rules)) => rules,
        };
        let m = match match_rules(&rules, input.domain, input.tenant, input.route) {
            Ok(m) => m,
            Err(e) => return CheckStep::Answer(Err(e)),
        };
        match self.decide_step(&rules, &m, input, cost, attempt, t) {
            Step::Done(answer) => CheckStep::Answer(answer),
            Step::Park { slot, rule_idx } => {
                self.register_wait(&rules, &m, input, cost, rule_idx, &slot, t);
                CheckStep::Wait
            }
        }
    }

    /// The start of the slow path: no rules (unavailable), the fast path
    /// (`Ok(Ok(answer))`), a cost above a burst (invalid), or the rules to
    /// go on with (`Ok(Err(rules))`).
    #[allow(clippy::type_complexity)]
    fn slow_prelude(
        &self,
        input: &CheckInput<'_>,
        cost: u64,
        t: u64,
    ) -> Result<Result<CheckResponse, Arc<RuleSet>>, CheckError> {
        let inner = &*self.inner;
        let Some(rules) = inner.rules.load_full() else {
            inner.metrics.unavailable.add(1);
            return Err(CheckError::Unavailable(
                "no rules yet: the allocator has not been reached".into(),
            ));
        };
        if let Some(a) = self.fast_with(&rules, input, cost, t) {
            return Ok(Ok(a.to_response(&rules)));
        }
        let m = match_rules(&rules, input.domain, input.tenant, input.route)?;
        for &i in m.indices() {
            let r = &rules.rules[i as usize];
            if !r.shadow && cost > r.burst {
                inner.metrics.invalid.add(1);
                return Err(CheckError::Invalid {
                    field: "cost",
                    reason: format!("{cost} is above the burst {} of rule {}", r.burst, r.id),
                });
            }
        }
        Ok(Err(rules))
    }

    /// One pass of the slow path at `t`: charge, deny, apply a fail policy,
    /// or park for the next grant.
    fn decide_step(
        &self,
        rules: &RuleSet,
        m: &Matched,
        input: &CheckInput<'_>,
        cost: u64,
        attempt: u32,
        t: u64,
    ) -> Step {
        let inner = &*self.inner;
        match self.try_charge(rules, m, input, cost, t) {
            Ok((remaining, rule_idx)) => {
                let reason = self.charge_shadow(rules, m, input, cost, t);
                inner.metrics.allowed.add(1);
                self.count_admitted(rules, m);
                Step::Done(Ok(FastAdmit {
                    remaining,
                    rule_index: Some(rule_idx),
                    rule_version: rules.version,
                    reason,
                }
                .to_response(rules)))
            }
            Err(rule_idx) => {
                let rule = &rules.rules[rule_idx];
                let slot = self.slot_for(rule, input.tenant, input.route);
                let Some(slot) = slot else {
                    return Step::Done(self.fail_policy(
                        rule,
                        rules,
                        "the agent holds max_keys keys",
                    ));
                };
                if let Some((status, why)) = slot.st.lock().refused.clone() {
                    inner.metrics.over_limit.add(1);
                    tracing::debug!(rule = %rule.id, ?status, %why, "key refused by the allocator");
                    return Step::Done(Ok(self.over_limit(rule, rules, 1_000)));
                }
                let dry_until = slot.dry_until_ns.load(Ordering::Acquire);
                // Behind a regional allocator whose parent is unreachable the
                // regional's pool still counts as leased: ask it once; when
                // it is dry, the fail policy applies (SPEC §2 I3, §6).
                let parent_cut =
                    inner.parent_down.load(Ordering::Acquire) && (attempt > 0 || dry_until > t);
                let cut_off = parent_cut
                    || inner.down.load(Ordering::Acquire)
                    || (!inner.connected.load(Ordering::Acquire) && attempt > 0);
                // A key the allocator is still fetching from its parent gets
                // a few more rounds (each bounded by `fetch_timeout`).
                let max_attempts = if slot.opening.load(Ordering::Acquire) {
                    MAX_ATTEMPTS_OPENING
                } else {
                    MAX_ATTEMPTS
                };
                if dry_until > t
                    && !parent_cut
                    && max_attempts > MAX_ATTEMPTS
                    && attempt < max_attempts
                {
                    return Step::Park { slot, rule_idx };
                }
                if dry_until > t && !parent_cut {
                    slot.denied.fetch_add(cost, Ordering::Relaxed);
                    inner.metrics.over_limit.add(1);
                    // The answer names the denying rule with the largest retry.
                    let (ms, idx) =
                        self.largest_retry(rules, m, input, cost, t, rule_idx, dry_until - t);
                    return Step::Done(Ok(self.over_limit(&rules.rules[idx], rules, ms)));
                }
                if cut_off {
                    if rule.fail_policy == FailPolicy::Open {
                        return Step::Done(
                            match self.try_charge_emergency(rules, m, input, cost, t) {
                                Ok((remaining, idx)) => {
                                    inner.metrics.failure_mode_allowed.add(1);
                                    self.count_rule(&rule.id, |c| &c.failure_mode_allowed);
                                    Ok(FastAdmit {
                                        remaining,
                                        rule_index: Some(idx),
                                        rule_version: rules.version,
                                        reason: Reason::FailureModeAllowed,
                                    }
                                    .to_response(rules))
                                }
                                Err(k) => self.fail_policy(
                                    &rules.rules[k],
                                    rules,
                                    "allocator unreachable; emergency bucket empty",
                                ),
                            },
                        );
                    }
                    return Step::Done(self.fail_policy(rule, rules, "allocator unreachable"));
                }
                if attempt >= max_attempts {
                    slot.denied.fetch_add(cost, Ordering::Relaxed);
                    inner.metrics.over_limit.add(1);
                    let ms = inner.cfg.plan.renew_interval.as_millis() as u64;
                    return Step::Done(Ok(self.over_limit(rule, rules, ms.max(1))));
                }
                Step::Park { slot, rule_idx }
            }
        }
    }

    /// Register a parked request: every rule of it that cannot pay asks in
    /// the next batch; wake the renewal loop.
    #[allow(clippy::too_many_arguments)]
    fn register_wait(
        &self,
        rules: &RuleSet,
        m: &Matched,
        input: &CheckInput<'_>,
        cost: u64,
        rule_idx: usize,
        slot: &Arc<Slot>,
        t: u64,
    ) {
        let inner = &*self.inner;
        slot.waiting_cost.fetch_add(cost, Ordering::AcqRel);
        let mut wanted = inner.wanted.lock();
        wanted.push(slot.clone());
        for &ri in m.indices() {
            let other = &rules.rules[ri as usize];
            if other.shadow || ri as usize == rule_idx {
                continue;
            }
            if let Some(s) = self.slot_for(other, input.tenant, input.route) {
                if s.word.peek(t).is_none_or(|held| held < cost) {
                    s.waiting_cost.fetch_add(cost, Ordering::AcqRel);
                    wanted.push(s);
                }
            }
        }
        drop(wanted);
        inner.wake.notify_one();
        inner.metrics.waits.add(1);
    }

    /// The lease charge behind `check_fast` and `decide`: charge every
    /// non-shadow matched rule from its lease, or none. `Ok((min remaining, rule index))` or
    /// `Err(index of the first rule that could not pay)`.
    fn try_charge(
        &self,
        rules: &RuleSet,
        m: &Matched,
        input: &CheckInput<'_>,
        cost: u64,
        t: u64,
    ) -> Result<(u64, usize), usize> {
        let table = self.inner.table.pin();
        // (slot id, generation) of each charge, for an all-or-none refund.
        let mut taken: [(u64, u64); MAX_MATCHED] = [(0, 0); MAX_MATCHED];
        let mut min_remaining = u64::MAX;
        let mut min_rule = m.indices()[0] as usize;
        for j in 0..m.len() {
            let ri = m.indices()[j] as usize;
            let r = &rules.rules[ri];
            if r.shadow {
                continue;
            }
            let key = Lookup::of(r, input.tenant, input.route);
            let (slot_id, take) = match table.get(&key) {
                Some(slot) => (slot.id, slot.word.try_take(cost, t)),
                None => (0, Take::NoLease),
            };
            match take {
                Take::Taken {
                    generation,
                    remaining,
                } => {
                    taken[j] = (slot_id, generation);
                    if remaining < min_remaining {
                        min_remaining = remaining;
                        min_rule = ri;
                    }
                }
                Take::Short { .. } | Take::NoLease => {
                    // All or none: give back what this request took.
                    for (&rk_idx, &(slot_id, generation)) in
                        m.indices()[..j].iter().zip(&taken[..j])
                    {
                        let rk = &rules.rules[rk_idx as usize];
                        if rk.shadow {
                            continue;
                        }
                        let key = Lookup::of(rk, input.tenant, input.route);
                        if let Some(slot) = table.get(&key) {
                            if slot.id == slot_id {
                                slot.word.refund(generation, cost);
                            }
                        }
                    }
                    return Err(ri);
                }
            }
        }
        self.log_admission(rules, m, input, cost, t);
        Ok((
            if min_remaining == u64::MAX {
                0
            } else {
                min_remaining
            },
            min_rule,
        ))
    }

    /// Among the matched rules that cannot pay `cost` now, the one that
    /// asks to wait longest: (retry in ms, rule index). `first` is the rule
    /// already found denying with `first_wait_ns`.
    #[allow(clippy::too_many_arguments)]
    fn largest_retry(
        &self,
        rules: &RuleSet,
        m: &Matched,
        input: &CheckInput<'_>,
        cost: u64,
        t: u64,
        first: usize,
        first_wait_ns: u64,
    ) -> (u64, usize) {
        let table = self.inner.table.pin();
        let mut best = (first_wait_ns, first);
        for &ri in m.indices() {
            let r = &rules.rules[ri as usize];
            if r.shadow || ri as usize == first {
                continue;
            }
            let Some(slot) = table.get(&Lookup::of(r, input.tenant, input.route)) else {
                continue;
            };
            let dry = slot.dry_until_ns.load(Ordering::Acquire);
            let short = slot.word.peek(t).is_none_or(|held| held < cost);
            if short && dry > t && dry - t > best.0 {
                best = (dry - t, ri as usize);
            }
        }
        (best.0.div_ceil(1_000_000).max(1), best.1)
    }

    /// Test-only admission log: one line per charged (non-shadow) rule.
    fn log_admission(
        &self,
        rules: &RuleSet,
        m: &Matched,
        input: &CheckInput<'_>,
        cost: u64,
        t: u64,
    ) {
        let Some(log) = &self.inner.admission_log else {
            return;
        };
        let mut w = log.lock();
        for &ri in m.indices() {
            let r = &rules.rules[ri as usize];
            if !r.shadow {
                let _ = writeln!(
                    w,
                    "{t}\t{}\t{}\t{}\t{cost}",
                    r.id,
                    r.tenant.key_part(input.tenant),
                    r.route.key_part(input.route)
                );
            }
        }
    }

    /// Fail-open admission while the allocator is unreachable (SPEC §2 I3):
    /// every matched rule pays from its lease if it can, and an `open` rule
    /// that cannot pays from its key's emergency bucket. All or none.
    /// `Ok((min remaining, rule index))` or `Err(index of the rule that
    /// could not pay)`.
    fn try_charge_emergency(
        &self,
        rules: &RuleSet,
        m: &Matched,
        input: &CheckInput<'_>,
        cost: u64,
        t: u64,
    ) -> Result<(u64, usize), usize> {
        enum Paid {
            Lease(Arc<Slot>, u64),
            Emergency(Arc<Slot>),
        }
        let outage = self.inner.outage.load(Ordering::Acquire);
        let mut paid: Vec<Paid> = Vec::with_capacity(m.len());
        let mut min = (u64::MAX, m.indices()[0] as usize);
        let mut failed = None;
        for &ri in m.indices() {
            let r = &rules.rules[ri as usize];
            if r.shadow {
                continue;
            }
            let Some(slot) = self.slot_for(r, input.tenant, input.route) else {
                failed = Some(ri as usize);
                break;
            };
            if let Take::Taken {
                generation,
                remaining,
            } = slot.word.try_take(cost, t)
            {
                if remaining < min.0 {
                    min = (remaining, ri as usize);
                }
                paid.push(Paid::Lease(slot, generation));
                continue;
            }
            if r.fail_policy != FailPolicy::Open {
                failed = Some(ri as usize);
                break;
            }
            let log = self
                .inner
                .cfg
                .record_emergency
                .then_some(&self.inner.emergency_log);
            let took = slot.emergency_take(r, &self.inner.cfg.emergency, outage, cost, t, log);
            match took {
                Some(remaining) => {
                    if remaining < min.0 {
                        min = (remaining, ri as usize);
                    }
                    paid.push(Paid::Emergency(slot));
                }
                None => {
                    failed = Some(ri as usize);
                    break;
                }
            }
        }
        if let Some(ri) = failed {
            for p in paid {
                match p {
                    Paid::Lease(slot, generation) => {
                        slot.word.refund(generation, cost);
                    }
                    Paid::Emergency(slot) => slot.emergency_refund(cost, t),
                }
            }
            return Err(ri);
        }
        self.log_admission(rules, m, input, cost, t);
        Ok((if min.0 == u64::MAX { 0 } else { min.0 }, min.1))
    }

    /// Shadow rules decide and report, never deny, never refund.
    fn charge_shadow(
        &self,
        rules: &RuleSet,
        m: &Matched,
        input: &CheckInput<'_>,
        cost: u64,
        t: u64,
    ) -> Reason {
        let mut reason = Reason::Ok;
        if !m.any_shadow() {
            return reason;
        }
        for &ri in m.indices() {
            let r = &rules.rules[ri as usize];
            if !r.shadow {
                continue;
            }
            let key = Lookup::of(r, input.tenant, input.route);
            let take = self
                .inner
                .table
                .pin()
                .get(&key)
                .map(|s| s.word.try_take(cost, t));
            match take {
                Some(Take::Taken { .. }) => {}
                other => {
                    if let Some(slot) = self.slot_for(r, input.tenant, input.route) {
                        let dry = slot.dry_until_ns.load(Ordering::Acquire) > t;
                        if dry && matches!(other, Some(Take::Short { .. })) {
                            reason = Reason::ShadowOverLimit;
                            self.inner.metrics.shadow_over_limit.add(1);
                        } else {
                            slot.waiting_cost.fetch_add(cost, Ordering::AcqRel);
                            self.inner.wanted.lock().push(slot);
                            self.inner.wake.notify_one();
                        }
                    }
                }
            }
        }
        reason
    }

    /// Count an admission for every rule the request matched.
    #[inline]
    fn count_admitted(&self, rules: &RuleSet, m: &Matched) {
        let counters = self.inner.metrics.by_rule.load();
        if counters.version != rules.version {
            return;
        }
        for &i in m.indices() {
            if let Some((_, c)) = counters.rules.get(i as usize) {
                c.allowed.add(1);
            }
        }
    }

    /// Count one result for one rule.
    fn count_rule(&self, rule_id: &str, which: impl Fn(&RuleCounters) -> &Counter) {
        if let Some(c) = self.inner.metrics.by_rule.load().get(rule_id) {
            which(c).add(1);
        }
    }

    fn over_limit(&self, rule: &Rule, rules: &RuleSet, retry_after_ms: u64) -> CheckResponse {
        self.count_rule(&rule.id, |c| &c.over_limit);
        CheckResponse {
            allowed: false,
            remaining: 0,
            retry_after_ms,
            rule_id: rule.id.clone(),
            applied_rule_version: rules.version,
            reason: Reason::OverLimit as i32,
        }
    }

    fn fail_policy(
        &self,
        rule: &Rule,
        rules: &RuleSet,
        why: &str,
    ) -> Result<CheckResponse, CheckError> {
        let m = &self.inner.metrics;
        self.count_rule(&rule.id, |c| &c.failure_mode_denied);
        match rule.fail_policy {
            FailPolicy::Closed => {
                m.unavailable.add(1);
                m.closed_unavailable.add(1);
                Err(CheckError::Unavailable(format!(
                    "rule {}: {why}; fail_policy closed",
                    rule.id
                )))
            }
            FailPolicy::Open | FailPolicy::LeaseOnly => {
                m.failure_mode_denied.add(1);
                Ok(CheckResponse {
                    allowed: false,
                    remaining: 0,
                    retry_after_ms: self.inner.cfg.fetch_timeout.as_millis() as u64,
                    rule_id: rule.id.clone(),
                    applied_rule_version: rules.version,
                    reason: Reason::FailureModeDenied as i32,
                })
            }
        }
    }

    /// The slot of a rule's key, created if missing (None when the table is full).
    fn slot_for(&self, rule: &Rule, tenant: &str, route: &str) -> Option<Arc<Slot>> {
        let (tp, rp) = (rule.tenant.key_part(tenant), rule.route.key_part(route));
        let key = Lookup(KeyRef::new(&rule.id, tp, rp));
        let table = self.inner.table.pin();
        if let Some(s) = table.get(&key) {
            return Some(s.clone());
        }
        if table.len() >= self.inner.cfg.max_keys {
            return None;
        }
        let slot = table
            .get_or_insert_with(key.0.to_key_id(), || Arc::new(Slot::new(&rule.id, tp, rp)))
            .clone();
        Some(slot)
    }

    // -----------------------------------------------------------------------
    // Renewal loop

    /// The tokio driver of the renewal side: plan at every tick or wake,
    /// send each batch on its own task, feed the outcome back.
    async fn renewal_loop(self) {
        let inner = &*self.inner;
        let mut tick = tokio::time::interval(inner.cfg.plan.renew_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        while !inner.stop.load(Ordering::Acquire) {
            let woken = tokio::select! {
                _ = tick.tick() => false,
                _ = inner.wake.notified() => true,
                _ = inner.stopped.notified() => break,
            };
            if let Some(batch) = self.poll(self.now(), woken) {
                let me = self.clone();
                tokio::spawn(async move { me.send(batch).await });
            }
        }
    }

    /// Sans-IO: plan every key at `t` and return the batch to send, if any
    /// (renewals, releases, or a heartbeat). The driver delivers it and calls
    /// [`Agent::on_reply`] or [`Agent::on_failure`] with its sequence number.
    pub fn poll_renewal(&self, t: u64) -> Option<LeaseBatch> {
        self.poll(t, false)
    }

    /// Sans-IO: like [`Agent::poll_renewal`] after a wake-up by waiting
    /// requests: plans only the keys they wait for (O(waiting keys), not
    /// O(keys held)); releases and refreshes wait for the next tick.
    pub fn poll_renewal_woken(&self, t: u64) -> Option<LeaseBatch> {
        self.poll(t, true)
    }

    fn poll(&self, t: u64, woken: bool) -> Option<LeaseBatch> {
        let inner = &*self.inner;
        let (items, slots) = self.plan_all(t, woken);
        let mut pending = inner.pending.lock();
        // Forget abandoned batches whose grants have surely expired.
        let keep_ns = 2 * inner.cfg.lease_ttl.as_nanos() as u64;
        pending.retain(|_, p| !p.abandoned || p.sent_ns.saturating_add(keep_ns) > t);
        let heartbeat_due = (t.saturating_sub(inner.last_sent_ns.load(Ordering::Acquire))
            >= inner.cfg.heartbeat.as_nanos() as u64
            || inner.rules.load().is_none()
            || !inner.connected.load(Ordering::Acquire))
            && pending.values().all(|p| p.abandoned);
        if items.is_empty() && !heartbeat_due {
            return None;
        }
        inner.last_sent_ns.store(t, Ordering::Release);
        let seq = inner.seq.fetch_add(1, Ordering::AcqRel) + 1;
        for s in &slots {
            if let Some(f) = s.st.lock().in_flight.as_mut() {
                f.seq = seq;
            }
        }
        let batch = self.batch(seq, items.clone(), inner.cfg.lease_ttl.as_millis() as u64);
        pending.insert(
            seq,
            Pending {
                sent_ns: t,
                items,
                slots,
                abandoned: false,
            },
        );
        Some(batch)
    }

    fn batch(&self, seq: u64, items: Vec<LeaseItem>, ttl_ms: u64) -> LeaseBatch {
        let inner = &*self.inner;
        LeaseBatch {
            header: Some(RequestHeader {
                agent_id: inner.cfg.agent_id.clone(),
                incarnation: inner.incarnation.load(Ordering::Acquire),
                seq,
                protocol_version: PROTOCOL_VERSION,
                rules_version: inner.rules.load().as_ref().map(|r| r.version).unwrap_or(0),
            }),
            ttl_ms,
            items,
        }
    }

    /// Plan every key at `t`: the items of the next batch and their slots.
    fn plan_all(&self, t: u64, woken: bool) -> (Vec<LeaseItem>, Vec<Arc<Slot>>) {
        let inner = &*self.inner;
        let rules = inner.rules.load_full();
        let mut items = std::mem::take(&mut *inner.late_releases.lock());
        let version = rules.as_ref().map_or(0, |r| r.version);
        let mut ctx = PlanCtx {
            rules_changed: !woken
                && inner.planned_version.swap(version, Ordering::AcqRel) != version,
            rules,
            idle_ns: inner.cfg.plan.idle_release.as_nanos() as u64,
            lead_ns: (4 * inner.cfg.plan.renew_interval.as_nanos() as u64)
                .max(inner.cfg.plan.low_water.as_nanos() as u64),
            releases: Vec::new(),
            renews: Vec::new(),
            forget: Vec::new(),
        };
        let table = inner.table.pin();
        if woken {
            // Only the keys requests wait for (releases wait for a tick).
            let wanted = std::mem::take(&mut *inner.wanted.lock());
            let mut seen = std::collections::HashSet::with_capacity(wanted.len());
            for slot in wanted {
                if seen.insert(slot.id) {
                    self.plan_slot(None, &slot, t, &mut ctx);
                }
            }
        } else {
            inner.wanted.lock().clear();
            for (key, slot) in table.iter() {
                self.plan_slot(Some(key), slot, t, &mut ctx);
            }
        }
        let PlanCtx {
            mut releases,
            mut renews,
            forget,
            ..
        } = ctx;
        for k in forget {
            table.remove(&k);
        }
        // Items in key order, whatever the table's hash order: the
        // allocator's fair shares then do not depend on a per-process seed
        // (the simulator replays exactly).
        let order = |a: &LeaseItem, b: &LeaseItem| {
            (&a.rule_id, &a.tenant, &a.route).cmp(&(&b.rule_id, &b.tenant, &b.route))
        };
        releases.sort_by(order);
        items.extend(releases);
        renews.sort_by(|(a, _), (b, _)| order(a, b));
        let mut slots = Vec::with_capacity(renews.len());
        for (item, slot) in renews {
            items.push(item);
            slots.push(slot);
        }
        (items, slots)
    }

    /// Plan one key at `t` (see `plan_all`). `key` is `None` on a wake-up
    /// pass, which never releases.
    fn plan_slot(&self, key: Option<&KeyId>, slot: &Arc<Slot>, t: u64, ctx: &mut PlanCtx) {
        let inner = &*self.inner;
        // A quiet key (nothing spent, denied or waiting since the last
        // visit) is skipped until the planner's answer can change: a
        // tick costs O(active keys), not O(keys held).
        let (gen, tokens) = slot.word.load();
        let packed = crate::lease_table::pack(gen, tokens);
        if !ctx.rules_changed
            && t < slot.quiet_until_ns.load(Ordering::Acquire)
            && slot.seen_word.load(Ordering::Acquire) == packed
            && slot.waiting_cost.load(Ordering::Acquire) == 0
            && slot.denied.load(Ordering::Relaxed) == 0
        {
            return;
        }
        let mut st = slot.st.lock();
        if gen == st.generation {
            let consumed = st.baseline.saturating_sub(tokens);
            st.usage.since_tick += consumed;
        }
        // Demand, not just admissions, sizes the next lease.
        st.usage.denied_since_tick += slot.denied.swap(0, Ordering::Relaxed);
        st.baseline = tokens;
        st.usage.tick(0, t, inner.cfg.plan.ewma_tau);
        let waiting = slot.waiting_cost.load(Ordering::Acquire);
        if waiting > 0 {
            st.usage.last_active_ns = t;
        }
        let rule = ctx.rules.as_ref().and_then(|r| r.get(&slot.rule_id));
        let deadline = slot.word.deadline_ns();
        let decision = match rule {
            None => Plan::Release,
            Some(rule) => plan(
                &inner.cfg.plan,
                &st.usage,
                KeyNow {
                    held: if t < deadline { tokens } else { 0 },
                    valid: t < deadline && st.lease_id != 0,
                    deadline_ns: deadline,
                    burst: rule.burst,
                    waiting_cost: waiting,
                    dry_until_ns: slot.dry_until_ns.load(Ordering::Acquire),
                    in_flight: st.in_flight.is_some(),
                },
                t,
            ),
        };
        // Until when this key's plan cannot change without activity: its
        // idle release, the end of a dry spell, its refresh lead, its
        // deadline (each only if still ahead).
        let quiet_until = if matches!(decision, Plan::Wait) && st.in_flight.is_none() {
            let dry = slot.dry_until_ns.load(Ordering::Acquire);
            [
                st.usage.last_active_ns.saturating_add(ctx.idle_ns + 1),
                dry,
                deadline.saturating_sub(ctx.lead_ns),
                deadline,
            ]
            .into_iter()
            .filter(|&x| x > t)
            .min()
            .unwrap_or(0)
        } else {
            0
        };
        slot.quiet_until_ns.store(quiet_until, Ordering::Release);
        slot.seen_word.store(packed, Ordering::Release);
        match decision {
            Plan::Wait => {}
            Plan::Renew { want } => {
                // Cut a new generation at the report: a refund of a
                // charge taken before it must not come back after the
                // allocator counted that charge as spent.
                let (at_cut, new_gen) = slot.word.cut();
                let spent = if gen == st.generation {
                    st.usage.since_tick += tokens.saturating_sub(at_cut);
                    st.granted.saturating_sub(at_cut)
                } else {
                    0
                };
                st.generation = new_gen;
                st.baseline = at_cut;
                let item = LeaseItem {
                    rule_id: slot.rule_id.clone(),
                    tenant: slot.tenant.clone(),
                    route: slot.route.clone(),
                    kind: ItemKind::Renew as i32,
                    lease_id: st.lease_id,
                    spent,
                    want,
                };
                st.in_flight = Some(InFlight {
                    seq: 0,
                    generation: new_gen,
                    tokens_at_send: at_cut,
                    kind: ItemKind::Renew,
                });
                ctx.renews.push((item, slot.clone()));
            }
            Plan::Release => {
                // A wake-up pass never releases: the next tick does.
                let Some(key) = key else { return };
                if st.in_flight.is_some() {
                    return;
                }
                // Keep a key whose emergency bucket serves the current
                // outage: dropping it would start a full bucket again.
                let outage = inner.outage.load(Ordering::Acquire);
                if inner.down.load(Ordering::Acquire)
                    && slot
                        .emergency
                        .lock()
                        .as_ref()
                        .is_some_and(|(o, _)| *o == outage)
                {
                    return;
                }
                let (left, new_gen) = slot.word.retire();
                st.generation = new_gen;
                if st.lease_id != 0 {
                    let spent = st.granted.saturating_sub(left);
                    ctx.releases.push(slot.release_item(st.lease_id, spent));
                    if deadline <= t {
                        inner.metrics.tokens_expired_unused.add(left);
                    } else {
                        inner.metrics.tokens_released.add(left);
                    }
                }
                st.lease_id = 0;
                ctx.forget.push(key.clone());
            }
        }
    }

    #[tracing::instrument(level = "debug", name = "renewal", skip_all, fields(seq, items = batch.items.len()))]
    async fn send(&self, batch: LeaseBatch) {
        let inner = &*self.inner;
        let Some(transport) = inner.transport.as_ref() else {
            return;
        };
        let seq = batch.header.as_ref().map(|h| h.seq).unwrap_or(0);
        let mut result = Err(String::new());
        // Retries reuse the sequence number: the allocator answers a
        // duplicate from its cache and never grants twice.
        for _ in 0..2 {
            inner.metrics.messages.add(1);
            inner
                .metrics
                .record_message_rules(batch.items.iter().map(|i| i.rule_id.as_str()));
            let call = transport.lease(batch.clone());
            result = match tokio::time::timeout(inner.cfg.fetch_timeout, call).await {
                Ok(r) => r,
                Err(_) => Err("allocator call timed out".into()),
            };
            if result.is_ok() || inner.stop.load(Ordering::Acquire) {
                break;
            }
        }
        match result {
            Ok(reply) => self.on_reply(self.now(), seq, reply),
            Err(why) => self.on_failure(self.now(), seq, &why),
        }
    }

    /// Sans-IO: the reply to batch `seq` arrived at `t`. A reply to a batch
    /// given up on only releases the fresh tokens it granted; an unknown or
    /// repeated reply is ignored.
    pub fn on_reply(&self, t: u64, seq: u64, reply: LeaseReply) {
        let inner = &*self.inner;
        let Some(p) = inner.pending.lock().remove(&seq) else {
            return;
        };
        inner
            .metrics
            .record_renewal(Duration::from_nanos(t.saturating_sub(p.sent_ns)));
        inner.down.store(false, Ordering::Release);
        if !inner.connected.swap(true, Ordering::AcqRel) {
            tracing::info!("allocator reachable");
        }
        if reply.grants.len() != p.items.len() || reply.seq != seq {
            tracing::error!(
                items = p.items.len(),
                grants = reply.grants.len(),
                seq,
                reply_seq = reply.seq,
                "allocator reply does not match the request; ignoring what does not"
            );
        }
        self.apply_reply(reply, seq, &p.items, &p.slots, p.sent_ns, t);
        if !p.abandoned {
            self.settle(seq, &p.slots);
        }
    }

    /// Sans-IO: batch `seq` failed (an error, or no reply within
    /// `fetch_timeout`) at `t`. The keys are free to ask again, releases go
    /// back to the queue, and fail policies apply until a call succeeds.
    pub fn on_failure(&self, _t: u64, seq: u64, why: &str) {
        let inner = &*self.inner;
        let mut pending = inner.pending.lock();
        let Some(p) = pending.get_mut(&seq).filter(|p| !p.abandoned) else {
            return;
        };
        p.abandoned = true;
        // Releases that did not get through return to the queue.
        let releases: Vec<LeaseItem> = p
            .items
            .iter()
            .filter(|i| i.kind == ItemKind::Release as i32)
            .cloned()
            .collect();
        let slots = p.slots.clone();
        drop(pending);
        inner.metrics.rpc_errors.add(1);
        if !inner.down.swap(true, Ordering::AcqRel) {
            inner.outage.fetch_add(1, Ordering::AcqRel);
        }
        if inner.connected.swap(false, Ordering::AcqRel) {
            tracing::warn!(%why, "allocator unreachable; serving from leases, then fail policies");
        }
        inner.late_releases.lock().extend(releases);
        self.settle(seq, &slots);
    }

    /// Batch `seq` is answered or given up: its keys may ask again and the
    /// requests parked on them re-check.
    fn settle(&self, seq: u64, slots: &[Arc<Slot>]) {
        for s in slots {
            let mut st = s.st.lock();
            if st.in_flight.is_some_and(|f| f.seq == seq) {
                st.in_flight = None;
            }
            drop(st);
            s.quiet_until_ns.store(0, Ordering::Release);
            s.waiting_cost.store(0, Ordering::Release);
            s.parked.notify_waiters();
        }
    }

    fn apply_reply(
        &self,
        reply: LeaseReply,
        seq: u64,
        items: &[LeaseItem],
        slots: &[Arc<Slot>],
        sent_ns: u64,
        t: u64,
    ) {
        let inner = &*self.inner;
        let mine = inner.incarnation.load(Ordering::Acquire);
        if reply.holder_incarnation > mine {
            // The allocator knows this agent id under a higher incarnation
            // (our clock stepped back across a restart): take a higher one,
            // so our batches are not refused as stale.
            let next = reply.holder_incarnation + 1;
            if inner
                .incarnation
                .compare_exchange(mine, next, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                tracing::warn!(
                    from = mine,
                    to = next,
                    "raised the agent incarnation above the allocator's record"
                );
            }
        }
        if let Some(pb) = &reply.rules {
            let current = inner.rules.load().as_ref().map(|r| r.version).unwrap_or(0);
            if pb.version > current {
                match RuleSet::from_proto(pb) {
                    Ok(rs) => {
                        tracing::info!(
                            version = rs.version,
                            rules = rs.rules.len(),
                            "adopted rules from the allocator"
                        );
                        let counters =
                            RuleCounterSet::for_rules(&rs, &inner.metrics.by_rule.load());
                        inner.metrics.by_rule.store(Arc::new(counters));
                        inner.rules.store(Some(Arc::new(rs)));
                    }
                    Err(errs) => {
                        tracing::error!(errors = errs.len(), first = %errs[0], "allocator sent invalid rules; keeping the last good ones")
                    }
                }
            }
        }
        let version = inner.rules.load().as_ref().map(|r| r.version).unwrap_or(0);
        let renews = items
            .iter()
            .zip(reply.grants.iter())
            .filter(|(i, _)| i.kind == ItemKind::Renew as i32)
            .map(|(_, g)| g);
        for (grant, slot) in renews.zip(slots) {
            self.install(slot, grant, seq, sent_ns, version, t);
        }
    }

    fn install(&self, slot: &Slot, g: &Grant, seq: u64, sent_ns: u64, version: u64, t: u64) {
        let inner = &*self.inner;
        let mut st = slot.st.lock();
        let release = |lease_id: u64, spent: u64| {
            if lease_id != 0 {
                inner
                    .late_releases
                    .lock()
                    .push(slot.release_item(lease_id, spent));
            }
        };
        let Some(f) = st
            .in_flight
            .filter(|f| f.seq == seq && f.kind == ItemKind::Renew)
        else {
            // A grant for a request we gave up on. Fresh tokens go back; a
            // grant that carried our old lease is left to expire, because
            // the old lease may still be spending that part.
            if g.carried == 0 {
                release(g.lease_id, 0);
            }
            return;
        };
        st.in_flight = None;
        if g.carried > g.tokens {
            tracing::error!(rule = %slot.rule_id, tokens = g.tokens, carried = g.carried, "malformed grant ignored");
            return;
        }
        if inner.stop.load(Ordering::Acquire) {
            // Shutting down: the lease word is retired; the grant expires.
            return;
        }
        let status = GrantStatus::try_from(g.status).unwrap_or(GrantStatus::BadItem);
        match status {
            GrantStatus::Granted => {}
            GrantStatus::Stale | GrantStatus::Unsupported => return,
            other => {
                st.refused = Some((other, g.detail.clone()));
                slot.dry_until_ns
                    .store(t + 1_000_000_000, Ordering::Release);
                return;
            }
        }
        st.refused = None;
        // A regional allocator tells whether its own parent is reachable; a
        // cut-off region's agents apply fail policies once its pool is dry.
        if g.parent_unreachable {
            if !inner.parent_down.swap(true, Ordering::AcqRel) {
                inner.outage.fetch_add(1, Ordering::AcqRel);
                tracing::warn!("the regional allocator reports its parent unreachable");
            }
        } else if inner.parent_down.swap(false, Ordering::AcqRel) {
            tracing::info!("the regional allocator reaches its parent again");
        }
        slot.holders
            .store(u64::from(g.holders.max(1)), Ordering::Release);
        // A grant we cannot use: give it back. If it carried the old lease,
        // retire that lease first, so that what we report as spent is final.
        let give_back = |st: &mut SlotState| {
            if g.carried == 0 {
                release(g.lease_id, 0);
            } else if st.generation == f.generation {
                let (left, new_gen) = slot.word.retire();
                let spent_since = f.tokens_at_send.saturating_sub(left).min(g.carried);
                release(g.lease_id, spent_since);
                st.generation = new_gen;
                st.baseline = 0;
                st.lease_id = 0;
                st.granted = 0;
            } else {
                // The generation the carry came from is already dead.
                release(g.lease_id, g.carried);
            }
        };
        if g.rule_version > version {
            // Never spend a grant stamped with a rule version we do not enforce.
            give_back(&mut st);
            return;
        }
        // A regional allocator still opening the key upstream: the waiting
        // requests keep waiting for the next ask (after the hint) instead
        // of being denied — a cold key pays the round trip to the top, once.
        let opening = g.opening
            && g.tokens == 0
            && g.retry_after_ms < inner.cfg.fetch_timeout.as_millis() as u64;
        slot.opening.store(opening, Ordering::Release);
        let dry = if g.retry_after_ms > 0 {
            t.saturating_add(g.retry_after_ms.saturating_mul(1_000_000))
        } else {
            0
        };
        slot.dry_until_ns.store(dry, Ordering::Release);
        if g.lease_id == 0 {
            // Nothing leased and nothing carried: the lease we named is
            // unknown to the allocator (rolled by a lost reply, expired, or
            // a predecessor's); it stays usable under its own deadline.
            return;
        }
        // deadline = first send + TTL * (1 - 2 rho) - epsilon
        let ttl_ns = g.ttl_ms.saturating_mul(1_000_000);
        let deadline = use_by_ns(sent_ns, ttl_ns, inner.cfg.epsilon.as_nanos() as u64);
        if t >= deadline {
            give_back(&mut st);
            return;
        }
        let same_lease = st.generation == f.generation;
        let old_deadline = slot.word.deadline_ns();
        let (old_seen, new_gen, new_tokens) = slot.word.install(deadline, |cur| {
            if same_lease {
                // Carried = what the lease held at the cut; what was spent
                // since then comes out of the new lease.
                let spent_since = f.tokens_at_send.saturating_sub(cur);
                g.tokens.saturating_sub(spent_since.min(g.carried))
            } else {
                // The generation the carry came from is dead: keep only the
                // fresh tokens.
                g.tokens - g.carried
            }
        });
        if same_lease {
            st.usage.since_tick += st.baseline.saturating_sub(old_seen);
        }
        if g.carried == 0 && old_deadline <= t && st.lease_id != 0 {
            // The old lease ran out before it was renewed: what it still held
            // is lost.
            inner.metrics.tokens_expired_unused.add(old_seen);
        }
        st.lease_id = g.lease_id;
        st.granted = g.tokens;
        st.generation = new_gen;
        st.baseline = new_tokens;
        inner.metrics.tokens_leased.add(g.tokens - g.carried);
    }

    /// Stop the renewal loop, retire every lease and release the unused
    /// tokens to the allocator (bounded by `fetch_timeout`).
    pub async fn shutdown(&self) {
        let inner = &*self.inner;
        inner.stop.store(true, Ordering::Release);
        inner.stopped.notify_waiters();
        let mut items = std::mem::take(&mut *inner.late_releases.lock());
        let mut released = 0;
        for (_, slot) in inner.table.pin().iter() {
            let mut st = slot.st.lock();
            let (left, new_gen) = slot.word.retire();
            st.generation = new_gen;
            if st.lease_id != 0 {
                released += left;
                items.push(slot.release_item(st.lease_id, st.granted.saturating_sub(left)));
            }
        }
        if let Some(log) = &inner.admission_log {
            let _ = log.lock().flush();
        }
        if items.is_empty() {
            return;
        }
        let seq = inner.seq.fetch_add(1, Ordering::AcqRel) + 1;
        let n = items.len();
        let batch = self.batch(seq, items, 0);
        let Some(transport) = inner.transport.as_ref() else {
            return;
        };
        match tokio::time::timeout(inner.cfg.fetch_timeout, transport.lease(batch)).await {
            Ok(Ok(_)) => {
                tracing::info!(leases = n, tokens = released, "released leases on shutdown")
            }
            Ok(Err(e)) => {
                tracing::warn!(%e, "could not release leases on shutdown; they expire on their own")
            }
            Err(_) => tracing::warn!("release on shutdown timed out; leases expire on their own"),
        }
    }

    /// Flush the test-only admission log.
    pub fn flush_admission_log(&self) {
        if let Some(log) = &self.inner.admission_log {
            let _ = log.lock().flush();
        }
    }
}

#[cfg(test)]
mod tests;

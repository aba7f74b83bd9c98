//! The agent: answers checks from leased tokens and keeps leases topped up
//! in the background.
//!
//! Three parts (docs/architecture.md, "The agent"):
//!
//! * the **lease table** ([`crate::lease_table`]): one [`Slot`] per key,
//!   atomics only; the request fast path ([`Agent::check_fast`]) matches
//!   rules and takes tokens with one CAS per rule, no lock;
//! * the **core** ([`crate::core::AgentCore`]): a single-owner sans-IO state
//!   machine for renewals, batches, retries, timeouts, outages and
//!   emergency buckets, behind one mutex that the fast path never takes;
//! * **drivers**: the tokio driver ([`crate::driver`], started by
//!   [`Agent::start`]) and the simulator pump the same core.
//!
//! Only when a lease is missing or short does a request leave the fast
//! path: under the core's lock it asks for the key in the next batch (or
//! applies a fail policy), then waits (bounded by `fetch_timeout`) for the
//! key's batch to settle and checks again.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Mutex, MutexGuard};
use quotalease_model::matching::{Matched, TooManyMatches, MAX_MATCHED};
use quotalease_model::protocol::MAX_ID_BYTES;
use quotalease_model::rules::{FailPolicy, Rule, RuleSet};
use quotalease_proto::v1::{CheckResponse, Reason};
use tokio::sync::Notify;

use crate::core::{AgentCore, CoreConfig, Event};
pub use crate::core::{EmergencyConfig, EmergencyOpened};
use crate::driver::Pumped as _;
pub use crate::handle::KeyHandle;
use crate::handle::{take_all, Charges};
use crate::idempotency::{Claim, ReplayCache};
use crate::lease_table::Take;
pub use crate::lease_table::{KeyId, KeyRef, Lookup, Slot, SlotRef, Table};
use crate::metrics::{self, AgentMetrics, Counter, RuleCounterSet, RuleCounters};
use crate::shapes;
use crate::snapshot::{RulesCell, Snapshot};
use crate::transport::Transport;

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
    /// The key's global remaining tokens as this agent estimates them, for
    /// the most constrained rule charged
    /// ([`crate::lease_table::SlotHead::global_remaining`]).
    pub remaining: u64,
    /// Index (in the rule set) of that rule; None when no rule matched.
    pub rule_index: Option<usize>,
    /// Rule set version applied.
    pub rule_version: u64,
    /// OK, NO_RULE or SHADOW_OVER_LIMIT.
    pub reason: Reason,
}

impl FastAdmit {
    /// Admitted because no rule matched.
    fn no_rule(rule_version: u64) -> Self {
        Self {
            remaining: 0,
            rule_index: None,
            rule_version,
            reason: Reason::NoRule,
        }
    }

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

/// The rules a request matched (the one matcher, [`RuleSet::match_rules`]);
/// too many is an invalid `tenant_id`. A check that matches no rate rule
/// but a rule limiting requests in flight is invalid too (SPEC §4: such a
/// rule is served by acquiring a permit, never by a check).
#[inline]
fn match_rules(
    rules: &RuleSet,
    domain: Option<&str>,
    tenant: &str,
    route: &str,
) -> Result<Matched, CheckError> {
    let m = rules
        .match_rules(domain, tenant, route)
        .map_err(|e: TooManyMatches| CheckError::Invalid {
            field: TooManyMatches::FIELD,
            reason: e.to_string(),
        })?;
    if m.is_empty() && !rules.permit_rules.is_empty() {
        concurrency_only(rules, domain, tenant, route)?;
    }
    Ok(m)
}

/// The error for a check whose request only rules limiting requests in
/// flight select; `Ok` when none does.
#[cold]
fn concurrency_only(
    rules: &RuleSet,
    domain: Option<&str>,
    tenant: &str,
    route: &str,
) -> Result<(), CheckError> {
    let first = rules
        .permit_rules
        .iter()
        .find(|p| p.applies(domain, tenant, route));
    match first {
        None => Ok(()),
        Some(p) => Err(CheckError::Invalid {
            field: "route_id",
            reason: format!(
                "rule {} limits requests in flight only (concurrency): acquire a permit; a check charges rates",
                p.id
            ),
        }),
    }
}

/// The rule (by index) whose lease could not pay, and its slot if the
/// table holds one.
type Unpaid = (usize, Option<Slot>);

/// How long a request of `cost` denied on `slot` (a key of `rule`) at `t`
/// should wait: until the allocator said the bucket has more
/// (`dry_until`), and, for a lease that carries a rate, at least until its
/// own refill holds `cost` (the allocator's hint to a holder of a rate is
/// about its own bucket, which the holders' rates may leave empty: a `1/m`
/// rule's single holder waits a minute, not the allocator's economy wait).
/// The refill part is at most what the rule's rate takes to refill `cost`
/// (what an ideal bucket says from empty): the holder's refill runs slower
/// by the clock-drift margin, a safety margin not passed on to clients.
///
/// Without a lease that refills, `dry_until` is only when to ask the
/// allocator again (at most its economy wait), not when a token exists:
/// when the allocator also reported the bucket empty beyond what this
/// agent holds, the wait is what the rule's rate takes to refill `cost`,
/// as an ideal bucket from empty says (a drained `1/m` bucket told its
/// clients `Retry-After: 1`, a minute early).
fn denial_wait_ns(slot: &crate::lease_table::SlotHead, rule: &Rule, cost: u64, t: u64) -> u64 {
    let dry = slot.dry_until().saturating_sub(t);
    let ideal = u128::from(cost) * u128::from(rule.rate.period_s) * 1_000_000_000
        / u128::from(rule.rate.tokens.max(1));
    let ideal = u64::try_from(ideal).unwrap_or(u64::MAX);
    let own = match slot.word.refill_wait_ns(cost, t) {
        Some(local) => local.min(ideal),
        None if slot.global_remaining(slot.word.peek(t).unwrap_or(0), u64::MAX) < cost => ideal,
        None => 0,
    };
    let wait = dry.max(own);
    // No token is further than an ideal bucket from empty says, unless the
    // allocator knows of a longer wait (a restart's): the allocator's hint
    // counts from when its answer was installed, which a request that read
    // its clock before can overshoot by milliseconds (1/d said a day and
    // 4 ms), and an economy wait is when to ask, not when tokens exist.
    if wait > ideal && wait - ideal <= 1_000_000_000 {
        ideal
    } else {
        wait
    }
}

/// Count an admission for every rule (by index) a request matched.
#[inline]
fn count_admitted(
    counters: &RuleCounterSet,
    matched: impl IntoIterator<Item = impl std::borrow::Borrow<u32>>,
) {
    for i in matched {
        let i = *i.borrow();
        if let Some((_, c)) = counters.rules.get(i as usize) {
            c.allowed.add(1);
        }
    }
}

/// Whether an answer may be replayed to a retry of the same request id.
/// Answers that only say the allocator was out of reach (`UNAVAILABLE`,
/// `FAILURE_MODE_DENIED`) are not: a retry after the outage is decided
/// again. Everything that charged tokens is.
fn replayable(answer: &Result<CheckResponse, CheckError>) -> bool {
    match answer {
        Err(CheckError::Unavailable(_)) => false,
        Err(CheckError::Invalid { .. }) => true,
        Ok(r) => {
            r.reason != Reason::FailureModeDenied as i32 && r.reason != Reason::Starting as i32
        }
    }
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
    /// Per-process nonce sent beside the agent id (SPEC §8).
    instance: u64,
    /// The renewal task died: the agent can no longer renew and is not
    /// ready (`/readyz`), whatever else holds.
    renewal_dead: AtomicBool,
    /// None when a driver moves the batches itself (the simulator).
    transport: Option<Arc<dyn Transport>>,
    rules: Arc<RulesCell>,
    table: Arc<Table>,
    metrics: Arc<AgentMetrics>,
    /// The single-owner core; the fast path never takes this lock.
    core: Mutex<AgentCore>,
    /// Wakes the tokio driver (a request waits for a key).
    wake: Notify,
    /// Requests parked on a key's next grant wait on the waker of its
    /// stripe ([`Inner::parked_on`]); a wake-up for another key of the
    /// stripe only makes them look again (they wait on the key's settle
    /// count). Striped rather than one per key: a waker per key held
    /// would be most of a key's bytes.
    parked: Box<[Notify]>,
    stop: AtomicBool,
    stopped: Notify,
    /// Emergency buckets opened (only with `record_emergency`), collected
    /// from the core's events by the tokio driver.
    emergency_log: Mutex<Vec<EmergencyOpened>>,
    replays: ReplayCache<Result<CheckResponse, CheckError>>,
    admission_log: Option<Mutex<BufWriter<File>>>,
    /// The permits of concurrency rules (started with the tokio driver).
    permits: std::sync::OnceLock<crate::permit_driver::Permits>,
}

/// Wakers for parked requests (see `Inner::parked`).
const PARKED_STRIPES: usize = 64;

impl Inner {
    /// The waker requests parked on `slot` wait on.
    fn parked_on(&self, slot: &Slot) -> &Notify {
        &self.parked[(slot.addr() >> 4) % self.parked.len()]
    }
}

/// A running agent. Cheap to clone.
#[derive(Clone)]
pub struct Agent {
    inner: Arc<Inner>,
}

impl crate::driver::Pumped for Agent {
    fn core(&self) -> MutexGuard<'_, AgentCore> {
        self.inner.core.lock()
    }

    fn now(&self) -> u64 {
        self.inner.cfg.clock.now()
    }

    fn fetch_timeout(&self) -> Duration {
        self.inner.cfg.fetch_timeout
    }

    fn note_event(&self, ev: Event) {
        match ev {
            Event::Settled(slot) => self.inner.parked_on(&slot).notify_waiters(),
            Event::EmergencyOpened(e) => self.inner.emergency_log.lock().push(e),
        }
    }

    fn stopping(&self) -> bool {
        self.inner.stop.load(Ordering::Acquire)
    }

    fn wake_and_stop(&self) -> (&Notify, &Notify) {
        (&self.inner.wake, &self.inner.stopped)
    }

    fn metrics(&self) -> &AgentMetrics {
        &self.inner.metrics
    }

    /// The renewal side is gone: not ready from now on, counted and logged.
    fn renewal_died(&self, why: &str) {
        let inner = &*self.inner;
        inner.metrics.renewal_task_failures.add(1);
        inner.renewal_dead.store(true, Ordering::Release);
        tracing::error!(%why, "renewal task died; the agent is not ready and serves only what it holds");
    }
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
    /// Start an agent and its tokio driver on the current runtime.
    /// `bootstrap` rules (e.g. from `--rules`) are used until the
    /// allocator sends its own.
    pub fn start(
        cfg: AgentConfig,
        transport: Arc<dyn Transport>,
        bootstrap: Option<RuleSet>,
    ) -> std::io::Result<Agent> {
        let agent = Self::new(cfg, Some(transport.clone()), bootstrap)?;
        let permits =
            crate::permit_driver::Permits::start(agent.permits_config(), transport.clone());
        let _ = agent.inner.permits.set(permits);
        let bg = agent.clone();
        let task = tokio::spawn(async move { crate::driver::run(bg, transport).await });
        // A driver that dies (a panic is a bug) must not leave an agent that
        // looks healthy while its leases run dry.
        let watcher = agent.clone();
        tokio::spawn(async move {
            if let Err(e) = task.await {
                if e.is_panic() {
                    watcher.renewal_died("the renewal driver panicked");
                }
            }
        });
        Ok(agent)
    }

    /// An agent without a driver: the caller pumps [`Agent::core`] (the
    /// simulator does; [`Agent::start`] runs the tokio driver).
    pub fn new(
        cfg: AgentConfig,
        transport: Option<Arc<dyn Transport>>,
        bootstrap: Option<RuleSet>,
    ) -> std::io::Result<Agent> {
        cfg.validate()
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
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
        let instance = cfg
            .instance
            .unwrap_or_else(quotalease_proto::random_instance);
        let table = Arc::new(Table::new());
        let metrics = Arc::new(AgentMetrics::default());
        let rules = Arc::new(RulesCell::new(bootstrap, &metrics));
        let core = AgentCore::new(
            CoreConfig {
                agent_id: cfg.agent_id.clone(),
                instance,
                incarnation,
                lease_ttl: cfg.lease_ttl,
                plan: cfg.plan,
                fetch_timeout: cfg.fetch_timeout,
                epsilon: cfg.epsilon,
                heartbeat: cfg.heartbeat,
                emergency: cfg.emergency,
                record_emergency: cfg.record_emergency,
                max_in_flight: cfg.max_in_flight,
                max_keys: cfg.max_keys,
                cluster: cfg.cluster.clone(),
            },
            table.clone(),
            rules.clone(),
            metrics.clone(),
            cfg.clock.now(),
        );
        let inner = Arc::new(Inner {
            replays: ReplayCache::new(cfg.replay_capacity, 60_000_000_000),
            cfg,
            instance,
            renewal_dead: AtomicBool::new(false),
            transport,
            rules,
            table,
            metrics,
            core: Mutex::new(core),
            wake: Notify::new(),
            parked: (0..PARKED_STRIPES).map(|_| Notify::new()).collect(),
            stop: AtomicBool::new(false),
            stopped: Notify::new(),
            emergency_log: Mutex::new(Vec::new()),
            admission_log,
            permits: std::sync::OnceLock::new(),
        });
        Ok(Agent { inner })
    }

    /// The core, locked: drivers pump it (`handle_*`, then `poll_*`).
    pub fn core(&self) -> MutexGuard<'_, AgentCore> {
        self.inner.core.lock()
    }

    /// The emergency buckets opened since the last call, as the tokio
    /// driver collected them (only with `record_emergency`).
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

    /// Whether the last allocator call succeeded, rules are known and the
    /// renewal side is alive.
    pub fn is_ready(&self) -> bool {
        self.inner.rules.has_rules()
            && !self.inner.renewal_dead.load(Ordering::Acquire)
            && self.inner.core.lock().reach().connected
    }

    /// The rules' generation: moves on whenever rules are put in force (a
    /// [`KeyHandle`] resolved under an older one is stale).
    pub fn rules_generation(&self) -> u64 {
        self.inner.rules.generation()
    }

    /// The per-process nonce this agent sends beside its id.
    pub fn instance(&self) -> u64 {
        self.inner.instance
    }

    /// The incarnation it sends now.
    pub fn incarnation(&self) -> u64 {
        self.inner.core.lock().incarnation()
    }

    /// The rule set in force, if any.
    pub fn rules(&self) -> Option<Arc<RuleSet>> {
        self.inner.rules.rules()
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
        self.check_by(input, None).await
    }

    /// [`Agent::check`], answered by `deadline` (the caller's own timeout,
    /// say Envoy's rate limit filter's `timeout`, which turns a late answer
    /// into a 503): a request that would still wait for a grant then is
    /// decided at once, as after its last wait (429 with a retry hint, or
    /// its fail policy while the allocator is unreachable). The one way
    /// into the agent for every face: [`Agent::step`]s the request, waits
    /// where a step says, and answers a retry of a request id with the
    /// first answer. A request decided by its first step (the fast path,
    /// a denial) allocates nothing.
    pub async fn check_by(
        &self,
        input: CheckInput<'_>,
        deadline: Option<tokio::time::Instant>,
    ) -> Result<CheckResponse, CheckError> {
        let req = self.request(input)?;
        if input.request_id.is_empty() {
            return self.decide(req, deadline).await;
        }
        Box::pin(self.decide_once(req, deadline)).await
    }

    /// [`Agent::check_by`] for a request with an id: decided once, its
    /// answer replayed to retries.
    async fn decide_once(
        &self,
        req: Request<'_>,
        deadline: Option<tokio::time::Instant>,
    ) -> Result<CheckResponse, CheckError> {
        let input = *req.input();
        let replays = &self.inner.replays;
        loop {
            let claim = replays.claim(
                input.request_id,
                input.tenant,
                input.route,
                input.cost.max(1),
                self.now(),
            );
            match claim {
                Claim::Replay(first) => {
                    self.inner.metrics.replays.add(1);
                    return first;
                }
                // A retry of a request still being decided: its answer,
                // never a second charge.
                Claim::Wait(waiter) => {
                    if let Some(first) = waiter.wait().await {
                        replays.count_replay();
                        self.inner.metrics.replays.add(1);
                        return first;
                    }
                }
                Claim::First(ticket) => {
                    let answer = self.decide(req, deadline).await;
                    let replayable = replayable(&answer);
                    return ticket.finish(answer, replayable);
                }
            }
        }
    }

    /// Step a request until it has an answer; the first step at once, the
    /// waiting rounds in a boxed future (small when the first step
    /// answers).
    async fn decide(
        &self,
        mut req: Request<'_>,
        deadline: Option<tokio::time::Instant>,
    ) -> Result<CheckResponse, CheckError> {
        match self.step(&mut req, self.now()) {
            Step::Answer(answer) => answer,
            Step::Wait(wait) => Box::pin(self.wait_rounds(req, wait, deadline)).await,
        }
    }

    /// The waiting rounds of a request: wait until the key's batch settles
    /// or the step's `until` (or the caller's deadline), then step again.
    #[tracing::instrument(level = "debug", name = "check", skip_all)]
    async fn wait_rounds(
        &self,
        mut req: Request<'_>,
        mut wait: Wait,
        deadline: Option<tokio::time::Instant>,
    ) -> Result<CheckResponse, CheckError> {
        let inner = &*self.inner;
        loop {
            // Registered with the core already (in the step): wait until
            // the key's batch settles (checked after `enable`, so a settle
            // in between is not missed), at most until the step said.
            let left = wait.until.saturating_sub(self.now());
            let until = tokio::time::Instant::now() + Duration::from_nanos(left);
            let until = deadline.map_or(until, |d| d.min(until));
            loop {
                let parked = inner.parked_on(&wait.slot).notified();
                tokio::pin!(parked);
                parked.as_mut().enable();
                if wait.settled() {
                    break;
                }
                if tokio::time::timeout_at(until, parked).await.is_err() {
                    break;
                }
            }
            if deadline.is_some_and(|d| tokio::time::Instant::now() >= d) {
                // The caller's time is up: no more waiting.
                req.time_up();
            }
            match self.step(&mut req, self.now()) {
                Step::Answer(answer) => return answer,
                Step::Wait(next) => wait = next,
            }
        }
    }

    /// The in-process fast path, for gateways that link the agent: `Some`
    /// when every matched rule was charged from a held lease (or no rule
    /// matched); `None` when the slow path is needed (no lease, short lease,
    /// invalid input, no rules) — then nothing was charged. No lock, no
    /// allocation, no await: one CAS per matched rule.
    #[inline]
    pub fn check_fast(&self, input: &CheckInput<'_>) -> Option<FastAdmit> {
        self.check_fast_at(input, self.now())
    }

    /// [`Agent::check_fast`] at a time the caller read from [`Agent::now`]
    /// during this request (a gateway that reads the clock once per
    /// request). The reading's age counts against `epsilon` like the stall
    /// between reading the clock and charging (docs/protocol.md,
    /// "Clocks"): pass a reading taken for this request, never one cached
    /// across requests.
    #[inline(always)]
    pub fn check_fast_at(&self, input: &CheckInput<'_>, now: u64) -> Option<FastAdmit> {
        let cost = validate(input).ok()?;
        self.fast_at(input, cost, now)
    }

    /// [`Agent::check_fast_at`] on validated input.
    #[inline(always)]
    fn fast_at(&self, input: &CheckInput<'_>, cost: u64, now: u64) -> Option<FastAdmit> {
        self.fast_shape(input, cost, now)
    }

    /// The fast path through this thread's cached handle only, for the slow
    /// path's first step (a shape it has none for costs a hash, and is
    /// resolved and cached on its second miss in a row, see `shapes`): the answer,
    /// or the plan of the shape's cached handle when it could not pay
    /// (`Err(Some)`), or neither (`Err(None)`: no handle).
    fn fast_or_plan(
        &self,
        input: &CheckInput<'_>,
        cost: u64,
        now: u64,
    ) -> Result<FastAdmit, Option<ChargePlan>> {
        let rules = &self.inner.rules;
        let generation = rules.generation();
        let decided = shapes::with(
            rules.id(),
            generation,
            input.domain,
            input.tenant,
            input.route,
            |h| {
                let (r, keep) = self.charge_cached(h, cost, now);
                (Some(r.ok_or_else(|| h.plan.clone())), keep)
            },
            |cache| match cache {
                true => {
                    let (r, h) = self.fast_uncached(input, cost, now, generation, true);
                    let r = match (r, &h) {
                        (Some(a), _) => Some(Ok(a)),
                        (None, Some(h)) => Some(Err(h.plan.clone())),
                        (None, None) => None,
                    };
                    (r, h)
                }
                false => (None, None),
            },
        );
        match decided {
            Some(r) => r.map_err(Some),
            None => Err(None),
        }
    }

    /// The fast path on the shape's cached handle; on a shape this thread
    /// has none for, resolve and cache it when due (its second miss), else
    /// decide uncached.
    #[inline(always)]
    fn fast_shape(&self, input: &CheckInput<'_>, cost: u64, now: u64) -> Option<FastAdmit> {
        let rules = &self.inner.rules;
        let generation = rules.generation();
        shapes::with(
            rules.id(),
            generation,
            input.domain,
            input.tenant,
            input.route,
            #[inline(always)]
            |h| self.charge_cached(h, cost, now),
            |cache| self.fast_uncached(input, cost, now, generation, cache),
        )
    }

    /// Charge a cached handle. A shape seen before on this thread: its
    /// handle, from the thread's cache (see `shapes`). A `None` from it
    /// (short, expired) keeps the entry unless a key's word holds no lease
    /// at all (retired, or never leased): the shape is then resolved again
    /// next time (a retired key has a new slot by then).
    #[inline(always)]
    fn charge_cached(&self, h: &KeyHandle, cost: u64, now: u64) -> (Option<FastAdmit>, bool) {
        let r = self.charge_handle(h, cost, now);
        let keep = r.is_some() || h.slots.iter().all(|(_, s)| s.word.deadline_ns() != 0);
        (r, keep)
    }

    /// [`Agent::check_fast_at`] on a shape this thread has no handle for:
    /// if it is to be cached, resolve it from the lease table and charge the
    /// handle (then cached); else, or without a handle (shadow rules, a key
    /// not held), decide without one.
    #[inline(never)]
    fn fast_uncached(
        &self,
        input: &CheckInput<'_>,
        cost: u64,
        now: u64,
        generation: u64,
        cache: bool,
    ) -> (Option<FastAdmit>, Option<KeyHandle>) {
        self.inner.rules.with(|snap| {
            let Some(snap) = snap else {
                return (None, None);
            };
            match cache
                .then(|| self.resolve_held(snap, generation, input))
                .flatten()
            {
                Some(h) => (self.charge_handle(&h, cost, now), Some(h)),
                None => (self.fast_charge(snap, input, cost, now), None),
            }
        })
    }

    /// Resolve a request shape (tenant, route, domain) once, for
    /// [`Agent::check_handle`]: the rules it matches and their keys' slots,
    /// created if new. Embedders that see the same shape often (a gateway
    /// route bound to a tenant) skip rule matching and key lookup per
    /// request. Errors as [`Agent::check`] would (invalid input, no rules).
    pub fn resolve(&self, input: &CheckInput<'_>) -> Result<KeyHandle, CheckError> {
        validate(input)?;
        let generation = self.inner.rules.generation();
        let Some(snap) = self.inner.rules.load_full() else {
            return Err(CheckError::Unavailable(
                "no rules yet: the allocator has not been reached".into(),
            ));
        };
        let m = match_rules(&snap.rules, input.domain, input.tenant, input.route)?;
        let mut slots = Vec::with_capacity(m.len());
        let mut core = self.inner.core.lock();
        for &ri in m.indices() {
            let rule = &snap.rules.rules[ri as usize];
            if rule.shadow {
                continue;
            }
            let Some(slot) = core.slot_for(rule, input.tenant, input.route) else {
                return Err(CheckError::Unavailable(
                    "the agent holds max_keys keys".into(),
                ));
            };
            slots.push((ri, slot));
        }
        drop(core);
        Ok(KeyHandle::new(generation, &snap, &m, slots))
    }

    /// [`Agent::resolve`] for the fast path: the slots of keys the lease
    /// table holds already, no lock, nothing created. None when the shape
    /// matches a shadow rule (the fast path charges those separately), a
    /// key has no slot yet, or too many rules match.
    fn resolve_held(
        &self,
        snap: &Arc<Snapshot>,
        generation: u64,
        input: &CheckInput<'_>,
    ) -> Option<KeyHandle> {
        let m = match_rules(&snap.rules, input.domain, input.tenant, input.route).ok()?;
        if m.any_shadow() {
            return None;
        }
        let table = self.inner.table.pin();
        let mut slots = Vec::with_capacity(m.len());
        for &ri in m.indices() {
            let rule = &snap.rules.rules[ri as usize];
            let slot = table.get(&Lookup::of(rule, input.tenant, input.route))?;
            slots.push((ri, slot.to_owned()));
        }
        Some(KeyHandle::new(generation, snap, &m, slots))
    }

    /// The fast path for a resolved shape at a caller-read time (see
    /// [`Agent::check_fast_at`] for `now`): one CAS per charged rule, no
    /// matching, no lookup. `None` when the slow path is needed — no lease
    /// or a short one, a cost above a burst, rules changed since
    /// [`Agent::resolve`], or a key the agent has forgotten meanwhile (its
    /// lease word is retired): then nothing was charged; call
    /// [`Agent::check`] and, if rules changed, resolve again. Shapes that
    /// match shadow rules always take the slow path.
    // Always inlined: returned through memory, the answer's fields cost a
    // store-forwarding stall in the caller that doubles the decision.
    #[inline(always)]
    pub fn check_handle(&self, h: &KeyHandle, cost: u32, now: u64) -> Option<FastAdmit> {
        if h.any_shadow || h.generation != self.inner.rules.generation() {
            return None;
        }
        self.charge_handle(h, u64::from(cost.max(1)), now)
    }

    /// Charge a current handle without shadow rules: one CAS per rule.
    #[inline(always)]
    fn charge_handle(&self, h: &KeyHandle, cost: u64, now: u64) -> Option<FastAdmit> {
        let inner = &*self.inner;
        let version = h.version;
        if h.no_rule {
            inner.metrics.no_rule.add(1);
            return Some(FastAdmit::no_rule(version));
        }
        if cost > h.max_cost {
            return None;
        }
        let (remaining, rule_index) = match h.slots.as_slice() {
            // The common shape: one rule, one word.
            // (`max_cost` is then the rule's burst.)
            [(ri, slot)] => match slot.word.try_take(cost, now) {
                Take::Taken { remaining, .. } => {
                    (slot.global_remaining(remaining, h.max_cost), *ri as usize)
                }
                Take::Short { .. } | Take::NoLease => return None,
            },
            slots => take_all(slots, cost, now, h.max_cost)?,
        };
        if inner.admission_log.is_some() {
            self.log_handle(h, cost, now);
        }
        let thread = metrics::thread_index();
        inner.metrics.allowed.add_at(thread, 1);
        for c in &h.counters {
            c.allowed.add_at(thread, 1);
        }
        Some(FastAdmit {
            remaining,
            rule_index: Some(rule_index),
            rule_version: version,
            reason: Reason::Ok,
        })
    }

    #[cold]
    fn log_handle(&self, h: &KeyHandle, cost: u64, now: u64) {
        if let Some(log) = &self.inner.admission_log {
            let mut w = log.lock();
            for (_, slot) in &h.slots {
                let _ = writeln!(
                    w,
                    "{now}\t{}\t{}\t{}\t{cost}",
                    slot.rule_id(),
                    slot.tenant(),
                    slot.route()
                );
            }
        }
    }

    /// Stop the driver, retire every lease and release the unused tokens
    /// to the allocator (bounded by `fetch_timeout`).
    pub async fn shutdown(&self) {
        let inner = &*self.inner;
        if let Some(p) = inner.permits.get() {
            p.shutdown().await;
        }
        inner.stop.store(true, Ordering::Release);
        inner.stopped.notify_waiters();
        let batch = inner.core.lock().shutdown(self.now());
        self.flush_admission_log();
        let (Some(batch), Some(transport)) = (batch, inner.transport.as_ref()) else {
            return;
        };
        let n = batch.items.len();
        match tokio::time::timeout(inner.cfg.fetch_timeout, transport.lease(batch)).await {
            Ok(Ok(_)) => tracing::info!(leases = n, "released leases on shutdown"),
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

mod config;
mod permits;
mod request;
#[cfg(test)]
mod tests;

pub use crate::handle::ChargePlan;
pub use config::{check_fraction, AgentConfig, ConfigError, MAX_SETTING};
pub use permits::{AcquireInput, Acquired};
pub use request::{Parked, Request, Step, Wait};

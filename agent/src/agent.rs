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
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Mutex, MutexGuard};
use quotalease_model::clock::ClockSource;
use quotalease_model::matching::{Matched, TooManyMatches, MAX_MATCHED};
use quotalease_model::protocol::MAX_ID_BYTES;
use quotalease_model::rules::{FailPolicy, Rule, RuleSet};
use quotalease_proto::v1::{CheckResponse, Reason};
use tokio::sync::Notify;

use crate::core::{AgentCore, CoreConfig, Event};
pub use crate::core::{EmergencyConfig, EmergencyOpened};
use crate::driver::Pumped as _;
use crate::handle::take_all;
pub use crate::handle::KeyHandle;
use crate::idempotency::{Claim, ReplayCache};
use crate::lease_table::Take;
pub use crate::lease_table::{KeyId, KeyRef, Lookup, Slot, SlotRef, Table};
use crate::metrics::{self, AgentMetrics, Counter, RuleCounterSet, RuleCounters};
use crate::renewal::PlanConfig;
use crate::shapes;
use crate::snapshot::{RulesCell, Snapshot};
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
    /// Per-process nonce sent beside `agent_id` (SPEC §8): the allocator
    /// keys holders by both, so processes sharing an id stay distinct.
    /// `None` draws a random one (drivers that replay exactly, like the
    /// simulator, pass their own).
    pub instance: Option<u64>,
    /// Remember every emergency bucket opened (for the simulator's I3 check).
    pub record_emergency: bool,
    /// Most lease batches in flight at once (backpressure: more keys wait
    /// for the next batch instead of failing).
    pub max_in_flight: usize,
    /// The cluster this agent belongs to (`--cluster`; "" when not set),
    /// presented to the allocator (SPEC §2 "First start").
    pub cluster: String,
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
            instance: None,
            record_emergency: false,
            max_in_flight: 8,
            cluster: String::new(),
        }
    }
}

/// The longest duration an agent setting accepts (longer ones would
/// overflow deadlines computed from them).
pub const MAX_SETTING: Duration = Duration::from_secs(24 * 3600);

/// An agent setting out of range, naming it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{setting}: {reason}")]
pub struct ConfigError {
    /// The setting (as its command-line flag).
    pub setting: &'static str,
    /// Why.
    pub reason: String,
}

impl AgentConfig {
    /// Check every setting: durations in `(0, MAX_SETTING]`, `epsilon` below
    /// the lease TTL, capacities above zero.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let within = |setting: &'static str, d: Duration| {
            if d.is_zero() {
                Err(ConfigError {
                    setting,
                    reason: "must be greater than zero".into(),
                })
            } else if d > MAX_SETTING {
                Err(ConfigError {
                    setting,
                    reason: format!("{d:?} is above the maximum {MAX_SETTING:?}"),
                })
            } else {
                Ok(())
            }
        };
        within("--lease-ttl", self.lease_ttl)?;
        within("--renew-interval", self.plan.renew_interval)?;
        within("--low-water", self.plan.low_water)?;
        within("--idle-release", self.plan.idle_release)?;
        within("--fetch-timeout", self.fetch_timeout)?;
        within("heartbeat", self.heartbeat)?;
        if self.epsilon >= self.lease_ttl {
            return Err(ConfigError {
                setting: "epsilon",
                reason: format!(
                    "{:?} must be below the lease TTL {:?}",
                    self.epsilon, self.lease_ttl
                ),
            });
        }
        if self.agent_id.is_empty() || self.agent_id.len() > MAX_ID_BYTES {
            return Err(ConfigError {
                setting: "--agent-id",
                reason: format!("must be 1..={MAX_ID_BYTES} bytes"),
            });
        }
        if self.max_in_flight == 0 {
            return Err(ConfigError {
                setting: "max_in_flight",
                reason: "must be greater than zero".into(),
            });
        }
        if self.max_keys == 0 {
            return Err(ConfigError {
                setting: "max_keys",
                reason: "must be greater than zero".into(),
            });
        }
        Ok(())
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

/// Rounds a request waits for a grant before it is denied.
const MAX_ATTEMPTS: u32 = 2;
/// While the allocator is opening the key upstream a request waits up to
/// `fetch_timeout` from its arrival (or its caller's deadline), asking again
/// as the allocator's hints say, in at most this many rounds. Counting
/// rounds alone let a regional's quick "still opening" answers use them up
/// in 4 ms while its parent's grant was a millisecond away (the demo's cold
/// tenants: most of their denials).
const MAX_ROUNDS_OPENING: u32 = 16;

/// The longest a request waits for an allocator that says it is starting
/// (its 3 s start grace, a restart's wait): its caller's deadline bounds
/// it sooner; an HTTP caller, who cannot give one, is answered within a
/// second (a 503 with `Retry-After`, which HTTP clients understand). Then
/// it is answered `STARTING` (see `Agent::starting`).
const STARTING_WAIT_NS: u64 = 1_000_000_000;

/// What is left of a request's wait for a key being opened: `fetch_timeout`
/// from its arrival at `since`, at `now` (the drivers bound a waiting round
/// by it; `Agent::check_at`'s callers too).
pub fn opening_wait_left_ns(fetch_timeout_ns: u64, since: u64, now: u64) -> u64 {
    since.saturating_add(fetch_timeout_ns).saturating_sub(now)
}

/// How long one waiting round on `slot` of a request that arrived at
/// `since` lasts at `now` (the tokio driver and the simulator alike):
/// `fetch_timeout`, or for a key being opened what is left of its opening
/// wait (at least 1 ns) — unless the allocator is starting, whose wait
/// outlasts any opening and has its own bound (see `STARTING_WAIT_NS`; a
/// round cut to nothing there spun the simulator, and would the driver).
pub fn wait_round_ns(slot: &Slot, fetch_timeout_ns: u64, since: u64, now: u64) -> u64 {
    if slot.opening() && !slot.starting() {
        opening_wait_left_ns(fetch_timeout_ns, since, now).clamp(1, fetch_timeout_ns)
    } else {
        fetch_timeout_ns
    }
}

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
}

/// Wakers for parked requests (see `Inner::parked`).
const PARKED_STRIPES: usize = 64;

impl Inner {
    /// The waker requests parked on `slot` wait on.
    fn parked_on(&self, slot: &Slot) -> &Notify {
        &self.parked[(slot.addr() >> 4) % self.parked.len()]
    }
}

/// One step of the slow path.
enum Step {
    Done(Result<CheckResponse, CheckError>),
    /// Registered with the core: wait for the next grant of `slot` (rule
    /// `rule_idx` could not pay).
    Park {
        slot: Slot,
        /// `slot.settles()` when the request registered (under the core's
        /// lock): it waits until the count moves on.
        seen: u32,
    },
}

/// What [`Agent::check_at`] decided.
#[derive(Clone, Debug, PartialEq)]
pub enum CheckStep {
    /// The answer.
    Answer(Result<CheckResponse, CheckError>),
    /// The request waits for a grant of this key: the driver pumps the
    /// core (see [`Agent::core`]) and calls `check_at` again with
    /// `attempt + 1` once the core reported this key settled
    /// ([`Event::Settled`]) or `fetch_timeout` passed.
    Wait(Slot),
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
    /// its fail policy while the allocator is unreachable).
    pub async fn check_by(
        &self,
        input: CheckInput<'_>,
        deadline: Option<tokio::time::Instant>,
    ) -> Result<CheckResponse, CheckError> {
        let cost = match validate(&input) {
            Ok(c) => c,
            Err(e) => {
                self.inner.metrics.invalid.add(1);
                return Err(e);
            }
        };
        if !input.request_id.is_empty() {
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
                        let answer = self.decide(&input, cost, deadline).await;
                        let replayable = replayable(&answer);
                        return ticket.finish(answer, replayable);
                    }
                }
            }
        }
        self.decide(&input, cost, deadline).await
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
        self.fast_shape(input, cost, now, true)
    }

    /// The fast path through this thread's cached handle only: a shape it
    /// has none for costs a hash (and is resolved and cached on its second
    /// miss in a row, see `shapes`), not a rule match and look-ups.
    fn fast_cached(&self, input: &CheckInput<'_>, cost: u64, now: u64) -> Option<FastAdmit> {
        self.fast_shape(input, cost, now, false)
    }

    /// The fast path on the shape's cached handle; on a shape this thread
    /// has none for, resolve and cache it when due (its second miss), else
    /// decide uncached (`uncached`) or not at all.
    #[inline(always)]
    fn fast_shape(
        &self,
        input: &CheckInput<'_>,
        cost: u64,
        now: u64,
        uncached: bool,
    ) -> Option<FastAdmit> {
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
            |cache| match cache || uncached {
                true => self.fast_uncached(input, cost, now, generation, cache),
                false => (None, None),
            },
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
                None => (self.fast_with(snap, input, cost, now), None),
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

    fn fast_with(
        &self,
        snap: &Snapshot,
        input: &CheckInput<'_>,
        cost: u64,
        t: u64,
    ) -> Option<FastAdmit> {
        let inner = &*self.inner;
        let rules = &*snap.rules;
        let m = match_rules(rules, input.domain, input.tenant, input.route).ok()?;
        if m.is_empty() {
            inner.metrics.no_rule.add(1);
            return Some(FastAdmit::no_rule(rules.version));
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
        count_admitted(&snap.counters, m.indices());
        Some(FastAdmit {
            remaining,
            rule_index: Some(rule_idx),
            rule_version: rules.version,
            reason,
        })
    }

    #[tracing::instrument(level = "debug", name = "check", skip_all, fields(cost))]
    async fn decide(
        &self,
        input: &CheckInput<'_>,
        cost: u64,
        deadline: Option<tokio::time::Instant>,
    ) -> Result<CheckResponse, CheckError> {
        let inner = &*self.inner;
        let (rules, m) = match self.slow_prelude(input, cost, self.now())? {
            Ok(answer) => return Ok(answer),
            Err(go_on) => go_on,
        };
        let mut attempt = 0;
        let since = self.now();
        loop {
            match self.decide_step(&rules, &m, input, cost, attempt, since, self.now()) {
                Step::Done(answer) => return answer,
                Step::Park { slot, seen } => {
                    // Registered with the core already (in decide_step):
                    // wait until the key's batch settles (its count moves
                    // past `seen`; checked after `enable`, so a settle in
                    // between is not missed), at most `fetch_timeout`, and
                    // for a key being opened no later than `fetch_timeout`
                    // after the request's arrival.
                    attempt += 1;
                    let fetch_ns = inner.cfg.fetch_timeout.as_nanos() as u64;
                    let round = wait_round_ns(&slot, fetch_ns, since, self.now());
                    let until = tokio::time::Instant::now() + Duration::from_nanos(round);
                    let until = deadline.map_or(until, |d| d.min(until));
                    loop {
                        let parked = inner.parked_on(&slot).notified();
                        tokio::pin!(parked);
                        parked.as_mut().enable();
                        if slot.settles() != seen {
                            break;
                        }
                        if tokio::time::timeout_at(until, parked).await.is_err() {
                            break;
                        }
                    }
                    if deadline.is_some_and(|d| tokio::time::Instant::now() >= d) {
                        // The caller's time is up: no more waiting.
                        attempt = u32::MAX;
                    }
                }
            }
        }
    }

    /// The sans-IO form of [`Agent::check`] for drivers that own time and
    /// waiting (the simulator): decide at agent-clock instant `t` the
    /// `attempt`-th round of a request that arrived at `since`. Replays by
    /// request id are not handled here.
    pub fn check_at(&self, input: &CheckInput<'_>, attempt: u32, since: u64, t: u64) -> CheckStep {
        let cost = match validate(input) {
            Ok(c) => c,
            Err(e) => {
                self.inner.metrics.invalid.add(1);
                return CheckStep::Answer(Err(e));
            }
        };
        let (rules, m) = match self.slow_prelude(input, cost, t) {
            Err(e) => return CheckStep::Answer(Err(e)),
            Ok(Ok(answer)) => return CheckStep::Answer(Ok(answer)),
            Ok(Err(go_on)) => go_on,
        };
        match self.decide_step(&rules, &m, input, cost, attempt, since, t) {
            Step::Done(answer) => CheckStep::Answer(answer),
            Step::Park { slot, .. } => CheckStep::Wait(slot),
        }
    }

    /// The start of the slow path: no rules (unavailable), the fast path
    /// through this thread's cached handle (`Ok(Ok(answer))`), no rule
    /// matched, a cost above a burst (invalid), or the rules and what
    /// matched to go on with (`Ok(Err(..))`). The request's rules are
    /// matched once here; a shape this thread has no handle for is decided
    /// by the slow path itself (its first pass charges leases that hold
    /// enough), not by an uncached fast attempt first.
    #[allow(clippy::type_complexity)]
    fn slow_prelude(
        &self,
        input: &CheckInput<'_>,
        cost: u64,
        t: u64,
    ) -> Result<Result<CheckResponse, (Arc<RuleSet>, Matched)>, CheckError> {
        let inner = &*self.inner;
        let Some(snap) = inner.rules.load_full() else {
            inner.metrics.unavailable.add(1);
            return Err(CheckError::Unavailable(
                "no rules yet: the allocator has not been reached".into(),
            ));
        };
        if let Some(a) = self.fast_cached(input, cost, t) {
            // The answer names its rule by index in the rules it was decided
            // under: a publish in between means newer rules than `snap`.
            let rules = match a.rule_version == snap.rules.version {
                true => snap.rules.clone(),
                false => inner.rules.rules().unwrap_or_else(|| snap.rules.clone()),
            };
            return Ok(Ok(a.to_response(&rules)));
        }
        let rules = snap.rules.clone();
        let m = match_rules(&rules, input.domain, input.tenant, input.route)?;
        if m.is_empty() {
            inner.metrics.no_rule.add(1);
            return Ok(Ok(FastAdmit::no_rule(rules.version).to_response(&rules)));
        }
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
        Ok(Err((rules, m)))
    }

    /// One pass of the slow path at `t`: charge, deny, apply a fail policy,
    /// or park for the next grant.
    #[allow(clippy::too_many_arguments)]
    fn decide_step(
        &self,
        rules: &RuleSet,
        m: &Matched,
        input: &CheckInput<'_>,
        cost: u64,
        attempt: u32,
        since: u64,
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
            Err((rule_idx, found)) => {
                let rule = &rules.rules[rule_idx];
                let mut core = inner.core.lock();
                let slot = match found {
                    // Still the key's slot (the core forgets a key from the
                    // table and its own state together, under this lock).
                    Some(s) if core.holds(&s) => Some(s),
                    _ => core.slot_for(rule, input.tenant, input.route),
                };
                let Some(slot) = slot else {
                    drop(core);
                    return Step::Done(self.fail_policy(
                        rule,
                        rules,
                        "the agent holds max_keys keys",
                    ));
                };
                if let Some((status, why)) = core.refused(&slot) {
                    drop(core);
                    inner.metrics.over_limit.add(1);
                    tracing::debug!(rule = %rule.id, ?status, %why, "key refused by the allocator");
                    return Step::Done(Ok(self.over_limit(rule, rules, 1_000)));
                }
                let dry_until = slot.dry_until();
                let reach = core.reach_of(&slot);
                // Behind a regional allocator whose parent is unreachable the
                // regional's pool still counts as leased: ask it once; when
                // it is dry, the fail policy applies (SPEC §2 I3, §6).
                let parent_cut = reach.parent_down && (attempt > 0 || dry_until > t);
                let cut_off = parent_cut || reach.down || (!reach.connected && attempt > 0);
                // A key the allocator is still fetching from its parent
                // waits for it (see MAX_ROUNDS_OPENING).
                let fetch_ns = inner.cfg.fetch_timeout.as_nanos() as u64;
                let opening_wait = slot.opening()
                    && attempt < MAX_ROUNDS_OPENING
                    && t.saturating_sub(since) < fetch_ns;
                if dry_until > t && !parent_cut && opening_wait {
                    self.register_wait(&mut core, rules, m, input, cost, rule_idx, &slot, t);
                    let seen = slot.settles();
                    return Step::Park { slot, seen };
                }
                // The allocator is starting (its grace, a restart's wait):
                // wait through it up to the caller's deadline (at most
                // STARTING_WAIT without one), then say so, never "over
                // limit".
                // (The allocator's last word on the key: its hint may have
                // passed while the next ask is on its way.)
                if slot.starting() && !cut_off {
                    if attempt != u32::MAX && t.saturating_sub(since) < STARTING_WAIT_NS {
                        self.register_wait(&mut core, rules, m, input, cost, rule_idx, &slot, t);
                        let seen = slot.settles();
                        return Step::Park { slot, seen };
                    }
                    drop(core);
                    let left_ms = dry_until.saturating_sub(t).div_ceil(1_000_000);
                    return Step::Done(self.starting(rule, rules, left_ms));
                }
                if dry_until > t && !parent_cut {
                    drop(core);
                    slot.add_denied(cost);
                    inner.metrics.over_limit.add(1);
                    // The answer names the denying rule with the largest retry.
                    let (ms, idx) = self.largest_retry(
                        rules,
                        m,
                        input,
                        cost,
                        t,
                        rule_idx,
                        denial_wait_ns(&slot, rule, cost, t),
                    );
                    return Step::Done(Ok(self.over_limit(&rules.rules[idx], rules, ms)));
                }
                if cut_off {
                    if rule.fail_policy == FailPolicy::Open {
                        let paid = self.try_charge_emergency(&mut core, rules, m, input, cost, t);
                        drop(core);
                        return Step::Done(match paid {
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
                        });
                    }
                    drop(core);
                    return Step::Done(self.fail_policy(rule, rules, "allocator unreachable"));
                }
                if attempt >= MAX_ATTEMPTS && !opening_wait {
                    drop(core);
                    slot.add_denied(cost);
                    inner.metrics.over_limit.add(1);
                    let ms = inner.cfg.plan.renew_interval.as_millis() as u64;
                    return Step::Done(Ok(self.over_limit(rule, rules, ms.max(1))));
                }
                self.register_wait(&mut core, rules, m, input, cost, rule_idx, &slot, t);
                let seen = slot.settles();
                Step::Park { slot, seen }
            }
        }
    }

    /// Register a parked request with the core: every rule of it that
    /// cannot pay asks in the next batch; wake the driver.
    #[allow(clippy::too_many_arguments)]
    fn register_wait(
        &self,
        core: &mut AgentCore,
        rules: &RuleSet,
        m: &Matched,
        input: &CheckInput<'_>,
        cost: u64,
        rule_idx: usize,
        slot: &Slot,
        t: u64,
    ) {
        core.want(slot.clone(), cost);
        for &ri in m.indices() {
            let other = &rules.rules[ri as usize];
            if other.shadow || ri as usize == rule_idx {
                continue;
            }
            if let Some(s) = core.slot_for(other, input.tenant, input.route) {
                if s.word.peek(t).is_none_or(|held| held < cost) {
                    core.want(s, cost);
                }
            }
        }
        self.inner.wake.notify_one();
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
    ) -> Result<(u64, usize), Unpaid> {
        let table = self.inner.table.pin();
        // (slot, generation) of each charge, for an all-or-none refund.
        let mut taken: [Option<(SlotRef<'_>, u64)>; MAX_MATCHED] = [None; MAX_MATCHED];
        let mut min_remaining = u64::MAX;
        let mut min_rule = m.indices()[0] as usize;
        for j in 0..m.len() {
            let ri = m.indices()[j] as usize;
            let r = &rules.rules[ri];
            if r.shadow {
                continue;
            }
            let slot = table.get(&Lookup::of(r, input.tenant, input.route));
            let take = slot.map_or(Take::NoLease, |s| s.word.try_take(cost, t));
            match take {
                Take::Taken {
                    generation,
                    remaining,
                } => {
                    taken[j] = slot.map(|s| (s, generation));
                    let remaining =
                        slot.map_or(remaining, |s| s.global_remaining(remaining, r.burst));
                    if remaining < min_remaining {
                        min_remaining = remaining;
                        min_rule = ri;
                    }
                }
                Take::Short { .. } | Take::NoLease => {
                    // All or none: give back what this request took.
                    for (s, generation) in taken[..j].iter().flatten() {
                        s.word.refund(*generation, cost);
                    }
                    // The slot that could not pay, so the slow path need
                    // not look it up again.
                    return Err((ri, slot.map(|s| s.to_owned())));
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
            let short = slot.word.peek(t).is_none_or(|held| held < cost);
            let wait = denial_wait_ns(&slot, r, cost, t);
            if short && wait > best.0 {
                best = (wait, ri as usize);
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
        core: &mut AgentCore,
        rules: &RuleSet,
        m: &Matched,
        input: &CheckInput<'_>,
        cost: u64,
        t: u64,
    ) -> Result<(u64, usize), usize> {
        enum Paid {
            Lease(Slot, u64),
            Emergency(Slot),
        }
        let mut paid: Vec<Paid> = Vec::with_capacity(m.len());
        let mut min = (u64::MAX, m.indices()[0] as usize);
        let mut failed = None;
        for &ri in m.indices() {
            let r = &rules.rules[ri as usize];
            if r.shadow {
                continue;
            }
            let Some(slot) = core.slot_for(r, input.tenant, input.route) else {
                failed = Some(ri as usize);
                break;
            };
            if let Take::Taken {
                generation,
                remaining,
            } = slot.word.try_take(cost, t)
            {
                let remaining = slot.global_remaining(remaining, r.burst);
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
            let took = core.emergency_take(&slot, r, cost, t);
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
                    Paid::Emergency(slot) => core.emergency_refund(&slot, cost, t),
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
                    let mut core = self.inner.core.lock();
                    if let Some(slot) = core.slot_for(r, input.tenant, input.route) {
                        let dry = slot.dry_until() > t;
                        if dry && matches!(other, Some(Take::Short { .. })) {
                            reason = Reason::ShadowOverLimit;
                            self.inner.metrics.shadow_over_limit.add(1);
                        } else {
                            core.want(slot, cost);
                            drop(core);
                            self.inner.wake.notify_one();
                        }
                    }
                }
            }
        }
        reason
    }

    /// Count an admission for every rule the request matched (slow path:
    /// the counters in force, if they belong to `rules`).
    fn count_admitted(&self, rules: &RuleSet, m: &Matched) {
        let counters = self.inner.metrics.by_rule.load();
        if counters.version == rules.version {
            count_admitted(&counters, m.indices());
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

    /// The answer while the allocator is starting (SPEC §2 "First start"):
    /// not a limit. The fail policy's answer with a reason of its own:
    /// `closed` answers unavailable, `open` and `lease_only` deny with
    /// `STARTING` and the time until the wait ends. Counted as a fail
    /// policy's denial. (`open` does not admit through the emergency
    /// bucket here: the allocator is reachable, and I3 allows excess only
    /// while it is not.)
    fn starting(
        &self,
        rule: &Rule,
        rules: &RuleSet,
        left_ms: u64,
    ) -> Result<CheckResponse, CheckError> {
        let why = format!("the allocator is starting (granting in {left_ms} ms)");
        self.policy_denial(rule, rules, &why, left_ms.max(1), Reason::Starting)
    }

    fn fail_policy(
        &self,
        rule: &Rule,
        rules: &RuleSet,
        why: &str,
    ) -> Result<CheckResponse, CheckError> {
        let retry_ms = self.inner.cfg.fetch_timeout.as_millis() as u64;
        self.policy_denial(rule, rules, why, retry_ms, Reason::FailureModeDenied)
    }

    /// A fail policy's denial, counted as one: `closed` answers
    /// unavailable saying `why`; `open` and `lease_only` deny with
    /// `reason`, to retry after `retry_after_ms`.
    fn policy_denial(
        &self,
        rule: &Rule,
        rules: &RuleSet,
        why: &str,
        retry_after_ms: u64,
        reason: Reason,
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
                    retry_after_ms,
                    rule_id: rule.id.clone(),
                    applied_rule_version: rules.version,
                    reason: reason as i32,
                })
            }
        }
    }

    /// Stop the driver, retire every lease and release the unused tokens
    /// to the allocator (bounded by `fetch_timeout`).
    pub async fn shutdown(&self) {
        let inner = &*self.inner;
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

#[cfg(test)]
mod tests;

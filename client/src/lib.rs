//! quotalease in the caller's process: a global, exact rate limit decided
//! in memory.
//!
//! A [`Client`] embeds a quotalease agent (the same one the sidecar runs):
//! it holds leases of each key's global bucket from an allocator, decides
//! every check from them in memory (one atomic update per rule charged when
//! the lease holds enough), and renews them in the background on the tokio
//! runtime it was built on. The limit holds across every process that holds
//! leases of the same allocator: tokens admitted over any interval `T`
//! never exceed `B + R*T` (SPEC §2).
//!
//! ```no_run
//! # async fn run() -> Result<(), quotalease_client::Error> {
//! use quotalease_client::{Client, Key};
//!
//! let client = Client::builder()
//!     .allocator("http://127.0.0.1:7070")
//!     .agent_id("checkout-7f9c")
//!     .build()?;
//! let key = Key::new("tenant-42", "/v1/orders");
//! // Synchronous, never waits: from the lease held, or "would wait".
//! let d = client.try_check(&key, 1);
//! if !d.allowed() {
//!     // May wait for a grant, up to the client's deadline.
//!     let d = client.check(&key, 1).await;
//!     if !d.allowed() {
//!         println!("429, retry after {:?}", d.retry_after());
//!     }
//! }
//! client.shutdown().await; // gives back what it holds
//! # Ok(()) }
//! ```
//!
//! In tests, the `testing` feature runs the real allocator core in this
//! process, on a clock the test controls (here tokio's, paused):
//!
//! ```
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! use std::time::Duration;
//! use quotalease_client::testing::{InProcessAllocator, TokioClock};
//!
//! let alloc = InProcessAllocator::from_yaml_with_clock(
//!     r#"
//! rules:
//!   - id: orders
//!     match: { tenant: "*", route: /v1/orders }
//!     rate: 10/s
//!     burst: 20
//! "#,
//!     TokioClock::new(),
//! )
//! .unwrap();
//! let client = alloc.client("orders-test").unwrap();
//! assert!(client.ready(Duration::from_secs(1)).await); // the rules are known
//! let orders = client.key("tenant-42", "/v1/orders").unwrap(); // a hot key's handle
//! let mut admitted = 0;
//! for _ in 0..30 {
//!     admitted += u32::from(orders.check(1).await.allowed());
//! }
//! assert_eq!(admitted, 20); // the burst, and no more at one instant
//! tokio::time::advance(Duration::from_millis(1010)).await;
//! let d = client.check(orders.key(), 10).await; // ten tokens refilled
//! assert!(d.allowed());
//! client.shutdown().await;
//! # }
//! ```
//!
//! **Every process that embeds a client is a holder.** An allocator
//! shares a key's burst among its holders (SPEC §2's ranges count them):
//! a service with 50 replicas holding leases of a `5/m burst 5` rule needs
//! the allocator to serve it centrally, as it does, and short-lived or
//! prefork processes pay a round trip on their first check of each key:
//! run the sidecar (`quotalease agent`) beside those instead. A client
//! needs a tokio runtime (multi-thread or current-thread) and refuses any
//! clock but `CLOCK_BOOTTIME` when it talks to a remote allocator
//! (docs/client.md).
#![warn(missing_docs)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use quotalease_agent::agent::{Agent, AgentConfig, CheckError, CheckInput, FastAdmit, Step};
use quotalease_agent::core::EmergencyConfig;
use quotalease_agent::transport::{GrpcTransport, Transport};
use quotalease_proto::v1::{CheckResponse, Reason};

#[allow(deprecated)]
pub use permits::enable_experimental_permits;
pub use permits::{AcquireError, Permit, PermitLost};
/// The rule set type [`Builder::bootstrap_rules`] takes
/// (`RuleSet::parse(yaml, source_name, version)` reads SPEC §4 YAML).
pub use quotalease_model::rules::RuleSet;

mod permits;

#[cfg(feature = "tower")]
pub mod middleware;
#[cfg(feature = "testing")]
pub mod testing;

/// How often a check made before the rules are known looks again.
const RULES_POLL: Duration = Duration::from_millis(1);

/// What a client could not be built from (every variant names the
/// setting).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Error {
    /// No allocator URL, and no in-process allocator.
    #[error("allocator: at least one allocator URL is needed")]
    NoAllocator,
    /// A setting is invalid.
    #[error("{field}: {reason}")]
    Invalid {
        /// The builder setting.
        field: &'static str,
        /// Why.
        reason: String,
    },
    /// The bootstrap rules do not validate (every error, one per line).
    #[error("rules: {0}")]
    Rules(String),
    /// No tokio runtime to run the renewals on.
    #[error("a client is built inside a tokio runtime (it renews its leases there)")]
    NoRuntime,
}

impl Error {
    /// Every error of a rules file, one per line.
    pub(crate) fn rules(errs: &[quotalease_model::rules::RuleError]) -> Self {
        Error::Rules(
            errs.iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("\n"),
        )
    }
}

/// The bucket a check draws from: a tenant and a route (and, for rules
/// in a namespace, a domain), matched against the rules in force.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Key {
    tenant: String,
    route: String,
    domain: Option<String>,
}

impl Key {
    /// The key of `tenant` on `route`.
    pub fn new(tenant: impl Into<String>, route: impl Into<String>) -> Self {
        Self {
            tenant: tenant.into(),
            route: route.into(),
            domain: None,
        }
    }

    /// The same key in rule namespace `domain` (Envoy's domain).
    pub fn in_domain(mut self, domain: impl Into<String>) -> Self {
        self.domain = Some(domain.into());
        self
    }

    /// Tenant part.
    pub fn tenant(&self) -> &str {
        &self.tenant
    }

    /// Route part.
    pub fn route(&self) -> &str {
        &self.route
    }

    fn input<'a>(&'a self, cost: u32, request_id: &'a str) -> CheckInput<'a> {
        CheckInput {
            tenant: &self.tenant,
            route: &self.route,
            cost,
            request_id,
            domain: self.domain.as_deref(),
        }
    }
}

/// Why a decision is what it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Admitted within the limit.
    Ok,
    /// No rule matches the key: admitted, unlimited.
    NoRule,
    /// Denied: the limit is reached.
    OverLimit,
    /// Admitted: a shadow rule (observed, not enforced) is over its limit.
    ShadowOverLimit,
    /// Admitted by the rule's fail policy (`open`) while the allocator is
    /// out of reach.
    FailureModeAllowed,
    /// Denied by the rule's fail policy while the allocator is out of reach.
    FailureModeDenied,
    /// The allocator is starting (a restart's wait): nothing could be
    /// leased yet; denied under the rule's fail policy, not a limit.
    Starting,
    /// [`Client::try_check`] only: no lease holds enough and one is being
    /// fetched; [`Client::check`] would wait for it. Nothing was charged.
    WouldWait,
    /// No decision: the rules are not known yet, or the rule is
    /// fail-`closed` with no lease (`UNAVAILABLE`).
    Unavailable(String),
    /// No decision: the check is invalid (`field` says which part).
    Invalid {
        /// The invalid field.
        field: &'static str,
        /// Why.
        reason: String,
    },
}

/// The answer to one check: enough to write `RateLimit` and `Retry-After`
/// headers (SPEC §5).
#[must_use]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    allowed: bool,
    remaining: u64,
    retry_after: Option<Duration>,
    rule: Option<RuleRef>,
    rule_version: u64,
    outcome: Outcome,
}

/// The rule that decided: within the rule set in force when the lease
/// decided (no copy on the fast path), or by the id an answer named.
#[derive(Clone, Debug)]
enum RuleRef {
    InSet(Arc<RuleSet>, usize),
    Named(Arc<str>),
}

impl RuleRef {
    fn id(&self) -> &str {
        match self {
            RuleRef::InSet(set, i) => &set.rules[*i].id,
            RuleRef::Named(id) => id,
        }
    }
}

impl PartialEq for RuleRef {
    fn eq(&self, other: &Self) -> bool {
        self.id() == other.id()
    }
}

impl Eq for RuleRef {}

impl Decision {
    /// Whether the request may pass.
    pub fn allowed(&self) -> bool {
        self.allowed
    }

    /// The key's global remaining tokens as this process estimates them
    /// (for the most constrained rule charged; SPEC §5 "What the headers
    /// say"); 0 when unknown.
    pub fn remaining(&self) -> u64 {
        self.remaining
    }

    /// When a denied request may succeed at the earliest.
    pub fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }

    /// The rule that decided (the most constrained one charged), if any.
    pub fn rule_id(&self) -> Option<&str> {
        self.rule.as_ref().map(RuleRef::id)
    }

    /// The rule set and the deciding rule's index in it when the decision
    /// came from the leases held (the middleware's headers read the rule).
    #[cfg(feature = "tower")]
    pub(crate) fn rule_slot(&self) -> Option<(&Arc<RuleSet>, usize)> {
        match &self.rule {
            Some(RuleRef::InSet(set, i)) if *i < set.rules.len() => Some((set, *i)),
            _ => None,
        }
    }

    /// The version of the rules applied (0: bootstrap rules, or none).
    pub fn rule_version(&self) -> u64 {
        self.rule_version
    }

    /// Why.
    pub fn outcome(&self) -> &Outcome {
        &self.outcome
    }

    /// Whether the limit was consulted in shadow mode only.
    pub fn is_shadow(&self) -> bool {
        self.outcome == Outcome::ShadowOverLimit
    }

    /// The refusal as a gRPC status for a tonic handler that checks in its
    /// own code (the key from the message, not the request's metadata):
    /// `RESOURCE_EXHAUSTED` over the limit (with `retry-after` metadata in
    /// whole seconds), `UNAVAILABLE` without a decision, `INVALID_ARGUMENT`
    /// for an invalid key; `None` when allowed.
    ///
    /// ```
    /// # fn f(d: quotalease_client::Decision) -> Result<(), tonic::Status> {
    /// if let Some(status) = d.to_status() {
    ///     return Err(status);
    /// }
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "tonic")]
    pub fn to_status(&self) -> Option<tonic::Status> {
        if self.allowed {
            return None;
        }
        let code = tonic::Code::from_i32(i32::from(self.grpc_code()));
        let mut metadata = tonic::metadata::MetadataMap::new();
        if code == tonic::Code::ResourceExhausted {
            let ms = self.retry_after.map_or(0, |r| r.as_millis() as u64);
            let secs = quotalease_model::headers::retry_after_secs(ms);
            if let Ok(v) = secs.to_string().parse() {
                metadata.insert("retry-after", v);
            }
        }
        Some(tonic::Status::with_metadata(
            code,
            self.refusal_message(),
            metadata,
        ))
    }

    /// The gRPC status code a refusal answers with.
    #[cfg_attr(not(any(feature = "tower", feature = "tonic")), allow(dead_code))]
    pub(crate) fn grpc_code(&self) -> u8 {
        match self.outcome {
            Outcome::Invalid { .. } => 3,  // INVALID_ARGUMENT
            Outcome::Unavailable(_) => 14, // UNAVAILABLE
            _ => 8,                        // RESOURCE_EXHAUSTED
        }
    }

    /// A refusal's message (ASCII).
    #[cfg_attr(not(any(feature = "tower", feature = "tonic")), allow(dead_code))]
    pub(crate) fn refusal_message(&self) -> String {
        match &self.outcome {
            Outcome::Invalid { field, .. } => format!("invalid {field}"),
            Outcome::Unavailable(_) => "rate limiter unavailable".to_owned(),
            _ => {
                let ms = self.retry_after.map_or(0, |r| r.as_millis());
                match self.rule_id() {
                    Some(rule) => format!("rate limited by rule {rule}, retry after {ms} ms"),
                    None => format!("rate limited, retry after {ms} ms"),
                }
            }
        }
    }

    fn from_fast(f: FastAdmit, agent: &Agent) -> Self {
        // The rule set read now is the one the charge used unless a reload
        // came in between (then its version differs, and the decision
        // names no rule rather than another set's rule at that index).
        let rule = f.rule_index.and_then(|i| {
            agent
                .rules()
                .filter(|set| i < set.rules.len() && set.version == f.rule_version)
                .map(|set| RuleRef::InSet(set, i))
        });
        Self {
            allowed: true,
            remaining: f.remaining,
            retry_after: None,
            rule,
            rule_version: f.rule_version,
            outcome: outcome_of(f.reason),
        }
    }

    fn from_answer(answer: Result<CheckResponse, CheckError>) -> Self {
        match answer {
            Ok(r) => Self {
                allowed: r.allowed,
                remaining: r.remaining,
                retry_after: (r.retry_after_ms > 0)
                    .then(|| Duration::from_millis(r.retry_after_ms)),
                rule: (!r.rule_id.is_empty()).then(|| RuleRef::Named(Arc::from(r.rule_id))),
                rule_version: r.applied_rule_version,
                outcome: outcome_of(Reason::try_from(r.reason).unwrap_or(Reason::Ok)),
            },
            Err(CheckError::Invalid { field, reason }) => {
                Self::undecided(Outcome::Invalid { field, reason }, None)
            }
            Err(CheckError::Unavailable(why)) => Self::undecided(Outcome::Unavailable(why), None),
        }
    }

    fn undecided(outcome: Outcome, retry_after: Option<Duration>) -> Self {
        Self {
            allowed: false,
            remaining: 0,
            retry_after,
            rule: None,
            rule_version: 0,
            outcome,
        }
    }
}

fn outcome_of(reason: Reason) -> Outcome {
    match reason {
        Reason::Ok => Outcome::Ok,
        Reason::OverLimit => Outcome::OverLimit,
        Reason::ShadowOverLimit => Outcome::ShadowOverLimit,
        Reason::NoRule => Outcome::NoRule,
        Reason::FailureModeAllowed => Outcome::FailureModeAllowed,
        Reason::FailureModeDenied => Outcome::FailureModeDenied,
        Reason::Invalid => Outcome::Invalid {
            field: "request",
            reason: "invalid".into(),
        },
        Reason::Starting => Outcome::Starting,
    }
}

/// Builds a [`Client`]. Defaults as the sidecar's (docs/operations.md).
#[derive(Clone, Debug)]
#[must_use]
pub struct Builder {
    allocators: Vec<String>,
    agent_id: Option<String>,
    rules: Option<RuleSet>,
    rules_file: Option<PathBuf>,
    tls: Option<(PathBuf, PathBuf, PathBuf)>,
    deadline: Duration,
    lease_ttl: Option<Duration>,
    cluster: String,
    emergency: EmergencyConfig,
    admission_log: Option<PathBuf>,
    #[cfg(feature = "testing")]
    in_process: Option<testing::InProcessAllocator>,
}

impl Default for Builder {
    fn default() -> Self {
        Self {
            allocators: Vec::new(),
            agent_id: None,
            rules: None,
            rules_file: None,
            tls: None,
            deadline: AgentConfig::default().fetch_timeout,
            lease_ttl: None,
            cluster: String::new(),
            emergency: EmergencyConfig::default(),
            admission_log: None,
            #[cfg(feature = "testing")]
            in_process: None,
        }
    }
}

impl Builder {
    /// An allocator to hold leases of (`http://` or, with [`Builder::tls`],
    /// `https://`); several: the replicas of one allocator (the leader is
    /// followed).
    pub fn allocator(mut self, url: impl Into<String>) -> Self {
        self.allocators.push(url.into());
        self
    }

    /// This process's identity at the allocator (unique per process; the
    /// default is `client-<pid>`). A per-process random nonce is sent
    /// beside it, so two processes sharing an id stay distinct holders.
    pub fn agent_id(mut self, id: impl Into<String>) -> Self {
        self.agent_id = Some(id.into());
        self
    }

    /// Rules to use until the allocator's arrive (the allocator's rules
    /// win as soon as it answers).
    pub fn bootstrap_rules(mut self, rules: RuleSet) -> Self {
        self.rules = Some(rules);
        self
    }

    /// [`Builder::bootstrap_rules`] from a rules file (SPEC §4), validated
    /// when the client is built.
    pub fn bootstrap_rules_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.rules_file = Some(path.into());
        self
    }

    /// mTLS to the allocator: this process's certificate and key and the
    /// CA the allocator's certificate is signed by (PEM files, re-read when
    /// they change).
    pub fn tls(
        mut self,
        cert: impl Into<PathBuf>,
        key: impl Into<PathBuf>,
        ca: impl Into<PathBuf>,
    ) -> Self {
        self.tls = Some((cert.into(), key.into(), ca.into()));
        self
    }

    /// The longest [`Client::check`] waits for a grant before it answers
    /// as its last round would (default: the agent's fetch timeout,
    /// 250 ms).
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
        self
    }

    /// Lease lifetime asked for (the allocator grants at most its
    /// `TTL_max`).
    pub fn lease_ttl(mut self, ttl: Duration) -> Self {
        self.lease_ttl = Some(ttl);
        self
    }

    /// The cluster this process belongs to (`--cluster` of the sidecar).
    pub fn cluster(mut self, cluster: impl Into<String>) -> Self {
        self.cluster = cluster.into();
        self
    }

    /// Fail policy `open` (SPEC §6): the rate of the emergency bucket a
    /// key admits through once its lease is spent while the allocator is
    /// out of reach, as a fraction of the rule's rate in (0, 1] (default:
    /// this process's recent share of the rule's rate, as the sidecar's
    /// `--emergency-rate`). The rule's policy itself is the rule's: a
    /// client cannot turn `closed` into `open`.
    pub fn emergency_rate(mut self, fraction: f64) -> Self {
        self.emergency.rate_fraction = Some(fraction);
        self
    }

    /// [`Builder::emergency_rate`]'s burst: the emergency bucket's burst
    /// as a fraction of the rule's burst in (0, 1] (default: the rule's
    /// burst over its holders; the sidecar's `--emergency-burst`).
    pub fn emergency_burst(mut self, fraction: f64) -> Self {
        self.emergency.burst_fraction = Some(fraction);
        self
    }

    /// Test-only: append every admission (time, key, cost) to `path`, as
    /// the sidecar's test admission log does (flushed on
    /// [`Client::shutdown`]); end-to-end tests check the bound over every
    /// window from it.
    #[doc(hidden)]
    pub fn admission_log(mut self, path: impl Into<PathBuf>) -> Self {
        self.admission_log = Some(path.into());
        self
    }

    /// Hold leases of an allocator core in this process instead of a
    /// remote one (tests; the `testing` feature).
    #[cfg(feature = "testing")]
    pub fn in_process(mut self, allocator: &testing::InProcessAllocator) -> Self {
        self.in_process = Some(allocator.clone());
        self
    }

    /// Start the client on the current tokio runtime: it reaches the
    /// allocator lazily, so this succeeds while the allocator is down
    /// (checks then answer by each rule's fail policy).
    pub fn build(self) -> Result<Client, Error> {
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(Error::NoRuntime);
        }
        let mut rules = self.rules;
        if let Some(path) = &self.rules_file {
            let parsed = RuleSet::load(path, 0).map_err(|errs| Error::rules(&errs))?;
            rules = Some(parsed);
        }
        let mut cfg = AgentConfig {
            agent_id: self
                .agent_id
                .unwrap_or_else(|| format!("client-{}", std::process::id())),
            cluster: self.cluster,
            emergency: self.emergency,
            admission_log: self.admission_log,
            ..AgentConfig::default()
        };
        if let Some(ttl) = self.lease_ttl {
            cfg.lease_ttl = ttl;
        }
        cfg.validate().map_err(|e| Error::Invalid {
            field: builder_setting(e.setting),
            reason: e.reason,
        })?;
        let transport: Arc<dyn Transport> = {
            #[cfg(feature = "testing")]
            let in_process = self.in_process;
            #[cfg(not(feature = "testing"))]
            let in_process: Option<std::convert::Infallible> = None;
            match in_process {
                #[cfg(feature = "testing")]
                Some(a) => {
                    if !self.allocators.is_empty() {
                        return Err(Error::Invalid {
                            field: "allocator",
                            reason: "an in-process allocator and allocator URLs exclude each other"
                                .into(),
                        });
                    }
                    cfg.clock = a.clock();
                    Arc::new(a.transport())
                }
                #[cfg(not(feature = "testing"))]
                Some(never) => match never {},
                None => {
                    if self.allocators.is_empty() {
                        return Err(Error::NoAllocator);
                    }
                    let tls = match &self.tls {
                        None => None,
                        Some((cert, key, ca)) => Some(
                            quotalease_tls::ClientTls::client(quotalease_tls::TlsFiles {
                                cert: (cert.clone(), "tls cert"),
                                key: (key.clone(), "tls key"),
                                ca: (ca.clone(), "tls ca"),
                            })
                            .map_err(|reason| Error::Invalid {
                                field: "tls",
                                reason,
                            })?,
                        ),
                    };
                    if let Some(t) = &tls {
                        t.clone().watch();
                    }
                    Arc::new(
                        GrpcTransport::with_tls(&self.allocators, cfg.fetch_timeout, tls.as_ref())
                            .map_err(|reason| Error::Invalid {
                                field: "allocator",
                                reason,
                            })?,
                    )
                }
            }
        };
        let agent = Agent::start(cfg, transport, rules).map_err(|e| Error::Invalid {
            field: "agent",
            reason: e.to_string(),
        })?;
        Ok(Client {
            agent,
            deadline: self.deadline,
        })
    }
}

/// The builder setting behind an agent setting (named as its sidecar flag).
fn builder_setting(agent_setting: &'static str) -> &'static str {
    match agent_setting {
        "--lease-ttl" => "lease_ttl",
        "--agent-id" => "agent_id",
        "--emergency-rate" => "emergency_rate",
        "--emergency-burst" => "emergency_burst",
        other => other,
    }
}

/// A handle on the embedded agent: cheap to clone, `Send + Sync`; every
/// clone decides from the same leases.
#[derive(Clone, Debug)]
pub struct Client {
    agent: Agent,
    deadline: Duration,
}

impl Client {
    /// A [`Builder`].
    pub fn builder() -> Builder {
        Builder::default()
    }

    /// Decide a check of `cost` tokens on `key` now, without waiting: from
    /// the leases held, or [`Outcome::WouldWait`] when a lease must be
    /// fetched first (the fetch starts; nothing is charged). Denials,
    /// fail policies and invalid input are answered as [`Client::check`]
    /// answers them.
    pub fn try_check(&self, key: &Key, cost: u32) -> Decision {
        let input = key.input(cost, "");
        let now = self.agent.now();
        if let Some(f) = self.agent.check_fast_at(&input, now) {
            return Decision::from_fast(f, &self.agent);
        }
        let mut req = match self.agent.request(input) {
            Ok(r) => r,
            Err(e) => return Decision::from_answer(Err(e)),
        };
        match self.agent.step(&mut req, now) {
            Step::Answer(answer) => Decision::from_answer(answer),
            Step::Wait(w) => Decision::undecided(
                Outcome::WouldWait,
                Some(Duration::from_nanos(w.until.saturating_sub(now))),
            ),
        }
    }

    /// `key` resolved once (its rules matched and its keys' slots found):
    /// checks through the [`ResolvedKey`] skip matching and look-up (one
    /// atomic update per rule charged). `Err` is the decision a check of
    /// the key would get now (the rules are not known yet, or the key is
    /// invalid).
    pub fn resolve(&self, key: &Key) -> Result<ResolvedKey, Decision> {
        match self.agent.resolve(&key.input(1, "")) {
            Ok(handle) => Ok(ResolvedKey {
                client: self.clone(),
                key: key.clone(),
                handle,
            }),
            Err(e) => Err(Decision::from_answer(Err(e))),
        }
    }

    /// [`Client::resolve`] of the key of `tenant` on `route`: a handle for
    /// a hot key (once the rules are known: [`Client::ready`]).
    pub fn key(
        &self,
        tenant: impl Into<String>,
        route: impl Into<String>,
    ) -> Result<ResolvedKey, Decision> {
        self.resolve(&Key::new(tenant, route))
    }

    /// Decide a check of `cost` tokens on `key`, waiting for a grant when
    /// no lease holds enough, at most the client's deadline
    /// ([`Builder::deadline`]); then it answers as its last round would
    /// (denied with a retry hint, or the rule's fail policy while the
    /// allocator is out of reach).
    pub async fn check(&self, key: &Key, cost: u32) -> Decision {
        self.check_with_id(key, cost, "").await
    }

    /// [`Client::check`] with a request id: a retry of the same id within a
    /// minute is answered with the first answer and charged once.
    pub async fn check_with_id(&self, key: &Key, cost: u32, request_id: &str) -> Decision {
        if request_id.is_empty() {
            if let Some(d) = self.check_fast(key, cost) {
                return d;
            }
        }
        let input = key.input(cost, request_id);
        let deadline = tokio::time::Instant::now() + self.deadline;
        // Just built, the client may not know the rules yet: the first
        // answer from the allocator brings them, within the deadline.
        self.rules_by(deadline).await;
        Decision::from_answer(self.agent.check_by(input, Some(deadline)).await)
    }

    /// The fast path alone: `Some` when the leases held admit the check
    /// now (the first step of [`Client::check`] without a request id).
    pub(crate) fn check_fast(&self, key: &Key, cost: u32) -> Option<Decision> {
        self.agent
            .check_fast(&key.input(cost, ""))
            .map(|f| Decision::from_fast(f, &self.agent))
    }

    /// Wait until the rules are known or `deadline` passes.
    async fn rules_by(&self, deadline: tokio::time::Instant) {
        while !self.has_rules() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(RULES_POLL).await;
        }
    }

    /// Wait up to `within` until the client knows the rules and its last
    /// call to the allocator succeeded (what the sidecar's `/readyz`
    /// says); whether it did.
    pub async fn ready(&self, within: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if self.agent.is_ready() {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(RULES_POLL).await;
        }
    }

    /// The rules in force (for headers).
    #[cfg(feature = "tower")]
    pub(crate) fn rules(&self) -> Option<Arc<RuleSet>> {
        self.agent.rules()
    }

    /// Whether the rules are known (bootstrap rules, or the allocator's).
    pub fn has_rules(&self) -> bool {
        self.agent.rules().is_some()
    }

    /// Give back every lease this process holds (unused tokens return to
    /// the allocator's bucket at once) and stop renewing; checks after it
    /// answer by each rule's fail policy. Bounded by the agent's fetch
    /// timeout; leases that could not be given back expire on their own.
    pub async fn shutdown(&self) {
        self.agent.shutdown().await;
    }
}

/// A key resolved by [`Client::resolve`], for hot keys: its checks charge
/// the leases directly when they cover the cost, and otherwise take the
/// client's path for the key (so a rules change, which makes the handle
/// stale, costs speed, never a wrong answer; resolve again to get the
/// speed back: [`ResolvedKey::is_current`]).
#[derive(Clone, Debug)]
pub struct ResolvedKey {
    client: Client,
    key: Key,
    handle: quotalease_agent::KeyHandle,
}

impl ResolvedKey {
    /// The key.
    pub fn key(&self) -> &Key {
        &self.key
    }

    /// [`Client::try_check`] of this key.
    pub fn try_check(&self, cost: u32) -> Decision {
        let agent = &self.client.agent;
        match agent.check_handle(&self.handle, cost, agent.now()) {
            Some(f) => Decision::from_fast(f, agent),
            None => self.client.try_check(&self.key, cost),
        }
    }

    /// [`Client::check`] of this key.
    pub async fn check(&self, cost: u32) -> Decision {
        let agent = &self.client.agent;
        match agent.check_handle(&self.handle, cost, agent.now()) {
            Some(f) => Decision::from_fast(f, agent),
            None => self.client.check(&self.key, cost).await,
        }
    }

    /// Whether the handle was resolved under the rules in force (after a
    /// rules change its checks take the slower path until resolved again).
    pub fn is_current(&self) -> bool {
        self.handle.generation() == self.client.agent.rules_generation()
    }
}

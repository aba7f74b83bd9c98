//! The real allocator core in this process, for an embedder's tests (the
//! `testing` feature): the same ledger and state machine the allocator
//! server runs, reached without a network, a server or a state directory.
//! Not a mock: what a test admits through it is what a real allocator
//! would have granted.
//!
//! Time is injectable here, and only here: an in-process allocator reads
//! the clock it is given and every client built on it reads the same one
//! (a [`ManualClock`] the test moves, or a [`TokioClock`] that follows
//! `tokio::time::pause` and `advance`). A client holding leases of a
//! remote allocator always reads `CLOCK_BOOTTIME` (SPEC §2 "Clocks").
//!
//! ```
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! use std::time::Duration;
//! use quotalease_client::testing::{InProcessAllocator, TokioClock};
//! use quotalease_client::Key;
//!
//! let rules = "rules:\n  - id: login\n    match: { tenant: \"*\", route: /login }\n    rate: 1/m\n    burst: 2\n";
//! let alloc = InProcessAllocator::from_yaml_with_clock(rules, TokioClock::new()).unwrap();
//! let client = alloc.client("test").unwrap();
//! let key = Key::new("alice", "/login");
//! assert!(client.check(&key, 1).await.allowed());
//! assert!(client.check(&key, 1).await.allowed());
//! assert!(!client.check(&key, 1).await.allowed());
//! // A minute passes at once: one more token (R is slowed by 0.1 %, SPEC
//! // §2 "Clocks": a whole token takes 60.06 s).
//! tokio::time::advance(Duration::from_secs(61)).await;
//! assert!(client.check(&key, 1).await.allowed());
//! # }
//! ```

use std::sync::{Arc, Mutex};

use quotalease_agent::transport::InProcess;
use quotalease_allocator_core::core::{AllocatorCore, CoreConfig};
pub use quotalease_model::clock::{Clock, ClockSource, ManualClock};
use quotalease_model::key::KeyId;
use quotalease_model::rules::RuleSet;

use crate::Error;

/// An allocator core shared by every client built with
/// [`crate::Builder::in_process`] on it (cheap to clone: clones are the
/// same allocator). It starts with every bucket full (no predecessor).
#[derive(Clone)]
pub struct InProcessAllocator {
    core: Arc<Mutex<AllocatorCore>>,
    clock: ClockSource,
}

impl std::fmt::Debug for InProcessAllocator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("InProcessAllocator")
    }
}

/// What the allocator's ledger holds of one key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ledger {
    /// Tokens in the bucket, not leased.
    pub available: u64,
    /// Tokens (and capacities) counted in unexpired leases.
    pub outstanding: u64,
    /// Holders with an unexpired lease.
    pub holders: usize,
}

impl InProcessAllocator {
    /// An allocator enforcing `rules` (SPEC §4 YAML), on the boot clock.
    pub fn from_yaml(rules: &str) -> Result<Self, Error> {
        let rules = RuleSet::parse(rules, "rules", 1).map_err(|errs| Error::rules(&errs))?;
        Ok(Self::new(rules, ClockSource::Boot))
    }

    /// An allocator enforcing `rules` (SPEC §4 YAML), reading time from
    /// `clock` (a [`ManualClock`], a [`TokioClock`]; the clients built on
    /// it read the same clock).
    pub fn from_yaml_with_clock(rules: &str, clock: impl Into<ClockSource>) -> Result<Self, Error> {
        let rules = RuleSet::parse(rules, "rules", 1).map_err(|errs| Error::rules(&errs))?;
        Ok(Self::new(rules, clock.into()))
    }

    /// An allocator enforcing `rules`, reading time from `clock` (the
    /// clients built on it read the same clock).
    pub fn new(rules: RuleSet, clock: ClockSource) -> Self {
        let now = clock.now();
        let cfg = CoreConfig {
            no_predecessor: true,
            ..CoreConfig::default()
        };
        let core = AllocatorCore::new(cfg, rules, 1, 1, now);
        Self {
            core: Arc::new(Mutex::new(core)),
            clock,
        }
    }

    /// A client holding leases of this allocator as `agent_id` (the
    /// builder's defaults otherwise; [`crate::Builder::in_process`] for
    /// more settings). Inside a tokio runtime.
    pub fn client(&self, agent_id: &str) -> Result<crate::Client, Error> {
        crate::Client::builder()
            .in_process(self)
            .agent_id(agent_id)
            .build()
    }

    /// What the ledger of rule `rule`'s key for `tenant` on `route` holds
    /// now (`None`: no holder ever asked for it).
    pub fn ledger(&self, rule: &str, tenant: &str, route: &str) -> Option<Ledger> {
        let key = KeyId::new(rule, tenant, route);
        let now = self.clock.now();
        let view = self
            .core
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .key_view(now, &key)?;
        Some(Ledger {
            available: view.available,
            outstanding: view.outstanding,
            holders: view.holders.len(),
        })
    }

    /// Put `rules` (SPEC §4 YAML) in force as version `version` (larger
    /// than the one in force: clients adopt it with their next answer).
    pub fn set_rules(&self, rules: &str, version: u64) -> Result<(), Error> {
        let rules = RuleSet::parse(rules, "rules", version).map_err(|errs| Error::rules(&errs))?;
        let now = self.clock.now();
        self.core
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .set_rules(rules, now);
        Ok(())
    }

    pub(crate) fn clock(&self) -> ClockSource {
        self.clock.clone()
    }

    pub(crate) fn transport(&self) -> InProcess {
        let core = self.core.clone();
        let clock = self.clock.clone();
        InProcess::new(move |batch| {
            let now = clock.now();
            core.lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .handle_from(now, batch, "")
        })
    }
}

/// tokio's clock as the allocator's and its clients' time: under
/// `tokio::time::pause()` (or `#[tokio::test(start_paused = true)]`) it
/// stands still until the test advances it (`tokio::time::advance`, or
/// the runtime's auto-advance when every task waits on a timer), so a
/// test of a `1/m` limit takes no minute. Read it inside the runtime.
#[derive(Clone, Copy, Debug)]
pub struct TokioClock {
    origin: tokio::time::Instant,
}

/// What a [`TokioClock`] reads at its origin (any fixed value: the cores
/// take time as nanoseconds from an arbitrary origin).
const TOKIO_CLOCK_ORIGIN_NS: u64 = 1_000_000_000;

impl TokioClock {
    /// A clock starting now (tokio's now: the paused one under `pause`).
    #[allow(clippy::new_without_default)] // reads the runtime's clock: not a plain default
    pub fn new() -> Self {
        Self {
            origin: tokio::time::Instant::now(),
        }
    }
}

impl Clock for TokioClock {
    fn now_ns(&self) -> u64 {
        let elapsed = tokio::time::Instant::now().saturating_duration_since(self.origin);
        TOKIO_CLOCK_ORIGIN_NS.saturating_add(u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX))
    }
}

impl From<TokioClock> for ClockSource {
    fn from(c: TokioClock) -> Self {
        ClockSource::Other(Arc::new(c))
    }
}

//! The real allocator core in this process, for an embedder's tests (the
//! `testing` feature): the same ledger and state machine the allocator
//! server runs, reached without a network, a server or a state directory.
//! Not a mock: what a test admits through it is what a real allocator
//! would have granted.

use std::sync::{Arc, Mutex};

use quotalease_agent::transport::InProcess;
use quotalease_allocator_core::core::{AllocatorCore, CoreConfig};
use quotalease_model::clock::ClockSource;
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
        let key = KeyId {
            rule: rule.into(),
            tenant: tenant.into(),
            route: route.into(),
        };
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

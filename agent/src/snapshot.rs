//! The rule set in force, as the request path reads it.
//!
//! The core publishes a [`Snapshot`] — the rules and their per-rule
//! counters, built together so they always agree — into a [`RulesCell`].
//! The fast path reads it through a small per-thread cache validated by a
//! single atomic load of the cell's generation: no shared read-modify-write
//! (no reference count, no lock) on a decision. A thread refreshes its
//! cached copy only after a publish.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwapOption;
use quotalease_model::rules::RuleSet;

use crate::metrics::{AgentMetrics, RuleCounterSet};

/// Rules and their counters, aligned by index.
#[derive(Debug)]
pub struct Snapshot {
    /// The rule set.
    pub rules: Arc<RuleSet>,
    /// Its per-rule counters (same order as `rules.rules`).
    pub counters: Arc<RuleCounterSet>,
}

/// Where the agent's rules live; see the module docs.
#[derive(Debug)]
pub struct RulesCell {
    /// Tells cells apart in the per-thread cache.
    id: u64,
    /// Bumped after every publish.
    generation: AtomicU64,
    current: ArcSwapOption<Snapshot>,
}

/// Per-thread cache: direct-mapped by cell id, (cell id, generation,
/// snapshot). Large enough that a process holding hundreds of agents (the
/// simulator) mostly hits too.
const CACHED: usize = 256;

type Entry = (u64, u64, Option<Arc<Snapshot>>);

thread_local! {
    static CACHE: RefCell<Vec<Entry>> = const { RefCell::new(Vec::new()) };
}

impl RulesCell {
    /// A cell holding `bootstrap` (if any), with counters in `metrics`.
    pub fn new(bootstrap: Option<RuleSet>, metrics: &AgentMetrics) -> Self {
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        let cell = Self {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            generation: AtomicU64::new(1),
            current: ArcSwapOption::empty(),
        };
        if let Some(rules) = bootstrap {
            cell.publish(rules, metrics);
        }
        cell
    }

    /// Put `rules` in force, keeping the counters of rules that stay.
    pub fn publish(&self, rules: RuleSet, metrics: &AgentMetrics) {
        let counters = Arc::new(RuleCounterSet::for_rules(&rules, &metrics.by_rule.load()));
        metrics.by_rule.store(counters.clone());
        self.current.store(Some(Arc::new(Snapshot {
            rules: Arc::new(rules),
            counters,
        })));
        self.generation.fetch_add(1, Ordering::Release);
    }

    /// The snapshot in force (a reference-counted copy: slow paths only).
    pub fn load_full(&self) -> Option<Arc<Snapshot>> {
        self.current.load_full()
    }

    /// The rule set in force (slow paths only).
    pub fn rules(&self) -> Option<Arc<RuleSet>> {
        self.current.load().as_ref().map(|s| s.rules.clone())
    }

    /// Unique per cell in this process (so per agent).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The generation: moves on at every publish.
    #[inline]
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Whether any rules are in force (bootstrap or from the allocator).
    pub fn has_rules(&self) -> bool {
        self.current.load().is_some()
    }

    /// The version of the rules in force (0: none yet, or bootstrap rules).
    pub fn version(&self) -> u64 {
        self.current.load().as_ref().map_or(0, |s| s.rules.version)
    }

    /// Run `f` on the snapshot in force, from this thread's cache when it
    /// is current (one atomic load, nothing written).
    #[inline]
    pub fn with<R>(&self, f: impl FnOnce(Option<&Arc<Snapshot>>) -> R) -> R {
        let generation = self.generation.load(Ordering::Acquire);
        CACHE.with(|c| {
            let Ok(mut c) = c.try_borrow_mut() else {
                // Re-entered from inside `f` (not done by this crate): no cache.
                return f(self.current.load_full().as_ref());
            };
            if c.is_empty() {
                c.resize(CACHED, (0, 0, None));
            }
            let e = &mut c[(self.id as usize) % CACHED];
            if e.0 != self.id || e.1 != generation {
                // A publish since this thread last looked, a first look, or
                // another cell in this entry: refresh.
                *e = (self.id, generation, self.current.load_full());
            }
            f(e.2.as_ref())
        })
    }
}

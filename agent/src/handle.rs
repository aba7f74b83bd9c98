//! A resolved request shape ([`KeyHandle`]): the rules a (domain, tenant,
//! route) matches and their keys' slots, resolved once and charged with one
//! CAS per rule (see `Agent::resolve`, `Agent::check_handle` and the
//! per-thread cache in `shapes`).

use std::sync::Arc;

use quotalease_model::matching::{Matched, MAX_MATCHED};
use quotalease_model::rules::RuleSet;

use crate::lease_table::{Slot, Take};
use crate::metrics::RuleCounters;
use crate::snapshot::Snapshot;

/// A resolved request shape: see [`crate::Agent::resolve`] and
/// [`crate::Agent::check_handle`].
#[derive(Debug, Clone)]
pub struct KeyHandle {
    /// The rules' generation at resolve time.
    pub(crate) generation: u64,
    /// Their version (what answers report).
    pub(crate) version: u64,
    /// (rule index, slot) of each non-shadow matched rule.
    pub(crate) slots: Vec<(u32, Slot)>,
    /// Their rules' counters, in the same order.
    pub(crate) counters: Vec<Arc<RuleCounters>>,
    /// The largest cost the fast path may charge: the smallest burst of
    /// the rules in `slots` (a larger one is decided by the slow path).
    pub(crate) max_cost: u64,
    pub(crate) any_shadow: bool,
    pub(crate) no_rule: bool,
    /// What a request of this shape is charged to (the slow path's plan,
    /// found once per shape).
    pub(crate) plan: ChargePlan,
}

impl KeyHandle {
    /// A handle for the rules `m` matched in `snap`, whose non-shadow keys
    /// have these slots.
    pub(crate) fn new(
        generation: u64,
        snap: &Snapshot,
        m: &Matched,
        slots: Vec<(u32, Slot)>,
    ) -> Self {
        let max_cost = slots
            .iter()
            .map(|(ri, _)| snap.rules.rules[*ri as usize].burst)
            .min()
            .unwrap_or(u64::MAX);
        let counters = slots
            .iter()
            .filter_map(|(ri, _)| snap.counters.rules.get(*ri as usize))
            .map(|(_, c)| c.clone())
            .collect();
        Self {
            generation,
            version: snap.rules.version,
            any_shadow: m.any_shadow(),
            no_rule: m.is_empty(),
            max_cost,
            slots,
            counters,
            plan: ChargePlan {
                rules: snap.rules.clone(),
                charges: Charges::of(&snap.rules, m),
            },
        }
    }

    /// The rules' generation this handle was resolved for.
    pub fn generation(&self) -> u64 {
        self.generation
    }
}

/// What a request is charged to: the rules it matched, by index into
/// `rules`, split into the charged rules (in file order) and the shadow
/// rules (in file order), which only report. Found once per request.
#[derive(Clone, Debug)]
pub struct ChargePlan {
    pub(crate) rules: Arc<RuleSet>,
    pub(crate) charges: Charges,
}

impl ChargePlan {
    /// The rule set the request was matched in (its answers name rules of
    /// it and its version).
    pub fn rules(&self) -> &Arc<RuleSet> {
        &self.rules
    }
}

/// The matched rules' indices: the charged ones, then the shadow ones.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Charges {
    idx: [u32; MAX_MATCHED],
    charged: usize,
    n: usize,
    /// The first matched rule in file order: an admission that charged no
    /// rule (only shadow rules matched) names it.
    pub(crate) first: u32,
}

impl Charges {
    pub(crate) fn of(rules: &RuleSet, m: &Matched) -> Self {
        let mut idx = [0; MAX_MATCHED];
        let (mut n, mut charged) = (0, 0);
        for shadow in [false, true] {
            for &i in m.indices() {
                if rules.rules[i as usize].shadow == shadow {
                    idx[n] = i;
                    n += 1;
                }
            }
            if !shadow {
                charged = n;
            }
        }
        Self {
            idx,
            charged,
            n,
            first: m.indices().first().copied().unwrap_or(0),
        }
    }

    pub(crate) fn charged(&self) -> &[u32] {
        &self.idx[..self.charged]
    }

    pub(crate) fn shadow(&self) -> &[u32] {
        &self.idx[self.charged..self.n]
    }

    pub(crate) fn all(&self) -> &[u32] {
        &self.idx[..self.n]
    }
}

/// Take `cost` from every slot's lease, all or none: (the smallest
/// global remaining estimate, capped at `max_burst`, the smallest burst of
/// the slots' rules, and its rule index), or None (nothing charged).
pub(crate) fn take_all(
    slots: &[(u32, Slot)],
    cost: u64,
    now: u64,
    max_burst: u64,
) -> Option<(u64, usize)> {
    let mut taken: [u64; MAX_MATCHED] = [0; MAX_MATCHED];
    let mut min = (u64::MAX, slots.first().map_or(0, |s| s.0 as usize));
    for (j, (ri, slot)) in slots.iter().enumerate() {
        match slot.word.try_take(cost, now) {
            Take::Taken {
                generation,
                remaining,
            } => {
                taken[j] = generation;
                // min over slots of min(max_burst, x) = min(max_burst, min x)
                // = min over slots of min(own burst, x).
                let remaining = slot.global_remaining(remaining, max_burst);
                if remaining < min.0 {
                    min = (remaining, *ri as usize);
                }
            }
            Take::Short { .. } | Take::NoLease => {
                for ((_, s), &generation) in slots[..j].iter().zip(&taken[..j]) {
                    s.word.refund(generation, cost);
                }
                return None;
            }
        }
    }
    Some(min)
}

//! Slot leases through the regional (docs/permits.md "Through regional
//! allocators"): per concurrency key one parent slot lease
//! ([`SlotChain`]) whose slots the key's pool in the child-facing core
//! lends to the children. Slot asks go upstream in batches of their own;
//! a batch that failed is sent again as the same batch (same sequence
//! number: the parent's reply cache answers a copy it already applied
//! with the lease it made, so a lost reply does not break the chain), up
//! to [`SLOT_RESENDS`] times.

use super::*;
use crate::slots::chain::{
    ChainChange, ChainTimes, ChainWake, ParentSlotAsk, ParentSlotGrant, FENCES_PER_PARENT_GRANT,
};

/// A failed batch of slot asks is sent again this many times at most.
pub const SLOT_RESENDS: u32 = 3;

/// A batch of slot asks that failed, to send again.
#[derive(Clone, Debug)]
pub(super) struct SlotResend {
    batch: LeaseBatch,
    keys: Vec<KeyId>,
    tries: u32,
}

impl RegionalCore {
    fn chain_times(&self) -> ChainTimes {
        ChainTimes {
            tick_ns: self.cfg.renew_interval_ns,
            low_water_ns: self.cfg.low_water_ns,
            epsilon_ns: self.cfg.epsilon_ns,
        }
    }

    /// Keys children opened get a chain; chains past their deadline
    /// lapse; keys with no parent lease and an idle pool are forgotten.
    pub(super) fn tend_slot_chains(&mut self, now_ns: u64) {
        for key in self.core.take_new_slot_keys() {
            self.slot_chains.entry(key).or_default();
        }
        let mut forget = Vec::new();
        for (key, chain) in self.slot_chains.iter_mut() {
            let Some(pool) = self.core.slot_ledger_mut(key) else {
                if chain.is_idle() {
                    forget.push(key.clone());
                }
                continue;
            };
            pool.advance(now_ns);
            if chain.lapse(now_ns, pool) {
                self.stats.slot_chains_lapsed += 1;
            }
            if chain.is_idle() && pool.is_idle() {
                forget.push(key.clone());
            }
        }
        for key in forget {
            self.slot_chains.remove(&key);
            self.core.remove_slot_key(&key);
        }
    }

    /// The next batch of slot asks: a failed one again, or the asks of
    /// the keys that need one now (`SlotChain::plan`), in key order.
    pub(super) fn poll_slots(&mut self, now_ns: u64) -> Option<LeaseBatch> {
        if let Some(r) = self.slot_resend.take() {
            self.stats.slot_resends += 1;
            return Some(self.resend(now_ns, r));
        }
        let times = self.chain_times();
        let mut asks = Vec::new();
        for (key, chain) in self.slot_chains.iter_mut() {
            let Some(pool) = self.core.slot_ledger_mut(key) else {
                continue;
            };
            let Some(ask) = chain.plan(now_ns, pool, &times) else {
                continue;
            };
            chain.sent(now_ns, ask, pool, &times);
            asks.push((key.clone(), ask));
        }
        if asks.is_empty() {
            return None;
        }
        let items = asks
            .iter()
            .map(|(k, a)| slot_item(k, a))
            .collect::<Vec<_>>();
        let keys = asks.into_iter().map(|(k, _)| k).collect();
        self.stats.slot_asks += items.len() as u64;
        let batch = self.send(now_ns, items, Vec::new());
        if let Some(f) = self.in_flight.as_mut() {
            f.slots = keys;
            f.batch = Some(batch.clone());
        }
        Some(batch)
    }

    /// The `WaitSlots` wake-ups to send the parent now (each key at
    /// most one at a time; `SlotChain::take_wake`).
    pub fn slot_wakes(&mut self, now_ns: u64) -> Vec<(KeyId, ChainWake)> {
        self.slot_chains
            .iter_mut()
            .filter_map(|(k, c)| c.take_wake(now_ns).map(|w| (k.clone(), w)))
            .collect()
    }

    /// A wake-up's answer for `key` (`served`: the parent answered it).
    /// Whether the upstream side should look at once.
    pub fn on_slot_wake(
        &mut self,
        now_ns: u64,
        key: &KeyId,
        served: bool,
        room: bool,
        contended: bool,
    ) -> bool {
        let (Some(chain), Some(pool)) = (
            self.slot_chains.get_mut(key),
            self.core.slot_ledger_mut(key),
        ) else {
            return false;
        };
        chain.on_wake(now_ns, served, room, contended, pool);
        served && (room || contended)
    }

    /// At shutdown: every parent slot lease renewed keeping only what
    /// the children hold (their permits run to their expiries), the rest
    /// given back; items for the last batch and their keys.
    pub(super) fn slot_shutdown_items(&mut self, now_ns: u64) -> (Vec<LeaseItem>, Vec<KeyId>) {
        let times = self.chain_times();
        let mut asks = Vec::new();
        for (key, chain) in self.slot_chains.iter_mut() {
            let (lease_id, _, _) = chain.lease();
            let Some(pool) = self.core.slot_ledger_mut(key) else {
                continue;
            };
            if lease_id == 0 || chain.asking() {
                continue;
            }
            pool.advance(now_ns);
            let ask = ParentSlotAsk {
                lease_id,
                keep: pool.held(),
                want: 0,
                sent_ns: now_ns,
                resume: false,
            };
            chain.sent(now_ns, ask, pool, &times);
            asks.push((key.clone(), ask));
        }
        let items = asks.iter().map(|(k, a)| slot_item(k, a)).collect();
        let keys = asks.into_iter().map(|(k, _)| k).collect();
        (items, keys)
    }

    /// Send `r`'s batch again, unchanged.
    fn resend(&mut self, now_ns: u64, mut r: SlotResend) -> LeaseBatch {
        self.stats.upstream_messages += 1;
        self.last_sent_ns = Some(now_ns);
        let mut f = self.in_flight_of(&mut r.batch, now_ns, Vec::new());
        f.slots = r.keys;
        f.batch = Some(r.batch.clone());
        f.tries = r.tries;
        self.in_flight = Some(f);
        r.batch
    }

    /// The slot asks of the batch `f` got no answer: sent again unless it
    /// was sent often enough; then their promises stand (`SlotChain::abandon`).
    pub(super) fn slot_batch_failed(&mut self, f: InFlight) {
        if f.slots.is_empty() {
            return;
        }
        match f.batch {
            Some(batch) if f.tries < SLOT_RESENDS => {
                self.slot_resend = Some(SlotResend {
                    batch,
                    keys: f.slots,
                    tries: f.tries + 1,
                });
            }
            _ => {
                for key in &f.slots {
                    if let Some(c) = self.slot_chains.get_mut(key) {
                        c.abandon();
                    }
                }
            }
        }
    }

    /// The parent's answers to the slot asks of the batch in flight.
    pub(super) fn apply_slot_grants(&mut self, now_ns: u64, keys: &[KeyId], grants: &[Grant]) {
        let times = self.chain_times();
        for (key, g) in keys.iter().zip(grants) {
            let Some(chain) = self.slot_chains.get_mut(key) else {
                continue;
            };
            let pg = ParentSlotGrant {
                applied: g.status == GrantStatus::Granted as i32,
                lease_id: g.lease_id,
                slots: g.tokens,
                kept: g.carried,
                folded: g.folded,
                ttl_ns: g.ttl_ms.saturating_mul(MS),
                fence: g.fence,
                contended: g.contended,
                over: g.over,
                share: g.share,
                retry_after_ns: g.retry_after_ms.saturating_mul(MS),
                holders: g.holders,
            };
            if !pg.applied {
                tracing::debug!(?key, status = g.status, detail = %g.detail, "the parent refused a slot ask");
            }
            // A chain asking keeps its pool (pools are forgotten only with
            // idle chains); should one be gone, the chain must not stay
            // asking for ever.
            let Some(pool) = self.core.slot_ledger_mut(key) else {
                chain.abandon();
                continue;
            };
            match chain.on_grant(now_ns, &pg, pool, &times) {
                ChainChange::Broke => self.stats.slot_chain_breaks += 1,
                ChainChange::Resumed(kept) => {
                    self.stats.slot_resumes += 1;
                    self.stats.slots_resumed += kept;
                }
                ChainChange::None => {}
            }
        }
    }
}

/// The `SLOTS` item of `ask` for `key`.
fn slot_item(key: &KeyId, ask: &ParentSlotAsk) -> LeaseItem {
    LeaseItem {
        rule_id: key.rule().to_string(),
        tenant: key.tenant().to_string(),
        route: key.route().to_string(),
        kind: ItemKind::Slots as i32,
        lease_id: ask.lease_id,
        keep: ask.keep,
        want: ask.want,
        fences: FENCES_PER_PARENT_GRANT,
        resume: ask.resume,
        ..LeaseItem::default()
    }
}

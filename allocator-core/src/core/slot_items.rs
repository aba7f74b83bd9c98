//! Items of keys of rules with `concurrency` (SPEC §4, docs/permits.md):
//! slot leases asked for, renewed and given back, one [`SlotLedger`] per
//! key.
//!
//! * A key's ledger is made at its first ask. While a predecessor's slot
//!   leases may still be out (a restart's wait, or a new term's: slot
//!   ledgers are neither checkpointed nor reserved; or the wait after our
//!   state turned out lost or older than what holders saw), its phantom
//!   holds all `N` slots until that wait is over, and holders' asks
//!   naming a predecessor's lease adopt its kept slots out of the phantom
//!   (`SlotLedger::after_restart`): permits held across a restart or
//!   failover are renewed on, not lost.
//! * Each ask gets a new lease id of this core's (ids grow across
//!   restarts and terms); duplicates never reach the ledger (the reply
//!   cache answers them, older sequence numbers are stale).
//! * **Fencing**: a new ledger's counter starts at
//!   `(wall clock ns >> 30) << 12` as this core reckons it from its lease
//!   id base (wall-clock ns at its start, and with `--etcd` at least
//!   2^42 above the predecessor's): the numbers of a key grow across
//!   restarts, failovers and a dropped-and-remade ledger while a key takes
//!   fewer than 4 096 numbers per 2^30 ns (~3 800 a second) on average
//!   (a grant takes one, a regional's a block of up to 64) and
//!   the wall clock does not step back between starts. They stay below
//!   2^44 (the permits' tokens keep 20 bits of their own) until 2116.
//! * At a regional allocator (pooled mode) a key's ledger is a pool
//!   ([`SlotLedger::new_pool`]) that lends what its parent slot lease
//!   holds, no lease past that lease's deadline; the regional's upstream
//!   side keeps it (`slots::chain`). A grant short of what a child wants
//!   says `opening`, so the upstream side looks at once.

use quotalease_proto::lease::ItemKind;

use super::*;
use crate::slots::{SlotAsk, SlotLedger};

/// A child's ask that waits for a regional's resume is told to ask again
/// after this long (about a round trip to the parent).
const RESUME_RETRY_MS: u64 = 20;

impl AllocatorCore {
    /// A `SLOTS` or `SLOTS_RELEASE` item.
    pub(super) fn slot_item(
        &mut self,
        now_ns: u64,
        holder: HolderId,
        item: &LeaseItem,
        ttl_ns: u64,
    ) -> Grant {
        let version = self.rules.version;
        let bad = |detail: String| super::batch::bad_item(version, detail);
        let release = item.kind == ItemKind::SlotsRelease as i32;
        if item.kind == ItemKind::PermitRelease as i32 {
            for (field, v) in [
                ("rule_id", &item.rule_id),
                ("tenant", &item.tenant),
                ("route", &item.route),
            ] {
                if v.len() > MAX_ID_BYTES {
                    return bad(format!(
                        "{field}: {} bytes, at most {MAX_ID_BYTES}",
                        v.len()
                    ));
                }
            }
            return self.forward_release(holder, item);
        }
        let key = Self::key_of(item);
        let Some(rule) = self.rules.permit_rule(&item.rule_id) else {
            // A release for a rule that is gone still frees its slots.
            if release {
                return self.slot_release(now_ns, holder, &key, item.lease_id);
            }
            return Grant {
                status: GrantStatus::UnknownRule as i32,
                rule_version: version,
                detail: format!(
                    "rule_id: no rule with concurrency has id {:?}",
                    item.rule_id
                ),
                ..Grant::default()
            };
        };
        if let Err(why) = key_part_ok(&rule.tenant, &item.tenant) {
            return bad(format!("tenant: {why}"));
        }
        if let Err(why) = key_part_ok(&rule.route, &item.route) {
            return bad(format!("route: {why}"));
        }
        if release {
            return self.slot_release(now_ns, holder, &key, item.lease_id);
        }
        // A start's grace is part of the phantom's time (`slots_phantom_until_ns`):
        // nothing fresh, and predecessors' leases are adopted.
        let (n, max_keys) = (rule.concurrency, rule.max_keys);
        if !self.slot_keys.contains_key(&key) {
            let count = self
                .slot_keys_per_rule
                .get(&item.rule_id)
                .copied()
                .unwrap_or(0);
            if max_keys.is_some_and(|m| count >= m) {
                self.stats.key_limit_refusals += 1;
                return Grant {
                    status: GrantStatus::KeyLimit as i32,
                    rule_version: version,
                    detail: format!("rule {}: max_keys {} reached", item.rule_id, count),
                    ..Grant::default()
                };
            }
            *self
                .slot_keys_per_rule
                .entry(item.rule_id.clone())
                .or_insert(0) += 1;
            let base = self.fence_base(now_ns);
            let ledger = match self.slots_phantom_until_ns {
                // A regional's pool lends nothing until its parent slot
                // lease says how much (`slots::chain`).
                _ if self.pooled.is_some() => {
                    self.new_slot_keys.push(key.clone());
                    let mut pool = SlotLedger::new_pool(0);
                    // Children may name leases of this regional's
                    // predecessor: with resumes on, they wait for one.
                    if self.cfg.resume_slot_leases {
                        pool.await_resume(self.fence_clock.0);
                    }
                    pool
                }
                Some(until) if now_ns < until => {
                    SlotLedger::after_restart(n, base, until, self.fence_clock.0)
                }
                _ => SlotLedger::new(n, base),
            };
            self.slot_keys.insert(key.clone(), ledger);
        }
        let ledger = self.slot_keys.get_mut(&key).expect("inserted above");
        if ledger.needs_resume(item.lease_id) {
            // Answered now it would keep nothing, and the child's permits
            // on it would end at their use-by: the chain's resume (asked
            // at once: `opening`) says how much of it the parent covers.
            self.stats.slot_resume_waits += 1;
            return Grant {
                status: GrantStatus::Resuming as i32,
                rule_version: version,
                retry_after_ms: RESUME_RETRY_MS,
                opening: true,
                detail: "lease_id: a lease of this regional's predecessor; it is resuming the key's parent lease: ask again".into(),
                ..Grant::default()
            };
        }
        if item.resume {
            // Its predecessors are the other processes of its id and
            // principal (each drew its own instance nonce).
            let me = self.holder_names.get(&holder);
            let siblings: Vec<HolderId> = me.map_or(Vec::new(), |me| {
                self.holders
                    .iter()
                    .filter(|(n, h)| {
                        h.id != holder && n.principal == me.principal && n.agent_id == me.agent_id
                    })
                    .map(|(_, h)| h.id)
                    .collect()
            });
            ledger.reassign(&siblings, holder);
        }
        let new_id = self.next_lease_id;
        self.next_lease_id += 1;
        let g = ledger.ask(
            now_ns,
            SlotAsk {
                holder,
                lease_id: item.lease_id,
                keep: item.keep,
                want: item.want.min(n),
                ttl_ns,
                new_id,
                fences: item.fences,
                resume: item.resume,
            },
        );
        let ledger_holders = ledger.holders();
        if g.fresh > 0 {
            self.stats.slot_grants += 1;
            self.stats.slots_granted += g.fresh;
        }
        let phantom_ms = self
            .slots_phantom_until_ns
            .filter(|&u| now_ns < u)
            .map(|u| (u - now_ns).div_ceil(1_000_000));
        Grant {
            status: GrantStatus::Granted as i32,
            lease_id: g.lease_id,
            tokens: g.slots,
            carried: g.kept,
            folded: g.folded,
            ttl_ms: g.expires_ns.saturating_sub(now_ns) / 1_000_000,
            rule_version: version,
            // While a predecessor's leases may be out, nothing is free
            // before they have expired; otherwise slots come back when a
            // holder releases, at no time known here.
            retry_after_ms: if g.fresh < item.want.min(n) {
                phantom_ms.unwrap_or(0)
            } else {
                0
            },
            fence: g.fence,
            contended: g.contended,
            over: g.over,
            share: g.share,
            holders: ledger_holders,
            starting: g.lease_id == 0 && phantom_ms.is_some(),
            // A regional's pool short of what a child wants: its upstream
            // side looks at once.
            opening: self.pooled.is_some() && g.fresh < item.want.min(n),
            ..Grant::default()
        }
    }

    fn slot_release(&mut self, now_ns: u64, holder: HolderId, key: &KeyId, lease_id: u64) -> Grant {
        if let Some(ledger) = self.slot_keys.get_mut(key) {
            if ledger.release(now_ns, holder, lease_id) {
                self.stats.slot_releases += 1;
            }
            // A regional's pool goes only with its chain (`tend_slot_chains`):
            // a reply to its parent ask must find it.
            if ledger.is_idle() && self.pooled.is_none() {
                self.drop_slot_key(key);
            }
        }
        Grant {
            status: GrantStatus::Released as i32,
            rule_version: self.rules.version,
            ..Grant::default()
        }
    }

    /// A `PERMIT_RELEASE` from `from`: queued for the holder it names when
    /// that holder has `from`'s principal and the named incarnation (SPEC
    /// §8: a principal acts only on leases of its own identities).
    fn forward_release(&mut self, from: HolderId, item: &LeaseItem) -> Grant {
        let version = self.rules.version;
        let principal = self.holder_names.get(&from).map(|n| n.principal.clone());
        let target = principal.and_then(|principal| {
            self.holders
                .iter()
                .find(|(name, h)| {
                    name.principal == principal
                        && name.instance == item.holder_instance
                        && h.incarnation == item.holder_incarnation
                })
                .map(|(_, h)| h.id)
        });
        let Some(target) = target else {
            self.stats.forwarded_unknown += 1;
            return Grant {
                status: GrantStatus::UnknownHolder as i32,
                rule_version: version,
                detail: "holder_instance: no holder of this principal with that instance and incarnation here (it stopped, or the allocator restarted): the permit frees at its expiry".into(),
                ..Grant::default()
            };
        };
        let queue = self.forwarded.entry(target).or_default();
        let release = quotalease_proto::lease::ForwardedRelease {
            rule_id: item.rule_id.clone(),
            tenant: item.tenant.clone(),
            route: item.route.clone(),
            incarnation: item.holder_incarnation,
            permit: item.permit,
        };
        if !queue.contains(&release) {
            if queue.len() >= crate::core::MAX_FORWARDED {
                return super::batch::bad_item(
                    version,
                    format!(
                        "permit: {} releases already wait for that holder's next reply; the permit frees at its expiry",
                        crate::core::MAX_FORWARDED
                    ),
                );
            }
            queue.push(release);
            self.stats.forwarded_releases += 1;
        }
        Grant {
            status: GrantStatus::Released as i32,
            rule_version: version,
            ..Grant::default()
        }
    }

    fn drop_slot_key(&mut self, key: &KeyId) {
        if self.slot_keys.remove(key).is_some() {
            if let Some(c) = self.slot_keys_per_rule.get_mut(key.rule()) {
                *c = c.saturating_sub(1);
            }
        }
    }

    /// Drop the slot ledgers with nothing lent and no recent demand at
    /// `now_ns` (their next ask makes a new one, its fencing numbers above
    /// this one's).
    pub(super) fn sweep_slot_keys(&mut self, now_ns: u64) {
        if self.pooled.is_some() {
            // A regional's pools go with their parent leases
            // ([`AllocatorCore::remove_slot_key`]).
            return;
        }
        let idle: Vec<KeyId> = self
            .slot_keys
            .iter_mut()
            .filter_map(|(k, l)| {
                l.advance(now_ns);
                l.is_idle().then(|| k.clone())
            })
            .collect();
        for k in idle {
            self.drop_slot_key(&k);
        }
    }

    /// A predecessor's slot leases may be out until `until_ns` after all
    /// (our state was lost or is older than what holders saw): every slot
    /// ledger's phantom holds all `N` beside what it knows, and ledgers
    /// made before then start with one.
    pub(super) fn slots_predecessor_lost(&mut self, until_ns: u64) {
        let until = self
            .slots_phantom_until_ns
            .map_or(until_ns, |u| u.max(until_ns));
        self.slots_phantom_until_ns = Some(until);
        let own_ids_from = self.fence_clock.0;
        for ledger in self.slot_keys.values_mut() {
            ledger.predecessor_lost(until, own_ids_from);
        }
    }

    /// The fencing base of a slot ledger made at `now_ns` (module docs).
    fn fence_base(&self, now_ns: u64) -> u64 {
        let (id_base, start_ns) = self.fence_clock;
        let wall = id_base.saturating_add(now_ns.saturating_sub(start_ns));
        ((wall >> 30) << 12).min(crate::slots::MAX_FENCE_BASE)
    }

    /// A read-only view of one concurrency key's slots (for `GET
    /// /v1/keys`): `N`, slots held, and the leases by holder.
    pub fn slot_view(&mut self, now_ns: u64, key: &KeyId) -> Option<SlotView> {
        let ledger = self.slot_keys.get_mut(key)?;
        ledger.advance(now_ns);
        let leases = ledger
            .leases()
            .iter()
            .map(|l| {
                let name = self
                    .holder_names
                    .get(&l.holder)
                    .cloned()
                    .unwrap_or_else(|| HolderName {
                        agent_id: "(predecessor)".into(),
                        ..HolderName::default()
                    });
                (name, *l)
            })
            .collect();
        Some(SlotView {
            n: ledger.n(),
            held: ledger.held(),
            leases,
        })
    }

    /// An operator's forced release of slot lease `lease_id` of `key`
    /// (its holder is dead and its lease's TTL long): the lease freed,
    /// with its holder, or `None` when the key holds no such lease. The
    /// holder, should it be alive after all, keeps its permits only to
    /// their expiries (its asks naming the lease keep nothing of it), and
    /// the next grants carry larger fencing tokens.
    pub fn force_release_slots(
        &mut self,
        now_ns: u64,
        key: &KeyId,
        lease_id: u64,
    ) -> Option<(HolderName, crate::slots::SlotLease)> {
        let ledger = self.slot_keys.get_mut(key)?;
        let lease = ledger.force_release(now_ns, lease_id)?;
        self.stats.slot_force_releases += 1;
        let name = self
            .holder_names
            .get(&lease.holder)
            .cloned()
            .unwrap_or_default();
        // A regional's pool goes only with its chain (`tend_slot_chains`):
        // a reply to its parent ask must find it.
        if ledger.is_idle() && self.pooled.is_none() {
            self.drop_slot_key(key);
        }
        Some((name, lease))
    }

    /// What a `WaitSlots` wake-up reads of `key` at `now_ns`: its free
    /// slots and whether some holder misses slots; `None` when no ledger
    /// of it is here.
    pub fn slot_wake(&mut self, now_ns: u64, key: &KeyId) -> Option<(u64, bool)> {
        let ledger = self.slot_keys.get_mut(key)?;
        ledger.advance(now_ns);
        Some((ledger.room(now_ns), ledger.contended()))
    }

    /// Whether releases forwarded by other agents wait for the holder
    /// `name`'s next reply (a `WaitSlots` wake-up answers then).
    pub fn releases_waiting(&self, name: &HolderName) -> bool {
        self.holders
            .get(name)
            .is_some_and(|h| self.forwarded.get(&h.id).is_some_and(|q| !q.is_empty()))
    }

    /// The slot ledger of `key`, if any (a regional's pool: its upstream
    /// side sets what it may lend, `slots::chain`).
    pub fn slot_ledger_mut(&mut self, key: &KeyId) -> Option<&mut SlotLedger> {
        self.slot_keys.get_mut(key)
    }

    /// Pooled mode: the concurrency keys children opened since the last
    /// call.
    pub fn take_new_slot_keys(&mut self) -> Vec<KeyId> {
        std::mem::take(&mut self.new_slot_keys)
    }

    /// Pooled mode: forget `key`'s pool (nothing lent, no parent lease).
    pub fn remove_slot_key(&mut self, key: &KeyId) {
        self.drop_slot_key(key);
    }

    /// Keys with a slot ledger.
    pub fn slot_key_count(&self) -> usize {
        self.slot_keys.len()
    }
}

/// One concurrency key's slots, as [`AllocatorCore::slot_view`] shows them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotView {
    /// The rule's `N`.
    pub n: u64,
    /// Slots held by unexpired leases (the phantom's included).
    pub held: u64,
    /// The leases, by holder.
    pub leases: Vec<(HolderName, crate::slots::SlotLease)>,
}

//! Planning: the tick's walk over the keys (in bounded steps), parking
//! and listing, and what each key asks for or gives back
//! ([`plan_key`], over [`crate::renewal`]'s planner).

use super::*;

impl AgentCore {
    /// Plan keys at `t`: the items of the next batch and the keys of its
    /// renewals (in item order); `None` while a tick's walk is under way
    /// (its steps follow, see [`WALK_STEP`]).
    pub(super) fn plan_all(
        &mut self,
        t: u64,
        woken: bool,
    ) -> Option<(Vec<LeaseItem>, Vec<Renewing>)> {
        let rules = self.rules.rules();
        let version = rules.as_ref().map_or(0, |r| r.version);
        let previous = if woken {
            version
        } else {
            std::mem::replace(&mut self.planned_version, version)
        };
        let rules_changed = previous != version;
        let mut ctx = PlanCtx {
            rules,
            rules_changed,
            idle_ns: self.cfg.plan.idle_release.as_nanos() as u64,
            lead_ns: (4 * self.cfg.plan.renew_interval.as_nanos() as u64)
                .max(self.cfg.plan.low_water.as_nanos() as u64),
            ups: self
                .ups
                .iter()
                .map(|u| (u.down, u.outage, u.probe_at_ns))
                .collect(),
            late: std::mem::take(&mut self.late_releases),
            releases: Vec::new(),
            renews: Vec::new(),
            forget: Vec::new(),
        };
        if woken {
            // Only the keys requests wait for (releases wait for a tick).
            let wanted = std::mem::take(&mut self.wanted);
            let mut seen = std::collections::HashSet::with_capacity(wanted.len());
            for slot in wanted {
                if seen.insert(slot.addr()) {
                    let mut k = KeyState::load(&slot);
                    if k.held {
                        self.plan_one(&slot, &mut k, t, false, &mut ctx);
                        k.store(&slot);
                        self.list(slot, t);
                    }
                }
            }
        } else if rules_changed {
            // Every key (the rules may change any key's plan), in key order
            // (the table's is seeded per process; the simulator replays
            // exactly), then the lists again from scratch.
            self.wanted.clear();
            let mut all: Vec<Slot> = self.table.pin().iter().map(|s| s.to_owned()).collect();
            all.sort_unstable_by(|a, b| a.key_ref().cmp(&b.key_ref()));
            self.active.clear();
            self.parked.clear();
            for slot in all {
                // Denials cached under older rules are dropped: the key
                // asks the allocator again (a new burst or rate may
                // admit). Not at the first rules (the hints came with them).
                if previous != 0 {
                    slot.set_dry_until(0);
                }
                let mut k = KeyState::load(&slot);
                self.plan_one(&slot, &mut k, t, true, &mut ctx);
                k.listed = !k.parked;
                k.store(&slot);
                if k.parked {
                    self.park(k.quiet_until_ns, slot);
                } else {
                    self.active.push(slot);
                }
            }
        } else {
            // Keys requests wait for are planned by this tick, parked or
            // not (a parked one would otherwise be skipped, and its
            // request wait out its fetch timeouts).
            for slot in std::mem::take(&mut self.wanted) {
                let mut k = KeyState::load(&slot);
                if k.held {
                    k.parked = false;
                    if !k.listed {
                        k.listed = true;
                        self.active.push(slot.clone());
                    }
                    k.store(&slot);
                }
            }
            // Parked keys whose interval has come join the visit.
            let now_bin = t / self.interval_ns();
            while let Some(entry) = self.parked.first_entry() {
                if *entry.key() > now_bin {
                    break;
                }
                for slot in entry.remove() {
                    let mut k = KeyState::load(&slot);
                    if k.held && !k.listed {
                        k.listed = true;
                        k.store(&slot);
                        self.active.push(slot);
                    }
                }
            }
            let walk = Walk {
                keys: std::mem::take(&mut self.active),
                next: 0,
                ctx,
            };
            return self.step_walk(t, walk);
        }
        self.forget(&mut ctx.forget);
        Some(finish_plan(ctx))
    }

    /// The next [`WALK_STEP`] keys of a tick at `t`. When the walk is done,
    /// its plan is sent; until then the walk is kept for the next call.
    /// Always `None` (the shape of [`AgentCore::plan_all`]'s answer).
    pub(super) fn step_walk(
        &mut self,
        t: u64,
        mut walk: Walk,
    ) -> Option<(Vec<LeaseItem>, Vec<Renewing>)> {
        let end = walk.keys.len().min(walk.next + WALK_STEP);
        for i in walk.next..end {
            let slot = walk.keys[i].clone();
            let mut k = KeyState::load(&slot);
            if k.held {
                k.listed = false; // taken out of the list at the walk's start
                self.plan_one(&slot, &mut k, t, true, &mut walk.ctx);
                k.store(&slot);
                self.list(slot, t);
            }
        }
        walk.next = end;
        // Keys found idle long enough go at once, under this same call: a
        // request must not find one half-forgotten between two steps.
        self.forget(&mut walk.ctx.forget);
        if walk.next < walk.keys.len() {
            self.walk = Some(walk);
            return None;
        }
        let plan = finish_plan(walk.ctx);
        self.send(t, plan.0, plan.1);
        None
    }

    /// Forget keys (from the table and the core together).
    fn forget(&mut self, slots: &mut Vec<Slot>) {
        if slots.is_empty() {
            return;
        }
        let table = self.table.pin();
        for slot in slots.drain(..) {
            let mut k = KeyState::load(&slot);
            if k.held {
                k.held = false;
                k.listed = false;
                k.parked = false;
                k.store(&slot);
                self.rare.remove(&slot);
                table.remove(&Lookup(slot.key_ref()));
            }
        }
    }

    /// [`plan_key`] with this core's settings.
    fn plan_one(
        &self,
        slot: &Slot,
        k: &mut KeyState,
        t: u64,
        may_release: bool,
        ctx: &mut PlanCtx,
    ) {
        plan_key(
            &self.cfg,
            &self.metrics,
            &self.rare,
            slot,
            k,
            t,
            may_release,
            ctx,
        );
    }

    /// The renew interval in ns (at least 1): the width of a parked bin.
    pub(super) fn interval_ns(&self) -> u64 {
        (self.cfg.plan.renew_interval.as_nanos() as u64).max(1)
    }

    /// Park `slot` until `quiet_until` (in the bin of its interval).
    fn park(&mut self, quiet_until: u64, slot: Slot) {
        let bin = quiet_until / self.interval_ns();
        self.parked.entry(bin).or_default().push(slot);
    }

    /// After a visit of `slot`: keep it in the tick's list, or park it
    /// until it is due (a parked key is in `parked` at its current
    /// `quiet_until_ns`; an older entry of it is harmless).
    fn list(&mut self, slot: Slot, t: u64) {
        let mut k = KeyState::load(&slot);
        if !k.held {
            return;
        }
        if k.parked && k.quiet_until_ns > t {
            // Still listed (a wanted key planned between ticks): the next
            // tick visits it and parks it then.
            if !k.listed {
                self.park(k.quiet_until_ns, slot);
            }
        } else if !k.listed {
            k.listed = true;
            k.store(&slot);
            self.active.push(slot);
        }
    }
}

/// A planning pass's items in send order: releases the allocator did not
/// apply before (as they came back), releases in key order, then
/// renewals in key order (whatever the hash order: the allocator's fair
/// shares then do not depend on a per-process seed, and the simulator
/// replays exactly), with the renewals' slot ids.
fn finish_plan(ctx: PlanCtx) -> (Vec<LeaseItem>, Vec<Renewing>) {
    let PlanCtx {
        mut late,
        mut releases,
        mut renews,
        ..
    } = ctx;
    releases.sort_by(item_order);
    renews.sort_by(|(a, _), (b, _)| item_order(a, b));
    late.append(&mut releases);
    let mut items = late;
    let mut keys = Vec::with_capacity(renews.len());
    for (item, r) in renews {
        items.push(item);
        keys.push(r);
    }
    (items, keys)
}

/// Batch items in key order.
pub(super) fn item_order(a: &LeaseItem, b: &LeaseItem) -> std::cmp::Ordering {
    (&a.rule_id, &a.tenant, &a.route).cmp(&(&b.rule_id, &b.tenant, &b.route))
}

/// Plan one key at `t`. `may_release` is false on a wake-up pass.
#[allow(clippy::too_many_arguments)]
fn plan_key(
    cfg: &CoreConfig,
    metrics: &AgentMetrics,
    rare: &HashMap<Slot, Rare, foldhash::fast::FixedState>,
    slot: &Slot,
    k: &mut KeyState,
    t: u64,
    may_release: bool,
    ctx: &mut PlanCtx,
) {
    // An idle key is skipped by the tick until its plan can change,
    // without touching its slot: a tick over many cold keys costs a walk
    // over the core's own compact entries.
    if may_release && !ctx.rules_changed && k.parked && t < k.quiet_until_ns {
        return;
    }
    // A quiet key (nothing spent, denied or waiting since the last visit)
    // is skipped until the planner's answer can change: a tick costs
    // O(active keys) of work, not O(keys held).
    let (gen, tokens) = slot.word.level_at(t);
    let packed = pack(gen, tokens);
    // The word as the last visit left it: a visit that waits leaves
    // (generation, baseline) = the word it read.
    let seen_word = pack(k.generation, k.baseline);
    if !ctx.rules_changed
        && t < k.quiet_until_ns
        && seen_word == packed
        && slot.waiting() == 0
        && slot.denied_peek() == 0
        && slot.word.taken_peek() == 0
    {
        // Nothing changed, so a full visit would plan as before; idle for
        // the EWMA's time constant now: parked until its plan can change.
        let idle_ns = cfg.plan.ewma_tau.as_nanos() as u64;
        k.parked = k.usage.last_active_ns.saturating_add(idle_ns) <= t;
        return;
    }
    // Consumption: a lease of tokens tells it by its level, a rate lease
    // (which refills) by its count of tokens taken.
    let refill = slot.word.refill();
    if gen == k.generation && !refill.is_rate() {
        let consumed = k.baseline.saturating_sub(tokens);
        k.usage.since_tick += consumed;
    }
    k.usage.since_tick += slot.word.take_taken();
    // Demand, not just admissions, sizes the next lease.
    k.usage.denied_since_tick += slot.take_denied();
    k.baseline = tokens;
    k.usage.tick(0, t, cfg.plan.ewma_tau);
    // What the tick did not fold in (a second visit at the same instant)
    // waits in the slot for the next one.
    let unfolded = std::mem::take(&mut k.usage.denied_since_tick);
    if unfolded > 0 {
        slot.add_denied(unfolded);
    }
    let waiting = slot.waiting();
    if waiting > 0 {
        k.usage.last_active_ns = t;
    }
    let rule = ctx.rules.as_ref().and_then(|r| r.get(slot.rule_id()));
    let deadline = slot.word.deadline_ns();
    let decision = match rule {
        None => Plan::Release,
        Some(rule) => plan(
            &cfg.plan,
            &k.usage,
            KeyNow {
                held: if t < deadline { tokens } else { 0 },
                valid: t < deadline && k.lease_id != 0,
                deadline_ns: deadline,
                burst: rule.burst,
                waiting_cost: waiting,
                dry_until_ns: slot.dry_until(),
                in_flight: k.in_flight.is_some(),
                rule_rate_utps: rule.rate.tokens.saturating_mul(1_000_000)
                    / rule.rate.period_s.max(1),
                lease_rate_utps: if refill.is_rate() && t < deadline {
                    1_000_000_000_000_000 / refill.ns_per_token
                } else {
                    0
                },
                asked_rate_utps: k.asked_rate_utps,
                lease_ttl_ns: cfg.lease_ttl.as_nanos() as u64,
                central: cfg.plan.central && rule.rate.served_centrally(),
                fetch_timeout_ns: cfg.fetch_timeout.as_nanos() as u64,
            },
            t,
        ),
    };
    // An allocator taken for unreachable is asked only by its probes: a
    // key that would ask waits for the next one.
    let (down, _, probe_at) = ctx.ups[key_shard(slot, ctx.ups.len())];
    let held_back = down && t < probe_at && matches!(decision, Plan::Renew { .. });
    let decision = if held_back { Plan::Wait } else { decision };
    // Until when this key's plan cannot change without activity: its idle
    // release, the end of a dry spell, its refresh lead, its deadline, the
    // next probe (each only if still ahead).
    k.quiet_until_ns = if matches!(decision, Plan::Wait) && k.in_flight.is_none() {
        [
            k.usage.last_active_ns.saturating_add(ctx.idle_ns + 1),
            slot.dry_until(),
            deadline.saturating_sub(ctx.lead_ns),
            deadline,
            if held_back { probe_at } else { 0 },
            // A key served centrally gives back what its lease still
            // holds once quiet for a fetch timeout.
            if cfg.plan.central && rule.is_some_and(|r| r.rate.served_centrally()) {
                k.usage
                    .last_active_ns
                    .saturating_add(cfg.fetch_timeout.as_nanos() as u64)
            } else {
                0
            },
        ]
        .into_iter()
        .filter(|&x| x > t)
        .min()
        .unwrap_or(0)
    } else {
        0
    };
    let idle_ns = cfg.plan.ewma_tau.as_nanos() as u64;
    k.parked = k.quiet_until_ns > t
        && k.usage.last_active_ns.saturating_add(idle_ns) <= t
        && slot.waiting() == 0;
    match decision {
        Plan::Wait => {}
        Plan::Renew {
            want,
            want_rate_utps,
        } => {
            // Cut a new generation at the report: a refund of a charge taken
            // before it must not come back after the allocator counted that
            // charge as spent.
            let (at_cut, new_gen) = slot.word.cut(t);
            let spent = if gen == k.generation && !refill.is_rate() {
                k.usage.since_tick += tokens.saturating_sub(at_cut);
                k.granted.saturating_sub(at_cut)
            } else {
                0
            };
            k.asked_rate_utps = want_rate_utps;
            k.generation = new_gen;
            k.baseline = at_cut;
            let item = LeaseItem {
                rule_id: slot.rule_id().to_string(),
                tenant: slot.tenant().to_string(),
                route: slot.route().to_string(),
                kind: ItemKind::Renew as i32,
                lease_id: k.lease_id,
                spent,
                want,
                want_rate_utps,
                ..LeaseItem::default()
            };
            // Tagged with its batch's seq once the batch is made (`poll`).
            k.in_flight = Some(0);
            ctx.renews.push((
                item,
                Renewing {
                    slot: slot.clone(),
                    generation: new_gen,
                    tokens_at_send: at_cut,
                    asked_rate_utps: want_rate_utps,
                },
            ));
        }
        Plan::Return => {
            if !may_release || k.in_flight.is_some() || k.lease_id == 0 {
                return;
            }
            let same_word = gen == k.generation;
            let left = give_back(slot, k, t, refill.is_rate(), deadline, ctx, metrics);
            if same_word && !refill.is_rate() {
                k.usage.since_tick += tokens.saturating_sub(left);
            }
            k.baseline = 0;
        }
        Plan::Release => {
            if !may_release || k.in_flight.is_some() {
                return;
            }
            // Keep a key whose emergency bucket serves the current outage:
            // dropping it would start a full bucket again.
            let (down, outage, _) = ctx.ups[key_shard(slot, ctx.ups.len())];
            if down
                && rare
                    .get(slot)
                    .and_then(|r| r.emergency.as_ref())
                    .is_some_and(|(o, _)| *o == outage)
            {
                return;
            }
            give_back(slot, k, t, refill.is_rate(), deadline, ctx, metrics);
            ctx.forget.push(slot.clone());
        }
    }
}

/// Retire `slot`'s lease word and queue the RELEASE of what it still holds
/// (counted released, or expired unused past its `deadline`), if a lease
/// is held; the key holds none after. What the word held.
fn give_back(
    slot: &Slot,
    k: &mut KeyState,
    t: u64,
    rate: bool,
    deadline: u64,
    ctx: &mut PlanCtx,
    metrics: &AgentMetrics,
) -> u64 {
    let (left, new_gen) = slot.word.retire(t);
    k.generation = new_gen;
    if k.lease_id != 0 {
        ctx.releases.push(k.release_item(slot, rate, left));
        if deadline <= t {
            metrics.tokens_expired_unused.add(left);
        } else {
            metrics.tokens_released.add(left);
        }
    }
    k.lease_id = 0;
    left
}

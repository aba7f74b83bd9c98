//! A regional allocator's parent slot lease of one concurrency key
//! (docs/permits.md "Through regional allocators"), sans-IO: what it asks
//! its parent for, and what a grant does to the pool its children's slot
//! leases are cut from (a [`SlotLedger`] made by
//! [`SlotLedger::new_pool`]).
//!
//! * The pool lends at most the parent lease's `P` slots, and no child
//!   lease expires after the parent lease's deadline `U_p` on this clock
//!   (`first send + TTL(1 - 2 rho) - epsilon`, as an agent computes its
//!   use-by). So every child lease the regional counts lies within the
//!   parent lease the parent counts (the clock argument, one tier up), and
//!   I4 at the parent bounds the permits of every region.
//! * A renewal keeps the slots the children hold (their leases may back
//!   permits) and, unless the parent said `contended` or `over`, the spare
//!   ones the children's demand still covers; it wants the rest of their
//!   demand. **From the moment it is sent** the pool lends at most what it
//!   keeps (the agents' promise, one tier up): whether the parent applies
//!   it or not, and whether its reply arrives or not, what the children
//!   hold is counted there until `U_p` at least.
//! * A grant that keeps what was asked continues the chain: `P` and `U_p`
//!   move (`U_p` never back), and the pool's fencing numbers are the
//!   block the grant carries. A grant that keeps less (the parent no
//!   longer had the lease: a reply lost beyond the driver's resends, an
//!   operator's forced release) **breaks** it: a new pool starts with the
//!   new lease; the old children's leases are not carried (their asks
//!   naming them keep nothing), so their permits run to their use-by,
//!   within the old parent lease, which the parent counts until then (or
//!   a successor of it made by the lost reply, which expires no earlier).
//! * At `U_p` a chain that was not renewed lapses: its children's leases
//!   have all expired by then; the pool lends nothing until a new lease.
//! * `over` from the parent (its `N` was lowered, or it restarted and
//!   adopted this lease while its phantom stands): the pool lends nothing
//!   fresh; the children keep what they hold.
//! * **A restart** (docs/permits.md "A regional restart"): when a child
//!   names a lease of a predecessor (another process of this region) that
//!   the pool cannot adopt, the pool answers it `RESUMING` (nothing
//!   applied) and the chain's next ask, at once, says `resume`: the parent
//!   folds every other lease of this regional's id of the key (its
//!   predecessors') into the new one, keeping their slots and expiring no
//!   earlier. The `folded` slots are what the predecessors' children may
//!   still run permits on, until at most the parent's expiry of them: the
//!   pool holds them in a phantom of that size until then (on this clock,
//!   with the drift margin), the children's renewals adopt out of it, and
//!   the chain's renewals keep at least what the pool holds. A resume
//!   whose batch failed is asked again; once one is answered (or
//!   refused), the children that waited adopt or keep nothing.
//! * A `share` from the parent (some holder there misses slots): the pool
//!   lends at most the region's max-min share; children above it keep
//!   what they hold and start nothing new until they are below it, and
//!   the renewals (`contended`: keep what the children hold) give the
//!   rest back, so regions that want more than `N` each share it.

use super::SlotLedger;

/// Fencing numbers a regional asks per parent grant for its children's
/// grants (once used up, the last repeats until the next parent grant).
pub const FENCES_PER_PARENT_GRANT: u64 = 16;

/// When to ask the parent, as the regional's settings say.
#[derive(Clone, Copy, Debug)]
pub struct ChainTimes {
    /// After the parent could not give what was asked, ask no more often
    /// than this for one key (unmet demand, give-back); after a grant that
    /// gave it all, a new shortfall is asked for at once.
    pub tick_ns: u64,
    /// Renew at least this long before the parent lease's deadline (and
    /// at half its life if that is earlier).
    pub low_water_ns: u64,
    /// The regional's clock granularity and stall allowance (subtracted
    /// from the deadline).
    pub epsilon_ns: u64,
}

/// What to ask the parent for one key (a `SLOTS` item).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ParentSlotAsk {
    /// The parent lease renewed (0: a new one).
    pub lease_id: u64,
    /// Slots of it kept.
    pub keep: u64,
    /// Fresh slots wanted on top.
    pub want: u64,
    /// When it was first sent (its deadline counts from then).
    pub sent_ns: u64,
    /// A child named a predecessor's lease: the parent folds every other
    /// lease of this regional's id (its predecessors') into the new one,
    /// and says how many slots that was (module docs, "A restart").
    pub resume: bool,
}

/// The parent's answer to a [`ParentSlotAsk`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ParentSlotGrant {
    /// Whether the parent applied the ask (`GRANTED`); other statuses
    /// change nothing there.
    pub applied: bool,
    /// The new parent lease (0: none held now).
    pub lease_id: u64,
    /// Its slots, and of them the ones kept from the lease renewed.
    pub slots: u64,
    /// See `slots`.
    pub kept: u64,
    /// Its TTL as the parent said (ns).
    pub ttl_ns: u64,
    /// The first fencing number of the block it carries.
    pub fence: u64,
    /// Of `kept`, the slots a `resume` folded in from the predecessors'
    /// leases.
    pub folded: u64,
    /// Some holder at the parent misses slots.
    pub contended: bool,
    /// Lend nothing fresh (see the module docs).
    pub over: bool,
    /// The region's max-min share at the parent while some holder there
    /// misses slots: the pool lends at most that much (the region's
    /// children drain to it as their permits end, and the chain gives
    /// the rest back).
    pub share: Option<u64>,
    /// Ask again no sooner than this after the answer (the parent's hint).
    pub retry_after_ns: u64,
    /// Holders of the key at the parent (this region included; 0: not
    /// said).
    pub holders: u32,
}

/// How a grant changed the chain (counted by the regional).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChainChange {
    /// Nothing (a refusal, or a grant continuing the chain).
    None,
    /// The chain broke: a new pool.
    Broke,
    /// The resume kept this many slots of the predecessor's (the pool
    /// holds them in a phantom the children's renewals adopt from).
    Resumed(u64),
}

/// One key's parent slot lease at a regional allocator.
#[derive(Clone, Debug, Default)]
pub struct SlotChain {
    lease_id: u64,
    slots: u64,
    deadline_ns: u64,
    /// When the current lease's ask was first sent.
    asked_ns: u64,
    contended: bool,
    over: bool,
    in_flight: Option<ParentSlotAsk>,
    next_ask_ns: u64,
    /// The last grant gave fewer fresh slots than asked (the parent was
    /// full): a wake-up for room is worth waiting for.
    parent_unmet: bool,
    /// A wake-up of the parent is out, or none before this instant.
    waking: bool,
    wake_after_ns: u64,
}

/// What a chain wants to be woken for by its parent (`WaitSlots`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChainWake {
    /// The parent's free slots grew (its children miss slots).
    pub room: bool,
    /// Some holder at the parent misses slots (the pool's spare slots go
    /// back at once).
    pub contended: bool,
}

impl SlotChain {
    /// The parent lease held (0: none), its slots and deadline.
    pub fn lease(&self) -> (u64, u64, u64) {
        (self.lease_id, self.slots, self.deadline_ns)
    }

    /// Whether an ask is in flight.
    pub fn asking(&self) -> bool {
        self.in_flight.is_some()
    }

    /// Nothing held at the parent and nothing asked: the key may be
    /// forgotten once its pool is idle too.
    pub fn is_idle(&self) -> bool {
        self.lease_id == 0 && self.in_flight.is_none()
    }

    /// At `U_p` a lease not renewed lapses (its children's leases have
    /// expired): the pool lends nothing. Whether it lapsed now.
    pub fn lapse(&mut self, now_ns: u64, pool: &mut SlotLedger) -> bool {
        if self.lease_id == 0 || now_ns < self.deadline_ns {
            return false;
        }
        self.lease_id = 0;
        self.slots = 0;
        pool.set_n(0);
        true
    }

    /// What to ask the parent now, if anything (see the module docs): a
    /// new lease where children miss slots; a renewal when the lease is
    /// due, when children miss more than the pool can lend, or when the
    /// pool holds slots its children neither hold nor want (given back at
    /// once, as an agent gives back idle slots: through regions the wait
    /// tail fell from 1.03-1.18 s to 0.81-0.97 s in the simulator). At
    /// most one ask in flight, and after a grant that left children's
    /// demand unmet (or one that failed) at most one per tick unless the
    /// lease is due, as an agent asks.
    pub fn plan(
        &mut self,
        now_ns: u64,
        pool: &mut SlotLedger,
        t: &ChainTimes,
    ) -> Option<ParentSlotAsk> {
        pool.advance(now_ns);
        self.lapse(now_ns, pool);
        if self.in_flight.is_some() {
            return None;
        }
        let held = pool.held();
        let (demand, missing) = pool.demand();
        let paced = now_ns < self.next_ask_ns;
        // A child named a predecessor's lease the pool cannot adopt: the
        // ask goes at once, unpaced, and says `resume` (the parent folds
        // the predecessors' leases into this one).
        let resume = pool.resume_wanted();
        if self.lease_id == 0 {
            if !resume && (missing == 0 || paced) {
                return None;
            }
            return Some(ParentSlotAsk {
                lease_id: 0,
                keep: 0,
                want: demand.max(missing),
                sent_ns: now_ns,
                resume,
            });
        }
        // Under contention the children's demand is what they hold and
        // what they missed at asks within the last two ticks (a waiting
        // child asks once a tick), not what they wanted at any ask within
        // the second: the slots that demand covers stay (up to the
        // region's share), the rest go back, and only it is asked for.
        // Giving back slots children missed and asking for them again in
        // one renewal (the stale demand) left the pool lending nothing
        // for a round trip each tick, and a child whose asks fell in
        // those windows was never served (the permit swarm's liveness
        // failures at N = 1).
        let (demand, missing) = if self.contended && !self.over {
            let recent = pool.missing_since(now_ns.saturating_sub(2 * t.tick_ns));
            (held.saturating_add(recent), recent)
        } else {
            (demand, missing)
        };
        let keep = if self.over {
            held
        } else if self.contended {
            held.max(demand.min(self.slots).min(pool.share().unwrap_or(u64::MAX)))
        } else {
            self.slots.min(demand.max(held))
        };
        let want = demand.saturating_sub(keep);
        let life = self.deadline_ns.saturating_sub(self.asked_ns);
        let ahead = t.low_water_ns.max(life / 2);
        let due = now_ns.saturating_add(ahead) >= self.deadline_ns;
        let room = pool.n().saturating_sub(held);
        let unmet = missing > room && !self.over;
        let give_back = keep < self.slots;
        if resume || due || (!paced && (unmet || give_back)) {
            return Some(ParentSlotAsk {
                lease_id: self.lease_id,
                keep,
                want,
                sent_ns: now_ns,
                resume,
            });
        }
        None
    }

    /// The wake-up this chain wants from its parent now, if none is out
    /// (docs/permits.md "Slots follow demand"): `room` after the parent
    /// could not give what was asked, `contended` while it holds a lease
    /// and has heard of no one missing slots. Marks it out.
    pub fn take_wake(&mut self, now_ns: u64) -> Option<ChainWake> {
        if self.waking || now_ns < self.wake_after_ns || self.in_flight.is_some() {
            return None;
        }
        let room = self.parent_unmet;
        let contended = self.lease_id != 0 && !self.contended;
        if !(room || contended) {
            return None;
        }
        self.waking = true;
        Some(ChainWake { room, contended })
    }

    /// The wake-up's answer at `now_ns` (`served`: the parent answered
    /// it; otherwise none for a second): room grew (ask at once), or some
    /// holder misses slots (the pool says `contended` to its children,
    /// and gives its spare slots back at the next plan).
    pub fn on_wake(
        &mut self,
        now_ns: u64,
        served: bool,
        room: bool,
        contended: bool,
        pool: &mut SlotLedger,
    ) {
        self.waking = false;
        if !served {
            self.wake_after_ns = now_ns.saturating_add(1_000_000_000);
            return;
        }
        if room {
            self.parent_unmet = false;
            self.next_ask_ns = 0;
        }
        if contended {
            self.contended = true;
            let (n, cap) = (pool.n(), pool.cap_ns());
            pool.set_pool(n, cap, 0, 0, true);
        }
    }

    /// `ask` was sent at `now_ns`: from now the pool lends at most what
    /// it keeps.
    pub fn sent(&mut self, now_ns: u64, ask: ParentSlotAsk, pool: &mut SlotLedger, t: &ChainTimes) {
        if ask.lease_id != 0 {
            pool.set_n(pool.n().min(ask.keep));
        }
        self.in_flight = Some(ask);
        self.next_ask_ns = now_ns.saturating_add(t.tick_ns);
    }

    /// The ask in flight will not be answered (its batch failed and was
    /// not sent again). Its promise stands: the pool lends at most what it
    /// kept until a grant or the lapse; a later renewal naming the old
    /// lease finds it replaced (if the parent applied the lost ask) and
    /// breaks the chain.
    pub fn abandon(&mut self) {
        self.in_flight = None;
    }

    /// The parent's answer at `now_ns` to the ask in flight.
    pub fn on_grant(
        &mut self,
        now_ns: u64,
        g: &ParentSlotGrant,
        pool: &mut SlotLedger,
        t: &ChainTimes,
    ) -> ChainChange {
        let Some(ask) = self.in_flight.take() else {
            return ChainChange::None;
        };
        self.next_ask_ns = now_ns.saturating_add(t.tick_ns.max(g.retry_after_ns));
        if !g.applied {
            if ask.resume {
                // Refused (the rule is gone, a key limit, another shard):
                // nothing resumed; the children that waited keep nothing
                // (their permits end at their use-by).
                pool.resumed(0, 0);
            }
            return ChainChange::None;
        }
        self.contended = g.contended;
        self.over = g.over;
        self.parent_unmet = g.slots.saturating_sub(g.kept) < ask.want;
        if ask.want > 0 && !self.parent_unmet {
            // The parent gave all that was asked: a shortfall the children
            // report from now on is new demand, asked for at once (an ask
            // that wanted nothing stays paced: a renewal or a give-back
            // must not repeat every round trip; pacing
            // it by a tick kept a region's waiters up to 50 ms from free
            // slots at the parent: docs/permits.md "Wait tail").
            self.next_ask_ns = now_ns.saturating_add(g.retry_after_ns);
        }
        // What the parent kept of the lease the ask named (the folded
        // slots are the predecessors', or an unknown successor's).
        let broke = ask.lease_id != 0 && g.kept.saturating_sub(g.folded) < ask.keep;
        if broke {
            // The children's leases stay within the old parent lease (or
            // its unknown successor); a new pool for the new one, still
            // knowing which lease ids are predecessors'.
            pool.restart_pool();
        }
        if ask.resume {
            // The folded slots are in use at most until the parent's
            // expiry of them: its `ttl` from the grant's instant (before
            // now), on this clock at most that plus the drift margin,
            // plus a millisecond of rounding. They may be the
            // predecessors' children's, and, when a resume applied
            // before was answered too late and this one broke the chain,
            // also this chain's own old children's (the unknown successor
            // it folded carried their slots): the new pool's phantom
            // holds them, set after the break's reset (a review found the
            // reset dropping it: 8 slots in use of N = 4).
            let until = now_ns
                .saturating_add(g.ttl_ns)
                .saturating_add(quotalease_model::protocol::drift_margin_ns(g.ttl_ns))
                .saturating_add(t.epsilon_ns)
                .saturating_add(1_000_000);
            pool.resumed(g.folded, until);
        }
        if g.lease_id == 0 || g.slots == 0 {
            // Nothing held now (we kept nothing, or the lease was gone).
            self.lease_id = 0;
            self.slots = 0;
            pool.set_n(0);
            return if broke {
                ChainChange::Broke
            } else {
                ChainChange::None
            };
        }
        let deadline = quotalease_model::protocol::use_by_ns(ask.sent_ns, g.ttl_ns, t.epsilon_ns);
        // A kept lease expires no earlier than the one it came from.
        let deadline = if !broke && g.kept > 0 && ask.lease_id == self.lease_id {
            deadline.max(self.deadline_ns)
        } else {
            deadline
        };
        self.lease_id = g.lease_id;
        self.slots = g.slots;
        self.deadline_ns = deadline;
        self.asked_ns = ask.sent_ns;
        let n = if g.over { 0 } else { g.slots };
        pool.set_pool(n, deadline, g.fence, FENCES_PER_PARENT_GRANT, g.contended);
        pool.set_share(g.share);
        // The children's agents size their fail-open semaphores and decide
        // on contention wake-ups by the key's holders everywhere.
        pool.set_other_holders(g.holders.saturating_sub(1));
        if broke {
            ChainChange::Broke
        } else if ask.resume && g.folded > 0 {
            ChainChange::Resumed(g.folded)
        } else {
            ChainChange::None
        }
    }
}

#[cfg(test)]
mod tests;

//! An agent's permits on one concurrency key (issue 34, docs/permits.md):
//! a local semaphore over the slot leases the agent holds. Sans-IO like
//! the agent's core: time is the agent's clock in ns, passed in; a driver
//! (not built yet) wraps one of these per key in a mutex and carries its
//! asks to the allocator and the grants back.
//!
//! * Permits stand on a slot lease and never outlive its use-by
//!   (`first send of the ask + TTL(1 - 2 rho) - epsilon`, the token
//!   leases' formula), which falls before the allocator's expiry of that
//!   lease in true time: while a permit is valid, the allocator counts its
//!   slots.
//! * New permits go on the current lease only, while its slots cover
//!   them; a lease superseded by a grant keeps the permits that could not
//!   move to the new one until they end.
//! * **The promise**: once an ask keeping `k` slots of the current lease is
//!   sent, at most `k` permits run on it until the grant arrives (so a lost
//!   reply is safe: the allocator counts the `k` kept slots, or the old
//!   lease if the ask never arrived).
//! * Acquires wait in arrival order; renewing cannot extend a permit past
//!   its lease's use-by or `max_hold`; a permit past its expiry is gone
//!   (renewing it answers [`RenewError::Expired`]) and its slots are free
//!   from its expiry, never before; release is idempotent.

use std::collections::VecDeque;

use quotalease_model::protocol::use_by_ns;

/// Bits of a permit's fencing token taken by the local sequence number.
pub const FENCE_LOCAL_BITS: u32 = 20;

/// The largest grant fencing number a token holds (44 bits: the ledger's
/// counter, whose base carries the allocator's run number, must stay
/// below it; larger ones saturate rather than wrap).
pub const MAX_GRANT_FENCE: u64 = (1 << (64 - FENCE_LOCAL_BITS)) - 1;

/// The largest local sequence number of a token.
const LOCAL_FENCE_MAX: u64 = (1 << FENCE_LOCAL_BITS) - 1;

/// An acquire that ran out of time is told to try again after at least
/// this long ([`PermitKey::retry_hint_ns`])...
pub const RETRY_HINT_MIN_NS: u64 = 10_000_000;
/// ...and at most this long.
pub const RETRY_HINT_MAX_NS: u64 = 60_000_000_000;
/// The hint when this agent has started no permit on the key yet.
pub const RETRY_HINT_UNKNOWN_NS: u64 = 1_000_000_000;

/// A key's permit settings (from its rule, and the agent's lease TTL).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PermitSettings {
    /// `N` of the rule: the most slots one acquire may ask for.
    pub n: u64,
    /// A permit expires unless renewed within this.
    pub permit_ttl_ns: u64,
    /// The longest a permit may be held in total.
    pub max_hold_ns: u64,
    /// Lease TTL asked for.
    pub lease_ttl_ns: u64,
    /// Stall allowance (`epsilon`).
    pub epsilon_ns: u64,
}

/// A permit held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Permit {
    /// Id (unique per key and incarnation of the agent).
    pub id: u64,
    /// Slots it takes.
    pub slots: u64,
    /// When it was acquired (agent clock).
    pub acquired_ns: u64,
    /// When it expires unless renewed (agent clock).
    pub expiry_ns: u64,
    /// Fencing token: grows with the grant its lease came from.
    pub fence: u64,
    /// The slot lease it stands on.
    pub lease_id: u64,
}

/// An acquire that could not be granted at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AcquireError {
    /// More slots than the rule's `N` (or 0): never grantable.
    Invalid,
    /// Queued as this waiter; [`PermitKey::serve_waiters`] grants it.
    Queued(u64),
}

/// A renew that did not extend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RenewError {
    /// The permit is past its expiry (or was released): never revived.
    Expired,
}

/// A slot lease held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Held {
    id: u64,
    slots: u64,
    use_by_ns: u64,
    fence: u64,
    /// The grant said `over`: no new permit on this lease (its slots
    /// drain as its permits end, and the next ask gives the free ones
    /// back).
    over: bool,
    /// The grant's share (`u64::MAX`: none): new permits fill at most
    /// this many slots of the lease.
    share: u64,
}

/// An ask sent and not answered yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SentAsk {
    /// Its place among this key's asks (grants for older asks that arrive
    /// after a newer one's are stale).
    pub seq: u64,
    /// The lease it renews (0: none).
    pub lease_id: u64,
    /// Slots of it kept.
    pub keep: u64,
    /// Fresh slots wanted.
    pub want: u64,
    /// When it was first sent (agent clock): the use-by of its grant
    /// counts from here.
    pub first_send_ns: u64,
}

/// What the allocator granted for an ask (its `SlotGrant`, as received).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Granted {
    /// The new lease (0: none).
    pub lease_id: u64,
    /// Its slots.
    pub slots: u64,
    /// Of which kept from the lease the ask named.
    pub kept: u64,
    /// The grant's fencing number.
    pub fence: u64,
    /// More slots are held than `N` (after a lowering): no new permit on
    /// this lease beyond those already standing on it, so the holdings
    /// drain to the new `N` as permits end.
    pub over: bool,
    /// The lease's TTL as granted (an allocator grants at most its
    /// `TTL_max`): its use-by counts the shorter of this and the TTL
    /// asked for.
    pub ttl_ns: u64,
    /// While some holder starves (the allocator's `STARVE_NS`): the most
    /// this agent should hold (its max-min share). No new permit past it;
    /// the slots beyond it go back as permits end.
    pub share: Option<u64>,
}

/// One key's permits at one agent.
#[derive(Clone, Debug)]
pub struct PermitKey {
    settings: PermitSettings,
    /// The current lease (new permits go here), if any.
    current: Option<Held>,
    /// Superseded leases that still have permits standing on them.
    older: Vec<Held>,
    /// The ask in flight on the current lease, if any.
    sent: Option<SentAsk>,
    permits: Vec<Permit>,
    waiting: VecDeque<(u64, u64)>,
    next_id: u64,
    next_local_fence: u64,
    next_seq: u64,
    /// The newest ask whose grant was applied.
    applied_seq: u64,
    /// Permits that reached their expiry unreleased (see
    /// [`PermitKey::take_expired`]).
    expired: u64,
    /// When the last permit started, and the time between permit starts
    /// per slot (a moving average): how fast this agent serves the key
    /// ([`PermitKey::retry_hint_ns`]).
    last_start_ns: Option<u64>,
    start_gap_ns: Option<u64>,
}

impl PermitKey {
    /// No lease, no permits.
    pub fn new(settings: PermitSettings) -> Self {
        Self {
            settings,
            current: None,
            older: Vec::new(),
            sent: None,
            permits: Vec::new(),
            waiting: VecDeque::new(),
            next_id: 1,
            next_local_fence: 0,
            next_seq: 1,
            applied_seq: 0,
            expired: 0,
            last_start_ns: None,
            start_gap_ns: None,
        }
    }

    /// Whether permits are held (as of the last expiry pass).
    pub fn holds_permits(&self) -> bool {
        !self.permits.is_empty()
    }

    /// The permits valid at `now` (expired ones are dropped).
    pub fn permits(&mut self, now_ns: u64) -> &[Permit] {
        self.expire(now_ns);
        &self.permits
    }

    /// Slots taken by valid permits on lease `id`.
    fn used_on(&self, id: u64) -> u64 {
        self.permits
            .iter()
            .filter(|p| p.lease_id == id)
            .map(|p| p.slots)
            .sum()
    }

    fn expire(&mut self, now_ns: u64) {
        let before = self.permits.len();
        self.permits.retain(|p| p.expiry_ns > now_ns);
        self.expired += (before - self.permits.len()) as u64;
        let permits = &self.permits;
        self.older
            .retain(|h| permits.iter().any(|p| p.lease_id == h.id));
        if self.current.is_some_and(|c| c.use_by_ns <= now_ns) {
            self.current = None;
        }
    }

    /// Slots free for a new permit now on the current lease.
    pub fn free(&mut self, now_ns: u64) -> u64 {
        self.expire(now_ns);
        let Some(c) = self.current else {
            return 0;
        };
        self.cap(c).saturating_sub(self.used_on(c.id))
    }

    /// Slots of the current lease beyond its share that no permit stands
    /// on (see [`Granted::share`]): the next ask gives them back.
    pub fn beyond_share(&mut self, now_ns: u64) -> u64 {
        self.expire(now_ns);
        let Some(c) = self.current.filter(|c| !c.over) else {
            return 0;
        };
        c.slots.saturating_sub(c.share.max(self.used_on(c.id)))
    }

    /// What new permits may fill on `c`: its slots (only those in use
    /// after a grant that said `over`), and at most the `keep` of an
    /// unanswered ask on it
    /// (its reply may yet arrive, or be lost: the promise stands).
    fn cap(&self, c: Held) -> u64 {
        let cap = if c.over {
            self.used_on(c.id).min(c.slots)
        } else {
            c.slots.min(c.share)
        };
        match self.sent {
            Some(s) if s.lease_id == c.id => cap.min(s.keep),
            _ => cap,
        }
    }

    /// Acquire `slots` now, or queue behind earlier waiters.
    pub fn acquire(&mut self, now_ns: u64, slots: u64) -> Result<Permit, AcquireError> {
        if slots == 0 || slots > self.settings.n {
            return Err(AcquireError::Invalid);
        }
        if self.waiting.is_empty() && self.free(now_ns) >= slots {
            return Ok(self.grant(now_ns, slots));
        }
        let id = self.next_id;
        self.next_id += 1;
        self.waiting.push_back((id, slots));
        Err(AcquireError::Queued(id))
    }

    fn grant(&mut self, now_ns: u64, slots: u64) -> Permit {
        let c = self
            .current
            .expect("a free slot stands on the current lease");
        let s = &self.settings;
        let expiry_ns = now_ns
            .saturating_add(s.permit_ttl_ns)
            .min(c.use_by_ns)
            .min(now_ns.saturating_add(s.max_hold_ns));
        let id = self.next_id;
        self.next_id += 1;
        let fence = (c.fence << FENCE_LOCAL_BITS) | self.next_local_fence;
        // Saturates: past 2^20 permits on one lease the tokens repeat
        // (they still never fall below the grant's).
        self.next_local_fence = (self.next_local_fence + 1).min(LOCAL_FENCE_MAX);
        if let Some(last) = self.last_start_ns {
            let gap = now_ns.saturating_sub(last) / slots;
            self.start_gap_ns = Some(match self.start_gap_ns {
                Some(g) => (g.saturating_mul(7).saturating_add(gap)) / 8,
                None => gap,
            });
        }
        self.last_start_ns = Some(now_ns);
        let p = Permit {
            id,
            slots,
            acquired_ns: now_ns,
            expiry_ns,
            fence,
            lease_id: c.id,
        };
        self.permits.push(p);
        p
    }

    /// Grant waiters in arrival order while the head fits: (waiter id,
    /// permit) each.
    pub fn serve_waiters(&mut self, now_ns: u64) -> Vec<(u64, Permit)> {
        let mut out = Vec::new();
        while let Some(&(id, slots)) = self.waiting.front() {
            if self.free(now_ns) < slots {
                break;
            }
            self.waiting.pop_front();
            out.push((id, self.grant(now_ns, slots)));
        }
        out
    }

    /// How long `waiter`, whose wait ran out, should wait before it asks
    /// again (SPEC §5: an acquire that gets nothing says how long to
    /// wait): the slots queued up to and including its own, times the time
    /// this agent has taken per slot it started a permit on (a moving
    /// average, or the time since the last start when that is longer: a
    /// drought counts), within [`RETRY_HINT_MIN_NS`] and
    /// [`RETRY_HINT_MAX_NS`]; [`RETRY_HINT_UNKNOWN_NS`] before any start.
    /// An estimate from this agent's view alone: slots freed at other
    /// agents reach it only as its grants do.
    pub fn retry_hint_ns(&self, now_ns: u64, waiter: u64) -> u64 {
        let Some(last) = self.last_start_ns else {
            return RETRY_HINT_UNKNOWN_NS;
        };
        let per_slot = self
            .start_gap_ns
            .unwrap_or(0)
            .max(now_ns.saturating_sub(last));
        self.queued_up_to(waiter)
            .max(1)
            .saturating_mul(per_slot)
            .clamp(RETRY_HINT_MIN_NS, RETRY_HINT_MAX_NS)
    }

    /// The slots queued up to and including `waiter`'s (all queued when
    /// it is not).
    pub fn queued_up_to(&self, waiter: u64) -> u64 {
        let mut slots = 0u64;
        for &(id, s) in &self.waiting {
            slots = slots.saturating_add(s);
            if id == waiter {
                break;
            }
        }
        slots
    }

    /// A waiter gave up (its deadline, or its client went away).
    pub fn cancel(&mut self, waiter: u64) {
        self.waiting.retain(|(id, _)| *id != waiter);
    }

    /// The current lease, if any: (id, slots, use-by).
    pub fn current(&self) -> Option<(u64, u64, u64)> {
        self.current.map(|c| (c.id, c.slots, c.use_by_ns))
    }

    /// The settings in force.
    pub fn settings(&self) -> PermitSettings {
        self.settings
    }

    /// New settings (a rule change): a lowered `N` refuses larger
    /// acquires from now on; held permits keep their expiries.
    pub fn set_settings(&mut self, settings: PermitSettings) {
        self.settings = settings;
    }

    /// No permit held, nobody waiting and no lease: the key may be
    /// forgotten. (An ask whose reply is still out may be answered after:
    /// its lease, if it made one, is one the allocator counts, safe to use
    /// by a key made anew.)
    pub fn is_idle(&mut self, now_ns: u64) -> bool {
        self.expire(now_ns);
        self.permits.is_empty()
            && self.waiting.is_empty()
            && self.current.is_none()
            && self.older.is_empty()
    }

    /// Permits that reached their expiry unreleased since the last call.
    pub fn take_expired(&mut self) -> u64 {
        std::mem::take(&mut self.expired)
    }

    /// The waiters in arrival order: (waiter id, slots).
    pub fn waiters(&self) -> Vec<(u64, u64)> {
        self.waiting.iter().copied().collect()
    }

    /// Slots the waiters want beyond what is free.
    pub fn waiting_slots(&self) -> u64 {
        self.waiting.iter().map(|(_, n)| n).sum()
    }

    /// Extend permit `id` by the permit TTL, within its lease's use-by and
    /// `max_hold`: its new expiry.
    pub fn renew(&mut self, now_ns: u64, id: u64) -> Result<u64, RenewError> {
        self.expire(now_ns);
        let Some(i) = self.permits.iter().position(|p| p.id == id) else {
            return Err(RenewError::Expired);
        };
        let p = self.permits[i];
        let use_by = self
            .current
            .iter()
            .chain(self.older.iter())
            .find(|h| h.id == p.lease_id)
            .map_or(p.expiry_ns, |h| h.use_by_ns);
        let s = &self.settings;
        let expiry = now_ns
            .saturating_add(s.permit_ttl_ns)
            .min(use_by)
            .min(p.acquired_ns.saturating_add(s.max_hold_ns))
            .max(p.expiry_ns);
        self.permits[i].expiry_ns = expiry;
        Ok(expiry)
    }

    /// Release permit `id`: its slots are free at once. Whether it was
    /// held (a second release changes nothing).
    pub fn release(&mut self, now_ns: u64, id: u64) -> bool {
        self.expire(now_ns);
        let before = self.permits.len();
        self.permits.retain(|p| p.id != id);
        self.permits.len() < before
    }

    /// The ask to send now: renew the current lease keeping the slots in
    /// use (and the free ones too unless `give_back`), and want what the
    /// waiters miss. From here on at most `keep` permits run on the
    /// current lease until [`PermitKey::on_grant`].
    pub fn ask(&mut self, now_ns: u64, give_back: bool) -> SentAsk {
        self.expire(now_ns);
        let (lease_id, used, cap) = match self.current {
            Some(c) => (c.id, self.used_on(c.id), self.cap(c)),
            None => (0, 0, 0),
        };
        let keep = if give_back { used } else { cap.max(used) };
        let want = self.waiting_slots().saturating_sub(keep - used);
        let sent = SentAsk {
            seq: self.next_seq,
            lease_id,
            keep,
            want,
            first_send_ns: now_ns,
        };
        self.next_seq += 1;
        self.sent = Some(sent);
        sent
    }

    /// The grant for `sent` arrived. The ledger replaced the lease the ask
    /// named by the new one, keeping `kept` of its slots: its permits move
    /// to the new lease when those cover them, and otherwise stay on it
    /// until they end (then they are counted by whatever replaced it
    /// earlier: an orphaned grant whose reply was lost, or the phantom).
    /// The grant of the newest ask becomes the current lease; a stale
    /// grant (an older ask answered late) carries only the permits that
    /// moved onto it, and its other slots go unused until it expires.
    pub fn on_grant(&mut self, now_ns: u64, sent: SentAsk, g: Granted) {
        self.expire(now_ns);
        let newest = sent.seq > self.applied_seq;
        if newest {
            self.applied_seq = sent.seq;
        }
        if self.sent.is_some_and(|s| s.seq <= sent.seq) {
            self.sent = None;
        }
        let use_by_ns = use_by_ns(
            sent.first_send_ns,
            self.settings.lease_ttl_ns.min(g.ttl_ns),
            self.settings.epsilon_ns,
        );
        let new = (g.lease_id != 0 && use_by_ns > now_ns).then_some(Held {
            id: g.lease_id,
            slots: g.slots,
            use_by_ns,
            fence: g.fence.min(MAX_GRANT_FENCE),
            over: g.over,
            share: g.share.unwrap_or(u64::MAX),
        });
        if sent.lease_id != 0 {
            let used = self.used_on(sent.lease_id);
            if let Some(n) = new.filter(|_| used > 0 && g.kept >= used) {
                for p in self
                    .permits
                    .iter_mut()
                    .filter(|p| p.lease_id == sent.lease_id)
                {
                    p.lease_id = n.id;
                }
            }
            // The named lease is gone at the ledger: nothing new goes on it.
            if self.current.is_some_and(|c| c.id == sent.lease_id) {
                self.retire_current();
            }
        }
        match new {
            Some(n) if newest => {
                self.retire_current();
                self.current = Some(n);
                self.next_local_fence = 0;
            }
            Some(n) if self.used_on(n.id) > 0 => self.older.push(n),
            _ => {}
        }
    }

    /// The current lease stops taking new permits; it stays known while
    /// permits stand on it.
    fn retire_current(&mut self) {
        if let Some(c) = self.current.take() {
            if self.used_on(c.id) > 0 {
                self.older.push(c);
            }
        }
    }
}

pub mod policy;

#[cfg(test)]
mod tests;

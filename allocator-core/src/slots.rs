//! The slot ledger of a concurrency rule's key (SPEC §2 I4, §4
//! `concurrency`; docs/permits.md): `N` slots lent to holders as slot
//! leases. Sans-IO like the token ledger: time is an argument.
//!
//! Served by the allocator core (`core/slot_items.rs`, items `SLOTS` and
//! `SLOTS_RELEASE`); no agent asks for slots yet (issue 34 is being built
//! in steps; docs/permits.md says which are done).
//!
//! * **Held** is the slots of the unexpired leases. A grant never takes it
//!   above `max(N, held before the grant)`: kept slots are never cut, and
//!   fresh ones only fill `N - held`.
//! * **Ask** `(holder, lease_id, keep, want)`: the holder keeps
//!   `min(keep, lease.slots)` of the lease it names (the rest is free at
//!   once: the holder promised, when it sent the ask, to run at most `keep`
//!   permits from then on) and gets up to `want` fresh slots: at most
//!   `N - held` and at most its max-min share (water-filling over the
//!   demand, kept plus wanted, of the holders that asked within the last
//!   second). The new lease replaces the old one in the same step, so kept
//!   slots are counted continuously.
//! * **Shares of what is held**: kept slots are never cut, so a holder
//!   that keeps wanting could hold all `N` while another misses slots for
//!   good. While some holder **starves** (it has missed slots at every ask
//!   for [`STARVE_NS`] and holds less than half its share), every grant
//!   carries the holder's max-min `share`; a holder above it starts no
//!   permit past it and gives back the rest as permits end (a regional's
//!   pool lends at most its region's share). Only ever less is used:
//!   nothing here can raise what is held.
//! * **Duplicates**: an ask is applied once per holder and new lease id (a
//!   duplicate is answered with the lease it made; an older id changes
//!   nothing), so two leases never share an id. A kept lease never
//!   expires before the lease it came from.
//! * **Release** frees a lease's slots at once (the holder sends it when no
//!   permit stands on it); **expiry** frees them at the lease's expiry.
//!   Unlike tokens, slots always come back.
//! * **After a restart** the phantom holds all `N` until every lease a
//!   predecessor could have granted has expired ([`SlotLedger::after_restart`]).
//!   A holder's ask naming a predecessor's lease (an id below the ones
//!   this ledger gives) **adopts** it: the slots it keeps (at most what the
//!   phantom still holds) become a known lease out of the phantom, expiring
//!   no earlier than the phantom, each predecessor id once. No fresh slot
//!   is granted while the phantom stands, so the slots counted then never
//!   fall below what the predecessor could have lent; the adopted leases
//!   just let their permits be renewed across the restart.
//! * **Resume** (a regional allocator that restarted, docs/permits.md
//!   "A regional restart"): its first ask of a key names no lease and
//!   says `resume`; the grant keeps every slot of the holder's leases
//!   here (they become the one new lease, expiring no earlier than any),
//!   so the new instance learns what its predecessor may have lent on.
//!   Its pool ([`SlotLedger::await_resume`]) answers nothing to children
//!   naming the predecessor's leases until then, and then holds those
//!   slots in a phantom of exactly that size ([`SlotLedger::resumed`]),
//!   which the children's renewals adopt from: fresh slots are lent
//!   beside it, since it covers all the predecessor could have lent. An
//!   adopted lease in a pool is counted until the phantom's end, but
//!   never told to expire after the pool's cap.
//! * **Fencing**: each grant of slots takes the next number of a per-key
//!   counter (`fence`); the holder stamps its permits on that lease with
//!   `fence << 20 | a local sequence number`, so a permit stamped on a
//!   later grant carries a larger token. The counter starts at a base the
//!   caller makes larger than any predecessor's (its run number in the
//!   high bits).

use crate::ledger::{HolderId, PHANTOM};

pub mod chain;

/// How long a holder's demand counts for max-min shares after it asked.
pub const ACTIVE_WINDOW_NS: u64 = 1_000_000_000;

/// A holder that has missed slots at every ask for this long while
/// holding less than half its max-min share starves: until it no longer
/// does, grants carry each holder's share and holders above it give back
/// as their permits end (docs/permits.md "Max-min on what is held").
/// Shorter contention is left to the fresh slots' max-min and the
/// give-backs of free slots: enforcing shares at once cost slots in use
/// in transit (the simulator, session 33).
pub const STARVE_NS: u64 = 1_000_000_000;

/// The largest fencing base a ledger starts from: fencing numbers stay
/// below 2^44 (a permit's token keeps 20 bits for its own sequence
/// number), with room for 2^32 grants above the base.
pub const MAX_FENCE_BASE: u64 = (1 << 44) - (1 << 32);

/// One unexpired slot lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotLease {
    /// Lease id (unique per key; 0 is the phantom's).
    pub id: u64,
    /// Who holds it.
    pub holder: HolderId,
    /// Slots lent.
    pub slots: u64,
    /// Allocator-clock instant at which its slots are free again.
    pub expires_ns: u64,
    /// What the grant that made it answered (a duplicate of its ask is
    /// answered the same).
    pub kept: u64,
    /// See `kept`.
    pub folded: u64,
    /// See `kept`.
    pub fence: u64,
    /// Made by adopting a predecessor's lease (see [`SlotLedger::after_restart`]).
    pub adopted: bool,
}

/// A holder's ask for one key.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SlotAsk {
    /// Holder asking.
    pub holder: HolderId,
    /// The lease it renews (0: none).
    pub lease_id: u64,
    /// Slots of that lease it keeps (at most the lease's).
    pub keep: u64,
    /// Fresh slots it wants on top.
    pub want: u64,
    /// Lifetime of the new lease.
    pub ttl_ns: u64,
    /// Id to give the new lease.
    pub new_id: u64,
    /// Fencing numbers wanted (a regional's block for its children's
    /// grants; 0 or 1: one). The grant's `fence` is the block's first.
    pub fences: u64,
    /// With `lease_id` 0: the holder restarted and knows none of its
    /// leases (a regional allocator): the new lease keeps every slot of
    /// every lease it holds here, expiring no earlier than any of them,
    /// so what its predecessor lent on stays counted and the new
    /// instance learns how much that may be (module docs, "Resume").
    pub resume: bool,
}

/// The largest block of fencing numbers one grant takes.
pub const MAX_FENCES_PER_GRANT: u64 = 64;

/// What an ask produced.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SlotGrant {
    /// The new lease's id; 0 when the holder now holds nothing.
    pub lease_id: u64,
    /// Slots of the new lease (kept + fresh).
    pub slots: u64,
    /// Of which kept from the renewed lease.
    pub kept: u64,
    /// Of which fresh.
    pub fresh: u64,
    /// Of `kept`, the slots a `resume` folded in from the holder's other
    /// leases (its predecessors').
    pub folded: u64,
    /// The new lease's expiry (allocator clock).
    pub expires_ns: u64,
    /// The grant's fencing number (see the module docs; 0 when nothing is
    /// held).
    pub fence: u64,
    /// Some holder that asked within the window still misses slots: give
    /// back the ones no permit uses, and report a release at once.
    pub contended: bool,
    /// More slots are held than `N` (after a lowering): start new permits
    /// only on fresh slots.
    pub over: bool,
    /// While some holder starves ([`STARVE_NS`]): the most this holder
    /// should hold, its max-min share of what may be lent over the
    /// holders' demand (kept plus wanted at their last asks within the
    /// window), rounded up. A holder above it starts no permit past it,
    /// and gives back what it holds beyond it as permits end, so slots
    /// move to where requests wait. `None`: hold what you have.
    pub share: Option<u64>,
}

/// A holder's demand (kept + wanted at its last ask) and when it asked.
#[derive(Clone, Copy, Debug)]
struct Demand {
    holder: HolderId,
    demand: u64,
    missing: u64,
    at_ns: u64,
    /// What it held after that ask.
    holding: u64,
    /// Since when it has missed slots at every ask (`None`: it did not at
    /// its last).
    missing_since: Option<u64>,
}

/// One concurrency key's slots.
#[derive(Clone, Debug)]
pub struct SlotLedger {
    n: u64,
    leases: Vec<SlotLease>,
    demand: Vec<Demand>,
    next_fence: u64,
    /// The largest fencing number this ledger hands out (a regional's
    /// pool uses the block of numbers its parent's grant gave it; the
    /// last one repeats once the block is used up).
    fence_limit: u64,
    /// No lease expires after this (a regional's pool: its parent lease's
    /// deadline on the regional's clock); `u64::MAX` at the global.
    cap_ns: u64,
    /// The parent said some holder elsewhere misses slots (a regional's
    /// pool): every grant says `contended`, so children give back the
    /// slots no permit uses.
    parent_contended: bool,
    /// Holders of the key elsewhere (a regional's pool: the parent's
    /// holders but this region), counted in [`SlotLedger::holders`].
    other_holders: u32,
    /// A regional's pool: its share at the parent (`u64::MAX`: none); see
    /// [`SlotLedger::set_share`].
    share: u64,
    /// Per holder, the highest new lease id it asked for, and until when
    /// that is remembered (an ask's TTL: a later duplicate could only make
    /// an orphan lease, counted and never named).
    seen: Vec<(HolderId, u64, u64)>,
    /// While a predecessor's leases may be out: the phantom's end, the
    /// first lease id of this ledger's own (lower ids are predecessors'),
    /// and the predecessor ids adopted so far.
    predecessor: Option<Predecessor>,
    /// A regional's pool: its predecessors' lease ids and the children
    /// waiting for a resume ([`SlotLedger::needs_resume`]).
    resume: Option<Resume>,
}

/// See [`SlotLedger::await_resume`].
#[derive(Clone, Debug)]
struct Resume {
    own_ids_from: u64,
    /// Predecessors' lease ids answered `RESUMING`, waiting for the next
    /// resume to be answered.
    pending: Vec<u64>,
    /// Those a resume answered since: named again, they keep nothing.
    tried: Vec<u64>,
}

/// The most predecessors' lease ids a pool remembers waiting for, or
/// tried by, a resume (one per child holding slots at a restart).
const MAX_RESUME_IDS: usize = 10_000;

/// See [`SlotLedger::after_restart`].
#[derive(Clone, Debug)]
struct Predecessor {
    until_ns: u64,
    own_ids_from: u64,
    adopted: Vec<u64>,
    /// The phantom holds exactly what the predecessor may have lent (a
    /// resumed pool), not all `N`: fresh slots may be lent beside it.
    exact: bool,
}

impl SlotLedger {
    /// `n` free slots; fencing numbers from `fence_base`.
    pub fn new(n: u64, fence_base: u64) -> Self {
        Self {
            n,
            leases: Vec::new(),
            demand: Vec::new(),
            next_fence: fence_base,
            fence_limit: u64::MAX,
            cap_ns: u64::MAX,
            parent_contended: false,
            other_holders: 0,
            share: u64::MAX,
            seen: Vec::new(),
            predecessor: None,
            resume: None,
        }
    }

    /// A regional's pool whose chain broke: a new pool (nothing lent,
    /// no lease past 0) that still knows which lease ids are its
    /// predecessors' and which children wait for a resume.
    pub fn restart_pool(&mut self) {
        let resume = self.resume.take();
        *self = Self::new_pool(0);
        self.resume = resume;
    }

    /// A regional's pool (docs/permits.md "A regional restart"): lease
    /// ids below `own_ids_from` are its predecessors' (other processes of
    /// its region), which only a resume of its parent lease can cover
    /// ([`SlotLedger::needs_resume`]).
    pub fn await_resume(&mut self, own_ids_from: u64) {
        self.resume = Some(Resume {
            own_ids_from,
            pending: Vec::new(),
            tried: Vec::new(),
        });
    }

    /// Whether an ask naming `lease_id` must wait for a resume of the
    /// parent lease (answered `RESUMING`, nothing applied): it names a
    /// predecessor's lease that the pool cannot adopt (no phantom of
    /// resumed slots holds it) and that no resume answered since it was
    /// first named has covered. Such an id is remembered until the next
    /// resume is answered ([`SlotLedger::resume_wanted`]); named again
    /// after that, it is answered as any ask (keeping nothing).
    pub fn needs_resume(&mut self, lease_id: u64) -> bool {
        let adoptable = self.adoptable(lease_id);
        let Some(r) = self.resume.as_mut() else {
            return false;
        };
        if lease_id == 0 || lease_id >= r.own_ids_from || adoptable {
            return false;
        }
        if let Some(i) = r.tried.iter().position(|&t| t == lease_id) {
            r.tried.swap_remove(i);
            return false;
        }
        if !r.pending.contains(&lease_id) && r.pending.len() < MAX_RESUME_IDS {
            r.pending.push(lease_id);
        }
        true
    }

    /// Some child waits for a resume of the parent lease.
    pub fn resume_wanted(&self) -> bool {
        self.resume.as_ref().is_some_and(|r| !r.pending.is_empty())
    }

    /// A resume of the parent lease was answered: `folded` slots of its
    /// grant came from the predecessors' leases, in use at most until
    /// `until_ns` (this clock). They join a phantom of exactly what was
    /// folded, which children's asks naming predecessors' leases adopt
    /// from; fresh slots are lent beside it. The children that waited may
    /// now adopt, or keep nothing if nothing covered their leases.
    pub fn resumed(&mut self, folded: u64, until_ns: u64) {
        let Some(r) = self.resume.as_mut() else {
            return;
        };
        let own_ids_from = r.own_ids_from;
        let waited = std::mem::take(&mut r.pending);
        r.tried.extend(waited);
        if r.tried.len() > MAX_RESUME_IDS {
            let extra = r.tried.len() - MAX_RESUME_IDS;
            r.tried.drain(..extra);
        }
        if folded == 0 {
            return;
        }
        match self.leases.iter_mut().find(|l| l.holder == PHANTOM) {
            Some(ph) => {
                ph.slots = ph.slots.saturating_add(folded);
                ph.expires_ns = ph.expires_ns.max(until_ns);
            }
            None => self.leases.push(SlotLease {
                id: 0,
                holder: PHANTOM,
                slots: folded,
                expires_ns: until_ns,
                kept: 0,
                folded: 0,
                fence: 0,
                adopted: false,
            }),
        }
        match self.predecessor.as_mut() {
            Some(p) => p.until_ns = p.until_ns.max(until_ns),
            None => {
                self.predecessor = Some(Predecessor {
                    until_ns,
                    own_ids_from,
                    adopted: Vec::new(),
                    exact: true,
                })
            }
        }
    }

    /// Whether an ask naming `lease_id` would adopt out of the phantom.
    fn adoptable(&self, lease_id: u64) -> bool {
        self.predecessor.as_ref().is_some_and(|p| {
            lease_id != 0 && lease_id < p.own_ids_from && !p.adopted.contains(&lease_id)
        }) && self
            .leases
            .iter()
            .any(|l| l.holder == PHANTOM && l.slots > 0)
    }

    /// Nothing fresh may be lent: a predecessor's leases may be out and
    /// the phantom holds all `N` for them (not a resumed pool's exact one).
    fn phantom_blocks(&self) -> bool {
        self.predecessor.as_ref().is_some_and(|p| !p.exact)
    }

    /// A regional allocator's pool of one key (docs/permits.md "Through
    /// regional allocators"): nothing to lend (`N` = 0) and no lease past
    /// `cap_ns` until its parent slot lease says otherwise
    /// ([`SlotLedger::set_pool`]).
    pub fn new_pool(cap_ns: u64) -> Self {
        let mut l = Self::new(0, 0);
        l.cap_ns = cap_ns;
        l.fence_limit = 0;
        l
    }

    /// A regional's pool after a grant of its parent: lend at most `n`
    /// slots, no lease past `cap_ns` (which only grows while the parent
    /// lease is renewed with its slots), fencing numbers from the block
    /// `[fence, fence + fences)` of the parent's counter, and say
    /// `contended` when the parent did.
    pub fn set_pool(&mut self, n: u64, cap_ns: u64, fence: u64, fences: u64, contended: bool) {
        self.n = n;
        self.cap_ns = cap_ns;
        if fence > 0 && fence > self.fence_limit {
            self.next_fence = fence - 1;
            self.fence_limit = fence.saturating_add(fences.max(1) - 1);
        }
        self.parent_contended = contended;
    }

    /// A regional's pool: the region's max-min share at the parent while
    /// some holder there misses slots (`None`: none). The pool lends at
    /// most that much (its children above their own shares of it give
    /// back as their permits end).
    pub fn set_share(&mut self, share: Option<u64>) {
        self.share = share.unwrap_or(u64::MAX);
    }

    /// What the holders that asked at `since_ns` or later missed at their
    /// last asks.
    pub fn missing_since(&self, since_ns: u64) -> u64 {
        self.demand
            .iter()
            .filter(|d| d.at_ns >= since_ns)
            .fold(0, |m, d| m.saturating_add(d.missing))
    }

    /// A regional's pool: its share at the parent, if one was given
    /// ([`SlotLedger::set_share`]).
    pub fn share(&self) -> Option<u64> {
        (self.share != u64::MAX).then_some(self.share)
    }

    /// What may be held: `N`, or a pool's share of its parent if smaller.
    fn lendable(&self) -> u64 {
        self.n.min(self.share)
    }

    /// No lease of this ledger expires after this instant.
    pub fn cap_ns(&self) -> u64 {
        self.cap_ns
    }

    /// The holders' demand within the window (as of the last
    /// [`SlotLedger::advance`]): the sum of each one's kept and wanted
    /// slots at its last ask, and of what they missed then.
    pub fn demand(&self) -> (u64, u64) {
        self.demand.iter().fold((0, 0), |(d, m), x| {
            (d.saturating_add(x.demand), m.saturating_add(x.missing))
        })
    }

    /// A ledger that cannot know what a predecessor lent: the phantom
    /// holds all `n` slots until `until_ns` (when every lease it could
    /// have granted has expired). Lease ids below `own_ids_from` are the
    /// predecessor's: an ask naming one adopts it (module docs).
    pub fn after_restart(n: u64, fence_base: u64, until_ns: u64, own_ids_from: u64) -> Self {
        let mut l = Self::new(n, fence_base);
        l.predecessor_lost(until_ns, own_ids_from);
        l
    }

    /// A predecessor's leases may be out after all (the allocator learned
    /// its state was lost or older than what holders saw): the phantom
    /// holds all `N` slots, beside the leases this ledger knows, until
    /// `until_ns`; asks naming ids below `own_ids_from` adopt.
    pub fn predecessor_lost(&mut self, until_ns: u64, own_ids_from: u64) {
        self.leases.retain(|l| l.holder != PHANTOM);
        self.leases.push(SlotLease {
            id: 0,
            holder: PHANTOM,
            slots: self.n,
            expires_ns: until_ns,
            kept: 0,
            folded: 0,
            fence: 0,
            adopted: false,
        });
        let adopted = self.predecessor.take().map_or(Vec::new(), |p| p.adopted);
        self.predecessor = Some(Predecessor {
            until_ns,
            own_ids_from,
            adopted,
            exact: false,
        });
    }

    /// `N` in force.
    pub fn n(&self) -> u64 {
        self.n
    }

    /// Change `N`. Kept slots stay; fresh ones are granted only while
    /// `held < N` (I4 against `max(N_old, N_new)` until the old permits
    /// are gone).
    pub fn set_n(&mut self, n: u64) {
        self.n = n;
    }

    /// The unexpired leases (as of the last [`SlotLedger::advance`]).
    pub fn leases(&self) -> &[SlotLease] {
        &self.leases
    }

    /// Nothing lent, no demand within the window (as of the last
    /// [`SlotLedger::advance`]) and no resume awaited: the ledger may be
    /// dropped.
    pub fn is_idle(&self) -> bool {
        self.leases.is_empty() && self.demand.is_empty() && !self.resume_wanted()
    }

    /// Holders with a lease or a recent ask (as of the last
    /// [`SlotLedger::advance`]; the phantom not counted; with a pool's
    /// holders elsewhere), at least 1: an
    /// agent sizes its fail-open emergency semaphore `max(1, N / this)`.
    pub fn holders(&self) -> u32 {
        let mut ids: Vec<HolderId> = self
            .leases
            .iter()
            .map(|l| l.holder)
            .chain(self.demand.iter().map(|d| d.holder))
            .filter(|&h| h != PHANTOM)
            .collect();
        ids.sort_unstable();
        ids.dedup();
        u32::try_from(ids.len())
            .unwrap_or(u32::MAX)
            .saturating_add(self.other_holders)
            .max(1)
    }

    /// A regional's pool: the key's holders elsewhere (the parent's last
    /// count, less this region).
    pub fn set_other_holders(&mut self, n: u32) {
        self.other_holders = n;
    }

    /// Free slots a fresh ask could get at `now` (before max-min shares):
    /// none while a predecessor's leases may be out or past the pool's cap
    /// (as of the last [`SlotLedger::advance`]).
    pub fn room(&self, now_ns: u64) -> u64 {
        if self.phantom_blocks() || self.cap_ns <= now_ns {
            return 0;
        }
        self.lendable().saturating_sub(self.held())
    }

    /// Some holder that asked within the window misses slots (or the
    /// parent said so, for a regional's pool).
    pub fn contended(&self) -> bool {
        self.parent_contended || self.demand.iter().any(|d| d.missing > 0)
    }

    /// Slots held (as of the last [`SlotLedger::advance`]).
    pub fn held(&self) -> u64 {
        self.leases.iter().map(|l| l.slots).sum()
    }

    /// Drop the leases expired at `now_ns` (their slots are free) and
    /// forget demand older than the window.
    pub fn advance(&mut self, now_ns: u64) {
        self.leases.retain(|l| l.expires_ns > now_ns);
        self.demand
            .retain(|d| d.at_ns.saturating_add(ACTIVE_WINDOW_NS) > now_ns);
        self.seen.retain(|s| s.2 > now_ns);
        if self
            .predecessor
            .as_ref()
            .is_some_and(|p| p.until_ns <= now_ns)
        {
            self.predecessor = None;
        }
    }

    /// The slots `ask` adopts from the phantom (0 unless it names a
    /// predecessor's lease not adopted yet, while the phantom stands).
    fn adopt(&mut self, ask: &SlotAsk) -> u64 {
        let Some(p) = self.predecessor.as_mut() else {
            return 0;
        };
        if ask.lease_id == 0 || ask.lease_id >= p.own_ids_from || p.adopted.contains(&ask.lease_id)
        {
            return 0;
        }
        let Some(phantom) = self.leases.iter_mut().find(|l| l.holder == PHANTOM) else {
            return 0;
        };
        let kept = ask.keep.min(phantom.slots);
        if kept > 0 {
            phantom.slots -= kept;
            p.adopted.push(ask.lease_id);
        }
        kept
    }

    /// Renew and/or ask for slots (see the module docs).
    pub fn ask(&mut self, now_ns: u64, ask: SlotAsk) -> SlotGrant {
        self.advance(now_ns);
        // A duplicate of an ask already applied changes nothing: the lease
        // it made is answered again (or, once renewed or released, nothing;
        // two leases never share an id).
        if let Some(l) = self
            .leases
            .iter()
            .find(|l| l.holder == ask.holder && l.id == ask.new_id && ask.new_id != 0)
        {
            return SlotGrant {
                lease_id: l.id,
                slots: l.slots,
                kept: l.kept,
                fresh: l.slots - l.kept,
                folded: l.folded,
                expires_ns: l.expires_ns.min(self.cap_ns),
                fence: l.fence,
                contended: self.parent_contended || self.demand.iter().any(|d| d.missing > 0),
                over: self.held() > self.n || (l.adopted && self.predecessor.is_some()),
                share: None,
            };
        }
        let until = now_ns.saturating_add(ask.ttl_ns);
        match self.seen.iter_mut().find(|s| s.0 == ask.holder) {
            Some(s) if s.1 >= ask.new_id => {
                return SlotGrant {
                    contended: self.parent_contended || self.demand.iter().any(|d| d.missing > 0),
                    over: self.held() > self.n,
                    ..SlotGrant::default()
                };
            }
            Some(s) => *s = (ask.holder, ask.new_id, s.2.max(until)),
            None => self.seen.push((ask.holder, ask.new_id, until)),
        }
        let old = (ask.lease_id != 0)
            .then(|| {
                self.leases
                    .iter()
                    .position(|l| l.id == ask.lease_id && l.holder == ask.holder)
            })
            .flatten();
        let mut kept = old.map_or(0, |i| ask.keep.min(self.leases[i].slots));
        let mut adopted = false;
        // Kept slots stay counted at least as long as the lease they come
        // from was (permits on it may run until then).
        let mut expires_ns = now_ns.saturating_add(ask.ttl_ns).min(self.cap_ns);
        if let Some(i) = old {
            if kept > 0 {
                expires_ns = expires_ns.max(self.leases[i].expires_ns);
            }
            self.leases.swap_remove(i);
        } else {
            let slots = self.adopt(&ask);
            if slots > 0 {
                // The predecessor's lease may be counted nowhere else
                // until the phantom's end.
                kept = slots;
                adopted = true;
                let until = self.predecessor.as_ref().map_or(0, |p| p.until_ns);
                expires_ns = expires_ns.max(until);
            }
        }
        // A resume: every other lease of the holder (its predecessors',
        // made its own by `reassign`) becomes part of this one.
        let mut folded = 0u64;
        if ask.resume {
            let mut until = 0u64;
            self.leases.retain(|l| {
                let mine = l.holder == ask.holder && l.holder != PHANTOM;
                if mine {
                    folded = folded.saturating_add(l.slots);
                    until = until.max(l.expires_ns);
                    adopted |= l.adopted;
                }
                !mine
            });
            if folded > 0 {
                kept = kept.saturating_add(folded);
                expires_ns = expires_ns.max(until);
            }
        }
        let held = self.held() + kept;
        // Nothing fresh while the phantom stands (module docs).
        let room = if self.phantom_blocks() || self.cap_ns <= now_ns {
            0
        } else {
            self.lendable().saturating_sub(held)
        };
        // Max-min over demand: this holder's demand is what it keeps and
        // wants; the others' is what they had at their last ask.
        let demand = kept.saturating_add(ask.want);
        let missing_before = self
            .demand
            .iter()
            .find(|d| d.holder == ask.holder)
            .and_then(|d| d.missing_since);
        self.demand.retain(|d| d.holder != ask.holder);
        let mut demands: Vec<u64> = self.demand.iter().map(|d| d.demand).collect();
        demands.push(demand);
        // The share as `share_cap` makes it: a floor of the even split
        // would leave up to one slot per holder unlent while every holder
        // wants more than its share (3 regions, N = 32: 30 lent, 2 idle).
        let cap = share_cap(demands, self.lendable());
        let fresh = ask.want.min(room).min(cap.saturating_sub(kept));
        self.demand.push(Demand {
            holder: ask.holder,
            demand,
            missing: ask.want - fresh,
            at_ns: now_ns,
            holding: kept + fresh,
            missing_since: (ask.want > fresh).then(|| missing_before.unwrap_or(now_ns)),
        });
        // Max-min on what is held, while some holder starves: it has
        // missed slots at every ask for `STARVE_NS` and holds less than
        // half its share.
        let starving = self.demand.iter().any(|d| {
            d.missing_since
                .is_some_and(|s| now_ns.saturating_sub(s) >= STARVE_NS)
                && d.holding.saturating_mul(2) < d.demand.min(cap)
        });
        // A regional's pool capped by its parent's share passes shares on
        // too: its children above theirs drain, or the region never would.
        let share = ((starving || self.share != u64::MAX) && cap != u64::MAX).then_some(cap);
        let slots = kept + fresh;
        let fence = if slots > 0 {
            self.next_fence = self.next_fence.saturating_add(1).min(self.fence_limit);
            let first = self.next_fence;
            let block = ask.fences.clamp(1, MAX_FENCES_PER_GRANT);
            self.next_fence = first.saturating_add(block - 1).min(self.fence_limit);
            first
        } else {
            0
        };
        let lease_id = if slots > 0 {
            self.leases.push(SlotLease {
                id: ask.new_id,
                holder: ask.holder,
                slots,
                expires_ns,
                kept,
                folded,
                fence,
                adopted,
            });
            ask.new_id
        } else {
            0
        };
        SlotGrant {
            lease_id,
            slots,
            kept,
            fresh,
            folded: if slots > 0 { folded } else { 0 },
            // A pool counts an adopted lease until the phantom's end, but
            // tells no expiry past its cap (its parent lease's deadline).
            expires_ns: if slots > 0 {
                expires_ns.min(self.cap_ns)
            } else {
                0
            },
            fence,
            contended: self.parent_contended || self.demand.iter().any(|d| d.missing > 0),
            share,
            // An adopted lease takes no new permit while the phantom
            // stands: the lease it names may already have been replaced
            // at the predecessor by one the holder also got (two asks in
            // flight across the restart), which only the phantom counts;
            // the permits that move onto it are covered either way.
            over: self.held() > self.n || adopted,
        }
    }

    /// A restarted holder resumes its predecessors' leases (another
    /// process of the same id and principal: a regional allocator draws a
    /// new instance nonce at each start): the non-phantom leases of
    /// `from` become `to`'s, to be folded by `to`'s `resume` ask. Counted
    /// slots and expiries do not change.
    pub fn reassign(&mut self, from: &[HolderId], to: HolderId) {
        for l in self.leases.iter_mut() {
            if l.holder != PHANTOM && from.contains(&l.holder) {
                l.holder = to;
            }
        }
    }

    /// An operator frees lease `lease_id` at once, whoever holds it (a
    /// holder known to be dead, docs/operations.md "In-flight limits"):
    /// the lease as it was, or `None` when no such lease is held (the
    /// phantom, id 0, is never one). I4 rests on the operator's word that
    /// no permit still runs on it.
    pub fn force_release(&mut self, now_ns: u64, lease_id: u64) -> Option<SlotLease> {
        self.advance(now_ns);
        let i = self
            .leases
            .iter()
            .position(|l| l.id == lease_id && l.holder != PHANTOM && lease_id != 0)?;
        Some(self.leases.swap_remove(i))
    }

    /// `holder` gives lease `lease_id` back: its slots are free at once.
    /// Whether it was held (a duplicate or late release changes nothing).
    pub fn release(&mut self, now_ns: u64, holder: HolderId, lease_id: u64) -> bool {
        self.advance(now_ns);
        match self
            .leases
            .iter()
            .position(|l| l.id == lease_id && l.holder == holder && lease_id != 0)
        {
            Some(i) => {
                self.leases.swap_remove(i);
                true
            }
            None => false,
        }
    }
}

/// The max-min share of `avail` over `wants`: the smallest level `L`
/// with `sum(min(w, L)) >= avail` (so capping every holder at `L` leaves
/// no slot that nobody may take while they want them); `u64::MAX` when
/// the wants together fit. (Rounding each holder's share up in turn, the
/// first cut, gave 0 for two holders wanting the one slot of `N` = 1.)
fn share_cap(mut wants: Vec<u64>, avail: u64) -> u64 {
    wants.sort_unstable();
    let mut left = avail;
    let n = wants.len() as u64;
    for (i, w) in wants.iter().enumerate() {
        // The level if every want from here on is at least it.
        let level = left.div_ceil(n - i as u64);
        if *w >= level {
            return level;
        }
        left -= w;
    }
    u64::MAX
}

#[cfg(test)]
mod tests;

//! When an agent asks the allocator for a key's slots (docs/permits.md
//! "The agent's driver"): the one copy of that policy, sans-IO (time is
//! an argument), used by the agent's tokio driver (`permit_driver.rs`)
//! and by the simulator's permit model (`quotalease_sim::permits`).
//!
//! A key asks when its waiters miss slots (at most once a tick while the
//! ledger is full), when its lease comes within half its TTL of its
//! use-by (renewed keeping the slots in use, or given back whole when
//! nothing uses it), when it holds free slots no waiter here wants
//! while another holder misses some (`contended`) or for
//! [`IDLE_GIVE_BACK_NS`], and when its lease holds slots beyond the
//! max-min share the last grant gave (they go back as permits end). One
//! ask per key in flight.

use super::{Granted, PermitKey, SentAsk};

/// The driver's tick: how often it looks at every key.
pub const TICK_NS: u64 = 50_000_000;

/// Free slots no acquire here waits for go back to the allocator after
/// this long (another agent's waiters may need them; the allocator can
/// only say so in a reply to this agent): a slot released at one agent
/// serves a waiter at another within this, a tick and two round trips.
pub const IDLE_GIVE_BACK_NS: u64 = 100_000_000;

/// What a key wants to be woken for (see [`AskPolicy::wake_wanted`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Wake {
    /// The ledger's free slots grew.
    pub room: bool,
    /// Some holder misses slots.
    pub contended: bool,
    /// A release of one of this agent's permits forwarded by another
    /// agent waits at the allocator.
    pub releases: bool,
}

/// One key's asking state beside its [`PermitKey`].
#[derive(Clone, Copy, Debug)]
pub struct AskPolicy {
    /// Since when the current lease has had free slots and no waiter
    /// here (given back after [`IDLE_GIVE_BACK_NS`]).
    free_since: Option<u64>,
    /// The last grant said another holder misses slots.
    contended: bool,
    /// The TTL of the last slot lease granted (the allocator's cap may
    /// make it shorter than asked): renewals come due at half of it.
    granted_ttl_ns: u64,
    /// An ask of this key is on its way and unanswered (no second one
    /// meanwhile; after a failed call [`AskPolicy::not_answered`] lets it
    /// ask again: the first ask's promise stands, and the new one keeps
    /// no more).
    in_flight: bool,
    /// When a grant last left the key's wanted fresh slots unmet (the
    /// ledger was full): its waiters ask again only a tick after, not on
    /// every local acquire and release (those free no slot elsewhere).
    unmet_at: Option<u64>,
    /// Holders of the key at the allocator's last grant (0: none heard).
    holders: u32,
    /// A release forwarded by another agent waits at the allocator for
    /// this agent's next reply: ask now (a renewal) to fetch it.
    fetch_releases: bool,
}

impl AskPolicy {
    /// A key that has asked nothing yet; leases asked for `lease_ttl_ns`.
    pub fn new(lease_ttl_ns: u64) -> Self {
        Self {
            free_since: None,
            contended: false,
            granted_ttl_ns: lease_ttl_ns,
            in_flight: false,
            unmet_at: None,
            holders: 0,
            fetch_releases: false,
        }
    }

    /// The ask `pk` should send at `now`, if any (it is then in flight):
    /// made by [`PermitKey::ask`], so its promise holds from here.
    pub fn due(&mut self, pk: &mut PermitKey, now: u64) -> Option<SentAsk> {
        let ttl_ns = pk.settings().lease_ttl_ns;
        let half_ttl = ttl_ns.min(self.granted_ttl_ns) / 2;
        let free = pk.free(now);
        let used = !pk.permits(now).is_empty();
        let waiting = pk.waiting_slots() > 0;
        let renew_due = pk
            .current()
            .is_some_and(|(_, _, use_by)| use_by.saturating_sub(now) <= half_ttl);
        if free > 0 && !waiting {
            self.free_since.get_or_insert(now);
        } else {
            self.free_since = None;
        }
        let idle_free = self
            .free_since
            .is_some_and(|t| now.saturating_sub(t) >= IDLE_GIVE_BACK_NS);
        let unmet_recently = self
            .unmet_at
            .is_some_and(|t| now.saturating_sub(t) < TICK_NS);
        let give_back = if self.in_flight {
            return None;
        } else if pk.beyond_share(now) > 0 {
            // Holding more than its share while others miss slots: what
            // no permit uses beyond the share goes back (the ask keeps
            // the share or what is in use, if more).
            false
        } else if waiting && free < pk.waiting_slots() && !unmet_recently {
            false
        } else if (self.contended || idle_free) && free > 0 && !waiting {
            true
        } else if renew_due || self.fetch_releases {
            !used && !waiting
        } else {
            return None;
        };
        Some(self.send(pk, now, give_back))
    }

    /// An ask sent now whatever is due (a probe while the allocator is
    /// unreachable, or a shutdown's): in flight from here.
    pub fn send(&mut self, pk: &mut PermitKey, now: u64, give_back: bool) -> SentAsk {
        self.contended = false;
        self.free_since = None;
        self.in_flight = true;
        self.fetch_releases = false;
        pk.ask(now, give_back)
    }

    /// The grant for `sent` arrived at `now` (`granted` as received;
    /// `contended` and `holders` from the same grant): applied to `pk`.
    pub fn on_grant(
        &mut self,
        pk: &mut PermitKey,
        now: u64,
        sent: SentAsk,
        granted: Granted,
        contended: bool,
        holders: u32,
    ) {
        self.contended = contended;
        self.in_flight = false;
        let fresh = granted.slots.saturating_sub(granted.kept);
        self.unmet_at = (fresh < sent.want).then_some(now);
        if holders > 0 {
            self.holders = holders;
        }
        if granted.lease_id != 0 && granted.ttl_ns > 0 {
            self.granted_ttl_ns = granted.ttl_ns;
        }
        pk.on_grant(now, sent, granted);
    }

    /// The ask got no usable reply: the key may ask again.
    pub fn not_answered(&mut self) {
        self.in_flight = false;
    }

    /// The wake-up this key wants from the allocator now
    /// (docs/permits.md "Slots follow demand"): `room` while its waiters
    /// miss slots the ledger did not have (their ask goes out the moment
    /// a slot frees, not a tick later), `contended` while it holds a lease
    /// shared with other holders and has heard of no one missing slots
    /// (its free slots go back the moment someone does, not after
    /// [`IDLE_GIVE_BACK_NS`]). `None`: no wake-up.
    pub fn wake_wanted(&self, pk: &PermitKey) -> Option<Wake> {
        let waiting = pk.waiting_slots() > 0;
        let room = waiting && self.unmet_at.is_some();
        let shared = self.holders > 1 && pk.current().is_some();
        let contended = !waiting && !self.contended && shared;
        // Permits held here on a shared key may be released through
        // another agent (a dispatcher acquires, a worker releases).
        let releases = shared && pk.holds_permits() && !self.fetch_releases;
        (room || contended || releases).then_some(Wake {
            room,
            contended,
            releases,
        })
    }

    /// A wake-up answered: the ledger's free slots grew (`room`), some
    /// holder misses slots (`contended`), or a release of one of this
    /// agent's permits forwarded by another agent waits for its next reply
    /// (`released`). The next [`AskPolicy::due`] acts on it at once.
    pub fn on_wake(&mut self, room: bool, contended: bool, released: bool) {
        self.fetch_releases |= released;
        if room {
            self.unmet_at = None;
        }
        if contended {
            self.contended = true;
        }
    }

    /// An ask is on its way.
    pub fn in_flight(&self) -> bool {
        self.in_flight
    }

    /// Holders of the key at the allocator's last grant (0: none heard).
    pub fn holders(&self) -> u32 {
        self.holders
    }
}

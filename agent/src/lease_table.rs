//! The agent's lease table: the hot path.
//!
//! Each key has a [`Slot`](crate::agent::Slot) whose lease lives in one `AtomicU64` word:
//! `[generation: 24 bits | tokens: 40 bits]`, plus the lease's deadline on
//! the agent clock in a second atomic. A decision with a lease held is
//! `load deadline, load word, compare_exchange_weak` — no lock, no
//! allocation, no await; a denial writes nothing.
//!
//! Ordering. A checker reads the deadline *before* the word; an installer
//! swaps the word (new generation) *before* storing the new deadline. So a
//! checker that saw the new deadline also sees the new word; a checker that
//! saw the old deadline and then wins its CAS on the old generation spent
//! from the old lease while the old deadline was valid at the time it read
//! the clock (the stall between that read and the CAS is covered by
//! `epsilon`, see docs/protocol.md). A checker that read the old deadline
//! and the new word uses the new lease under the earlier deadline of the
//! two only if renewals never shorten deadlines, which the installer
//! guarantees by refusing leases whose deadline already passed.
//!
//! Refunds (a request matched several rules and a later one denied) go back
//! only into the generation they were taken from; a refund into a replaced
//! or retired lease is dropped.

#[cfg(quotalease_loom)]
use loom::sync::atomic::AtomicU64;
#[cfg(not(quotalease_loom))]
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;

const TOKEN_BITS: u32 = 40;
const TOKEN_MASK: u64 = (1 << TOKEN_BITS) - 1;
const GEN_MASK: u64 = (1 << (64 - TOKEN_BITS)) - 1;

/// Largest token count a lease word holds.
pub const MAX_WORD_TOKENS: u64 = TOKEN_MASK;

/// Pack a generation and a token count.
#[inline]
pub const fn pack(generation: u64, tokens: u64) -> u64 {
    ((generation & GEN_MASK) << TOKEN_BITS) | (tokens & TOKEN_MASK)
}

/// Split a word into (generation, tokens).
#[inline]
pub const fn unpack(word: u64) -> (u64, u64) {
    (word >> TOKEN_BITS, word & TOKEN_MASK)
}

/// Outcome of one consumption attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Take {
    /// Charged; the generation charged and the tokens left.
    Taken {
        /// Generation the tokens came from (for a refund).
        generation: u64,
        /// Tokens left in the lease.
        remaining: u64,
    },
    /// The lease is valid but holds fewer tokens than the cost.
    Short {
        /// Tokens the lease holds.
        remaining: u64,
    },
    /// No valid lease (none installed, expired or retired).
    NoLease,
}

/// The atomic part of a key's lease: the word and its deadline, side by
/// side (a decision reads the deadline and CASes the word), at the front of
/// the key's [`Slot`]. A slot is larger than a cache line, so two keys'
/// words never share one; the slot's other atomics beside the word are
/// written only on slow paths.
#[derive(Debug)]
#[repr(C)]
pub struct LeaseWord {
    word: AtomicU64,
    deadline_ns: AtomicU64,
}

impl Default for LeaseWord {
    fn default() -> Self {
        Self::new()
    }
}

impl LeaseWord {
    /// An empty word: generation 0, no tokens, deadline 0 (expired).
    pub fn new() -> Self {
        Self {
            word: AtomicU64::new(0),
            deadline_ns: AtomicU64::new(0),
        }
    }

    /// The hot path: take `cost` tokens at `now_ns` if a valid lease holds them.
    #[inline]
    pub fn try_take(&self, cost: u64, now_ns: u64) -> Take {
        if now_ns >= self.deadline_ns.load(Ordering::Acquire) {
            return Take::NoLease;
        }
        let mut w = self.word.load(Ordering::Acquire);
        loop {
            let (generation, tokens) = unpack(w);
            if tokens < cost {
                return Take::Short { remaining: tokens };
            }
            let next = pack(generation, tokens - cost);
            match self
                .word
                .compare_exchange_weak(w, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    return Take::Taken {
                        generation,
                        remaining: tokens - cost,
                    }
                }
                Err(seen) => w = seen,
            }
        }
    }

    /// Tokens of a valid lease at `now_ns` (None when there is none). Reads only.
    pub fn peek(&self, now_ns: u64) -> Option<u64> {
        if now_ns >= self.deadline_ns.load(Ordering::Acquire) {
            return None;
        }
        Some(unpack(self.word.load(Ordering::Acquire)).1)
    }

    /// Give `cost` back to `generation`; dropped if the lease was replaced
    /// or retired meanwhile. Returns whether it was applied.
    pub fn refund(&self, generation: u64, cost: u64) -> bool {
        let mut w = self.word.load(Ordering::Acquire);
        loop {
            let (g, tokens) = unpack(w);
            if g != generation & GEN_MASK {
                return false;
            }
            let next = pack(g, (tokens + cost).min(TOKEN_MASK));
            match self
                .word
                .compare_exchange_weak(w, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return true,
                Err(seen) => w = seen,
            }
        }
    }

    /// Current (generation, tokens).
    pub fn load(&self) -> (u64, u64) {
        unpack(self.word.load(Ordering::Acquire))
    }

    /// Deadline of the current lease.
    pub fn deadline_ns(&self) -> u64 {
        self.deadline_ns.load(Ordering::Acquire)
    }

    /// Replace the lease: compute the new token count from the current one
    /// (which may still be falling under concurrent checks) and bump the
    /// generation, then publish the deadline. Returns (old tokens seen,
    /// new generation, new tokens). Callers serialize installs per key.
    pub fn install(&self, deadline_ns: u64, tokens_from: impl Fn(u64) -> u64) -> (u64, u64, u64) {
        let mut w = self.word.load(Ordering::Acquire);
        loop {
            let (g, tokens) = unpack(w);
            let new_tokens = tokens_from(tokens).min(TOKEN_MASK);
            let new_gen = (g + 1) & GEN_MASK;
            match self.word.compare_exchange_weak(
                w,
                pack(new_gen, new_tokens),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    self.deadline_ns.store(deadline_ns, Ordering::Release);
                    return (tokens, new_gen, new_tokens);
                }
                Err(seen) => w = seen,
            }
        }
    }

    /// Retire the lease: no tokens, expired. Returns (the tokens it held
    /// when retired, the new generation); nothing can be taken from it, or
    /// refunded into it, afterwards.
    pub fn retire(&self) -> (u64, u64) {
        self.deadline_ns.store(0, Ordering::Release);
        let (old, generation, _) = self.install(0, |_| 0);
        (old, generation)
    }

    /// Start a new generation holding the same tokens under the same
    /// deadline: charges taken before this point can no longer be refunded.
    /// Used when the tokens spent so far are reported to the allocator.
    /// Returns (tokens at the cut, new generation).
    pub fn cut(&self) -> (u64, u64) {
        let deadline = self.deadline_ns.load(Ordering::Acquire);
        let (seen, generation, _) = self.install(deadline, |cur| cur);
        (seen, generation)
    }
}

// ---------------------------------------------------------------------------
// Keys and slots

use papaya::Equivalent;
pub use quotalease_model::key::{str_eq, KeyId, KeyRef};

/// A [`KeyRef`] as a lease-table lookup: hashes like the table's [`Held`]
/// slots and compares part by part, so a lookup builds nothing. (papaya's
/// `Equivalent` and the key type are foreign here, hence the wrapper.)
#[derive(Clone, Copy, Debug, Hash)]
pub struct Lookup<'a>(pub KeyRef<'a>);

impl<'a> Lookup<'a> {
    /// The key of `rule` for a request on (tenant, route).
    #[inline]
    pub fn of(rule: &'a quotalease_model::rules::Rule, tenant: &'a str, route: &'a str) -> Self {
        Self(KeyRef::of(rule, tenant, route))
    }
}

/// Source of slot ids: a slot removed from the table and created again for
/// the same key is a different slot, so a late refund cannot land in it.
static NEXT_SLOT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// One key held by the agent: what the request path reads and writes,
/// atomics only. The renewal side of the key lives in the agent core
/// ([`crate::core`]), which alone installs, cuts and retires the word.
/// Compact (SPEC §9 counts the agent's bytes per key held): the key's
/// parts in one allocation, no waker of its own (requests parked on a key
/// wait on the agent's striped wakers, keyed by [`Slot::id`]).
#[derive(Debug)]
#[repr(C)]
pub struct Slot {
    /// The lease word (hot path), first.
    pub word: LeaseWord,
    id: u64,
    /// The allocator said the bucket is dry until then.
    dry_until_ns: std::sync::atomic::AtomicU64,
    /// Sum of the costs of requests waiting for this key's next grant.
    waiting_cost: std::sync::atomic::AtomicU64,
    /// Tokens asked for but denied since the last visit (demand the lease
    /// could not serve).
    denied: std::sync::atomic::AtomicU64,
    /// Counts the key's batches settled (answered or given up on): a parked
    /// request waits until it moves past what it saw when it registered.
    settles: std::sync::atomic::AtomicU64,
    /// The key's parts, rule id then tenant then route, in one string.
    key: Box<str>,
    /// Where the tenant and the route parts start in `key`.
    tenant_at: u16,
    route_at: u16,
    /// The allocator is still opening this (never leased) key upstream.
    opening: std::sync::atomic::AtomicBool,
}

impl PartialEq for Slot {
    fn eq(&self, other: &Self) -> bool {
        self.id == other.id
    }
}

impl Slot {
    /// An empty slot for a key. Parts are ids of at most
    /// `MAX_ID_BYTES` (256) bytes each, so their offsets fit 16 bits.
    pub fn new(rule_id: &str, tenant: &str, route: &str) -> Self {
        use std::sync::atomic::{AtomicBool, AtomicU64};
        let offset = |n: usize| u16::try_from(n).expect("key parts are ids of at most 256 bytes");
        Self {
            word: LeaseWord::new(),
            id: NEXT_SLOT_ID.fetch_add(1, Ordering::Relaxed),
            dry_until_ns: AtomicU64::new(0),
            waiting_cost: AtomicU64::new(0),
            denied: AtomicU64::new(0),
            settles: AtomicU64::new(0),
            key: [rule_id, tenant, route].concat().into_boxed_str(),
            tenant_at: offset(rule_id.len()),
            route_at: offset(rule_id.len() + tenant.len()),
            opening: AtomicBool::new(false),
        }
    }

    /// The key, borrowed.
    #[inline]
    pub fn key_ref(&self) -> KeyRef<'_> {
        KeyRef::new(self.rule_id(), self.tenant(), self.route())
    }

    /// Unique per slot ever created in this process.
    pub fn id(&self) -> u64 {
        self.id
    }
    /// The rule id of the key.
    #[inline]
    pub fn rule_id(&self) -> &str {
        &self.key[..usize::from(self.tenant_at)]
    }
    /// The tenant part of the key.
    #[inline]
    pub fn tenant(&self) -> &str {
        &self.key[usize::from(self.tenant_at)..usize::from(self.route_at)]
    }
    /// The route part of the key.
    #[inline]
    pub fn route(&self) -> &str {
        &self.key[usize::from(self.route_at)..]
    }
    /// Until when the allocator said the bucket is dry.
    pub fn dry_until(&self) -> u64 {
        self.dry_until_ns.load(Ordering::Acquire)
    }
    pub(crate) fn set_dry_until(&self, t: u64) {
        self.dry_until_ns.store(t, Ordering::Release)
    }
    /// Whether the allocator is still opening the key upstream.
    pub fn opening(&self) -> bool {
        self.opening.load(Ordering::Acquire)
    }
    pub(crate) fn set_opening(&self, v: bool) {
        self.opening.store(v, Ordering::Release)
    }
    /// How many of the key's batches have settled.
    pub fn settles(&self) -> u64 {
        self.settles.load(Ordering::Acquire)
    }
    pub(crate) fn note_settled(&self) {
        self.settles.fetch_add(1, Ordering::AcqRel);
    }
    pub(crate) fn add_waiting(&self, cost: u64) {
        self.waiting_cost.fetch_add(cost, Ordering::AcqRel);
    }
    pub(crate) fn waiting(&self) -> u64 {
        self.waiting_cost.load(Ordering::Acquire)
    }
    pub(crate) fn clear_waiting(&self) {
        self.waiting_cost.store(0, Ordering::Release)
    }
    pub(crate) fn add_denied(&self, cost: u64) {
        self.denied.fetch_add(cost, Ordering::Relaxed);
    }
    pub(crate) fn denied_peek(&self) -> u64 {
        self.denied.load(Ordering::Relaxed)
    }
    pub(crate) fn take_denied(&self) -> u64 {
        self.denied.swap(0, Ordering::Relaxed)
    }

    /// A RELEASE item for this key.
    pub(crate) fn release_item(
        &self,
        lease_id: u64,
        spent: u64,
    ) -> quotalease_proto::lease::LeaseItem {
        use quotalease_proto::lease::{ItemKind, LeaseItem};
        LeaseItem {
            rule_id: self.rule_id().to_string(),
            tenant: self.tenant().to_string(),
            route: self.route().to_string(),
            kind: ItemKind::Release as i32,
            lease_id,
            spent,
            want: 0,
        }
    }
}

/// A slot in the lease table: hashes and compares by its key, so the table
/// needs no key of its own (one copy of the key's bytes per key held).
#[derive(Clone, Debug)]
pub struct Held(pub std::sync::Arc<Slot>);

impl std::ops::Deref for Held {
    type Target = std::sync::Arc<Slot>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl std::hash::Hash for Held {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        self.0.key_ref().hash(h)
    }
}

impl PartialEq for Held {
    fn eq(&self, other: &Self) -> bool {
        Lookup(self.0.key_ref()).equivalent(other)
    }
}

impl Eq for Held {}

impl papaya::Equivalent<Held> for Lookup<'_> {
    #[inline]
    fn equivalent(&self, k: &Held) -> bool {
        let (a, b) = (self.0, k.0.key_ref());
        str_eq(a.tenant, b.tenant) && str_eq(a.route, b.route) && str_eq(a.rule, b.rule)
    }
}

/// The lease table: the slots of the keys held, found by key. A lock-free
/// set (reads pin an epoch guard, which writes only thread-local state),
/// so concurrent checks on one hot key share no written cache line except
/// the lease word itself. Only the agent core inserts and removes. The
/// hasher is seeded per process.
pub type Table = papaya::HashSet<Held, foldhash::fast::RandomState>;

#[cfg(all(test, not(quotalease_loom)))]
mod tests {
    use super::*;

    #[test]
    fn take_until_short_then_refund_same_generation_only() {
        let w = LeaseWord::new();
        assert_eq!(w.try_take(1, 0), Take::NoLease);
        let (_, g1, t) = w.install(100, |_| 5);
        assert_eq!(t, 5);
        assert_eq!(
            w.try_take(3, 10),
            Take::Taken {
                generation: g1,
                remaining: 2
            }
        );
        assert_eq!(w.try_take(3, 10), Take::Short { remaining: 2 });
        assert!(w.refund(g1, 3));
        assert_eq!(w.load(), (g1, 5));
        // A renewal replaces the lease: a late refund into g1 is dropped.
        let (old, g2, _) = w.install(200, |cur| cur + 10);
        assert_eq!(old, 5);
        assert!(!w.refund(g1, 3));
        assert_eq!(w.load(), (g2, 15));
        // Expiry is checked on every decision.
        assert_eq!(w.try_take(1, 200), Take::NoLease);
        // A cut keeps tokens and deadline but drops refunds of older charges.
        let Take::Taken {
            generation: g2b, ..
        } = w.try_take(1, 150)
        else {
            panic!("lease valid at 150")
        };
        let (seen, g3) = w.cut();
        assert_eq!((seen, w.deadline_ns()), (14, 200));
        assert!(!w.refund(g2b, 1));
        assert_eq!(w.load(), (g3, 14));
        assert_eq!(w.retire().0, 14);
        assert_eq!(w.try_take(1, 10), Take::NoLease);
    }

    #[test]
    fn pack_round_trips_at_extremes() {
        assert_eq!(unpack(pack(GEN_MASK, TOKEN_MASK)), (GEN_MASK, TOKEN_MASK));
        assert_eq!(unpack(pack(GEN_MASK + 1, 0)), (0, 0));
    }

    #[test]
    fn concurrent_takes_never_exceed_the_lease() {
        let w = std::sync::Arc::new(LeaseWord::new());
        w.install(u64::MAX, |_| 10_000);
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let w = w.clone();
                std::thread::spawn(move || {
                    let mut n = 0u64;
                    while let Take::Taken { .. } = w.try_take(1, 1) {
                        n += 1;
                    }
                    n
                })
            })
            .collect();
        let total: u64 = handles.into_iter().map(|h| h.join().unwrap()).sum();
        assert_eq!(total, 10_000);
    }
}

#[cfg(all(test, quotalease_loom))]
mod loom_tests {
    //! `RUSTFLAGS="--cfg quotalease_loom" cargo test -p quotalease-agent --release loom`
    use super::*;
    use loom::sync::Arc;
    use loom::thread;

    /// Two takers and a refund racing an install: granted never exceeds
    /// what the leases held, and a stale refund never lands in a new lease.
    #[test]
    fn loom_takes_refunds_and_install() {
        loom::model(|| {
            let w = Arc::new(LeaseWord::new());
            let (_, g1, _) = w.install(100, |_| 2);
            let taker = |w: Arc<LeaseWord>| {
                thread::spawn(move || match w.try_take(1, 1) {
                    Take::Taken { .. } => 1u64,
                    _ => 0,
                })
            };
            let a = taker(w.clone());
            let b = taker(w.clone());
            let w2 = w.clone();
            let c = thread::spawn(move || {
                // Renewal carries the current remainder and adds 1 new token.
                let (seen, _, new_tokens) = w2.install(200, |cur| cur + 1);
                (seen, new_tokens)
            });
            let ta = a.join().unwrap();
            let tb = b.join().unwrap();
            let (seen, new_tokens) = c.join().unwrap();
            let (_, left) = w.load();
            // Old lease: 2 tokens; the install saw `seen` of them still there and
            // carried them plus 1. Everything taken + left == 2 + 1.
            assert_eq!(ta + tb + left, 3, "seen {seen} new {new_tokens}");
            // The install replaced generation g1: a refund into it is dropped.
            assert!(!w.refund(g1, 1));
        });
    }
}

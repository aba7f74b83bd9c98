//! The agent's lease table: the hot path.
//!
//! Each key has a [`Slot`](crate::agent::Slot) whose lease lives in one `AtomicU64` word:
//! `[generation: 24 bits | value: 40 bits]`, plus the lease's deadline on
//! the agent clock and how the lease refills, in atomics beside it on the
//! same cache line. A decision with a lease held is `load deadline, load
//! word, load refill, compare_exchange_weak` — no lock, no allocation, no
//! await; a denial writes nothing.
//!
//! Two kinds of lease (SPEC §2, "Leases may carry a rate"):
//!
//! * **tokens only**: `value` is the token count;
//! * **a rate**: the lease is a small token bucket, `capacity` tokens
//!   refilled at one token per `ns_per_token` (the granted rate slowed by
//!   `rho`), until its deadline. `value` is then the bucket's *theoretical
//!   arrival time* (GCRA, as governor keeps it) modulo 2^40 ns on the agent
//!   clock: the bucket holds `capacity - (tat - now)⁺ / ns_per_token`
//!   tokens at `now`, and taking `c` moves `tat` to `max(tat, now) + c *
//!   ns_per_token`. That is a continuous, capped refill computed at the
//!   instant of each take, so it never admits more than `level + rate * T`
//!   over any `T`, however the takes fall (a refill added at the next
//!   shortage would count the time the bucket sat full).
//!
//! Which kind a generation is, and its rate and capacity, sit in one of
//! two refill words, chosen by the generation's parity: an installer writes
//! the next generation's refill word before it swaps the lease word to that
//! generation, so a checker that read a generation reads its refill (a
//! checker that was overtaken by two installs fails its CAS).
//!
//! A rate lease is used only where the 40-bit arrival time cannot wrap:
//! capacity times `ns_per_token` and the lease's remaining life both below
//! 2^38 ns (about 4.5 minutes). A larger capacity is held smaller (it
//! still refills), and a rate too slow for one token in that span is held
//! as tokens only (it then never refills: conservative). Agents ask for no
//! such rates ([`MIN_RATE_UTPS`], `quotalease_model::protocol::MAX_RATE_FILL_S`).
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
/// Arrival times ahead of `now` by less than this are ahead; the rest are
/// behind (a full bucket).
const AHEAD: u64 = 1 << (TOKEN_BITS - 1);
/// A rate lease is held as one only while its bucket's span and its life
/// stay under this (so an arrival time is never more than 2^39 ns from
/// the clock reading it).
pub const RATE_SPAN_NS: u64 = 1 << 38;
const CAPACITY_BITS: u32 = 24;
const CAPACITY_MASK: u64 = (1 << CAPACITY_BITS) - 1;

/// Largest token count a lease word holds.
pub const MAX_WORD_TOKENS: u64 = TOKEN_MASK;
/// Largest capacity of a rate lease as held (a larger one is held smaller).
pub const MAX_RATE_CAPACITY: u64 = CAPACITY_MASK;
/// The slowest rate (micro-tokens per second) an agent asks of the
/// allocator: one token every 250 s, so that a lease of it refills at
/// least one token within the word's time span ([`RATE_SPAN_NS`], 275 s).
/// Rules slower than this get leases of tokens only.
pub const MIN_RATE_UTPS: u64 = 4_000;

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

/// How a lease refills: not at all ([`Refill::NONE`], a lease of tokens),
/// or one token every `ns_per_token` up to `capacity`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Refill {
    /// Agent-clock nanoseconds per token (0: no refill).
    pub ns_per_token: u64,
    /// Most tokens the lease holds.
    pub capacity: u64,
}

impl Refill {
    /// A lease of tokens only.
    pub const NONE: Refill = Refill {
        ns_per_token: 0,
        capacity: 0,
    };

    /// The refill of a grant of `rate_utps` micro-tokens per second and
    /// `capacity`, as the holder may run it on its clock: the rate slowed
    /// by `rho`, rounded down (one token every so many ns, rounded up).
    /// `NONE` for a grant without a rate.
    pub fn of_grant(rate_utps: u64, capacity: u64) -> Refill {
        let slowed = quotalease_model::protocol::slowed_by_rho(rate_utps);
        if slowed == 0 || capacity == 0 {
            return Refill::NONE;
        }
        let ns = (1_000_000_000_000_000u128).div_ceil(u128::from(slowed));
        let ns_per_token = u64::try_from(ns).unwrap_or(u64::MAX);
        // A capacity the word cannot refill within its time span (more
        // than 2^38 ns from empty to full: 60/m with a capacity of 600,
        // say) is held smaller, so that the lease still refills at its
        // rate: holding less than the allocator counts is safe, and a lease
        // held as a plain count would never refill while the allocator
        // counts it refilling (an adversarial review saw 0 admitted for
        // 45 s after a burst at 60/m burst 600). A rate too slow for even
        // one token is held as tokens (agents do not ask for one:
        // [`MIN_RATE_UTPS`]).
        let span_cap = (RATE_SPAN_NS - 1) / ns_per_token.max(1);
        let capacity = capacity.min(MAX_RATE_CAPACITY);
        Refill {
            ns_per_token,
            capacity: if span_cap >= 1 {
                capacity.min(span_cap)
            } else {
                capacity
            },
        }
    }

    /// Whether it refills.
    pub fn is_rate(self) -> bool {
        self.ns_per_token != 0
    }

    /// Whether a lease with this refill, installed at `now_ns` until
    /// `deadline_ns`, can be held as a rate lease (see the module docs).
    fn fits(self, now_ns: u64, deadline_ns: u64) -> bool {
        self.ns_per_token != 0
            && self.ns_per_token < TOKEN_MASK
            && (1..=MAX_RATE_CAPACITY).contains(&self.capacity)
            && self
                .capacity
                .checked_mul(self.ns_per_token)
                .is_some_and(|span| span < RATE_SPAN_NS)
            && deadline_ns.saturating_sub(now_ns) < RATE_SPAN_NS
    }

    const fn encode(self) -> u64 {
        (self.ns_per_token << CAPACITY_BITS) | (self.capacity & CAPACITY_MASK)
    }

    const fn decode(x: u64) -> Refill {
        Refill {
            ns_per_token: x >> CAPACITY_BITS,
            capacity: x & CAPACITY_MASK,
        }
    }
}

/// Nanoseconds a rate bucket whose arrival time is `tat` (low 40 bits) is
/// behind being full at `now`: `(tat - now)⁺`.
#[inline]
fn debt(tat: u64, now_ns: u64) -> u64 {
    let d = tat.wrapping_sub(now_ns) & TOKEN_MASK;
    if d < AHEAD {
        d
    } else {
        0
    }
}

/// Tokens a word's `value` stands for at `now` under `refill`.
#[inline]
fn level(value: u64, refill: Refill, now_ns: u64) -> u64 {
    if refill.ns_per_token == 0 {
        value
    } else {
        let span = refill.capacity * refill.ns_per_token;
        span.saturating_sub(debt(value, now_ns)) / refill.ns_per_token
    }
}

/// Nanoseconds of refill a rate lease's `value` holds beyond its whole
/// tokens at `now` (0 for a lease of tokens, or a full bucket).
#[inline]
fn part_ns(value: u64, refill: Refill, now_ns: u64) -> u64 {
    if refill.ns_per_token == 0 {
        return 0;
    }
    let span = refill.capacity * refill.ns_per_token;
    let owed = debt(value, now_ns);
    if owed == 0 {
        0
    } else {
        (span - owed.min(span)) % refill.ns_per_token
    }
}

/// The `value` that stands for `tokens` at `now` under `refill` (at most
/// the capacity of a rate lease), plus `part` of a token of refill under
/// way (ns of `refill`; dropped when the bucket is full).
#[inline]
fn value_of(tokens: u64, refill: Refill, now_ns: u64, part: u64) -> u64 {
    if refill.ns_per_token == 0 {
        tokens.min(TOKEN_MASK)
    } else {
        let missing = refill.capacity - tokens.min(refill.capacity);
        let owed = (missing * refill.ns_per_token).saturating_sub(if missing > 0 {
            part.min(refill.ns_per_token - 1)
        } else {
            0
        });
        now_ns.wrapping_add(owed) & TOKEN_MASK
    }
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

/// The atomic part of a key's lease: the word, its deadline and its two
/// refill words, side by side (a decision reads the deadline and the refill
/// and CASes the word), 64 bytes into the key's [`Slot`] block, whose own
/// bytes fill the word's cache line wherever the block starts: two keys'
/// words never share a line, nor does any other allocation; the slot's
/// other fields on that line are written only on slow paths and by the
/// core (at most once a renew interval).
#[derive(Debug)]
#[repr(C)]
pub struct LeaseWord {
    word: AtomicU64,
    deadline_ns: AtomicU64,
    /// [`Refill::encode`] of the generations of each parity.
    refill: [AtomicU64; 2],
    /// Tokens taken from rate leases (net of refunds), for the core's
    /// consumption figures: a rate lease's level does not tell them (it
    /// refills). Leases of tokens do not count here (their level does).
    taken: AtomicU64,
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
            refill: [AtomicU64::new(0), AtomicU64::new(0)],
            taken: AtomicU64::new(0),
        }
    }

    /// Whether tokens were taken from rate leases since the last
    /// [`LeaseWord::take_taken`] (reads only).
    pub fn taken_peek(&self) -> u64 {
        self.taken.load(Ordering::Relaxed)
    }

    /// Tokens taken from rate leases since the last call (net of refunds).
    pub fn take_taken(&self) -> u64 {
        let n = self.taken.swap(0, Ordering::Relaxed);
        // A refund after the last call of a charge counted before it.
        if n > u64::MAX / 2 {
            0
        } else {
            n
        }
    }

    #[inline]
    fn refill_of(&self, generation: u64) -> Refill {
        Refill::decode(self.refill[(generation & 1) as usize].load(Ordering::Acquire))
    }

    /// The hot path: take `cost` tokens at `now_ns` if a valid lease holds them.
    #[inline]
    pub fn try_take(&self, cost: u64, now_ns: u64) -> Take {
        if now_ns >= self.deadline_ns.load(Ordering::Acquire) {
            return Take::NoLease;
        }
        let mut w = self.word.load(Ordering::Acquire);
        loop {
            let (generation, value) = unpack(w);
            let refill = self.refill_of(generation);
            let (next, remaining) = if refill.ns_per_token == 0 {
                if value < cost {
                    return Take::Short { remaining: value };
                }
                (value - cost, value - cost)
            } else {
                let span = refill.capacity * refill.ns_per_token;
                let owed = debt(value, now_ns);
                let after = cost
                    .checked_mul(refill.ns_per_token)
                    .and_then(|c| c.checked_add(owed))
                    .filter(|&d| d <= span);
                let Some(after) = after else {
                    return Take::Short {
                        remaining: span.saturating_sub(owed) / refill.ns_per_token,
                    };
                };
                (
                    now_ns.wrapping_add(after) & TOKEN_MASK,
                    (span - after) / refill.ns_per_token,
                )
            };
            match self.word.compare_exchange_weak(
                w,
                pack(generation, next),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    if refill.ns_per_token != 0 {
                        self.taken.fetch_add(cost, Ordering::Relaxed);
                    }
                    return Take::Taken {
                        generation,
                        remaining,
                    };
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
        Some(self.level_at(now_ns).1)
    }

    /// (generation, tokens the lease stands for at `now_ns`), whatever its
    /// deadline.
    pub fn level_at(&self, now_ns: u64) -> (u64, u64) {
        let (g, value) = unpack(self.word.load(Ordering::Acquire));
        (g, level(value, self.refill_of(g), now_ns))
    }

    /// For a valid rate lease: how long until it holds `cost` tokens at
    /// `now_ns` by its own refill, as if renewals keep its rate past its
    /// deadline (None for a lease of tokens, an expired lease, or a cost
    /// above its capacity).
    pub fn refill_wait_ns(&self, cost: u64, now_ns: u64) -> Option<u64> {
        let deadline = self.deadline_ns.load(Ordering::Acquire);
        let (g, value) = unpack(self.word.load(Ordering::Acquire));
        let refill = self.refill_of(g);
        if refill.ns_per_token == 0 || cost > refill.capacity || now_ns >= deadline {
            return None;
        }
        let span = refill.capacity * refill.ns_per_token;
        let need = debt(value, now_ns) + cost * refill.ns_per_token;
        Some(need.saturating_sub(span))
    }

    /// How the current generation refills.
    pub fn refill(&self) -> Refill {
        self.refill_of(self.load_raw().0)
    }

    /// Give `cost` back to `generation`; dropped if the lease was replaced
    /// or retired meanwhile. Returns whether it was applied.
    pub fn refund(&self, generation: u64, cost: u64) -> bool {
        let mut w = self.word.load(Ordering::Acquire);
        loop {
            let (g, value) = unpack(w);
            if g != generation & GEN_MASK {
                return false;
            }
            let refill = self.refill_of(g);
            let next = if refill.ns_per_token == 0 {
                (value + cost).min(TOKEN_MASK)
            } else {
                // Move the arrival time back by what the charge moved it
                // forward (a bucket that refilled meanwhile may end up
                // "fuller than full", which its next take reads as full).
                value.wrapping_sub(cost.saturating_mul(refill.ns_per_token)) & TOKEN_MASK
            };
            match self.word.compare_exchange_weak(
                w,
                pack(g, next),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    if refill.ns_per_token != 0 {
                        // Wrapping: the take's count may not have landed yet.
                        self.taken.fetch_sub(cost, Ordering::Relaxed);
                    }
                    return true;
                }
                Err(seen) => w = seen,
            }
        }
    }

    /// Current (generation, raw value): the token count of a lease of
    /// tokens, the arrival time of a rate lease (see [`LeaseWord::level_at`]).
    pub fn load_raw(&self) -> (u64, u64) {
        unpack(self.word.load(Ordering::Acquire))
    }

    /// Deadline of the current lease.
    pub fn deadline_ns(&self) -> u64 {
        self.deadline_ns.load(Ordering::Acquire)
    }

    /// Replace the lease at `now_ns`: compute the new level from the
    /// current one (which may still be falling under concurrent checks) and
    /// bump the generation, with `refill` (held as tokens only if it cannot
    /// be held as a rate, see the module docs), then publish the deadline.
    /// Returns (old level seen, new generation, new level). Callers
    /// serialize installs per key.
    pub fn install(
        &self,
        deadline_ns: u64,
        refill: Refill,
        now_ns: u64,
        level_from: impl Fn(u64) -> u64,
    ) -> (u64, u64, u64) {
        // A version whose capacity the word cannot refill in its time field
        // is held as a plain count, still never above its capacity: the
        // allocator counts the holder at the capacity once it names the
        // version (an adversarial review held 600 tokens under a capacity of
        // 301 at 2/s burst 600, and admitted 601 at once against B = 600).
        let cap = if refill.is_rate() {
            refill.capacity
        } else {
            TOKEN_MASK
        };
        let refill = if refill.fits(now_ns, deadline_ns) {
            refill
        } else {
            Refill::NONE
        };
        self.swap(deadline_ns, |g, value| {
            let old_refill = self.refill_of(g);
            let old = level(value, old_refill, now_ns);
            let new = level_from(old).min(cap).min(TOKEN_MASK);
            // The part of a token refilled so far carries over, as the same
            // fraction of a token at the new rate (rounded down): renewals
            // every few ms would otherwise lose up to a token each (a
            // fifth of the rate at one renewal per two tokens' time).
            let part = if refill.is_rate() && old_refill.is_rate() {
                let p = u128::from(part_ns(value, old_refill, now_ns));
                let scaled =
                    p * u128::from(refill.ns_per_token) / u128::from(old_refill.ns_per_token);
                u64::try_from(scaled).unwrap_or(0)
            } else {
                0
            };
            (old, value_of(new, refill, now_ns, part), refill, new)
        })
    }

    /// Swap the word to the next generation, its value and refill computed
    /// by `next(generation, value) -> (old level, value, refill, new
    /// level)`; then publish `deadline_ns`.
    fn swap(
        &self,
        deadline_ns: u64,
        next: impl Fn(u64, u64) -> (u64, u64, Refill, u64),
    ) -> (u64, u64, u64) {
        let mut w = self.word.load(Ordering::Acquire);
        loop {
            let (g, value) = unpack(w);
            let new_gen = (g + 1) & GEN_MASK;
            let (old, new_value, refill, new_level) = next(g, value);
            // The next generation's refill first: a checker that reads the
            // new word reads it (see the module docs).
            self.refill[(new_gen & 1) as usize].store(refill.encode(), Ordering::Release);
            match self.word.compare_exchange_weak(
                w,
                pack(new_gen, new_value),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    self.deadline_ns.store(deadline_ns, Ordering::Release);
                    return (old, new_gen, new_level);
                }
                Err(seen) => w = seen,
            }
        }
    }

    /// Retire the lease at `now_ns`: no tokens, expired. Returns (the
    /// tokens it held when retired, the new generation); nothing can be
    /// taken from it, or refunded into it, afterwards.
    pub fn retire(&self, now_ns: u64) -> (u64, u64) {
        self.deadline_ns.store(0, Ordering::Release);
        let (old, generation, _) = self.install(0, Refill::NONE, now_ns, |_| 0);
        (old, generation)
    }

    /// Start a new generation holding the same lease (value, refill,
    /// deadline): charges taken before this point can no longer be
    /// refunded. Used when the tokens spent so far are reported to the
    /// allocator. Returns (level at the cut at `now_ns`, new generation).
    pub fn cut(&self, now_ns: u64) -> (u64, u64) {
        let deadline = self.deadline_ns.load(Ordering::Acquire);
        let (seen, generation, _) = self.swap(deadline, |g, value| {
            let refill = self.refill_of(g);
            let l = level(value, refill, now_ns);
            (l, value, refill, l)
        });
        (seen, generation)
    }
}

// ---------------------------------------------------------------------------
// Keys and slots

pub use quotalease_model::key::{str_eq, KeyId, KeyRef};

/// A [`KeyRef`] as a lease-table lookup: the table hashes it as it hashes
/// its slots' keys and compares part by part, so a lookup builds nothing.
#[derive(Clone, Copy, Debug, Hash)]
pub struct Lookup<'a>(pub KeyRef<'a>);

impl<'a> Lookup<'a> {
    /// The key of `rule` for a request on (tenant, route).
    #[inline]
    pub fn of(rule: &'a quotalease_model::rules::Rule, tenant: &'a str, route: &'a str) -> Self {
        Self(KeyRef::of(rule, tenant, route))
    }
}

/// The fixed part of a key's [`Slot`], at the start of its one heap block;
/// the key's bytes (rule id, tenant, route) follow it in the same block.
///
/// Three kinds of fields:
///
/// * the lease word (the hot path reads its deadline and CASes it), 64
///   bytes into the block, so that its cache line, wherever the block
///   starts (blocks are 16-aligned, not line-aligned), holds only this
///   block's bytes: no other allocation, hot or not, shares it;
/// * atomics the request slow path reads or writes (`dry_until`, waiting
///   demand, denied demand, the settle count) and the reference count;
/// * words only the agent core reads and writes (`core_a`, `core_b`,
///   `core_flags`): its renewal state of the key, kept here so that a key
///   costs one allocation (SPEC §9 counts the agent's bytes per key held).
///   They are atomics so that a slot can be shared (`Sync`) without
///   `unsafe`; the core accesses them with `Relaxed` ordering, always
///   under its own mutex, which orders its accesses, and writes a word
///   only when its value changed (at most once a visit, every renew
///   interval for a busy key). One exception is read outside the core:
///   word 3, what the allocator last reported is left in the bucket
///   beyond this lease, which the request path loads (`Relaxed`: an
///   estimate for `remaining`, never used to admit) in
///   [`SlotHead::global_remaining`]; it sits on the lease word's cache
///   line, so that read costs no other line.
#[derive(Debug)]
#[repr(C)]
pub struct SlotHead {
    /// The allocator said the bucket is dry until then (ns; bit 63: the
    /// allocator is still opening this never-leased key upstream).
    dry_until_ns: std::sync::atomic::AtomicU64,
    /// Sum of the costs of requests waiting for this key's next grant.
    waiting_cost: std::sync::atomic::AtomicU64,
    /// Tokens asked for but denied since the last visit (demand the lease
    /// could not serve).
    denied: std::sync::atomic::AtomicU64,
    /// Where the tenant and the route parts start in the key bytes, and
    /// their total length.
    tenant_at: u16,
    route_at: u16,
    key_len: u16,
    /// Core-owned flags (see [`crate::core`]).
    pub(crate) core_flags: std::sync::atomic::AtomicU16,
    /// Handles ([`Slot`]) to this block.
    refs: std::sync::atomic::AtomicU32,
    /// Counts the key's batches settled (answered or given up on): a parked
    /// request waits until it moves past what it saw when it registered.
    settles: std::sync::atomic::AtomicU32,
    /// Core-owned words 0-2 of the key's renewal state, packed (see
    /// [`crate::core`]). Nothing but the core touches them.
    core_a: [std::sync::atomic::AtomicU64; 3],
    /// The lease word (hot path), 64 bytes in.
    pub word: LeaseWord,
    /// Core-owned words 3-8; word 3 (at offset 104, on the lease word's
    /// line) is the bucket snapshot the request path reads.
    core_b: [std::sync::atomic::AtomicU64; 6],
}

/// Offset of the lease word in a slot's block.
pub const WORD_OFFSET: usize = std::mem::offset_of!(SlotHead, word);
const _: () = assert!(
    WORD_OFFSET == 64,
    "the word's line holds only its own block"
);
const _: () = assert!(
    std::mem::offset_of!(SlotHead, core_b) + 8 <= WORD_OFFSET + 64,
    "the bucket snapshot the request path reads is on the lease word's line"
);

impl SlotHead {
    /// Core-owned word `i` (0..9) of the key's renewal state.
    #[inline]
    pub(crate) fn core(&self, i: usize) -> &std::sync::atomic::AtomicU64 {
        match i {
            0..3 => &self.core_a[i],
            _ => &self.core_b[i - 3],
        }
    }

    /// The key's global remaining tokens as this agent estimates them
    /// (SPEC §5 "What the headers say"), `lease_level` being what its
    /// lease holds now: `min(burst, lease_level + what the allocator last
    /// reported is left in the bucket beyond the lease)`. What was spent
    /// since the report has left the lease's level; what refilled since is
    /// not added. With an allocator that reports nothing (older than the
    /// field) it is the lease's level. Every interface's `remaining`
    /// (Check, Envoy RLS `limit_remaining`, the `RateLimit` headers) is
    /// this, taken at the admission.
    #[inline]
    pub fn global_remaining(&self, lease_level: u64, burst: u64) -> u64 {
        lease_level
            .saturating_add(self.core_b[0].load(Ordering::Relaxed))
            .min(burst)
    }
}

const OPENING_BIT: u64 = 1 << 63;
/// The allocator said it is starting (see [`SlotHead::starting`]).
const STARTING_BIT: u64 = 1 << 62;
/// The flags kept in the high bits of `dry_until_ns`.
const FLAG_BITS: u64 = OPENING_BIT | STARTING_BIT;
/// Bytes of the fixed part of a slot; the key's bytes start there.
pub const SLOT_HEAD_BYTES: usize = std::mem::size_of::<SlotHead>();
/// Alignment of a slot's block: 16, so a table can keep a 4-bit tag in the
/// low bits of a slot's address.
pub const SLOT_ALIGN: usize = 16;

/// One key held by the agent: a counted handle to its block (one heap
/// allocation holding [`SlotHead`] and the key's bytes; a thin pointer).
/// What the request path reads and writes is atomics only; the renewal
/// side of the key lives in the same block, in words only the agent core
/// ([`crate::core`]) touches, and the core alone installs, cuts and
/// retires the word. No waker of its own: requests parked on a key wait
/// on the agent's striped wakers, keyed by [`Slot::addr`].
///
/// Two handles are equal when they are handles to the same block: a key
/// forgotten and created again has a new slot, so a late refund cannot
/// land in it.
pub struct Slot {
    ptr: std::ptr::NonNull<SlotHead>,
}

// SAFETY: a slot's block holds only atomics and integers that never change
// after creation (the key's offsets and bytes), so sharing and sending
// handles across threads is as safe as sharing `&SlotHead` and `&[u8]`;
// the block is freed only by the last handle's drop (see `Drop`).
unsafe impl Send for Slot {}
// SAFETY: as above.
unsafe impl Sync for Slot {}

impl Slot {
    /// Bytes of the heap block of a slot whose key has `key_len` bytes (for
    /// memory accounting: `examples/agent_memory.rs` prints it).
    pub fn block_bytes(key_len: usize) -> usize {
        Self::layout(key_len).size()
    }

    /// The layout of a block with a key of `key_len` bytes.
    ///
    /// Not padded to its alignment: no Rust value spans the whole block
    /// (the head is a `SlotHead`, the rest bytes), and the allocator then
    /// rounds only once (glibc's 16-byte chunks).
    fn layout(key_len: usize) -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(
            SLOT_HEAD_BYTES + key_len,
            SLOT_ALIGN.max(std::mem::align_of::<SlotHead>()),
        )
        .expect("a slot block is small")
    }

    /// An empty slot for a key. Parts are ids of at most
    /// `MAX_ID_BYTES` (256) bytes each, so their offsets fit 16 bits.
    pub fn new(rule_id: &str, tenant: &str, route: &str) -> Self {
        use std::sync::atomic::{AtomicU16, AtomicU32, AtomicU64};
        let offset = |n: usize| u16::try_from(n).expect("key parts are ids of at most 256 bytes");
        let len = rule_id.len() + tenant.len() + route.len();
        let head = SlotHead {
            dry_until_ns: AtomicU64::new(0),
            waiting_cost: AtomicU64::new(0),
            denied: AtomicU64::new(0),
            tenant_at: offset(rule_id.len()),
            route_at: offset(rule_id.len() + tenant.len()),
            key_len: offset(len),
            core_flags: AtomicU16::new(0),
            refs: AtomicU32::new(1),
            settles: AtomicU32::new(0),
            core_a: Default::default(),
            word: LeaseWord::new(),
            core_b: Default::default(),
        };
        let layout = Self::layout(len);
        // SAFETY: the layout has a non-zero size (the head alone is more
        // than 100 bytes).
        let block = unsafe { std::alloc::alloc(layout) };
        let Some(ptr) = std::ptr::NonNull::new(block) else {
            std::alloc::handle_alloc_error(layout)
        };
        // SAFETY: `block` is valid for writes of `layout.size()` =
        // SLOT_HEAD_BYTES + len bytes (at least) and aligned for
        // `SlotHead`; the head goes first, the parts after it, each copied
        // from a `&str` that cannot overlap a fresh allocation.
        unsafe {
            block.cast::<SlotHead>().write(head);
            let mut at = block.add(SLOT_HEAD_BYTES);
            for part in [rule_id, tenant, route] {
                std::ptr::copy_nonoverlapping(part.as_ptr(), at, part.len());
                at = at.add(part.len());
            }
        }
        Self { ptr: ptr.cast() }
    }

    /// A borrowed view of this slot.
    #[inline]
    pub fn borrow(&self) -> SlotRef<'_> {
        SlotRef {
            ptr: self.ptr,
            _life: std::marker::PhantomData,
        }
    }

    /// The key, borrowed.
    #[inline]
    pub fn key_ref(&self) -> KeyRef<'_> {
        self.borrow().key_ref()
    }
    /// The rule id of the key.
    #[inline]
    pub fn rule_id(&self) -> &str {
        self.borrow().rule_id()
    }
    /// The tenant part of the key.
    #[inline]
    pub fn tenant(&self) -> &str {
        self.borrow().tenant()
    }
    /// The route part of the key.
    #[inline]
    pub fn route(&self) -> &str {
        self.borrow().route()
    }

    /// The block's address: unique among live slots (a forgotten key's
    /// slot lives on while a handle to it does), stable for its life.
    #[inline]
    pub fn addr(&self) -> usize {
        self.ptr.as_ptr().addr()
    }

    /// Give up this handle as a raw pointer to its block (for a table);
    /// [`Slot::from_raw`] takes it back.
    pub(crate) fn into_raw(self) -> *mut u8 {
        let p = self.ptr.as_ptr().cast::<u8>();
        std::mem::forget(self);
        p
    }

    /// The handle [`Slot::into_raw`] gave up.
    ///
    /// # Safety
    ///
    /// `p` came from [`Slot::into_raw`] and is passed here once.
    pub(crate) unsafe fn from_raw(p: *mut u8) -> Self {
        // SAFETY: per the contract, `p` is a live block's non-null address.
        Self {
            ptr: unsafe { std::ptr::NonNull::new_unchecked(p.cast()) },
        }
    }

    /// A borrowed view of the block at `p`.
    ///
    /// # Safety
    ///
    /// `p` is a block's address (from [`Slot::into_raw`]) whose handle
    /// stays alive for `'a`.
    pub(crate) unsafe fn borrow_raw<'a>(p: *mut u8) -> SlotRef<'a> {
        SlotRef {
            // SAFETY: per the contract, `p` is non-null.
            ptr: unsafe { std::ptr::NonNull::new_unchecked(p.cast()) },
            _life: std::marker::PhantomData,
        }
    }
}

impl Clone for Slot {
    #[inline]
    fn clone(&self) -> Self {
        self.borrow().to_owned()
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        use std::sync::atomic::{fence, Ordering};
        // As `std::sync::Arc`: the decrement releases this handle's
        // accesses; the last one acquires all the others' before freeing.
        if self.refs.fetch_sub(1, Ordering::Release) != 1 {
            return;
        }
        fence(Ordering::Acquire);
        let layout = Self::layout(usize::from(self.key_len));
        // SAFETY: this was the last handle, so nothing else can reach the
        // block; it was allocated in `Slot::new` with this very layout
        // (same key length). `SlotHead` holds atomics and integers only:
        // there is nothing to drop in place.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr().cast(), layout) }
    }
}

impl std::ops::Deref for Slot {
    type Target = SlotHead;
    #[inline]
    fn deref(&self) -> &SlotHead {
        // SAFETY: the block lives as long as this handle does.
        unsafe { self.ptr.as_ref() }
    }
}

impl PartialEq for Slot {
    fn eq(&self, other: &Self) -> bool {
        self.ptr == other.ptr
    }
}
impl Eq for Slot {}

/// By block, as equality (the table finds slots by key).
impl std::hash::Hash for Slot {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        self.addr().hash(h)
    }
}

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slot")
            .field("key", &self.key_ref())
            .field("word", &self.word.load_raw())
            .field("deadline_ns", &self.word.deadline_ns())
            .finish()
    }
}

/// A borrowed slot: valid while some handle to it lives for `'a` (a
/// table's guard, or a [`Slot`]). Reads like a `&Slot`.
#[derive(Clone, Copy)]
pub struct SlotRef<'a> {
    ptr: std::ptr::NonNull<SlotHead>,
    _life: std::marker::PhantomData<&'a SlotHead>,
}

// SAFETY: as for `Slot`: a view of atomics and immutable bytes.
unsafe impl Send for SlotRef<'_> {}
// SAFETY: as above.
unsafe impl Sync for SlotRef<'_> {}

impl<'a> SlotRef<'a> {
    /// The head, for `'a`.
    #[inline]
    pub fn head(self) -> &'a SlotHead {
        // SAFETY: the block lives for 'a (the type's contract).
        unsafe { self.ptr.as_ref() }
    }

    /// The key's bytes (rule id, tenant, route).
    #[inline]
    fn key_bytes(self) -> &'a [u8] {
        let len = usize::from(self.head().key_len);
        // SAFETY: the block holds `len` initialized key bytes right after
        // the head (written in `Slot::new`, never changed), and lives for
        // 'a. The pointer is the block's own (not derived from a reference
        // to the head), so it may reach past the head.
        unsafe {
            std::slice::from_raw_parts(self.ptr.as_ptr().cast::<u8>().add(SLOT_HEAD_BYTES), len)
        }
    }

    /// Bytes `from..to` of the key as a string.
    #[inline]
    fn part(self, from: u16, to: u16) -> &'a str {
        let bytes = &self.key_bytes()[usize::from(from)..usize::from(to)];
        // SAFETY: the key's bytes are three `&str`s copied one after the
        // other, and `from..to` is one of them (their boundaries are
        // `tenant_at`, `route_at` and `key_len`): valid UTF-8.
        unsafe { std::str::from_utf8_unchecked(bytes) }
    }

    /// The rule id of the key.
    #[inline]
    pub fn rule_id(self) -> &'a str {
        self.part(0, self.head().tenant_at)
    }
    /// The tenant part of the key.
    #[inline]
    pub fn tenant(self) -> &'a str {
        let h = self.head();
        self.part(h.tenant_at, h.route_at)
    }
    /// The route part of the key.
    #[inline]
    pub fn route(self) -> &'a str {
        let h = self.head();
        self.part(h.route_at, h.key_len)
    }
    /// The key, borrowed.
    #[inline]
    pub fn key_ref(self) -> KeyRef<'a> {
        KeyRef::new(self.rule_id(), self.tenant(), self.route())
    }

    /// A handle of its own to this slot.
    #[inline]
    pub fn to_owned(self) -> Slot {
        // Relaxed as in `std::sync::Arc::clone`: a new handle is made from
        // a live one, which keeps the block alive meanwhile.
        let old = self
            .head()
            .refs
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if old > u32::MAX / 2 {
            // Never in practice (handles are per key and thread); as
            // `Arc`, abort rather than risk an overflow.
            std::process::abort();
        }
        Slot { ptr: self.ptr }
    }
}

impl std::ops::Deref for SlotRef<'_> {
    type Target = SlotHead;
    #[inline]
    fn deref(&self) -> &SlotHead {
        self.head()
    }
}

impl SlotHead {
    /// Until when the allocator said the bucket is dry.
    pub fn dry_until(&self) -> u64 {
        self.dry_until_ns.load(Ordering::Acquire) & !FLAG_BITS
    }
    pub(crate) fn set_dry_until(&self, t: u64) {
        let t = t.min(!FLAG_BITS);
        let _ = self
            .dry_until_ns
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                Some((v & FLAG_BITS) | t)
            });
    }
    /// Whether the allocator said it is starting (nothing to lease until
    /// `dry_until`, and not because of a limit).
    pub fn starting(&self) -> bool {
        self.dry_until_ns.load(Ordering::Acquire) & STARTING_BIT != 0
    }
    pub(crate) fn set_starting(&self, v: bool) {
        if v {
            self.dry_until_ns.fetch_or(STARTING_BIT, Ordering::AcqRel);
        } else {
            self.dry_until_ns.fetch_and(!STARTING_BIT, Ordering::AcqRel);
        }
    }
    /// Whether the allocator is still opening the key upstream.
    pub fn opening(&self) -> bool {
        self.dry_until_ns.load(Ordering::Acquire) & OPENING_BIT != 0
    }
    pub(crate) fn set_opening(&self, v: bool) {
        if v {
            self.dry_until_ns.fetch_or(OPENING_BIT, Ordering::AcqRel);
        } else {
            self.dry_until_ns.fetch_and(!OPENING_BIT, Ordering::AcqRel);
        }
    }
    /// How many of the key's batches have settled (wrapping: a waiter only
    /// asks whether it moved).
    pub fn settles(&self) -> u32 {
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
}

impl Slot {
    /// A RELEASE item for this key: `spent` of a lease of tokens, or the
    /// level `left` of a rate lease when it stopped being used.
    pub(crate) fn release_item(
        &self,
        lease_id: u64,
        spent: u64,
        left: u64,
    ) -> quotalease_proto::lease::LeaseItem {
        use quotalease_proto::lease::{ItemKind, LeaseItem};
        LeaseItem {
            rule_id: self.rule_id().to_string(),
            tenant: self.tenant().to_string(),
            route: self.route().to_string(),
            kind: ItemKind::Release as i32,
            lease_id,
            spent,
            left,
            want: 0,
            ..LeaseItem::default()
        }
    }
}

mod table;
pub use table::{Pinned, Table};

#[cfg(all(test, not(quotalease_loom)))]
mod tests {
    use super::*;

    #[test]
    fn take_until_short_then_refund_same_generation_only() {
        let w = LeaseWord::new();
        assert_eq!(w.try_take(1, 0), Take::NoLease);
        let (_, g1, t) = w.install(100, Refill::NONE, 0, |_| 5);
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
        assert_eq!(w.load_raw(), (g1, 5));
        // A renewal replaces the lease: a late refund into g1 is dropped.
        let (old, g2, _) = w.install(200, Refill::NONE, 10, |cur| cur + 10);
        assert_eq!(old, 5);
        assert!(!w.refund(g1, 3));
        assert_eq!(w.load_raw(), (g2, 15));
        // Expiry is checked on every decision.
        assert_eq!(w.try_take(1, 200), Take::NoLease);
        // A cut keeps tokens and deadline but drops refunds of older charges.
        let Take::Taken {
            generation: g2b, ..
        } = w.try_take(1, 150)
        else {
            panic!("lease valid at 150")
        };
        let (seen, g3) = w.cut(150);
        assert_eq!((seen, w.deadline_ns()), (14, 200));
        assert!(!w.refund(g2b, 1));
        assert_eq!(w.load_raw(), (g3, 14));
        assert_eq!(w.retire(150).0, 14);
        assert_eq!(w.try_take(1, 10), Take::NoLease);
    }

    /// One block, many handles: parts come back apart (any lengths, any
    /// UTF-8), clones and drops on several threads keep the count exact.
    #[test]
    fn slot_handles_share_one_block() {
        let long = "x".repeat(256);
        for (r, t, u) in [
            ("r", "ab", "c"),
            ("rule", "tenant-\u{e9}", ""),
            ("r", "", ""),
        ] {
            let s = Slot::new(r, t, u);
            assert_eq!((s.rule_id(), s.tenant(), s.route()), (r, t, u));
        }
        let s = Slot::new(&long, &long, &long);
        assert_eq!(
            (s.rule_id(), s.tenant(), s.route()),
            (&*long, &*long, &*long)
        );
        assert_eq!(s.addr() % SLOT_ALIGN, 0);
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let c = s.clone();
                std::thread::spawn(move || {
                    for _ in 0..10_000 {
                        drop(c.clone());
                    }
                    c
                })
            })
            .collect();
        let back: Vec<Slot> = threads.into_iter().map(|h| h.join().unwrap()).collect();
        assert!(back.iter().all(|b| *b == s));
        assert_eq!(s.refs.load(Ordering::Relaxed), 5);
        drop(back);
        assert_eq!(s.refs.load(Ordering::Relaxed), 1);
        assert_ne!(Slot::new("r", "ab", "c"), Slot::new("r", "ab", "c"));
        // The opening flag and the dry instant share a word.
        s.set_dry_until(123);
        s.set_opening(true);
        assert_eq!((s.dry_until(), s.opening()), (123, true));
        s.set_dry_until(7);
        assert_eq!((s.dry_until(), s.opening()), (7, true));
        s.set_opening(false);
        assert_eq!((s.dry_until(), s.opening()), (7, false));
        s.set_starting(true);
        s.set_dry_until(9);
        assert_eq!((s.dry_until(), s.opening(), s.starting()), (9, false, true));
        s.set_opening(true);
        s.set_starting(false);
        assert_eq!((s.dry_until(), s.opening(), s.starting()), (9, true, false));
    }

    #[test]
    fn pack_round_trips_at_extremes() {
        assert_eq!(unpack(pack(GEN_MASK, TOKEN_MASK)), (GEN_MASK, TOKEN_MASK));
        assert_eq!(unpack(pack(GEN_MASK + 1, 0)), (0, 0));
    }

    #[test]
    fn concurrent_takes_never_exceed_the_lease() {
        let w = std::sync::Arc::new(LeaseWord::new());
        w.install(u64::MAX, Refill::NONE, 0, |_| 10_000);
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

    const MS: u64 = 1_000_000;

    /// 1 000 tokens/s (one per ms), capacity 10.
    fn per_ms(capacity: u64) -> Refill {
        Refill {
            ns_per_token: MS,
            capacity,
        }
    }

    #[test]
    fn a_rate_lease_refills_continuously_up_to_its_capacity() {
        let w = LeaseWord::new();
        let t0 = 5_000 * MS;
        let (_, g, level) = w.install(t0 + 1_000 * MS, per_ms(10), t0, |_| 4);
        assert_eq!(level, 4);
        assert_eq!(w.peek(t0), Some(4));
        for left in (0..4).rev() {
            assert!(
                matches!(w.try_take(1, t0), Take::Taken { remaining, .. } if remaining == left)
            );
        }
        assert_eq!(w.try_take(1, t0), Take::Short { remaining: 0 });
        // Half a token's time: still short; a whole one: one token.
        assert_eq!(w.try_take(1, t0 + MS / 2), Take::Short { remaining: 0 });
        assert!(
            matches!(w.try_take(1, t0 + MS), Take::Taken { generation, remaining: 0 } if generation == g)
        );
        // Sitting idle fills it to its capacity, never beyond.
        assert_eq!(w.peek(t0 + 500 * MS), Some(10));
        assert!(matches!(
            w.try_take(10, t0 + 500 * MS),
            Take::Taken { remaining: 0, .. }
        ));
        assert_eq!(w.try_take(1, t0 + 500 * MS), Take::Short { remaining: 0 });
        // A refund gives back what the charge took.
        let Take::Taken { generation, .. } = w.try_take(1, t0 + 502 * MS) else {
            panic!("one token refilled")
        };
        assert!(w.refund(generation, 1));
        assert_eq!(w.peek(t0 + 502 * MS), Some(2));
        // A cut keeps the bucket; a renewal to a smaller capacity clips it
        // and adds its increment on top.
        let (at_cut, g2) = w.cut(t0 + 502 * MS);
        assert_eq!((at_cut, w.refill()), (2, per_ms(10)));
        assert!(!w.refund(generation, 1));
        let (seen, g3, new) = w.install(t0 + 2_000 * MS, per_ms(3), t0 + 505 * MS, |cur| {
            cur.min(3) + 2
        });
        assert_eq!((seen, new, w.peek(t0 + 505 * MS)), (5, 3, Some(3)));
        assert!(g3 != g2);
        // Expiry ends the refill with the lease.
        assert_eq!(w.try_take(1, t0 + 2_000 * MS), Take::NoLease);
        // Back to tokens only: the level carries over, no refill.
        w.install(t0 + 3_000 * MS, Refill::NONE, t0 + 1_000 * MS, |cur| cur);
        assert_eq!(w.peek(t0 + 2_500 * MS), Some(3));
        assert_eq!(w.retire(t0 + 2_500 * MS).0, 3);
    }

    /// Renewals every half token must not lose the half: the part of a
    /// token refilled so far carries over (as the same fraction at a new
    /// rate), and never as more.
    #[test]
    fn a_renewal_keeps_the_part_of_a_token_refilled_so_far() {
        let w = LeaseWord::new();
        let t0 = 5_000 * MS;
        w.install(t0 + 1_000 * MS, per_ms(10), t0, |_| 0);
        let mut t = t0;
        let mut taken = 0;
        for _ in 0..100 {
            t += MS / 2;
            w.install(t + 1_000 * MS, per_ms(10), t, |cur| cur);
            while let Take::Taken { .. } = w.try_take(1, t) {
                taken += 1;
            }
        }
        // 50 ms at one token per ms.
        assert_eq!(taken, 50);
        // Half a token refilled at 1/ms is half a token at 1 per 2 ms: one
        // more ms completes it.
        let w = LeaseWord::new();
        w.install(t0 + 1_000 * MS, per_ms(10), t0, |_| 0);
        let slower = Refill {
            ns_per_token: 2 * MS,
            capacity: 10,
        };
        w.install(t0 + 1_000 * MS, slower, t0 + MS / 2, |cur| cur);
        assert_eq!(
            w.try_take(1, t0 + MS / 2 + MS - 1),
            Take::Short { remaining: 0 }
        );
        assert!(matches!(
            w.try_take(1, t0 + MS / 2 + MS),
            Take::Taken { .. }
        ));
    }

    #[test]
    fn a_capacity_too_large_for_its_rate_is_held_smaller_and_still_refills() {
        // 60/m granted with a capacity of 600: 600 s from empty to full.
        let r = Refill::of_grant(1_000_000, 600);
        assert!(r.fits(0, 2_000 * MS), "{r:?}");
        assert!(r.capacity < 600 && r.capacity * r.ns_per_token < RATE_SPAN_NS);
        assert!(r.capacity >= 270, "{r:?}");
        let w = LeaseWord::new();
        let t0 = 1_000 * MS;
        w.install(t0 + 60_000 * MS, r, t0, |_| 600);
        let mut burst = 0;
        while let Take::Taken { .. } = w.try_take(1, t0) {
            burst += 1;
        }
        assert_eq!(burst, r.capacity, "held at its capacity");
        // 45 s later: about 45 tokens (the rate slowed by rho), not 0.
        let t = t0 + 45_000 * MS;
        let mut later = 0;
        while let Take::Taken { .. } = w.try_take(1, t) {
            later += 1;
        }
        assert_eq!(later, 44, "refilled at 1/s slowed by rho");
        // The slowest rate agents ask for still refills a token.
        assert!(Refill::of_grant(MIN_RATE_UTPS, 1).fits(0, MS));
        assert!(!Refill::of_grant(MIN_RATE_UTPS / 2, 1).fits(0, MS));
    }

    #[test]
    fn rates_that_could_wrap_are_held_as_tokens() {
        let w = LeaseWord::new();
        // 1 token per 100 s with capacity 10 000: a span of 11 days.
        let slow = Refill {
            ns_per_token: 100_000 * MS,
            capacity: 10_000,
        };
        w.install(1_000 * MS, slow, 0, |_| 7);
        assert_eq!((w.refill(), w.peek(0)), (Refill::NONE, Some(7)));
        // A lease living longer than 2^38 ns likewise.
        w.install(RATE_SPAN_NS + 1, per_ms(10), 0, |_| 7);
        assert_eq!(w.refill(), Refill::NONE);
        // The grant's rate, slowed by rho, rounded against the holder.
        let r = Refill::of_grant(1_000_000_000, 5);
        assert_eq!(r.capacity, 5);
        assert!(
            r.ns_per_token > MS && r.ns_per_token < MS + MS / 500,
            "{r:?}"
        );
        assert_eq!(Refill::of_grant(0, 5), Refill::NONE);
        assert_eq!(Refill::of_grant(1_000, 0), Refill::NONE);
    }

    /// A small deterministic generator (no dependency).
    fn next(x: &mut u64) -> u64 {
        *x ^= *x << 13;
        *x ^= *x >> 7;
        *x ^= *x << 17;
        *x
    }

    /// Against a reference bucket (level as a fraction, refilled
    /// continuously): the word admits exactly what the reference admits,
    /// and over every window of every history admits at most the level at
    /// its start plus the rate times its length plus what was installed in
    /// it; across the 40-bit wrap of the clock too.
    #[test]
    fn a_rate_lease_matches_a_reference_bucket_over_random_histories() {
        for seed in 1..=300u64 {
            let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            let ns = 1 + next(&mut x) % (3 * MS);
            let cap = 1 + next(&mut x) % 40;
            let refill = Refill {
                ns_per_token: ns,
                capacity: cap,
            };
            let w = LeaseWord::new();
            // Start close to a wrap of the 40-bit value for some seeds.
            let mut now = if seed % 3 == 0 {
                (1 << 40) - 50 * ns
            } else {
                10_000 * MS
            };
            let start_level = next(&mut x) % (cap + 1);
            let deadline = now + (100_000 * ns).min(200_000 * MS);
            w.install(deadline, refill, now, |_| start_level);
            assert_eq!(w.refill(), refill, "seed {seed}: held as a rate lease");
            // Reference: level in units of ns (tokens * ns), continuous.
            let mut ref_level = u128::from(start_level) * u128::from(ns);
            let span = u128::from(cap) * u128::from(ns);
            let mut last = now;
            let mut admitted: Vec<(u64, u64)> = Vec::new();
            for _ in 0..400 {
                now += next(&mut x) % (2 * ns + 1);
                if now >= deadline {
                    break;
                }
                ref_level = (ref_level + u128::from(now - last)).min(span);
                last = now;
                let cost = 1 + next(&mut x) % 3;
                let want = u128::from(cost) * u128::from(ns);
                let got = w.try_take(cost, now);
                if ref_level >= want {
                    ref_level -= want;
                    assert!(
                        matches!(got, Take::Taken { .. }),
                        "seed {seed}: reference admits at {now}, word said {got:?}"
                    );
                    admitted.push((now, cost));
                } else {
                    assert!(
                        matches!(got, Take::Short { .. }),
                        "seed {seed}: reference denies at {now}, word said {got:?}"
                    );
                }
                let floor = u64::try_from(ref_level / u128::from(ns)).unwrap();
                assert_eq!(w.peek(now), Some(floor), "seed {seed} at {now}");
            }
            // Every window [a, b]: admitted <= capacity + (b - a) / ns + 1.
            for i in 0..admitted.len() {
                let mut sum = 0;
                for &(t, c) in &admitted[i..] {
                    sum += c;
                    let bound = cap + (t - admitted[i].0) / ns;
                    assert!(
                        sum <= bound,
                        "seed {seed}: {sum} admitted over a window allowing {bound}"
                    );
                }
            }
        }
    }

    #[test]
    fn concurrent_takes_from_a_rate_lease_never_exceed_its_refill() {
        use std::time::Instant;
        let w = std::sync::Arc::new(LeaseWord::new());
        let t0 = Instant::now();
        let now = move || t0.elapsed().as_nanos() as u64 + 1_000 * MS;
        // One token every 10 us, capacity 50, for 200 ms.
        let refill = Refill {
            ns_per_token: 10_000,
            capacity: 50,
        };
        let start = now();
        w.install(start + 200 * MS, refill, start, |_| 50);
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let w = w.clone();
                std::thread::spawn(move || {
                    let mut n = 0u64;
                    loop {
                        match w.try_take(1, now()) {
                            Take::Taken { .. } => n += 1,
                            Take::Short { .. } => std::hint::spin_loop(),
                            Take::NoLease => return n,
                        }
                    }
                })
            })
            .collect();
        let total: u64 = handles.into_iter().map(|h| h.join().unwrap()).sum();
        let end = w.deadline_ns();
        let bound = 50 + (end - start) / 10_000;
        assert!(total <= bound, "{total} taken, at most {bound} refilled");
        assert!(total > 0);
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
            let (_, g1, _) = w.install(100, Refill::NONE, 0, |_| 2);
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
                let (seen, _, new_tokens) = w2.install(200, Refill::NONE, 1, |cur| cur + 1);
                (seen, new_tokens)
            });
            let ta = a.join().unwrap();
            let tb = b.join().unwrap();
            let (seen, new_tokens) = c.join().unwrap();
            let (_, left) = w.load_raw();
            // Old lease: 2 tokens; the install saw `seen` of them still there and
            // carried them plus 1. Everything taken + left == 2 + 1.
            assert_eq!(ta + tb + left, 3, "seen {seen} new {new_tokens}");
            // The install replaced generation g1: a refund into it is dropped.
            assert!(!w.refund(g1, 1));
        });
    }

    /// The same race on a rate lease whose renewal changes its rate and
    /// capacity: a taker (that refunds when it can) reads each generation's
    /// own refill word, and nothing is taken that neither lease held.
    #[test]
    fn loom_rate_lease_take_refund_and_renewal() {
        loom::model(|| {
            let slow = Refill {
                ns_per_token: 1_000,
                capacity: 2,
            };
            let fast = Refill {
                ns_per_token: 10,
                capacity: 3,
            };
            let w = Arc::new(LeaseWord::new());
            let (_, g1, _) = w.install(100_000, slow, 1, |_| 2);
            let a = {
                let w = w.clone();
                thread::spawn(move || match w.try_take(1, 1) {
                    // A refund lands only in the generation charged.
                    Take::Taken { generation, .. } => u64::from(!w.refund(generation, 1)),
                    _ => 0,
                })
            };
            let w2 = w.clone();
            let c = thread::spawn(move || w2.install(200_000, fast, 1, |cur| cur + 1));
            let taken = a.join().unwrap();
            let (_, g2, _) = c.join().unwrap();
            let (g, left) = w.level_at(1);
            assert_eq!(g, g2);
            assert_eq!(w.refill(), fast);
            // At the same instant nothing refilled: taken + left == 2 + 1.
            assert_eq!(taken + left, 3);
            assert!(!w.refund(g1, 1));
        });
    }
}

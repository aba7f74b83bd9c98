//! A key's renewal-side state, packed into its slot's core-owned words
//! ([`KeyState`]).

use super::*;

/// Renewal-side state of one key (never touched by the request fast path),
/// as the core works on it: decoded from the key's slot
/// ([`KeyState::load`]) and written back ([`KeyState::store`]). It lives
/// in the slot's core-owned words, packed (SPEC §9 counts the agent's
/// bytes per key held: one allocation per key holds the lease word, the
/// request side's atomics, this state and the key's bytes). The key's
/// rare parts (a refusal, an emergency bucket) are in `AgentCore::rare`.
#[derive(Clone, Debug)]
pub(super) struct KeyState {
    pub(super) lease_id: u64,
    /// Tokens of the lease as the allocator records them (at most
    /// [`crate::lease_table::MAX_WORD_TOKENS`], what a word holds).
    pub(super) granted: u64,
    /// The word's generation as the core last set it (24 bits, as in the
    /// word). Only the core changes a word's generation, so the word's
    /// always equals this.
    pub(super) generation: u64,
    /// Tokens in the word at the last visit (for consumption accounting).
    pub(super) baseline: u64,
    pub(super) usage: Usage,
    /// A renewal is in flight: the low [`SEQ_TAG_BITS`] bits of its
    /// batch's sequence number (its carry and tokens at send are in the
    /// batch's [`Renewing`] entry).
    pub(super) in_flight: Option<u32>,
    /// Holders of this key at the allocator, as of the last grant.
    pub(super) holders: u64,
    /// The tick may skip this key before this instant if its word still
    /// reads (generation, baseline) and nothing waits or was denied.
    pub(super) quiet_until_ns: u64,
    /// Idle (nothing spent for a second or more) at the last visit: the
    /// tick skips it until `quiet_until_ns` without even reading its word
    /// (a request that finds its lease short asks through `want` anyway).
    pub(super) parked: bool,
    /// In the core's list of keys the tick visits (`AgentCore::active`);
    /// a parked key is not, it waits in `AgentCore::parked` instead.
    pub(super) listed: bool,
    /// The core holds the key: false once it was forgotten (its slot may
    /// live on in handles and lists; the core skips it).
    pub(super) held: bool,
    /// The rate asked for in the last renewal (micro-tokens per second).
    /// Kept (as `f32`, in `granted`'s bits) only while `granted` is 0,
    /// which it is whenever the lease carries a rate, the only time the
    /// planner reads it; a renewal in flight also keeps it in its
    /// [`Renewing`] entry, and the grant that answers it restores it.
    pub(super) asked_rate_utps: u64,
    /// What the allocator last reported is left in the key's bucket beyond
    /// our lease (`Grant.bucket_available`): the request path reads it
    /// (the one core-owned word it reads) to answer `remaining`, see
    /// [`crate::lease_table::SlotHead::global_remaining`].
    pub(super) bucket_available: u64,
}

/// Bits of a batch sequence number kept per key in flight. A key's
/// in-flight tag is compared only with batches still pending (answered or
/// given up on within `2 * lease_ttl`); 2^24 batches never go out in that
/// time (and at most one pending batch that is not given up on renews a
/// key: the planner does not renew a key in flight).
pub(super) const SEQ_TAG_BITS: u32 = 24;
pub(super) const SEQ_TAG_MASK: u64 = (1 << SEQ_TAG_BITS) - 1;
pub(super) const LOW40: u64 = (1 << 40) - 1;
pub(super) const HOLDERS_MAX: u64 = (1 << 24) - 1;

pub(super) const F_HELD: u16 = 1;
pub(super) const F_LISTED: u16 = 2;
pub(super) const F_PARKED: u16 = 4;
pub(super) const F_IN_FLIGHT: u16 = 8;
/// Word 1's low 40 bits hold `asked_rate_utps` as `f32` bits, not
/// `granted` (which is then 0).
pub(super) const F_ASKED_RATE: u16 = 16;

/// The tag of batch `seq` in a key's state.
pub(super) fn seq_tag(seq: u64) -> u32 {
    (seq & SEQ_TAG_MASK) as u32
}

/// A rate as stored (`f32`): a positive rate stays positive (it would
/// round to zero only after ~100 time constants idle; the planner treats
/// "no rate" and "some rate" differently).
pub(super) fn rate_bits(x: f64) -> u32 {
    let f = x as f32;
    if f == 0.0 && x > 0.0 {
        f32::from_bits(1).to_bits()
    } else {
        f.to_bits()
    }
}

impl KeyState {
    /// A key just created (held, in the tick's list).
    pub(super) fn fresh() -> Self {
        Self {
            lease_id: 0,
            granted: 0,
            generation: 0,
            baseline: 0,
            usage: Usage::default(),
            in_flight: None,
            holders: 1,
            quiet_until_ns: 0,
            parked: false,
            listed: true,
            held: true,
            asked_rate_utps: 0,
            bucket_available: 0,
        }
    }

    /// Decode the core-owned words of `s`. Relaxed: only the core writes
    /// them, always under its mutex, which orders its accesses (the
    /// request path only loads word 3, an estimate).
    pub(super) fn load(s: &SlotHead) -> Self {
        let w = |i: usize| s.core(i).load(Relaxed);
        let flags = s.core_flags.load(Relaxed);
        let (granted_gen, baseline_holders, rates, since_seq) = (w(1), w(2), w(8), w(4));
        let asked_rate = flags & F_ASKED_RATE != 0;
        Self {
            lease_id: w(0),
            granted: if asked_rate { 0 } else { granted_gen & LOW40 },
            generation: granted_gen >> 40,
            baseline: baseline_holders & LOW40,
            holders: baseline_holders >> 40,
            usage: Usage {
                rate: f64::from(f32::from_bits(rates as u32)),
                admitted_rate: f64::from(f32::from_bits((rates >> 32) as u32)),
                since_tick: since_seq & LOW40,
                denied_since_tick: 0,
                last_tick_ns: w(5),
                last_active_ns: w(6),
            },
            in_flight: (flags & F_IN_FLIGHT != 0).then_some((since_seq >> 40) as u32),
            quiet_until_ns: w(7),
            parked: flags & F_PARKED != 0,
            listed: flags & F_LISTED != 0,
            held: flags & F_HELD != 0,
            asked_rate_utps: if asked_rate {
                f32::from_bits(granted_gen as u32) as u64
            } else {
                0
            },
            bucket_available: w(3),
        }
    }

    /// Encode into the core-owned words of `s`, writing only the words
    /// that changed (a hot key's block is not written on every visit).
    /// `usage.denied_since_tick` is not kept here: a visit folds it in at
    /// once (see `plan_key`).
    pub(super) fn store(&self, s: &SlotHead) {
        let put = |i: usize, v: u64| {
            if s.core(i).load(Relaxed) != v {
                s.core(i).store(v, Relaxed);
            }
        };
        debug_assert!(self.generation < 1 << 24, "a word's generation has 24 bits");
        put(0, self.lease_id);
        // `granted`, or, while it is 0, the rate asked for.
        let asked_rate = self.granted == 0 && self.asked_rate_utps > 0;
        let low = if asked_rate {
            u64::from((self.asked_rate_utps as f32).to_bits())
        } else {
            self.granted.min(LOW40)
        };
        put(1, low | (self.generation << 40));
        put(
            2,
            self.baseline.min(LOW40) | (self.holders.min(HOLDERS_MAX) << 40),
        );
        put(3, self.bucket_available);
        put(
            8,
            u64::from(rate_bits(self.usage.rate))
                | (u64::from(rate_bits(self.usage.admitted_rate)) << 32),
        );
        let tag = u64::from(self.in_flight.unwrap_or(0)) & SEQ_TAG_MASK;
        put(4, self.usage.since_tick.min(LOW40) | (tag << 40));
        put(5, self.usage.last_tick_ns);
        put(6, self.usage.last_active_ns);
        put(7, self.quiet_until_ns);
        let bit = |on: bool, f: u16| if on { f } else { 0 };
        let flags = bit(self.held, F_HELD)
            | bit(self.listed, F_LISTED)
            | bit(self.parked, F_PARKED)
            | bit(self.in_flight.is_some(), F_IN_FLIGHT)
            | bit(asked_rate, F_ASKED_RATE);
        if s.core_flags.load(Relaxed) != flags {
            s.core_flags.store(flags, Relaxed);
        }
    }
}

impl KeyState {
    /// The RELEASE of this key's lease, retired with `left` tokens: a
    /// lease of tokens reports what it spent, a rate lease its level.
    pub(super) fn release_item(&self, slot: &Slot, rate: bool, left: u64) -> LeaseItem {
        if rate {
            slot.release_item(self.lease_id, 0, left)
        } else {
            slot.release_item(self.lease_id, self.granted.saturating_sub(left), 0)
        }
    }
}

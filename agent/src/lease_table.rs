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

/// The atomic part of a key's lease: the word and its deadline, each on its
/// own cache line (128 bytes, for adjacent-line prefetch): the deadline is
/// read on every decision and written only on install, so it must not share
/// a line with the word that every decision writes.
#[derive(Debug)]
pub struct LeaseWord {
    word: Line,
    deadline_ns: Line,
}

#[derive(Debug)]
#[repr(align(128))]
struct Line(AtomicU64);

impl std::ops::Deref for Line {
    type Target = AtomicU64;
    fn deref(&self) -> &AtomicU64 {
        &self.0
    }
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
            word: Line(AtomicU64::new(0)),
            deadline_ns: Line(AtomicU64::new(0)),
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

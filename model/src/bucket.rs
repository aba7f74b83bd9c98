//! Token bucket core: integer fixed-point tokens with lazy, exact refill.
//!
//! The level is kept in *fine units*: one token is `period_ns * SCALE` fine
//! units, and a rate of `N` tokens per period adds exactly `N * SCALE` fine
//! units per nanosecond. Refill is therefore exact integer arithmetic and
//! keeps every remainder: 5/min loses no fractions, and stepping lazily over
//! an interval equals stepping every tick (min(min(f + a, c) + b, c) =
//! min(f + a + b, c)). `SCALE` (10^6) makes a lease's rate in micro-tokens
//! per second exact too: `u` utps add `u * period_s` fine units per
//! nanosecond ([`lease_rate_fine`]), so a share of a rule's rate refills
//! without rounding. All values fit in `u128` by construction: `burst <=
//! 1e9` tokens and `period_ns <= 8.64e13`, so a full bucket is below 2^97
//! fine units, and `elapsed_ns * N * SCALE <= 2^64 * 1e15 < 2^114`.
//!
//! [`Level`] is the bare refilling quantity with a caller-given cap (the
//! allocator's ledger caps it at `B - outstanding`); [`TokenBucket`] is a
//! level capped at the burst.

use crate::rules::Rate;

/// Fine units per token and period nanosecond (see the module docs).
pub const SCALE: u128 = 1_000_000;

/// Fine units per token under `rate`'s period.
#[inline]
fn unit(rate: Rate) -> u128 {
    u128::from(rate.period_ns()) * SCALE
}

/// Fine units per nanosecond that `rate` itself adds.
#[inline]
pub fn rate_fine(rate: Rate) -> u128 {
    u128::from(rate.tokens) * SCALE
}

/// Fine units per nanosecond (under `rate`'s period) that a lease rate of
/// `utps` micro-tokens per second adds: exact.
#[inline]
pub fn lease_rate_fine(rate: Rate, utps: u64) -> u128 {
    u128::from(utps) * u128::from(rate.period_s)
}

/// `rate` in micro-tokens per second, rounded down.
#[inline]
pub fn rate_utps(rate: Rate) -> u64 {
    let u = u128::from(rate.tokens) * 1_000_000 / u128::from(rate.period_s.max(1));
    u64::try_from(u).unwrap_or(u64::MAX)
}

/// Why a bucket said no.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Denied {
    /// Not enough tokens now; enough will have refilled after this many ms
    /// (rounded up), if nobody else takes them.
    Wait {
        /// `ceil(missing / rate)` in milliseconds, at least 1.
        retry_after_ms: u64,
    },
    /// The cost can never be paid: 0 or above the burst.
    Invalid,
}

/// A refilling amount of tokens in fine units with its own timestamp.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Level {
    fine: u128,
    last_ns: u64,
}

impl Level {
    /// A level holding `tokens` at `now_ns`.
    pub fn new(tokens: u64, rate: Rate, now_ns: u64) -> Self {
        Self {
            fine: u128::from(tokens) * unit(rate),
            last_ns: now_ns,
        }
    }

    /// Refill up to `now_ns` at `rate`, never above `cap_tokens`. Time that
    /// runs backwards creates nothing and does not move the timestamp back.
    /// A level already above the cap (the cap was lowered) is left alone.
    pub fn refill(&mut self, rate: Rate, cap_tokens: u64, now_ns: u64) {
        self.refill_fine(rate, rate_fine(rate), cap_tokens, now_ns);
    }

    /// [`Level::refill`] at `fine_per_ns` fine units per nanosecond instead
    /// of `rate`'s own (which only sets the unit): a fraction of the rate,
    /// for example what is left after the rates of leases out.
    pub fn refill_fine(&mut self, rate: Rate, fine_per_ns: u128, cap_tokens: u64, now_ns: u64) {
        let Some(elapsed) = now_ns.checked_sub(self.last_ns) else {
            return;
        };
        self.last_ns = now_ns;
        let cap = u128::from(cap_tokens) * unit(rate);
        if self.fine >= cap {
            return;
        }
        let added = u128::from(elapsed).saturating_mul(fine_per_ns);
        self.fine = self.fine.saturating_add(added).min(cap);
    }

    /// Move the timestamp to `now_ns` without adding anything (time during
    /// which nothing refills). Never moves it back.
    pub fn touch(&mut self, now_ns: u64) {
        self.last_ns = self.last_ns.max(now_ns);
    }

    /// Lower the level to at most `cap_tokens` (after a burst change or when
    /// outstanding tokens grew).
    pub fn clamp(&mut self, rate: Rate, cap_tokens: u64) {
        let cap = u128::from(cap_tokens) * unit(rate);
        self.fine = self.fine.min(cap);
    }

    /// Whole tokens available.
    pub fn tokens(&self, rate: Rate) -> u64 {
        u64::try_from(self.fine / unit(rate)).unwrap_or(u64::MAX)
    }

    /// Timestamp of the last refill.
    pub fn last_ns(&self) -> u64 {
        self.last_ns
    }

    /// Take `n` whole tokens if present.
    pub fn take(&mut self, rate: Rate, n: u64) -> bool {
        let need = u128::from(n) * unit(rate);
        if self.fine >= need {
            self.fine -= need;
            true
        } else {
            false
        }
    }

    /// Add `n` whole tokens, never above `cap_tokens`.
    pub fn give(&mut self, rate: Rate, n: u64, cap_tokens: u64) {
        let p = unit(rate);
        self.fine = (self.fine + u128::from(n) * p).min(u128::from(cap_tokens) * p);
    }

    /// Milliseconds (rounded up, >= 1) until the level holds `n` tokens at
    /// `rate`; 0 if it already does.
    pub fn wait_ms(&self, rate: Rate, n: u64) -> u64 {
        self.wait_ms_fine(rate, rate_fine(rate), n)
    }

    /// [`Level::wait_ms`] at `fine_per_ns` (see [`Level::refill_fine`]);
    /// `u64::MAX` when nothing refills.
    pub fn wait_ms_fine(&self, rate: Rate, fine_per_ns: u128, n: u64) -> u64 {
        let need = u128::from(n) * unit(rate);
        if self.fine >= need {
            return 0;
        }
        if fine_per_ns == 0 {
            return u64::MAX;
        }
        let missing = need - self.fine;
        let ns = missing.div_ceil(fine_per_ns);
        let ms = ns.div_ceil(1_000_000).max(1);
        u64::try_from(ms).unwrap_or(u64::MAX)
    }

    /// Re-express the level under a new rate period, rounding down (never
    /// creates tokens).
    pub fn rescale(&mut self, old: Rate, new: Rate) {
        if old.period_ns() != new.period_ns() {
            self.fine = self.fine * u128::from(new.period_ns()) / u128::from(old.period_ns());
        }
    }
}

/// A token bucket: rate `R`, burst `B`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenBucket {
    rate: Rate,
    burst: u64,
    level: Level,
}

impl TokenBucket {
    /// A full bucket at `now_ns`.
    pub fn new_full(rate: Rate, burst: u64, now_ns: u64) -> Self {
        Self {
            rate,
            burst,
            level: Level::new(burst, rate, now_ns),
        }
    }

    /// An empty bucket at `now_ns`.
    pub fn new_empty(rate: Rate, burst: u64, now_ns: u64) -> Self {
        Self {
            rate,
            burst,
            level: Level::new(0, rate, now_ns),
        }
    }

    /// The rate.
    pub fn rate(&self) -> Rate {
        self.rate
    }

    /// The burst.
    pub fn burst(&self) -> u64 {
        self.burst
    }

    /// Whole tokens in the bucket at `now_ns`.
    pub fn tokens(&mut self, now_ns: u64) -> u64 {
        self.level.refill(self.rate, self.burst, now_ns);
        self.level.tokens(self.rate)
    }

    /// Take `cost` tokens at `now_ns`; a denial changes nothing.
    /// Returns the whole tokens left.
    pub fn try_acquire(&mut self, cost: u64, now_ns: u64) -> Result<u64, Denied> {
        if cost == 0 || cost > self.burst {
            return Err(Denied::Invalid);
        }
        self.level.refill(self.rate, self.burst, now_ns);
        if self.level.take(self.rate, cost) {
            Ok(self.level.tokens(self.rate))
        } else {
            Err(Denied::Wait {
                retry_after_ms: self.level.wait_ms(self.rate, cost),
            })
        }
    }

    /// Give back `n` tokens (never above the burst).
    pub fn refund(&mut self, n: u64, now_ns: u64) {
        self.level.refill(self.rate, self.burst, now_ns);
        self.level.give(self.rate, n, self.burst);
    }

    /// Change rate and burst at `now_ns` without resetting to full: refill
    /// under the old rate up to now, then clamp to the new burst.
    pub fn set_limits(&mut self, rate: Rate, burst: u64, now_ns: u64) {
        self.level.refill(self.rate, self.burst, now_ns);
        self.level.rescale(self.rate, rate);
        self.rate = rate;
        self.burst = burst;
        self.level.clamp(rate, burst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const SEC: u64 = 1_000_000_000;

    fn rate(tokens: u64, period_s: u64) -> Rate {
        Rate { tokens, period_s }
    }

    #[test]
    fn five_per_minute_loses_no_fractions() {
        let r = rate(5, 60);
        let mut b = TokenBucket::new_empty(r, 5, 0);
        // 12 s per token; step in awkward 7 s increments for 60 s.
        let mut t = 0;
        while t + 7 * SEC <= 56 * SEC {
            t += 7 * SEC;
            b.tokens(t);
        }
        assert_eq!(b.tokens(60 * SEC), 5);
        let mut b2 = TokenBucket::new_empty(r, 5, 0);
        assert_eq!(b2.tokens(12 * SEC - 1), 0);
        assert_eq!(b2.tokens(12 * SEC), 1);
    }

    #[test]
    fn clamps_to_burst() {
        let mut b = TokenBucket::new_full(rate(10, 1), 7, 0);
        assert_eq!(b.tokens(1000 * SEC), 7);
    }

    #[test]
    fn cost_is_validated() {
        let mut b = TokenBucket::new_full(rate(10, 1), 7, 0);
        assert_eq!(b.try_acquire(0, 0), Err(Denied::Invalid));
        assert_eq!(b.try_acquire(8, 0), Err(Denied::Invalid));
        assert_eq!(b.try_acquire(7, 0), Ok(0));
    }

    #[test]
    fn retry_after_is_ceil_of_missing_over_rate() {
        // 1/d: one token takes a day.
        let mut b = TokenBucket::new_full(rate(1, 86_400), 10, 0);
        for _ in 0..10 {
            b.try_acquire(1, 0).unwrap();
        }
        assert_eq!(
            b.try_acquire(1, 0),
            Err(Denied::Wait {
                retry_after_ms: 86_400_000
            })
        );
        // 3/s, need 2 tokens from empty: 666.67 ms -> 667.
        let mut b = TokenBucket::new_empty(rate(3, 1), 5, 0);
        assert_eq!(
            b.try_acquire(2, 0),
            Err(Denied::Wait {
                retry_after_ms: 667
            })
        );
    }

    #[test]
    fn negative_elapsed_creates_nothing() {
        let mut b = TokenBucket::new_empty(rate(1, 1), 10, 10 * SEC);
        assert_eq!(b.tokens(5 * SEC), 0);
        assert_eq!(b.tokens(10 * SEC), 0);
        assert_eq!(b.tokens(11 * SEC), 1);
    }

    #[test]
    fn limit_change_does_not_reset_to_full() {
        let mut b = TokenBucket::new_full(rate(60, 60), 20, 0);
        for _ in 0..20 {
            b.try_acquire(1, 0).unwrap();
        }
        // 10 s at 1/s -> 10 tokens, then switch to 2/s burst 15.
        b.set_limits(rate(2, 1), 15, 10 * SEC);
        assert_eq!(b.tokens(10 * SEC), 10);
        assert_eq!(b.tokens(12 * SEC), 14);
        assert_eq!(b.tokens(100 * SEC), 15);
        // Lowering burst clamps.
        b.set_limits(rate(2, 1), 3, 100 * SEC);
        assert_eq!(b.tokens(100 * SEC), 3);
    }

    #[test]
    fn extremes_do_not_overflow() {
        let r = rate(crate::rules::MAX_RATE_TOKENS, 1);
        let mut b = TokenBucket::new_empty(r, crate::rules::MAX_BURST, 0);
        assert_eq!(b.tokens(u64::MAX), crate::rules::MAX_BURST);
        let slow = rate(1, 86_400);
        // u64::MAX ns is 213 503 days: at 1/d that many tokens.
        let mut b = TokenBucket::new_empty(slow, crate::rules::MAX_BURST, 0);
        assert_eq!(b.tokens(u64::MAX), 213_503);
        let mut b = TokenBucket::new_empty(slow, 100_000, 0);
        assert_eq!(b.tokens(u64::MAX), 100_000);
        assert!(b.try_acquire(100_000, u64::MAX).is_ok());
        assert_eq!(
            b.try_acquire(100_000, u64::MAX),
            Err(Denied::Wait {
                retry_after_ms: 100_000 * 86_400_000
            })
        );
    }

    // --- Property tests against a tiny reference model -------------------

    /// Reference: real-valued (rational) bucket stepped every millisecond.
    #[derive(Clone, Debug)]
    enum Op {
        Advance(u64),
        Acquire(u64),
        Refund(u64),
        SetLimits(u64, u64, u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0u64..3_000).prop_map(Op::Advance),
            4 => (1u64..30).prop_map(Op::Acquire),
            1 => (1u64..5).prop_map(Op::Refund),
            1 => (1u64..50, prop_oneof![Just(1u64), Just(60), Just(3600)], 1u64..40)
                .prop_map(|(n, p, b)| Op::SetLimits(n, p, b)),
        ]
    }

    /// Model in exact rationals: `scaled / period_ms` tokens where
    /// `period_ms` counts nanoseconds (one token = the period in ns), stepped
    /// every 1 ms (adds n * 1e6).
    struct Model {
        n: u64,
        period_ms: u64,
        burst: u64,
        scaled: u128,
    }

    impl Model {
        fn tick(&mut self) {
            let cap = u128::from(self.burst) * u128::from(self.period_ms);
            self.scaled = (self.scaled + u128::from(self.n) * 1_000_000).min(cap);
        }
        fn tokens(&self) -> u64 {
            (self.scaled / u128::from(self.period_ms)) as u64
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Lazy refill equals stepping every tick; 0 <= tokens <= B; the
        /// tokens admitted in any window never exceed B + R*T.
        #[test]
        fn lazy_equals_ticked_and_bounds_hold(
            n in 1u64..50,
            period in prop_oneof![Just(1u64), Just(60), Just(3600)],
            burst in 1u64..40,
            ops in proptest::collection::vec(op(), 1..120),
        ) {
            let ms = 1_000_000u64;
            let mut r = rate(n, period);
            let mut b = TokenBucket::new_full(r, burst, 0);
            let unit = 1_000_000_000u64; // ns per second
            let mut m = Model { n, period_ms: period * unit, burst, scaled: u128::from(burst) * u128::from(period * unit) };
            let mut now_ms = 0u64;
            // (time_ms, tokens) of each admission, plus limit history.
            let mut admitted: Vec<(u64, u64)> = Vec::new();
            let mut changes: Vec<(u64, Rate, u64)> = vec![(0, r, burst)];
            for o in ops {
                match o {
                    Op::Advance(d) => {
                        for _ in 0..d { m.tick(); }
                        now_ms += d;
                    }
                    Op::Acquire(c) => {
                        let res = b.try_acquire(c, now_ms * ms);
                        if c > m.burst {
                            prop_assert_eq!(res, Err(Denied::Invalid));
                        } else if m.tokens() >= c {
                            prop_assert!(res.is_ok());
                            m.scaled -= u128::from(c) * u128::from(m.period_ms);
                            admitted.push((now_ms, c));
                        } else {
                            let waits = matches!(res, Err(Denied::Wait { retry_after_ms }) if retry_after_ms >= 1);
                            prop_assert!(waits, "expected a wait >= 1 ms, got {:?}", res);
                        }
                    }
                    Op::Refund(k) => {
                        b.refund(k, now_ms * ms);
                        let cap = u128::from(m.burst) * u128::from(m.period_ms);
                        m.scaled = (m.scaled + u128::from(k) * u128::from(m.period_ms)).min(cap);
                        // A refund un-admits tokens for the window check.
                        let mut left = k;
                        while left > 0 {
                            let Some(last) = admitted.last_mut() else { break };
                            let t = last.1.min(left);
                            last.1 -= t;
                            left -= t;
                            if last.1 == 0 { admitted.pop(); }
                        }
                    }
                    Op::SetLimits(n2, p2, b2) => {
                        let r2 = rate(n2, p2);
                        b.set_limits(r2, b2, now_ms * ms);
                        // Model: rescale scaled units to the new period, round down, clamp.
                        m.scaled = m.scaled * u128::from(p2 * unit) / u128::from(m.period_ms);
                        m.n = n2; m.period_ms = p2 * unit; m.burst = b2;
                        m.scaled = m.scaled.min(u128::from(b2) * u128::from(m.period_ms));
                        r = r2;
                        changes.push((now_ms, r2, b2));
                    }
                }
                let t = b.tokens(now_ms * ms);
                prop_assert_eq!(t, m.tokens(), "lazy != ticked at {} ms", now_ms);
                prop_assert!(t <= b.burst());
            }
            let _ = r;
            // Window bound: for every pair of admission instants [t0, t1],
            // admitted <= max B over the window + sum of R * T per segment.
            for i in 0..admitted.len() {
                let mut sum = 0u64;
                for j in i..admitted.len() {
                    sum += admitted[j].1;
                    let (t0, t1) = (admitted[i].0, admitted[j].0);
                    let mut bound_num = 0f64;
                    let mut max_b = 0u64;
                    for (k, &(tc, rc, bc)) in changes.iter().enumerate() {
                        let end = changes.get(k + 1).map(|c| c.0).unwrap_or(u64::MAX);
                        let (s, e) = (tc.max(t0), end.min(t1));
                        if tc <= t1 && end >= t0 { max_b = max_b.max(bc); }
                        if e > s {
                            bound_num += (e - s) as f64 / 1000.0 * rc.tokens as f64 / rc.period_s as f64;
                        }
                    }
                    prop_assert!(sum as f64 <= max_b as f64 + bound_num + 1e-9,
                        "admitted {} in [{}, {}] ms > bound {} + {}", sum, t0, t1, max_b, bound_num);
                }
            }
        }
    }

    /// The same property as a `proptest-state-machine` test: a reference
    /// bucket stepped every millisecond in exact rationals, the real bucket
    /// stepped lazily, compared after every transition.
    mod state_machine {
        use super::*;
        use proptest_state_machine::{prop_state_machine, ReferenceStateMachine, StateMachineTest};

        const NS_PER_S: u128 = 1_000_000_000;

        #[derive(Clone, Debug)]
        pub struct RefBucket {
            n: u64,
            period_s: u64,
            burst: u64,
            full: bool,
            /// tokens * period in ns
            scaled: u128,
            now_ms: u64,
            admitted: Vec<(u64, u64)>,
            last_ok: Option<bool>,
        }

        impl RefBucket {
            fn unit(&self) -> u128 {
                u128::from(self.period_s) * NS_PER_S
            }
            fn tokens(&self) -> u64 {
                (self.scaled / self.unit()) as u64
            }
        }

        #[derive(Clone, Debug)]
        pub enum Step {
            Advance(u64),
            Acquire(u64),
        }

        impl ReferenceStateMachine for RefBucket {
            type State = RefBucket;
            type Transition = Step;

            fn init_state() -> BoxedStrategy<RefBucket> {
                (
                    1u64..50,
                    prop_oneof![Just(1u64), Just(60), Just(86_400)],
                    1u64..40,
                    any::<bool>(),
                )
                    .prop_map(|(n, period_s, burst, full)| {
                        let mut r = RefBucket {
                            n,
                            period_s,
                            burst,
                            full,
                            scaled: 0,
                            now_ms: 0,
                            admitted: vec![],
                            last_ok: None,
                        };
                        if full {
                            r.scaled = u128::from(burst) * r.unit();
                        }
                        r
                    })
                    .boxed()
            }

            fn transitions(_: &RefBucket) -> BoxedStrategy<Step> {
                prop_oneof![
                    (0u64..3_000).prop_map(Step::Advance),
                    (1u64..45).prop_map(Step::Acquire)
                ]
                .boxed()
            }

            fn apply(mut s: RefBucket, t: &Step) -> RefBucket {
                match *t {
                    Step::Advance(d) => {
                        let cap = u128::from(s.burst) * s.unit();
                        for _ in 0..d {
                            s.scaled = (s.scaled + u128::from(s.n) * 1_000_000).min(cap);
                        }
                        s.now_ms += d;
                        s.last_ok = None;
                    }
                    Step::Acquire(c) => {
                        let ok = c <= s.burst && s.tokens() >= c;
                        if ok {
                            s.scaled -= u128::from(c) * s.unit();
                            s.admitted.push((s.now_ms, c));
                        }
                        s.last_ok = Some(ok);
                    }
                }
                s
            }
        }

        struct BucketTest;

        impl StateMachineTest for BucketTest {
            type SystemUnderTest = TokenBucket;
            type Reference = RefBucket;

            fn init_test(r: &RefBucket) -> TokenBucket {
                let rate = Rate {
                    tokens: r.n,
                    period_s: r.period_s,
                };
                if r.full {
                    TokenBucket::new_full(rate, r.burst, 0)
                } else {
                    TokenBucket::new_empty(rate, r.burst, 0)
                }
            }

            fn apply(mut b: TokenBucket, r: &RefBucket, t: Step) -> TokenBucket {
                if let Step::Acquire(c) = t {
                    let res = b.try_acquire(c, r.now_ms * 1_000_000);
                    assert_eq!(res.is_ok(), r.last_ok == Some(true), "acquire {c}: {res:?}");
                    if c > r.burst {
                        assert_eq!(res, Err(Denied::Invalid));
                    }
                }
                b
            }

            fn check_invariants(b: &TokenBucket, r: &RefBucket) {
                let mut b = b.clone();
                let t = b.tokens(r.now_ms * 1_000_000);
                assert_eq!(t, r.tokens(), "lazy != ticked at {} ms", r.now_ms);
                assert!(t <= r.burst);
                // Admitted in any window [t_i, t_j] <= B + R*T.
                for i in 0..r.admitted.len() {
                    let mut sum = 0u128;
                    for j in i..r.admitted.len() {
                        sum += u128::from(r.admitted[j].1);
                        let dt_ns = u128::from(r.admitted[j].0 - r.admitted[i].0) * 1_000_000;
                        assert!(
                            sum * r.unit()
                                <= u128::from(r.burst) * r.unit() + u128::from(r.n) * dt_ns,
                            "I1 broken between {} and {} ms",
                            r.admitted[i].0,
                            r.admitted[j].0
                        );
                    }
                }
            }
        }

        prop_state_machine! {
            #![proptest_config(ProptestConfig::with_cases(200))]
            #[test]
            fn bucket_state_machine(sequential 1..60 => BucketTest);
        }
    }
}

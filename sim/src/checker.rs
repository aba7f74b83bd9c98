//! Independent I1 checker: from a log of admissions of one key, the largest
//! excess over `B + R*T` of any window `[t_i, t_j]`, computed exactly in
//! integers. It trusts nothing from the allocator's books.
//!
//! The worst window starts and ends at admission instants, so checking
//! windows between admissions is checking every window. With `A_j` the
//! cumulative admitted tokens up to and including admission `j` (sorted by
//! time), the excess of `[t_i, t_j]` in fine units is
//! `(A_j - A_{i-1}) * P - N * (t_j - t_i) - B * P`, maximised over `i <= j`
//! with a running minimum: O(n).

use quotalease_model::rules::Rate;

/// The worst window found.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Worst {
    /// Tokens admitted in the worst window.
    pub admitted: u64,
    /// Window start and end (ns, inclusive).
    pub from_ns: u64,
    /// Window end.
    pub to_ns: u64,
    /// Largest `admitted - (B + R*T)` over all windows, in tokens rounded
    /// up; <= 0 means I1 held.
    pub excess: i64,
}

impl Worst {
    /// Whether I1 held.
    pub fn held(&self) -> bool {
        self.excess <= 0
    }
}

/// Check I1 for one key. `admissions` are `(time_ns, tokens)` in any order.
pub fn worst_window(admissions: &mut [(u64, u64)], rate: Rate, burst: u64) -> Worst {
    admissions.sort_unstable();
    let mut c = StreamChecker::new(rate, burst);
    for &(t, n) in admissions.iter() {
        c.push(t, n);
    }
    c.worst()
}

/// Fine units per token: a day in ns, which every rule period (1 s, 1 min,
/// 1 h, 1 d) divides, so any rate is a whole number of fine units per ns.
const FINE: i128 = 86_400 * 1_000_000_000;

/// A stretch of time with one refill rate and one burst in the bound.
#[derive(Clone, Debug)]
struct Segment {
    from_ns: u64,
    /// Fine units of refill per ns.
    n: i128,
    /// Burst, fine units.
    b: i128,
    /// Cumulative refill (fine) at `from_ns`.
    c0: i128,
    /// min over the window starts i in this segment of
    /// `A_{i-1} * FINE - C(t_i)`, and where it was `(t_i, A_{i-1})`.
    min_start: i128,
    min_at: (u64, u64),
}

/// The same exact check fed one admission at a time in time order, in
/// O(1) memory per rule change: the simulator keeps one per key.
///
/// Across rule changes ([`StreamChecker::change`]) the bound of a window
/// is SPEC §4's `max(B) + integral of R`: the rate is piecewise constant
/// (`C(t)` is the cumulative refill) and the burst is the largest of the
/// stretches the window touches, so the excess of `[t_i, t_j]` is
/// `A_j - A_{i-1} - (C(t_j) - C(t_i)) - max B`, maximised with one running
/// minimum per stretch.
#[derive(Clone, Debug)]
pub struct StreamChecker {
    segs: Vec<Segment>,
    /// The segment of the last admission.
    cur: usize,
    burst: u64,
    cum: i128,
    best_fine: i128,
    best: Worst,
    last_t: u64,
    any: bool,
}

fn fine_per_ns(rate: Rate) -> i128 {
    i128::from(rate.tokens) * (FINE / i128::from(rate.period_ns().max(1)))
}

impl StreamChecker {
    /// A checker for a key with `rate` and `burst`.
    pub fn new(rate: Rate, burst: u64) -> Self {
        Self {
            segs: vec![Segment {
                from_ns: 0,
                n: fine_per_ns(rate),
                b: i128::from(burst) * FINE,
                c0: 0,
                min_start: i128::MAX,
                min_at: (0, 0),
            }],
            cur: 0,
            burst,
            cum: 0,
            best_fine: i128::MIN,
            best: Worst::default(),
            last_t: 0,
            any: false,
        }
    }

    /// The key's rule changes to `rate` and `burst` at `at_ns` (not before
    /// the last admission pushed), and the old rule may stay in force
    /// somewhere until `at_ns + lag_ns`: during that lag the bound counts
    /// the larger of every rate and burst in force, afterwards the new
    /// ones (SPEC §2 "Rule changes", §4).
    pub fn change(&mut self, at_ns: u64, lag_ns: u64, rate: Rate, burst: u64) {
        let (n, b) = (fine_per_ns(rate), i128::from(burst) * FINE);
        let until = at_ns.saturating_add(lag_ns);
        self.split(at_ns);
        self.split(until);
        for s in &mut self.segs {
            if s.from_ns >= until {
                (s.n, s.b) = (n, b);
            } else if s.from_ns >= at_ns {
                (s.n, s.b) = (s.n.max(n), s.b.max(b));
            }
        }
        for i in 1..self.segs.len() {
            let p = &self.segs[i - 1];
            let c0 = p.c0 + p.n * i128::from(self.segs[i].from_ns - p.from_ns);
            self.segs[i].c0 = c0;
        }
    }

    /// Start a segment at `t` (a copy of the one that covers it).
    fn split(&mut self, t: u64) {
        let i = self.segs.partition_point(|s| s.from_ns <= t) - 1;
        if self.segs[i].from_ns == t {
            return;
        }
        let mut s = self.segs[i].clone();
        s.from_ns = t;
        s.min_start = i128::MAX;
        self.segs.insert(i + 1, s);
    }

    /// One admission of `c` tokens at `t`; `t` must not decrease.
    pub fn push(&mut self, t: u64, c: u64) {
        debug_assert!(!self.any || t >= self.last_t, "admissions out of order");
        self.any = true;
        self.last_t = t;
        while self.cur + 1 < self.segs.len() && self.segs[self.cur + 1].from_ns <= t {
            self.cur += 1;
        }
        let seg = &mut self.segs[self.cur];
        let c_t = seg.c0 + seg.n * i128::from(t - seg.from_ns);
        let start = self.cum * FINE - c_t;
        if start < seg.min_start {
            seg.min_start = start;
            seg.min_at = (t, self.cum as u64);
        }
        self.cum += i128::from(c);
        let end = self.cum * FINE - c_t;
        let mut b_max = 0;
        for s in self.segs[..=self.cur].iter().rev() {
            b_max = b_max.max(s.b);
            if s.min_start == i128::MAX {
                continue;
            }
            let fine = end - s.min_start - b_max;
            if fine > self.best_fine {
                self.best_fine = fine;
                self.best = Worst {
                    admitted: self.cum as u64 - s.min_at.1,
                    from_ns: s.min_at.0,
                    to_ns: t,
                    excess: 0,
                };
            }
        }
    }

    /// Tokens admitted so far.
    pub fn admitted(&self) -> u64 {
        self.cum as u64
    }

    /// The worst window so far.
    pub fn worst(&self) -> Worst {
        if !self.any {
            return Worst {
                excess: -(self.burst as i64),
                ..Worst::default()
            };
        }
        // Round up to whole tokens (positive = broken).
        let f = self.best_fine;
        let excess = if f > 0 {
            (f + FINE - 1) / FINE
        } else {
            f / FINE
        };
        Worst {
            excess: excess.clamp(i64::MIN as i128, i64::MAX as i128) as i64,
            ..self.best
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: u64 = 1_000_000_000;

    fn brute(adm: &[(u64, u64)], rate: Rate, burst: u64) -> bool {
        let mut a = adm.to_vec();
        a.sort_unstable();
        for i in 0..a.len() {
            let mut sum = 0u128;
            for j in i..a.len() {
                sum += u128::from(a[j].1);
                let lhs = sum * u128::from(rate.period_ns());
                let rhs = u128::from(burst) * u128::from(rate.period_ns())
                    + u128::from(rate.tokens) * u128::from(a[j].0 - a[i].0);
                if lhs > rhs {
                    return false;
                }
            }
        }
        true
    }

    #[test]
    fn detects_a_burst_over_b() {
        let r = Rate {
            tokens: 1,
            period_s: 1,
        };
        let mut a: Vec<(u64, u64)> = (0..10).map(|i| (i, 1)).collect();
        assert!(worst_window(&mut a, r, 10).held());
        a.push((20, 1));
        let w = worst_window(&mut a, r, 10);
        assert!(!w.held());
        assert_eq!(w.excess, 1);
        assert_eq!(w.admitted, 11);
    }

    #[test]
    fn steady_rate_holds() {
        let r = Rate {
            tokens: 500,
            period_s: 1,
        };
        let mut a: Vec<(u64, u64)> = (0..5000).map(|i| (i * SEC / 500, 1)).collect();
        a.extend((0..100).map(|i| (i, 1)));
        assert!(worst_window(&mut a, r, 101).held());
    }

    /// The bound of `[a, b]` across one change at `at` (lag `lag`) from
    /// (n0/s, b0) to (n1/s, b1): max B of the stretches touched plus the
    /// integral of the rate (the larger one during the lag).
    fn brute_changed(
        adm: &[(u64, u64)],
        (n0, b0): (u64, u64),
        (n1, b1): (u64, u64),
        at: u64,
        lag: u64,
    ) -> i128 {
        let segs = [
            (0u64, n0, b0),
            (at, n0.max(n1), b0.max(b1)),
            (at + lag, n1, b1),
        ];
        let rate_at = |t: u64| segs.iter().rev().find(|s| s.0 <= t).expect("0 first");
        // Refill in token-ns (rate per s): integrate piecewise.
        let refill = |a: u64, b: u64| -> i128 {
            let mut sum = 0i128;
            for (i, s) in segs.iter().enumerate() {
                let end = segs.get(i + 1).map_or(u64::MAX, |n| n.0);
                let (lo, hi) = (a.max(s.0), b.min(end));
                if hi > lo {
                    sum += i128::from(s.1) * i128::from(hi - lo);
                }
            }
            sum
        };
        let mut a = adm.to_vec();
        a.sort_unstable();
        let mut worst = i128::MIN;
        for i in 0..a.len() {
            let mut sum = 0i128;
            for j in i..a.len() {
                sum += i128::from(a[j].1);
                let b_max = segs
                    .iter()
                    .enumerate()
                    .filter(|(k, s)| {
                        let end = segs.get(k + 1).map_or(u64::MAX, |n| n.0);
                        s.0 <= a[j].0 && a[i].0 < end
                    })
                    .map(|(_, s)| s.2)
                    .max()
                    .unwrap_or(rate_at(a[i].0).2);
                let fine = sum * i128::from(SEC)
                    - refill(a[i].0, a[j].0)
                    - i128::from(b_max) * i128::from(SEC);
                worst = worst.max(fine);
            }
        }
        worst
    }

    #[test]
    fn a_rule_change_bounds_by_the_larger_rule_during_the_lag() {
        let r = |n| Rate {
            tokens: n,
            period_s: 1,
        };
        // 10/s burst 10 lowered to 1/s burst 2 at 5 s, lag 1 s: 10 tokens
        // at 5.5 s still fit (max B), 3 at 7 s after 2 at 6.9 s do not.
        let mut c = StreamChecker::new(r(10), 10);
        c.push(0, 5);
        c.change(5 * SEC, SEC, r(1), 2);
        c.push(5 * SEC + SEC / 2, 10);
        assert!(c.worst().held(), "{:?}", c.worst());
        c.push(7 * SEC, 1);
        c.push(7 * SEC + 1, 1);
        assert!(c.worst().held(), "{:?}", c.worst());
        c.push(7 * SEC + 2, 1);
        assert_eq!(c.worst().excess, 1, "{:?}", c.worst());
    }

    proptest::proptest! {
        #[test]
        fn a_change_matches_brute_force(
            before in proptest::collection::vec((0u64..3_000_000_000, 1u64..4), 0..25),
            after in proptest::collection::vec((3_000_000_000u64..6_000_000_000, 1u64..4), 0..25),
            n0 in 1u64..20, b0 in 1u64..20, n1 in 1u64..20, b1 in 1u64..20,
            lag in 0u64..2_000_000_000,
        ) {
            let r = |n| Rate { tokens: n, period_s: 1 };
            let at = 3_000_000_000;
            let mut all: Vec<(u64, u64)> = before.clone();
            all.sort_unstable();
            let mut c = StreamChecker::new(r(n0), b0);
            for &(t, n) in &all {
                c.push(t, n);
            }
            c.change(at, lag, r(n1), b1);
            let mut later = after.clone();
            later.sort_unstable();
            for &(t, n) in &later {
                c.push(t, n);
            }
            all.extend(later);
            let brute = brute_changed(&all, (n0, b0), (n1, b1), at, lag);
            let want = if all.is_empty() { -(b0 as i64) } else if brute > 0 {
                ((brute + i128::from(SEC) - 1) / i128::from(SEC)) as i64
            } else {
                (brute / i128::from(SEC)) as i64
            };
            proptest::prop_assert_eq!(c.worst().excess, want);
        }
    }

    proptest::proptest! {
        #[test]
        fn matches_brute_force(
            adm in proptest::collection::vec((0u64..5_000_000_000, 1u64..4), 0..60),
            n in 1u64..20, burst in 1u64..20,
        ) {
            let r = Rate { tokens: n, period_s: 1 };
            let mut a = adm.clone();
            proptest::prop_assert_eq!(worst_window(&mut a, r, burst).held(), brute(&adm, r, burst));
        }
    }
}

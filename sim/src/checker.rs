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

/// The same exact check fed one admission at a time in time order, in
/// O(1) memory: the simulator keeps one per key.
#[derive(Clone, Debug)]
pub struct StreamChecker {
    p: i128,
    n: i128,
    b: i128,
    burst: u64,
    /// min over i of (A_{i-1} * P - N * t_i)
    min_start: i128,
    min_at: (u64, u64), // (t_i, A_{i-1})
    cum: i128,
    best_fine: i128,
    best: Worst,
    last_t: u64,
    any: bool,
}

impl StreamChecker {
    /// A checker for a key with `rate` and `burst`.
    pub fn new(rate: Rate, burst: u64) -> Self {
        let p = i128::from(rate.period_ns());
        Self {
            p,
            n: i128::from(rate.tokens),
            b: i128::from(burst) * p,
            burst,
            min_start: i128::MAX,
            min_at: (0, 0),
            cum: 0,
            best_fine: i128::MIN,
            best: Worst::default(),
            last_t: 0,
            any: false,
        }
    }

    /// One admission of `c` tokens at `t`; `t` must not decrease.
    pub fn push(&mut self, t: u64, c: u64) {
        debug_assert!(!self.any || t >= self.last_t, "admissions out of order");
        self.any = true;
        self.last_t = t;
        let start = self.cum * self.p - self.n * i128::from(t);
        if start < self.min_start {
            self.min_start = start;
            self.min_at = (t, self.cum as u64);
        }
        self.cum += i128::from(c);
        let end = self.cum * self.p - self.n * i128::from(t);
        let fine = end - self.min_start - self.b;
        if fine > self.best_fine {
            self.best_fine = fine;
            self.best = Worst {
                admitted: self.cum as u64 - self.min_at.1,
                from_ns: self.min_at.0,
                to_ns: t,
                excess: 0,
            };
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
        let (f, p) = (self.best_fine, self.p);
        let excess = if f > 0 { (f + p - 1) / p } else { f / p };
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

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

use quotalease_allocator::rules::Rate;

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
    let p = i128::from(rate.period_ns());
    let n = i128::from(rate.tokens);
    let b = i128::from(burst) * p;
    let mut best = Worst {
        excess: i64::MIN,
        ..Worst::default()
    };
    let mut best_fine = i128::MIN;
    // min over i of (A_{i-1} * P - N * t_i), with its index
    let mut min_start = i128::MAX;
    let mut min_at = (0u64, 0u64); // (t_i, A_{i-1})
    let mut cum: i128 = 0;
    for &(t, c) in admissions.iter() {
        let start = cum * p - n * i128::from(t);
        if start < min_start {
            min_start = start;
            min_at = (t, cum as u64);
        }
        cum += i128::from(c);
        let end = cum * p - n * i128::from(t);
        let fine = end - min_start - b;
        if fine > best_fine {
            best_fine = fine;
            best = Worst {
                admitted: cum as u64 - min_at.1,
                from_ns: min_at.0,
                to_ns: t,
                excess: 0,
            };
        }
    }
    if admissions.is_empty() {
        return Worst {
            excess: -(burst as i64),
            ..Worst::default()
        };
    }
    // Round up to whole tokens (positive = broken).
    let excess = if best_fine > 0 {
        (best_fine + p - 1) / p
    } else {
        best_fine / p
    };
    best.excess = excess.clamp(i64::MIN as i128, i64::MAX as i128) as i64;
    best
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

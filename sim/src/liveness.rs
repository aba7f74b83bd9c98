//! Liveness after the faults heal (swarm mode, or `liveness: true` in a
//! scenario): once the last fault that ends has healed
//! ([`crate::scenario::Scenario::heal_ns`]), every tracked key must be back
//! to serving its demand within `3 x TTL_max`.
//!
//! The judged window runs from `heal + 3 x TTL_max` (rounded up to a whole
//! simulated second) to the end of the run, and must last at least
//! `10 x TTL_max` (SPEC §2's utilization window). Over it a key's *target*
//! is `min(tokens requested, R * T)`: its demand, capped by its rule's rate
//! (the rate in force after the last rule change). Requests that reached no
//! agent (a crashed agent that never restarts) are not demand: liveness is
//! judged on what remains. Only `OK` admissions count (an open key's
//! emergency admissions are not recovery). The key is live when
//! `admitted >= THRESHOLD x target`.

use quotalease_model::rules::Rate;

/// The fraction of its target a key must reach. SPEC §2 promises 97%
/// utilization per window of `10 x TTL_max` without faults; the judged
/// window is at least that long and starts `3 x TTL_max` after the last
/// fault healed, so a recovered deployment is back to its fault-free
/// figure. The same 97% would leave no room for what a fault legitimately
/// leaves behind for a while (a restarted allocator's phantom lease of `B`
/// until `TTL_max` has passed on its own clock, a rule change's lag): 95%
/// is the fault-free figure less a margin that a deployment which
/// recovers only partly (a region or an agent still starved) cannot meet.
pub const THRESHOLD: f64 = 0.95;

/// The judged window must be at least this many `TTL_max` long.
pub const MIN_WINDOW_TTLS: u64 = 10;

/// Recovery deadline after the last fault heals, in `TTL_max`.
pub const RECOVERY_TTLS: u64 = 3;

/// One key's liveness over the judged window.
#[derive(Clone, Debug, PartialEq)]
pub struct KeyLiveness {
    /// Tokens requested in the window (at agents that were up).
    pub requested: u64,
    /// Tokens admitted `OK` in the window.
    pub admitted: u64,
    /// `min(requested, R * T)`.
    pub target: f64,
    /// `admitted / target` (1 when the target is 0).
    pub ratio: f64,
}

impl KeyLiveness {
    /// Whether the key recovered.
    pub fn held(&self) -> bool {
        self.ratio >= THRESHOLD
    }
}

/// Judge one key: `requested` and `admitted` tokens over a window of
/// `window_ns` under `rate`.
pub fn judge(requested: u64, admitted: u64, rate: Rate, window_ns: u64) -> KeyLiveness {
    let capacity = rate.tokens as f64 * window_ns as f64 / rate.period_ns() as f64;
    let target = (requested as f64).min(capacity);
    let ratio = if target <= 0.0 {
        1.0
    } else {
        admitted as f64 / target
    };
    KeyLiveness {
        requested,
        admitted,
        target,
        ratio,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    #[test]
    fn judges_against_demand_capped_by_rate() {
        let r = Rate {
            tokens: 100,
            period_s: 1,
        };
        // Demand 2x the rate: the target is R*T.
        let k = judge(4000, 1950, r, 20 * S);
        assert_eq!(k.target, 2000.0);
        assert!(k.held());
        // A starved key fails.
        assert!(!judge(4000, 1800, r, 20 * S).held());
        // Demand below the rate: the target is the demand.
        let k = judge(500, 490, r, 20 * S);
        assert_eq!(k.target, 500.0);
        assert!(k.held());
        assert!(!judge(500, 400, r, 20 * S).held());
        // Nothing left to serve: live.
        assert!(judge(0, 0, r, 20 * S).held());
    }
}

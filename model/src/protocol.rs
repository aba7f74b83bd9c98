//! Protocol constants every process agrees on (SPEC §2, §8): the clock
//! drift bound `rho`, the longest id, and the one formula for the margin a
//! lease holder subtracts from a lease's lifetime.
//!
//! A holder that asked for a lease at `first_send` (its own clock) and got
//! `ttl` uses it until `first_send + ttl * (1 - 2 rho) - epsilon`
//! ([`use_by_ns`]); an allocator that restarts waits
//! `ttl_max + 2 rho ttl_max + ...` ([`drift_margin_ns`]) before it trusts
//! that no lease of its predecessor is still in use.

/// Largest relative clock rate error between any two processes, in parts
/// per million (SPEC §2 "Clocks"): 1000 ppm = 0.1 %.
pub const RHO_PPM: u64 = 1_000;

/// Longest accepted rule id, match pattern, domain, tenant, route, request
/// or agent id, in bytes (SPEC §8).
pub const MAX_ID_BYTES: usize = 256;

/// The longest a rate lease held by an agent may take to fill from empty
/// (seconds): an agent holds it in one 64-bit word whose time field spans
/// 2^38 ns (about 275 s, `agent::lease_table`). Agents ask for no rate for
/// rules whose burst is more than this many seconds of their rate
/// ([`max_rate_capacity`]): such bursts are held whole in leases of tokens.
pub const MAX_RATE_FILL_S: u64 = 270;

/// [`MAX_RATE_FILL_S`] of `rate_utps` micro-tokens per second, in whole
/// tokens (rounded down).
pub const fn max_rate_capacity(rate_utps: u64) -> u64 {
    (rate_utps as u128 * MAX_RATE_FILL_S as u128 / 1_000_000) as u64
}

/// `x * (1 - rho)`, rounded up in what it takes away (so never above the
/// exact value), without overflow: a rate that a refill on a clock within
/// `rho` of true time may use (SPEC §2).
#[inline]
pub const fn slowed_by_rho(x: u64) -> u64 {
    x - x / 1_000_000 * RHO_PPM - (x % 1_000_000 * RHO_PPM).div_ceil(1_000_000)
}

/// `2 * rho * ttl_ns`, rounded down, computed exactly without overflow for
/// every `ttl_ns` (no intermediate product exceeds `u64`).
#[inline]
pub const fn drift_margin_ns(ttl_ns: u64) -> u64 {
    ttl_ns / 1_000_000 * (2 * RHO_PPM) + (ttl_ns % 1_000_000) * (2 * RHO_PPM) / 1_000_000
}

/// The instant (holder's clock) until which a lease of `ttl_ns` asked for at
/// `first_send_ns` may be used: `first_send + ttl - 2 rho ttl - epsilon`,
/// saturating at both ends.
#[inline]
pub const fn use_by_ns(first_send_ns: u64, ttl_ns: u64, epsilon_ns: u64) -> u64 {
    first_send_ns
        .saturating_add(ttl_ns)
        .saturating_sub(drift_margin_ns(ttl_ns).saturating_add(epsilon_ns))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drift_margin_is_exact_two_rho() {
        assert_eq!(drift_margin_ns(0), 0);
        assert_eq!(drift_margin_ns(499), 0);
        assert_eq!(drift_margin_ns(500), 1);
        assert_eq!(drift_margin_ns(1_000_000), 2_000);
        assert_eq!(drift_margin_ns(2_000_000_000), 4_000_000);
        // Exact against 128-bit arithmetic, at the extremes too.
        for ttl in [1, 999_999, 1_000_001, u64::MAX / 2, u64::MAX - 1, u64::MAX] {
            let exact = u128::from(ttl) * u128::from(2 * RHO_PPM) / 1_000_000;
            assert_eq!(u128::from(drift_margin_ns(ttl)), exact, "ttl {ttl}");
        }
    }

    #[test]
    fn use_by_saturates() {
        assert_eq!(
            use_by_ns(10, 2_000_000_000, 50),
            10 + 2_000_000_000 - 4_000_000 - 50
        );
        assert_eq!(use_by_ns(0, 0, 0), 0);
        assert_eq!(use_by_ns(0, 1_000, u64::MAX), 0);
        let far = use_by_ns(u64::MAX, u64::MAX, 0);
        assert_eq!(far, u64::MAX - drift_margin_ns(u64::MAX));
        assert_eq!(use_by_ns(5, u64::MAX, u64::MAX), 0);
    }
}

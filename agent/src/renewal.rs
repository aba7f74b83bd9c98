//! Renewal planning, sans-IO: when a key's lease should be renewed, how many
//! tokens to ask for, and when an idle key should give its tokens back.
//!
//! Per key the planner keeps an EWMA of consumption (tokens/s), updated on
//! the background tick from the lease word — never on the request path.
//!
//! * **Low-water mark.** Renew when the lease holds less than
//!   `rate * low_water` tokens (what the key would spend during one
//!   renewal round trip plus margin), or when a request is waiting.
//! * **Size.** Ask for enough to cover `rate * horizon` where
//!   `horizon = 2 * low_water + renew_interval`, minus what is still held;
//!   at least what waiting requests need, at most the burst. A key with no
//!   history (cold) asks for exactly what its waiting requests cost: the
//!   smallest lease, so no tokens strand in an agent that will not use them.
//! * **Refresh.** An active key whose lease nears its deadline renews (to
//!   report spent tokens and carry the rest) before it lapses.
//! * **Idle.** A key that consumed nothing for `idle_release` releases its
//!   lease and is dropped from the table.
//! * **Rates** (SPEC §2, "Leases may carry a rate"; with
//!   [`PlanConfig::rate_leases`]). A key with a consumption history asks
//!   for a rate of `1.25 x` its demand (admitted and denied), at most the
//!   rule's; a cold key's first lease is tokens only. A lease that carries
//!   a rate refills itself, so it is renewed only to refresh it before its
//!   deadline, when requests wait for more than it holds, or when the
//!   rate wanted moved by more than a quarter from the rate last asked for
//!   (a holder held at its fair share below what it asks does not ask
//!   again on every tick).

use crate::lease_table::MIN_RATE_UTPS;
use std::time::Duration;

/// Planner settings (agent flags).
#[derive(Clone, Copy, Debug)]
pub struct PlanConfig {
    /// Background tick.
    pub renew_interval: Duration,
    /// Renew when the lease covers less than this much consumption.
    pub low_water: Duration,
    /// Release and forget keys idle this long.
    pub idle_release: Duration,
    /// EWMA time constant.
    pub ewma_tau: Duration,
    /// Ask for leases that carry a rate (protocol 3).
    pub rate_leases: bool,
    /// Serve keys of slow rules centrally (`Rate::served_centrally`,
    /// docs/protocol.md "Slow rules, served centrally"); off, they are
    /// leased ahead as faster ones are.
    pub central: bool,
}

impl Default for PlanConfig {
    fn default() -> Self {
        Self {
            renew_interval: Duration::from_millis(50),
            low_water: Duration::from_millis(100),
            idle_release: Duration::from_secs(10),
            ewma_tau: Duration::from_secs(1),
            rate_leases: true,
            central: true,
        }
    }
}

/// Consumption history of one key.
#[derive(Clone, Debug, Default)]
pub struct Usage {
    /// Demand in tokens/s (admitted and denied), exponentially weighted:
    /// sizes leases.
    pub rate: f64,
    /// Admitted tokens/s, exponentially weighted: this agent's recent share
    /// of the key's rate (sizes the fail-open emergency bucket).
    pub admitted_rate: f64,
    /// Tokens consumed since the last tick (fed by the driver).
    pub since_tick: u64,
    /// Tokens asked for but denied since the last tick (fed by the driver).
    pub denied_since_tick: u64,
    /// Instant of the last tick.
    pub last_tick_ns: u64,
    /// Last instant anything was consumed or requested.
    pub last_active_ns: u64,
}

impl Usage {
    /// Fold `consumed` tokens (plus what the driver accumulated) observed
    /// over `(last_tick, now]` into the EWMAs.
    pub fn tick(&mut self, consumed: u64, now_ns: u64, tau: Duration) {
        let consumed = consumed + std::mem::take(&mut self.since_tick);
        let denied = std::mem::take(&mut self.denied_since_tick);
        if self.last_tick_ns == 0 {
            self.last_tick_ns = now_ns;
            if consumed > 0 {
                self.last_active_ns = now_ns;
            }
            return;
        }
        let dt = now_ns.saturating_sub(self.last_tick_ns);
        if dt == 0 {
            self.since_tick += consumed;
            self.denied_since_tick += denied;
            return;
        }
        let dt_s = dt as f64 / 1e9;
        let alpha = 1.0 - (-dt_s / tau.as_secs_f64()).exp();
        self.rate += alpha * ((consumed + denied) as f64 / dt_s - self.rate);
        self.admitted_rate += alpha * (consumed as f64 / dt_s - self.admitted_rate);
        self.last_tick_ns = now_ns;
        if consumed > 0 {
            self.last_active_ns = now_ns;
        }
    }
}

/// What to do for a key on this tick.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Plan {
    /// Nothing.
    Wait,
    /// Renew (or open) the lease asking for `want` more tokens and a rate.
    Renew {
        /// New tokens wanted on top of what is held.
        want: u64,
        /// Rate asked for, in micro-tokens per second (0: tokens only).
        want_rate_utps: u64,
    },
    /// Give the lease back and forget the key.
    Release,
    /// Give the lease back and keep the key (its cached denials): a key
    /// served centrally returns what its waiting requests did not take.
    Return,
}

/// Inputs of one planning decision.
#[derive(Clone, Copy, Debug)]
pub struct KeyNow {
    /// Tokens left in the lease (0 when none).
    pub held: u64,
    /// Whether a valid lease is held.
    pub valid: bool,
    /// Agent-clock deadline of the lease.
    pub deadline_ns: u64,
    /// Burst of the key's rule.
    pub burst: u64,
    /// Tokens that waiting requests need (sum of their costs; 0 = none).
    pub waiting_cost: u64,
    /// The allocator said not to come back before this.
    pub dry_until_ns: u64,
    /// A request for this key is in flight.
    pub in_flight: bool,
    /// The rule's rate in micro-tokens per second.
    pub rule_rate_utps: u64,
    /// The held lease's rate (micro-tokens per second; 0: tokens only).
    pub lease_rate_utps: u64,
    /// The rate asked for in the last renewal (micro-tokens per second).
    pub asked_rate_utps: u64,
    /// The lease TTL this agent asks for.
    pub lease_ttl_ns: u64,
    /// The key is served centrally (`Rate::served_centrally`).
    pub central: bool,
    /// How long a request waits for a grant (the agent's fetch timeout):
    /// a key served centrally keeps tokens left in its lease this long
    /// after its last activity (a request charging several rules gives a
    /// token back to this key while it waits for another key's grant).
    pub fetch_timeout_ns: u64,
}

/// Rate to ask for: `1.25 x` the demand, at most the rule's rate; 0 for
/// a key without history (its first lease is tokens only) or when rates
/// are off.
pub fn rate_wanted(cfg: &PlanConfig, usage: &Usage, rule_rate_utps: u64, burst: u64) -> u64 {
    // Rates slower than the lease word can refill are not asked for, nor
    // are rates of rules whose burst takes longer than the word's span to
    // refill (60/m burst 600, MAX_RATE_FILL_S): the word would hold such a
    // capacity smaller and lose the rest; leases of tokens hold it whole.
    if !cfg.rate_leases
        || usage.rate <= 0.0
        || rule_rate_utps < MIN_RATE_UTPS
        || quotalease_model::protocol::max_rate_capacity(rule_rate_utps) < burst
    {
        return 0;
    }
    let want = (usage.rate * 1.25 * 1e6).ceil();
    if want >= rule_rate_utps as f64 {
        rule_rate_utps
    } else {
        (want as u64).max(MIN_RATE_UTPS)
    }
}

/// Whether `want` moved by more than a quarter from `asked`.
fn moved(want: u64, asked: u64) -> bool {
    let (lo, hi) = (want.min(asked), want.max(asked));
    hi - lo > hi / 4
}

/// Decide for one key at `now_ns`.
pub fn plan(cfg: &PlanConfig, usage: &Usage, k: KeyNow, now_ns: u64) -> Plan {
    if k.in_flight {
        return Plan::Wait;
    }
    let idle_ns = cfg.idle_release.as_nanos() as u64;
    let idle = usage.last_active_ns.saturating_add(idle_ns) < now_ns;
    if k.central {
        let quiet = usage.last_active_ns.saturating_add(k.fetch_timeout_ns) <= now_ns;
        return plan_central(k, idle, quiet, now_ns);
    }
    if idle && k.waiting_cost == 0 {
        return Plan::Release;
    }
    let rate_lease = k.lease_rate_utps > 0;
    let lead = (4 * cfg.renew_interval.as_nanos() as u64).max(cfg.low_water.as_nanos() as u64);
    let recently_active = usage
        .last_active_ns
        .saturating_add(2 * cfg.renew_interval.as_nanos() as u64)
        >= now_ns;
    if now_ns < k.dry_until_ns {
        // The allocator has nothing more before then; a rate lease still
        // refreshes before it lapses (its refill would stop with it).
        let refresh =
            rate_lease && recently_active && k.valid && k.deadline_ns.saturating_sub(now_ns) < lead;
        if !refresh {
            return Plan::Wait;
        }
    }
    let want_rate_utps = rate_wanted(cfg, usage, k.rule_rate_utps, k.burst);
    let renew = |want: u64| Plan::Renew {
        want,
        want_rate_utps,
    };
    let low_water = (usage.rate * cfg.low_water.as_secs_f64()).ceil() as u64;
    let horizon = 2.0 * cfg.low_water.as_secs_f64() + cfg.renew_interval.as_secs_f64();
    let target = (usage.rate * horizon).ceil() as u64;
    // A key whose requests are too sparse to spend two tokens in a lease's
    // life fetches nothing ahead: a token fetched ahead would strand here
    // until the lease lapses, and a pool counts it spent then (the demo's
    // cold tenants, a request per agent every few seconds, kept their
    // regions' small pools dry with tokens stranded at agents).
    let sparse = usage.rate > 0.0 && usage.rate * (k.lease_ttl_ns as f64 / 1e9) < 2.0;
    let target = if sparse { 0 } else { target };
    let cold = if sparse { 1 } else { (k.burst / 16).max(1) };
    let want = target
        .saturating_sub(k.held)
        .max(k.waiting_cost)
        .max(if k.held == 0 {
            cold.max(k.waiting_cost)
        } else {
            0
        })
        .clamp(1, k.burst.max(1));
    if k.waiting_cost > 0 {
        return renew(want);
    }
    if !k.valid {
        return if recently_active && !sparse {
            renew(want)
        } else {
            Plan::Wait
        };
    }
    if !rate_lease && usage.rate > 0.0 && !sparse && k.held <= low_water {
        return renew(want);
    }
    // A rate lease refills itself: renew when the rate wanted moved.
    if rate_lease && recently_active && moved(want_rate_utps, k.asked_rate_utps) {
        return renew(0);
    }
    // Refresh an active lease before it lapses: report spent, carry the rest.
    if recently_active && k.deadline_ns.saturating_sub(now_ns) < lead {
        return renew(if rate_lease {
            0
        } else {
            target.saturating_sub(k.held).min(k.burst)
        });
    }
    Plan::Wait
}

/// [`plan`] of a key served centrally (docs/protocol.md "Slow rules,
/// served centrally"): ask for exactly what the waiting requests cost once
/// the allocator's next-token instant has come (denials are cached until
/// then), never ahead and never for a rate; give back what they did not
/// take: a lease spent to 0 at once (its spent report lets the
/// allocator's bucket refill: while it counts the lease outstanding it
/// cannot), tokens left once the key was `quiet` for a fetch timeout (a
/// token kept here is one another gateway's request is denied; a request
/// that charges several rules gives this key's token back while it waits
/// for another key's grant, and comes back for it).
fn plan_central(k: KeyNow, idle: bool, quiet: bool, now_ns: u64) -> Plan {
    if k.waiting_cost > 0 {
        return if now_ns >= k.dry_until_ns {
            Plan::Renew {
                want: k.waiting_cost.clamp(1, k.burst.max(1)),
                want_rate_utps: 0,
            }
        } else {
            Plan::Wait
        };
    }
    // A lease that carries a rate (held from before a rule change made the
    // key slow) goes back at once: its capacity counts at the allocator.
    if k.valid && (k.held == 0 || quiet || k.lease_rate_utps > 0) {
        Plan::Return
    } else if idle && !k.valid {
        Plan::Release
    } else {
        Plan::Wait
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn key(held: u64) -> KeyNow {
        KeyNow {
            held,
            valid: held > 0,
            deadline_ns: 10_000 * MS,
            burst: 100,
            waiting_cost: 0,
            dry_until_ns: 0,
            in_flight: false,
            rule_rate_utps: 1_000 * 1_000_000,
            lease_rate_utps: 0,
            asked_rate_utps: 0,
            lease_ttl_ns: 2_000 * MS,
            central: false,
            fetch_timeout_ns: 250 * MS,
        }
    }

    #[test]
    fn ewma_follows_consumption() {
        let mut u = Usage::default();
        let tau = Duration::from_secs(1);
        u.tick(0, 1_000 * MS, tau);
        for i in 1..=100 {
            u.tick(50, (1_000 + 50 * i) * MS, tau);
        }
        assert!((u.rate - 1000.0).abs() < 10.0, "rate {}", u.rate);
    }

    #[test]
    fn cold_key_with_a_waiter_asks_for_a_small_lease() {
        let cfg = PlanConfig::default();
        let mut k = key(0);
        k.waiting_cost = 1;
        assert_eq!(
            plan(&cfg, &Usage::default(), k, MS),
            Plan::Renew {
                want: 6,
                want_rate_utps: 0
            }
        );
    }

    #[test]
    fn hot_key_renews_at_low_water_and_asks_for_its_horizon() {
        let cfg = PlanConfig::default();
        let u = Usage {
            rate: 500.0,
            admitted_rate: 500.0,
            denied_since_tick: 0,
            last_active_ns: 1_000 * MS,
            last_tick_ns: 1_000 * MS,
            since_tick: 0,
        };
        // 500/s * 100 ms = 50 tokens of low water.
        assert_eq!(plan(&cfg, &u, key(80), 1_000 * MS), Plan::Wait);
        // horizon 250 ms -> 125 wanted, minus 40 held, clamped to the burst.
        assert_eq!(
            plan(&cfg, &u, key(40), 1_000 * MS),
            Plan::Renew {
                want: 85,
                want_rate_utps: 625 * 1_000_000
            }
        );
    }

    #[test]
    fn a_sparse_key_fetches_only_for_waiting_requests() {
        let cfg = PlanConfig::default();
        // 0.5/s with 2 s leases: one token in a lease's life.
        let u = Usage {
            rate: 0.5,
            admitted_rate: 0.5,
            denied_since_tick: 0,
            last_active_ns: 1_000 * MS,
            last_tick_ns: 1_000 * MS,
            since_tick: 0,
        };
        // Empty, or lapsed while recently active: nothing fetched ahead.
        assert_eq!(plan(&cfg, &u, key(0), 1_000 * MS), Plan::Wait);
        let mut lapsed = key(0);
        lapsed.deadline_ns = 0;
        assert_eq!(plan(&cfg, &u, lapsed, 1_000 * MS), Plan::Wait);
        // A waiting request gets exactly its cost.
        let mut k = key(0);
        k.waiting_cost = 1;
        assert!(matches!(
            plan(&cfg, &u, k, 1_000 * MS),
            Plan::Renew { want: 1, .. }
        ));
        // 1/s with 2 s leases (two tokens a lease's life) fetches ahead.
        let busier = Usage { rate: 1.0, ..u };
        assert!(matches!(
            plan(&cfg, &busier, key(0), 1_000 * MS),
            Plan::Renew { .. }
        ));
    }

    #[test]
    fn dry_keys_wait_and_idle_keys_release() {
        let cfg = PlanConfig::default();
        let u = Usage {
            rate: 10.0,
            admitted_rate: 10.0,
            denied_since_tick: 0,
            last_active_ns: 1_000 * MS,
            last_tick_ns: 1_000 * MS,
            since_tick: 0,
        };
        let mut k = key(0);
        k.waiting_cost = 1;
        k.dry_until_ns = 2_000 * MS;
        assert_eq!(plan(&cfg, &u, k, 1_500 * MS), Plan::Wait);
        assert_eq!(plan(&cfg, &u, key(5), 20_000 * MS), Plan::Release);
        let mut busy = key(5);
        busy.in_flight = true;
        assert_eq!(plan(&cfg, &u, busy, 1_000 * MS), Plan::Wait);
    }

    #[test]
    fn a_rate_lease_renews_to_refresh_or_when_its_rate_moves() {
        let cfg = PlanConfig {
            rate_leases: true,
            ..PlanConfig::default()
        };
        let u = Usage {
            rate: 400.0,
            admitted_rate: 400.0,
            denied_since_tick: 0,
            last_active_ns: 1_000 * MS,
            last_tick_ns: 1_000 * MS,
            since_tick: 0,
        };
        // Wanted: 1.25 x 400 = 500/s.
        let mut k = key(3);
        k.lease_rate_utps = 480 * 1_000_000;
        k.asked_rate_utps = 500 * 1_000_000;
        // Few tokens held do not matter: it refills.
        assert_eq!(plan(&cfg, &u, k, 1_000 * MS), Plan::Wait);
        // Granted less than asked (a fair share): still no renewal.
        k.lease_rate_utps = 100 * 1_000_000;
        assert_eq!(plan(&cfg, &u, k, 1_000 * MS), Plan::Wait);
        // Demand moved by more than a quarter: ask again, for no tokens.
        k.asked_rate_utps = 350 * 1_000_000;
        assert_eq!(
            plan(&cfg, &u, k, 1_000 * MS),
            Plan::Renew {
                want: 0,
                want_rate_utps: 500 * 1_000_000
            }
        );
        k.asked_rate_utps = 500 * 1_000_000;
        // The allocator said it has nothing for a day: no renewal...
        k.dry_until_ns = 86_400_000 * MS;
        k.asked_rate_utps = 350 * 1_000_000;
        assert_eq!(plan(&cfg, &u, k, 1_000 * MS), Plan::Wait);
        k.asked_rate_utps = 500 * 1_000_000;
        // ...but near its deadline a rate lease refreshes, dry or not (a
        // lease of tokens waits).
        k.deadline_ns = 1_100 * MS;
        assert!(matches!(plan(&cfg, &u, k, 1_000 * MS), Plan::Renew { .. }));
        let mut tokens_only = k;
        tokens_only.lease_rate_utps = 0;
        assert_eq!(plan(&cfg, &u, tokens_only, 1_000 * MS), Plan::Wait);
        k.dry_until_ns = 0;
        // The rule caps the rate; without rates nothing is asked.
        k.rule_rate_utps = 200 * 1_000_000;
        assert_eq!(
            rate_wanted(&cfg, &u, k.rule_rate_utps, k.burst),
            200 * 1_000_000
        );
        let off = PlanConfig {
            rate_leases: false,
            ..cfg
        };
        assert_eq!(rate_wanted(&off, &u, k.rule_rate_utps, k.burst), 0);
        assert_eq!(
            rate_wanted(&cfg, &Usage::default(), k.rule_rate_utps, k.burst),
            0
        );
        // A burst longer than 270 s of rate (60/m burst 600) is held in
        // leases of tokens; 270 s exactly still gets a rate.
        assert_eq!(rate_wanted(&cfg, &u, 1_000_000, 600), 0);
        assert_eq!(rate_wanted(&cfg, &u, 1_000_000, 270), 1_000_000);
        // So is a rule slower than a token per 250 s.
        assert_eq!(rate_wanted(&cfg, &u, MIN_RATE_UTPS - 1, 1), 0);
    }

    /// A key served centrally asks for exactly what its waiting requests
    /// cost once the allocator's next-token instant has come, never ahead
    /// and never for a rate, gives a lease spent to 0 back at once, keeps
    /// tokens left for a fetch timeout after its last activity (a request
    /// charging several rules comes back for them), and a rate lease from
    /// before a rule change not at all.
    #[test]
    fn a_key_served_centrally_asks_exactly_and_gives_back() {
        let cfg = PlanConfig::default();
        // A busy key: consumption history would size a lease ahead.
        let u = Usage {
            rate: 50.0,
            last_active_ns: 1_000 * MS,
            ..Usage::default()
        };
        let mut k = key(0);
        k.central = true;
        k.burst = 5;
        k.rule_rate_utps = 83_333;
        k.waiting_cost = 3;
        let now = 1_000 * MS;
        assert_eq!(
            plan(&cfg, &u, k, now),
            Plan::Renew {
                want: 3,
                want_rate_utps: 0
            }
        );
        // More waiting than the burst: at most the burst.
        k.waiting_cost = 9;
        assert_eq!(
            plan(&cfg, &u, k, now),
            Plan::Renew {
                want: 5,
                want_rate_utps: 0
            }
        );
        // Denials cached until the allocator's next token: nothing asked.
        k.dry_until_ns = now + 12_000 * MS;
        assert_eq!(plan(&cfg, &u, k, now), Plan::Wait);
        k.dry_until_ns = 0;
        // Nothing waits: a lease spent to 0 goes back at once.
        k.waiting_cost = 0;
        k.valid = true;
        assert_eq!(plan(&cfg, &u, k, now), Plan::Return);
        // Tokens left: kept while the key was active within a fetch
        // timeout, given back after.
        k.held = 2;
        assert_eq!(plan(&cfg, &u, k, now + 100 * MS), Plan::Wait);
        assert_eq!(plan(&cfg, &u, k, now + 250 * MS), Plan::Return);
        // A rate lease: back at once.
        k.lease_rate_utps = 83_333;
        assert_eq!(plan(&cfg, &u, k, now + 100 * MS), Plan::Return);
        // No lease, idle: the key is forgotten; not idle: kept (its
        // cached denial with it).
        k.valid = false;
        k.held = 0;
        k.lease_rate_utps = 0;
        assert_eq!(plan(&cfg, &u, k, now + 100 * MS), Plan::Wait);
        assert_eq!(plan(&cfg, &u, k, now + 11_000 * MS), Plan::Release);
        // The same busy key not served centrally asks ahead, with a rate.
        k.central = false;
        k.waiting_cost = 3;
        match plan(&cfg, &u, k, now) {
            Plan::Renew {
                want,
                want_rate_utps,
            } => assert!(want > 3 && want_rate_utps > 0, "{want} {want_rate_utps}"),
            other => panic!("{other:?}"),
        }
    }
}

//! Ledger tests: examples, then property tests of I2 and I1 under random
//! grant / spend-report / expire / release / stale-report / restart sequences.

use super::*;
use proptest::prelude::*;

const MS: u64 = 1_000_000;
const SEC: u64 = 1_000 * MS;
/// Base time long after the allocator became ready (at 0): new keys are full.
const T0: u64 = 1_000 * SEC;

fn rate(tokens: u64, period_s: u64) -> Rate {
    Rate { tokens, period_s }
}

/// How long the root takes to refill what `R` gives in `ns`: it refills at
/// `R (1 - rho)` (SPEC §2), `rho` = 1e-3.
fn at_root_rate(ns: u64) -> u64 {
    ns + ns.div_ceil(999)
}

fn renewal(holder: HolderId, lease_id: u64, spent: u64, want: u64, new_id: u64) -> Renewal {
    Renewal {
        holder,
        lease_id,
        spent,
        want,
        ttl_ns: 2 * SEC,
        new_id,
        want_rate_utps: 0,
        returned: 0,
    }
}

#[test]
fn fresh_key_is_full_and_grants_fair_shares() {
    let mut l = KeyLedger::new(rate(10, 1), 100, T0, Some(0));
    assert_eq!(l.available(), 100);
    let g = l.renew(T0, renewal(1, 0, 0, 30, 1), SEC);
    assert_eq!((g.tokens, g.fresh, g.carried), (30, 30, 0));
    assert_eq!(l.available() + l.outstanding(), 100);
    // Two holders asking 1000 each share the remaining 70.
    let g2 = l.renew(T0, renewal(2, 0, 0, 1000, 2), SEC);
    // Holder 1 wants 30 (already satisfied), holder 2 gets the rest of the level.
    assert_eq!(g2.fresh, 70);
    assert!(g2.retry_after_ms >= 1);
}

#[test]
fn spent_reports_free_room_for_refill_and_never_count_twice() {
    let mut l = KeyLedger::new(rate(10, 1), 20, T0, Some(0));
    let g = l.renew(T0, renewal(1, 0, 0, 20, 1), SEC);
    assert_eq!(g.tokens, 20);
    assert_eq!(l.available(), 0);
    // 1 s later nothing refilled: all 20 are outstanding.
    l.advance(T0 + SEC);
    assert_eq!(l.available(), 0);
    // Report 15 spent: the unspent 5 are carried, 15 leave outstanding.
    let g = l.renew(T0 + SEC, renewal(1, 1, 15, 0, 2), SEC);
    assert_eq!((g.carried, g.fresh), (5, 0));
    assert_eq!(l.outstanding(), 5);
    // A stale duplicate of the same report names the rolled lease: no effect.
    let g3 = l.renew(T0 + SEC, renewal(1, 1, 15, 0, 3), SEC);
    assert_eq!(g3.carried, 0);
    assert_eq!(l.outstanding(), 5);
    l.advance(T0 + SEC + at_root_rate(SEC));
    assert_eq!(l.available(), 10);
}

#[test]
fn the_root_refills_at_its_rate_slowed_by_rho() {
    // Its clock may run fast by rho: R on it could be more than R in true
    // time, so it refills at R (1 - rho), 9.99/s for a 10/s rule.
    let mut l = KeyLedger::new(rate(10, 1), 1_000_000, 0, Some(0));
    l.advance(1_000 * SEC);
    assert_eq!(l.available(), 9_990);
    l.advance(1_000 * SEC + 100 * MS);
    assert_eq!(l.available(), 9_990, "0.999 of a token in 100 ms");
    l.advance(1_000 * SEC + 101 * MS);
    assert_eq!(l.available(), 9_991);
    // A holder told to come back for one token is told the slowed time:
    // 100.1 ms for the next one, rounded up to 101.
    let mut e = KeyLedger::new(rate(10, 1), 20, 0, Some(0));
    let g = e.renew(0, renewal(1, 0, 0, 1, 1), SEC);
    assert_eq!(g.tokens, 0);
    assert_eq!(g.retry_after_ms, 101);
}

#[test]
fn expiry_applies_at_its_instant_and_unspent_counts_as_spent() {
    let mut l = KeyLedger::new(rate(10, 1), 20, T0, Some(0));
    l.renew(T0, renewal(1, 0, 0, 20, 1), SEC); // expires at 2 s
                                               // Advance straight past 3 s: the lease expired at 2 s, so only 1 s of
                                               // refill (at R (1 - rho)).
    l.advance(T0 + 2 * SEC + at_root_rate(SEC));
    assert_eq!(l.outstanding(), 0);
    assert_eq!(l.available(), 10);
}

#[test]
fn release_returns_the_rest_once() {
    let mut l = KeyLedger::new(rate(1, 60), 10, T0, Some(0));
    l.renew(T0, renewal(1, 0, 0, 10, 7), SEC);
    assert_eq!(l.release(T0, 1, 7, 4), Some(6));
    assert_eq!(l.available(), 6);
    assert_eq!(l.release(T0, 1, 7, 4), None);
    assert_eq!(l.release(T0, 2, 99, 0), None);
    assert_eq!(l.available(), 6);
}

#[test]
fn restart_treats_the_key_as_fully_leased_until_ready() {
    // Allocator started at 0 with TTL_max ~ 2 s: ready at 2 s.
    let mut l = KeyLedger::new(rate(10, 1), 20, SEC, Some(2 * SEC));
    assert_eq!(l.available(), 0);
    assert_eq!(l.outstanding(), 20);
    let g = l.renew(SEC, renewal(1, 0, 0, 5, 1), SEC);
    assert_eq!(g.tokens, 0);
    assert!(g.retry_after_ms > 0);
    l.advance(2 * SEC + at_root_rate(SEC));
    assert_eq!(l.outstanding(), 0);
    assert_eq!(l.available(), 10);
    // A key first seen well after ready is full.
    let l2 = KeyLedger::new(rate(10, 1), 20, 10 * SEC, Some(2 * SEC));
    assert_eq!(l2.available(), 20);
    // ... but one seen just after ready has only refilled since ready.
    let l3 = KeyLedger::new(
        rate(10, 1),
        20,
        2 * SEC + at_root_rate(500 * MS),
        Some(2 * SEC),
    );
    assert_eq!(l3.available(), 5);
}

#[test]
fn lowering_burst_below_outstanding_stops_grants() {
    let mut l = KeyLedger::new(rate(10, 1), 100, T0, Some(0));
    l.renew(T0, renewal(1, 0, 0, 80, 1), SEC);
    l.set_limits(rate(10, 1), 50, T0);
    assert_eq!(l.available(), 0);
    let g = l.renew(T0, renewal(2, 0, 0, 10, 2), SEC);
    assert_eq!(g.fresh, 0);
    assert!(l.i2_holds());
}

#[test]
fn rate_change_does_not_reset_to_full() {
    let mut l = KeyLedger::new(rate(60, 60), 20, T0, Some(0));
    l.renew(T0, renewal(1, 0, 0, 20, 1), SEC);
    l.release(T0, 1, 1, 20);
    assert_eq!(l.available(), 0);
    let t = T0 + at_root_rate(5 * SEC);
    l.set_limits(rate(2, 1), 20, t); // 5 tokens at 1/s
    assert_eq!(l.available(), 5);
    l.advance(t + at_root_rate(SEC));
    assert_eq!(l.available(), 7);
}

// --- Property tests -------------------------------------------------------

#[derive(Clone, Debug)]
enum Op {
    Advance(u64),
    /// holder, want, report spent accurately?
    Renew(u32, u64, bool),
    /// holder spends n from its lease if it can
    Spend(u32, u64),
    Release(u32),
    /// holder sends a stale report naming its previous lease id
    Stale(u32, u64),
    /// the allocator restarts (loses the ledger)
    Restart,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1u64..400).prop_map(Op::Advance),
        4 => (0u32..3, 0u64..40, any::<bool>()).prop_map(|(h, w, a)| Op::Renew(h, w, a)),
        6 => (0u32..3, 1u64..10).prop_map(|(h, n)| Op::Spend(h, n)),
        1 => (0u32..3).prop_map(Op::Release),
        1 => (0u32..3, 0u64..50).prop_map(|(h, s)| Op::Stale(h, s)),
        1 => Just(Op::Restart),
    ]
}

/// What a holder believes it holds.
#[derive(Clone, Copy, Debug, Default)]
struct Held {
    id: u64,
    previous_id: u64,
    granted: u64,
    spent: u64,
    /// The holder's own deadline (here: the allocator's expiry, zero latency).
    until_ns: u64,
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn i1_and_i2_hold_under_random_histories(
        n in 1u64..40,
        period in prop_oneof![Just(1u64), Just(60)],
        burst in 1u64..50,
        ops in proptest::collection::vec(op(), 1..150),
    ) {
        let r = rate(n, period);
        let ttl_ns = 500 * MS;
        let mut now = 0u64;
        let mut l = KeyLedger::new(r, burst, now, None);
        let mut held = [Held::default(); 3];
        let mut next_id = 1u64;
        let mut admitted: Vec<(u64, u64)> = Vec::new();
        for o in ops {
            match o {
                Op::Advance(d) => { now += d * MS; l.advance(now); }
                Op::Renew(h, want, accurate) => {
                    let me = &mut held[h as usize];
                    let valid = me.id != 0 && now < me.until_ns;
                    // An inaccurate holder under-reports (a stale count): safe, never over.
                    let spent = if accurate { me.spent } else { me.spent / 2 };
                    let g = l.renew(now, Renewal { holder: h, lease_id: if valid { me.id } else { 0 }, spent, want, ttl_ns, new_id: next_id, want_rate_utps: 0, returned: 0 }, SEC);
                    next_id += 1;
                    prop_assert!(!g.shadow_violation, "shadow bucket fired");
                    // The holder installs: tokens = carried + fresh - spent since report.
                    let rest_now = if valid { me.granted - me.spent } else { 0 };
                    let rest_reported = if valid { me.granted - spent } else { 0 };
                    let spent_since = rest_reported.saturating_sub(rest_now);
                    prop_assert!(g.carried <= rest_reported);
                    me.previous_id = me.id;
                    if g.lease_id != 0 {
                        // carry is exactly the reported rest when the lease was known
                        let usable = g.tokens - spent_since.min(g.carried);
                        *me = Held { id: g.lease_id, previous_id: me.previous_id, granted: g.tokens, spent: g.tokens - usable, until_ns: g.expires_ns };
                    } else {
                        *me = Held { previous_id: me.previous_id, ..Held::default() };
                    }
                }
                Op::Spend(h, k) => {
                    let me = &mut held[h as usize];
                    if me.id != 0 && now < me.until_ns && me.granted - me.spent >= k {
                        me.spent += k;
                        admitted.push((now, k));
                    }
                }
                Op::Release(h) => {
                    let me = &mut held[h as usize];
                    if me.id != 0 && now < me.until_ns {
                        l.release(now, h, me.id, me.spent);
                    }
                    *me = Held { previous_id: me.id, ..Held::default() };
                }
                Op::Stale(h, s) => {
                    let prev = held[h as usize].previous_id;
                    if prev != 0 {
                        let g = l.renew(now, Renewal { holder: h, lease_id: prev, spent: s, want: 0, ttl_ns, new_id: next_id, want_rate_utps: 0, returned: 0 }, SEC);
                        next_id += 1;
                        // A stale report names a rolled lease: it carries nothing.
                        prop_assert_eq!(g.carried, 0);
                    }
                }
                Op::Restart => {
                    // A new allocator knows nothing; holders keep their leases
                    // until their own deadlines. Ready after TTL_max.
                    l = KeyLedger::new(r, burst, now, Some(now + ttl_ns));
                }
            }
            prop_assert!(l.i2_holds(), "I2 broken at {} ms: available {} outstanding {} burst {}", now / MS, l.available(), l.outstanding(), burst);
            prop_assert!(l.available() <= burst);
        }
        // I1 over every window [t_i, t_j] between admissions.
        let rate_per_ns = n as f64 / (period as f64 * 1e9);
        for i in 0..admitted.len() {
            let mut sum = 0u64;
            for j in i..admitted.len() {
                sum += admitted[j].1;
                let t = (admitted[j].0 - admitted[i].0) as f64;
                prop_assert!(sum as f64 <= burst as f64 + rate_per_ns * t + 1e-9,
                    "I1: {} admitted in {} ms, bound {}", sum, t / 1e6, burst as f64 + rate_per_ns * t);
            }
        }
    }

    /// Lazy advance equals advancing every millisecond, with leases expiring
    /// in between.
    #[test]
    fn lazy_advance_equals_ticked(
        n in 1u64..40,
        burst in 1u64..50,
        wants in proptest::collection::vec((0u64..30, 1u64..1500), 1..6),
        horizon_ms in 1u64..4000,
    ) {
        let r = rate(n, 1);
        let mut lazy = KeyLedger::new(r, burst, 0, None);
        for (i, (w, ttl_ms)) in wants.iter().enumerate() {
            lazy.renew(0, Renewal { holder: i as u32, lease_id: 0, spent: 0, want: *w, ttl_ns: ttl_ms * MS, new_id: i as u64 + 1, want_rate_utps: 0, returned: 0 }, SEC);
        }
        let mut ticked = lazy.clone();
        for t in 1..=horizon_ms { ticked.advance(t * MS); }
        lazy.advance(horizon_ms * MS);
        prop_assert_eq!(lazy.available(), ticked.available());
        prop_assert_eq!(lazy.outstanding(), ticked.outstanding());
    }
}

// --- Leases that carry a rate ----------------------------------------------

/// Nano-tokens per token in the holders' model below.
const NT: u128 = 1_000_000_000;

#[test]
fn rates_lent_out_slow_the_root_and_capacities_count_until_acknowledged() {
    // 100/s burst 100, full.
    let mut l = KeyLedger::new(rate(100, 1), 100, T0, None);
    let ask = |holder, lease_id, want, rate_tps: u64, new_id| Renewal {
        want_rate_utps: rate_tps * 1_000_000,
        ..renewal(holder, lease_id, 0, want, new_id)
    };
    let g = l.renew(T0, ask(1, 0, 10, 40, 1), SEC);
    // The rate asked for (under R (1 - rho)), its share of B as capacity
    // (ceil(100 * 40 / 99.9) = 41), and tokens: the 10 asked for plus the
    // 31 that the count of 41 would otherwise clamp out of `available`
    // (100 - 10 > B - 41): handed over, not destroyed.
    assert_eq!(
        (g.rate_utps, g.capacity, g.tokens, g.version_of),
        (40_000_000, 41, 41, 0)
    );
    assert_eq!(l.rates_out_utps(), 40_000_000);
    assert_eq!(l.outstanding(), 41);
    assert_eq!(l.available(), 59);
    // The root refills at R (1 - rho) - 40/s = 59.9/s.
    let g_tokens = l.renew(T0, renewal(2, 0, 0, 20, 9), SEC);
    assert_eq!(g_tokens.tokens, 20);
    assert_eq!(l.available(), 39);
    assert_eq!(l.release(T0, 2, 9, 20), Some(0), "all 20 spent");
    l.advance(T0 + 200 * MS);
    assert_eq!(l.available(), 39 + 11, "11.98 in 200 ms");
    // A new version with a lower rate and capacity (10/s asked, raised to
    // the floor of R (1 - rho) / 4 for the one holder asking for a rate,
    // and that rate's share of B): until acknowledged, the larger of the
    // two counts.
    let g2 = l.renew(T0 + 100 * MS, ask(1, 1, 0, 10, 2), SEC);
    assert_eq!(g2.version_of, 1);
    assert_eq!((g2.rate_utps, g2.capacity), (24_975_000, 25));
    assert_eq!(l.rates_out_utps(), 40_000_000, "version 1 still counts");
    assert_eq!(l.outstanding(), 41);
    // Naming version 2 acknowledges it: version 1 stops counting.
    let g3 = l.renew(T0 + 200 * MS, ask(1, 2, 0, 10, 3), SEC);
    assert_eq!(g3.version_of, 2);
    assert_eq!(l.rates_out_utps(), 24_975_000);
    assert_eq!(l.outstanding(), 25);
    assert!(l.i2_holds());
    // A release returns what the holder had left, at most its count, once.
    let before = l.available();
    assert_eq!(l.release_with(T0 + 200 * MS, 1, 3, 0, 500), Some(25));
    assert_eq!(l.available(), before + 25);
    assert_eq!((l.rates_out_utps(), l.outstanding()), (0, 0));
    assert_eq!(
        l.release_with(T0 + 200 * MS, 1, 3, 0, 500),
        None,
        "only once"
    );
}

/// A renewal asking for a rate of `rate_tps` tokens/s and no tokens.
fn rate_ask(holder: HolderId, lease_id: u64, rate_tps: u64, new_id: u64) -> Renewal {
    Renewal {
        want_rate_utps: rate_tps * 1_000_000,
        ..renewal(holder, lease_id, 0, 0, new_id)
    }
}

#[test]
fn a_burst_lowered_below_the_holders_leaves_one_capacity_with_the_whole_rate() {
    // 50/s burst 50 under four holders asking for 60/s each, renewing
    // every 100 ms; the rule becomes 1/s burst 1 (the adversarial run of
    // issue 29: every holder kept a capacity of one token, four tokens at
    // once, for as long as they renewed).
    let mut l = KeyLedger::new(rate(50, 1), 50, T0, None);
    let mut named = [0u64; 4];
    let mut ids = 1u64;
    let mut renew_all = |l: &mut KeyLedger, now: u64| {
        for h in 0..4u32 {
            let g = l.renew(now, rate_ask(h, named[h as usize], 60, ids), SEC);
            ids += 1;
            if g.lease_id != 0 {
                named[h as usize] = g.lease_id;
            }
        }
    };
    for step in 0..10u64 {
        renew_all(&mut l, T0 + step * 100 * MS);
    }
    let change = T0 + SEC;
    l.set_limits(rate(1, 1), 1, change);
    for step in 0..40u64 {
        let now = change + step * 100 * MS;
        renew_all(&mut l, now);
        if now > change + 2 * SEC {
            // Every version from before the change has expired (TTL 2 s).
            assert!(
                l.available() + l.outstanding() <= 1,
                "{} ms after the change: available {} outstanding {}",
                (now - change) / MS,
                l.available(),
                l.outstanding()
            );
        }
    }
    // One holder holds the burst, with the whole rate: the others' asks,
    // which can have no capacity, do not split R (it would refill no one).
    let counted: Vec<(u64, u64)> = (0..4u32).map(|h| l.counted_for(h)).collect();
    let holding: Vec<_> = counted.iter().filter(|c| c.0 > 0).collect();
    assert_eq!(holding.len(), 1, "{counted:?}");
    assert_eq!(*holding[0], (1, 999_000), "{counted:?}");
}

#[test]
fn rate_shares_are_max_min_fair_and_never_exceed_the_rate() {
    let ask = rate_ask;
    let mut l = KeyLedger::new(rate(300, 1), 300, T0, None);
    // Three holders want 200/s each of 300/s: 1/3 of R (1 - rho) each once
    // every one of them has asked and re-asked.
    let mut ids = [0u64; 3];
    let mut next = 1;
    for round in 0..3 {
        for h in 0..3u32 {
            let g = l.renew(
                T0 + round * 10 * MS,
                ask(h, ids[h as usize], 200, next),
                SEC,
            );
            ids[h as usize] = g.lease_id;
            next += 1;
            assert!(l.rates_out_utps() <= 299_700_000, "over R (1 - rho)");
        }
    }
    let shares: Vec<u64> = (0..3)
        .map(|h| {
            l.leases()
                .iter()
                .filter(|x| x.holder == h)
                .map(|x| x.rate_utps)
                .max()
                .unwrap()
        })
        .collect();
    for s in &shares {
        assert!((*s as i64 - 99_900_000).abs() <= 1, "shares {shares:?}");
    }
}

#[test]
fn a_first_ask_counts_as_an_equal_share_until_the_holder_asks_again() {
    let ask = rate_ask;
    // 300/s: two holders open asking 3/s each (their children cold), a
    // third then asks for 250/s.
    let mut l = KeyLedger::new(rate(300, 1), 300, T0, None);
    let a = l.renew(T0, ask(0, 0, 3, 1), SEC);
    let b = l.renew(T0, ask(1, 0, 3, 2), SEC);
    // Each is raised to the rate floor: a quarter of an equal share among
    // the holders asking for a rate so far (one, then two).
    assert_eq!((a.rate_utps, b.rate_utps), (74_925_000, 37_462_500));
    // Taken at their word the two first asks would leave 187.3/s to the
    // third; as first asks they count as a third of R (1 - rho) each.
    let c = l.renew(T0 + MS, ask(2, 0, 250, 3), SEC);
    assert_eq!(c.rate_utps, 99_900_000);
    // The first two ask again, for their equal share: it is there.
    let a = l.renew(T0 + 2 * MS, ask(0, a.lease_id, 200, 4), SEC);
    let b = l.renew(T0 + 2 * MS, ask(1, b.lease_id, 200, 5), SEC);
    assert_eq!((a.rate_utps, b.rate_utps), (99_900_000, 99_900_000));
    assert!(l.rates_out_utps() <= 299_700_000, "over R (1 - rho)");
    // Had the two re-asked for 3/s, the third grows into the rest: all of
    // it but the two floors (a quarter of an equal share of three each).
    let mut l = KeyLedger::new(rate(300, 1), 300, T0, None);
    let a = l.renew(T0, ask(0, 0, 3, 1), SEC);
    let b = l.renew(T0, ask(1, 0, 3, 2), SEC);
    let c = l.renew(T0 + MS, ask(2, 0, 250, 3), SEC);
    let a = l.renew(T0 + 2 * MS, ask(0, a.lease_id, 3, 4), SEC);
    let b = l.renew(T0 + 2 * MS, ask(1, b.lease_id, 3, 5), SEC);
    // Their larger first versions count until they name the new ones.
    l.renew(T0 + 3 * MS, ask(0, a.lease_id, 3, 6), SEC);
    l.renew(T0 + 3 * MS, ask(1, b.lease_id, 3, 7), SEC);
    let c = l.renew(T0 + 4 * MS, ask(2, c.lease_id, 250, 8), SEC);
    assert_eq!(c.rate_utps, 299_700_000 - 2 * 24_975_000);
}

#[derive(Clone, Debug)]
enum ROp {
    Advance(u64),
    /// holder, tokens wanted, rate wanted (tokens/s), reply lost?
    Renew(u32, u64, u64, bool),
    /// a lost reply arrives late
    Deliver(u32),
    Spend(u32, u64),
    /// the holder spends all it can
    Drain(u32),
    Release(u32),
    Restart,
    /// A clean shutdown's checkpoint, resumed at once or after a pause.
    CleanRestart(u64),
}

fn rop() -> impl Strategy<Value = ROp> {
    rop_of(3)
}

/// [`rop`] over `holders` holders.
fn rop_of(holders: u32) -> impl Strategy<Value = ROp> {
    prop_oneof![
        4 => (1u64..120).prop_map(ROp::Advance),
        5 => (0..holders, 0u64..60, 0u64..60, prop::bool::weighted(0.2))
            .prop_map(|(h, w, r, lost)| ROp::Renew(h, w, r, lost)),
        1 => (0..holders).prop_map(ROp::Deliver),
        10 => (0..holders, 1u64..8).prop_map(|(h, n)| ROp::Spend(h, n)),
        3 => (0..holders).prop_map(ROp::Drain),
        1 => (0..holders).prop_map(ROp::Release),
        1 => Just(ROp::Restart),
        1 => (0u64..600).prop_map(ROp::CleanRestart),
    ]
}

/// A holder of rate leases: its level in nano-tokens, the version it uses
/// and the replies still on their way.
#[derive(Clone, Debug, Default)]
struct RateHolder {
    level_nt: u128,
    /// (id, rate utps, capacity, use-by), of the version in use.
    current: Option<(u64, u64, u64, u64)>,
    refilled_to_ns: u64,
    /// A reply that was lost on the way (may still arrive): (grant, sent at).
    late: Option<(Granted, u64)>,
}

impl RateHolder {
    /// Refill up to `now` (at the rate slowed by rho, only until use-by).
    fn refill(&mut self, now: u64) {
        if let Some((_, r, c, use_by)) = self.current {
            let until = now.min(use_by);
            if until > self.refilled_to_ns {
                let dt = u128::from(until - self.refilled_to_ns);
                // r utps = r nano-tokens per ms; slowed by rho = 1e-3.
                let per_ns_num = u128::from(r - r / 1000);
                self.level_nt =
                    (self.level_nt + dt * per_ns_num / 1_000_000).min(u128::from(c) * NT);
            }
        }
        self.refilled_to_ns = self.refilled_to_ns.max(now);
    }

    fn usable(&self, now: u64) -> bool {
        self.current.is_some_and(|(_, _, _, use_by)| now < use_by)
    }

    /// Apply a grant received at `now`: versions in order, level carried
    /// over (dropped if the lease in use ran out), clipped, tokens added.
    fn apply(&mut self, g: &Granted, now: u64) {
        if g.lease_id == 0 || g.capacity == 0 {
            return;
        }
        if self.current.is_some_and(|(id, ..)| id >= g.lease_id) {
            return; // an older version arriving late
        }
        self.refill(now);
        if !self.usable(now) {
            self.level_nt = 0;
        }
        // The holder's use-by: a little before the allocator's expiry.
        let use_by = g.expires_ns.saturating_sub(MS);
        self.level_nt =
            (self.level_nt + u128::from(g.tokens) * NT).min(u128::from(g.capacity) * NT);
        self.current = Some((g.lease_id, g.rate_utps, g.capacity, use_by));
        self.refilled_to_ns = now;
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    /// I1 and I2 with leases that carry a rate: holders refill locally,
    /// replies are lost and arrive late or never, versions are
    /// acknowledged, released, the allocator restarts; admissions over
    /// every window stay within `B + R*T`.
    #[test]
    fn i1_and_i2_hold_with_rate_leases(
        n in 1u64..60,
        burst in 1u64..60,
        ops in proptest::collection::vec(rop(), 1..400),
    ) {
        let mut w = RateWorld::new(rate(n, 1), burst, 3);
        for o in ops {
            w.step(o)?;
        }
        // I1 over every window [t_i, t_j] between admissions, exactly:
        // sum <= B + n * t / 1e9.
        check_windows(&w.admitted, |_, _, t| {
            u128::from(burst) * 1_000_000_000 + u128::from(n) * u128::from(t)
        })?;
    }

    /// A rule change that lowers the rate and the burst, to below the
    /// number of holders (down to 1), amid renewals, lost replies and
    /// restarts (SPEC §2 "Rule changes"): from `TTL_max` after the change
    /// on, `available + outstanding <= B_new`; over every window,
    /// admissions stay within `B_old + R_old * T_before + R_new * T_after`,
    /// the change taking effect for the bound at `t_change + TTL_max`
    /// (zero latency here: a holder uses a version until a millisecond
    /// before its expiry). Before the capacity floor was removed a holder
    /// kept at least one token of capacity for as long as it renewed.
    #[test]
    fn i1_and_i2_hold_when_a_rule_change_lowers_the_burst_below_the_holders(
        n_old in 2u64..60,
        burst_old in 4u64..40,
        n_new_pct in 1u64..=100,
        burst_new in prop_oneof![Just(1u64), 1u64..6],
        holders in 3u32..7,
        ops in proptest::collection::vec(rop_of(6), 1..400),
        change_at in 0usize..200,
    ) {
        let n_new = (n_old * n_new_pct / 100).max(1);
        let burst_new = burst_new.min(burst_old);
        let mut w = RateWorld::new(rate(n_old, 1), burst_old, holders);
        let mut t_change = None;
        for (i, o) in ops.into_iter().enumerate() {
            if i == change_at {
                w.l.set_limits(rate(n_new, 1), burst_new, w.now);
                (w.r, w.burst) = (rate(n_new, 1), burst_new);
                t_change = Some(w.now);
            }
            let o = match o {
                ROp::Renew(h, ..) | ROp::Deliver(h) | ROp::Spend(h, _) | ROp::Drain(h) | ROp::Release(h)
                    if h >= holders => continue,
                o => o,
            };
            w.step(o)?;
            // Checked once every version granted before the change has
            // expired, and so has a restart's phantom (a clean restart
            // counts what was leased at its stop for up to `TTL_max` and a
            // millisecond of margin from its resume: it cannot know how
            // long it was down).
            if t_change.is_some_and(|t| w.now > t.max(w.restarted_ns) + w.ttl_ns + MS) {
                w.rates_cap_utps = n_new * 1_000_000;
                prop_assert!(
                    w.l.available() + w.l.outstanding() <= burst_new,
                    "I2 under the new burst at {} ms: available {} outstanding {} burst {}",
                    w.now / MS, w.l.available(), w.l.outstanding(), burst_new
                );
            }
        }
        let t_eff = t_change.map_or(u64::MAX, |t| t + w.ttl_ns);
        check_windows(&w.admitted, |a, b, _| {
            let before = b.min(t_eff).saturating_sub(a);
            let after = b.saturating_sub(a.max(t_eff));
            u128::from(burst_old) * 1_000_000_000
                + u128::from(n_old) * u128::from(before)
                + u128::from(n_new) * u128::from(after)
        })?;
    }
}

/// I1 over every window `[t_i, t_j]` between admissions: the sum admitted
/// times 1e9 is at most `bound(t_i, t_j, t_j - t_i)` (nano-tokens).
fn check_windows(
    admitted: &[(u64, u64)],
    bound: impl Fn(u64, u64, u64) -> u128,
) -> Result<(), TestCaseError> {
    for i in 0..admitted.len() {
        let mut sum = 0u128;
        for j in i..admitted.len() {
            sum += u128::from(admitted[j].1);
            let (a, b) = (admitted[i].0, admitted[j].0);
            let limit = bound(a, b, b - a);
            prop_assert!(
                sum * 1_000_000_000 <= limit,
                "I1: {} admitted from {} ms to {} ms, bound {}",
                sum,
                a / MS,
                b / MS,
                limit as f64 / 1e9
            );
        }
    }
    Ok(())
}

/// A ledger and its rate holders driven by [`ROp`]s, with I2 and the
/// ledger's own alarms checked after every step.
struct RateWorld {
    l: KeyLedger,
    /// The rule in force (restarts build the ledger with it).
    r: Rate,
    burst: u64,
    ttl_ns: u64,
    now: u64,
    hs: Vec<RateHolder>,
    next_id: u64,
    /// The most the rates lent out may sum to (the largest `R` in force
    /// within a lease's life).
    rates_cap_utps: u64,
    /// The last restart (clean or not), after its pause.
    restarted_ns: u64,
    /// (instant, tokens) of every admission.
    admitted: Vec<(u64, u64)>,
}

impl RateWorld {
    fn new(r: Rate, burst: u64, holders: u32) -> Self {
        RateWorld {
            l: KeyLedger::new(r, burst, 0, None),
            r,
            burst,
            ttl_ns: 500 * MS,
            now: 0,
            hs: vec![RateHolder::default(); holders as usize],
            next_id: 1,
            rates_cap_utps: rate_utps(r),
            restarted_ns: 0,
            admitted: Vec::new(),
        }
    }

    fn step(&mut self, o: ROp) -> Result<(), TestCaseError> {
        let now = self.now;
        match o {
            ROp::Advance(d) => {
                self.now += d * MS;
                self.l.advance(self.now);
            }
            ROp::Renew(h, want, rate_tps, lost) => {
                let me = &mut self.hs[h as usize];
                let named = me.current.map_or(0, |c| c.0);
                let g = self.l.renew(
                    now,
                    Renewal {
                        holder: h,
                        lease_id: named,
                        spent: 0,
                        want,
                        ttl_ns: self.ttl_ns,
                        new_id: self.next_id,
                        want_rate_utps: rate_tps * 1_000_000 + 1,
                        returned: 0,
                    },
                    SEC,
                );
                self.next_id += 1;
                prop_assert!(!g.shadow_violation, "shadow bucket fired");
                prop_assert!(g.capacity <= self.burst);
                if lost {
                    me.late = Some((g, now));
                } else {
                    me.apply(&g, now);
                }
            }
            ROp::Deliver(h) => {
                let me = &mut self.hs[h as usize];
                if let Some((g, _)) = me.late.take() {
                    me.apply(&g, now);
                }
            }
            ROp::Spend(h, k) => {
                let me = &mut self.hs[h as usize];
                me.refill(now);
                if me.usable(now) && me.level_nt >= u128::from(k) * NT {
                    me.level_nt -= u128::from(k) * NT;
                    self.admitted.push((now, k));
                }
            }
            ROp::Drain(h) => {
                let me = &mut self.hs[h as usize];
                me.refill(now);
                let k = u64::try_from(me.level_nt / NT).unwrap();
                if me.usable(now) && k > 0 {
                    me.level_nt -= u128::from(k) * NT;
                    self.admitted.push((now, k));
                }
            }
            ROp::Release(h) => {
                let me = &mut self.hs[h as usize];
                me.refill(now);
                if let Some((id, ..)) = me.current {
                    if me.usable(now) {
                        let left = u64::try_from(me.level_nt / NT).unwrap();
                        self.l.release_with(now, h, id, 0, left);
                    }
                }
                // Stops using it either way; a late reply is ignored now.
                *me = RateHolder {
                    refilled_to_ns: now,
                    ..RateHolder::default()
                };
            }
            ROp::Restart => {
                self.l = KeyLedger::new(self.r, self.burst, now, Some(now + self.ttl_ns));
                self.restarted_ns = now;
            }
            ROp::CleanRestart(pause_ms) => {
                let cp = self.l.checkpoint(now);
                self.now += pause_ms * MS;
                self.l = KeyLedger::resume(self.r, self.burst, self.now, &cp, MS);
                self.restarted_ns = self.now;
            }
        }
        let l = &self.l;
        prop_assert!(
            l.i2_holds(),
            "I2 broken at {} ms: available {} outstanding {} burst {}",
            self.now / MS,
            l.available(),
            l.outstanding(),
            self.burst
        );
        prop_assert!(
            l.rates_out_utps() <= self.rates_cap_utps,
            "rates out {} over R",
            l.rates_out_utps()
        );
        Ok(())
    }
}

#[test]
fn a_holder_of_half_the_rate_and_the_root_together_admit_at_most_the_rate() {
    // 100/s burst 100. One holder takes a rate lease of 50/s and, renewing
    // every 100 ms, also every token the root has; it spends everything it
    // can. Over 10 s it admits at most B + R*T = 1 100, and not much less.
    let (r, burst) = (rate(100, 1), 100u64);
    let mut l = KeyLedger::new(r, burst, 0, None);
    let mut h = RateHolder::default();
    let mut admitted = 0u64;
    for (id, step) in (1..).zip(0..=100u64) {
        let now = step * 100 * MS;
        h.refill(now);
        let spend = u64::try_from(h.level_nt / NT).unwrap();
        if h.usable(now) {
            h.level_nt -= u128::from(spend) * NT;
            admitted += spend;
        }
        let named = h.current.map_or(0, |c| c.0);
        let g = l.renew(
            now,
            Renewal {
                want_rate_utps: 50_000_000,
                ..renewal(1, named, 0, burst, id)
            },
            SEC,
        );
        h.apply(&g, now);
    }
    assert!(admitted <= 1_100, "admitted {admitted}");
    assert!(
        admitted >= 1_000,
        "admitted {admitted}: the quota is not delivered"
    );
}

#[test]
fn tokens_of_a_version_still_on_its_way_count_until_it_is_acknowledged() {
    // The property test's first catch (51/s, burst 6): a holder's second
    // version carries a token and its reply is delayed; meanwhile the
    // holder spends its level and another holder fills the rest of the
    // burst. Counting only capacities let 7 tokens go in one instant.
    let (r, burst) = (rate(51, 1), 6u64);
    let mut l = KeyLedger::new(r, burst, 0, None);
    let ask = |holder, lease_id, want, new_id| Renewal {
        want_rate_utps: 1,
        ..renewal(holder, lease_id, 0, want, new_id)
    };
    let mut h1 = RateHolder::default();
    let g = l.renew(0, ask(1, 0, 0, 1), SEC);
    h1.apply(&g, 0);
    let late = l.renew(0, ask(1, g.lease_id, 5, 2), SEC); // reply delayed
    let mut h0 = RateHolder::default();
    let g0 = l.renew(
        0,
        Renewal {
            want_rate_utps: 34_000_000,
            ..renewal(0, 0, 0, 0, 3)
        },
        SEC,
    );
    h0.apply(&g0, 0);
    assert!(l.i2_holds());
    let t = 30 * MS;
    let mut admitted = 0u128;
    for h in [&mut h0, &mut h1] {
        h.refill(t);
        admitted += h.level_nt / NT;
        h.level_nt %= NT;
    }
    h1.apply(&late, t);
    h1.refill(t);
    admitted += h1.level_nt / NT;
    assert!(
        admitted <= u128::from(burst),
        "{admitted} admitted at one instant"
    );
}

#[test]
fn a_holder_back_from_a_cut_gets_room_though_the_others_kept_their_capacity() {
    // The swarm's find (flat base, 1000/s burst 200, 5 agents): while one
    // agent was cut off, four held a quarter of B each; back, it asked for
    // a rate and got no room, ever: each of the four kept its capacity
    // (its share moved from 50 to 40, less than a quarter). Capacities are
    // not kept while a holder is squeezed, so within two renewals of the
    // others the fifth holds its share.
    let (r, burst) = (rate(1_000, 1), 200u64);
    let mut l = KeyLedger::new(r, burst, 0, None);
    let want_rate = 500_000_000; // each asks for half of R
    let ask = |holder, lease_id, new_id| Renewal {
        want_rate_utps: want_rate,
        ..renewal(holder, lease_id, 0, 10, new_id)
    };
    let mut ids = 1u64;
    let mut named = [0u64; 5];
    // Four holders alone for a while: a quarter of R and of B each.
    for step in 0..20u64 {
        let now = step * 100 * MS;
        for h in 0..4u32 {
            let g = l.renew(now, ask(h, named[h as usize], ids), SEC);
            ids += 1;
            if g.lease_id != 0 {
                named[h as usize] = g.lease_id;
            }
        }
    }
    let caps: Vec<u64> = (0..4u32).map(|h| l.counted_parts(h).0).collect();
    assert_eq!(caps.iter().sum::<u64>(), burst, "{caps:?}");
    // The fifth comes back and asks; the four renew as before.
    let mut fifth = 0;
    for step in 20..60u64 {
        let now = step * 100 * MS;
        let g = l.renew(now, ask(4, named[4], ids), SEC);
        ids += 1;
        if g.lease_id != 0 {
            named[4] = g.lease_id;
            fifth = g.capacity;
        }
        for h in 0..4u32 {
            let g = l.renew(now, ask(h, named[h as usize], ids), SEC);
            ids += 1;
            if g.lease_id != 0 {
                named[h as usize] = g.lease_id;
            }
        }
        assert!(l.i2_holds());
    }
    assert!(
        fifth >= burst / 5 - 1,
        "the fifth holder's capacity is {fifth}"
    );
    let (_, rate_fifth) = l.counted_for(4);
    assert!(
        rate_fifth >= 190_000_000,
        "the fifth holder's rate is {rate_fifth} utps"
    );
}

#[test]
fn a_burst_raised_during_the_restart_wait_is_room_for_the_ledger_and_its_shadow() {
    // 40/s burst 20, restarted at 10 s with a wait until 12 s; at 11 s the
    // burst goes to 25: the 5 new tokens are room the ledger fills at its
    // rate and grants (SPEC §2 allows max(B_old, B_new) across a change),
    // and the shadow bucket must not call that grant a violation (the
    // swarm's shadow-alarm finding).
    let mut l = KeyLedger::new(rate(40, 1), 20, 10 * SEC, Some(12 * SEC));
    let g = l.renew(10 * SEC, renewal(1, 0, 0, 10, 1), SEC);
    assert_eq!(g.fresh, 0, "nothing before the wait ends");
    l.set_limits(rate(40, 1), 25, 11 * SEC);
    let g = l.renew(11 * SEC + 200 * MS, renewal(1, 0, 0, 10, 2), SEC);
    assert_eq!(g.fresh, 5, "the raise is room");
    assert!(
        !g.shadow_violation,
        "the shadow bucket alarmed on the raise"
    );
    // Nothing beyond it until the wait ends.
    let g = l.renew(11 * SEC + 300 * MS, renewal(2, 0, 0, 10, 3), SEC);
    assert_eq!(g.fresh, 0);
}

#[test]
fn a_growing_capacity_hands_the_tokens_it_would_clamp_to_the_holder() {
    // A fresh 10/s burst 20 key on one agent (seen through a real Envoy):
    // a lease of 1 token, then rate versions of capacity 5, 15 and 20 as
    // its demand estimate grew. Each larger count clamped `available` and
    // destroyed what no longer fit (9, then 3 tokens): the agent admitted
    // 8 of the burst at once. The tokens above any level the holder can
    // have (its largest capacity) fit under the new capacity: they go to
    // the holder, and the whole burst is usable at once.
    let (r, burst) = (rate(10, 1), 20u64);
    let mut l = KeyLedger::new(r, burst, 0, None);
    let g = l.renew(0, renewal(1, 0, 0, 1, 1), SEC);
    let mut got = g.tokens;
    let mut h = RateHolder::default();
    let mut named = g.lease_id;
    for (id, want, rate_tps) in [(2u64, 1u64, 1u64), (3, 2, 7), (4, 2, 10)] {
        let g = l.renew(
            0,
            Renewal {
                want_rate_utps: rate_tps * 1_000_000,
                ..renewal(1, named, if id == 2 { 1 } else { 0 }, want, id)
            },
            SEC,
        );
        h.apply(&g, 0);
        got += g.fresh;
        named = g.lease_id;
        assert!(l.i2_holds());
    }
    assert_eq!(got, burst, "tokens handed out in one instant");
    // The holder holds them (1 was spent from the lease of tokens).
    assert_eq!(h.level_nt / NT, u128::from(burst - 1));
}

// ---- An adversarial review's stronger holder model (more holders, leases of tokens
// mixed with rate versions, several late replies, agent-like carry-over) ----

#[derive(Clone, Debug)]
enum MOp {
    Advance(u64),
    /// holder, want, rate (0: tokens only), reply lost?, name nothing?
    Renew(u32, u64, u64, bool, bool),
    /// a late reply (index) arrives: applied if its request is the one the
    /// holder awaits, else treated as the agent treats a reply to a request
    /// it gave up on (agent/src/core.rs `install_key`: a first version or a
    /// fresh lease of tokens is released, anything else left to expire)
    DeliverApply(u32, usize),
    /// a late reply arrives for a request given up on: the agent releases
    /// a first version / fresh lease of tokens
    DeliverRelease(u32, usize),
    Spend(u32, u64),
    Drain(u32),
    Release(u32),
    Restart,
}

const MH: u32 = 5;

fn mop() -> impl Strategy<Value = MOp> {
    prop_oneof![
        4 => (1u64..200).prop_map(MOp::Advance),
        6 => (0u32..MH, 0u64..60, prop_oneof![2 => Just(0u64), 5 => 0u64..60], prop::bool::weighted(0.25), prop::bool::weighted(0.05))
            .prop_map(|(h, w, r, lost, none)| MOp::Renew(h, w, r, lost, none)),
        2 => (0u32..MH, 0usize..4).prop_map(|(h, i)| MOp::DeliverApply(h, i)),
        1 => (0u32..MH, 0usize..4).prop_map(|(h, i)| MOp::DeliverRelease(h, i)),
        10 => (0u32..MH, 1u64..8).prop_map(|(h, n)| MOp::Spend(h, n)),
        3 => (0u32..MH).prop_map(MOp::Drain),
        1 => (0u32..MH).prop_map(MOp::Release),
        1 => Just(MOp::Restart),
    ]
}

#[derive(Clone, Copy, Debug)]
enum MCur {
    /// id, rate utps, capacity, use-by
    Rate(u64, u64, u64, u64),
    /// id, granted, use-by
    Tokens(u64, u64, u64),
    /// A rate version the agent's word cannot hold as one (its bucket's
    /// span is 2^38 ns or more, or no rate): held as tokens, no refill,
    /// clipped to its capacity (agent/src/lease_table.rs `install`).
    RateNone(u64, u64),
}

#[derive(Clone, Debug, Default)]
struct MHolder {
    level_nt: u128,
    cur: Option<MCur>,
    refilled_to_ns: u64,
    /// (grant, sent at, level at send in whole tokens, request tag)
    late: Vec<(Granted, u64, u64, u64)>,
    /// The request whose reply the holder awaits, like the agent's
    /// `in_flight`: one per key; a renewal sent meanwhile means the holder
    /// gave up on it (the agent sends no other renewal while one is
    /// awaited), and a release forgets it.
    awaits: Option<u64>,
}

impl MHolder {
    fn id(&self) -> u64 {
        match self.cur {
            Some(MCur::Rate(id, ..)) | Some(MCur::Tokens(id, ..)) | Some(MCur::RateNone(id, _)) => {
                id
            }
            None => 0,
        }
    }
    fn use_by(&self) -> u64 {
        match self.cur {
            Some(MCur::Rate(_, _, _, u))
            | Some(MCur::Tokens(_, _, u))
            | Some(MCur::RateNone(_, u)) => u,
            None => 0,
        }
    }
    /// Like the agent's word: a rate lease refills on (clipped to its
    /// capacity) whatever its use-by; it is usable only before it.
    fn refill(&mut self, now: u64) {
        if let Some(MCur::Rate(_, r, c, _)) = self.cur {
            if now > self.refilled_to_ns {
                let dt = u128::from(now - self.refilled_to_ns);
                let per = u128::from(r - r / 1000);
                self.level_nt = (self.level_nt + dt * per / 1_000_000).min(u128::from(c) * NT);
            }
        }
        self.refilled_to_ns = self.refilled_to_ns.max(now);
    }
    fn usable(&self, now: u64) -> bool {
        self.cur.is_some() && now < self.use_by()
    }
    fn tokens(&self) -> u64 {
        u64::try_from(self.level_nt / NT).unwrap()
    }
    /// The agent's install_key for an awaited reply.
    fn apply(&mut self, g: &Granted, sent: u64, at_send: u64, ttl: u64, now: u64) {
        if g.lease_id == 0 {
            return;
        }
        if g.lease_id <= self.id() {
            return;
        }
        let use_by = (sent + ttl - 2 * ttl / 1000).saturating_sub(MS);
        if now >= use_by {
            return; // given back (the model does not release it: conservative)
        }
        self.refill(now);
        let rate_grant = g.capacity > 0;
        let cur = self.tokens();
        let continues = g.carried > 0 || (rate_grant && g.version_of != 0);
        let new = if rate_grant {
            if continues {
                cur.saturating_add(g.tokens)
            } else {
                g.tokens
            }
        } else {
            let spent_since = at_send.saturating_sub(cur);
            g.tokens.saturating_sub(spent_since.min(g.carried))
        };
        // Keep the fractional part only for rate to rate (roughly as the agent).
        let slowed = quotalease_model::protocol::slowed_by_rho(g.rate_utps);
        let ns = if slowed == 0 {
            u64::MAX
        } else {
            u64::try_from(1_000_000_000_000_000u128.div_ceil(u128::from(slowed)))
                .unwrap_or(u64::MAX)
        };
        // A capacity the word cannot time is held smaller (lease_table.rs
        // `Refill::of_grant`), unless not even one token fits.
        let span_cap = ((1u64 << 38) - 1) / ns.max(1);
        let held_cap = if span_cap >= 1 {
            g.capacity.min(span_cap)
        } else {
            g.capacity
        };
        let fits = slowed > 0
            && ns < (1u64 << 40)
            && held_cap.checked_mul(ns).is_some_and(|x| x < (1u64 << 38));
        if rate_grant && !fits {
            // Held as tokens, clipped to the capacity (lease_table.rs).
            self.level_nt = u128::from(new.min(g.capacity)) * NT;
            self.cur = Some(MCur::RateNone(g.lease_id, use_by));
        } else if rate_grant {
            let n = new.min(held_cap);
            self.level_nt = u128::from(n) * NT;
            self.cur = Some(MCur::Rate(g.lease_id, g.rate_utps, held_cap, use_by));
        } else {
            self.level_nt = u128::from(new) * NT;
            self.cur = Some(MCur::Tokens(g.lease_id, g.tokens, use_by));
        }
        self.refilled_to_ns = now;
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn i1_holds_with_mixed_holders_and_late_replies(
        n in 1u64..40,
        period in prop_oneof![Just(1u64), Just(60u64)],
        burst in 1u64..60,
        ops in proptest::collection::vec(mop(), 1..500),
    ) {
        let r = rate(n, period);
        let ttl_ns = 500 * MS;
        let mut now = 0u64;
        let mut l = KeyLedger::new(r, burst, now, None);
        let mut hs: Vec<MHolder> = vec![MHolder::default(); MH as usize];
        let mut next_id = 1u64;
        let mut admitted: Vec<(u64, u64)> = Vec::new();
        for o in ops {
            match o {
                MOp::Advance(d) => { now += d * MS; l.advance(now); }
                MOp::Renew(h, want, rate_tps, lost, none) => {
                    let me = &mut hs[h as usize];
                    me.refill(now);
                    let named = if none { 0 } else { me.id() };
                    let at_send = me.tokens();
                    let spent = match me.cur {
                        Some(MCur::Tokens(_, granted, _)) => granted.saturating_sub(at_send),
                        _ => 0,
                    };
                    let g = l.renew(now, Renewal {
                        holder: h, lease_id: named, spent, want, ttl_ns,
                        new_id: next_id, want_rate_utps: rate_tps * 1_000_000 / period,
                        returned: 0,
                    }, SEC);
                    next_id += 1;
                    prop_assert!(!g.shadow_violation, "shadow bucket fired");
                    let tag = next_id;
                    next_id += 1;
                    if lost {
                        me.late.push((g, now, at_send, tag));
                        me.awaits = Some(tag);
                    } else {
                        me.awaits = None;
                        me.apply(&g, now, at_send, ttl_ns, now);
                    }
                }
                MOp::DeliverApply(h, i) | MOp::DeliverRelease(h, i) => {
                    let me = &mut hs[h as usize];
                    if i < me.late.len() {
                        let (g, sent, at, tag) = me.late.remove(i);
                        let awaited = me.awaits == Some(tag);
                        if awaited {
                            me.awaits = None;
                        }
                        if awaited && matches!(o, MOp::DeliverApply(..)) {
                            me.apply(&g, sent, at, ttl_ns, now);
                        } else if g.carried == 0 && g.version_of == 0 && g.lease_id != 0 {
                            l.release_with(now, h, g.lease_id, 0, g.tokens);
                        }
                    }
                }
                MOp::Spend(h, k) => {
                    let me = &mut hs[h as usize];
                    me.refill(now);
                    if me.usable(now) && me.level_nt >= u128::from(k) * NT {
                        me.level_nt -= u128::from(k) * NT;
                        admitted.push((now, k));
                    }
                }
                MOp::Drain(h) => {
                    let me = &mut hs[h as usize];
                    me.refill(now);
                    let k = me.tokens();
                    if me.usable(now) && k > 0 {
                        me.level_nt -= u128::from(k) * NT;
                        admitted.push((now, k));
                    }
                }
                MOp::Release(h) => {
                    let me = &mut hs[h as usize];
                    me.refill(now);
                    if me.usable(now) {
                        match me.cur {
                            Some(MCur::Rate(id, ..)) | Some(MCur::RateNone(id, _)) => { l.release_with(now, h, id, 0, me.tokens()); }
                            Some(MCur::Tokens(id, granted, _)) => { l.release(now, h, id, granted - me.tokens().min(granted)); }
                            None => {}
                        }
                    }
                    let late = std::mem::take(&mut me.late);
                    *me = MHolder { refilled_to_ns: now, late, awaits: None, ..MHolder::default() };
                }
                MOp::Restart => {
                    l = KeyLedger::new(r, burst, now, Some(now + ttl_ns));
                }
            }
            prop_assert!(l.i2_holds(), "I2 broken at {} ms", now / MS);
        }
        for i in 0..admitted.len() {
            let mut sum = 0u128;
            for j in i..admitted.len() {
                sum += u128::from(admitted[j].1);
                let t = u128::from(admitted[j].0 - admitted[i].0);
                prop_assert!(sum * 1_000_000_000 * u128::from(period) <= u128::from(burst) * 1_000_000_000 * u128::from(period) + u128::from(n) * t,
                    "I1: {} admitted in {} ms (from {} ms), bound {}", sum, t / 1_000_000, admitted[i].0 / MS,
                    burst as f64 + n as f64 * t as f64 / 1e9 / period as f64);
            }
        }
    }
}

/// Review: a slow rule's rate version that the agent's lease word cannot
/// hold as a bucket (capacity x ns per token >= 2^38 ns, agent
/// lease_table.rs `fits`) is held as tokens: no refill, but also no clip
/// to its capacity. A later version's tokens counted "in flight" on top of
/// the capacity join the level in full; once the holder names that version
/// the ledger counts only the capacity again, and refills `available` into
/// room the holder has already filled.
///
/// Since the agent holds a capacity its word cannot time smaller, a rule
/// of 1/m is held as a rate; one of 1 per 10 minutes (half of it: a token
/// per 20 minutes, slower than the word can time) is still held as tokens.
/// Both keep I1.
fn slow_rule_rate_version_keeps_i1(period: u64, held_as_tokens: bool) {
    let (r, burst) = (rate(1, period), 20u64);
    let ttl = 60 * SEC;
    let mut l = KeyLedger::new(r, burst, 0, None);
    let mut a = MHolder::default();
    let mut now = 0u64;
    let mut id = 1u64;
    // A asks half the rate.
    let half = 1_000_000 / (2 * period);
    let ask = |l: &mut KeyLedger, a: &mut MHolder, now: u64, want: u64, id: &mut u64| {
        let at = a.tokens();
        let g = l.renew(
            now,
            Renewal {
                holder: 1,
                lease_id: a.id(),
                spent: 0,
                want,
                ttl_ns: ttl,
                new_id: *id,
                want_rate_utps: half,
                returned: 0,
            },
            SEC,
        );
        *id += 1;
        a.apply(&g, now, at, ttl, now);
        g
    };
    let g1 = ask(&mut l, &mut a, now, 10, &mut id);
    eprintln!("v1 {g1:?} level {}", a.tokens());
    let g2 = ask(&mut l, &mut a, now, 10, &mut id);
    eprintln!("v2 {g2:?} level {}", a.tokens());
    assert_eq!(
        matches!(a.cur, Some(MCur::RateNone(..))),
        held_as_tokens,
        "held as tokens: {:?}",
        a.cur
    );
    if let Some(MCur::Rate(_, rate_utps, cap, _)) = a.cur {
        // Held no larger than the agent's word can refill.
        let ns =
            1_000_000_000_000_000u64.div_ceil(quotalease_model::protocol::slowed_by_rho(rate_utps));
        assert!(cap * ns < 1 << 38, "{cap} at {rate_utps}");
    }
    // A keeps its chain alive, naming the latest version, asking nothing.
    let mut admitted = Vec::new();
    for _ in 0..20 {
        now += 30 * SEC;
        ask(&mut l, &mut a, now, 0, &mut id);
    }
    l.advance(now);
    eprintln!(
        "after 10 min: A level {}, available {}, outstanding {}",
        a.tokens(),
        l.available(),
        l.outstanding()
    );
    // C (tokens only) takes what `available` refilled.
    let gc = l.renew(
        now,
        Renewal {
            holder: 2,
            lease_id: 0,
            spent: 0,
            want: 20,
            ttl_ns: ttl,
            new_id: id,
            want_rate_utps: 0,
            returned: 0,
        },
        SEC,
    );
    // Both spend everything at this instant.
    let ka = a.tokens();
    assert!(a.usable(now));
    admitted.push((now, ka));
    admitted.push((now, gc.fresh));
    let sum: u64 = admitted.iter().map(|x| x.1).sum();
    assert!(
        sum <= burst,
        "I1: {sum} admitted at one instant ({ka} by A, {} by C), bound {burst} (rule 1/{period}s)",
        gc.fresh
    );
}

#[test]
fn a_rate_version_of_a_slow_rule_keeps_i1() {
    slow_rule_rate_version_keeps_i1(60, false);
}

#[test]
fn a_rate_version_held_as_tokens_of_a_very_slow_rule_keeps_i1() {
    slow_rule_rate_version_keeps_i1(600, true);
}

/// Review: the same at default lease lengths, a rule of 2/s burst 600 and
/// one agent whose burst of demand stops just after its second version: a
/// capacity of 300 at 1/s is a 300 s span (>= 2^38 ns): it was held as
/// tokens, the agent now holds it as a rate of a smaller capacity (agents
/// do not ask for rates at 2/s burst 600 any more, but an allocator may
/// still grant such a version to one that asks at a larger burst share).
#[test]
fn a_rate_version_at_2_per_s_burst_600_keeps_i1() {
    let (r, burst) = (rate(2, 1), 600u64);
    let ttl = 2 * SEC;
    let mut l = KeyLedger::new(r, burst, 0, None);
    let mut a = MHolder::default();
    let mut id = 1u64;
    let ask = |l: &mut KeyLedger, a: &mut MHolder, now: u64, want: u64, id: &mut u64| {
        let at = a.tokens();
        let g = l.renew(
            now,
            Renewal {
                holder: 1,
                lease_id: a.id(),
                spent: 0,
                want,
                ttl_ns: ttl,
                new_id: *id,
                want_rate_utps: 1_000_000,
                returned: 0,
            },
            SEC,
        );
        *id += 1;
        a.apply(&g, now, at, ttl, now);
        g
    };
    let g1 = ask(&mut l, &mut a, 0, 300, &mut id);
    let g2 = ask(&mut l, &mut a, MS, 300, &mut id);
    // The agent holds a capacity its word cannot time smaller (274 of
    // 300), as a rate that refills (it was held as tokens).
    assert!(
        matches!(a.cur, Some(MCur::Rate(_, _, cap, _)) if cap < 300),
        "held as a smaller rate: {:?}",
        a.cur
    );
    eprintln!(
        "v1 cap {} fresh {}; v2 cap {} fresh {}; A's level {}",
        g1.capacity,
        g1.fresh,
        g2.capacity,
        g2.fresh,
        a.tokens()
    );
    // The next renewal names v2 (the agent asks at least 1).
    let now = SEC;
    ask(&mut l, &mut a, now, 1, &mut id);
    let now = now + 1_990 * MS; // before A's use-by (first send + 2 s (1 - 2 rho) - 1 ms)
    l.advance(now);
    let gc = l.renew(
        now,
        Renewal {
            holder: 2,
            lease_id: 0,
            spent: 0,
            want: 50,
            ttl_ns: ttl,
            new_id: id,
            want_rate_utps: 0,
            returned: 0,
        },
        SEC,
    );
    assert!(a.usable(now));
    let sum = a.tokens() + gc.fresh;
    assert!(
        sum <= burst,
        "I1: {sum} admitted at one instant ({} by A, {} by C), bound {burst}",
        a.tokens(),
        gc.fresh
    );
}

#[test]
fn releasing_a_version_given_up_on_keeps_the_held_version_counted() {
    // The allocator met an agent's two requests for a key in the other
    // order: B (sent after the agent gave up on A) got version 1, which the
    // agent installed and spends; A got version 2, whose late reply the
    // agent releases. Releasing version 2 took version 1 out of the count
    // too (every older version went): another holder got the whole burst
    // and rate while the first still refilled version 1 (I1 broken).
    let (r, burst, ttl_ns) = (rate(4, 1), 4u64, 500 * MS);
    let mut l = KeyLedger::new(r, burst, 0, None);
    let ask = |holder, new_id| Renewal {
        holder,
        lease_id: 0,
        spent: 0,
        want: 4,
        ttl_ns,
        new_id,
        want_rate_utps: 4_000_000,
        returned: 0,
    };
    let b = l.renew(0, ask(3, 1), SEC);
    assert_eq!((b.capacity, b.tokens), (4, 4));
    let a = l.renew(0, ask(3, 2), SEC);
    assert_eq!(a.version_of, 0, "a first version");
    l.release_with(0, 3, a.lease_id, 0, a.tokens);
    assert_eq!(l.outstanding(), 4, "version 1 still counts");
    let other = l.renew(0, ask(4, 3), SEC);
    assert_eq!(other.capacity, 0, "{other:?}");
    // Released itself (with what it has left), it stops counting.
    l.release_with(100 * MS, 3, b.lease_id, 0, 0);
    assert_eq!(l.outstanding(), 0);
    assert!(l.i2_holds());
}

/// A key served centrally (`5/m burst 5`, docs/protocol.md "Slow rules,
/// served centrally"): six holders asking a token each at once are served
/// first come, first served, so all five tokens go out; the sixth is told
/// the next token's instant, 12 s (at `R`, as a client is told: never
/// later than the token can exist), with no economy wait added, before
/// and after the five report their tokens spent.
#[test]
fn a_key_served_centrally_grants_first_come_and_hints_the_next_token() {
    let r = rate(5, 60);
    assert!(r.served_centrally());
    let mut l = KeyLedger::new(r, 5, T0, Some(0));
    let mut leases = Vec::new();
    for h in 1..=5u32 {
        let g = l.renew(T0, renewal(h, 0, 0, 1, u64::from(h)), SEC);
        assert_eq!((g.tokens, g.retry_after_ms), (1, 0), "holder {h}");
        leases.push(g.lease_id);
    }
    let g = l.renew(T0, renewal(6, 0, 0, 1, 6), SEC);
    assert_eq!((g.tokens, g.retry_after_ms), (0, 12_000), "{g:?}");
    for (h, id) in (1..=5u32).zip(&leases) {
        assert_eq!(l.release(T0 + SEC, h, *id, 1), Some(0));
    }
    // Reported a second late, the refill starts then: while the five were
    // outstanding the bucket was full by its count (I2 caps the refill at
    // `B - outstanding`), which is why holders of such keys report at once.
    let g = l.renew(T0 + SEC, renewal(6, 0, 0, 1, 7), SEC);
    assert_eq!((g.tokens, g.retry_after_ms), (0, 12_000), "{g:?}");
    // Two tokens asked for when the first exists (the root refills at
    // R (1 - rho)): the one that exists now, and the next one's instant.
    let t = T0 + SEC + at_root_rate(12 * SEC);
    let g = l.renew(t, renewal(6, 0, 0, 2, 8), SEC);
    assert_eq!(g.tokens, 1, "a partial grant: what exists now");
    assert!((11_900..=12_000).contains(&g.retry_after_ms), "{g:?}");
}

/// The same key not served centrally (`10/s burst 5`) keeps its max-min
/// fair shares and economy waits.
#[test]
fn a_leased_key_keeps_fair_shares_and_economy_waits() {
    let r = rate(10, 1);
    assert!(!r.served_centrally());
    let mut l = KeyLedger::new(r, 5, T0, Some(0));
    let g = l.renew(T0, renewal(1, 0, 0, 5, 1), SEC);
    assert_eq!(g.tokens, 5);
    let g = l.renew(T0, renewal(2, 0, 0, 5, 2), SEC);
    assert_eq!(g.tokens, 0);
    assert!(g.retry_after_ms >= 100, "an economy wait: {g:?}");
}

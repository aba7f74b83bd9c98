//! The slot ledger: unit cases, and a property test against a model of
//! what each holder may be using.

use std::collections::HashMap;

use proptest::prelude::*;

use super::*;

const TTL: u64 = 2_000_000_000;

fn ask(holder: HolderId, lease_id: u64, keep: u64, want: u64, new_id: u64) -> SlotAsk {
    SlotAsk {
        holder,
        lease_id,
        keep,
        want,
        ttl_ns: TTL,
        new_id,
        fences: 0,
        resume: false,
    }
}

#[test]
fn slots_are_lent_up_to_n_and_come_back_on_release_and_expiry() {
    let mut l = SlotLedger::new(5, 100);
    let a = l.ask(0, ask(1, 0, 0, 3, 10));
    assert_eq!((a.lease_id, a.slots, a.fresh, a.fence), (10, 3, 3, 101));
    let b = l.ask(1, ask(2, 0, 0, 4, 11));
    assert_eq!(b.slots, 2, "only N - held = 2 left");
    assert!(b.contended, "holder 2 still misses 2");
    assert_eq!(b.fence, 102);
    assert_eq!(l.held(), 5);
    // Holder 1 releases: its 3 slots are free at once.
    assert!(l.release(2, 1, 10));
    assert!(!l.release(3, 1, 10), "a duplicate release changes nothing");
    assert_eq!(l.held(), 2);
    // Holder 2's lease expires unrenewed: its slots are free at expiry.
    l.advance(1 + TTL - 1);
    assert_eq!(l.held(), 2);
    l.advance(1 + TTL);
    assert_eq!(l.held(), 0);
}

/// `holders` holders (1, 2, ...) ask round after round, `every_ns`
/// apart, each renewing its lease keeping all of it and wanting
/// `want(kept)` more; new lease ids from `first_id` on.
fn ask_in_rounds(
    l: &mut SlotLedger,
    holders: u32,
    rounds: u64,
    every_ns: u64,
    first_id: u64,
    want: impl Fn(u64) -> u64,
) {
    let mut leases = vec![0u64; holders as usize];
    let mut id = first_id;
    for round in 0..rounds {
        for h in 0..holders {
            let i = h as usize;
            let kept = l
                .leases()
                .iter()
                .find(|x| x.id == leases[i])
                .map_or(0, |x| x.slots);
            id += 1;
            let at = round * every_ns + u64::from(h);
            let g = l.ask(at, ask(h + 1, leases[i], kept, want(kept), id));
            if g.lease_id != 0 {
                leases[i] = g.lease_id;
            }
        }
    }
}

/// Three holders that each want 20 of `N` = 32 from the start (their
/// asks first met the restart's phantom) get all 32 between them: the
/// max-min share is rounded up. A floor (10 each) left 2 slots unlent for
/// as long as they all wanted more; in the simulator, through three
/// regions at 1.5 x `N`, slots in use 96.6 % -> 97.7 %.
#[test]
fn shares_rounded_up_lend_all_of_n() {
    const MS: u64 = 1_000_000;
    let mut l = SlotLedger::after_restart(32, 0, 10 * MS, 1_000);
    ask_in_rounds(&mut l, 3, 4, 10 * MS, 1_000, |_| 20);
    assert_eq!(l.held(), 32, "{:?}", l.leases());
    let mut each: Vec<u64> = l.leases().iter().map(|x| x.slots).collect();
    each.sort_unstable();
    assert_eq!(each, vec![10, 11, 11]);
}

/// A holder that keeps wanting could keep all `N` for good (kept slots
/// are never cut): once another holder has starved for `STARVE_NS`, the
/// grants carry max-min shares, the big holder drains to its share, and
/// the starved one gets the rest; then shares stop.
#[test]
fn a_starving_holder_makes_grants_carry_shares_until_it_holds_its_own() {
    const MS: u64 = 1_000_000;
    let mut l = SlotLedger::new(8, 0);
    let mut id = 10;
    let mut next = || {
        id += 1;
        id
    };
    let a = l.ask(0, ask(1, 0, 0, 8, next()));
    assert_eq!(a.slots, 8);
    // Holder 2 misses 4 slots at every ask (once a tick); holder 1 keeps
    // all 8 and wants 4 more.
    let mut a_lease = a.lease_id;
    let mut t = 0;
    while t < STARVE_NS {
        t += 50 * MS;
        let b = l.ask(t, ask(2, 0, 0, 4, next()));
        assert_eq!(b.slots, 0);
        let a = l.ask(t + MS, ask(1, a_lease, 8, 4, next()));
        a_lease = a.lease_id;
        if t + MS < STARVE_NS {
            assert_eq!(a.share, None, "not starving yet at {t}: {a:?}");
        }
    }
    // Holder 2 has starved for a second: holder 1 is told its share (of
    // demands 12 and 4: 4 each)...
    t += 50 * MS;
    let b = l.ask(t, ask(2, 0, 0, 4, next()));
    assert_eq!((b.slots, b.share), (0, Some(4)), "{b:?}");
    let a = l.ask(t + MS, ask(1, a_lease, 8, 4, next()));
    assert_eq!(
        (a.slots, a.share),
        (8, Some(4)),
        "kept slots are not cut: {a:?}"
    );
    // ... and gives back what it holds beyond it as its permits end (it
    // keeps 4): holder 2 gets them, holds its share, and shares stop.
    let a = l.ask(t + 2 * MS, ask(1, a.lease_id, 4, 4, next()));
    assert_eq!((a.slots, a.fresh), (4, 0), "{a:?}");
    let b = l.ask(t + 3 * MS, ask(2, 0, 0, 4, next()));
    assert_eq!((b.slots, b.share), (4, None), "{b:?}");
}

#[test]
fn kept_slots_are_never_cut_and_the_rest_is_free_at_once() {
    let mut l = SlotLedger::new(4, 0);
    let g = l.ask(0, ask(1, 0, 0, 4, 1));
    assert_eq!(g.slots, 4);
    // Keep 1 of 4 (one permit runs): 3 free now.
    let g = l.ask(10, ask(1, 1, 1, 0, 2));
    assert_eq!((g.lease_id, g.slots, g.kept, g.fresh), (2, 1, 1, 0));
    assert_eq!(l.held(), 1);
    // Keep more than the lease had: capped at the lease.
    let g = l.ask(20, ask(1, 2, 9, 0, 3));
    assert_eq!(g.kept, 1);
    // Naming a lease that is not this holder's keeps nothing.
    let g = l.ask(30, ask(2, 3, 1, 0, 4));
    assert_eq!((g.lease_id, g.kept), (0, 0));
    assert_eq!(l.held(), 1);
}

#[test]
fn a_lowered_n_keeps_kept_slots_and_grants_nothing_fresh_until_under_it() {
    let mut l = SlotLedger::new(6, 0);
    l.ask(0, ask(1, 0, 0, 3, 1));
    l.ask(0, ask(2, 0, 0, 3, 2));
    l.set_n(2);
    // Holder 1 keeps its 3 (permits may stand on them): over N.
    let g = l.ask(10, ask(1, 1, 3, 1, 3));
    assert_eq!((g.kept, g.fresh), (3, 0));
    assert!(g.over);
    assert_eq!(l.held(), 6);
    // Holder 2 gives back everything: still 3 > 2 held, nothing fresh.
    assert!(l.release(20, 2, 2));
    let g = l.ask(30, ask(2, 0, 0, 1, 4));
    assert_eq!(g.fresh, 0);
    // Holder 1 keeps 1: now 1 < 2, one fresh for holder 2.
    l.ask(40, ask(1, 3, 1, 0, 5));
    let g = l.ask(50, ask(2, 0, 0, 1, 6));
    assert_eq!(g.fresh, 1);
    assert!(!g.over);
}

#[test]
fn the_phantom_holds_every_slot_until_its_end() {
    let mut l = SlotLedger::after_restart(3, 1 << 40, 1_000, 1);
    assert_eq!(l.ask(999, ask(1, 0, 0, 1, 1)).fresh, 0);
    let g = l.ask(1_000, ask(1, 0, 0, 1, 2));
    assert_eq!(g.fresh, 1);
    assert_eq!(g.fence, (1 << 40) + 1, "fencing starts above the base");
}

#[test]
fn a_predecessors_lease_is_adopted_once_out_of_the_phantom() {
    // N = 5; the predecessor's ids are below 100, ours from 100.
    let mut l = SlotLedger::after_restart(5, 0, 1_000, 100);
    // Holder 1 renews its predecessor lease 7 keeping 2 (permits on it)
    // and wants 1 more: the 2 are adopted, nothing fresh yet.
    let g = l.ask(10, ask(1, 7, 2, 1, 100));
    assert_eq!((g.lease_id, g.slots, g.kept, g.fresh), (100, 2, 2, 0));
    assert!(
        g.expires_ns >= 1_000,
        "an adopted lease outlives the phantom"
    );
    assert_eq!(l.held(), 5, "adopted 2 + phantom 3");
    // The same predecessor lease again (a duplicate from another path):
    // nothing more out of the phantom.
    let g = l.ask(20, ask(2, 7, 2, 0, 101));
    assert_eq!((g.lease_id, g.kept), (0, 0));
    // Our own id (expired or never ours) is not adopted.
    let g = l.ask(30, ask(2, 150, 2, 0, 102));
    assert_eq!(g.kept, 0);
    // Keeping more than the phantom holds adopts only what it holds.
    let g = l.ask(40, ask(3, 8, 9, 0, 103));
    assert_eq!(g.kept, 3);
    assert_eq!(l.held(), 5);
    // A release during the phantom's time frees nothing for others.
    assert!(l.release(50, 3, 103));
    assert_eq!(l.ask(60, ask(2, 0, 0, 3, 104)).fresh, 0);
    // The adopted lease renews like any other, past the phantom's end.
    let g = l.ask(900, ask(1, 100, 2, 0, 105));
    assert_eq!((g.kept, g.slots), (2, 2));
    // At the phantom's end the rest is free; the adopted 2 stay held.
    l.advance(1_000);
    assert_eq!(l.held(), 2, "the phantom is gone, the adopted lease stays");
    let g = l.ask(1_000, ask(2, 0, 0, 5, 106));
    assert!(g.fresh > 0, "fresh slots once the phantom has ended");
    assert!(l.held() <= 5);
    // Predecessor ids are no longer adopted once its leases are gone.
    let g = l.ask(1_100, ask(4, 9, 1, 0, 107));
    assert_eq!(g.kept, 0);
}

/// An adopted lease may name a lease the predecessor had already replaced
/// (a duplicated ask): the holder then runs its permits on the
/// replacement, which only the phantom counts. So the adopted slots stay
/// out of the phantom until its end, whatever TTL was asked, and nothing
/// fresh is granted before it.
#[test]
fn adopted_slots_stay_counted_until_the_phantoms_end() {
    let until = 3 * TTL;
    let mut l = SlotLedger::after_restart(5, 0, until, 100);
    let g = l.ask(0, ask(1, 7, 2, 0, 100));
    assert_eq!(g.kept, 2);
    assert_eq!(g.expires_ns, until, "a TTL shorter than the phantom's time");
    l.advance(TTL + 1);
    assert_eq!(l.held(), 5);
    assert!(l.release(TTL + 2, 1, 100));
    assert_eq!(l.ask(TTL + 3, ask(2, 0, 0, 5, 101)).fresh, 0);
    assert_eq!(l.ask(until, ask(2, 0, 0, 5, 102)).fresh, 5);
}

#[test]
fn a_lost_state_adds_a_phantom_beside_the_known_leases() {
    let mut l = SlotLedger::new(4, 0);
    l.ask(0, ask(1, 0, 0, 2, 100));
    l.predecessor_lost(1_000, 100);
    assert_eq!(l.held(), 6, "2 known + N phantom");
    assert_eq!(l.ask(10, ask(2, 0, 0, 1, 101)).fresh, 0);
    // A lease of the lost predecessor adopts out of the phantom.
    assert_eq!(l.ask(20, ask(3, 5, 1, 0, 102)).kept, 1);
    l.advance(1_000);
    assert_eq!(l.held(), 3);
}

#[test]
fn slots_move_to_where_demand_is_max_min() {
    let mut l = SlotLedger::new(10, 0);
    // Holder 1 takes all 10 while alone.
    assert_eq!(l.ask(0, ask(1, 0, 0, 10, 1)).slots, 10);
    // Holder 2 wants 6: nothing free, contended.
    let g = l.ask(1, ask(2, 0, 0, 6, 2));
    assert_eq!(g.fresh, 0);
    assert!(g.contended);
    // Holder 1, told so, keeps only its 3 in use (demand 3).
    let g = l.ask(2, ask(1, 1, 3, 0, 3));
    assert!(g.contended, "holder 2's want is still unmet");
    // Holder 2 now gets its 6 (demands 3 and 6 fit in 10).
    let g = l.ask(3, ask(2, 0, 0, 6, 4));
    assert_eq!(g.fresh, 6);
    // A third holder wanting 5: 1 free; max-min level over 3, 6, 5 in 10
    // is 3, so it gets 1 now (all that is free) and more as 2 gives back.
    let g = l.ask(4, ask(3, 0, 0, 5, 5));
    assert_eq!(g.fresh, 1);
    // Holder 2 renews keeping 6 and asking nothing: level 3 < its 6; it
    // is told others wait.
    let g = l.ask(5, ask(2, 4, 6, 0, 6));
    assert!(g.contended);
}

/// One step of a holder's or the clock's life.
#[derive(Clone, Debug)]
enum Op {
    /// Holder `h` asks, keeping `keep` (drawn 0..=slots+1) and wanting
    /// `want`; the reply is lost when `lost`.
    Ask {
        h: HolderId,
        keep: u64,
        want: u64,
        lost: bool,
    },
    /// Holder `h` releases its lease (`dup`: the previous one, again).
    Release { h: HolderId, dup: bool },
    /// Time passes.
    Wait { ns: u64 },
    /// `N` changes.
    SetN { n: u64 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u32..4, 0u64..8, 0u64..6, proptest::bool::weighted(0.2))
            .prop_map(|(h, keep, want, lost)| Op::Ask { h, keep, want, lost }),
        1 => (0u32..4, any::<bool>()).prop_map(|(h, dup)| Op::Release { h, dup }),
        3 => (0u64..TTL).prop_map(|ns| Op::Wait { ns }),
        1 => (1u64..8).prop_map(|n| Op::SetN { n }),
    ]
}

/// What a holder believes it holds, and the most it may run on it.
#[derive(Clone, Copy, Debug, Default)]
struct Holder {
    /// The lease it knows of (id, slots, expiry), from its last reply.
    known: Option<(u64, u64, u64)>,
    /// Its promise since an ask whose reply was lost: at most this many.
    promise: Option<u64>,
    /// The lease it released last (for duplicate releases).
    released: Option<u64>,
}

impl Holder {
    /// The most slots it may be running at `t`.
    fn usable(&self, t: u64) -> u64 {
        match self.known {
            Some((_, slots, exp)) if t < exp => slots.min(self.promise.unwrap_or(u64::MAX)),
            _ => 0,
        }
    }
}

/// The ledger's count of `h`'s slots at `t` (without advancing it).
fn counted(l: &SlotLedger, h: HolderId, t: u64) -> u64 {
    l.leases()
        .iter()
        .filter(|x| x.holder == h && x.expires_ns > t)
        .map(|x| x.slots)
        .sum()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn the_ledger_counts_every_slot_a_holder_may_run_and_never_grants_past_n(
        n0 in 1u64..8,
        ops in proptest::collection::vec(op(), 1..80),
    ) {
        let mut l = SlotLedger::new(n0, 0);
        let mut holders: HashMap<HolderId, Holder> = HashMap::new();
        let mut now = 0u64;
        let mut next_id = 1u64;
        let mut fence = 0u64;
        for op in ops {
            match op {
                Op::Ask { h, keep, want, lost } => {
                    let st = holders.entry(h).or_default();
                    let lease_id = st.known.map_or(0, |k| k.0);
                    let before = { l.advance(now); l.held() };
                    let g = l.ask(now, ask(h, lease_id, keep, want, next_id));
                    next_id += 1;
                    // Never past max(N, held before).
                    prop_assert!(l.held() <= l.n().max(before),
                        "held {} > max(N {}, before {})", l.held(), l.n(), before);
                    prop_assert!(g.fresh <= want);
                    // Each grant of slots takes a larger fencing number.
                    if g.slots > 0 {
                        prop_assert!(g.fence > fence);
                        fence = g.fence;
                    } else {
                        prop_assert_eq!(g.fence, 0);
                    }
                    // The holder promised at most `keep` from the send.
                    let st = holders.get_mut(&h).expect("holder");
                    if lost {
                        st.promise = Some(st.promise.unwrap_or(u64::MAX).min(keep));
                    } else {
                        st.known = (g.lease_id != 0).then_some((g.lease_id, g.slots, g.expires_ns));
                        st.promise = None;
                    }
                }
                Op::Release { h, dup } => {
                    let st = holders.entry(h).or_default();
                    if dup {
                        if let Some(id) = st.released {
                            prop_assert!(!l.release(now, h, id), "a duplicate release applied");
                        }
                    } else if let Some((id, _, _)) = st.known.take() {
                        l.release(now, h, id);
                        st.released = Some(id);
                        st.promise = None;
                    }
                }
                Op::Wait { ns } => now += ns,
                Op::SetN { n } => l.set_n(n),
            }
            // At now, and just before every expiry the holders know of,
            // the ledger counts at least what each holder may run.
            l.advance(now);
            let mut instants = vec![now];
            instants.extend(holders.values().filter_map(|s| s.known.map(|k| k.2.saturating_sub(1))).filter(|t| *t >= now));
            for t in instants {
                for (h, st) in &holders {
                    prop_assert!(counted(&l, *h, t) >= st.usable(t),
                        "holder {h} may run {} at {t}, the ledger counts {}", st.usable(t), counted(&l, *h, t));
                }
            }
        }
        // Nothing leaks: once every lease has expired, all slots are free.
        l.advance(now + 2 * TTL);
        prop_assert_eq!(l.held(), 0);
    }
}

#[test]
fn a_duplicated_ask_is_applied_once() {
    // Review finding: the same ask twice made two leases with one id.
    let mut l = SlotLedger::new(5, 0);
    l.ask(0, ask(1, 0, 0, 3, 1));
    let a = l.ask(10, ask(1, 1, 3, 1, 2));
    let b = l.ask(20, ask(1, 1, 3, 1, 2));
    assert_eq!(
        a,
        SlotGrant {
            contended: b.contended,
            over: b.over,
            ..b
        }
    );
    assert_eq!(l.leases().iter().filter(|x| x.id == 2).count(), 1);
    assert_eq!(l.held(), 4);
    // Once renewed, a late copy of the old ask changes nothing.
    l.ask(30, ask(1, 2, 4, 0, 3));
    let late = l.ask(40, ask(1, 1, 3, 1, 2));
    assert_eq!((late.lease_id, late.slots), (0, 0));
    assert_eq!(l.held(), 4);
}

#[test]
fn kept_slots_outlive_a_shorter_ttl_until_their_old_lease_ends() {
    // Review finding: a renewal with a shorter TTL cut the kept slots.
    let mut l = SlotLedger::new(2, 0);
    l.ask(0, ask(1, 0, 0, 2, 1));
    let g = l.ask(
        100,
        SlotAsk {
            ttl_ns: 500_000_000,
            ..ask(1, 1, 2, 0, 2)
        },
    );
    assert_eq!((g.kept, g.expires_ns), (2, TTL));
    assert_eq!(l.ask(600_000_000, ask(2, 0, 0, 2, 3)).fresh, 0);
    assert_eq!(l.ask(TTL, ask(2, 0, 0, 2, 4)).fresh, 2);
}

#[test]
fn a_forced_release_frees_any_holders_lease_but_never_the_phantom() {
    let mut l = SlotLedger::after_restart(4, 0, 1_000, 100);
    assert_eq!(
        l.force_release(0, 0),
        None,
        "the phantom is not a lease to free"
    );
    l.advance(1_000);
    l.ask(1_000, ask(1, 0, 0, 3, 100));
    let freed = l.force_release(1_001, 100).expect("held");
    assert_eq!((freed.holder, freed.slots), (1, 3));
    assert_eq!(l.held(), 0);
    assert_eq!(l.force_release(1_002, 100), None, "once");
    // The holder's next ask naming it keeps nothing.
    assert_eq!(l.ask(1_003, ask(1, 100, 3, 0, 101)).kept, 0);
}

#[test]
fn a_grant_takes_a_block_of_fencing_numbers_when_asked() {
    let mut l = SlotLedger::new(5, 100);
    let a = l.ask(
        0,
        SlotAsk {
            fences: 64,
            ..ask(1, 0, 0, 1, 1)
        },
    );
    let b = l.ask(0, ask(2, 0, 0, 1, 2));
    assert_eq!((a.fence, b.fence), (101, 165), "a's block is 101..=164");
    let c = l.ask(
        0,
        SlotAsk {
            fences: 1 << 40,
            ..ask(3, 0, 0, 1, 3)
        },
    );
    let d = l.ask(0, ask(4, 0, 0, 1, 4));
    assert_eq!(d.fence, c.fence + MAX_FENCES_PER_GRANT, "blocks are capped");
}

/// Found in review (session 33): `N` = 1, two holders each want the one
/// slot and ask again every 50 ms (agents whose waiters miss it); the
/// first cut of rounded-up shares capped both at 0 and the free slot was
/// never lent (the permit swarm's N = 1 seeds failed liveness).
#[test]
fn with_n_1_two_holders_wanting_the_slot_get_it_in_turn() {
    const MS: u64 = 1_000_000;
    assert_eq!(share_cap(vec![1, 1], 1), 1);
    assert_eq!(share_cap(vec![1, 1, 1], 2), 1);
    let mut l = SlotLedger::new(1, 0);
    assert_eq!(l.ask(0, ask(1, 0, 0, 1, 5)).slots, 1);
    assert_eq!(l.ask(MS, ask(2, 0, 0, 1, 6)).slots, 0);
    // Holder 1's permit ends and another of its waiters wants the slot:
    // it gives its lease back and asks again.
    let g = l.ask(2 * MS, ask(1, 5, 0, 1, 7));
    assert_eq!((g.slots, l.held()), (1, 1), "{g:?}");
}

/// Found in review (session 33): four holders each wanting 3 of `N` =
/// 10 get all 10 between them (the shares rounded up one by one capped
/// them at 2: 8 held).
#[test]
fn four_holders_wanting_three_of_ten_get_all_ten() {
    assert_eq!(share_cap(vec![3, 3, 3, 3], 10), 3);
    let mut l = SlotLedger::new(10, 0);
    ask_in_rounds(&mut l, 4, 5, 50_000_000, 10, |kept| 3 - kept);
    assert_eq!(l.held(), 10);
}

/// A `resume` folds every other lease the holder has (its predecessors',
/// made its own by `reassign`) into the new one, beside what it keeps of
/// the lease it names: their slots stay counted, expiring no earlier, and
/// the grant says how many were folded.
#[test]
fn a_resume_folds_the_holders_other_leases_into_the_new_one() {
    let mut l = SlotLedger::new(10, 0);
    l.ask(0, ask(1, 0, 0, 3, 100));
    // A second lease (an ask whose reply was lost), and another holder's.
    l.ask(500, ask(1, 0, 0, 2, 101));
    l.ask(600, ask(2, 0, 0, 4, 102));
    // A third holder (the asker's new process) holds 1 and takes over
    // holder 1's leases.
    l.ask(650, ask(3, 0, 0, 1, 103));
    assert_eq!(l.held(), 10);
    l.reassign(&[1], 3);
    let g = l.ask(
        700,
        SlotAsk {
            resume: true,
            ..ask(3, 103, 1, 0, 104)
        },
    );
    assert_eq!(
        (g.lease_id, g.kept, g.folded, g.fresh, g.slots),
        (104, 6, 5, 0, 6),
        "{g:?}"
    );
    assert!(
        g.expires_ns >= 500 + TTL,
        "no earlier than the latest folded"
    );
    assert_eq!(
        l.held(),
        10,
        "holder 2's lease untouched, nothing counted twice"
    );
    assert_eq!(l.leases().len(), 2);
    // A duplicate of the resume is answered the same.
    let d = l.ask(
        710,
        SlotAsk {
            resume: true,
            ..ask(3, 103, 1, 0, 104)
        },
    );
    assert_eq!((d.kept, d.folded), (6, 5));
    // Nothing left to fold: a resume keeps only what it names.
    let g = l.ask(
        800,
        SlotAsk {
            resume: true,
            ..ask(3, 104, 6, 0, 105)
        },
    );
    assert_eq!((g.kept, g.folded), (6, 0));
    // Without `resume`, an ask naming no lease keeps nothing.
    let g = l.ask(900, ask(2, 0, 0, 1, 106));
    assert_eq!(g.kept, 0);
    assert_eq!(l.held(), 10);
}

/// A regional's pool: a child naming a predecessor's lease waits for a
/// resume (once per resume); then a phantom of exactly what the parent
/// folded holds those slots, the child's renewal adopts out of it (never
/// told an expiry past the pool's cap), and fresh slots are lent beside it.
#[test]
fn a_resumed_pool_adopts_the_predecessors_leases_and_lends_beside_them() {
    let mut pool = SlotLedger::new_pool(0);
    pool.await_resume(1_000);
    assert!(!pool.needs_resume(0), "no lease named");
    assert!(!pool.needs_resume(1_000), "an id of ours");
    assert!(!pool.resume_wanted());
    assert!(pool.needs_resume(7), "a predecessor's id");
    assert!(pool.resume_wanted());
    assert!(!pool.is_idle(), "a pool a child waits on stays");
    // The resume's grant: 5 slots, 3 of them folded from the predecessor.
    let cap = TTL;
    pool.set_pool(5, cap, 40, 16, false);
    pool.resumed(3, 3 * TTL);
    assert!(!pool.resume_wanted());
    assert!(!pool.needs_resume(7), "adoptable now");
    assert_eq!((pool.held(), pool.room(10)), (3, 2));
    // The child renews its predecessor lease 7 keeping 2: adopted, and no
    // new permit on it while the phantom stands.
    let g = pool.ask(10, ask(1, 7, 2, 0, 1_000));
    assert_eq!((g.lease_id, g.kept, g.fresh), (1_000, 2, 0));
    assert!(g.over);
    assert!(g.expires_ns <= cap, "told no expiry past the cap: {g:?}");
    assert_eq!(pool.held(), 3, "out of the phantom");
    // Fresh slots beside the phantom: 2, not more.
    let g = pool.ask(20, ask(2, 0, 0, 4, 1_001));
    assert_eq!(g.fresh, 2);
    assert_eq!(pool.held(), 5);
    // The adopted lease stays counted until the phantom's end, past the
    // TTL it was told.
    pool.set_pool(5, 4 * TTL, 0, 0, false);
    pool.advance(2 * TTL);
    assert_eq!(
        pool.held(),
        3,
        "phantom 1 + adopted 2; the fresh lease expired"
    );
    pool.advance(3 * TTL);
    assert_eq!(pool.held(), 0);
}

/// A child whose predecessor's lease no resume covered (nothing was left
/// at the parent) waits for one resume only, then keeps nothing; a later
/// child of another predecessor makes the pool resume again, and the
/// phantom grows by what that resume folded.
#[test]
fn each_uncovered_predecessor_lease_waits_for_one_resume() {
    let mut pool = SlotLedger::new_pool(0);
    pool.await_resume(1_000);
    pool.set_pool(2, TTL, 0, 0, false);
    assert!(pool.needs_resume(7));
    assert!(pool.needs_resume(7), "until a resume is answered");
    pool.resumed(0, 3 * TTL);
    assert!(!pool.needs_resume(7), "tried once");
    let g = pool.ask(10, ask(1, 7, 2, 1, 1_000));
    assert_eq!((g.kept, g.fresh), (0, 1));
    // Another predecessor's child (the pool's parent lease grew by 2).
    assert!(pool.needs_resume(8));
    pool.set_pool(4, TTL, 0, 0, false);
    pool.resumed(2, 3 * TTL);
    assert_eq!(pool.held(), 3, "the fresh 1 and a phantom of 2");
    assert_eq!(pool.ask(20, ask(2, 8, 2, 0, 1_001)).kept, 2);
}

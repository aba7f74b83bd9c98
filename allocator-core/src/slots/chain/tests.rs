use super::*;
use crate::slots::SlotAsk;

const MS: u64 = 1_000_000;
const T: u64 = 1_000 * MS;
const TIMES: ChainTimes = ChainTimes {
    tick_ns: 50 * MS,
    low_water_ns: 500 * MS,
    epsilon_ns: 10 * MS,
};

/// A child's ask of the pool.
fn child(
    pool: &mut SlotLedger,
    now: u64,
    holder: u32,
    lease: u64,
    keep: u64,
    want: u64,
    id: u64,
) -> crate::slots::SlotGrant {
    pool.ask(
        now,
        SlotAsk {
            holder,
            lease_id: lease,
            keep,
            want,
            ttl_ns: 2_000 * MS,
            new_id: id,
            fences: 0,
            resume: false,
        },
    )
}

fn granted(lease_id: u64, slots: u64, kept: u64, fence: u64) -> ParentSlotGrant {
    ParentSlotGrant {
        applied: true,
        lease_id,
        slots,
        kept,
        ttl_ns: 2_000 * MS,
        fence,
        ..ParentSlotGrant::default()
    }
}

/// A chain holding `slots` from the parent (lease 100), asked at `T`.
fn holding(slots: u64) -> (SlotChain, SlotLedger) {
    let mut chain = SlotChain::default();
    let mut pool = SlotLedger::new_pool(0);
    assert_eq!(child(&mut pool, T, 1, 0, 0, slots, 1).slots, 0);
    let ask = chain
        .plan(T, &mut pool, &TIMES)
        .expect("a child misses slots");
    assert_eq!((ask.lease_id, ask.keep, ask.want), (0, 0, slots));
    chain.sent(T, ask, &mut pool, &TIMES);
    assert_eq!(chain.plan(T, &mut pool, &TIMES), None, "one ask in flight");
    chain.on_grant(T + 40 * MS, &granted(100, slots, 0, 7), &mut pool, &TIMES);
    (chain, pool)
}

#[test]
fn a_pool_lends_what_its_parent_lease_holds_and_nothing_past_its_deadline() {
    let (chain, mut pool) = holding(4);
    let (id, slots, deadline) = chain.lease();
    assert_eq!((id, slots), (100, 4));
    // sent + TTL(1 - 2 rho) - epsilon.
    assert_eq!(
        deadline,
        quotalease_model::protocol::use_by_ns(T, 2_000 * MS, 10 * MS)
    );
    let g = child(&mut pool, T + 50 * MS, 1, 0, 0, 6, 2);
    assert_eq!(g.slots, 4, "at most the parent lease's slots");
    assert!(g.expires_ns <= deadline, "{} > {deadline}", g.expires_ns);
    assert_eq!(g.fence, 7, "the parent's block");
    let g2 = child(&mut pool, T + 60 * MS, 2, 0, 0, 1, 3);
    assert_eq!(g2.slots, 0, "the pool is empty");
    assert_eq!(g2.fence, 0);
}

#[test]
fn from_a_renewals_send_the_pool_lends_at_most_what_it_keeps() {
    let (mut chain, mut pool) = holding(4);
    let a = child(&mut pool, T + 50 * MS, 1, 0, 0, 1, 2);
    assert_eq!(a.slots, 1);
    // The parent is contended: the renewal gives the 3 spare slots back.
    let mut g = granted(100, 4, 0, 7);
    g.contended = true;
    chain.in_flight = Some(ParentSlotAsk::default());
    chain.on_grant(T + 60 * MS, &g, &mut pool, &TIMES);
    let now = T + 200 * MS;
    let ask = chain.plan(now, &mut pool, &TIMES).expect("give back");
    assert_eq!((ask.keep, ask.want), (1, 0), "{ask:?}");
    chain.sent(now, ask, &mut pool, &TIMES);
    // Until the answer, a child gets nothing more.
    assert_eq!(child(&mut pool, now + MS, 2, 0, 0, 3, 3).slots, 0);
    // The reply is lost; the promise stands after the ask is abandoned.
    chain.abandon();
    assert_eq!(child(&mut pool, now + 2 * MS, 2, 0, 0, 3, 4).slots, 0);
    // The next renewal finds the lease replaced (the parent applied the
    // lost ask): kept 0 of 1 breaks the chain, a new pool.
    let later = now + 300 * MS;
    let ask = chain
        .plan(later, &mut pool, &TIMES)
        .expect("a child misses slots");
    assert_eq!(ask.lease_id, 100);
    chain.sent(later, ask, &mut pool, &TIMES);
    let change = chain.on_grant(later + 40 * MS, &granted(101, 2, 0, 80), &mut pool, &TIMES);
    assert_eq!(change, ChainChange::Broke);
    assert_eq!(pool.held(), 0, "the old children's leases are not carried");
    // Renewing the old child lease keeps nothing of it.
    let r = child(&mut pool, later + 50 * MS, 1, 2, 1, 0, 5);
    assert_eq!(r.kept, 0, "{r:?}");
}

#[test]
fn a_lease_not_renewed_lapses_at_its_deadline_and_the_pool_lends_nothing() {
    let (mut chain, mut pool) = holding(4);
    let (_, _, deadline) = chain.lease();
    let g = child(&mut pool, T + 50 * MS, 1, 0, 0, 2, 2);
    assert_eq!(g.slots, 2);
    // The renewal goes out and is never answered (a cut).
    let due = deadline - 600 * MS;
    let ask = chain.plan(due, &mut pool, &TIMES).expect("due");
    assert_eq!(ask.keep, 2);
    chain.sent(due, ask, &mut pool, &TIMES);
    chain.abandon();
    // A child renewing is not extended past the deadline.
    let r = child(&mut pool, deadline - 100 * MS, 1, 2, 2, 0, 3);
    assert_eq!(r.kept, 2);
    assert!(r.expires_ns <= deadline, "{r:?}");
    assert!(chain.lapse(deadline, &mut pool));
    pool.advance(deadline);
    assert_eq!(pool.held(), 0, "every child lease ended by the deadline");
    assert_eq!(child(&mut pool, deadline + MS, 2, 0, 0, 1, 4).slots, 0);
    assert!(chain.is_idle());
}

#[test]
fn over_from_the_parent_lends_nothing_fresh_and_keeps_what_children_hold() {
    let (mut chain, mut pool) = holding(4);
    assert_eq!(child(&mut pool, T + 50 * MS, 1, 0, 0, 2, 2).slots, 2);
    let mut g = granted(101, 2, 2, 9);
    g.over = true;
    chain.in_flight = Some(ParentSlotAsk {
        lease_id: 100,
        keep: 2,
        want: 0,
        sent_ns: T + 60 * MS,
        resume: false,
    });
    assert_eq!(
        chain.on_grant(T + 100 * MS, &g, &mut pool, &TIMES),
        ChainChange::None
    );
    let r = child(&mut pool, T + 110 * MS, 1, 2, 2, 1, 3);
    assert_eq!((r.kept, r.fresh), (2, 0), "{r:?}");
    assert!(r.over);
}

/// After a grant that gave what was asked, a new shortfall is asked for at
/// once; after one that could not, at most once per tick.
#[test]
fn a_child_missing_slots_asks_at_once_after_a_met_grant_and_once_per_tick_after_an_unmet_one() {
    let (mut chain, mut pool) = holding(2);
    assert_eq!(child(&mut pool, T + 50 * MS, 1, 0, 0, 4, 2).slots, 2);
    let now = T + 60 * MS;
    let ask = chain
        .plan(now, &mut pool, &TIMES)
        .expect("2 missing, 20 ms after a grant that gave all it was asked");
    assert_eq!((ask.keep, ask.want), (2, 2), "{ask:?}");
    chain.sent(now, ask, &mut pool, &TIMES);
    chain.on_grant(now + 10 * MS, &granted(101, 2, 2, 9), &mut pool, &TIMES);
    assert_eq!(
        chain.plan(now + 20 * MS, &mut pool, &TIMES),
        None,
        "within the tick"
    );
    assert!(chain.plan(now + 60 * MS, &mut pool, &TIMES).is_some());
}

#[test]
fn a_chain_wants_a_wake_up_for_room_after_an_unmet_ask_and_for_contention_while_it_holds() {
    let (mut chain, mut pool) = holding(2);
    let now = T + 100 * MS;
    // Holding, nobody said contended: one wake-up out at a time.
    assert_eq!(
        chain.take_wake(now),
        Some(ChainWake {
            room: false,
            contended: true
        })
    );
    assert_eq!(chain.take_wake(now), None, "one out at a time");
    // Someone misses slots at the parent: the pool says so to children,
    // and the spare slots go back at the next plan.
    chain.on_wake(now, true, false, true, &mut pool);
    assert!(pool.contended());
    let ask = chain
        .plan(now + 60 * MS, &mut pool, &TIMES)
        .expect("give back");
    assert_eq!(ask.keep, 0, "no child holds any: {ask:?}");
    // An ask the parent could not meet: a wake-up for room.
    chain.sent(now + 60 * MS, ask, &mut pool, &TIMES);
    let mut g = granted(101, 0, 0, 0);
    g.contended = true;
    let ask2 = ParentSlotAsk {
        lease_id: 100,
        keep: 0,
        want: 2,
        sent_ns: now + 60 * MS,
        resume: false,
    };
    chain.in_flight = Some(ask2);
    chain.on_grant(now + 70 * MS, &g, &mut pool, &TIMES);
    assert_eq!(
        chain.take_wake(now + 80 * MS),
        Some(ChainWake {
            room: true,
            contended: false
        })
    );
    // Not answered (an older parent): none for a second.
    chain.on_wake(now + 90 * MS, false, false, false, &mut pool);
    assert_eq!(chain.take_wake(now + 100 * MS), None);
    assert!(chain.take_wake(now + 1_100 * MS).is_some());
}

/// Found in review (session 33): a child's lease outlives its demand
/// entry and another child misses slots, so the chain renews wanting 0;
/// the parent "gave all it asked" and, unpaced, the chain asked again
/// every round trip. An ask that wanted nothing stays paced by the tick.
#[test]
fn a_renewal_that_wanted_nothing_stays_paced() {
    let (mut chain, mut pool) = holding(4);
    assert_eq!(child(&mut pool, T + 50 * MS, 1, 0, 0, 4, 2).slots, 4);
    let mut now = T + 1_100 * MS;
    assert_eq!(child(&mut pool, now, 2, 0, 0, 2, 3).slots, 0);
    let (mut asks, mut id) = (0, 101);
    while now < T + 1_300 * MS {
        if let Some(ask) = chain.plan(now, &mut pool, &TIMES) {
            asks += 1;
            chain.sent(now, ask, &mut pool, &TIMES);
            let g = granted(id, ask.keep + ask.want, ask.keep, 9);
            chain.on_grant(now + MS, &g, &mut pool, &TIMES);
            id += 1;
        }
        now += 2 * MS;
    }
    assert!(asks <= 5, "{asks} parent asks in 200 ms (tick 50 ms)");
}

fn resumed(lease_id: u64, slots: u64, kept: u64, folded: u64, fence: u64) -> ParentSlotGrant {
    ParentSlotGrant {
        folded,
        ..granted(lease_id, slots, kept, fence)
    }
}

/// A regional that restarted: no resume until a child names a
/// predecessor's lease; then the next ask resumes at once, the folded
/// slots go to a phantom the child's renewal adopts from, and the chain's
/// renewals keep them.
#[test]
fn a_restarted_regional_resumes_when_a_child_names_a_predecessors_lease() {
    let mut chain = SlotChain::default();
    let mut pool = SlotLedger::new_pool(0);
    pool.await_resume(1_000);
    // A new child first: an ordinary ask.
    child(&mut pool, T, 2, 0, 0, 1, 1_000);
    let ask = chain
        .plan(T, &mut pool, &TIMES)
        .expect("a child misses one");
    assert!(!ask.resume, "{ask:?}");
    chain.sent(T, ask, &mut pool, &TIMES);
    chain.on_grant(T + 40 * MS, &granted(100, 1, 0, 9), &mut pool, &TIMES);
    assert_eq!(child(&mut pool, T + 45 * MS, 2, 0, 0, 1, 1_001).slots, 1);
    // A child of the predecessor renews its lease 7: it waits, and the
    // chain resumes at once, renewing its own lease.
    assert!(pool.needs_resume(7), "a child naming its lease 7 waits");
    let ask = chain
        .plan(T + 50 * MS, &mut pool, &TIMES)
        .expect("the resume");
    assert!(ask.resume, "{ask:?}");
    assert_eq!((ask.lease_id, ask.keep), (100, 1));
    chain.sent(T + 50 * MS, ask, &mut pool, &TIMES);
    let change = chain.on_grant(T + 90 * MS, &resumed(101, 4, 4, 3, 25), &mut pool, &TIMES);
    assert_eq!(change, ChainChange::Resumed(3));
    assert!(!pool.needs_resume(7), "adoptable now");
    assert_eq!(
        pool.held(),
        4,
        "the child's 1 and the predecessors' 3 in the phantom"
    );
    let g = child(&mut pool, T + 95 * MS, 1, 7, 2, 0, 1_002);
    assert_eq!((g.kept, g.fresh), (2, 0), "adopted: {g:?}");
    assert!(g.expires_ns <= chain.lease().2, "within the parent lease");
    // The renewal, when due, keeps what the pool holds.
    let due = chain.lease().2 - 500 * MS;
    let ask = chain.plan(due, &mut pool, &TIMES).expect("due");
    assert!(!ask.resume);
    assert_eq!((ask.lease_id, ask.keep), (101, 4), "{ask:?}");
}

/// A resume that kept less of the lease it named than asked broke the
/// chain, however much it folded; one that kept it all did not.
#[test]
fn a_resume_breaks_the_chain_only_when_the_named_lease_was_gone() {
    let (mut chain, mut pool) = holding(2);
    assert_eq!(child(&mut pool, T + 50 * MS, 1, 0, 0, 2, 2).slots, 2);
    pool.await_resume(1_000);
    assert!(pool.needs_resume(7));
    let ask = chain
        .plan(T + 60 * MS, &mut pool, &TIMES)
        .expect("the resume");
    assert_eq!((ask.keep, ask.resume), (2, true));
    chain.sent(T + 60 * MS, ask, &mut pool, &TIMES);
    // The named lease was gone: 3 folded, 0 of it kept.
    let change = chain.on_grant(T + 90 * MS, &resumed(101, 3, 3, 3, 25), &mut pool, &TIMES);
    assert_eq!(change, ChainChange::Broke);
}

/// A resume whose batch failed is asked again (the child waits
/// meanwhile); one the parent refused ends the wait.
#[test]
fn a_resume_not_applied_is_asked_again_and_a_refused_one_ends_the_wait() {
    let mut chain = SlotChain::default();
    let mut pool = SlotLedger::new_pool(0);
    pool.await_resume(1_000);
    assert!(pool.needs_resume(7));
    let ask = chain.plan(T, &mut pool, &TIMES).expect("the resume");
    assert!(ask.resume);
    chain.sent(T, ask, &mut pool, &TIMES);
    chain.abandon();
    let again = chain
        .plan(T + MS, &mut pool, &TIMES)
        .expect("asked again at once");
    assert!(again.resume);
    chain.sent(T + MS, again, &mut pool, &TIMES);
    assert!(!pool.is_idle(), "a pool a child waits on stays");
    let refused = ParentSlotGrant {
        applied: false,
        ..ParentSlotGrant::default()
    };
    chain.on_grant(T + 40 * MS, &refused, &mut pool, &TIMES);
    assert!(!pool.needs_resume(7), "tried");
    assert!(pool.is_idle());
    assert_eq!(chain.plan(T + 150 * MS, &mut pool, &TIMES), None);
}

/// While the parent says contended, a renewal keeps the slots children
/// missed within the last two ticks and asks for no more than those: it
/// gave slots back and asked for them again in one renewal (by the
/// children's wants at any ask within the second), which left the pool
/// lending nothing for a round trip each tick, and a child whose asks fell
/// in those windows was never served (the permit swarm's liveness failures
/// with `N` = 1). Slots no child has missed lately still go back.
#[test]
fn under_contention_a_chain_keeps_the_slots_its_children_miss() {
    let (mut chain, mut pool) = holding(1);
    // The child missed 1 at T (the pool was empty); the parent says
    // someone else misses slots too.
    chain.on_wake(T + 50 * MS, true, false, true, &mut pool);
    assert_eq!(
        chain.plan(T + 60 * MS, &mut pool, &TIMES),
        None,
        "the slot the child misses stays, and stays lendable"
    );
    let g = child(&mut pool, T + 70 * MS, 1, 0, 0, 1, 2);
    assert_eq!(g.slots, 1, "served: {g:?}");
    // Once nobody has missed a slot for two ticks, what no child holds
    // goes back, and the child's older want is not asked for again in the
    // same renewal (giving back and asking again is the same live-lock).
    assert!(pool.release(T + 80 * MS, 1, 2));
    let ask = chain
        .plan(T + 200 * MS, &mut pool, &TIMES)
        .expect("give back");
    assert_eq!((ask.keep, ask.want), (0, 0), "{ask:?}");
}

/// A global ledger's answer to `a` from `holder`, as the chain sees it.
fn at_global(
    global: &mut SlotLedger,
    now: u64,
    holder: u32,
    a: &ParentSlotAsk,
    new_id: u64,
) -> ParentSlotGrant {
    let g = global.ask(
        now,
        SlotAsk {
            holder,
            lease_id: a.lease_id,
            keep: a.keep,
            want: a.want,
            ttl_ns: 2_000 * MS,
            new_id,
            fences: FENCES_PER_PARENT_GRANT,
            resume: a.resume,
        },
    );
    ParentSlotGrant {
        applied: true,
        lease_id: g.lease_id,
        slots: g.slots,
        kept: g.kept,
        folded: g.folded,
        ttl_ns: g.expires_ns.saturating_sub(now) / MS * MS,
        fence: g.fence,
        contended: g.contended,
        over: g.over,
        share: g.share,
        retry_after_ns: 0,
        holders: 0,
    }
}

/// Found by review (session 34): a resume the global applied whose reply
/// was lost (its batch abandoned) is asked again naming the chain's old
/// lease; the global folds the unknown successor (the predecessor's 3
/// slots and the chain's own 1) and the chain breaks. The break's new pool
/// dropped the phantom and lent all 4 fresh beside the predecessor's
/// children and its own old child (8 in use of N = 4); now the new pool's
/// phantom holds what was folded.
#[test]
fn a_resume_asked_again_after_a_lost_reply_keeps_the_folded_slots_in_the_phantom() {
    const N: u64 = 4;
    let mut global = SlotLedger::new(N, 0);
    // The predecessor (holder 10) holds 3 at the global; its children
    // run permits on them until the global's expiry.
    let g = global.ask(
        T,
        SlotAsk {
            holder: 10,
            lease_id: 0,
            keep: 0,
            want: 3,
            ttl_ns: 2_000 * MS,
            new_id: 7,
            fences: 1,
            resume: false,
        },
    );
    assert_eq!(g.slots, 3);
    let predecessors_until = g.expires_ns;
    // The new process (holder 11): a new child gets 1.
    let mut chain = SlotChain::default();
    let mut pool = SlotLedger::new_pool(0);
    pool.await_resume(1_000);
    let now = T + 100 * MS;
    child(&mut pool, now, 2, 0, 0, 1, 1_000);
    let ask = chain
        .plan(now, &mut pool, &TIMES)
        .expect("a child misses one");
    chain.sent(now, ask, &mut pool, &TIMES);
    let pg = at_global(&mut global, now + 10 * MS, 11, &ask, 100);
    chain.on_grant(now + 20 * MS, &pg, &mut pool, &TIMES);
    let g = child(&mut pool, now + 25 * MS, 2, 0, 0, 1, 1_001);
    assert_eq!(g.slots, 1);
    let own_child_until = g.expires_ns;
    // A predecessor's child names its lease 5: the resume goes, the
    // global applies it, its reply is lost: abandoned.
    let now = T + 200 * MS;
    assert!(pool.needs_resume(5));
    let ask = chain.plan(now, &mut pool, &TIMES).expect("the resume");
    chain.sent(now, ask, &mut pool, &TIMES);
    global.reassign(&[10], 11);
    let lost = at_global(&mut global, now + 10 * MS, 11, &ask, 101);
    assert_eq!((lost.slots, lost.folded), (4, 3));
    chain.abandon();
    // Asked again, naming lease 100 (gone at the global): a break.
    let now = T + 400 * MS;
    let ask = chain
        .plan(now, &mut pool, &TIMES)
        .expect("the resume again");
    assert!(ask.resume);
    chain.sent(now, ask, &mut pool, &TIMES);
    let pg = at_global(&mut global, now + 10 * MS, 11, &ask, 102);
    assert_eq!(
        chain.on_grant(now + 20 * MS, &pg, &mut pool, &TIMES),
        ChainChange::Broke
    );
    // New children ask the new pool: nothing beside what is in use.
    let now = T + 450 * MS;
    let fresh: u64 = (3..10u32)
        .map(|h| child(&mut pool, now, h, 0, 0, 1, 2_000 + u64::from(h)).slots)
        .sum();
    let in_use = fresh
        + if now < predecessors_until { 3 } else { 0 }
        + if now < own_child_until { 1 } else { 0 };
    assert!(
        in_use <= N,
        "{in_use} slots in use of N = {N} (fresh {fresh})"
    );
    // The predecessor's child still adopts its lease in the new pool.
    assert_eq!(child(&mut pool, now, 9, 5, 2, 0, 3_000).kept, 2);
}

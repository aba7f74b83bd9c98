//! The local semaphore's unit cases (the whole protocol against the slot
//! ledger is `tests/permits_core.rs` of the root crate).

use super::*;

const MS: u64 = 1_000_000;

fn settings() -> PermitSettings {
    PermitSettings {
        n: 4,
        permit_ttl_ns: 100 * MS,
        max_hold_ns: 250 * MS,
        lease_ttl_ns: 2_000 * MS,
        epsilon_ns: 10 * MS,
    }
}

/// A key holding a lease of `slots` granted for an ask sent at `at`.
fn holding(slots: u64, at: u64) -> PermitKey {
    holding_with(settings(), slots, at)
}

fn holding_with(settings: PermitSettings, slots: u64, at: u64) -> PermitKey {
    let mut k = PermitKey::new(settings);
    let sent = k.ask(at, false);
    k.on_grant(
        at,
        sent,
        Granted {
            lease_id: 7,
            slots,
            kept: 0,
            fence: 3,
            over: false,
            ttl_ns: 2_000 * MS,
            share: None,
        },
    );
    k
}

#[test]
fn waiters_are_served_in_arrival_order_once_slots_arrive() {
    let mut k = PermitKey::new(settings());
    assert_eq!(k.acquire(0, 5), Err(AcquireError::Invalid), "more than N");
    assert_eq!(k.acquire(0, 0), Err(AcquireError::Invalid));
    assert_eq!(k.acquire(0, 2), Err(AcquireError::Queued(1)));
    assert_eq!(k.acquire(0, 1), Err(AcquireError::Queued(2)));
    let sent = k.ask(1, false);
    assert_eq!((sent.lease_id, sent.keep, sent.want), (0, 0, 3));
    k.on_grant(
        2,
        sent,
        Granted {
            lease_id: 9,
            slots: 2,
            kept: 0,
            fence: 5,
            over: false,
            ttl_ns: 2_000 * MS,
            share: None,
        },
    );
    // Two slots: the first waiter (2) fits, the second must wait.
    let served = k.serve_waiters(3);
    assert_eq!(served.len(), 1);
    assert_eq!(served[0].0, 1);
    assert_eq!(served[0].1.fence, 5 << FENCE_LOCAL_BITS);
    assert!(k.serve_waiters(3).is_empty());
    // A later acquire queues behind waiter 2 even when a slot frees.
    assert!(k.release(4, served[0].1.id));
    assert_eq!(k.acquire(5, 1), Err(AcquireError::Queued(4)));
    let served = k.serve_waiters(5);
    assert_eq!(served.iter().map(|s| s.0).collect::<Vec<_>>(), [2, 4]);
}

#[test]
fn a_permit_never_outlives_its_lease_or_max_hold_and_is_never_revived() {
    let mut k = holding(2, 0);
    let use_by = use_by_ns(0, 2_000 * MS, 10 * MS);
    let p = k.acquire(1_900 * MS, 1).expect("free");
    assert_eq!(p.expiry_ns, use_by, "the lease's use-by comes first");
    assert_eq!(k.renew(1_950 * MS, p.id), Ok(use_by), "cannot pass it");
    // Past its expiry: gone, its slot free, renewing says so.
    assert_eq!(k.renew(use_by, p.id), Err(RenewError::Expired));
    assert!(!k.release(use_by, p.id));
    // max_hold: renewed every 50 ms, it ends 250 ms after its acquire.
    let mut k = holding(2, 0);
    let p = k.acquire(0, 1).expect("free");
    let mut t = 0;
    let mut last = 0;
    while let Ok(e) = k.renew(t, p.id) {
        last = e;
        t += 50 * MS;
    }
    assert_eq!(last, 250 * MS);
}

#[test]
fn an_ask_in_flight_holds_the_agent_to_what_it_keeps() {
    let mut k = holding(3, 0);
    let p = k.acquire(1, 1).expect("free");
    assert_eq!(k.free(1), 2);
    // Give back what no permit uses: keep 1, so nothing is free until
    // the grant (whose reply may be lost).
    let sent = k.ask(2, true);
    assert_eq!((sent.lease_id, sent.keep), (7, 1));
    assert_eq!(k.free(3), 0);
    assert_eq!(k.acquire(3, 1), Err(AcquireError::Queued(2)));
    // The grant keeps the one slot and moves the permit onto it.
    k.on_grant(
        4,
        sent,
        Granted {
            lease_id: 8,
            slots: 1,
            kept: 1,
            fence: 4,
            over: false,
            ttl_ns: 2_000 * MS,
            share: None,
        },
    );
    assert_eq!(k.permits(5)[0].lease_id, 8);
    assert!(k.release(5, p.id));
    assert_eq!(k.serve_waiters(6).len(), 1);
}

#[test]
fn permits_that_cannot_move_stay_on_their_lease_until_they_end() {
    let long = PermitSettings {
        permit_ttl_ns: 10_000 * MS,
        max_hold_ns: 100_000 * MS,
        ..settings()
    };
    let mut k = holding_with(long, 2, 0);
    let p = k.acquire(1, 2).expect("free");
    let sent = k.ask(2, false);
    // The allocator did not know the lease (kept 0): a fresh lease of 1.
    k.on_grant(
        3,
        sent,
        Granted {
            lease_id: 9,
            slots: 1,
            kept: 0,
            fence: 6,
            over: false,
            ttl_ns: 2_000 * MS,
            share: None,
        },
    );
    let held = k.permits(4).to_vec();
    assert_eq!(held.len(), 1);
    assert_eq!(held[0].lease_id, 7, "still on the old lease");
    // New permits use the new lease's slot only.
    assert_eq!(k.free(4), 1);
    // The old permit renews only up to the old lease's use-by.
    let use_by_old = use_by_ns(0, 2_000 * MS, 10 * MS);
    let e = k.renew(1_950 * MS, p.id).expect("valid");
    assert_eq!(e, use_by_old, "not the new lease's later use-by");
}

#[test]
fn fencing_tokens_grow_with_the_grant_and_never_wrap() {
    // Review finding: `fence << 20` dropped the high bits of a large
    // grant number (an allocator's run number), making a later token
    // smaller than an earlier one.
    let token = |fence: u64| {
        let mut k = PermitKey::new(settings());
        let sent = k.ask(0, false);
        k.on_grant(
            0,
            sent,
            Granted {
                lease_id: 1,
                slots: 4,
                kept: 0,
                fence,
                over: false,
                ttl_ns: 2_000 * MS,
                share: None,
            },
        );
        let a = k.acquire(1, 1).expect("free").fence;
        let b = k.acquire(1, 1).expect("free").fence;
        assert!(b > a, "tokens grow on a lease");
        a
    };
    assert!(token(8) > token(7));
    assert!(token((1 << 44) + 1) > token(7));
    assert!(token(u64::MAX) >= token((1 << 44) + 1));
}

/// The wake-ups a key wants (docs/permits.md "Slots follow demand"): room
/// while its waiters miss slots the ledger lacked, contended while it
/// holds a shared lease and heard of no one missing; each answered one
/// makes the next `due` ask at once.
#[test]
fn wake_ups_are_wanted_while_they_help_and_make_the_key_ask_at_once() {
    use super::policy::{AskPolicy, Wake};
    let mut k = PermitKey::new(settings());
    let mut p = AskPolicy::new(2_000 * MS);
    assert_eq!(p.wake_wanted(&k), None, "nothing held, nothing waits");
    // A waiter; the grant gives nothing (the ledger is full): room.
    assert_eq!(k.acquire(0, 1), Err(AcquireError::Queued(1)));
    let sent = p.due(&mut k, 0).expect("a waiter asks");
    let none = Granted {
        lease_id: 0,
        slots: 0,
        kept: 0,
        fence: 0,
        over: false,
        ttl_ns: 0,
        share: None,
    };
    p.on_grant(&mut k, 10 * MS, sent, none, true, 3);
    assert_eq!(
        p.wake_wanted(&k),
        Some(Wake {
            room: true,
            contended: false,
            releases: false,
        })
    );
    assert!(p.due(&mut k, 20 * MS).is_none(), "not before the tick");
    p.on_wake(true, false, false);
    assert!(p.due(&mut k, 21 * MS).is_some(), "woken: asks at once");
    // A holder of a shared lease with no waiter: contended.
    let mut h = holding(2, 0);
    let mut q = AskPolicy::new(2_000 * MS);
    assert!(q.due(&mut h, 0).is_none(), "nothing due yet");
    let renewal = q.send(&mut h, 0, false);
    let kept = Granted {
        lease_id: 8,
        slots: 2,
        kept: 2,
        fence: 4,
        over: false,
        ttl_ns: 2_000 * MS,
        share: None,
    };
    q.on_grant(&mut h, 0, renewal, kept, false, 2);
    assert_eq!(
        q.wake_wanted(&h),
        Some(Wake {
            room: false,
            contended: true,
            releases: false,
        })
    );
    let id = h.acquire(1, 1).expect("a free slot");
    h.release(2 * MS, id.id);
    assert!(
        q.due(&mut h, 3 * MS).is_none(),
        "kept 100 ms while nobody misses it"
    );
    q.on_wake(false, true, false);
    let back = q.due(&mut h, 4 * MS).expect("given back at once");
    assert_eq!(back.keep, 0, "{back:?}");
}

/// A grant with a share below what the key holds (another holder
/// starves): no permit starts past the share, the slots beyond it that no
/// permit uses go back at the next ask, and the ones in use stay kept.
#[test]
fn a_share_caps_new_permits_and_the_slots_beyond_it_go_back() {
    let mut k = holding(4, 0);
    let p: Vec<Permit> = (0..3).map(|_| k.acquire(1, 1).expect("free")).collect();
    // The allocator says: hold at most 2 (3 in use).
    let sent = k.ask(2, false);
    assert_eq!(sent.keep, 4);
    k.on_grant(
        3,
        sent,
        Granted {
            lease_id: 8,
            slots: 4,
            kept: 4,
            fence: 4,
            over: false,
            ttl_ns: 2_000 * MS,
            share: Some(2),
        },
    );
    assert_eq!(k.free(3), 0, "3 in use, share 2");
    assert_eq!(k.beyond_share(3), 1, "the unused fourth slot");
    assert_eq!(k.acquire(3, 1), Err(AcquireError::Queued(4)));
    // Permits end: what is beyond the share goes back, the rest is kept.
    assert!(k.release(4, p[0].id));
    assert_eq!(k.beyond_share(4), 2);
    assert!(k.serve_waiters(4).is_empty(), "2 in use = the share");
    let sent = k.ask(5, false);
    assert_eq!((sent.keep, sent.want), (2, 1), "{sent:?}");
}

/// An acquire whose wait ran out is told how long to wait (SPEC §5): its
/// place in the queue times the time this agent took per slot it started,
/// or the time since the last start when that is longer; 1 s before any
/// start; within 10 ms and 60 s.
#[test]
fn a_waiter_that_ran_out_is_told_its_place_times_the_pace_of_starts() {
    let long = PermitSettings {
        permit_ttl_ns: 10_000 * MS,
        max_hold_ns: 10_000 * MS,
        ..settings()
    };
    let mut k = holding_with(long, 2, 0);
    let Err(AcquireError::Queued(w0)) = k.acquire(0, 3) else {
        panic!("3 of 2 slots waits")
    };
    assert_eq!(
        k.retry_hint_ns(1, w0),
        RETRY_HINT_UNKNOWN_NS,
        "nothing started"
    );
    k.cancel(w0);
    let p0 = k.acquire(0, 1).expect("free");
    assert_eq!(
        k.retry_hint_ns(0, 99),
        RETRY_HINT_MIN_NS,
        "a start just now"
    );
    k.acquire(20 * MS, 1).expect("free");
    let Err(AcquireError::Queued(w1)) = k.acquire(25 * MS, 1) else {
        panic!("full")
    };
    let Err(AcquireError::Queued(w2)) = k.acquire(26 * MS, 2) else {
        panic!("full")
    };
    // 20 ms per slot started; w2 has 3 slots up to and including its own.
    assert_eq!(k.retry_hint_ns(30 * MS, w1), 20 * MS);
    assert_eq!(k.retry_hint_ns(30 * MS, w2), 60 * MS);
    // Nothing started for 500 ms: the drought is the pace.
    assert_eq!(k.retry_hint_ns(520 * MS, w1), 500 * MS);
    assert_eq!(k.retry_hint_ns(520 * MS, w2), 1_500 * MS);
    // A release serves w1 at 530 ms: the average takes the 510 ms in.
    assert!(k.release(530 * MS, p0.id));
    assert_eq!(k.serve_waiters(530 * MS).len(), 1);
    let per_slot = (20 * MS * 7 + 510 * MS) / 8;
    assert_eq!(k.retry_hint_ns(531 * MS, w2), 2 * per_slot);
    // Far down a long queue: at most 60 s.
    for t in 0..1_000 {
        let _ = k.acquire(532 * MS + t, 1);
    }
    assert_eq!(k.retry_hint_ns(600 * MS, u64::MAX), RETRY_HINT_MAX_NS);
}

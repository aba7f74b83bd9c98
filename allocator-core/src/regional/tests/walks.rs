//! Which keys a walk visits (docs/protocol.md "Which keys a walk visits"):
//! the keys a child's item or the parent's answer named since their last
//! visit, and the others only when they are due.

use super::*;

fn key_n(i: usize) -> KeyId {
    KeyId::new("hot", format!("t{i}"), String::new())
}

fn item_n(i: usize, lease_id: u64, spent: u64, want: u64) -> LeaseItem {
    LeaseItem {
        tenant: format!("t{i}"),
        ..item(ItemKind::Renew, lease_id, spent, want)
    }
}

/// Poll every 10 ms from `*now` to `end`, through the parent.
fn run_until(reg: &mut RegionalCore, parent: &mut AllocatorCore, now: &mut u64, end: u64) {
    while *now < end {
        pump(reg, parent, *now);
        reg.check_i2(*now).unwrap();
        *now += 10 * MS;
    }
}

fn visits(reg: &RegionalCore) -> u64 {
    reg.stats().walk_keys_planned
}

/// 40 keys a child opened once and named no more: the walks pass them by
/// until they are due (at the latest an active window on), where every
/// walk (every 50 ms) visited every key. A key a child names again is
/// visited by the next walk.
#[test]
fn a_walk_passes_by_keys_no_child_named_until_they_are_due() {
    const KEYS: usize = 40;
    let mut now = T0;
    let mut parent = parent_at(now);
    let mut reg = rate_regional_at(now);
    let items = (0..KEYS).map(|i| item_n(i, 0, 0, 1)).collect();
    let r = reg.handle(now, &child_batch("a", 1, items));
    assert_eq!(r.grants.len(), KEYS);
    run_until(&mut reg, &mut parent, &mut now, T0 + 300 * MS);
    for i in 0..KEYS {
        assert!(reg.chain_view(&key_n(i)).is_some(), "key {i} opened");
    }
    // 600 ms without a child's item: 12 walks over 40 keys when every
    // walk visited every key.
    let before = visits(&reg);
    run_until(&mut reg, &mut parent, &mut now, T0 + 900 * MS);
    let quiet = visits(&reg) - before;
    assert!(
        quiet <= KEYS as u64 / 4,
        "{quiet} visits of quiet keys in 600 ms"
    );
    assert!(reg.stats().walk_keys_skipped >= 10 * KEYS as u64);
    // A child names key 7 again: the next walk visits it (and only it,
    // nothing else being due).
    let before = visits(&reg);
    reg.handle(now, &child_batch("a", 2, vec![item_n(7, 0, 0, 1)]));
    let end = now + 60 * MS;
    run_until(&mut reg, &mut parent, &mut now, end);
    let named = visits(&reg) - before;
    assert!(
        (1..=2).contains(&named),
        "{named} visits after a child named one key"
    );
    assert_eq!(reg.stats().chains_lapsed, 0);
}

/// A key its child uses once every 700 ms (never within one walk of the
/// last use): the walks pass it by between uses, and its chain is still
/// renewed ahead of each deadline, for 10 s of 2 s parent leases.
#[test]
fn a_key_used_now_and_then_keeps_its_chain_though_walks_pass_it_by() {
    let mut now = T0;
    let mut parent = parent_at(now);
    let mut reg = rate_regional_at(now);
    let (mut lease, mut seq, mut denied) = (0u64, 0u64, 0u64);
    let mut step = 0u64;
    while now < T0 + 10 * SEC {
        if step.is_multiple_of(70) {
            seq += 1;
            let g = ask(&mut reg, now, "a", seq, lease, u64::from(lease != 0), 1);
            if g.lease_id != 0 {
                lease = g.lease_id;
            } else if now > T0 + SEC {
                denied += 1;
            }
        }
        pump(&mut reg, &mut parent, now);
        reg.check_i2(now).unwrap();
        now += 10 * MS;
        step += 1;
    }
    assert_eq!(reg.stats().chains_lapsed, 0, "{:?}", reg.stats());
    assert_eq!(denied, 0);
    assert!(reg.chain_view(&key()).is_some());
    // 200 walks in 10 s; about one visit per use and per due instant.
    assert!(reg.stats().walk_keys_skipped > 100, "{:?}", reg.stats());
}

/// A key its child uses every 2.4 s beside a key in use every 50 ms,
/// behind a parent whose round trip grows from 20 ms to 200 ms (the busy
/// key's batches teach the regional the new round trip, so a renewal
/// ahead of the deadline needs a longer lead): the walks that passed the
/// quiet key by still plan its renewal early enough, and its chain does
/// not lapse.
#[test]
fn a_parent_slowing_down_does_not_lapse_chains_the_walks_passed_by() {
    let mut now = T0;
    let mut parent = parent_at(now);
    let mut reg = eu_with_short_low_water(now);
    let (mut lease, mut busy_lease, mut seq) = (0u64, 0u64, 0u64);
    let mut reply: Option<(u64, LeaseReply)> = None;
    for step in 0..2_000u64 {
        if step.is_multiple_of(240) {
            seq += 1;
            let g = ask(&mut reg, now, "a", seq, lease, u64::from(lease != 0), 1);
            if g.lease_id != 0 {
                lease = g.lease_id;
            }
        }
        if step.is_multiple_of(5) {
            seq += 1;
            let spent = u64::from(busy_lease != 0);
            let b = child_batch("a", seq, vec![item_n(1, busy_lease, spent, 1)]);
            let g = reg.handle(now, &b).grants[0].clone();
            if g.lease_id != 0 {
                busy_lease = g.lease_id;
            }
        }
        if reply.as_ref().is_some_and(|(at, _)| *at <= now) {
            let (_, r) = reply.take().expect("checked");
            reg.handle_reply(now, &r);
        }
        if reply.is_none() {
            if let Some(b) = reg.poll_transmit(now) {
                let rtt = if now < T0 + 6 * SEC {
                    20 * MS
                } else {
                    200 * MS
                };
                reply = Some((now + rtt, parent.handle(now + rtt / 2, &b)));
            }
        }
        reg.check_i2(now).unwrap();
        now += 10 * MS;
    }
    assert!(reg.chain_view(&key()).is_some());
    assert_eq!(reg.stats().chains_lapsed, 0, "{:?}", reg.stats());
    assert!(reg.stats().walk_keys_skipped > 0);
}

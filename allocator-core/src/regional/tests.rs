//! Regional allocator tests: a [`RegionalCore`] driven in-process with
//! explicit times, with a real [`AllocatorCore`] as its parent. Examples
//! first (carry-over, chain break, expiry caps, unreachable parent,
//! duplicates, rules, idle release, shutdown), then a property test over
//! random histories that checks I2 at both tiers and I1 over the children's
//! admissions at every step.

use super::*;
use proptest::prelude::*;
use quotalease_proto::lease::{ItemKind, LeaseItem, RequestHeader};

const SEC: u64 = 1_000 * MS;
/// Start of every test (arbitrary, far from 0).
const T0: u64 = 1_000 * SEC;
const RATE: u64 = 100; // per second
const BURST: u64 = 50;

fn rules(version: u64) -> RuleSet {
    RuleSet::parse(
        "rules:\n  - id: hot\n    match: { tenant: \"*\" }\n    rate: 100/s\n    burst: 50\n    fail_policy: closed\n",
        "test.yaml",
        version,
    )
    .expect("valid rules")
}

/// The rule lowered to `rate/s burst b` (below the two regions and the
/// five children's count at `b` = 1), as version 6.
fn lowered_rules(rate: u64, burst: u64) -> RuleSet {
    RuleSet::parse(
        &format!("rules:\n  - id: hot\n    match: {{ tenant: \"*\" }}\n    rate: {rate}/s\n    burst: {burst}\n    fail_policy: closed\n"),
        "test.yaml",
        6,
    )
    .expect("valid rules")
}

fn parent_at(now: u64) -> AllocatorCore {
    let cfg = CoreConfig {
        no_predecessor: true,
        ..CoreConfig::default()
    };
    AllocatorCore::new(cfg, rules(5), 1, 1_000_000, now)
}

/// A regional of leases of tokens only (the chain tests below; rate
/// chains have their own).
fn regional_at(now: u64, bootstrap: bool) -> RegionalCore {
    let cfg = RegionalConfig {
        region: "eu".into(),
        rate_leases: false,
        ..RegionalConfig::default()
    };
    RegionalCore::new(cfg, bootstrap.then(|| rules(0)), 7_000_000, 5_000_000, now)
}

/// A regional of rate chains (the default) with bootstrap rules.
fn rate_regional_at(now: u64) -> RegionalCore {
    rate_regional_with("eu", rules(0), now)
}

/// A regional of rate chains for `region` with bootstrap `rules`.
fn rate_regional_with(region: &str, rules: RuleSet, now: u64) -> RegionalCore {
    let cfg = RegionalConfig {
        region: region.into(),
        ..RegionalConfig::default()
    };
    RegionalCore::new(cfg, Some(rules), 7_000_000, 5_000_000, now)
}

fn key() -> KeyId {
    KeyId::new("hot", "acme", String::new())
}

fn item(kind: ItemKind, lease_id: u64, spent: u64, want: u64) -> LeaseItem {
    LeaseItem {
        rule_id: "hot".into(),
        tenant: "acme".into(),
        route: String::new(),
        kind: kind as i32,
        lease_id,
        spent,
        want,
        ..LeaseItem::default()
    }
}

fn child_batch(agent: &str, seq: u64, items: Vec<LeaseItem>) -> LeaseBatch {
    LeaseBatch {
        header: Some(RequestHeader {
            agent_id: agent.into(),
            incarnation: 1,
            seq,
            protocol_version: PROTOCOL_VERSION,
            rules_version: 0,
            instance: 0,
            ledger_id: 0,
            run_id: 0,
            record_seq: 0,
            cluster: String::new(),
            ledger_cluster: String::new(),
        }),
        items,
        ttl_ms: 2_000,
        shard: 0,
    }
}

/// One poll of the upstream side, delivered to the parent and back.
fn pump(reg: &mut RegionalCore, parent: &mut AllocatorCore, now: u64) -> Option<LeaseReply> {
    let b = reg.poll_transmit(now)?;
    let r = parent.handle(now, &b);
    reg.handle_reply(now, &r);
    Some(r)
}

fn ask(
    reg: &mut RegionalCore,
    now: u64,
    agent: &str,
    seq: u64,
    lease: u64,
    spent: u64,
    want: u64,
) -> Grant {
    let r = reg.handle(
        now,
        &child_batch(agent, seq, vec![item(ItemKind::Renew, lease, spent, want)]),
    );
    r.grants[0].clone()
}

fn parent_region_outstanding(parent: &mut AllocatorCore, now: u64) -> u64 {
    parent.key_view(now, &key()).map_or(0, |v| {
        v.holders
            .iter()
            .filter(|(n, _)| n.agent_id == "region/eu")
            .map(|(_, l)| l.granted - l.spent)
            .sum()
    })
}

/// A regional with an open chain for the key and one child holding `got`.
fn opened(now: u64) -> (RegionalCore, AllocatorCore, Grant) {
    let mut parent = parent_at(now);
    let mut reg = regional_at(now, true);
    let g = ask(&mut reg, now, "a", 1, 0, 0, 10);
    assert_eq!(g.status, GrantStatus::Granted as i32);
    assert_eq!(g.tokens, 0, "nothing before the parent is asked");
    assert!(
        g.retry_after_ms >= 1,
        "a dry pool tells the child when to come back"
    );
    pump(&mut reg, &mut parent, now).expect("children wait: ask the parent");
    let g = ask(&mut reg, now, "a", 2, 0, 0, 10);
    assert_eq!(g.tokens, 10);
    reg.check_i2(now).unwrap();
    (reg, parent, g)
}

#[test]
fn a_chain_carries_over_and_reports_exactly_what_left_it() {
    let t = T0;
    let (mut reg, mut parent, g) = opened(t);
    let c0 = reg.chain_view(&key()).expect("chain");
    assert!(c0.granted >= 10 && c0.granted <= BURST);
    assert_eq!(parent_region_outstanding(&mut parent, t), c0.granted);
    // The child spends 4 of its 10 and reports it at the next renewal.
    let t = t + 1_500 * MS;
    let g2 = ask(&mut reg, t, "a", 3, g.lease_id, 4, 0);
    assert_eq!(g2.carried, 6);
    // E - low_water reached: the regional renews its parent lease, spent
    // = G - H = 4, so the parent carries the rest.
    let h = c0.granted - 4;
    let r = pump(&mut reg, &mut parent, t).expect("renewal ahead of E");
    assert_eq!(r.grants.len(), 1);
    assert_eq!(r.grants[0].carried, h);
    let c1 = reg.chain_view(&key()).expect("chain continues");
    assert_eq!(c1.granted, r.grants[0].tokens);
    assert_eq!(c1.parent_lease_id, r.grants[0].lease_id);
    assert!(c1.deadline_ns > c0.deadline_ns);
    assert_eq!(parent_region_outstanding(&mut parent, t), c1.granted);
    assert_eq!(reg.stats().chain_breaks, 0);
    reg.check_i2(t).unwrap();
}

/// SPEC §5: a grant tells what is left in the bucket beyond the holder's
/// lease: the root its `available`, a regional its pool's plus what the
/// parent last reported above the region's lease. A duplicate gets the
/// cached figure.
#[test]
fn grants_report_what_is_left_beyond_the_lease_at_both_tiers() {
    let t = T0;
    // The root: a fresh bucket of 50, 3 leased.
    let mut root = parent_at(t);
    let b = child_batch("x", 1, vec![item(ItemKind::Renew, 0, 0, 3)]);
    let r = root.handle(t, &b);
    assert_eq!(
        (r.grants[0].tokens, r.grants[0].bucket_available),
        (3, BURST - 3)
    );
    // The region leased G from the root, its child holds 10 of them: the
    // child hears of the pool's G - 10 and the root's 50 - G.
    let (mut reg, _parent, g) = opened(t);
    let c = reg.chain_view(&key()).expect("chain");
    assert!(c.granted >= 10 && c.granted <= BURST, "{}", c.granted);
    assert_eq!(g.bucket_available, BURST - 10, "{g:?}");
    // Another child: whatever the pool gives it, the rest is reported.
    let b = child_batch("b", 1, vec![item(ItemKind::Renew, 0, 0, 2)]);
    let r = reg.handle(t, &b);
    let g = &r.grants[0];
    assert_eq!(g.bucket_available, BURST - 10 - g.tokens, "{g:?}");
    assert_eq!(reg.handle(t, &b), r, "a duplicate gets the cached reply");
}

#[test]
fn a_lost_reply_breaks_the_chain_and_old_sub_leases_carry_nothing() {
    let t = T0;
    let (mut reg, mut parent, g) = opened(t);
    let t = t + 1_500 * MS;
    let b = reg.poll_transmit(t).expect("renewal");
    let seq = b.header.as_ref().unwrap().seq;
    let _lost = parent.handle(t, &b); // applied at the parent, reply lost
    reg.handle_failure(t, seq);
    assert!(!reg.parent_reachable());
    let g_unreach = ask(&mut reg, t, "b", 1, 0, 0, 1);
    assert!(g_unreach.parent_unreachable);
    // Next renewal names the rolled lease: the parent carries nothing.
    let t = t + 100 * MS;
    let r = pump(&mut reg, &mut parent, t).expect("next renewal");
    assert_eq!(r.grants[0].carried, 0);
    assert_eq!(reg.stats().chain_breaks, 1);
    assert!(reg.parent_reachable());
    // The child's old sub-lease is unknown to the new chain's ledger.
    let g2 = ask(&mut reg, t, "a", 3, g.lease_id, 2, 0);
    assert_eq!(g2.carried, 0);
    reg.check_i2(t).unwrap();
    let c = reg.chain_view(&key()).expect("new chain");
    assert_eq!(c.granted, r.grants[0].tokens);
}

#[test]
fn sub_leases_never_outlive_the_parent_lease() {
    let t = T0;
    let (mut reg, _parent, g) = opened(t);
    // The child gives its 10 back to the pool.
    reg.handle(
        t,
        &child_batch("a", 3, vec![item(ItemKind::Release, g.lease_id, 0, 0)]),
    );
    let e = reg.chain_view(&key()).unwrap().deadline_ns;
    // Cut off from the parent from now on: every upstream call fails.
    let mut now = t;
    while now < e - 300 * MS {
        now += 50 * MS;
        if let Some(b) = reg.poll_transmit(now) {
            reg.handle_failure(now, b.header.unwrap().seq);
        }
    }
    let g = ask(&mut reg, now, "b", 1, 0, 0, 5);
    assert!(g.parent_unreachable);
    assert_eq!(g.tokens, 5, "keeps sub-leasing what the pool holds");
    assert!(now + g.ttl_ms * MS <= e, "ttl {} ms beyond E", g.ttl_ms);
    reg.check_i2(now).unwrap();
    // Too close to E: nothing new from the pool.
    let near = e - 60 * MS;
    let g = ask(&mut reg, near, "c", 1, 0, 0, 5);
    assert_eq!(g.tokens, 0);
    assert!(g.retry_after_ms >= 1);
    // The upstream side wakes at E at the latest (the chain's deadline is
    // the earliest due), and at E the chain lapses with its pool.
    assert!(reg.next_wakeup_ns() <= e);
    let _ = reg.poll_transmit(e);
    assert!(reg.chain_view(&key()).is_none());
    assert!(reg.stats().chains_lapsed == 1 && reg.stats().tokens_destroyed > 0);
    reg.check_i2(e).unwrap();
}

#[test]
fn parent_unreachable_is_stamped_until_a_reply_arrives() {
    let t = T0;
    let (mut reg, mut parent, _) = opened(t);
    assert!(reg.parent_reachable());
    let t = t + 100 * MS;
    let g = ask(&mut reg, t, "a", 3, 0, 0, 1);
    assert!(!g.parent_unreachable);
    // A call that never returns: after fetch_timeout the parent counts as
    // unreachable even before the driver reports the failure.
    let t = t + 1_500 * MS;
    let b = reg.poll_transmit(t).expect("renewal");
    let t2 = t + reg.config().fetch_timeout_ns;
    let g = ask(&mut reg, t2, "a", 4, 0, 0, 1);
    assert!(g.parent_unreachable);
    reg.handle_failure(t2, b.header.unwrap().seq);
    assert!(!reg.parent_reachable());
    let t3 = t2 + 100 * MS;
    pump(&mut reg, &mut parent, t3).expect("retry");
    assert!(reg.parent_reachable());
    let g = ask(&mut reg, t3, "a", 5, 0, 0, 1);
    assert!(!g.parent_unreachable);
}

#[test]
fn a_duplicate_child_batch_is_answered_from_the_cache_and_grants_once() {
    let t = T0;
    let (mut reg, _parent, _) = opened(t);
    let b = child_batch("d", 1, vec![item(ItemKind::Renew, 0, 0, 5)]);
    let r1 = reg.handle(t, &b);
    let pool = reg.core_mut().ledger_mut(&key()).unwrap().available();
    let r2 = reg.handle(t + MS, &b);
    assert_eq!(r1, r2);
    assert_eq!(reg.core_mut().ledger_mut(&key()).unwrap().available(), pool);
    assert_eq!(reg.child_stats().duplicates, 1);
    reg.check_i2(t + MS).unwrap();
}

#[test]
fn without_rules_children_are_refused_until_the_parent_sends_them() {
    let t = T0;
    let mut parent = parent_at(t);
    let mut reg = regional_at(t, false);
    assert!(!reg.has_rules());
    let g = ask(&mut reg, t, "a", 1, 0, 0, 5);
    assert_eq!(g.status, GrantStatus::UnknownRule as i32);
    assert!(g.detail.contains("no rules yet"), "{}", g.detail);
    // The first poll is a heartbeat; its reply carries the rules.
    let r = pump(&mut reg, &mut parent, t).expect("heartbeat");
    assert!(r.rules.is_some());
    assert!(reg.has_rules());
    assert_eq!(reg.core().rules().version, 5);
    let g = ask(&mut reg, t, "a", 2, 0, 0, 5);
    assert_eq!(g.status, GrantStatus::Granted as i32);
    assert_eq!(g.rule_version, 5);
}

#[test]
fn an_idle_chain_is_released_and_the_pool_returns_to_the_parent() {
    let t = T0;
    let (mut reg, mut parent, g) = opened(t);
    let g2 = reg.handle(
        t,
        &child_batch("a", 3, vec![item(ItemKind::Release, g.lease_id, 3, 0)]),
    );
    assert_eq!(g2.grants[0].status, GrantStatus::Released as i32);
    // Keep the chain alive while idle does not yet count, then let it idle.
    let mut now = t;
    let end = t + reg.config().idle_release_ns() + SEC;
    let mut released = false;
    while now < end {
        now += 50 * MS;
        if let Some(b) = reg.poll_transmit(now) {
            released |= b.items.iter().any(|i| i.kind == ItemKind::Release as i32);
            let r = parent.handle(now, &b);
            reg.handle_reply(now, &r);
        }
    }
    assert!(released, "idle chain released");
    assert!(reg.chain_view(&key()).is_none());
    assert_eq!(parent_region_outstanding(&mut parent, now), 0);
    // 3 spent by the child: the parent refilled the rest long ago.
    let v = parent.key_view(now, &key());
    assert!(v.is_none_or(|v| v.available == BURST));
    reg.check_i2(now).unwrap();
}

#[test]
fn shutdown_returns_the_pool_but_keeps_what_children_hold() {
    let t = T0;
    let (mut reg, mut parent, g) = opened(t);
    let before = reg.chain_view(&key()).unwrap().granted;
    let b = reg.shutdown(t).expect("something to give back");
    assert_eq!(b.items.len(), 1);
    // A child holds 10: renewed with the pool counted as spent (destroyed),
    // carrying only the 10.
    assert_eq!(b.items[0].kind, ItemKind::Renew as i32);
    assert_eq!(b.items[0].spent, before - g.tokens);
    let r = parent.handle(t, &b);
    assert_eq!(r.grants[0].carried, g.tokens);
    reg.handle_reply(t, &r);
    let g = ask(&mut reg, t, "a", 9, 0, 0, 1);
    assert_eq!(
        g.status,
        GrantStatus::UnknownRule as i32,
        "refuses while stopping"
    );
}

#[test]
fn heartbeats_keep_the_parent_reachable_when_idle() {
    let t = T0;
    let mut parent = parent_at(t);
    let mut reg = regional_at(t, true);
    let mut beats = 0;
    let mut now = t;
    while now < t + 5 * SEC {
        if pump(&mut reg, &mut parent, now).is_some() {
            beats += 1;
        }
        assert!(reg.parent_reachable(), "at {now}");
        now = reg.next_wakeup_ns().max(now + MS);
    }
    assert!((4..=7).contains(&beats), "{beats} heartbeats in 5 s");
}

// ---------------------------------------------------------------------------
// Property test: random histories over both tiers.

#[derive(Clone, Debug)]
enum Op {
    ChildRenew {
        c: usize,
        want: u64,
        lose_reply: bool,
    },
    ChildSpend {
        c: usize,
        n: u64,
    },
    ChildRelease {
        c: usize,
    },
    ChildDuplicate {
        c: usize,
    },
    UpPoll {
        r: usize,
    },
    UpPump {
        r: usize,
    },
    UpDeliver {
        r: usize,
    },
    UpLoseRequest {
        r: usize,
    },
    UpLoseReply {
        r: usize,
    },
    UpDeliverLate {
        r: usize,
    },
    UpDuplicate {
        r: usize,
    },
    Advance {
        ms: u64,
    },
}

/// Children 0..3 are in region 0, 3..5 in region 1.
const CHILDREN: usize = 5;
fn region_of(c: usize) -> usize {
    usize::from(c >= 3)
}

fn op() -> impl Strategy<Value = Op> {
    let r = || 0..2usize;
    prop_oneof![
        4 => (0..CHILDREN, 0..40u64, proptest::bool::weighted(0.15))
            .prop_map(|(c, want, lose_reply)| Op::ChildRenew { c, want, lose_reply }),
        8 => (0..CHILDREN, 1..15u64).prop_map(|(c, n)| Op::ChildSpend { c, n }),
        1 => (0..CHILDREN).prop_map(|c| Op::ChildRelease { c }),
        1 => (0..CHILDREN).prop_map(|c| Op::ChildDuplicate { c }),
        3 => r().prop_map(|r| Op::UpPoll { r }),
        4 => r().prop_map(|r| Op::UpPump { r }),
        4 => r().prop_map(|r| Op::UpDeliver { r }),
        1 => r().prop_map(|r| Op::UpLoseRequest { r }),
        1 => r().prop_map(|r| Op::UpLoseReply { r }),
        1 => r().prop_map(|r| Op::UpDeliverLate { r }),
        1 => r().prop_map(|r| Op::UpDuplicate { r }),
        5 => (1..500u64).prop_map(|ms| Op::Advance { ms }),
    ]
}

/// A child as an agent behaves: one lease, used until its deadline
/// (first send + TTL*(1-2rho) - epsilon), spent counts reported truthfully.
#[derive(Clone, Debug, Default)]
struct Child {
    seq: u64,
    lease_id: u64,
    granted: u64,
    left: u64,
    deadline: u64,
    last: Option<(LeaseBatch, LeaseReply)>,
}

const CHILD_EPS: u64 = 50 * MS;

impl Child {
    fn install(&mut self, now: u64, g: &Grant) {
        if g.status != GrantStatus::Granted as i32 || g.lease_id == 0 {
            return; // the named lease stays usable under its own deadline
        }
        let ttl = g.ttl_ms * MS;
        let deadline = use_by_ns(now, ttl, CHILD_EPS);
        if deadline <= now {
            // Unusable: retire the old lease; the grant expires at the regional.
            self.lease_id = 0;
            self.left = 0;
            return;
        }
        self.lease_id = g.lease_id;
        self.granted = g.tokens;
        self.left = g.tokens;
        self.deadline = deadline;
    }
}

/// One region of the property test: its regional and its upstream link.
struct Region {
    reg: RegionalCore,
    /// Polled, not yet delivered.
    pending: Option<LeaseBatch>,
    /// Reported failed, never delivered (may arrive late).
    lost: Vec<LeaseBatch>,
    /// Last batch the parent saw (may be duplicated).
    delivered: Option<LeaseBatch>,
}

fn region(now: u64, name: &str, rate_leases: bool) -> Region {
    let cfg = RegionalConfig {
        region: name.into(),
        rate_leases,
        ..RegionalConfig::default()
    };
    Region {
        reg: RegionalCore::new(cfg, Some(rules(0)), 7_000_000, 5_000_000, now),
        pending: None,
        lost: Vec::new(),
        delivered: None,
    }
}

/// `admitted` sorted by time: every window [t_i, t_j] admits at most
/// B + R*(t_j - t_i).
fn i1_holds(admitted: &[(u64, u64)]) -> Result<(), String> {
    i1_holds_across(admitted, None)
}

/// [`i1_holds`] across a change to `R_new`, `B_new <= B` taking effect for
/// the bound at `t_eff` (SPEC §2 "Rule changes"): at most
/// `B + R * T_before + R_new * T_after`.
fn i1_holds_across(admitted: &[(u64, u64)], change: Option<(u64, u64)>) -> Result<(), String> {
    let (t_eff, r_new) = change.unwrap_or((u64::MAX, RATE));
    for i in 0..admitted.len() {
        let mut sum = 0;
        for a in &admitted[i..] {
            sum += a.1;
            let before = a.0.min(t_eff).saturating_sub(admitted[i].0);
            let after = a.0.saturating_sub(admitted[i].0.max(t_eff));
            let bound = BURST as u128
                + (RATE as u128 * u128::from(before) + r_new as u128 * u128::from(after))
                    / 1_000_000_000;
            if sum as u128 > bound {
                return Err(format!(
                    "{sum} admitted in [{}, {}], bound {bound}",
                    admitted[i].0, a.0
                ));
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Two regions under one parent, five agents: I2 at every tier, the
    /// chain invariants, and I1 over all agents' admissions together.
    #[test]
    fn both_tiers_keep_i1_and_i2_under_random_histories(
        ops in proptest::collection::vec(op(), 1..400),
        rates in proptest::collection::vec(any::<bool>(), 2),
    ) {
        both_tiers_keep_i1_and_i2(ops, rates, None)?;
    }

    /// The same with the rule lowered at a random step, its burst below
    /// the number of holders at each tier (down to 1): from
    /// `TTL_max (1 + 2 rho) + epsilon` after the change on, I2 holds at
    /// the parent under the new burst, and I1 holds across the change.
    #[test]
    fn both_tiers_keep_i1_and_i2_when_the_burst_is_lowered_below_the_holders(
        ops in proptest::collection::vec(op(), 1..400),
        rates in proptest::collection::vec(any::<bool>(), 2),
        change_at in 0usize..300,
        rate_new in 1u64..=RATE,
        burst_new in prop_oneof![Just(1u64), 1u64..5],
    ) {
        both_tiers_keep_i1_and_i2(ops, rates, Some((change_at, rate_new, burst_new)))?;
    }

    /// The same with the rule slowed at a random step to one served
    /// centrally (`1/s`, docs/protocol.md "Slow rules, served centrally"):
    /// rate chains from before the change are given back, and the
    /// regionals pass their children's asks through.
    #[test]
    fn both_tiers_keep_i1_and_i2_when_the_rule_becomes_one_served_centrally(
        ops in proptest::collection::vec(op(), 1..400),
        rates in proptest::collection::vec(any::<bool>(), 2),
        change_at in 0usize..300,
        burst_new in 1u64..10,
    ) {
        both_tiers_keep_i1_and_i2(ops, rates, Some((change_at, 1, burst_new)))?;
    }
}

/// Two regions under one parent, five agents, driven by `ops`; `change`:
/// at that step the parent's rule becomes `rate/s burst b`.
fn both_tiers_keep_i1_and_i2(
    ops: Vec<Op>,
    rates: Vec<bool>,
    change: Option<(usize, u64, u64)>,
) -> Result<(), TestCaseError> {
    {
        let mut now = T0;
        let mut parent = parent_at(now);
        // Each region with leases that carry a rate, or of tokens only.
        let mut regions = [region(now, "eu", rates[0]), region(now, "us", rates[1])];
        let mut children: Vec<Child> = vec![Child::default(); CHILDREN];
        let mut admitted: Vec<(u64, u64)> = Vec::new();
        let mut t_eff = None;
        for (i, op) in ops.into_iter().enumerate() {
            if let Some((at, rate, burst)) = change {
                if i == at {
                    parent.set_rules(lowered_rules(rate, burst), now);
                    t_eff = Some(now + CoreConfig::default().restart_wait_ns());
                }
            }
            match op {
                Op::ChildRenew {
                    c,
                    want,
                    lose_reply,
                } => {
                    let ch = &mut children[c];
                    ch.seq += 1;
                    let live = ch.lease_id != 0 && now < ch.deadline;
                    let (lease, spent) = if live {
                        (ch.lease_id, ch.granted - ch.left)
                    } else {
                        (0, 0)
                    };
                    if !live {
                        ch.lease_id = 0;
                        ch.left = 0;
                    }
                    let b = child_batch(
                        &format!("c{c}"),
                        ch.seq,
                        vec![item(ItemKind::Renew, lease, spent, want)],
                    );
                    let r = regions[region_of(c)].reg.handle(now, &b);
                    if !lose_reply {
                        ch.install(now, &r.grants[0]);
                    }
                    ch.last = Some((b, r));
                }
                Op::ChildSpend { c, n } => {
                    let ch = &mut children[c];
                    if ch.lease_id != 0 && now < ch.deadline {
                        let n = n.min(ch.left);
                        if n > 0 {
                            ch.left -= n;
                            admitted.push((now, n));
                        }
                    }
                }
                Op::ChildRelease { c } => {
                    let ch = &mut children[c];
                    if ch.lease_id != 0 {
                        ch.seq += 1;
                        let spent = ch.granted - ch.left;
                        let b = child_batch(
                            &format!("c{c}"),
                            ch.seq,
                            vec![item(ItemKind::Release, ch.lease_id, spent, 0)],
                        );
                        ch.lease_id = 0;
                        ch.left = 0;
                        let r = regions[region_of(c)].reg.handle(now, &b);
                        ch.last = Some((b, r));
                    }
                }
                Op::ChildDuplicate { c } => {
                    if let Some((b, r)) = children[c].last.clone() {
                        let r2 = regions[region_of(c)].reg.handle(now, &b);
                        prop_assert_eq!(r2, r, "a duplicate gets the cached reply");
                    }
                }
                Op::UpPoll { r } => {
                    let g = &mut regions[r];
                    if g.pending.is_none() {
                        g.pending = g.reg.poll_transmit(now);
                    }
                }
                Op::UpPump { r } => {
                    let g = &mut regions[r];
                    if g.pending.is_none() {
                        if let Some(b) = g.reg.poll_transmit(now) {
                            let rep = parent.handle(now, &b);
                            g.reg.handle_reply(now, &rep);
                            g.delivered = Some(b);
                        }
                    }
                }
                Op::UpDeliver { r } => {
                    let g = &mut regions[r];
                    if let Some(b) = g.pending.take() {
                        let rep = parent.handle(now, &b);
                        g.reg.handle_reply(now, &rep);
                        g.delivered = Some(b);
                    }
                }
                Op::UpLoseRequest { r } => {
                    let g = &mut regions[r];
                    if let Some(b) = g.pending.take() {
                        g.reg.handle_failure(now, b.header.as_ref().unwrap().seq);
                        g.lost.push(b);
                    }
                }
                Op::UpLoseReply { r } => {
                    let g = &mut regions[r];
                    if let Some(b) = g.pending.take() {
                        let _ = parent.handle(now, &b);
                        g.reg.handle_failure(now, b.header.as_ref().unwrap().seq);
                        g.delivered = Some(b);
                    }
                }
                Op::UpDeliverLate { r } => {
                    let g = &mut regions[r];
                    if !g.lost.is_empty() {
                        let b = g.lost.remove(0);
                        let rep = parent.handle(now, &b);
                        g.reg.handle_reply(now, &rep); // answers no in-flight batch: ignored
                    }
                }
                Op::UpDuplicate { r } => {
                    let g = &mut regions[r];
                    if let Some(b) = &g.delivered {
                        let rep = parent.handle(now, b);
                        g.reg.handle_reply(now, &rep);
                    }
                }
                Op::Advance { ms } => now += ms * MS,
            }
            let view = parent.key_view(now, &key());
            if let Some(v) = &view {
                // I2 at the parent; until a lowered burst has taken
                // effect, under the old one, with nothing available while
                // over the new one.
                let burst = match t_eff {
                    Some(t) if now < t => BURST,
                    _ => v.burst,
                };
                prop_assert!(v.available + v.outstanding <= burst, "parent I2: {:?}", v);
                prop_assert!(
                    v.available == 0 || v.available + v.outstanding <= v.burst,
                    "parent I2: {:?}",
                    v
                );
            }
            for g in regions.iter_mut() {
                // I2 at the regional (and H <= G, sub-leases within E).
                if let Err(e) = g.reg.check_i2(now) {
                    return Err(TestCaseError::fail(e));
                }
                // The chain's deadline is before the parent's expiry of
                // the lease it names.
                if let (Some(v), Some(c)) = (&view, g.reg.chain_view(&key())) {
                    if let Some((_, l)) = v.holders.iter().find(|(_, l)| l.id == c.parent_lease_id)
                    {
                        prop_assert!(
                            c.deadline_ns < l.expires_ns,
                            "E {} not before the parent's expiry {}",
                            c.deadline_ns,
                            l.expires_ns
                        );
                    }
                }
            }
            prop_assert!(parent.stats().shadow_violations.is_empty());
        }
        if std::env::var_os("REGIONAL_PROPTEST_STATS").is_some() {
            eprintln!(
                "admitted {} tokens in {} admissions; regional {:?}",
                admitted.iter().map(|a| a.1).sum::<u64>(),
                admitted.len(),
                regions[1].reg.stats()
            );
        }
        // I1 over everything the children of both regions admitted.
        admitted.sort_unstable();
        let across = t_eff.zip(change.map(|c| c.1));
        if let Err(e) = i1_holds_across(&admitted, across) {
            return Err(TestCaseError::fail(e));
        }
    }
    Ok(())
}

/// Two regions behind a 30 ms upstream round trip, one child each spending
/// all it can every millisecond and renewing every 10 ms, on a rule of
/// 1 000/s with a burst of 50 (0.05 s of rate): returns the tokens the
/// children admitted in each 100 ms over `secs` seconds.
fn two_regions_behind_a_slow_parent(rate_leases: bool, secs: u64) -> Vec<u64> {
    let text = "rules:\n  - id: hot\n    match: { tenant: \"*\" }\n    rate: 1000/s\n    burst: 50\n    fail_policy: closed\n";
    let rules = RuleSet::parse(text, "t.yaml", 3).unwrap();
    let mut now = T0;
    let mut parent = AllocatorCore::new(
        CoreConfig {
            no_predecessor: true,
            ..CoreConfig::default()
        },
        rules.clone(),
        1,
        1_000_000,
        now,
    );
    let mut regs: Vec<RegionalCore> = ["eu", "us"]
        .iter()
        .map(|name| {
            let cfg = RegionalConfig {
                region: (*name).into(),
                rate_leases,
                ..RegionalConfig::default()
            };
            RegionalCore::new(cfg, Some(rules.clone()), 7_000_000, 5_000_000, now)
        })
        .collect();
    // Per region: (batch, parent handles at, reply back at) in flight.
    type InFlight = (LeaseBatch, u64, u64, Option<LeaseReply>);
    let mut wire: Vec<Option<InFlight>> = vec![None, None];
    // Per child: (lease id, granted, spent, seq).
    let mut kids = [(0u64, 0u64, 0u64, 0u64); 2];
    let mut per_100ms = vec![0u64; (secs * 10) as usize];
    let end = T0 + secs * SEC;
    while now < end {
        for r in 0..2 {
            // The upstream link: 15 ms each way.
            if let Some((b, at, back, reply)) = wire[r].as_mut() {
                if reply.is_none() && now >= *at {
                    *reply = Some(parent.handle(now, b));
                }
                if now >= *back {
                    let (_, _, _, reply) = wire[r].take().unwrap();
                    regs[r].handle_reply(now, &reply.unwrap());
                }
            }
            if wire[r].is_none() {
                if let Some(b) = regs[r].poll_transmit(now) {
                    wire[r] = Some((b, now + 15 * MS, now + 30 * MS, None));
                }
            }
            // The child: spends everything, renews every 10 ms.
            let k = &mut kids[r];
            let (k_lease, k_granted, k_spent) = (k.0, k.1, k.2);
            if k_granted > k_spent {
                per_100ms[((now - T0) / (100 * MS)) as usize] += k_granted - k_spent;
                k.2 = k_granted;
            }
            if (now - T0).is_multiple_of(10 * MS) {
                k.3 += 1;
                let agent = format!("child-{r}");
                let g = ask(&mut regs[r], now, &agent, k.3, k_lease, k.2, 100);
                if g.status == GrantStatus::Granted as i32 && g.lease_id != 0 {
                    *k = (g.lease_id, g.tokens, 0, k.3);
                } else if g.status == GrantStatus::Granted as i32 {
                    *k = (0, 0, 0, k.3);
                }
            }
            regs[r].check_i2(now).unwrap();
        }
        now += MS;
    }
    per_100ms
}

#[test]
fn rate_chains_deliver_a_small_burst_behind_a_slow_parent_within_the_bound() {
    let windows = |w: &[u64]| {
        // I1 over every window of whole 100 ms slots: B + R * T, with T
        // the slots' span (each admission lies inside its slot).
        for i in 0..w.len() {
            let mut sum = 0;
            for (j, x) in w.iter().enumerate().skip(i) {
                sum += x;
                let span_ms = (j - i + 1) as u64 * 100;
                assert!(sum <= 50 + span_ms, "I1: {sum} in slots {i}..={j}");
            }
        }
    };
    let rates = two_regions_behind_a_slow_parent(true, 10);
    let tokens = two_regions_behind_a_slow_parent(false, 10);
    windows(&rates);
    windows(&tokens);
    // After a second of warm-up: 9 s at 1 000/s.
    let after = |w: &[u64]| w[10..].iter().sum::<u64>();
    let (r, t) = (after(&rates), after(&tokens));
    assert!(
        r >= 9_000 * 97 / 100,
        "rate leases delivered {r} of 9 000 (tokens only: {t})"
    );
    assert!(r > t, "rate leases {r}, tokens only {t}");
}

/// Adjacent protocol versions interoperate: a regional that asks for rate
/// leases under a protocol-2 parent (which knows no `want_rate_utps` and
/// grants leases of tokens only: modelled by the field never reaching
/// it) runs chains of tokens; and a protocol-2 regional (which never asks)
/// under this parent gets leases of tokens only. Both serve their child
/// within the parent's bound.
#[test]
fn adjacent_protocol_versions_interoperate_with_and_without_rates() {
    for (asks, parent_knows) in [(true, false), (false, true)] {
        let mut now = T0;
        let mut parent = parent_at(now);
        let cfg = RegionalConfig {
            region: "eu".into(),
            rate_leases: asks,
            ..RegionalConfig::default()
        };
        let mut reg = RegionalCore::new(cfg, Some(rules(0)), 7_000_000, 5_000_000, now);
        let (mut lease, mut seq, mut admitted) = (0u64, 0u64, 0u64);
        let mut chains_seen = 0;
        for _ in 0..200 {
            let g = {
                seq += 1;
                ask(&mut reg, now, "a", seq, lease, 0, 20)
            };
            if g.lease_id != 0 {
                admitted += g.tokens;
                // Spend all at once; report it with the next renewal.
                lease = g.lease_id;
                seq += 1;
                ask(&mut reg, now, "a", seq, lease, g.tokens, 0);
                lease = 0;
            }
            if let Some(mut b) = reg.poll_transmit(now) {
                if !parent_knows {
                    // A protocol-2 parent decodes the batch without the
                    // fields it does not know, digests what it decoded and
                    // answers as version 2.
                    for i in &mut b.items {
                        i.want_rate_utps = 0;
                    }
                }
                let mut r = parent.handle(now, &b);
                if !parent_knows {
                    r.protocol_version = 2;
                }
                assert!(
                    r.grants.iter().all(|g| g.capacity == 0 && g.rate_utps == 0),
                    "no rate lease without asking: {r:?}"
                );
                reg.handle_reply(now, &r);
            }
            reg.check_i2(now).unwrap();
            // Every chain is one of tokens (one ends when a renewal finds
            // the parent's bucket dry and starts again later).
            if let Some(c) = reg.chain_view(&key()) {
                assert_eq!(c.capacity, 0, "a chain of tokens ({asks}, {parent_knows})");
                chains_seen += 1;
            }
            now += 10 * MS;
        }
        assert!(chains_seen > 0, "no chain ({asks}, {parent_knows})");
        // 2 s at 100/s, burst 50.
        assert!(
            admitted <= BURST + RATE * 2,
            "admitted {admitted} ({asks}, {parent_knows})"
        );
        assert!(
            admitted >= RATE,
            "admitted {admitted} ({asks}, {parent_knows}): not served"
        );
        assert_eq!(reg.stats().upstream_mismatched_replies, 0);
    }
}

/// A regional busy opening cold keys (a new tenant's first request every
/// 5 ms, each an urgent upstream batch) still renews its hot key's chain
/// ahead of the chain's deadline: every key is walked once per renew
/// interval whatever else was sent. (Urgent batches used to keep the
/// throttle from lapsing, so the hot chain was never planned and ran out
/// under its children every lease TTL: the demo's hot keys got 33-61 %.)
#[test]
fn a_hot_chain_is_renewed_ahead_of_its_deadline_while_cold_keys_keep_opening() {
    let mut now = T0;
    let mut parent = parent_at(now);
    let mut reg = rate_regional_at(now);
    let tenant_item = |tenant: &str, lease: u64, spent: u64, want: u64| LeaseItem {
        tenant: tenant.into(),
        ..item(ItemKind::Renew, lease, spent, want)
    };
    let (mut hot_lease, mut seq) = (0u64, 0u64);
    let mut opened_hot = false;
    for step in 0..1_000u64 {
        // The hot key's child every 20 ms: spends what it holds, asks for 2.
        if step % 4 == 0 {
            seq += 1;
            let r = reg.handle(
                now,
                &child_batch("a", seq, vec![tenant_item("acme", hot_lease, 2, 2)]),
            );
            let g = &r.grants[0];
            if g.lease_id != 0 {
                hot_lease = g.lease_id;
            }
        }
        // A new cold tenant's first request.
        seq += 1;
        reg.handle(
            now,
            &child_batch(
                "c",
                seq,
                vec![tenant_item(&format!("cold-{step}"), 0, 0, 1)],
            ),
        );
        pump(&mut reg, &mut parent, now);
        reg.check_i2(now).unwrap();
        if reg.chain_view(&key()).is_some() {
            opened_hot = true;
        } else {
            assert!(!opened_hot, "the hot chain ended at {} ms", (now - T0) / MS);
        }
        now += 5 * MS;
    }
    assert!(opened_hot, "the hot key was never opened");
    assert_eq!(reg.stats().chains_lapsed, 0, "{:?}", reg.stats());
}

/// A rate regional whose one child spends a token every `every` 10 ms
/// steps (asked for and spent at once), for 3 s behind a parent that
/// answers at once; and the upstream items it sent in the last 2 s.
fn upstream_items_after_a_second(every: u64) -> (RegionalCore, u64) {
    let mut now = T0;
    let mut parent = parent_at(now);
    let mut reg = rate_regional_at(now);
    let (mut lease, mut seq, mut items) = (0u64, 0u64, 0u64);
    for step in 0..300u64 {
        if step % every == 0 {
            seq += 1;
            let g = ask(&mut reg, now, "a", seq, lease, u64::from(lease != 0), 1);
            if g.lease_id != 0 {
                lease = g.lease_id;
            }
        }
        if let Some(b) = reg.poll_transmit(now) {
            if now >= T0 + SEC {
                items += b.items.len() as u64;
            }
            let r = parent.handle(now, &b);
            reg.handle_reply(now, &r);
        }
        reg.check_i2(now).unwrap();
        now += 10 * MS;
    }
    (reg, items)
}

/// A rate chain at steady demand is not renewed on every walk: the
/// version each renewal brings is as large as the one before, and the
/// next renewal it has anyway acknowledges it. (Every renewal used to
/// bring a version to acknowledge, so a chain renewed itself every renew
/// interval forever.)
#[test]
fn a_rate_chain_at_steady_demand_is_not_renewed_only_to_acknowledge() {
    // 20/s of a 100/s rule: a token every 50 ms.
    let (reg, items) = upstream_items_after_a_second(5);
    assert!(
        reg.chain_view(&key()).is_some_and(|c| c.capacity > 0),
        "a rate chain"
    );
    // 2 s with a 2 s lease: a renewal ahead of the deadline, a few as the
    // estimate settles; 40 when every walk renewed.
    assert!(items <= 10, "{items} upstream items in 2 s");
}

/// A rate chain the parent gave more than it asked for (its floor: a
/// quarter of an equal share per holder asking) is not renewed on every
/// walk to ask for less: the parent answers any smaller ask with the same
/// rate. (A cold key asking 0.5/s of a 200/s rule behind three regions
/// got 4/s and renewed every 50 ms, for as long as it was used: nine in
/// ten of `zipf-100k`'s regional plans.)
#[test]
fn a_rate_chain_at_the_parents_floor_is_not_renewed_to_ask_for_less() {
    // 2/s of a 100/s rule: a token every 500 ms.
    let (reg, items) = upstream_items_after_a_second(50);
    let c = reg.chain_view(&key()).expect("a chain");
    // The floor: 25/s (a quarter of 100/s, one holder), where the
    // children spend 2/s.
    assert!(c.capacity > 0 && c.rate_utps > 10_000_000, "{c:?}");
    // 2 s with a 2 s lease: a renewal ahead of the deadline and a few as
    // the estimate settles; 40 when every walk asked for less.
    assert!(items <= 10, "{items} upstream items in 2 s");
}

/// A chain at the parent's floor asks again once per active window, so
/// it gives rate back soon after another holder comes (the floor is a
/// quarter of an equal share per holder asking: 25/s alone, 12.5/s
/// beside one other), not only at its next renewal ahead of the deadline
/// (1.5 s after the last one with the default low water).
#[test]
fn a_chain_at_the_floor_gives_rate_back_within_an_active_window_of_another_holder() {
    let mut now = T0;
    let mut parent = parent_at(now);
    let mut reg = rate_regional_at(now);
    let (mut lease, mut seq) = (0u64, 0u64);
    let (mut b_lease, mut b_seq) = (0u64, 0u64);
    let mut b_since: Option<u64> = None;
    let mut given_back_after = None;
    for step in 0..400u64 {
        // The region's children: 2/s of a 100/s rule.
        if step % 50 == 0 {
            seq += 1;
            let g = ask(&mut reg, now, "a", seq, lease, u64::from(lease != 0), 1);
            if g.lease_id != 0 {
                lease = g.lease_id;
            }
        }
        if let Some(b) = reg.poll_transmit(now) {
            let renewal = !b.items.is_empty();
            let r = parent.handle(now, &b);
            reg.handle_reply(now, &r);
            let floor = reg
                .chain_view(&key())
                .is_some_and(|c| c.capacity > 0 && c.rate_utps > 20_000_000);
            // Another holder comes right after a renewal that left the
            // region at its floor.
            if b_since.is_none() && renewal && floor && now >= T0 + SEC {
                b_since = Some(now);
            }
        }
        // The other holder (an agent at the parent) asks for 90/s every
        // 100 ms.
        if b_since.is_some() && step % 10 == 0 {
            b_seq += 1;
            let it = LeaseItem {
                want_rate_utps: 90_000_000,
                ..item(ItemKind::Renew, b_lease, 0, 10)
            };
            let r = parent.handle(now, &child_batch("b", b_seq, vec![it]));
            if r.grants[0].lease_id != 0 {
                b_lease = r.grants[0].lease_id;
            }
        }
        if let (Some(t), None) = (b_since, given_back_after) {
            if reg
                .chain_view(&key())
                .is_some_and(|c| c.rate_utps < 13_000_000)
            {
                given_back_after = Some(now - t);
            }
        }
        reg.check_i2(now).unwrap();
        now += 10 * MS;
    }
    assert!(b_since.is_some(), "the region never renewed at its floor");
    let after = given_back_after.expect("the region never gave its floor's rate back");
    assert!(
        after <= 1_100 * MS,
        "gave rate back {} ms after the other holder came",
        after / MS
    );
}

/// Regional `eu` at `now` with the simulator's low water (100 ms) and the
/// rules of version 0.
fn eu_with_short_low_water(now: u64) -> RegionalCore {
    let cfg = RegionalConfig {
        region: "eu".into(),
        low_water_ns: 100 * MS,
        ..RegionalConfig::default()
    };
    RegionalCore::new(cfg, Some(rules(0)), 7_000_000, 5_000_000, now)
}

/// A chain renewed only ahead of its deadline is renewed early enough
/// for the answer to come back before it, also with a short low water
/// and a parent a round trip of 80 ms away (walks wait while a batch is
/// out). Planned within the low water alone (100 ms, the simulator's
/// setting), renewals left 20-60 ms before the deadline and came back
/// after it: the chain lapsed under children still using the key.
#[test]
fn a_chain_renewed_only_ahead_of_its_deadline_does_not_lapse_behind_a_slow_parent() {
    let mut now = T0;
    let mut parent = parent_at(now);
    let mut reg = eu_with_short_low_water(now);
    let (mut lease, mut seq) = (0u64, 0u64);
    let mut reply: Option<(u64, LeaseReply)> = None;
    let mut opened = false;
    for step in 0..1_000u64 {
        // 2/s of a 100/s rule (a chain at the parent's floor): a token
        // every 500 ms, spent at once.
        if step % 50 == 0 {
            seq += 1;
            let g = ask(&mut reg, now, "a", seq, lease, u64::from(lease != 0), 1);
            if g.lease_id != 0 {
                lease = g.lease_id;
            }
        }
        if reply.as_ref().is_some_and(|(at, _)| *at <= now) {
            let (_, r) = reply.take().expect("checked");
            reg.handle_reply(now, &r);
        }
        if reply.is_none() {
            if let Some(b) = reg.poll_transmit(now) {
                reply = Some((now + 80 * MS, parent.handle(now + 40 * MS, &b)));
            }
        }
        reg.check_i2(now).unwrap();
        opened |= reg.chain_view(&key()).is_some();
        now += 10 * MS;
    }
    assert!(opened, "the key was never opened");
    assert_eq!(reg.stats().chains_lapsed, 0, "{:?}", reg.stats());
}

/// Rate chains under random histories and rule changes (an adversarial
/// review's harness and the two cases it found).
mod rate_chains;
mod slot_chains;
mod walks;

/// A pool without a rate yet grows only by the parent's next answer: while
/// the regional asks for a rate despite the parent's token hint (the
/// parent's first version came with a capacity and rate 0, the rule's rate
/// lent to other holders), its children are told one round trip, not the
/// parent's hint on top (small-burst-below-rate seed 7: a region's hundred
/// agents were told 300 ms and sat it out while the rate came 45 ms later).
#[test]
fn children_of_a_pool_without_a_rate_wait_one_round_trip_while_the_regional_asks() {
    let now = T0;
    let mut parent = parent_at(now);
    let mut reg = rate_regional_at(now);
    let g = ask(&mut reg, now, "a", 1, 0, 0, 10);
    assert_eq!(g.tokens, 0, "nothing before the parent is asked");
    let b = reg.poll_transmit(now).expect("the child waits: open");
    // The parent's answer as it is when the other holders' rates fill the
    // rule's rate: a first version with room for a capacity but no rate,
    // no tokens, and a token hint of 250 ms.
    let mut r = parent.handle(now, &b);
    let pg = &mut r.grants[0];
    assert_eq!(pg.status, GrantStatus::Granted as i32);
    assert!(
        pg.lease_id != 0 && pg.capacity > 0,
        "a rate version: {pg:?}"
    );
    pg.rate_utps = 0;
    pg.tokens = 0;
    pg.retry_after_ms = 250;
    pg.holders = 3;
    reg.handle_reply(now + 20 * MS, &r);
    let now = now + 21 * MS;
    // Within the throttle: the renewal that asks for a rate (starved: rate
    // 0 of an equal share) waits for the walk, the hint does not add the
    // parent's 250 ms.
    assert!(
        reg.poll_transmit(now).is_none(),
        "not urgent: the walk sends it"
    );
    let g = ask(&mut reg, now, "a", 2, 0, 0, 10);
    assert_eq!(g.tokens, 0);
    assert!(
        (1..=reg.cfg.renew_interval_ns.div_ceil(MS)).contains(&g.retry_after_ms),
        "told {} ms",
        g.retry_after_ms
    );
    // The walk asks for a rate despite the hint.
    let now = now + reg.cfg.renew_interval_ns;
    let b = reg.poll_transmit(now).expect("the walk renews for a rate");
    assert_eq!(b.items.len(), 1);
    assert!(b.items[0].want_rate_utps > 0);
    assert_eq!(b.items[0].want, 0, "no tokens asked before the hint is out");
}

/// A version that shrinks a rate chain's rate is named to the parent at
/// once, not at the next walk or renewal: the parent counts the larger
/// older version until then, and what the shrink frees is another
/// region's share.
#[test]
fn a_shrink_of_rate_is_acknowledged_at_once() {
    let mut now = T0;
    let mut parent = parent_at(now);
    let mut reg = rate_regional_at(now);
    let (mut lease, mut seq) = (0u64, 0u64);
    // 50/s of a 100/s rule until the regional renews its chain.
    let renewal = loop {
        assert!(now < T0 + 10 * SEC, "no renewal in 10 s");
        seq += 1;
        let g = ask(&mut reg, now, "a", seq, lease, u64::from(lease != 0), 1);
        if g.lease_id != 0 {
            lease = g.lease_id;
        }
        if let Some(b) = reg.poll_transmit(now) {
            // (A renewal, not a heartbeat: a chain at the parent's floor
            // renews before its deadline, not on every walk.)
            if !b.items.is_empty()
                && reg
                    .chain_view(&key())
                    .is_some_and(|c| c.capacity > 0 && c.rate_utps > 20_000_000)
            {
                break b;
            }
            let r = parent.handle(now, &b);
            reg.handle_reply(now, &r);
        }
        now += 20 * MS;
    };
    let c = reg.chain_view(&key()).expect("a rate chain");
    // The parent's answer, as when another holder's demand halves this
    // one's share: same capacity, half the rate.
    let mut r = parent.handle(now, &renewal);
    let pg = &mut r.grants[0];
    assert_eq!(pg.status, GrantStatus::Granted as i32);
    assert!(pg.lease_id != 0 && pg.capacity > 0, "{pg:?}");
    pg.rate_utps = c.rate_utps / 2;
    pg.capacity = c.capacity;
    pg.tokens = 0;
    let newest = pg.lease_id;
    reg.handle_reply(now + 10 * MS, &r);
    let b = reg
        .poll_transmit(now + 11 * MS)
        .expect("the shrink is told at once, within the throttle");
    assert_eq!(b.items.len(), 1);
    assert_eq!(
        b.items[0].lease_id, newest,
        "the renewal names the smaller version"
    );
}

/// Rules of one key served centrally: `5/m burst 5`.
fn slow_rules(version: u64) -> RuleSet {
    RuleSet::parse(
        "rules:\n  - id: hot\n    match: { tenant: \"*\" }\n    rate: 5/m\n    burst: 5\n    fail_policy: closed\n",
        "test.yaml",
        version,
    )
    .expect("valid rules")
}

/// A key served centrally (docs/protocol.md "Slow rules, served
/// centrally"): the regional asks its parent for exactly what its children
/// wait for, with no rate (it has rate chains on), hands it down, and gives
/// the chain back once no child waits and nothing is sub-leased; a child
/// the parent has no token for is told the parent's next-token instant,
/// counted from when the regional asked, not a round trip beyond it.
#[test]
fn a_key_served_centrally_asks_exactly_what_children_wait_for_and_gives_it_back() {
    let t = T0;
    let mut parent = AllocatorCore::new(
        CoreConfig {
            no_predecessor: true,
            ..CoreConfig::default()
        },
        slow_rules(5),
        1,
        1_000_000,
        t,
    );
    let mut reg = rate_regional_with("eu", slow_rules(0), t);
    // Two children wait for 2 and 1.
    let g = ask(&mut reg, t, "a", 1, 0, 0, 2);
    assert!(g.opening && g.tokens == 0, "{g:?}");
    let g = ask(&mut reg, t, "b", 1, 0, 0, 1);
    assert!(g.opening && g.tokens == 0, "{g:?}");
    let b = reg.poll_transmit(t).expect("children wait: ask the parent");
    assert_eq!(b.items.len(), 1);
    assert_eq!((b.items[0].want, b.items[0].want_rate_utps), (3, 0));
    let r = parent.handle(t, &b);
    reg.handle_reply(t, &r);
    assert_eq!(r.grants[0].tokens, 3);
    let ga = ask(&mut reg, t, "a", 2, 0, 0, 2);
    let gb = ask(&mut reg, t, "b", 2, 0, 0, 1);
    assert_eq!((ga.tokens, gb.tokens), (2, 1));
    // Spent and given back at once (as an agent does for such a key).
    let now = t + 10 * MS;
    for (c, g) in [("a", &ga), ("b", &gb)] {
        let r = reg.handle(
            now,
            &child_batch(c, 3, vec![item(ItemKind::Release, g.lease_id, g.tokens, 0)]),
        );
        assert_eq!(r.grants[0].status, GrantStatus::Released as i32);
    }
    // A child that gave up: its ask stays unmet for the active window; the
    // chain goes back at the first walk after it (not after the idle
    // release's two lease TTLs).
    let mut released_at = None;
    let mut now = now;
    while now < t + 3 * SEC && released_at.is_none() {
        now += 50 * MS;
        if let Some(b) = reg.poll_transmit(now) {
            if b.items.iter().any(|i| i.kind == ItemKind::Release as i32) {
                released_at = Some(now);
            }
            let r = parent.handle(now, &b);
            reg.handle_reply(now, &r);
        }
    }
    let released_at = released_at.expect("the chain was given back");
    assert!(
        released_at <= t + reg.config().core.active_window_ns + 100 * MS,
        "released {} ms after the grant",
        (released_at - t) / MS
    );
    assert!(reg.chain_view(&key()).is_none());
    assert_eq!(parent_region_outstanding(&mut parent, now), 0);
    // The parent has 2 left; a child wanting 3 gets 2, and one wanting
    // more after that is told the parent's next token: 12 s after the
    // parent's refill started (the releases above), counted from the ask.
    let t2 = now + 10 * MS;
    assert_eq!(ask(&mut reg, t2, "a", 4, 0, 0, 2).tokens, 0);
    assert_eq!(ask(&mut reg, t2, "b", 4, 0, 0, 1).tokens, 0);
    let b = reg.poll_transmit(t2).expect("ask the parent");
    let t3 = t2 + 30 * MS;
    let r = parent.handle(t3, &b);
    reg.handle_reply(t3 + 30 * MS, &r);
    assert_eq!(r.grants[0].tokens, 2);
    let hint = r.grants[0].retry_after_ms;
    assert!(hint > 11_000, "{:?}", r.grants[0]);
    let ga = ask(&mut reg, t3 + 31 * MS, "a", 5, 0, 0, 2);
    assert_eq!(ga.tokens, 2);
    let gb = ask(&mut reg, t3 + 31 * MS, "b", 5, 0, 0, 1);
    assert_eq!(gb.tokens, 0);
    // The pool is dry until the parent's instant, counted from the ask
    // (t2): never later than the token can exist at the parent.
    let c = reg.poll_transmit(t3 + 40 * MS);
    assert!(c.is_none_or(|b| b.items.iter().all(|i| i.want == 0)));
    let gb = ask(&mut reg, t3 + 41 * MS, "b", 6, 0, 0, 1);
    assert_eq!(gb.tokens, 0);
    assert!(!gb.opening, "the parent is dry: a denial, cached");
    let until = t3 + 41 * MS + gb.retry_after_ms * MS;
    assert!(
        until <= t2 + hint * MS + MS,
        "child told {} ms, the parent's instant is {} ms after the ask",
        gb.retry_after_ms,
        hint
    );
    reg.check_i2(t3 + 41 * MS).unwrap();
}

/// A regional `eu` opens the key for 40 tokens that its child never comes
/// back for, then a second region `us` asks for the key hard: `eu`'s next
/// version is smaller, and its pool holds more than it fits. Returns
/// `eu`'s counters and the parent's tokens handed back. With
/// `parent_reads_left` off, the parent is of the release before the hand
/// back (it decodes `left` on a RENEW and ignores it: stripped here).
fn shrink_under_a_second_region(parent_reads_left: bool) -> (RegionalStats, u64) {
    let mut now = T0;
    let mut parent = parent_at(now);
    let mut eu = rate_regional_at(now);
    let mut us = rate_regional_with("us", rules(0), now);
    let g = ask(&mut eu, now, "a", 1, 0, 0, 40);
    assert!(g.opening, "{g:?}");
    let mut seq = 1;
    while now < T0 + 6 * SEC {
        for (reg, is_eu) in [(&mut eu, true), (&mut us, false)] {
            if !is_eu && now >= T0 + 100 * MS {
                seq += 1;
                let g = ask(reg, now, "b", seq, 0, 0, 40);
                // Spent at once: reported released, all of it.
                if g.lease_id != 0 {
                    seq += 1;
                    reg.handle(
                        now,
                        &child_batch(
                            "b",
                            seq,
                            vec![item(ItemKind::Release, g.lease_id, g.tokens, 0)],
                        ),
                    );
                }
            }
            if let Some(b) = reg.poll_transmit(now) {
                let r = if is_eu && !parent_reads_left {
                    // It decodes `left` (a field since protocol 3) and
                    // digests it, and applies it only to a RELEASE.
                    let mut ignored = b.clone();
                    for i in &mut ignored.items {
                        if i.kind == ItemKind::Renew as i32 {
                            i.left = 0;
                        }
                    }
                    let mut r = parent.handle(now, &ignored);
                    r.request_digest = quotalease_proto::request_digest(&b);
                    r
                } else {
                    parent.handle(now, &b)
                };
                reg.handle_reply(now, &r);
            }
            reg.check_i2(now).unwrap();
        }
        assert_eq!(parent.i2_holds(now, &key()), Some(true));
        now += 10 * MS;
    }
    (eu.stats().clone(), parent.stats().tokens_handed_back)
}

/// A shrink hands back what no longer fits (docs/protocol.md "A shrink
/// hands back"): the regional gives the pool tokens a smaller version
/// does not fit to its parent with the renewal that names that version,
/// and the parent credits them (at most what the older versions' count
/// drops by): none destroyed. A parent of the previous release ignores
/// them: they are destroyed as before, and both tiers keep I2.
#[test]
fn a_shrink_hands_back_what_no_longer_fits() {
    let (eu, credited) = shrink_under_a_second_region(true);
    eprintln!("reads left: eu {eu:?}, parent credited {credited}");
    assert!(eu.tokens_handed_back > 0, "no shrink happened: {eu:?}");
    assert_eq!(credited, eu.tokens_handed_back, "{eu:?}");
    assert_eq!(eu.tokens_destroyed, 0, "{eu:?}");
    let (eu_old, credited_old) = shrink_under_a_second_region(false);
    eprintln!("ignores left: eu {eu_old:?}, parent credited {credited_old}");
    assert_eq!(credited_old, 0);
    assert!(eu_old.tokens_handed_back > 0, "{eu_old:?}");
    assert_eq!(eu_old.upstream_mismatched_replies, 0, "{eu_old:?}");
    assert_eq!(eu_old.chain_breaks + eu_old.chains_lapsed, 0, "{eu_old:?}");
}

#[test]
fn a_young_keys_consumption_is_its_mean_so_far_and_a_cold_ones_is_not_inflated() {
    // 1 800 tokens/s sampled every 50 ms: 200 ms after the key opened the
    // EWMA from 0 reads about 326/s; corrected for the weight it gave its
    // samples, the mean so far.
    let mut ks = KeyState::default();
    for _ in 0..4 {
        ks.sample(90, 0.05);
    }
    assert!((ks.rate - 326.3).abs() < 1.0, "EWMA {}", ks.rate);
    assert!(
        (ks.consumption() - 1800.0).abs() < 1.0,
        "{}",
        ks.consumption()
    );
    // A second on, the correction has all but gone: still the rate.
    for _ in 0..20 {
        ks.sample(90, 0.05);
    }
    assert!(
        (ks.consumption() - 1800.0).abs() < 1.0,
        "{}",
        ks.consumption()
    );
    // One request of a cold key in its first 50 ms is not read as 20/s:
    // below `SEEN_FOR_CORRECTION` tokens the EWMA stands as it is.
    let mut cold = KeyState::default();
    cold.sample(1, 0.05);
    assert!(cold.consumption() < 1.0, "{}", cold.consumption());
    for _ in 0..19 {
        cold.sample(0, 0.05);
    }
    assert!(cold.consumption() < 1.0, "{}", cold.consumption());
}

#[test]
fn an_opening_supersedes_a_heartbeat_in_flight_and_its_late_answer_is_ignored() {
    let now = 1_000 * MS;
    let mut parent = parent_at(now);
    let mut reg = rate_regional_at(now);
    // Nothing to ask yet: the first poll is a heartbeat, and it is out.
    let hb = reg.poll_transmit(now).expect("a first heartbeat");
    assert!(hb.items.is_empty());
    assert!(reg.heartbeat_in_flight());
    // A child asks for a key the region does not hold: told to wait
    // (opening); the next poll opens the key without waiting for the
    // heartbeat's answer.
    let g = ask(&mut reg, now + MS, "a", 1, 0, 0, 10);
    assert!(g.opening && g.tokens == 0, "{g:?}");
    let open = reg
        .poll_transmit(now + MS)
        .expect("the opening goes out at once");
    assert_eq!(open.items.len(), 1);
    assert!(open.header.as_ref().unwrap().seq > hb.header.as_ref().unwrap().seq);
    assert!(!reg.heartbeat_in_flight());
    assert_eq!(reg.stats().upstream_heartbeats_superseded, 1);
    // Nothing else goes out while the opening is in flight.
    assert!(reg.poll_transmit(now + 2 * MS).is_none());
    // The heartbeat's answer arrives late: ignored (the opening is still
    // the batch in flight); then the opening's answer fills the pool.
    let late = parent.handle(now + 2 * MS, &hb);
    reg.handle_reply(now + 3 * MS, &late);
    assert!(reg.poll_transmit(now + 3 * MS).is_none(), "still in flight");
    let r = parent.handle(now + 3 * MS, &open);
    reg.handle_reply(now + 4 * MS, &r);
    let g = ask(&mut reg, now + 4 * MS, "a", 2, 0, 0, 10);
    assert_eq!(g.tokens, 10, "{g:?}");
    reg.check_i2(now + 4 * MS).unwrap();
    // A batch with items in flight is never superseded: a second key's
    // opening is out, a third key's waits for its answer.
    let child_asks = |reg: &mut RegionalCore, t: u64, seq: u64, tenant: &str| {
        let r = reg.handle(
            t,
            &child_batch(
                "a",
                seq,
                vec![LeaseItem {
                    tenant: tenant.into(),
                    ..item(ItemKind::Renew, 0, 0, 5)
                }],
            ),
        );
        r.grants[0].clone()
    };
    let t = now + 5 * MS;
    assert!(child_asks(&mut reg, t, 3, "second").opening);
    let second = reg.poll_transmit(t).expect("the second key's opening");
    assert!(second.items.iter().any(|i| i.tenant == "second"));
    assert!(child_asks(&mut reg, t + MS, 4, "third").opening);
    assert!(
        reg.poll_transmit(t + MS).is_none(),
        "an opening is in flight"
    );
    assert_eq!(reg.stats().upstream_heartbeats_superseded, 1);
}

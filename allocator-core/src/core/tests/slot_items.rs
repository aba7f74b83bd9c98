//! Slot leases through the core's batches (`SLOTS`, `SLOTS_RELEASE`).

use super::*;

const PERMIT_RULES: &str = r#"
rules:
  - id: gen
    match: { tenant: "*", route: /gen }
    concurrency: 4
  - id: both
    match: { tenant: "*", route: /both }
    rate: 10/s
    burst: 10
    concurrency: 2
  - id: capped
    match: { tenant: "*" }
    concurrency: 1
    max_keys: 1
  - id: rate-only
    match: { tenant: "*", route: /rate }
    rate: 10/s
    burst: 10
"#;

fn rules(version: u64) -> RuleSet {
    RuleSet::parse(PERMIT_RULES, "test.yaml", version).expect("valid rules")
}

fn core(now: u64, ready: bool) -> AllocatorCore {
    let mut c = AllocatorCore::new(CoreConfig::default(), rules(7), 1, 1000, now);
    if ready {
        c.ready_at_ns = None;
        c.slots_phantom_until_ns = None;
    }
    c
}

fn slots(rule: &str, tenant: &str, route: &str, lease_id: u64, keep: u64, want: u64) -> LeaseItem {
    LeaseItem {
        rule_id: rule.into(),
        tenant: tenant.into(),
        route: route.into(),
        kind: ItemKind::Slots as i32,
        lease_id,
        keep,
        want,
        ..LeaseItem::default()
    }
}

fn give_back(rule: &str, tenant: &str, route: &str, lease_id: u64) -> LeaseItem {
    LeaseItem {
        kind: ItemKind::SlotsRelease as i32,
        ..slots(rule, tenant, route, lease_id, 0, 0)
    }
}

/// One item from `agent` (sequence `seq`): its grant.
fn ask(c: &mut AllocatorCore, now: u64, agent: &str, seq: u64, item: LeaseItem) -> Grant {
    c.handle(now, &batch(agent, 1, seq, vec![item]))
        .grants
        .remove(0)
}

fn key(rule: &str, tenant: &str, route: &str) -> KeyId {
    KeyId::new(rule, tenant, route)
}

#[test]
fn slots_are_lent_within_n_and_come_back_on_release() {
    let mut c = core(T, true);
    let a = ask(&mut c, T, "a", 1, slots("gen", "t", "/gen", 0, 0, 3));
    assert_eq!(a.status, GrantStatus::Granted as i32, "{a:?}");
    assert_eq!((a.tokens, a.carried), (3, 0));
    assert!(a.lease_id != 0 && a.fence != 0 && a.ttl_ms == 1000, "{a:?}");
    // b wants 3 as well: 1 is left, and b is told the key is contended.
    let b = ask(&mut c, T, "b", 1, slots("gen", "t", "/gen", 0, 0, 3));
    assert_eq!(b.tokens, 1);
    assert!(b.contended && !b.over, "{b:?}");
    assert!(b.fence > a.fence);
    // Another tenant's key has its own 4.
    let other = ask(&mut c, T, "b", 2, slots("gen", "u", "/gen", 0, 0, 4));
    assert_eq!(other.tokens, 4);
    let v = c.slot_view(T, &key("gen", "t", "/gen")).unwrap();
    assert_eq!((v.n, v.held, v.leases.len()), (4, 4, 2));
    // a renews keeping 1 of its 3 (2 permits ended): b gets them.
    let a2 = ask(
        &mut c,
        T + 10 * MS,
        "a",
        2,
        slots("gen", "t", "/gen", a.lease_id, 1, 0),
    );
    assert_eq!((a2.tokens, a2.carried), (1, 1));
    let b2 = ask(
        &mut c,
        T + 20 * MS,
        "b",
        3,
        slots("gen", "t", "/gen", b.lease_id, 1, 2),
    );
    assert_eq!((b2.tokens, b2.carried), (3, 1));
    // a gives its lease back; a release of someone else's lease frees nothing.
    let r = ask(
        &mut c,
        T + 30 * MS,
        "b",
        4,
        give_back("gen", "t", "/gen", a2.lease_id),
    );
    assert_eq!(r.status, GrantStatus::Released as i32);
    assert_eq!(
        c.slot_view(T + 30 * MS, &key("gen", "t", "/gen"))
            .unwrap()
            .held,
        4
    );
    ask(
        &mut c,
        T + 40 * MS,
        "a",
        3,
        give_back("gen", "t", "/gen", a2.lease_id),
    );
    assert_eq!(
        c.slot_view(T + 40 * MS, &key("gen", "t", "/gen"))
            .unwrap()
            .held,
        3
    );
    assert_eq!(c.stats().slot_releases, 1);
    // Leases expire: everything is free after the TTL.
    let late = T + 2 * SEC;
    assert_eq!(c.slot_view(late, &key("gen", "t", "/gen")).unwrap().held, 0);
}

#[test]
fn a_duplicate_batch_is_answered_the_same_and_counted_once() {
    let mut c = core(T, true);
    let b = batch("a", 1, 1, vec![slots("gen", "t", "/gen", 0, 0, 2)]);
    let r1 = c.handle(T, &b);
    let r2 = c.handle(T + MS, &b);
    assert_eq!(r1, r2);
    assert_eq!(
        c.slot_view(T + MS, &key("gen", "t", "/gen")).unwrap().held,
        2
    );
}

#[test]
fn after_a_restart_the_phantom_holds_every_slot_until_the_wait_is_over() {
    let start = T;
    let mut c = core(start, false);
    let wait = c.config().restart_wait_ns();
    let g = ask(
        &mut c,
        start + SEC,
        "a",
        1,
        slots("gen", "t", "/gen", 0, 0, 2),
    );
    assert_eq!((g.lease_id, g.tokens), (0, 0), "{g:?}");
    assert!(g.starting, "{g:?}");
    let left_ms = (start + wait - (start + SEC)).div_ceil(MS);
    assert_eq!(g.retry_after_ms, left_ms);
    // A holder that keeps slots of a predecessor's lease (an id below this
    // core's) adopts them out of the phantom: its permits are renewed on,
    // to at least the phantom's end; nothing fresh meanwhile.
    let g = ask(
        &mut c,
        start + 2 * SEC,
        "b",
        1,
        slots("gen", "t", "/gen", 77, 2, 1),
    );
    assert_eq!((g.tokens, g.carried), (2, 2), "{g:?}");
    assert!(g.lease_id >= 1000 && !g.starting, "{g:?}");
    assert!(
        start + 2 * SEC + g.ttl_ms * MS + MS >= start + wait,
        "{g:?}"
    );
    // The same predecessor lease named again adopts nothing more.
    let g = ask(
        &mut c,
        start + 2 * SEC,
        "c",
        1,
        slots("gen", "t", "/gen", 77, 2, 0),
    );
    assert_eq!(g.tokens, 0, "{g:?}");
    let after = start + wait + MS;
    let g = ask(&mut c, after, "a", 2, slots("gen", "t", "/gen", 0, 0, 4));
    assert_eq!(g.tokens, 2, "N = 4 less the 2 adopted: {g:?}");
    assert!(!g.starting);
    // A key first asked for after the wait has no phantom at all.
    let g = ask(&mut c, after, "a", 3, slots("gen", "u", "/gen", 0, 0, 4));
    assert_eq!(g.tokens, 4);
}

#[test]
fn a_lowered_n_keeps_the_kept_slots_and_grants_nothing_fresh_until_below_it() {
    let mut c = core(T, true);
    let a = ask(&mut c, T, "a", 1, slots("gen", "t", "/gen", 0, 0, 4));
    assert_eq!(a.tokens, 4);
    let lowered = PERMIT_RULES.replace("concurrency: 4", "concurrency: 2");
    c.set_rules(RuleSet::parse(&lowered, "test.yaml", 8).unwrap(), T + MS);
    let a2 = ask(
        &mut c,
        T + 2 * MS,
        "a",
        2,
        slots("gen", "t", "/gen", a.lease_id, 4, 1),
    );
    assert_eq!((a2.tokens, a2.carried), (4, 4), "{a2:?}");
    assert!(a2.over, "{a2:?}");
    let b = ask(
        &mut c,
        T + 3 * MS,
        "b",
        1,
        slots("gen", "t", "/gen", 0, 0, 1),
    );
    assert_eq!(b.tokens, 0);
    // Permits end: a keeps 1, and b gets the one slot left below N = 2.
    let a3 = ask(
        &mut c,
        T + 4 * MS,
        "a",
        3,
        slots("gen", "t", "/gen", a2.lease_id, 1, 0),
    );
    assert!(!a3.over && a3.tokens == 1, "{a3:?}");
    let b2 = ask(
        &mut c,
        T + 5 * MS,
        "b",
        2,
        slots("gen", "t", "/gen", 0, 0, 2),
    );
    assert_eq!(b2.tokens, 1);
}

#[test]
fn items_of_the_wrong_kind_or_key_are_refused_naming_what() {
    let mut c = core(T, true);
    // Slots of a rule without concurrency, tokens of one without a rate.
    let g = ask(&mut c, T, "a", 1, slots("rate-only", "t", "/rate", 0, 0, 1));
    assert_eq!(g.status, GrantStatus::UnknownRule as i32);
    assert!(g.detail.contains("no rule with concurrency"), "{g:?}");
    let g = ask(&mut c, T, "a", 2, renew("gen", "t", "/gen", 0, 0, 1));
    assert_eq!(g.status, GrantStatus::UnknownRule as i32, "{g:?}");
    // A rule with both: tokens and slots, each from its own ledger.
    let g = ask(&mut c, T, "a", 3, renew("both", "t", "/both", 0, 0, 5));
    assert_eq!(g.tokens, 5);
    let g = ask(&mut c, T, "a", 4, slots("both", "t", "/both", 0, 0, 5));
    assert_eq!(g.tokens, 2, "want is capped at N: {g:?}");
    let g = ask(&mut c, T, "a", 5, slots("gen", "", "/gen", 0, 0, 1));
    assert_eq!(g.status, GrantStatus::BadItem as i32);
    assert!(g.detail.starts_with("tenant:"), "{g:?}");
    let g = ask(&mut c, T, "a", 6, slots("gen", "t", "/other", 0, 0, 1));
    assert!(g.detail.starts_with("route:"), "{g:?}");
    // max_keys counts slot keys.
    let g = ask(&mut c, T, "a", 7, slots("capped", "t", "", 0, 0, 1));
    assert_eq!(g.tokens, 1);
    let g = ask(&mut c, T, "a", 8, slots("capped", "u", "", 0, 0, 1));
    assert_eq!(g.status, GrantStatus::KeyLimit as i32, "{g:?}");
    // A release for a rule that is gone is still answered.
    let g = ask(&mut c, T, "a", 9, give_back("gone", "t", "", 5));
    assert_eq!(g.status, GrantStatus::Released as i32);
}

#[test]
fn idle_slot_keys_are_dropped_and_a_remade_ledger_fences_above_the_old_one() {
    let mut c = core(T, true);
    let a = ask(&mut c, T, "a", 1, slots("gen", "t", "/gen", 0, 0, 1));
    let a2 = ask(
        &mut c,
        T + MS,
        "a",
        2,
        slots("gen", "t", "/gen", a.lease_id, 1, 0),
    );
    assert!(a2.fence > a.fence);
    c.sweep(T + 500 * MS);
    assert_eq!(c.slot_key_count(), 1, "a lease is out");
    // Its lease expired and its demand is older than the window.
    c.sweep(T + 3 * SEC);
    assert_eq!(c.slot_key_count(), 0);
    let b = ask(
        &mut c,
        T + 3 * SEC,
        "b",
        1,
        slots("gen", "t", "/gen", 0, 0, 1),
    );
    assert!(b.fence > a2.fence, "{} after {}", b.fence, a2.fence);
    // A release that leaves a ledger idle drops it at once.
    let r = ask(
        &mut c,
        T + 5 * SEC,
        "b",
        2,
        give_back("gen", "t", "/gen", b.lease_id),
    );
    assert_eq!(r.status, GrantStatus::Released as i32);
    assert_eq!(c.slot_key_count(), 0);
}

#[test]
fn fencing_numbers_grow_across_a_restart_and_fit_a_permit_token() {
    let mut c = core(T, true);
    let a = ask(&mut c, T, "a", 1, slots("gen", "t", "/gen", 0, 0, 1));
    // The successor starts later with a larger lease id base (its wall
    // clock at start): its fencing numbers start above.
    let base = 1000 + 2_000_000_000;
    let mut d = AllocatorCore::new(CoreConfig::default(), rules(7), 2, base, T);
    d.ready_at_ns = None;
    d.slots_phantom_until_ns = None;
    let b = ask(&mut d, T, "a", 1, slots("gen", "t", "/gen", 0, 0, 1));
    assert!(b.fence > a.fence, "{} after {}", b.fence, a.fence);
    // Today's wall clock (ns) as a base stays below 2^44.
    let today = 1_796_000_000_000_000_000;
    let mut e = AllocatorCore::new(CoreConfig::default(), rules(7), 3, today, T);
    e.ready_at_ns = None;
    e.slots_phantom_until_ns = None;
    let g = ask(&mut e, T, "a", 1, slots("gen", "t", "/gen", 0, 0, 1));
    assert!(g.fence > b.fence && g.fence < 1 << 44, "{}", g.fence);
}

#[test]
fn a_regional_pool_lends_nothing_before_its_parent_lease_and_wakes_its_upstream_side() {
    let mut c = AllocatorCore::new_pooled(CoreConfig::default(), rules(7), 1, 1000, T);
    let g = ask(&mut c, T, "a", 1, slots("gen", "t", "/gen", 0, 0, 1));
    assert_eq!(g.status, GrantStatus::Granted as i32);
    assert_eq!((g.lease_id, g.tokens), (0, 0), "{g:?}");
    assert!(g.opening, "the upstream side must be woken: {g:?}");
    let key = KeyId::new("gen", "t", "/gen");
    assert_eq!(c.take_new_slot_keys(), vec![key.clone()]);
    // The regional's upstream side sets the pool; then it lends, no lease
    // past the pool's cap.
    let cap = T + 700 * MS;
    c.slot_ledger_mut(&key)
        .expect("made by the ask")
        .set_pool(3, cap, 40, 64, false);
    let g = ask(&mut c, T + 1, "a", 2, slots("gen", "t", "/gen", 0, 0, 5));
    assert_eq!(g.tokens, 3, "{g:?}");
    assert_eq!(g.fence, 40, "the first of the parent's block: {g:?}");
    assert!(T + 1 + g.ttl_ms * MS <= cap, "{g:?}");
    assert!(g.opening, "2 more wanted than the pool holds: {g:?}");
    // Rules do not change a pool's size (it is the parent lease's).
    c.set_rules(rules(7), T + 2);
    assert_eq!(c.slot_ledger_mut(&key).map(|l| l.n()), Some(3));
}

/// A start that resumes its tokens from the reservations (`no_predecessor`
/// for tokens) still waits out an earlier term's slot leases: slot
/// ledgers are not in the reservations. A new ledger's first start waits
/// only its grace. Found in session 26: a restart with a state directory
/// lent all `N` slots once the start's grace (shorter than `TTL_max` when
/// `--ttl-max` is above 3 s) was over, beside the predecessor's.
#[test]
fn a_start_from_reservations_still_waits_out_slot_leases() {
    let base = CoreConfig {
        ttl_max_ns: 10 * SEC,
        ..CoreConfig::default()
    };
    let durable = |first: bool| crate::term::Durable {
        first,
        lost: false,
        predecessor_ttl_max_ns: 0,
        ledger_id: 9,
        reservations: Vec::new(),
        checkpoint: None,
    };
    let grace = crate::term::Grace {
        first_ns: 3 * SEC,
        later_ns: 3 * SEC,
    };
    // A restart: tokens resume at once (no_predecessor), slots wait the
    // whole restart wait (10 s and the margins), beyond the 3 s grace.
    let cfg = crate::term::config(base.clone(), &durable(false), grace, false);
    assert!(cfg.no_predecessor && cfg.slot_leases_may_be_out);
    let wait = cfg.restart_wait_ns();
    let mut c = AllocatorCore::new(cfg, rules(7), 1, 1000, T);
    let g = ask(
        &mut c,
        T + 4 * SEC,
        "a",
        1,
        slots("gen", "t", "/gen", 0, 0, 2),
    );
    assert_eq!(
        g.tokens, 0,
        "fresh slots after the grace, within the wait: {g:?}"
    );
    assert!(g.starting && g.retry_after_ms > 0, "{g:?}");
    let g = ask(&mut c, T + wait, "a", 2, slots("gen", "t", "/gen", 0, 0, 2));
    assert_eq!(g.tokens, 2, "{g:?}");
    // A new ledger's first start: only the grace.
    let cfg = crate::term::config(base, &durable(true), grace, false);
    assert!(!cfg.slot_leases_may_be_out);
    let mut c = AllocatorCore::new(cfg, rules(7), 1, 1000, T);
    let g = ask(&mut c, T + SEC, "a", 1, slots("gen", "t", "/gen", 0, 0, 2));
    assert_eq!(g.tokens, 0, "{g:?}");
    let g = ask(
        &mut c,
        T + 3 * SEC,
        "a",
        2,
        slots("gen", "t", "/gen", 0, 0, 2),
    );
    assert_eq!(g.tokens, 2, "{g:?}");
}

/// A batch from `agent` with instance nonce `instance`, by `principal`.
fn from(
    c: &mut AllocatorCore,
    now: u64,
    principal: &str,
    agent: &str,
    instance: u64,
    seq: u64,
    items: Vec<LeaseItem>,
) -> LeaseReply {
    let mut b = batch(agent, 1, seq, items);
    b.header.as_mut().unwrap().instance = instance;
    c.handle_from(now, &b, principal)
}

fn forward(holder_instance: u64, holder_incarnation: u64, permit: u64) -> LeaseItem {
    LeaseItem {
        kind: ItemKind::PermitRelease as i32,
        holder_instance,
        holder_incarnation,
        permit,
        ..slots("gen", "t", "/gen", 0, 0, 0)
    }
}

/// A release through another holder reaches the permit's holder once, in
/// its next reply, only when both are of one principal and the holder's
/// incarnation is the one named (SPEC §8).
#[test]
fn a_forwarded_release_reaches_its_holder_once_within_its_principal() {
    let mut c = core(T, true);
    // Holder a (instance 11) takes slots; b (instance 22) and a stranger
    // of another principal (instance 33) are known too.
    let r = from(
        &mut c,
        T,
        "svc",
        "a",
        11,
        1,
        vec![slots("gen", "t", "/gen", 0, 0, 2)],
    );
    assert_eq!(r.grants[0].tokens, 2);
    from(
        &mut c,
        T,
        "svc",
        "b",
        22,
        1,
        vec![slots("gen", "t", "/gen", 0, 0, 0)],
    );
    from(
        &mut c,
        T,
        "other",
        "x",
        33,
        1,
        vec![slots("gen", "t", "/gen", 0, 0, 0)],
    );
    // b releases a's permit 5: queued for a.
    let r = from(&mut c, T + 1, "svc", "b", 22, 2, vec![forward(11, 1, 5)]);
    assert_eq!(r.grants[0].status, GrantStatus::Released as i32, "{r:?}");
    assert!(r.released_permits.is_empty(), "not b's to apply");
    // The same release twice is queued once.
    from(&mut c, T + 2, "svc", "b", 22, 3, vec![forward(11, 1, 5)]);
    // Another principal cannot reach a, whatever it names; nor can a
    // wrong incarnation.
    let r = from(&mut c, T + 3, "other", "x", 33, 2, vec![forward(11, 1, 6)]);
    assert_eq!(
        r.grants[0].status,
        GrantStatus::UnknownHolder as i32,
        "{r:?}"
    );
    let r = from(&mut c, T + 3, "svc", "b", 22, 4, vec![forward(11, 2, 7)]);
    assert_eq!(
        r.grants[0].status,
        GrantStatus::UnknownHolder as i32,
        "{r:?}"
    );
    // a's next reply carries permit 5, once.
    let r = from(&mut c, T + 4, "svc", "a", 11, 2, vec![]);
    assert_eq!(r.released_permits.len(), 1, "{r:?}");
    let f = &r.released_permits[0];
    assert_eq!(
        (f.rule_id.as_str(), f.tenant.as_str(), f.route.as_str()),
        ("gen", "t", "/gen")
    );
    assert_eq!((f.incarnation, f.permit), (1, 5));
    let r = from(&mut c, T + 5, "svc", "a", 11, 3, vec![]);
    assert!(r.released_permits.is_empty());
    assert_eq!(c.stats().forwarded_releases, 1);
    assert_eq!(c.stats().forwarded_unknown, 2);
    // Bounded: past MAX_FORWARDED waiting for a, refused naming the field.
    for i in 0..crate::core::MAX_FORWARDED as u64 {
        from(
            &mut c,
            T + 6,
            "svc",
            "b",
            22,
            10 + i,
            vec![forward(11, 1, 100 + i)],
        );
    }
    let r = from(
        &mut c,
        T + 7,
        "svc",
        "b",
        22,
        1_000_000,
        vec![forward(11, 1, 1)],
    );
    assert_eq!(r.grants[0].status, GrantStatus::BadItem as i32);
    assert!(r.grants[0].detail.starts_with("permit:"), "{r:?}");
    // A regional allocator forwards to its own children only.
    let mut regional = AllocatorCore::new_pooled(CoreConfig::default(), rules(7), 1, 1000, T);
    let g = regional
        .handle(T, &batch("b", 1, 1, vec![forward(11, 1, 5)]))
        .grants
        .remove(0);
    assert_eq!(g.status, GrantStatus::UnknownHolder as i32);
}

/// A `resume` folds the leases of the other processes of the asker's id
/// and principal (a regional that restarted drew a new instance nonce),
/// keeping their slots, and nobody else's: not another id's, not the same
/// id under another principal (SPEC §8).
#[test]
fn a_resume_folds_the_leases_of_the_askers_other_processes_only() {
    let mut c = core(T, true);
    let take = |c: &mut AllocatorCore, principal: &str, id: &str, inst: u64, want: u64| {
        from(
            c,
            T,
            principal,
            id,
            inst,
            1,
            vec![slots("gen", "t", "/gen", 0, 0, want)],
        )
        .grants[0]
            .tokens
    };
    // The old process of region/eu (instance 1), another region, and a
    // process of region/eu under another principal.
    assert_eq!(take(&mut c, "p", "region/eu", 1, 2), 2);
    assert_eq!(take(&mut c, "p", "region/us", 2, 1), 1);
    assert_eq!(take(&mut c, "q", "region/eu", 3, 1), 1);
    let resume = LeaseItem {
        resume: true,
        ..slots("gen", "t", "/gen", 0, 0, 0)
    };
    let g = from(&mut c, T + MS, "p", "region/eu", 4, 1, vec![resume]).grants[0].clone();
    assert_eq!(
        (g.carried, g.tokens),
        (2, 2),
        "region/eu's old lease only: {g:?}"
    );
    assert!(g.ttl_ms >= 999, "no earlier than the folded lease: {g:?}");
    let ledger = c.slot_ledger_mut(&key("gen", "t", "/gen")).unwrap();
    assert_eq!(ledger.held(), 4, "nothing counted twice or dropped");
    assert_eq!(ledger.leases().len(), 3);
    // Without `resume`, a new process keeps nothing of its predecessor's.
    let g = from(
        &mut c,
        T + 2 * MS,
        "p",
        "region/us",
        5,
        1,
        vec![slots("gen", "t", "/gen", 0, 0, 0)],
    )
    .grants[0]
        .clone();
    assert_eq!(g.carried, 0);
}

//! Allocator core tests: messages, duplicates, restarts, rules.

use super::*;
use quotalease_proto::lease::{ItemKind, LeaseItem, RequestHeader};

const MS: u64 = 1_000_000;
const SEC: u64 = 1_000 * MS;
/// A time long after the allocator became ready: every new key is full.
const T: u64 = 1_000 * SEC;

const RULES: &str = r#"
rules:
  - id: orders
    match: { tenant: "*", route: /api/orders }
    rate: 60/m
    burst: 20
    fail_policy: lease_only
  - id: capped
    match: { tenant: "*" }
    rate: 10/s
    burst: 10
    max_keys: 2
"#;

fn core_at(now: u64, ready_immediately: bool) -> AllocatorCore {
    let rules = RuleSet::parse(RULES, "test.yaml", 7).expect("valid rules");
    let cfg = CoreConfig::default();
    let mut c = AllocatorCore::new(cfg, rules, 1, 1000, now);
    if ready_immediately {
        c.ready_at_ns = None;
    }
    c
}

fn batch(agent: &str, inc: u64, seq: u64, items: Vec<LeaseItem>) -> LeaseBatch {
    LeaseBatch {
        header: Some(RequestHeader {
            agent_id: agent.into(),
            incarnation: inc,
            seq,
            protocol_version: PROTOCOL_VERSION,
            rules_version: 7,
            instance: 0,
            ledger_id: 0,
            run_id: 0,
            record_seq: 0,
            cluster: String::new(),
            ledger_cluster: String::new(),
        }),
        items,
        ttl_ms: 1000,
        shard: 0,
    }
}

fn renew(rule: &str, tenant: &str, route: &str, lease_id: u64, spent: u64, want: u64) -> LeaseItem {
    LeaseItem {
        rule_id: rule.into(),
        tenant: tenant.into(),
        route: route.into(),
        kind: ItemKind::Renew as i32,
        lease_id,
        spent,
        want,
        ..LeaseItem::default()
    }
}

#[test]
fn duplicate_gets_the_cached_reply_and_never_grants_twice() {
    let mut c = core_at(T, true);
    let b = batch(
        "a1",
        1,
        1,
        vec![renew("orders", "acme", "/api/orders", 0, 0, 5)],
    );
    let r1 = c.handle(T, &b);
    assert_eq!(r1.grants[0].tokens, 5);
    let r2 = c.handle(T, &b);
    assert_eq!(r1, r2);
    assert_eq!(c.stats().duplicates, 1);
    let key = KeyId::new("orders", "acme", "/api/orders");
    let v = c.key_view(T, &key).unwrap();
    assert_eq!(v.outstanding, 5);
    assert_eq!(v.available, 15);
    assert_eq!(v.holders.len(), 1);
}

#[test]
fn old_sequence_numbers_and_incarnations_are_stale() {
    let mut c = core_at(T, true);
    for seq in 1..=100 {
        c.handle(
            T,
            &batch(
                "a1",
                1,
                seq,
                vec![renew("orders", "t", "/api/orders", 0, 0, 0)],
            ),
        );
    }
    // seq 1 fell out of the 64-entry window: refused, nothing applied.
    let r = c.handle(
        T,
        &batch(
            "a1",
            1,
            1,
            vec![renew("orders", "t", "/api/orders", 0, 0, 5)],
        ),
    );
    assert_eq!(r.grants[0].status, GrantStatus::Stale as i32);
    assert_eq!(r.grants[0].tokens, 0);
    // A new incarnation starts a fresh window; the old one is stale.
    let r = c.handle(
        T,
        &batch(
            "a1",
            2,
            1,
            vec![renew("orders", "t", "/api/orders", 0, 0, 5)],
        ),
    );
    assert_eq!(r.grants[0].tokens, 5);
    let r = c.handle(
        T,
        &batch(
            "a1",
            1,
            500,
            vec![renew("orders", "t", "/api/orders", 0, 0, 5)],
        ),
    );
    assert_eq!(r.grants[0].status, GrantStatus::Stale as i32);
}

#[test]
fn release_applies_once_and_only_to_known_leases() {
    let mut c = core_at(T, true);
    let r = c.handle(
        T,
        &batch(
            "a1",
            1,
            1,
            vec![renew("orders", "t", "/api/orders", 0, 0, 10)],
        ),
    );
    let id = r.grants[0].lease_id;
    let mut rel = renew("orders", "t", "/api/orders", id, 4, 0);
    rel.kind = ItemKind::Release as i32;
    c.handle(T, &batch("a1", 1, 2, vec![rel.clone()]));
    c.handle(T, &batch("a1", 1, 3, vec![rel.clone()]));
    // Another agent cannot release someone else's lease id.
    c.handle(T, &batch("a2", 1, 1, vec![rel]));
    assert_eq!(c.stats().releases, 1);
    assert_eq!(c.stats().tokens_released, 6);
}

#[test]
fn a_started_allocator_grants_nothing_until_ttl_max_has_passed() {
    let mut c = core_at(SEC, false);
    let wait = CoreConfig::default().restart_wait_ns();
    assert!(wait > 2 * SEC);
    let r = c.handle(
        SEC,
        &batch(
            "a1",
            1,
            1,
            vec![renew("orders", "t", "/api/orders", 0, 0, 5)],
        ),
    );
    assert_eq!(r.grants[0].tokens, 0);
    assert!(r.grants[0].retry_after_ms > 0);
    // Right after ready the bucket has only refilled since then (1/s,
    // slowed by rho: 2 tokens take 2.002002 s).
    let at = SEC + wait + 2 * SEC + 3 * MS;
    let r = c.handle(
        at,
        &batch(
            "a1",
            1,
            2,
            vec![renew("orders", "t", "/api/orders", 0, 0, 20)],
        ),
    );
    assert_eq!(r.grants[0].tokens, 2);
}

#[test]
fn bad_items_name_the_field_and_unknown_rules_are_reported() {
    let mut c = core_at(T, true);
    let r = c.handle(
        SEC,
        &batch(
            "a1",
            1,
            1,
            vec![
                renew("nope", "t", "/api/orders", 0, 0, 1),
                renew("orders", "t", "/api/other", 0, 0, 1),
                renew("orders", "", "/api/orders", 0, 0, 1),
                renew("orders", &"x".repeat(300), "/api/orders", 0, 0, 1),
            ],
        ),
    );
    assert_eq!(r.grants[0].status, GrantStatus::UnknownRule as i32);
    assert!(
        r.grants[1].detail.starts_with("route:"),
        "{}",
        r.grants[1].detail
    );
    assert!(
        r.grants[2].detail.starts_with("tenant:"),
        "{}",
        r.grants[2].detail
    );
    assert!(
        r.grants[3].detail.contains("at most 256"),
        "{}",
        r.grants[3].detail
    );
    let mut no_header = batch(
        "a1",
        1,
        2,
        vec![renew("orders", "t", "/api/orders", 0, 0, 1)],
    );
    no_header.header = None;
    let r = c.handle(T, &no_header);
    assert!(r.grants[0].detail.starts_with("header"));
}

#[test]
fn max_keys_caps_distinct_keys_and_full_idle_keys_are_dropped() {
    let mut c = core_at(T, true);
    for (i, t) in ["a", "b", "c"].iter().enumerate() {
        let r = c.handle(
            T,
            &batch("a1", 1, i as u64 + 1, vec![renew("capped", t, "", 0, 0, 1)]),
        );
        let want = if i < 2 {
            GrantStatus::Granted
        } else {
            GrantStatus::KeyLimit
        };
        assert_eq!(r.grants[0].status, want as i32);
    }
    assert_eq!(c.key_count(), 2);
    // Leases expire after 1 s, buckets refill at 10/s: after 3 s both are full.
    c.sweep(T + 4 * SEC);
    assert_eq!(c.key_count(), 0);
    let r = c.handle(
        T + 4 * SEC,
        &batch("a1", 1, 10, vec![renew("capped", "c", "", 0, 0, 1)]),
    );
    assert_eq!(r.grants[0].status, GrantStatus::Granted as i32);
}

#[test]
fn stale_rules_version_gets_the_rules_and_lag_is_reported() {
    let mut c = core_at(T, true);
    let mut b = batch("a1", 1, 1, vec![]);
    b.header.as_mut().unwrap().rules_version = 3;
    let r = c.handle(T, &b);
    assert_eq!(r.rules.as_ref().map(|r| r.version), Some(7));
    assert_eq!(c.rule_lag(), vec![("a1".to_string(), 1)]);
    let r = c.handle(T, &batch("a1", 1, 2, vec![]));
    assert!(r.rules.is_none());
    assert_eq!(c.rule_lag(), vec![("a1".to_string(), 0)]);
}

#[test]
fn rule_change_applies_without_reset() {
    let mut c = core_at(T, true);
    let r = c.handle(
        T,
        &batch(
            "a1",
            1,
            1,
            vec![renew("orders", "t", "/api/orders", 0, 0, 20)],
        ),
    );
    assert_eq!(r.grants[0].tokens, 20);
    let text = RULES.replace("burst: 20", "burst: 30");
    c.set_rules(RuleSet::parse(&text, "t.yaml", 8).unwrap(), T);
    let key = KeyId::new("orders", "t", "/api/orders");
    // Not reset to full: still 0 available, 20 outstanding.
    let v = c.key_view(T, &key).unwrap();
    assert_eq!((v.available, v.outstanding, v.burst), (0, 20, 30));
}

#[test]
fn expired_unspent_tokens_are_counted() {
    let mut c = core_at(T, true);
    let r = c.handle(
        T,
        &batch(
            "a1",
            1,
            1,
            vec![renew("orders", "t", "/api/orders", 0, 0, 7)],
        ),
    );
    assert_eq!(r.grants[0].tokens, 7);
    // TTL 1 s: swept after expiry, nothing reported spent.
    c.sweep(T + 2 * SEC);
    assert_eq!(c.stats().tokens_expired_unused, 7);
}

#[test]
fn adjacent_protocol_versions_interoperate_and_others_are_refused() {
    let mut c = core_at(T, true);
    for (seq, v) in [(1, PROTOCOL_VERSION - 1), (2, PROTOCOL_VERSION + 1)] {
        let mut b = batch(
            "a1",
            1,
            seq,
            vec![renew("orders", "t", "/api/orders", 0, 0, 1)],
        );
        b.header.as_mut().unwrap().protocol_version = v;
        let r = c.handle(T, &b);
        assert_eq!(
            r.grants[0].status,
            GrantStatus::Granted as i32,
            "version {v}"
        );
        assert_eq!(r.protocol_version, PROTOCOL_VERSION);
    }
    let mut b = batch(
        "a1",
        1,
        3,
        vec![renew("orders", "t", "/api/orders", 0, 0, 1)],
    );
    b.header.as_mut().unwrap().protocol_version = PROTOCOL_VERSION + 2;
    let r = c.handle(T, &b);
    assert_eq!(r.grants[0].status, GrantStatus::Unsupported as i32);
    assert!(r.grants[0].detail.contains("protocol_version"));
}

#[test]
fn a_repeated_seq_with_other_content_is_refused_never_answered_from_the_cache() {
    let mut c = core_at(T, true);
    let first = batch(
        "a1",
        1,
        1,
        vec![renew("orders", "t", "/api/orders", 0, 0, 5)],
    );
    let r1 = c.handle(T, &first);
    assert_eq!(r1.grants[0].tokens, 5);
    assert_eq!(r1.request_digest, quotalease_proto::request_digest(&first));
    // A true duplicate: the cached reply, nothing granted twice.
    let again = c.handle(T + MS, &first);
    assert_eq!(again, r1);
    assert_eq!(c.stats().duplicates, 1);
    // Same (agent, incarnation, seq), other content: refused and counted.
    let twin = batch(
        "a1",
        1,
        1,
        vec![renew("orders", "u", "/api/orders", 0, 0, 5)],
    );
    let r2 = c.handle(T + 2 * MS, &twin);
    assert_eq!(r2.grants[0].status, GrantStatus::SeqConflict as i32);
    assert_eq!(r2.grants[0].tokens, 0);
    assert!(r2.grants[0].detail.contains("header.seq"));
    assert_eq!(r2.request_digest, quotalease_proto::request_digest(&twin));
    assert_eq!(c.stats().seq_conflicts, 1);
    assert_eq!(c.stats().grants, 1, "nothing granted for the conflict");
    // The key of the conflicting request was never touched.
    let key = KeyId::new("orders", "u", "/api/orders");
    assert!(c.key_view(T + 2 * MS, &key).is_none());
}

#[test]
fn processes_sharing_an_agent_id_are_distinct_holders_by_instance() {
    let mut c = core_at(T, true);
    let with_instance = |instance: u64, seq: u64, lease_id: u64, want: u64| {
        let mut b = batch(
            "agent-1",
            1,
            seq,
            vec![renew("orders", "t", "/api/orders", lease_id, 0, want)],
        );
        b.header.as_mut().unwrap().instance = instance;
        b
    };
    // Two processes, one id, one incarnation, the same seq: each gets
    // its own lease (a reply cache keyed by id alone would hand the first
    // lease to both).
    let ra = c.handle(T, &with_instance(0xa, 1, 0, 4));
    let rb = c.handle(T, &with_instance(0xb, 1, 0, 4));
    assert_eq!(ra.grants[0].status, GrantStatus::Granted as i32);
    assert_eq!(rb.grants[0].status, GrantStatus::Granted as i32);
    assert_ne!(ra.grants[0].lease_id, rb.grants[0].lease_id);
    assert_eq!(c.stats().duplicates, 0);
    let key = KeyId::new("orders", "t", "/api/orders");
    let view = c.key_view(T, &key).expect("key held");
    assert_eq!(view.outstanding, 8);
    assert_eq!(view.holders.len(), 2);
    assert!(view
        .holders
        .iter()
        .all(|(name, _)| name.agent_id == "agent-1"));
    // Neither can renew or release the other's lease.
    let steal = c.handle(T + MS, &with_instance(0xb, 2, ra.grants[0].lease_id, 1));
    assert_ne!(steal.grants[0].carried, 4, "b must not carry a's lease");
    assert_eq!(c.key_view(T + MS, &key).unwrap().holders.len(), 3);
}

#[test]
fn an_agent_without_an_instance_is_one_holder_per_id() {
    // Version-1 agents sent no instance (0); version 1 is no longer
    // adjacent (refused, see the test above), but an instance of 0 is
    // still served the way it was: each agent id is one holder, and
    // duplicates still hit the cache.
    let mut c = core_at(T, true);
    let mut b = batch(
        "old",
        1,
        1,
        vec![renew("orders", "t", "/api/orders", 0, 0, 3)],
    );
    b.header.as_mut().unwrap().protocol_version = PROTOCOL_VERSION - 1;
    b.header.as_mut().unwrap().instance = 0;
    let r = c.handle(T, &b);
    assert_eq!(r.grants[0].status, GrantStatus::Granted as i32);
    assert_eq!(c.handle(T + MS, &b), r, "a duplicate gets the cached reply");
    let key = KeyId::new("orders", "t", "/api/orders");
    let v = c.key_view(T + MS, &key).unwrap();
    assert_eq!(v.holders.len(), 1);
    assert_eq!(v.holders[0].0.instance, 0);
}

#[test]
fn the_sweep_visits_only_due_keys_in_bounded_steps() {
    let mut c = core_at(T, true);
    let items: Vec<LeaseItem> = (0..3000)
        .map(|i| renew("orders", &format!("t{i}"), "/api/orders", 0, 0, 1))
        .collect();
    let r = c.handle(T, &batch("a1", 1, 1, items));
    assert!(r
        .grants
        .iter()
        .all(|g| g.status == GrantStatus::Granted as i32));
    assert_eq!(c.key_count(), 3000);
    // TTL 1 s: before it, no key is due and a step looks at none.
    assert!(!c.sweep_step(T + SEC / 2, 1024));
    assert_eq!(c.key_count(), 3000);
    // After expiry and refill every key is due: three steps of at most 1024.
    let mut steps = 0;
    while c.sweep_step(T + 3 * SEC, 1024) {
        steps += 1;
        assert!(
            c.key_count() >= 3000 - 1024 * steps,
            "a step went past its bound"
        );
    }
    assert_eq!(steps, 2);
    assert_eq!(c.key_count(), 0);
    assert_eq!(c.stats().keys_dropped, 3000);
    assert_eq!(c.stats().tokens_expired_unused, 3000);
}

#[test]
fn a_key_in_use_is_swept_once_per_lease_and_kept() {
    let mut c = core_at(T, true);
    let key = KeyId::new("orders", "t", "/api/orders");
    let mut lease = 0;
    for s in 0..40u64 {
        let now = T + s * 100 * MS;
        let r = c.handle(
            now,
            &batch(
                "a1",
                1,
                s + 1,
                vec![renew("orders", "t", "/api/orders", lease, 0, 1)],
            ),
        );
        lease = r.grants[0].lease_id;
        c.sweep(now);
        assert!(
            c.key_view(now, &key).is_some(),
            "dropped while leased at step {s}"
        );
    }
    // One live queue entry for the key, however often it renewed.
    assert!(c.sweep_due.len() <= 2, "{} entries", c.sweep_due.len());
}

/// The promises recorded so far, folded as a restart reads the log.
fn fold(log: &[crate::reservations::Record]) -> Vec<(KeyId, Reservation)> {
    use crate::reservations::Record;
    let mut m = std::collections::BTreeMap::new();
    for r in log {
        match r {
            Record::Set(k, v) => {
                m.insert(k.clone(), *v);
            }
            Record::AtRest(k) => {
                m.remove(k);
            }
        }
    }
    m.into_iter().collect()
}

const RESERVED_RULES: &str = r#"
rules:
  - id: fast
    match: { tenant: "*", route: /fast }
    rate: 100/s
    burst: 100
  - id: minute
    match: { tenant: "*", route: /minute }
    rate: 60/m
    burst: 20
  - id: login
    match: { tenant: "*", route: /login }
    rate: 5/m
    burst: 5
  - id: daily
    match: { tenant: "*", route: /daily }
    rate: 1/d
    burst: 10
"#;

/// Write-ahead reservations: at every instant the durable promises (every
/// record taken so far) bound the true state: each key's `available` at or
/// above its floor, its lent rates at or below its cap, and keys without a
/// record at rest. A crash there resumes each key at its floor with the
/// rest of the burst leased out, which the true state dominates; keys at
/// rest keep their whole burst.
#[test]
fn reservations_bound_the_state_at_every_instant_and_a_crash_resumes_below_it() {
    let rules = RuleSet::parse(RESERVED_RULES, "t.yaml", 7).unwrap();
    let cfg = CoreConfig {
        no_predecessor: true,
        reservations: true,
        ..CoreConfig::default()
    };
    let mut c = AllocatorCore::new(cfg.clone(), rules.clone(), 1, 1000, T);
    let mut log = Vec::new();
    let routes = [
        ("fast", "/fast"),
        ("minute", "/minute"),
        ("login", "/login"),
        ("daily", "/daily"),
    ];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut leases: std::collections::HashMap<(usize, usize), u64> = Default::default();
    let mut now = T;
    let mut seq = 0;
    let mut writes = 0;
    for step in 0..3_000u64 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        now += (x % 40) * MS;
        let (ri, tenant) = ((x >> 8) as usize % 4, (x >> 16) as usize % 3);
        let (rule, route) = routes[ri];
        let agent = (x >> 24) % 2;
        seq += 1;
        let lease = leases.get(&(ri, tenant)).copied().unwrap_or(0);
        let mut item = renew(
            rule,
            &format!("t{tenant}"),
            route,
            lease,
            0,
            1 + (x >> 32) % 30,
        );
        if (x >> 40).is_multiple_of(3) {
            item.want_rate_utps = 1 + (x >> 44) % 50_000_000;
        }
        let mut b = batch(&format!("a{agent}"), 1, seq, vec![item]);
        b.ttl_ms = 2_000;
        let r = c.handle(now, &b);
        if let Some(g) = r.grants.first() {
            if g.lease_id != 0 {
                leases.insert((ri, tenant), g.lease_id);
            }
        }
        if step.is_multiple_of(7) {
            c.sweep(now);
        }
        let before = log.len();
        log.extend(c.reservations_mut().unwrap().take().1);
        writes += usize::from(log.len() > before);
        // The durable promises bound every key's true state now.
        let promised = fold(&log);
        for (ri, (rule, route)) in routes.iter().enumerate() {
            for t in 0..3 {
                let key = KeyId::new(*rule, format!("t{t}"), *route);
                let Some(l) = c.ledger_mut(&key) else {
                    assert!(
                        promised.iter().all(|(k, _)| *k != key),
                        "a dropped key is at rest"
                    );
                    continue;
                };
                l.advance(now);
                let (avail, rates) = (l.available(), l.rates_out_utps());
                match promised.iter().find(|(k, _)| *k == key) {
                    Some((_, p)) => {
                        assert!(
                            avail >= p.floor,
                            "step {step} {key:?}: available {avail} below floor {}",
                            p.floor
                        );
                        assert!(
                            rates <= p.rate_cap_utps,
                            "step {step} {key:?}: rates {rates} above cap {}",
                            p.rate_cap_utps
                        );
                    }
                    None => {
                        let burst = rules.rules[ri].burst;
                        assert!(
                            avail >= burst && rates == 0,
                            "step {step} {key:?}: no promise but not at rest ({avail})"
                        );
                    }
                }
            }
        }
        // Crash here now and then: the resumed core is at the floors.
        if step % 500 == 499 {
            let mut d = AllocatorCore::new(
                CoreConfig {
                    predecessor_ttl_max_ns: 2 * SEC,
                    ..cfg.clone()
                },
                rules.clone(),
                2,
                1_000_000,
                now + SEC,
            );
            d.resume_reserved(now + SEC, promised.clone());
            let kept = d.reserve_current_keys(now + SEC);
            for (key, p) in &promised {
                let l = d.ledger_mut(key).unwrap();
                assert_eq!(l.available(), p.floor.min(l.burst()), "{key:?}");
                assert!(l.i2_holds());
            }
            assert_eq!(kept.len(), promised.len());
        }
    }
    // Grants far outnumber log writes (the slack at work).
    assert!(writes < 3_000 / 2, "{writes} writes for 3000 batches");
    eprintln!(
        "{writes} log writes for 3000 batches, {} records",
        log.len()
    );
}

#[test]
fn a_lowered_burst_lowers_the_promise_below_what_is_left() {
    let rules = RuleSet::parse(RESERVED_RULES, "t.yaml", 7).unwrap();
    let cfg = CoreConfig {
        no_predecessor: true,
        reservations: true,
        ..CoreConfig::default()
    };
    let mut c = AllocatorCore::new(cfg, rules, 1, 1000, T);
    let b = batch("a", 1, 1, vec![renew("fast", "t", "/fast", 0, 0, 30)]);
    assert_eq!(c.handle(T, &b).grants[0].tokens, 30);
    let key = KeyId::new("fast", "t", "/fast");
    let before = c.reservations_mut().unwrap().get(&key).unwrap().floor;
    assert!(before <= 70);
    let lowered =
        RESERVED_RULES.replace("rate: 100/s\n    burst: 100", "rate: 100/s\n    burst: 40");
    let mut v2 = RuleSet::parse(&lowered, "t.yaml", 8).unwrap();
    v2.version = 8;
    c.set_rules(v2, T);
    let l = c.ledger_mut(&key).unwrap();
    l.advance(T);
    let avail = l.available();
    let floor = c.reservations_mut().unwrap().get(&key).unwrap().floor;
    assert!(
        floor <= avail,
        "floor {floor} above what is left {avail} (was {before})"
    );
}

/// A ready core serving shard 0 of 2 with ledger id `ledger_id`.
fn shard_core(ledger_id: u64) -> AllocatorCore {
    let rules = RuleSet::parse(RULES, "test.yaml", 7).expect("valid rules");
    let cfg = CoreConfig {
        shard: (0, 2),
        ledger_id,
        ..CoreConfig::default()
    };
    let mut c = AllocatorCore::new(cfg, rules, 1, 1000, T);
    c.ready_at_ns = None;
    c
}

/// A tenant whose `orders` key is in `shard` of 2.
fn tenant_in(shard: u32) -> String {
    (0..)
        .map(|i| format!("t{i}"))
        .find(|t| quotalease_proto::shard_of("orders", t, "/api/orders", 2) == shard)
        .unwrap()
}

#[test]
fn a_shard_applies_nothing_for_another_shards_key() {
    let mut c = shard_core(0);
    let (ours, theirs) = (tenant_in(0), tenant_in(1));
    let b = batch(
        "a1",
        1,
        1,
        vec![
            renew("orders", &theirs, "/api/orders", 0, 0, 5),
            renew("orders", &ours, "/api/orders", 0, 0, 5),
        ],
    );
    let r = c.handle(T, &b);
    assert_eq!(r.grants[0].status, GrantStatus::WrongShard as i32);
    assert_eq!((r.grants[0].tokens, r.grants[0].lease_id), (0, 0));
    assert_eq!(r.grants[1].status, GrantStatus::Granted as i32);
    assert_eq!(r.grants[1].tokens, 5);
    assert_eq!((r.shard, r.shard_count), (0, 2));
    assert_eq!(
        c.key_count(),
        1,
        "a ledger was made for another shard's key"
    );
}

#[test]
fn a_batch_meant_for_another_shard_does_not_make_this_one_think_its_ledger_lost() {
    // Agents keep one ledger id per shard; a batch that reached this
    // shard's leader while meant for another (routes not known yet)
    // presents that shard's id. Taking it for a lost ledger made the whole
    // shard wait a minute (an adversarial review).
    let mut c = shard_core(0xaaaa);
    let mut b = batch(
        "a1",
        1,
        1,
        vec![renew("orders", &tenant_in(1), "/api/orders", 0, 0, 5)],
    );
    b.shard = 1;
    b.header.as_mut().unwrap().ledger_id = 0xbbbb;
    let r = c.handle(T, &b);
    assert_eq!(r.grants[0].status, GrantStatus::WrongShard as i32);
    // This shard's keys are served at once, as before.
    let r = c.handle(
        T,
        &batch(
            "a2",
            1,
            1,
            vec![renew("orders", &tenant_in(0), "/api/orders", 0, 0, 5)],
        ),
    );
    assert_eq!(r.grants[0].tokens, 5, "{r:?}");
}

/// A ready core of ledger 0x1ed with runs: 0xb2 in progress, 0xa1 before
/// it (ended at record 5).
fn core_with_runs() -> AllocatorCore {
    let rules = RuleSet::parse(RULES, "test.yaml", 7).expect("valid rules");
    let cfg = CoreConfig {
        ledger_id: 0x1ed,
        runs: Some(Runs {
            current: 0xb2,
            past: vec![(0xa1, 5)],
        }),
        reservations: true,
        ..CoreConfig::default()
    };
    let mut c = AllocatorCore::new(cfg, rules, 1, 1000, T);
    c.ready_at_ns = None;
    c
}

/// A batch of `agent` presenting ledger 0x1ed, `run` and `seq`.
fn presenting(agent: &str, seq: u64, run: u64, record_seq: u64) -> LeaseBatch {
    let mut b = batch(
        agent,
        1,
        seq,
        vec![renew("orders", "acme", "/api/orders", 0, 0, 5)],
    );
    let h = b.header.as_mut().unwrap();
    (h.ledger_id, h.run_id, h.record_seq) = (0x1ed, run, record_seq);
    b
}

#[test]
fn replies_carry_the_run_and_its_records_so_far() {
    let mut c = core_with_runs();
    let r = c.handle(T, &presenting("a1", 1, 0, 0));
    assert_eq!(r.grants[0].tokens, 5);
    assert_eq!((r.ledger_id, r.run_id), (0x1ed, 0xb2));
    // The grant broke the key's durable promise: one record, which the
    // driver makes durable before this reply goes out.
    assert_eq!(r.record_seq, c.reservation_seq());
    assert!(r.record_seq >= 1, "{r:?}");
}

#[test]
fn a_requester_that_saw_what_this_state_lacks_makes_the_ledger_wait() {
    // Runs and records this state holds: served as usual.
    let mut c = core_with_runs();
    for (i, (run, seq)) in [(0xa1, 5), (0xa1, 0), (0xb2, 0)].into_iter().enumerate() {
        let r = c.handle(T, &presenting(&format!("ok{i}"), 1, run, seq));
        assert_eq!(r.grants[0].tokens, 5, "({run:x}, {seq}): {r:?}");
    }
    assert_eq!(c.stats().ledgers_lost, 0);
    // A run it never had (a backup restored after more starts), more of
    // an earlier run than it recorded (a log cut short, a copy of a live
    // directory), more of this run than it made: each an older copy.
    let now = c.reservation_seq();
    for (run, seq) in [(0xc3, 1), (0xa1, 6), (0xb2, now + 1)] {
        let mut c = core_with_runs();
        let r = c.handle(T, &presenting("b", 1, run, seq));
        assert_eq!(r.grants[0].tokens, 0, "({run:x}, {seq}): {r:?}");
        assert!(r.grants[0].retry_after_ms > 0);
        assert_eq!(c.stats().ledgers_lost, 1, "({run:x}, {seq})");
        // Whoever asks next waits too: a brand-new agent presents nothing.
        let r = c.handle(T + SEC, &presenting("new", 1, 0, 0));
        assert_eq!(r.grants[0].tokens, 0, "({run:x}, {seq}): {r:?}");
        // The same run named again by another requester waits no longer.
        c.handle(T + SEC, &presenting("b2", 1, run, seq));
        assert_eq!(c.stats().ledgers_lost, 1);
        assert!(c.ready_at_ns() >= T + TTL_MAX_CAP_NS, "waits out the cap");
    }
    // With --new-ledger the operator says those leases are gone.
    let mut c = core_with_runs();
    c.cfg.new_ledger = true;
    let r = c.handle(T, &presenting("b", 1, 0xc3, 1));
    assert_eq!(r.grants[0].tokens, 5);
}

#[test]
fn a_batch_observed_while_a_term_waits_counts_what_it_presents() {
    // An etcd term waiting out its predecessor answers nothing, but a
    // requester that saw a run this state lacks is heard meanwhile.
    let mut c = core_with_runs();
    c.observe(T, &presenting("ok", 1, 0xa1, 5));
    assert_eq!(c.stats().ledgers_lost, 0, "a run it holds");
    // Another cluster's, or a closed core's, says nothing.
    let mut other = presenting("staging", 1, 0xc3, 1);
    other.header.as_mut().unwrap().cluster = "staging".into();
    c.cfg.cluster = "prod".into();
    c.observe(T, &other);
    assert_eq!(c.stats().ledgers_lost, 0, "another cluster's batch");
    c.cfg.cluster.clear();
    c.observe(T, &presenting("b", 1, 0xc3, 1));
    assert_eq!(c.stats().ledgers_lost, 1);
    assert!(c.ready_at_ns() >= T + TTL_MAX_CAP_NS, "waits out the cap");
    // Nothing was applied: no holder, no reply cached.
    assert!(c.holders.is_empty(), "observing applies nothing");
}

#[test]
fn a_requester_of_another_cluster_is_refused_and_never_makes_the_ledger_wait() {
    let rules = RuleSet::parse(RULES, "test.yaml", 7).expect("valid rules");
    let cfg = CoreConfig {
        ledger_id: 0x1ed,
        cluster: "prod".into(),
        ..CoreConfig::default()
    };
    let mut c = AllocatorCore::new(cfg, rules, 1, 1000, T);
    c.ready_at_ns = None;
    let from = |cluster: &str, ledger: u64, seq: u64| {
        let mut b = presenting("a", seq, 0, 0);
        let h = b.header.as_mut().unwrap();
        (h.cluster, h.ledger_id, h.agent_id) = (cluster.into(), ledger, format!("{cluster}-a"));
        b
    };
    // A staging agent naming staging's ledger, and an agent without a
    // cluster: refused whole, the field named; nothing applied or lost.
    for (i, cluster) in ["staging", ""].into_iter().enumerate() {
        let r = c.handle(T, &from(cluster, 0x5a, i as u64 + 1));
        assert_eq!(
            r.grants[0].status,
            GrantStatus::BadItem as i32,
            "{cluster:?}"
        );
        assert!(r.grants[0].detail.starts_with("header.cluster"), "{r:?}");
        assert!(r.grants[0].detail.contains("\"prod\""), "{r:?}");
        assert_eq!(r.cluster, "prod");
    }
    assert_eq!(c.stats().wrong_cluster, 2);
    assert_eq!(
        c.stats().ledgers_lost,
        0,
        "its own ledger is not taken for lost"
    );
    assert_eq!(c.key_count(), 0);
    // Its own cluster is served.
    let r = c.handle(T, &from("prod", 0x1ed, 1));
    assert_eq!(r.grants[0].tokens, 5, "{r:?}");
    // A prod agent once served by an allocator without a cluster names
    // that allocator's ledger: it says nothing of prod's (an adversarial
    // review made prod wait 60 s this way).
    let mut b = from("prod", 0x77, 2);
    b.header.as_mut().unwrap().ledger_cluster = String::new();
    let r = c.handle(T, &b);
    assert_eq!(r.grants[0].status, GrantStatus::Granted as i32, "{r:?}");
    assert_eq!(c.stats().ledgers_lost, 0, "another cluster's ledger");
    // Another ledger of its own cluster: its state was lost.
    let mut b = from("prod", 0x78, 3);
    b.header.as_mut().unwrap().ledger_cluster = "prod".into();
    c.handle(T, &b);
    assert_eq!(c.stats().ledgers_lost, 1, "a ledger of its own cluster");
    // An allocator without a cluster cannot tell: it serves anyone.
    let mut open = core_with_runs();
    let r = open.handle(T, &from("staging", 0x1ed, 1));
    assert_eq!(r.grants[0].tokens, 5, "{r:?}");
}

#[test]
fn another_live_ledger_keeps_the_alarm_on_for_as_long_as_it_is_seen() {
    // The first request naming another ledger: taken for a lost state
    // (the wait). Requesters still naming it afterwards talk to another
    // live allocator: an alarm while they do, never tolerated silently.
    let mut c = shard_core(0x1ed);
    let naming = |agent: &str, seq: u64| {
        let mut b = batch(
            agent,
            1,
            seq,
            vec![renew("orders", &tenant_in(0), "/api/orders", 0, 0, 1)],
        );
        b.header.as_mut().unwrap().ledger_id = 0xbbbb;
        b
    };
    c.handle(T, &naming("a", 1));
    assert_eq!(c.stats().ledgers_lost, 1);
    assert_eq!(c.stats().foreign_sightings, 0);
    assert!(!c.foreign_alarm(T));
    for s in 0..5u64 {
        c.handle(T + s * SEC, &naming("b", s + 1));
    }
    assert_eq!(c.stats().ledgers_lost, 1, "one wait");
    assert_eq!(c.stats().foreign_sightings, 5);
    assert!(c.foreign_alarm(T + 5 * SEC));
    assert!(
        !c.foreign_alarm(T + 15 * SEC),
        "off 10 s after the last sighting"
    );
}

mod slot_items;

//! The agent core alone, sans-IO: time and replies are made up here, the
//! allocator is not involved. Driver policy — retries, backpressure, what
//! counts as an outage — is the core's, so it is tested here once.

use super::*;
use quotalease_proto::lease::{FailPolicy as PbFailPolicy, Rule as PbRule, RuleSet as PbRuleSet};

const MS: u64 = 1_000_000;
const T0: u64 = 1_000_000 * MS;

fn rules() -> RuleSet {
    RuleSet::from_proto(&PbRuleSet {
        version: 1,
        rules: vec![PbRule {
            id: "r".into(),
            tenant: "*".into(),
            route: String::new(),
            rate_tokens: 100,
            rate_period_s: 1,
            burst: 100,
            fail_policy: PbFailPolicy::LeaseOnly as i32,
            ..PbRule::default()
        }],
        ..Default::default()
    })
    .expect("valid rules")
}

fn core(max_in_flight: usize) -> (AgentCore, RuleSet) {
    core_with(max_in_flight, 1000)
}

fn core_with(max_in_flight: usize, max_keys: usize) -> (AgentCore, RuleSet) {
    let metrics = Arc::new(AgentMetrics::default());
    let rules = rules();
    let cell = Arc::new(RulesCell::new(Some(rules.clone()), &metrics));
    let table = Arc::new(Table::new());
    let cfg = CoreConfig {
        agent_id: "a".into(),
        instance: 7,
        incarnation: 1,
        lease_ttl: Duration::from_secs(2),
        plan: PlanConfig::default(),
        fetch_timeout: Duration::from_millis(250),
        epsilon: Duration::from_millis(50),
        heartbeat: Duration::from_secs(1),
        emergency: EmergencyConfig::default(),
        record_emergency: false,
        max_in_flight,
        max_keys,
        cluster: String::new(),
    };
    (AgentCore::new(cfg, table, cell, metrics, T0), rules)
}

/// A request on `tenant` waits; the core is pumped at `now`.
fn want(c: &mut AgentCore, rules: &RuleSet, tenant: &str, now: u64) -> Vec<Transmit> {
    let slot = c.slot_for(&rules.rules[0], tenant, "").expect("room");
    c.want(slot, 1);
    pump(c, now)
}

fn pump(c: &mut AgentCore, now: u64) -> Vec<Transmit> {
    if c.poll_timeout().is_some_and(|t| t <= now) {
        c.handle_timeout(now);
    }
    std::iter::from_fn(|| c.poll_transmit()).collect()
}

/// The allocator's answer granting what every renew item wants.
fn grant_all(tx: &Transmit) -> LeaseReply {
    LeaseReply {
        seq: tx.seq,
        grants: tx
            .batch
            .items
            .iter()
            .enumerate()
            .map(|(i, item)| Grant {
                status: GrantStatus::Granted as i32,
                lease_id: 1000 + tx.seq * 100 + i as u64,
                tokens: item.want,
                ttl_ms: 2000,
                rule_version: 1,
                holders: 1,
                ..Grant::default()
            })
            .collect(),
        request_digest: quotalease_proto::request_digest(&tx.batch),
        ..LeaseReply::default()
    }
}

fn renew_keys(tx: &Transmit) -> Vec<String> {
    tx.batch
        .items
        .iter()
        .filter(|i| i.kind == ItemKind::Renew as i32)
        .map(|i| i.tenant.clone())
        .collect()
}

#[test]
fn backpressure_holds_wanted_keys_for_the_next_batch_instead_of_failing_them() {
    let (mut c, rules) = core(1);
    let first = want(&mut c, &rules, "k1", T0);
    assert_eq!(first.len(), 1);
    assert_eq!(renew_keys(&first[0]), ["k1"]);
    // One batch in flight, the cap: more wanted keys wait.
    assert!(want(&mut c, &rules, "k2", T0 + MS).is_empty());
    assert!(want(&mut c, &rules, "k3", T0 + 2 * MS).is_empty());
    // The reply frees the slot: the waiting keys go out together.
    c.handle_reply(T0 + 3 * MS, first[0].seq, grant_all(&first[0]));
    let next = pump(&mut c, T0 + 3 * MS);
    assert_eq!(next.len(), 1);
    assert_eq!(renew_keys(&next[0]), ["k2", "k3"]);
    assert!(!c.reach().down);
}

#[test]
fn a_retry_reuses_the_sequence_number_and_content() {
    let (mut c, rules) = core(8);
    let first = want(&mut c, &rules, "k1", T0);
    let t = T0 + 250 * MS;
    let retry = pump(&mut c, t);
    assert_eq!(retry.len(), 1);
    assert_eq!(retry[0].seq, first[0].seq);
    assert_eq!(retry[0].attempt, 2);
    assert_eq!(retry[0].batch, first[0].batch);
    // A failure of the old attempt changes nothing now.
    c.handle_failure(t + MS, first[0].seq, 1, "late error of attempt 1");
    assert!(c.poll_transmit().is_none());
}

#[test]
fn overload_is_not_an_outage_but_silence_is() {
    // A batch given up on while other batches are answered: overload.
    let (mut c, rules) = core(8);
    let slow = want(&mut c, &rules, "slow", T0);
    let fast = want(&mut c, &rules, "fast", T0 + MS);
    c.handle_reply(T0 + 2 * MS, fast[0].seq, grant_all(&fast[0]));
    assert!(c.reach().connected);
    let retry = pump(&mut c, T0 + 250 * MS);
    assert_eq!(retry.len(), 1, "the slow batch is retried once");
    assert_eq!(retry[0].seq, slow[0].seq);
    pump(&mut c, T0 + 500 * MS);
    let reach = c.reach();
    assert!(!reach.down, "replies kept coming: not unreachable");
    assert!(reach.connected);
    // Nothing answered at all: unreachable, fail policies apply.
    let (mut c, rules) = core(8);
    want(&mut c, &rules, "k", T0);
    pump(&mut c, T0 + 250 * MS);
    pump(&mut c, T0 + 500 * MS);
    assert!(c.reach().down);
}

#[test]
fn poll_timeout_is_now_when_requests_wait_else_the_tick_or_a_deadline() {
    let (mut c, rules) = core(8);
    // Fresh: the first tick is due at once (a heartbeat fetches rules).
    assert_eq!(c.poll_timeout(), Some(T0));
    c.handle_timeout(T0);
    let hb = std::iter::from_fn(|| c.poll_transmit()).count();
    assert_eq!(hb, 1, "a heartbeat: not connected yet");
    let next = c.poll_timeout().expect("a timeout");
    assert!(next > T0 && next <= T0 + 250 * MS, "{next}");
    let slot = c.slot_for(&rules.rules[0], "k", "").unwrap();
    c.want(slot, 1);
    assert_eq!(c.poll_timeout(), Some(0), "requests wait: now");
}

#[test]
fn a_stale_reply_asks_again_under_a_new_seq_without_settling_the_key() {
    let (mut c, rules) = core(8);
    let first = want(&mut c, &rules, "k", T0);
    let slot = c.slot_for(&rules.rules[0], "k", "").unwrap();
    let settles = slot.settles();
    let mut stale = grant_all(&first[0]);
    for g in &mut stale.grants {
        g.status = GrantStatus::Stale as i32;
        g.tokens = 0;
        g.lease_id = 0;
    }
    c.handle_reply(T0 + MS, first[0].seq, stale);
    assert_eq!(slot.settles(), settles, "waiting requests are not woken");
    assert!(std::iter::from_fn(|| c.poll_event()).all(|e| !matches!(e, Event::Settled(_))));
    let again = pump(&mut c, T0 + 2 * MS);
    assert_eq!(again.len(), 1);
    assert!(again[0].seq > first[0].seq);
    assert_eq!(renew_keys(&again[0]), ["k"]);
    c.handle_reply(T0 + 3 * MS, again[0].seq, grant_all(&again[0]));
    assert_eq!(slot.settles(), settles + 1);
    assert!(slot.word.peek(T0 + 4 * MS).is_some_and(|t| t >= 1));
}

#[test]
fn a_protocol_1_allocator_reply_without_a_digest_is_accepted() {
    // Version-1 allocators send no `request_digest` (0): the seq and the
    // grant count still have to match, and then the reply applies.
    let (mut c, rules) = core(8);
    let first = want(&mut c, &rules, "k", T0);
    let mut reply = grant_all(&first[0]);
    reply.request_digest = 0;
    reply.protocol_version = 1;
    c.handle_reply(T0 + MS, first[0].seq, reply);
    let slot = c.slot_for(&rules.rules[0], "k", "").unwrap();
    assert!(slot.word.peek(T0 + 2 * MS).is_some_and(|t| t >= 1));
    assert_eq!(c.metrics.mismatched_replies.get(), 0);
}

/// Every key is either in the tick's list or parked (due again at its
/// `quiet_until`), never both listed twice: idle keys leave the list, are
/// visited again when due (and released when idle long enough), and a key
/// a request waits for is planned at once and rejoins the list.
#[test]
fn the_tick_visits_parked_keys_only_when_due_and_wanted_keys_at_once() {
    let (mut c, rules) = core(8);
    let mut now = T0;
    for i in 0..50 {
        for tx in want(&mut c, &rules, &format!("t{i}"), now) {
            c.handle_reply(now + MS, tx.seq, grant_all(&tx));
        }
    }
    let check = |c: &AgentCore| {
        let mut listed: Vec<usize> = c.active.iter().map(Slot::addr).collect();
        listed.sort_unstable();
        let before = listed.len();
        listed.dedup();
        assert_eq!(before, listed.len(), "a key listed twice");
        for slot in &c.active {
            let k = KeyState::load(slot);
            if k.held {
                assert!(k.listed, "key {slot:?} in the list but not marked listed");
            }
        }
        let parked: std::collections::HashSet<usize> =
            c.parked.values().flatten().map(Slot::addr).collect();
        for slot in c.held_slots() {
            let k = KeyState::load(&slot);
            let id = slot.addr();
            assert!(
                k.listed == listed.binary_search(&id).is_ok(),
                "key {slot:?}: listed flag disagrees with the list"
            );
            assert!(
                k.listed || parked.contains(&id),
                "key {slot:?} neither listed nor parked: the tick would never visit it"
            );
        }
    };
    check(&c);
    // Idle for a few seconds: the keys park (the tick's list empties).
    for _ in 0..80 {
        now += 50 * MS;
        for tx in pump(&mut c, now) {
            c.handle_reply(now + MS, tx.seq, grant_all(&tx));
        }
        check(&c);
    }
    assert!(
        c.active.len() < 50,
        "idle keys should have left the tick's list ({} listed)",
        c.active.len()
    );
    // A request on a parked key is planned at once and the key rejoins.
    let before = c.key_count();
    let sent = want(&mut c, &rules, "t7", now);
    assert_eq!(renew_keys(&sent[0]), vec!["t7".to_string()]);
    check(&c);
    assert_eq!(c.key_count(), before);
    // Long idle: parked keys come due and are released and forgotten.
    for _ in 0..400 {
        now += 50 * MS;
        for tx in pump(&mut c, now) {
            c.handle_reply(now + MS, tx.seq, grant_all(&tx));
        }
        check(&c);
    }
    assert_eq!(c.key_count(), 0, "idle keys were never released");
}

/// A request on a parked (idle) key that is still waiting when the tick
/// comes due is planned by that tick: the tick must not drop the wanted
/// key because it is parked (the request would wait out its fetch timeout
/// twice and be denied although tokens abound).
#[test]
fn a_wanted_parked_key_is_planned_by_the_tick_that_clears_the_wanted_list() {
    let (mut c, rules) = core(8);
    let mut now = T0;
    for tx in want(&mut c, &rules, "idle", now) {
        c.handle_reply(now + MS, tx.seq, grant_all(&tx));
    }
    // Idle for 3 s of ticks: the key parks.
    for _ in 0..60 {
        now += 50 * MS;
        for tx in pump(&mut c, now) {
            c.handle_reply(now + MS, tx.seq, grant_all(&tx));
        }
    }
    let idle = c.slot_for(&rules.rules[0], "idle", "").expect("held");
    assert!(!KeyState::load(&idle).listed, "the idle key parked");
    // A request wants it; before any wake-up pass runs, the tick is due.
    let slot = c.slot_for(&rules.rules[0], "idle", "").expect("held");
    c.want(slot, 200);
    let tick = c.next_tick_ns;
    c.handle_timeout(tick);
    let sent: Vec<Transmit> = std::iter::from_fn(|| c.poll_transmit()).collect();
    assert!(
        sent.iter()
            .any(|tx| renew_keys(tx).contains(&"idle".to_string())),
        "the tick dropped a wanted parked key: {:?}",
        sent.iter().map(renew_keys).collect::<Vec<_>>()
    );
}

#[test]
fn a_tick_over_many_keys_goes_in_bounded_steps_and_batches() {
    // More keys than one step plans and one batch carries.
    let n = 2 * MAX_BATCH_ITEMS + 100;
    let (mut c, rules) = core_with(8, 2 * n);
    let slots: Vec<_> = (0..n)
        .map(|i| {
            let slot = c
                .slot_for(&rules.rules[0], &format!("k{i}"), "")
                .expect("room");
            c.want(slot.clone(), 1);
            slot
        })
        .collect();
    // One wake-up asks for them all, split at the batch limit.
    let first = pump(&mut c, T0);
    assert_eq!(
        first
            .iter()
            .map(|tx| tx.batch.items.len())
            .collect::<Vec<_>>(),
        [MAX_BATCH_ITEMS, MAX_BATCH_ITEMS, 100]
    );
    for tx in &first {
        c.handle_reply(T0 + MS, tx.seq, grant_all(tx));
    }
    // Every key got the grant of its own item (ids follow the split).
    for (i, slot) in slots.iter().enumerate() {
        assert!(slot.word.peek(T0 + MS).is_some(), "key {i} holds no lease");
    }
    // Spend from every key, so the tick plans each one, close to expiry
    // (TTL 2 s), so each one renews.
    let t = T0 + 1_900 * MS;
    for slot in &slots {
        assert!(matches!(
            slot.word.try_take(1, t),
            crate::lease_table::Take::Taken { .. }
        ));
    }
    // The tick: a step per WALK_STEP keys, nothing sent until its walk is
    // done, and the driver asked to call again at once in between.
    let mut steps = 0;
    let mut sent = Vec::new();
    while c.poll_timeout().is_some_and(|at| at <= t) {
        c.handle_timeout(t);
        steps += 1;
        sent.extend(std::iter::from_fn(|| c.poll_transmit()));
        if steps == 3 {
            // A request waiting for a new key mid-walk is not held up by
            // the tick: its batch leaves at once.
            assert!(sent.is_empty(), "the tick sent before its walk was done");
            // (Its pump is a call of `handle_timeout`: one more step.)
            let cold = want(&mut c, &rules, "cold", t);
            steps += 1;
            assert_eq!(cold.len(), 1);
            assert_eq!(renew_keys(&cold[0]), ["cold"]);
        }
        assert!(steps <= n, "the walk does not end");
    }
    assert_eq!(steps, n.div_ceil(WALK_STEP));
    let renewed: usize = sent.iter().map(|tx| renew_keys(tx).len()).sum();
    assert_eq!(renewed, n, "every key renewed once");
    assert!(sent
        .iter()
        .all(|tx| tx.batch.items.len() <= MAX_BATCH_ITEMS));
    assert_eq!(sent.len(), n.div_ceil(MAX_BATCH_ITEMS));
}

/// The packed state gives back what was stored, at the extremes of each
/// field, and writes nothing when nothing changed.
#[test]
fn key_state_round_trips_through_its_slot() {
    let slot = Slot::new("r", "t", "");
    let mut k = KeyState::fresh();
    k.store(&slot);
    let same = |a: &KeyState, b: &KeyState| format!("{a:?}") == format!("{b:?}");
    assert!(same(&KeyState::load(&slot), &k));
    k.lease_id = u64::MAX;
    k.granted = (1 << 40) - 1;
    k.generation = (1 << 24) - 1;
    k.baseline = (1 << 40) - 1;
    k.holders = (1 << 24) - 1;
    k.usage.rate = 1e9;
    k.usage.admitted_rate = 0.5;
    k.usage.since_tick = (1 << 40) - 1;
    k.usage.last_tick_ns = u64::MAX - 1;
    k.usage.last_active_ns = u64::MAX - 2;
    k.in_flight = Some(seq_tag(u64::MAX));
    k.quiet_until_ns = u64::MAX - 3;
    k.parked = true;
    k.listed = false;
    k.held = true;
    k.bucket_available = u64::MAX - 4;
    k.store(&slot);
    assert!(
        same(&KeyState::load(&slot), &k),
        "{:?}",
        KeyState::load(&slot)
    );
    // Past its field, a count saturates; a tiny positive rate stays positive.
    k.granted = u64::MAX;
    k.holders = u64::MAX;
    k.usage.rate = 1e-300;
    k.store(&slot);
    let back = KeyState::load(&slot);
    assert_eq!((back.granted, back.holders), ((1 << 40) - 1, (1 << 24) - 1));
    assert!(back.usage.rate > 0.0);
    assert_eq!(back.lease_id, u64::MAX, "neighbours untouched");
    assert!(!KeyState::fresh().parked);
}

/// The rate asked for shares `granted`'s bits: kept while `granted` is 0
/// (always, while the lease carries a rate: the only time it is read),
/// dropped while a lease of tokens counts its grant; the bucket report is
/// a word of its own that the request path reads.
#[test]
fn the_rate_asked_lives_in_granteds_bits_and_the_bucket_report_is_read_by_requests() {
    let slot = Slot::new("r", "t", "");
    let mut k = KeyState::fresh();
    k.generation = (1 << 24) - 1;
    k.asked_rate_utps = 333_333_333;
    k.granted = 0;
    k.bucket_available = 17;
    k.store(&slot);
    let back = KeyState::load(&slot);
    assert_eq!(back.granted, 0);
    assert_eq!(back.generation, (1 << 24) - 1, "the generation untouched");
    let asked = back.asked_rate_utps as f64;
    assert!((asked / 333_333_333.0 - 1.0).abs() < 1e-6, "{asked}");
    assert_eq!(back.bucket_available, 17);
    // A lease of tokens: `granted` is kept, the rate asked is not.
    k.granted = 12;
    k.store(&slot);
    let back = KeyState::load(&slot);
    assert_eq!((back.granted, back.asked_rate_utps), (12, 0));
    assert_eq!(back.generation, (1 << 24) - 1);
    // The request path: lease level + the report, at most the burst.
    assert_eq!(slot.global_remaining(2, 20), 19);
    assert_eq!(slot.global_remaining(1, 20), 18);
    k.bucket_available = 0;
    k.store(&slot);
    assert_eq!(
        slot.global_remaining(3, 20),
        3,
        "no report: the lease's level"
    );
    k.bucket_available = u64::MAX;
    k.store(&slot);
    assert_eq!(slot.global_remaining(u64::MAX, 20), 20);
}

/// What a replica without a leader answers (SPEC §7).
fn no_leader(tx: &Transmit) -> LeaseReply {
    LeaseReply {
        seq: tx.seq,
        not_leader: true,
        retry_after_ms: 500,
        request_digest: quotalease_proto::request_digest(&tx.batch),
        ..LeaseReply::default()
    }
}

#[test]
fn no_leader_yet_is_reachable_and_empty_until_the_grace_then_an_outage() {
    let (mut c, rules) = core(8);
    // A lease first: 50 tokens for "k".
    let first = want(&mut c, &rules, "k", T0);
    c.handle_reply(T0 + MS, first[0].seq, grant_all(&first[0]));
    let slot = c.slot_for(&rules.rules[0], "k", "").expect("room");
    let level = slot.word.level_at(T0 + MS).1;
    assert!(level > 0, "the lease was installed");
    // The leader dies: replicas answer "no leader yet".
    let mut t = T0 + 2 * MS;
    let ask = want(&mut c, &rules, "other", t);
    c.handle_reply(t + MS, ask[0].seq, no_leader(&ask[0]));
    let reach = c.reach();
    assert!(
        reach.connected && !reach.down,
        "no leader yet is not an outage"
    );
    // The held lease still serves; the key that needed tokens is dry until the hint.
    assert_eq!(slot.word.level_at(t + MS).1, level);
    let other = c.slot_for(&rules.rules[0], "other", "").expect("room");
    assert!(other.dry_until() >= t + MS + 500 * MS);
    // Longer than an election takes: fail policies apply.
    t += NO_LEADER_GRACE.as_nanos() as u64 + 2 * MS;
    let again = want(&mut c, &rules, "third", t);
    let tx = again.last().expect("a batch");
    c.handle_reply(t + MS, tx.seq, no_leader(tx));
    pump(&mut c, t + 300 * MS);
    pump(&mut c, t + 600 * MS);
    assert!(
        c.reach().down,
        "no leader for longer than the grace is an outage"
    );
}

/// A shard's answer: `grant_all` for keys of `shard`, `WRONG_SHARD` for the
/// others, as a sharded allocator of 2 shards says it.
fn shard_reply(tx: &Transmit, shard: u32) -> LeaseReply {
    let mut r = grant_all(tx);
    for (g, item) in r.grants.iter_mut().zip(&tx.batch.items) {
        if quotalease_proto::shard_of(&item.rule_id, &item.tenant, &item.route, 2) != shard {
            *g = Grant {
                status: GrantStatus::WrongShard as i32,
                ..Grant::default()
            };
        }
    }
    r.shard = shard;
    r.shard_count = 2;
    r
}

fn tenant_in(shard: u32) -> String {
    (0..)
        .map(|i| format!("t{i}"))
        .find(|t| quotalease_proto::shard_of("r", t, "", 2) == shard)
        .unwrap()
}

#[test]
fn keys_go_to_their_shard_and_one_shards_outage_is_its_keys_alone() {
    let (mut c, rules) = core(8);
    let (a, b) = (tenant_in(0), tenant_in(1));
    // Before any reply the agent knows one shard: both keys in one batch,
    // to the first contact, whose leader serves shard 1.
    let slot_a = c.slot_for(&rules.rules[0], &a, "").unwrap();
    let slot_b = c.slot_for(&rules.rules[0], &b, "").unwrap();
    c.want(slot_a.clone(), 1);
    c.want(slot_b.clone(), 1);
    let first = pump(&mut c, T0);
    assert_eq!(first.len(), 1);
    assert_eq!(first[0].batch.shard, 0);
    c.handle_reply(T0 + MS, first[0].seq, shard_reply(&first[0], 1));
    assert_eq!(c.shard_count(), 2);
    // Shard 1's key was granted; shard 0's is asked again at once, alone,
    // in a batch for shard 0.
    let again = pump(&mut c, T0 + 2 * MS);
    assert_eq!(again.len(), 1, "{again:?}");
    assert_eq!(again[0].batch.shard, 0);
    assert_eq!(renew_keys(&again[0]), vec![a.clone()]);
    c.handle_reply(T0 + 3 * MS, again[0].seq, shard_reply(&again[0], 0));
    assert!(c.reach().connected);
    // From now on every batch holds one shard's keys.
    let mut t = T0 + 3 * MS;
    let mut sent = Vec::new();
    for _ in 0..10 {
        t += 100 * MS;
        // Requests wait for both keys (their leases ran low, say).
        c.want(slot_a.clone(), 1);
        c.want(slot_b.clone(), 1);
        for tx in pump(&mut c, t).into_iter().chain(pump(&mut c, t)) {
            for item in &tx.batch.items {
                assert_eq!(
                    quotalease_proto::shard_of(&item.rule_id, &item.tenant, &item.route, 2),
                    tx.batch.shard
                );
            }
            sent.push(tx);
        }
        // Shard 0 answers; shard 1 is gone (every attempt fails).
        for tx in sent.drain(..) {
            if tx.batch.shard == 0 {
                c.handle_reply(t, tx.seq, shard_reply(&tx, 0));
            } else {
                c.handle_failure(t, tx.seq, tx.attempt, "shard 1 unreachable");
            }
        }
    }
    // Shard 1's outage is its keys': fail policies there, not on shard 0.
    assert!(c.reach_of(&slot_b).down, "shard 1 not taken for down");
    assert!(!c.reach_of(&slot_a).down, "shard 0 taken for down");
    assert!(c.reach_of(&slot_a).connected);
    assert!(!c.reach().connected, "readiness ignores shard 1's outage");
}

#[test]
fn a_key_whose_shard_cannot_be_reached_waits_instead_of_asking_in_a_loop() {
    // The shard count is known (2) but shard 1's leader is not: its key's
    // batches reach shard 0, which answers WRONG_SHARD. Asking again at
    // once sent ~870 messages a second to shard 0 (an adversarial review).
    let (mut c, rules) = core(8);
    let b = tenant_in(1);
    let slot_b = c.slot_for(&rules.rules[0], &b, "").unwrap();
    c.want(slot_b.clone(), 1);
    let first = pump(&mut c, T0);
    c.handle_reply(T0 + MS, first[0].seq, shard_reply(&first[0], 0));
    // Under the count just learned the key is shard 1's: asked again at
    // once, in a batch for shard 1 (which the transport sends to shard 0
    // again: it knows no leader of shard 1).
    let again = pump(&mut c, T0 + 2 * MS);
    let to1: Vec<&Transmit> = again.iter().filter(|t| t.batch.shard == 1).collect();
    assert_eq!(to1.len(), 1, "{again:?}");
    assert_eq!(renew_keys(to1[0]), vec![b.clone()]);
    c.handle_reply(T0 + 3 * MS, to1[0].seq, shard_reply(to1[0], 0));
    for tx in again.iter().filter(|t| t.batch.shard == 0) {
        c.handle_reply(T0 + 3 * MS, tx.seq, shard_reply(tx, 0));
    }
    // Now it waits: more requests for it send nothing for a while.
    let mut renewals = 0;
    for step in 1..=40u64 {
        let t = T0 + 3 * MS + step * 10 * MS;
        c.want(slot_b.clone(), 1);
        for tx in pump(&mut c, t) {
            renewals += renew_keys(&tx).len();
            c.handle_reply(t, tx.seq, shard_reply(&tx, 0));
        }
    }
    assert!(renewals <= 1, "{renewals} renewals of the key in 400 ms");
    assert!(!c.reach_of(&slot_b).down, "down before the grace");
}

#[test]
fn the_newest_run_a_reply_carried_is_presented_with_its_ledger() {
    let (mut c, rules) = core(8);
    let header = |tx: &Transmit| {
        let h = tx.batch.header.as_ref().unwrap();
        (h.ledger_id, h.run_id, h.record_seq)
    };
    let mut now = T0;
    let mut tx = want(&mut c, &rules, "k0", now);
    assert_eq!(header(&tx[0]), (0, 0, 0), "nothing seen yet");
    // (ledger, run, records) as replies carry them, and what is presented
    // next: the largest count of a run, a new run as it comes, a reply of
    // another ledger starting over, a version-4 reply without a run (a
    // regional that has not heard from its root) changing nothing.
    for (i, (ledger, run, seq, expect)) in [
        (0x1ed, 0xa1, 5, (0x1ed, 0xa1, 5)),
        (0x1ed, 0xa1, 3, (0x1ed, 0xa1, 5)),
        (0x1ed, 0xb2, 1, (0x1ed, 0xb2, 1)),
        (0x1ed, 0, 0, (0x1ed, 0xb2, 1)),
        (0x2ee, 0, 0, (0x2ee, 0, 0)),
        (0x2ee, 0xc3, 9, (0x2ee, 0xc3, 9)),
    ]
    .into_iter()
    .enumerate()
    {
        let mut reply = grant_all(&tx[0]);
        (reply.ledger_id, reply.run_id, reply.record_seq) = (ledger, run, seq);
        reply.protocol_version = quotalease_proto::PROTOCOL_VERSION;
        now += MS;
        c.handle_reply(now, tx[0].seq, reply);
        now += MS;
        tx = want(&mut c, &rules, &format!("k{}", i + 1), now);
        assert_eq!(header(&tx[0]), expect, "after reply {i}");
    }
}

#[test]
fn an_allocator_downgraded_to_protocol_3_is_understood_and_sees_no_run() {
    // Presented a run, then answered by a version-3 allocator: it dropped
    // the fields it does not know and digested the rest. The reply applies,
    // and no run is presented to it again.
    let (mut c, rules) = core(8);
    let first = want(&mut c, &rules, "k0", T0);
    let mut reply = grant_all(&first[0]);
    (reply.ledger_id, reply.run_id, reply.record_seq) = (0x1ed, 0xa1, 5);
    reply.protocol_version = quotalease_proto::PROTOCOL_VERSION;
    c.handle_reply(T0 + MS, first[0].seq, reply);
    let second = want(&mut c, &rules, "k1", T0 + 2 * MS);
    assert_eq!(second[0].batch.header.as_ref().unwrap().run_id, 0xa1);
    let mut old = grant_all(&second[0]);
    old.request_digest = quotalease_proto::request_digest_v3(&second[0].batch);
    assert_ne!(
        old.request_digest,
        quotalease_proto::request_digest(&second[0].batch)
    );
    (old.ledger_id, old.protocol_version) = (0x1ed, 3);
    c.handle_reply(T0 + 3 * MS, second[0].seq, old);
    assert_eq!(c.metrics.mismatched_replies.get(), 0);
    let slot = c.slot_for(&rules.rules[0], "k1", "").unwrap();
    assert!(
        slot.word.peek(T0 + 4 * MS).is_some_and(|t| t >= 1),
        "applied"
    );
    let third = want(&mut c, &rules, "k2", T0 + 5 * MS);
    let h = third[0].batch.header.as_ref().unwrap();
    assert_eq!((h.ledger_id, h.run_id, h.record_seq), (0x1ed, 0, 0));
}

#[test]
fn a_reply_of_another_cluster_is_not_used() {
    let (mut c, rules) = core(8);
    c.cfg.cluster = "prod".into();
    let first = want(&mut c, &rules, "k0", T0);
    assert_eq!(first[0].batch.header.as_ref().unwrap().cluster, "prod");
    let mut reply = grant_all(&first[0]);
    reply.cluster = "staging".into();
    c.handle_reply(T0 + MS, first[0].seq, reply);
    let slot = c.slot_for(&rules.rules[0], "k0", "").unwrap();
    assert!(
        slot.word.peek(T0 + 2 * MS).is_none_or(|t| t == 0),
        "not applied"
    );
    assert_eq!(c.metrics.mismatched_replies.get(), 1);
    // Taken as no answer: the same batch is sent again.
    let again = pump(&mut c, T0 + 2 * MS);
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].seq, first[0].seq);
    // An allocator without a cluster cannot say: its replies apply.
    c.handle_reply(T0 + 3 * MS, again[0].seq, grant_all(&again[0]));
    assert!(slot.word.peek(T0 + 4 * MS).is_some_and(|t| t >= 1));
}

#[test]
fn an_idle_agent_with_a_long_renew_interval_still_heartbeats_every_heartbeat() {
    // --renew-interval 30s: the tick (which sends heartbeats) still runs
    // every heartbeat (1 s), so what the agent saw of the ledger reaches a
    // restarted allocator within its start wait.
    let (mut c, _rules) = core(8);
    c.cfg.plan.renew_interval = Duration::from_secs(30);
    let mut now = T0;
    let mut heartbeats = Vec::new();
    for _ in 0..50 {
        now += 100 * MS;
        for tx in pump(&mut c, now) {
            assert!(tx.batch.items.is_empty(), "nothing to renew");
            heartbeats.push(now);
            c.handle_reply(now, tx.seq, grant_all(&tx));
        }
    }
    assert!(heartbeats.len() >= 4, "heartbeats at {heartbeats:?}");
    for w in heartbeats.windows(2) {
        assert!(
            w[1] - w[0] <= 1_100 * MS,
            "a gap of {} ms",
            (w[1] - w[0]) / MS
        );
    }
}

#[test]
fn the_ledger_is_presented_with_the_cluster_of_the_allocator_that_gave_it() {
    // An allocator takes its ledger for lost only for another ledger of
    // its own cluster: the agent says whose ledger it names.
    let (mut c, rules) = core(8);
    c.cfg.cluster = "prod".into();
    let first = want(&mut c, &rules, "k0", T0);
    let mut reply = grant_all(&first[0]);
    reply.ledger_id = 0x77; // an allocator without a cluster
    c.handle_reply(T0 + MS, first[0].seq, reply);
    let second = want(&mut c, &rules, "k1", T0 + 2 * MS);
    let h = second[0].batch.header.as_ref().unwrap();
    assert_eq!((h.ledger_id, h.ledger_cluster.as_str()), (0x77, ""));
    let mut reply = grant_all(&second[0]);
    (reply.ledger_id, reply.cluster) = (0x1ed, "prod".into());
    c.handle_reply(T0 + 3 * MS, second[0].seq, reply);
    let third = want(&mut c, &rules, "k2", T0 + 4 * MS);
    let h = third[0].batch.header.as_ref().unwrap();
    assert_eq!((h.ledger_id, h.ledger_cluster.as_str()), (0x1ed, "prod"));
}

#[test]
fn an_allocator_of_another_cluster_is_probed_at_a_backed_off_pace() {
    // A staging agent pointed at production: every reply is of another
    // cluster. Once taken for unreachable it is only probed (heartbeats
    // and asks alike), the gap doubling up to the heartbeat; a key that
    // wants tokens waits for the next probe instead of asking every tick.
    let (mut c, rules) = core(8);
    c.cfg.cluster = "staging".into();
    let mut now = T0;
    let mut sent = Vec::new();
    for i in 0..200 {
        now += 50 * MS;
        let out = if i % 2 == 0 {
            want(&mut c, &rules, "k", now)
        } else {
            pump(&mut c, now)
        };
        for tx in out {
            sent.push(now);
            let mut reply = grant_all(&tx);
            reply.cluster = "prod".into();
            c.handle_reply(now + MS, tx.seq, reply);
        }
    }
    // 10 s: before, about 40 batches a second went out (a heartbeat each
    // tick while no rules or no reply had been taken, and its retries).
    assert!(c.reach().down, "taken for unreachable");
    let last_5s = sent.iter().filter(|&&t| t > now - 5_000 * MS).count();
    assert!(
        last_5s <= 5 * 3,
        "{last_5s} transmits in the last 5 s: {sent:?}"
    );
    assert!(last_5s >= 4, "still probed: {last_5s} in 5 s");
    // A reply of our own cluster: reachable again at once, and asked at
    // the tick's pace from then on.
    let mut back = Vec::new();
    for _ in 0..40 {
        now += 50 * MS;
        for tx in want(&mut c, &rules, "k", now) {
            back.push(tx.seq);
            c.handle_reply(now + MS, tx.seq, grant_all(&tx));
        }
    }
    let reach = c.reach();
    assert!(reach.connected && !reach.down, "{reach:?}; sent {back:?}");
    assert!(back.len() >= 2, "{back:?}");
}

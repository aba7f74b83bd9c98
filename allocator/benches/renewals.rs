//! SPEC §9: allocator key-renewals per second on one core, batched.
//!
//! One holder renews 10 000 keys of one rule (`tenant: "*"`) in batches of
//! 100 items through [`AllocatorCore::handle`], the sans-IO core every
//! driver calls (no network, no protobuf decoding, no lock). Each item is a
//! real renewal: it names the lease id of the key's previous grant, reports
//! it spent all but 2 of its tokens (so 2 are carried) and wants 10 more.
//! The clock advances 10 us per batch, so each key is renewed every 1 ms of
//! allocator time and its bucket (10 M/s) never runs dry: every grant is
//! asserted, outside the timed loop, to be GRANTED with carried 2 + fresh 10.
//!
//! Criterion reports elements/s with `Throughput::Elements(100)`: that is
//! key-renewals per second.
// A benchmark times itself: the sans-IO rule (clippy.toml) is for the
// crate's core modules.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use quotalease_allocator::core::{AllocatorCore, CoreConfig};
use quotalease_model::rules::RuleSet;
use quotalease_proto::lease::{
    GrantStatus, ItemKind, LeaseBatch, LeaseItem, LeaseReply, RequestHeader,
};
use quotalease_proto::PROTOCOL_VERSION;

const RULES: &str = r#"
rules:
  - id: per-tenant
    match: { tenant: "*" }
    rate: 10000000/s
    burst: 1000
    fail_policy: lease_only
"#;
const RULES_VERSION: u64 = 1;
const KEYS: usize = 10_000;
const BATCH: usize = 100;
const WANT: u64 = 10;
/// Tokens of a lease left unspent at renewal (carried into the next one).
const CARRY: u64 = 2;
const STEP_NS: u64 = 10_000;

/// One holder renewing every key in turn, with the state it keeps per key.
struct Holder {
    core: AllocatorCore,
    /// One reusable batch per block of `BATCH` keys; only the numbers
    /// change between rounds, so the bench side allocates nothing.
    batches: Vec<LeaseBatch>,
    /// Per key: (lease id, tokens) of the last grant.
    leases: Vec<(u64, u64)>,
    now_ns: u64,
    seq: u64,
    next_block: usize,
    /// Grants that were not "carried CARRY + fresh WANT" (checked at the end).
    short: u64,
}

impl Holder {
    fn new() -> Self {
        let rules =
            RuleSet::parse(RULES, "bench", RULES_VERSION).expect("the bench rules are valid");
        let now_ns = 1_000_000_000;
        let core = AllocatorCore::new(
            CoreConfig {
                no_predecessor: true,
                ..Default::default()
            },
            rules,
            1,
            1,
            now_ns,
        );
        let batches = (0..KEYS / BATCH)
            .map(|block| LeaseBatch {
                header: Some(RequestHeader {
                    agent_id: "bench-agent".into(),
                    incarnation: 1,
                    seq: 0,
                    protocol_version: PROTOCOL_VERSION,
                    rules_version: RULES_VERSION,
                    instance: 0,
                    ledger_id: 0,
                    run_id: 0,
                    record_seq: 0,
                    cluster: String::new(),
                    ledger_cluster: String::new(),
                }),
                items: (0..BATCH)
                    .map(|i| LeaseItem {
                        rule_id: "per-tenant".into(),
                        tenant: format!("tenant-{}", block * BATCH + i),
                        route: String::new(),
                        kind: ItemKind::Renew as i32,
                        lease_id: 0,
                        spent: 0,
                        want: WANT,
                        ..LeaseItem::default()
                    })
                    .collect(),
                ttl_ms: 1_000,
                shard: 0,
            })
            .collect();
        let mut h = Holder {
            core,
            batches,
            leases: vec![(0, 0); KEYS],
            now_ns,
            seq: 0,
            next_block: 0,
            short: 0,
        };
        // Open every key's first lease (untimed), then check the steady state.
        for _ in 0..2 * KEYS / BATCH {
            let reply = h.step();
            h.check(&reply);
        }
        assert_eq!(h.core.key_count(), KEYS);
        assert_eq!(h.short, 0, "warm-up renewals were not all full grants");
        h
    }

    /// Renew the next block of keys: one `handle` call.
    #[inline]
    fn step(&mut self) -> LeaseReply {
        let block = self.next_block;
        self.next_block = (block + 1) % self.batches.len();
        self.seq += 1;
        self.now_ns += STEP_NS;
        let batch = &mut self.batches[block];
        batch.header.as_mut().expect("set above").seq = self.seq;
        let base = block * BATCH;
        for (item, &(lease_id, tokens)) in
            batch.items.iter_mut().zip(&self.leases[base..base + BATCH])
        {
            item.lease_id = lease_id;
            item.spent = tokens.saturating_sub(CARRY);
        }
        let reply = self.core.handle(self.now_ns, batch);
        for (g, lease) in reply
            .grants
            .iter()
            .zip(&mut self.leases[base..base + BATCH])
        {
            // A key's first grant carries nothing; every renewal must carry
            // CARRY from the lease it names and add WANT fresh tokens.
            let (carried, tokens) = if lease.0 == 0 {
                (0, WANT)
            } else {
                (CARRY, CARRY + WANT)
            };
            let ok = g.status == GrantStatus::Granted as i32
                && g.lease_id != 0
                && g.carried == carried
                && g.tokens == tokens;
            self.short += u64::from(!ok);
            *lease = (g.lease_id, g.tokens);
        }
        reply
    }

    /// Strict check of one reply (untimed).
    fn check(&self, reply: &LeaseReply) {
        assert_eq!(reply.grants.len(), BATCH);
        for g in &reply.grants {
            assert_eq!(g.status, GrantStatus::Granted as i32, "{}", g.detail);
        }
    }
}

fn renewals(c: &mut Criterion) {
    let mut h = Holder::new();
    let mut g = c.benchmark_group("allocator");
    g.sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(5))
        .throughput(Throughput::Elements(BATCH as u64));
    g.bench_function("renew_batch_100", |b| {
        b.iter_custom(|iters| {
            let t0 = Instant::now();
            for _ in 0..iters {
                black_box(h.step());
            }
            t0.elapsed()
        })
    });
    g.finish();
    let renewed = h.seq;
    let carried_steady = h.core.stats().tokens_carried;
    println!(
        "allocator/renew_batch_100: {renewed} batches, {} grants not 'carried {CARRY} + fresh {WANT}', tokens carried {carried_steady}",
        h.short
    );
    assert_eq!(h.short, 0, "some renewals were not full grants");
    assert_eq!(h.core.key_count(), KEYS);
}

criterion_group!(benches, renewals);
criterion_main!(benches);

//! The agent core: the single-owner, sans-IO state machine of everything
//! but the hot path (ENGINEERING §1, §8).
//!
//! It owns, per key, the renewal state (lease id, what was granted, the
//! generation last cut, consumption history, the item in flight, a refusal),
//! the fail-open emergency bucket, and, for the agent, the batches in
//! flight, their retries and timeouts, the outage state and the sequence
//! numbers. A key's renewal state is kept packed in words of the key's own
//! slot that only the core touches (`KeyState`; one heap block per key,
//! SPEC §9), its rare parts in a map. It never reads a clock, spawns, sleeps or touches a socket:
//! time comes in as an argument (`now` on the agent clock, ns), messages
//! come in through `handle_*`, and what to do comes out through `poll_*`:
//!
//! * [`AgentCore::poll_transmit`]: a batch to send (a new one, or a retry
//!   of one in flight under the same sequence number);
//! * [`AgentCore::poll_event`]: keys whose waiting requests may re-check,
//!   emergency buckets opened, reachability changes;
//! * [`AgentCore::poll_timeout`]: when to call
//!   [`AgentCore::handle_timeout`] next (the renew tick, a batch's fetch
//!   timeout, or now when requests wait for a key).
//!
//! Retries, timeouts, backpressure (at most `max_in_flight` batches out)
//! and wake-ups live here, once; the tokio driver ([`crate::driver`]) and
//! the simulator only pump. The lease words themselves are in the shared
//! [`crate::lease_table`]; the core cuts, retires and installs them.
//!
//! Overload is not an outage: a batch given up on marks the allocator
//! unreachable only if no reply at all came back since it was first sent.
//!
//! Its parts: this file the state, the upstreams and the batches in flight
//! (`handle_*`, `poll_*`, sending, retries, outages and probes);
//! `plan.rs` the tick's walk and each key's plan; `install.rs` replies'
//! grants installed and emergency buckets sized.
#![deny(clippy::disallowed_methods, clippy::disallowed_types)]

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use quotalease_model::bucket::TokenBucket;
use quotalease_model::protocol::use_by_ns;
use quotalease_model::rules::{Rate, Rule, RuleSet};
use quotalease_proto::lease::{
    Grant, GrantStatus, ItemKind, LeaseBatch, LeaseItem, LeaseReply, RequestHeader,
};
use quotalease_proto::PROTOCOL_VERSION;

use crate::lease_table::{pack, Lookup, Refill, Slot, SlotHead, Table};
use crate::metrics::AgentMetrics;
use crate::renewal::{plan, KeyNow, Plan, PlanConfig, Usage};
use crate::snapshot::RulesCell;

mod install;
pub use install::{EmergencyConfig, EmergencyOpened};
mod plan;

use install::emergency_size;
use plan::item_order;

/// Attempts of one batch (the first send and its retries, each bounded by
/// `fetch_timeout`, all under the same sequence number).
pub const SEND_ATTEMPTS: u32 = 2;

/// How long replies saying "no leader yet" (SPEC §7: allocator replicas
/// electing a leader through etcd) count as an allocator that is reachable
/// but has nothing to grant: requests that need new tokens are denied with
/// a retry time, held leases keep serving. Longer than that, the allocator
/// is taken for unreachable and fail policies apply. An election takes the
/// dead leader's etcd lease TTL (3 s by default) and a round trip.
pub const NO_LEADER_GRACE: Duration = Duration::from_secs(15);

/// The core's settings (a subset of [`crate::AgentConfig`]).
#[derive(Clone, Debug)]
pub struct CoreConfig {
    /// Identity sent to the allocator.
    pub agent_id: String,
    /// Per-process nonce sent beside the id.
    pub instance: u64,
    /// First incarnation.
    pub incarnation: u64,
    /// Lease lifetime asked for.
    pub lease_ttl: Duration,
    /// Renewal planning.
    pub plan: PlanConfig,
    /// Bound of one allocator call.
    pub fetch_timeout: Duration,
    /// Stall allowance subtracted from every lease deadline.
    pub epsilon: Duration,
    /// Heartbeat to the allocator when nothing else is sent.
    pub heartbeat: Duration,
    /// Fail-open emergency bucket sizes.
    pub emergency: EmergencyConfig,
    /// Report every emergency bucket opened as an [`Event`].
    pub record_emergency: bool,
    /// Most batches in flight at once; more wanted keys wait for the next
    /// batch (backpressure instead of errors).
    pub max_in_flight: usize,
    /// Largest number of keys held.
    pub max_keys: usize,
    /// The cluster presented to the allocator ("": none); a reply from an
    /// allocator of another named cluster is not used.
    pub cluster: String,
}

/// The core's timers, by name; [`AgentCore::poll_timeout`] is the earliest
/// set one and [`AgentCore::handle_timeout`] acts on every one due.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Timer {
    /// Due at once: a walk over the keys is under way, or requests wait
    /// for keys and fewer than `max_in_flight` batches are out.
    Asked,
    /// The earliest deadline of a batch attempt in flight (retry or give
    /// up).
    Retry,
    /// The next tick: every key planned (at least every heartbeat).
    Tick,
}

impl Timer {
    /// Every timer.
    pub const ALL: [Timer; 3] = [Timer::Asked, Timer::Retry, Timer::Tick];
}

/// What the driver must act on.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// The key's batch was answered or given up on: requests waiting for
    /// it re-check.
    Settled(Slot),
    /// An emergency bucket was opened (only with `record_emergency`).
    EmergencyOpened(EmergencyOpened),
}

/// A batch to send. A retry has the same `seq` and content and a higher
/// `attempt`.
#[derive(Clone, Debug, PartialEq)]
pub struct Transmit {
    /// Sequence number.
    pub seq: u64,
    /// 1 for the first send.
    pub attempt: u32,
    /// The batch.
    pub batch: LeaseBatch,
}

/// Renewal-side state of one key (never touched by the request fast path),
/// as the core works on it: decoded from the key's slot
/// ([`KeyState::load`]) and written back ([`KeyState::store`]). It lives
/// in the slot's core-owned words, packed (SPEC §9 counts the agent's
/// bytes per key held: one allocation per key holds the lease word, the
/// request side's atomics, this state and the key's bytes). The key's
/// rare parts (a refusal, an emergency bucket) are in `AgentCore::rare`.
#[derive(Clone, Debug)]
struct KeyState {
    lease_id: u64,
    /// Tokens of the lease as the allocator records them (at most
    /// [`crate::lease_table::MAX_WORD_TOKENS`], what a word holds).
    granted: u64,
    /// The word's generation as the core last set it (24 bits, as in the
    /// word). Only the core changes a word's generation, so the word's
    /// always equals this.
    generation: u64,
    /// Tokens in the word at the last visit (for consumption accounting).
    baseline: u64,
    usage: Usage,
    /// A renewal is in flight: the low [`SEQ_TAG_BITS`] bits of its
    /// batch's sequence number (its carry and tokens at send are in the
    /// batch's [`Renewing`] entry).
    in_flight: Option<u32>,
    /// Holders of this key at the allocator, as of the last grant.
    holders: u64,
    /// The tick may skip this key before this instant if its word still
    /// reads (generation, baseline) and nothing waits or was denied.
    quiet_until_ns: u64,
    /// Idle (nothing spent for a second or more) at the last visit: the
    /// tick skips it until `quiet_until_ns` without even reading its word
    /// (a request that finds its lease short asks through `want` anyway).
    parked: bool,
    /// In the core's list of keys the tick visits (`AgentCore::active`);
    /// a parked key is not, it waits in `AgentCore::parked` instead.
    listed: bool,
    /// The core holds the key: false once it was forgotten (its slot may
    /// live on in handles and lists; the core skips it).
    held: bool,
    /// The rate asked for in the last renewal (micro-tokens per second).
    /// Kept (as `f32`, in `granted`'s bits) only while `granted` is 0,
    /// which it is whenever the lease carries a rate, the only time the
    /// planner reads it; a renewal in flight also keeps it in its
    /// [`Renewing`] entry, and the grant that answers it restores it.
    asked_rate_utps: u64,
    /// What the allocator last reported is left in the key's bucket beyond
    /// our lease (`Grant.bucket_available`): the request path reads it
    /// (the one core-owned word it reads) to answer `remaining`, see
    /// [`crate::lease_table::SlotHead::global_remaining`].
    bucket_available: u64,
}

/// Bits of a batch sequence number kept per key in flight. A key's
/// in-flight tag is compared only with batches still pending (answered or
/// given up on within `2 * lease_ttl`); 2^24 batches never go out in that
/// time (and at most one pending batch that is not given up on renews a
/// key: the planner does not renew a key in flight).
const SEQ_TAG_BITS: u32 = 24;
const SEQ_TAG_MASK: u64 = (1 << SEQ_TAG_BITS) - 1;
const LOW40: u64 = (1 << 40) - 1;
const HOLDERS_MAX: u64 = (1 << 24) - 1;

const F_HELD: u16 = 1;
const F_LISTED: u16 = 2;
const F_PARKED: u16 = 4;
const F_IN_FLIGHT: u16 = 8;
/// Word 1's low 40 bits hold `asked_rate_utps` as `f32` bits, not
/// `granted` (which is then 0).
const F_ASKED_RATE: u16 = 16;

/// The tag of batch `seq` in a key's state.
fn seq_tag(seq: u64) -> u32 {
    (seq & SEQ_TAG_MASK) as u32
}

/// A rate as stored (`f32`): a positive rate stays positive (it would
/// round to zero only after ~100 time constants idle; the planner treats
/// "no rate" and "some rate" differently).
fn rate_bits(x: f64) -> u32 {
    let f = x as f32;
    if f == 0.0 && x > 0.0 {
        f32::from_bits(1).to_bits()
    } else {
        f.to_bits()
    }
}

impl KeyState {
    /// A key just created (held, in the tick's list).
    fn fresh() -> Self {
        Self {
            lease_id: 0,
            granted: 0,
            generation: 0,
            baseline: 0,
            usage: Usage::default(),
            in_flight: None,
            holders: 1,
            quiet_until_ns: 0,
            parked: false,
            listed: true,
            held: true,
            asked_rate_utps: 0,
            bucket_available: 0,
        }
    }

    /// Decode the core-owned words of `s`. Relaxed: only the core writes
    /// them, always under its mutex, which orders its accesses (the
    /// request path only loads word 3, an estimate).
    fn load(s: &SlotHead) -> Self {
        let w = |i: usize| s.core(i).load(Relaxed);
        let flags = s.core_flags.load(Relaxed);
        let (granted_gen, baseline_holders, rates, since_seq) = (w(1), w(2), w(8), w(4));
        let asked_rate = flags & F_ASKED_RATE != 0;
        Self {
            lease_id: w(0),
            granted: if asked_rate { 0 } else { granted_gen & LOW40 },
            generation: granted_gen >> 40,
            baseline: baseline_holders & LOW40,
            holders: baseline_holders >> 40,
            usage: Usage {
                rate: f64::from(f32::from_bits(rates as u32)),
                admitted_rate: f64::from(f32::from_bits((rates >> 32) as u32)),
                since_tick: since_seq & LOW40,
                denied_since_tick: 0,
                last_tick_ns: w(5),
                last_active_ns: w(6),
            },
            in_flight: (flags & F_IN_FLIGHT != 0).then_some((since_seq >> 40) as u32),
            quiet_until_ns: w(7),
            parked: flags & F_PARKED != 0,
            listed: flags & F_LISTED != 0,
            held: flags & F_HELD != 0,
            asked_rate_utps: if asked_rate {
                f32::from_bits(granted_gen as u32) as u64
            } else {
                0
            },
            bucket_available: w(3),
        }
    }

    /// Encode into the core-owned words of `s`, writing only the words
    /// that changed (a hot key's block is not written on every visit).
    /// `usage.denied_since_tick` is not kept here: a visit folds it in at
    /// once (see `plan_key`).
    fn store(&self, s: &SlotHead) {
        let put = |i: usize, v: u64| {
            if s.core(i).load(Relaxed) != v {
                s.core(i).store(v, Relaxed);
            }
        };
        debug_assert!(self.generation < 1 << 24, "a word's generation has 24 bits");
        put(0, self.lease_id);
        // `granted`, or, while it is 0, the rate asked for.
        let asked_rate = self.granted == 0 && self.asked_rate_utps > 0;
        let low = if asked_rate {
            u64::from((self.asked_rate_utps as f32).to_bits())
        } else {
            self.granted.min(LOW40)
        };
        put(1, low | (self.generation << 40));
        put(
            2,
            self.baseline.min(LOW40) | (self.holders.min(HOLDERS_MAX) << 40),
        );
        put(3, self.bucket_available);
        put(
            8,
            u64::from(rate_bits(self.usage.rate))
                | (u64::from(rate_bits(self.usage.admitted_rate)) << 32),
        );
        let tag = u64::from(self.in_flight.unwrap_or(0)) & SEQ_TAG_MASK;
        put(4, self.usage.since_tick.min(LOW40) | (tag << 40));
        put(5, self.usage.last_tick_ns);
        put(6, self.usage.last_active_ns);
        put(7, self.quiet_until_ns);
        let bit = |on: bool, f: u16| if on { f } else { 0 };
        let flags = bit(self.held, F_HELD)
            | bit(self.listed, F_LISTED)
            | bit(self.parked, F_PARKED)
            | bit(self.in_flight.is_some(), F_IN_FLIGHT)
            | bit(asked_rate, F_ASKED_RATE);
        if s.core_flags.load(Relaxed) != flags {
            s.core_flags.store(flags, Relaxed);
        }
    }
}

impl KeyState {
    /// The RELEASE of this key's lease, retired with `left` tokens: a
    /// lease of tokens reports what it spent, a rate lease its level.
    fn release_item(&self, slot: &Slot, rate: bool, left: u64) -> LeaseItem {
        if rate {
            slot.release_item(self.lease_id, 0, left)
        } else {
            slot.release_item(self.lease_id, self.granted.saturating_sub(left), 0)
        }
    }
}

/// A key's rarely used parts, kept by the core beside its slot.
#[derive(Debug, Default)]
struct Rare {
    /// Set when the allocator refused the key (unknown rule, key limit...).
    refused: Option<(GrantStatus, String)>,
    /// Fail-open emergency bucket of an outage: (outage, bucket).
    emergency: Option<(u64, TokenBucket)>,
}

/// A key renewed by a batch in flight.
#[derive(Clone, Debug)]
struct Renewing {
    slot: Slot,
    /// The generation cut at the report.
    generation: u64,
    /// Tokens in the word at the cut.
    tokens_at_send: u64,
    /// The rate the renewal asked for (the key's `asked_rate_utps`, which
    /// its slot may not keep while a lease of tokens is held).
    asked_rate_utps: u64,
}

/// A batch on its way to the allocator.
#[derive(Debug)]
struct Pending {
    batch: LeaseBatch,
    first_sent_ns: u64,
    attempt: u32,
    /// When the current attempt times out.
    deadline_ns: u64,
    digest: u64,
    /// The keys of the RENEW items, in item order.
    renews: Vec<Renewing>,
    /// Given up on: a late reply only releases what it granted.
    abandoned: bool,
    /// The shard count its items were split under.
    shards: usize,
}

/// The agent's single-owner core. See the module docs.
#[derive(Debug)]
pub struct AgentCore {
    cfg: CoreConfig,
    /// When a reply of another cluster was last logged.
    wrong_cluster_logged_ns: u64,
    incarnation: u64,
    seq: u64,
    table: Arc<Table>,
    rules: Arc<RulesCell>,
    metrics: Arc<AgentMetrics>,
    /// The keys the tick visits: every key not parked (some may be
    /// forgotten: skipped).
    active: Vec<Slot>,
    /// Parked keys by the renew interval they are due again in
    /// (`quiet_until_ns / renew_interval`): the tick visits a parked key
    /// only when its interval has come, so a tick over many idle keys costs
    /// O(active keys), not a walk over all. Entries may be stale (the key
    /// left, or was re-parked later) or early (due later in the interval):
    /// a visit before its time is harmless. A stale entry keeps a
    /// forgotten key's slot alive until its interval comes.
    parked: BTreeMap<u64, Vec<Slot>>,
    /// Slots requests wait for since the last pass.
    wanted: Vec<Slot>,
    /// Rare per-key parts (refusals, emergency buckets), by slot.
    rare: HashMap<Slot, Rare, foldhash::fast::FixedState>,
    pending: BTreeMap<u64, Pending>,
    late_releases: Vec<LeaseItem>,
    transmits: VecDeque<Transmit>,
    events: VecDeque<Event>,
    /// Per shard (SPEC §7 "Sharding"; one while no reply said more): how
    /// its allocator is reached. A key's shard is
    /// `quotalease_proto::shard_of` over `ups.len()`.
    ups: Vec<Upstream>,
    /// Counts outages of every shard; an emergency bucket belongs to one.
    outages: u64,
    last_sent_ns: u64,
    next_tick_ns: u64,
    planned_version: u64,
    /// A tick's walk over the listed keys, when it is under way.
    walk: Option<Walk>,
    stopping: bool,
}

/// Keys a tick plans per call of [`AgentCore::handle_timeout`]. A tick over
/// many keys goes in steps (the driver calls again at once while
/// [`AgentCore::poll_timeout`] says now), so the core is never held for
/// long: the tokio driver holds the core's lock while it calls, and a
/// request that waits for a key takes the same lock to register.
const WALK_STEP: usize = 256;

/// Items per lease batch at most: a tick that plans more sends several
/// batches (a message stays far below the gRPC message limit, and a reply
/// is applied in bounded time).
const MAX_BATCH_ITEMS: usize = 2048;

/// A tick under way: the keys it visits, how far it got, what it planned.
#[derive(Debug)]
struct Walk {
    keys: Vec<Slot>,
    next: usize,
    ctx: PlanCtx,
}

/// How one shard's allocator is reached (the whole allocator when it is
/// not sharded).
#[derive(Clone, Debug, Default)]
struct Upstream {
    /// The last call to it succeeded.
    connected: bool,
    /// Taken for unreachable (fail policies apply to its keys).
    down: bool,
    /// A regional allocator reports its own parent unreachable.
    parent_down: bool,
    /// The outage (of `AgentCore::outages`) it is in or was in last.
    outage: u64,
    last_reply_ns: Option<u64>,
    /// Since when every reply said "no leader yet" (SPEC §7).
    no_leader_since_ns: Option<u64>,
    /// The ledger id of the allocator that last answered (0: none yet).
    ledger_id: u64,
    /// The newest run of that ledger a reply carried and the largest
    /// record sequence of it (0, 0: none), presented with the ledger id.
    run: (u64, u64),
    /// The cluster of the allocator whose reply gave `ledger_id`.
    ledger_cluster: String,
    /// While not connected: no batch goes to it before this instant (a
    /// probe), so that an allocator that is down, or that refuses us (of
    /// another cluster), is not asked every tick.
    probe_at_ns: u64,
    /// The wait after the next probe: doubles from the renew interval up
    /// to the heartbeat while no probe is answered; 0 once one is.
    probe_gap_ns: u64,
}

/// Where a request stands with the core, for the slow path.
#[derive(Clone, Copy, Debug)]
pub struct Reach {
    /// The allocator is taken for unreachable.
    pub down: bool,
    /// The last call succeeded.
    pub connected: bool,
    /// The (regional) allocator reports its parent unreachable.
    pub parent_down: bool,
}

impl AgentCore {
    /// A core at `now` over the shared lease table, rule cell and metrics.
    pub fn new(
        cfg: CoreConfig,
        table: Arc<Table>,
        rules: Arc<RulesCell>,
        metrics: Arc<AgentMetrics>,
        now: u64,
    ) -> Self {
        Self {
            incarnation: cfg.incarnation,
            cfg,
            wrong_cluster_logged_ns: 0,
            seq: 0,
            table,
            rules,
            metrics,
            active: Vec::new(),
            parked: BTreeMap::new(),
            wanted: Vec::new(),
            rare: HashMap::with_hasher(foldhash::fast::FixedState::with_seed(0)),
            pending: BTreeMap::new(),
            late_releases: Vec::new(),
            transmits: VecDeque::new(),
            events: VecDeque::new(),
            ups: vec![Upstream::default()],
            outages: 0,
            last_sent_ns: 0,
            next_tick_ns: now,
            planned_version: 0,
            walk: None,
            stopping: false,
        }
    }

    /// Bytes of the core's per-key renewal state as it works on it
    /// (decoded; it is stored packed in 64 bytes of the key's slot).
    pub const KEY_STATE_BYTES: usize = std::mem::size_of::<KeyState>();

    /// The incarnation sent now.
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// Reachability of the whole allocator, for readiness: connected
    /// while every shard's last call succeeded, down while one is down.
    pub fn reach(&self) -> Reach {
        Reach {
            down: self.ups.iter().any(|u| u.down),
            connected: self.ups.iter().all(|u| u.connected),
            parent_down: self.ups.iter().any(|u| u.parent_down),
        }
    }

    /// Reachability of the shard `slot`'s key belongs to, for the slow
    /// path: one shard's outage is its keys' alone.
    pub fn reach_of(&self, slot: &Slot) -> Reach {
        let u = &self.ups[self.shard_of(slot)];
        Reach {
            down: u.down,
            connected: u.connected,
            parent_down: u.parent_down,
        }
    }

    /// Shards the allocator has, as last learned (1: not sharded).
    pub fn shard_count(&self) -> usize {
        self.ups.len()
    }

    fn shard_of(&self, slot: &Slot) -> usize {
        key_shard(slot, self.ups.len())
    }

    /// Number of keys with renewal state.
    pub fn key_count(&self) -> usize {
        self.table.len()
    }

    // -- the slow path's entry points (called under the driver's lock) --

    /// The slot of a rule's key, created (in the table and here) if
    /// missing; `None` when `max_keys` keys are held.
    pub fn slot_for(&mut self, rule: &Rule, tenant: &str, route: &str) -> Option<Slot> {
        let (tp, rp) = (rule.tenant.key_part(tenant), rule.route.key_part(route));
        let key = Lookup(crate::lease_table::KeyRef::new(&rule.id, tp, rp));
        let table = self.table.pin();
        if let Some(s) = table.get(&key) {
            return Some(s.to_owned());
        }
        if table.len() >= self.cfg.max_keys {
            return None;
        }
        // The core alone inserts: nothing can have raced this one in.
        let slot = Slot::new(&rule.id, tp, rp);
        KeyState::fresh().store(&slot);
        self.active.push(slot.clone());
        table.insert(slot.clone());
        Some(slot)
    }

    /// The slots of the keys held (tests).
    #[cfg(test)]
    fn held_slots(&self) -> Vec<Slot> {
        self.table.pin().iter().map(|s| s.to_owned()).collect()
    }

    /// Whether `slot` is the slot of a key the core holds (not forgotten).
    pub fn holds(&self, slot: &Slot) -> bool {
        slot.core_flags.load(Relaxed) & F_HELD != 0
    }

    /// Why the allocator refused this key, if it did.
    pub fn refused(&self, slot: &Slot) -> Option<(GrantStatus, String)> {
        self.rare.get(slot).and_then(|r| r.refused.clone())
    }

    /// A request waits for `slot`'s next grant (`cost` more tokens): it
    /// goes into the next batch, planned at once (see `poll_timeout`).
    pub fn want(&mut self, slot: Slot, cost: u64) {
        slot.add_waiting(cost);
        self.wanted.push(slot);
        self.metrics.waits.add(1);
    }

    /// Take `cost` from the key's emergency bucket for the current outage,
    /// creating it on first use: rate `r_e = max(this agent's recent
    /// consumption, R / holders)`, burst `b_e = max(1, B / holders)` (SPEC §2
    /// I3, §6). The tokens left, or `None` when it is empty.
    pub fn emergency_take(&mut self, slot: &Slot, rule: &Rule, cost: u64, t: u64) -> Option<u64> {
        let outage = self.ups[self.shard_of(slot)].outage;
        let cfg = self.cfg.emergency;
        let record = self.cfg.record_emergency;
        let k = KeyState::load(slot);
        if !k.held {
            return None;
        }
        let rare = self.rare.entry(slot.clone()).or_default();
        if rare.emergency.as_ref().is_none_or(|(o, _)| *o != outage) {
            let (rate, burst) = emergency_size(&cfg, rule, k.usage.admitted_rate, k.holders);
            if record {
                self.events
                    .push_back(Event::EmergencyOpened(EmergencyOpened {
                        at_ns: t,
                        rule_id: slot.rule_id().to_string(),
                        tenant: slot.tenant().to_string(),
                        route: slot.route().to_string(),
                        rate,
                        burst,
                    }));
            }
            rare.emergency = Some((outage, TokenBucket::new_full(rate, burst, t)));
        }
        let (_, bucket) = rare.emergency.as_mut().expect("created above");
        bucket.try_acquire(cost, t).ok()
    }

    /// Give back an emergency charge of an all-or-none request that failed.
    pub fn emergency_refund(&mut self, slot: &Slot, cost: u64, t: u64) {
        if let Some((_, bucket)) = self.rare.get_mut(slot).and_then(|r| r.emergency.as_mut()) {
            bucket.refund(cost, t);
        }
    }

    // -- the driver's entry points --

    /// When to call [`AgentCore::handle_timeout`] next (agent clock, ns):
    /// the earliest of its [`Timer`]s; `None` once stopping.
    pub fn poll_timeout(&self) -> Option<u64> {
        if self.stopping {
            return None;
        }
        Timer::ALL.iter().filter_map(|&t| self.timer(t)).min()
    }

    /// When the timer `t` is due (agent clock, ns), if it is set.
    pub fn timer(&self, t: Timer) -> Option<u64> {
        match t {
            Timer::Asked => (self.walk.is_some()
                || (!self.wanted.is_empty() && self.in_flight() < self.cfg.max_in_flight))
                .then_some(0),
            Timer::Retry => self
                .pending
                .values()
                .filter(|p| !p.abandoned)
                .map(|p| p.deadline_ns)
                .min(),
            Timer::Tick => Some(self.next_tick_ns),
        }
    }

    /// Time passed to `now`: give up on or retry batches whose attempt
    /// timed out; when the tick is due, plan every key; else plan the keys
    /// requests wait for, if fewer than `max_in_flight` batches are out.
    pub fn handle_timeout(&mut self, now: u64) {
        if self.stopping {
            return;
        }
        let timed_out: Vec<(u64, u32)> = self
            .pending
            .iter()
            .filter(|(_, p)| !p.abandoned && p.deadline_ns <= now)
            .map(|(&seq, p)| (seq, p.attempt))
            .collect();
        for (seq, attempt) in timed_out {
            self.attempt_failed(now, seq, attempt, "allocator call timed out");
        }
        if let Some(walk) = self.walk.take() {
            // A tick under way goes on (and keys requests wait for are
            // asked for between its steps).
            self.step_walk(now, walk);
            if !self.wanted.is_empty() && self.in_flight() < self.cfg.max_in_flight {
                self.poll(now, true);
            }
        } else if now >= self.next_tick_ns {
            // The tick plans every key (the wanted ones too) and is never
            // held back by the in-flight cap: renewals of warm keys must
            // not starve behind a flood of cold fetches. It sends one
            // batch per renew interval (more only past `MAX_BATCH_ITEMS`),
            // when its walk is done.
            // At least every heartbeat: a heartbeat is sent from the tick,
            // and it presents what this agent saw of the ledger within an
            // allocator's start wait. With `--renew-interval 5s` an idle
            // agent presented it too late, and a restored state directory
            // gave a brand-new agent the burst a second time (+19.7 tokens
            // at `1/m burst 20`, an adversarial review).
            let interval = (self.cfg.plan.renew_interval.min(self.cfg.heartbeat)).as_nanos() as u64;
            self.next_tick_ns = now.saturating_add(interval.max(1));
            self.poll(now, false);
        } else if !self.wanted.is_empty() && self.in_flight() < self.cfg.max_in_flight {
            self.poll(now, true);
        }
    }

    /// Whether a driver has anything to pick up now: a transmit, an event,
    /// or keys requests wait for.
    pub fn has_output(&self) -> bool {
        !self.transmits.is_empty() || !self.events.is_empty() || !self.wanted.is_empty()
    }

    /// The next batch to send, if any.
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        self.transmits.pop_front()
    }

    /// The next event to act on, if any.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// Attempt `attempt` of batch `seq` failed at `now` (an error from the
    /// transport): retry at once, or give up after [`SEND_ATTEMPTS`].
    pub fn handle_failure(&mut self, now: u64, seq: u64, attempt: u32, why: &str) {
        self.attempt_failed(now, seq, attempt, why);
    }

    /// The reply to batch `seq` arrived at `now`. A reply that does not
    /// answer the request (seq, grant count, digest) is ignored and the
    /// batch given up on; a reply to a batch given up on only releases the
    /// fresh tokens it granted; a repeated reply is ignored.
    pub fn handle_reply(&mut self, now: u64, seq: u64, mut reply: LeaseReply) {
        let Some(p) = self.pending.get(&seq) else {
            return;
        };
        let shard = answering_shard(&reply, p.batch.shard);
        // The shard count, learned from every reply: keys the allocator
        // says belong elsewhere are asked again at once, each from its
        // shard's leader.
        let count = reply.shard_count.clamp(1, MAX_SHARDS) as usize;
        let resharded = count != self.ups.len();
        if resharded {
            tracing::info!(
                from = self.ups.len(),
                to = count,
                "the allocator's shard count changed"
            );
            self.ups.resize(count, Upstream::default());
        }
        if reply.not_leader && reply.grants.is_empty() {
            // An allocator replica without a leader (the transport follows
            // a named one): nothing was applied. Reachable but empty, for
            // as long as an election takes: every key is answered "dry,
            // ask again after the hint", and the leases held stay usable
            // under their own deadlines (a grant naming no lease).
            let since = *up_of(&mut self.ups, shard)
                .no_leader_since_ns
                .get_or_insert(now);
            if now.saturating_sub(since) > NO_LEADER_GRACE.as_nanos() as u64 {
                let attempt = p.attempt;
                self.attempt_failed(now, seq, attempt, "no allocator leader");
                return;
            }
            let retry_ms = reply.retry_after_ms.max(1);
            if since == now {
                tracing::warn!(retry_ms, "the allocator replicas have no leader yet; requests that need new tokens are denied until one is elected");
            }
            // Releases come first, then the renewals in `renews` order. A
            // key keeps what it knew of its holders and of the bucket (the
            // emergency bucket of a later outage is sized by the former).
            let releases = p.batch.items.len().saturating_sub(p.renews.len());
            reply.grants = p
                .batch
                .items
                .iter()
                .enumerate()
                .map(|(n, i)| {
                    if i.kind == ItemKind::Release as i32 {
                        return Grant {
                            status: GrantStatus::Released as i32,
                            ..Grant::default()
                        };
                    }
                    let known = n
                        .checked_sub(releases)
                        .and_then(|j| p.renews.get(j))
                        .map(|r| KeyState::load(&r.slot));
                    Grant {
                        status: GrantStatus::Granted as i32,
                        retry_after_ms: retry_ms,
                        holders: known
                            .as_ref()
                            .map_or(1, |k| u32::try_from(k.holders).unwrap_or(u32::MAX)),
                        bucket_available: known.as_ref().map_or(0, |k| k.bucket_available),
                        ..Grant::default()
                    }
                })
                .collect();
        } else if up_of(&mut self.ups, shard)
            .no_leader_since_ns
            .take()
            .is_some()
        {
            tracing::info!("the allocator replicas have a leader again");
        }
        if !self.cfg.cluster.is_empty()
            && !reply.cluster.is_empty()
            && reply.cluster != self.cfg.cluster
        {
            // An allocator of another cluster (a staging agent pointed at
            // production, or the reverse): none of its grants is used.
            self.metrics.mismatched_replies.add(1);
            if now >= self.wrong_cluster_logged_ns.saturating_add(10_000_000_000) {
                self.wrong_cluster_logged_ns = now;
                tracing::error!(
                    theirs = %reply.cluster,
                    ours = %self.cfg.cluster,
                    "the allocator serves another cluster: its replies are not used (logged once every 10 s)"
                );
            }
            // As if it had not answered: retried, then the allocator is
            // taken for unreachable (fail policies apply, and the core
            // probes it at its own pace instead of asking per request).
            let attempt = self.pending.get(&seq).map_or(0, |p| p.attempt);
            self.attempt_failed(now, seq, attempt, "the allocator serves another cluster");
            return;
        }
        let digest_ok = reply.request_digest == 0
            || reply.request_digest == p.digest
            || (reply.protocol_version < 4
                && reply.request_digest == quotalease_proto::request_digest_v3(&p.batch));
        if reply.seq != seq || reply.grants.len() != p.batch.items.len() || !digest_ok {
            self.metrics.mismatched_replies.add(1);
            tracing::error!(
                seq,
                reply_seq = reply.seq,
                items = p.batch.items.len(),
                grants = reply.grants.len(),
                digest_ok,
                "allocator reply does not answer our request; ignored"
            );
            self.abandon(seq);
            return;
        }
        let p = self.pending.remove(&seq).expect("looked up above");
        let up = self.up(shard);
        up.last_reply_ns = Some(now);
        up.down = false;
        (up.probe_at_ns, up.probe_gap_ns) = (0, 0);
        if !up.connected {
            up.connected = true;
            tracing::info!(shard, "allocator reachable");
        }
        self.metrics
            .record_renewal(Duration::from_nanos(now.saturating_sub(p.first_sent_ns)));
        let again = self.apply_reply(reply, seq, &p, now, resharded);
        if p.abandoned {
            return;
        }
        // Keys whose item was not applied (STALE: the allocator saw newer
        // sequence numbers first; SEQ_CONFLICT) are asked again at once
        // under a new seq; their waiting requests keep waiting, so a
        // reordering costs them no attempt.
        let settled: Vec<Slot> = p
            .renews
            .iter()
            .map(|r| &r.slot)
            .filter(|s| !again.contains(s))
            .cloned()
            .collect();
        self.settle(seq, &settled);
        for slot in again {
            let mut k = KeyState::load(&slot);
            if k.held {
                if k.in_flight == Some(seq_tag(seq)) {
                    k.in_flight = None;
                }
                k.quiet_until_ns = 0;
                k.store(&slot);
                self.wanted.push(slot);
            }
        }
    }

    /// Stop: retire every lease and return the batch that releases their
    /// unused tokens (sent once, best effort), if anything is held.
    pub fn shutdown(&mut self, now: u64) -> Option<LeaseBatch> {
        self.stopping = true;
        let mut items = std::mem::take(&mut self.late_releases);
        if let Some(walk) = self.walk.take() {
            // A tick under way: what it planned to release goes too.
            items.extend(walk.ctx.late);
            items.extend(walk.ctx.releases);
        }
        let mut released = 0;
        let mut leases = Vec::new();
        for s in self.table.pin().iter() {
            let slot = &s.to_owned();
            let mut k = KeyState::load(slot);
            let was_rate = slot.word.refill().is_rate();
            let (left, new_gen) = slot.word.retire(now);
            k.generation = new_gen;
            k.store(slot);
            if k.lease_id != 0 {
                released += left;
                leases.push(k.release_item(slot, was_rate, left));
            }
        }
        // In key order, whatever the table's (seeded) order.
        leases.sort_by(item_order);
        items.extend(leases);
        self.metrics.tokens_released.add(released);
        if items.is_empty() {
            return None;
        }
        self.seq += 1;
        Some(self.batch(self.seq, items, 0))
    }

    // -- internals --

    /// Shard `shard`'s state (a batch sent before the shard count shrank
    /// names one past the end: the last one's).
    fn up(&mut self, shard: usize) -> &mut Upstream {
        up_of(&mut self.ups, shard)
    }

    fn in_flight(&self) -> usize {
        self.pending.values().filter(|p| !p.abandoned).count()
    }

    fn attempt_failed(&mut self, now: u64, seq: u64, attempt: u32, why: &str) {
        let Some(p) = self.pending.get_mut(&seq) else {
            return;
        };
        if p.abandoned || p.attempt != attempt {
            return;
        }
        self.metrics.rpc_errors.add(1);
        if p.attempt < SEND_ATTEMPTS {
            // The same batch, the same sequence number: the allocator
            // answers a duplicate from its cache and never grants twice.
            p.attempt += 1;
            p.deadline_ns = now.saturating_add(self.cfg.fetch_timeout.as_nanos() as u64);
            let t = Transmit {
                seq,
                attempt: p.attempt,
                batch: p.batch.clone(),
            };
            self.transmits.push_back(t);
            return;
        }
        // Overload is not an outage: only a batch that saw no reply at all
        // since it was first sent makes the allocator unreachable.
        let first_sent = p.first_sent_ns;
        let shard = p.batch.shard as usize;
        self.abandon(seq);
        let outages = self.outages + 1;
        let up = self.up(shard);
        let heard_since = up.last_reply_ns.is_some_and(|r| r >= first_sent);
        if heard_since {
            tracing::debug!(seq, %why, "batch given up on; the allocator answers others (overload, not an outage)");
            return;
        }
        if !up.down {
            up.down = true;
            up.outage = outages;
            self.outages = outages;
        }
        let up = self.up(shard);
        if up.connected {
            up.connected = false;
            tracing::warn!(shard, %why, "allocator unreachable; serving from leases, then fail policies");
        }
    }

    /// Give up on batch `seq`: its releases go back to the queue, its keys
    /// may ask again, and a late reply only releases what it granted.
    fn abandon(&mut self, seq: u64) {
        let Some(p) = self.pending.get_mut(&seq).filter(|p| !p.abandoned) else {
            return;
        };
        p.abandoned = true;
        let releases: Vec<LeaseItem> = p
            .batch
            .items
            .iter()
            .filter(|i| i.kind == ItemKind::Release as i32)
            .cloned()
            .collect();
        let renews: Vec<Slot> = p.renews.iter().map(|r| r.slot.clone()).collect();
        self.late_releases.extend(releases);
        self.settle(seq, &renews);
    }

    /// Batch `seq` is answered or given up: its keys may ask again and the
    /// requests parked on them re-check.
    fn settle(&mut self, seq: u64, renews: &[Slot]) {
        for slot in renews {
            let mut k = KeyState::load(slot);
            if !k.held {
                continue;
            }
            if k.in_flight == Some(seq_tag(seq)) {
                k.in_flight = None;
            }
            k.quiet_until_ns = 0;
            k.store(slot);
            slot.clear_waiting();
            slot.note_settled();
            self.events.push_back(Event::Settled(slot.clone()));
        }
    }

    /// Plan and queue the next batch at `t` (renewals, releases, or a
    /// heartbeat); a wake-up pass (`woken`) plans only the wanted keys.
    fn poll(&mut self, t: u64, woken: bool) {
        // Forget abandoned batches whose grants have surely expired.
        let keep_ns = 2 * self.cfg.lease_ttl.as_nanos() as u64;
        self.pending
            .retain(|_, p| !p.abandoned || p.first_sent_ns.saturating_add(keep_ns) > t);
        if let Some((items, renews)) = self.plan_all(t, woken) {
            self.send(t, items, renews);
        }
    }

    /// Send planned items (releases first, then renewals with their slot
    /// ids in item order) in batches of at most [`MAX_BATCH_ITEMS`], or a
    /// heartbeat when nothing is planned and one is due.
    fn send(&mut self, t: u64, items: Vec<LeaseItem>, renews: Vec<Renewing>) {
        // A heartbeat is due when nothing was sent for its interval, while
        // no rules are known, and to a shard not reached yet.
        let quiet = self.in_flight() == 0;
        let due =
            quiet && t.saturating_sub(self.last_sent_ns) >= self.cfg.heartbeat.as_nanos() as u64;
        // Sooner while no rules are known or the shard is not reached yet,
        // at the pace of its probes.
        let no_rules = !self.rules.has_rules();
        let heartbeat_due =
            |u: &Upstream| due || (quiet && (no_rules || !u.connected) && t >= u.probe_at_ns);
        if items.is_empty() && !self.ups.iter().any(heartbeat_due) {
            return;
        }
        self.last_sent_ns = t;
        let count = self.ups.len();
        if count == 1 {
            self.send_to(t, 0, items, renews);
            return;
        }
        // One batch (or more) per shard, each item to its key's shard; a
        // heartbeat to every shard.
        let releases = items.len() - renews.len();
        let mut per: Vec<(Vec<LeaseItem>, Vec<Renewing>)> =
            (0..count).map(|_| (Vec::new(), Vec::new())).collect();
        let mut items = items.into_iter();
        for item in items.by_ref().take(releases) {
            let s =
                quotalease_proto::shard_of(&item.rule_id, &item.tenant, &item.route, count as u32);
            per[s as usize].0.push(item);
        }
        for (item, r) in items.zip(renews) {
            let s = key_shard(&r.slot, count);
            per[s].0.push(item);
            per[s].1.push(r);
        }
        let due: Vec<bool> = self.ups.iter().map(heartbeat_due).collect();
        for (s, (items, renews)) in per.into_iter().enumerate() {
            if !items.is_empty() || due[s] {
                self.send_to(t, s as u32, items, renews);
            }
        }
    }

    /// [`AgentCore::send`] of items of one shard.
    fn send_to(
        &mut self,
        t: u64,
        shard: u32,
        mut items: Vec<LeaseItem>,
        mut renews: Vec<Renewing>,
    ) {
        // The first `releases` items are releases, the rest renewals.
        let mut releases = items.len() - renews.len();
        loop {
            let take = items.len().min(MAX_BATCH_ITEMS);
            let rest = items.split_off(take);
            let rest_renews = renews.split_off(take.saturating_sub(releases));
            releases = releases.saturating_sub(take);
            self.send_one(t, shard, items, renews);
            items = rest;
            renews = rest_renews;
            if items.is_empty() {
                return;
            }
        }
    }

    fn send_one(&mut self, t: u64, shard: u32, items: Vec<LeaseItem>, renews: Vec<Renewing>) {
        self.seq += 1;
        let seq = self.seq;
        for r in &renews {
            let mut k = KeyState::load(&r.slot);
            if k.held && k.in_flight.is_some() {
                k.in_flight = Some(seq_tag(seq));
                k.store(&r.slot);
            }
        }
        let mut batch = self.batch(seq, items, self.cfg.lease_ttl.as_millis() as u64);
        batch.shard = shard;
        if let Some(h) = &mut batch.header {
            let up = self.ups.get(shard as usize);
            h.ledger_id = up.map_or(0, |u| u.ledger_id);
            (h.run_id, h.record_seq) = up.map_or((0, 0), |u| u.run);
            h.ledger_cluster = up.map_or(String::new(), |u| u.ledger_cluster.clone());
        }
        let digest = quotalease_proto::request_digest(&batch);
        let floor = self.interval_ns();
        let most = (self.cfg.heartbeat.as_nanos() as u64).max(floor);
        let up = self.up(shard as usize);
        if !up.connected {
            // A probe: the next one waits longer while none is answered.
            let gap = up.probe_gap_ns.max(floor);
            up.probe_at_ns = t.saturating_add(gap);
            up.probe_gap_ns = gap.saturating_mul(2).min(most);
        }
        self.transmits.push_back(Transmit {
            seq,
            attempt: 1,
            batch: batch.clone(),
        });
        self.pending.insert(
            seq,
            Pending {
                batch,
                first_sent_ns: t,
                attempt: 1,
                deadline_ns: t.saturating_add(self.cfg.fetch_timeout.as_nanos() as u64),
                digest,
                renews,
                abandoned: false,
                shards: self.ups.len(),
            },
        );
    }

    fn batch(&self, seq: u64, items: Vec<LeaseItem>, ttl_ms: u64) -> LeaseBatch {
        LeaseBatch {
            header: Some(RequestHeader {
                agent_id: self.cfg.agent_id.clone(),
                incarnation: self.incarnation,
                seq,
                protocol_version: PROTOCOL_VERSION,
                rules_version: self.rules.version(),
                instance: self.cfg.instance,
                ledger_id: self.ups[0].ledger_id,
                run_id: self.ups[0].run.0,
                record_seq: self.ups[0].run.1,
                cluster: self.cfg.cluster.clone(),
                ledger_cluster: self.ups[0].ledger_cluster.clone(),
            }),
            ttl_ms,
            items,
            shard: 0,
        }
    }
}

/// How long a key whose shard the transport cannot reach yet waits before
/// it asks again.
const NO_ROUTE_RETRY_NS: u64 = 500_000_000;

/// Shards an agent follows at most (a reply cannot make it hold more).
const MAX_SHARDS: u32 = 1024;

/// Shard `shard`'s state in `ups` (a batch sent before the shard count
/// shrank names one past the end: the last one's).
fn up_of(ups: &mut [Upstream], shard: usize) -> &mut Upstream {
    let last = ups.len() - 1;
    &mut ups[shard.min(last)]
}

/// The shard whose allocator answered a batch sent to `sent_to`: the one
/// the reply names when sharded (a first contact's leader may serve
/// another shard than the batch was meant for, before the shards are
/// known), else the batch's.
fn answering_shard(reply: &LeaseReply, sent_to: u32) -> usize {
    if reply.shard_count > 1 {
        reply.shard.min(reply.shard_count - 1) as usize
    } else {
        sent_to as usize
    }
}

/// The shard of `slot`'s key among `count`.
fn key_shard(slot: &Slot, count: usize) -> usize {
    quotalease_proto::shard_of(slot.rule_id(), slot.tenant(), slot.route(), count as u32) as usize
}

/// Working state of one planning pass.
#[derive(Debug)]
struct PlanCtx {
    rules: Option<Arc<RuleSet>>,
    rules_changed: bool,
    idle_ns: u64,
    lead_ns: u64,
    /// Per shard: (down, its outage, when the next probe may go).
    ups: Vec<(bool, u64, u64)>,
    /// Releases to send again (not applied by the allocator before).
    late: Vec<LeaseItem>,
    releases: Vec<LeaseItem>,
    renews: Vec<(LeaseItem, Renewing)>,
    forget: Vec<Slot>,
}

#[cfg(test)]
mod tests;

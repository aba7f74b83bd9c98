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
//! Its parts: this file the state, its named timers, the upstreams and the
//! driver's entry points (`handle_timeout`, `poll_*`); `batches.rs` the
//! batches in flight (`handle_reply`, `handle_failure`, sending, retries,
//! giving up); `key_state.rs` a key's renewal state packed into its slot;
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

mod batches;
mod install;
mod key_state;
pub use install::{EmergencyConfig, EmergencyOpened};
mod plan;

use install::emergency_size;
use key_state::*;
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

/// A key's rarely used parts, kept by the core beside its slot.
#[derive(Debug, Default)]
struct Rare {
    /// Set when the allocator refused the key (unknown rule, key limit...).
    refused: Option<(GrantStatus, String)>,
    /// Fail-open emergency bucket of an outage: (outage, bucket).
    emergency: Option<(u64, TokenBucket)>,
    /// Tokens a newer rate version's smaller capacity clipped from the
    /// word, handed back with the next renewal, which names that version
    /// (`LeaseItem.left`; docs/protocol.md "A shrink hands back").
    returnable: u64,
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

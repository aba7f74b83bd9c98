//! The allocator core, sans-IO: holders and their duplicate suppression,
//! the rule set, and one [`KeyLedger`] per key. A driver feeds it
//! `(now, LeaseBatch)` and sends back the returned `LeaseReply`.
//!
//! Messages (SPEC §2 "Messages"): every batch carries (agent id,
//! incarnation, sequence number). A batch seen before is answered from the
//! reply cache and applies nothing; a batch older than the cache window, or
//! from an older incarnation, is answered `STALE` and applies nothing.
//! Releases apply at most once because the ledger removes the lease they
//! name and ignores unknown ids.
//!
//! Its parts: this file the state, its settings and what drivers read;
//! `core/batch.rs` a batch and its items; `core/resume.rs` checkpoints and
//! resumes; `core/sweep.rs` housekeeping; `core/runs.rs` what requesters
//! present of the ledger and run that served them, and what a lost or
//! older state costs.

use std::collections::BTreeMap;

/// The core's maps: keyed by ids agents send, so a seeded hash that is
/// still fast (SipHash was a tenth of a busy allocator's time).
type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::quality::RandomState>;

use quotalease_proto::lease::{
    Grant, GrantStatus, ItemKind, LeaseBatch, LeaseItem, LeaseReply, RuleSet as PbRuleSet,
};
use quotalease_proto::PROTOCOL_VERSION;

use quotalease_model::key::KeyId;
use quotalease_model::protocol::{drift_margin_ns, MAX_ID_BYTES};
use quotalease_model::rules::{Pattern, Rule, RuleSet};

use crate::ledger::{HolderId, KeyCheckpoint, KeyLedger, Lease, PoolTerm, Renewal, PHANTOM};
use crate::reservations::{Reservation, Reservations};

mod batch;
mod resume;
mod runs;
mod slot_items;
mod sweep;

pub use slot_items::SlotView;

/// Least gap between two sweeps of one key.
const SWEEP_MIN_GAP_NS: u64 = 100_000_000;

/// Allocator configuration.
#[derive(Clone, Debug)]
pub struct CoreConfig {
    /// Longest lease this allocator grants (`TTL_max`). A restarted
    /// allocator waits this long (plus drift margin) before granting.
    pub ttl_max_ns: u64,
    /// Clock granularity and stall allowance added to the restart wait.
    pub epsilon_ns: u64,
    /// Replies remembered per holder for duplicate suppression.
    pub reply_cache: usize,
    /// A holder that asked for a key within this window counts for the
    /// key's fair share.
    pub active_window_ns: u64,
    /// Holders silent this long are forgotten (their leases expired long before).
    pub holder_idle_ns: u64,
    /// Skip the start-up wait: only for a process that knows no predecessor
    /// ever granted a lease for its keys (the in-process demo). Never set
    /// for a real deployment: a restart would break I1.
    pub no_predecessor: bool,
    /// An earlier term of this ledger may have lent slot leases
    /// (docs/permits.md): slot ledgers are neither checkpointed nor
    /// reserved, so a start that resumes tokens from its reservations
    /// (`no_predecessor`) must still wait out those leases before lending
    /// slots. Set by [`crate::term::config`] for every start but a new
    /// ledger's first; ignored when `no_predecessor` is false (then every
    /// kind waits).
    pub slot_leases_may_be_out: bool,
    /// A regional's pools resume their predecessors' slot leases
    /// (docs/permits.md "A regional restart"): experimental and off by
    /// default: I4 holds only while one process of a region name is
    /// alive at a time (a review found two live ones, as in a rolling
    /// update's overlap, breaking it).
    pub resume_slot_leases: bool,
    /// The longest `TTL_max` a predecessor may have granted leases under
    /// (recorded in the state directory; 0: this one's): a restart waits
    /// for the larger.
    pub predecessor_ttl_max_ns: u64,
    /// This allocator's ledger id (SPEC §2 "First start"), stamped on
    /// every reply; 0: none (a regional allocator, a test core), and
    /// requesters' ids are not checked.
    pub ledger_id: u64,
    /// A new ledger grants nothing for this long after its start (its
    /// buckets are full after it): requesters that hold another ledger's
    /// leases (the state directory was lost) name it within their
    /// heartbeat, before a new requester can take a burst a second time.
    /// 0: none.
    pub first_start_grace_ns: u64,
    /// The operator said this is a new ledger: a requester naming another
    /// one does not make this allocator wait (its old leases are known to
    /// be gone, or the operator accepts the risk).
    pub new_ledger: bool,
    /// Keep write-ahead reservations ([`crate::reservations`]; global
    /// allocators with a state directory): a grant that breaks a key's
    /// durable promise is answered only once its new record is durable.
    pub reservations: bool,
    /// Sharding (SPEC §7): this allocator serves shard `.0` of `.1`; an
    /// item of a key of another shard is answered `WRONG_SHARD` and
    /// nothing is applied. (0, 1): not sharded.
    pub shard: (u32, u32),
    /// This ledger's runs (SPEC §2 "First start"): stamped on every reply
    /// with the reservation records made so far, and checked against what
    /// requesters present. `None`: no check (a regional allocator, one
    /// with `--etcd`, a test core).
    pub runs: Option<Runs>,
    /// The cluster this allocator serves (`--cluster`; "" when not set:
    /// every requester is taken for one of its own). A requester that
    /// presents another cluster is refused before anything else is looked
    /// at, so it never makes this allocator take its ledger for lost.
    pub cluster: String,
}

/// A ledger's runs, as its state directory records them: each start of a
/// global allocator draws a new run id, and the run before it is kept with
/// how many of its reservation records were durable when it ended (SPEC §2
/// "First start"). A requester presents the newest (run, record sequence)
/// a reply carried; a run missing here, or a sequence beyond what is
/// recorded for it, means this allocator started from an older copy of its
/// state than the one that served the requester.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Runs {
    /// This start's run id (never 0).
    pub current: u64,
    /// Earlier runs of this ledger: (run id, its durable records).
    pub past: Vec<(u64, u64)>,
}

impl Runs {
    /// Whether a requester that saw `record_seq` records of run `run` may
    /// have seen this ledger's state as it is here; `current_seq`: this
    /// run's records so far.
    pub fn knows(&self, run: u64, record_seq: u64, current_seq: u64) -> bool {
        if run == self.current {
            return record_seq <= current_seq;
        }
        self.past
            .iter()
            .any(|&(r, last)| r == run && record_seq <= last)
    }
}

/// Repeated warnings (refused clusters, another live ledger) are logged
/// at most this often.
const LOG_EVERY_NS: u64 = 10_000_000_000;

/// The largest `TTL_max` an allocator accepts (`--ttl-max`): how long a
/// lost ledger's leases may still be out, whatever it was run with.
pub const TTL_MAX_CAP_NS: u64 = 60_000_000_000;

// A permit lives on one slot lease: the longest `permit_ttl` a rule file
// may give stays within the cap (SPEC §4).
const _: () = assert!(quotalease_model::rules::MAX_PERMIT_TTL_MS * 1_000_000 <= TTL_MAX_CAP_NS);

impl Default for CoreConfig {
    fn default() -> Self {
        Self {
            ttl_max_ns: 2_000_000_000,
            epsilon_ns: 10_000_000,
            reply_cache: 64,
            active_window_ns: 1_000_000_000,
            holder_idle_ns: 3_600_000_000_000,
            no_predecessor: false,
            slot_leases_may_be_out: false,
            resume_slot_leases: false,
            predecessor_ttl_max_ns: 0,
            first_start_grace_ns: 0,
            ledger_id: 0,
            new_ledger: false,
            reservations: false,
            shard: (0, 1),
            runs: None,
            cluster: String::new(),
        }
    }
}

impl CoreConfig {
    /// How long after start an allocator must treat every key as fully
    /// leased out: `TTL_max * (1 + 2 rho) + epsilon`.
    pub fn restart_wait_ns(&self) -> u64 {
        let ttl = self.ttl_max_ns.max(self.predecessor_ttl_max_ns);
        ttl + drift_margin_ns(ttl) + 1 + self.epsilon_ns
    }
}

#[derive(Debug)]
struct Holder {
    id: HolderId,
    incarnation: u64,
    /// Cached replies by seq, each with the digest of the request it
    /// answered; encoded (a fifth of the memory of the decoded message: a
    /// regional's batch renews thousands of keys, and each holder keeps
    /// `reply_cache` of them; decoded again only for a duplicate).
    replies: BTreeMap<u64, (u64, Vec<u8>)>,
    /// Every seq at or below this that is not cached is stale.
    floor: u64,
    rules_version: u64,
    last_seen_ns: u64,
}

/// Counters exported as metrics.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    /// Lease batches handled (duplicates included).
    pub messages: u64,
    /// Items in those batches.
    pub items: u64,
    /// Batches answered from the reply cache.
    pub duplicates: u64,
    /// Batches answered `STALE`.
    pub stale: u64,
    /// Batches that repeated a sequence number with other content
    /// (refused `SEQ_CONFLICT`, never answered from the cache).
    pub seq_conflicts: u64,
    /// Leases granted (with new tokens).
    pub grants: u64,
    /// New tokens leased out.
    pub tokens_granted: u64,
    /// New versions of leases that carry a rate.
    pub rate_grants: u64,
    /// Tokens carried from renewed leases.
    pub tokens_carried: u64,
    /// Tokens holders of rate leases handed back of a shrink (a RENEW's
    /// `left`, docs/protocol.md "A shrink hands back").
    pub tokens_handed_back: u64,
    /// Releases applied.
    pub releases: u64,
    /// Tokens returned by releases.
    pub tokens_released: u64,
    /// Per rule: grants the shadow bucket says would break I1.
    pub shadow_violations: BTreeMap<String, u64>,
    /// Items refused because of a rule's `max_keys`.
    pub key_limit_refusals: u64,
    /// Keys dropped because they were full and idle.
    pub keys_dropped: u64,
    /// Times a requester named another ledger (this one's state was lost).
    pub ledgers_lost: u64,
    /// Batches refused because they came from another cluster.
    pub wrong_cluster: u64,
    /// Batches naming another ledger (or a run of this one its state
    /// lacks) already taken for lost: another live allocator serves the
    /// same requesters (SPEC §2 "First start": never tolerated silently).
    pub foreign_sightings: u64,
    /// When the last of those was seen (0: never).
    pub foreign_seen_ns: u64,
    /// Tokens of leases that expired unspent (as far as reported).
    pub tokens_expired_unused: u64,
    /// Slot leases granted with fresh slots.
    pub slot_grants: u64,
    /// Fresh slots lent.
    pub slots_granted: u64,
    /// Slot leases given back.
    pub slot_releases: u64,
    /// Children's slot asks naming a predecessor's lease answered
    /// `RESUMING` (a regional's pool before its chain's resume).
    pub slot_resume_waits: u64,
    /// Permit releases forwarded to their holder (PERMIT_RELEASE items
    /// queued for it; handed over in its next reply).
    pub forwarded_releases: u64,
    /// PERMIT_RELEASE items naming no holder of the requester's
    /// principal here.
    pub forwarded_unknown: u64,
    /// Slot leases an operator freed ([`AllocatorCore::force_release_slots`]).
    pub slot_force_releases: u64,
}

/// A read-only view of one key's ledger (for `GET /v1/keys`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyView {
    /// Tokens available.
    pub available: u64,
    /// Tokens outstanding in unexpired leases.
    pub outstanding: u64,
    /// Burst.
    pub burst: u64,
    /// Leases: (holder name, lease).
    pub holders: Vec<(HolderName, Lease)>,
}

/// Who holds a lease (SPEC §8): the principal of the requester's client
/// certificate (empty without TLS), the agent id and the per-process
/// instance nonce it sent (0 from protocol-1 agents, regional allocators in
/// tests, and the phantom of a predecessor). A requester acts only on the
/// leases of the holders its own principal names.
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HolderName {
    /// The TLS principal ("" without TLS).
    pub principal: String,
    /// The agent id (`--agent-id`, `region/NAME`, or "(predecessor)").
    pub agent_id: String,
    /// The instance nonce.
    pub instance: u64,
}

/// The allocator's state machine.
#[derive(Debug)]
pub struct AllocatorCore {
    cfg: CoreConfig,
    epoch: u64,
    /// None: no predecessor, buckets start full.
    ready_at_ns: Option<u64>,
    rules: RuleSet,
    /// Versions published during this process, oldest first (for lag).
    versions: Vec<u64>,
    keys: HashMap<KeyId, Box<KeyLedger>>,
    keys_per_rule: HashMap<String, u64>,
    /// By (principal, agent id, per-process instance nonce).
    holders: HashMap<HolderName, Holder>,
    holder_names: HashMap<HolderId, HolderName>,
    next_lease_id: u64,
    next_holder: HolderId,
    stats: Stats,
    /// `Some` for the child-facing core of a regional allocator: ledgers
    /// are pooled (fed by parent leases), see [`AllocatorCore::new_pooled`].
    pooled: Option<PooledMode>,
    /// Pooled mode: keys created since the last `take_new_keys`.
    new_keys: Vec<KeyId>,
    /// Pooled mode: keys a child's item named since the last
    /// `take_touched_keys` (each once: see `KeyLedger::touched`).
    touched_keys: Vec<KeyId>,
    /// The sweep's queue: when each key with a ledger is looked at next
    /// (one live entry per ledger, the one matching its `sweep_due_ns`;
    /// others are stale and skipped). A sweep visits only keys that are
    /// due, in bounded steps, never every key.
    sweep_due: std::collections::BinaryHeap<std::cmp::Reverse<(u64, KeyId)>>,
    /// Other ledgers' ids requesters named (each makes the core wait once).
    foreign_ledgers: Vec<u64>,
    /// Runs of this ledger requesters named that its state lacks (each
    /// makes the core wait once).
    foreign_runs: Vec<u64>,
    /// When a refusal of another cluster's requester was last logged.
    wrong_cluster_logged_ns: u64,
    /// When a sighting of another live ledger was last logged.
    foreign_logged_ns: u64,
    /// Checkpointed for a clean shutdown: nothing more is granted.
    closed: bool,
    /// A new ledger's first-start grace ends here (see
    /// `CoreConfig::first_start_grace_ns`).
    grace_until_ns: u64,
    /// Write-ahead reservations (global allocators with a state directory).
    reservations: Option<Reservations>,
    /// The slot ledgers of the keys of rules with `concurrency`
    /// (docs/permits.md).
    slot_keys: HashMap<KeyId, crate::slots::SlotLedger>,
    /// Slot ledgers per rule id (for `max_keys`).
    slot_keys_per_rule: HashMap<String, u64>,
    /// Pooled mode: concurrency keys opened since the regional last looked.
    new_slot_keys: Vec<KeyId>,
    /// Until when a new slot ledger's phantom holds all its slots: every
    /// slot lease a predecessor could have granted has expired then
    /// (`restart_wait_ns` after the start; slot ledgers are neither
    /// checkpointed nor reserved). `None`: no predecessor.
    slots_phantom_until_ns: Option<u64>,
    /// (lease id base, start instant): the wall clock the fencing numbers
    /// of new slot ledgers start from ([`slot_items`]).
    fence_clock: (u64, u64),
    /// Permit releases forwarded to each holder, handed over in its next
    /// reply ([`slot_items`]); at most [`MAX_FORWARDED`] per holder.
    forwarded: HashMap<HolderId, Vec<quotalease_proto::lease::ForwardedRelease>>,
}

/// The most permit releases waiting for one holder's next reply: beyond
/// it a forwarded release is refused (the permit frees at its expiry).
pub const MAX_FORWARDED: usize = 10_000;

/// State of a core in pooled mode (regional allocator).
#[derive(Clone, Copy, Debug, Default)]
struct PooledMode {
    /// Stamped on every grant (SPEC §2 I3).
    parent_unreachable: bool,
}

impl AllocatorCore {
    /// A core starting at `now_ns`. `epoch` must grow across restarts (the
    /// driver uses wall-clock milliseconds at start); lease ids start at
    /// `lease_id_base`, which must exceed every id a predecessor issued
    /// (the driver uses wall-clock nanoseconds at start).
    pub fn new(
        cfg: CoreConfig,
        rules: RuleSet,
        epoch: u64,
        lease_id_base: u64,
        now_ns: u64,
    ) -> Self {
        let grace_until_ns = match cfg.first_start_grace_ns {
            0 => 0,
            g => now_ns.saturating_add(g),
        };
        let ready_at_ns = if cfg.no_predecessor {
            None
        } else {
            Some(now_ns.saturating_add(cfg.restart_wait_ns()))
        };
        let cfg_reservations = cfg.reservations;
        // Slot ledgers have no durable state: while a predecessor's slot
        // leases may be out, and through a start's grace, a new slot
        // ledger's phantom holds all its slots.
        let slot_wait = (!cfg.no_predecessor || cfg.slot_leases_may_be_out)
            .then(|| now_ns.saturating_add(cfg.restart_wait_ns()));
        let slot_grace = (grace_until_ns > 0).then_some(grace_until_ns);
        let slots_phantom_until_ns = slot_wait.max(slot_grace);
        Self {
            versions: vec![rules.version],
            cfg,
            epoch,
            ready_at_ns,
            rules,
            keys: HashMap::default(),
            keys_per_rule: HashMap::default(),
            holders: HashMap::default(),
            holder_names: HashMap::default(),
            next_lease_id: lease_id_base.max(1),
            next_holder: 0,
            stats: Stats::default(),
            pooled: None,
            new_keys: Vec::new(),
            touched_keys: Vec::new(),
            sweep_due: Default::default(),
            foreign_ledgers: Vec::new(),
            foreign_runs: Vec::new(),
            wrong_cluster_logged_ns: 0,
            foreign_logged_ns: 0,
            closed: false,
            grace_until_ns,
            reservations: cfg_reservations.then(Reservations::default),
            slot_keys: HashMap::default(),
            slot_keys_per_rule: HashMap::default(),
            new_slot_keys: Vec::new(),
            slots_phantom_until_ns,
            fence_clock: (lease_id_base, now_ns),
            forwarded: HashMap::default(),
        }
    }

    /// The child-facing core of a regional allocator: every key's ledger is
    /// *pooled* ([`KeyLedger::new_pooled`]): it does not refill, it holds
    /// what the regional deposits from parent leases, and its leases expire
    /// no later than the pool's deadline. There is no start-up wait
    /// (`cfg.no_predecessor` is ignored): everything a pooled ledger grants
    /// is backed by a parent lease the parent still counts, so whatever a
    /// predecessor sub-leased is covered by the predecessor's parent leases.
    pub fn new_pooled(
        cfg: CoreConfig,
        rules: RuleSet,
        epoch: u64,
        lease_id_base: u64,
        now_ns: u64,
    ) -> Self {
        let mut c = Self::new(cfg, rules, epoch, lease_id_base, now_ns);
        c.ready_at_ns = None;
        c.pooled = Some(PooledMode::default());
        // A regional keeps no state: its parent counts what it holds.
        c.reservations = None;
        c
    }

    /// True for the child-facing core of a regional allocator.
    pub fn is_pooled(&self) -> bool {
        self.pooled.is_some()
    }

    /// Pooled mode: stamp `parent_unreachable` on grants from now on.
    pub fn set_parent_unreachable(&mut self, unreachable: bool) {
        if let Some(p) = self.pooled.as_mut() {
            p.parent_unreachable = unreachable;
        }
    }

    /// The ledger of `key`, if any (the regional allocator feeds pooled
    /// ledgers through this).
    pub fn ledger_mut(&mut self, key: &KeyId) -> Option<&mut KeyLedger> {
        self.keys.get_mut(key).map(|l| &mut **l)
    }

    /// Every key with a ledger, sorted (deterministic iteration).
    pub fn key_ids(&self) -> Vec<KeyId> {
        let mut v: Vec<KeyId> = self.keys.keys().cloned().collect();
        v.sort();
        v
    }

    /// Pooled mode: the keys children created since the last call.
    pub fn take_new_keys(&mut self) -> Vec<KeyId> {
        std::mem::take(&mut self.new_keys)
    }

    /// Pooled mode: the keys a child's item named since the last call
    /// (renewals, openings and releases; each key once until
    /// [`AllocatorCore::untouch`] is called for it). The regional's planner
    /// visits them at its next walk; the others only when they are due.
    /// [`KeyLedger::untouch`] lists a key again at the next item naming it.
    pub fn take_touched_keys(&mut self) -> Vec<KeyId> {
        std::mem::take(&mut self.touched_keys)
    }

    /// Pooled mode: list `key` as touched by a child (once).
    pub(super) fn touch(
        pooled: bool,
        touched: &mut Vec<KeyId>,
        key: &KeyId,
        ledger: &mut KeyLedger,
    ) {
        if pooled && !ledger.touched {
            ledger.touched = true;
            touched.push(key.clone());
        }
    }

    /// Put `ledger` in place for `key` (a new chain of parent leases); the
    /// key counts against its rule's `max_keys` as before.
    pub fn replace_ledger(&mut self, key: &KeyId, ledger: KeyLedger) {
        if self.keys.insert(key.clone(), Box::new(ledger)).is_none() {
            *self
                .keys_per_rule
                .entry(key.rule().to_string())
                .or_insert(0) += 1;
        }
    }

    /// Forget `key` (a pooled key that holds nothing and is idle).
    pub fn remove_key(&mut self, key: &KeyId) {
        if self.keys.remove(key).is_some() {
            self.stats.keys_dropped += 1;
            if let Some(c) = self.keys_per_rule.get_mut(key.rule()) {
                *c = c.saturating_sub(1);
            }
        }
    }

    /// The configuration.
    pub fn config(&self) -> &CoreConfig {
        &self.cfg
    }

    /// The epoch stamped on every reply.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// When the start's grace ends (0: none; see
    /// `CoreConfig::first_start_grace_ns`).
    pub fn grace_until_ns(&self) -> u64 {
        self.grace_until_ns
    }

    /// Instant from which this allocator hands out tokens: after its
    /// start's grace and any restart wait.
    pub fn ready_at_ns(&self) -> u64 {
        self.ready_at_ns.unwrap_or(0).max(self.grace_until_ns)
    }

    /// The rules in force.
    pub fn rules(&self) -> &RuleSet {
        &self.rules
    }

    /// Counters.
    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// Number of keys with a ledger.
    pub fn key_count(&self) -> usize {
        self.keys.len()
    }

    /// Replace the rules at `now_ns`. Rate and burst changes apply to
    /// existing ledgers without resetting them; ledgers of removed rules
    /// stay until their leases expire and they are full.
    pub fn set_rules(&mut self, rules: RuleSet, now_ns: u64) {
        for (key, ledger) in self.keys.iter_mut() {
            if let Some(rule) = rules.get(key.rule()) {
                ledger.set_limits(rule.rate, rule.burst, now_ns);
                if let Some(r) = &mut self.reservations {
                    // A lowered burst clamps `available`: keep the promise
                    // below it (tokens were destroyed, none granted, so
                    // nothing waits for this record).
                    r.after_grant(
                        key,
                        ledger.available(),
                        ledger.rates_out_utps(),
                        rule.rate,
                        rule.burst,
                    );
                }
            }
        }
        // A regional's pools lend what their parent leases hold, not `N`.
        let pooled = self.pooled.is_some();
        for (key, ledger) in self.slot_keys.iter_mut().filter(|_| !pooled) {
            if let Some(rule) = rules.permit_rule(key.rule()) {
                // Kept slots stay: I4 against max(N_old, N_new) until the
                // old permits are gone.
                ledger.set_n(rule.concurrency);
            }
        }
        self.versions.push(rules.version);
        self.rules = rules;
    }

    /// How many published versions each agent id is behind (the most over
    /// its instances).
    pub fn rule_lag(&self) -> Vec<(String, u64)> {
        let mut by_id: BTreeMap<&str, u64> = BTreeMap::new();
        for (HolderName { agent_id, .. }, h) in &self.holders {
            let lag = self
                .versions
                .iter()
                .filter(|v| **v > h.rules_version)
                .count() as u64;
            let e = by_id.entry(agent_id).or_default();
            *e = (*e).max(lag);
        }
        by_id
            .into_iter()
            .map(|(id, lag)| (id.to_string(), lag))
            .collect()
    }

    /// Handle one batch at `now_ns` from a requester without TLS.
    pub fn handle(&mut self, now_ns: u64, batch: &LeaseBatch) -> LeaseReply {
        self.handle_from(now_ns, batch, "")
    }

    /// Handle one batch at `now_ns` from a requester whose client
    /// certificate names `principal` ("" without TLS): its holders are
    /// those of that principal only, so no requester can renew, report or
    /// release another principal's leases, whatever agent id and instance
    /// it sends.
    pub fn handle_from(&mut self, now_ns: u64, batch: &LeaseBatch, principal: &str) -> LeaseReply {
        let mut reply = self.handle_batch(now_ns, batch, principal);
        reply.ledger_id = self.cfg.ledger_id;
        reply.cluster.clone_from(&self.cfg.cluster);
        if let Some(runs) = &self.cfg.runs {
            // The driver sends the reply once this many records are
            // durable: a requester never sees a sequence a crash can lose.
            reply.run_id = runs.current;
            reply.record_seq = self.reservation_seq();
        }
        reply
    }

    /// The ledger of one key at `now_ns`; `None` means a full bucket that
    /// nobody holds.
    pub fn key_view(&mut self, now_ns: u64, key: &KeyId) -> Option<KeyView> {
        let ledger = self.keys.get_mut(key)?;
        ledger.advance(now_ns);
        let holders = ledger
            .leases()
            .iter()
            .map(|l| {
                let name = if l.holder == PHANTOM {
                    HolderName {
                        agent_id: "(predecessor)".into(),
                        ..HolderName::default()
                    }
                } else {
                    self.holder_names
                        .get(&l.holder)
                        .cloned()
                        .unwrap_or_else(|| HolderName {
                            agent_id: format!("holder-{}", l.holder),
                            ..HolderName::default()
                        })
                };
                (name, l.clone())
            })
            .collect();
        Some(KeyView {
            available: ledger.available(),
            outstanding: ledger.outstanding(),
            burst: ledger.burst(),
            holders,
        })
    }

    /// I2 for one key at `now_ns` (`None`: no ledger, a full bucket). For
    /// checkers such as the simulator's.
    pub fn i2_holds(&mut self, now_ns: u64, key: &KeyId) -> Option<bool> {
        let ledger = self.keys.get_mut(key)?;
        ledger.advance(now_ns);
        Some(ledger.i2_holds())
    }

    /// The rule set as sent on the wire.
    pub fn rules_proto(&self) -> PbRuleSet {
        self.rules.to_proto()
    }
}

fn key_part_ok(pattern: &Pattern, value: &str) -> Result<(), String> {
    if value.len() > MAX_ID_BYTES {
        return Err(format!("{} bytes, at most {MAX_ID_BYTES}", value.len()));
    }
    match pattern {
        Pattern::Any if value.is_empty() => Ok(()),
        Pattern::Any => Err("must be empty: the rule does not key on it".into()),
        Pattern::PerValue if value.is_empty() => Err("must not be empty".into()),
        Pattern::PerValue => Ok(()),
        Pattern::Exact(s) if s == value => Ok(()),
        Pattern::Exact(s) => Err(format!("must be {s:?} for this rule")),
    }
}

#[cfg(test)]
mod tests;

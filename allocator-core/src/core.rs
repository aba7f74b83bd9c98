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
//! `core/runs.rs` holds what requesters present of the ledger and run
//! that served them, and what a lost or older state costs.

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

mod runs;

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

impl Default for CoreConfig {
    fn default() -> Self {
        Self {
            ttl_max_ns: 2_000_000_000,
            epsilon_ns: 10_000_000,
            reply_cache: 64,
            active_window_ns: 1_000_000_000,
            holder_idle_ns: 3_600_000_000_000,
            no_predecessor: false,
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
    /// answered.
    replies: BTreeMap<u64, (u64, LeaseReply)>,
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
    keys: HashMap<KeyId, KeyLedger>,
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
}

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
            sweep_due: Default::default(),
            foreign_ledgers: Vec::new(),
            foreign_runs: Vec::new(),
            wrong_cluster_logged_ns: 0,
            foreign_logged_ns: 0,
            closed: false,
            grace_until_ns,
            reservations: cfg_reservations.then(Reservations::default),
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
        self.keys.get_mut(key)
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

    /// Put `ledger` in place for `key` (a new chain of parent leases); the
    /// key counts against its rule's `max_keys` as before.
    pub fn replace_ledger(&mut self, key: &KeyId, ledger: KeyLedger) {
        if self.keys.insert(key.clone(), ledger).is_none() {
            *self.keys_per_rule.entry(key.rule.clone()).or_insert(0) += 1;
        }
    }

    /// Forget `key` (a pooled key that holds nothing and is idle).
    pub fn remove_key(&mut self, key: &KeyId) {
        if self.keys.remove(key).is_some() {
            self.stats.keys_dropped += 1;
            if let Some(c) = self.keys_per_rule.get_mut(&key.rule) {
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
            if let Some(rule) = rules.get(&key.rule) {
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

    /// A clean shutdown at `now_ns`: every key's checkpoint, and from now
    /// on nothing is granted (every batch is answered "unavailable"), so
    /// the checkpoint stays the whole truth.
    pub fn checkpoint_and_close(&mut self, now_ns: u64) -> Vec<(KeyId, KeyCheckpoint)> {
        self.closed = true;
        let mut out: Vec<(KeyId, KeyCheckpoint)> = self
            .keys
            .iter_mut()
            .map(|(k, l)| (k.clone(), l.checkpoint(now_ns)))
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Resume keys from a clean shutdown's checkpoint at `now_ns`
    /// ([`KeyLedger::resume`]); keys of rules that no longer exist are
    /// dropped. Keys not in it start full: the shutdown recorded every key
    /// it had, and a key it did not have was full.
    pub fn resume_keys(&mut self, now_ns: u64, keys: Vec<(KeyId, KeyCheckpoint)>) {
        for (key, cp) in keys {
            let Some(rule) = self.rules.get(&key.rule) else {
                continue;
            };
            let margin = drift_margin_ns(cp.leases_end_in_ns) + 1 + self.cfg.epsilon_ns;
            let mut ledger = KeyLedger::resume(rule.rate, rule.burst, now_ns, &cp, margin);
            *self.keys_per_rule.entry(key.rule.clone()).or_insert(0) += 1;
            ledger.sweep_due_ns = now_ns
                .saturating_add(cp.leases_end_in_ns)
                .saturating_add(margin)
                .max(1);
            self.sweep_due
                .push(std::cmp::Reverse((ledger.sweep_due_ns, key.clone())));
            self.keys.insert(key, ledger);
        }
    }

    /// Resume after a crash from the durable reservations (SPEC §2
    /// "Restarts", [`crate::reservations`]) at `now_ns`: each recorded key
    /// at its floor, the rest of its burst one phantom lease lending its
    /// rate cap until the longest lease the predecessor could have granted
    /// has expired (`restart_wait_ns`); keys without a record start full.
    /// Call [`AllocatorCore::reserve_current_keys`] before serving.
    pub fn resume_reserved(&mut self, now_ns: u64, records: Vec<(KeyId, Reservation)>) {
        let ttl = self.cfg.ttl_max_ns.max(self.cfg.predecessor_ttl_max_ns);
        let keys = records
            .iter()
            .filter_map(|(key, r)| {
                let rule = self.rules.get(&key.rule)?;
                let floor = r.floor.min(rule.burst);
                Some((
                    key.clone(),
                    KeyCheckpoint {
                        available: floor,
                        outstanding: rule.burst - floor,
                        rates_out_utps: r.rate_cap_utps,
                        leases_end_in_ns: ttl,
                    },
                ))
            })
            .collect();
        self.resume_keys(now_ns, keys);
    }

    /// Make every key's state at `now_ns` its promise (after a resume: a
    /// resumed key's `available` and the rate it lends are exact, and must
    /// be promised before anything is granted, or a crash would take it for
    /// a key at rest). Returns the promises, for a fresh log.
    pub fn reserve_current_keys(&mut self, now_ns: u64) -> Vec<(KeyId, Reservation)> {
        if self.reservations.is_none() {
            return Vec::new();
        }
        let mut all: Vec<(KeyId, Reservation)> = self
            .keys
            .iter_mut()
            .map(|(k, l)| {
                l.advance(now_ns);
                (
                    k.clone(),
                    Reservation {
                        floor: l.available(),
                        rate_cap_utps: l.rates_out_utps(),
                    },
                )
            })
            .collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        self.reservations = Some(Reservations::restored(all.iter().cloned()));
        all
    }

    /// The write-ahead reservations, if this core keeps them.
    pub fn reservations_mut(&mut self) -> Option<&mut Reservations> {
        self.reservations.as_mut()
    }

    /// Records appended to the reservation log so far (0 without one): a
    /// reply may be sent once the driver has made this many durable.
    pub fn reservation_seq(&self) -> u64 {
        self.reservations.as_ref().map_or(0, Reservations::seq)
    }

    fn handle_batch(&mut self, now_ns: u64, batch: &LeaseBatch, principal: &str) -> LeaseReply {
        self.stats.messages += 1;
        self.stats.items += batch.items.len() as u64;
        let Some(header) = batch.header.as_ref() else {
            return self.refuse(batch, 0, GrantStatus::BadItem, "header: missing");
        };
        if self.closed {
            return self.refuse(
                batch,
                header.seq,
                GrantStatus::Stale,
                "allocator shutting down: nothing applied",
            );
        }
        let seq = header.seq;
        if header.agent_id.is_empty() || header.agent_id.len() > MAX_ID_BYTES {
            return self.refuse(
                batch,
                seq,
                GrantStatus::BadItem,
                "header.agent_id: must be 1..=256 bytes",
            );
        }
        if header.protocol_version.abs_diff(PROTOCOL_VERSION) > 1 {
            return self.refuse(
                batch,
                seq,
                GrantStatus::Unsupported,
                "header.protocol_version: unsupported",
            );
        }
        if !self.cfg.cluster.is_empty() && header.cluster != self.cfg.cluster {
            // Another cluster's agent (staging pointed at production, a
            // blue/green switch): refused whole, before its ledger id is
            // looked at.
            self.stats.wrong_cluster += 1;
            let theirs = match header.cluster.as_str() {
                "" => "no cluster (start it with --cluster)".to_string(),
                c => format!("cluster {c:?}"),
            };
            let why = format!(
                "header.cluster: this allocator serves cluster {:?}; the requester is of {theirs}",
                self.cfg.cluster
            );
            if now_ns >= self.wrong_cluster_logged_ns.saturating_add(LOG_EVERY_NS) {
                self.wrong_cluster_logged_ns = now_ns;
                tracing::warn!(
                    agent = %header.agent_id,
                    principal,
                    refused = self.stats.wrong_cluster,
                    "{why}: refused (logged once every 10 s)"
                );
            }
            return self.refuse(batch, seq, GrantStatus::BadItem, &why);
        }
        self.check_presented(now_ns, batch, header);
        // Holder, incarnation and duplicate suppression.
        let digest = quotalease_proto::request_digest(batch);
        let holder_key = HolderName {
            principal: principal.to_owned(),
            agent_id: header.agent_id.clone(),
            instance: header.instance,
        };
        let holder = match self.holders.get_mut(&holder_key) {
            Some(h) => h,
            None => {
                let id = self.next_holder;
                self.next_holder = self.next_holder.wrapping_add(1);
                self.holder_names.insert(id, holder_key.clone());
                self.holders.entry(holder_key.clone()).or_insert(Holder {
                    id,
                    incarnation: header.incarnation,
                    replies: BTreeMap::new(),
                    floor: 0,
                    rules_version: 0,
                    last_seen_ns: now_ns,
                })
            }
        };
        if header.incarnation < holder.incarnation {
            self.stats.stale += 1;
            let current = holder.incarnation;
            let mut reply = self.refuse(
                batch,
                seq,
                GrantStatus::Stale,
                "header.incarnation: older than the holder's current one",
            );
            reply.holder_incarnation = current;
            return reply;
        }
        if header.incarnation > holder.incarnation {
            holder.incarnation = header.incarnation;
            holder.replies.clear();
            holder.floor = 0;
        }
        holder.last_seen_ns = holder.last_seen_ns.max(now_ns);
        holder.rules_version = holder.rules_version.max(header.rules_version);
        if let Some((cached_digest, cached)) = holder.replies.get(&seq) {
            if *cached_digest == digest {
                self.stats.duplicates += 1;
                return cached.clone();
            }
            // Same (agent, instance, incarnation, seq), other content: two
            // processes share an identity, or a requester reuses sequence
            // numbers. Answering from the cache would hand one lease to
            // two spenders (SPEC §2 "Messages").
            self.stats.seq_conflicts += 1;
            tracing::warn!(
                agent_id = %header.agent_id,
                instance = header.instance,
                incarnation = header.incarnation,
                seq,
                "lease request repeats a sequence number with other content; refused"
            );
            return self.refuse(
                batch,
                seq,
                GrantStatus::SeqConflict,
                "header.seq: repeated with other content",
            );
        }
        if seq <= holder.floor {
            self.stats.stale += 1;
            return self.refuse(
                batch,
                seq,
                GrantStatus::Stale,
                "header.seq: older than the duplicate window",
            );
        }
        let holder_id = holder.id;
        let ttl_ns = if batch.ttl_ms == 0 {
            self.cfg.ttl_max_ns
        } else {
            batch
                .ttl_ms
                .saturating_mul(1_000_000)
                .min(self.cfg.ttl_max_ns)
        };
        let grants = batch
            .items
            .iter()
            .map(|item| self.handle_item(now_ns, holder_id, item, ttl_ns))
            .collect();
        let reply = LeaseReply {
            seq,
            epoch: self.epoch,
            protocol_version: PROTOCOL_VERSION,
            holder_incarnation: header.incarnation,
            grants,
            rules: (header.rules_version < self.rules.version).then(|| self.rules.to_proto()),
            request_digest: digest,
            ledger_id: self.cfg.ledger_id,
            shard: self.cfg.shard.0,
            shard_count: self.cfg.shard.1,
            ..LeaseReply::default()
        };
        let cap = self.cfg.reply_cache.max(1);
        let holder = self
            .holders
            .get_mut(&holder_key)
            .expect("holder inserted above");
        holder.replies.insert(seq, (digest, reply.clone()));
        while holder.replies.len() > cap {
            let (old, _) = holder.replies.pop_first().expect("len > cap >= 1");
            holder.floor = holder.floor.max(old);
        }
        reply
    }

    fn refuse(&self, batch: &LeaseBatch, seq: u64, status: GrantStatus, why: &str) -> LeaseReply {
        LeaseReply {
            seq,
            epoch: self.epoch,
            protocol_version: PROTOCOL_VERSION,
            grants: batch
                .items
                .iter()
                .map(|_| Grant {
                    status: status as i32,
                    detail: why.to_string(),
                    ..Grant::default()
                })
                .collect(),
            rules: None,
            holder_incarnation: 0,
            // Refusals answer this request too: the requester matches them.
            request_digest: quotalease_proto::request_digest(batch),
            ledger_id: self.cfg.ledger_id,
            ..LeaseReply::default()
        }
    }

    fn handle_item(
        &mut self,
        now_ns: u64,
        holder: HolderId,
        item: &LeaseItem,
        ttl_ns: u64,
    ) -> Grant {
        let version = self.rules.version;
        let bad = |detail: String| Grant {
            status: GrantStatus::BadItem as i32,
            rule_version: version,
            detail,
            ..Grant::default()
        };
        let (shard, shards) = self.cfg.shard;
        if shards > 1
            && quotalease_proto::shard_of(&item.rule_id, &item.tenant, &item.route, shards) != shard
        {
            return Grant {
                status: GrantStatus::WrongShard as i32,
                rule_version: version,
                detail: format!("the key belongs to another shard than {shard} of {shards}"),
                ..Grant::default()
            };
        }
        let Some(rule) = self.rules.get(&item.rule_id) else {
            // A release for a rule that is gone still frees its lease.
            if item.kind == ItemKind::Release as i32 {
                return self.release(now_ns, holder, item);
            }
            return Grant {
                status: GrantStatus::UnknownRule as i32,
                rule_version: version,
                detail: format!("rule_id: unknown rule {:?}", item.rule_id),
                ..Grant::default()
            };
        };
        if let Err(why) = key_part_ok(&rule.tenant, &item.tenant) {
            return bad(format!("tenant: {why}"));
        }
        if let Err(why) = key_part_ok(&rule.route, &item.route) {
            return bad(format!("route: {why}"));
        }
        let kind = ItemKind::try_from(item.kind);
        match kind {
            Ok(ItemKind::Release) => self.release(now_ns, holder, item),
            Ok(ItemKind::Renew) => self.renew(now_ns, holder, item, ttl_ns),
            Err(_) => bad(format!("kind: unknown value {}", item.kind)),
        }
    }

    fn key_of(item: &LeaseItem) -> KeyId {
        KeyId {
            rule: item.rule_id.clone(),
            tenant: item.tenant.clone(),
            route: item.route.clone(),
        }
    }

    fn release(&mut self, now_ns: u64, holder: HolderId, item: &LeaseItem) -> Grant {
        let key = Self::key_of(item);
        if let Some(ledger) = self.keys.get_mut(&key) {
            if let Some(rest) =
                ledger.release_with(now_ns, holder, item.lease_id, item.spent, item.left)
            {
                self.stats.releases += 1;
                self.stats.tokens_released += rest;
            }
        }
        Grant {
            status: GrantStatus::Released as i32,
            rule_version: self.rules.version,
            ..Grant::default()
        }
    }

    fn renew(&mut self, now_ns: u64, holder: HolderId, item: &LeaseItem, ttl_ns: u64) -> Grant {
        if now_ns < self.grace_until_ns {
            // A new ledger's grace: nothing yet, come back when it ends.
            return Grant {
                status: GrantStatus::Granted as i32,
                rule_version: self.rules.version,
                retry_after_ms: (self.grace_until_ns - now_ns).div_ceil(1_000_000),
                starting: true,
                ..Grant::default()
            };
        }
        let rule: &Rule = self
            .rules
            .get(&item.rule_id)
            .expect("renew is only called for a known rule");
        let (rate, burst, max_keys) = (rule.rate, rule.burst, rule.max_keys);
        let version = self.rules.version;
        let key = Self::key_of(item);
        if !self.keys.contains_key(&key) {
            let count = self.keys_per_rule.get(&item.rule_id).copied().unwrap_or(0);
            if max_keys.is_some_and(|m| count >= m) {
                self.stats.key_limit_refusals += 1;
                return Grant {
                    status: GrantStatus::KeyLimit as i32,
                    rule_version: version,
                    detail: format!("rule {}: max_keys {} reached", item.rule_id, count),
                    ..Grant::default()
                };
            }
            *self.keys_per_rule.entry(item.rule_id.clone()).or_insert(0) += 1;
            let ledger = if self.pooled.is_some() {
                KeyLedger::new_pooled(rate, burst, now_ns)
            } else {
                KeyLedger::new(rate, burst, now_ns, self.ready_at_ns)
            };
            if self.pooled.is_some() {
                self.new_keys.push(key.clone());
            }
            self.keys.insert(key.clone(), ledger);
        }
        let ledger = self.keys.get_mut(&key).expect("inserted above");
        if ledger.sweep_due_ns == 0 {
            // Looked at no earlier than this lease can expire.
            ledger.sweep_due_ns = now_ns.saturating_add(ttl_ns).max(1);
            let due = std::cmp::Reverse((ledger.sweep_due_ns, key.clone()));
            self.sweep_due.push(due);
        }
        let mut ttl_ns = ttl_ns;
        let mut parent_unreachable = false;
        let mut opening = false;
        let mut fetch_retry_ms = u64::MAX;
        if let (Some(mode), Some(pool)) = (self.pooled, ledger.pool()) {
            // No parent lease yet, or the pool is short while the parent
            // has tokens: the regional is fetching, the child should wait.
            // A pool refilled by a rate lease fetches too while the parent
            // last said it has tokens beyond the region's lease (the
            // regional renews with a larger rate and capacity at once); a
            // key the parent has nothing more of (a hot key at its rate)
            // waits for its refill here, and the retry hint says when.
            opening = (pool.deadline_ns <= now_ns
                || (!pool.parent_dry && (pool.rate_utps == 0 || pool.parent_available > 0)))
                && !mode.parent_unreachable;
            // Fetching: come back when the parent's answer can be in (not
            // when the pool's own refill would have a token).
            fetch_retry_ms = pool.retry_ms.max(1);
            // A sub-lease never outlives the parent lease: whole
            // milliseconds up to the pool's deadline, and nothing new from
            // the pool when that is too short to be of use (the ledger
            // still records the want, which the regional passes upstream).
            parent_unreachable = mode.parent_unreachable;
            let left_ms = pool.deadline_ns.saturating_sub(now_ns) / 1_000_000;
            ttl_ns = ttl_ns.min(left_ms.saturating_mul(1_000_000));
            ledger.set_pool(PoolTerm::MinTtl(2 * self.cfg.epsilon_ns));
        }
        let new_id = self.next_lease_id;
        self.next_lease_id += 1;
        let g = ledger.renew(
            now_ns,
            Renewal {
                holder,
                lease_id: item.lease_id,
                spent: item.spent,
                want: item.want.min(burst),
                ttl_ns,
                new_id,
                want_rate_utps: item.want_rate_utps,
            },
            self.cfg.active_window_ns,
        );
        // What is left in the bucket beyond the leases, at the grant's
        // instant (the ledger is advanced to `now_ns` by the renewal): the
        // holder's estimate of the key's global remaining (SPEC §5). A
        // pooled ledger's is its pool's plus what the parent last
        // reported above the region's lease. Part of the reply, so a
        // duplicate gets the same figure.
        let bucket_available = ledger
            .available()
            .saturating_add(ledger.pool().map_or(0, |p| p.parent_available));
        if let Some(r) = &mut self.reservations {
            r.after_grant(
                &key,
                ledger.available(),
                ledger.rates_out_utps(),
                rate,
                burst,
            );
        }
        if g.shadow_violation {
            *self
                .stats
                .shadow_violations
                .entry(item.rule_id.clone())
                .or_insert(0) += 1;
            tracing::error!(rule = %item.rule_id, fresh = g.fresh, "shadow bucket: this grant would break I1");
        }
        if g.fresh > 0 {
            self.stats.grants += 1;
            self.stats.tokens_granted += g.fresh;
        }
        if g.capacity > 0 && g.lease_id != 0 {
            self.stats.rate_grants += 1;
        }
        self.stats.tokens_carried += g.carried;
        Grant {
            status: GrantStatus::Granted as i32,
            lease_id: g.lease_id,
            tokens: g.tokens,
            carried: g.carried,
            ttl_ms: ttl_ns / 1_000_000,
            rule_version: version,
            retry_after_ms: if opening && g.tokens == 0 {
                g.retry_after_ms.min(fetch_retry_ms)
            } else {
                g.retry_after_ms
            },
            parent_unreachable,
            detail: String::new(),
            holders: g.holders,
            opening: opening && g.tokens == 0,
            rate_utps: g.rate_utps,
            capacity: g.capacity,
            version_of: g.version_of,
            bucket_available,
            // Nothing because a restart's (or a lost state's) wait has not
            // ended: the key's phantom still counts the whole burst.
            starting: self.pooled.is_none()
                && g.lease_id == 0
                && self.ready_at_ns.is_some_and(|r| now_ns < r),
        }
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

    /// Housekeeping at `now_ns`, all of it (see [`AllocatorCore::sweep_step`]).
    pub fn sweep(&mut self, now_ns: u64) {
        while self.sweep_step(now_ns, usize::MAX) {}
    }

    /// One step of housekeeping at `now_ns`: look at up to `max_keys` keys
    /// that are due, collect their expired unspent tokens, drop those that
    /// are full with nothing outstanding (a missing key means a full
    /// bucket); on the last step, drop holders silent for
    /// `holder_idle_ns`. Returns whether keys are still due (call again:
    /// a driver releases its lock between steps, so a sweep over a million
    /// keys never holds up grants).
    pub fn sweep_step(&mut self, now_ns: u64, max_keys: usize) -> bool {
        let mut looked = 0;
        while let Some(std::cmp::Reverse((due, _))) = self.sweep_due.peek() {
            if *due > now_ns {
                break;
            }
            if looked == max_keys {
                return true;
            }
            let std::cmp::Reverse((due, key)) = self.sweep_due.pop().expect("peeked");
            let Some(ledger) = self.keys.get_mut(&key) else {
                continue;
            };
            if ledger.sweep_due_ns != due {
                continue; // stale: the ledger was replaced or re-queued
            }
            looked += 1;
            let full = ledger.is_full_and_idle(now_ns);
            self.stats.tokens_expired_unused += ledger.take_expired_unused();
            if full {
                self.keys.remove(&key);
                if let Some(r) = &mut self.reservations {
                    r.at_rest(&key);
                }
                self.stats.keys_dropped += 1;
                if let Some(c) = self.keys_per_rule.get_mut(&key.rule) {
                    *c = c.saturating_sub(1);
                }
                continue;
            }
            if let Some(r) = &mut self.reservations {
                ledger.advance(now_ns);
                r.raise(
                    &key,
                    ledger.available(),
                    ledger.rates_out_utps(),
                    ledger.rate(),
                    ledger.burst(),
                );
            }
            match ledger.next_sweep_ns(now_ns) {
                Some(at) => {
                    // Never sooner than a beat later: a key renewed all the
                    // time comes back once per lease, not once per sweep.
                    let at = at.max(now_ns.saturating_add(SWEEP_MIN_GAP_NS));
                    ledger.sweep_due_ns = at;
                    self.sweep_due.push(std::cmp::Reverse((at, key)));
                }
                None => ledger.sweep_due_ns = 0,
            }
        }
        let idle = self.cfg.holder_idle_ns;
        let names = &mut self.holder_names;
        self.holders.retain(|_, h| {
            let keep = h.last_seen_ns.saturating_add(idle) > now_ns;
            if !keep {
                names.remove(&h.id);
            }
            keep
        });
        false
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

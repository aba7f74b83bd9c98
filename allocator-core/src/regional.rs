//! The regional allocator, sans-IO: takes leases from a parent allocator and
//! sub-leases them to its children (agents) over the same Lease protocol.
//!
//! The child-facing side is an [`AllocatorCore`] in pooled mode
//! ([`AllocatorCore::new_pooled`]): the same duplicate suppression, holders,
//! rules and [`KeyLedger`]s as the global allocator, except that a ledger
//! does not refill at `R`; it holds what the current parent lease backs.
//!
//! Per key the regional keeps a *chain* (docs/protocol.md "Regional
//! allocators"): the parent lease id, `G` (tokens that lease holds), `E`
//! (its deadline on this clock, computed like an agent's: first send +
//! `TTL*(1-2rho) - epsilon`), and the pooled ledger. `H = available +
//! outstanding` of that ledger is what the regional still holds of `G`.
//!
//! * A renewal reports `spent = G - H` (never more than was consumed or
//!   destroyed), so the parent carries exactly `H`.
//! * A reply that carried our lease continues the chain: `G := carried +
//!   fresh`, the fresh part is deposited, `E` moves.
//! * A reply that did not carry it (lost reply, parent restart) breaks the
//!   chain: a new ledger starts with the fresh tokens; the old pool is
//!   destroyed, the old sub-leases stay valid at the children until their own
//!   expiry (<= the old `E`), backed by the old parent lease.
//! * Every sub-lease expires no later than `E`; at `E` a chain that was not
//!   renewed is dropped with its pool.
//!
//! Time is always an argument; what leaves is in sorted key order (plans
//! are sorted after a walk over the hashed keys), so outputs never depend
//! on hash order.

use std::cmp::Reverse;

/// Seeded per process; nothing depends on the iteration order.
type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::quality::RandomState>;
use std::collections::BinaryHeap;

use quotalease_proto::lease::{
    Grant, GrantStatus, ItemKind, LeaseBatch, LeaseItem, LeaseReply, RequestHeader,
};
use quotalease_proto::PROTOCOL_VERSION;

use quotalease_model::key::KeyId;
use quotalease_model::protocol::{slowed_by_rho, use_by_ns};
use quotalease_model::rules::RuleSet;

use crate::core::{AllocatorCore, CoreConfig, KeyView, Stats};
use crate::ledger::KeyLedger;

const MS: u64 = 1_000_000;
/// Send a heartbeat (an empty batch: liveness, rules) when nothing was sent
/// upstream for this long.
pub const HEARTBEAT_NS: u64 = 1_000 * MS;
/// The same while the regional holds a parent lease: its children's fail
/// policies follow its view of the parent, and pools refilled by rate
/// leases seldom ask, so without it a cut parent went unnoticed for up to
/// `HEARTBEAT_NS + fetch_timeout`.
pub const HEARTBEAT_HOLDING_NS: u64 = 250 * MS;
/// Shortest retry hint given to a child the pool cannot serve.
pub const MIN_CHILD_RETRY_MS: u64 = 5;
/// Time constant of the per-key consumption estimate.
const EWMA_TAU_S: f64 = 1.0;

/// A rate chain asks for this much more than its children consume, so a
/// region whose demand grows can grow its share.
const RATE_HEADROOM: f64 = 1.25;

/// Regional allocator configuration.
#[derive(Clone, Debug)]
pub struct RegionalConfig {
    /// Child-facing core configuration (`ttl_max_ns`: longest sub-lease;
    /// `no_predecessor` is ignored: a regional needs no start-up wait).
    pub core: CoreConfig,
    /// Region name; the regional talks to its parent as `region/<NAME>`.
    pub region: String,
    /// How often the upstream planner walks every key (plans that are not
    /// urgent go out only with a walk; urgent ones at once).
    pub renew_interval_ns: u64,
    /// Ask the parent ahead: when the pool covers less than this much of the
    /// children's consumption, and when the parent lease is this close to `E`.
    pub low_water_ns: u64,
    /// An upstream call without an answer for this long has failed; no
    /// success for this long (beyond the heartbeat) marks the parent
    /// unreachable.
    pub fetch_timeout_ns: u64,
    /// Lease TTL asked of the parent.
    pub lease_ttl_ns: u64,
    /// Clock granularity and stall allowance subtracted from `E`.
    pub epsilon_ns: u64,
    /// Per-process random nonce sent to the parent beside the
    /// `region/NAME` id (SPEC §8): two regional processes of one region
    /// never share leases or sequence numbers. The driver draws it.
    pub instance: u64,
    /// Ask the parent for leases that carry a rate (SPEC §2; protocol 3):
    /// each pool then refills here at its lease's rate, so small bursts are
    /// fully used however long spent reports take to reach the parent. A
    /// parent that grants none (protocol 2) gets leases of tokens as before.
    pub rate_leases: bool,
}

impl Default for RegionalConfig {
    fn default() -> Self {
        Self {
            core: CoreConfig::default(),
            region: "default".into(),
            renew_interval_ns: 50 * MS,
            low_water_ns: 500 * MS,
            fetch_timeout_ns: 500 * MS,
            lease_ttl_ns: 2_000 * MS,
            epsilon_ns: 50 * MS,
            instance: 0,
            rate_leases: true,
        }
    }
}

impl RegionalConfig {
    /// A chain's parent lease is released once no child asked for the key
    /// for this long and nothing is sub-leased: `2 * lease_ttl`.
    pub fn idle_release_ns(&self) -> u64 {
        self.lease_ttl_ns.saturating_mul(2)
    }
}

/// Upstream counters (the child-facing ones are [`RegionalCore::child_stats`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RegionalStats {
    /// Batches sent to the parent (heartbeats included).
    pub upstream_messages: u64,
    /// Items in those batches.
    pub upstream_items: u64,
    /// Of the batches, heartbeats (no items).
    pub upstream_heartbeats: u64,
    /// Replies applied.
    pub upstream_replies: u64,
    /// Batches that failed or timed out (or were answered STALE/UNSUPPORTED).
    pub upstream_failures: u64,
    /// Fresh tokens received from the parent.
    pub tokens_from_parent: u64,
    /// Tokens given back to the parent by releases (as sent).
    pub tokens_returned: u64,
    /// Pool tokens destroyed (chain break, lapse, backing shrank, shutdown).
    pub tokens_destroyed: u64,
    /// Chains that broke (the parent did not carry our lease).
    pub chain_breaks: u64,
    /// Chains dropped at their deadline without renewal.
    pub chains_lapsed: u64,
    /// Rule sets adopted from the parent.
    pub rules_adopted: u64,
    /// Replies ignored because they answer another request (digest).
    pub upstream_mismatched_replies: u64,
}

/// A key's chain of parent leases, as seen from outside (for `/v1/keys`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChainView {
    /// Current parent lease id.
    pub parent_lease_id: u64,
    /// Tokens the current parent lease holds (`G`).
    pub granted: u64,
    /// Deadline of the parent lease on this clock (`E`).
    pub deadline_ns: u64,
    /// A lease that carries a rate: its rate (micro-tokens per second, as
    /// granted) and capacity; 0 and 0 for a lease of tokens only.
    pub rate_utps: u64,
    /// See `rate_utps`.
    pub capacity: u64,
    /// What the parent counts for this chain: a bound on what the region
    /// holds of it (`G` for a lease of tokens; for a rate lease the larger
    /// capacity of the newest and the acknowledged version).
    pub backs: u64,
}

#[derive(Clone, Debug)]
struct Chain {
    serial: u64,
    /// The newest parent lease (version) applied.
    parent_lease_id: u64,
    /// A chain of tokens only: `G`. A rate chain: the tokens of the grant
    /// that opened it (informational).
    granted: u64,
    deadline_ns: u64,
    /// A rate chain (capacity > 0): the newest version's rate (as granted,
    /// micro-tokens per second) and capacity.
    rate_utps: u64,
    capacity: u64,
    /// A rate chain: the version the next renewal names (acknowledges),
    /// the newest one whose capacity what the region holds fits under;
    /// and that version's capacity. Until then the parent counts the
    /// larger of the versions in between (SPEC §2).
    ack_id: u64,
    ack_capacity: u64,
    /// The acknowledged version's deadline on this clock. While a newer
    /// version with a smaller capacity waits to be acknowledged, the pool
    /// grants (and carries) no sub-lease past it: by then every sub-lease
    /// made under the larger capacity has run out, so what the region
    /// holds fits under the newer one before the parent stops counting
    /// the older (at its own expiry, after this deadline).
    ack_deadline_ns: u64,
    /// The version the last renewal sent named.
    told_ack_id: u64,
    /// The largest capacity of the versions the parent may still count
    /// (those since `told_ack_id`): telling it a newer acknowledged version
    /// is worth a renewal of its own only when this is larger than what
    /// would be counted then (a shrink); every renewal names one anyway.
    counted_capacity: u64,
    /// The largest rate of the versions the parent may still count (as
    /// `counted_capacity`): the parent counts a holder's largest rate
    /// until the newest version is named, so a shrink of rate alone is
    /// worth a renewal too.
    counted_rate_utps: u64,
    /// A version since the one last told brought tokens: the parent counts
    /// those on top of its capacity until the version is named (unless they
    /// fit under it), so naming it is worth a renewal too.
    unnamed_tokens: bool,
}

impl Chain {
    fn is_rate(&self) -> bool {
        self.capacity > 0
    }

    /// What the parent counts for this chain (a bound on `H`).
    fn backing(&self) -> u64 {
        if self.is_rate() {
            self.capacity.max(self.ack_capacity)
        } else {
            self.granted
        }
    }
}

/// Give chain `c` of `key` its new deadline. Its entry in `due` moves on
/// when it comes due; only a deadline that came closer needs one now.
fn move_deadline(
    due: &mut BinaryHeap<Reverse<(u64, u64, KeyId)>>,
    c: &mut Chain,
    key: &KeyId,
    deadline: u64,
) {
    if deadline < c.deadline_ns {
        due.push(Reverse((deadline, c.serial, key.clone())));
    }
    c.deadline_ns = deadline;
}

/// `rate_utps` slowed by the drift margin (a refill on this clock).
fn slowed(rate_utps: u64) -> u64 {
    slowed_by_rho(rate_utps)
}

#[derive(Clone, Debug, Default)]
struct KeyState {
    chain: Option<Chain>,
    /// Children's consumption, tokens/s (EWMA over what left `H`).
    rate: f64,
    /// `H` at the last sample plus what was deposited since.
    sample_h: u64,
    sample_ns: u64,
    /// Do not ask the parent for more before this (its retry hint).
    retry_at_ns: u64,
    /// Holders the parent last said share this key (this region included;
    /// 0: not told yet).
    parent_holders: u32,
}

#[derive(Clone, Debug)]
struct SentItem {
    key: KeyId,
    release: bool,
    /// Serial of the chain the renewal named (None: a new chain was asked).
    chain_serial: Option<u64>,
    /// A renewal of a chain of leases of tokens: the rest it asked the
    /// parent to carry (`G - spent`); 0 otherwise.
    carry_asked: u64,
}

#[derive(Clone, Debug)]
struct InFlight {
    seq: u64,
    /// `request_digest` of the batch, to match the reply.
    digest: u64,
    /// The digest of the batch as a protocol-3 parent decodes it (without
    /// the protocol-4 fields, which it drops): its reply names that one.
    digest_v3: u64,
    /// The same for a protocol-2 parent (without the protocol-3 fields too).
    digest_v2: u64,
    sent_ns: u64,
    items: Vec<SentItem>,
}

/// The regional allocator's state machine.
#[derive(Debug)]
pub struct RegionalCore {
    cfg: RegionalConfig,
    core: AllocatorCore,
    agent_id: String,
    incarnation: u64,
    /// The parent's ledger id as its last reply said (presented upstream).
    parent_ledger_id: u64,
    /// Another ledger a child named: presented upstream once.
    child_ledger_id: u64,
    /// The newest run of the parent's ledger its replies carried and the
    /// largest record sequence of it (SPEC §2 "First start"): presented
    /// upstream, and passed on to the children.
    parent_run: (u64, u64),
    /// The run a child presented with `child_ledger_id` (the parent's
    /// ledger, when the child saw a run or sequence we have not).
    child_run: (u64, u64),
    /// The parent's cluster as its replies say, and the one a child
    /// presented with `child_ledger_id`.
    parent_cluster: String,
    child_ledger_cluster: String,
    /// The parent said it is starting until then (0: not lately).
    parent_starting_until_ns: u64,
    seq: u64,
    rules_known: bool,
    /// Per key (hashed: a look-up per child item must not cost a string
    /// comparison per tree level; whatever leaves in key order is sorted).
    keys: HashMap<KeyId, KeyState>,
    /// Keys a child found without tokens (or new) since the last walk over
    /// every key: within the throttle after a send, a poll plans only
    /// these (SPEC §9: a poll per dry pool must not cost a walk over all).
    wanting: Vec<KeyId>,
    /// An upstream failure since the last walk over every key: the next
    /// poll walks them all (reachability, and with it every pool's hints
    /// for children, may have changed).
    walk_all: bool,
    /// Reachability at the last walk over every key (a change walks all).
    walked_reachable: bool,
    /// When every key was last walked with the walk's plans free to go
    /// out. The walk comes once per renew interval whatever else is sent:
    /// urgent batches (openings, dry pools) must not keep it from coming,
    /// or a hot key's renewal ahead of its deadline is never planned and
    /// its chain runs out under its children (the demo's hot key got
    /// 55-65 % of its quota beside 300 cold tenants).
    last_walk_ns: Option<u64>,
    in_flight: Option<InFlight>,
    /// The parent said it is sharded (logged once).
    warned_sharded: bool,
    last_sent_ns: Option<u64>,
    not_before_ns: u64,
    started_ns: u64,
    last_success_ns: Option<u64>,
    last_failed: bool,
    reachable: bool,
    next_serial: u64,
    /// When chains come due, (deadline, chain serial, key; the serial orders
    /// equal deadlines without comparing keys): every chain has an entry no
    /// later than its deadline, so a poll lapses the chains now due without
    /// a walk over every key. An entry that comes due for a chain renewed
    /// since moves to its new deadline; one of a chain that ended is
    /// dropped.
    chain_deadlines: BinaryHeap<Reverse<(u64, u64, KeyId)>>,
    stopping: bool,
    /// Upstream round trip, EWMA (sizes the children's retry hints).
    rtt_ns: u64,
    stats: RegionalStats,
}

/// What the planner decided for one key.
enum Plan {
    Nothing,
    /// Ask for a new chain.
    Open {
        want: u64,
        want_rate: u64,
        urgent: bool,
    },
    /// Renew the chain's parent lease.
    Renew {
        want: u64,
        want_rate: u64,
        urgent: bool,
    },
    /// Give the chain's parent lease back (idle, nothing sub-leased).
    Release,
    /// Forget the key.
    Forget,
}

impl RegionalCore {
    /// A regional allocator starting at `now_ns`. `rules`: bootstrap rules
    /// (from `--rules`), or `None` to refuse child items until the parent's
    /// rules arrive. `incarnation` must grow across restarts (the driver
    /// uses wall-clock nanoseconds); it is also the epoch stamped on
    /// replies to children (in milliseconds). Sub-lease ids start at
    /// `lease_id_base`, which must exceed every id a predecessor issued.
    pub fn new(
        cfg: RegionalConfig,
        rules: Option<RuleSet>,
        incarnation: u64,
        lease_id_base: u64,
        now_ns: u64,
    ) -> Self {
        let rules_known = rules.is_some();
        // The core's epsilon sizes the shortest useful sub-lease (2 epsilon);
        // it has no restart wait to size in pooled mode.
        let core_cfg = CoreConfig {
            epsilon_ns: cfg.core.epsilon_ns.max(cfg.epsilon_ns),
            ..cfg.core.clone()
        };
        let core = AllocatorCore::new_pooled(
            core_cfg,
            rules.unwrap_or_default(),
            incarnation / MS,
            lease_id_base,
            now_ns,
        );
        Self {
            agent_id: format!("region/{}", cfg.region),
            cfg,
            core,
            incarnation,
            parent_ledger_id: 0,
            child_ledger_id: 0,
            parent_run: (0, 0),
            child_run: (0, 0),
            parent_cluster: String::new(),
            child_ledger_cluster: String::new(),
            parent_starting_until_ns: 0,
            seq: 0,
            rules_known,
            keys: HashMap::default(),
            wanting: Vec::new(),
            walk_all: true,
            walked_reachable: false,
            last_walk_ns: None,
            in_flight: None,
            warned_sharded: false,
            last_sent_ns: None,
            not_before_ns: 0,
            started_ns: now_ns,
            last_success_ns: None,
            last_failed: false,
            reachable: true,
            next_serial: 1,
            chain_deadlines: BinaryHeap::new(),
            stopping: false,
            rtt_ns: 0,
            stats: RegionalStats::default(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &RegionalConfig {
        &self.cfg
    }

    /// The id this regional uses towards its parent: `region/<NAME>`.
    pub fn agent_id(&self) -> &str {
        &self.agent_id
    }

    /// True once rules are known (bootstrap or from the parent).
    pub fn has_rules(&self) -> bool {
        self.rules_known
    }

    /// The child-facing core (rules, holders, ledgers).
    pub fn core(&self) -> &AllocatorCore {
        &self.core
    }

    /// The child-facing core, mutable (housekeeping sweeps of holders).
    pub fn core_mut(&mut self) -> &mut AllocatorCore {
        &mut self.core
    }

    /// Child-facing: exactly the [`AllocatorCore::handle`] contract
    /// (duplicates, STALE, rules in the reply, statuses), with sub-leases
    /// cut from the pools, and `parent_unreachable` stamped on grants.
    /// Without rules every item is answered `UNKNOWN_RULE` (nothing applied).
    pub fn handle(&mut self, now_ns: u64, batch: &LeaseBatch) -> LeaseReply {
        self.handle_from(now_ns, batch, "")
    }

    /// Whether `reply` (to a child) asks the upstream side to look at once:
    /// a pool ran dry while the parent has tokens, or a key has no parent
    /// lease yet (a grant marked `opening`). A pool dry because the parent
    /// is dry waits for the parent's hint (the loop's own wake-up). The
    /// tokio driver and the simulator both wake their upstream loop on it.
    pub fn wants_upstream_now(reply: &LeaseReply) -> bool {
        reply.grants.iter().any(|g| g.opening)
    }

    /// [`RegionalCore::handle`] for a child whose client certificate names
    /// `principal` (see [`AllocatorCore::handle_from`]).
    pub fn handle_from(&mut self, now_ns: u64, batch: &LeaseBatch, principal: &str) -> LeaseReply {
        self.update_reachable(now_ns);
        self.core.set_parent_unreachable(!self.reachable);
        if !self.rules_known || self.stopping {
            let why = if self.stopping {
                format!("regional allocator {} is shutting down", self.agent_id)
            } else {
                format!(
                    "regional allocator {} has no rules yet: its parent was not reached",
                    self.agent_id
                )
            };
            return LeaseReply {
                seq: batch.header.as_ref().map_or(0, |h| h.seq),
                epoch: self.core.epoch(),
                protocol_version: PROTOCOL_VERSION,
                grants: batch
                    .items
                    .iter()
                    .map(|_| Grant {
                        status: GrantStatus::UnknownRule as i32,
                        retry_after_ms: self.cfg.renew_interval_ns.div_ceil(MS).max(1),
                        parent_unreachable: !self.reachable,
                        detail: why.clone(),
                        ..Grant::default()
                    })
                    .collect(),
                rules: None,
                holder_incarnation: 0,
                request_digest: quotalease_proto::request_digest(batch),
                ledger_id: 0,
                ..LeaseReply::default()
            };
        }
        // A child naming a ledger other than the parent's (the root lost its
        // state, or this regional restarted and has not heard from the
        // parent yet): the next upstream batch names it, so the root learns
        // of it before it grants (SPEC §2 "First start").
        if let Some(h) = batch.header.as_ref() {
            // Likewise a run of the parent's ledger (or more of one) than
            // its replies have shown us: the root may have restarted from
            // an older copy of its state.
            let newer_run = h.ledger_id == self.parent_ledger_id
                && h.run_id != 0
                && (h.run_id != self.parent_run.0 || h.record_seq > self.parent_run.1);
            if h.ledger_id != 0 && (h.ledger_id != self.parent_ledger_id || newer_run) {
                self.child_ledger_id = h.ledger_id;
                self.child_run = (h.run_id, h.record_seq);
                self.child_ledger_cluster.clone_from(&h.ledger_cluster);
            }
        }
        let mut reply = self.core.handle_from(now_ns, batch, principal);
        // Children learn the root's ledger and run through us.
        reply.ledger_id = self.parent_ledger_id;
        (reply.run_id, reply.record_seq) = self.parent_run;
        if now_ns < self.parent_starting_until_ns {
            let left_ms = (self.parent_starting_until_ns - now_ns).div_ceil(MS);
            for g in &mut reply.grants {
                if g.status == GrantStatus::Granted as i32 && g.lease_id == 0 {
                    g.starting = true;
                    g.retry_after_ms = g.retry_after_ms.max(left_ms);
                }
            }
        }
        for (item, grant) in batch.items.iter().zip(&reply.grants) {
            if grant.opening {
                self.wanting.push(KeyId {
                    rule: item.rule_id.clone(),
                    tenant: item.tenant.clone(),
                    route: item.route.clone(),
                });
            }
        }
        reply
    }

    /// Whether the parent is reachable: the last upstream call succeeded,
    /// none is pending beyond `fetch_timeout`, and something succeeded
    /// within `HEARTBEAT + fetch_timeout` (or since start).
    pub fn parent_reachable(&self) -> bool {
        self.reachable
    }

    fn update_reachable(&mut self, now_ns: u64) {
        let timeout = self.cfg.fetch_timeout_ns;
        let pending_too_long = self
            .in_flight
            .as_ref()
            .is_some_and(|f| now_ns >= f.sent_ns.saturating_add(timeout));
        let since = self.last_success_ns.unwrap_or(self.started_ns);
        let silent =
            now_ns >= since.saturating_add(HEARTBEAT_NS.max(self.cfg.renew_interval_ns) + timeout);
        self.reachable = !self.last_failed && !pending_too_long && !silent;
    }

    /// Upstream counters.
    pub fn stats(&self) -> &RegionalStats {
        &self.stats
    }

    /// Child-facing counters (as for the global allocator).
    pub fn child_stats(&self) -> &Stats {
        self.core.stats()
    }

    /// The sub-lease ledger of one key at `now_ns` (for `/v1/keys`).
    pub fn key_view(&mut self, now_ns: u64, key: &KeyId) -> Option<KeyView> {
        self.core.key_view(now_ns, key)
    }

    /// The key's chain of parent leases, if one is live.
    pub fn chain_view(&self, key: &KeyId) -> Option<ChainView> {
        let c = self.keys.get(key)?.chain.as_ref()?;
        Some(ChainView {
            parent_lease_id: c.parent_lease_id,
            granted: c.granted,
            deadline_ns: c.deadline_ns,
            rate_utps: c.rate_utps,
            capacity: c.capacity,
            backs: c.backing(),
        })
    }

    /// When `poll_upstream` should next be called at the latest: one renew
    /// interval after the last walk over every key (renewals ahead of `E`,
    /// pool top-ups and heartbeats are decided then), the in-flight batch's
    /// timeout, or the next chain deadline (to drop a lapsed chain). A
    /// child the pool cannot serve is a reason to call it earlier (the
    /// driver is woken).
    pub fn next_wakeup_ns(&mut self) -> u64 {
        let mut t = self
            .last_walk_ns
            .unwrap_or(self.started_ns)
            .saturating_add(self.cfg.renew_interval_ns)
            .max(self.not_before_ns);
        if let Some(f) = &self.in_flight {
            t = t.min(f.sent_ns.saturating_add(self.cfg.fetch_timeout_ns));
        }
        if let Some(due) = self.next_chain_deadline() {
            t = t.min(due);
        }
        t
    }

    /// The earliest deadline of any chain, from `chain_deadlines`: entries
    /// at its top of chains that ended are dropped, of chains renewed since
    /// moved to their current deadline.
    fn next_chain_deadline(&mut self) -> Option<u64> {
        while let Some(Reverse((due, serial, key))) = self.chain_deadlines.peek() {
            let current = self
                .keys
                .get(key)
                .and_then(|ks| ks.chain.as_ref())
                .filter(|c| c.serial == *serial)
                .map(|c| c.deadline_ns);
            match current {
                Some(d) if d == *due => return Some(d),
                Some(d) => {
                    let Some(Reverse((_, serial, key))) = self.chain_deadlines.pop() else {
                        break;
                    };
                    self.chain_deadlines.push(Reverse((d, serial, key)));
                }
                None => {
                    self.chain_deadlines.pop();
                }
            }
        }
        None
    }

    /// When the upstream driver next looks (calls `handle_upstream_timeout`
    /// and `poll_upstream`): [`RegionalCore::next_wakeup_ns`] kept within
    /// 1 ms and one renew interval from `now_ns`. Both drivers (the tokio
    /// `upstream::run` and the simulator) sleep until this instant, so the
    /// policy exists once.
    pub fn upstream_timeout(&mut self, now_ns: u64) -> u64 {
        let interval = self.cfg.renew_interval_ns.max(MS);
        self.next_wakeup_ns()
            .clamp(now_ns.saturating_add(MS), now_ns.saturating_add(interval))
    }

    /// Until when the batch in flight may still be answered (its send plus
    /// `fetch_timeout`); `None` when nothing is in flight.
    pub fn upstream_deadline(&self) -> Option<u64> {
        self.in_flight
            .as_ref()
            .map(|f| f.sent_ns.saturating_add(self.cfg.fetch_timeout_ns))
    }

    /// Time passed to `now_ns`: a batch in flight past its deadline failed.
    pub fn handle_upstream_timeout(&mut self, now_ns: u64) {
        let Some(f) = &self.in_flight else { return };
        if now_ns >= f.sent_ns.saturating_add(self.cfg.fetch_timeout_ns) {
            let seq = f.seq;
            self.upstream_failed(now_ns, seq);
        }
    }

    /// The chain's deadline for a parent lease of `ttl_ms` asked at
    /// `sent_ns`: `sent + TTL*(1 - 2 rho) - epsilon` (as an agent installs).
    fn deadline(&self, sent_ns: u64, ttl_ms: u64) -> u64 {
        let ttl_ns = ttl_ms.saturating_mul(MS);
        use_by_ns(sent_ns, ttl_ns, self.cfg.epsilon_ns)
    }

    /// Drop chains whose deadline passed (their pools are destroyed; their
    /// sub-leases expired by construction).
    fn lapse_chains(&mut self, now_ns: u64) {
        while let Some(Reverse((due, _, _))) = self.chain_deadlines.peek() {
            if *due > now_ns {
                break;
            }
            let Some(Reverse((_, serial, key))) = self.chain_deadlines.pop() else {
                break;
            };
            let Some(ks) = self.keys.get_mut(&key) else {
                continue;
            };
            let Some(c) = ks.chain.as_ref().filter(|c| c.serial == serial) else {
                continue; // the chain ended (a new one has its own entry)
            };
            if now_ns < c.deadline_ns {
                // Renewed since: due again at its new deadline.
                let d = c.deadline_ns;
                self.chain_deadlines.push(Reverse((d, serial, key)));
                continue;
            }
            ks.chain = None;
            self.stats.chains_lapsed += 1;
            if let Some(l) = self.core.ledger_mut(&key) {
                let d = l.drain_pool(now_ns);
                self.stats.tokens_destroyed += d;
                l.set_pool_deadline(0);
                ks.sample_h = ks.sample_h.saturating_sub(d);
            }
        }
    }

    /// The next batch for the parent, or `None`: renewals of due chains
    /// (with `spent = G - H`), requests for new chains where children wait,
    /// releases of idle chains, or a heartbeat. At most one batch is in
    /// flight; every batch has a new, higher `seq`.
    pub fn poll_upstream(&mut self, now_ns: u64) -> Option<LeaseBatch> {
        self.update_reachable(now_ns);
        self.core.set_parent_unreachable(!self.reachable);
        self.lapse_chains(now_ns);
        // Keys the children created since the last poll.
        for key in self.core.take_new_keys() {
            self.keys.entry(key.clone()).or_insert_with(|| KeyState {
                sample_ns: now_ns,
                ..KeyState::default()
            });
            self.wanting.push(key);
        }
        // The throttle: plans that are not urgent go out once per renew
        // interval, with the walk over every key.
        let throttled = self
            .last_walk_ns
            .is_some_and(|t| now_ns < t.saturating_add(self.cfg.renew_interval_ns));
        let blocked = self.in_flight.is_some() || self.stopping || now_ns < self.not_before_ns;
        let must_walk = self.walk_all || self.walked_reachable != self.reachable;
        // Within the throttle only urgent plans go out, and only a key a
        // child found without tokens can be urgent: plan just those and the
        // keys the last upstream answer named (their chains and retry times
        // changed, so their pools' hints for children). Every key once per
        // renew interval (renewals ahead of the deadline, reports,
        // releases: the walk waits for a batch in flight to be answered)
        // and when reachability changed (every pool's hints, at once).
        let plans = if throttled && !must_walk {
            if blocked {
                // Nothing can go out; the answer in flight plans its keys.
                return None;
            }
            let mut keys = std::mem::take(&mut self.wanting);
            keys.sort_unstable();
            keys.dedup();
            self.plan_keys(now_ns, &keys)
        } else if blocked && !must_walk {
            return None;
        } else {
            if !blocked {
                self.wanting.clear();
                self.last_walk_ns = Some(now_ns);
            }
            self.walk_all = false;
            self.walked_reachable = self.reachable;
            self.plan(now_ns)
        };
        if blocked {
            return None;
        }
        let urgent = plans.iter().any(|(_, p)| {
            matches!(
                p,
                Plan::Open { urgent: true, .. } | Plan::Renew { urgent: true, .. }
            )
        });
        let mut items = Vec::new();
        let mut sent = Vec::new();
        let mut forget = Vec::new();
        for (key, plan) in plans {
            match plan {
                Plan::Nothing => {}
                Plan::Forget => forget.push(key),
                _ if throttled && !urgent => {}
                Plan::Open {
                    want, want_rate, ..
                } => {
                    let mut item = self.item(&key, ItemKind::Renew, 0, 0, want);
                    item.want_rate_utps = want_rate;
                    items.push(item);
                    sent.push(SentItem {
                        key,
                        release: false,
                        chain_serial: None,
                        carry_asked: 0,
                    });
                }
                Plan::Renew {
                    want, want_rate, ..
                } => {
                    let h = self.holding(now_ns, &key);
                    let c = self.keys[&key].chain.clone().expect("planned for a chain");
                    let mut carry_asked = 0;
                    let mut item = if c.is_rate() {
                        // A rate chain names the version it acknowledges;
                        // spent reports mean nothing for it.
                        if let Some(c) = self.keys.get_mut(&key).and_then(|k| k.chain.as_mut()) {
                            c.told_ack_id = c.ack_id;
                            if c.ack_id == c.parent_lease_id {
                                // Only the newest version is counted now
                                // (and the one this renewal brings).
                                c.counted_capacity = c.capacity;
                                c.counted_rate_utps = c.rate_utps;
                                c.unnamed_tokens = false;
                            }
                        }
                        self.item(&key, ItemKind::Renew, c.ack_id, 0, want)
                    } else {
                        let spent = c.granted.saturating_sub(h);
                        carry_asked = c.granted - spent;
                        self.item(&key, ItemKind::Renew, c.parent_lease_id, spent, want)
                    };
                    item.want_rate_utps = want_rate;
                    items.push(item);
                    sent.push(SentItem {
                        key,
                        release: false,
                        chain_serial: Some(c.serial),
                        carry_asked,
                    });
                }
                Plan::Release => {
                    if let Some(item) = self.release_item(now_ns, &key) {
                        items.push(item);
                        sent.push(SentItem {
                            key,
                            release: true,
                            chain_serial: None,
                            carry_asked: 0,
                        });
                    }
                }
            }
        }
        for key in forget {
            self.keys.remove(&key);
            self.core.remove_key(&key);
        }
        let heartbeat = items.is_empty()
            && match self.last_sent_ns {
                None => true,
                Some(t) if !self.rules_known || self.last_failed => {
                    now_ns >= t.saturating_add(self.cfg.renew_interval_ns)
                }
                Some(t) => {
                    let every = if self.chain_deadlines.is_empty() {
                        HEARTBEAT_NS
                    } else {
                        HEARTBEAT_HOLDING_NS
                    };
                    now_ns >= t.saturating_add(every)
                }
            };
        if items.is_empty() && !heartbeat {
            return None;
        }
        Some(self.send(now_ns, items, sent))
    }

    fn item(&self, key: &KeyId, kind: ItemKind, lease_id: u64, spent: u64, want: u64) -> LeaseItem {
        LeaseItem {
            rule_id: key.rule.clone(),
            tenant: key.tenant.clone(),
            route: key.route.clone(),
            kind: kind as i32,
            lease_id,
            spent,
            want,
            ..LeaseItem::default()
        }
    }

    /// Release the chain of `key`: the pool goes back to the parent (spent
    /// = `G - pool`, which is `G - H` since nothing is sub-leased, or
    /// counts what is still sub-leased as spent otherwise — never used
    /// then, see `shutdown`); the chain ends here.
    fn release_item(&mut self, now_ns: u64, key: &KeyId) -> Option<LeaseItem> {
        let ks = self.keys.get_mut(key)?;
        let c = ks.chain.take()?;
        let ledger = self.core.ledger_mut(key)?;
        let pool = ledger.drain_pool(now_ns);
        ledger.set_pool_deadline(0);
        debug_assert_eq!(
            ledger.outstanding(),
            0,
            "released only with nothing sub-leased"
        );
        ks.sample_h = ks.sample_h.saturating_sub(pool);
        self.stats.tokens_returned += pool;
        if c.is_rate() {
            // Every version up to the newest stops counting; the pool goes back.
            let mut item = self.item(key, ItemKind::Release, c.parent_lease_id, 0, 0);
            item.left = pool;
            return Some(item);
        }
        let spent = c.granted.saturating_sub(pool);
        Some(self.item(key, ItemKind::Release, c.parent_lease_id, spent, 0))
    }

    fn send(&mut self, now_ns: u64, items: Vec<LeaseItem>, sent: Vec<SentItem>) -> LeaseBatch {
        self.seq += 1;
        self.stats.upstream_messages += 1;
        // What a child named, once; else the parent's ledger and run.
        let (ledger_id, (run_id, record_seq), ledger_cluster) =
            match std::mem::take(&mut self.child_ledger_id) {
                0 => (
                    self.parent_ledger_id,
                    self.parent_run,
                    self.parent_cluster.clone(),
                ),
                theirs => (
                    theirs,
                    std::mem::take(&mut self.child_run),
                    std::mem::take(&mut self.child_ledger_cluster),
                ),
            };
        self.stats.upstream_items += items.len() as u64;
        if items.is_empty() {
            self.stats.upstream_heartbeats += 1;
        }
        self.last_sent_ns = Some(now_ns);
        let batch = LeaseBatch {
            header: Some(RequestHeader {
                agent_id: self.agent_id.clone(),
                incarnation: self.incarnation,
                seq: self.seq,
                protocol_version: PROTOCOL_VERSION,
                rules_version: if self.rules_known {
                    self.core.rules().version
                } else {
                    0
                },
                instance: self.cfg.instance,
                ledger_id,
                run_id,
                record_seq,
                // Its children's cluster is its own: one check at each tier.
                cluster: self.cfg.core.cluster.clone(),
                ledger_cluster,
            }),
            items,
            ttl_ms: self.cfg.lease_ttl_ns / MS,
            shard: 0,
        };
        self.in_flight = Some(InFlight {
            seq: self.seq,
            digest: quotalease_proto::request_digest(&batch),
            digest_v3: quotalease_proto::request_digest_v3(&batch),
            digest_v2: {
                let mut v2 = batch.clone();
                for i in &mut v2.items {
                    i.want_rate_utps = 0;
                    i.left = 0;
                }
                quotalease_proto::request_digest_v3(&v2)
            },
            sent_ns: now_ns,
            items: sent,
        });
        batch
    }

    fn holding(&mut self, now_ns: u64, key: &KeyId) -> u64 {
        self.core.ledger_mut(key).map_or(0, |l| l.holding(now_ns))
    }

    /// Decide per key (sorted): sample consumption, then whether to open,
    /// renew, release or forget.
    fn plan(&mut self, now_ns: u64) -> Vec<(KeyId, Plan)> {
        let ctx = self.plan_ctx();
        let mut out = Vec::new();
        for (key, ks) in self.keys.iter_mut() {
            if let Some(plan) = plan_key(&ctx, &mut self.core, now_ns, key, ks) {
                out.push((key.clone(), plan));
            }
        }
        // Each key's plan is its own; the batch goes out in key order
        // (whatever the hash order: the simulator replays exactly).
        out.sort_unstable_by(|(a, _), (b, _)| a.cmp(b));
        out
    }

    /// [`RegionalCore::plan`] for these keys only (sorted, distinct).
    fn plan_keys(&mut self, now_ns: u64, keys: &[KeyId]) -> Vec<(KeyId, Plan)> {
        let ctx = self.plan_ctx();
        let mut out = Vec::new();
        for key in keys {
            let Some(ks) = self.keys.get_mut(key) else {
                continue;
            };
            if let Some(plan) = plan_key(&ctx, &mut self.core, now_ns, key, ks) {
                out.push((key.clone(), plan));
            }
        }
        out
    }

    fn plan_ctx(&self) -> PlanCtx {
        let cfg = &self.cfg;
        // A child the pool cannot serve comes back when the next upstream
        // answer can be in: about two round trips when the regional may
        // ask now (it is woken by that child), at least MIN_CHILD_RETRY_MS,
        // at most one renew interval; later if the parent said so.
        let rtt_ms = (2 * self.rtt_ns).div_ceil(MS).clamp(
            MIN_CHILD_RETRY_MS,
            cfg.renew_interval_ns.div_ceil(MS).max(MIN_CHILD_RETRY_MS),
        );
        PlanCtx {
            window: cfg.core.active_window_ns,
            idle_ns: cfg.idle_release_ns(),
            low_water_ns: cfg.low_water_ns,
            renew_interval_ns: cfg.renew_interval_ns,
            low_water_s: cfg.low_water_ns as f64 / 1e9,
            horizon_s: (2 * cfg.low_water_ns + cfg.renew_interval_ns) as f64 / 1e9,
            rtt_ms,
            reachable: self.reachable,
            rate_leases: cfg.rate_leases,
        }
    }

    /// Apply the parent's reply to the in-flight batch (ignored if it
    /// answers another one: another seq, or a digest that is not our
    /// request's).
    pub fn handle_upstream_reply(&mut self, now_ns: u64, reply: &LeaseReply) {
        if reply.shard_count > 1 && !self.warned_sharded {
            // Not built: a regional allocator sends all its keys to one
            // parent; the keys of the parent's other shards are refused.
            self.warned_sharded = true;
            tracing::error!(
                shards = reply.shard_count,
                "the parent allocator is sharded; a regional allocator does not route keys by shard (docs/operations.md \"Sharding\"): keys of the other shards are refused"
            );
        }
        if reply.not_leader && reply.grants.is_empty() {
            // The parent's replicas have no leader yet (SPEC §7; a named
            // leader is followed by the transport): nothing was applied.
            // The pools serve what they hold meanwhile.
            tracing::debug!(
                seq = reply.seq,
                retry_ms = reply.retry_after_ms,
                "the parent's replicas have no leader yet"
            );
            self.upstream_failed(now_ns, reply.seq);
            return;
        }
        let Some(f) = self.in_flight.take_if(|f| {
            f.seq == reply.seq
                && (reply.request_digest == 0
                    || reply.request_digest == f.digest
                    || (reply.protocol_version < 4 && reply.request_digest == f.digest_v3)
                    || (reply.protocol_version < 3 && reply.request_digest == f.digest_v2))
        }) else {
            if self.in_flight.as_ref().is_some_and(|f| f.seq == reply.seq) {
                self.stats.upstream_mismatched_replies += 1;
                tracing::error!(
                    seq = reply.seq,
                    "parent reply answers another request (digest differs); ignored"
                );
            }
            return;
        };
        // The answered keys' chains and retry times change: plan them next
        // (their pools' hints for children with them).
        self.wanting.extend(f.items.iter().map(|i| i.key.clone()));
        if reply.ledger_id != 0 {
            self.parent_run =
                quotalease_proto::newest_run(self.parent_ledger_id, self.parent_run, reply);
            self.parent_ledger_id = reply.ledger_id;
            self.parent_cluster.clone_from(&reply.cluster);
        }
        if reply.holder_incarnation > self.incarnation {
            // Our clock stepped back across a restart: move above.
            self.incarnation = reply.holder_incarnation + 1;
        }
        let refused = reply.grants.iter().any(|g| {
            g.status == GrantStatus::Stale as i32
                || g.status == GrantStatus::Unsupported as i32
                || g.status == GrantStatus::SeqConflict as i32
        });
        if refused || reply.grants.len() != f.items.len() {
            // Nothing was applied (or the reply is malformed: treat it so;
            // every chain keeps its old lease and deadline).
            self.fail(now_ns);
            return;
        }
        self.stats.upstream_replies += 1;
        let rtt = now_ns.saturating_sub(f.sent_ns);
        self.rtt_ns = if self.rtt_ns == 0 {
            rtt
        } else {
            (self.rtt_ns * 7 + rtt) / 8
        };
        self.last_success_ns = Some(now_ns);
        self.last_failed = false;
        // Rules first, as an agent does.
        if let Some(pb) = &reply.rules {
            if !self.rules_known || pb.version > self.core.rules().version {
                match RuleSet::from_proto(pb) {
                    Ok(rules) => {
                        self.core.set_rules(rules, now_ns);
                        self.rules_known = true;
                        self.stats.rules_adopted += 1;
                    }
                    Err(errs) => {
                        tracing::error!(errors = errs.len(), "rules from the parent rejected");
                    }
                }
            }
        }
        for (sent, g) in f.items.iter().zip(&reply.grants) {
            if sent.release {
                continue;
            }
            self.apply_grant(now_ns, f.sent_ns, sent, g);
            if g.status == GrantStatus::Granted as i32 {
                // What the parent knows is left beyond the region's lease:
                // the pool adds it to its own on every grant to a child
                // (SPEC §5 "What the headers say").
                if let Some(ledger) = self.core.ledger_mut(&sent.key) {
                    ledger.set_pool_parent_available(g.bucket_available);
                }
            }
        }
        self.update_reachable(now_ns);
    }

    fn apply_grant(&mut self, now_ns: u64, sent_ns: u64, sent: &SentItem, g: &Grant) {
        if g.starting {
            // The parent is starting: children that get nothing are told
            // so (not a limit), until it said it ends.
            let until = now_ns.saturating_add(g.retry_after_ms.saturating_mul(MS));
            self.parent_starting_until_ns = self.parent_starting_until_ns.max(until);
        }
        let deadline = self.deadline(sent_ns, g.ttl_ms);
        let key = &sent.key;
        let ks = self.keys.entry(key.clone()).or_insert_with(|| KeyState {
            sample_ns: now_ns,
            ..KeyState::default()
        });
        if g.retry_after_ms > 0 {
            ks.retry_at_ns = now_ns.saturating_add(g.retry_after_ms.saturating_mul(MS));
        }
        if g.status != GrantStatus::Granted as i32 {
            // Refused (unknown rule, key limit, bad item): nothing applied
            // at the parent; the chain, if any, keeps its lease. Ask again
            // in a second at the earliest.
            ks.retry_at_ns = ks.retry_at_ns.max(now_ns.saturating_add(1_000 * MS));
            return;
        }
        if g.holders > 0 {
            ks.parent_holders = g.holders;
        }
        // A rate lease, or an answer to a rate chain's renewal (even one
        // without a new version: "no room", the chain keeps its versions).
        let rate_chain = ks.chain.as_ref().is_some_and(Chain::is_rate);
        if g.capacity > 0 || g.version_of != 0 || rate_chain {
            self.apply_rate_grant(now_ns, deadline, sent, g);
            return;
        }
        if g.carried > g.tokens {
            tracing::error!(rule = %key.rule, tokens = g.tokens, carried = g.carried, "malformed grant from the parent ignored");
            return;
        }
        let fresh = g.tokens - g.carried;
        let same_chain =
            sent.chain_serial.is_some() && ks.chain.as_ref().map(|c| c.serial) == sent.chain_serial;
        // A parent carries less than the rest asked only when a lowered
        // burst leaves no room for it (SPEC §2 "Rule changes"): the
        // children's sub-leases would then hold more than the new lease
        // backs. That is a break: the old pool is destroyed, the old
        // sub-leases (cut from a lease granted before the change, so
        // ending before it takes effect) are forgotten, and the carried
        // part is left unused.
        let clamped = g.carried < sent.carry_asked;
        if same_chain && g.carried > 0 && g.lease_id != 0 && !clamped {
            // The chain continues: G := carried + fresh, the pool gains fresh.
            let c = ks.chain.as_mut().expect("same_chain");
            c.parent_lease_id = g.lease_id;
            c.granted = g.tokens;
            move_deadline(&mut self.chain_deadlines, c, key, deadline);
            let Some(ledger) = self.core.ledger_mut(key) else {
                return;
            };
            ledger.set_pool_deadline(deadline);
            let took = ledger.deposit(now_ns, fresh);
            self.stats.tokens_from_parent += fresh;
            self.stats.tokens_destroyed += fresh - took;
            ks.sample_h += took;
            // Never hold more than the parent lease backs.
            let h = ledger.holding(now_ns);
            if h > g.tokens {
                let d = ledger.drain(now_ns, h - g.tokens);
                self.stats.tokens_destroyed += d;
                ks.sample_h = ks.sample_h.saturating_sub(d);
            }
            return;
        }
        // Not carried: a new chain (or none). The old chain's pool is
        // destroyed; its sub-leases are forgotten by the new ledger, stay
        // valid at the children until their own expiry (<= the old E) and
        // are backed by the old parent lease, which the parent counts until
        // it expires.
        self.new_chain(now_ns, deadline, sent, g, fresh);
    }

    /// A grant of a lease that carries a rate (SPEC §2): the pool refills
    /// here at the rate (slowed by the drift margin) up to the capacity
    /// until `deadline`. A new version of this chain's lease (the parent
    /// knew the version named, or carried the rest of its lease of tokens)
    /// continues the chain: the pool keeps its level (clipped to the new
    /// capacity) and gains the grant's tokens; the version is acknowledged
    /// once what the region holds fits under it. Anything else starts a new
    /// chain, as a break does for leases of tokens.
    fn apply_rate_grant(&mut self, now_ns: u64, deadline: u64, sent: &SentItem, g: &Grant) {
        let key = &sent.key;
        let Some(ks) = self.keys.get_mut(key) else {
            return;
        };
        let same_chain = sent.chain_serial.is_some()
            && ks.chain.as_ref().map(|c| c.serial) == sent.chain_serial
            && (g.version_of != 0 || g.carried > 0);
        if same_chain && g.lease_id == 0 {
            // No new version (no room at the parent): the chain keeps the
            // versions it has.
            return;
        }
        if same_chain && now_ns < deadline {
            let c = ks.chain.as_mut().expect("same_chain");
            let was_rate = c.is_rate();
            c.parent_lease_id = g.lease_id;
            c.rate_utps = g.rate_utps;
            c.capacity = g.capacity;
            c.counted_capacity = c.counted_capacity.max(g.capacity);
            c.counted_rate_utps = c.counted_rate_utps.max(g.rate_utps);
            c.unnamed_tokens |= g.tokens > 0;
            if !was_rate {
                // From a lease of tokens: the parent removed it and counts
                // the new version alone (its capacity covers the rest).
                c.ack_id = g.lease_id;
                c.ack_capacity = g.capacity;
                c.ack_deadline_ns = deadline;
                c.told_ack_id = g.lease_id;
                c.counted_capacity = g.capacity;
                c.counted_rate_utps = g.rate_utps;
                c.unnamed_tokens = false;
            }
            move_deadline(&mut self.chain_deadlines, c, key, deadline);
            let Some(ledger) = self.core.ledger_mut(key) else {
                return;
            };
            let d = ledger.set_pool_rate(now_ns, slowed(g.rate_utps), g.capacity);
            self.stats.tokens_destroyed += d;
            ks.sample_h = ks.sample_h.saturating_sub(d);
            let took = ledger.deposit(now_ns, g.tokens);
            self.stats.tokens_from_parent += g.tokens;
            self.stats.tokens_destroyed += g.tokens - took;
            ks.sample_h += took;
            if ledger.outstanding() <= g.capacity {
                c.ack_id = g.lease_id;
                c.ack_capacity = g.capacity;
                c.ack_deadline_ns = deadline;
            }
            // Sub-leases live no longer than the acknowledged version
            // (the newest, unless a smaller one waits, see `ack_deadline_ns`).
            ledger.set_pool_deadline(c.ack_deadline_ns);
            return;
        }
        // A new chain, as for leases of tokens.
        self.new_chain(now_ns, deadline, sent, g, g.tokens);
    }

    /// Start a new chain for `sent.key` on grant `g` (or none, if it holds
    /// nothing to build one on: a parent lease arriving past its deadline
    /// is left to expire at the parent), depositing `deposit` of its tokens
    /// in a fresh pool; a grant that carries a rate makes the pool refill
    /// at it. The old chain's pool is destroyed; its sub-leases stay backed
    /// by the old parent lease, which the parent counts until it expires.
    fn new_chain(&mut self, now_ns: u64, deadline: u64, sent: &SentItem, g: &Grant, deposit: u64) {
        let key = &sent.key;
        let Some(ks) = self.keys.get_mut(key) else {
            return;
        };
        let had_chain = ks.chain.take().is_some();
        let rule = self.core.rules().get(&key.rule).map(|r| (r.rate, r.burst));
        let mut old = self.core.ledger_mut(key);
        // A renewal of a chain that held nothing (every token spent) is not
        // carried by the parent and needs no carrying: not a break.
        let held = old.as_mut().map_or(0, |l| l.holding(now_ns));
        if had_chain && sent.chain_serial.is_some() && held > 0 {
            self.stats.chain_breaks += 1;
        }
        let mut fresh_ledger = match (old, rule) {
            (Some(l), _) => {
                let d = l.drain_pool(now_ns);
                self.stats.tokens_destroyed += d;
                l.fresh_chain(now_ns)
            }
            (None, Some((rate, burst))) => KeyLedger::new_pooled(rate, burst, now_ns),
            (None, None) => return,
        };
        let carries_rate = g.capacity > 0;
        // A lease of tokens with none is nothing; one with a rate refills.
        if g.lease_id == 0 || (g.tokens == 0 && !carries_rate) || now_ns >= deadline {
            if had_chain {
                self.core.replace_ledger(key, fresh_ledger);
            }
            ks.sample_h = 0;
            return;
        }
        fresh_ledger.set_pool_deadline(deadline);
        if carries_rate {
            fresh_ledger.set_pool_rate(now_ns, slowed(g.rate_utps), g.capacity);
        }
        let took = fresh_ledger.deposit(now_ns, deposit);
        self.stats.tokens_from_parent += deposit;
        self.stats.tokens_destroyed += deposit - took;
        self.core.replace_ledger(key, fresh_ledger);
        ks.sample_h = took;
        ks.sample_ns = now_ns;
        ks.chain = Some(Chain {
            serial: self.next_serial,
            parent_lease_id: g.lease_id,
            granted: g.tokens,
            deadline_ns: deadline,
            rate_utps: g.rate_utps,
            capacity: g.capacity,
            ack_id: g.lease_id,
            ack_capacity: g.capacity,
            ack_deadline_ns: deadline,
            told_ack_id: g.lease_id,
            counted_capacity: g.capacity,
            counted_rate_utps: g.rate_utps,
            unnamed_tokens: false,
        });
        self.chain_deadlines
            .push(Reverse((deadline, self.next_serial, key.clone())));
        self.next_serial += 1;
    }

    /// The in-flight batch `seq` failed or timed out (the driver decides the
    /// timeout). Chains keep their leases and deadlines; the next batch has
    /// a new `seq` (a renewal the parent did apply shows up as a chain
    /// break then).
    pub fn upstream_failed(&mut self, now_ns: u64, seq: u64) {
        if self.in_flight.as_ref().is_some_and(|f| f.seq == seq) {
            self.in_flight = None;
            self.fail(now_ns);
        }
    }

    fn fail(&mut self, now_ns: u64) {
        self.walk_all = true;
        self.stats.upstream_failures += 1;
        self.last_failed = true;
        self.not_before_ns = now_ns.saturating_add(self.cfg.renew_interval_ns);
        self.update_reachable(now_ns);
        self.core.set_parent_unreachable(!self.reachable);
    }

    /// Stop: no more sub-leasing, and one last batch giving the pools back:
    /// a chain with nothing sub-leased is released (its pool returns to
    /// the parent); a chain with sub-leases outstanding is renewed with its
    /// pool destroyed and reported spent, carrying only what the children
    /// hold. `None` if there is nothing to give back.
    pub fn shutdown(&mut self, now_ns: u64) -> Option<LeaseBatch> {
        self.stopping = true;
        self.lapse_chains(now_ns);
        let mut keys: Vec<KeyId> = self
            .keys
            .iter()
            .filter(|(_, ks)| ks.chain.is_some())
            .map(|(k, _)| k.clone())
            .collect();
        keys.sort_unstable();
        let mut items = Vec::new();
        let mut sent = Vec::new();
        for key in keys {
            let outstanding = self.core.ledger_mut(&key).map_or(0, |l| {
                l.advance(now_ns);
                l.outstanding()
            });
            if outstanding == 0 {
                if let Some(item) = self.release_item(now_ns, &key) {
                    items.push(item);
                    sent.push(SentItem {
                        key,
                        release: true,
                        chain_serial: None,
                        carry_asked: 0,
                    });
                }
                continue;
            }
            let Some(ledger) = self.core.ledger_mut(&key) else {
                continue;
            };
            let d = ledger.drain_pool(now_ns);
            self.stats.tokens_destroyed += d;
            let h = ledger.holding(now_ns);
            let c = self.keys[&key].chain.clone().expect("filtered on chain");
            if c.is_rate() {
                // Its count does not fall with reports: the parent counts
                // it until the sub-leases (and so the lease) run out.
                continue;
            }
            items.push(self.item(
                &key,
                ItemKind::Renew,
                c.parent_lease_id,
                c.granted.saturating_sub(h),
                0,
            ));
            sent.push(SentItem {
                key,
                release: false,
                chain_serial: Some(c.serial),
                carry_asked: c.granted.min(h),
            });
        }
        if items.is_empty() {
            return None;
        }
        Some(self.send(now_ns, items, sent))
    }

    /// Check the regional's invariants at `now_ns`, per key: the ledger's I2
    /// (`available + outstanding <= B`); with a chain, `H <= G` (what the
    /// pool and the children hold is backed by the parent lease) and every
    /// sub-lease expires no later than `E`; without one, nothing is held.
    pub fn check_i2(&mut self, now_ns: u64) -> Result<(), String> {
        self.lapse_chains(now_ns);
        for key in self.core.key_ids() {
            let chain = self.keys.get(&key).and_then(|k| k.chain.clone());
            self.check_key(now_ns, &key, chain)?;
        }
        Ok(())
    }

    /// [`RegionalCore::check_i2`] for the keys of one child batch only (what a
    /// batch can change), so that a checker can run it after every batch.
    pub fn check_i2_batch(&mut self, now_ns: u64, batch: &LeaseBatch) -> Result<(), String> {
        for item in &batch.items {
            let key = KeyId {
                rule: item.rule_id.clone(),
                tenant: item.tenant.clone(),
                route: item.route.clone(),
            };
            let mut chain = self.keys.get(&key).and_then(|k| k.chain.clone());
            if chain.as_ref().is_some_and(|c| now_ns >= c.deadline_ns) {
                self.lapse_chains(now_ns);
                chain = self.keys.get(&key).and_then(|k| k.chain.clone());
            }
            self.check_key(now_ns, &key, chain)?;
        }
        Ok(())
    }

    /// I2 of one key whose chain is `chain`; a key without a ledger holds
    /// nothing to check.
    fn check_key(&mut self, now_ns: u64, key: &KeyId, chain: Option<Chain>) -> Result<(), String> {
        let Some(ledger) = self.core.ledger_mut(key) else {
            return Ok(());
        };
        let h = ledger.holding(now_ns);
        if !ledger.i2_holds() {
            return Err(format!(
                "{key:?}: available {} + outstanding {} > B {}",
                ledger.available(),
                ledger.outstanding(),
                ledger.burst()
            ));
        }
        match chain {
            Some(c) => {
                if h > c.backing() {
                    return Err(format!(
                        "{key:?}: holding {h} > what the parent lease backs {}",
                        c.backing()
                    ));
                }
                if let Some(l) = ledger
                    .leases()
                    .iter()
                    .find(|l| l.expires_ns > c.deadline_ns)
                {
                    return Err(format!(
                        "{key:?}: sub-lease {} expires at {} after the chain deadline {}",
                        l.id, l.expires_ns, c.deadline_ns
                    ));
                }
            }
            None if h > 0 => {
                return Err(format!("{key:?}: holding {h} without a parent lease"));
            }
            None => {}
        }
        Ok(())
    }
}

/// What [`plan_key`] needs of the regional's settings and state.
struct PlanCtx {
    window: u64,
    idle_ns: u64,
    low_water_ns: u64,
    renew_interval_ns: u64,
    low_water_s: f64,
    horizon_s: f64,
    rtt_ms: u64,
    reachable: bool,
    rate_leases: bool,
}

/// Plan one key (None: nothing to do); also samples its consumption and
/// sets its pool's hints for children.
fn plan_key(
    ctx: &PlanCtx,
    core: &mut AllocatorCore,
    now_ns: u64,
    key: &KeyId,
    ks: &mut KeyState,
) -> Option<Plan> {
    let Some(ledger) = core.ledger_mut(key) else {
        return ks.chain.is_none().then_some(Plan::Forget);
    };
    let h = ledger.holding(now_ns);
    // What a rate lease refilled joined H as a deposit does.
    ks.sample_h = ks.sample_h.saturating_add(ledger.take_refilled());
    // Consumption estimate: what left H since the last sample.
    let dt = now_ns.saturating_sub(ks.sample_ns);
    if dt >= ctx.renew_interval_ns.max(1) {
        let used = ks.sample_h.saturating_sub(h) as f64;
        let dt_s = dt as f64 / 1e9;
        let alpha = 1.0 - (-dt_s / EWMA_TAU_S).exp();
        ks.rate += alpha * (used / dt_s - ks.rate);
        ks.sample_h = h;
        ks.sample_ns = now_ns;
    }
    let pool = ledger.available();
    let outstanding = ledger.outstanding();
    let unmet = ledger.unmet_demand(now_ns, ctx.window);
    let burst = ledger.burst();
    let low = (ks.rate * ctx.low_water_s).ceil() as u64;
    let target = (ks.rate * ctx.horizon_s).ceil() as u64;
    let want = unmet.saturating_add(target).saturating_sub(pool).min(burst);
    let idle = now_ns.saturating_sub(ledger.last_used_ns()) >= ctx.idle_ns;
    let may_ask = now_ns >= ks.retry_at_ns;
    ledger.set_pool_parent_dry(!may_ask);
    // The rate to ask for: what the children consume, with room to grow;
    // twice the current rate while children miss tokens; what they ask
    // for now, spread over the consumption estimate's time constant (what
    // the estimate will say after one sample of it: a key the region does
    // not hold yet has no estimate). At most the rule's rate. Spread over
    // a low-water time instead, one request of a cold key asked for the
    // whole rate of a 10/s rule, and with it the whole burst as capacity,
    // counted at the parent until the chain shrank while the key's other
    // region found no room (300 cold tenants of the demo's shape: 18-57 %
    // of their checks denied, where an ideal bucket denies none).
    let rule_tps = ledger.rate().tokens as f64 / ledger.rate().period_s.max(1) as f64;
    let want_rate = if ctx.rate_leases {
        let current = ks.chain.as_ref().map_or(0.0, |c| c.rate_utps as f64 / 1e6);
        let grow = if unmet > 0 { 2.0 * current } else { 0.0 };
        let asked = unmet as f64 / EWMA_TAU_S;
        let tps = (ks.rate * RATE_HEADROOM).max(grow).max(asked).min(rule_tps);
        ((tps * 1e6) as u64).max(1)
    } else {
        0
    };
    if let Some(c) = ks.chain.as_mut().filter(|c| c.is_rate()) {
        // What the region holds fits under the newest version now: the
        // next renewal acknowledges it, and sub-leases may live as long.
        if c.ack_id != c.parent_lease_id && outstanding <= c.capacity {
            c.ack_id = c.parent_lease_id;
            c.ack_capacity = c.capacity;
            c.ack_deadline_ns = c.deadline_ns;
            ledger.set_pool_deadline(c.deadline_ns);
        }
    }
    let plan = match &ks.chain {
        None if unmet > 0 && may_ask => Plan::Open {
            want: want.max(1),
            want_rate,
            urgent: true,
        },
        None if idle && outstanding == 0 && pool == 0 => Plan::Forget,
        None => Plan::Nothing,
        Some(_) if idle && outstanding == 0 => Plan::Release,
        Some(c) if c.is_rate() => {
            let ahead = c.deadline_ns.saturating_sub(now_ns) <= ctx.low_water_ns && !idle;
            let short = may_ask && want > 0 && unmet > pool;
            // The rate asked for moved by more than a quarter (a share
            // freed or needed), or a shrink waits to be acknowledged.
            let moved = want_rate.abs_diff(c.rate_utps) > c.rate_utps / 4 + 1_000_000;
            // Below nine tenths of an equal share of the holders the
            // parent named while children miss tokens, a larger rate is
            // asked for without waiting out the parent's retry hint: that
            // hint is about the bucket's tokens (none while the rates are
            // lent), not about the rate another holder's renewal frees.
            // Waiting it out, a region that opened a key at 375/s sat there
            // 250 ms while its children asked for 37 000/s
            // (small-burst-below-rate: most false rejects were in that
            // first second); at a quarter of a share (session 14) one that
            // got 9 990/s of 20 000 sat there as long (seed 7). At an equal
            // share (max-min gives every holder that asks more at least
            // that, 19 980/s of 20 000 once rho is taken) the hint holds,
            // so an overloaded key does not renew every walk.
            let starved = unmet > 0
                && ks.parent_holders > 0
                && want_rate > c.rate_utps
                && (c.rate_utps as f64 / 1e6) * f64::from(ks.parent_holders) < 0.9 * rule_tps;
            // The parent counts the older versions until told: a shrink
            // (of capacity, or of rate once the newest version is the one
            // acknowledged) is told at once, a version that brought tokens
            // (counted on top of its capacity until named) at the next
            // walk; a grown or equal version without tokens waits for the
            // next renewal. What a shrink frees is another holder's share:
            // told at the next walk, a region that opened a key late got
            // half its share for another round trip
            // (small-burst-below-rate seed 7).
            let untold = c.ack_id != c.told_ack_id;
            let shrink = untold
                && (c.counted_capacity > c.capacity.max(c.ack_capacity)
                    || (c.ack_id == c.parent_lease_id && c.counted_rate_utps > c.rate_utps));
            let ack = shrink || (untold && c.unnamed_tokens);
            if ahead || short || (moved && (may_ask || starved)) || ack {
                Plan::Renew {
                    want: if may_ask && short { want } else { 0 },
                    want_rate,
                    urgent: shrink || (unmet > 0 && pool == 0 && may_ask),
                }
            } else {
                Plan::Nothing
            }
        }
        Some(c) => {
            let ahead = c.deadline_ns.saturating_sub(now_ns) <= ctx.low_water_ns && !idle;
            let short = may_ask && want > 0 && (unmet > pool || pool < low);
            // Spending the parent does not know of yet keeps its
            // bucket from refilling (refill is capped at
            // B - outstanding): report it (at most once per renew
            // interval, even while told to wait for new tokens)
            // once it is a useful part of B.
            let report = c.granted.saturating_sub(h) >= (burst / 32).max(1);
            if ahead || short || report {
                Plan::Renew {
                    want: if may_ask { want } else { 0 },
                    want_rate,
                    urgent: unmet > 0 && pool == 0 && may_ask,
                }
            } else {
                Plan::Nothing
            }
        }
    };
    // Children's pool hint: until the next upstream answer can be in: the
    // parent's retry hint and a round trip beyond it. A pool that has no
    // rate yet (no chain, or a first version with a capacity and rate 0)
    // grows only by that answer, so when this walk asks the parent (an
    // open, or a renewal that goes out despite the hint: `starved`,
    // `ack`, `ahead`) its children are told one round trip: told the
    // parent's hint as well, the hundred agents of a region whose first
    // grant was a capacity without a rate waited 300 ms, none came back
    // when the renewal brought 9 990/s 45 ms later, and the pool sat full
    // meanwhile (small-burst-below-rate seed 7: region 0 admitted 9 486 of
    // 18 000 in its first second). A pool that refills at a rate tells
    // its children its own refill (the ledger's hint) within this one.
    let rated = ks.chain.as_ref().is_some_and(|c| c.rate_utps > 0);
    let wait_ms = match plan {
        Plan::Open { .. } | Plan::Renew { .. } if !rated => 0,
        _ => ks.retry_at_ns.saturating_sub(now_ns).div_ceil(MS),
    };
    let hint = if ctx.reachable {
        ctx.rtt_ms + wait_ms
    } else {
        ctx.renew_interval_ns.div_ceil(MS).max(1) + wait_ms
    };
    ledger.set_pool_retry_ms(hint);
    (!matches!(plan, Plan::Nothing)).then_some(plan)
}

#[cfg(test)]
mod tests;

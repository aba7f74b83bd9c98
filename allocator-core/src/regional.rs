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
//!
//! Its upstream side speaks the agent core's verbs, so its tokio pump
//! (`quotalease_allocator::upstream::run`) and the simulator's read like
//! the agent's driver: `handle_timeout`, `handle_reply`, `handle_failure`
//! feed it time and outcomes; `poll_transmit` gives the next batch for the
//! parent and `poll_timeout` when to look again. (The children's side is
//! `handle`, as every allocator's.)
//!
//! Its parts: this file the state, the children's side and the timers;
//! `upstream.rs` what it asks its parent for and sends; `grants.rs` the
//! parent's replies applied to the chains; `check.rs` I2 of its pools;
//! `slots.rs` the parent slot leases of concurrency keys (one
//! `slots::chain::SlotChain` each, lending through the pools of the
//! child-facing core; docs/permits.md "Through regional allocators").

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
use crate::ledger::{KeyLedger, PoolTerm};

mod check;
mod grants;
mod slots;
mod upstream;

pub use slots::SLOT_RESENDS;

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
    /// Heartbeats whose reply was not waited for: a batch opening a key a
    /// child waits for went out instead.
    pub upstream_heartbeats_superseded: u64,
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
    /// Pool tokens a shrink did not fit, handed back to the parent (a
    /// parent of an older release ignores them: destroyed then).
    pub tokens_handed_back: u64,
    /// Chains that broke (the parent did not carry our lease).
    pub chain_breaks: u64,
    /// Chains dropped at their deadline without renewal.
    pub chains_lapsed: u64,
    /// Keys the walks over the keys planned (visited).
    pub walk_keys_planned: u64,
    /// Keys those walks passed by as not due (docs/protocol.md "Which keys
    /// a walk visits").
    pub walk_keys_skipped: u64,
    /// Rule sets adopted from the parent.
    pub rules_adopted: u64,
    /// Replies ignored because they answer another request (digest).
    pub upstream_mismatched_replies: u64,
    /// Slot asks sent to the parent (items; docs/permits.md "Through
    /// regional allocators").
    pub slot_asks: u64,
    /// Batches of slot asks sent again after a failure.
    pub slot_resends: u64,
    /// Parent slot leases that broke (the parent kept less than asked).
    pub slot_chain_breaks: u64,
    /// Parent slot leases that reached their deadline unrenewed.
    pub slot_chains_lapsed: u64,
    /// Parent slot leases resumed with slots of a predecessor's (this
    /// regional restarted while its children held permits), and those
    /// slots.
    pub slot_resumes: u64,
    /// See `slot_resumes`.
    pub slots_resumed: u64,
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
    /// Pool tokens a shrink did not fit (a newer version's smaller
    /// capacity), handed back with the renewal that next names a newer
    /// acknowledged version (`LeaseItem.left`; docs/protocol.md "A shrink
    /// hands back").
    returnable: u64,
    /// Until then (0: not) the newest version's rate is the parent's
    /// floor: it granted more than the item asked for (at least a quarter
    /// of an equal share per holder asking, docs/protocol.md "Leases that
    /// carry a rate"). While the holders asking stay the same, a smaller
    /// ask brings the same rate back, so it is not worth a renewal of its
    /// own; after one active window (the parent forgets a holder's demand
    /// after it, and other holders may have come, which lowers the floor)
    /// or new rules, it is again.
    floored_until_ns: u64,
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
    /// Children's consumption, tokens/s (EWMA over what left `H`, biased
    /// towards 0 while the key is young: read it through
    /// [`KeyState::consumption`]).
    rate: f64,
    /// The weight the EWMA has given to samples so far, `1 - e^(-t/tau)`
    /// after `t` of samples: what corrects its start from 0.
    weight: f64,
    /// Tokens that left `H` since this state was created.
    seen: u64,
    /// `H` at the last sample plus what was deposited since.
    sample_h: u64,
    sample_ns: u64,
    /// Do not ask the parent for more before this (its retry hint).
    retry_at_ns: u64,
    /// Holders the parent last said share this key (this region included;
    /// 0: not told yet).
    parent_holders: u32,
    /// The walk over the keys visits this one again from then on (0: at
    /// every walk), or earlier when a child's item or the parent's answer
    /// names it (docs/protocol.md "Which keys a walk visits").
    due_ns: u64,
}

/// Tokens a key must have consumed before its consumption estimate is
/// corrected for the EWMA's start from 0: a count's relative error
/// (`1 / sqrt(n)`, Poisson) is then within the rate's headroom of a
/// quarter, so one request of a cold key is not read as a rate.
const SEEN_FOR_CORRECTION: u64 = 16;

impl KeyState {
    /// Fold `used` tokens that left `H` over the last `dt_s` seconds into
    /// the consumption estimate.
    fn sample(&mut self, used: u64, dt_s: f64) {
        let alpha = 1.0 - (-dt_s / EWMA_TAU_S).exp();
        self.rate += alpha * (used as f64 / dt_s - self.rate);
        self.weight += alpha * (1.0 - self.weight);
        self.seen = self.seen.saturating_add(used);
    }

    /// Children's consumption, tokens/s: the EWMA divided by the weight it
    /// has given samples so far once it has seen enough tokens (the mean
    /// since the key opened while that is short against tau; the EWMA
    /// alone, from 0, read 220/s 200 ms after a region's children started
    /// spending 1 800/s, and the region shrank its rate to a quarter of
    /// what they spent: docs/simulation.md "The opening, again").
    fn consumption(&self) -> f64 {
        if self.seen >= SEEN_FOR_CORRECTION && self.weight > 0.0 {
            self.rate / self.weight
        } else {
            self.rate
        }
    }
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
    /// The rate the item asked for (micro-tokens per second; 0: none).
    asked_rate_utps: u64,
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
    /// The keys of its slot asks, after `items` (their grants follow the
    /// token items' in the reply).
    slots: Vec<KeyId>,
    /// A batch of slot asks: the batch, to send again if it fails, and
    /// how often it was sent again already.
    batch: Option<LeaseBatch>,
    tries: u32,
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
    keys: HashMap<KeyId, Box<KeyState>>,
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
    /// Per concurrency key, its parent slot lease (key order: what leaves
    /// is sorted).
    slot_chains: std::collections::BTreeMap<KeyId, crate::slots::chain::SlotChain>,
    /// A failed batch of slot asks to send again.
    slot_resend: Option<slots::SlotResend>,
    /// The last batch sent was one of slot asks (the walk over the token
    /// chains goes next when it is due).
    last_batch_slots: bool,
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
            slot_chains: std::collections::BTreeMap::new(),
            slot_resend: None,
            last_batch_slots: false,
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
                    .map(|item| Grant {
                        // A slot lease renewed before the parent's rules
                        // came (a restart): nothing applied, the lease
                        // stands (a refusal would end its permits at their
                        // use-by; docs/permits.md "A regional restart").
                        status: if !self.stopping
                            && item.kind == quotalease_proto::lease::ItemKind::Slots as i32
                            && item.lease_id != 0
                        {
                            GrantStatus::Resuming as i32
                        } else {
                            GrantStatus::UnknownRule as i32
                        },
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
                self.wanting
                    .push(KeyId::new(&item.rule_id, &item.tenant, &item.route));
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

    /// When `poll_transmit` should next be called at the latest: one renew
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

    /// When the upstream driver next looks (calls `handle_timeout`
    /// and `poll_transmit`): [`RegionalCore::next_wakeup_ns`] kept within
    /// 1 ms and one renew interval from `now_ns`. Both drivers (the tokio
    /// `upstream::run` and the simulator) sleep until this instant, so the
    /// policy exists once.
    pub fn poll_timeout(&mut self, now_ns: u64) -> u64 {
        let interval = self.cfg.renew_interval_ns.max(MS);
        self.next_wakeup_ns()
            .clamp(now_ns.saturating_add(MS), now_ns.saturating_add(interval))
    }

    /// Whether the batch in flight is a heartbeat (no items): a driver
    /// then also polls when a child waits, since a batch opening a key
    /// supersedes it ([`RegionalCore::poll_transmit`]).
    pub fn heartbeat_in_flight(&self) -> bool {
        self.in_flight
            .as_ref()
            .is_some_and(|f| f.items.is_empty() && f.slots.is_empty())
    }

    /// Until when the batch in flight may still be answered (its send plus
    /// `fetch_timeout`); `None` when nothing is in flight.
    pub fn upstream_deadline(&self) -> Option<u64> {
        self.in_flight
            .as_ref()
            .map(|f| f.sent_ns.saturating_add(self.cfg.fetch_timeout_ns))
    }

    /// Time passed to `now_ns`: a batch in flight past its deadline failed.
    pub fn handle_timeout(&mut self, now_ns: u64) {
        let Some(f) = &self.in_flight else { return };
        if now_ns >= f.sent_ns.saturating_add(self.cfg.fetch_timeout_ns) {
            let seq = f.seq;
            self.handle_failure(now_ns, seq);
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
            self.stats.tokens_destroyed += c.returnable;
            ks.chain = None;
            ks.due_ns = 0;
            self.stats.chains_lapsed += 1;
            if let Some(l) = self.core.ledger_mut(&key) {
                let d = l.drain_pool(now_ns);
                self.stats.tokens_destroyed += d;
                l.set_pool(PoolTerm::Deadline(0));
                ks.sample_h = ks.sample_h.saturating_sub(d);
            }
        }
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
                self.release_into(now_ns, key, &mut items, &mut sent);
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
                asked_rate_utps: 0,
            });
        }
        let (slot_items, slot_keys) = self.slot_shutdown_items(now_ns);
        items.extend(slot_items);
        if items.is_empty() {
            return None;
        }
        let batch = self.send(now_ns, items, sent);
        if let Some(f) = self.in_flight.as_mut() {
            f.slots = slot_keys;
        }
        Some(batch)
    }
}

#[cfg(test)]
mod tests;

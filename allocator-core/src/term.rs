//! How a global allocator's core starts a term from what its durable state
//! says (SPEC §2 "Restarts", §7): the part of a start, or of winning an
//! election, that does not depend on where that state is kept. The etcd
//! driver (`src/etcd.rs`) and the simulator's failover model both use it.

use std::time::Duration;

use quotalease_model::key::KeyId;

use crate::core::{AllocatorCore, CoreConfig, TTL_MAX_CAP_NS};
use crate::ledger::KeyCheckpoint;
use crate::reservations::Reservation;

/// How long a global allocator grants nothing after a first start (see `CoreConfig::first_start_grace_ns`): three of the agents'
/// default 1 s heartbeats.
pub const START_GRACE: Duration = Duration::from_secs(3);

/// The start's wait of a restart: [`START_GRACE`], or `TTL_max` if that is
/// shorter (but at least one agent heartbeat, 1 s).
pub fn restart_grace(ttl_max: Duration) -> Duration {
    START_GRACE.min(ttl_max.max(Duration::from_secs(1)))
}

/// What the durable state says at the start of a term.
#[derive(Clone, Debug, Default)]
pub struct Durable {
    /// No ledger and nothing reserved: a new ledger (buckets start full).
    pub first: bool,
    /// The reservations were given up (a lost ledger): every key counts as
    /// fully leased out for the compiled `TTL_max` cap.
    pub lost: bool,
    /// The largest `TTL_max` a predecessor may have granted under (ns).
    pub predecessor_ttl_max_ns: u64,
    /// The ledger's id.
    pub ledger_id: u64,
    /// Every key's write-ahead reservation.
    pub reservations: Vec<(KeyId, Reservation)>,
    /// A predecessor's exact state after its last grant (a clean stop),
    /// when there is one whole and of this ledger.
    pub checkpoint: Option<Vec<(KeyId, KeyCheckpoint)>>,
}

/// How a term resumed (for its log line).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resumed {
    /// A new ledger.
    First,
    /// A lost ledger: every key waits the cap.
    Lost,
    /// From a predecessor's checkpoint, this many keys.
    Checkpoint(usize),
    /// From the reservations, this many keys.
    Reserved(usize),
}

/// How long a term grants nothing after it starts (see
/// `CoreConfig::first_start_grace_ns`), unless the operator said the
/// ledger is new.
#[derive(Clone, Copy, Debug, Default)]
pub struct Grace {
    /// A new ledger's first term.
    pub first_ns: u64,
    /// Every later term.
    pub later_ns: u64,
}

/// The core settings of a term that resumes from `d`, on top of `base`
/// (its `ttl_max_ns` and the rest); it grants nothing for `grace`
/// unless `new_ledger`.
pub fn config(base: CoreConfig, d: &Durable, grace: Grace, new_ledger: bool) -> CoreConfig {
    CoreConfig {
        predecessor_ttl_max_ns: if d.lost {
            TTL_MAX_CAP_NS
        } else {
            d.predecessor_ttl_max_ns
        },
        // The reservations (or the checkpoint) bound what any predecessor
        // granted; without them every key waits (a lost ledger).
        no_predecessor: !d.lost,
        reservations: true,
        ledger_id: d.ledger_id,
        first_start_grace_ns: match (new_ledger, d.first) {
            (true, _) => 0,
            (false, true) => grace.first_ns,
            (false, false) => grace.later_ns,
        },
        new_ledger,
        ..base
    }
}

/// Resume `core` (just made with [`config`]) at `now` from `d`. Returns
/// how, and the promises that must be durable before it grants anything.
pub fn resume(
    core: &mut AllocatorCore,
    now: u64,
    d: Durable,
) -> (Resumed, Vec<(KeyId, Reservation)>) {
    let how = if d.lost {
        Resumed::Lost
    } else if let Some(keys) = d.checkpoint {
        let n = keys.len();
        core.resume_keys(now, keys);
        Resumed::Checkpoint(n)
    } else if d.first {
        Resumed::First
    } else {
        let n = d.reservations.len();
        core.resume_reserved(now, d.reservations);
        Resumed::Reserved(n)
    };
    (how, core.reserve_current_keys(now))
}

//! How a global allocator's core starts a term from what its durable state
//! says (SPEC §2 "Restarts", §7): the part of a start, or of winning an
//! election, that does not depend on where that state is kept. The etcd
//! driver (`src/etcd.rs`) and the simulator's failover model both use it.

use std::time::Duration;

use quotalease_model::key::KeyId;

use crate::core::{AllocatorCore, CoreConfig, TTL_MAX_CAP_NS};
use crate::durable::LedgerRecord;
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

/// What a term writes before anything else: its ledger record, from the
/// one its store holds (`prev`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NextRecord {
    /// The record to write (guarded, with `--etcd`) before the term grants.
    pub record: LedgerRecord,
    /// The largest `TTL_max` the predecessor may have granted under (ms).
    pub predecessor_ttl_max_ms: u64,
    /// The rule version this term starts at: above any served before, and
    /// the wall clock's ms if later (versions never go backwards).
    pub rules_version: u64,
}

/// What a start brings to its ledger record: fresh ids drawn by the
/// driver, and its settings.
#[derive(Clone, Copy, Debug)]
pub struct Starting<'a> {
    /// The id of a new ledger (used when the store holds no record).
    pub new_ledger_id: u64,
    /// This term's run id (never 0).
    pub run: u64,
    /// How many records the store says the previous run made durable
    /// (`u64::MAX`: unknown).
    pub last_seq: u64,
    /// The wall clock's ms (the rule version floor).
    pub unix_ms: u64,
    /// This allocator's `TTL_max` (ms).
    pub ttl_max_ms: u64,
    /// `--cluster`, if given.
    pub cluster: Option<&'a str>,
    /// The lease id base of this term, with `--etcd` (each term's leases
    /// are numbered above the last term's); `None` keeps the recorded one.
    pub lease_id_base: Option<u64>,
}

/// The ledger record a start writes, from the one its store holds: a
/// missing record is a new ledger's (`first`: nothing else of a
/// predecessor is stored either; else a predecessor of unknown `TTL_max`,
/// the compiled cap). The recorded `TTL_max` only grows, the rule version
/// moves past the served ones, the cluster is recorded by the first start
/// that names one, and this start's run begins (the previous one ends at
/// `last_seq`). `Err`: the recorded cluster, which `--cluster` is not.
pub fn next_record(
    prev: Option<LedgerRecord>,
    first: bool,
    s: Starting<'_>,
) -> Result<NextRecord, String> {
    let prev = prev.unwrap_or(LedgerRecord {
        id: s.new_ledger_id.max(1),
        ttl_max_ms: if first { 0 } else { TTL_MAX_CAP_NS / 1_000_000 },
        rules_version: 0,
        lease_id_base: 0,
        run: 0,
        runs: Vec::new(),
        cluster: String::new(),
    });
    let cluster = prev.cluster_with(s.cluster)?;
    let rules_version = s.unix_ms.max(prev.rules_version + 1);
    let predecessor_ttl_max_ms = prev.ttl_max_ms;
    let mut record = LedgerRecord {
        // A lowered TTL_max never lowers the recorded one: the next start
        // waits the largest any start used.
        ttl_max_ms: prev.ttl_max_ms.max(s.ttl_max_ms),
        rules_version,
        lease_id_base: s.lease_id_base.unwrap_or(prev.lease_id_base),
        cluster,
        ..prev
    };
    record.start_run(s.run, s.last_seq);
    Ok(NextRecord {
        record,
        predecessor_ttl_max_ms,
        rules_version,
    })
}

/// What the durable state says at the start of a term.
#[derive(Clone, Debug, Default)]
pub struct Durable {
    /// No ledger and nothing reserved: a new ledger (buckets start full).
    pub first: bool,
    /// No reservations describe the predecessor's leases (a lost ledger's
    /// were given up; a state directory has no log): every key counts as
    /// fully leased out for `predecessor_ttl_max_ns`.
    pub lost: bool,
    /// The largest `TTL_max` a predecessor may have granted under (ns;
    /// a lost ledger's: the compiled cap).
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
        predecessor_ttl_max_ns: d.predecessor_ttl_max_ns,
        // The reservations (or the checkpoint) bound what any predecessor
        // granted; without them every key waits (a lost ledger).
        no_predecessor: !d.lost,
        // Slot leases are not in the reservations: any earlier term's may
        // still be out.
        slot_leases_may_be_out: !d.first,
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

#[cfg(test)]
mod tests {
    use super::*;

    fn starting(cluster: Option<&str>) -> Starting<'_> {
        Starting {
            new_ledger_id: 0xfeed,
            run: 0xa1,
            last_seq: 7,
            unix_ms: 1_000,
            ttl_max_ms: 2_000,
            cluster,
            lease_id_base: None,
        }
    }

    #[test]
    fn a_missing_record_is_a_new_ledger_or_a_predecessor_of_unknown_ttl_max() {
        let n = next_record(None, true, starting(None)).unwrap();
        assert_eq!(n.record.id, 0xfeed);
        assert_eq!(n.predecessor_ttl_max_ms, 0);
        assert_eq!(n.record.ttl_max_ms, 2_000);
        assert_eq!(n.record.run, 0xa1);
        assert!(n.record.runs.is_empty(), "no earlier run");
        assert_eq!(n.rules_version, 1_000);
        // Something else of a predecessor is stored: its TTL_max is the cap.
        let n = next_record(None, false, starting(None)).unwrap();
        assert_eq!(n.predecessor_ttl_max_ms, TTL_MAX_CAP_NS / 1_000_000);
        assert_eq!(n.record.ttl_max_ms, TTL_MAX_CAP_NS / 1_000_000);
    }

    #[test]
    fn a_recorded_ledger_moves_on_and_never_back() {
        let prev = LedgerRecord {
            id: 0xbeef,
            ttl_max_ms: 5_000,
            rules_version: 9_999,
            lease_id_base: 77,
            run: 0xa0,
            runs: Vec::new(),
            cluster: "prod".into(),
        };
        let n = next_record(Some(prev.clone()), false, starting(None)).unwrap();
        assert_eq!(n.record.id, 0xbeef, "the same ledger");
        assert_eq!(n.predecessor_ttl_max_ms, 5_000);
        assert_eq!(
            n.record.ttl_max_ms, 5_000,
            "a lowered TTL_max is not recorded"
        );
        assert_eq!(n.rules_version, 10_000, "above every version served");
        assert_eq!(n.record.lease_id_base, 77, "kept without a new base");
        assert_eq!(n.record.cluster, "prod", "recorded, none given");
        assert_eq!(
            n.record.runs,
            vec![(0xa0, 7)],
            "the last run ended at last_seq"
        );
        assert_eq!(n.record.run, 0xa1);
        let with_base = Starting {
            lease_id_base: Some(1 << 50),
            ..starting(Some("prod"))
        };
        let n = next_record(Some(prev.clone()), false, with_base).unwrap();
        assert_eq!(n.record.lease_id_base, 1 << 50);
        assert_eq!(
            next_record(Some(prev), false, starting(Some("staging"))),
            Err("prod".to_string()),
            "another cluster's ledger is refused"
        );
        // The first start that names a cluster records it.
        let n = next_record(None, true, starting(Some("prod"))).unwrap();
        assert_eq!(n.record.cluster, "prod");
    }
}

//! The simulator's model of `--etcd` replicas (SPEC §7): the global
//! allocator's leader, its etcd lease and what etcd holds, on the real
//! cores ([`AllocatorCore`], the [`Leadership`] gate, [`term`]'s resume).
//! The event loop (`world.rs`) owns time and messages; this holds the
//! state and the rules:
//!
//! - **Lease.** The leader keeps its etcd lease alive, and confirms its
//!   leader key, every sixth of its TTL while it is alive and awake; each
//!   round renews etcd's expiry to `sent + TTL` and the leader's validity
//!   to `sent + min(TTL - margin, margin)` on its own (drifting) clock, as
//!   `src/etcd.rs` does.
//! - **Election.** Once etcd's expiry has passed (the leader died, or it is
//!   frozen), a successor leads `election` later: a new core, its config
//!   and resume from the reservations in the store by [`term`]; it grants
//!   only after its predecessor's key confirmations have run out (the key
//!   window, `max(TTL/3, 1 s)`, with the clocks' rate error), as
//!   `src/etcd.rs` waits. A frozen
//!   leader keeps its core: it is *deposed*, and whatever reaches it (what
//!   was queued while it slept, its own held replies) is judged by its own
//!   gate when it wakes — a grant from it is a fencing failure the run
//!   reports.
//! - **Write-ahead.** Records the leader's core appends become durable in
//!   the store `write_lag` later, if its term is still the current one;
//!   replies wait until every record before them is durable, as
//!   `LeaseService` waits on `Durability`.
//! - Requests that reach no leader (none elected yet, or a dead one) get a
//!   follower's refusal: "no leader yet" (what `LeaderClient` returns when
//!   the named leader does not answer).

use std::collections::BTreeMap;

use quotalease_allocator::core::{AllocatorCore, CoreConfig};
use quotalease_allocator::leadership::{self, Leadership};
use quotalease_allocator::reservations::{Record, Reservation};
use quotalease_allocator::term;
use quotalease_model::key::KeyId;
use quotalease_model::rules::RuleSet;
use quotalease_proto::lease::{LeaseBatch, LeaseReply};

use crate::net::Node;
use crate::scenario::FailoverSpec;

const MS: u64 = 1_000_000;

/// The model's settings, in ns.
#[derive(Clone, Copy, Debug)]
pub struct Settings {
    /// The etcd lease TTL.
    pub lease_ttl_ns: u64,
    /// Validity margin under it (`max(TTL/3, 1 s)`, as the driver).
    pub margin_ns: u64,
    /// From expiry to the successor serving.
    pub election_ns: u64,
    /// Until a write is durable.
    pub write_lag_ns: u64,
    /// Between keep-alives.
    pub keep_alive_ns: u64,
}

impl Settings {
    /// How long one round of confirmations keeps a leader valid: the
    /// earlier of the lease's (`TTL - margin`) and the leader key's (the
    /// margin), as `src/etcd.rs` has it (the model confirms both at every
    /// keep-alive).
    pub fn validity_ns(&self) -> u64 {
        leadership::lease_validity_ns(self.lease_ttl_ns, self.lease_ttl_ns).min(self.margin_ns)
    }

    /// From the scenario's spec.
    pub fn of(spec: &FailoverSpec) -> Self {
        let ttl = spec.lease_ttl_ms * MS;
        Self {
            lease_ttl_ns: ttl,
            margin_ns: leadership::key_window_ns(ttl),
            election_ns: spec.election_ms * MS,
            write_lag_ns: spec.write_lag_ms * MS,
            keep_alive_ns: leadership::keep_alive_every_ns(ttl),
        }
    }
}

/// A term: one leader's gate and what its replies wait for.
#[derive(Debug)]
pub struct Term {
    /// Its epoch.
    pub epoch: u64,
    /// Its gate.
    pub gate: Leadership,
    /// Records of this term durable so far (the core's count).
    pub durable_seq: u64,
    /// Replies waiting for records: (records needed, to, the batch, its
    /// reply).
    pub held: Vec<(u64, Node, LeaseBatch, LeaseReply)>,
}

/// A deposed leader still running: frozen through its lease, a successor
/// elected meanwhile.
pub struct Deposed {
    /// Its core as it was.
    pub core: AllocatorCore,
    /// Its term.
    pub term: Term,
    /// It sleeps until this true time (0: awake).
    pub asleep_until: u64,
}

/// The replicas and etcd.
pub struct Failover {
    /// Settings.
    pub cfg: Settings,
    /// The reservations durable in etcd.
    pub store: BTreeMap<KeyId, Reservation>,
    /// The current term (`None`: no leader yet).
    pub term: Option<Term>,
    /// etcd's expiry of the current leader's lease (true ns).
    pub lease_expires: u64,
    /// A deposed leader, if one still runs.
    pub deposed: Option<Deposed>,
    /// What a replica without a leader answers with.
    pub follower: Leadership,
    /// Last epoch elected.
    pub epoch: u64,
    /// Elections after the first.
    pub failovers: u64,
    /// Batches a deposed leader refused.
    pub deposed_refusals: u64,
    /// Batches a deposed leader granted (a fencing failure).
    pub deposed_grants: u64,
    /// Batches answered "no leader yet".
    pub no_leader_replies: u64,
}

impl Failover {
    /// No leader yet, nothing stored.
    pub fn new(spec: &FailoverSpec) -> Self {
        Self {
            cfg: Settings::of(spec),
            store: BTreeMap::new(),
            term: None,
            lease_expires: 0,
            deposed: None,
            follower: Leadership::new("sim://follower".into(), 500),
            epoch: 0,
            failovers: 0,
            deposed_refusals: 0,
            deposed_grants: 0,
            no_leader_replies: 0,
        }
    }

    /// Elect a leader at true time `t` (its clock reads `now`): a new core
    /// resumed from the store by [`term`] (the first has no predecessor),
    /// its promises durable before it serves (the election covers that).
    pub fn elect(&mut self, t: u64, now: u64, ttl_max_ns: u64, rules: RuleSet) -> AllocatorCore {
        let first = self.epoch == 0;
        self.epoch += 1;
        if !first {
            self.failovers += 1;
        }
        let durable = term::Durable {
            first,
            lost: false,
            // As the driver: the predecessor's leases may outlive the
            // read by TTL_max plus the key window.
            predecessor_ttl_max_ns: ttl_max_ns + self.cfg.margin_ns,
            ledger_id: 1,
            reservations: self.store.iter().map(|(k, v)| (k.clone(), *v)).collect(),
            checkpoint: None,
        };
        let cfg = term::config(
            CoreConfig {
                ttl_max_ns,
                ..CoreConfig::default()
            },
            &durable,
            term::Grace::default(),
            false,
        );
        let mut core = AllocatorCore::new(cfg, rules, self.epoch, self.epoch << 40, now);
        let (_, promises) = term::resume(&mut core, now, durable);
        for (k, v) in promises {
            self.store.insert(k, v);
        }
        let gate = Leadership::new(format!("sim://leader/{}", self.epoch), 500);
        // As the driver: a successor resumed from the reservations waits
        // out its predecessor's longest validity before it grants.
        let window = self.cfg.margin_ns;
        let serve_from = if first {
            0
        } else {
            leadership::successor_serves_from(now, window)
        };
        gate.lead(self.epoch, now + self.cfg.validity_ns(), serve_from);
        // Everything the resume wrote is durable: the core's count so far.
        let durable_seq = core.reservation_seq();
        if let Some(r) = core.reservations_mut() {
            let _ = r.take();
        }
        self.term = Some(Term {
            epoch: self.epoch,
            gate,
            durable_seq,
            held: Vec::new(),
        });
        self.lease_expires = t + self.cfg.lease_ttl_ns;
        core
    }

    /// A keep-alive of the current leader sent at `t` (clock `now`):
    /// renews the lease and the leader's validity, unless etcd has let it
    /// expire already (then the leader is deposed when the successor comes).
    pub fn keep_alive(&mut self, t: u64, now: u64) {
        let Some(term) = &self.term else { return };
        if t >= self.lease_expires {
            return;
        }
        self.lease_expires = t + self.cfg.lease_ttl_ns;
        term.gate.extend(term.epoch, now + self.cfg.validity_ns());
    }

    /// When the current leader's successor may serve (its lease's expiry
    /// plus the election).
    pub fn successor_at(&self) -> u64 {
        self.lease_expires + self.cfg.election_ns
    }

    /// Apply durable records of term `epoch`: only if it is the current
    /// one (every write is guarded by the leader key). Returns whether they
    /// were applied.
    pub fn commit(&mut self, epoch: u64, seq: u64, records: Vec<Record>) -> bool {
        let Some(term) = self.term.as_mut().filter(|t| t.epoch == epoch) else {
            return false;
        };
        for r in records {
            match r {
                Record::Set(k, v) => {
                    self.store.insert(k, v);
                }
                Record::AtRest(k) => {
                    self.store.remove(&k);
                }
            }
        }
        term.durable_seq = term.durable_seq.max(seq);
        true
    }

    /// A line for the report.
    pub fn summary(&self) -> String {
        format!(
            "failovers {}, batches answered \"no leader yet\" {}, refused by a deposed leader {}, granted by a deposed leader {}",
            self.failovers, self.no_leader_replies, self.deposed_refusals, self.deposed_grants
        )
    }
}

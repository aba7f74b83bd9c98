//! Whose state this is (SPEC §2 "First start"): what requesters present
//! of the ledger and run that served them, a lost or older state taken as
//! such (every key waits out the compiled `TTL_max` cap), and the alarm
//! while another live ledger of the cluster is seen.

use super::*;

impl AllocatorCore {
    /// A requester named another ledger than ours (SPEC §2 "First start"):
    /// our state was lost while it may still hold that ledger's leases, and
    /// we may have granted from full buckets already. Every key is treated
    /// as fully leased out until the longest lease any ledger can have
    /// granted (the compiled `TTL_max` cap) has surely expired, then as
    /// empty: the keys are forgotten (what we leased ends within that wait
    /// too) and nothing is granted before it.
    fn ledger_lost(&mut self, now_ns: u64, theirs: u64) {
        self.foreign_ledgers.push(theirs);
        self.state_lost(
            now_ns,
            format_args!(
                "a requester names another ledger ({theirs:016x}): this allocator's state was lost"
            ),
        );
    }

    /// Whether another live ledger was seen within [`LOG_EVERY_NS`] of
    /// `now_ns` (see [`Self::foreign_sighting`]).
    pub fn foreign_alarm(&self, now_ns: u64) -> bool {
        self.stats.foreign_seen_ns != 0
            && now_ns < self.stats.foreign_seen_ns.saturating_add(LOG_EVERY_NS)
    }

    /// A requester named a ledger (or a run) already taken for lost: its
    /// leases were counted out by the wait, but it still talks to another
    /// live allocator of the same cluster after that allocator answered
    /// it, or it would name ours. Two live ledgers serving the same
    /// requesters can each grant a whole burst: an alarm for as long as it
    /// is seen (a metric, and a log line every 10 s), never tolerated
    /// silently. (Right after a real loss, each holder's first batch names
    /// the old ledger once: a short alarm then.)
    fn foreign_sighting(&mut self, now_ns: u64, agent: &str, what: &str, id: u64) {
        self.stats.foreign_sightings += 1;
        self.stats.foreign_seen_ns = now_ns;
        if now_ns >= self.foreign_logged_ns.saturating_add(LOG_EVERY_NS) {
            self.foreign_logged_ns = now_ns;
            tracing::error!(
                agent,
                theirs = format_args!("{id:016x}"),
                ours = format_args!("{:016x}", self.cfg.ledger_id),
                sightings = self.stats.foreign_sightings,
                "a requester still names {what}: another allocator serves the same requesters (two live ledgers can each grant a whole burst); give each its own --cluster, or stop one (logged once every 10 s)"
            );
        }
    }

    /// Our state was lost or is older than what a requester saw: every key
    /// counts as fully leased out until the longest lease any ledger can
    /// have granted (the compiled `TTL_max` cap) has surely expired, then
    /// as empty (see [`Self::ledger_lost`]).
    fn state_lost(&mut self, now_ns: u64, why: std::fmt::Arguments<'_>) {
        let wait = CoreConfig {
            ttl_max_ns: TTL_MAX_CAP_NS.max(self.cfg.ttl_max_ns),
            ..self.cfg.clone()
        }
        .restart_wait_ns();
        let ready = now_ns.saturating_add(wait);
        self.ready_at_ns = Some(self.ready_at_ns.map_or(ready, |r| r.max(ready)));
        self.slots_predecessor_lost(ready);
        self.keys.clear();
        self.keys_per_rule.clear();
        self.sweep_due.clear();
        self.new_keys.clear();
        if let Some(r) = &mut self.reservations {
            // The log no longer describes this ledger: a restart must wait
            // the whole recorded TTL_max again (the driver deletes it).
            r.invalidate();
        }
        self.stats.ledgers_lost += 1;
        tracing::warn!(
            ours = format_args!("{:016x}", self.cfg.ledger_id),
            wait_s = wait / 1_000_000_000,
            "{why}; every key counts as fully leased out until the longest possible lease has expired (start with --new-ledger if those leases are known to be gone)"
        );
    }

    /// What a requester presents of the state that served it (SPEC §2
    /// "First start"): another ledger of our cluster, or a run (or more of
    /// a run's records) our state lacks, means our state was lost or is
    /// an older copy; [`Self::state_lost`] then.
    pub(super) fn check_presented(
        &mut self,
        now_ns: u64,
        batch: &LeaseBatch,
        header: &quotalease_proto::lease::RequestHeader,
    ) {
        // A batch meant for another shard presents that shard's ledger id
        // (agents keep one per shard): it says nothing of this ledger.
        let (shard, shards) = self.cfg.shard;
        let ours = shards <= 1 || batch.shard == shard;
        if self.cfg.ledger_id != 0
        && ours
        && !self.cfg.new_ledger
        && header.ledger_id != 0
        && header.ledger_id != self.cfg.ledger_id
        // Another cluster's ledger (or that of an allocator without
        // one, when this one has a cluster) says nothing of ours.
        && header.ledger_cluster == self.cfg.cluster
        {
            if self.foreign_ledgers.contains(&header.ledger_id) {
                self.foreign_sighting(now_ns, &header.agent_id, "another ledger", header.ledger_id);
            } else {
                self.ledger_lost(now_ns, header.ledger_id);
            }
        }
        // Our own ledger, but a run we have no record of, or more of a
        // run's records than we hold: we started from an older copy of our
        // state (a restored backup, a rolled-back volume, a reservation log
        // that lost its tail), and that requester may hold leases the copy
        // does not count (SPEC §2 "First start").
        if let Some(runs) = &self.cfg.runs {
            if ours
                && !self.cfg.new_ledger
                && header.ledger_id == self.cfg.ledger_id
                && header.run_id != 0
                && !runs.knows(header.run_id, header.record_seq, self.reservation_seq())
            {
                if self.foreign_runs.contains(&header.run_id) {
                    self.foreign_sighting(
                        now_ns,
                        &header.agent_id,
                        "a run of this ledger its state lacks",
                        header.run_id,
                    );
                } else {
                    self.foreign_runs.push(header.run_id);
                    self.state_lost(
                now_ns,
                format_args!(
                    "a requester saw run {:016x} of this ledger up to record {}, which this allocator's durable state (its state directory, or etcd) does not hold: it was restored from an older copy",
                    header.run_id, header.record_seq
                ),
            );
                }
            }
        }
    }

    /// A batch that reached this allocator while it leads but may not
    /// answer yet (an etcd term waiting out its predecessor's validity):
    /// nothing is applied or granted, but what it presents of the state
    /// that served it counts, so that a requester that saw a newer state
    /// than ours is heard within the term's start wait. A batch of another
    /// cluster, or without a header, says nothing.
    pub fn observe(&mut self, now_ns: u64, batch: &LeaseBatch) {
        let Some(header) = batch.header.as_ref() else {
            return;
        };
        if self.closed || (!self.cfg.cluster.is_empty() && header.cluster != self.cfg.cluster) {
            return;
        }
        self.check_presented(now_ns, batch, header);
    }
}

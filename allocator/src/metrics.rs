//! The allocator's `/metrics`: a snapshot of the global core's counters
//! (and, on a regional allocator, of its upstream counters), taken under
//! the core's lock and encoded after it is released, in the Prometheus
//! text format through `quotalease_model::exposition`. Labels are rule ids
//! and agent ids, never tenant or route values.

use std::collections::BTreeMap;

use quotalease_model::exposition::{self, Collector, DescriptorEncoder};

use crate::core::{AllocatorCore, Stats};
use crate::regional::{RegionalCore, RegionalStats};

/// What one scrape of an allocator shows.
#[derive(Debug)]
pub struct Snapshot {
    stats: Stats,
    reload_failures: u64,
    keys: u64,
    rule_version: u64,
    epoch: u64,
    /// Every current rule (0 if none) and every rule that has violations.
    shadow_violations: BTreeMap<String, u64>,
    rule_lag: Vec<(String, u64)>,
    regional: Option<Regional>,
    /// A global allocator: whether it leads now (always without `--etcd`).
    leader: Option<bool>,
    /// Another live ledger was seen within the last 10 s.
    foreign_alarm: bool,
}

#[derive(Debug)]
struct Regional {
    stats: RegionalStats,
    parent_reachable: bool,
}

impl Snapshot {
    /// Read the counters of `core` (the global core, or a regional's core).
    pub fn of_core(core: &AllocatorCore, reload_failures: u64) -> Self {
        let mut shadow_violations: BTreeMap<String, u64> = core
            .rules()
            .rules
            .iter()
            .map(|r| (r.id.clone(), 0))
            .collect();
        for (rule, v) in &core.stats().shadow_violations {
            shadow_violations.insert(rule.clone(), *v);
        }
        Self {
            stats: core.stats().clone(),
            reload_failures,
            keys: core.key_count() as u64,
            rule_version: core.rules().version,
            epoch: core.epoch(),
            shadow_violations,
            rule_lag: core.rule_lag(),
            regional: None,
            leader: None,
            foreign_alarm: false,
        }
    }

    /// Whether `core` saw another live ledger lately, as of `now_ns`.
    pub fn with_alarm(mut self, core: &AllocatorCore, now_ns: u64) -> Self {
        self.foreign_alarm = core.foreign_alarm(now_ns);
        self
    }

    /// Add the upstream counters of a regional allocator.
    pub fn with_regional(mut self, r: &RegionalCore) -> Self {
        self.regional = Some(Regional {
            stats: r.stats().clone(),
            parent_reachable: r.parent_reachable(),
        });
        self
    }

    /// A global allocator: say whether it leads (may grant).
    pub fn with_leader(mut self, leading: bool) -> Self {
        self.leader = Some(leading);
        self
    }

    /// The Prometheus text form.
    pub fn render(self) -> String {
        exposition::render(self)
    }
}

impl Collector for Snapshot {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let st = &self.stats;
        for (name, help, v) in [
            (
                "quotalease_allocator_lease_messages_total",
                "Lease batches handled (duplicates included).",
                st.messages,
            ),
            (
                "quotalease_allocator_lease_items_total",
                "Items in the lease batches handled.",
                st.items,
            ),
            (
                "quotalease_allocator_duplicate_messages_total",
                "Lease batches answered from the reply cache (a repeated sequence number).",
                st.duplicates,
            ),
            (
                "quotalease_allocator_stale_messages_total",
                "Lease batches answered STALE (older than the duplicate window).",
                st.stale,
            ),
            (
                "quotalease_allocator_seq_conflict_messages_total",
                "Lease batches refused as a repeated sequence number with other content (must stay 0).",
                st.seq_conflicts,
            ),
            (
                "quotalease_allocator_grants_total",
                "Leases granted with new tokens.",
                st.grants,
            ),
            (
                "quotalease_allocator_tokens_granted_total",
                "New tokens leased out.",
                st.tokens_granted,
            ),
            (
                "quotalease_allocator_tokens_carried_total",
                "Tokens carried over from renewed leases.",
                st.tokens_carried,
            ),
            (
                "quotalease_allocator_tokens_handed_back_total",
                "Tokens holders of rate leases handed back of a shrink (a renewal's left).",
                st.tokens_handed_back,
            ),
            (
                "quotalease_allocator_releases_total",
                "Lease releases applied.",
                st.releases,
            ),
            (
                "quotalease_allocator_tokens_released_total",
                "Tokens returned by releases.",
                st.tokens_released,
            ),
            (
                "quotalease_allocator_key_limit_refusals_total",
                "Items refused because their rule reached max_keys.",
                st.key_limit_refusals,
            ),
            (
                "quotalease_allocator_keys_dropped_total",
                "Keys dropped because their bucket was full and nothing was outstanding.",
                st.keys_dropped,
            ),
            (
                "quotalease_allocator_ledgers_lost_total",
                "Requesters that named another ledger: this allocator's state was lost and it waited the TTL_max cap.",
                st.ledgers_lost,
            ),
            (
                "quotalease_allocator_wrong_cluster_refusals_total",
                "Batches refused because their requester is of another cluster (or of none, when this allocator has one).",
                st.wrong_cluster,
            ),
            (
                "quotalease_allocator_foreign_ledger_sightings_total",
                "Batches naming a ledger (or a run of this one) already taken for lost: another live allocator serves the same requesters.",
                st.foreign_sightings,
            ),
            (
                "quotalease_allocator_tokens_expired_unused_total",
                "Tokens of leases that expired unspent (as far as reported).",
                st.tokens_expired_unused,
            ),
            (
                "quotalease_allocator_rules_reload_failures_total",
                "Rules files that failed to load; the last good rules keep serving.",
                self.reload_failures,
            ),
            (
                "quotalease_allocator_slots_granted_total",
                "Fresh slots lent on slot leases (in-flight limits).",
                st.slots_granted,
            ),
            (
                "quotalease_allocator_slot_releases_total",
                "Slot leases given back by their holders.",
                st.slot_releases,
            ),
            (
                "quotalease_allocator_slot_resume_waits_total",
                "Slot asks naming a lease of a restarted regional's predecessor answered RESUMING (asked again once the regional resumed the key's parent lease).",
                st.slot_resume_waits,
            ),
            (
                "quotalease_allocator_permit_releases_forwarded_total",
                "Permit releases forwarded to their holder through this allocator.",
                st.forwarded_releases,
            ),
            (
                "quotalease_allocator_slot_force_releases_total",
                "Slot leases an operator freed (POST /v1/slots/release; audited in the log).",
                st.slot_force_releases,
            ),
        ] {
            exposition::counter(&mut enc, name, help, v)?;
        }
        exposition::gauge(
            &mut enc,
            "quotalease_allocator_foreign_ledger_alarm",
            "1 while requesters named another live ledger (or a run of this one its state lacks) within the last 10 s: two allocators serve the same requesters and each may grant a whole burst.",
            u64::from(self.foreign_alarm),
        )?;
        exposition::gauge(
            &mut enc,
            "quotalease_allocator_keys",
            "Keys with a ledger in memory.",
            self.keys,
        )?;
        exposition::gauge(
            &mut enc,
            "quotalease_allocator_rule_version",
            "Version of the rules this allocator applies.",
            self.rule_version,
        )?;
        exposition::gauge(
            &mut enc,
            "quotalease_allocator_epoch",
            "Epoch this allocator grants under.",
            self.epoch,
        )?;
        if let Some(leading) = self.leader {
            exposition::gauge(
                &mut enc,
                "quotalease_allocator_leader",
                "1 while this global allocator may grant: always without --etcd; with --etcd on the elected leader only, else 0.",
                u64::from(leading),
            )?;
        }
        exposition::counters(
            &mut enc,
            "quotalease_allocator_shadow_violations_total",
            "Grants the independent shadow bucket says would break I1, by rule (must stay 0).",
            self.shadow_violations
                .iter()
                .map(|(rule, v)| ([("rule", rule.as_str())], *v)),
        )?;
        exposition::gauges(
            &mut enc,
            "quotalease_allocator_agent_rule_version_lag",
            "Published rule versions each agent (by agent id) is behind.",
            self.rule_lag
                .iter()
                .map(|(agent, lag)| ([("agent", agent.as_str())], *lag)),
        )?;
        let Some(r) = &self.regional else {
            return Ok(());
        };
        let st = &r.stats;
        for (name, help, v) in [
            (
                "quotalease_regional_upstream_messages_total",
                "Lease batches sent to the parent allocator (heartbeats included).",
                st.upstream_messages,
            ),
            (
                "quotalease_regional_upstream_items_total",
                "Items in the batches sent to the parent.",
                st.upstream_items,
            ),
            (
                "quotalease_regional_upstream_heartbeats_total",
                "Batches sent to the parent without items.",
                st.upstream_heartbeats,
            ),
            (
                "quotalease_regional_upstream_heartbeats_superseded_total",
                "Heartbeats whose reply was not waited for: a batch opening a key went out instead.",
                st.upstream_heartbeats_superseded,
            ),
            (
                "quotalease_regional_upstream_replies_total",
                "Parent replies applied.",
                st.upstream_replies,
            ),
            (
                "quotalease_regional_upstream_failures_total",
                "Batches to the parent that failed, timed out or were answered STALE or UNSUPPORTED.",
                st.upstream_failures,
            ),
            (
                "quotalease_regional_slot_asks_total",
                "Slot asks (items) sent to the parent for children's permits.",
                st.slot_asks,
            ),
            (
                "quotalease_regional_slot_resends_total",
                "Batches of slot asks sent again (same batch) after a failure.",
                st.slot_resends,
            ),
            (
                "quotalease_regional_slot_chain_breaks_total",
                "Parent slot leases that broke: the parent kept less than asked; a new pool started.",
                st.slot_chain_breaks,
            ),
            (
                "quotalease_regional_slot_chains_lapsed_total",
                "Parent slot leases that reached their deadline unrenewed (a cut).",
                st.slot_chains_lapsed,
            ),
            (
                "quotalease_regional_slot_resumes_total",
                "Parent slot leases resumed after a restart with slots the predecessor's children may hold (adopted by their renewals).",
                st.slot_resumes,
            ),
            (
                "quotalease_regional_slots_resumed_total",
                "Slots of the predecessor's parent slot leases kept by those resumes.",
                st.slots_resumed,
            ),
            (
                "quotalease_regional_tokens_from_parent_total",
                "Fresh tokens received from the parent.",
                st.tokens_from_parent,
            ),
            (
                "quotalease_regional_tokens_returned_total",
                "Tokens given back to the parent by releases.",
                st.tokens_returned,
            ),
            (
                "quotalease_regional_tokens_destroyed_total",
                "Pool tokens dropped on a chain break, lapse or shutdown.",
                st.tokens_destroyed,
            ),
            (
                "quotalease_regional_tokens_handed_back_total",
                "Pool tokens a smaller capacity did not fit, handed back to the parent.",
                st.tokens_handed_back,
            ),
            (
                "quotalease_regional_chain_breaks_total",
                "Chains that broke (the parent did not carry this regional's lease).",
                st.chain_breaks,
            ),
            (
                "quotalease_regional_chains_lapsed_total",
                "Chains dropped at their deadline without renewal.",
                st.chains_lapsed,
            ),
            (
                "quotalease_regional_rules_adopted_total",
                "Rule sets adopted from the parent.",
                st.rules_adopted,
            ),
            (
                "quotalease_regional_upstream_mismatched_replies_total",
                "Parent replies ignored because they answer another request.",
                st.upstream_mismatched_replies,
            ),
        ] {
            exposition::counter(&mut enc, name, help, v)?;
        }
        exposition::gauge(
            &mut enc,
            "quotalease_regional_parent_reachable",
            "1 when the last call to the parent succeeded within the fetch timeout, else 0.",
            u64::from(r.parent_reachable),
        )
    }
}

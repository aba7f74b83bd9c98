//! Agent counters and their Prometheus text form (through
//! `quotalease_model::exposition`). Labels are rule ids and results, never
//! tenant or route values.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use quotalease_model::exposition::{self, Collector, DescriptorEncoder, Histogram};

/// Threads (this many alive at once; an exited thread's index is reused)
/// that get a cell of their own in every counter: their adds are a plain
/// load and store, no locked read-modify-write. Threads beyond share
/// striped cells with `fetch_add`.
const OWN_CELLS: usize = 16;
const SHARED_CELLS: usize = 4;

#[repr(align(128))]
#[derive(Debug, Default)]
struct Padded(AtomicU64);

/// A counter with a single-writer cell per thread (for the first
/// [`OWN_CELLS`] threads) and striped shared cells for the rest, each on
/// its own cache line, so that threads counting on the request path never
/// contend and the common case writes without a locked instruction.
#[derive(Debug, Default)]
pub struct Counter {
    own: [Padded; OWN_CELLS],
    shared: [Padded; SHARED_CELLS],
}

/// A thread's cell index; given back when the thread exits, so threads that
/// come and go (a pool resizing, `spawn_blocking`) do not use up the own
/// cells. Single writer still: the next owner of an index takes it from
/// the free list after the previous one gave it back on exit (the lock
/// orders the previous owner's last store before the next owner's load).
struct ThreadIndex(usize);

static FREE_INDICES: Mutex<Vec<usize>> = Mutex::new(Vec::new());

impl Drop for ThreadIndex {
    fn drop(&mut self) {
        // Anything this thread counts from here on (other thread-locals'
        // destructors) goes to a shared cell.
        let _ = THREAD_INDEX.try_with(|i| i.set(OWN_CELLS));
        FREE_INDICES.lock().push(self.0);
    }
}

thread_local! {
    /// The index itself: a plain thread-local read on the request path.
    static THREAD_INDEX: std::cell::Cell<usize> = const { std::cell::Cell::new(usize::MAX) };
    /// Gives the index back when the thread exits.
    static INDEX_GUARD: std::cell::RefCell<Option<ThreadIndex>> = const { std::cell::RefCell::new(None) };
}

/// This thread's index (held until the thread exits, then reused).
#[inline]
pub(crate) fn thread_index() -> usize {
    THREAD_INDEX.with(|s| {
        let i = s.get();
        if i != usize::MAX {
            return i;
        }
        claim_index(s)
    })
}

#[cold]
fn claim_index(cell: &std::cell::Cell<usize>) -> usize {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let free = FREE_INDICES.lock().pop();
    let i = free.unwrap_or_else(|| NEXT.fetch_add(1, Ordering::Relaxed) as usize);
    if INDEX_GUARD
        .try_with(|g| *g.borrow_mut() = Some(ThreadIndex(i)))
        .is_err()
    {
        // The thread is exiting: nothing would give the index back.
        FREE_INDICES.lock().push(i);
        cell.set(OWN_CELLS);
        return OWN_CELLS;
    }
    cell.set(i);
    i
}

impl Counter {
    /// Add `n`.
    #[inline]
    pub fn add(&self, n: u64) {
        self.add_at(thread_index(), n)
    }

    /// Add `n` from the thread whose [`thread_index`] is `i` (read once
    /// for several counters).
    #[inline]
    pub(crate) fn add_at(&self, i: usize, n: u64) {
        match self.own.get(i) {
            // Single writer: this thread alone writes this cell.
            Some(c) => c.0.store(
                c.0.load(Ordering::Relaxed).wrapping_add(n),
                Ordering::Relaxed,
            ),
            None => {
                self.shared[i % SHARED_CELLS]
                    .0
                    .fetch_add(n, Ordering::Relaxed);
            }
        }
    }

    /// The total.
    pub fn get(&self) -> u64 {
        self.own
            .iter()
            .chain(self.shared.iter())
            .map(|s| s.0.load(Ordering::Relaxed))
            .fold(0u64, u64::wrapping_add)
    }
}

/// Checks counted for one rule, by result.
#[derive(Debug, Default)]
pub struct RuleCounters {
    /// Requests admitted that this rule matched (and charged).
    pub allowed: Counter,
    /// Requests this rule denied.
    pub over_limit: Counter,
    /// Requests this rule's fail policy denied (or answered unavailable).
    pub failure_mode_denied: Counter,
    /// Requests this rule's fail-open emergency bucket admitted.
    pub failure_mode_allowed: Counter,
}

/// Per-rule counters, aligned by index with the rule set of `version`.
#[derive(Debug, Default)]
pub struct RuleCounterSet {
    /// Rule set version these belong to.
    pub version: u64,
    /// (rule id, counters), in rule-set order.
    pub rules: Vec<(String, std::sync::Arc<RuleCounters>)>,
}

impl RuleCounterSet {
    /// Counters for `rules`, keeping those of rules that already had some.
    pub fn for_rules(rules: &quotalease_model::rules::RuleSet, previous: &RuleCounterSet) -> Self {
        Self {
            version: rules.version,
            rules: rules
                .rules
                .iter()
                .map(|r| {
                    let kept = previous
                        .rules
                        .iter()
                        .find(|(id, _)| *id == r.id)
                        .map(|(_, c)| c.clone())
                        .unwrap_or_default();
                    (r.id.clone(), kept)
                })
                .collect(),
        }
    }

    /// The counters of the rule with this id.
    pub fn get(&self, id: &str) -> Option<&RuleCounters> {
        self.rules.iter().find(|(r, _)| r == id).map(|(_, c)| &**c)
    }
}

/// Counters of one agent.
#[derive(Debug, Default)]
pub struct AgentMetrics {
    /// Admitted.
    pub allowed: Counter,
    /// Denied over the limit.
    pub over_limit: Counter,
    /// No rule matched.
    pub no_rule: Counter,
    /// Invalid input.
    pub invalid: Counter,
    /// Answered unavailable (fail-closed, no rules yet).
    pub unavailable: Counter,
    /// Denied by a `lease_only` (or, for now, `open`) fail policy.
    pub failure_mode_denied: Counter,
    /// Of the `unavailable` answers, those of fail-closed rules (they are
    /// failure-mode denials too).
    pub closed_unavailable: Counter,
    /// Admitted by a fail policy (the fail-open emergency bucket).
    pub failure_mode_allowed: Counter,
    /// Shadow rules that would have denied.
    pub shadow_over_limit: Counter,
    /// Idempotent replays answered from memory.
    pub replays: Counter,
    /// Checks that waited for a lease.
    pub waits: Counter,
    /// Allocator messages sent (retries included).
    pub messages: Counter,
    /// Failed allocator calls.
    pub rpc_errors: Counter,
    /// New tokens received in leases.
    pub tokens_leased: Counter,
    /// Unused tokens given back.
    pub tokens_released: Counter,
    /// Tokens a smaller rate version clipped from a lease word, handed
    /// back with the renewal naming that version.
    pub tokens_handed_back: Counter,
    /// Tokens a lease still held when it ran out.
    pub tokens_expired_unused: Counter,
    /// Allocator replies ignored because they do not answer the request
    /// they came back for (sequence number, grant count or digest).
    pub mismatched_replies: Counter,
    /// Batches the allocator refused as a repeated sequence number with
    /// other content.
    pub seq_conflicts: Counter,
    /// Grants answered `STALE` (the allocator had seen newer sequence
    /// numbers past its duplicate window first); their keys are asked again.
    pub stale_replies: Counter,
    /// Renewal tasks that died (a panic); the agent is then not ready.
    pub renewal_task_failures: Counter,
    /// Renewal round trips (an allocator call; never the request path).
    renewal: RenewalLatency,
    /// Per rule: allocator messages that carried at least one of its keys.
    messages_by_rule: Mutex<std::collections::BTreeMap<String, u64>>,
    /// Per rule: checks by result.
    pub by_rule: arc_swap::ArcSwap<RuleCounterSet>,
    /// Permits (issue 34): acquires answered, by result.
    pub permits: PermitMetrics,
}

/// The permit driver's counters and gauges.
#[derive(Debug, Default)]
pub struct PermitMetrics {
    /// Acquires that got permits from slots.
    pub acquired: Counter,
    /// Acquires that got emergency permits (fail-open, unreachable).
    pub failure_mode: Counter,
    /// Acquires whose wait ran out.
    pub timeouts: Counter,
    /// Acquires answered unavailable (fail-closed, unreachable).
    pub unavailable: Counter,
    /// Acquires not queued: too many already wait for the key here.
    pub queue_full: Counter,
    /// Permits released.
    pub released: Counter,
    /// Permits that reached their expiry unreleased.
    pub expired: Counter,
    /// Releases of other agents' permits forwarded through the allocator.
    pub forwarded_sent: Counter,
    /// Releases of this agent's permits that came through the allocator
    /// from another agent and released a permit held here.
    pub forwarded_applied: Counter,
    /// `WaitSlots` wake-ups answered: slots freed at the allocator for a
    /// key whose waiters missed some.
    pub wakeups_room: Counter,
    /// The same: another holder misses slots (free ones go back at once).
    pub wakeups_contended: Counter,
    /// Permits held here, as the driver last counted (every tick).
    pub held: std::sync::atomic::AtomicU64,
    /// Acquires waiting here, as the driver last counted.
    pub waiting: std::sync::atomic::AtomicU64,
    /// How long acquires that got a permit waited.
    wait: RenewalLatency,
}

impl PermitMetrics {
    /// Record how long an acquire that got a permit waited.
    pub fn record_wait(&self, d: Duration) {
        self.wait.0.observe(d.as_secs_f64());
    }
}

impl AgentMetrics {
    /// Decisions made (replays excluded): the sum of every result.
    pub fn checks(&self) -> u64 {
        self.allowed.get()
            + self.over_limit.get()
            + self.no_rule.get()
            + self.invalid.get()
            + self.unavailable.get()
            + self.failure_mode_denied.get()
    }

    /// Record one allocator round trip.
    pub fn record_renewal(&self, d: Duration) {
        self.renewal.0.observe(d.as_secs_f64());
    }

    /// Count one message for each rule it carried keys of.
    pub fn record_message_rules<'a>(&self, rules: impl Iterator<Item = &'a str>) {
        let mut seen: Vec<&str> = rules.collect();
        seen.sort_unstable();
        seen.dedup();
        let mut m = self.messages_by_rule.lock();
        for r in seen {
            match m.get_mut(r) {
                Some(v) => *v += 1,
                None => {
                    m.insert(r.to_string(), 1);
                }
            }
        }
    }

    /// Allocator messages that carried keys of `rule`.
    pub fn messages_for_rule(&self, rule: &str) -> u64 {
        self.messages_by_rule.lock().get(rule).copied().unwrap_or(0)
    }

    /// Prometheus text exposition (format 0.0.4; serve it with
    /// [`quotalease_model::exposition::CONTENT_TYPE`]).
    pub fn render(&self, keys_held: usize, rule_version: u64, ready: bool) -> String {
        let g = |a: &Counter| a.get();
        let snapshot = Snapshot {
            checks: [
                ("allowed", g(&self.allowed)),
                ("over_limit", g(&self.over_limit)),
                ("no_rule", g(&self.no_rule)),
                ("invalid", g(&self.invalid)),
                ("unavailable", g(&self.unavailable)),
                ("failure_mode_denied", g(&self.failure_mode_denied)),
            ],
            totals: [
                (
                    "quotalease_agent_failure_mode_allowed_total",
                    "Checks admitted by a fail policy (the fail-open emergency bucket).",
                    g(&self.failure_mode_allowed),
                ),
                (
                    "quotalease_agent_failure_mode_denied_total",
                    "Checks denied by a fail policy (lease_only and open denials, closed unavailable answers).",
                    g(&self.failure_mode_denied) + g(&self.closed_unavailable),
                ),
                (
                    "quotalease_agent_shadow_over_limit_total",
                    "Checks that a shadow rule would have denied (admitted all the same).",
                    g(&self.shadow_over_limit),
                ),
                (
                    "quotalease_agent_replays_total",
                    "Repeated checks (same request id) answered from memory, charging nothing.",
                    g(&self.replays),
                ),
                (
                    "quotalease_agent_lease_waits_total",
                    "Checks that waited for a lease.",
                    g(&self.waits),
                ),
                (
                    "quotalease_agent_allocator_messages_total",
                    "Lease batches sent to the allocator (retries included).",
                    g(&self.messages),
                ),
                (
                    "quotalease_agent_allocator_errors_total",
                    "Failed allocator calls.",
                    g(&self.rpc_errors),
                ),
                (
                    "quotalease_agent_tokens_leased_total",
                    "New tokens received in leases.",
                    g(&self.tokens_leased),
                ),
                (
                    "quotalease_agent_tokens_expired_unused_total",
                    "Tokens a lease still held when it ran out.",
                    g(&self.tokens_expired_unused),
                ),
                (
                    "quotalease_agent_tokens_released_total",
                    "Unused tokens given back to the allocator.",
                    g(&self.tokens_released),
                ),
                (
                    "quotalease_agent_tokens_handed_back_total",
                    "Tokens a smaller rate version clipped from a lease, handed back with the renewal naming it.",
                    g(&self.tokens_handed_back),
                ),
                (
                    "quotalease_agent_mismatched_replies_total",
                    "Allocator replies ignored because they answer another request.",
                    g(&self.mismatched_replies),
                ),
                (
                    "quotalease_agent_stale_replies_total",
                    "Grants answered STALE (reordered past the duplicate window) and asked again.",
                    g(&self.stale_replies),
                ),
                (
                    "quotalease_agent_seq_conflicts_total",
                    "Batches the allocator refused as a repeated sequence number with other content (must stay 0).",
                    g(&self.seq_conflicts),
                ),
                (
                    "quotalease_agent_renewal_task_failures_total",
                    "Renewal tasks that died; the agent is not ready after one.",
                    g(&self.renewal_task_failures),
                ),
            ],
            by_rule: self
                .by_rule
                .load()
                .rules
                .iter()
                .map(|(rule, c)| {
                    (
                        rule.clone(),
                        [
                            ("allowed", c.allowed.get()),
                            ("over_limit", c.over_limit.get()),
                            ("failure_mode_denied", c.failure_mode_denied.get()),
                            ("failure_mode_allowed", c.failure_mode_allowed.get()),
                        ],
                    )
                })
                .collect(),
            messages_by_rule: self
                .messages_by_rule
                .lock()
                .iter()
                .map(|(r, v)| (r.clone(), *v))
                .collect(),
            keys_held: keys_held as u64,
            rule_version,
            ready,
            renewal: self.renewal.0.clone(),
            permit_acquires: [
                ("acquired", g(&self.permits.acquired)),
                ("failure_mode", g(&self.permits.failure_mode)),
                ("timeout", g(&self.permits.timeouts)),
                ("unavailable", g(&self.permits.unavailable)),
                ("queue_full", g(&self.permits.queue_full)),
            ],
            permits_released: g(&self.permits.released),
            permits_forwarded: [
                ("sent", g(&self.permits.forwarded_sent)),
                ("applied", g(&self.permits.forwarded_applied)),
            ],
            permit_wakeups: [
                ("room", g(&self.permits.wakeups_room)),
                ("contended", g(&self.permits.wakeups_contended)),
            ],
            permits_expired: g(&self.permits.expired),
            permits_held: self.permits.held.load(std::sync::atomic::Ordering::Relaxed),
            permits_waiting: self.permits.waiting.load(std::sync::atomic::Ordering::Relaxed),
            permit_wait: self.permits.wait.0.clone(),
        };
        exposition::render(snapshot)
    }
}

/// What one scrape shows, read from the counters at once; encoded after.
#[derive(Debug)]
struct Snapshot {
    checks: [(&'static str, u64); 6],
    /// (name, help, value) of the unlabelled counters.
    totals: [(&'static str, &'static str, u64); 15],
    by_rule: Vec<(String, [(&'static str, u64); 4])>,
    messages_by_rule: Vec<(String, u64)>,
    keys_held: u64,
    rule_version: u64,
    ready: bool,
    renewal: Histogram,
    permit_acquires: [(&'static str, u64); 5],
    permits_released: u64,
    permits_forwarded: [(&'static str, u64); 2],
    permit_wakeups: [(&'static str, u64); 2],
    permits_expired: u64,
    permits_held: u64,
    permits_waiting: u64,
    permit_wait: Histogram,
}

impl Collector for Snapshot {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        exposition::counters(
            &mut enc,
            "quotalease_agent_checks_total",
            "Checks decided, by result (replays excluded).",
            self.checks
                .iter()
                .map(|&(result, v)| ([("result", result)], v)),
        )?;
        for &(name, help, v) in &self.totals {
            exposition::counter(&mut enc, name, help, v)?;
        }
        exposition::counters(
            &mut enc,
            "quotalease_agent_rule_checks_total",
            "Checks by rule and result: an admission counts for every rule the request matched, a denial for the rule that denied it.",
            self.by_rule.iter().flat_map(|(rule, rows)| {
                rows.iter()
                    .map(move |&(result, v)| ([("rule", rule.as_str()), ("result", result)], v))
            }),
        )?;
        exposition::counters(
            &mut enc,
            "quotalease_agent_allocator_messages_by_rule_total",
            "Lease batches sent to the allocator that carried at least one key of the rule.",
            self.messages_by_rule
                .iter()
                .map(|(rule, v)| ([("rule", rule.as_str())], *v)),
        )?;
        exposition::gauge(
            &mut enc,
            "quotalease_agent_keys_held",
            "Keys this agent holds state for.",
            self.keys_held,
        )?;
        exposition::gauge(
            &mut enc,
            "quotalease_agent_rule_version",
            "Version of the rules this agent applies (0: none yet).",
            self.rule_version,
        )?;
        exposition::gauge(
            &mut enc,
            "quotalease_agent_ready",
            "1 when the agent has rules and reached its allocator, else 0.",
            u64::from(self.ready),
        )?;
        exposition::histogram(
            &mut enc,
            "quotalease_agent_renewal_latency_seconds",
            "Round trip of a lease batch to the allocator, from its first send to the reply (retries included).",
            &self.renewal,
        )?;
        exposition::counters(
            &mut enc,
            "quotalease_agent_permit_acquires_total",
            "Permit acquires answered, by result (failure_mode: an emergency permit of a fail-open rule).",
            self.permit_acquires
                .iter()
                .map(|&(result, v)| ([("result", result)], v)),
        )?;
        exposition::counter(
            &mut enc,
            "quotalease_agent_permits_released_total",
            "Permits released.",
            self.permits_released,
        )?;
        exposition::counters(
            &mut enc,
            "quotalease_agent_permit_forwarded_releases_total",
            "Permit releases forwarded through the allocator: sent (another agent's permit released here) and applied (a permit held here released through another agent).",
            self.permits_forwarded
                .iter()
                .map(|&(direction, v)| ([("direction", direction)], v)),
        )?;
        exposition::counters(
            &mut enc,
            "quotalease_agent_permit_wakeups_total",
            "WaitSlots wake-ups the allocator answered, by reason: room (slots freed for a key whose waiters missed some: they ask at once) and contended (another holder misses slots: free ones go back at once).",
            self.permit_wakeups
                .iter()
                .map(|&(reason, v)| ([("reason", reason)], v)),
        )?;
        exposition::counter(
            &mut enc,
            "quotalease_agent_permits_expired_total",
            "Permits that reached their expiry unreleased.",
            self.permits_expired,
        )?;
        exposition::gauge(
            &mut enc,
            "quotalease_agent_permits_held",
            "Permits held at this agent.",
            self.permits_held,
        )?;
        exposition::gauge(
            &mut enc,
            "quotalease_agent_permits_waiting",
            "Permit acquires waiting at this agent.",
            self.permits_waiting,
        )?;
        exposition::histogram(
            &mut enc,
            "quotalease_agent_permit_wait_seconds",
            "How long acquires that got a permit waited.",
            &self.permit_wait,
        )
    }
}

/// Renewal round trips, in seconds, in Prometheus histogram buckets.
#[derive(Debug)]
struct RenewalLatency(Histogram);

impl Default for RenewalLatency {
    fn default() -> Self {
        Self(exposition::latency_histogram())
    }
}

#[cfg(test)]
mod thread_cells {
    use super::*;

    /// Threads that come and go reuse the own cells (none falls back to a
    /// shared cell while fewer than OWN_CELLS live), and no count is lost.
    #[test]
    fn exited_threads_give_their_cells_back() {
        let c = std::sync::Arc::new(Counter::default());
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..4 * OWN_CELLS {
            let c = c.clone();
            let i = std::thread::spawn(move || {
                c.add(1);
                thread_index()
            })
            .join()
            .expect("counting thread");
            seen.insert(i);
        }
        // One thread at a time: without reuse, 64 distinct indices (and
        // all but the first few in shared cells). Other tests' threads may
        // take a freed index now and then, never most of them.
        assert!(seen.len() < OWN_CELLS, "indices used: {seen:?}");
        assert_eq!(c.get(), 4 * OWN_CELLS as u64);
    }
}

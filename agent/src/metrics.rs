//! Agent counters and their Prometheus text form. Labels are rule ids and
//! results, never tenant or route values.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

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
    renewal_us: Mutex<Option<hdrhistogram::Histogram<u64>>>,
    /// Per rule: allocator messages that carried at least one of its keys.
    messages_by_rule: Mutex<std::collections::BTreeMap<String, u64>>,
    /// Per rule: checks by result.
    pub by_rule: arc_swap::ArcSwap<RuleCounterSet>,
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
        let mut h = self.renewal_us.lock();
        let h = h.get_or_insert_with(|| {
            hdrhistogram::Histogram::new_with_bounds(1, 60_000_000, 2)
                .expect("static histogram bounds are valid")
        });
        let _ = h.record((d.as_micros() as u64).clamp(1, 60_000_000));
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

    /// Renewal round-trip percentile in microseconds.
    pub fn renewal_percentile_us(&self, q: f64) -> u64 {
        self.renewal_us
            .lock()
            .as_ref()
            .map(|h| h.value_at_quantile(q))
            .unwrap_or(0)
    }

    /// Prometheus text exposition.
    pub fn render(&self, keys_held: usize, rule_version: u64, ready: bool) -> String {
        let g = |a: &Counter| a.get();
        let mut s = String::new();
        let _ = writeln!(s, "# TYPE quotalease_agent_checks_total counter");
        for (result, v) in [
            ("allowed", g(&self.allowed)),
            ("over_limit", g(&self.over_limit)),
            ("no_rule", g(&self.no_rule)),
            ("invalid", g(&self.invalid)),
            ("unavailable", g(&self.unavailable)),
            ("failure_mode_denied", g(&self.failure_mode_denied)),
        ] {
            let _ = writeln!(
                s,
                "quotalease_agent_checks_total{{result=\"{result}\"}} {v}"
            );
        }
        for (name, help, v) in [
            (
                "failure_mode_allowed_total",
                "admitted by a fail policy",
                g(&self.failure_mode_allowed),
            ),
            (
                "failure_mode_denied_total",
                "denied by a fail policy (lease_only and open denials, closed unavailable answers)",
                g(&self.failure_mode_denied) + g(&self.closed_unavailable),
            ),
            (
                "shadow_over_limit_total",
                "shadow rules that would have denied",
                g(&self.shadow_over_limit),
            ),
            (
                "replays_total",
                "idempotent replays answered from memory",
                g(&self.replays),
            ),
            (
                "lease_waits_total",
                "checks that waited for a lease",
                g(&self.waits),
            ),
            (
                "allocator_messages_total",
                "allocator messages sent",
                g(&self.messages),
            ),
            (
                "allocator_errors_total",
                "failed allocator calls",
                g(&self.rpc_errors),
            ),
            (
                "tokens_leased_total",
                "new tokens received",
                g(&self.tokens_leased),
            ),
            (
                "tokens_expired_unused_total",
                "tokens a lease still held when it ran out",
                g(&self.tokens_expired_unused),
            ),
            (
                "tokens_released_total",
                "unused tokens given back",
                g(&self.tokens_released),
            ),
            (
                "mismatched_replies_total",
                "allocator replies ignored because they answer another request",
                g(&self.mismatched_replies),
            ),
            (
                "stale_replies_total",
                "grants answered STALE (reordered past the duplicate window) and asked again",
                g(&self.stale_replies),
            ),
            (
                "seq_conflicts_total",
                "batches refused as a repeated sequence number with other content",
                g(&self.seq_conflicts),
            ),
            (
                "renewal_task_failures_total",
                "renewal tasks that died; the agent is not ready after one",
                g(&self.renewal_task_failures),
            ),
        ] {
            let _ = writeln!(s, "# HELP quotalease_agent_{name} {help}\n# TYPE quotalease_agent_{name} counter\nquotalease_agent_{name} {v}");
        }
        let _ = writeln!(s, "# TYPE quotalease_agent_rule_checks_total counter");
        for (rule, c) in self.by_rule.load().rules.iter() {
            let rule = rule.escape_default();
            for (result, v) in [
                ("allowed", c.allowed.get()),
                ("over_limit", c.over_limit.get()),
                ("failure_mode_denied", c.failure_mode_denied.get()),
                ("failure_mode_allowed", c.failure_mode_allowed.get()),
            ] {
                let _ = writeln!(
                    s,
                    "quotalease_agent_rule_checks_total{{rule=\"{rule}\",result=\"{result}\"}} {v}"
                );
            }
        }
        let _ = writeln!(
            s,
            "# TYPE quotalease_agent_allocator_messages_by_rule_total counter"
        );
        for (rule, v) in self.messages_by_rule.lock().iter() {
            let _ = writeln!(
                s,
                "quotalease_agent_allocator_messages_by_rule_total{{rule=\"{}\"}} {v}",
                rule.escape_default()
            );
        }
        let _ = writeln!(
            s,
            "# TYPE quotalease_agent_keys_held gauge\nquotalease_agent_keys_held {keys_held}"
        );
        let _ = writeln!(s, "# TYPE quotalease_agent_rule_version gauge\nquotalease_agent_rule_version {rule_version}");
        let _ = writeln!(
            s,
            "# TYPE quotalease_agent_ready gauge\nquotalease_agent_ready {}",
            u8::from(ready)
        );
        let _ = writeln!(s, "# TYPE quotalease_agent_renewal_latency_us summary");
        for q in [0.5, 0.99, 0.999] {
            let _ = writeln!(
                s,
                "quotalease_agent_renewal_latency_us{{quantile=\"{q}\"}} {}",
                self.renewal_percentile_us(q)
            );
        }
        s
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

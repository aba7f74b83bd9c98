//! The tokio driver of the agent core: a pump (ENGINEERING §8). It sleeps
//! until the core's `poll_timeout`, a wake-up by a waiting request, or an
//! allocator call's outcome; feeds that to the core; sends what
//! `poll_transmit` returns, each call on its own task; and acts on
//! `poll_event` (wakes parked requests). Retries, timeouts, backpressure
//! and outage decisions are the core's, so the simulator, which pumps the
//! same core, runs the same policy.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::MutexGuard;
use quotalease_proto::lease::LeaseReply;
use tokio::sync::Notify;
use tokio::task::JoinSet;

use crate::core::{AgentCore, Event};
use crate::metrics::AgentMetrics;
use crate::transport::Transport;

type Outcome = (u64, u32, Result<LeaseReply, String>);

/// What the driver pumps: the agent's core and what surrounds it (its
/// clock, wake-ups, metrics). The agent facade implements it; the driver
/// knows nothing else of the facade.
pub(crate) trait Pumped {
    /// The core, locked.
    fn core(&self) -> MutexGuard<'_, AgentCore>;
    /// The agent's clock.
    fn now(&self) -> u64;
    /// The bound of one allocator call (`fetch_timeout`).
    fn fetch_timeout(&self) -> Duration;
    /// A core event to act on (wake parked requests, record).
    fn note_event(&self, ev: Event);
    /// Whether the agent is stopping.
    fn stopping(&self) -> bool;
    /// (woken by a waiting request, woken to stop).
    fn wake_and_stop(&self) -> (&Notify, &Notify);
    /// Counters.
    fn metrics(&self) -> &AgentMetrics;
    /// The renewal side is gone.
    fn renewal_died(&self, why: &str);
}

/// Run until the agent stops.
pub(crate) async fn run(agent: impl Pumped, transport: Arc<dyn Transport>) {
    let mut calls: JoinSet<Outcome> = JoinSet::new();
    let mut sent_by = HashMap::new();
    // A call the core gave up on still ends on its own (HTTP/2 timeouts).
    let bound = agent.fetch_timeout() * 2;
    let (wake, stopped) = agent.wake_and_stop();
    while !agent.stopping() {
        let (transmits, events, timeout) = {
            let mut core = agent.core();
            let now = agent.now();
            if core.poll_timeout().is_some_and(|at| at <= now) {
                core.handle_timeout(now);
            }
            let transmits: Vec<_> = std::iter::from_fn(|| core.poll_transmit()).collect();
            let events: Vec<_> = std::iter::from_fn(|| core.poll_event()).collect();
            (transmits, events, core.poll_timeout())
        };
        for ev in events {
            agent.note_event(ev);
        }
        for t in transmits {
            let m = agent.metrics();
            m.messages.add(1);
            m.record_message_rules(t.batch.items.iter().map(|i| i.rule_id.as_str()));
            let transport = transport.clone();
            let handle = calls.spawn(async move {
                let res = match tokio::time::timeout(bound, transport.lease(t.batch)).await {
                    Ok(r) => r,
                    Err(_) => Err("allocator call timed out".into()),
                };
                (t.seq, t.attempt, res)
            });
            sent_by.insert(handle.id(), (t.seq, t.attempt));
        }
        let sleep = match timeout {
            Some(at) => Duration::from_nanos(at.saturating_sub(agent.now())),
            None => Duration::from_secs(3600),
        };
        tokio::select! {
            _ = tokio::time::sleep(sleep) => {}
            _ = wake.notified() => {}
            Some(done) = calls.join_next_with_id(), if !calls.is_empty() => {
                let now = agent.now();
                match done {
                    Ok((id, (seq, attempt, result))) => {
                        sent_by.remove(&id);
                        let mut core = agent.core();
                        match result {
                            Ok(reply) => core.handle_reply(now, seq, reply),
                            Err(why) => core.handle_failure(now, seq, attempt, &why),
                        }
                    }
                    Err(e) => {
                        if let Some((seq, attempt)) = sent_by.remove(&e.id()) {
                            agent.core().handle_failure(now, seq, attempt, "renewal task died");
                        }
                        if e.is_panic() {
                            agent.renewal_died("a renewal send task panicked");
                        }
                    }
                }
            }
            _ = stopped.notified() => break,
        }
    }
    // Calls still out finish on their own; shutdown releases what is held.
    calls.detach_all();
}

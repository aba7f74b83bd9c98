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

use quotalease_proto::lease::LeaseReply;
use tokio::task::JoinSet;

use crate::agent::Agent;
use crate::transport::Transport;

type Outcome = (u64, u32, Result<LeaseReply, String>);

/// Run until the agent stops.
pub(crate) async fn run(agent: Agent, transport: Arc<dyn Transport>) {
    let mut calls: JoinSet<Outcome> = JoinSet::new();
    let mut sent_by = HashMap::new();
    // A call the core gave up on still ends on its own (HTTP/2 timeouts).
    let bound = agent.config().fetch_timeout * 2;
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

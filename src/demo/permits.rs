//! The demo's in-flight limit: a rule with `concurrency: 8`, two agents
//! on the global allocator (the demo's regions serve its rate rules), and
//! 32 workers (4 x
//! `N`) that loop acquire, hold for a lognormal time (median 50 ms) and
//! release. I4 is checked from what the workers were told: each permit
//! counts from its acquire's answer to its release, and at no instant may
//! more than `N` count.

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use quotalease_agent::agent::{AcquireInput, Agent, AgentConfig};
use quotalease_agent::permit_driver::PermitError;
use quotalease_agent::transport::GrpcTransport;

/// The rule the demo adds (appended to its rate rules).
pub const RULE: &str = r#"
  - id: jobs
    match: { tenant: "*", route: /jobs }
    concurrency: 8
    permit_ttl: 10s
    fail_policy: closed
"#;

const N: usize = 8;
const AGENTS: usize = 2;
const WORKERS: usize = 4 * N;
/// The median hold, and the spread of its logarithm.
const HOLD_MEDIAN_MS: f64 = 50.0;
const HOLD_SIGMA: f64 = 0.8;

/// What the workers saw.
pub struct Outcome {
    agents: Vec<Agent>,
    spans: Arc<Mutex<Vec<(Instant, Instant)>>>,
    waits: Arc<Mutex<Vec<Duration>>>,
    /// Acquires timed out, refused (fail-closed), permits that expired
    /// before their worker was done.
    timeouts: Arc<Mutex<(u64, u64, u64)>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    start: Instant,
}

/// Start the agents (on the global allocator at `url`) and the workers,
/// for `duration` once the agents are ready.
pub async fn start(url: &str, duration: Duration) -> anyhow::Result<Outcome> {
    let mut agents = Vec::new();
    for i in 0..AGENTS {
        let t = GrpcTransport::new(&[url.to_string()], Duration::from_millis(250))
            .map_err(|e| anyhow::anyhow!(e))?;
        let cfg = AgentConfig {
            agent_id: format!("demo-permits-{i}"),
            lease_ttl: Duration::from_secs(1),
            ..AgentConfig::default()
        };
        agents.push(Agent::start(cfg, Arc::new(t), None)?);
    }
    while agents.iter().any(|a| !a.is_ready()) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let spans = Arc::new(Mutex::new(Vec::new()));
    let waits = Arc::new(Mutex::new(Vec::new()));
    let timeouts = Arc::new(Mutex::new((0, 0, 0)));
    let start = Instant::now();
    let tasks = (0..WORKERS)
        .map(|w| {
            let agent = agents[w % AGENTS].clone();
            let (spans, waits, timeouts) = (spans.clone(), waits.clone(), timeouts.clone());
            let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ (w as u64).wrapping_mul(0x2545_f491_4f6c_dd1d);
            tokio::spawn(async move {
                while start.elapsed() < duration {
                    let asked = Instant::now();
                    let input = AcquireInput {
                        tenant: "acme",
                        route: "/jobs",
                        domain: None,
                        slots: 1,
                        wait: Duration::from_secs(2),
                        request_id: "",
                    };
                    let got = match agent.acquire(input).await {
                        Ok(got) => got,
                        Err(PermitError::Timeout { .. }) => {
                            timeouts.lock().0 += 1;
                            continue;
                        }
                        Err(_) => {
                            // Fail-closed while the allocator seems
                            // unreachable (a loaded machine): a moment's
                            // pause, not a hot loop.
                            timeouts.lock().1 += 1;
                            tokio::time::sleep(Duration::from_millis(20)).await;
                            continue;
                        }
                    };
                    let from = Instant::now();
                    waits.lock().push(from - asked);
                    let p = &got.permits[0];
                    // The expiry the worker was told: it counts until then
                    // at the latest (it does not renew; a permit whose
                    // lease could not be renewed in time ends early).
                    let told =
                        from + Duration::from_nanos(p.permit.expiry_ns.saturating_sub(agent.now()));
                    tokio::time::sleep(hold(&mut rng)).await;
                    let to = Instant::now();
                    agent.release_permit(&p.key, p.permit.id);
                    if told < to {
                        timeouts.lock().2 += 1;
                    }
                    spans.lock().push((from, to.min(told)));
                }
            })
        })
        .collect();
    Ok(Outcome {
        agents,
        spans,
        waits,
        timeouts,
        tasks,
        start,
    })
}

/// A lognormal hold time (median [`HOLD_MEDIAN_MS`]).
fn hold(rng: &mut u64) -> Duration {
    let mut uniform = || {
        *rng ^= *rng << 13;
        *rng ^= *rng >> 7;
        *rng ^= *rng << 17;
        ((*rng >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    let (u1, u2) = (uniform(), uniform());
    let normal = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
    Duration::from_secs_f64(HOLD_MEDIAN_MS / 1e3 * (HOLD_SIGMA * normal).exp())
}

impl Outcome {
    /// Wait for the workers and stop the agents: the figures to print,
    /// and whether I4 held.
    pub async fn finish(self) -> (String, bool) {
        for t in self.tasks {
            let _ = t.await;
        }
        let end = Instant::now();
        for a in &self.agents {
            a.shutdown().await;
        }
        let spans = self.spans.lock().clone();
        let mut waits = self.waits.lock().clone();
        waits.sort_unstable();
        let q = |f: f64| {
            waits
                .get(((waits.len() as f64 * f) as usize).min(waits.len().saturating_sub(1)))
                .copied()
                .unwrap_or_default()
        };
        // Held at once, as the workers count: the most, and the time
        // average over the run after its first second (demand is 4 x N
        // throughout, so an ideal semaphore keeps all N in use).
        let mut edges: Vec<(Instant, i64)> =
            spans.iter().flat_map(|&(a, b)| [(a, 1), (b, -1)]).collect();
        edges.sort_by(|x, y| x.0.cmp(&y.0).then(x.1.cmp(&y.1)));
        let from = self.start + Duration::from_secs(1);
        let (mut now, mut most, mut area, mut last) = (0i64, 0i64, 0.0f64, from);
        for (t, d) in edges {
            if t > from {
                area += now as f64 * (t.min(end) - last.max(from)).as_secs_f64();
                last = t.max(from);
            }
            now += d;
            most = most.max(now);
        }
        let span_s = (end - from).as_secs_f64().max(1e-9);
        let used = 100.0 * area / span_s / N as f64;
        let held = most as usize <= N;
        let refused = *self.timeouts.lock();
        let report = format!(
            "permits: rule jobs, concurrency {N} per tenant; {WORKERS} workers on {AGENTS} agents of the global allocator, holds lognormal (median {HOLD_MEDIAN_MS} ms)\n  {} permits, {} acquires timed out (2 s), {} refused (allocator unreachable, fail-closed), {} expired before their worker was done (counted to their expiry); at most {most} held at once (N = {N}): I4 {}; slots in use {used:.1} % of N (time-averaged after the first second); wait p50 {} ms, p99 {} ms",
            spans.len(),
            refused.0,
            refused.1,
            refused.2,
            if held { "held" } else { "BROKEN" },
            q(0.5).as_millis(),
            q(0.99).as_millis(),
        );
        (report, held)
    }
}

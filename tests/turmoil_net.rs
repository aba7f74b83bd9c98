//! The real network code under turmoil: the tonic `Allocator/Lease` server
//! of a global and a regional allocator, the regional's upstream driver and
//! the agent's renewal loop with its `GrpcTransport`, over a simulated
//! network (turmoil) with a region partition and a crash of the global
//! allocator. It checks what `sim/src/world.rs` assumes of the drivers:
//! calls fail within `fetch_timeout`, a retry reuses its sequence number and
//! never grants twice, the same `Channel` reconnects by itself, and a
//! restarted global allocator grants nothing during its phantom wait.
//!
//! Every process reads turmoil's simulated time (one clock shared by all
//! hosts); no wall clock is read for any decision. See docs/simulation.md,
//! "The real network code under turmoil".

use std::net::{IpAddr, Ipv4Addr};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use quotalease_agent::transport::{self, GrpcTransport, LeaseFuture, Transport};
use quotalease_agent::{Agent, AgentConfig, CheckInput};
use quotalease_allocator::core::CoreConfig;
use quotalease_allocator::regional::RegionalConfig;
use quotalease_allocator::server::{housekeeping, LeaseService, Shared};
use quotalease_allocator::upstream;
use quotalease_model::clock::{Clock, ClockSource};
use quotalease_model::rules::RuleSet;
use quotalease_proto::lease::{GrantStatus, LeaseBatch};
use quotalease_proto::v1::Reason;
use quotalease_sim::checker::worst_window;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tonic::transport::server::Connected;
use tonic::transport::{Channel, Endpoint, Server};

const PORT: u16 = 9000;
const MS: u64 = 1_000_000;
const SEC: u64 = 1_000 * MS;
/// Readings start here, so that no process sees time 0.
const BASE_NS: u64 = SEC;
const TTL_NS: u64 = 2 * SEC;
const AGENT_FETCH: Duration = Duration::from_millis(250);
const UPSTREAM_FETCH: Duration = Duration::from_millis(500);

const RULES: &str = r#"
rules:
  - id: api
    match: { tenant: "*", route: /api }
    rate: 400/s
    burst: 200
    fail_policy: lease_only
"#;

// Scenario (simulated time since the start, ns; readings add BASE_NS).
const PARTITION_AT: u64 = 6 * SEC;
const REPAIR_AT: u64 = 10 * SEC;
const HOLD_AT: u64 = 40 * SEC;
const RELEASE_AT: u64 = HOLD_AT + 400 * MS;
const CRASH_AT: u64 = 46 * SEC;
const BOUNCE_AT: u64 = 47 * SEC;
const END: u64 = 56 * SEC;

/// turmoil's simulated time, the same for every host.
#[derive(Debug)]
struct SimClock;

impl Clock for SimClock {
    fn now_ns(&self) -> u64 {
        let t = turmoil::sim_elapsed().expect("the clock is read inside a turmoil host");
        BASE_NS + t.as_nanos() as u64
    }
}

// ---------------------------------------------------------------------------
// Wiring tonic to turmoil's TCP

/// A turmoil TCP stream as a tonic server connection.
struct Conn(turmoil::net::TcpStream);

impl Connected for Conn {
    type ConnectInfo = ();
    fn connect_info(&self) -> Self::ConnectInfo {}
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_read(cx, buf)
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write(cx, buf)
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
    }
}

/// Serve the production `LeaseService` over `shared` on turmoil's TCP.
async fn serve(shared: Arc<Shared>) -> turmoil::Result {
    let listener =
        turmoil::net::TcpListener::bind((IpAddr::V4(Ipv4Addr::UNSPECIFIED), PORT)).await?;
    let (tx, rx) = tokio::sync::mpsc::channel::<std::io::Result<Conn>>(16);
    tokio::spawn(async move {
        loop {
            let r = listener.accept().await.map(|(s, _)| Conn(s));
            if tx.send(r).await.is_err() {
                return;
            }
        }
    });
    Server::builder()
        .add_service(LeaseService::new(shared).into_server())
        .serve_with_incoming(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await?;
    Ok(())
}

/// A lazily connecting channel with the production endpoint settings,
/// whose connections go through turmoil to `host:PORT`. `connects` counts
/// the TCP connections it opened.
fn channel(ep: Endpoint, host: &'static str, connects: Arc<AtomicU64>) -> Channel {
    ep.connect_with_connector_lazy(tower::service_fn(move |_uri: tonic::transport::Uri| {
        let connects = connects.clone();
        async move {
            let s = turmoil::net::TcpStream::connect((host, PORT)).await?;
            connects.fetch_add(1, Ordering::Relaxed);
            Ok::<_, std::io::Error>(TokioIo::new(s))
        }
    }))
}

// ---------------------------------------------------------------------------
// What the test records

/// One call of an agent's transport (one attempt of a batch).
#[derive(Clone, Debug)]
struct Call {
    seq: u64,
    start_ns: u64,
    /// None: dropped unanswered (the agent's `fetch_timeout` fired).
    end_ns: Option<u64>,
    ok: bool,
    /// Fresh tokens granted in the reply (tokens - carried).
    fresh: u64,
    parent_unreachable: bool,
}

/// One check: when it was answered and how.
#[derive(Clone, Copy, Debug)]
struct Answer {
    t_ns: u64,
    allowed: bool,
    reason: Reason,
}

#[derive(Default)]
struct AgentLog {
    calls: Vec<Call>,
    answers: Vec<Answer>,
    connects: Arc<AtomicU64>,
}

/// The production `GrpcTransport`, recording each call.
struct Recording {
    inner: GrpcTransport,
    log: Arc<Mutex<AgentLog>>,
}

impl Transport for Recording {
    fn lease(&self, batch: LeaseBatch) -> LeaseFuture<'_> {
        Box::pin(async move {
            let seq = batch.header.as_ref().map_or(0, |h| h.seq);
            let idx = {
                let mut log = self.log.lock();
                log.calls.push(Call {
                    seq,
                    start_ns: SimClock.now_ns(),
                    end_ns: None,
                    ok: false,
                    fresh: 0,
                    parent_unreachable: false,
                });
                log.calls.len() - 1
            };
            let res = self.inner.lease(batch).await;
            let mut log = self.log.lock();
            let c = &mut log.calls[idx];
            c.end_ns = Some(SimClock.now_ns());
            if let Ok(reply) = &res {
                c.ok = true;
                for g in &reply.grants {
                    if g.status == GrantStatus::Granted as i32 {
                        c.fresh += g.tokens - g.carried;
                    }
                    c.parent_unreachable |= g.parent_unreachable;
                }
            }
            res
        })
    }
}

/// Register an agent host that checks one request every 10 ms until END.
fn agent_host(
    sim: &mut turmoil::Sim<'_>,
    name: &'static str,
    allocator: &'static str,
    tenant: &'static str,
    rules: RuleSet,
) -> Arc<Mutex<AgentLog>> {
    let log = Arc::new(Mutex::new(AgentLog::default()));
    let out = log.clone();
    sim.client(name, async move {
        let url = format!("http://{allocator}:{PORT}");
        let ep = transport::endpoint(&url, AGENT_FETCH)?;
        let connects = log.lock().connects.clone();
        let grpc = GrpcTransport::from_channels(vec![(url, channel(ep, allocator, connects))])?;
        let cfg = AgentConfig {
            agent_id: name.into(),
            lease_ttl: Duration::from_nanos(TTL_NS),
            fetch_timeout: AGENT_FETCH,
            clock: ClockSource::Other(Arc::new(SimClock)),
            incarnation: Some(1),
            // Leases of tokens: the held link's retry below needs a renewal
            // within its 400 ms, and a lease that carries a rate is renewed
            // about once a TTL (the agents behind the regional get leases
            // of tokens anyway: a regional's pool lends no rates).
            plan: quotalease_agent::renewal::PlanConfig {
                rate_leases: false,
                ..Default::default()
            },
            ..AgentConfig::default()
        };
        let t: Arc<dyn Transport> = Arc::new(Recording {
            inner: grpc,
            log: log.clone(),
        });
        let agent = Agent::start(cfg, t, Some(rules))?;
        let mut tick = tokio::time::interval(Duration::from_millis(10));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        while SimClock.now_ns() < BASE_NS + END {
            tick.tick().await;
            let input = CheckInput {
                tenant,
                route: "/api",
                cost: 1,
                request_id: "",
                domain: None,
            };
            let (allowed, reason) = match agent.check(input).await {
                Ok(r) => (r.allowed, r.reason()),
                Err(_) => (false, Reason::FailureModeDenied),
            };
            log.lock().answers.push(Answer {
                t_ns: SimClock.now_ns(),
                allowed,
                reason,
            });
        }
        Ok(())
    });
    out
}

/// Run the simulation until `t` (ns since the start), calling `sample`
/// after every step with the reading of that instant.
fn run_until(sim: &mut turmoil::Sim<'_>, t: u64, sample: &mut impl FnMut(u64)) {
    while (sim.elapsed().as_nanos() as u64) < t {
        sim.step().expect("simulation step");
        sample(BASE_NS + sim.elapsed().as_nanos() as u64);
    }
}

#[test]
fn real_tonic_code_over_a_partitioned_and_crashing_network() {
    let rules = RuleSet::parse(RULES, "rules.yaml", 1).expect("valid rules");
    let rule = rules.get("api").expect("rule api").clone();

    let mut sim = turmoil::Builder::new()
        .simulation_duration(Duration::from_nanos(END + 5 * SEC))
        .tick_duration(Duration::from_millis(1))
        .min_message_latency(Duration::from_millis(1))
        .max_message_latency(Duration::from_millis(3))
        .rng_seed(20_261_130)
        .build();

    // The global allocator: a fresh core at every boot (a crash loses it).
    let global: Arc<Mutex<Vec<Arc<Shared>>>> = Arc::default();
    {
        let (global, rules) = (global.clone(), rules.clone());
        sim.host("global", move || {
            let (global, rules) = (global.clone(), rules.clone());
            async move {
                let cfg = CoreConfig {
                    ttl_max_ns: TTL_NS,
                    ..CoreConfig::default()
                };
                let shared = Shared::new_with_clock(cfg, rules, None, Arc::new(SimClock));
                global.lock().push(shared.clone());
                tokio::spawn(housekeeping(shared.clone(), Duration::from_millis(500)));
                serve(shared).await
            }
        });
    }

    // The regional allocator of region a, with its upstream driver.
    let regional: Arc<Mutex<Option<Arc<Shared>>>> = Arc::default();
    let upstream_connects = Arc::new(AtomicU64::new(0));
    {
        let (regional, rules, connects) =
            (regional.clone(), rules.clone(), upstream_connects.clone());
        sim.host("region-a", move || {
            let (regional, rules, connects) = (regional.clone(), rules.clone(), connects.clone());
            async move {
                let cfg = RegionalConfig {
                    core: CoreConfig {
                        ttl_max_ns: TTL_NS,
                        ..CoreConfig::default()
                    },
                    region: "a".into(),
                    fetch_timeout_ns: UPSTREAM_FETCH.as_nanos() as u64,
                    lease_ttl_ns: TTL_NS,
                    ..RegionalConfig::default()
                };
                let shared = Shared::new_regional_with_clock(cfg, Some(rules), Arc::new(SimClock));
                *regional.lock() = Some(shared.clone());
                let ep = upstream::endpoint(&format!("http://global:{PORT}"), UPSTREAM_FETCH)?;
                let client = upstream::client_on(channel(ep, "global", connects));
                let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
                tokio::spawn(housekeeping(shared.clone(), Duration::from_millis(500)));
                tokio::spawn(upstream::run(shared.clone(), client, stop_rx));
                let r = serve(shared).await;
                drop(stop_tx);
                r
            }
        });
    }

    let a1 = agent_host(&mut sim, "agent-a1", "region-a", "acme", rules.clone());
    let a2 = agent_host(&mut sim, "agent-a2", "region-a", "acme", rules.clone());
    let g1 = agent_host(&mut sim, "agent-g1", "global", "acme", rules.clone());

    // Transitions of the regional's `parent_reachable`, and the first
    // instant each boot of the global allocator had granted tokens,
    // sampled every tick.
    let reach: Arc<Mutex<Vec<(u64, bool)>>> = Arc::default();
    let first_grant: Arc<Mutex<Vec<Option<u64>>>> = Arc::default();
    let mut sample = {
        let (regional, reach, global, first_grant) = (
            regional.clone(),
            reach.clone(),
            global.clone(),
            first_grant.clone(),
        );
        move |t: u64| {
            {
                let global = global.lock();
                let mut fg = first_grant.lock();
                fg.resize(global.len(), None);
                for (g, f) in global.iter().zip(fg.iter_mut()) {
                    if f.is_none() && g.with_core(|c| c.stats().tokens_granted) > 0 {
                        *f = Some(t);
                    }
                }
            }
            let Some(r) = regional.lock().clone() else {
                return;
            };
            let now = r.with_regional(|r| r.parent_reachable()).unwrap_or(false);
            let mut reach = reach.lock();
            if reach.last().map(|&(_, v)| v) != Some(now) {
                reach.push((t, now));
            }
        }
    };

    run_until(&mut sim, PARTITION_AT, &mut sample);
    sim.partition("region-a", "global");
    run_until(&mut sim, REPAIR_AT, &mut sample);
    sim.repair("region-a", "global");
    run_until(&mut sim, HOLD_AT, &mut sample);
    sim.hold("agent-g1", "global");
    run_until(&mut sim, RELEASE_AT, &mut sample);
    sim.release("agent-g1", "global");
    run_until(&mut sim, CRASH_AT, &mut sample);
    sim.crash("global");
    run_until(&mut sim, BOUNCE_AT, &mut sample);
    sim.bounce("global");
    run_until(&mut sim, END + 100 * MS, &mut sample);

    let (a1, a2, g1) = (a1.lock(), a2.lock(), g1.lock());
    report(&reach.lock(), &a1, &a2, &g1);
    let global = global.lock();
    let first_grant = first_grant.lock();
    let reach = reach.lock();
    let at = |t: u64| BASE_NS + t;
    let restart_wait = CoreConfig {
        ttl_max_ns: TTL_NS,
        ..CoreConfig::default()
    }
    .restart_wait_ns();

    // Boots of the global allocator: the first and the one after the crash.
    assert_eq!(global.len(), 2, "the global allocator booted twice");
    for (i, g) in global.iter().enumerate() {
        let ready = g.with_core(|c| c.ready_at_ns());
        let granted = first_grant[i].expect("each boot granted tokens in the end");
        eprintln!(
            "global boot {i}: ready at {:.3} ms, first grant at {:.3} ms, stats {:?}",
            (ready - BASE_NS) as f64 / 1e6,
            (granted - BASE_NS) as f64 / 1e6,
            g.with_core(|c| c.stats().clone())
        );
        // The phantom lease: nothing granted before start + TTL_max wait.
        assert!(
            granted >= ready,
            "boot {i} granted before its phantom wait passed"
        );
        // ... and the first renewal after it is served promptly.
        assert!(
            granted <= ready + 200 * MS,
            "boot {i} granted late: {granted} vs {ready}"
        );
    }
    let ready_first = global[0].with_core(|c| c.ready_at_ns());
    assert!(ready_first >= at(restart_wait));
    let ready_second = global[1].with_core(|c| c.ready_at_ns());
    assert!(ready_second >= at(BOUNCE_AT) + restart_wait);

    // --- Partition of region a from the global allocator.
    let lost = reach
        .iter()
        .find(|&&(t, v)| !v && t > at(PARTITION_AT))
        .map(|&(t, _)| t)
        .expect("the regional reported its parent unreachable");
    let regained = reach
        .iter()
        .find(|&&(t, v)| v && t > lost)
        .map(|&(t, _)| t)
        .expect("the regional reached its parent again");
    // The call in flight at the cut (or the next one the planner sends)
    // fails after `fetch_timeout`; the core then marks the parent
    // unreachable. Bound: two upstream timeouts plus one planner tick.
    let renew = RegionalConfig::default().renew_interval_ns;
    assert!(
        lost <= at(PARTITION_AT) + 2 * UPSTREAM_FETCH.as_nanos() as u64 + renew,
        "parent unreachable only at {lost}"
    );
    assert!(regained > at(REPAIR_AT));
    // turmoil's TCP does not retransmit: segments sent during the partition
    // are lost for good and the old HTTP/2 connection stalls. The HTTP/2
    // keep-alive (a ping every 1 s, 4 fetch timeouts for the ack) closes
    // it, and the same Channel connects anew on the next call.
    let fetch = UPSTREAM_FETCH.as_nanos() as u64;
    assert!(
        regained <= at(REPAIR_AT) + SEC + 4 * fetch + fetch + renew + 100 * MS,
        "reconnected only at {regained} (repair at {})",
        at(REPAIR_AT)
    );
    for (name, log) in [("a1", &*a1), ("a2", &*a2)] {
        // Grants during the cut carry `parent_unreachable`, none outside it.
        let flagged: Vec<&Call> = log.calls.iter().filter(|c| c.parent_unreachable).collect();
        assert!(
            !flagged.is_empty(),
            "{name}: no grant said parent_unreachable"
        );
        for c in &flagged {
            let t = c.end_ns.expect("a flagged reply arrived");
            let in_cut = t >= lost && t <= regained + 10 * MS;
            let in_crash = t >= at(CRASH_AT) && t <= at(BOUNCE_AT) + 200 * MS;
            assert!(in_cut || in_crash, "{name}: parent_unreachable at {t}");
        }
        // Served from leases, then the fail policy: no admission once every
        // sub-lease cut from pre-partition parent leases has expired.
        let denied = log
            .answers
            .iter()
            .filter(|a| a.t_ns > lost && a.t_ns < regained)
            .filter(|a| a.reason == Reason::FailureModeDenied)
            .count();
        assert!(denied > 0, "{name}: lease_only did not deny during the cut");
        assert!(
            !log.answers
                .iter()
                .any(|a| a.allowed && a.t_ns > at(PARTITION_AT) + TTL_NS && a.t_ns < regained),
            "{name}: admitted beyond the parent leases during the cut"
        );
        assert!(
            log.answers
                .iter()
                .any(|a| a.allowed && a.t_ns > regained && a.t_ns < at(HOLD_AT)),
            "{name}: no admission after the partition healed"
        );
        // One TCP connection for the whole run: region a's own links never broke.
        assert_eq!(log.connects.load(Ordering::Relaxed), 1, "{name}");
    }
    // The regional's channel to the global: the first connection, the one
    // after the stalled connection was closed, the one after the crash.
    assert_eq!(upstream_connects.load(Ordering::Relaxed), 3);

    // --- Held link between agent-g1 and the global allocator: a retry
    // reuses the sequence number and is answered from the reply cache.
    let held: Vec<&Call> = g1
        .calls
        .iter()
        .filter(|c| c.start_ns >= at(HOLD_AT) && c.start_ns < at(RELEASE_AT))
        .collect();
    assert!(held.len() >= 2, "agent-g1 called during the hold: {held:?}");
    let (first, retry) = (held[0], held[1]);
    assert_eq!(first.seq, retry.seq, "the retry reuses the sequence number");
    assert!(!first.ok);
    // The first attempt failed within fetch_timeout (tonic's own timeout or
    // the agent's, whichever fires first: both are fetch_timeout).
    let fetch = AGENT_FETCH.as_nanos() as u64;
    assert!(retry.start_ns - first.start_ns <= fetch + MS);
    assert!(retry.ok, "the retry was answered after the release");
    assert_eq!(
        global[0].with_core(|c| c.stats().duplicates),
        1,
        "exactly one batch was answered from the reply cache"
    );

    // --- Crash of the global allocator.
    let crash: Vec<&Call> = g1
        .calls
        .iter()
        .filter(|c| c.start_ns >= at(CRASH_AT) && c.start_ns < at(BOUNCE_AT))
        .collect();
    assert!(!crash.is_empty());
    for c in &crash {
        assert!(!c.ok, "a call to a crashed allocator succeeded: {c:?}");
        let end = c.end_ns.unwrap_or(c.start_ns + fetch);
        assert!(
            end - c.start_ns <= fetch + MS,
            "a failed call took too long: {c:?}"
        );
    }
    // The agent served from its lease after the crash, then the fail policy.
    assert!(g1
        .answers
        .iter()
        .any(|a| a.allowed && a.t_ns > at(CRASH_AT) && a.t_ns < at(BOUNCE_AT)));
    assert!(g1
        .answers
        .iter()
        .any(|a| a.reason == Reason::FailureModeDenied && a.t_ns > at(CRASH_AT)));
    // The same channel reconnected by itself after the restart...
    assert_eq!(g1.connects.load(Ordering::Relaxed), 2);
    let back = g1
        .calls
        .iter()
        .find(|c| c.ok && c.start_ns >= at(BOUNCE_AT))
        .expect("a call succeeded after the restart");
    assert!(back.start_ns <= at(BOUNCE_AT) + fetch + 100 * MS);
    // ...and fresh tokens reached it only after the phantom wait.
    for c in g1
        .calls
        .iter()
        .filter(|c| c.start_ns >= at(CRASH_AT) && c.fresh > 0)
    {
        assert!(c.end_ns.is_some_and(|e| e >= ready_second), "{c:?}");
    }

    // --- I1 over every admission of every agent (one key).
    let mut admissions: Vec<(u64, u64)> = [&*a1, &*a2, &*g1]
        .iter()
        .flat_map(|l| l.answers.iter().filter(|a| a.allowed).map(|a| (a.t_ns, 1)))
        .collect();
    let n = admissions.len();
    let worst = worst_window(&mut admissions, rule.rate, rule.burst);
    eprintln!("{n} admissions; worst window {worst:?}");
    assert!(worst.held(), "I1 broken: {worst:?}");
}

fn report(reach: &[(u64, bool)], a1: &AgentLog, a2: &AgentLog, g1: &AgentLog) {
    let ms = |t: u64| (t.saturating_sub(BASE_NS)) as f64 / 1e6;
    eprintln!("regional parent_reachable transitions:");
    for &(t, v) in reach {
        eprintln!("  {:>10.3} ms {v}", ms(t));
    }
    for (name, log) in [("a1", a1), ("a2", a2), ("g1", g1)] {
        eprintln!(
            "{name}: {} calls ({} replies said parent_unreachable), {} connects",
            log.calls.len(),
            log.calls.iter().filter(|c| c.parent_unreachable).count(),
            log.connects.load(Ordering::Relaxed)
        );
        let mut last_ok = None;
        for c in &log.calls {
            let interesting = !c.ok || last_ok != Some(true);
            if interesting {
                eprintln!(
                    "  seq {:>4} start {:>10.3} end {:?} ok {} fresh {} pu {}",
                    c.seq,
                    ms(c.start_ns),
                    c.end_ns.map(ms),
                    c.ok,
                    c.fresh,
                    c.parent_unreachable
                );
            }
            last_ok = Some(c.ok);
        }
        let mut prev: Option<(bool, Reason)> = None;
        for a in &log.answers {
            if prev != Some((a.allowed, a.reason)) {
                eprintln!(
                    "  answer {:>10.3} allowed {} {:?}",
                    ms(a.t_ns),
                    a.allowed,
                    a.reason
                );
                prev = Some((a.allowed, a.reason));
            }
        }
    }
}

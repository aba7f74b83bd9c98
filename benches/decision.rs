//! SPEC §9: the in-process decision with a lease held (key lookup
//! included), beside a bare `AtomicU64` compare-exchange-weak decrement
//! measured in the same run.
//!
//! The agent is real: a real allocator core behind [`InProcess`] (no
//! network), the agent's renewal loop on a one-worker tokio runtime that
//! lives for the whole run. Only `Agent::check_fast` is timed. A `None`
//! from it (lease momentarily short while a renewal is in flight) is
//! counted, reported, and fails the run if it is more than
//! [`MAX_NONE_FRACTION`] of the timed calls: a `None` does no charge, so
//! many of them would make the figure look better than it is.
//!
//! Groups (read the medians from `target/criterion/<id>/new/estimates.json`):
//!
//! * `decision/1_thread/{bare_cas, agent_check_fast}`: time per decision.
//! * `decision/2_threads_same_key/{bare_cas, agent_check_fast}`: two threads
//!   each do `iters` decisions on the same word / the same agent key; the
//!   reported time is wall time per iteration with both working, so the
//!   throughput is `2 / time` decisions per unit of time for either row and
//!   the SPEC ratio is `time(bare_cas) / time(agent_check_fast)`.

use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use quotalease_agent::agent::FastAdmit;
use quotalease_agent::{transport::InProcess, Agent, AgentConfig, CheckInput};
use quotalease_allocator::{core::CoreConfig, server::Shared};
use quotalease_model::rules::RuleSet;

const RULES: &str = r#"
rules:
  - id: hot
    match: { tenant: "*", route: /api/hot }
    rate: 1000000000/s
    burst: 1000000000
    fail_policy: lease_only
"#;

const INPUT: CheckInput<'static> = CheckInput {
    tenant: "acme",
    route: "/api/hot",
    cost: 1,
    request_id: "",
    domain: None,
};

/// Largest tolerated fraction of timed `check_fast` calls returning `None`.
const MAX_NONE_FRACTION: f64 = 1e-3;

/// A running agent with its allocator and runtime, plus the tally of the
/// timed calls.
struct Bench {
    rt: tokio::runtime::Runtime,
    agent: Agent,
    calls: AtomicU64,
    nones: AtomicU64,
}

impl Bench {
    fn start() -> Self {
        let rules = RuleSet::parse(RULES, "bench", 1).expect("the bench rules are valid");
        let shared = Shared::new(
            CoreConfig {
                no_predecessor: true,
                ..CoreConfig::default()
            },
            rules,
            None,
        );
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("a one-worker tokio runtime");
        let agent = rt
            .block_on(async {
                Agent::start(
                    AgentConfig::default(),
                    Arc::new(InProcess::new(move |b| shared.handle(b))),
                    None,
                )
            })
            .expect("agent starts (no admission log)");
        let b = Bench {
            rt,
            agent,
            calls: AtomicU64::new(0),
            nones: AtomicU64::new(0),
        };
        // The first check has no rules yet (they arrive with the first
        // heartbeat), then fetches the lease synchronously.
        let t0 = Instant::now();
        while b.agent.check_fast(&INPUT).is_none() {
            let _ = b.rt.block_on(b.agent.check(INPUT));
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "check_fast still returns None 10 s after start"
            );
        }
        b
    }

    /// Run the key at full speed for `d`, taking the slow path whenever the
    /// fast one says `None`, so the renewal planner's consumption estimate
    /// (EWMA, tau 1 s) reflects a hot key before anything is timed. Called
    /// before each timed agent benchmark, since the key idles meanwhile.
    fn prime(&self, threads: usize, d: Duration) {
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| {
                    let t0 = Instant::now();
                    while t0.elapsed() < d {
                        for _ in 0..1024 {
                            if self.agent.check_fast(&INPUT).is_none() {
                                let _ = self.rt.block_on(self.agent.check(INPUT));
                            }
                        }
                    }
                });
            }
        });
    }

    /// [`Bench::prime`] through a key handle: the consumption estimate then
    /// reflects the handle's (much higher) rate before it is timed.
    fn prime_handle(&self, h: &quotalease_agent::KeyHandle, d: Duration) {
        let t0 = Instant::now();
        while t0.elapsed() < d {
            for _ in 0..1024 {
                if self.agent.check_handle(h, 1, self.agent.now()).is_none() {
                    let _ = self.rt.block_on(self.agent.check(INPUT));
                }
            }
        }
    }

    /// `iters` timed decisions through a resolved key handle at a time read
    /// once per batch of iterations (the caller-supplied time); a `None`
    /// takes the slow path inside the timing, as an embedder would.
    #[inline(never)]
    fn run_handle(&self, h: &quotalease_agent::KeyHandle, iters: u64) -> (Duration, u64) {
        let mut nones = 0u64;
        let t0 = Instant::now();
        let now = self.agent.now();
        for _ in 0..iters {
            let r = black_box(self.agent.check_handle(black_box(h), 1, now));
            if r.is_none() {
                // What an embedder does (and what tells the planner the
                // lease ran short): the slow path, timed with the rest.
                nones += 1;
                let _ = self.rt.block_on(self.agent.check(INPUT));
            }
        }
        (t0.elapsed(), nones)
    }

    /// `iters` timed fast-path decisions on this thread; returns the
    /// elapsed time and how many answered `None`.
    #[inline(never)]
    fn run(&self, iters: u64) -> (Duration, u64) {
        let input = black_box(INPUT);
        let mut nones = 0u64;
        let t0 = Instant::now();
        for _ in 0..iters {
            let r: Option<FastAdmit> = black_box(self.agent.check_fast(black_box(&input)));
            nones += u64::from(r.is_none());
        }
        (t0.elapsed(), nones)
    }

    fn tally(&self, iters: u64, nones: u64) {
        self.calls.fetch_add(iters, Ordering::Relaxed);
        self.nones.fetch_add(nones, Ordering::Relaxed);
    }
}

/// The reference decision: load, check, compare-exchange-weak a decrement.
#[inline(always)]
fn bare_take(word: &AtomicU64) -> bool {
    let mut w = word.load(Ordering::Acquire);
    loop {
        if w == 0 {
            return false;
        }
        match word.compare_exchange_weak(w, w - 1, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return true,
            Err(seen) => w = seen,
        }
    }
}

/// Two threads, each doing `iters` operations, started together; the wall
/// time from the first start to the last finish.
fn two_threads(iters: u64, op: impl Fn(u64) -> u64 + Sync) -> (Duration, u64) {
    let barrier = Barrier::new(2);
    let (spans, extra): (Vec<(Instant, Instant)>, Vec<u64>) = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|_| {
                s.spawn(|| {
                    barrier.wait();
                    let t0 = Instant::now();
                    let x = op(iters);
                    ((t0, Instant::now()), x)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("bench thread panicked"))
            .unzip()
    });
    let start = spans.iter().map(|s| s.0).min().expect("two spans");
    let end = spans.iter().map(|s| s.1).max().expect("two spans");
    (end - start, extra.iter().sum())
}

fn decision(c: &mut Criterion) {
    let bench = Bench::start();
    let word = AtomicU64::new(u64::MAX);

    {
        let mut g = c.benchmark_group("decision/1_thread");
        g.sample_size(20)
            .warm_up_time(Duration::from_secs(1))
            .measurement_time(Duration::from_secs(3));
        g.bench_function("bare_cas", |b| {
            b.iter(|| black_box(bare_take(black_box(&word))))
        });
        g.bench_function("clock_read", |b| b.iter(|| black_box(bench.agent.now())));
        bench.prime(1, Duration::from_secs(2));
        g.bench_function("agent_check_fast", |b| {
            b.iter_custom(|iters| {
                let (d, nones) = bench.run(iters);
                bench.tally(iters, nones);
                d
            })
        });
        report_nones(&bench, "decision/1_thread/agent_check_fast");
        let handle = bench.agent.resolve(&INPUT).expect("the bench key resolves");
        bench.prime_handle(&handle, Duration::from_secs(4));
        g.bench_function("agent_key_handle", |b| {
            b.iter_custom(|iters| {
                let (d, nones) = bench.run_handle(&handle, iters);
                bench.tally(iters, nones);
                d
            })
        });
        g.finish();
    }
    report_nones(&bench, "decision/1_thread/agent_key_handle");

    {
        let mut g = c.benchmark_group("decision/2_threads_same_key");
        g.sample_size(20)
            .warm_up_time(Duration::from_secs(1))
            .measurement_time(Duration::from_secs(3));
        g.bench_function("bare_cas", |b| {
            b.iter_custom(|iters| {
                two_threads(iters, |n| {
                    for _ in 0..n {
                        black_box(bare_take(black_box(&word)));
                    }
                    0
                })
                .0
            })
        });
        bench.prime(2, Duration::from_secs(2));
        g.bench_function("agent_check_fast", |b| {
            b.iter_custom(|iters| {
                let (d, nones) = two_threads(iters, |n| bench.run(n).1);
                bench.tally(2 * iters, nones);
                d
            })
        });
        g.finish();
    }
    report_nones(&bench, "decision/2_threads_same_key/agent_check_fast");

    bench.rt.block_on(bench.agent.shutdown());
}

/// Print the share of timed calls that returned `None` (and reset the
/// tally); panic if it is above [`MAX_NONE_FRACTION`]. Silent when the
/// benchmark was filtered out.
fn report_nones(bench: &Bench, id: &str) {
    let calls = bench.calls.swap(0, Ordering::Relaxed);
    let nones = bench.nones.swap(0, Ordering::Relaxed);
    if calls == 0 {
        // Filtered out (`cargo bench -- <filter>`) or `--list`.
        return;
    }
    let frac = nones as f64 / calls as f64;
    println!("{id}: the fast path returned None for {nones} of {calls} timed calls ({frac:.2e})");
    assert!(
        frac <= MAX_NONE_FRACTION,
        "{id}: the fast path returned None for {nones} of {calls} timed calls, above {MAX_NONE_FRACTION}"
    );
}

criterion_group!(benches, decision);
criterion_main!(benches);

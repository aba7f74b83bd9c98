//! What an axum hello-world serves with each rate-limit layer in front of
//! it, side by side in one run (issue 33 item 5): requests per second and
//! latency at the client, and the server's CPU time per request (its
//! runtime's threads, from `/proc/self/task/*/schedstat`: what the layer
//! adds, whichever side is the bottleneck), closed loop over keep-alive HTTP/1.1
//! connections on 127.0.0.1 (the load generator on a current-thread
//! runtime of its own, the servers on a multi-thread one). The layers: none; `tower_governor` (a local
//! limiter: each process its own bucket, no global limit); the quotalease
//! layer (the real allocator core in process) on a key that never binds,
//! with and without the rate-limit headers on admitted responses. The
//! four servers run at once on one runtime; rounds go through them in
//! turn, each round starting at the next one (no position favoured), and
//! the report is the median round of each.
//!
//! `cargo bench -p quotalease-client --bench axum_hello` (env
//! `AXUM_HELLO_ROUNDS`, default 5; `AXUM_HELLO_SECS` per round, default 2;
//! `AXUM_HELLO_CONNS`, default 32; `AXUM_HELLO_ONLY=I` loads only the
//! I-th layer, for a profile of one).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::routing::get;
use axum::Router;
use hdrhistogram::Histogram;
use quotalease_client::middleware::{HeaderKey, RateLimitLayer};
use quotalease_client::testing::InProcessAllocator;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tower_governor::governor::GovernorConfigBuilder;
use tower_governor::key_extractor::GlobalKeyExtractor;
use tower_governor::GovernorLayer;

/// A rule the benchmark's key never reaches.
const RULES: &str = r#"
rules:
  - id: wide
    match: { tenant: "*", route: / }
    rate: 100000000/s
    burst: 100000000
"#;

const REQUEST: &[u8] = b"GET / HTTP/1.1\r\nhost: bench\r\nx-tenant: acme\r\n\r\n";

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

async fn serve(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await.expect("serve") });
    addr
}

/// The length of the first complete response in `buf` (headers and a
/// `content-length` body), if it is all there.
fn response_len(buf: &[u8]) -> Option<usize> {
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let head = std::str::from_utf8(&buf[..end]).expect("ascii head");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let body: usize = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().ok())?
        })
        .unwrap_or(0);
    (buf.len() >= end + body).then_some(end + body)
}

/// One connection's closed loop until `until`: latencies into `hist`.
async fn connection(addr: SocketAddr, until: Instant, hist: &mut Histogram<u64>) -> u64 {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    s.set_nodelay(true).expect("nodelay");
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    let mut n = 0;
    while Instant::now() < until {
        let t0 = Instant::now();
        s.write_all(REQUEST).await.expect("write");
        loop {
            if let Some(len) = response_len(&buf) {
                buf.drain(..len);
                break;
            }
            let got = s.read(&mut chunk).await.expect("read");
            assert!(got > 0, "server closed the connection");
            buf.extend_from_slice(&chunk[..got]);
        }
        hist.saturating_record(t0.elapsed().as_micros() as u64);
        n += 1;
    }
    n
}

/// One round against `addr`: (requests/s, p50 µs, p99 µs, requests).
async fn round(addr: SocketAddr, conns: u64, secs: u64) -> (f64, u64, u64, u64) {
    // A short warm-up on the same connections' path (not counted).
    let warm = Instant::now() + Duration::from_millis(200);
    let mut h = Histogram::<u64>::new(3).expect("histogram");
    connection(addr, warm, &mut h).await;
    let start = Instant::now();
    let until = start + Duration::from_secs(secs);
    let tasks: Vec<_> = (0..conns)
        .map(|_| {
            tokio::spawn(async move {
                let mut h = Histogram::<u64>::new(3).expect("histogram");
                let n = connection(addr, until, &mut h).await;
                (n, h)
            })
        })
        .collect();
    let mut total = 0;
    let mut hist = Histogram::<u64>::new(3).expect("histogram");
    for t in tasks {
        let (n, h) = t.await.expect("task");
        total += n;
        hist.add(h).expect("merge");
    }
    let rps = total as f64 / start.elapsed().as_secs_f64();
    (
        rps,
        hist.value_at_quantile(0.5),
        hist.value_at_quantile(0.99),
        total,
    )
}

/// This thread's kernel id.
fn gettid() -> i32 {
    // SAFETY: gettid(2) takes no arguments and cannot fail.
    unsafe { libc::syscall(libc::SYS_gettid) as i32 }
}

/// CPU time the server runtime's threads have run, in ns (the first
/// field of `/proc/self/task/TID/schedstat`).
fn cpu_ns(tids: &Mutex<Vec<i32>>) -> u64 {
    tids.lock()
        .expect("tids")
        .iter()
        .map(|tid| {
            std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat"))
                .ok()
                .and_then(|s| s.split_whitespace().next()?.parse().ok())
                .unwrap_or(0)
        })
        .sum()
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).expect("no NaN"));
    v[v.len() / 2]
}

fn main() {
    // `cargo bench` passes `--bench`; a `cargo test` run of benches passes
    // nothing to look at either: run only when benchmarking.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let rounds = env_or("AXUM_HELLO_ROUNDS", 5);
    let secs = env_or("AXUM_HELLO_SECS", 2);
    let conns = env_or("AXUM_HELLO_CONNS", 32);
    // The servers and the load generator share the machine: a runtime
    // each, as a service and its callers would have.
    let server_threads = env_or("AXUM_HELLO_SERVER_THREADS", 1) as usize;
    let tids = Arc::new(Mutex::new(Vec::new()));
    let servers = {
        let tids = tids.clone();
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(server_threads)
            .on_thread_start(move || tids.lock().expect("tids").push(gettid()))
            .enable_all()
            .build()
            .expect("server runtime")
    };
    let hello = || Router::new().route("/", get(|| async { "hello" }));
    let alloc = InProcessAllocator::from_yaml(RULES).expect("rules");
    let targets: Vec<(&str, SocketAddr)> = servers.block_on(async {
        let client = alloc.client("bench").expect("client");
        assert!(client.ready(Duration::from_secs(5)).await, "ready");
        let governor = Arc::new(
            GovernorConfigBuilder::default()
                .key_extractor(GlobalKeyExtractor)
                .per_nanosecond(1)
                .burst_size(u32::MAX)
                .finish()
                .expect("governor config"),
        );
        vec![
            ("no layer", serve(hello()).await),
            (
                "tower_governor (local only)",
                serve(hello().layer(GovernorLayer::new(governor))).await,
            ),
            (
                "quotalease, no headers",
                serve(
                    hello().layer(
                        RateLimitLayer::new(client.clone(), HeaderKey::new("x-tenant"))
                            .headers_on_admitted(false),
                    ),
                )
                .await,
            ),
            (
                "quotalease, headers",
                serve(hello().layer(RateLimitLayer::new(client, HeaderKey::new("x-tenant")))).await,
            ),
        ]
    });
    let load = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("load runtime");
    let mut results: Vec<Vec<(f64, u64, u64, f64)>> = vec![Vec::new(); targets.len()];
    // AXUM_HELLO_ONLY=I: load only the I-th layer (profiling one).
    let only = std::env::var("AXUM_HELLO_ONLY")
        .ok()
        .and_then(|v| v.parse::<usize>().ok());
    for r in 0..rounds as usize {
        // Each round starts at the next layer: no layer always runs first.
        for i in (0..targets.len()).map(|k| (k + r) % targets.len()) {
            let (name, addr) = &targets[i];
            if only.is_some_and(|o| o != i) {
                results[i].push((1.0, 0, 0, 0.0));
                continue;
            }
            let cpu0 = cpu_ns(&tids);
            let res = load.block_on(round(*addr, conns, secs));
            let cpu_us = (cpu_ns(&tids) - cpu0) as f64 / 1e3 / res.3 as f64;
            eprintln!(
                "round {r} {name}: {:.0} req/s, p50 {} us, p99 {} us, server {cpu_us:.2} us CPU/request",
                res.0, res.1, res.2
            );
            results[i].push((res.0, res.1, res.2, cpu_us));
        }
    }
    let base = median(&mut results[0].iter().map(|r| r.0).collect::<Vec<_>>());
    println!(
        "axum hello-world, {conns} keep-alive connections, closed loop, {rounds} rounds of {secs} s (median round)"
    );
    println!("| layer | requests/s | vs no layer | p50 us | p99 us | server CPU us/request | vs no layer |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    let base_cpu = median(&mut results[0].iter().map(|r| r.3).collect::<Vec<_>>());
    for (i, (name, _)) in targets.iter().enumerate() {
        let rps = median(&mut results[i].iter().map(|r| r.0).collect::<Vec<_>>());
        let p50 = median(&mut results[i].iter().map(|r| r.1 as f64).collect::<Vec<_>>());
        let p99 = median(&mut results[i].iter().map(|r| r.2 as f64).collect::<Vec<_>>());
        let cpu = median(&mut results[i].iter().map(|r| r.3).collect::<Vec<_>>());
        println!(
            "| {name} | {rps:.0} | {:.3} | {p50:.0} | {p99:.0} | {cpu:.2} | {:+.2} |",
            rps / base,
            cpu - base_cpu
        );
    }
    drop(servers);
}

//! `quotalease bench`: a load generator for the agent's three interfaces
//! (SPEC §3, §5, §9), and `--serve-echo`, a do-nothing server on the same
//! stacks as the agent that is the floor SPEC §9 compares against.
//!
//! This module owns the measurement method:
//!
//! - **Open loop** (default): request `i` is due at `t0 + i/rate`. A pacer
//!   on its own thread sleeps until each due time and hands the request to
//!   the tokio runtime without waiting for earlier answers, so a slow server
//!   cannot slow the offered load. Latency is measured from the *intended*
//!   send time, so time a request spent waiting behind the generator, a
//!   connection or the server is counted (no coordinated omission). How late
//!   the pacer itself dispatched is reported apart ("send lag"), so a
//!   generator that cannot keep up is visible.
//! - **Closed loop** (`--closed-loop --concurrency N`): N workers, each sends
//!   its next request when the previous one is answered; measures the
//!   highest throughput at N in flight.
//!
//! Latencies go into HdrHistograms in microseconds (3 significant digits).
//! Requests whose due time falls in `--warmup` are sent but not counted.
//! Every request has a `--timeout`; a request that has not been answered by
//! then is an error of kind `timeout`, so a run always ends.
//!
//! Interfaces: gRPC `quotalease.v1.RateLimiter/Check`, Envoy RLS
//! `ShouldRateLimit` (one descriptor with entries `tenant` and `route`) and
//! HTTP `GET /v1/check?tenant=…&route=…` over keep-alive HTTP/1.1
//! connections (hyper's connection-level client; a request waits for a free
//! connection when all `--connections` are busy, and that wait is counted).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context};
use axum::http::header::CONTENT_TYPE;
use axum::routing::get;
use axum::serve::ListenerExt;
use axum::Router;
use clap::{Args, ValueEnum};
use hdrhistogram::Histogram;
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use quotalease_proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use quotalease_proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use quotalease_proto::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus,
};
use quotalease_proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use quotalease_proto::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use quotalease_proto::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use quotalease_proto::v1::rate_limiter_client::RateLimiterClient;
use quotalease_proto::v1::rate_limiter_server::{RateLimiter, RateLimiterServer};
use quotalease_proto::v1::{CheckRequest, CheckResponse, Reason};
use quotalease_proto::MAX_MESSAGE_BYTES;
use tokio::net::{TcpListener, TcpStream};
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Endpoint};

/// Most distinct tenants a Zipf table is built for (8 bytes each).
const MAX_ZIPF_KEYS: u64 = 10_000_000;
/// Highest latency the histograms hold (1 hour in µs); above, it saturates.
const HIST_MAX_US: u64 = 3_600_000_000;

/// `quotalease bench` flags.
#[derive(Args, Debug)]
pub struct BenchArgs {
    /// The agent: http://HOST:PORT — its --grpc address for `check` and
    /// `envoy`, its --http address for `http`.
    #[arg(long, value_name = "URL", value_parser = parse_target,
          required_unless_present = "serve_echo")]
    target: Option<Target>,
    /// Which interface to load.
    #[arg(long, value_enum, required_unless_present = "serve_echo")]
    interface: Option<Interface>,
    /// Open loop: requests per second, sent on schedule whatever the answers.
    #[arg(long, value_name = "N",
          value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    rate: Option<u64>,
    /// How long to measure (after --warmup).
    #[arg(long, default_value = "10s", value_parser = crate::parse_duration)]
    duration: Duration,
    /// Send load this long before measuring (not counted).
    #[arg(long, value_parser = crate::parse_duration)]
    warmup: Option<Duration>,
    /// gRPC: HTTP/2 connections, requests spread round robin (default 1).
    /// HTTP: most keep-alive HTTP/1.1 connections open at once (default 64,
    /// or --concurrency in closed loop).
    #[arg(long, value_name = "C",
          value_parser = clap::value_parser!(u32).range(1..=10_000))]
    connections: Option<u32>,
    /// Tenants: `hot` (one), `uniform:N` (N, equally likely) or `zipf:N:S`
    /// (N, Zipf with exponent S; tenant 0 is the most frequent).
    #[arg(long, value_name = "SPEC", default_value = "hot", value_parser = parse_keys)]
    keys: KeySpec,
    /// Tenant ids are PREFIX0, PREFIX1, …
    #[arg(long = "tenant-prefix", value_name = "PREFIX", default_value = "t")]
    tenant_prefix: String,
    /// Route id of every request.
    #[arg(long, default_value = "/bench")]
    route: String,
    /// Envoy RLS domain (empty: rules without a domain).
    #[arg(long, default_value = "")]
    domain: String,
    /// Seed of the key sequence (splitmix64).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// A request not answered within this is an error of kind `timeout`.
    #[arg(long, default_value = "5s", value_parser = crate::parse_duration)]
    timeout: Duration,
    /// Closed loop: each worker sends its next request when the previous one
    /// is answered (maximum throughput at --concurrency in flight).
    #[arg(long = "closed-loop", conflicts_with = "rate")]
    closed_loop: bool,
    /// Closed loop: number of workers, i.e. requests in flight [default: 64].
    #[arg(long, value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    concurrency: Option<u32>,
    /// Serve a do-nothing echo of the three interfaces instead of loading one.
    #[arg(long = "serve-echo",
          conflicts_with_all = ["target", "interface", "rate", "closed_loop"])]
    serve_echo: bool,
    /// Threads of the load generator's runtime (1: a current-thread runtime).
    #[arg(long = "client-threads", value_name = "N", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=64))]
    client_threads: u32,
    /// Echo: gRPC address for quotalease.v1 Check and Envoy RLS
    /// [default: 127.0.0.1:0, a free port; the chosen one is printed].
    #[arg(long, value_name = "ADDR")]
    grpc: Option<SocketAddr>,
    /// Echo: HTTP address for GET/POST /v1/check, /healthz, /readyz
    /// [default: 127.0.0.1:0].
    #[arg(long, value_name = "ADDR")]
    http: Option<SocketAddr>,
    /// Echo: leave TCP_NODELAY off on accepted connections (the agent sets
    /// it; this reproduces the agent before it did).
    #[arg(long = "no-tcp-nodelay")]
    no_tcp_nodelay: bool,
}

/// The interface under load.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Interface {
    /// gRPC quotalease.v1.RateLimiter/Check.
    Check,
    /// gRPC envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit.
    Envoy,
    /// HTTP GET /v1/check.
    Http,
}

impl Interface {
    fn name(self) -> &'static str {
        match self {
            Interface::Check => "check",
            Interface::Envoy => "envoy",
            Interface::Http => "http",
        }
    }
}

/// A plaintext `http://HOST:PORT` target.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    /// `HOST:PORT`.
    authority: String,
}

impl Target {
    fn url(&self) -> String {
        format!("http://{}", self.authority)
    }
}

fn parse_target(s: &str) -> Result<Target, String> {
    let rest = if let Some(r) = s.strip_prefix("http://") {
        r
    } else if s.starts_with("https://") {
        return Err("https is not supported: the bench speaks plaintext (http://HOST:PORT)".into());
    } else if s.contains("://") {
        return Err("expected http://HOST:PORT".into());
    } else {
        s
    };
    let authority = rest.strip_suffix('/').unwrap_or(rest);
    if authority.is_empty() || authority.contains(['/', '?', '#', '@', ' ']) {
        return Err("expected http://HOST:PORT with no path".into());
    }
    let Some((host, port)) = authority.rsplit_once(':') else {
        return Err("expected http://HOST:PORT: the port is missing".into());
    };
    if host.is_empty() || port.parse::<u16>().map_or(true, |p| p == 0) {
        return Err("expected http://HOST:PORT with a port 1-65535".into());
    }
    Ok(Target {
        authority: authority.to_string(),
    })
}

/// How tenants are drawn.
#[derive(Clone, Debug, PartialEq)]
pub enum KeySpec {
    /// One tenant.
    Hot,
    /// N tenants, equally likely.
    Uniform(u64),
    /// N tenants, Zipf with exponent S.
    Zipf(u64, f64),
}

impl std::fmt::Display for KeySpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KeySpec::Hot => write!(f, "hot"),
            KeySpec::Uniform(n) => write!(f, "uniform:{n}"),
            KeySpec::Zipf(n, s) => write!(f, "zipf:{n}:{s}"),
        }
    }
}

fn parse_keys(s: &str) -> Result<KeySpec, String> {
    const FORMS: &str = "expected hot, uniform:N or zipf:N:S";
    let parts: Vec<&str> = s.split(':').collect();
    let count = |n: &str| -> Result<u64, String> {
        match n.parse::<u64>() {
            Ok(0) | Err(_) => Err(format!("{n:?} is not a tenant count (a whole number >= 1)")),
            Ok(n) => Ok(n),
        }
    };
    match parts.as_slice() {
        ["hot"] => Ok(KeySpec::Hot),
        ["uniform", n] => Ok(KeySpec::Uniform(count(n)?)),
        ["zipf", n, e] => {
            let n = count(n)?;
            if n > MAX_ZIPF_KEYS {
                return Err(format!("zipf: at most {MAX_ZIPF_KEYS} tenants"));
            }
            match e.parse::<f64>() {
                Ok(e) if e.is_finite() && (0.0..=100.0).contains(&e) => Ok(KeySpec::Zipf(n, e)),
                _ => Err(format!(
                    "zipf exponent {e:?}: expected a number from 0 to 100"
                )),
            }
        }
        _ => Err(FORMS.into()),
    }
}

/// splitmix64: a small, fast, deterministic generator.
#[derive(Clone, Debug)]
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (Lemire's multiply-shift; bias below 2^-40 here).
    fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next()) * u128::from(n)) >> 64) as u64
    }

    /// Uniform in `[0, 1)`.
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The tenant distribution, built once and shared by all key generators.
#[derive(Debug)]
enum Keys {
    Hot,
    Uniform(u64),
    /// Inverse CDF: `cdf[k]` = P(tenant <= k).
    Zipf(Vec<f64>),
}

impl Keys {
    fn build(spec: &KeySpec) -> Keys {
        match *spec {
            KeySpec::Hot => Keys::Hot,
            KeySpec::Uniform(n) => Keys::Uniform(n),
            KeySpec::Zipf(n, s) => {
                let mut cdf = Vec::with_capacity(n as usize);
                let mut sum = 0.0;
                for k in 1..=n {
                    sum += (k as f64).powf(-s);
                    cdf.push(sum);
                }
                for c in &mut cdf {
                    *c /= sum;
                }
                Keys::Zipf(cdf)
            }
        }
    }
}

/// One stream of tenant indices.
struct KeyGen {
    keys: Arc<Keys>,
    rng: SplitMix64,
}

impl KeyGen {
    fn new(keys: Arc<Keys>, seed: u64, stream: u64) -> KeyGen {
        let mut mix = SplitMix64(seed ^ stream.wrapping_mul(0xA076_1D64_78BD_642F));
        KeyGen {
            keys,
            rng: SplitMix64(mix.next()),
        }
    }

    fn next(&mut self) -> u64 {
        match &*self.keys {
            Keys::Hot => 0,
            Keys::Uniform(n) => self.rng.below(*n),
            Keys::Zipf(cdf) => {
                let u = self.rng.unit();
                cdf.partition_point(|&c| c <= u).min(cdf.len() - 1) as u64
            }
        }
    }
}

/// Percent-encode everything but RFC 3986 unreserved characters.
fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The result of one request.
enum Outcome {
    Admitted,
    Denied,
    Error(String),
}

/// A pool of keep-alive HTTP/1.1 connections; at most `permits` are in use
/// at once, and a request waits for a free one.
struct HttpPool {
    addr: SocketAddr,
    authority: String,
    idle: Mutex<Vec<SendRequest<Empty<Bytes>>>>,
    permits: tokio::sync::Semaphore,
}

impl HttpPool {
    async fn connect(&self) -> Result<SendRequest<Empty<Bytes>>, String> {
        let stream = TcpStream::connect(self.addr)
            .await
            .map_err(|e| format!("http connect: {}", e.kind()))?;
        stream
            .set_nodelay(true)
            .map_err(|e| format!("http connect: {}", e.kind()))?;
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|_| "http handshake".to_string())?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(sender)
    }

    /// A pool for `target`, with one connection opened now so that an
    /// unreachable target fails before the run.
    async fn open(target: &Target, connections: usize) -> anyhow::Result<HttpPool> {
        let addr = tokio::net::lookup_host(&target.authority)
            .await
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| anyhow!("--target {}: cannot resolve", target.url()))?;
        let pool = HttpPool {
            addr,
            authority: target.authority.clone(),
            idle: Mutex::new(Vec::new()),
            permits: tokio::sync::Semaphore::new(connections),
        };
        let first = pool
            .connect()
            .await
            .map_err(|e| anyhow!("--target {}: {e}", target.url()))?;
        pool.idle.lock().push(first);
        Ok(pool)
    }

    async fn get(&self, path_and_query: String) -> Outcome {
        let Ok(_permit) = self.permits.acquire().await else {
            return Outcome::Error("http pool closed".into());
        };
        let mut sender = loop {
            let popped = self.idle.lock().pop();
            match popped {
                Some(mut s) => {
                    if s.ready().await.is_ok() {
                        break s;
                    }
                }
                None => match self.connect().await {
                    Ok(s) => break s,
                    Err(e) => return Outcome::Error(e),
                },
            }
        };
        let req = match hyper::Request::get(path_and_query)
            .header(hyper::header::HOST, &self.authority)
            .body(Empty::<Bytes>::new())
        {
            Ok(r) => r,
            Err(_) => return Outcome::Error("http bad request uri".into()),
        };
        let resp = match sender.send_request(req).await {
            Ok(r) => r,
            Err(e) => {
                let kind = if e.is_closed() || e.is_incomplete_message() {
                    "http connection closed"
                } else {
                    "http protocol"
                };
                return Outcome::Error(kind.into());
            }
        };
        let status = resp.status().as_u16();
        if resp.into_body().collect().await.is_err() {
            return Outcome::Error("http body".into());
        }
        if !sender.is_closed() {
            self.idle.lock().push(sender);
        }
        match status {
            200 => Outcome::Admitted,
            429 => Outcome::Denied,
            s => Outcome::Error(format!("http {s}")),
        }
    }
}

/// `connections` HTTP/2 connections to `target`.
async fn grpc_channels(
    target: &Target,
    connections: usize,
    timeout: Duration,
) -> anyhow::Result<Vec<Channel>> {
    let endpoint = Endpoint::from_shared(target.url())
        .map_err(|e| anyhow!("--target {}: {e}", target.url()))?
        .tcp_nodelay(true)
        .connect_timeout(timeout);
    let mut channels = Vec::with_capacity(connections);
    for _ in 0..connections {
        channels.push(endpoint.connect().await.map_err(|e| {
            // The innermost cause says what went wrong (refused, timed out).
            let mut cause: &dyn std::error::Error = &e;
            while let Some(next) = cause.source() {
                cause = next;
            }
            anyhow!("--target {}: cannot connect: {cause}", target.url())
        })?);
    }
    Ok(channels)
}

/// A client of the interface under load.
#[derive(Clone)]
enum Client {
    Check(Arc<[RateLimiterClient<Channel>]>),
    Envoy(Arc<[RateLimitServiceClient<Channel>]>),
    Http(Arc<HttpPool>),
}

/// What every request carries besides its tenant.
struct RequestShape {
    tenant_prefix: String,
    route: String,
    domain: String,
    /// `/v1/check?route=…&tenant=PREFIX` (the tenant index is appended).
    http_prefix: String,
}

impl Client {
    async fn connect(
        interface: Interface,
        target: &Target,
        connections: usize,
        timeout: Duration,
    ) -> anyhow::Result<Client> {
        match interface {
            Interface::Http => Ok(Client::Http(Arc::new(
                HttpPool::open(target, connections).await?,
            ))),
            Interface::Check => Ok(Client::Check(
                grpc_channels(target, connections, timeout)
                    .await?
                    .into_iter()
                    .map(|c| {
                        RateLimiterClient::new(c)
                            .max_decoding_message_size(MAX_MESSAGE_BYTES)
                            .max_encoding_message_size(MAX_MESSAGE_BYTES)
                    })
                    .collect(),
            )),
            Interface::Envoy => Ok(Client::Envoy(
                grpc_channels(target, connections, timeout)
                    .await?
                    .into_iter()
                    .map(|c| {
                        RateLimitServiceClient::new(c)
                            .max_decoding_message_size(MAX_MESSAGE_BYTES)
                            .max_encoding_message_size(MAX_MESSAGE_BYTES)
                    })
                    .collect(),
            )),
        }
    }

    /// Request number `n` (for connection round robin) for tenant `key`.
    async fn call(&self, shape: &RequestShape, n: u64, key: u64) -> Outcome {
        match self {
            Client::Check(clients) => {
                let mut c = clients[(n % clients.len() as u64) as usize].clone();
                let req = CheckRequest {
                    tenant_id: format!("{}{key}", shape.tenant_prefix),
                    route_id: shape.route.clone(),
                    cost: 1,
                    ..CheckRequest::default()
                };
                match c.check(req).await {
                    Ok(r) => {
                        let r = r.into_inner();
                        if r.allowed {
                            Outcome::Admitted
                        } else if r.reason == Reason::Invalid as i32 {
                            Outcome::Error("check INVALID".into())
                        } else {
                            Outcome::Denied
                        }
                    }
                    Err(s) => Outcome::Error(format!("grpc {:?}", s.code())),
                }
            }
            Client::Envoy(clients) => {
                let mut c = clients[(n % clients.len() as u64) as usize].clone();
                let req = RateLimitRequest {
                    domain: shape.domain.clone(),
                    descriptors: vec![RateLimitDescriptor {
                        entries: vec![
                            Entry {
                                key: "tenant".into(),
                                value: format!("{}{key}", shape.tenant_prefix),
                            },
                            Entry {
                                key: "route".into(),
                                value: shape.route.clone(),
                            },
                        ],
                        limit: None,
                        hits_addend: None,
                    }],
                    hits_addend: 0,
                };
                match c.should_rate_limit(req).await {
                    Ok(r) => match Code::try_from(r.into_inner().overall_code) {
                        Ok(Code::Ok) => Outcome::Admitted,
                        Ok(Code::OverLimit) => Outcome::Denied,
                        _ => Outcome::Error("envoy overall_code UNKNOWN".into()),
                    },
                    Err(s) => Outcome::Error(format!("grpc {:?}", s.code())),
                }
            }
            Client::Http(pool) => pool.get(format!("{}{key}", shape.http_prefix)).await,
        }
    }
}

/// Histograms guarded together: one lock per answered request.
struct Hists {
    /// Measured requests, the whole run.
    total: Histogram<u64>,
    /// Every answered request since the last progress line.
    interval: Histogram<u64>,
}

/// Counters and histograms shared by all requests.
struct Stats {
    /// Start of the measured window.
    measure_start: Instant,
    sent: AtomicU64,
    admitted: AtomicU64,
    denied: AtomicU64,
    errors: AtomicU64,
    in_flight: AtomicU64,
    /// Nanoseconds after `measure_start` of the last measured answer.
    last_answer_ns: AtomicU64,
    hists: Mutex<Hists>,
    error_kinds: Mutex<BTreeMap<String, u64>>,
    /// Admitted answers per second of completion since `measure_start`.
    admitted_per_s: Vec<AtomicU64>,
    /// End of the measured window (no request is due after it).
    measure_end: Instant,
    /// The p99 of each whole second of the measured window, in µs.
    p99_per_s: Mutex<Vec<u64>>,
}

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, HIST_MAX_US, 3)
        .expect("1 <= 3600e6 µs with 3 significant digits are valid bounds")
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX).max(1)
}

impl Stats {
    fn new(measure_start: Instant, measure_end: Instant, seconds: usize) -> Stats {
        Stats {
            measure_start,
            sent: AtomicU64::new(0),
            admitted: AtomicU64::new(0),
            denied: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            in_flight: AtomicU64::new(0),
            last_answer_ns: AtomicU64::new(0),
            hists: Mutex::new(Hists {
                total: histogram(),
                interval: histogram(),
            }),
            error_kinds: Mutex::new(BTreeMap::new()),
            admitted_per_s: (0..seconds).map(|_| AtomicU64::new(0)).collect(),
            measure_end,
            p99_per_s: Mutex::new(Vec::new()),
        }
    }

    /// A request due at `due` is being sent.
    fn start(&self, due: Instant) {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        if due >= self.measure_start {
            self.sent.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The request due at `due` ended with `out`.
    fn finish(&self, due: Instant, out: Outcome) {
        let now = Instant::now();
        let measured = due >= self.measure_start;
        let answered = !matches!(out, Outcome::Error(_));
        if answered {
            let us = micros(now.saturating_duration_since(due));
            let mut h = self.hists.lock();
            h.interval.saturating_record(us);
            if measured {
                h.total.saturating_record(us);
            }
        }
        if measured {
            let since = now.saturating_duration_since(self.measure_start);
            match out {
                Outcome::Admitted => {
                    self.admitted.fetch_add(1, Ordering::Relaxed);
                    let i = (since.as_secs() as usize).min(self.admitted_per_s.len() - 1);
                    self.admitted_per_s[i].fetch_add(1, Ordering::Relaxed);
                }
                Outcome::Denied => {
                    self.denied.fetch_add(1, Ordering::Relaxed);
                }
                Outcome::Error(kind) => {
                    self.errors.fetch_add(1, Ordering::Relaxed);
                    *self.error_kinds.lock().entry(kind).or_insert(0) += 1;
                }
            }
            if answered {
                let ns = u64::try_from(since.as_nanos()).unwrap_or(u64::MAX);
                self.last_answer_ns.fetch_max(ns, Ordering::Relaxed);
            }
        }
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
    }

    /// One progress line; resets the interval histogram.
    fn progress(&self, started: Instant) {
        let p99 = {
            let mut h = self.hists.lock();
            let p = (!h.interval.is_empty()).then(|| h.interval.value_at_quantile(0.99));
            h.interval.reset();
            p
        };
        // Keep the p99 of seconds that lie inside the measured window
        // (ticks may run a little late).
        let now = Instant::now();
        let slack = Duration::from_millis(100);
        if let Some(p) = p99 {
            if now >= self.measure_start + Duration::from_secs(1) && now <= self.measure_end + slack
            {
                self.p99_per_s.lock().push(p);
            }
        }
        let elapsed = started.elapsed().as_secs_f64().round() as u64;
        // A line covers the second before it: warmup if that second began
        // before the measured window (give or take a late tick).
        let phase = if now < self.measure_start + Duration::from_millis(900) {
            " warmup"
        } else {
            ""
        };
        println!(
            "[{elapsed:>3}s{phase}] sent={} admitted={} denied={} errors={} in_flight={} p99={}",
            self.sent.load(Ordering::Relaxed),
            self.admitted.load(Ordering::Relaxed),
            self.denied.load(Ordering::Relaxed),
            self.errors.load(Ordering::Relaxed),
            self.in_flight.load(Ordering::Relaxed),
            p99.map_or("-".to_string(), ms),
        );
    }
}

/// Microseconds as milliseconds with µs resolution.
fn ms(us: u64) -> String {
    format!("{}.{:03}ms", us / 1000, us % 1000)
}

fn percentiles(h: &Histogram<u64>) -> String {
    if h.is_empty() {
        return "no samples".into();
    }
    format!(
        "p50={} p90={} p99={} p999={} max={}",
        ms(h.value_at_quantile(0.5)),
        ms(h.value_at_quantile(0.9)),
        ms(h.value_at_quantile(0.99)),
        ms(h.value_at_quantile(0.999)),
        ms(h.max()),
    )
}

/// Everything a run needs, resolved from the flags.
struct Plan {
    interface: Interface,
    target: Target,
    rate: Option<u64>,
    concurrency: usize,
    connections: usize,
    warmup: Duration,
    duration: Duration,
    timeout: Duration,
    spec: KeySpec,
    seed: u64,
    shape: Arc<RequestShape>,
}

/// `quotalease bench`.
pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    if args.serve_echo {
        let stop = crate::serve::Termination::catch();
        let grpc = args
            .grpc
            .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 0)));
        let http = args
            .http
            .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 0)));
        return serve_echo(grpc, http, !args.no_tcp_nodelay, stop).await;
    }
    // The load runs on its own runtime: with one thread (the default) every
    // wake-up stays on that thread, which costs far fewer context switches
    // per request than tokio's work-stealing pool.
    let threads = args.client_threads as usize;
    let rt = if threads == 1 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(threads);
        b
    }
    .enable_all()
    .build()
    .context("--client-threads: cannot start the client runtime")?;
    tokio::task::spawn_blocking(move || rt.block_on(load(args)))
        .await
        .context("the client runtime")?
}

/// The load generator proper, on the client runtime.
async fn load(args: BenchArgs) -> anyhow::Result<()> {
    let (Some(target), Some(interface)) = (args.target, args.interface) else {
        return Err(anyhow!("--target and --interface are required"));
    };
    for (given, flag) in [
        (args.grpc.is_some(), "--grpc"),
        (args.http.is_some(), "--http"),
        (args.no_tcp_nodelay, "--no-tcp-nodelay"),
    ] {
        if given {
            return Err(anyhow!("{flag}: only with --serve-echo"));
        }
    }
    if args.concurrency.is_some() && !args.closed_loop {
        return Err(anyhow!("--concurrency: only with --closed-loop"));
    }
    if !args.closed_loop && args.rate.is_none() {
        return Err(anyhow!(
            "--rate: required for an open-loop run (or use --closed-loop)"
        ));
    }
    let concurrency = args.concurrency.unwrap_or(64) as usize;
    let connections = match (args.connections, interface) {
        (Some(c), _) => c as usize,
        (None, Interface::Http) if args.closed_loop => concurrency,
        (None, Interface::Http) => 64,
        (None, _) => 1,
    };
    let http_prefix = format!(
        "/v1/check?route={}&tenant={}",
        percent_encode(&args.route),
        percent_encode(&args.tenant_prefix)
    );
    let plan = Plan {
        interface,
        target,
        rate: if args.closed_loop { None } else { args.rate },
        concurrency,
        connections,
        warmup: args.warmup.unwrap_or(Duration::ZERO),
        duration: args.duration,
        timeout: args.timeout,
        spec: args.keys,
        seed: args.seed,
        shape: Arc::new(RequestShape {
            tenant_prefix: args.tenant_prefix,
            route: args.route,
            domain: args.domain,
            http_prefix,
        }),
    };
    let client =
        Client::connect(plan.interface, &plan.target, plan.connections, plan.timeout).await?;
    let keys = Arc::new(Keys::build(&plan.spec));
    let mode = match plan.rate {
        Some(r) => format!("open loop at {r} req/s"),
        None => format!("closed loop, {} in flight", plan.concurrency),
    };
    println!(
        "quotalease bench: {} {mode} for {:?} (warmup {:?}) against {}, {} connection(s), keys {}, tenant {}N, route {}",
        plan.interface.name(),
        plan.duration,
        plan.warmup,
        plan.target.url(),
        plan.connections,
        plan.spec,
        plan.shape.tenant_prefix,
        plan.shape.route,
    );
    // Room for answers that arrive after the window (up to the timeout).
    let seconds = (plan.duration + plan.timeout).as_secs() as usize + 2;
    let t0 = Instant::now() + Duration::from_millis(10);
    let stats = Arc::new(Stats::new(
        t0 + plan.warmup,
        t0 + plan.warmup + plan.duration,
        seconds,
    ));
    let stop = Arc::new(AtomicBool::new(false));
    let lag = match plan.rate {
        Some(rate) => open_loop(&plan, rate, client, keys, t0, stats.clone(), stop).await?,
        None => {
            closed_loop(&plan, client, keys, t0, stats.clone(), stop).await?;
            None
        }
    };
    summary(&plan, &stats, lag.as_ref());
    Ok(())
}

/// Progress lines every second until `done` resolves; SIGTERM or Ctrl-C
/// sets `stop`.
async fn watch<F: std::future::Future>(
    stats: &Stats,
    t0: Instant,
    stop: &AtomicBool,
    done: F,
) -> F::Output {
    let mut tick =
        tokio::time::interval_at((t0 + Duration::from_secs(1)).into(), Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let signal = crate::serve::Termination::catch().wait();
    tokio::pin!(signal, done);
    let mut signalled = false;
    loop {
        tokio::select! {
            out = &mut done => return out,
            _ = tick.tick() => stats.progress(t0),
            _ = &mut signal, if !signalled => {
                signalled = true;
                stop.store(true, Ordering::Relaxed);
                println!("stopping: no new requests, waiting for those in flight");
            }
        }
    }
}

/// Wait (up to the request timeout and a margin) for every request in flight.
async fn drain(stats: &Stats, timeout: Duration) {
    let deadline = Instant::now() + timeout + Duration::from_secs(1);
    while stats.in_flight.load(Ordering::Relaxed) > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

async fn one(
    client: &Client,
    shape: &RequestShape,
    timeout: Duration,
    n: u64,
    key: u64,
) -> Outcome {
    match tokio::time::timeout(timeout, client.call(shape, n, key)).await {
        Ok(out) => out,
        Err(_) => Outcome::Error("timeout".into()),
    }
}

/// Requests on schedule from a pacer thread; returns the pacer's send-lag
/// histogram (µs behind schedule at dispatch, measured requests only).
async fn open_loop(
    plan: &Plan,
    rate: u64,
    client: Client,
    keys: Arc<Keys>,
    t0: Instant,
    stats: Arc<Stats>,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<Option<Histogram<u64>>> {
    let total = plan.warmup + plan.duration;
    let count = u64::try_from(total.as_nanos() * u128::from(rate) / 1_000_000_000)
        .map_err(|_| anyhow!("--rate × --duration: too many requests"))?;
    // The pacer thread only timestamps and queues (due, n, key); a task on
    // the client runtime spawns the requests in batches. So the runtime
    // thread allocates and frees its own tasks (with glibc, tasks allocated
    // on the pacer thread and freed on the runtime thread showed up as
    // malloc_consolidate and page faults in the pacer), and one wake-up of
    // the runtime carries every request that fell due since the last one.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(Instant, u64, u64)>();
    let seed = plan.seed;
    let pacer_stats = stats.clone();
    let pacer_stop = stop.clone();
    let pacer = tokio::task::spawn_blocking(move || {
        let stats = pacer_stats;
        let mut gen = KeyGen::new(keys, seed, 0);
        let mut lag = histogram();
        for i in 0..count {
            if pacer_stop.load(Ordering::Relaxed) {
                break;
            }
            let offset = u128::from(i) * 1_000_000_000 / u128::from(rate);
            let due = t0 + Duration::from_nanos(offset as u64);
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            if due >= stats.measure_start {
                lag.saturating_record(micros(Instant::now().saturating_duration_since(due)));
            }
            stats.start(due);
            if tx.send((due, i, gen.next())).is_err() {
                break;
            }
        }
        lag
    });
    let (shape, timeout) = (plan.shape.clone(), plan.timeout);
    let dispatch_stats = stats.clone();
    let dispatcher = tokio::spawn(async move {
        let mut batch = Vec::with_capacity(256);
        while rx.recv_many(&mut batch, 256).await > 0 {
            for (due, n, key) in batch.drain(..) {
                let (client, shape, stats) =
                    (client.clone(), shape.clone(), dispatch_stats.clone());
                tokio::spawn(async move {
                    let out = one(&client, &shape, timeout, n, key).await;
                    stats.finish(due, out);
                });
            }
        }
    });
    let lag = watch(&stats, t0, &stop, async {
        let lag = pacer.await;
        let _ = dispatcher.await;
        drain(&stats, plan.timeout).await;
        lag
    })
    .await
    .context("the pacer thread")?;
    Ok(Some(lag))
}

/// `concurrency` workers, each sending when its previous request is answered.
async fn closed_loop(
    plan: &Plan,
    client: Client,
    keys: Arc<Keys>,
    t0: Instant,
    stats: Arc<Stats>,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<()> {
    let end = t0 + plan.warmup + plan.duration;
    tokio::time::sleep_until(t0.into()).await;
    let mut workers = tokio::task::JoinSet::new();
    for w in 0..plan.concurrency {
        let (client, shape, stats, stop) = (
            client.clone(),
            plan.shape.clone(),
            stats.clone(),
            stop.clone(),
        );
        let mut gen = KeyGen::new(keys.clone(), plan.seed, w as u64);
        let timeout = plan.timeout;
        workers.spawn(async move {
            let mut n = w as u64;
            loop {
                let now = Instant::now();
                if now >= end || stop.load(Ordering::Relaxed) {
                    break;
                }
                let key = gen.next();
                stats.start(now);
                let out = one(&client, &shape, timeout, n, key).await;
                stats.finish(now, out);
                n += 1;
            }
        });
    }
    watch(&stats, t0, &stop, async {
        while let Some(r) = workers.join_next().await {
            r.context("a closed-loop worker")?;
        }
        Ok::<(), anyhow::Error>(())
    })
    .await
}

fn summary(plan: &Plan, stats: &Stats, lag: Option<&Histogram<u64>>) {
    let sent = stats.sent.load(Ordering::Relaxed);
    let admitted = stats.admitted.load(Ordering::Relaxed);
    let denied = stats.denied.load(Ordering::Relaxed);
    let errors = stats.errors.load(Ordering::Relaxed);
    let answered = admitted + denied;
    let unfinished = sent.saturating_sub(answered + errors);
    let last = Duration::from_nanos(stats.last_answer_ns.load(Ordering::Relaxed));
    let window = last.max(plan.duration).as_secs_f64();
    let achieved = answered as f64 / window;
    println!("--- summary ---");
    println!(
        "sent={sent} answered={answered} admitted={admitted} denied={denied} errors={errors}{}",
        if unfinished > 0 {
            format!(" unfinished={unfinished}")
        } else {
            String::new()
        }
    );
    match plan.rate {
        Some(rate) => println!(
            "achieved={achieved:.1} req/s (target {rate} req/s, {:.1}%)",
            100.0 * achieved / rate as f64
        ),
        None => println!(
            "throughput={achieved:.1} req/s ({} in flight)",
            plan.concurrency
        ),
    }
    let what = if plan.rate.is_some() {
        "from the intended send time"
    } else {
        "from the send time"
    };
    println!(
        "latency ({what}): {}",
        percentiles(&stats.hists.lock().total)
    );
    let mut per_s = stats.p99_per_s.lock().clone();
    if !per_s.is_empty() {
        per_s.sort_unstable();
        println!(
            "p99 of each second: median={} best={} worst={} ({} seconds)",
            ms(per_s[per_s.len() / 2]),
            ms(per_s[0]),
            ms(per_s[per_s.len() - 1]),
            per_s.len()
        );
    }
    if let Some(lag) = lag {
        println!("send lag (pacer behind schedule): {}", percentiles(lag));
        if !lag.is_empty() && lag.value_at_quantile(0.99) > 1000 {
            println!(
                "warning: the load generator fell behind its schedule by more than 1 ms at p99; \
                 latencies include its own delay"
            );
        }
    }
    let per_s: Vec<u64> = stats
        .admitted_per_s
        .iter()
        .map(|a| a.load(Ordering::Relaxed))
        .collect();
    let shown = per_s
        .iter()
        .rposition(|&a| a > 0)
        .map_or(0, |i| i + 1)
        .max(plan.duration.as_secs() as usize)
        .min(per_s.len());
    let series: Vec<String> = per_s[..shown].iter().map(|a| a.to_string()).collect();
    println!("admitted per second: {}", series.join(" "));
    let kinds = stats.error_kinds.lock();
    if kinds.is_empty() {
        println!("errors by kind: none");
    } else {
        let list: Vec<String> = kinds.iter().map(|(k, n)| format!("{k}={n}")).collect();
        println!("errors by kind: {}", list.join(", "));
    }
}

// ---------------------------------------------------------------- echo --

/// The do-nothing gRPC services.
#[derive(Clone, Copy, Debug, Default)]
struct Echo;

#[tonic::async_trait]
impl RateLimiter for Echo {
    async fn check(
        &self,
        _request: tonic::Request<CheckRequest>,
    ) -> Result<tonic::Response<CheckResponse>, tonic::Status> {
        Ok(tonic::Response::new(CheckResponse {
            allowed: true,
            reason: Reason::Ok as i32,
            ..CheckResponse::default()
        }))
    }
}

#[tonic::async_trait]
impl RateLimitService for Echo {
    async fn should_rate_limit(
        &self,
        request: tonic::Request<RateLimitRequest>,
    ) -> Result<tonic::Response<RateLimitResponse>, tonic::Status> {
        let statuses = request
            .get_ref()
            .descriptors
            .iter()
            .map(|_| DescriptorStatus {
                code: Code::Ok as i32,
                ..DescriptorStatus::default()
            })
            .collect();
        Ok(tonic::Response::new(RateLimitResponse {
            overall_code: Code::Ok as i32,
            statuses,
            ..RateLimitResponse::default()
        }))
    }
}

const ECHO_BODY: &str =
    r#"{"allowed":true,"remaining":0,"rule_id":"","rule_version":0,"reason":"OK"}"#;

fn echo_router() -> Router {
    let check = || async { ([(CONTENT_TYPE, "application/json")], ECHO_BODY) };
    Router::new()
        .route("/v1/check", get(check).post(check))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(|| async { "ready\n" }))
}

async fn bind(flag: &str, addr: SocketAddr) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .with_context(|| format!("{flag} {addr}: cannot listen"))
}

/// `quotalease bench --serve-echo`: the same servers as the agent (tonic
/// with the same message limits, axum), answering without any work.
async fn serve_echo(
    grpc: SocketAddr,
    http: SocketAddr,
    nodelay: bool,
    stop: crate::serve::Termination,
) -> anyhow::Result<()> {
    let grpc = bind("--grpc", grpc).await?;
    let http = bind("--http", http).await?;
    println!(
        "quotalease echo grpc={} http={}",
        grpc.local_addr()?,
        http.local_addr()?
    );
    let (tx, rx) = tokio::sync::watch::channel(false);
    let mut rx2 = rx.clone();
    let admin = tokio::spawn(async move {
        let http = http.tap_io(move |s| {
            if nodelay {
                let _ = s.set_nodelay(true);
            }
        });
        axum::serve(http, echo_router())
            .with_graceful_shutdown(async move {
                let _ = rx2.wait_for(|s| *s).await;
            })
            .await
    });
    let mut rx3 = rx.clone();
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(
                RateLimiterServer::new(Echo)
                    .max_decoding_message_size(MAX_MESSAGE_BYTES)
                    .max_encoding_message_size(MAX_MESSAGE_BYTES),
            )
            .add_service(
                RateLimitServiceServer::new(Echo)
                    .max_decoding_message_size(MAX_MESSAGE_BYTES)
                    .max_encoding_message_size(MAX_MESSAGE_BYTES),
            )
            .serve_with_incoming_shutdown(
                TcpIncoming::from(grpc).with_nodelay(nodelay.then_some(true)),
                async move {
                    let _ = rx3.wait_for(|s| *s).await;
                },
            ),
    );
    stop.wait().await;
    let _ = tx.send(true);
    let _ = tokio::time::timeout(Duration::from_secs(5), server).await;
    let _ = tokio::time::timeout(Duration::from_secs(5), admin).await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_parse_and_reject_with_reasons() {
        assert_eq!(parse_keys("hot"), Ok(KeySpec::Hot));
        assert_eq!(parse_keys("uniform:10"), Ok(KeySpec::Uniform(10)));
        assert_eq!(parse_keys("zipf:100:1.1"), Ok(KeySpec::Zipf(100, 1.1)));
        for bad in [
            "",
            "cold",
            "uniform",
            "uniform:0",
            "uniform:x",
            "zipf:10",
            "zipf:10:nan",
            "zipf:0:1",
            "zipf:10:-1",
            "zipf:20000000:1",
        ] {
            assert!(parse_keys(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn targets_are_plain_http_host_port() {
        assert_eq!(
            parse_target("http://127.0.0.1:80").unwrap().authority,
            "127.0.0.1:80"
        );
        assert_eq!(
            parse_target("localhost:8080/").unwrap().authority,
            "localhost:8080"
        );
        assert_eq!(parse_target("http://[::1]:9").unwrap().authority, "[::1]:9");
        for bad in [
            "https://a:1",
            "http://a",
            "http://a:0",
            "http://a:1/x",
            "grpc://a:1",
            "a:99999",
            "",
        ] {
            assert!(parse_target(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn key_streams_are_deterministic_and_in_range() {
        let keys = Arc::new(Keys::build(&KeySpec::Uniform(7)));
        let a: Vec<u64> = {
            let mut g = KeyGen::new(keys.clone(), 5, 0);
            (0..1000).map(|_| g.next()).collect()
        };
        let b: Vec<u64> = {
            let mut g = KeyGen::new(keys.clone(), 5, 0);
            (0..1000).map(|_| g.next()).collect()
        };
        let c: Vec<u64> = {
            let mut g = KeyGen::new(keys, 5, 1);
            (0..1000).map(|_| g.next()).collect()
        };
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert!(a.iter().all(|&k| k < 7));
        assert_eq!(a.iter().collect::<std::collections::BTreeSet<_>>().len(), 7);
    }

    #[test]
    fn zipf_frequencies_follow_the_law() {
        let n = 1000;
        let s = 1.0;
        let keys = Arc::new(Keys::build(&KeySpec::Zipf(n, s)));
        let mut g = KeyGen::new(keys, 42, 0);
        let draws = 200_000;
        let mut counts = vec![0u64; n as usize];
        for _ in 0..draws {
            counts[g.next() as usize] += 1;
        }
        let h: f64 = (1..=n).map(|k| (k as f64).powf(-s)).sum();
        for k in [1u64, 2, 10] {
            let expect = draws as f64 * (k as f64).powf(-s) / h;
            let got = counts[(k - 1) as usize] as f64;
            assert!(
                (got - expect).abs() < 0.05 * expect,
                "rank {k}: {got} vs {expect}"
            );
        }
        assert!(counts[0] > counts[1] && counts[1] > counts[9]);
        // Exponent 0 is uniform.
        let keys = Arc::new(Keys::build(&KeySpec::Zipf(4, 0.0)));
        let mut g = KeyGen::new(keys, 1, 0);
        let mut c = [0u64; 4];
        for _ in 0..40_000 {
            c[g.next() as usize] += 1;
        }
        assert!(c.iter().all(|&x| (9_000..11_000).contains(&x)), "{c:?}");
    }

    #[test]
    fn query_values_are_percent_encoded() {
        assert_eq!(percent_encode("/api/x y&z"), "%2Fapi%2Fx%20y%26z");
        assert_eq!(percent_encode("t-1._~"), "t-1._~");
        assert_eq!(percent_encode("é"), "%C3%A9");
    }

    #[test]
    fn milliseconds_keep_microseconds() {
        assert_eq!(ms(1), "0.001ms");
        assert_eq!(ms(12_345), "12.345ms");
    }
}

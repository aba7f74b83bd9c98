//! Agent memory per key held (SPEC §9: "agent memory <= 200 B per key held,
//! excluding the key bytes, measured: RSS growth over 1 M keys, each with an
//! unexpired lease").
//!
//! ```text
//! cargo run --release --example agent_memory -- [N]            # both modes, N = 1_000_000
//! cargo run --release --example agent_memory -- N agent        # one mode, this process
//! cargo run --release --example agent_memory -- N allocator
//! ```
//!
//! * `agent`: a real allocator core in this process behind the in-process
//!   transport, and a real agent (tokio driver, lease table, core). `N`
//!   distinct tenants of one `tenant: "*"` rule are checked once each
//!   (every key opens a lease: TTL 60 s, idle release 1 h, so nothing
//!   expires or is released during the run); RSS is read before and after
//!   (after `malloc_trim(0)`, so freed batch buffers do not count); then
//!   `check_fast` confirms every key still holds a lease. The growth is the
//!   agent's keys *and* the allocator's ledgers.
//! * `allocator`: the same allocator, driven directly with the same
//!   batches (one holder, one RENEW item per key) and no agent: its part of
//!   the figure above. Agent = the difference.
//!
//! Without a mode the binary runs itself once per mode (a fresh process
//! each, so neither inherits the other's heap) and prints both.

use std::sync::Arc;
use std::time::{Duration, Instant};

use quotalease_agent::agent::{Agent, AgentConfig, CheckInput, KeyId, Slot};
use quotalease_agent::lease_table::{LeaseWord, SlotHead};
use quotalease_agent::renewal::{PlanConfig, Usage};
use quotalease_agent::transport::InProcess;
use quotalease_allocator::core::CoreConfig;
use quotalease_allocator::ledger::{KeyLedger, Lease};
use quotalease_allocator::server::Shared;
use quotalease_model::bucket::TokenBucket;
use quotalease_model::rules::RuleSet;
use quotalease_proto::lease::{GrantStatus, ItemKind, LeaseBatch, LeaseItem, RequestHeader};

const RULE_ID: &str = "per-tenant";
const RULES: &str = r#"
rules:
  - id: per-tenant
    match: { tenant: "*" }
    rate: 1000/s
    burst: 64
"#;
const TTL: Duration = Duration::from_secs(60);
/// Long, so that a missed wake-up stands out from queueing delays.
const FETCH_TIMEOUT: Duration = Duration::from_secs(5);

fn tenant(i: usize) -> String {
    format!("tenant-{i:08}")
}

/// Resident set size of this process, in bytes.
fn rss() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm (Linux)");
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|f| f.parse().ok())
        .expect("statm: resident pages");
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64;
    pages * page
}

/// RSS after giving freed heap back to the kernel.
fn trimmed_rss() -> u64 {
    // SAFETY: malloc_trim only releases free memory of glibc's arenas.
    unsafe {
        libc::malloc_trim(0);
    }
    rss()
}

fn rules() -> RuleSet {
    RuleSet::parse(RULES, "agent_memory", 1).expect("valid rules")
}

fn allocator() -> Arc<Shared> {
    Shared::new(
        CoreConfig {
            no_predecessor: true,
            ttl_max_ns: 2 * TTL.as_nanos() as u64,
            ..CoreConfig::default()
        },
        rules(),
        None,
    )
}

/// Result of one mode: (RSS growth, keys holding a lease, seconds).
struct Run {
    growth: u64,
    held: usize,
    secs: f64,
}

fn run_agent(n: usize) -> Run {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    rt.block_on(async move {
        let shared = allocator();
        let s = shared.clone();
        // Largest lag (in sequence numbers) of a batch behind the newest
        // one the allocator had already handled when it arrived.
        let max_seq = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let worst_lag = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let (ms, wl) = (max_seq.clone(), worst_lag.clone());
        let transport = Arc::new(InProcess::new(move |b| {
            use std::sync::atomic::Ordering::Relaxed;
            let seq = b.header.as_ref().map_or(0, |h| h.seq);
            let newest = ms.fetch_max(seq, Relaxed);
            wl.fetch_max(newest.saturating_sub(seq), Relaxed);
            s.handle(b)
        }));
        let cfg = AgentConfig {
            agent_id: "memory".into(),
            lease_ttl: TTL,
            plan: PlanConfig {
                renew_interval: Duration::from_secs(1),
                low_water: Duration::from_millis(100),
                idle_release: Duration::from_secs(3600),
                ..PlanConfig::default()
            },
            fetch_timeout: FETCH_TIMEOUT,
            max_keys: n + 1,
            ..AgentConfig::default()
        };
        let agent = Agent::start(cfg, transport, None).expect("agent starts");
        for _ in 0..500 {
            if agent.is_ready() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(agent.is_ready(), "agent not ready");
        let before = trimmed_rss();
        let start = Instant::now();
        const TASKS: usize = 512;
        let mut tasks = tokio::task::JoinSet::new();
        for w in 0..TASKS {
            let agent = agent.clone();
            tasks.spawn(async move {
                // (admitted, denied on a first try and admitted on a retry,
                // checks that waited the whole fetch timeout)
                let (mut allowed, mut retried, mut slow) = (0usize, 0usize, 0usize);
                for i in (w..n).step_by(TASKS) {
                    let t = tenant(i);
                    let input = CheckInput {
                        tenant: &t,
                        route: "",
                        cost: 1,
                        request_id: "",
                        domain: None,
                    };
                    // A first check can be denied although tokens abound:
                    // see `stale` below (a batch the runtime sent late).
                    for attempt in 0..50 {
                        let t0 = Instant::now();
                        let r = agent.check(input).await.expect("an answer");
                        slow += usize::from(t0.elapsed() >= FETCH_TIMEOUT);
                        if r.allowed {
                            allowed += 1;
                            retried += usize::from(attempt > 0);
                            break;
                        }
                    }
                }
                (allowed, retried, slow)
            });
        }
        let (mut allowed, mut retried, mut slow) = (0, 0, 0);
        while let Some(r) = tasks.join_next().await {
            let (a, r, s) = r.expect("check task");
            allowed += a;
            retried += r;
            slow += s;
        }
        let secs = start.elapsed().as_secs_f64();
        let stale = shared.with_core(|c| c.stats().stale);
        println!(
            "agent mode: {retried} first checks denied and admitted on a retry; \
             {stale} batches refused STALE by the allocator (largest lag behind \
             the newest seq handled: {}; the reply cache holds {}); \
             {slow} checks took >= the fetch timeout ({FETCH_TIMEOUT:?}; no batch \
             is that late here, so a parked request missed its wake-up)",
            worst_lag.load(std::sync::atomic::Ordering::Relaxed),
            CoreConfig::default().reply_cache,
        );
        assert_eq!(allowed, n, "every first check of a key is admitted");
        let after = trimmed_rss();
        // Every key still holds an unexpired lease with tokens left (a cold
        // key is leased burst/16 = 4 tokens and spent one).
        let held = (0..n)
            .filter(|&i| {
                let t = tenant(i);
                let input = CheckInput {
                    tenant: &t,
                    route: "",
                    cost: 1,
                    request_id: "",
                    domain: None,
                };
                agent.check_fast(&input).is_some()
            })
            .count();
        assert_eq!(agent.key_count(), n);
        assert_eq!(shared.with_core(|c| c.key_count()), n);
        Run {
            growth: after.saturating_sub(before),
            held,
            secs,
        }
    })
}

fn run_allocator(n: usize) -> Run {
    let shared = allocator();
    let header = |seq: u64, rules_version: u64| RequestHeader {
        agent_id: "memory".into(),
        incarnation: 1,
        seq,
        protocol_version: quotalease_proto::PROTOCOL_VERSION,
        rules_version,
        instance: 1,
        ledger_id: 0,
        run_id: 0,
        record_seq: 0,
        cluster: String::new(),
        ledger_cluster: String::new(),
    };
    // Learn the rule version first (so replies do not carry the rule set).
    let hello = shared.handle(&LeaseBatch {
        header: Some(header(1, 0)),
        items: vec![],
        ttl_ms: 0,
        shard: 0,
    });
    let version = hello.rules.map_or(0, |r| r.version);
    let before = trimmed_rss();
    let start = Instant::now();
    let mut held = 0;
    const BATCH: usize = 512;
    for (b, chunk) in (0..n).collect::<Vec<_>>().chunks(BATCH).enumerate() {
        let items = chunk
            .iter()
            .map(|&i| LeaseItem {
                rule_id: RULE_ID.into(),
                tenant: tenant(i),
                route: String::new(),
                kind: ItemKind::Renew as i32,
                lease_id: 0,
                spent: 0,
                want: 4,
                ..LeaseItem::default()
            })
            .collect();
        let reply = shared.handle(&LeaseBatch {
            header: Some(header(b as u64 + 2, version)),
            items,
            ttl_ms: TTL.as_millis() as u64,
            shard: 0,
        });
        held += reply
            .grants
            .iter()
            .filter(|g| g.status == GrantStatus::Granted as i32 && g.tokens == 4)
            .count();
    }
    let secs = start.elapsed().as_secs_f64();
    let after = trimmed_rss();
    assert_eq!(shared.with_core(|c| c.key_count()), n);
    Run {
        growth: after.saturating_sub(before),
        held,
        secs,
    }
}

fn sizes(key_bytes: usize) {
    use std::mem::size_of;
    println!("size_of (bytes):");
    println!(
        "  agent  lease_table::SlotHead        {:>4} (LeaseWord {} at offset 64; request-side atomics; the core's renewal state packed in 64 B)",
        size_of::<SlotHead>(),
        size_of::<LeaseWord>()
    );
    println!(
        "  agent  Slot block, {key_bytes} B key       {:>4} (one allocation per key: head + key bytes, align 16; Slot is a {} B thin handle)",
        Slot::block_bytes(key_bytes),
        size_of::<Slot>()
    );
    println!(
        "  agent  lease table cell               8 (open addressing, one slot address + 4 tag bits a cell, at most 3/4 full, a power of two: 2^21 cells at 1 M keys; no node per key)"
    );
    println!(
        "  agent  core KeyState (decoded)      {:>4} (AgentCore::KEY_STATE_BYTES: the core's working copy; stored packed in the slot)",
        quotalease_agent::core::AgentCore::KEY_STATE_BYTES
    );
    println!(
        "  agent  renewal::Usage               {:>4}",
        size_of::<Usage>()
    );
    println!(
        "  agent  Option<(u64, TokenBucket)>   {:>4} (an emergency bucket, in the core's map of rare parts)",
        size_of::<Option<(u64, TokenBucket)>>()
    );
    println!(
        "  alloc  ledger::KeyLedger            {:>4} (a heap block of its own, + a Vec<Lease> block, {} per lease)",
        size_of::<KeyLedger>(),
        size_of::<Lease>()
    );
    println!(
        "  alloc  map entry (KeyId, Box<KeyLedger>) {:>4}",
        size_of::<(KeyId, Box<KeyLedger>)>()
    );
}

fn report(mode: &str, n: usize, r: &Run, key_bytes: usize) {
    println!(
        "{mode:>9}: N {n}, RSS growth {:.1} MiB = {:.1} B/key (key bytes {key_bytes} B/key), {} keys hold a lease, {:.1} s",
        r.growth as f64 / (1 << 20) as f64,
        r.growth as f64 / n as f64,
        r.held,
        r.secs
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let n: usize = args
        .get(1)
        .map(|s| s.replace('_', "").parse().expect("N: a number of keys"))
        .unwrap_or(1_000_000);
    let key_bytes = RULE_ID.len() + tenant(0).len();
    match args.get(2).map(String::as_str) {
        Some("agent") => {
            let r = run_agent(n);
            report("agent+alloc", n, &r, key_bytes);
            println!("RESULT {}", r.growth);
        }
        Some("allocator") => {
            let r = run_allocator(n);
            report("allocator", n, &r, key_bytes);
            println!("RESULT {}", r.growth);
        }
        Some(other) => panic!("mode {other:?}: agent or allocator"),
        None => {
            sizes(key_bytes);
            let exe = std::env::current_exe().expect("own path");
            let mut growth = Vec::new();
            for mode in ["agent", "allocator"] {
                let out = std::process::Command::new(&exe)
                    .args([n.to_string(), mode.to_string()])
                    .output()
                    .expect("run a mode");
                let text = String::from_utf8_lossy(&out.stdout);
                assert!(
                    out.status.success(),
                    "{mode}: {text}{}",
                    String::from_utf8_lossy(&out.stderr)
                );
                for line in text.lines() {
                    match line.strip_prefix("RESULT ") {
                        Some(g) => growth.push(g.parse::<u64>().expect("growth")),
                        None => println!("{line}"),
                    }
                }
            }
            let agent = growth[0].saturating_sub(growth[1]) as f64 / n as f64;
            println!(
                "agent alone (difference): {agent:.1} B/key including its key bytes; {:.1} B/key excluding them once",
                agent - key_bytes as f64
            );
        }
    }
}

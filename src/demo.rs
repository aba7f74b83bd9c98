//! `quotalease demo`: one global allocator, two regional allocators and six
//! agents (three per region) in one process, talking real gRPC over
//! loopback, under a synthetic gateway load — one hot tenant at three times
//! its rate and many cold ones. Ends with a table per rule, with I1 checked
//! by an independent sliding-window counter of admissions (not the
//! allocators' books).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use parking_lot::Mutex;
use quotalease_agent::agent::{Agent, AgentConfig, CheckInput};
use quotalease_agent::transport::GrpcTransport;
use quotalease_allocator::core::CoreConfig;
use quotalease_allocator::regional::RegionalConfig;
use quotalease_allocator::server::{LeaseService, Shared};
use quotalease_allocator::upstream;
use quotalease_model::clock::BootClock;
use quotalease_model::rules::RuleSet;
use quotalease_proto::v1::Reason;
use quotalease_sim::checker::worst_window;
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;

mod permits;

const DEMO_RULES: &str = r#"
rules:
  - id: orders
    match: { tenant: "*", route: /api/orders }
    rate: 200/s
    burst: 200
    fail_policy: lease_only
  - id: search
    match: { tenant: "*", route: /api/search }
    rate: 10/s
    burst: 20
    fail_policy: lease_only
  - id: login
    match: { tenant: "*", route: /api/login }
    rate: 5/m
    burst: 5
    fail_policy: closed
  - id: checkout
    match: { tenant: "*", route: /api/checkout }
    rate: 2000/s
    burst: 100
    fail_policy: lease_only
  - id: tenant-total
    match: { tenant: "*" }
    rate: 5000/s
    burst: 2500
    fail_policy: lease_only
"#;

const AGENTS: usize = 6;
const REGIONS: [&str; 2] = ["eu", "us"];
const HOT_TENANT: &str = "acme";
/// The tenant that asks twice the small-burst `checkout` rule's rate.
const CHECKOUT_TENANT: &str = "globex";
/// Its checks per second over all agents: 2 x the rule's 2000/s.
const CHECKOUT_RATE: f64 = 4000.0;
const COLD_TENANTS: usize = 300;

/// Admissions per key: (rule, tenant part, route part) -> [(t_ns, cost)].
type Log = Mutex<BTreeMap<(String, String, String), Vec<(u64, u64)>>>;

#[derive(Default)]
struct Counts {
    checks: BTreeMap<String, u64>,
    admitted: BTreeMap<String, u64>,
    denied: BTreeMap<String, u64>,
    unavailable: u64,
    /// Every check of a key of a charged rule: (arrival, admitted), for an
    /// ideal bucket fed the same arrivals.
    arrivals: BTreeMap<(String, String, String), Vec<(u64, bool)>>,
}

pub async fn run(duration: Duration) -> anyhow::Result<()> {
    // A concurrency rule beside the rate rules (src/demo/permits.rs).
    let text = format!("{DEMO_RULES}{}", permits::RULE);
    let rules = RuleSet::parse(&text, "<demo>", 1).map_err(|e| anyhow::anyhow!("{}", e[0]))?;
    // Short TTL_max so the start-up wait (SPEC §2 "Restarts") is brief.
    // This process is the first and only allocator of these keys, so it
    // may skip the start-up wait that a restarted allocator must honour.
    let cfg = CoreConfig {
        ttl_max_ns: 1_000_000_000,
        no_predecessor: true,
        ..CoreConfig::default()
    };
    let shared = Shared::new(cfg, rules.clone(), None);
    let addr = serve(shared.clone()).await?;
    // Two regional allocators take leases from the global one and
    // sub-lease them to the agents of their region.
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut regional_urls = Vec::new();
    let mut regionals = Vec::new();
    for region in REGIONS {
        let rcfg = RegionalConfig {
            core: CoreConfig {
                ttl_max_ns: 1_000_000_000,
                ..CoreConfig::default()
            },
            region: region.to_string(),
            lease_ttl_ns: 1_000_000_000,
            ..RegionalConfig::default()
        };
        let regional = Shared::new_regional(rcfg, None);
        let raddr = serve(regional.clone()).await?;
        let timeout = Duration::from_millis(500);
        let client = upstream::client(&format!("http://{addr}"), timeout, None)
            .map_err(|e| anyhow::anyhow!(e))?;
        tokio::spawn(upstream::run(regional.clone(), client, stop_rx.clone()));
        regional_urls.push(format!("http://{raddr}"));
        regionals.push((region, raddr, regional));
    }
    println!(
        "quotalease demo: global allocator on {addr}; regional allocators {} on {} and {} on {}; {AGENTS} agents ({} per region); {}s of load",
        regionals[0].0,
        regionals[0].1,
        regionals[1].0,
        regionals[1].1,
        AGENTS / REGIONS.len(),
        duration.as_secs()
    );
    println!("rules: orders 200/s burst 200 per tenant (hot tenant {HOT_TENANT} asks 600/s), search 10/s burst 20 per tenant ({COLD_TENANTS} cold tenants, ~1/s each),");
    println!("       login 5/m burst 5 per tenant ({HOT_TENANT} tries 1 every 2 s), checkout 2000/s burst 100 per tenant (a burst of 0.05 s of rate; {CHECKOUT_TENANT} asks {CHECKOUT_RATE}/s),");
    println!("       tenant-total 5000/s burst 2500 per tenant");
    let mut agents = Vec::new();
    for i in 0..AGENTS {
        let url = &regional_urls[i * REGIONS.len() / AGENTS];
        let t = GrpcTransport::new(std::slice::from_ref(url), Duration::from_millis(250))
            .map_err(|e| anyhow::anyhow!(e))?;
        let cfg = AgentConfig {
            agent_id: format!("demo-agent-{i}"),
            lease_ttl: Duration::from_secs(1),
            ..AgentConfig::default()
        };
        agents.push(Agent::start(cfg, Arc::new(t), None)?);
    }
    // Wait for rules and for the allocator's start-up wait to pass.
    let ready_at = shared.with_core(|c| c.ready_at_ns());
    while BootClock::now() < ready_at || agents.iter().any(|a| !a.is_ready()) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let permit_load = permits::start(&format!("http://{addr}"), duration).await?;
    let log: Arc<Log> = Arc::new(Mutex::new(BTreeMap::new()));
    let counts = Arc::new(Mutex::new(Counts::default()));
    let start = Instant::now();
    let start_ns = BootClock::now();
    let mut tasks = Vec::new();
    for (i, agent) in agents.iter().enumerate() {
        let agent = agent.clone();
        let log = log.clone();
        let counts = counts.clone();
        tasks.push(tokio::spawn(async move {
            load(i, agent, duration, log, counts).await;
        }));
    }
    // Live progress.
    let mut last = 0;
    while start.elapsed() < duration {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let (adm, den) = {
            let c = counts.lock();
            (
                c.admitted.values().sum::<u64>(),
                c.denied.values().sum::<u64>(),
            )
        };
        let msgs: u64 = agents.iter().map(|a| a.metrics().messages.get()).sum();
        let secs = start.elapsed().as_secs();
        if secs != last {
            last = secs;
            println!(
                "  t={secs:>3}s  admitted {adm:>7}  denied {den:>7}  allocator messages {msgs:>6}"
            );
        }
    }
    for t in tasks {
        let _ = t.await;
    }
    let end_ns = BootClock::now();
    let t_s = (end_ns - start_ns) as f64 / 1e9;
    let checks: u64 = agents.iter().map(|a| a.metrics().checks()).sum();
    let msgs: u64 = agents.iter().map(|a| a.metrics().messages.get()).sum();
    let msgs_by_rule: BTreeMap<String, u64> = rules
        .rules
        .iter()
        .map(|r| {
            (
                r.id.clone(),
                agents
                    .iter()
                    .map(|a| a.metrics().messages_for_rule(&r.id))
                    .sum(),
            )
        })
        .collect();
    for a in &agents {
        a.shutdown().await;
    }
    let _ = stop_tx.send(true);
    let violations: u64 = shared.with_core(|c| c.stats().shadow_violations.values().sum());
    let upstream_msgs: Vec<(String, u64)> = regionals
        .iter()
        .map(|(name, _, r)| {
            (
                name.to_string(),
                r.with_regional(|c| c.stats().upstream_messages)
                    .unwrap_or(0),
            )
        })
        .collect();

    // The table: per rule, the busiest key's bound and utilization, and
    // I1 over every window of every key.
    println!();
    println!(
        "{:<13} {:>8} {:>8} {:>8} {:>5} {:>13} {:>9} {:>9} {:>9} {:>7} {:>7} {:>7} {:>5}",
        "rule",
        "checks",
        "admitted",
        "denied",
        "keys",
        "busiest key",
        "its adm",
        "ideal",
        "B+R*T",
        "vs id %",
        "util %",
        "chk/msg",
        "I1"
    );
    let (permit_report, i4_held) = permit_load.finish().await;
    let log = log.lock();
    let counts = counts.lock();
    let mut all_held = true;
    for rule in &rules.rules {
        let mut held = true;
        let mut busiest: Option<(u64, String, u64)> = None;
        let mut keys = 0;
        for ((rid, tenant, route), adm) in log.iter() {
            if rid != &rule.id {
                continue;
            }
            keys += 1;
            let mut a = adm.clone();
            let w = worst_window(&mut a, rule.rate, rule.burst);
            held &= w.held();
            let total: u64 = adm.iter().map(|x| x.1).sum();
            if busiest.as_ref().is_none_or(|b| total > b.0) {
                let key = (rid.clone(), tenant.clone(), route.clone());
                let arrivals = counts.arrivals.get(&key).map_or(&[][..], |a| &a[..]);
                let ideal = ideal_admits(rule, arrivals);
                busiest = Some((total, format!("{tenant}{route}"), ideal));
            }
        }
        all_held &= held;
        let rate_per_s = rule.rate.tokens as f64 / rule.rate.period_s as f64;
        let bound = rule.burst as f64 + rate_per_s * t_s;
        let (b_adm, b_name, b_ideal) = busiest.unwrap_or((0, "-".into(), 0));
        let util = 100.0 * b_adm as f64 / bound.max(1e-9);
        let rule_checks = counts.checks.get(&rule.id).copied().unwrap_or(0);
        let rule_msgs = msgs_by_rule.get(&rule.id).copied().unwrap_or(0);
        println!(
            "{:<13} {:>8} {:>8} {:>8} {:>5} {:>13} {:>9} {:>9} {:>9.0} {:>7.1} {:>7.1} {:>7.1} {:>5}",
            rule.id,
            rule_checks,
            counts.admitted.get(&rule.id).copied().unwrap_or(0),
            counts.denied.get(&rule.id).copied().unwrap_or(0),
            keys,
            truncate(&b_name, 13),
            b_adm,
            b_ideal,
            bound,
            100.0 * b_adm as f64 / b_ideal.max(1) as f64,
            util.min(999.9),
            rule_checks as f64 / rule_msgs.max(1) as f64,
            if held { "held" } else { "BROKEN" }
        );
    }
    println!();
    println!("T = {t_s:.1}s. For the busiest key of each rule: its admitted tokens; what one ideal bucket (exact, starting full) admits over the same arrivals, and vs id % = admitted / ideal (of that rule alone: a key charged beside another rule, like tenant-total, also loses what the other rule denies); the bound B + R*T, and util % = admitted / (B + R*T).");
    println!("chk/msg = checks matching the rule / messages from agents to their regional allocator carrying any of its keys (a batch counts once); all rules: {checks} checks / {msgs} messages.");
    for (name, n) in &upstream_msgs {
        println!(
            "regional allocator {name}: {n} messages to the global allocator ({:.0} checks per message overall)",
            checks as f64 / REGIONS.len() as f64 / (*n).max(1) as f64
        );
    }
    if counts.unavailable > 0 {
        println!("{} checks were answered unavailable.", counts.unavailable);
    }
    println!("I1 is checked over every window of every key from the admissions recorded here, independently of the allocator; shadow-bucket alarms: {violations}");
    println!();
    println!("{permit_report}");
    if !all_held || violations > 0 {
        anyhow::bail!("the bound B + R*T was broken");
    }
    if !i4_held {
        anyhow::bail!("more permits were held at once than the concurrency limit");
    }
    Ok(())
}

/// Serve the Lease protocol of `shared` on an ephemeral loopback port.
async fn serve(shared: Arc<Shared>) -> anyhow::Result<std::net::SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .context("binding a demo allocator")?;
    let addr = listener.local_addr()?;
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(LeaseService::new(shared).into_server())
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    Ok(addr)
}

/// What one ideal bucket of `rule` (exact, global, starting full) admits
/// over `arrivals` (time, our answer), each of cost 1: the simulator's
/// shortfall figure (SPEC §2).
fn ideal_admits(rule: &quotalease_model::rules::Rule, arrivals: &[(u64, bool)]) -> u64 {
    let mut sorted = arrivals.to_vec();
    sorted.sort_unstable();
    let mut ideal = quotalease_sim::quality::FalseRejectStream::new(rule.rate, rule.burst, 0);
    for (t, admitted) in sorted {
        ideal.push(t, 1, admitted);
    }
    ideal.versus_ideal().1
}

fn truncate(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        format!("{}…", s.chars().take(n - 1).collect::<String>())
    }
}

/// Open-loop load for one agent: the hot tenant at 3x its rate split over
/// the agents, cold tenants at ~1/s each, and occasional logins.
async fn load(
    i: usize,
    agent: Agent,
    duration: Duration,
    log: Arc<Log>,
    counts: Arc<Mutex<Counts>>,
) {
    let hot_per_agent = 600.0 / AGENTS as f64; // 3x the orders rate of 200/s
    let cold_per_agent = COLD_TENANTS as f64 / AGENTS as f64; // ~1/s per cold tenant
    let checkout_per_agent = CHECKOUT_RATE / AGENTS as f64;
    let start = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(5));
    let (mut hot_due, mut cold_due, mut login_due) = (0.0f64, 0.0f64, 0.0f64);
    let mut checkout_due = 0.0f64;
    let mut n = 0u64;
    let rules = agent.rules().expect("agent is ready");
    let mut inflight = tokio::task::JoinSet::new();
    while start.elapsed() < duration {
        tick.tick().await;
        let dt = 0.005;
        hot_due += hot_per_agent * dt;
        cold_due += cold_per_agent * dt;
        login_due += 0.5 * dt;
        checkout_due += checkout_per_agent * dt;
        let mut batch: Vec<(String, &'static str)> = Vec::new();
        while hot_due >= 1.0 {
            hot_due -= 1.0;
            batch.push((HOT_TENANT.to_string(), "/api/orders"));
        }
        while cold_due >= 1.0 {
            cold_due -= 1.0;
            n += 1;
            let t = (n as usize * 7 + i * 13) % COLD_TENANTS;
            batch.push((format!("tenant-{t:03}"), "/api/search"));
        }
        while login_due >= 1.0 {
            login_due -= 1.0;
            batch.push((HOT_TENANT.to_string(), "/api/login"));
        }
        while checkout_due >= 1.0 {
            checkout_due -= 1.0;
            batch.push((CHECKOUT_TENANT.to_string(), "/api/checkout"));
        }
        // A gateway does not wait for one request before taking the next:
        // each check runs on its own task (a cold key's first check waits
        // for its lease without holding up the others).
        for (tenant, route) in batch {
            let (agent, rules, log, counts) =
                (agent.clone(), rules.clone(), log.clone(), counts.clone());
            inflight.spawn(async move {
                let input = CheckInput {
                    tenant: &tenant,
                    route,
                    cost: 1,
                    request_id: "",
                    domain: None,
                };
                let arrived = BootClock::now();
                let res = agent.check(input).await;
                let t = BootClock::now();
                let matched = rules.matching(None, &tenant, route).unwrap_or_default();
                let mut c = counts.lock();
                for rule in &matched {
                    *c.checks.entry(rule.id.clone()).or_insert(0) += 1;
                }
                let admitted = matches!(&res, Ok(r) if r.allowed);
                for rule in matched.iter().filter(|r| !r.shadow) {
                    c.arrivals
                        .entry((
                            rule.id.clone(),
                            rule.tenant.key_part(&tenant).to_string(),
                            rule.route.key_part(route).to_string(),
                        ))
                        .or_default()
                        .push((arrived, admitted));
                }
                match res {
                    Ok(r) if r.allowed && r.reason != Reason::NoRule as i32 => {
                        let mut l = log.lock();
                        for rule in matched.iter().filter(|r| !r.shadow) {
                            *c.admitted.entry(rule.id.clone()).or_insert(0) += 1;
                            l.entry((
                                rule.id.clone(),
                                rule.tenant.key_part(&tenant).to_string(),
                                rule.route.key_part(route).to_string(),
                            ))
                            .or_default()
                            .push((t, 1));
                        }
                    }
                    Ok(_) => {
                        for rule in &matched {
                            *c.denied.entry(rule.id.clone()).or_insert(0) += 1;
                        }
                    }
                    Err(_) => c.unavailable += 1,
                }
            });
        }
        while inflight.try_join_next().is_some() {}
    }
    while inflight.join_next().await.is_some() {}
}

//! End to end: slow and small rules (SPEC §2, "Slow and small rules")
//! across many gateways, all real child processes over real gRPC: a global
//! allocator, two regional allocators and agents in each region.
//!
//! * `5/m burst 5`, six agents in two regions all asking at the same
//!   instant and then each once a second: exactly 5 admitted at once, then
//!   one per 12 s, as one ideal bucket fed the same arrivals admits.
//! * The same with three agents through three `--etcd` replicas.
//! * `1/d burst 10`, 100 concurrent requests over three agents in two
//!   regions: exactly 10 admitted.

mod common;

use std::time::{Duration, Instant};

use common::*;
use quotalease_model::clock::BootClock;
use quotalease_proto::v1::rate_limiter_client::RateLimiterClient;
use tonic::transport::Channel;

const SLOW_RULES: &str = r#"
rules:
  - id: login
    match: { tenant: "*", route: /api/login }
    rate: 5/m
    burst: 5
    fail_policy: closed
  - id: daily
    match: { tenant: "*", route: /api/daily }
    rate: 1/d
    burst: 10
    fail_policy: closed
"#;

/// A global allocator, regionals `eu` and `us`, and `per_region` agents
/// under each (logging admissions), all ready.
struct Topology {
    _global: Proc,
    _regionals: Vec<Proc>,
    agents: Vec<Proc>,
    logs: Vec<std::path::PathBuf>,
    /// Dropped last: after the processes that write in it.
    _dir: TempDir,
}

impl Topology {
    /// Stop the agents (their admission logs are complete then): the logs.
    fn stop_agents(&mut self) -> Vec<std::path::PathBuf> {
        for a in std::mem::take(&mut self.agents) {
            assert!(a.terminate().success());
        }
        self.logs.clone()
    }
}

fn two_regions(name: &str, per_region: usize) -> Topology {
    let dir = tempdir(name);
    let rules = write_rules(&dir, SLOW_RULES);
    let global = allocator(&rules, &dir.join("state"), None, "2s");
    wait_ok(global.http, "/readyz", Duration::from_secs(10));
    let regionals: Vec<Proc> = ["eu", "us"]
        .iter()
        .map(|r| regional(&global.url(), r, None, &[]))
        .collect();
    for r in &regionals {
        wait_ok(r.http, "/readyz", Duration::from_secs(10));
    }
    let n = 2 * per_region;
    let logs: Vec<_> = (0..n).map(|i| dir.join(format!("adm-{i}.log"))).collect();
    let agents: Vec<Proc> = (0..n)
        .map(|i| {
            let parent = &regionals[i / per_region];
            agent(&format!("{name}-{i}"), &parent.url(), Some(&logs[i]), &[])
        })
        .collect();
    for a in &agents {
        wait_ok(a.http, "/readyz", Duration::from_secs(10));
    }
    Topology {
        _global: global,
        _regionals: regionals,
        agents,
        logs,
        _dir: dir,
    }
}

/// One check of cost 1 for tenant `acme` on `route` through `c`: allowed?
async fn check_once(c: &mut RateLimiterClient<Channel>, route: &str) -> bool {
    check_one(c, "acme", route).await.allowed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_login_rule_admits_five_at_once_then_one_per_twelve_seconds_across_six_agents() {
    let mut top = two_regions("slow-login", 3);
    let admitted_at = login_rounds(&top.agents, 27).await;
    let start_ns = admitted_at.0;
    let logs = top.stop_agents();
    login_like_an_ideal_bucket(&logs, start_ns, &admitted_at.1, 6);
}

/// The same through three `--etcd` replicas (one etcd member), an agent
/// at each (3 admitted at once, 2 a second later): before, each agent
/// held a third of the rate and waited for its own token (one per ~36 s
/// each instead of one per 12 s in all).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_login_rule_through_three_etcd_replicas_admits_like_one_bucket() {
    use common::etcd::*;
    let Some(bin) = etcd_bin() else { return };
    let dir = tempdir("slow-etcd");
    let rules = write_rules(&dir, SLOW_RULES);
    let etcd = Etcd::start(&bin, &dir, 1);
    let urls = etcd.urls();
    let replicas = replicas(&dir, Some(&rules), &urls, 3);
    leader_of(&replicas, None, Duration::from_secs(20));
    let logs: Vec<_> = (0..3).map(|i| dir.join(format!("adm-{i}.log"))).collect();
    let agents: Vec<Proc> = (0..3)
        .map(|i| {
            let up = replicas[i].as_ref().expect("started").url();
            agent(&format!("slow-etcd-{i}"), &up, Some(&logs[i]), &[])
        })
        .collect();
    for a in &agents {
        wait_ok(a.http, "/readyz", Duration::from_secs(20));
    }
    let (start_ns, admitted_at) = login_rounds(&agents, 27).await;
    for a in agents {
        assert!(a.terminate().success());
    }
    login_like_an_ideal_bucket(&logs, start_ns, &admitted_at, 3);
    drop(replicas);
    drop(etcd);
}

/// Every agent asks `login` once a second, all at the same instant, for
/// `rounds` seconds: (the boot-clock instant of the first round, the
/// seconds since it at which answers said "allowed").
async fn login_rounds(agents: &[Proc], rounds: u32) -> (u64, Vec<f64>) {
    let mut clients = Vec::new();
    for a in agents {
        clients.push(client(a).await);
    }
    let start = Instant::now();
    let start_ns = BootClock::now();
    let mut admitted_at: Vec<f64> = Vec::new();
    for round in 0..rounds {
        let due = start + Duration::from_secs(round.into());
        tokio::time::sleep(due.saturating_duration_since(Instant::now())).await;
        let tasks: Vec<_> = clients
            .iter()
            .map(|c| {
                let mut c = c.clone();
                tokio::spawn(async move { check_once(&mut c, "/api/login").await })
            })
            .collect();
        for t in tasks {
            if t.await.expect("task") {
                admitted_at.push(start.elapsed().as_secs_f64());
            }
        }
    }
    eprintln!("login admissions at (s): {admitted_at:.2?}");
    (start_ns, admitted_at)
}

/// What one ideal `5/m burst 5` bucket admits of demand far above it over
/// 27 s from `start_ns`, `agents` asking each round: as many as ask (at
/// most 5) in the first round, the rest of the 5 in the second, then one
/// in the first round at or after 12 s and after 24 s. I1 exactly, from
/// the admission logs.
fn login_like_an_ideal_bucket(
    logs: &[std::path::PathBuf],
    start_ns: u64,
    admitted_at: &[f64],
    agents: usize,
) {
    let adm = read_admissions(logs);
    let key = (
        "login".to_string(),
        "acme".to_string(),
        "/api/login".to_string(),
    );
    let mut list = adm.get(&key).cloned().unwrap_or_default();
    let w = quotalease_sim::checker::worst_window(
        &mut list,
        quotalease_model::rules::Rate {
            tokens: 5,
            period_s: 60,
        },
        5,
    );
    assert!(w.held(), "I1: {w:?}");
    // As many as ask at once, up to the burst; the rest of it in the
    // next round.
    let first = admitted_at.iter().filter(|t| **t < 1.0).count();
    assert_eq!(first, agents.min(5), "admitted at once: {admitted_at:?}");
    let by_two = admitted_at.iter().filter(|t| **t < 2.0).count();
    assert_eq!(by_two, 5, "admitted in two rounds: {admitted_at:?}");
    assert_eq!(admitted_at.len(), 7, "admissions: {admitted_at:?}");
    // The 6th and 7th tokens are due 12 and 24 s after the first five
    // were taken (at start_ns or a round trip after); each is admitted in
    // the round that follows, within a round (1 s) and a round trip.
    let mut times: Vec<u64> = list.iter().map(|a| a.0 - start_ns).collect();
    times.sort_unstable();
    for (i, due_s) in [(5usize, 12.0f64), (6, 24.0)] {
        let t = times[i] as f64 / 1e9;
        assert!(
            t >= due_s - 0.5 && t <= due_s + 1.5,
            "token {} admitted at {t:.2} s, due {due_s} s: {times:?}",
            i + 1
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daily_rule_admits_its_burst_of_ten_to_a_hundred_concurrent_requests() {
    let mut top = two_regions("slow-daily", 2);
    // Three agents: two in eu, one in us.
    let agents = [&top.agents[0], &top.agents[1], &top.agents[2]];
    let mut tasks = Vec::new();
    for i in 0..100usize {
        let mut c = client(agents[i % 3]).await;
        tasks.push(tokio::spawn(async move {
            check_once(&mut c, "/api/daily").await
        }));
    }
    let mut admitted = 0;
    for t in tasks {
        admitted += usize::from(t.await.expect("task"));
    }
    assert_eq!(admitted, 10, "1/d burst 10 under 100 concurrent requests");
    let adm = read_admissions(&top.stop_agents());
    let key = (
        "daily".to_string(),
        "acme".to_string(),
        "/api/daily".to_string(),
    );
    assert_eq!(adm.get(&key).map_or(0, |l| l.len()), 10, "{adm:?}");
}

//! A real etcd cluster on 127.0.0.1 and `quotalease allocator --etcd`
//! replicas, for the high-availability and sharding tests.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use quotalease_proto::v1::{CheckRequest, Reason};

use super::*;

/// The rules of the HA and sharding tests: a hot rule and a slow one.
pub const HA_RULES: &str = r#"
rules:
  - id: ha
    match: { tenant: "*", route: /api/ha }
    rate: 200/s
    burst: 50
    fail_policy: lease_only
  - id: slow
    match: { tenant: "*", route: /api/slow }
    rate: 1/m
    burst: 5
    fail_policy: closed
"#;

/// The etcd binary, or `None` (outside CI) when there is none.
pub fn etcd_bin() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("QUOTALEASE_ETCD") {
        return Some(PathBuf::from(p));
    }
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("etcd"))
            .find(|p| p.is_file())
    });
    if found.is_none() {
        assert!(
            std::env::var_os("CI").is_none(),
            "etcd is missing: the test command installs Debian's etcd-server (or set QUOTALEASE_ETCD)"
        );
        eprintln!("SKIPPED: no etcd on PATH (install Debian's etcd-server or set QUOTALEASE_ETCD)");
    }
    found
}

/// One etcd member, killed when dropped.
pub struct Member {
    pub child: Child,
    pub client: String,
}

impl Drop for Member {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An etcd cluster on 127.0.0.1.
pub struct Etcd {
    pub members: Vec<Option<Member>>,
    bin: PathBuf,
    dir: PathBuf,
    peers: Vec<std::net::SocketAddr>,
    clients: Vec<std::net::SocketAddr>,
}

impl Etcd {
    pub fn start(bin: &Path, dir: &Path, n: usize) -> Etcd {
        let mut etcd = Etcd {
            members: (0..n).map(|_| None).collect(),
            bin: bin.to_path_buf(),
            dir: dir.to_path_buf(),
            peers: (0..n).map(|_| free_addr()).collect(),
            clients: (0..n).map(|_| free_addr()).collect(),
        };
        for i in 0..n {
            etcd.members[i] = Some(etcd.spawn(i));
        }
        // Up when every member answers its health check.
        for i in 0..n {
            etcd.wait_up(i);
        }
        etcd
    }

    /// Member `i`'s data directory.
    pub fn data_dir(&self, i: usize) -> PathBuf {
        self.dir.join(format!("etcd-{i}"))
    }

    /// Stop member `i` with SIGTERM and wait for it to exit.
    pub fn stop(&mut self, i: usize) {
        if let Some(mut m) = self.members[i].take() {
            unsafe {
                libc::kill(m.child.id() as i32, libc::SIGTERM);
            }
            let _ = m.child.wait();
        }
    }

    /// Start member `i` again on its data directory and addresses.
    pub fn restart(&mut self, i: usize) {
        self.stop(i);
        self.members[i] = Some(self.spawn(i));
        self.wait_up(i);
    }

    fn wait_up(&self, i: usize) {
        wait_ok(self.clients[i], "/health", Duration::from_secs(30));
    }

    fn spawn(&self, i: usize) -> Member {
        let initial: Vec<String> = self
            .peers
            .iter()
            .enumerate()
            .map(|(i, p)| format!("m{i}=http://{p}"))
            .collect();
        let (peer, client) = (self.peers[i], self.clients[i]);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(format!("etcd-{i}.log")))
            .expect("log");
        let child = Command::new(&self.bin)
            .args([
                "--name",
                &format!("m{i}"),
                "--data-dir",
                &self.data_dir(i).display().to_string(),
                "--listen-client-urls",
                &format!("http://{client}"),
                "--advertise-client-urls",
                &format!("http://{client}"),
                "--listen-peer-urls",
                &format!("http://{peer}"),
                "--initial-advertise-peer-urls",
                &format!("http://{peer}"),
                "--initial-cluster",
                &initial.join(","),
                "--initial-cluster-state",
                "new",
                "--initial-cluster-token",
                "quotalease-test",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn etcd");
        Member {
            child,
            client: format!("http://{client}"),
        }
    }

    pub fn urls(&self) -> String {
        self.members
            .iter()
            .flatten()
            .map(|m| m.client.clone())
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// A replica on a fixed address (so that it advertises it); rules from
/// `rules`, or as published in etcd.
pub fn replica(dir: &Path, rules: Option<&Path>, etcd: &str, i: usize, log: &Path) -> Proc {
    replica_with(dir, rules, etcd, i, log, &[])
}

/// [`replica`] with `extra` flags.
pub fn replica_with(
    dir: &Path,
    rules: Option<&Path>,
    etcd: &str,
    i: usize,
    log: &Path,
    extra: &[&str],
) -> Proc {
    replica_on(free_addr(), dir, rules, etcd, i, log, extra)
}

/// [`replica_with`] listening on `listen` (a replica started again where
/// its agents know it).
pub fn replica_on(
    listen: std::net::SocketAddr,
    dir: &Path,
    rules: Option<&Path>,
    etcd: &str,
    i: usize,
    log: &Path,
    extra: &[&str],
) -> Proc {
    let mut args: Vec<String> = [
        "allocator",
        "--listen",
        &listen.to_string(),
        "--http",
        "127.0.0.1:0",
        "--etcd",
        etcd,
        "--etcd-prefix",
        &format!("/test-{}", dir.file_name().unwrap().to_string_lossy()),
        "--etcd-lease-ttl",
        "3s",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if let Some(r) = rules {
        args.extend(["--rules".to_string(), r.display().to_string()]);
    }
    // 1 s leases unless `extra` says otherwise.
    if !extra.contains(&"--ttl-max") {
        args.extend(["--ttl-max".to_string(), "1s".to_string()]);
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    Proc::try_spawn_at_level(&format!("replica-{i}"), &args, None, Some(log), "info")
        .unwrap_or_else(|l| panic!("replica {i} did not start: {l:?}"))
}

/// `n` replicas of [`replica`] (logs `replica-I.log` in `dir`).
pub fn replicas(dir: &Path, rules: Option<&Path>, etcd: &str, n: usize) -> Vec<Option<Proc>> {
    (0..n)
        .map(|i| {
            Some(replica(
                dir,
                rules,
                etcd,
                i,
                &dir.join(format!("replica-{i}.log")),
            ))
        })
        .collect()
}

/// Index of the replica that says it leads, waiting up to `within`.
pub fn leader_of(replicas: &[Option<Proc>], skip: Option<usize>, within: Duration) -> usize {
    let deadline = Instant::now() + within;
    loop {
        for (i, r) in replicas.iter().enumerate() {
            if Some(i) == skip {
                continue;
            }
            if let Some(r) = r {
                let (code, body) = http_get(r.http, "/readyz");
                if code == 200 && body.contains("leader epoch") {
                    return i;
                }
            }
        }
        assert!(Instant::now() < deadline, "no replica leads");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[derive(Default)]
pub struct Counts {
    pub allowed: AtomicU64,
    pub denied: AtomicU64,
    pub failure_denied: AtomicU64,
    pub errors: AtomicU64,
}

/// A key of the `ha` rule driven at about 2 x its rate from every agent.
pub struct Load {
    stop: Arc<AtomicBool>,
    pub counts: Arc<Counts>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    /// Drive tenant `tenant`'s `/api/ha` key.
    pub async fn start(agents: &[Proc], tenant: &str) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let counts = Arc::new(Counts::default());
        let tasks = hot_load(agents, tenant, stop.clone(), counts.clone()).await;
        Load {
            stop,
            counts,
            tasks,
        }
    }

    /// Stop it: (allowed, errors, failure-mode answers).
    pub async fn stop(self) -> (u64, u64, u64) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            t.await.expect("client");
        }
        let c = &self.counts;
        (
            c.allowed.load(Ordering::Relaxed),
            c.errors.load(Ordering::Relaxed),
            c.failure_denied.load(Ordering::Relaxed),
        )
    }
}

/// Drive the hot key at about 2 x its rate from every agent until `stop`.
async fn hot_load(
    agents: &[Proc],
    tenant: &str,
    stop: Arc<AtomicBool>,
    counts: Arc<Counts>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let mut tasks = Vec::new();
    for a in agents {
        for _ in 0..4 {
            let mut c = client(a).await;
            let (stop, counts, tenant) = (stop.clone(), counts.clone(), tenant.to_string());
            tasks.push(tokio::spawn(async move {
                let mut tick = tokio::time::interval(Duration::from_secs_f64(12.0 / 400.0));
                while !stop.load(Ordering::Relaxed) {
                    tick.tick().await;
                    let req = CheckRequest {
                        tenant_id: tenant.clone(),
                        route_id: "/api/ha".into(),
                        cost: 1,
                        ..Default::default()
                    };
                    match c.check(req).await {
                        Ok(r) => {
                            let r = r.into_inner();
                            let n = if r.allowed {
                                &counts.allowed
                            } else if r.reason == Reason::FailureModeDenied as i32 {
                                &counts.failure_denied
                            } else {
                                &counts.denied
                            };
                            n.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(_) => {
                            counts.errors.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            }));
        }
    }
    tasks
}

/// The longest gap between admissions of `key` in the logs after `from_ns`
/// (agents' clock: CLOCK_BOOTTIME, the same as ours on one machine), and
/// the number admitted after it.
pub fn gap_after(logs: &[PathBuf], key: (&str, &str, &str), from_ns: u64) -> (Duration, u64) {
    gap_between(logs, key, from_ns, u64::MAX)
}

/// [`gap_after`] over the admissions in `[from_ns, to_ns)` only. Read the
/// logs once the agents are stopped: a log being written may end in half
/// a line.
pub fn gap_between(
    logs: &[PathBuf],
    key: (&str, &str, &str),
    from_ns: u64,
    to_ns: u64,
) -> (Duration, u64) {
    let adm = read_admissions(logs);
    let k = (key.0.to_string(), key.1.to_string(), key.2.to_string());
    let mut ts: Vec<u64> = adm
        .get(&k)
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(|a| a.0)
        .collect();
    ts.sort_unstable();
    let mut last = from_ns;
    let mut gap = 0;
    let mut after = 0;
    for t in ts.into_iter().filter(|t| (from_ns..to_ns).contains(t)) {
        gap = gap.max(t - last);
        last = t;
        after += 1;
    }
    (Duration::from_nanos(gap), after)
}

pub fn boottime_ns() -> u64 {
    quotalease_model::clock::BootClock::now()
}

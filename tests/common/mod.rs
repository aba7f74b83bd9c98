//! Test harness: real `quotalease` child processes on 127.0.0.1, real gRPC.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use quotalease_proto::v1::rate_limiter_client::RateLimiterClient;
use tonic::transport::Channel;

pub mod etcd;

pub const BIN: &str = env!("CARGO_BIN_EXE_quotalease");

/// A child process killed (SIGKILL) when dropped.
pub struct Proc {
    pub child: Child,
    pub grpc: SocketAddr,
    pub http: SocketAddr,
    pub name: String,
}

impl Proc {
    fn spawn(name: &str, args: &[String]) -> Proc {
        Self::try_spawn(name, args).unwrap_or_else(|line| panic!("{name}: no start line: {line:?}"))
    }

    /// Start a child; `Err(its first line)` if it exited before printing
    /// its addresses (it could not listen, say).
    fn try_spawn(name: &str, args: &[String]) -> Result<Proc, String> {
        Self::try_spawn_in(name, args, None)
    }

    /// [`Proc::try_spawn`] in the working directory `cwd`.
    pub fn try_spawn_in(name: &str, args: &[String], cwd: Option<&Path>) -> Result<Proc, String> {
        Self::try_spawn_logged(name, args, cwd, None)
    }

    /// [`Proc::try_spawn_in`] with its log (stderr) written to `log`
    /// instead of the test's stderr.
    pub fn try_spawn_logged(
        name: &str,
        args: &[String],
        cwd: Option<&Path>,
        log: Option<&Path>,
    ) -> Result<Proc, String> {
        Self::try_spawn_at_level(name, args, cwd, log, "warn")
    }

    /// [`Proc::try_spawn_logged`] with `RUST_LOG` set to `level`.
    pub fn try_spawn_at_level(
        name: &str,
        args: &[String],
        cwd: Option<&Path>,
        log: Option<&Path>,
        level: &str,
    ) -> Result<Proc, String> {
        Self::try_spawn_bin(Path::new(BIN), name, args, cwd, log, level)
    }

    /// [`Proc::try_spawn_at_level`] of the binary `bin` (another
    /// release's, say).
    pub fn try_spawn_bin(
        bin: &Path,
        name: &str,
        args: &[String],
        cwd: Option<&Path>,
        log: Option<&Path>,
        level: &str,
    ) -> Result<Proc, String> {
        let mut cmd = Command::new(bin);
        if let Some(dir) = cwd {
            cmd.current_dir(dir);
        }
        let stderr = match log {
            Some(p) => Stdio::from(std::fs::File::create(p).expect("create the log file")),
            None => Stdio::inherit(),
        };
        let mut child = cmd
            .args(args)
            .env("RUST_LOG", level)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .expect("spawn quotalease");
        let stdout = child.stdout.take().expect("piped stdout");
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("read the start line");
        let field = |k: &str| -> SocketAddr {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(&format!("{k}=")))
                .unwrap_or_else(|| panic!("{name}: no {k}= in start line {line:?}"))
                .parse()
                .expect("socket address")
        };
        if !line.contains("grpc=") {
            let _ = child.kill();
            let _ = child.wait();
            return Err(line);
        }
        let (grpc, http) = (field("grpc"), field("http"));
        Ok(Proc {
            child,
            grpc,
            http,
            name: name.to_string(),
        })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.grpc)
    }

    /// SIGTERM and wait for a clean exit (agents flush their admission logs).
    pub fn terminate(mut self) -> std::process::ExitStatus {
        // SAFETY: kill(2) on our own child's pid.
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if let Some(st) = self.child.try_wait().expect("wait") {
                return st;
            }
            assert!(
                Instant::now() < deadline,
                "{} did not stop on SIGTERM",
                self.name
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL now.
    pub fn kill9(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A free loopback port (bound then released).
/// A free address on 127.0.0.1 for a process a test starts. The port is
/// below the kernel's ephemeral range (32768 and up on Linux): a port
/// from that range, free when asked, could be taken by any outgoing
/// connection before the process bound it (an etcd member lost its peer
/// port that way under CI's load). Ports go out in turn from a counter
/// that starts at an offset of this process's id, each checked bindable;
/// port 0's pick once they are used up.
pub fn free_addr() -> SocketAddr {
    use std::sync::atomic::{AtomicU32, Ordering};
    const LOW: u32 = 20_000;
    const SPAN: u32 = 12_000;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let base = std::process::id().wrapping_mul(613) % SPAN;
    loop {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        if n >= SPAN {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            return l.local_addr().expect("addr");
        }
        let port = (LOW + (base + n) % SPAN) as u16;
        if let Ok(l) = std::net::TcpListener::bind(("127.0.0.1", port)) {
            return l.local_addr().expect("addr");
        }
    }
}

pub fn write_rules(dir: &Path, yaml: &str) -> PathBuf {
    let p = dir.join("rules.yaml");
    std::fs::write(&p, yaml).expect("write rules");
    p
}

/// A test's directory under the system's temp dir, removed when dropped
/// unless the test is failing (a failed test's logs stay to be read).
/// Declare it before the processes that write in it: they are dropped
/// (killed) first.
pub struct TempDir(PathBuf);

impl std::ops::Deref for TempDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for TempDir {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

const TEMPDIR_PREFIX: &str = "quotalease-test-";

/// A fresh [`TempDir`] named after the test. Directories that earlier test
/// processes left (failed tests' logs, or a run that was killed) are
/// removed first once their process is gone: an etcd test's directory
/// holds ~370 MB, and a machine that runs the suite again and again
/// filled its disk with them.
pub fn tempdir(name: &str) -> TempDir {
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    remove_stale_tempdirs();
    let d = std::env::temp_dir().join(format!(
        "{TEMPDIR_PREFIX}{name}-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("tempdir");
    TempDir(d)
}

/// Remove `quotalease-test-NAME-PID-N` directories whose process `PID` no
/// longer runs (Linux: no `/proc/PID`). A reused pid only keeps a
/// directory longer; a live test's directory is never touched.
fn remove_stale_tempdirs() {
    if !Path::new("/proc/self").exists() {
        return;
    }
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(TEMPDIR_PREFIX)) else {
            continue;
        };
        let mut parts = rest.rsplitn(3, '-');
        let (Some(_seq), Some(pid), Some(_name)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let Ok(pid) = pid.parse::<u32>() else {
            continue;
        };
        if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// Start an allocator. `listen` may be a fixed address (to restart on the
/// same port) or None for any free port.
pub fn allocator(
    rules: &Path,
    state_dir: &Path,
    listen: Option<SocketAddr>,
    ttl_max: &str,
) -> Proc {
    allocator_with(rules, state_dir, listen, ttl_max, &[])
}

/// [`allocator`] with `extra` flags appended.
pub fn allocator_with(
    rules: &Path,
    state_dir: &Path,
    listen: Option<SocketAddr>,
    ttl_max: &str,
    extra: &[&str],
) -> Proc {
    allocator_of(Path::new(BIN), rules, state_dir, listen, ttl_max, extra)
}

/// [`allocator_with`] of the binary `bin`.
pub fn allocator_of(
    bin: &Path,
    rules: &Path,
    state_dir: &Path,
    listen: Option<SocketAddr>,
    ttl_max: &str,
    extra: &[&str],
) -> Proc {
    let fixed = listen.is_some();
    let listen = listen
        .map(|a| a.to_string())
        .unwrap_or("127.0.0.1:0".into());
    let args = [
        "allocator".into(),
        "--listen".into(),
        listen,
        "--http".into(),
        "127.0.0.1:0".into(),
        "--rules".into(),
        rules.display().to_string(),
        "--state-dir".into(),
        state_dir.display().to_string(),
        "--ttl-max".into(),
        ttl_max.into(),
    ];
    let args: Vec<String> = args
        .into_iter()
        .chain(extra.iter().map(|s| s.to_string()))
        .collect();
    // A restart on the same address: the port was free when the old
    // process died, but another test's (or an agent's reconnecting)
    // socket may hold it as its ephemeral port for a moment. Try again for
    // a few seconds rather than fail on that.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match Proc::try_spawn_bin(bin, "allocator", &args, None, None, "warn") {
            Ok(p) => return p,
            Err(line) if fixed && Instant::now() < deadline => {
                eprintln!("allocator did not start ({line:?}); trying again");
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(line) => panic!("allocator: no start line: {line:?}"),
        }
    }
}

/// Start an agent with a test-only admission log.
pub fn agent(id: &str, allocator_url: &str, log: Option<&Path>, extra: &[&str]) -> Proc {
    agent_of(Path::new(BIN), id, allocator_url, log, extra)
}

/// [`agent`] of the binary `bin`.
pub fn agent_of(
    bin: &Path,
    id: &str,
    allocator_url: &str,
    log: Option<&Path>,
    extra: &[&str],
) -> Proc {
    let mut args: Vec<String> = vec![
        "agent".into(),
        "--allocator".into(),
        allocator_url.into(),
        "--grpc".into(),
        "127.0.0.1:0".into(),
        "--http".into(),
        "127.0.0.1:0".into(),
        "--agent-id".into(),
        id.into(),
    ];
    if let Some(l) = log {
        args.push("--admission-log".into());
        args.push(l.display().to_string());
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    Proc::try_spawn_bin(bin, id, &args, None, None, "warn")
        .unwrap_or_else(|line| panic!("{id}: no start line: {line:?}"))
}

/// `GET /v1/check` for tenant `acme` on `route` at agent `a`: the status.
pub fn check_acme(a: &Proc, route: &str) -> u16 {
    http_get(a.http, &format!("/v1/check?tenant=acme&route={route}")).0
}

/// [`check_acme`] every 5 ms for `for_`: how many were admitted.
pub fn hammer_acme(a: &Proc, route: &str, for_: Duration) -> u64 {
    let t = Instant::now();
    let mut ok = 0;
    while t.elapsed() < for_ {
        ok += u64::from(check_acme(a, route) == 200);
        std::thread::sleep(Duration::from_millis(5));
    }
    ok
}

/// Minimal HTTP/1.1 GET (test helper): (status, body).
pub fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let (status, _, body) = http_get_with_headers(addr, path);
    (status, body)
}

/// Minimal HTTP/1.1 GET: (status, response headers as
/// (lower-case name, value), body).
pub fn http_get_with_headers(addr: SocketAddr, path: &str) -> (u16, Vec<(String, String)>, String) {
    http_get_sending(addr, path, &[])
}

/// [`http_get_with_headers`] sending `headers` with the request.
pub fn http_get_sending(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
) -> (u16, Vec<(String, String)>, String) {
    http_send(addr, "GET", path, headers, None)
}

/// `method path` with a JSON `body` (if any): (status, body).
pub fn http_json(addr: SocketAddr, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
    let (status, _, body) = http_send(addr, method, path, &[], body);
    (status, body)
}

/// Minimal HTTP/1.1 request: (status, response headers as (lower-case
/// name, value), body).
pub fn http_send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> (u16, Vec<(String, String)>, String) {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).expect("connect http");
    s.set_read_timeout(Some(Duration::from_secs(30))).ok();
    let mut extra: String = headers
        .iter()
        .map(|(k, v)| format!("{k}: {v}\r\n"))
        .collect();
    if let Some(b) = body {
        extra.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            b.len()
        ));
    }
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: test\r\n{extra}Connection: close\r\n\r\n{}",
        body.unwrap_or("")
    )
    .expect("send");
    let mut buf = String::new();
    s.read_to_string(&mut buf).expect("read http");
    let status = buf
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let (head, body) = buf.split_once("\r\n\r\n").unwrap_or((&buf, ""));
    let headers = head
        .lines()
        .skip(1)
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    (status, headers, body.to_string())
}

/// Wait until GET `path` answers 200.
pub fn wait_ok(addr: SocketAddr, path: &str, within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        if let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) {
            s.set_read_timeout(Some(Duration::from_secs(2))).ok();
            let _ = write!(
                s,
                "GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
            );
            let mut buf = String::new();
            let _ = s.read_to_string(&mut buf);
            if buf.starts_with("HTTP/1.1 200") {
                return;
            }
        }
        assert!(
            Instant::now() < deadline,
            "{addr}{path} not ready within {within:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

pub async fn client(p: &Proc) -> RateLimiterClient<Channel> {
    RateLimiterClient::connect(p.url())
        .await
        .expect("connect agent")
}

/// Read admission logs: per key (rule, tenant, route) the (t_ns, cost) list.
pub fn read_admissions(
    logs: &[PathBuf],
) -> std::collections::BTreeMap<(String, String, String), Vec<(u64, u64)>> {
    let mut out: std::collections::BTreeMap<_, Vec<(u64, u64)>> = Default::default();
    for l in logs {
        let text = std::fs::read_to_string(l).unwrap_or_default();
        for line in text.lines() {
            let f: Vec<&str> = line.split('\t').collect();
            assert_eq!(f.len(), 5, "admission log line {line:?}");
            out.entry((f[1].to_string(), f[2].to_string(), f[3].to_string()))
                .or_default()
                .push((f[0].parse().expect("t"), f[4].parse().expect("cost")));
        }
    }
    out
}

/// A running allocator with `n` agents, all ready.
pub struct Cluster {
    pub alloc: Proc,
    pub agents: Vec<Proc>,
    /// Dropped last: after the processes that write in it.
    pub dir: TempDir,
}

/// Start an allocator on `rules_yaml` (TTL_max 2 s, fresh state directory)
/// and `n` agents named `{name}-{i}`, and wait until all are ready.
pub fn cluster(name: &str, rules_yaml: &str, n: usize) -> Cluster {
    let dir = tempdir(name);
    let rules = write_rules(&dir, rules_yaml);
    let alloc = allocator(&rules, &dir.join("state"), None, "2s");
    wait_ok(alloc.http, "/readyz", Duration::from_secs(10));
    let agents: Vec<Proc> = (0..n)
        .map(|i| agent(&format!("{name}-{i}"), &alloc.url(), None, &[]))
        .collect();
    for a in &agents {
        wait_ok(a.http, "/readyz", Duration::from_secs(10));
    }
    Cluster { alloc, agents, dir }
}

/// Start a regional allocator under `parent_url` for `region` (optional
/// bootstrap rules; `extra` flags appended).
pub fn regional(parent_url: &str, region: &str, rules: Option<&Path>, extra: &[&str]) -> Proc {
    regional_at(parent_url, region, None, rules, extra)
}

/// [`regional`] listening for its children on `listen` (a restart on the
/// address its predecessor had) or on any port.
pub fn regional_at(
    parent_url: &str,
    region: &str,
    listen: Option<SocketAddr>,
    rules: Option<&Path>,
    extra: &[&str],
) -> Proc {
    let fixed = listen.is_some();
    let listen = listen.map_or("127.0.0.1:0".into(), |a| a.to_string());
    let mut args: Vec<String> = vec![
        "allocator".into(),
        "--listen".into(),
        listen,
        "--http".into(),
        "127.0.0.1:0".into(),
        "--parent".into(),
        parent_url.into(),
        "--region".into(),
        region.into(),
    ];
    if let Some(r) = rules {
        args.push("--rules".into());
        args.push(r.display().to_string());
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    let name = format!("regional-{region}");
    // A restart on the same address may find the port held for a moment
    // (see `allocator_of`).
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match Proc::try_spawn(&name, &args) {
            Ok(p) => return p,
            Err(line) if fixed && Instant::now() < deadline => {
                eprintln!("{name} did not start ({line:?}); trying again");
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(line) => panic!("{name}: no start line: {line:?}"),
        }
    }
}

/// The value of an unlabelled metric in a Prometheus text body.
pub fn metric(body: &str, name: &str) -> Option<f64> {
    body.lines()
        .find(|l| l.split_whitespace().next() == Some(name))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

/// What the admission logs say about one key.
pub struct KeyCheck {
    /// Tokens admitted.
    pub admitted: u64,
    /// Seconds from the first to the last admission.
    pub t_s: f64,
    /// `B + R*t_s`.
    pub bound: f64,
    /// `admitted / bound`.
    pub util: f64,
}

/// Read the key (rule, tenant, route) from the agents' admission logs,
/// check that the logs agree with the `allowed` answers the clients got,
/// and assert I1 exactly over every window (`rate` per second, `burst`).
pub fn check_key_i1(
    logs: &[PathBuf],
    key: (&str, &str, &str),
    rate_per_s: u64,
    burst: u64,
    allowed: u64,
) -> KeyCheck {
    let rate = quotalease_model::rules::Rate {
        tokens: rate_per_s,
        period_s: 1,
    };
    check_key_i1_at(logs, key, rate, burst, allowed)
}

/// [`check_key_i1`] for any rate (`5/m`, `1/d`).
pub fn check_key_i1_at(
    logs: &[PathBuf],
    key: (&str, &str, &str),
    rate: quotalease_model::rules::Rate,
    burst: u64,
    allowed: u64,
) -> KeyCheck {
    let adm = read_admissions(logs);
    let k = (key.0.to_string(), key.1.to_string(), key.2.to_string());
    let mut log = adm.get(&k).cloned().unwrap_or_default();
    let admitted: u64 = log.iter().map(|a| a.1).sum();
    assert_eq!(
        admitted, allowed,
        "admission logs and client answers disagree"
    );
    let w = quotalease_sim::checker::worst_window(&mut log, rate, burst);
    assert!(
        w.held(),
        "I1 broken: {} admitted in [{}, {}] ns, excess {}",
        w.admitted,
        w.from_ns,
        w.to_ns,
        w.excess
    );
    let t_s = match (log.first(), log.last()) {
        (Some(a), Some(b)) => (b.0 - a.0) as f64 / 1e9,
        _ => 0.0,
    };
    let bound = burst as f64 + rate.tokens as f64 / rate.period_s.max(1) as f64 * t_s;
    KeyCheck {
        admitted,
        t_s,
        bound,
        util: admitted as f64 / bound,
    }
}

/// Drive `clients` clients per agent at `per_client` checks/s for tenant
/// `tenant` until `stop`; returns (sent, allowed, errors) counters.
pub async fn load_checks(
    agents: &[&Proc],
    clients: usize,
    per_client: f64,
    tenant: &'static str,
    route: &'static str,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> (
    std::sync::Arc<std::sync::atomic::AtomicU64>,
    std::sync::Arc<std::sync::atomic::AtomicU64>,
    std::sync::Arc<std::sync::atomic::AtomicU64>,
    Vec<tokio::task::JoinHandle<()>>,
) {
    let sent = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let allowed = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let errors = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut tasks = Vec::new();
    for a in agents {
        for _ in 0..clients {
            let mut c = client(a).await;
            let (allowed, errors, stop, sent) =
                (allowed.clone(), errors.clone(), stop.clone(), sent.clone());
            tasks.push(tokio::spawn(async move {
                let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / per_client));
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    tick.tick().await;
                    sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let req = quotalease_proto::v1::CheckRequest {
                        tenant_id: tenant.into(),
                        route_id: route.into(),
                        cost: 1,
                        ..Default::default()
                    };
                    match c.check(req).await {
                        Ok(r) if r.get_ref().allowed => {
                            allowed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                        Ok(_) => {}
                        Err(_) => {
                            errors.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                    }
                }
            }));
        }
    }
    (sent, allowed, errors, tasks)
}

/// Send up to `n` checks of cost 1 for (`tenant`, `route`) one after
/// another at `agent`; stop at the first denial when `until_denied`. How
/// many were allowed.
pub async fn count_allowed(
    agent: &Proc,
    tenant: &str,
    route: &str,
    n: usize,
    until_denied: bool,
) -> usize {
    let mut c = client(agent).await;
    let mut allowed = 0;
    for _ in 0..n {
        let r = check_one(&mut c, tenant, route).await;
        if r.allowed {
            allowed += 1;
        } else if until_denied {
            break;
        }
    }
    allowed
}

/// One check of cost 1 for (`tenant`, `route`) through `c`: the answer.
pub async fn check_one(
    c: &mut RateLimiterClient<Channel>,
    tenant: &str,
    route: &str,
) -> quotalease_proto::v1::CheckResponse {
    c.check(quotalease_proto::v1::CheckRequest {
        tenant_id: tenant.into(),
        route_id: route.into(),
        cost: 1,
        ..Default::default()
    })
    .await
    .expect("check")
    .into_inner()
}

/// Run `quotalease ARGS` in `cwd` to its end: (success, stderr).
pub fn run_to_end(cwd: &Path, args: &[&str]) -> (bool, String) {
    let mut child = Command::new(BIN)
        .args(args)
        .current_dir(cwd)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn quotalease");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if child.try_wait().expect("wait").is_some() {
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("quotalease {args:?} did not exit within 10 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().expect("output");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `1/m burst 20`, fail policy `closed`, on route `/r`: a slow rule whose
/// second burst is an obvious excess (the lost and restored state tests).
pub const SLOW_1M_B20: &str = r#"
rules:
  - id: slow
    match: { tenant: "*", route: /r }
    rate: 1/m
    burst: 20
    fail_policy: closed
"#;

/// A root-crate example's binary (`cargo test` builds the examples beside
/// the crate's binary; built here when a filtered run did not).
pub fn example_bin(name: &str) -> PathBuf {
    let bin = Path::new(BIN)
        .parent()
        .expect("target dir")
        .join("examples")
        .join(name);
    if !bin.exists() {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let status = Command::new(cargo)
            .args(["build", "--example", name])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .status()
            .expect("run cargo build --example");
        assert!(status.success(), "cargo build --example {name}");
    }
    bin
}

/// An example service holding leases of an allocator: its process, the
/// address it serves on and its admission log.
pub struct Example {
    pub child: Child,
    pub addr: SocketAddr,
    pub log: PathBuf,
}

/// Start example `bin` as holder `id` of `allocator` (`--allocator URL
/// --id ID`; it prints `listening=ADDR`), logging admissions to
/// `dir/ID.admissions`.
pub fn example(bin: &Path, allocator: &str, id: &str, dir: &Path) -> Example {
    let log = dir.join(format!("{id}.admissions"));
    let mut child = Command::new(bin)
        .args(["--allocator", allocator, "--id", id])
        .env("QUOTALEASE_ADMISSION_LOG", &log)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn the example");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("start line");
    let addr = line
        .trim()
        .strip_prefix("listening=")
        .unwrap_or_else(|| panic!("{id}: start line {line:?}"))
        .parse()
        .expect("address");
    Example { child, addr, log }
}

impl Example {
    /// SIGTERM: the example stops, gives its leases back and flushes its
    /// admission log; it must exit cleanly. Its admission log.
    pub fn stop(mut self) -> PathBuf {
        // SAFETY: plain kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let status = self.child.wait().expect("wait");
        assert!(status.success(), "clean exit: {status}");
        std::mem::take(&mut self.log)
    }
}

impl Drop for Example {
    /// A test that fails before [`Example::stop`] leaves no example
    /// running (one that had exited is not signalled again).
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Two example instances' admissions under demand far above a key's rule:
/// I1 exact over every window of their logs (which must count `oks`), more
/// refusals than admissions, and at least 80 % of `B + R*T` delivered.
pub fn check_shared_limit(
    logs: &[PathBuf],
    key: (&str, &str, &str),
    rate: u64,
    burst: u64,
    oks: u64,
    refused: u64,
) {
    let k = check_key_i1(logs, key, rate, burst, oks);
    eprintln!(
        "{} admitted over {:.2} s by {} instances (bound {:.1}, {:.1} %), {refused} refused",
        k.admitted,
        k.t_s,
        logs.len(),
        k.bound,
        100.0 * k.util
    );
    assert!(
        refused > oks,
        "demand far above the rule: {refused} refused, {oks} admitted"
    );
    // The burst and most of the refill reach the callers.
    assert!(
        k.util >= 0.8,
        "{:.1} % of B + R*T delivered",
        100.0 * k.util
    );
}

//! The long-running commands: `allocator`, `agent`, and `rules validate`.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, Context};
use quotalease_agent::agent::{Agent, AgentConfig, EmergencyConfig};
use quotalease_agent::renewal::PlanConfig;
use quotalease_agent::transport::GrpcTransport;
use quotalease_allocator::core::{CoreConfig, TTL_MAX_CAP_NS};
use quotalease_allocator::ledger::KeyCheckpoint;
use quotalease_allocator::regional::RegionalConfig;
use quotalease_allocator::reservation_log::{self, hex, unhex, Durability};
use quotalease_allocator::server::{self as alloc_server, LeaseService, Shared};
use quotalease_allocator::upstream;
use quotalease_gateway::envoy::EnvoyService;
use quotalease_gateway::service::{self, CheckService};
use quotalease_model::key::KeyId;
use quotalease_model::rules::RuleSet;
use quotalease_tls::{ClientTls, ServerTls};
use tokio::net::TcpListener;
use tonic::transport::server::TcpIncoming;

use crate::{AgentArgs, AllocatorArgs};

/// Load a rules file or fail with every error on its own line.
pub fn load_rules(path: &Path, version: u64) -> anyhow::Result<RuleSet> {
    RuleSet::load(path, version).map_err(|errs| {
        let lines: Vec<String> = errs.iter().map(|e| format!("  {e}")).collect();
        anyhow!(
            "{} error(s) in rules file {}:\n{}",
            errs.len(),
            path.display(),
            lines.join("\n")
        )
    })
}

/// `quotalease rules validate FILE`.
pub fn validate(path: &Path) -> anyhow::Result<()> {
    let rules = load_rules(path, 0)?;
    // Written, not printed: a reader that stops early (`| head`) is no
    // error, and must not make the process panic on the closed pipe.
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let written = writeln!(
        out,
        "{}: {} rule(s), valid",
        path.display(),
        rules.rules.len()
    )
    .and_then(|()| writeln!(out, "{}", rules.summary()))
    .and_then(|()| out.flush());
    match written {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(anyhow!("stdout: {e}")),
        _ => Ok(()),
    }
}

/// SIGTERM and Ctrl-C, caught from the moment this is made: a process
/// makes it before it serves anything, so a signal that arrives as soon as
/// it answers (a supervisor, a test) stops it gracefully instead of killing
/// it with the default action.
pub struct Termination {
    signals: Vec<tokio::signal::unix::Signal>,
}

impl Termination {
    /// Install the handlers (within a tokio runtime).
    pub fn catch() -> Self {
        use tokio::signal::unix::{signal, SignalKind};
        let signals = [SignalKind::terminate(), SignalKind::interrupt()]
            .into_iter()
            .filter_map(|kind| {
                signal(kind)
                    .map_err(|e| tracing::error!(%e, ?kind, "cannot install a signal handler"))
                    .ok()
            })
            .collect();
        Self { signals }
    }

    /// Resolves on the first SIGTERM or SIGINT.
    pub async fn wait(mut self) {
        if self.signals.is_empty() {
            return std::future::pending().await;
        }
        std::future::poll_fn(|cx| {
            for s in &mut self.signals {
                if s.poll_recv(cx).is_ready() {
                    return std::task::Poll::Ready(());
                }
            }
            std::task::Poll::Pending
        })
        .await
    }
}

pub(crate) async fn bind(flag: &str, addr: std::net::SocketAddr) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .with_context(|| format!("{flag} {addr}: cannot listen"))
}

/// Record this start in `dir`; true if no start was recorded before (no
/// predecessor can have leases outstanding).
/// The default state directory: per listen address, under the working
/// directory (SPEC §2 "First start").
fn default_state_dir(listen: std::net::SocketAddr) -> std::path::PathBuf {
    let name: String = listen
        .to_string()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect();
    Path::new("quotalease-state").join(name)
}

/// What a global allocator keeps in its state directory (`ledger`): its
/// ledger id, the largest `TTL_max` it may have granted leases under, the
/// largest rule version it served, and its runs. Durations and counters
/// only.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct LedgerRecord {
    pub(crate) id: u64,
    pub(crate) ttl_max_ms: u64,
    pub(crate) rules_version: u64,
    /// With `--etcd`: the lease id base of the latest term (each term
    /// starts above it, whatever the replicas' clocks say). 0 otherwise.
    pub(crate) lease_id_base: u64,
    /// The run in progress (0: none; a clean stop moves it to `runs`).
    pub(crate) run: u64,
    /// Earlier runs, oldest first: (run id, its durable records; `u64::MAX`
    /// when that is unknown), at most [`RUNS_KEPT`].
    pub(crate) runs: Vec<(u64, u64)>,
    /// The cluster this ledger belongs to ("": none set).
    pub(crate) cluster: String,
}

/// Runs a ledger record keeps: a requester that last talked to this ledger
/// this many starts ago is taken for one that saw a lost state.
pub(crate) const RUNS_KEPT: usize = 4096;

const LEDGER_FILE: &str = "ledger";
/// How long a global allocator with a state directory grants nothing after
/// it starts (see `CoreConfig::first_start_grace_ns`): three of the agents'
/// default 1 s heartbeats.
pub(crate) const START_GRACE: Duration = Duration::from_secs(3);

/// The start's wait of a restart: [`START_GRACE`], or `TTL_max` if that is
/// shorter (but at least one agent heartbeat, 1 s).
pub(crate) fn restart_grace(ttl_max: Duration) -> Duration {
    START_GRACE.min(ttl_max.max(Duration::from_secs(1)))
}
const LEDGER_FORMAT: u64 = 1;

impl LedgerRecord {
    pub(crate) fn encode(&self) -> String {
        let mut s = format!(
            "quotalease-ledger {LEDGER_FORMAT}\nid {:016x}\nttl_max_ms {}\nrules_version {}\n",
            self.id, self.ttl_max_ms, self.rules_version
        );
        if self.lease_id_base != 0 {
            s.push_str(&format!("lease_id_base {}\n", self.lease_id_base));
        }
        if self.run != 0 {
            s.push_str(&format!("run {:016x}\n", self.run));
        }
        if !self.cluster.is_empty() {
            s.push_str(&format!("cluster {}\n", self.cluster));
        }
        if !self.runs.is_empty() {
            s.push_str("runs");
            for (run, seq) in &self.runs {
                s.push_str(&format!(" {run:016x}:{seq}"));
            }
            s.push('\n');
        }
        s
    }

    /// The record of a new start: the run in progress, if any, becomes
    /// an earlier one that got to record `last_seq`, and `run` starts.
    pub(crate) fn start_run(&mut self, run: u64, last_seq: u64) {
        if self.run != 0 {
            self.runs.push((self.run, last_seq));
        }
        self.run = run;
        let over = self.runs.len().saturating_sub(RUNS_KEPT);
        self.runs.drain(..over);
    }

    /// The cluster this ledger belongs to when started with `--cluster`
    /// `arg`: the recorded one, or `arg` when none is recorded yet (the
    /// first start that names one records it). `Err`: the recorded
    /// cluster, which `arg` is not.
    pub(crate) fn cluster_with(&self, arg: Option<&str>) -> Result<String, String> {
        match (arg, self.cluster.as_str()) {
            (Some(c), "") => Ok(c.to_string()),
            (Some(c), theirs) if c != theirs => Err(theirs.to_string()),
            (_, theirs) => Ok(theirs.to_string()),
        }
    }

    /// A clean stop: the run in progress ended at record `last_seq`.
    pub(crate) fn end_run(&mut self, last_seq: u64) {
        self.start_run(0, last_seq);
    }

    /// The runs as the core checks them (`None` without a run).
    pub(crate) fn runs(&self) -> Option<quotalease_allocator::core::Runs> {
        (self.run != 0).then(|| quotalease_allocator::core::Runs {
            current: self.run,
            past: self.runs.clone(),
        })
    }

    /// Parse a ledger file; an error names what is wrong.
    pub(crate) fn decode(text: &str) -> Result<Self, String> {
        let mut lines = text.lines();
        let head = lines.next().unwrap_or("");
        let format = head
            .strip_prefix("quotalease-ledger ")
            .and_then(|v| v.trim().parse::<u64>().ok())
            .ok_or_else(|| format!("first line {head:?}: not a quotalease ledger"))?;
        if format > LEDGER_FORMAT {
            return Err(format!(
                "format {format} is newer than this binary's ({LEDGER_FORMAT}): run a newer quotalease"
            ));
        }
        let (mut id, mut ttl, mut version, mut base) = (None, None, None, 0);
        let (mut run, mut runs, mut cluster) = (0, Vec::new(), String::new());
        for line in lines {
            let (k, v) = line
                .split_once(' ')
                .ok_or_else(|| format!("line {line:?}: want `name value`"))?;
            let bad = |what: &str| format!("{k}: {v:?} is not {what}");
            match k {
                "id" => id = Some(u64::from_str_radix(v, 16).map_err(|_| bad("hex"))?),
                "ttl_max_ms" => ttl = Some(v.parse().map_err(|_| bad("a number"))?),
                "rules_version" => version = Some(v.parse().map_err(|_| bad("a number"))?),
                "lease_id_base" => base = v.parse().map_err(|_| bad("a number"))?,
                "run" => run = u64::from_str_radix(v, 16).map_err(|_| bad("hex"))?,
                "cluster" => {
                    cluster = crate::parse_cluster(v).map_err(|e| format!("cluster: {e}"))?
                }
                "runs" => {
                    for r in v.split(' ') {
                        let (id, seq) = r
                            .split_once(':')
                            .and_then(|(i, s)| {
                                Some((u64::from_str_radix(i, 16).ok()?, s.parse().ok()?))
                            })
                            .ok_or_else(|| bad("`RUN:SEQ` pairs (hex run ids)"))?;
                        runs.push((id, seq));
                    }
                }
                _ => {} // a later format's field
            }
        }
        let missing = |f: &str| format!("{f}: missing");
        let id: u64 = id.ok_or_else(|| missing("id"))?;
        if id == 0 {
            return Err("id: must not be 0".into());
        }
        Ok(Self {
            id,
            ttl_max_ms: ttl.ok_or_else(|| missing("ttl_max_ms"))?,
            rules_version: version.ok_or_else(|| missing("rules_version"))?,
            lease_id_base: base,
            run,
            runs,
            cluster,
        })
    }
}

const CHECKPOINT_FILE: &str = "checkpoint";
const CHECKPOINT_FORMAT: u64 = 1;

/// A clean shutdown's key states, for the ledger `ledger`.
pub(crate) fn encode_checkpoint(ledger: u64, keys: &[(KeyId, KeyCheckpoint)]) -> String {
    let mut out = format!("quotalease-checkpoint {CHECKPOINT_FORMAT}\nledger {ledger:016x}\n");
    for (k, c) in keys {
        out.push_str(&format!(
            "key {} {} {} {} {} {} {}\n",
            hex(&k.rule),
            hex(&k.tenant),
            hex(&k.route),
            c.available,
            c.outstanding,
            c.rates_out_utps,
            c.leases_end_in_ns
        ));
    }
    out.push_str("end\n");
    out
}

/// (ledger id, keys) of a checkpoint file; an error names what is wrong.
pub(crate) fn decode_checkpoint(text: &str) -> Result<(u64, Vec<(KeyId, KeyCheckpoint)>), String> {
    let mut lines = text.lines();
    let head = lines.next().unwrap_or("");
    let format = head
        .strip_prefix("quotalease-checkpoint ")
        .and_then(|v| v.trim().parse::<u64>().ok())
        .ok_or_else(|| format!("first line {head:?}: not a quotalease checkpoint"))?;
    if format > CHECKPOINT_FORMAT {
        return Err(format!("format {format} is newer than this binary's"));
    }
    let ledger = lines
        .next()
        .and_then(|l| l.strip_prefix("ledger "))
        .and_then(|v| u64::from_str_radix(v, 16).ok())
        .ok_or("second line: want `ledger ID`")?;
    let mut keys = Vec::new();
    for (n, line) in lines.by_ref().enumerate() {
        if line == "end" {
            return Ok((ledger, keys));
        }
        let w: Vec<&str> = line.split(' ').collect();
        let bad = || format!("key line {}: {line:?}", n + 1);
        if w.len() != 8 || w[0] != "key" {
            return Err(bad());
        }
        let num = |i: usize| w[i].parse::<u64>().map_err(|_| bad());
        keys.push((
            KeyId {
                rule: unhex(w[1]).ok_or_else(bad)?,
                tenant: unhex(w[2]).ok_or_else(bad)?,
                route: unhex(w[3]).ok_or_else(bad)?,
            },
            KeyCheckpoint {
                available: num(4)?,
                outstanding: num(5)?,
                rates_out_utps: num(6)?,
                leases_end_in_ns: num(7)?,
            },
        ));
    }
    Err("no `end` line: the checkpoint was cut short".into())
}

/// A state directory in use: locked for as long as this value lives.
struct StateDir {
    dir: std::path::PathBuf,
    _lock: std::fs::File,
}

impl StateDir {
    fn open(dir: &Path) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("--state-dir {}: cannot create", dir.display()))?;
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(dir.join("lock"))
            .with_context(|| format!("--state-dir {}: cannot open its lock", dir.display()))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(anyhow!(
                "--state-dir {}: in use by another allocator (locked); give each allocator its own",
                dir.display()
            ))
            }
            Err(std::fs::TryLockError::Error(e)) => {
                return Err(anyhow!("--state-dir {}: cannot lock: {e}", dir.display()))
            }
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            _lock: lock,
        })
    }

    /// The ledger record, `None` when there is none.
    fn read(&self) -> anyhow::Result<Option<LedgerRecord>> {
        let path = self.dir.join(LEDGER_FILE);
        match std::fs::read_to_string(&path) {
            Ok(text) => LedgerRecord::decode(&text).map(Some).map_err(|e| {
                anyhow!(
                    "{}: {e}; nothing is granted from it (fix or move it away)",
                    path.display()
                )
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(anyhow!("{}: cannot read: {e}", path.display())),
        }
    }

    /// Write the record durably (a new file renamed over the old one).
    fn write(&self, r: &LedgerRecord) -> anyhow::Result<()> {
        let path = self.dir.join(LEDGER_FILE);
        let tmp = self.dir.join("ledger.tmp");
        (|| {
            let mut f = std::fs::File::create(&tmp)?;
            std::io::Write::write_all(&mut f, r.encode().as_bytes())?;
            f.sync_all()?;
            std::fs::rename(&tmp, &path)?;
            std::fs::File::open(&self.dir)?.sync_all()
        })()
        .with_context(|| format!("{}: cannot write", path.display()))
    }

    /// Write a clean shutdown's checkpoint durably.
    fn write_checkpoint(&self, text: &str) -> anyhow::Result<()> {
        let path = self.dir.join(CHECKPOINT_FILE);
        let tmp = self.dir.join("checkpoint.tmp");
        (|| {
            let mut f = std::fs::File::create(&tmp)?;
            std::io::Write::write_all(&mut f, text.as_bytes())?;
            f.sync_all()?;
            std::fs::rename(&tmp, &path)?;
            std::fs::File::open(&self.dir)?.sync_all()
        })()
        .with_context(|| format!("{}: cannot write", path.display()))
    }

    /// Take the checkpoint a clean shutdown left for ledger `ledger`, if
    /// any, and remove it (durably) before anything is granted: a later
    /// crash must not find it. One of another ledger, or unreadable, is
    /// set aside (`checkpoint.unused`) and not used.
    fn take_checkpoint(&self, ledger: u64) -> anyhow::Result<Option<Vec<(KeyId, KeyCheckpoint)>>> {
        let path = self.dir.join(CHECKPOINT_FILE);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(anyhow!("{}: cannot read: {e}", path.display())),
        };
        let got = match decode_checkpoint(&text) {
            Ok((id, keys)) if id == ledger => Some(keys),
            Ok((id, _)) => {
                tracing::warn!(
                    theirs = format_args!("{id:016x}"),
                    "the checkpoint is of another ledger: not used"
                );
                None
            }
            Err(e) => {
                tracing::warn!(error = %e, "the checkpoint is unreadable: not used");
                None
            }
        };
        match got {
            Some(_) => std::fs::remove_file(&path),
            None => std::fs::rename(&path, self.dir.join("checkpoint.unused")),
        }
        .and_then(|_| std::fs::File::open(&self.dir)?.sync_all())
        .with_context(|| format!("{}: cannot remove", path.display()))?;
        Ok(got)
    }

    /// A state directory of an allocator older than the ledger file.
    fn has_old_start_record(&self) -> bool {
        self.dir.join("allocator-started").exists()
    }
}

/// Keep the ledger record true while the allocator runs: the largest rule
/// version served (checked every 500 ms), and a lowered `TTL_max` recorded
/// only once it has run for a whole old one (leases granted under the old
/// value have expired by then).
async fn keep_ledger_record(
    state: Arc<StateDir>,
    mut record: LedgerRecord,
    ttl_max_ms: u64,
    shared: Arc<Shared>,
) {
    let mut started = std::time::Instant::now();
    let lower_after = |ms: u64| Duration::from_millis(ms.saturating_mul(2).saturating_add(1_000));
    let mut lower_after_now = lower_after(record.ttl_max_ms);
    let mut lost_seen = 0;
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        tick.tick().await;
        let mut next = record.clone();
        let (version, lost) = shared.with_core(|c| (c.rules().version, c.stats().ledgers_lost));
        next.rules_version = next.rules_version.max(version);
        if lost > lost_seen {
            // Another ledger's leases may be out for up to the cap: a
            // restart during that wait must wait it too (an adversarial
            // review saw a restart wait only this ledger's TTL_max).
            lost_seen = lost;
            next.ttl_max_ms = TTL_MAX_CAP_NS / 1_000_000;
            started = std::time::Instant::now();
            lower_after_now = lower_after(next.ttl_max_ms);
        } else if next.ttl_max_ms > ttl_max_ms && started.elapsed() >= lower_after_now {
            next.ttl_max_ms = ttl_max_ms;
        }
        if next != record {
            match state.write(&next) {
                Ok(()) => record = next,
                Err(e) => tracing::error!(error = %e, "cannot update the ledger record"),
            }
        }
    }
}

/// `--ttl-max` in ms, within 1 ms..= the compiled cap, or an error naming
/// the flag.
pub(crate) fn ttl_max_ms(args: &AllocatorArgs) -> anyhow::Result<u64> {
    let ms = u64::try_from(args.ttl_max.as_millis()).unwrap_or(u64::MAX);
    if ms.saturating_mul(1_000_000) > TTL_MAX_CAP_NS || ms == 0 {
        return Err(anyhow!(
            "--ttl-max: {:?} is outside 1ms..={}s (the compiled cap: how long a lost ledger's leases may be out)",
            args.ttl_max,
            TTL_MAX_CAP_NS / 1_000_000_000
        ));
    }
    Ok(ms)
}

/// `quotalease allocator`.
pub async fn allocator(args: AllocatorArgs) -> anyhow::Result<()> {
    let stop = Termination::catch();
    match (&args.parent, &args.region) {
        (Some(_), Some(_)) if !args.etcd.is_empty() => {
            return Err(anyhow!(
                "--etcd: a regional allocator (--parent) keeps no state and is not replicated through etcd"
            ))
        }
        (Some(_), Some(_)) if args.shard.is_some() => {
            return Err(anyhow!(
                "--shard: a regional allocator is not sharded (its parent may not be either, see docs/operations.md \"Sharding\")"
            ))
        }
        (Some(_), Some(_)) => return regional(args, stop).await,
        (Some(_), None) => {
            return Err(anyhow!(
                "--parent needs --region NAME: a regional allocator is named by its region"
            ))
        }
        (None, Some(_)) => {
            return Err(anyhow!(
                "--region needs --parent URL: only a regional allocator has a region"
            ))
        }
        (None, None) => {}
    }
    if !args.etcd.is_empty() {
        return crate::etcd::allocator(args, stop).await;
    }
    if args.shard.is_some() {
        return Err(anyhow!(
            "--shard needs --etcd: agents learn every shard's leader from the replicas, which find each other through etcd"
        ));
    }
    let Some(rules_path) = args.rules.clone() else {
        return Err(anyhow!(
            "--rules FILE is required for the global allocator (a regional one, with --parent, may take its rules from the parent)"
        ));
    };
    let tls = server_tls(&args)?;
    let ttl_max_ms = ttl_max_ms(&args)?;
    let dir = args
        .state_dir
        .clone()
        .unwrap_or_else(|| default_state_dir(args.listen));
    let state = StateDir::open(&dir)?;
    let (record, first) = match state.read()? {
        Some(r) => (r, false),
        None => {
            let r = LedgerRecord {
                id: quotalease_proto::random_instance().max(1),
                // An allocator from before the ledger file recorded no
                // TTL_max: assume the cap.
                ttl_max_ms: if state.has_old_start_record() {
                    TTL_MAX_CAP_NS / 1_000_000
                } else {
                    0
                },
                rules_version: 0,
                lease_id_base: 0,
                run: 0,
                runs: Vec::new(),
                cluster: String::new(),
            };
            (r, !state.has_old_start_record())
        }
    };
    // Versions never go backwards, whatever the wall clock says.
    let version = alloc_server::unix_ms().max(record.rules_version + 1);
    let rules = load_rules(&rules_path, version)?;
    let predecessor_ttl_ms = record.ttl_max_ms;
    // A run that did not stop cleanly got as far as its reservation log's
    // last durable record (unknown without a log: a lost ledger's was
    // removed, and a restart then waits the whole recorded TTL_max).
    let last_seq = if record.run != 0 {
        match reservation_log::read(&dir, record.id) {
            Ok(Some((_, seq))) => seq,
            _ => u64::MAX,
        }
    } else {
        0
    };
    // The cluster: recorded at the first start that names one; a later
    // start naming another is refused before anything is written.
    let cluster = record
        .cluster_with(args.cluster.as_deref())
        .map_err(|theirs| {
            anyhow!(
                "--cluster {}: the state directory {} belongs to cluster {theirs} (start without --cluster, or give each cluster its own directory)",
                args.cluster.as_deref().unwrap_or_default(),
                dir.display()
            )
        })?;
    let mut record = LedgerRecord {
        ttl_max_ms: record.ttl_max_ms.max(ttl_max_ms),
        rules_version: version,
        cluster,
        ..record
    };
    let run = quotalease_proto::random_instance().max(1);
    record.start_run(run, last_seq);
    state.write(&record)?;
    let resumed = if first {
        None
    } else {
        state.take_checkpoint(record.id)?
    };
    // After a crash: the write-ahead reservations (none from a version
    // without them, or after a lost ledger: then the whole start-up wait).
    let reserved = if first || resumed.is_some() {
        None
    } else {
        reservation_log::read(&dir, record.id)
            .map_err(|e| anyhow!(e))?
            .map(|(keys, _)| keys)
    };
    if first {
        tracing::info!(dir = %dir.display(), ledger = format_args!("{:016x}", record.id), "no ledger in the state directory: a new ledger, buckets start full");
    } else if let Some(keys) = &resumed {
        tracing::info!(dir = %dir.display(), ledger = format_args!("{:016x}", record.id), keys = keys.len(), "clean restart of this ledger: keys resume from the shutdown's checkpoint, what was leased then counts until it has expired");
    } else if let Some(keys) = &reserved {
        tracing::info!(dir = %dir.display(), ledger = format_args!("{:016x}", record.id), keys = keys.len(), predecessor_ttl_max_ms = predecessor_ttl_ms, "restart of this ledger after a crash: keys resume from their write-ahead reservations (each at its floor, the rest of its burst leased out until the longest lease has expired); keys without one are full");
    } else {
        tracing::info!(dir = %dir.display(), ledger = format_args!("{:016x}", record.id), predecessor_ttl_max_ms = predecessor_ttl_ms, "restart of this ledger without a checkpoint: every key counts as fully leased out until the longest lease it may have granted has expired");
    }
    let cfg = CoreConfig {
        ttl_max_ns: args.ttl_max.as_nanos() as u64,
        predecessor_ttl_max_ns: predecessor_ttl_ms.saturating_mul(1_000_000),
        no_predecessor: first || resumed.is_some() || reserved.is_some(),
        reservations: true,
        ledger_id: record.id,
        runs: record.runs(),
        cluster: record.cluster.clone(),
        // Agents holding a lost ledger's leases name it within their 1 s
        // heartbeat (or their next renewal): a new ledger waits that long
        // before it serves its full buckets. So does every later start:
        // agents that saw a newer state than this directory holds (a
        // restored backup) name its run before a brand-new agent, which
        // presents nothing, can take from the older state; a restart waits
        // no longer than `TTL_max` (at least a heartbeat), so that a key
        // is usable again within `TTL_max` of a crash (SPEC §2
        // "Restarts").
        first_start_grace_ns: match (args.new_ledger, first) {
            (true, _) => 0,
            (false, true) => START_GRACE.as_nanos() as u64,
            (false, false) => restart_grace(args.ttl_max).as_nanos() as u64,
        },
        new_ledger: args.new_ledger,
        ..CoreConfig::default()
    };
    let shared = Shared::new(cfg, rules, Some(rules_path));
    let now = shared.now();
    if let Some(keys) = resumed {
        shared.with_core(|c| c.resume_keys(now, keys));
    } else if let Some(keys) = reserved {
        shared.with_core(|c| c.resume_reserved(now, keys));
    }
    // Every resumed key's state is its promise before anything is granted.
    let (promises, seq) = shared.with_core(|c| (c.reserve_current_keys(now), c.reservation_seq()));
    let log = reservation_log::Log::create(&dir, record.id, seq, &promises).with_context(|| {
        format!(
            "--state-dir {}: cannot write the reservation log",
            dir.display()
        )
    })?;
    let (durability, writer) =
        reservation_log::start(shared.clone(), reservation_log::FileStore::new(log));
    let state = Arc::new(state);
    let keeper = tokio::spawn(keep_ledger_record(
        state.clone(),
        record.clone(),
        ttl_max_ms,
        shared.clone(),
    ));
    let grpc = bind("--listen", args.listen).await?;
    let http = bind("--http", args.http).await?;
    println!(
        "quotalease allocator grpc={} http={}",
        grpc.local_addr()?,
        http.local_addr()?
    );
    tracing::info!(grpc = %grpc.local_addr()?, http = %http.local_addr()?, ttl_max = ?args.ttl_max, first_start = first, tls = tls.is_some(), "allocator started");
    let hk = tokio::spawn(alloc_server::housekeeping(
        shared.clone(),
        Duration::from_millis(500),
    ));
    let (tx, rx) = tokio::sync::watch::channel(false);
    let (server, admin) =
        serve_allocator(shared.clone(), grpc, http, tls, Some(durability), None, rx);
    stop.wait().await;
    tracing::info!("stopping");
    let _ = tx.send(true);
    hk.abort();
    let _ = tokio::time::timeout(Duration::from_secs(5), server).await;
    let _ = tokio::time::timeout(Duration::from_secs(5), admin).await;
    // A clean stop: every key's state, so the next start resumes it
    // instead of waiting out a phantom (SPEC §2 "Restarts").
    let keys = shared.checkpoint_and_close();
    state.write_checkpoint(&encode_checkpoint(record.id, &keys))?;
    // The run ended here: its last record is the history's (after the
    // keeper's last write, which may have raised what the record holds).
    keeper.abort();
    let _ = keeper.await;
    let mut ended = state.read()?.unwrap_or(record);
    ended.end_run(shared.with_core(|c| c.reservation_seq()));
    state.write(&ended)?;
    // The checkpoint is the whole truth now: the reservations are stale.
    writer.abort();
    let _ = writer.await;
    reservation_log::remove(&dir).context("removing the reservation log")?;
    tracing::info!(keys = keys.len(), "checkpoint written");
    Ok(())
}

/// Serve an allocator's Lease service on `grpc` and its admin HTTP on
/// `http` until `stop` turns true: (gRPC task, admin task).
pub(crate) fn serve_allocator(
    shared: Arc<Shared>,
    grpc: TcpListener,
    http: TcpListener,
    tls: Option<Arc<ServerTls>>,
    durability: Option<Durability>,
    leadership: Option<Arc<quotalease_allocator::leadership::Leadership>>,
    stop: tokio::sync::watch::Receiver<bool>,
) -> (
    tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
    tokio::task::JoinHandle<std::io::Result<()>>,
) {
    let mut stop_admin = stop.clone();
    let http = axum::serve::ListenerExt::tap_io(http, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    let admin = axum::serve(http, alloc_server::admin_router(shared.clone()))
        .with_graceful_shutdown(async move {
            let _ = stop_admin.wait_for(|s| *s).await;
        });
    let admin = tokio::spawn(async move { admin.await });
    let mut stop_grpc = stop;
    let stopped = async move {
        let _ = stop_grpc.wait_for(|s| *s).await;
    };
    let mut service = LeaseService::new(shared);
    if let Some(d) = durability {
        service = service.with_durability(d);
    }
    if let Some(l) = leadership {
        service = service.with_leadership(l);
    }
    let router = tonic::transport::Server::builder().add_service(service.into_server());
    let server = match tls {
        Some(tls) => {
            tls.clone().watch();
            tokio::spawn(
                router.serve_with_incoming_shutdown(quotalease_tls::incoming(grpc, tls), stopped),
            )
        }
        None => tokio::spawn(router.serve_with_incoming_shutdown(
            TcpIncoming::from(grpc).with_nodelay(Some(true)),
            stopped,
        )),
    };
    (server, admin)
}

/// The allocator's mTLS listener config from `--tls-cert`, `--tls-key` and
/// `--tls-client-ca` (all three or none).
pub(crate) fn server_tls(args: &AllocatorArgs) -> anyhow::Result<Option<Arc<ServerTls>>> {
    let files = quotalease_tls::files_from_flags(
        (args.tls_cert.as_deref(), "--tls-cert"),
        (args.tls_key.as_deref(), "--tls-key"),
        (args.tls_client_ca.as_deref(), "--tls-client-ca"),
    )
    .map_err(|e| anyhow!(e))?;
    files
        .map(|f| ServerTls::server(f).map_err(|e| anyhow!(e)))
        .transpose()
}

/// A client's mTLS config from its certificate, key and CA flags (all three
/// or none), reloaded on change.
fn client_tls(
    cert: (Option<&Path>, &'static str),
    key: (Option<&Path>, &'static str),
    ca: (Option<&Path>, &'static str),
) -> anyhow::Result<Option<Arc<ClientTls>>> {
    let Some(files) = quotalease_tls::files_from_flags(cert, key, ca).map_err(|e| anyhow!(e))?
    else {
        return Ok(None);
    };
    let tls = ClientTls::client(files).map_err(|e| anyhow!(e))?;
    tls.clone().watch();
    Ok(Some(tls))
}

/// `quotalease allocator --parent URL --region NAME`: a regional allocator.
async fn regional(args: AllocatorArgs, stop: Termination) -> anyhow::Result<()> {
    let parent = args.parent.clone().unwrap_or_default();
    let region = args.region.clone().unwrap_or_default();
    if region.is_empty() || region.len() > 200 {
        return Err(anyhow!("--region: must be 1..=200 bytes"));
    }
    // Bootstrap rules carry version 0: the parent's rules replace them.
    let bootstrap = match &args.rules {
        Some(p) => Some(load_rules(p, 0)?),
        None => None,
    };
    if args.state_dir.is_some() {
        tracing::warn!(
            "--state-dir is not used by a regional allocator: it needs no start-up wait"
        );
    }
    let ns = |d: Duration| d.as_nanos() as u64;
    let cfg = RegionalConfig {
        core: CoreConfig {
            ttl_max_ns: ns(args.ttl_max),
            cluster: args.cluster.clone().unwrap_or_default(),
            ..CoreConfig::default()
        },
        region: region.clone(),
        renew_interval_ns: ns(args.upstream_renew_interval),
        low_water_ns: ns(args.upstream_low_water),
        fetch_timeout_ns: ns(args.upstream_timeout),
        lease_ttl_ns: ns(args.upstream_ttl),
        ..RegionalConfig::default()
    };
    let tls = server_tls(&args)?;
    // Towards the parent the regional presents its own certificate and
    // checks the parent's against --tls-parent-ca (default: the client CA).
    let parent_tls = client_tls(
        (args.tls_cert.as_deref(), "--tls-cert"),
        (args.tls_key.as_deref(), "--tls-key"),
        match &args.tls_parent_ca {
            Some(p) => (Some(p.as_path()), "--tls-parent-ca"),
            None => (args.tls_client_ca.as_deref(), "--tls-client-ca"),
        },
    )?;
    let client = upstream::client(&parent, args.upstream_timeout, parent_tls.as_ref())
        .map_err(|e| anyhow!(e))?;
    let shared = Shared::new_regional(cfg, bootstrap);
    let grpc = bind("--listen", args.listen).await?;
    let http = bind("--http", args.http).await?;
    println!(
        "quotalease allocator grpc={} http={}",
        grpc.local_addr()?,
        http.local_addr()?
    );
    tracing::info!(grpc = %grpc.local_addr()?, http = %http.local_addr()?, %parent, %region, "regional allocator started");
    let hk = tokio::spawn(alloc_server::housekeeping(
        shared.clone(),
        Duration::from_millis(500),
    ));
    let (tx, rx) = tokio::sync::watch::channel(false);
    let up = tokio::spawn(upstream::run(shared.clone(), client.clone(), rx.clone()));
    let (server, admin) = serve_allocator(shared.clone(), grpc, http, tls, None, None, rx);
    stop.wait().await;
    tracing::info!("stopping: giving unused pools back to the parent");
    let _ = tx.send(true);
    hk.abort();
    let _ = up.await;
    upstream::shutdown(&shared, &client, args.upstream_timeout).await;
    let _ = tokio::time::timeout(Duration::from_secs(5), server).await;
    let _ = tokio::time::timeout(Duration::from_secs(5), admin).await;
    Ok(())
}

/// `quotalease agent`.
pub async fn agent(args: AgentArgs) -> anyhow::Result<()> {
    let stop = Termination::catch();
    let bootstrap = match &args.rules {
        Some(p) => Some(load_rules(p, 0)?),
        None => None,
    };
    let tls = client_tls(
        (args.tls_cert.as_deref(), "--tls-cert"),
        (args.tls_key.as_deref(), "--tls-key"),
        (args.tls_ca.as_deref(), "--tls-ca"),
    )?;
    let transport = GrpcTransport::with_tls(&args.allocator, args.fetch_timeout, tls.as_ref())
        .map_err(|e| anyhow!(e))?;
    let cfg = AgentConfig {
        agent_id: args
            .agent_id
            .clone()
            .unwrap_or_else(|| format!("agent-{}", std::process::id())),
        cluster: args.cluster.clone().unwrap_or_default(),
        lease_ttl: args.lease_ttl,
        plan: PlanConfig {
            renew_interval: args.renew_interval,
            low_water: args.low_water,
            idle_release: args.idle_release,
            rate_leases: args.rate_leases,
            ..PlanConfig::default()
        },
        fetch_timeout: args.fetch_timeout,
        admission_log: args.admission_log.clone(),
        emergency: EmergencyConfig {
            rate_fraction: args.emergency_rate,
            burst_fraction: args.emergency_burst,
        },
        ..AgentConfig::default()
    };
    let grpc = bind("--grpc", args.grpc).await?;
    let http = bind("--http", args.http).await?;
    let agent = Agent::start(cfg, Arc::new(transport), bootstrap).context("starting the agent")?;
    println!(
        "quotalease agent grpc={} http={}",
        grpc.local_addr()?,
        http.local_addr()?
    );
    tracing::info!(grpc = %grpc.local_addr()?, http = %http.local_addr()?, allocator = ?args.allocator, "agent started");
    let (tx, rx) = tokio::sync::watch::channel(false);
    let mut rx2 = rx.clone();
    let admin = tokio::spawn(service::serve_admin(agent.clone(), http, async move {
        let _ = rx2.wait_for(|s| *s).await;
    }));
    let mut rx3 = rx.clone();
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(CheckService::new(agent.clone()).into_server())
            .add_service(
                EnvoyService::new(agent.clone(), &args.envoy_tenant_key, &args.envoy_route_key)
                    .into_server(),
            )
            .serve_with_incoming_shutdown(
                TcpIncoming::from(grpc).with_nodelay(Some(true)),
                async move {
                    let _ = rx3.wait_for(|s| *s).await;
                },
            ),
    );
    stop.wait().await;
    tracing::info!("stopping: releasing unused lease tokens");
    let _ = tx.send(true);
    let _ = tokio::time::timeout(Duration::from_secs(5), server).await;
    agent.shutdown().await;
    let _ = tokio::time::timeout(Duration::from_secs(2), admin).await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ledger_record_round_trips_and_bad_ones_name_the_field() {
        let r = LedgerRecord {
            id: 0xdead_beef,
            ttl_max_ms: 2_000,
            rules_version: 1_796_000_000_000,
            lease_id_base: 0,
            run: 0,
            runs: Vec::new(),
            cluster: String::new(),
        };
        assert_eq!(LedgerRecord::decode(&r.encode()), Ok(r.clone()));
        let named = LedgerRecord {
            cluster: "prod-eu.1".into(),
            ..r.clone()
        };
        assert_eq!(LedgerRecord::decode(&named.encode()), Ok(named.clone()));
        let bad = LedgerRecord::decode(&format!("{}cluster a b\n", r.encode())).unwrap_err();
        assert!(bad.starts_with("cluster:"), "{bad}");
        let r = LedgerRecord {
            lease_id_base: 1 << 61,
            ..r
        };
        assert_eq!(LedgerRecord::decode(&r.encode()), Ok(r.clone()));
        // Runs: a start moves the run in progress to the history with its
        // last record; a clean stop does the same and leaves none running.
        let mut r = r;
        r.start_run(0xa1, 0);
        assert_eq!((r.run, r.runs.clone()), (0xa1, vec![]));
        r.start_run(0xb2, 17);
        r.end_run(5);
        assert_eq!((r.run, r.runs.clone()), (0, vec![(0xa1, 17), (0xb2, 5)]));
        r.start_run(0xc3, 0);
        r.start_run(0xd4, u64::MAX);
        assert_eq!(LedgerRecord::decode(&r.encode()), Ok(r.clone()));
        let runs = r.runs().expect("a run in progress");
        assert_eq!(runs.current, 0xd4);
        assert!(runs.knows(0xa1, 17, 0) && !runs.knows(0xa1, 18, 0));
        assert!(
            runs.knows(0xc3, 1 << 40, 0),
            "an unknown end accepts any record"
        );
        assert!(!runs.knows(0xe5, 0, 0), "a run it never had");
        assert!(runs.knows(0xd4, 3, 3) && !runs.knows(0xd4, 4, 3));
        for i in 0..RUNS_KEPT as u64 + 10 {
            r.start_run(i + 1, i);
        }
        assert_eq!(r.runs.len(), RUNS_KEPT, "the oldest runs are dropped");
        let bad = LedgerRecord::decode(&format!("{}runs 12:x\n", r.encode())).unwrap_err();
        assert!(bad.contains("runs"), "{bad}");
        let err = |t: &str| LedgerRecord::decode(t).unwrap_err();
        assert!(err("quotalease-ledger 1\nttl_max_ms 1\nrules_version 1\n").contains("id: missing"));
        assert!(
            err("quotalease-ledger 1\nid 0\nttl_max_ms 1\nrules_version 1\n")
                .contains("id: must not be 0")
        );
        assert!(
            err("quotalease-ledger 1\nid 1\nttl_max_ms x\nrules_version 1\n")
                .contains("ttl_max_ms")
        );
        assert!(err("quotalease-ledger 2\n").contains("newer"));
        assert!(err("").contains("not a quotalease ledger"));
        // A later format's extra field is ignored by a reader of the same format.
        let extra = format!("{}later_field 7\n", r.encode());
        assert_eq!(LedgerRecord::decode(&extra), Ok(r));
    }

    #[test]
    fn a_checkpoint_round_trips_any_key_and_a_cut_one_is_refused() {
        let keys = vec![(
            KeyId {
                rule: "orders".into(),
                tenant: "a b\nc é".into(),
                route: "".into(),
            },
            KeyCheckpoint {
                available: 7,
                outstanding: 3,
                rates_out_utps: 1_000_000,
                leases_end_in_ns: 1_500_000_000,
            },
        )];
        let text = encode_checkpoint(0xabc, &keys);
        assert_eq!(decode_checkpoint(&text), Ok((0xabc, keys)));
        let cut = text.trim_end_matches("end\n");
        assert!(decode_checkpoint(cut).unwrap_err().contains("cut short"));
        assert!(decode_checkpoint("quotalease-checkpoint 1\nledger 1\nkey zz\nend\n").is_err());
    }

    #[test]
    fn the_default_state_dir_is_per_listen_address() {
        let a = default_state_dir("127.0.0.1:7070".parse().unwrap());
        let b = default_state_dir("[::1]:7070".parse().unwrap());
        assert_eq!(a, Path::new("quotalease-state/127.0.0.1_7070"));
        assert_eq!(b, Path::new("quotalease-state/___1__7070"));
        assert_ne!(a, b);
    }
}

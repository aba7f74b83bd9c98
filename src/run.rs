//! The long-running commands: `allocator`, `agent`, and `rules validate`.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, Context};
use quotalease_agent::agent::{Agent, AgentConfig, EmergencyConfig};
use quotalease_agent::renewal::PlanConfig;
use quotalease_agent::transport::GrpcTransport;
use quotalease_allocator::core::{CoreConfig, TTL_MAX_CAP_NS};
use quotalease_allocator::durable::{decode_checkpoint, encode_checkpoint, LedgerRecord};
use quotalease_allocator::ledger::KeyCheckpoint;
use quotalease_allocator::regional::RegionalConfig;
use quotalease_allocator::reservation_log;
use quotalease_allocator::server::{self as alloc_server, Shared};
use quotalease_allocator::term;
use quotalease_allocator::upstream;
use quotalease_gateway::envoy::EnvoyService;
use quotalease_gateway::permits::PermitService;
use quotalease_gateway::service::{self, CheckService};
use quotalease_model::key::KeyId;
use quotalease_tls::ClientTls;
use tonic::transport::server::TcpIncoming;

use crate::serve::{bind, load_rules, serve_allocator, server_tls, ttl_max_ms, Termination};
use crate::{AgentArgs, AllocatorArgs};

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

const LEDGER_FILE: &str = "ledger";
const CHECKPOINT_FILE: &str = "checkpoint";

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
    let recorded = state.read()?;
    // No record: a new ledger, unless an allocator from before the ledger
    // file left its start record (its TTL_max unknown: the cap).
    let first = recorded.is_none() && !state.has_old_start_record();
    // A run that did not stop cleanly got as far as its reservation log's
    // last durable record (unknown without a log: a lost ledger's was
    // removed, and a restart then waits the whole recorded TTL_max).
    let last_seq = match &recorded {
        Some(r) if r.run != 0 => match reservation_log::read(&dir, r.id) {
            Ok(Some((_, seq))) => seq,
            _ => u64::MAX,
        },
        _ => 0,
    };
    // The cluster: recorded at the first start that names one; a later
    // start naming another is refused before anything is written.
    let next = term::next_record(
        recorded,
        first,
        term::Starting {
            new_ledger_id: quotalease_proto::random_instance(),
            run: quotalease_proto::random_instance().max(1),
            last_seq,
            unix_ms: alloc_server::unix_ms(),
            ttl_max_ms,
            cluster: args.cluster.as_deref(),
            lease_id_base: None,
        },
    )
    .map_err(|theirs| {
        anyhow!(
            "--cluster {}: the state directory {} belongs to cluster {theirs} (start without --cluster, or give each cluster its own directory)",
            args.cluster.as_deref().unwrap_or_default(),
            dir.display()
        )
    })?;
    let rules = load_rules(&rules_path, next.rules_version)?;
    let record = next.record;
    state.write(&record)?;
    let checkpoint = if first {
        None
    } else {
        state.take_checkpoint(record.id)?
    };
    // After a crash: the write-ahead reservations (none from a version
    // without them, or after a lost ledger: then the whole start-up wait).
    let reserved = if first || checkpoint.is_some() {
        None
    } else {
        reservation_log::read(&dir, record.id)
            .map_err(|e| anyhow!(e))?
            .map(|(keys, _)| keys)
    };
    let durable = term::Durable {
        first,
        lost: !first && checkpoint.is_none() && reserved.is_none(),
        predecessor_ttl_max_ns: next.predecessor_ttl_max_ms.saturating_mul(1_000_000),
        ledger_id: record.id,
        reservations: reserved.unwrap_or_default(),
        checkpoint,
    };
    // Agents holding a lost ledger's leases name it within their 1 s
    // heartbeat (or their next renewal): a new ledger waits that long
    // before it serves its full buckets. So does every later start:
    // agents that saw a newer state than this directory holds (a
    // restored backup) name its run before a brand-new agent, which
    // presents nothing, can take from the older state; a restart waits
    // no longer than `TTL_max` (at least a heartbeat), so that a key
    // is usable again within `TTL_max` of a crash (SPEC §2 "Restarts").
    let cfg = term::config(
        CoreConfig {
            ttl_max_ns: args.ttl_max.as_nanos() as u64,
            runs: record.runs(),
            cluster: record.cluster.clone(),
            ..CoreConfig::default()
        },
        &durable,
        term::Grace {
            first_ns: term::START_GRACE.as_nanos() as u64,
            later_ns: term::restart_grace(args.ttl_max).as_nanos() as u64,
        },
        args.new_ledger,
    );
    let shared = Shared::new(cfg, rules, Some(rules_path));
    let now = shared.now();
    let predecessor_ttl_ms = next.predecessor_ttl_max_ms;
    let ledger = format_args!("{:016x}", record.id).to_string();
    let (resumed, promises) = shared.with_core(|c| term::resume(c, now, durable));
    match resumed {
        term::Resumed::First => {
            tracing::info!(dir = %dir.display(), %ledger, "no ledger in the state directory: a new ledger, buckets start full")
        }
        term::Resumed::Checkpoint(keys) => {
            tracing::info!(dir = %dir.display(), %ledger, keys, "clean restart of this ledger: keys resume from the shutdown's checkpoint, what was leased then counts until it has expired")
        }
        term::Resumed::Reserved(keys) => {
            tracing::info!(dir = %dir.display(), %ledger, keys, predecessor_ttl_max_ms = predecessor_ttl_ms, "restart of this ledger after a crash: keys resume from their write-ahead reservations (each at its floor, the rest of its burst leased out until the longest lease has expired); keys without one are full")
        }
        term::Resumed::Lost => {
            tracing::info!(dir = %dir.display(), %ledger, predecessor_ttl_max_ms = predecessor_ttl_ms, "restart of this ledger without a checkpoint: every key counts as fully leased out until the longest lease it may have granted has expired")
        }
    }
    // Every resumed key's state is its promise before anything is granted.
    let seq = shared.with_core(|c| c.reservation_seq());
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
            resume_slot_leases: args.experimental_regional_resume,
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
            .add_service(PermitService::new(agent.clone()).into_server())
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
    fn the_default_state_dir_is_per_listen_address() {
        let a = default_state_dir("127.0.0.1:7070".parse().unwrap());
        let b = default_state_dir("[::1]:7070".parse().unwrap());
        assert_eq!(a, Path::new("quotalease-state/127.0.0.1_7070"));
        assert_eq!(b, Path::new("quotalease-state/___1__7070"));
        assert_ne!(a, b);
    }
}

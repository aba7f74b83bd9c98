//! The long-running commands: `allocator`, `agent`, and `rules validate`.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, Context};
use quotalease_agent::agent::{Agent, AgentConfig, EmergencyConfig};
use quotalease_agent::renewal::PlanConfig;
use quotalease_agent::transport::GrpcTransport;
use quotalease_allocator::core::CoreConfig;
use quotalease_allocator::regional::RegionalConfig;
use quotalease_allocator::server::{self as alloc_server, LeaseService, Shared};
use quotalease_allocator::upstream;
use quotalease_gateway::envoy::EnvoyService;
use quotalease_gateway::service::{self, CheckService};
use quotalease_model::rules::RuleSet;
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
    println!("{}: {} rule(s), valid", path.display(), rules.rules.len());
    println!("{}", rules.summary());
    Ok(())
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

async fn bind(flag: &str, addr: std::net::SocketAddr) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .with_context(|| format!("{flag} {addr}: cannot listen"))
}

/// Record this start in `dir`; true if no start was recorded before (no
/// predecessor can have leases outstanding).
fn first_start(dir: &Path) -> anyhow::Result<bool> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("--state-dir {}: cannot create", dir.display()))?;
    let marker = dir.join("allocator-started");
    let first = !marker.exists();
    let tmp = dir.join("allocator-started.tmp");
    std::fs::write(&tmp, format!("{}\n", alloc_server::unix_ms()))
        .and_then(|_| std::fs::rename(&tmp, &marker))
        .and_then(|_| std::fs::File::open(dir)?.sync_all())
        .with_context(|| format!("--state-dir {}: cannot record the start", dir.display()))?;
    Ok(first)
}

/// `quotalease allocator`.
pub async fn allocator(args: AllocatorArgs) -> anyhow::Result<()> {
    let stop = Termination::catch();
    match (&args.parent, &args.region) {
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
    let Some(rules_path) = args.rules.clone() else {
        return Err(anyhow!(
            "--rules FILE is required for the global allocator (a regional one, with --parent, may take its rules from the parent)"
        ));
    };
    let version = alloc_server::unix_ms();
    let rules = load_rules(&rules_path, version)?;
    let no_predecessor = match &args.state_dir {
        Some(dir) => first_start(dir)?,
        None => false,
    };
    if no_predecessor {
        tracing::info!("first start for this state directory: buckets start full");
    }
    let cfg = CoreConfig {
        ttl_max_ns: args.ttl_max.as_nanos() as u64,
        no_predecessor,
        ..CoreConfig::default()
    };
    let shared = Shared::new(cfg, rules, Some(rules_path));
    let grpc = bind("--listen", args.listen).await?;
    let http = bind("--http", args.http).await?;
    println!(
        "quotalease allocator grpc={} http={}",
        grpc.local_addr()?,
        http.local_addr()?
    );
    tracing::info!(grpc = %grpc.local_addr()?, http = %http.local_addr()?, ttl_max = ?args.ttl_max, "allocator started; no grants until TTL_max has passed");
    let hk = tokio::spawn(alloc_server::housekeeping(
        shared.clone(),
        Duration::from_millis(500),
    ));
    let (tx, rx) = tokio::sync::watch::channel(false);
    let (server, admin) = serve_allocator(shared, grpc, http, rx);
    stop.wait().await;
    tracing::info!("stopping");
    let _ = tx.send(true);
    hk.abort();
    let _ = tokio::time::timeout(Duration::from_secs(5), server).await;
    let _ = tokio::time::timeout(Duration::from_secs(5), admin).await;
    Ok(())
}

/// Serve an allocator's Lease service on `grpc` and its admin HTTP on
/// `http` until `stop` turns true: (gRPC task, admin task).
fn serve_allocator(
    shared: Arc<Shared>,
    grpc: TcpListener,
    http: TcpListener,
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
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(LeaseService::new(shared).into_server())
            .serve_with_incoming_shutdown(
                TcpIncoming::from(grpc).with_nodelay(Some(true)),
                async move {
                    let _ = stop_grpc.wait_for(|s| *s).await;
                },
            ),
    );
    (server, admin)
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
            ..CoreConfig::default()
        },
        region: region.clone(),
        renew_interval_ns: ns(args.upstream_renew_interval),
        low_water_ns: ns(args.upstream_low_water),
        fetch_timeout_ns: ns(args.upstream_timeout),
        lease_ttl_ns: ns(args.upstream_ttl),
        ..RegionalConfig::default()
    };
    let client = upstream::client(&parent, args.upstream_timeout).map_err(|e| anyhow!(e))?;
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
    let (server, admin) = serve_allocator(shared.clone(), grpc, http, rx);
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
    let transport =
        GrpcTransport::new(&args.allocator, args.fetch_timeout).map_err(|e| anyhow!(e))?;
    let cfg = AgentConfig {
        agent_id: args
            .agent_id
            .clone()
            .unwrap_or_else(|| format!("agent-{}", std::process::id())),
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

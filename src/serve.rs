//! What both global allocator drivers (`src/run.rs` with a state
//! directory, `src/etcd.rs` with `--etcd`) and the other long-running
//! commands share: rules files, signals, listening sockets, TLS and the
//! allocator's gRPC and admin servers.

use std::path::Path;
use std::sync::Arc;

use anyhow::{anyhow, Context};
use quotalease_allocator::core::TTL_MAX_CAP_NS;
use quotalease_allocator::reservation_log::Durability;
use quotalease_allocator::server::{self as alloc_server, LeaseService, Shared};
use quotalease_model::rules::RuleSet;
use quotalease_tls::ServerTls;
use tokio::net::TcpListener;
use tonic::transport::server::TcpIncoming;

use crate::AllocatorArgs;

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
        rules.rule_lines().len()
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

//! How the agent reaches its allocator. Production uses gRPC over tonic;
//! the simulator (and unit tests of a single module) plug in their own.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use quotalease_proto::lease::allocator_client::AllocatorClient;
use quotalease_proto::lease::{LeaseBatch, LeaseReply};
use quotalease_proto::MAX_MESSAGE_BYTES;
use tonic::transport::{Channel, Endpoint};

/// A boxed future returned by [`Transport::lease`].
pub type LeaseFuture<'a> = Pin<Box<dyn Future<Output = Result<LeaseReply, String>> + Send + 'a>>;

/// Sends one lease batch and waits for its reply.
pub trait Transport: Send + Sync + 'static {
    /// Send `batch`; `Err` carries a one-line reason (unreachable, timeout,
    /// refused...). The caller retries with the same sequence number.
    fn lease(&self, batch: LeaseBatch) -> LeaseFuture<'_>;
}

/// gRPC to one or more allocator URLs; on an error the next URL is tried
/// on the following call.
#[derive(Debug)]
pub struct GrpcTransport {
    clients: Vec<(String, AllocatorClient<Channel>)>,
    current: AtomicUsize,
}

impl GrpcTransport {
    /// Lazily connecting clients (the agent starts even if no allocator
    /// answers). `timeout` bounds each call.
    pub fn new(urls: &[String], timeout: Duration) -> Result<Self, String> {
        if urls.is_empty() {
            return Err("--allocator: at least one URL is needed".into());
        }
        let mut channels = Vec::new();
        for url in urls {
            channels.push((url.clone(), endpoint(url, timeout)?.connect_lazy()));
        }
        Self::from_channels(channels)
    }

    /// Clients over ready-made channels, each named by its URL (for logs).
    /// A test builds them from [`endpoint`] over its own network
    /// (`Endpoint::connect_with_connector_lazy`).
    pub fn from_channels(channels: Vec<(String, Channel)>) -> Result<Self, String> {
        if channels.is_empty() {
            return Err("--allocator: at least one URL is needed".into());
        }
        let clients = channels
            .into_iter()
            .map(|(url, channel)| {
                let client = AllocatorClient::new(channel)
                    .max_decoding_message_size(MAX_MESSAGE_BYTES)
                    .max_encoding_message_size(MAX_MESSAGE_BYTES);
                (url, client)
            })
            .collect();
        Ok(Self {
            clients,
            current: AtomicUsize::new(0),
        })
    }
}

/// The endpoint settings the agent uses for the allocator at `url`:
/// connect and call timeouts of `timeout`, HTTP/2 keep-alive pings every
/// 10 s (also while idle).
pub fn endpoint(url: &str, timeout: Duration) -> Result<Endpoint, String> {
    Ok(Endpoint::from_shared(url.to_string())
        .map_err(|e| format!("--allocator: {url:?} is not a valid URL: {e}"))?
        .connect_timeout(timeout)
        .timeout(timeout)
        .tcp_nodelay(true)
        // A connection whose pings go unanswered is dropped and the next
        // call reconnects: a healed partition is noticed within about
        // 1 s + 4 timeouts instead of HTTP/2's default 20 s ping wait.
        .http2_keep_alive_interval(Duration::from_secs(1))
        .keep_alive_timeout((timeout * 4).max(Duration::from_secs(1)))
        .keep_alive_while_idle(true))
}

impl Transport for GrpcTransport {
    fn lease(&self, batch: LeaseBatch) -> LeaseFuture<'_> {
        Box::pin(async move {
            let i = self.current.load(Ordering::Relaxed) % self.clients.len();
            let (url, client) = &self.clients[i];
            let mut client = client.clone();
            match client.lease(batch).await {
                Ok(resp) => Ok(resp.into_inner()),
                Err(status) => {
                    self.current.store(i + 1, Ordering::Relaxed);
                    Err(format!("{url}: {}: {}", status.code(), status.message()))
                }
            }
        })
    }
}

/// Calls an allocator running in the same process directly (benchmarks,
/// the library use of both halves in one binary). The allocator is the real
/// one; only the network is skipped.
#[derive(Debug, Clone)]
pub struct InProcess {
    shared: std::sync::Arc<quotalease_allocator::server::Shared>,
}

impl InProcess {
    /// Talk to `shared`.
    pub fn new(shared: std::sync::Arc<quotalease_allocator::server::Shared>) -> Self {
        Self { shared }
    }
}

impl Transport for InProcess {
    fn lease(&self, batch: LeaseBatch) -> LeaseFuture<'_> {
        let reply = self.shared.handle(&batch);
        Box::pin(async move { Ok(reply) })
    }
}

//! How the agent reaches its allocator. Production uses gRPC over tonic;
//! the simulator (and unit tests of a single module) plug in their own.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use quotalease_proto::follow::ShardedClient;
use quotalease_proto::lease::{LeaseBatch, LeaseReply, SlotWait, SlotWake};
use tonic::transport::{Channel, Endpoint};

/// A boxed future returned by [`Transport::lease`].
pub type LeaseFuture<'a> = Pin<Box<dyn Future<Output = Result<LeaseReply, String>> + Send + 'a>>;

/// A boxed future returned by [`Transport::wait_slots`].
pub type WakeFuture<'a> = Pin<Box<dyn Future<Output = Result<SlotWake, String>> + Send + 'a>>;

/// Sends one lease batch and waits for its reply.
pub trait Transport: Send + Sync + 'static {
    /// Send `batch`; `Err` carries a one-line reason (unreachable, timeout,
    /// refused...). The caller retries with the same sequence number.
    fn lease(&self, batch: LeaseBatch) -> LeaseFuture<'_>;

    /// A `WaitSlots` wake-up (docs/permits.md "Slots follow demand"): a
    /// transport without it answers `not_here` at once, and the permit
    /// driver asks on its tick as before.
    fn wait_slots(&self, _w: SlotWait) -> WakeFuture<'_> {
        Box::pin(async {
            Ok(SlotWake {
                not_here: true,
                ..SlotWake::default()
            })
        })
    }
}

/// gRPC to the allocator leader: the first contacts (`--allocator`), then
/// whatever replicas and leader the replies name
/// ([`quotalease_proto::follow::LeaderClient`]); on an error the next one
/// is tried on the following call. With shards, each batch goes to the
/// leader of the shard it names ([`quotalease_proto::follow::ShardedClient`]).
#[derive(Debug)]
pub struct GrpcTransport {
    client: ShardedClient,
}

impl GrpcTransport {
    /// Lazily connecting clients (the agent starts even if no allocator
    /// answers). `timeout` bounds each call.
    pub fn new(urls: &[String], timeout: Duration) -> Result<Self, String> {
        Self::with_tls(urls, timeout, None)
    }

    /// [`GrpcTransport::new`] over mTLS with `tls` when given (the URLs are
    /// then `https://`).
    pub fn with_tls(
        urls: &[String],
        timeout: Duration,
        tls: Option<&std::sync::Arc<quotalease_tls::ClientTls>>,
    ) -> Result<Self, String> {
        if urls.is_empty() {
            return Err("--allocator: at least one URL is needed".into());
        }
        let tls = tls.cloned();
        let connect = move |url: &str| {
            quotalease_tls::channel(endpoint(url, timeout)?, url, tls.as_ref(), "--allocator")
        };
        let mut channels = Vec::new();
        for url in urls {
            channels.push((url.clone(), connect(url)?));
        }
        Ok(Self {
            client: ShardedClient::new(channels, std::sync::Arc::new(connect))?,
        })
    }

    /// Clients over ready-made channels, each named by its URL (for logs).
    /// A test builds them from [`endpoint`] over its own network
    /// (`Endpoint::connect_with_connector_lazy`). Replicas named by replies
    /// are reached over the real network.
    pub fn from_channels(channels: Vec<(String, Channel)>) -> Result<Self, String> {
        let connect = |url: &str| Ok(endpoint(url, Duration::from_secs(2))?.connect_lazy());
        Ok(Self {
            client: ShardedClient::new(channels, std::sync::Arc::new(connect))
                .map_err(|e| format!("--allocator: {e}"))?,
        })
    }

    /// The allocator URL calls go to now.
    pub fn current_url(&self) -> String {
        self.client.current_url()
    }
}

/// The endpoint for the allocator at `url`: the common allocator client
/// settings ([`quotalease_model::endpoint::settings`]) with connect and call
/// timeouts of `timeout`.
pub fn endpoint(url: &str, timeout: Duration) -> Result<Endpoint, String> {
    quotalease_proto::endpoint(url, &quotalease_model::endpoint::settings(timeout))
        .map_err(|e| format!("--allocator: {url:?} is not a valid URL: {e}"))
}

impl Transport for GrpcTransport {
    fn lease(&self, batch: LeaseBatch) -> LeaseFuture<'_> {
        Box::pin(self.client.lease(batch))
    }

    fn wait_slots(&self, w: SlotWait) -> WakeFuture<'_> {
        Box::pin(self.client.wait_slots(w))
    }
}

/// The handler of an [`InProcess`] transport: one batch in, its reply out
/// (e.g. `move |b| shared.handle(b)` over a `quotalease_allocator::server::Shared`).
pub type Handler = dyn Fn(&LeaseBatch) -> LeaseReply + Send + Sync;

/// Calls an allocator running in the same process directly (benchmarks,
/// the library use of both halves in one binary). The allocator is the real
/// one, reached through a handler function (the agent does not depend on
/// the allocator crate); only the network is skipped.
#[derive(Clone)]
pub struct InProcess {
    handle: std::sync::Arc<Handler>,
}

impl std::fmt::Debug for InProcess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("InProcess")
    }
}

impl InProcess {
    /// Hand every batch to `handle` (for the real allocator:
    /// `InProcess::new(move |b| shared.handle(b))`).
    pub fn new(handle: impl Fn(&LeaseBatch) -> LeaseReply + Send + Sync + 'static) -> Self {
        Self {
            handle: std::sync::Arc::new(handle),
        }
    }
}

impl Transport for InProcess {
    fn lease(&self, batch: LeaseBatch) -> LeaseFuture<'_> {
        let reply = (self.handle)(&batch);
        Box::pin(async move { Ok(reply) })
    }
}

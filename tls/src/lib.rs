//! mTLS for quotalease's lease protocol (SPEC §8): the allocator's TLS
//! listener, which requires a client certificate signed by the client CA
//! and hands each connection's principal to the gRPC service, and the
//! connector agents and regional allocators use to reach an allocator.
//!
//! Certificates, keys and CA bundles are PEM files, re-read when their
//! contents change ([`Reloading::watch`]): a new handshake uses the new
//! material, connections already open keep theirs until they close. A file
//! that no longer parses is logged and the last good material keeps
//! serving. One crypto provider is compiled in and named explicitly:
//! ring ([`provider`]).
//!
//! A peer's principal is the first URI subject alternative name of its
//! certificate (a SPIFFE id, say), else its first DNS name; a client
//! certificate with neither is refused.
#![warn(missing_docs)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

/// Longest principal accepted (the bound of an agent id, SPEC §8).
pub const MAX_PRINCIPAL_BYTES: usize = 256;
/// Bound of one TLS handshake, either side.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How often [`Reloading::watch`] looks at the files.
pub const RELOAD_EVERY: Duration = Duration::from_secs(1);

/// The crypto provider every quotalease TLS config is built with: ring.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The three files of one side of mTLS, each named by the flag that gave
/// it (for error messages).
#[derive(Clone, Debug)]
pub struct TlsFiles {
    /// This process's certificate chain (PEM), and its flag.
    pub cert: (PathBuf, &'static str),
    /// Its private key (PEM: PKCS#8, PKCS#1 or SEC1), and its flag.
    pub key: (PathBuf, &'static str),
    /// The CA bundle that must have signed the peer's certificate, and its
    /// flag.
    pub ca: (PathBuf, &'static str),
}

/// The files' contents as read at one time.
#[derive(Clone, PartialEq, Eq)]
struct Contents {
    cert: Vec<u8>,
    key: Vec<u8>,
    ca: Vec<u8>,
}

fn read(file: &(PathBuf, &'static str)) -> Result<Vec<u8>, String> {
    std::fs::read(&file.0).map_err(|e| format!("{} {}: {e}", file.1, file.0.display()))
}

impl TlsFiles {
    fn read(&self) -> Result<Contents, String> {
        Ok(Contents {
            cert: read(&self.cert)?,
            key: read(&self.key)?,
            ca: read(&self.ca)?,
        })
    }
}

/// Parsed material: this side's chain and key, and the peer's roots.
struct Material {
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    roots: Arc<RootCertStore>,
}

fn parse(files: &TlsFiles, c: &Contents) -> Result<Material, String> {
    let name = |f: &(PathBuf, &'static str)| format!("{} {}", f.1, f.0.display());
    let chain = CertificateDer::pem_slice_iter(&c.cert)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{}: {e}", name(&files.cert)))?;
    if chain.is_empty() {
        return Err(format!("{}: no certificate in the file", name(&files.cert)));
    }
    let key = PrivateKeyDer::from_pem_slice(&c.key)
        .map_err(|e| format!("{}: no private key: {e}", name(&files.key)))?;
    let mut roots = RootCertStore::empty();
    let mut n = 0;
    for ca in CertificateDer::pem_slice_iter(&c.ca) {
        let ca = ca.map_err(|e| format!("{}: {e}", name(&files.ca)))?;
        roots
            .add(ca)
            .map_err(|e| format!("{}: not a CA certificate: {e}", name(&files.ca)))?;
        n += 1;
    }
    if n == 0 {
        return Err(format!("{}: no certificate in the file", name(&files.ca)));
    }
    Ok(Material {
        chain,
        key,
        roots: Arc::new(roots),
    })
}

/// Builds one side's rustls config from parsed material.
type Build<T> = fn(&TlsFiles, Material) -> Result<T, String>;

/// A rustls config kept current with its files: `current()` is what the
/// next handshake uses.
pub struct Reloading<T> {
    files: TlsFiles,
    build: Build<T>,
    state: parking_lot::Mutex<Contents>,
    current: ArcSwap<T>,
}

impl<T> std::fmt::Debug for Reloading<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reloading")
            .field("files", &self.files)
            .finish_non_exhaustive()
    }
}

impl<T: Send + Sync + 'static> Reloading<T> {
    fn load(files: TlsFiles, build: Build<T>) -> Result<Arc<Self>, String> {
        let contents = files.read()?;
        let config = build(&files, parse(&files, &contents)?)?;
        Ok(Arc::new(Self {
            files,
            build,
            state: parking_lot::Mutex::new(contents),
            current: ArcSwap::from_pointee(config),
        }))
    }

    /// The config the next handshake uses.
    pub fn current(&self) -> Arc<T> {
        self.current.load_full()
    }

    /// Re-read the files; when their contents changed and parse, the next
    /// handshakes use them (`Ok(true)`). On an error the last good
    /// material stays (`Err` says which file and why).
    pub fn reload(&self) -> Result<bool, String> {
        let contents = self.files.read()?;
        let mut state = self.state.lock();
        if *state == contents {
            return Ok(false);
        }
        let config = (self.build)(&self.files, parse(&self.files, &contents)?)?;
        self.current.store(Arc::new(config));
        *state = contents;
        Ok(true)
    }

    /// Reload every [`RELOAD_EVERY`] for as long as the process runs,
    /// logging each change and each error once until the files change
    /// again. A Kubernetes secret's `..data` symlink swap is a change of
    /// contents like any other.
    pub fn watch(self: Arc<Self>) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            let mut last_error: Option<String> = None;
            loop {
                tokio::time::sleep(RELOAD_EVERY).await;
                match self.reload() {
                    Ok(true) => {
                        tracing::info!(cert = %self.files.cert.0.display(), "TLS certificates reloaded; new connections use them");
                        last_error = None;
                    }
                    Ok(false) => {}
                    Err(e) => {
                        if last_error.as_deref() != Some(e.as_str()) {
                            tracing::error!(error = %e, "TLS files rejected; the last good certificates keep serving");
                            last_error = Some(e);
                        }
                    }
                }
            }
        })
    }
}

/// The allocator's side: requires a client certificate signed by `ca`.
pub type ServerTls = Reloading<ServerConfig>;
/// An agent's (or a regional allocator's) side towards its allocator:
/// presents `cert`, verifies the allocator against `ca`.
pub type ClientTls = Reloading<ClientConfig>;

fn build_server(files: &TlsFiles, m: Material) -> Result<ServerConfig, String> {
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(m.roots, provider())
        .build()
        .map_err(|e| format!("{} {}: {e}", files.ca.1, files.ca.0.display()))?;
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS: {e}"))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(m.chain, m.key)
        .map_err(|e| {
            format!(
                "{} {} / {} {}: {e}",
                files.cert.1,
                files.cert.0.display(),
                files.key.1,
                files.key.0.display()
            )
        })?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(config)
}

fn build_client(files: &TlsFiles, m: Material) -> Result<ClientConfig, String> {
    let mut config = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS: {e}"))?
        .with_root_certificates(m.roots)
        .with_client_auth_cert(m.chain, m.key)
        .map_err(|e| {
            format!(
                "{} {} / {} {}: {e}",
                files.cert.1,
                files.cert.0.display(),
                files.key.1,
                files.key.0.display()
            )
        })?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(config)
}

impl ServerTls {
    /// Load the allocator's certificate, key and client CA (errors name the
    /// flag and the file).
    pub fn server(files: TlsFiles) -> Result<Arc<Self>, String> {
        Self::load(files, build_server)
    }
}

impl ClientTls {
    /// Load a client's certificate, key and the allocator's CA.
    pub fn client(files: TlsFiles) -> Result<Arc<Self>, String> {
        Self::load(files, build_client)
    }
}

/// The principal a certificate names: its first URI subject alternative
/// name, else its first DNS name. `None` when it names neither, or one
/// longer than [`MAX_PRINCIPAL_BYTES`].
pub fn principal(cert: &CertificateDer<'_>) -> Option<String> {
    let ee = webpki::EndEntityCert::try_from(cert).ok()?;
    let name = ee
        .valid_uri_names()
        .next()
        .or_else(|| ee.valid_dns_names().next())?;
    (!name.is_empty() && name.len() <= MAX_PRINCIPAL_BYTES).then(|| name.to_owned())
}

/// What the gRPC service learns of a TLS connection (in each request's
/// extensions, through tonic's `Connected`).
#[derive(Clone, Debug)]
pub struct PeerInfo {
    /// The client's address.
    pub remote: SocketAddr,
    /// Its certificate's principal ([`principal`]).
    pub principal: Arc<str>,
}

/// One accepted, handshaken connection.
#[derive(Debug)]
pub struct TlsConn {
    stream: tokio_rustls::server::TlsStream<TcpStream>,
    info: PeerInfo,
}

impl tonic::transport::server::Connected for TlsConn {
    type ConnectInfo = PeerInfo;
    fn connect_info(&self) -> PeerInfo {
        self.info.clone()
    }
}

impl AsyncRead for TlsConn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for TlsConn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

/// How long repeats of one kind of refusal are logged at debug after the
/// warning that opened the window.
const REFUSAL_WINDOW: Duration = Duration::from_secs(10);
/// Most kinds of refusal remembered at once; refusals of further kinds share
/// one window (so a peer cycling through reasons cannot flood the log).
const MAX_REFUSAL_KINDS: usize = 256;

/// What makes refusals "the same" for the log: the reason, and who was
/// refused as far as the handshake showed it, never the peer's address
/// (a client reconnecting gets a new port each time).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct RefusalKind {
    reason: String,
    /// The certificate's issuer and subject (DER, length-prefixed) when the
    /// handshake got as far as a verified certificate; `None` otherwise.
    cert: Option<Vec<u8>>,
}

impl RefusalKind {
    fn new(reason: &str, cert: Option<&CertificateDer<'_>>) -> Self {
        let cert = cert
            .and_then(|c| webpki::EndEntityCert::try_from(c).ok())
            .map(|ee| {
                let mut id = Vec::with_capacity(16 + ee.issuer().len() + ee.subject().len());
                for part in [ee.issuer(), ee.subject()] {
                    id.extend_from_slice(&(part.len() as u64).to_be_bytes());
                    id.extend_from_slice(part);
                }
                id
            });
        Self {
            reason: reason.to_owned(),
            cert,
        }
    }
}

/// One kind's window: when its warning was logged, and how many refusals
/// of the kind went to debug since.
#[derive(Clone, Copy, Debug)]
struct Window {
    since: Instant,
    suppressed: u64,
}

impl Window {
    /// `Some(suppressed)` to log a warning now (and a new window opens),
    /// `None` for a repeat within the window.
    fn admit(&mut self, now: Instant) -> Option<u64> {
        if now.saturating_duration_since(self.since) < REFUSAL_WINDOW {
            self.suppressed += 1;
            None
        } else {
            let suppressed = self.suppressed;
            *self = Window {
                since: now,
                suppressed: 0,
            };
            Some(suppressed)
        }
    }
}

/// The de-duplication of refusal logs, sans-IO (time comes in): the first
/// refusal of a kind is logged at warn, repeats within [`REFUSAL_WINDOW`]
/// at debug, and the next warning of the kind says how many went to debug.
#[derive(Debug, Default)]
struct RefusalDedup {
    kinds: std::collections::HashMap<RefusalKind, Window>,
    /// Shared by kinds beyond [`MAX_REFUSAL_KINDS`].
    overflow: Option<Window>,
}

impl RefusalDedup {
    /// Whether a refusal of `kind` at `now` is logged at warn: `Some(n)`,
    /// `n` refusals of the kind having been logged at debug since its last
    /// warning, or `None` for debug.
    fn admit(&mut self, kind: &RefusalKind, now: Instant) -> Option<u64> {
        if let Some(w) = self.kinds.get_mut(kind) {
            return w.admit(now);
        }
        if self.kinds.len() >= MAX_REFUSAL_KINDS {
            // Forget the kinds whose window has passed (their uncounted
            // repeats, if any, are lost: they were at debug).
            self.kinds
                .retain(|_, w| now.saturating_duration_since(w.since) < REFUSAL_WINDOW);
        }
        if self.kinds.len() >= MAX_REFUSAL_KINDS {
            return match &mut self.overflow {
                Some(w) => w.admit(now),
                None => {
                    self.overflow = Some(Window {
                        since: now,
                        suppressed: 0,
                    });
                    Some(0)
                }
            };
        }
        self.kinds.insert(
            kind.clone(),
            Window {
                since: now,
                suppressed: 0,
            },
        );
        Some(0)
    }
}

/// Logs refused handshakes: each kind of refusal ([`RefusalKind`]) at
/// warn, repeats within ten seconds at debug, the next warning with the
/// number of them (a misconfigured fleet must not flood the log).
#[derive(Default)]
struct RefusalLog {
    dedup: parking_lot::Mutex<RefusalDedup>,
}

impl RefusalLog {
    /// A refusal of `peer` for `reason`; `cert` is the certificate it
    /// presented when the handshake verified one.
    fn refused(&self, what: &str, peer: &str, reason: &str, cert: Option<&CertificateDer<'_>>) {
        let kind = RefusalKind::new(reason, cert);
        let verdict = self.dedup.lock().admit(&kind, Instant::now());
        match verdict {
            Some(0) => tracing::warn!(peer, reason, "{what}"),
            // `suppressed`: refusals of this kind logged at debug since its
            // last warning.
            Some(suppressed) => tracing::warn!(peer, reason, suppressed, "{what}"),
            None => tracing::debug!(peer, reason, "{what}"),
        }
    }
}

/// The allocator's TLS listener as a stream of handshaken connections for
/// tonic's `serve_with_incoming`. Handshakes run concurrently (a slow
/// client holds up no other); a client without a valid certificate, or
/// with one that names no principal, is refused with a log line saying
/// why. The accept loop ends when the stream is dropped.
pub fn incoming(
    listener: TcpListener,
    tls: Arc<ServerTls>,
) -> tokio_stream::wrappers::ReceiverStream<std::io::Result<TlsConn>> {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let log = Arc::new(RefusalLog::default());
    tokio::spawn(async move {
        loop {
            let (tcp, remote) = tokio::select! {
                r = listener.accept() => match r {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::warn!(error = %e, "accepting a connection failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
                _ = tx.closed() => return,
            };
            let _ = tcp.set_nodelay(true);
            let acceptor = tokio_rustls::TlsAcceptor::from(tls.current());
            let tx = tx.clone();
            let log = log.clone();
            tokio::spawn(async move {
                let peer = remote.to_string();
                let stream =
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                        Ok(Ok(s)) => s,
                        // The handshake failed: no certificate to tell
                        // clients apart, the reason alone is the kind.
                        Ok(Err(e)) => {
                            log.refused("TLS client refused", &peer, &e.to_string(), None);
                            return;
                        }
                        Err(_) => {
                            log.refused("TLS client refused", &peer, "handshake timed out", None);
                            return;
                        }
                    };
                let cert = stream
                    .get_ref()
                    .1
                    .peer_certificates()
                    .and_then(|c| c.first());
                let Some(principal) = cert.and_then(principal) else {
                    log.refused(
                        "TLS client refused",
                        &peer,
                        "its certificate names no principal (a URI or DNS subject alternative name of at most 256 bytes)",
                        cert,
                    );
                    return;
                };
                tracing::debug!(peer, principal, "TLS client accepted");
                let info = PeerInfo {
                    remote,
                    principal: principal.into(),
                };
                let _ = tx.send(Ok(TlsConn { stream, info })).await;
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// The host part of an `https://HOST:PORT` URL as a TLS server name (a DNS
/// name or an IP address, which the allocator's certificate must name).
pub fn server_name(url: &str) -> Result<ServerName<'static>, String> {
    let rest = url
        .strip_prefix("https://")
        .ok_or_else(|| format!("{url:?}: TLS needs an https:// URL"))?;
    let authority = rest.split('/').next().unwrap_or("");
    let host = if let Some(v6) = authority.strip_prefix('[') {
        v6.split(']').next().unwrap_or("")
    } else {
        authority.rsplit_once(':').map_or(authority, |(h, _)| h)
    };
    ServerName::try_from(host.to_owned())
        .map_err(|e| format!("{url:?}: {host:?} is not a valid server name: {e}"))
}

/// A connector for tonic's `Endpoint::connect_with_connector_lazy` that
/// dials the endpoint's address over TCP and runs the TLS handshake with
/// the client's current config, verifying the allocator's certificate
/// against the server name (see [`server_name`]). A failed handshake is
/// logged (once per reason every ten seconds) and fails the connect.
#[derive(Clone)]
pub struct Connector {
    tls: Arc<ClientTls>,
    name: ServerName<'static>,
    log: Arc<RefusalLog>,
}

impl std::fmt::Debug for Connector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connector")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// What [`Connector`] connects: a TLS stream over TCP, for hyper.
pub type ClientIo = hyper_util::rt::TokioIo<tokio_rustls::client::TlsStream<TcpStream>>;

/// [`Connector`] for the allocator named `name` with `tls`.
pub fn connector(tls: Arc<ClientTls>, name: ServerName<'static>) -> Connector {
    Connector {
        tls,
        name,
        log: Arc::default(),
    }
}

impl tower::Service<tonic::transport::Uri> for Connector {
    type Response = ClientIo;
    type Error = std::io::Error;
    type Future =
        Pin<Box<dyn std::future::Future<Output = std::io::Result<ClientIo>> + Send + 'static>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: tonic::transport::Uri) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            let host = uri.host().unwrap_or("").trim_matches(['[', ']']).to_owned();
            let port = uri.port_u16().unwrap_or(443);
            let tcp = TcpStream::connect((host.as_str(), port)).await?;
            let _ = tcp.set_nodelay(true);
            let connector = tokio_rustls::TlsConnector::from(this.tls.current());
            match connector.connect(this.name.clone(), tcp).await {
                Ok(s) => Ok(hyper_util::rt::TokioIo::new(s)),
                Err(e) => {
                    this.log.refused(
                        "TLS handshake with the allocator failed",
                        &uri.to_string(),
                        &e.to_string(),
                        None,
                    );
                    Err(e)
                }
            }
        })
    }
}

/// A lazily connecting channel to the allocator at `url` over `endpoint`
/// (built from the same URL): plain TCP for `http://`, mTLS with `tls` for
/// `https://`. A URL whose scheme does not match whether TLS is configured
/// is an error naming `flag`.
pub fn channel(
    endpoint: tonic::transport::Endpoint,
    url: &str,
    tls: Option<&Arc<ClientTls>>,
    flag: &str,
) -> Result<tonic::transport::Channel, String> {
    match (url.starts_with("https://"), tls) {
        (false, None) => Ok(endpoint.connect_lazy()),
        (true, Some(tls)) => {
            let name = server_name(url).map_err(|e| format!("{flag}: {e}"))?;
            Ok(endpoint.connect_with_connector_lazy(connector(tls.clone(), name)))
        }
        (true, None) => Err(format!(
            "{flag}: {url:?} is https:// but no client certificate is configured (--tls-cert, --tls-key, --tls-ca)"
        )),
        (false, Some(_)) => Err(format!(
            "{flag}: {url:?}: with TLS configured the URL must be https://"
        )),
    }
}

/// The files of one side from three optional flags: all three or none.
/// `Ok(None)` without TLS; an error names the missing flags.
pub fn files_from_flags(
    cert: (Option<&Path>, &'static str),
    key: (Option<&Path>, &'static str),
    ca: (Option<&Path>, &'static str),
) -> Result<Option<TlsFiles>, String> {
    match (cert.0, key.0, ca.0) {
        (None, None, None) => Ok(None),
        (Some(c), Some(k), Some(a)) => Ok(Some(TlsFiles {
            cert: (c.to_owned(), cert.1),
            key: (k.to_owned(), key.1),
            ca: (a.to_owned(), ca.1),
        })),
        _ => {
            let missing: Vec<&str> = [cert, key, ca]
                .iter()
                .filter(|(p, _)| p.is_none())
                .map(|(_, f)| *f)
                .collect();
            Err(format!(
                "{}: TLS needs {}, {} and {} together",
                missing.join(", "),
                cert.1,
                key.1,
                ca.1
            ))
        }
    }
}

#[cfg(test)]
mod tests;

#[cfg(any(test, feature = "test-certs"))]
pub mod test_certs;

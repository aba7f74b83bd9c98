//! Real handshakes over loopback sockets with certificates made here.

use std::net::{IpAddr, Ipv4Addr};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_stream::StreamExt;
use tower::Service;

use super::test_certs::{San, TestCa};
use super::*;

const LOCAL: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

fn tempdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "quotalease-tls-{name}-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn files(cert: PathBuf, key: PathBuf, ca: PathBuf) -> TlsFiles {
    TlsFiles {
        cert: (cert, "--tls-cert"),
        key: (key, "--tls-key"),
        ca: (ca, "--tls-ca"),
    }
}

/// A TLS server on loopback: each accepted connection is sent its
/// principal, then echoed. Returns the address and the principals accepted.
async fn serve(
    tls: Arc<ServerTls>,
) -> (SocketAddr, tokio::sync::mpsc::UnboundedReceiver<Arc<str>>) {
    let listener = TcpListener::bind((LOCAL, 0)).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let mut conns = incoming(listener, tls);
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(conn) = conns.next().await {
            let mut conn = conn.unwrap();
            let info = tonic::transport::server::Connected::connect_info(&conn);
            tx.send(info.principal.clone()).unwrap();
            tokio::spawn(async move {
                let p = info.principal.as_bytes();
                conn.write_all(&[p.len() as u8]).await.unwrap();
                conn.write_all(p).await.unwrap();
                let mut buf = [0u8; 64];
                while let Ok(n) = conn.read(&mut buf).await {
                    if n == 0 || conn.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (addr, rx)
}

type Stream = tokio_rustls::client::TlsStream<TcpStream>;

async fn connect(tls: &Arc<ClientTls>, name: &str, addr: SocketAddr) -> std::io::Result<Stream> {
    let name = ServerName::try_from(name.to_owned()).unwrap();
    let uri: tonic::transport::Uri = format!("https://{addr}").parse().unwrap();
    Ok(connector(tls.clone(), name).call(uri).await?.into_inner())
}

/// What the server says first: the principal it saw.
async fn greeting(s: &mut Stream) -> std::io::Result<String> {
    let mut len = [0u8; 1];
    s.read_exact(&mut len).await?;
    let mut p = vec![0u8; len[0] as usize];
    s.read_exact(&mut p).await?;
    Ok(String::from_utf8(p).unwrap())
}

struct Pki {
    dir: PathBuf,
    ca: TestCa,
    ca_path: PathBuf,
    server: Arc<ServerTls>,
}

fn pki(name: &str) -> Pki {
    let dir = tempdir(name);
    let ca = TestCa::new("quotalease test CA");
    let ca_path = ca.write(&dir, "ca");
    let (c, k) = ca
        .leaf(&[San::Ip(LOCAL), San::Dns("allocator.test")], false)
        .write(&dir, "server");
    let server = ServerTls::server(files(c, k, ca_path.clone())).unwrap();
    Pki {
        dir,
        ca,
        ca_path,
        server,
    }
}

impl Pki {
    fn client(&self, name: &str, sans: &[San<'_>], expired: bool) -> Arc<ClientTls> {
        let (c, k) = self.ca.leaf(sans, expired).write(&self.dir, name);
        ClientTls::client(files(c, k, self.ca_path.clone())).unwrap()
    }
}

#[test]
fn the_principal_is_the_first_uri_else_the_first_dns_name() {
    let ca = TestCa::new("ca");
    let der = |sans: &[San<'_>]| {
        let pem = ca.leaf(sans, false).cert_pem;
        CertificateDer::from_pem_slice(pem.as_bytes()).unwrap()
    };
    assert_eq!(
        principal(&der(&[San::Dns("a.test"), San::Uri("spiffe://q/agent")])).as_deref(),
        Some("spiffe://q/agent")
    );
    assert_eq!(
        principal(&der(&[
            San::Ip(LOCAL),
            San::Dns("a.test"),
            San::Dns("b.test")
        ]))
        .as_deref(),
        Some("a.test")
    );
    assert_eq!(principal(&der(&[San::Ip(LOCAL)])), None);
    let long = format!("{}.test", "a".repeat(60)).repeat(5);
    assert!(long.len() > MAX_PRINCIPAL_BYTES);
    assert_eq!(principal(&der(&[San::Dns(&long)])), None);
}

#[tokio::test]
async fn a_client_with_a_valid_certificate_is_accepted_under_its_principal() {
    let pki = pki("valid");
    let (addr, mut seen) = serve(pki.server.clone()).await;
    let client = pki.client("agent", &[San::Uri("spiffe://q/agent-a")], false);
    let mut s = connect(&client, "127.0.0.1", addr).await.unwrap();
    assert_eq!(greeting(&mut s).await.unwrap(), "spiffe://q/agent-a");
    assert_eq!(&*seen.recv().await.unwrap(), "spiffe://q/agent-a");
    // By DNS name too.
    let mut s = connect(&client, "allocator.test", addr).await.unwrap();
    assert_eq!(greeting(&mut s).await.unwrap(), "spiffe://q/agent-a");
}

/// The connection is refused: the client's handshake or first read fails,
/// and the server hands no connection to the service.
async fn assert_refused(
    r: std::io::Result<Stream>,
    seen: &mut tokio::sync::mpsc::UnboundedReceiver<Arc<str>>,
) {
    if let Ok(mut s) = r {
        // TLS 1.3: the server judges the client's certificate after the
        // client's handshake is done; its alert arrives on the first read.
        assert!(greeting(&mut s).await.is_err(), "the server must not talk");
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        seen.try_recv().is_err(),
        "no connection reached the service"
    );
}

#[tokio::test]
async fn clients_without_a_valid_certificate_are_refused() {
    let pki = pki("refused");
    let (addr, mut seen) = serve(pki.server.clone()).await;

    // No certificate at all.
    let mut roots = RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(pki.ca.pem().as_bytes()).unwrap())
        .unwrap();
    let mut bare = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    bare.alpn_protocols = vec![b"h2".to_vec()];
    let tcp = TcpStream::connect(addr).await.unwrap();
    let r = tokio_rustls::TlsConnector::from(Arc::new(bare))
        .connect(ServerName::from(LOCAL), tcp)
        .await;
    assert_refused(r, &mut seen).await;

    // Signed by another CA.
    let other = TestCa::new("another CA");
    let (c, k) = other
        .leaf(&[San::Dns("agent.test")], false)
        .write(&pki.dir, "other");
    let wrong_ca = ClientTls::client(files(c, k, pki.ca_path.clone())).unwrap();
    assert_refused(connect(&wrong_ca, "127.0.0.1", addr).await, &mut seen).await;

    // Expired.
    let expired = pki.client("expired", &[San::Dns("agent.test")], true);
    assert_refused(connect(&expired, "127.0.0.1", addr).await, &mut seen).await;

    // Valid, but naming no principal (an IP address only).
    let nameless = pki.client("nameless", &[San::Ip(LOCAL)], false);
    assert_refused(connect(&nameless, "127.0.0.1", addr).await, &mut seen).await;

    // And a good one still gets in.
    let good = pki.client("good", &[San::Dns("agent.test")], false);
    let mut s = connect(&good, "127.0.0.1", addr).await.unwrap();
    assert_eq!(greeting(&mut s).await.unwrap(), "agent.test");
}

#[tokio::test]
async fn a_server_not_named_by_its_certificate_is_refused_by_the_client() {
    let pki = pki("wrong-name");
    let (addr, mut seen) = serve(pki.server.clone()).await;
    let client = pki.client("agent", &[San::Dns("agent.test")], false);
    let err = connect(&client, "elsewhere.test", addr).await.unwrap_err();
    assert!(
        err.to_string()
            .contains("not valid for name \"elsewhere.test\""),
        "{err}"
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(seen.try_recv().is_err());
}

#[tokio::test]
async fn rotation_new_connections_use_the_new_certificate_while_old_ones_finish() {
    let pki = pki("rotate");
    let (addr, mut seen) = serve(pki.server.clone()).await;
    let client = pki.client("agent", &[San::Dns("agent.test")], false);
    let mut old = connect(&client, "127.0.0.1", addr).await.unwrap();
    assert_eq!(greeting(&mut old).await.unwrap(), "agent.test");
    let first = old.get_ref().1.peer_certificates().unwrap()[0].clone();
    assert_eq!(pki.server.reload(), Ok(false), "nothing changed yet");

    // A new server certificate from the same CA, written in place.
    let (c, k) = pki
        .ca
        .leaf(&[San::Ip(LOCAL)], false)
        .write(&pki.dir, "server");
    let _ = (c, k);
    assert_eq!(pki.server.reload(), Ok(true));

    let mut new = connect(&client, "127.0.0.1", addr).await.unwrap();
    assert_eq!(greeting(&mut new).await.unwrap(), "agent.test");
    let second = new.get_ref().1.peer_certificates().unwrap()[0].clone();
    assert_ne!(first, second, "the new connection sees the new certificate");

    // The old connection still works.
    old.write_all(b"ping").await.unwrap();
    let mut buf = [0u8; 4];
    old.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"ping");
    assert_eq!(seen.recv().await.as_deref(), Some("agent.test"));

    // A broken file is refused; the last good certificate keeps serving.
    std::fs::write(pki.dir.join("server.key"), "not a key").unwrap();
    let err = pki.server.reload().unwrap_err();
    assert!(
        err.contains("--tls-key") && err.contains("server.key"),
        "{err}"
    );
    let mut again = connect(&client, "127.0.0.1", addr).await.unwrap();
    assert_eq!(greeting(&mut again).await.unwrap(), "agent.test");
    assert_eq!(again.get_ref().1.peer_certificates().unwrap()[0], second);
}

#[test]
fn bad_files_and_flags_name_what_is_wrong() {
    let dir = tempdir("bad");
    let ca = TestCa::new("ca");
    let ca_path = ca.write(&dir, "ca");
    let (c, k) = ca.leaf(&[San::Dns("a.test")], false).write(&dir, "a");
    let missing = dir.join("missing.pem");
    let err = ServerTls::server(files(missing.clone(), k.clone(), ca_path.clone())).unwrap_err();
    assert!(
        err.starts_with("--tls-cert") && err.contains("missing.pem"),
        "{err}"
    );
    let err = ServerTls::server(files(c.clone(), k.clone(), k.clone())).unwrap_err();
    assert!(err.starts_with("--tls-ca"), "{err}");
    let err = ServerTls::server(files(c.clone(), c.clone(), ca_path.clone())).unwrap_err();
    assert!(err.starts_with("--tls-key"), "{err}");

    let err = files_from_flags(
        (Some(&c), "--tls-cert"),
        (None, "--tls-key"),
        (None, "--tls-client-ca"),
    )
    .unwrap_err();
    assert!(err.starts_with("--tls-key, --tls-client-ca:"), "{err}");
    assert!(files_from_flags((None, "a"), (None, "b"), (None, "c"))
        .unwrap()
        .is_none());

    assert!(server_name("http://127.0.0.1:1").is_err());
    assert_eq!(
        server_name("https://127.0.0.1:7070").unwrap(),
        ServerName::from(LOCAL)
    );
    assert_eq!(
        server_name("https://[::1]:7070").unwrap(),
        ServerName::from(IpAddr::from(std::net::Ipv6Addr::LOCALHOST))
    );
    assert_eq!(
        server_name("https://alloc.example:7070/").unwrap(),
        ServerName::try_from("alloc.example").unwrap()
    );
}

// --- the refusal log's de-duplication (sans-IO: time is an argument)

fn cert_of(leaf: &test_certs::Leaf) -> CertificateDer<'static> {
    CertificateDer::from_pem_slice(leaf.cert_pem.as_bytes()).unwrap()
}

#[test]
fn repeated_refusals_of_one_kind_warn_once_per_window_with_a_count() {
    let mut d = RefusalDedup::default();
    let t0 = Instant::now();
    let s = Duration::from_secs;
    let wrong_ca = RefusalKind::new("invalid peer certificate: UnknownIssuer", None);
    // ~20 a second from one client (a new peer address each time: not part
    // of the kind): one warning, the rest at debug.
    assert_eq!(d.admit(&wrong_ca, t0), Some(0));
    let mut debug = 0;
    for i in 1..200u64 {
        let now = t0 + Duration::from_millis(50 * i); // up to 9.95 s
        assert_eq!(d.admit(&wrong_ca, now), None, "refusal {i}");
        debug += 1;
    }
    // Another kind in between has its own window and does not reopen the
    // first one's.
    let timeout = RefusalKind::new("handshake timed out", None);
    assert_eq!(d.admit(&timeout, t0 + s(5)), Some(0));
    assert_eq!(d.admit(&wrong_ca, t0 + s(6)), None);
    debug += 1;
    assert_eq!(d.admit(&timeout, t0 + s(6)), None);
    // Ten seconds after its warning: the next one warns with the count.
    assert_eq!(d.admit(&wrong_ca, t0 + s(10)), Some(debug));
    assert_eq!(d.admit(&wrong_ca, t0 + s(11)), None);
    assert_eq!(d.admit(&wrong_ca, t0 + s(25)), Some(1));
    assert_eq!(d.admit(&timeout, t0 + s(25)), Some(1));
}

#[test]
fn refusal_kinds_tell_certificates_apart_by_issuer_and_subject() {
    let (a, b) = (TestCa::new("a"), TestCa::new("b"));
    let nameless = "its certificate names no principal";
    let t0 = Instant::now();
    let mut d = RefusalDedup::default();
    let from_a = RefusalKind::new(nameless, Some(&cert_of(&a.leaf(&[], false))));
    // Another certificate with the same issuer and subject: the same kind.
    let again_a = RefusalKind::new(nameless, Some(&cert_of(&a.leaf(&[], false))));
    assert_eq!(from_a, again_a);
    // The same subject from another CA, or no certificate: other kinds.
    let from_b = RefusalKind::new(nameless, Some(&cert_of(&b.leaf(&[], false))));
    assert_ne!(from_a, from_b);
    assert_ne!(from_a, RefusalKind::new(nameless, None));
    // Bytes that are no certificate count as none.
    let junk = CertificateDer::from(vec![1u8, 2, 3]);
    assert_eq!(
        RefusalKind::new(nameless, Some(&junk)),
        RefusalKind::new(nameless, None)
    );
    assert_eq!(d.admit(&from_a, t0), Some(0));
    assert_eq!(d.admit(&again_a, t0), None);
    assert_eq!(d.admit(&from_b, t0), Some(0));
}

#[test]
fn refusal_kinds_beyond_the_cap_share_one_window() {
    let mut d = RefusalDedup::default();
    let t0 = Instant::now();
    let kind = |i: usize| RefusalKind::new(&format!("reason {i}"), None);
    for i in 0..MAX_REFUSAL_KINDS {
        assert_eq!(d.admit(&kind(i), t0), Some(0));
    }
    // Every slot is live: new kinds share the overflow window.
    assert_eq!(d.admit(&kind(1000), t0), Some(0));
    assert_eq!(d.admit(&kind(1001), t0), None);
    assert_eq!(d.admit(&kind(1002), t0), None);
    assert_eq!(d.kinds.len(), MAX_REFUSAL_KINDS);
    // Once their windows have passed the old kinds make room.
    let later = t0 + REFUSAL_WINDOW;
    assert_eq!(d.admit(&kind(2000), later), Some(0));
    assert_eq!(d.kinds.len(), 1);
    assert_eq!(d.admit(&kind(2000), later), None);
}

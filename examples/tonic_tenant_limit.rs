//! A tonic (gRPC) service limited per tenant by one global limit: the
//! client crate's tower layer in gRPC mode in front of every method. The
//! standard gRPC health service stands in for your own (it needs no code
//! generation here); the key is the tenant from the `x-tenant` metadata
//! and the method's path (`/grpc.health.v1.Health/Check`) as the route.
//! A refused call ends with `RESOURCE_EXHAUSTED`, a message naming the
//! rule and `retry-after` metadata. Run two of these against one
//! allocator and they share the limit (`tests/e2e_tonic_example.rs`
//! checks `B + R*T` over every window from both).
//!
//! ```text
//! quotalease allocator --listen 127.0.0.1:7070 --rules examples/rules.yaml &
//! cargo run --example tonic_tenant_limit -- --allocator http://127.0.0.1:7070 --id health-1
//! grpcurl -plaintext -H 'x-tenant: acme' ADDR grpc.health.v1.Health/Check
//! ```
//!
//! Flags: `--allocator URL` (required), `--id ID` (this instance's holder
//! id), `--listen ADDR` (default `127.0.0.1:0`). It prints
//! `listening=ADDR` once serving, and on SIGTERM or Ctrl-C stops taking
//! calls and gives its leases back. `QUOTALEASE_ADMISSION_LOG=FILE`
//! (tests only) logs every admission.

use quotalease_client::middleware::{HeaderKey, RateLimitLayer};
use quotalease_client::Client;

fn flag(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let allocator = flag(&args, "--allocator").ok_or("--allocator URL is required")?;
    let id = flag(&args, "--id").unwrap_or_else(|| format!("tonic-{}", std::process::id()));
    let listen = flag(&args, "--listen").unwrap_or_else(|| "127.0.0.1:0".into());

    let mut builder = Client::builder().allocator(allocator).agent_id(id);
    if let Ok(path) = std::env::var("QUOTALEASE_ADMISSION_LOG") {
        builder = builder.admission_log(path);
    }
    let client = builder.build()?;

    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_serving::<tonic_health::pb::health_server::HealthServer<
            tonic_health::server::HealthService,
        >>()
        .await;

    let listener = tokio::net::TcpListener::bind(&listen).await?;
    println!("listening={}", listener.local_addr()?);
    tonic::transport::Server::builder()
        // gRPC metadata are HTTP/2 headers: the layer reads `x-tenant`,
        // and answers refusals as gRPC statuses.
        .layer(RateLimitLayer::new(client.clone(), HeaderKey::new("x-tenant")).grpc())
        .add_service(health)
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            async {
                let mut term =
                    tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                        .expect("SIGTERM handler");
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            },
        )
        .await?;
    client.shutdown().await;
    Ok(())
}

//! An axum service limited per tenant by one global limit: the client
//! crate's tower layer (`quotalease-client`, feature `tower`) in front of
//! a route. Run two of these against one allocator and they share the
//! limit: tokens admitted over any interval `T` by both together never
//! exceed `B + R*T` (`tests/e2e_axum_example.rs` checks it over every
//! window).
//!
//! ```text
//! quotalease allocator --listen 127.0.0.1:7070 --rules examples/rules.yaml &
//! cargo run --example axum_tenant_limit -- --allocator http://127.0.0.1:7070 --id orders-1
//! curl -H 'x-tenant: acme' http://ADDR/v1/orders      # ADDR: the line it prints
//! ```
//!
//! Flags: `--allocator URL` (required), `--id ID` (this instance's holder
//! id), `--listen ADDR` (default `127.0.0.1:0`). It prints
//! `listening=ADDR` once serving, and on SIGTERM or Ctrl-C stops taking
//! requests and gives its leases back. `QUOTALEASE_ADMISSION_LOG=FILE`
//! (tests only) logs every admission.

use axum::routing::get;
use axum::Router;
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
    let id = flag(&args, "--id").unwrap_or_else(|| format!("axum-{}", std::process::id()));
    let listen = flag(&args, "--listen").unwrap_or_else(|| "127.0.0.1:0".into());

    let mut builder = Client::builder().allocator(allocator).agent_id(id);
    if let Ok(path) = std::env::var("QUOTALEASE_ADMISSION_LOG") {
        builder = builder.admission_log(path);
    }
    let client = builder.build()?;

    // The tenant from `x-tenant`, the route from the path: the rule
    // matching (tenant, /v1/orders) limits it.
    let app = Router::new()
        .route("/v1/orders", get(|| async { "order placed\n" }))
        .layer(RateLimitLayer::new(
            client.clone(),
            HeaderKey::new("x-tenant"),
        ));

    let listener = tokio::net::TcpListener::bind(&listen).await?;
    println!("listening={}", listener.local_addr()?);
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                    .expect("SIGTERM handler");
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        })
        .await?;
    client.shutdown().await;
    Ok(())
}

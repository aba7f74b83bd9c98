//! The agent's network faces: gRPC `quotalease.v1.RateLimiter/Check` and a
//! small HTTP server with `/metrics`, `/healthz` and `/readyz`.

use std::net::SocketAddr;

use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use quotalease_proto::v1::rate_limiter_server::{RateLimiter, RateLimiterServer};
use quotalease_proto::v1::{CheckRequest, CheckResponse, Reason};
use quotalease_proto::MAX_MESSAGE_BYTES;
use tonic::{Request, Response, Status};

use quotalease_agent::agent::{Agent, CheckError, CheckInput};
use quotalease_model::exposition;

/// The gRPC service.
#[derive(Clone, Debug)]
pub struct CheckService {
    agent: Agent,
}

impl CheckService {
    /// Wrap an agent.
    pub fn new(agent: Agent) -> Self {
        Self { agent }
    }

    /// As a tonic server with message size limits.
    pub fn into_server(self) -> RateLimiterServer<Self> {
        RateLimiterServer::new(self)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES)
    }
}

#[tonic::async_trait]
impl RateLimiter for CheckService {
    async fn check(
        &self,
        request: Request<CheckRequest>,
    ) -> Result<Response<CheckResponse>, Status> {
        let deadline = crate::grpc_deadline(request.metadata());
        let req = request.into_inner();
        let input = CheckInput {
            tenant: &req.tenant_id,
            route: &req.route_id,
            cost: req.cost,
            request_id: &req.request_id,
            domain: None,
        };
        match self.agent.check_by(input, deadline).await {
            Ok(resp) => Ok(Response::new(resp)),
            Err(CheckError::Invalid { field, reason }) => {
                tracing::debug!(field, %reason, "invalid check");
                Ok(Response::new(CheckResponse {
                    allowed: false,
                    reason: Reason::Invalid as i32,
                    rule_id: String::new(),
                    applied_rule_version: self.agent.rules().map(|r| r.version).unwrap_or(0),
                    ..CheckResponse::default()
                }))
            }
            Err(CheckError::Unavailable(why)) => Err(Status::unavailable(why)),
        }
    }
}

async fn metrics(State(agent): State<Agent>) -> impl IntoResponse {
    let version = agent.rules().map(|r| r.version).unwrap_or(0);
    let body = agent
        .metrics()
        .render(agent.key_count(), version, agent.is_ready());
    ([(CONTENT_TYPE, exposition::CONTENT_TYPE)], body)
}

async fn readyz(State(agent): State<Agent>) -> (StatusCode, &'static str) {
    if agent.is_ready() {
        (StatusCode::OK, "ready\n")
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: allocator not reached or no rules\n",
        )
    }
}

/// The HTTP router of the agent's admin face.
pub fn admin_router(agent: Agent) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(agent.clone())
        .merge(crate::http_api::router(agent.clone()))
        .merge(crate::permits::router(agent))
}

/// Serve the admin router on `addr` until `shutdown` resolves.
pub async fn serve_admin(
    agent: Agent,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    // Small request/response exchanges: never wait for Nagle.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, admin_router(agent))
        .with_graceful_shutdown(shutdown)
        .await
}

/// Bind helper with a clear error naming the flag.
pub async fn bind(flag: &str, addr: SocketAddr) -> Result<tokio::net::TcpListener, String> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("{flag} {addr}: cannot listen: {e}"))
}

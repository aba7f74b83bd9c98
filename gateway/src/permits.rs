//! The agent's permit faces (SPEC §5 "Permits", docs/permits.md): gRPC
//! `quotalease.v1.Permits` (`Acquire`, `Renew`, `Release`) and HTTP `POST
//! /v1/permits`, `PUT /v1/permits/{id}`, `DELETE /v1/permits/{id}`. Both
//! translate to [`Agent::acquire`] and the agent's renew and release by
//! permit id, through one set of conversions here.
//!
//! Expiries are durations from the answer (`expires_in_ms`), never clock
//! readings. Not on Envoy RLS: its `hits_addend` is unsigned and nothing
//! calls back when a request ends, so a permit taken through it could
//! never be given back.

use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{post, put};
use axum::{Json, Router};
use quotalease_agent::agent::{AcquireInput, Acquired, Agent};
use quotalease_agent::permit_driver::{PermitError, PermitStatus as Status};
use quotalease_proto::v1::permits_server::{Permits, PermitsServer};
use quotalease_proto::v1::{
    AcquireOutcome, AcquireRequest, AcquireResponse, Permit, PermitStatus, ReleaseRequest,
    ReleaseResponse, RenewRequest, RenewResponse,
};
use quotalease_proto::MAX_MESSAGE_BYTES;
use serde_json::{json, Value};

/// The longest an acquire may wait (a larger `wait_ms` is an error).
pub const MAX_WAIT_MS: u64 = 600_000;

/// The gRPC service.
#[derive(Clone, Debug)]
pub struct PermitService {
    agent: Agent,
}

impl PermitService {
    /// Wrap an agent.
    pub fn new(agent: Agent) -> Self {
        Self { agent }
    }

    /// As a tonic server with message size limits.
    pub fn into_server(self) -> PermitsServer<Self> {
        PermitsServer::new(self)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES)
    }
}

/// An acquire, answered: the one conversion both faces use.
async fn acquire(
    agent: &Agent,
    req: &AcquireRequest,
    deadline: Option<tokio::time::Instant>,
) -> AcquireResponse {
    let invalid = |detail: String| AcquireResponse {
        outcome: AcquireOutcome::InvalidRequest as i32,
        detail,
        ..AcquireResponse::default()
    };
    if req.wait_ms > MAX_WAIT_MS {
        return invalid(format!(
            "wait_ms: at most {MAX_WAIT_MS}, got {}",
            req.wait_ms
        ));
    }
    for (field, v) in [("tenant_id", &req.tenant_id), ("route_id", &req.route_id)] {
        if v.len() > quotalease_model::protocol::MAX_ID_BYTES {
            return invalid(format!(
                "{field}: {} bytes, at most {}",
                v.len(),
                quotalease_model::protocol::MAX_ID_BYTES
            ));
        }
    }
    let mut wait = match req.wait_ms {
        0 => agent.default_permit_wait(),
        ms => Duration::from_millis(ms),
    };
    if let Some(d) = deadline {
        wait = wait.min(d.saturating_duration_since(tokio::time::Instant::now()));
    }
    let input = AcquireInput {
        tenant: &req.tenant_id,
        route: &req.route_id,
        domain: None,
        slots: req.slots,
        wait,
        request_id: &req.request_id,
    };
    match agent.acquire(input).await {
        Ok(got) => AcquireResponse {
            outcome: AcquireOutcome::Acquired as i32,
            permits: permits_of(agent, &got),
            ..AcquireResponse::default()
        },
        Err(e @ PermitError::Timeout { retry_after_ms }) => AcquireResponse {
            outcome: AcquireOutcome::Timeout as i32,
            detail: e.to_string(),
            retry_after_ms,
            ..AcquireResponse::default()
        },
        Err(PermitError::RateLimited {
            rule_id,
            retry_after_ms,
        }) => AcquireResponse {
            outcome: AcquireOutcome::RateLimited as i32,
            rule_id,
            retry_after_ms,
            ..AcquireResponse::default()
        },
        Err(PermitError::NoRule) => AcquireResponse {
            outcome: AcquireOutcome::NoRule as i32,
            detail: PermitError::NoRule.to_string(),
            ..AcquireResponse::default()
        },
        Err(e @ PermitError::Invalid(_)) => invalid(e.to_string()),
        Err(PermitError::Unavailable(why)) => AcquireResponse {
            outcome: AcquireOutcome::Unavailable as i32,
            detail: why,
            ..AcquireResponse::default()
        },
        Err(e @ PermitError::QueueFull(_)) => AcquireResponse {
            outcome: AcquireOutcome::QueueFull as i32,
            detail: e.to_string(),
            retry_after_ms: 1_000,
            ..AcquireResponse::default()
        },
        Err(e) => AcquireResponse {
            // Stopping, or the rate side cannot decide: not a limit.
            outcome: AcquireOutcome::Timeout as i32,
            detail: e.to_string(),
            ..AcquireResponse::default()
        },
    }
}

fn permits_of(agent: &Agent, got: &Acquired) -> Vec<Permit> {
    let now = agent.now();
    got.permits
        .iter()
        .map(|h| Permit {
            permit_id: agent.permit_id(h),
            rule_id: h.key.rule().to_string(),
            slots: h.permit.slots,
            expires_in_ms: h.permit.expiry_ns.saturating_sub(now) / 1_000_000,
            fencing_token: h.permit.fence,
            failure_mode: h.failure_mode,
        })
        .collect()
}

/// A renew or release's status and the remaining time of a held permit.
fn status_of(agent: &Agent, s: Status) -> (PermitStatus, u64) {
    match s {
        Status::Held(expiry) => (
            PermitStatus::Held,
            expiry.saturating_sub(agent.now()) / 1_000_000,
        ),
        Status::Expired => (PermitStatus::Expired, 0),
        Status::NotHere => (PermitStatus::NotHere, 0),
        Status::Forwarded => (PermitStatus::Forwarded, 0),
    }
}

#[tonic::async_trait]
impl Permits for PermitService {
    async fn acquire(
        &self,
        request: tonic::Request<AcquireRequest>,
    ) -> Result<tonic::Response<AcquireResponse>, tonic::Status> {
        let deadline = crate::grpc_deadline(request.metadata());
        let req = request.into_inner();
        Ok(tonic::Response::new(
            acquire(&self.agent, &req, deadline).await,
        ))
    }

    async fn renew(
        &self,
        request: tonic::Request<RenewRequest>,
    ) -> Result<tonic::Response<RenewResponse>, tonic::Status> {
        let id = request.into_inner().permit_id;
        let s = self
            .agent
            .renew_permit_id(&id)
            .map_err(|why| tonic::Status::invalid_argument(format!("permit_id: {why}")))?;
        let (status, expires_in_ms) = status_of(&self.agent, s);
        Ok(tonic::Response::new(RenewResponse {
            status: status as i32,
            expires_in_ms,
        }))
    }

    async fn release(
        &self,
        request: tonic::Request<ReleaseRequest>,
    ) -> Result<tonic::Response<ReleaseResponse>, tonic::Status> {
        let id = request.into_inner().permit_id;
        let s = self
            .agent
            .release_permit_id(&id)
            .await
            .map_err(|why| tonic::Status::invalid_argument(format!("permit_id: {why}")))?
            .map_err(|why| tonic::Status::unavailable(why.to_string()))?;
        let released = matches!(s, Status::Held(_));
        let status = match s {
            // Released now: it is no longer held.
            Status::Held(_) | Status::Expired => PermitStatus::Expired,
            Status::NotHere => PermitStatus::NotHere,
            Status::Forwarded => PermitStatus::Forwarded,
        };
        Ok(tonic::Response::new(ReleaseResponse {
            released,
            status: status as i32,
        }))
    }
}

// ---------------------------------------------------------------------------
// HTTP

/// The permit routes, to be merged into the agent's HTTP server.
pub fn router(agent: Agent) -> Router {
    Router::new()
        .route("/v1/permits", post(http_acquire))
        .route("/v1/permits/{id}", put(http_renew).delete(http_release))
        .layer(axum::extract::DefaultBodyLimit::max(
            crate::http_api::MAX_BODY_BYTES,
        ))
        .with_state(agent)
}

fn error(status: StatusCode, field: &str, reason: &str) -> Response {
    (
        status,
        Json(json!({ "error": { "field": field, "reason": reason } })),
    )
        .into_response()
}

/// `POST /v1/permits` with `{"tenant_id", "route_id", "slots", "wait_ms",
/// "request_id"}`.
async fn http_acquire(State(agent): State<Agent>, body: Bytes) -> Response {
    let req = match parse_acquire(&body) {
        Ok(r) => r,
        Err((field, reason)) => return error(StatusCode::BAD_REQUEST, &field, &reason),
    };
    let resp = acquire(&agent, &req, None).await;
    let permits: Vec<Value> = resp
        .permits
        .iter()
        .map(|p| {
            json!({
                "permit_id": p.permit_id,
                "rule_id": p.rule_id,
                "slots": p.slots,
                "expires_in_ms": p.expires_in_ms,
                "fencing_token": p.fencing_token,
                "failure_mode": p.failure_mode,
            })
        })
        .collect();
    match AcquireOutcome::try_from(resp.outcome) {
        Ok(AcquireOutcome::Acquired) => {
            (StatusCode::OK, Json(json!({ "permits": permits }))).into_response()
        }
        Ok(AcquireOutcome::RateLimited) => too_many(
            json!({
                "error": "rate_limited",
                "rule_id": resp.rule_id,
                "retry_after_ms": resp.retry_after_ms,
            }),
            resp.retry_after_ms,
        ),
        // An acquire whose wait ran out says when to come back (SPEC §5);
        // stopping, or the rate side unable to decide, has no hint.
        Ok(AcquireOutcome::Timeout) if resp.retry_after_ms > 0 => too_many(
            json!({
                "error": "timeout",
                "reason": resp.detail,
                "retry_after_ms": resp.retry_after_ms,
            }),
            resp.retry_after_ms,
        ),
        Ok(AcquireOutcome::Timeout) => (
            StatusCode::TOO_MANY_REQUESTS,
            Json(json!({ "error": "timeout", "reason": resp.detail })),
        )
            .into_response(),
        Ok(AcquireOutcome::NoRule) => error(StatusCode::NOT_FOUND, "route_id", &resp.detail),
        Ok(AcquireOutcome::QueueFull) => too_many(
            json!({ "error": "queue_full", "reason": resp.detail }),
            resp.retry_after_ms,
        ),
        Ok(AcquireOutcome::Unavailable) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({ "error": "limiter_unavailable", "reason": resp.detail })),
        )
            .into_response(),
        _ => {
            let (field, reason) = resp
                .detail
                .split_once(": ")
                .unwrap_or(("body", &resp.detail));
            error(StatusCode::BAD_REQUEST, field, reason)
        }
    }
}

/// A `429` with `body` and a `Retry-After` of `retry_after_ms` in whole
/// seconds (rounded up, at least 1).
fn too_many(body: serde_json::Value, retry_after_ms: u64) -> Response {
    let mut r = (StatusCode::TOO_MANY_REQUESTS, Json(body)).into_response();
    let secs = retry_after_ms.div_ceil(1000).max(1);
    r.headers_mut()
        .insert("retry-after", secs.to_string().parse().expect("digits"));
    r
}

/// Reads an acquire body; errors name the field.
fn parse_acquire(body: &[u8]) -> Result<AcquireRequest, (String, String)> {
    let bad = |f: &str, r: String| (f.to_string(), r);
    let v: Value =
        serde_json::from_slice(body).map_err(|e| bad("body", format!("not valid JSON: {e}")))?;
    let Value::Object(map) = v else {
        return Err(bad(
            "body",
            "must be a JSON object with tenant_id, route_id, slots and wait_ms".into(),
        ));
    };
    if let Some(k) = map.keys().find(|k| {
        !matches!(
            k.as_str(),
            "tenant_id" | "route_id" | "slots" | "wait_ms" | "request_id"
        )
    }) {
        let shown: String = k.chars().take(64).collect();
        return Err(bad(
            &shown,
            "unknown field (expected tenant_id, route_id, slots, wait_ms, request_id)".into(),
        ));
    }
    let string = |f: &str| match map.get(f) {
        Some(Value::String(s)) => Ok(s.clone()),
        None => Err(bad(f, "missing".into())),
        Some(_) => Err(bad(f, "must be a string".into())),
    };
    let number = |f: &str| match map.get(f) {
        None | Some(Value::Null) => Ok(0),
        Some(Value::Number(n)) => n
            .as_u64()
            .ok_or_else(|| bad(f, format!("{n} is not a whole number >= 0"))),
        Some(_) => Err(bad(f, "must be a whole number".into())),
    };
    Ok(AcquireRequest {
        tenant_id: string("tenant_id")?,
        route_id: string("route_id")?,
        slots: number("slots")?,
        wait_ms: number("wait_ms")?,
        request_id: match map.get("request_id") {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(s)) => s.clone(),
            Some(_) => return Err(bad("request_id", "must be a string".into())),
        },
    })
}

/// `PUT /v1/permits/{id}`: renew.
async fn http_renew(State(agent): State<Agent>, Path(id): Path<String>) -> Response {
    match agent.renew_permit_id(&id) {
        Err(why) => error(StatusCode::BAD_REQUEST, "permit_id", &why),
        Ok(s) => match status_of(&agent, s) {
            (PermitStatus::Held, ms) => {
                (StatusCode::OK, Json(json!({ "expires_in_ms": ms }))).into_response()
            }
            (PermitStatus::Expired, _) => error(
                StatusCode::GONE,
                "permit_id",
                "expired or released: never revived",
            ),
            (PermitStatus::NotHere | PermitStatus::Forwarded, _) => error(
                StatusCode::MISDIRECTED_REQUEST,
                "permit_id",
                "held by another agent (or an earlier run of this one): renew it where it was acquired",
            ),
        },
    }
}

/// `DELETE /v1/permits/{id}`: release (idempotent).
async fn http_release(State(agent): State<Agent>, Path(id): Path<String>) -> Response {
    match agent.release_permit_id(&id).await {
        Err(why) => error(StatusCode::BAD_REQUEST, "permit_id", &why),
        Ok(Err(why)) => error(StatusCode::SERVICE_UNAVAILABLE, "permit_id", &why.to_string()),
        Ok(Ok(Status::NotHere)) => error(
            StatusCode::MISDIRECTED_REQUEST,
            "permit_id",
            "held by another agent that the allocator does not know for this agent's principal (it stopped, or the allocator restarted): the permit frees at its expiry",
        ),
        Ok(Ok(Status::Forwarded)) => (
            StatusCode::ACCEPTED,
            Json(json!({ "released": false, "forwarded": true })),
        )
            .into_response(),
        Ok(Ok(s)) => (
            StatusCode::OK,
            Json(json!({ "released": matches!(s, Status::Held(_)) })),
        )
            .into_response(),
    }
}

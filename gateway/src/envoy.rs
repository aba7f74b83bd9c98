//! Envoy's rate limit service API v3 on the agent's gRPC port:
//! `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`.
//!
//! Each descriptor is one check: its entries named by the tenant and route
//! keys (default `tenant`, `route`) select the bucket, the request's
//! `domain` selects the rule namespace, and the descriptor's `hits_addend`
//! (else the request's, else 1) is the cost. A descriptor without a tenant
//! entry, or that no rule matches, is `OK`. `overall_code` is `OVER_LIMIT`
//! if any descriptor is. Like Envoy's reference service, descriptors are
//! independent checks: each is atomic over the rules it matches, but a
//! descriptor admitted before another one is denied stays charged.
//! Fail-closed without a lease answers gRPC `UNAVAILABLE`.
//!
//! `response_headers_to_add` carries the rate-limit headers of one
//! descriptor's rule (the denied one with the longest retry time, else the
//! admitted one with the fewest tokens left) and, on `OVER_LIMIT`,
//! `retry-after` in whole seconds (rounded up, at least 1): Envoy puts them
//! on its 429, and on the upstream's answer when the request passes.

use quotalease_model::rules::RuleSet;
use quotalease_proto::envoy::config::core::v3::HeaderValue;
use quotalease_proto::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use quotalease_proto::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit,
};
use quotalease_proto::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use quotalease_proto::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use quotalease_proto::v1::{CheckResponse, Reason};
use quotalease_proto::MAX_MESSAGE_BYTES;
use tonic::{Request, Response, Status};

use crate::headers::{remaining_of, retry_after_secs, LimitInfo};
use quotalease_agent::agent::{Agent, CheckError, CheckInput};

/// Most descriptors in one request (SPEC §8).
pub const MAX_DESCRIPTORS: usize = 16;

/// The Envoy RLS service.
#[derive(Clone, Debug)]
pub struct EnvoyService {
    agent: Agent,
    tenant_key: String,
    route_key: String,
}

impl EnvoyService {
    /// Serve `agent`, reading tenant and route from these descriptor keys.
    pub fn new(agent: Agent, tenant_key: &str, route_key: &str) -> Self {
        Self {
            agent,
            tenant_key: tenant_key.to_string(),
            route_key: route_key.to_string(),
        }
    }

    /// As a tonic server with message size limits.
    pub fn into_server(self) -> RateLimitServiceServer<Self> {
        RateLimitServiceServer::new(self)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES)
    }
}

fn unit_of(period_s: u64) -> Unit {
    match period_s {
        1 => Unit::Second,
        60 => Unit::Minute,
        3600 => Unit::Hour,
        86_400 => Unit::Day,
        _ => Unit::Unknown,
    }
}

fn duration_ms(ms: u64) -> prost_types::Duration {
    prost_types::Duration {
        seconds: (ms / 1000) as i64,
        nanos: ((ms % 1000) * 1_000_000) as i32,
    }
}

/// One descriptor's status from a check answer.
fn status_of(resp: &CheckResponse, rules: Option<&RuleSet>) -> DescriptorStatus {
    let denied = !resp.allowed;
    let rule = rules.and_then(|r| r.get(&resp.rule_id));
    let current_limit = rule.map(|r| RateLimit {
        name: r.id.clone(),
        requests_per_unit: u32::try_from(r.rate.tokens).unwrap_or(u32::MAX),
        unit: unit_of(r.rate.period_s) as i32,
    });
    // Until reset: the retry time when denied; when admitted, the time one
    // token takes to come back.
    let until_ms = if denied {
        resp.retry_after_ms
    } else {
        rule.map(|r| (r.rate.period_s * 1000).div_ceil(r.rate.tokens))
            .unwrap_or(0)
    };
    DescriptorStatus {
        code: if denied { Code::OverLimit } else { Code::Ok } as i32,
        current_limit,
        limit_remaining: u32::try_from(remaining_of(resp)).unwrap_or(u32::MAX),
        duration_until_reset: Some(duration_ms(until_ms)),
        quota: None,
    }
}

#[tonic::async_trait]
impl RateLimitService for EnvoyService {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        // Answer within Envoy's `timeout`: a late answer is its 503.
        let deadline = crate::grpc_deadline(request.metadata());
        let req = request.into_inner();
        if req.descriptors.len() > MAX_DESCRIPTORS {
            return Err(Status::invalid_argument(format!(
                "descriptors: {} given, at most {MAX_DESCRIPTORS}",
                req.descriptors.len()
            )));
        }
        let domain = (!req.domain.is_empty()).then_some(req.domain.as_str());
        let rules = self.agent.rules();
        let mut statuses = Vec::with_capacity(req.descriptors.len());
        let mut overall = Code::Ok;
        // The descriptor whose rule headers go back to the client: the
        // denied one with the longest retry time (the request cannot pass
        // before it), else the admitted one with the fewest tokens left.
        let mut shown: Option<(bool, CheckResponse)> = None;
        // On OVER_LIMIT: the longest retry time of the denied descriptors.
        let mut retry_after_ms: Option<u64> = None;
        for (i, d) in req.descriptors.iter().enumerate() {
            let find = |k: &str| {
                d.entries
                    .iter()
                    .find(|e| e.key == k)
                    .map(|e| e.value.as_str())
            };
            let Some(tenant) = find(&self.tenant_key) else {
                statuses.push(DescriptorStatus {
                    code: Code::Ok as i32,
                    ..DescriptorStatus::default()
                });
                continue;
            };
            let route = find(&self.route_key).unwrap_or("");
            let hits = d.hits_addend.unwrap_or(u64::from(req.hits_addend)).max(1);
            let Ok(cost) = u32::try_from(hits) else {
                return Err(Status::invalid_argument(format!(
                    "descriptors[{i}].hits_addend: {hits} is too large"
                )));
            };
            let input = CheckInput {
                tenant,
                route,
                cost,
                request_id: "",
                domain,
            };
            // The one way into the agent (its first step is the fast path;
            // no allocation when that answers).
            let resp = match self.agent.check_by(input, deadline).await {
                Ok(r) => r,
                Err(CheckError::Invalid { field, reason }) => {
                    let field = match field {
                        "tenant_id" => format!("descriptors[{i}].{}", self.tenant_key),
                        "route_id" => format!("descriptors[{i}].{}", self.route_key),
                        "cost" => format!("descriptors[{i}].hits_addend"),
                        other => format!("descriptors[{i}].{other}"),
                    };
                    return Err(Status::invalid_argument(format!("{field}: {reason}")));
                }
                Err(CheckError::Unavailable(why)) => return Err(Status::unavailable(why)),
            };
            if !resp.allowed && resp.reason == Reason::Starting as i32 {
                // Not a limit: the allocator is starting. Envoy's own
                // failure mode decides, as for an unreachable service.
                return Err(Status::unavailable(format!(
                    "rule {}: the allocator is starting (granting in {} ms)",
                    resp.rule_id, resp.retry_after_ms
                )));
            }
            let status = status_of(&resp, rules.as_deref());
            let denied = !resp.allowed;
            if denied {
                overall = Code::OverLimit;
                retry_after_ms = retry_after_ms.max(Some(resp.retry_after_ms));
            }
            let better = match &shown {
                None => resp.reason != Reason::NoRule as i32,
                Some((was_denied, prev)) => match (denied, *was_denied) {
                    (true, false) => true,
                    (true, true) => resp.retry_after_ms > prev.retry_after_ms,
                    (false, false) => resp.remaining < prev.remaining,
                    (false, true) => false,
                },
            };
            if better {
                shown = Some((denied, resp));
            }
            statuses.push(status);
        }
        let response_headers_to_add = response_headers(
            rules.as_deref(),
            shown.map(|(_, resp)| resp).as_ref(),
            retry_after_ms.map(retry_after_secs),
        );
        Ok(Response::new(RateLimitResponse {
            overall_code: overall as i32,
            statuses,
            response_headers_to_add,
            ..RateLimitResponse::default()
        }))
    }
}

/// The headers Envoy adds to the client's answer: `retry-after` when
/// `retry_after_s` is given (an `OVER_LIMIT` answer), and the rate-limit
/// headers of the rule that decided `shown` (none for a shadow rule or an
/// answer no rule decided), with `t` / `RateLimit-Reset` equal to
/// `retry-after` on a denial and 0 on an admission, as the HTTP API does.
fn response_headers(
    rules: Option<&RuleSet>,
    shown: Option<&CheckResponse>,
    retry_after_s: Option<u64>,
) -> Vec<HeaderValue> {
    let header = |key: &str, value: String| HeaderValue {
        key: key.to_string(),
        value,
        raw_value: Vec::new(),
    };
    let mut out = Vec::with_capacity(6);
    if let Some(secs) = retry_after_s {
        out.push(header("retry-after", secs.to_string()));
    }
    let rule = shown.and_then(|resp| Some((rules?.get(&resp.rule_id)?, resp)));
    if let Some((rule, resp)) = rule.filter(|(r, _)| !r.shadow) {
        let reset_s = if resp.allowed {
            0
        } else {
            retry_after_secs(resp.retry_after_ms)
        };
        let info = LimitInfo {
            reset_s,
            ..LimitInfo::of_response(rule, resp)
        };
        out.extend(info.headers().into_iter().map(|(k, v)| header(k, v)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules() -> RuleSet {
        RuleSet::parse(
            "rules:\n  - id: orders\n    match: { tenant: \"*\" }\n    rate: 10/s\n    burst: 20\n  - id: quiet\n    match: { tenant: \"*\", route: /q }\n    rate: 10/s\n    burst: 20\n    shadow: true\n",
            "test",
            1,
        )
        .expect("valid rules")
    }

    fn get<'a>(h: &'a [HeaderValue], k: &str) -> Option<&'a str> {
        h.iter().find(|x| x.key == k).map(|x| x.value.as_str())
    }

    #[test]
    fn over_limit_carries_retry_after_rounded_up_and_the_policy_as_a_bucket() {
        let rules = rules();
        let denied = CheckResponse {
            allowed: false,
            remaining: 3,
            retry_after_ms: 1_200,
            rule_id: "orders".into(),
            ..CheckResponse::default()
        };
        let h = response_headers(Some(&rules), Some(&denied), Some(retry_after_secs(1_200)));
        assert_eq!(get(&h, "retry-after"), Some("2"));
        assert_eq!(get(&h, "ratelimit-policy"), Some("\"orders\";q=20;w=2"));
        assert_eq!(get(&h, "ratelimit"), Some("\"orders\";r=0;t=2"));
        assert_eq!(get(&h, "ratelimit-reset"), Some("2"));
        // A denial with a zero retry time still says 1 s, both ways.
        let zero = CheckResponse {
            retry_after_ms: 0,
            ..denied.clone()
        };
        let h = response_headers(Some(&rules), Some(&zero), Some(retry_after_secs(0)));
        assert_eq!(get(&h, "retry-after"), Some("1"));
        assert_eq!(get(&h, "ratelimit-reset"), Some("1"));
    }

    #[test]
    fn ok_carries_the_headers_without_retry_after_and_shadow_rules_none() {
        let rules = rules();
        let ok = CheckResponse {
            allowed: true,
            remaining: 7,
            rule_id: "orders".into(),
            ..CheckResponse::default()
        };
        let h = response_headers(Some(&rules), Some(&ok), None);
        assert_eq!(get(&h, "retry-after"), None);
        assert_eq!(get(&h, "ratelimit"), Some("\"orders\";r=7;t=0"));
        assert_eq!(get(&h, "ratelimit-remaining"), Some("7"));
        let shadow = CheckResponse {
            rule_id: "quiet".into(),
            ..ok
        };
        assert!(response_headers(Some(&rules), Some(&shadow), None).is_empty());
        assert!(response_headers(Some(&rules), None, None).is_empty());
    }
}

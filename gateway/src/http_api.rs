//! The agent's HTTP check API (SPEC §5, §8): `POST /v1/check` with a JSON
//! body and `GET /v1/check?tenant=…&route=…&cost=…&request_id=…`.
//!
//! This module owns the translation between HTTP and [`Agent::check`]: it
//! parses and validates the request itself (so every 400 names the field at
//! fault, which axum's stock `Json`/`Query` rejections do not), and it turns a
//! decision into a status code, a JSON body and the rate-limit headers.
//!
//! | decision | status | body |
//! |---|---|---|
//! | admitted (`OK`, `NO_RULE`, `SHADOW_OVER_LIMIT`, `FAILURE_MODE_ALLOWED`) | 200 | `{"allowed":true,"remaining":n,"rule_id":…,"rule_version":v,"reason":…}` |
//! | denied (`OVER_LIMIT`, `FAILURE_MODE_DENIED`) | 429 | `{"error":"rate_limited","retry_after_ms":…,"rule_id":…,"reason":…}` |
//! | fail-closed, no lease, or no rules yet | 503 | `{"error":"limiter_unavailable","reason":…}` |
//! | the allocator is starting (`STARTING`: its start's grace or a restart's wait; not a limit) | 503 (`Retry-After` until it ends) | `{"error":"limiter_unavailable","reason":"STARTING","retry_after_ms":…,"rule_id":…}` |
//! | bad input | 400 (413 for a body over [`MAX_BODY_BYTES`], at once when its `Content-Length` says so, before any of it is read) | `{"error":"invalid","field":…,"reason":…}` |
//!
//! Headers (all answers carry `Cache-Control: no-store`; the rate-limit
//! headers come from [`crate::headers`], shared with Envoy RLS):
//!
//! - 429: `Retry-After` (whole seconds, rounded up, at least 1), the IETF
//!   httpapi ratelimit-headers draft structured fields
//!   `RateLimit-Policy: "login";q=5;w=60` (the rule as a token bucket:
//!   quota = the burst, window = the seconds the rate takes to refill the
//!   burst, rounded up, so 10/s with burst 20 is `q=20;w=2`; the policy
//!   named by rule id) and
//!   `RateLimit: "login";r=0;t=3` (remaining, seconds until a retry can
//!   pass), and the legacy `RateLimit-Limit` (burst), `RateLimit-Remaining`
//!   and `RateLimit-Reset` (seconds, rounded up).
//! - 200 with a (non-shadow) rule: the same rate-limit headers with `r` =
//!   `remaining` and `t` = 0. `remaining` (here, in the body, and on a
//!   429 where it is 0) is the agent's estimate of the key's *global*
//!   remaining tokens for the most constrained rule (SPEC §5): its lease's
//!   level plus what the allocator last reported is left in the bucket,
//!   at most the burst ([`crate::headers::remaining_of`]).
//!   Shadow rules never deny, so they get no headers.
//! - 503: `Retry-After: 1`.
//!
//! Input rules: the JSON body must be one object with only the fields
//! `tenant_id` (string, required), `route_id` (string, required; `""` for
//! none), `cost` (whole number 0 … 4294967295, optional, 0 or absent
//! means 1) and `request_id` (string, optional); `null` counts as absent for
//! the optional fields. Unknown or repeated fields are rejected. The query
//! form takes `tenant`, `route`, `cost`, `request_id` with the same rules,
//! strictly percent-decoded (`+` is a space) and UTF-8. The body is read
//! whatever its `Content-Type`. Id lengths, an empty tenant and a cost above
//! a rule's burst are judged by the agent, and its error is passed on with
//! the field named as the client spelled it.

use std::borrow::Cow;

use axum::body::{Bytes, HttpBody};
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, FromRequest, RawQuery, Request, State};
use axum::http::header::{CACHE_CONTROL, RETRY_AFTER};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use quotalease_model::rules::Rule;
use quotalease_proto::v1::{CheckResponse, Reason};
use serde_json::{json, Map, Value};

use crate::headers::{retry_after_secs, LimitInfo};
use quotalease_agent::agent::{Agent, CheckError, CheckInput};

/// Largest request body accepted; a larger one is answered with 413.
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// Longest piece of client text (an unknown field's name) echoed in an error.
const MAX_ECHO_BYTES: usize = 64;

/// The check routes, to be merged into the agent's HTTP server.
pub fn router(agent: Agent) -> Router {
    Router::new()
        .route("/v1/check", post(check_post).get(check_get))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(agent)
}

async fn check_post(State(agent): State<Agent>, request: Request) -> Response {
    // A declared length over the limit is refused before any of the body is
    // read: waiting for it would hold the connection as long as the client
    // cares to (the limit on the body itself only acts on bytes received).
    if request.body().size_hint().lower() > MAX_BODY_BYTES as u64 {
        return too_large().into_response();
    }
    let params = match Bytes::from_request(request, &()).await {
        Ok(body) => parse_json(&body),
        Err(rejection) => Err(body_rejection(&rejection)),
    };
    match params {
        Ok(p) => answer(&agent, &p, Form::Json).await,
        Err(e) => e.into_response(),
    }
}

async fn check_get(State(agent): State<Agent>, RawQuery(query): RawQuery) -> Response {
    match parse_query(query.as_deref().unwrap_or("")) {
        Ok(p) => answer(&agent, &p, Form::Query).await,
        Err(e) => e.into_response(),
    }
}

// ---------------------------------------------------------------------------
// Requests

/// Where a request came from: it decides how fields are named in errors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Form {
    /// `POST` JSON body: `tenant_id`, `route_id`, `cost`, `request_id`.
    Json,
    /// `GET` query: `tenant`, `route`, `cost`, `request_id`.
    Query,
}

impl Form {
    /// The client's name for one of [`CheckError::Invalid`]'s fields.
    fn field(self, agent_field: &'static str) -> &'static str {
        match (self, agent_field) {
            (Form::Query, "tenant_id") => "tenant",
            (Form::Query, "route_id") => "route",
            (_, f) => f,
        }
    }
}

/// A parsed check request.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Params {
    tenant: String,
    route: String,
    cost: u32,
    request_id: String,
}

/// A request the API refuses before asking the agent.
#[derive(Clone, Debug, PartialEq, Eq)]
struct BadInput {
    status: StatusCode,
    field: Cow<'static, str>,
    reason: String,
}

impl BadInput {
    fn new(field: impl Into<Cow<'static, str>>, reason: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            field: field.into(),
            reason: reason.into(),
        }
    }
}

impl IntoResponse for BadInput {
    fn into_response(self) -> Response {
        invalid_response(self.status, &self.field, &self.reason)
    }
}

const COST_RANGE: &str = "must be a whole number from 0 to 4294967295 (0 means 1)";

/// The 413 for a body (declared or read) over [`MAX_BODY_BYTES`].
fn too_large() -> BadInput {
    BadInput {
        status: StatusCode::PAYLOAD_TOO_LARGE,
        field: "body".into(),
        reason: format!("larger than {MAX_BODY_BYTES} bytes"),
    }
}

fn body_rejection(rejection: &BytesRejection) -> BadInput {
    if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
        too_large()
    } else {
        BadInput::new("body", format!("cannot be read: {rejection}"))
    }
}

/// Parse a `POST /v1/check` body.
fn parse_json(body: &[u8]) -> Result<Params, BadInput> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| BadInput::new("body", format!("not valid JSON: {e}")))?;
    let Value::Object(map) = value else {
        return Err(BadInput::new(
            "body",
            "must be a JSON object with tenant_id, route_id, cost and request_id",
        ));
    };
    if let Some(unknown) = map
        .keys()
        .find(|k| !matches!(k.as_str(), "tenant_id" | "route_id" | "cost" | "request_id"))
    {
        return Err(BadInput::new(
            clip(unknown).into_owned(),
            "unknown field (expected tenant_id, route_id, cost, request_id)",
        ));
    }
    if let Some(dup) = duplicate_top_level_key(body) {
        return Err(BadInput::new(
            clip(&dup).into_owned(),
            "given more than once",
        ));
    }
    Ok(Params {
        tenant: json_string(&map, "tenant_id", true)?,
        route: json_string(&map, "route_id", true)?,
        cost: match map.get("cost") {
            None | Some(Value::Null) => 0,
            Some(Value::Number(n)) => n
                .as_u64()
                .and_then(|c| u32::try_from(c).ok())
                .ok_or_else(|| BadInput::new("cost", format!("{n} {COST_RANGE}")))?,
            Some(other) => {
                return Err(BadInput::new(
                    "cost",
                    format!("is {}, {COST_RANGE}", json_kind(other)),
                ))
            }
        },
        request_id: json_string(&map, "request_id", false)?,
    })
}

/// A string field of the body; an optional one may be absent or `null`.
fn json_string(
    map: &Map<String, Value>,
    field: &'static str,
    required: bool,
) -> Result<String, BadInput> {
    match map.get(field) {
        Some(Value::String(s)) => Ok(s.clone()),
        None | Some(Value::Null) if !required => Ok(String::new()),
        None => Err(BadInput::new(field, "missing")),
        Some(other) => Err(BadInput::new(
            field,
            format!("is {}, must be a string", json_kind(other)),
        )),
    }
}

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// The first key that appears twice at the top level of `json`, which must
/// already be known to be a valid JSON object (serde_json keeps the last
/// value of a repeated key silently; we refuse it instead).
fn duplicate_top_level_key(json: &[u8]) -> Option<String> {
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    let mut string_start = 0;
    let mut last_string = 0..0;
    let mut seen: Vec<String> = Vec::new();
    for (i, &b) in json.iter().enumerate() {
        if in_string {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_string = false;
                last_string = string_start..i + 1;
            }
            continue;
        }
        match b {
            b'"' => {
                in_string = true;
                string_start = i;
            }
            b'{' | b'[' => depth += 1,
            b'}' | b']' => depth = depth.saturating_sub(1),
            // In valid JSON a ':' outside strings follows an object key.
            b':' if depth == 1 => {
                let key: String = serde_json::from_slice(json.get(last_string.clone())?).ok()?;
                if seen.contains(&key) {
                    return Some(key);
                }
                seen.push(key);
            }
            _ => {}
        }
    }
    None
}

/// Parse a `GET /v1/check` query string.
fn parse_query(query: &str) -> Result<Params, BadInput> {
    let mut tenant = None;
    let mut route = None;
    let mut cost = None;
    let mut request_id = None;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (raw_key, raw_value) = pair.split_once('=').unwrap_or((pair, ""));
        let key = percent_decode(raw_key).map_err(|why| BadInput::new("query", why))?;
        let (field, slot) = match key.as_str() {
            "tenant" => ("tenant", &mut tenant),
            "route" => ("route", &mut route),
            "cost" => ("cost", &mut cost),
            "request_id" => ("request_id", &mut request_id),
            _ => {
                return Err(BadInput::new(
                    clip(&key).into_owned(),
                    "unknown parameter (expected tenant, route, cost, request_id)",
                ))
            }
        };
        if slot.is_some() {
            return Err(BadInput::new(field, "given more than once"));
        }
        *slot = Some(percent_decode(raw_value).map_err(|why| BadInput::new(field, why))?);
    }
    Ok(Params {
        tenant: tenant.ok_or_else(|| BadInput::new("tenant", "missing"))?,
        route: route.ok_or_else(|| BadInput::new("route", "missing"))?,
        cost: match cost {
            None => 0,
            Some(c) => c
                .parse::<u32>()
                .map_err(|_| BadInput::new("cost", format!("{:?} {COST_RANGE}", clip(&c))))?,
        },
        request_id: request_id.unwrap_or_default(),
    })
}

/// Strict `application/x-www-form-urlencoded` decoding: `+` is a space, every
/// `%` is followed by two hex digits, and the result is UTF-8.
fn percent_decode(s: &str) -> Result<String, String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' => {
                let hex = |j: usize| bytes.get(j).and_then(|&b| (b as char).to_digit(16));
                match (hex(i + 1), hex(i + 2)) {
                    (Some(hi), Some(lo)) => out.push((hi * 16 + lo) as u8),
                    _ => {
                        return Err(
                            "bad percent-encoding: '%' must be followed by two hex digits".into(),
                        )
                    }
                }
                i += 2;
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8(out).map_err(|_| "not UTF-8 once percent-decoded".into())
}

/// At most [`MAX_ECHO_BYTES`] of client text, cut on a character boundary.
fn clip(s: &str) -> Cow<'_, str> {
    if s.len() <= MAX_ECHO_BYTES {
        return Cow::Borrowed(s);
    }
    let mut end = MAX_ECHO_BYTES;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    Cow::Owned(format!("{}…", &s[..end]))
}

// ---------------------------------------------------------------------------
// Answers

async fn answer(agent: &Agent, p: &Params, form: Form) -> Response {
    let input = CheckInput {
        tenant: &p.tenant,
        route: &p.route,
        cost: p.cost,
        request_id: &p.request_id,
        domain: None,
    };
    match agent.check(input).await {
        Ok(resp) => {
            let rules = agent.rules();
            let rule = rules
                .as_deref()
                .filter(|_| !resp.rule_id.is_empty())
                .and_then(|r| r.get(&resp.rule_id));
            decision_response(rule, &resp)
        }
        Err(CheckError::Invalid { field, reason }) => {
            invalid_response(StatusCode::BAD_REQUEST, form.field(field), &reason)
        }
        Err(CheckError::Unavailable(why)) => {
            tracing::debug!(%why, "check unavailable");
            let mut headers = base_headers();
            headers.insert(RETRY_AFTER, HeaderValue::from(1u64));
            (
                StatusCode::SERVICE_UNAVAILABLE,
                headers,
                Json(json!({"error": "limiter_unavailable", "reason": why})),
            )
                .into_response()
        }
    }
}

fn invalid_response(status: StatusCode, field: &str, reason: &str) -> Response {
    (
        status,
        base_headers(),
        Json(json!({"error": "invalid", "field": field, "reason": reason})),
    )
        .into_response()
}

fn base_headers() -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h
}

/// 200 or 429 for a decision; `rule` is the rule named by `resp.rule_id`
/// in the rules in force (None for NO_RULE, or if it was just removed).
fn decision_response(rule: Option<&Rule>, resp: &CheckResponse) -> Response {
    let reason = Reason::try_from(resp.reason).unwrap_or(Reason::Invalid);
    if !resp.allowed && reason == Reason::Invalid {
        // The agent reports bad input as an error; this is a safety net.
        return invalid_response(StatusCode::BAD_REQUEST, "request", "refused as invalid");
    }
    if !resp.allowed && reason == Reason::Starting {
        // Not a limit: the allocator is starting. 503 with the wait.
        let mut h = base_headers();
        h.insert(
            RETRY_AFTER,
            HeaderValue::from(retry_after_secs(resp.retry_after_ms)),
        );
        let body = json!({
            "error": "limiter_unavailable",
            "reason": reason.as_str_name(),
            "retry_after_ms": resp.retry_after_ms,
            "rule_id": resp.rule_id,
        });
        return (StatusCode::SERVICE_UNAVAILABLE, h, Json(body)).into_response();
    }
    let headers = decision_headers(rule, resp);
    if resp.allowed {
        let body = json!({
            "allowed": true,
            "remaining": resp.remaining,
            "rule_id": resp.rule_id,
            "rule_version": resp.applied_rule_version,
            "reason": reason.as_str_name(),
        });
        return (StatusCode::OK, headers, Json(body)).into_response();
    }
    let body = json!({
        "error": "rate_limited",
        "retry_after_ms": resp.retry_after_ms,
        "rule_id": resp.rule_id,
        "reason": reason.as_str_name(),
    });
    (StatusCode::TOO_MANY_REQUESTS, headers, Json(body)).into_response()
}

/// The headers of a 200 or 429: on a denial `Retry-After` (whole seconds,
/// rounded up, at least 1), and, when a non-shadow rule decided, the five
/// rate-limit headers of [`LimitInfo`] with `t` / `RateLimit-Reset` equal to
/// `Retry-After` on a denial and 0 on an admission.
fn decision_headers(rule: Option<&Rule>, resp: &CheckResponse) -> HeaderMap {
    let mut h = base_headers();
    let reset_s = if resp.allowed {
        0
    } else {
        let secs = retry_after_secs(resp.retry_after_ms);
        h.insert(RETRY_AFTER, HeaderValue::from(secs));
        secs
    };
    if let Some(rule) = rule.filter(|r| !r.shadow) {
        let info = LimitInfo {
            reset_s,
            ..LimitInfo::of_response(rule, resp)
        };
        for (name, value) in info.headers() {
            // Valid names and visible ASCII values by construction; a header
            // that somehow is not is left out rather than panicking.
            if let (Ok(name), Ok(value)) =
                (HeaderName::try_from(name), HeaderValue::try_from(value))
            {
                h.insert(name, value);
            }
        }
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    use quotalease_model::rules::RuleSet;

    const RULES: &str = "rules:
  - id: login
    match: { tenant: \"*\", route: /api/login }
    rate: 5/m
    burst: 5
  - id: shadowed
    match: { tenant: \"*\", route: /api/new }
    rate: 10/s
    burst: 20
    shadow: true
  - id: orders
    match: { tenant: \"*\", route: /api/orders }
    rate: 10/s
    burst: 20
";

    fn rules() -> RuleSet {
        RuleSet::parse(RULES, "test.yaml", 7).expect("test rules are valid")
    }

    fn denial(rule_id: &str, retry_after_ms: u64) -> CheckResponse {
        CheckResponse {
            allowed: false,
            remaining: 0,
            retry_after_ms,
            rule_id: rule_id.into(),
            applied_rule_version: 7,
            reason: Reason::OverLimit as i32,
        }
    }

    fn header<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
        h.get(name).and_then(|v| v.to_str().ok())
    }

    #[test]
    fn retry_after_rounds_up_to_whole_seconds_at_least_one() {
        let rules = rules();
        let login = rules.get("login");
        for (ms, secs) in [
            (0, "1"),
            (1, "1"),
            (999, "1"),
            (1000, "1"),
            (1001, "2"),
            (12_000, "12"),
        ] {
            let h = decision_headers(login, &denial("login", ms));
            assert_eq!(header(&h, "retry-after"), Some(secs), "{ms} ms");
            // RateLimit's t and the legacy reset agree with Retry-After.
            assert_eq!(header(&h, "ratelimit-reset"), Some(secs), "{ms} ms");
            let expected = format!("\"login\";r=0;t={secs}");
            assert_eq!(header(&h, "ratelimit"), Some(expected.as_str()));
        }
        let h = decision_headers(None, &denial("", u64::MAX));
        let secs = u64::MAX.div_ceil(1000).to_string();
        assert_eq!(header(&h, "retry-after"), Some(secs.as_str()));
    }

    #[test]
    fn denial_carries_all_five_rate_limit_headers() {
        let rules = rules();
        let h = decision_headers(rules.get("login"), &denial("login", 11_500));
        assert_eq!(header(&h, "ratelimit-policy"), Some(r#""login";q=5;w=60"#));
        assert_eq!(header(&h, "ratelimit"), Some(r#""login";r=0;t=12"#));
        assert_eq!(header(&h, "ratelimit-limit"), Some("5"));
        assert_eq!(header(&h, "ratelimit-remaining"), Some("0"));
        assert_eq!(header(&h, "ratelimit-reset"), Some("12"));
        assert_eq!(header(&h, "retry-after"), Some("12"));
        assert_eq!(header(&h, "cache-control"), Some("no-store"));
    }

    #[test]
    fn the_policy_window_is_the_time_to_refill_the_burst() {
        // 10/s with burst 20 allows 20 per 2 s, not 20 per 1 s.
        let rules = rules();
        let h = decision_headers(rules.get("orders"), &denial("orders", 100));
        assert_eq!(header(&h, "ratelimit-policy"), Some(r#""orders";q=20;w=2"#));
        assert_eq!(header(&h, "retry-after"), Some("1"));
    }

    #[test]
    fn admission_headers_have_no_retry_after_and_t_zero() {
        let rules = rules();
        let ok = CheckResponse {
            allowed: true,
            remaining: 3,
            rule_id: "login".into(),
            applied_rule_version: 7,
            ..CheckResponse::default()
        };
        let h = decision_headers(rules.get("login"), &ok);
        assert_eq!(header(&h, "retry-after"), None);
        assert_eq!(header(&h, "ratelimit"), Some(r#""login";r=3;t=0"#));
        assert_eq!(header(&h, "ratelimit-remaining"), Some("3"));
        assert_eq!(header(&h, "ratelimit-reset"), Some("0"));
        // Shadow rules never deny: no quota is advertised for them.
        let h = decision_headers(rules.get("shadowed"), &ok);
        assert_eq!(header(&h, "ratelimit-policy"), None);
        assert_eq!(header(&h, "ratelimit"), None);
        // NO_RULE: nothing to advertise.
        assert_eq!(
            header(&decision_headers(None, &ok), "ratelimit-limit"),
            None
        );
    }

    #[test]
    fn statuses() {
        let rules = rules();
        let login = rules.get("login");
        assert_eq!(
            decision_response(login, &denial("login", 5)).status(),
            StatusCode::TOO_MANY_REQUESTS
        );
        let failed = CheckResponse {
            reason: Reason::FailureModeDenied as i32,
            ..denial("login", 250)
        };
        assert_eq!(
            decision_response(login, &failed).status(),
            StatusCode::TOO_MANY_REQUESTS
        );
        let invalid = CheckResponse {
            reason: Reason::Invalid as i32,
            ..denial("", 0)
        };
        assert_eq!(
            decision_response(None, &invalid).status(),
            StatusCode::BAD_REQUEST
        );
        let ok = CheckResponse {
            allowed: true,
            reason: Reason::NoRule as i32,
            ..CheckResponse::default()
        };
        assert_eq!(decision_response(None, &ok).status(), StatusCode::OK);
    }

    #[test]
    fn json_bodies() {
        let p = parse_json(br#"{"tenant_id":"t","route_id":"/r","cost":3,"request_id":"x"}"#);
        assert_eq!(
            p,
            Ok(Params {
                tenant: "t".into(),
                route: "/r".into(),
                cost: 3,
                request_id: "x".into()
            })
        );
        let p = parse_json(br#"{"tenant_id":"t","route_id":"","cost":null}"#).unwrap();
        assert_eq!((p.cost, p.request_id.as_str()), (0, ""));
        let field = |body: &[u8]| parse_json(body).map(|_| ()).unwrap_err().field;
        assert_eq!(field(b""), "body");
        assert_eq!(field(br#"{"tenant_id":"t","#), "body");
        assert_eq!(field(b"[1]"), "body");
        assert_eq!(field(b"\xff"), "body");
        assert_eq!(field(br#"{"route_id":"/r"}"#), "tenant_id");
        assert_eq!(field(br#"{"tenant_id":7,"route_id":"/r"}"#), "tenant_id");
        assert_eq!(field(br#"{"tenant_id":"t"}"#), "route_id");
        assert_eq!(
            field(br#"{"tenant_id":"t","route_id":"/r","cost":"2"}"#),
            "cost"
        );
        assert_eq!(
            field(br#"{"tenant_id":"t","route_id":"/r","cost":-1}"#),
            "cost"
        );
        assert_eq!(
            field(br#"{"tenant_id":"t","route_id":"/r","cost":1.5}"#),
            "cost"
        );
        assert_eq!(
            field(br#"{"tenant_id":"t","route_id":"/r","cost":4294967296}"#),
            "cost"
        );
        assert_eq!(
            field(br#"{"tenant_id":"t","route_id":"/r","request_id":1}"#),
            "request_id"
        );
        assert_eq!(
            field(br#"{"tenant_id":"t","route_id":"/r","tenant":"x"}"#),
            "tenant"
        );
        assert_eq!(
            field(br#"{"tenant_id":"a","route_id":"/r","tenant_id":"b"}"#),
            "tenant_id"
        );
        let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        assert_eq!(field(deep.as_bytes()), "body");
        let long = format!(r#"{{"{}":1}}"#, "k".repeat(1000));
        assert!(field(long.as_bytes()).len() < 100);
    }

    #[test]
    fn duplicate_keys_are_found_only_at_the_top_level() {
        let dup = |s: &str| duplicate_top_level_key(s.as_bytes());
        assert_eq!(dup(r#"{"a":1,"b":{"a":2},"c":"a:\"a\""}"#), None);
        assert_eq!(dup(r#"{"a":1,"b":[{"a":2}],"\u0061":3}"#), Some("a".into()));
    }

    #[test]
    fn query_strings() {
        let p = parse_query("tenant=acme&route=%2Fapi%2Flogin&cost=2&request_id=a+b").unwrap();
        assert_eq!(
            p,
            Params {
                tenant: "acme".into(),
                route: "/api/login".into(),
                cost: 2,
                request_id: "a b".into()
            }
        );
        let field = |q: &str| parse_query(q).map(|_| ()).unwrap_err().field;
        assert_eq!(field(""), "tenant");
        assert_eq!(field("tenant=t"), "route");
        assert_eq!(field("tenant=t&route=r&cost=x"), "cost");
        assert_eq!(field("tenant=t&route=r&cost=-1"), "cost");
        assert_eq!(field("tenant=t&route=r&cost="), "cost");
        assert_eq!(field("tenant=%ff&route=r"), "tenant");
        assert_eq!(field("tenant=%f&route=r"), "tenant");
        assert_eq!(field("tenant=t&tenant=u&route=r"), "tenant");
        assert_eq!(field("tenant=t&route=r&foo=1"), "foo");
        assert_eq!(field("%zz=1"), "query");
    }

    #[test]
    fn query_field_names_follow_the_form() {
        assert_eq!(Form::Query.field("tenant_id"), "tenant");
        assert_eq!(Form::Query.field("route_id"), "route");
        assert_eq!(Form::Query.field("cost"), "cost");
        assert_eq!(Form::Json.field("tenant_id"), "tenant_id");
    }
}

/// The HTTP check API's input parsers, for the fuzz targets (`fuzz/`):
/// each returns whether the input was accepted, and must never panic.
#[doc(hidden)]
pub mod fuzzing {
    /// `GET /v1/check` query string.
    pub fn query(q: &str) -> bool {
        super::parse_query(q).is_ok()
    }

    /// `POST /v1/check` JSON body.
    pub fn json(body: &[u8]) -> bool {
        super::parse_json(body).is_ok()
    }
}

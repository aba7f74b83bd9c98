//! tower middleware: a global limit in front of any `http` service (the
//! `tower` feature).
//!
//! [`RateLimitLayer`] wraps a service; each request's key comes from a
//! [`KeyExtractor`] (a header naming the tenant, the request path as the
//! route, or your own), and the decision is made in `call` through the
//! [`Client`] (never in `poll_ready`: a service polled ready and then
//! dropped has charged nothing). The service is `Clone` and its clones
//! share the client's leases.
//!
//! Answers (SPEC §5, §6): a denial is `429 Too Many Requests` with
//! `Retry-After`, `RateLimit-Policy` and `RateLimit` (and the legacy
//! `RateLimit-Limit/Remaining/Reset`); no decision because the rule is
//! fail-`closed` without a lease or the rules are not known yet is `503`;
//! an invalid key (say, a tenant header longer than an id may be) is
//! `400`. The rule's fail policy decides what happens while the allocator
//! is out of reach, as for every other face. Admitted responses carry the
//! rate-limit headers too unless [`RateLimitLayer::headers_on_admitted`]
//! turns them off.
//!
//! ```no_run
//! # fn layer(client: quotalease_client::Client) {
//! use quotalease_client::middleware::{HeaderKey, RateLimitLayer};
//! // The tenant from `x-tenant`, the route from the request path.
//! let layer = RateLimitLayer::new(client, HeaderKey::new("x-tenant"));
//! # let _ = layer; }
//! ```

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use std::sync::Arc;

use arc_swap::ArcSwapOption;
use http::header::{HeaderName, HeaderValue};
use http::{Request, Response, StatusCode};
use quotalease_model::headers::{retry_after_secs, LimitInfo};
use quotalease_model::rules::RuleSet;
use tower_layer::Layer;
use tower_service::Service;

use crate::{Client, Decision, Key, Outcome};

/// Where a request's key comes from.
pub trait KeyExtractor<B>: Clone + Send + Sync + 'static {
    /// The key of `req` and its cost; `None`: the request is not limited
    /// and passes.
    fn extract(&self, req: &Request<B>) -> Option<(Key, u32)>;
}

/// Where the route part of a key comes from.
#[derive(Clone, Debug)]
enum Route {
    /// The request's path.
    Path,
    /// Always this route.
    Fixed(String),
    /// axum's route template (`MatchedPath`, `/users/{id}`).
    #[cfg(feature = "axum")]
    Matched,
}

/// The route of a request axum matched to no route (its fallback): they
/// share one bucket per tenant instead of one per path tried.
#[cfg(feature = "axum")]
pub const UNMATCHED_ROUTE: &str = "(unmatched)";

impl Route {
    fn of<B>(&self, req: &Request<B>) -> String {
        match self {
            Route::Path => req.uri().path().to_owned(),
            Route::Fixed(r) => r.clone(),
            #[cfg(feature = "axum")]
            Route::Matched => req
                .extensions()
                .get::<axum::extract::MatchedPath>()
                .map_or(UNMATCHED_ROUTE, |m| m.as_str())
                .to_owned(),
        }
    }
}

/// The tenant from a request header (its value; one that is not visible
/// ASCII is read with invalid bytes as U+FFFD and limited as that tenant),
/// the route from the request path unless set; cost 1. A request
/// without the header passes unlimited unless [`HeaderKey::default_tenant`]
/// names a tenant for it.
#[derive(Clone, Debug)]
pub struct HeaderKey {
    header: HeaderName,
    route: Route,
    default_tenant: Option<String>,
}

impl HeaderKey {
    /// The tenant from `header`.
    ///
    /// # Panics
    /// If `header` is not a valid header name (a constant in the caller's
    /// code).
    pub fn new(header: &'static str) -> Self {
        Self {
            header: HeaderName::from_static(header),
            route: Route::Path,
            default_tenant: None,
        }
    }

    /// Every request on this route id instead of its path.
    pub fn route(mut self, route: impl Into<String>) -> Self {
        self.route = Route::Fixed(route.into());
        self
    }

    /// The route is axum's route template (`MatchedPath`: `/users/{id}`,
    /// so every user's page shares the route's rule) instead of the
    /// concrete path; requests that matched no route are
    /// [`UNMATCHED_ROUTE`]. Apply the layer with `Router::layer` or
    /// `route_layer` (it runs after routing there).
    #[cfg(feature = "axum")]
    pub fn matched_path(mut self) -> Self {
        self.route = Route::Matched;
        self
    }

    /// Requests without the header are this tenant (they share its
    /// limit) instead of passing unlimited.
    pub fn default_tenant(mut self, tenant: impl Into<String>) -> Self {
        self.default_tenant = Some(tenant.into());
        self
    }
}

impl<B> KeyExtractor<B> for HeaderKey {
    fn extract(&self, req: &Request<B>) -> Option<(Key, u32)> {
        let tenant = match req.headers().get(&self.header) {
            // Not visible ASCII: limited as the tenant it spells (invalid
            // bytes as U+FFFD), never passed unlimited.
            Some(v) => match v.to_str() {
                Ok(t) => t.to_owned(),
                Err(_) => String::from_utf8_lossy(v.as_bytes()).into_owned(),
            },
            None => self.default_tenant.clone()?,
        };
        Some((Key::new(tenant, self.route.of(req)), 1))
    }
}

/// One tenant for every request (a limit per route: a service-wide cap),
/// the route from the request path; cost 1.
#[derive(Clone, Debug)]
pub struct PathKey {
    tenant: String,
    route: Route,
}

impl PathKey {
    /// Every request is `tenant`, on its own path.
    pub fn new(tenant: impl Into<String>) -> Self {
        Self {
            tenant: tenant.into(),
            route: Route::Path,
        }
    }

    /// The route is axum's route template, as [`HeaderKey::matched_path`].
    #[cfg(feature = "axum")]
    pub fn matched_path(mut self) -> Self {
        self.route = Route::Matched;
        self
    }
}

impl<B> KeyExtractor<B> for PathKey {
    fn extract(&self, req: &Request<B>) -> Option<(Key, u32)> {
        Some((Key::new(self.tenant.clone(), self.route.of(req)), 1))
    }
}

/// How refusals are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Protocol {
    Http,
    Grpc,
}

/// The layer: see the module docs.
#[derive(Clone, Debug)]
pub struct RateLimitLayer<K> {
    client: Client,
    extractor: K,
    headers_on_admitted: bool,
    protocol: Protocol,
    rule_headers: Arc<RuleHeaderCache>,
}

impl<K> RateLimitLayer<K> {
    /// Limit every request by `client`, keyed by `extractor`.
    pub fn new(client: Client, extractor: K) -> Self {
        Self {
            client,
            extractor,
            headers_on_admitted: true,
            protocol: Protocol::Http,
            rule_headers: Arc::default(),
        }
    }

    /// Refuse as a gRPC server does (a tonic service behind the layer):
    /// a trailers-only response, HTTP 200 with `grpc-status`
    /// `RESOURCE_EXHAUSTED` (8) over the limit, `UNAVAILABLE` (14) without
    /// a decision, `INVALID_ARGUMENT` (3) for an invalid key, and a
    /// `grpc-message` naming the rule; `retry-after` and the rate-limit
    /// headers ride along as response metadata. The route of a gRPC
    /// request is its method path (`/pkg.Service/Method`) unless the
    /// extractor fixes one.
    pub fn grpc(mut self) -> Self {
        self.protocol = Protocol::Grpc;
        self
    }

    /// Whether admitted responses carry the rate-limit headers (default:
    /// yes; denials always do).
    pub fn headers_on_admitted(mut self, on: bool) -> Self {
        self.headers_on_admitted = on;
        self
    }
}

impl<S, K: Clone> Layer<S> for RateLimitLayer<K> {
    type Service = RateLimit<S, K>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimit {
            inner,
            client: self.client.clone(),
            extractor: self.extractor.clone(),
            headers_on_admitted: self.headers_on_admitted,
            protocol: self.protocol,
            rule_headers: self.rule_headers.clone(),
        }
    }
}

/// The service [`RateLimitLayer`] makes.
#[derive(Clone, Debug)]
pub struct RateLimit<S, K> {
    inner: S,
    client: Client,
    extractor: K,
    headers_on_admitted: bool,
    protocol: Protocol,
    rule_headers: Arc<RuleHeaderCache>,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, K, B, RB> Service<Request<B>> for RateLimit<S, K>
where
    S: Service<Request<B>, Response = Response<RB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    K: KeyExtractor<B>,
    B: Send + 'static,
    RB: Default + Send + 'static,
{
    type Response = Response<RB>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Response<RB>, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        // The service polled ready is the one that takes this request; a
        // clone stays for the next (tower's usual swap).
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let Some((key, cost)) = self.extractor.extract(&req) else {
            return Box::pin(inner.call(req));
        };
        let headers_on_admitted = self.headers_on_admitted;
        // Admitted from the leases held (the common case): decided here,
        // and the future carries the inner call alone.
        if let Some(d) = self.client.check_fast(&key, cost) {
            let fut = inner.call(req);
            if !headers_on_admitted {
                return Box::pin(fut);
            }
            let client = self.client.clone();
            let cache = self.rule_headers.clone();
            return Box::pin(async move {
                let mut resp = fut.await?;
                add_headers(&client, &cache, &d, resp.headers_mut());
                Ok(resp)
            });
        }
        let client = self.client.clone();
        let protocol = self.protocol;
        let cache = self.rule_headers.clone();
        Box::pin(async move {
            let d = client.check(&key, cost).await;
            if d.allowed() {
                let mut resp = inner.call(req).await?;
                if headers_on_admitted {
                    add_headers(&client, &cache, &d, resp.headers_mut());
                }
                return Ok(resp);
            }
            #[cfg(feature = "tracing")]
            trace_refusal(&key, &d);
            Ok(match protocol {
                Protocol::Http => refusal(&client, &cache, &d),
                Protocol::Grpc => grpc_refusal(&client, &cache, &d),
            })
        })
    }
}

/// A refusal as a tracing event: denials at DEBUG (they are the limiter
/// working), no decision at WARN (the allocator or the rules are missing).
#[cfg(feature = "tracing")]
fn trace_refusal(key: &Key, d: &Decision) {
    let retry_after_ms = d.retry_after().map_or(0, |r| r.as_millis() as u64);
    match d.outcome() {
        Outcome::Unavailable(why) => tracing::warn!(
            tenant = key.tenant(),
            route = key.route(),
            reason = %why,
            "quotalease: no decision, refused"
        ),
        Outcome::Invalid { field, reason } => tracing::debug!(
            tenant = key.tenant(),
            route = key.route(),
            field,
            reason = %reason,
            "quotalease: invalid key, refused"
        ),
        outcome => tracing::debug!(
            tenant = key.tenant(),
            route = key.route(),
            rule = d.rule_id().unwrap_or(""),
            outcome = ?outcome,
            retry_after_ms,
            "quotalease: rate limited"
        ),
    }
}

/// A gRPC refusal: trailers-only (HTTP 200, the status in the headers).
fn grpc_refusal<RB: Default>(
    client: &Client,
    cache: &RuleHeaderCache,
    d: &Decision,
) -> Response<RB> {
    let mut resp = Response::new(RB::default());
    let h = resp.headers_mut();
    h.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    h.insert("grpc-status", HeaderValue::from(u16::from(d.grpc_code())));
    let message = percent_encode_message(&d.refusal_message());
    if let Ok(v) = HeaderValue::try_from(message) {
        h.insert("grpc-message", v);
    }
    if d.grpc_code() == 8 {
        let ms = d.retry_after().map_or(0, |r| r.as_millis() as u64);
        h.insert(
            http::header::RETRY_AFTER,
            HeaderValue::from(retry_after_secs(ms)),
        );
        add_headers(client, cache, d, h);
    }
    resp
}

/// `grpc-message` encoding (gRPC over HTTP/2: percent-encode everything
/// outside printable ASCII and `%` itself).
fn percent_encode_message(m: &str) -> String {
    let mut out = String::with_capacity(m.len());
    for b in m.bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The response to a request that was not admitted.
fn refusal<RB: Default>(client: &Client, cache: &RuleHeaderCache, d: &Decision) -> Response<RB> {
    let status = match d.outcome() {
        Outcome::Invalid { .. } => StatusCode::BAD_REQUEST,
        Outcome::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::TOO_MANY_REQUESTS,
    };
    let mut resp = Response::new(RB::default());
    *resp.status_mut() = status;
    if status == StatusCode::TOO_MANY_REQUESTS {
        let ms = d.retry_after().map_or(0, |r| r.as_millis() as u64);
        resp.headers_mut().insert(
            http::header::RETRY_AFTER,
            HeaderValue::from(retry_after_secs(ms)),
        );
        add_headers(client, cache, d, resp.headers_mut());
    }
    resp
}

/// `RateLimit-Policy`, `RateLimit` and the legacy three for the rule that
/// decided `d` (nothing when no rule did).
fn add_headers(
    client: &Client,
    cache: &RuleHeaderCache,
    d: &Decision,
    headers: &mut http::HeaderMap,
) {
    // Admitted from the leases: the rule is at hand. Otherwise (a slow
    // path answer names its rule by id) it is found in the rules in force.
    let in_force;
    let (set, i) = match d.rule_slot() {
        Some(slot) => slot,
        None => {
            let Some(id) = d.rule_id() else {
                return;
            };
            let Some(set) = client.rules() else {
                return;
            };
            in_force = set;
            let Some(i) = in_force.rules.iter().position(|r| r.id == id) else {
                return;
            };
            (&in_force, i)
        }
    };
    headers.reserve(5);
    cache.with(set, |c| {
        for (name, value) in &c.rules[i] {
            headers.insert(name.clone(), value.clone());
        }
    });
    let remaining = if d.allowed() { d.remaining() } else { 0 };
    let ms = d.retry_after().map_or(0, |r| r.as_millis() as u64);
    for (name, value) in LimitInfo::new(&set.rules[i], remaining, ms).answer_headers() {
        // The string's buffer becomes the value's (no copy).
        if let Ok(v) = HeaderValue::try_from(value) {
            headers.insert(HeaderName::from_static(name), v);
        }
    }
}

/// The headers of every rule that depend on the rule alone
/// (`RateLimit-Policy`, `RateLimit-Limit`), for the rule set in force:
/// built on the first answer under a rule set, then cloned (a reference
/// count) instead of formatted on every response. Shared by a layer's
/// services.
#[derive(Default)]
struct RuleHeaderCache(ArcSwapOption<RuleHeaderSet>);

/// One rule set's rule headers, by rule index.
struct RuleHeaderSet {
    set: Arc<RuleSet>,
    rules: Vec<Vec<(HeaderName, HeaderValue)>>,
}

impl RuleHeaderCache {
    /// `f` on `set`'s rule headers (built when `set` is not the set
    /// cached: a rules change replaces the entry).
    fn with<R>(&self, set: &Arc<RuleSet>, f: impl FnOnce(&RuleHeaderSet) -> R) -> R {
        let cached = self.0.load();
        if let Some(c) = cached.as_ref() {
            if Arc::ptr_eq(&c.set, set) {
                return f(c);
            }
        }
        drop(cached);
        let rules = set
            .rules
            .iter()
            .map(|rule| {
                LimitInfo::new(rule, 0, 0)
                    .rule_headers()
                    .into_iter()
                    .filter_map(|(name, value)| {
                        Some((
                            HeaderName::from_static(name),
                            HeaderValue::try_from(value).ok()?,
                        ))
                    })
                    .collect()
            })
            .collect();
        let built = Arc::new(RuleHeaderSet {
            set: set.clone(),
            rules,
        });
        self.0.store(Some(built.clone()));
        f(&built)
    }
}

impl std::fmt::Debug for RuleHeaderCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RuleHeaderCache")
    }
}

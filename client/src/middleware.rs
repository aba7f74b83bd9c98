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

use http::header::{HeaderName, HeaderValue};
use http::{Request, Response, StatusCode};
use quotalease_model::headers::{retry_after_secs, LimitInfo};
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
}

impl Route {
    fn of<B>(&self, req: &Request<B>) -> String {
        match self {
            Route::Path => req.uri().path().to_owned(),
            Route::Fixed(r) => r.clone(),
        }
    }
}

/// The tenant from a request header (its value, which must be visible
/// ASCII), the route from the request path unless set; cost 1. A request
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
            Some(v) => v.to_str().ok()?.to_owned(),
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
}

impl PathKey {
    /// Every request is `tenant`, on its own path.
    pub fn new(tenant: impl Into<String>) -> Self {
        Self {
            tenant: tenant.into(),
        }
    }
}

impl<B> KeyExtractor<B> for PathKey {
    fn extract(&self, req: &Request<B>) -> Option<(Key, u32)> {
        Some((Key::new(self.tenant.clone(), req.uri().path()), 1))
    }
}

/// The layer: see the module docs.
#[derive(Clone, Debug)]
pub struct RateLimitLayer<K> {
    client: Client,
    extractor: K,
    headers_on_admitted: bool,
}

impl<K> RateLimitLayer<K> {
    /// Limit every request by `client`, keyed by `extractor`.
    pub fn new(client: Client, extractor: K) -> Self {
        Self {
            client,
            extractor,
            headers_on_admitted: true,
        }
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
        let key = self.extractor.extract(&req);
        let client = self.client.clone();
        let headers_on_admitted = self.headers_on_admitted;
        Box::pin(async move {
            let Some((key, cost)) = key else {
                return inner.call(req).await;
            };
            let d = client.check(&key, cost).await;
            if d.allowed() {
                let mut resp = inner.call(req).await?;
                if headers_on_admitted {
                    add_headers(&client, &d, resp.headers_mut());
                }
                return Ok(resp);
            }
            Ok(refusal(&client, &d))
        })
    }
}

/// The response to a request that was not admitted.
fn refusal<RB: Default>(client: &Client, d: &Decision) -> Response<RB> {
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
        add_headers(client, d, resp.headers_mut());
    }
    resp
}

/// `RateLimit-Policy`, `RateLimit` and the legacy three for the rule that
/// decided `d` (nothing when no rule did).
fn add_headers(client: &Client, d: &Decision, headers: &mut http::HeaderMap) {
    // Admitted from the leases: the rule is at hand. Otherwise (a slow
    // path answer names its rule by id) it is found in the rules in force.
    let rules;
    let rule = match d.rule_in_set() {
        Some(rule) => rule,
        None => {
            let Some(id) = d.rule_id() else {
                return;
            };
            let Some(set) = client.rules() else {
                return;
            };
            rules = set;
            let Some(rule) = rules.rules.iter().find(|r| r.id == id) else {
                return;
            };
            rule
        }
    };
    let remaining = if d.allowed() { d.remaining() } else { 0 };
    let ms = d.retry_after().map_or(0, |r| r.as_millis() as u64);
    for (name, value) in LimitInfo::new(rule, remaining, ms).headers() {
        // The string's buffer becomes the value's (no copy).
        if let Ok(v) = HeaderValue::try_from(value) {
            headers.insert(HeaderName::from_static(name), v);
        }
    }
}

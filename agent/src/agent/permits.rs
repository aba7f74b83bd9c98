//! Permits through the agent (SPEC §5 "Permits", docs/permits.md): an
//! acquire on the keys of every rule with `concurrency` that selects the
//! request, all or none, then the charge of its rate rules; renew and
//! release by key and permit id.

use std::time::Duration;

use quotalease_model::key::KeyId;

use super::*;
use crate::permit_driver::{
    permit_rules_for, HeldPermit, PermitError, PermitRef, PermitStatus, Permits, PermitsConfig,
};

/// An acquire.
#[derive(Clone, Copy, Debug)]
pub struct AcquireInput<'a> {
    /// Tenant id.
    pub tenant: &'a str,
    /// Route id.
    pub route: &'a str,
    /// Rule namespace (Envoy domain), if any.
    pub domain: Option<&'a str>,
    /// Slots to take (0 means 1); at most each rule's `N`.
    pub slots: u64,
    /// How long to wait for free slots.
    pub wait: Duration,
    /// The caller's id for this acquire ("" = none): a retry with the same
    /// id (tenant, route and slots) gets the same permits while they are
    /// held, instead of new ones.
    pub request_id: &'a str,
}

/// What an acquire got: one permit per rule with `concurrency` that
/// selects the request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Acquired {
    /// The permits, in the rules' file order.
    pub permits: Vec<HeldPermit>,
}

impl Agent {
    pub(super) fn permits_config(&self) -> PermitsConfig {
        let cfg = &self.inner.cfg;
        PermitsConfig {
            agent_id: cfg.agent_id.clone(),
            // A holder of its own at the allocator (see the driver's docs).
            instance: self.inner.instance ^ 0x5045_524d_4954_5321,
            incarnation: self.incarnation(),
            cluster: cfg.cluster.clone(),
            lease_ttl: cfg.lease_ttl,
            epsilon: cfg.epsilon,
            fetch_timeout: cfg.fetch_timeout,
            clock: cfg.clock.clone(),
            metrics: self.inner.metrics.clone(),
        }
    }

    /// How long an acquire that names no wait waits: the agent's fetch
    /// timeout (a key's first acquire at an agent needs a round trip).
    pub fn default_permit_wait(&self) -> Duration {
        self.inner.cfg.fetch_timeout
    }

    fn permits(&self) -> Result<&Permits, PermitError> {
        self.inner.permits.get().ok_or_else(|| {
            PermitError::Check("this agent has no permit driver (Agent::start starts one)".into())
        })
    }

    /// Take a permit on the key of every rule with `concurrency` that
    /// selects the request, waiting up to `input.wait` for free slots in
    /// arrival order; then charge its rate rules, if any. All or none: a
    /// timeout or a rate denial releases what was taken.
    pub async fn acquire(&self, input: AcquireInput<'_>) -> Result<Acquired, PermitError> {
        let permits = self.permits()?;
        let request = (!input.request_id.is_empty()).then(|| {
            format!(
                "{}\u{0}{}\u{0}{}\u{0}{}",
                input.request_id, input.tenant, input.route, input.slots
            )
        });
        if let Some(got) = request.as_deref().and_then(|r| permits.remembered(r)) {
            return Ok(Acquired { permits: got });
        }
        let Some(rules) = self.rules() else {
            return Err(PermitError::Check("no rules known yet".into()));
        };
        let selected = permit_rules_for(&rules, input.domain, input.tenant, input.route);
        if selected.is_empty() {
            return Err(PermitError::NoRule);
        }
        let slots = input.slots.max(1);
        let deadline = tokio::time::Instant::now() + input.wait;
        let mut taken: Vec<HeldPermit> = Vec::with_capacity(selected.len());
        for rule in selected {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match permits
                .acquire(rule, input.tenant, input.route, slots, left)
                .await
            {
                Ok(p) => taken.push(p),
                Err(e) => {
                    self.release_all(&taken);
                    return Err(e);
                }
            }
        }
        let rates = rules
            .match_rules(input.domain, input.tenant, input.route)
            .map_err(|e| PermitError::Check(e.to_string()))?;
        if !rates.is_empty() {
            let checked = self
                .check(CheckInput {
                    tenant: input.tenant,
                    route: input.route,
                    cost: 1,
                    request_id: "",
                    domain: input.domain,
                })
                .await;
            match checked {
                Ok(r) if r.allowed => {}
                Ok(r) => {
                    self.release_all(&taken);
                    return Err(PermitError::RateLimited {
                        rule_id: r.rule_id,
                        retry_after_ms: r.retry_after_ms,
                    });
                }
                Err(e) => {
                    self.release_all(&taken);
                    return Err(PermitError::Check(match e {
                        CheckError::Invalid { field, reason } => format!("{field}: {reason}"),
                        CheckError::Unavailable(why) => why,
                    }));
                }
            }
        }
        if let Some(r) = request {
            permits.remember(r, &taken);
        }
        Ok(Acquired { permits: taken })
    }

    fn release_all(&self, taken: &[HeldPermit]) {
        if let Ok(p) = self.permits() {
            for h in taken {
                p.release(&h.key, h.permit.id);
            }
        }
    }

    /// Extend a permit by its rule's permit TTL (within its lease's use-by
    /// and `max_hold`): its new expiry (agent clock, ns). A permit past its
    /// expiry or released answers [`PermitError::Expired`] and is never
    /// revived.
    pub fn renew_permit(&self, key: &KeyId, id: u64) -> Result<u64, PermitError> {
        self.permits()?.renew(key, id)
    }

    /// Release a permit (idempotent): whether it was held here.
    pub fn release_permit(&self, key: &KeyId, id: u64) -> bool {
        self.permits().is_ok_and(|p| p.release(key, id))
    }

    /// The id a client is given for a permit of this agent's (its text
    /// form names this agent's permit holder, the key and the permit).
    pub fn permit_id(&self, p: &HeldPermit) -> String {
        match self.permits() {
            Ok(permits) => permits.permit_ref(p).encode(),
            Err(_) => String::new(),
        }
    }

    /// Renew a permit by its id: where it stands. `Err` names what is
    /// wrong with the id.
    pub fn renew_permit_id(&self, id: &str) -> Result<PermitStatus, String> {
        let r = PermitRef::decode(id)?;
        let permits = self.permits().map_err(|e| e.to_string())?;
        Ok(permits.renew_ref(&r))
    }

    /// Release a permit by its id (idempotent): `Held` when it was held
    /// here and is released now; a permit of another agent's is forwarded
    /// through the allocator (`Forwarded`; `NotHere` when the allocator
    /// knows no such holder of this agent's principal). `Err` names what
    /// is wrong with the id; the inner `Err` why the release could not
    /// be forwarded (the allocator unreachable: the permit frees at its
    /// expiry).
    pub async fn release_permit_id(
        &self,
        id: &str,
    ) -> Result<Result<PermitStatus, PermitError>, String> {
        let r = PermitRef::decode(id)?;
        let permits = self.permits().map_err(|e| e.to_string())?;
        Ok(match permits.release_ref(&r) {
            PermitStatus::NotHere => permits.forward_release(&r).await,
            status => Ok(status),
        })
    }

    /// The permits of `key` held here now.
    pub fn permits_held(&self, key: &KeyId) -> Vec<crate::permits::Permit> {
        self.permits().map(|p| p.held(key)).unwrap_or_default()
    }
}

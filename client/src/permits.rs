//! Permits of rules with `concurrency` (SPEC §5 "Permits", issue 34):
//! [`Client::acquire`] waits for a permit on every concurrency rule that
//! selects a key and returns a [`Permit`], released when dropped.
//!
//! The allocator must be a release that serves slot leases (older ones
//! answer no rule with `concurrency`). A permit never outlives the slot
//! lease it stands on:
//! with an allocator's default `TTL_max` (2 s) renew it about every second
//! ([`Permit::expiring`] says when), whatever the rule's `permit_ttl`.

use std::time::Duration;

use quotalease_agent::agent::AcquireInput;
use quotalease_agent::permit_driver::{HeldPermit, PermitError};

use crate::{Client, Key};

/// Does nothing: rules with `concurrency` are read and served by default
/// since in-flight limits left their experimental gate (docs/permits.md).
/// Kept so that code written against the gated releases still builds.
#[deprecated(note = "permits are served by default; this does nothing")]
pub fn enable_experimental_permits() {}

/// Why an acquire got no permit. Nothing is held after any of them.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AcquireError {
    /// No rule with `concurrency` selects the key.
    #[error("no rule with concurrency matches the key")]
    NoRule,
    /// No slot was free before the wait ended: try again after
    /// `retry_after` (the agent's estimate from its place in the queue and
    /// how fast it has been starting permits on the key).
    #[error("no slot was free before the wait ended; retry after {retry_after:?}")]
    Timeout {
        /// When to try again.
        retry_after: Duration,
    },
    /// A rate rule of the key denied the request (the permits taken were
    /// given back).
    #[error("rate limited by rule {rule_id}; retry after {retry_after:?}")]
    RateLimited {
        /// The denying rule.
        rule_id: String,
        /// When to try again.
        retry_after: Duration,
    },
    /// The request is invalid (more slots than the rule allows, an id too
    /// long): the reason names the field.
    #[error("{0}")]
    Invalid(String),
    /// The client cannot decide now (no rules yet, stopping).
    #[error("{0}")]
    Unavailable(String),
}

impl From<PermitError> for AcquireError {
    fn from(e: PermitError) -> Self {
        match e {
            PermitError::NoRule => AcquireError::NoRule,
            PermitError::Timeout { retry_after_ms } => AcquireError::Timeout {
                retry_after: Duration::from_millis(retry_after_ms),
            },
            PermitError::RateLimited {
                rule_id,
                retry_after_ms,
            } => AcquireError::RateLimited {
                rule_id,
                retry_after: Duration::from_millis(retry_after_ms),
            },
            PermitError::Invalid(why) => AcquireError::Invalid(format!("slots: {why}")),
            other => AcquireError::Unavailable(other.to_string()),
        }
    }
}

/// The permit is past its expiry (or was released): it is never revived.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the permit expired")]
pub struct PermitLost;

/// A permit held on every concurrency rule of a key; released when
/// dropped (or by [`Permit::release`]).
#[derive(Debug)]
#[must_use = "a permit is released when dropped"]
pub struct Permit {
    client: Client,
    held: Vec<HeldPermit>,
}

impl Permit {
    /// Its fencing token (of the first rule's permit): grows per key with
    /// every slot lease its permits stand on, so a service that remembers
    /// the largest it saw can refuse work of a holder whose permit expired.
    pub fn fencing_token(&self) -> u64 {
        self.held.first().map_or(0, |h| h.permit.fence)
    }

    /// Granted by a fail-open rule's emergency semaphore while the
    /// allocator was unreachable: not counted against `N`.
    pub fn is_failure_mode(&self) -> bool {
        self.held.iter().any(|h| h.failure_mode)
    }

    /// How long it is held unless renewed (0 once expired).
    pub fn expires_in(&self) -> Duration {
        let now = self.client.agent.now();
        let expiry = self
            .held
            .iter()
            .map(|h| h.permit.expiry_ns)
            .min()
            .unwrap_or(now);
        Duration::from_nanos(expiry.saturating_sub(now))
    }

    /// Whether it is past its expiry.
    pub fn is_expired(&self) -> bool {
        self.expires_in().is_zero()
    }

    /// Extend it by its rules' permit TTL (within its slot lease's use-by
    /// and `max_hold`): how long it is held now.
    pub fn renew(&mut self) -> Result<Duration, PermitLost> {
        for h in &mut self.held {
            let expiry = self
                .client
                .agent
                .renew_permit(&h.key, h.permit.id)
                .map_err(|_| PermitLost)?;
            h.permit.expiry_ns = expiry;
        }
        Ok(self.expires_in())
    }

    /// Resolves `margin` before its expiry: the time to [`Permit::renew`]
    /// (at once when that is past). Renewing moves the expiry; call again.
    pub async fn expiring(&self, margin: Duration) {
        let left = self.expires_in().saturating_sub(margin);
        tokio::time::sleep(left).await;
    }

    /// Give it back now: whether it was still held.
    pub fn release(mut self) -> bool {
        self.give_back()
    }

    fn give_back(&mut self) -> bool {
        let mut held = false;
        for h in self.held.drain(..) {
            held |= self.client.agent.release_permit(&h.key, h.permit.id);
        }
        held
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.give_back();
    }
}

impl Client {
    /// Acquire one slot of every concurrency rule that selects `key`,
    /// waiting up to the client's deadline for free slots (in arrival
    /// order), then charge its rate rules once. See [`Client::acquire_with`].
    pub async fn acquire(&self, key: &Key) -> Result<Permit, AcquireError> {
        self.acquire_with(key, 1, self.deadline).await
    }

    /// Acquire `slots` (at most each rule's `N`) of every concurrency rule
    /// that selects `key`, waiting up to `wait`; all or none. A future
    /// dropped while it waits holds nothing.
    pub async fn acquire_with(
        &self,
        key: &Key,
        slots: u64,
        wait: Duration,
    ) -> Result<Permit, AcquireError> {
        let got = self
            .agent
            .acquire(AcquireInput {
                tenant: key.tenant(),
                route: key.route(),
                domain: key.domain.as_deref(),
                slots,
                wait,
                request_id: "",
            })
            .await?;
        Ok(Permit {
            client: self.clone(),
            held: got.permits,
        })
    }
}

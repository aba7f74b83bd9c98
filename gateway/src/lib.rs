//! quotalease gateway faces: how gateways reach an [`Agent`] — the
//! `quotalease.v1` gRPC Check service and the admin HTTP server
//! ([`service`]), Envoy's rate limit service v3 ([`envoy`]), HTTP
//! `/v1/check` ([`http_api`]) and the rate-limit headers they share
//! ([`headers`]).
//!
//! Each face only translates its protocol to [`Agent::check`] and back; the
//! decisions are the agent's. A Rust gateway linking the agent directly
//! needs none of this.
#![warn(missing_docs)]

pub mod envoy;
pub mod headers;
pub mod http_api;
pub mod service;

pub use quotalease_agent::Agent;

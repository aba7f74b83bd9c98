//! quotalease allocator: owns each key's global token bucket and hands out
//! short-lived leases of tokens (SPEC §1, §2).
//!
//! The sans-IO cores live in `quotalease-allocator-core` and are
//! re-exported here under their old paths ([`core`], [`ledger`],
//! [`regional`], [`reservations`], [`term`], [`durable`], [`leadership`]);
//! this crate is their tokio, tonic and axum drivers: [`server`] the lease
//! service and admin HTTP, [`upstream`] a regional's parent loop,
//! [`reservation_log`] the write-ahead log's writer, [`metrics`] the
//! `/metrics` snapshot.
#![warn(missing_docs)]

pub use quotalease_allocator_core::{
    core, durable, leadership, ledger, regional, reservations, slots, term,
};

pub mod metrics;
pub mod reservation_log;
pub mod server;
pub mod upstream;

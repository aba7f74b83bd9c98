//! quotalease allocator: owns each key's global token bucket and hands out
//! short-lived leases of tokens (SPEC §1, §2).
//!
//! Sans-IO cores ([`ledger`], [`core`], [`regional`], over
//! `quotalease_model`'s token bucket and rules) take time and messages as
//! arguments; [`server`] is the thin tokio/tonic/axum driver.
#![warn(missing_docs)]

pub mod core;
pub mod durable;
pub mod leadership;
pub mod ledger;
pub mod metrics;
pub mod regional;
pub mod reservation_log;
pub mod reservations;
pub mod server;
pub mod term;
pub mod upstream;

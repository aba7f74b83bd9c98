//! quotalease allocator: owns each key's global token bucket and hands out
//! short-lived leases of tokens (SPEC §1, §2).
//!
//! Sans-IO cores ([`ledger`], [`core`], [`regional`], over
//! `quotalease_model`'s token bucket and rules) take time and messages as
//! arguments; [`server`] is the thin tokio/tonic/axum driver.
#![warn(missing_docs)]
// Clocks, spawns, sleeps and files are denied in the sans-IO modules only
// (each says so; the list is in clippy.toml); drivers need them.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

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

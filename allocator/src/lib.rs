//! quotalease allocator: owns each key's global token bucket and hands out
//! short-lived leases of tokens (SPEC §1, §2).
//!
//! Sans-IO cores ([`bucket`], [`ledger`], [`core`], [`regional`]) take time and messages as
//! arguments; [`server`] is the thin tokio/tonic/axum driver.
#![warn(missing_docs)]

pub mod bucket;
pub mod clock;
pub mod core;
pub mod ledger;
pub mod regional;
pub mod rules;
pub mod server;
pub mod upstream;

//! quotalease agent: the sidecar that answers "may this request pass?" from
//! leased tokens in memory and renews them in the background (SPEC §1, §2, §5).
//!
//! Link it into a Rust gateway with [`Agent::start`] and [`Agent::check`],
//! or run it as `quotalease agent`. The gateway faces (gRPC Check, Envoy RLS,
//! HTTP `/v1/check`, admin HTTP) are in the `quotalease-gateway` crate.
#![warn(missing_docs)]
// Clocks, spawns, sleeps and files are denied in the sans-IO core only
// (`core.rs`; the list is in clippy.toml); drivers need them.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

pub mod agent;
pub mod core;
pub(crate) mod driver;
pub(crate) mod handle;
pub mod idempotency;
pub mod lease_table;
pub mod metrics;
pub mod permit_driver;
pub mod permits;
pub mod renewal;
pub(crate) mod shapes;
pub mod snapshot;
pub mod transport;

pub use agent::{Agent, AgentConfig, CheckError, CheckInput, KeyHandle};

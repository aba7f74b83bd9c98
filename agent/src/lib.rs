//! quotalease agent: the sidecar that answers "may this request pass?" from
//! leased tokens in memory and renews them in the background (SPEC §1, §2, §5).
//!
//! Link it into a Rust gateway with [`Agent::start`] and [`Agent::check`],
//! or run it as `quotalease agent`.
#![warn(missing_docs)]

pub mod agent;
pub mod core;
pub(crate) mod driver;
pub mod envoy;
pub mod headers;
pub mod http_api;
pub mod idempotency;
pub mod lease_table;
pub mod metrics;
pub mod renewal;
pub mod service;
pub mod transport;

pub use agent::{Agent, AgentConfig, CheckError, CheckInput};

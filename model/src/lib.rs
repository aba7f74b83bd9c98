//! quotalease model: what every quotalease process agrees on — the rules
//! and the one rule matcher, the token bucket, the clock, key ids, the
//! protocol constants (clock drift bound and the lease margin formula) and
//! the allocator endpoint settings.
//!
//! Everything here is sans-IO and shared by the allocator, the agent, the
//! gateway faces and the simulator. The YAML rule file parser is behind the
//! `yaml` feature (the allocator and the binary enable it; the agent does
//! not need it: it receives rules from its allocator). The Prometheus exposition
//! helpers are behind the `prometheus` feature.
#![warn(missing_docs)]

pub mod bucket;
pub mod clock;
pub mod endpoint;
#[cfg(feature = "prometheus")]
pub mod exposition;
pub mod headers;
pub mod key;
pub mod matching;
pub mod protocol;
pub mod rules;

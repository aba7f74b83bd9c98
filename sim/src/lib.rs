//! quotalease simulation support: the independent invariant checker used by
//! the demo and the end-to-end tests, and the deterministic pieces the
//! simulator's event loop is built from (random streams, network, workload,
//! scenarios, quality figures and report writers).
#![warn(missing_docs)]

pub mod checker;
pub mod failover;
pub mod fuzzing;
pub mod liveness;
pub mod net;
pub mod permits;
pub mod quality;
pub mod report;
pub mod rng;
pub mod runner;
pub mod scenario;
pub mod swarm;
pub mod workload;
pub mod world;

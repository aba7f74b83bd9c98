//! quotalease simulation support. For now: the independent invariant
//! checker used by the demo and the end-to-end tests. The deterministic
//! simulator grows here with the simulation issue.
#![warn(missing_docs)]

pub mod checker;

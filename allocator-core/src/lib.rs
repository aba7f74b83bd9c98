//! quotalease allocator cores (SPEC §1, §2, §7), sans-IO: they take time
//! and messages as arguments and return what to send; they never read a
//! clock, spawn, sleep or touch files (a clippy rule, `clippy.toml`,
//! denied for the whole crate). The drivers (tokio and tonic in
//! `quotalease-allocator`, etcd in the binary, the simulator) pump them.
//!
//! [`ledger`] the per-key ledger; [`core`] the allocator state machine;
//! [`regional`] the regional allocator (chains of parent leases over a
//! pooled core); [`reservations`] the write-ahead promises; [`slots`] the slot ledger of a
//! concurrency key (permits, not wired in yet); [`term`] how a
//! start or an election resumes from what is durable; [`durable`] the
//! durable formats; [`leadership`] the serving gate of `--etcd` replicas.
#![warn(missing_docs)]
#![deny(clippy::disallowed_methods, clippy::disallowed_types)]

pub mod core;
pub mod durable;
pub mod leadership;
pub mod ledger;
pub mod regional;
pub mod reservations;
pub mod slots;
pub mod term;

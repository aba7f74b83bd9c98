//! Generated protobuf and gRPC code for quotalease: the agent's public
//! `quotalease.v1` API and the allocator lease protocol.
#![allow(missing_docs, clippy::all)]

/// The agent's public API (SPEC §5).
pub mod v1 {
    tonic::include_proto!("quotalease.v1");
}

/// The allocator <-> agent lease protocol.
pub mod lease {
    tonic::include_proto!("quotalease.lease.v1");
}

/// Protocol version spoken by this build. Adjacent versions interoperate:
/// an allocator accepts `PROTOCOL_VERSION - 1 ..= PROTOCOL_VERSION + 1`.
pub const PROTOCOL_VERSION: u32 = 1;

/// Largest gRPC message either side decodes (SPEC §8).
pub const MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;

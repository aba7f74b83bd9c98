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

/// Envoy's rate limit service API v3, from our own wire-compatible copy of
/// its messages.
pub mod envoy {
    /// `envoy.service.ratelimit.v3`
    pub mod service {
        /// `envoy.service.ratelimit`
        pub mod ratelimit {
            /// `envoy.service.ratelimit.v3`
            pub mod v3 {
                tonic::include_proto!("envoy.service.ratelimit.v3");
            }
        }
    }
    /// `envoy.extensions.common.ratelimit.v3`
    pub mod extensions {
        /// `envoy.extensions.common`
        pub mod common {
            /// `envoy.extensions.common.ratelimit`
            pub mod ratelimit {
                /// `envoy.extensions.common.ratelimit.v3`
                pub mod v3 {
                    tonic::include_proto!("envoy.extensions.common.ratelimit.v3");
                }
            }
        }
    }
    /// `envoy.config.core.v3`
    pub mod config {
        /// `envoy.config.core`
        pub mod core {
            /// `envoy.config.core.v3`
            pub mod v3 {
                tonic::include_proto!("envoy.config.core.v3");
            }
        }
    }
    /// `envoy.type.v3`
    pub mod r#type {
        /// `envoy.type.v3`
        pub mod v3 {
            include!(concat!(env!("OUT_DIR"), "/envoy.r#type.v3.rs"));
        }
    }
}

/// Protocol version spoken by this build. Adjacent versions interoperate:
/// an allocator accepts `PROTOCOL_VERSION - 1 ..= PROTOCOL_VERSION + 1`.
/// Version 2 added `RequestHeader.instance`, `LeaseReply.request_digest`
/// and `GrantStatus::SeqConflict`; version 1 peers leave them 0.
pub const PROTOCOL_VERSION: u32 = 2;

/// A fresh random `RequestHeader.instance` (never 0): std's `RandomState`
/// keys come from the operating system's random source, mixed with the
/// process id and the wall clock so that even a failed random source
/// gives processes distinct values.
pub fn random_instance() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    let wall = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    h.write_u128(wall);
    h.finish().max(1)
}

/// A digest of a whole lease batch (header included), the same on every
/// process and every build: 64-bit FNV-1a over its protobuf encoding
/// (prost encodes fields in tag order, so equal messages give equal
/// bytes). The allocator keeps it beside each cached reply and refuses a
/// repeated sequence number whose digest differs; replies echo it so an
/// agent can tell a reply to its own request from any other. It guards
/// against mistakes, not adversaries.
pub fn request_digest(batch: &lease::LeaseBatch) -> u64 {
    use prost::Message;
    let bytes = batch.encode_to_vec();
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    // 0 means "no digest" on the wire.
    h.max(1)
}

/// Largest gRPC message either side decodes (SPEC §8).
pub const MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;

/// The settings of a client endpoint for an allocator; the numbers live in
/// `quotalease_model::endpoint::settings`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EndpointSettings {
    /// Bound of establishing the connection.
    pub connect_timeout: std::time::Duration,
    /// Bound of one call.
    pub call_timeout: std::time::Duration,
    /// HTTP/2 keep-alive ping interval (pings also while idle).
    pub keep_alive_interval: std::time::Duration,
    /// A connection whose ping is unanswered this long is dropped.
    pub keep_alive_timeout: std::time::Duration,
}

/// The one builder of the tonic endpoint every quotalease client uses for
/// an allocator at `url` (the agent's and the regional upstream's), lazily
/// connected by the caller, with TCP_NODELAY set. Errs when `url` is not a
/// valid URI.
pub fn endpoint(
    url: &str,
    s: &EndpointSettings,
) -> Result<tonic::transport::Endpoint, tonic::transport::Error> {
    Ok(tonic::transport::Endpoint::from_shared(url.to_string())?
        .connect_timeout(s.connect_timeout)
        .timeout(s.call_timeout)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(s.keep_alive_interval)
        .keep_alive_timeout(s.keep_alive_timeout)
        .keep_alive_while_idle(true))
}

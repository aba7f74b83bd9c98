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
pub const PROTOCOL_VERSION: u32 = 1;

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

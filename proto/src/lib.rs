//! Generated protobuf and gRPC code for quotalease: the agent's public
//! `quotalease.v1` API and the allocator lease protocol. The gRPC layer
//! (tonic clients and servers, `follow`, `endpoint`) is the `grpc`
//! feature; without it, the messages alone.
#![allow(missing_docs, clippy::all)]

/// The agent's public API (SPEC §5).
pub mod v1 {
    include!(concat!(env!("OUT_DIR"), "/quotalease.v1.rs"));
}

/// A lease client that follows the allocator leader (SPEC §7).
#[cfg(feature = "grpc")]
pub mod follow;

/// The allocator <-> agent lease protocol.
pub mod lease {
    include!(concat!(env!("OUT_DIR"), "/quotalease.lease.v1.rs"));
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
                include!(concat!(env!("OUT_DIR"), "/envoy.service.ratelimit.v3.rs"));
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
                    include!(concat!(
                        env!("OUT_DIR"),
                        "/envoy.extensions.common.ratelimit.v3.rs"
                    ));
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
                include!(concat!(env!("OUT_DIR"), "/envoy.config.core.v3.rs"));
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
/// and `GrantStatus::SeqConflict`; version 1 peers leave them 0. Version 3
/// added leases that carry a rate (`LeaseItem.want_rate_utps` and `left`,
/// `Grant.rate_utps`, `capacity` and `version_of`): a version-2 peer never
/// asks for one and is never sent one. Version 4 added runs
/// (`RequestHeader.run_id` and `record_seq`, `LeaseReply.run_id` and
/// `record_seq`): a requester sends them only after a reply carried them,
/// so a version-3 allocator never meets them; a version-3 requester leaves
/// them 0 and is never checked.
pub const PROTOCOL_VERSION: u32 = 4;

/// The shard of a key among `count` shards (SPEC §7 "Sharding"): 64-bit
/// FNV-1a over `rule_id`, `tenant` and `route` (the key parts as the lease
/// protocol carries them), each followed by a 0xff byte (which UTF-8 never
/// contains), modulo `count`; 0 when `count` is 0 or 1. Part of the
/// protocol: agents and allocators of adjacent releases must agree (a test
/// pins values).
pub fn shard_of(rule_id: &str, tenant: &str, route: &str, count: u32) -> u32 {
    if count <= 1 {
        return 0;
    }
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in [rule_id, tenant, route] {
        for &b in part.as_bytes().iter().chain(std::iter::once(&0xffu8)) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    (h % u64::from(count)) as u32
}

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
/// against mistakes, not adversaries. Part of the protocol: adjacent
/// releases must compute the same value (a test pins one).
pub fn request_digest(batch: &lease::LeaseBatch) -> u64 {
    use prost::Message;
    thread_local! {
        // Reused: the allocator digests every batch it handles.
        static BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    BUF.with(|buf| {
        let mut buf = buf.borrow_mut();
        buf.clear();
        batch
            .encode(&mut *buf)
            .expect("encoding into a Vec cannot run out of room");
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for &b in buf.iter() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        // 0 means "no digest" on the wire.
        h.max(1)
    })
}

/// [`request_digest`] of `batch` as an allocator of protocol version 3
/// decodes it: without the version-4 header fields (`run_id`,
/// `record_seq`), which it drops. A requester that presented a run to an
/// allocator since downgraded matches its reply by this one.
pub fn request_digest_v3(batch: &lease::LeaseBatch) -> u64 {
    let mut b = batch.clone();
    if let Some(h) = &mut b.header {
        (h.run_id, h.record_seq) = (0, 0);
    }
    request_digest(&b)
}

/// [`request_digest`], [`request_digest_v3`] and the digest as an
/// allocator of protocol version 2 decodes `batch` (also without the
/// items' `want_rate_utps` and `left`), in that order: what a requester
/// matches a reply by when it does not know its parent's version. Equal to
/// computing each on its own, without copying the batch (a regional's
/// batch names every key it holds): the fields are zeroed in place for
/// each encoding and put back.
pub fn request_digests(batch: &mut lease::LeaseBatch) -> (u64, u64, u64) {
    let digest = request_digest(batch);
    let run = batch
        .header
        .as_ref()
        .map_or((0, 0), |h| (h.run_id, h.record_seq));
    let set_run = |b: &mut lease::LeaseBatch, run: (u64, u64)| {
        if let Some(h) = &mut b.header {
            (h.run_id, h.record_seq) = run;
        }
    };
    let v3 = if run == (0, 0) {
        digest
    } else {
        set_run(batch, (0, 0));
        request_digest(batch)
    };
    let v2 = if batch
        .items
        .iter()
        .all(|i| i.want_rate_utps == 0 && i.left == 0)
    {
        v3
    } else {
        set_run(batch, (0, 0));
        let kept: Vec<(u64, u64)> = batch
            .items
            .iter_mut()
            .map(|i| {
                (
                    std::mem::take(&mut i.want_rate_utps),
                    std::mem::take(&mut i.left),
                )
            })
            .collect();
        let v2 = request_digest(batch);
        for (i, (rate, left)) in batch.items.iter_mut().zip(kept) {
            (i.want_rate_utps, i.left) = (rate, left);
        }
        v2
    };
    set_run(batch, run);
    (digest, v3, v2)
}

/// The (run id, record sequence) a requester presents after `reply`,
/// having presented `held` of ledger `ledger` (SPEC §2 "First start"): the
/// newest run a reply carried, with the largest sequence of it. A reply of
/// another ledger starts over; one from an allocator that keeps no runs
/// (version 3) makes it present none, so that one never meets the fields;
/// a version-4 one without a run (a regional that has not heard from its
/// parent yet, a replica with `--etcd`) changes nothing.
pub fn newest_run(ledger: u64, held: (u64, u64), reply: &lease::LeaseReply) -> (u64, u64) {
    let held = if reply.ledger_id != 0 && reply.ledger_id != ledger {
        (0, 0)
    } else {
        held
    };
    match reply.run_id {
        0 if reply.protocol_version < 4 => (0, 0),
        0 => held,
        run if run == held.0 => (run, held.1.max(reply.record_seq)),
        run => (run, reply.record_seq),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_digests_at_once_equal_each_computed_on_its_own() {
        let item = |rate: u64, left: u64| lease::LeaseItem {
            rule_id: "r".into(),
            tenant: "t".into(),
            route: "/a".into(),
            spent: 3,
            want: 7,
            want_rate_utps: rate,
            left,
            ..Default::default()
        };
        for run in [(0, 0), (5, 9)] {
            for items in [
                vec![],
                vec![item(0, 0)],
                vec![item(0, 0), item(2_000_000, 4)],
            ] {
                let batch = lease::LeaseBatch {
                    header: Some(lease::RequestHeader {
                        seq: 11,
                        agent_id: "a".into(),
                        run_id: run.0,
                        record_seq: run.1,
                        ..Default::default()
                    }),
                    items,
                    ttl_ms: 2_000,
                    shard: 0,
                };
                let mut v2 = batch.clone();
                for i in &mut v2.items {
                    (i.want_rate_utps, i.left) = (0, 0);
                }
                let want = (
                    request_digest(&batch),
                    request_digest_v3(&batch),
                    request_digest_v3(&v2),
                );
                let mut b = batch.clone();
                assert_eq!(request_digests(&mut b), want, "{run:?}");
                assert_eq!(b, batch, "put back as it was");
            }
        }
    }

    #[test]
    fn the_shard_of_a_key_is_pinned_across_releases() {
        // Agents and allocators of adjacent releases must agree.
        for (key, two, seven, many) in [
            (("ha", "hot", "/api/ha"), 1, 0, 275),
            (("slow", "t1", "/api/slow"), 1, 1, 345),
            (("r", "", ""), 0, 4, 388),
        ] {
            let (r, t, p) = key;
            assert_eq!(shard_of(r, t, p, 2), two, "{key:?}");
            assert_eq!(shard_of(r, t, p, 7), seven, "{key:?}");
            assert_eq!(shard_of(r, t, p, 1024), many, "{key:?}");
            assert_eq!(shard_of(r, t, p, 1), 0);
            assert_eq!(shard_of(r, t, p, 0), 0);
        }
    }

    #[test]
    fn the_request_digest_is_pinned_across_releases() {
        let batch = lease::LeaseBatch {
            header: Some(lease::RequestHeader {
                agent_id: "a".into(),
                incarnation: 1,
                seq: 2,
                protocol_version: 2,
                rules_version: 3,
                instance: 4,
                ledger_id: 0,
                run_id: 0,
                record_seq: 0,
                cluster: String::new(),
                ledger_cluster: String::new(),
            }),
            items: vec![lease::LeaseItem {
                rule_id: "r".into(),
                tenant: "t".into(),
                want: 5,
                ..lease::LeaseItem::default()
            }],
            ttl_ms: 2000,
            shard: 0,
        };
        let d = request_digest(&batch);
        assert_eq!(d, request_digest(&batch.clone()));
        // FNV-1a over the encoding, written out once more.
        let fnv = prost::Message::encode_to_vec(&batch)
            .iter()
            .fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
                (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
            });
        assert_eq!(d, fnv.max(1));
        assert_eq!(
            d, PINNED_DIGEST,
            "changing the digest breaks adjacent releases"
        );
        let mut other = batch;
        other.items[0].want = 6;
        assert_ne!(request_digest(&other), d);
    }

    /// `request_digest` of the batch above, as protocol version 2 defines it.
    const PINNED_DIGEST: u64 = 323_750_039_298_753_092;
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

#[cfg(feature = "grpc")]
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

//! End to end: malformed, truncated and invalid-UTF-8 protobuf sent straight
//! onto the wire to the agent's and the allocator's gRPC methods get an error
//! status, never a crash, and the processes keep serving.

mod common;

use std::time::Duration;

use bytes::{Buf, BufMut};
use common::*;
use prost::Message;
use quotalease_proto::v1::CheckRequest;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::codegen::http::uri::PathAndQuery;
use tonic::transport::Channel;
use tonic::Status;

/// Sends and receives raw bytes as gRPC messages.
#[derive(Clone, Copy, Default)]
struct Raw;
struct RawEnc;
struct RawDec;

impl Codec for Raw {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawEnc;
    type Decoder = RawDec;
    fn encoder(&mut self) -> RawEnc {
        RawEnc
    }
    fn decoder(&mut self) -> RawDec {
        RawDec
    }
}

impl Encoder for RawEnc {
    type Item = Vec<u8>;
    type Error = Status;
    fn encode(&mut self, item: Vec<u8>, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

impl Decoder for RawDec {
    type Item = Vec<u8>;
    type Error = Status;
    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Vec<u8>>, Status> {
        let n = src.remaining();
        Ok(Some(src.copy_to_bytes(n).to_vec()))
    }
}

async fn raw(url: &str, path: &'static str, body: Vec<u8>) -> Result<Vec<u8>, Status> {
    let ch = Channel::from_shared(url.to_string())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut g = tonic::client::Grpc::new(ch);
    g.ready().await.unwrap();
    g.unary(
        tonic::Request::new(body),
        PathAndQuery::from_static(path),
        Raw,
    )
    .await
    .map(|r| r.into_inner())
}

const RULES: &str = r#"
rules:
  - id: api
    match: { tenant: "*", route: /api }
    rate: 100/s
    burst: 100
    fail_policy: lease_only
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_protobuf_gets_an_error_and_nothing_breaks() {
    let dir = tempdir("badpb");
    let rules = write_rules(&dir, RULES);
    let alloc = allocator(&rules, &dir.join("state"), None, "2s");
    wait_ok(alloc.http, "/readyz", Duration::from_secs(10));
    let a = agent("badpb-0", &alloc.url(), None, &[]);
    wait_ok(a.http, "/readyz", Duration::from_secs(10));

    let good = CheckRequest {
        tenant_id: "acme".into(),
        route_id: "/api".into(),
        cost: 1,
        ..Default::default()
    }
    .encode_to_vec();
    let check = "/quotalease.v1.RateLimiter/Check";
    let envoy = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";
    let lease = "/quotalease.lease.v1.Allocator/Lease";
    let truncated = good[..good.len() - 1].to_vec();
    // tenant_id (field 1) holding bytes that are not UTF-8.
    let not_utf8 = vec![0x0a, 0x02, 0xff, 0xfe];
    // A length prefix far beyond the message.
    let overlong = vec![0x0a, 0xff, 0xff, 0x03, b'x'];
    let garbage: Vec<u8> = (0..200u32).map(|i| (i * 97 % 251) as u8).collect();
    for (url, path) in [(a.url(), check), (a.url(), envoy), (alloc.url(), lease)] {
        for body in [&truncated, &not_utf8, &overlong, &garbage] {
            let r = raw(&url, path, body.clone()).await;
            let e = r.expect_err(&format!("{path} accepted malformed bytes {body:?}"));
            assert!(
                matches!(
                    e.code(),
                    tonic::Code::Internal | tonic::Code::InvalidArgument
                ),
                "{path}: {e:?}"
            );
        }
    }
    // Still serving: a valid check passes through the raw path too.
    let ok = raw(&a.url(), check, good).await.expect("valid check");
    let resp = quotalease_proto::v1::CheckResponse::decode(ok.as_slice()).unwrap();
    assert!(resp.allowed);
    let (st, _) = http_get(alloc.http, "/healthz");
    assert_eq!(st, 200);
}

//! End to end, the agent's HTTP check API (SPEC §5, §8): `POST /v1/check`
//! and `GET /v1/check` against real allocator and agent processes on
//! 127.0.0.1, with status codes, JSON bodies and rate-limit headers checked
//! on the wire.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

const RULES: &str = r#"
rules:
  - id: orders
    match: { tenant: "*", route: /api/orders }
    rate: 60/m
    burst: 20
    fail_policy: lease_only
  - id: login
    match: { tenant: "*", route: /api/login }
    rate: 5/m
    burst: 5
    fail_policy: closed
"#;

/// One HTTP answer: status, headers (names lowercased) and body.
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Answer {
    /// The value of header `name` (case-insensitive), if present.
    fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The value of header `name`, which must be present.
    fn must(&self, name: &str) -> &str {
        self.header(name)
            .unwrap_or_else(|| panic!("no {name} header in {:?}", self.headers))
    }

    fn json(&self) -> Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {:?}", self.body))
    }
}

/// Minimal raw-TCP HTTP/1.1 request (test helper): one request per
/// connection, `Connection: close`, the answer read to the end.
fn http_request(addr: SocketAddr, method: &str, path: &str, body: &[u8]) -> Answer {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).expect("connect http");
    s.set_read_timeout(Some(Duration::from_secs(10))).ok();
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n");
    if method != "GET" {
        req.push_str("Content-Type: application/json\r\n");
        req.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    req.push_str("\r\n");
    let mut bytes = req.into_bytes();
    bytes.extend_from_slice(body);
    // The server may answer (413) and close before reading a large body.
    let _ = s.write_all(&bytes);
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf);
    let text = String::from_utf8_lossy(&buf).into_owned();
    let (head, rest) = text
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no end of headers in {text:?}"));
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {text:?}"));
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let chunked = headers
        .iter()
        .any(|(n, v)| n == "transfer-encoding" && v.contains("chunked"));
    let body = if chunked {
        dechunk(rest)
    } else {
        rest.to_string()
    };
    Answer {
        status,
        headers,
        body,
    }
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).expect("chunk size");
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
    out
}

fn post(addr: SocketAddr, body: &str) -> Answer {
    http_request(addr, "POST", "/v1/check", body.as_bytes())
}

fn get(addr: SocketAddr, path: &str) -> Answer {
    http_request(addr, "GET", path, b"")
}

/// A 400 (or `status`) whose JSON error names `field`.
#[track_caller]
fn assert_invalid(a: &Answer, status: u16, field: &str) {
    assert_eq!(a.status, status, "{}", a.body);
    let j = a.json();
    assert_eq!(j["error"], "invalid", "{}", a.body);
    assert_eq!(j["field"], field, "{}", a.body);
    assert!(
        j["reason"].as_str().is_some_and(|r| !r.is_empty()),
        "{}",
        a.body
    );
}

#[test]
fn login_five_per_minute_answers_200_then_429_with_every_header() {
    let c = cluster("http-login", RULES, 1);
    let addr = c.agents[0].http;
    let start = Instant::now();
    let mut admitted = 0;
    let mut denied = 0;
    for _ in 0..10 {
        let a = post(addr, r#"{"tenant_id":"alice","route_id":"/api/login"}"#);
        assert_eq!(a.must("content-type"), "application/json");
        let j = a.json();
        match a.status {
            200 => {
                admitted += 1;
                assert_eq!(j["allowed"], true);
                assert_eq!(j["rule_id"], "login");
                assert_eq!(j["reason"], "OK");
                assert!(j["rule_version"].as_u64().is_some_and(|v| v > 0), "{j}");
                let remaining = j["remaining"].as_u64().expect("remaining");
                assert!(remaining < 5, "{j}");
                // SPEC §5: the key's global estimate, not the cold lease's
                // single token: the first login leaves 4 of 5.
                if admitted == 1 {
                    assert!(remaining >= 3, "{j}");
                }
                assert_eq!(a.must("RateLimit-Policy"), r#""login";q=5;w=60"#);
                assert_eq!(a.must("RateLimit"), format!(r#""login";r={remaining};t=0"#));
                assert_eq!(a.must("RateLimit-Limit"), "5");
                assert_eq!(a.must("RateLimit-Remaining"), remaining.to_string());
                assert_eq!(a.must("RateLimit-Reset"), "0");
                assert!(a.header("Retry-After").is_none());
            }
            429 => {
                denied += 1;
                assert_eq!(j["error"], "rate_limited", "{j}");
                assert_eq!(j["rule_id"], "login", "{j}");
                assert_eq!(j["reason"], "OVER_LIMIT", "{j}");
                let ms = j["retry_after_ms"].as_u64().expect("retry_after_ms");
                // One token comes back every 12 s: never an infinite wait.
                assert!((1..=12_000).contains(&ms), "{ms}");
                let secs: u64 = a.must("Retry-After").parse().expect("whole seconds");
                assert!(secs >= 1);
                assert_eq!(secs, ms.div_ceil(1000).max(1), "rounded up from {ms} ms");
                assert!(secs * 1000 >= ms && secs * 1000 - ms < 1000);
                assert_eq!(a.must("RateLimit-Policy"), r#""login";q=5;w=60"#);
                assert_eq!(a.must("RateLimit"), format!(r#""login";r=0;t={secs}"#));
                assert_eq!(a.must("RateLimit-Limit"), "5");
                assert_eq!(a.must("RateLimit-Remaining"), "0");
                assert_eq!(a.must("RateLimit-Reset"), secs.to_string());
            }
            s => panic!("status {s}: {}", a.body),
        }
    }
    // I1: at most B + R*T, and with a healthy allocator the whole burst.
    let bound = 5 + start.elapsed().as_secs() / 12;
    assert!(admitted >= 5 && admitted <= bound, "{admitted} > {bound}");
    assert_eq!(admitted + denied, 10);
}

#[test]
fn get_form_and_requests_that_match_no_rule() {
    let c = cluster("http-get", RULES, 1);
    let addr = c.agents[0].http;
    let a = get(addr, "/v1/check?tenant=bob&route=%2Fapi%2Forders&cost=2");
    assert_eq!(a.status, 200, "{}", a.body);
    let j = a.json();
    assert_eq!(j["allowed"], true);
    assert_eq!(j["rule_id"], "orders");
    assert_eq!(j["reason"], "OK");
    // 60/m with burst 20: the burst refills in 20 s (SPEC §5).
    assert_eq!(a.must("RateLimit-Policy"), r#""orders";q=20;w=20"#);
    // Cost 21 > burst 20: INVALID, never a retry time of infinity.
    let a = get(addr, "/v1/check?tenant=bob&route=/api/orders&cost=21");
    assert_invalid(&a, 400, "cost");
    // Query errors name the query parameter.
    assert_invalid(&get(addr, "/v1/check?route=/api/orders"), 400, "tenant");
    assert_invalid(&get(addr, "/v1/check"), 400, "tenant");
    assert_invalid(
        &get(addr, "/v1/check?tenant=b&route=/x&cost=abc"),
        400,
        "cost",
    );
    let long = "t".repeat(257);
    let a = get(addr, &format!("/v1/check?tenant={long}&route=/api/orders"));
    assert_invalid(&a, 400, "tenant");
    assert_invalid(&get(addr, "/v1/check?tenant=%ff&route=/x"), 400, "tenant");
    assert_invalid(
        &get(addr, "/v1/check?tenant=b&route=/x&colour=red"),
        400,
        "colour",
    );
    // No rule: admitted, NO_RULE, no rate-limit headers.
    for a in [
        get(addr, "/v1/check?tenant=bob&route=/elsewhere"),
        post(addr, r#"{"tenant_id":"bob","route_id":"/elsewhere"}"#),
    ] {
        assert_eq!(a.status, 200, "{}", a.body);
        let j = a.json();
        assert_eq!(j["reason"], "NO_RULE", "{j}");
        assert_eq!(j["rule_id"], "", "{j}");
        assert!(a.header("RateLimit-Policy").is_none());
    }
}

#[test]
fn bad_input_is_400_naming_the_field_and_charges_nothing() {
    let c = cluster("http-bad", RULES, 1);
    let addr = c.agents[0].http;
    let cases: &[(&str, &str)] = &[
        (r#"{tenant_id: "t"}"#, "body"),
        (r#"{"tenant_id":"t","route_id":"/api/lo"#, "body"),
        ("", "body"),
        ("[]", "body"),
        ("\"t\"", "body"),
        (r#"{"route_id":"/api/login"}"#, "tenant_id"),
        (r#"{"tenant_id":null,"route_id":"/api/login"}"#, "tenant_id"),
        (r#"{"tenant_id":"","route_id":"/api/login"}"#, "tenant_id"),
        (r#"{"tenant_id":"t"}"#, "route_id"),
        (
            r#"{"tenant_id":"t","route_id":"/api/login","cost":6}"#,
            "cost",
        ),
        (
            r#"{"tenant_id":"t","route_id":"/api/login","cost":"1"}"#,
            "cost",
        ),
        (
            r#"{"tenant_id":"t","route_id":"/api/login","cost":-1}"#,
            "cost",
        ),
        (
            r#"{"tenant_id":"t","route_id":"/api/login","cost":1.5}"#,
            "cost",
        ),
        (
            r#"{"tenant_id":"t","route_id":"/api/login","cost":99999999999}"#,
            "cost",
        ),
        (
            r#"{"tenant_id":"t","route_id":"/api/login","request_id":7}"#,
            "request_id",
        ),
        (
            r#"{"tenant_id":"t","route_id":"/api/login","tenant":"u"}"#,
            "tenant",
        ),
        (
            r#"{"tenant_id":"t","route_id":"/api/login","tenant_id":"u"}"#,
            "tenant_id",
        ),
    ];
    for (body, field) in cases {
        let a = post(addr, body);
        assert_invalid(&a, 400, field);
    }
    let long = "x".repeat(257);
    let a = post(
        addr,
        &format!(r#"{{"tenant_id":"{long}","route_id":"/api/login"}}"#),
    );
    assert_invalid(&a, 400, "tenant_id");
    let a = post(addr, &format!(r#"{{"tenant_id":"t","route_id":"{long}"}}"#));
    assert_invalid(&a, 400, "route_id");
    // Not UTF-8, deeply nested, and over the 64 KiB cap.
    let a = http_request(addr, "POST", "/v1/check", b"{\"tenant_id\":\"\xff\"}");
    assert_invalid(&a, 400, "body");
    let deep = format!("{}{}", "[".repeat(20_000), "]".repeat(20_000));
    assert_invalid(&post(addr, &deep), 400, "body");
    let huge = format!(
        r#"{{"tenant_id":"t","route_id":"/api/login","request_id":"{}"}}"#,
        "r".repeat(70 * 1024)
    );
    assert_invalid(&post(addr, &huge), 413, "body");
    // The agent is still up, and none of the above charged tenant "t".
    assert_eq!(http_get(addr, "/healthz").0, 200);
    let admitted = (0..5)
        .filter(|_| post(addr, r#"{"tenant_id":"t","route_id":"/api/login"}"#).status == 200)
        .count();
    assert_eq!(admitted, 5);
}

/// A `Content-Length` over the 64 KiB cap is answered 413 as soon as the
/// headers are read: the body (1 byte of a declared 99 999 999 999) is never
/// sent, and the answer does not wait for it.
#[test]
fn a_declared_length_over_the_cap_is_413_without_waiting_for_the_body() {
    let c = cluster("http-declared", RULES, 1);
    let addr = c.agents[0].http;
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).expect("connect http");
    s.set_read_timeout(Some(Duration::from_secs(5))).ok();
    let sent = Instant::now();
    s.write_all(
        b"POST /v1/check HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n\
          Content-Length: 99999999999\r\n\r\n{",
    )
    .expect("send the headers");
    // Read until the answer's headers and its declared body are in (the
    // connection may stay open: read_to_end would wait on it).
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let (status, body) = loop {
        let n = s.read(&mut chunk).unwrap_or_else(|e| {
            panic!(
                "no answer {:?} after the headers ({e}); read so far: {:?}",
                sent.elapsed(),
                String::from_utf8_lossy(&buf)
            )
        });
        assert!(
            n > 0,
            "closed without an answer: {:?}",
            String::from_utf8_lossy(&buf)
        );
        buf.extend_from_slice(&chunk[..n]);
        let text = String::from_utf8_lossy(&buf).into_owned();
        let Some((head, rest)) = text.split_once("\r\n\r\n") else {
            continue;
        };
        let len: usize = head
            .lines()
            .filter_map(|l| l.split_once(':'))
            .find(|(n, _)| n.eq_ignore_ascii_case("content-length"))
            .and_then(|(_, v)| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no Content-Length in {head:?}"));
        if rest.len() >= len {
            let status = head.split_whitespace().nth(1).unwrap_or("").to_string();
            break (status, rest[..len].to_string());
        }
    };
    assert_eq!(status, "413", "{body}");
    assert!(
        sent.elapsed() < Duration::from_secs(5),
        "{:?}",
        sent.elapsed()
    );
    let j: Value = serde_json::from_str(&body).expect("a JSON error");
    assert_eq!(j["error"], "invalid", "{body}");
    assert_eq!(j["field"], "body", "{body}");
    // The agent still answers.
    assert_eq!(http_get(addr, "/healthz").0, 200);
}

#[test]
fn closed_rule_without_allocator_is_503_and_lease_only_is_429() {
    let dir = tempdir("http-noalloc");
    let rules = write_rules(&dir, RULES);
    let dead = free_addr();
    let a = agent(
        "http-lonely",
        &format!("http://{dead}"),
        None,
        &["--rules", rules.to_str().unwrap()],
    );
    assert_eq!(http_get(a.http, "/readyz").0, 503);
    // closed: 503 limiter_unavailable.
    let r = post(a.http, r#"{"tenant_id":"t","route_id":"/api/login"}"#);
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.json()["error"], "limiter_unavailable");
    assert_eq!(r.must("Retry-After"), "1");
    let r = get(a.http, "/v1/check?tenant=t&route=/api/login");
    assert_eq!(r.status, 503, "{}", r.body);
    // lease_only: a clean denial, retry later.
    let r = post(a.http, r#"{"tenant_id":"t","route_id":"/api/orders"}"#);
    assert_eq!(r.status, 429, "{}", r.body);
    let j = r.json();
    assert_eq!(j["error"], "rate_limited");
    assert_eq!(j["reason"], "FAILURE_MODE_DENIED");
    assert_eq!(j["rule_id"], "orders");
    assert!(r.must("Retry-After").parse::<u64>().unwrap() >= 1);
    assert_eq!(r.must("RateLimit-Policy"), r#""orders";q=20;w=20"#);
    // Without bootstrap rules: 503 until the allocator is reached.
    let b = agent("http-lonelier", &format!("http://{dead}"), None, &[]);
    let r = post(b.http, r#"{"tenant_id":"t","route_id":"/api/orders"}"#);
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.json()["error"], "limiter_unavailable");
}

#[test]
fn a_repeated_request_id_charges_nothing() {
    let c = cluster("http-idem", RULES, 1);
    let addr = c.agents[0].http;
    let body = r#"{"tenant_id":"bob","route_id":"/api/login","request_id":"req-1"}"#;
    let start = Instant::now();
    let first = post(addr, body);
    assert_eq!(first.status, 200, "{}", first.body);
    for _ in 0..10 {
        let again = post(addr, body);
        assert_eq!(again.status, 200);
        assert_eq!(again.json(), first.json());
    }
    // The GET form is the same request: the same first answer.
    let again = get(
        addr,
        "/v1/check?tenant=bob&route=/api/login&request_id=req-1",
    );
    assert_eq!(again.status, 200);
    assert_eq!(again.json(), first.json());
    // Only one token of five was charged: four more distinct requests pass.
    let admitted = (0..6)
        .filter(|i| {
            let body =
                format!(r#"{{"tenant_id":"bob","route_id":"/api/login","request_id":"x{i}"}}"#);
            post(addr, &body).status == 200
        })
        .count() as u64;
    assert!(admitted >= 4 && admitted <= 4 + start.elapsed().as_secs() / 12);
    let (_, m) = http_get(addr, "/metrics");
    assert!(m.contains("quotalease_agent_replays_total 11"), "{m}");
}

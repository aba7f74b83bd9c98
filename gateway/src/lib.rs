//! quotalease gateway faces: how gateways reach an [`Agent`] — the
//! `quotalease.v1` gRPC Check service and the admin HTTP server
//! ([`service`]), Envoy's rate limit service v3 ([`envoy`]), HTTP
//! `/v1/check` ([`http_api`]) and the rate-limit headers they share
//! ([`headers`]).
//!
//! Each face only translates its protocol to [`Agent::check`] and back; the
//! decisions are the agent's. A Rust gateway linking the agent directly
//! needs none of this.
#![warn(missing_docs)]

pub mod envoy;
/// The rate-limit headers (moved to `quotalease_model::headers`, shared
/// with the client crate).
pub use quotalease_model::headers;
pub mod http_api;
pub mod permits;
pub mod service;

pub use quotalease_agent::Agent;

/// When a gRPC caller's answer is due (its `grpc-timeout`, e.g. Envoy's
/// rate limit filter `timeout`), less a fifth of it (at most 10 ms) for the
/// answer's way back; `None` without the header or with a malformed one.
/// Checks are decided by then ([`quotalease_agent::Agent::check_by`]).
pub fn grpc_deadline(md: &tonic::metadata::MetadataMap) -> Option<tokio::time::Instant> {
    let v = md.get("grpc-timeout")?.to_str().ok()?;
    let budget = parse_grpc_timeout(v)?;
    let margin = (budget / 5).min(std::time::Duration::from_millis(10));
    Some(tokio::time::Instant::now() + budget.saturating_sub(margin))
}

/// `grpc-timeout`'s value: at most 8 digits and a unit (H, M, S, m, u, n).
fn parse_grpc_timeout(v: &str) -> Option<std::time::Duration> {
    use std::time::Duration;
    let (digits, unit) = v.split_at(v.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.checked_mul(3600)?),
        "M" => Duration::from_secs(n.checked_mul(60)?),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

#[cfg(test)]
mod deadline_tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn grpc_timeouts_parse_and_bad_ones_do_not() {
        assert_eq!(parse_grpc_timeout("50m"), Some(Duration::from_millis(50)));
        assert_eq!(parse_grpc_timeout("2S"), Some(Duration::from_secs(2)));
        assert_eq!(parse_grpc_timeout("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(
            parse_grpc_timeout("250000u"),
            Some(Duration::from_millis(250))
        );
        for bad in ["", "m", "50", "50x", "-5m", "123456789m", "5 m"] {
            assert_eq!(parse_grpc_timeout(bad), None, "{bad:?}");
        }
    }
}

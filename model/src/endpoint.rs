//! The connection settings every quotalease gRPC client uses for an
//! allocator (an agent for its allocator, a regional allocator for its
//! parent): the numbers, as plain durations. The one builder of the tonic
//! endpoint is [`quotalease_proto::endpoint`].

use std::time::Duration;

use quotalease_proto::EndpointSettings;

/// HTTP/2 keep-alive ping interval (pings also while idle).
pub const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(1);
/// A ping unanswered for this many call timeouts drops the connection...
pub const KEEP_ALIVE_TIMEOUTS: u32 = 4;
/// ...but never sooner than this.
pub const MIN_KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(1);

/// The settings for a client whose calls (and connects) are bounded by
/// `timeout`: a connection whose pings go unanswered is dropped and the
/// next call reconnects, so a healed partition is noticed within about
/// 1 s + 4 timeouts instead of HTTP/2's default 20 s ping wait.
pub fn settings(timeout: Duration) -> EndpointSettings {
    EndpointSettings {
        connect_timeout: timeout,
        call_timeout: timeout,
        keep_alive_interval: KEEP_ALIVE_INTERVAL,
        keep_alive_timeout: (timeout * KEEP_ALIVE_TIMEOUTS).max(MIN_KEEP_ALIVE_TIMEOUT),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keep_alive_timeout_is_four_calls_at_least_a_second() {
        let s = settings(Duration::from_millis(250));
        assert_eq!(s.connect_timeout, Duration::from_millis(250));
        assert_eq!(s.call_timeout, Duration::from_millis(250));
        assert_eq!(s.keep_alive_interval, Duration::from_secs(1));
        assert_eq!(s.keep_alive_timeout, Duration::from_secs(1));
        assert_eq!(
            settings(Duration::from_secs(2)).keep_alive_timeout,
            Duration::from_secs(8)
        );
        assert_eq!(
            settings(Duration::from_millis(100)).keep_alive_timeout,
            Duration::from_secs(1)
        );
    }
}

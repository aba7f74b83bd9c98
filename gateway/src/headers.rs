//! Rate-limit response headers shared by the HTTP API and Envoy RLS: the
//! IETF httpapi ratelimit-headers draft structured fields (`RateLimit-Policy`,
//! `RateLimit`), the legacy `RateLimit-Limit/Remaining/Reset`, and
//! `Retry-After`.

use quotalease_model::rules::Rule;

/// What the headers describe: one rule's bucket as seen by this answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LimitInfo<'a> {
    /// Policy name: the rule id (ids are `[A-Za-z0-9_.:-]`, no escaping needed).
    pub policy: &'a str,
    /// Quota: the burst.
    pub quota: u64,
    /// Window: the rule's rate period in seconds.
    pub window_s: u64,
    /// Tokens left (in this agent's lease).
    pub remaining: u64,
    /// Seconds until a retry can pass (0 when admitted).
    pub reset_s: u64,
}

impl<'a> LimitInfo<'a> {
    /// For `rule`, with `remaining` tokens and a retry after `retry_after_ms`.
    pub fn new(rule: &'a Rule, remaining: u64, retry_after_ms: u64) -> Self {
        Self {
            policy: &rule.id,
            quota: rule.burst,
            window_s: rule.rate.period_s,
            remaining,
            reset_s: retry_after_ms.div_ceil(1000),
        }
    }

    /// The five rate-limit headers.
    pub fn headers(&self) -> [(&'static str, String); 5] {
        let p = self.policy;
        [
            (
                "ratelimit-policy",
                format!("\"{p}\";q={};w={}", self.quota, self.window_s),
            ),
            (
                "ratelimit",
                format!("\"{p}\";r={};t={}", self.remaining, self.reset_s),
            ),
            ("ratelimit-limit", self.quota.to_string()),
            ("ratelimit-remaining", self.remaining.to_string()),
            ("ratelimit-reset", self.reset_s.to_string()),
        ]
    }
}

/// `Retry-After` in whole seconds: rounded up, at least 1.
pub fn retry_after_secs(retry_after_ms: u64) -> u64 {
    retry_after_ms.div_ceil(1000).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_rounds_up_to_at_least_one_second() {
        assert_eq!(retry_after_secs(0), 1);
        assert_eq!(retry_after_secs(1), 1);
        assert_eq!(retry_after_secs(1000), 1);
        assert_eq!(retry_after_secs(1001), 2);
    }

    #[test]
    fn structured_fields() {
        let info = LimitInfo {
            policy: "orders",
            quota: 20,
            window_s: 60,
            remaining: 0,
            reset_s: 3,
        };
        let h = info.headers();
        assert_eq!(
            h[0],
            ("ratelimit-policy", "\"orders\";q=20;w=60".to_string())
        );
        assert_eq!(h[1], ("ratelimit", "\"orders\";r=0;t=3".to_string()));
        assert_eq!(h[4], ("ratelimit-reset", "3".to_string()));
    }
}

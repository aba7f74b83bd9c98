//! Rate-limit response headers shared by the HTTP API, Envoy RLS and the
//! client crate's middleware: the
//! IETF httpapi ratelimit-headers draft structured fields (`RateLimit-Policy`,
//! `RateLimit`), the legacy `RateLimit-Limit/Remaining/Reset`, and
//! `Retry-After`.

use crate::rules::Rule;
use quotalease_proto::v1::CheckResponse;

/// The `remaining` every interface reports for an answer (Envoy RLS
/// `limit_remaining`, `RateLimit` `r=`, `RateLimit-Remaining`): when
/// admitted, the agent's estimate of the key's *global* remaining tokens
/// (`CheckResponse.remaining`, see `SlotHead::global_remaining` in the
/// agent crate), never just its own lease's; 0 when denied (SPEC §5).
pub fn remaining_of(resp: &CheckResponse) -> u64 {
    if resp.allowed {
        resp.remaining
    } else {
        0
    }
}

/// What the headers describe: one rule's bucket as seen by this answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LimitInfo<'a> {
    /// Policy name: the rule id (ids are `[A-Za-z0-9_.:-]`, no escaping needed).
    pub policy: &'a str,
    /// Quota: the burst.
    pub quota: u64,
    /// Window: the seconds the rule's rate takes to refill the burst,
    /// rounded up ([`refill_window_secs`]): a token bucket of `q` tokens
    /// per `w` seconds on average, never more than `q` at once (SPEC §5).
    pub window_s: u64,
    /// The key's global remaining tokens as the agent estimates them (0 on
    /// a denial): [`remaining_of`].
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
            window_s: refill_window_secs(rule),
            remaining,
            reset_s: retry_after_ms.div_ceil(1000),
        }
    }

    /// For `rule` and the agent's answer `resp`: [`remaining_of`] it, a
    /// retry after its `retry_after_ms`.
    pub fn of_response(rule: &'a Rule, resp: &CheckResponse) -> Self {
        Self::new(rule, remaining_of(resp), resp.retry_after_ms)
    }

    /// The five rate-limit headers: [`LimitInfo::rule_headers`], then
    /// [`LimitInfo::answer_headers`].
    pub fn headers(&self) -> [(&'static str, String); 5] {
        let [policy, limit] = self.rule_headers();
        let [ratelimit, remaining, reset] = self.answer_headers();
        [policy, ratelimit, limit, remaining, reset]
    }

    /// The headers that depend on the rule alone (`RateLimit-Policy`,
    /// `RateLimit-Limit`): the same on every answer of a rule, so a caller
    /// may build them once per rule.
    pub fn rule_headers(&self) -> [(&'static str, String); 2] {
        [
            (
                "ratelimit-policy",
                format!("\"{}\";q={};w={}", self.policy, self.quota, self.window_s),
            ),
            ("ratelimit-limit", self.quota.to_string()),
        ]
    }

    /// The headers that depend on the answer (`RateLimit`,
    /// `RateLimit-Remaining`, `RateLimit-Reset`).
    pub fn answer_headers(&self) -> [(&'static str, String); 3] {
        [
            (
                "ratelimit",
                format!(
                    "\"{}\";r={};t={}",
                    self.policy, self.remaining, self.reset_s
                ),
            ),
            ("ratelimit-remaining", self.remaining.to_string()),
            ("ratelimit-reset", self.reset_s.to_string()),
        ]
    }
}

/// The `w` of `RateLimit-Policy`: the seconds `rule`'s rate takes to refill
/// its burst, `ceil(burst * period / tokens)`, at least 1 (10/s with burst
/// 20 is `w=2`; 5/m with burst 5 is `w=60`). Computed in `u128`, so it
/// cannot overflow; saturates at `u64::MAX` (unreachable with valid rules).
pub fn refill_window_secs(rule: &Rule) -> u64 {
    let num = u128::from(rule.burst) * u128::from(rule.rate.period_s);
    let den = u128::from(rule.rate.tokens.max(1));
    u64::try_from(num.div_ceil(den).max(1)).unwrap_or(u64::MAX)
}

/// `Retry-After` in whole seconds: rounded up, at least 1.
pub fn retry_after_secs(retry_after_ms: u64) -> u64 {
    retry_after_ms.div_ceil(1000).max(1)
}

#[cfg(all(test, feature = "yaml"))]
mod tests {
    use super::*;

    #[test]
    fn retry_after_rounds_up_to_at_least_one_second() {
        assert_eq!(retry_after_secs(0), 1);
        assert_eq!(retry_after_secs(1), 1);
        assert_eq!(retry_after_secs(1000), 1);
        assert_eq!(retry_after_secs(1001), 2);
    }

    fn rule(rate: &str, burst: u64) -> Rule {
        crate::rules::RuleSet::parse(
            &format!(
                "rules:\n  - id: orders\n    match: {{ tenant: \"*\" }}\n    rate: {rate}\n    burst: {burst}\n"
            ),
            "test",
            1,
        )
        .expect("valid rules")
        .rules
        .remove(0)
    }

    #[test]
    fn the_policy_window_is_the_time_the_rate_takes_to_refill_the_burst() {
        // 10/s with burst 20: 20 tokens per 2 s, not 20 per 1 s.
        let r = rule("10/s", 20);
        assert_eq!(refill_window_secs(&r), 2);
        assert_eq!(
            LimitInfo::new(&r, 20, 0).headers()[0],
            ("ratelimit-policy", "\"orders\";q=20;w=2".to_string())
        );
        // Rounded up: 10 tokens at 3/s take 3.33 s.
        assert_eq!(refill_window_secs(&rule("3/s", 10)), 4);
        // A burst below the rate per second still says at least 1 s.
        assert_eq!(refill_window_secs(&rule("100/s", 10)), 1);
        // Burst equal to the rate per period: the period.
        assert_eq!(refill_window_secs(&rule("5/m", 5)), 60);
        assert_eq!(refill_window_secs(&rule("600/m", 200)), 20);
        // The slowest rate with a huge burst does not overflow.
        let mut r = rule("1/d", 1);
        r.burst = u64::MAX;
        assert_eq!(refill_window_secs(&r), u64::MAX);
    }

    #[test]
    fn remaining_is_the_agents_global_estimate_and_zero_on_a_denial() {
        let rule = crate::rules::RuleSet::parse(
            "rules:\n  - id: orders\n    match: { tenant: \"*\" }\n    rate: 20/m\n    burst: 20\n",
            "test",
            1,
        )
        .expect("valid rules")
        .rules
        .remove(0);
        let admitted = CheckResponse {
            allowed: true,
            remaining: 17,
            ..CheckResponse::default()
        };
        let h = LimitInfo::of_response(&rule, &admitted).headers();
        assert_eq!(h[1], ("ratelimit", "\"orders\";r=17;t=0".to_string()));
        assert_eq!(h[3], ("ratelimit-remaining", "17".to_string()));
        // A denial says 0, whatever the answer carries.
        let denied = CheckResponse {
            allowed: false,
            remaining: 17,
            retry_after_ms: 2_500,
            ..CheckResponse::default()
        };
        assert_eq!(remaining_of(&denied), 0);
        let h = LimitInfo::of_response(&rule, &denied).headers();
        assert_eq!(h[1], ("ratelimit", "\"orders\";r=0;t=3".to_string()));
        assert_eq!(h[3], ("ratelimit-remaining", "0".to_string()));
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

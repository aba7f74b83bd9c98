//! In-flight limits (SPEC §4 `concurrency`, issue 34): the rule kind and
//! its field checks, shared by the YAML and protobuf paths.
//!
//! A rule entry may limit a rate (`rate` + `burst`), requests in flight
//! (`concurrency`, with `permit_ttl` and `max_hold`), or both. The model
//! keeps the two kinds in two lists: the rate part of an entry in
//! [`RuleSet::rules`] (every reader of a rule's rate and burst unchanged),
//! its concurrency part in [`RuleSet::permit_rules`], under the same id. On
//! the wire the second list is a field of its own, which releases before
//! it ignore: an older agent keeps enforcing the rates of a rule that has
//! both and never sees a rule without a rate.

use super::*;

/// Largest accepted `concurrency` (`N`): `1..=MAX_CONCURRENCY`.
pub const MAX_CONCURRENCY: u64 = 1_000_000;
/// Longest accepted `permit_ttl`, in milliseconds: the allocator's compiled
/// cap on a lease's TTL (`TTL_MAX_CAP_NS`, checked against this at compile
/// time there), so a permit can always live on one slot lease and restarts
/// and failovers keep their usual waits.
pub const MAX_PERMIT_TTL_MS: u64 = 60_000;
/// Shortest accepted `permit_ttl`, in milliseconds: a permit must outlive
/// the round trip that renews it.
pub const MIN_PERMIT_TTL_MS: u64 = 100;
/// Longest accepted `max_hold`, in milliseconds (7 days).
pub const MAX_HOLD_MS: u64 = 7 * 86_400_000;
/// `permit_ttl` when the rule does not say (the SPEC's example).
pub const DEFAULT_PERMIT_TTL_MS: u64 = 10_000;
/// `max_hold` when the rule does not say (the SPEC's example).
pub const DEFAULT_MAX_HOLD_MS: u64 = 30 * 60_000;

/// The concurrency part of a rule: at most `concurrency` permits of a key
/// held at once, across every agent and region (I4).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PermitRule {
    /// The rule's id (shared with its rate part in [`RuleSet::rules`] when
    /// the entry has both).
    pub id: String,
    /// How the tenant id is matched.
    pub tenant: Pattern,
    /// How the route id is matched.
    pub route: Pattern,
    /// `N`: the most permits of one key held at once, `1..=MAX_CONCURRENCY`.
    pub concurrency: u64,
    /// A permit expires unless renewed within this, in milliseconds
    /// (`MIN_PERMIT_TTL_MS..=MAX_PERMIT_TTL_MS`).
    pub permit_ttl_ms: u64,
    /// The longest total hold of one permit, renewals included, in
    /// milliseconds (`permit_ttl_ms..=MAX_HOLD_MS`).
    pub max_hold_ms: u64,
    /// Behaviour while the allocator is unreachable (`open`: a per-agent
    /// emergency semaphore of `max(1, N / agents)`).
    pub fail_policy: FailPolicy,
    /// Rule namespace (Envoy `domain`); `None` serves every domain.
    pub domain: Option<String>,
    /// Cap on the number of distinct keys of this rule.
    pub max_keys: Option<u64>,
}

impl PermitRule {
    pub(super) fn to_proto(&self) -> PbPermitRule {
        PbPermitRule {
            id: self.id.clone(),
            tenant: self.tenant.to_proto(),
            route: self.route.to_proto(),
            concurrency: self.concurrency,
            permit_ttl_ms: self.permit_ttl_ms,
            max_hold_ms: self.max_hold_ms,
            fail_policy: self.fail_policy.to_proto() as i32,
            domain: self.domain.clone().unwrap_or_default(),
            max_keys: self.max_keys.unwrap_or(0),
        }
    }

    /// The same selection as a rate rule (for the checks shared with
    /// rate rules: how many rules one request matches).
    pub(super) fn as_selector(&self) -> Rule {
        Rule {
            id: self.id.clone(),
            tenant: self.tenant.clone(),
            route: self.route.clone(),
            rate: Rate {
                tokens: 1,
                period_s: 1,
            },
            burst: 1,
            fail_policy: self.fail_policy,
            overrides: Vec::new(),
            shadow: false,
            domain: self.domain.clone(),
            max_keys: self.max_keys,
        }
    }

    /// Whether this rule applies to a request: the same test as
    /// [`Rule::applies`] (domain, then tenant and route patterns).
    #[inline]
    pub fn applies(&self, domain: Option<&str>, tenant: &str, route: &str) -> bool {
        crate::matching::selects(
            self.domain.as_deref(),
            &self.tenant,
            &self.route,
            domain,
            tenant,
            route,
        )
    }
}

pub(super) fn check_concurrency(n: u64) -> Result<u64, String> {
    if (1..=MAX_CONCURRENCY).contains(&n) {
        Ok(n)
    } else {
        Err(format!("must be from 1 to {MAX_CONCURRENCY}, got {n}"))
    }
}

pub(super) fn check_permit_ttl(ms: u64) -> Result<u64, String> {
    if (MIN_PERMIT_TTL_MS..=MAX_PERMIT_TTL_MS).contains(&ms) {
        Ok(ms)
    } else {
        Err(format!(
            "must be from {} to {} (the longest lease a permit can live on), got {}",
            duration_text(MIN_PERMIT_TTL_MS),
            duration_text(MAX_PERMIT_TTL_MS),
            duration_text(ms)
        ))
    }
}

pub(super) fn check_max_hold(ms: u64, permit_ttl_ms: u64) -> Result<u64, String> {
    if ms > MAX_HOLD_MS {
        Err(format!(
            "must be at most {}, got {}",
            duration_text(MAX_HOLD_MS),
            duration_text(ms)
        ))
    } else if ms < permit_ttl_ms {
        Err(format!(
            "must be at least permit_ttl ({}), got {}",
            duration_text(permit_ttl_ms),
            duration_text(ms)
        ))
    } else {
        Ok(ms)
    }
}

/// Parses a duration of a rule file, `250ms`, `10s`, `30m`, `2h` or `1d`,
/// into milliseconds. A unit is required; the number is whole.
pub fn parse_duration_ms(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let bad = || {
        format!("{s:?} is not a duration: expected a whole number and a unit (ms, s, m, h or d), e.g. 10s")
    };
    if num.is_empty() {
        return Err(bad());
    }
    let ms_per_unit: u64 = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return Err(bad()),
    };
    let n: u64 = num.parse().map_err(|_| format!("{s:?} is too long"))?;
    n.checked_mul(ms_per_unit)
        .ok_or_else(|| format!("{s:?} is too long"))
}

/// A duration in milliseconds in the largest unit that divides it:
/// `250ms`, `10s`, `30m`, `2h`, `1d`.
pub fn duration_text(ms: u64) -> String {
    const UNITS: [(u64, &str); 4] = [
        (86_400_000, "d"),
        (3_600_000, "h"),
        (60_000, "m"),
        (1_000, "s"),
    ];
    for (per, unit) in UNITS {
        if ms != 0 && ms.is_multiple_of(per) {
            return format!("{}{unit}", ms / per);
        }
    }
    format!("{ms}ms")
}

/// Checks one protobuf permit rule. `rate_rules` maps the ids of the rate
/// rules to their index: a permit rule with such an id is the concurrency
/// part of that entry and must select what it selects.
pub(super) fn permit_rule_from_proto(
    pb: &PbPermitRule,
    at: &RuleLoc,
    first: &HashMap<&str, usize>,
    rate_rules: &[Rule],
    errs: &mut Errors<'_>,
) -> Option<PermitRule> {
    let before = errs.len();
    check_id_at(at, &pb.id, first, errs);
    let (tenant, route) = match_from_proto(&pb.tenant, &pb.route, at, errs);
    let field = |errs: &mut Errors<'_>, name: &str, r: Result<u64, String>| match r {
        Ok(v) => Some(v),
        Err(e) => {
            errs.rule(at, name, e);
            None
        }
    };
    let concurrency = field(errs, "concurrency", check_concurrency(pb.concurrency));
    let permit_ttl_ms = field(errs, "permit_ttl", check_permit_ttl(pb.permit_ttl_ms));
    let max_hold_ms = field(
        errs,
        "max_hold",
        check_max_hold(pb.max_hold_ms, permit_ttl_ms.unwrap_or(0)),
    );
    let fail_policy = FailPolicy::from_proto(pb.fail_policy).unwrap_or_else(|e| {
        errs.rule(at, "fail_policy", e);
        FailPolicy::default()
    });
    let domain = if pb.domain.is_empty() {
        None
    } else {
        check_domain(&pb.domain)
            .map_err(|e| errs.rule(at, "domain", e))
            .ok()
    };
    let max_keys = (pb.max_keys != 0).then_some(pb.max_keys);
    if let Some(r) = rate_rules.iter().find(|r| r.id == pb.id) {
        if r.tenant != tenant || r.route != route || r.domain != domain {
            errs.rule(
                at,
                "match",
                "selects other requests than the rate rule with the same id (one rule entry selects one set of requests)",
            );
        }
    }
    if errs.len() != before {
        return None;
    }
    Some(PermitRule {
        id: pb.id.clone(),
        tenant,
        route,
        concurrency: concurrency?,
        permit_ttl_ms: permit_ttl_ms?,
        max_hold_ms: max_hold_ms?,
        fail_policy,
        domain,
        max_keys,
    })
}

/// The concurrency fields of one YAML rule entry, before they are
/// checked together.
#[cfg(feature = "yaml")]
pub(super) struct ConcurrencyFields {
    pub concurrency: Option<u64>,
    pub permit_ttl_ms: Option<u64>,
    pub max_hold_ms: Option<u64>,
}

#[cfg(feature = "yaml")]
impl ConcurrencyFields {
    /// The permit rule of an entry whose other fields are known, or `None`
    /// when the entry has no `concurrency` (then `permit_ttl` and
    /// `max_hold` are errors: they mean nothing without it).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn finish(
        self,
        at: &RuleLoc,
        id: &str,
        tenant: &Pattern,
        route: &Pattern,
        fail_policy: FailPolicy,
        domain: &Option<String>,
        max_keys: Option<u64>,
        errs: &mut Errors<'_>,
    ) -> Option<PermitRule> {
        let Some(concurrency) = self.concurrency else {
            for (name, given) in [
                ("permit_ttl", self.permit_ttl_ms.is_some()),
                ("max_hold", self.max_hold_ms.is_some()),
            ] {
                if given {
                    errs.rule(at, name, "only with concurrency (it is a permit's setting)");
                }
            }
            return None;
        };
        let permit_ttl_ms = self.permit_ttl_ms.unwrap_or(DEFAULT_PERMIT_TTL_MS);
        let max_hold_ms = match self.max_hold_ms {
            Some(ms) => ms,
            // The default hold never cuts below the TTL a rule chose.
            None => DEFAULT_MAX_HOLD_MS.max(permit_ttl_ms),
        };
        if let Err(e) = check_max_hold(max_hold_ms, permit_ttl_ms) {
            errs.rule(at, "max_hold", e);
            return None;
        }
        Some(PermitRule {
            id: id.to_string(),
            tenant: tenant.clone(),
            route: route.clone(),
            concurrency,
            permit_ttl_ms,
            max_hold_ms,
            fail_policy,
            domain: domain.clone(),
            max_keys,
        })
    }
}

#[cfg(all(test, feature = "yaml"))]
mod tests;

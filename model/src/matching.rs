//! The one rule matcher: which rules of a [`RuleSet`] apply to a request,
//! domains and `overrides` applied, without allocating (the agent's request
//! path calls it on every check).

use crate::rules::{Rule, RuleSet};

/// Most rules one request can match.
pub const MAX_MATCHED: usize = 16;

/// A request matched more than [`MAX_MATCHED`] rules. Checks answer it as
/// an invalid [`TooManyMatches::FIELD`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("matches more than {MAX_MATCHED} rules")]
pub struct TooManyMatches;

impl TooManyMatches {
    /// The request field the error is reported under.
    pub const FIELD: &'static str = "tenant_id";
}

/// Indices (in [`RuleSet::rules`], file order) of the rules a request
/// matched, overrides applied.
#[derive(Clone, Copy, Debug)]
pub struct Matched {
    idx: [u32; MAX_MATCHED],
    n: usize,
    any_shadow: bool,
}

impl Matched {
    /// The indices, in file order.
    #[inline]
    pub fn indices(&self) -> &[u32] {
        &self.idx[..self.n]
    }

    /// How many rules matched.
    #[inline]
    pub fn len(&self) -> usize {
        self.n
    }

    /// No rule matched.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// Some matching rule is a shadow rule. Counted before overrides are
    /// applied: an overridden shadow rule still sets it.
    #[inline]
    pub fn any_shadow(&self) -> bool {
        self.any_shadow
    }
}

impl RuleSet {
    /// The rules applying to a request, in file order, with overrides
    /// applied: a matching rule that lists `overrides: [x]` removes rule x
    /// from the result for this request. A rule with domain `Some(x)`
    /// applies only when `domain == Some(x)`; a rule without a domain
    /// applies to every domain.
    ///
    /// Overrides are transitive: a matching rule removes its targets even if
    /// it is itself overridden. Validated sets have no override cycles, so
    /// whenever some rule matches, the result is not empty.
    ///
    /// Errs when more than [`MAX_MATCHED`] rules match (before overrides).
    pub fn match_rules(
        &self,
        domain: Option<&str>,
        tenant: &str,
        route: &str,
    ) -> Result<Matched, TooManyMatches> {
        let mut m = Matched {
            idx: [0; MAX_MATCHED],
            n: 0,
            any_shadow: false,
        };
        let mut any_override = false;
        for (i, r) in self.rules.iter().enumerate() {
            let domain_ok = match (&r.domain, domain) {
                (None, _) => true,
                (Some(d), Some(q)) => d == q,
                (Some(_), None) => false,
            };
            if domain_ok && r.tenant.matches(tenant) && r.route.matches(route) {
                if m.n == MAX_MATCHED {
                    return Err(TooManyMatches);
                }
                m.idx[m.n] = i as u32;
                m.n += 1;
                any_override |= !r.overrides.is_empty();
                m.any_shadow |= r.shadow;
            }
        }
        if any_override {
            let all = m.idx;
            let n = m.n;
            let mut kept = 0;
            for j in 0..n {
                let id = &self.rules[all[j] as usize].id;
                let overridden = all[..n]
                    .iter()
                    .any(|&o| self.rules[o as usize].overrides.iter().any(|x| x == id));
                if !overridden {
                    m.idx[kept] = all[j];
                    kept += 1;
                }
            }
            m.n = kept;
        }
        Ok(m)
    }

    /// [`RuleSet::match_rules`] as the rules themselves.
    pub fn matching<'a>(
        &'a self,
        domain: Option<&str>,
        tenant: &str,
        route: &str,
    ) -> Result<Vec<&'a Rule>, TooManyMatches> {
        let m = self.match_rules(domain, tenant, route)?;
        Ok(m.indices()
            .iter()
            .map(|&i| &self.rules[i as usize])
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::{FailPolicy, Pattern, Rate};

    fn rule(id: &str, tenant: Pattern, route: Pattern) -> Rule {
        Rule {
            id: id.to_string(),
            tenant,
            route,
            rate: Rate {
                tokens: 1,
                period_s: 1,
            },
            burst: 1,
            fail_policy: FailPolicy::Open,
            overrides: Vec::new(),
            shadow: false,
            domain: None,
            max_keys: None,
        }
    }

    fn ids(rs: &RuleSet, domain: Option<&str>, tenant: &str, route: &str) -> Vec<String> {
        let m = rs.match_rules(domain, tenant, route).expect("at most 16");
        m.indices()
            .iter()
            .map(|&i| rs.rules[i as usize].id.clone())
            .collect()
    }

    fn exact(s: &str) -> Pattern {
        Pattern::Exact(s.to_string())
    }

    #[test]
    fn patterns_and_file_order() {
        let rs = RuleSet {
            version: 1,
            rules: vec![
                rule("per-tenant", Pattern::PerValue, Pattern::Any),
                rule("orders", Pattern::PerValue, exact("/orders")),
                rule("acme", exact("acme"), Pattern::Any),
            ],
        };
        assert_eq!(
            ids(&rs, None, "acme", "/orders"),
            ["per-tenant", "orders", "acme"]
        );
        assert_eq!(ids(&rs, None, "globex", "/x"), ["per-tenant"]);
        assert!(RuleSet::default()
            .match_rules(None, "a", "b")
            .unwrap()
            .is_empty());
    }

    #[test]
    fn overrides_are_transitive() {
        let mut top = rule("top", exact("acme"), exact("/vip"));
        top.overrides = vec!["mid".into()];
        let mut mid = rule("mid", exact("acme"), Pattern::Any);
        mid.overrides = vec!["base".into()];
        let rs = RuleSet {
            version: 1,
            rules: vec![rule("base", Pattern::PerValue, Pattern::Any), mid, top],
        };
        assert_eq!(ids(&rs, None, "acme", "/vip"), ["top"]);
        assert_eq!(ids(&rs, None, "acme", "/x"), ["mid"]);
        assert_eq!(ids(&rs, None, "other", "/vip"), ["base"]);
        assert_eq!(
            rs.matching(None, "acme", "/x").unwrap()[0].id,
            "mid",
            "matching is the same matcher"
        );
    }

    #[test]
    fn domains() {
        let mut edge = rule("edge-only", Pattern::Any, Pattern::Any);
        edge.domain = Some("edge".into());
        let rs = RuleSet {
            version: 1,
            rules: vec![rule("all", Pattern::Any, exact("/r")), edge],
        };
        assert_eq!(ids(&rs, Some("edge"), "t", "/r"), ["all", "edge-only"]);
        assert_eq!(ids(&rs, Some("other"), "t", "/r"), ["all"]);
        assert_eq!(ids(&rs, None, "t", "/r"), ["all"]);
        assert!(ids(&rs, None, "t", "/s").is_empty());
    }

    #[test]
    fn shadow_flag_counts_overridden_rules_too() {
        let mut watch = rule("watch", Pattern::PerValue, exact("/w"));
        watch.shadow = true;
        let mut vip = rule("vip", exact("vip"), exact("/w"));
        vip.overrides = vec!["watch".into()];
        let rs = RuleSet {
            version: 1,
            rules: vec![rule("base", Pattern::PerValue, Pattern::Any), watch, vip],
        };
        let m = rs.match_rules(None, "t", "/w").unwrap();
        assert!(m.any_shadow());
        assert_eq!(m.len(), 2);
        let m = rs.match_rules(None, "vip", "/w").unwrap();
        assert_eq!(m.indices(), [0, 2]);
        assert!(m.any_shadow());
        assert!(!rs.match_rules(None, "t", "/x").unwrap().any_shadow());
    }

    #[test]
    fn more_than_sixteen_matches_is_an_error() {
        let mut rs = RuleSet::default();
        for i in 0..MAX_MATCHED {
            rs.rules
                .push(rule(&format!("r{i}"), Pattern::Any, Pattern::Any));
        }
        assert_eq!(rs.match_rules(None, "t", "/").unwrap().len(), MAX_MATCHED);
        rs.rules.push(rule("one-more", Pattern::Any, exact("/x")));
        assert_eq!(rs.match_rules(None, "t", "/").unwrap().len(), MAX_MATCHED);
        assert_eq!(rs.match_rules(None, "t", "/x").unwrap_err(), TooManyMatches);
        assert!(rs.matching(None, "t", "/x").is_err());
        assert_eq!(TooManyMatches.to_string(), "matches more than 16 rules");
        assert_eq!(TooManyMatches::FIELD, "tenant_id");
    }
}

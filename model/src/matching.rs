//! The one rule matcher: which rules of a [`RuleSet`] apply to a request,
//! domains and `overrides` applied, without allocating (the agent's request
//! path calls it on every check).

use std::collections::HashMap;

use crate::rules::{Pattern, Rule, RuleSet};

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

impl Rule {
    /// Whether this rule applies to a request, before overrides: its domain
    /// (if any) is the request's and its tenant and route patterns match.
    #[inline]
    pub fn applies(&self, domain: Option<&str>, tenant: &str, route: &str) -> bool {
        selects(
            self.domain.as_deref(),
            &self.tenant,
            &self.route,
            domain,
            tenant,
            route,
        )
    }
}

/// Whether a rule's domain and patterns select a request: the rule's
/// domain (if any) is the request's and its tenant and route patterns
/// match. The one test of both rule kinds.
#[inline]
pub(crate) fn selects(
    rule_domain: Option<&str>,
    rule_tenant: &Pattern,
    rule_route: &Pattern,
    domain: Option<&str>,
    tenant: &str,
    route: &str,
) -> bool {
    let domain_ok = match (rule_domain, domain) {
        (None, _) => true,
        (Some(d), Some(q)) => d == q,
        (Some(_), None) => false,
    };
    domain_ok && rule_tenant.matches(tenant) && rule_route.matches(route)
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
            if r.applies(domain, tenant, route) {
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

    /// The permit rules (rules with `concurrency`) applying to a request,
    /// as indices into [`RuleSet::permit_rules`] in file order. Permit rules
    /// have no overrides and no shadow mode.
    ///
    /// Errs when more than [`MAX_MATCHED`] permit rules match.
    pub fn match_permit_rules(
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
        for (i, r) in self.permit_rules.iter().enumerate() {
            if r.applies(domain, tenant, route) {
                if m.n == MAX_MATCHED {
                    return Err(TooManyMatches);
                }
                m.idx[m.n] = i as u32;
                m.n += 1;
            }
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

/// A request that matches more than [`MAX_MATCHED`] rules (before
/// overrides): the matcher refuses every such request, so a rule set with
/// one is invalid. Fields are `None` where no value is named: the rules
/// listed match every value there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Overfull<'a> {
    pub(crate) domain: Option<&'a str>,
    pub(crate) tenant: Option<&'a str>,
    pub(crate) route: Option<&'a str>,
    /// Indices of the rules it matches, in file order; more than
    /// [`MAX_MATCHED`].
    pub(crate) rules: Vec<usize>,
}

/// The exact literal a pattern names, `None` for one matching every value.
fn literal(p: &Pattern) -> Option<&str> {
    match p {
        Pattern::Exact(s) => Some(s),
        Pattern::Any | Pattern::PerValue => None,
    }
}

/// The rules of one domain (or those without a domain) by which of tenant
/// and route they name, as indices in file order: `ww` names neither,
/// `ew[t]` only tenant `t`, `we[r]` only route `r`, `ee[(t, r)]` both. A
/// request (t, r) matches `ww + ew[t] + we[r] + ee[(t, r)]` of them (a term
/// being empty for a value no rule names).
#[derive(Default)]
struct ByNames<'a> {
    ww: Vec<usize>,
    ew: HashMap<&'a str, Vec<usize>>,
    we: HashMap<&'a str, Vec<usize>>,
    ee: HashMap<(&'a str, &'a str), Vec<usize>>,
    /// The routes `ee` pairs with each tenant, and the tenants with each route.
    ee_routes: HashMap<&'a str, Vec<&'a str>>,
    ee_tenants: HashMap<&'a str, Vec<&'a str>>,
}

/// A request as (tenant, route); `None` is a value no rule names.
type Request<'a> = (Option<&'a str>, Option<&'a str>);

impl<'a> ByNames<'a> {
    fn new(rules: &'a [Rule], idx: &[usize]) -> Self {
        let mut b = ByNames::default();
        for &i in idx {
            let r = &rules[i];
            match (literal(&r.tenant), literal(&r.route)) {
                (None, None) => b.ww.push(i),
                (Some(t), None) => b.ew.entry(t).or_default().push(i),
                (None, Some(rt)) => b.we.entry(rt).or_default().push(i),
                (Some(t), Some(rt)) => {
                    let e = b.ee.entry((t, rt)).or_default();
                    if e.is_empty() {
                        b.ee_routes.entry(t).or_default().push(rt);
                        b.ee_tenants.entry(rt).or_default().push(t);
                    }
                    e.push(i);
                }
            }
        }
        b
    }

    fn ew(&self, t: Option<&str>) -> usize {
        t.and_then(|t| self.ew.get(t)).map_or(0, Vec::len)
    }

    fn we(&self, r: Option<&str>) -> usize {
        r.and_then(|r| self.we.get(r)).map_or(0, Vec::len)
    }

    /// How many of these rules request `q` matches.
    fn count(&self, (t, r): Request<'_>) -> usize {
        let ee = match (t, r) {
            (Some(t), Some(r)) => self.ee.get(&(t, r)).map_or(0, Vec::len),
            _ => 0,
        };
        self.ww.len() + self.ew(t) + self.we(r) + ee
    }

    /// The rules request `q` matches.
    fn list(&self, (t, r): Request<'_>) -> Vec<usize> {
        let ew = t.and_then(|t| self.ew.get(t));
        let we = r.and_then(|r| self.we.get(r));
        let ee = t.zip(r).and_then(|k| self.ee.get(&k));
        let parts = [Some(&self.ww), ew, we, ee];
        parts.into_iter().flatten().flatten().copied().collect()
    }

    /// The tenant most rules naming only a tenant name (the first so named
    /// on a tie), and the same for routes.
    fn most_named(&self) -> Request<'a> {
        let most = |m: &HashMap<&'a str, Vec<usize>>| {
            m.iter()
                .max_by_key(|(_, v)| (v.len(), std::cmp::Reverse(v[0])))
                .map(|(k, _)| *k)
        };
        (most(&self.ew), most(&self.we))
    }
}

/// The request matching the most of the rules `n` and `d` hold together
/// (the rules without a domain, and those of one domain), with how many it
/// matches.
///
/// Exact, not a heuristic. With the two merged, a request (t, r) matches
/// `ww + ew[t] + we[r] + ee[(t, r)]` rules. One whose (t, r) no rule names
/// together matches at most `ww + max ew + max we`, which the request of
/// the two maximising values reaches or exceeds: it is a candidate (the
/// merged maximum is `n`'s own or one of the values `d` names). Every other
/// request is a pair `ee` names: `d`'s pairs are candidates; a pair of
/// `n` whose tenant and route no rule of `d` names alone matches `n`'s
/// count plus `d.ww` (plus `d.ee`, when it is also `d`'s pair), at most
/// what `n`'s best request matches plus `d.ww`, so `n`'s best request is a
/// candidate, and the remaining pairs of `n` (sharing a tenant or route with
/// a rule of `d` naming only that) are candidates.
///
/// The second argument is `n`'s own best request and its
/// [`ByNames::most_named`].
///
/// Time: linear in `d`, plus `n`'s pairs sharing a value with `d`'s rules.
fn most_matched<'a>(
    n: &ByNames<'a>,
    (n_best, (n_t, n_r)): (Request<'a>, Request<'a>),
    d: &ByNames<'a>,
) -> (usize, Request<'a>) {
    let count = |q: Request<'_>| n.count(q) + d.count(q);
    let t_most =
        d.ew.keys()
            .copied()
            .chain(n_t)
            .max_by_key(|&t| (n.ew(Some(t)) + d.ew(Some(t)), std::cmp::Reverse(t)));
    let r_most =
        d.we.keys()
            .copied()
            .chain(n_r)
            .max_by_key(|&r| (n.we(Some(r)) + d.we(Some(r)), std::cmp::Reverse(r)));
    let shared_tenants = d.ew.keys().flat_map(|&t| {
        n.ee_routes
            .get(t)
            .into_iter()
            .flatten()
            .map(move |&r| (t, r))
    });
    let shared_routes = d.we.keys().flat_map(|&r| {
        n.ee_tenants
            .get(r)
            .into_iter()
            .flatten()
            .map(move |&t| (t, r))
    });
    let pairs =
        d.ee.keys()
            .copied()
            .chain(shared_tenants)
            .chain(shared_routes);
    let mut candidates: Vec<Request<'a>> = vec![n_best, (t_most, r_most)];
    candidates.extend(pairs.map(|(t, r)| (Some(t), Some(r))));
    // The most matches; on a tie the first candidate, then the smallest
    // values, so the answer does not depend on hash order.
    candidates
        .into_iter()
        .map(|q| (count(q), q))
        .enumerate()
        .max_by_key(|&(i, (c, q))| (c, std::cmp::Reverse((i.min(2), q))))
        .map(|(_, best)| best)
        .unwrap_or((0, (None, None)))
}

/// The requests that match more than [`MAX_MATCHED`] of `rules`: for
/// requests without a domain, then for each domain a rule names (in file
/// order), the request matching the most rules ([`most_matched`]) when that
/// is more than [`MAX_MATCHED`]; a request matching the same rules as one
/// already reported is left out. Empty exactly when no request matches more
/// than [`MAX_MATCHED`] rules.
///
/// Time: about linear in the rules (see [`most_matched`]).
pub(crate) fn overfull_requests(rules: &[Rule]) -> Vec<Overfull<'_>> {
    // Indices of the rules of each domain (first: those without one), in
    // file order.
    let mut by_domain: Vec<(Option<&str>, Vec<usize>)> = vec![(None, Vec::new())];
    let mut slot: HashMap<&str, usize> = HashMap::new();
    for (i, r) in rules.iter().enumerate() {
        let at = match r.domain.as_deref() {
            None => 0,
            Some(d) => *slot.entry(d).or_insert_with(|| {
                by_domain.push((Some(d), Vec::new()));
                by_domain.len() - 1
            }),
        };
        by_domain[at].1.push(i);
    }
    let none = ByNames::default();
    let n = ByNames::new(rules, &by_domain[0].1);
    let (n_count, n_best) = most_matched(&none, ((None, None), (None, None)), &n);
    let n_named = n.most_named();
    let mut found: Vec<Overfull<'_>> = Vec::new();
    for (domain, own) in &by_domain {
        let (count, (tenant, route), d) = if domain.is_none() {
            (n_count, n_best, ByNames::default())
        } else {
            let d = ByNames::new(rules, own);
            // A request of this domain matches at most the most of the
            // rules without a domain plus the most of its own.
            let d_alone = most_matched(&none, ((None, None), (None, None)), &d).0;
            if n_count + d_alone <= MAX_MATCHED {
                continue;
            }
            let (count, q) = most_matched(&n, (n_best, n_named), &d);
            (count, q, d)
        };
        if count <= MAX_MATCHED {
            continue;
        }
        let mut matched = n.list((tenant, route));
        matched.extend(d.list((tenant, route)));
        matched.sort_unstable();
        if found.iter().any(|o| o.rules == matched) {
            continue;
        }
        // Name the domain only when a listed rule needs it.
        let domain = domain.filter(|_| matched.iter().any(|&i| rules[i].domain.is_some()));
        found.push(Overfull {
            domain,
            tenant,
            route,
            rules: matched,
        });
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::{FailPolicy, Rate};
    use proptest::prelude::*;

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
            ..Default::default()
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
            ..Default::default()
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
            ..Default::default()
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
            ..Default::default()
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

    /// A request of `overfull_requests` as the matcher's arguments.
    fn request<'a>(o: &Overfull<'a>) -> (Option<&'a str>, &'a str, &'a str) {
        (o.domain, o.tenant.unwrap_or(""), o.route.unwrap_or(""))
    }

    #[test]
    fn overfull_requests_finds_a_tenant_and_route_no_one_rule_names_together() {
        // 8 rules of tenant acme (any route) and 9 of route /x (any tenant):
        // no rule names both, yet (acme, /x) matches all 17.
        let mut rules: Vec<Rule> = (0..8)
            .map(|i| rule(&format!("t{i}"), exact("acme"), Pattern::Any))
            .collect();
        rules.extend((0..9).map(|i| rule(&format!("r{i}"), Pattern::PerValue, exact("/x"))));
        let rs = RuleSet {
            version: 1,
            rules,
            ..Default::default()
        };
        let found = overfull_requests(&rs.rules);
        assert_eq!(found.len(), 1, "{found:?}");
        let o = &found[0];
        assert_eq!(
            (o.domain, o.tenant, o.route),
            (None, Some("acme"), Some("/x"))
        );
        assert_eq!(o.rules, (0..17).collect::<Vec<_>>());
        let (d, t, r) = request(o);
        assert_eq!(rs.match_rules(d, t, r).unwrap_err(), TooManyMatches);
        // One rule fewer: 16 is allowed.
        let mut rs = rs;
        rs.rules.pop();
        assert!(overfull_requests(&rs.rules).is_empty());
    }

    #[test]
    fn overfull_requests_per_domain() {
        let mut rules: Vec<Rule> = (0..10)
            .map(|i| rule(&format!("all{i}"), Pattern::PerValue, Pattern::Any))
            .collect();
        for (d, n) in [("edge", 6), ("core", 7)] {
            rules.extend((0..n).map(|i| {
                let mut r = rule(&format!("{d}{i}"), Pattern::PerValue, Pattern::Any);
                r.domain = Some(d.into());
                r
            }));
        }
        let found = overfull_requests(&rules);
        assert_eq!(found.len(), 1, "{found:?}");
        let o = &found[0];
        assert_eq!((o.domain, o.tenant, o.route), (Some("core"), None, None));
        assert_eq!(o.rules.len(), 17);
        assert!(o
            .rules
            .iter()
            .all(|&i| rules[i].domain.as_deref() != Some("edge")));
        // Disjoint rules never add up, however many there are.
        let many: Vec<Rule> = (0..40)
            .map(|i| {
                rule(
                    &format!("r{i}"),
                    Pattern::PerValue,
                    exact(&format!("/r{i}")),
                )
            })
            .collect();
        assert!(overfull_requests(&many).is_empty());
    }

    fn arb_pattern(values: &'static [&'static str]) -> impl Strategy<Value = Pattern> {
        prop_oneof![
            Just(Pattern::Any),
            Just(Pattern::PerValue),
            proptest::sample::select(values).prop_map(exact),
        ]
    }

    fn arb_rules() -> impl Strategy<Value = Vec<Rule>> {
        let one = (
            arb_pattern(&["a", "b", "c"]),
            arb_pattern(&["/x", "/y", "/z"]),
            proptest::option::of(proptest::sample::select(&["e1", "e2"][..])),
        );
        proptest::collection::vec(one, 0..48).prop_map(|v| {
            v.into_iter()
                .enumerate()
                .map(|(i, (t, r, d))| {
                    let mut rule = rule(&format!("r{i}"), t, r);
                    rule.domain = d.map(str::to_string);
                    rule
                })
                .collect()
        })
    }

    proptest! {
        /// `overfull_requests` is empty exactly when no request (over every
        /// value the rules name and one they do not) is refused by the
        /// matcher, and each request it reports is refused.
        #[test]
        fn overfull_requests_agrees_with_the_matcher(rules in arb_rules()) {
            let rs = RuleSet { version: 1, rules, ..Default::default() };
            let mut refused = false;
            for d in [None, Some("e1"), Some("e2"), Some("other")] {
                for t in ["a", "b", "c", "t"] {
                    for r in ["/x", "/y", "/z", "/other"] {
                        refused |= rs.match_rules(d, t, r).is_err();
                    }
                }
            }
            let found = overfull_requests(&rs.rules);
            prop_assert_eq!(refused, !found.is_empty(), "{:?}", found);
            for o in &found {
                let (d, t, r) = request(o);
                prop_assert!(rs.match_rules(d, t, r).is_err(), "{:?}", o);
                let listed: Vec<usize> = rs
                    .rules
                    .iter()
                    .enumerate()
                    .filter(|(_, x)| x.applies(d, t, r))
                    .map(|(i, _)| i)
                    .collect();
                prop_assert_eq!(&listed, &o.rules);
            }
        }
    }
}

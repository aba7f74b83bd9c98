//! Rules (SPEC §4): the rule model shared by the allocator and the agents,
//! validation listing every error, and the rule file.
//!
//! - [`RuleSet::parse`] / [`RuleSet::load`] (feature `yaml`, module `yaml`)
//!   read the YAML rule file. Each rule
//!   entry is checked on its own (read with serde-saphyr, as YAML 1.2, into
//!   a small YAML tree of the module's own, then field by field),
//!   so one bad rule never hides the errors of another: the caller gets every
//!   error of the file, each naming the rule (by id, or by index when the id is
//!   unusable) and the field.
//! - [`RuleSet::match_rules`] (in [`crate::matching`]) selects the rules
//!   that apply to a request, with domains and `overrides` applied.
//! - [`RuleSet::to_proto`] / [`RuleSet::from_proto`] convert to and from the
//!   lease protocol's `RuleSet` message; the decoded side is validated again.
//!
//! Validation beyond the per-field checks: ids are unique, `overrides` name
//! existing rules other than the rule itself, overrides never form a cycle
//! (with a cycle, a request matching all its rules would be limited by none),
//! and no request can match more than [`MAX_MATCHED`] rules (the matcher
//! refuses such a request, so every one would be answered as invalid).
//!
//! Nothing here panics on any input.

use std::collections::HashMap;
use std::fmt;

use quotalease_proto::lease::{
    FailPolicy as PbFailPolicy, PermitRule as PbPermitRule, Rule as PbRule, RuleSet as PbRuleSet,
};

use crate::matching::{overfull_requests, MAX_MATCHED};
use crate::protocol::MAX_ID_BYTES;

mod concurrency;
#[cfg(feature = "yaml")]
pub mod yaml;

pub use concurrency::{
    duration_text, parse_duration_ms, PermitRule, DEFAULT_MAX_HOLD_MS, DEFAULT_PERMIT_TTL_MS,
    MAX_CONCURRENCY, MAX_HOLD_MS, MAX_PERMIT_TTL_MS, MIN_PERMIT_TTL_MS,
};

/// Largest accepted `burst` (bucket capacity); `burst` is `1..=MAX_BURST`.
pub const MAX_BURST: u64 = 1_000_000_000;
/// Largest accepted `N` in a rate `N/unit`; `N` is `1..=MAX_RATE_TOKENS`.
pub const MAX_RATE_TOKENS: u64 = 1_000_000_000;

/// File name used in errors of [`RuleSet::from_proto`].
const PROTO_FILE: &str = "<allocator>";
/// The periods a rate may have, in seconds, with their canonical unit letter.
const PERIODS: [(u64, &str); 4] = [(1, "s"), (60, "m"), (3_600, "h"), (86_400, "d")];

// ---------------------------------------------------------------------------
// Rate

/// A refill rate: `tokens` per `period_s` seconds.
///
/// Keys of a rule slower than this many tokens a second are served
/// centrally ([`Rate::served_centrally`]): `R x 2 s` (the default lease
/// TTL) below 4 tokens.
pub const CENTRAL_BELOW_TPS: u64 = 2;

/// Rates parsed or validated by this module have `tokens` in
/// `1..=MAX_RATE_TOKENS` and `period_s` one of 1, 60, 3600 or 86400.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rate {
    /// Tokens added per period (`N` in `N/unit`).
    pub tokens: u64,
    /// Length of the period in seconds: 1, 60, 3600 or 86400.
    pub period_s: u64,
}

impl Rate {
    /// Parses `N/unit`: `N` a whole number in `1..=MAX_RATE_TOKENS`, `unit`
    /// one of `s`, `m`, `h`, `d` (also `sec`, `second(s)`, `min`,
    /// `minute(s)`, `hour(s)`, `day(s)`). Spaces around the parts are
    /// ignored. On error, returns the reason.
    pub fn parse(s: &str) -> Result<Rate, String> {
        let Some((n, unit)) = s.trim().split_once('/') else {
            return Err(format!(
                "{s:?} is not a rate: expected N/unit with unit s, m, h or d, e.g. 60/m"
            ));
        };
        let (n, unit) = (n.trim(), unit.trim());
        if n.is_empty() {
            return Err(format!("{s:?}: the number of tokens before '/' is missing"));
        }
        if !n.bytes().all(|b| b.is_ascii_digit()) {
            return Err(format!(
                "{s:?}: the number of tokens must be a whole number from 1 to {MAX_RATE_TOKENS}, got {n:?}"
            ));
        }
        // Only digits: parsing fails only on overflow.
        let tokens = match n.parse::<u64>() {
            Ok(t) if t > MAX_RATE_TOKENS => None,
            Ok(t) => Some(t),
            Err(_) => None,
        };
        let Some(tokens) = tokens else {
            return Err(format!(
                "{s:?}: the number of tokens is too large (at most {MAX_RATE_TOKENS})"
            ));
        };
        if tokens == 0 {
            return Err(format!("{s:?}: the number of tokens must be at least 1"));
        }
        let period_s = match unit {
            "s" | "sec" | "second" | "seconds" => 1,
            "m" | "min" | "minute" | "minutes" => 60,
            "h" | "hour" | "hours" => 3_600,
            "d" | "day" | "days" => 86_400,
            "" => {
                return Err(format!(
                    "{s:?}: the unit after '/' is missing (s, m, h or d)"
                ))
            }
            other => return Err(format!("{s:?}: unknown unit {other:?} (use s, m, h or d)")),
        };
        Ok(Rate { tokens, period_s })
    }

    /// Whether keys of this rate are served centrally (SPEC §2 "Slow and
    /// small rules", docs/protocol.md "Slow rules, served centrally"):
    /// below [`CENTRAL_BELOW_TPS`] tokens a second a lease of the default
    /// 2 s TTL would carry less than a few tokens, so every tier asks for
    /// exactly what its waiting requests cost, no tier keeps tokens ahead
    /// or asks for a rate, and the root grants first come, first served
    /// from the whole bucket.
    pub fn served_centrally(&self) -> bool {
        self.tokens < CENTRAL_BELOW_TPS.saturating_mul(self.period_s)
    }

    /// The period in nanoseconds (saturating, so a hand-built rate with an
    /// absurd period cannot overflow).
    pub fn period_ns(&self) -> u64 {
        self.period_s.saturating_mul(1_000_000_000)
    }

    /// Checks the invariants of a rate that did not come from [`Rate::parse`]
    /// (for example from a protobuf message).
    fn validate(self) -> Result<Rate, String> {
        if self.tokens == 0 || self.tokens > MAX_RATE_TOKENS {
            return Err(format!(
                "tokens per period must be from 1 to {MAX_RATE_TOKENS}, got {}",
                self.tokens
            ));
        }
        if !PERIODS.iter().any(|&(p, _)| p == self.period_s) {
            return Err(format!(
                "period must be 1, 60, 3600 or 86400 seconds, got {}",
                self.period_s
            ));
        }
        Ok(self)
    }
}

impl fmt::Display for Rate {
    /// `60/m` style with the canonical unit letter; a period that is not one
    /// of the four units is shown in seconds (`7/90s`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match PERIODS.iter().find(|&&(p, _)| p == self.period_s) {
            Some((_, unit)) => write!(f, "{}/{}", self.tokens, unit),
            None => write!(f, "{}/{}s", self.tokens, self.period_s),
        }
    }
}

// ---------------------------------------------------------------------------
// FailPolicy

/// What an agent does for a rule while it cannot reach its allocator
/// (SPEC §6). YAML spelling: `open`, `closed`, `lease_only`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum FailPolicy {
    /// Spend leased tokens, then admit through a local emergency bucket.
    #[default]
    Open,
    /// Spend leased tokens, then answer "unavailable".
    Closed,
    /// Spend leased tokens, then deny.
    LeaseOnly,
}

impl FailPolicy {
    /// The YAML spelling: `open`, `closed` or `lease_only`.
    pub fn as_str(&self) -> &'static str {
        match self {
            FailPolicy::Open => "open",
            FailPolicy::Closed => "closed",
            FailPolicy::LeaseOnly => "lease_only",
        }
    }

    #[cfg(feature = "yaml")]
    fn from_yaml_str(s: &str) -> Result<FailPolicy, String> {
        match s {
            "open" => Ok(FailPolicy::Open),
            "closed" => Ok(FailPolicy::Closed),
            "lease_only" => Ok(FailPolicy::LeaseOnly),
            other => Err(format!("must be open, closed or lease_only, got {other:?}")),
        }
    }

    fn to_proto(self) -> PbFailPolicy {
        match self {
            FailPolicy::Open => PbFailPolicy::Open,
            FailPolicy::Closed => PbFailPolicy::Closed,
            FailPolicy::LeaseOnly => PbFailPolicy::LeaseOnly,
        }
    }

    fn from_proto(v: i32) -> Result<FailPolicy, String> {
        match PbFailPolicy::try_from(v) {
            Ok(PbFailPolicy::Open) => Ok(FailPolicy::Open),
            Ok(PbFailPolicy::Closed) => Ok(FailPolicy::Closed),
            Ok(PbFailPolicy::LeaseOnly) => Ok(FailPolicy::LeaseOnly),
            Err(_) => Err(format!("unknown fail policy value {v}")),
        }
    }
}

impl fmt::Display for FailPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

// ---------------------------------------------------------------------------
// Pattern

/// How a rule matches one request field (tenant or route).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Pattern {
    /// Field absent from `match`: every value matches and all share one bucket.
    Any,
    /// `"*"`: every value matches, one bucket per distinct value.
    PerValue,
    /// Any other string: only this exact value matches.
    Exact(String),
}

impl Pattern {
    /// Whether a request value `v` matches. `Any` and `PerValue` match every
    /// value (the empty string too; request fields are validated elsewhere).
    pub fn matches(&self, v: &str) -> bool {
        match self {
            Pattern::Any | Pattern::PerValue => true,
            Pattern::Exact(s) => crate::key::str_eq(s, v),
        }
    }

    /// The part of the bucket key this field contributes for value `v`:
    /// `Any` -> `""`, `PerValue` -> `v`, `Exact(s)` -> `s`.
    pub fn key_part<'a>(&'a self, v: &'a str) -> &'a str {
        match self {
            Pattern::Any => "",
            Pattern::PerValue => v,
            Pattern::Exact(s) => s,
        }
    }

    /// The protobuf spelling: `""`, `"*"` or the literal.
    fn to_proto(&self) -> String {
        match self {
            Pattern::Any => String::new(),
            Pattern::PerValue => "*".to_string(),
            Pattern::Exact(s) => s.clone(),
        }
    }

    /// Parses a pattern given in a rule (YAML or a non-empty protobuf field).
    fn from_text(s: &str) -> Result<Pattern, String> {
        if s.is_empty() {
            return Err("must not be empty (leave the field out to match every value)".into());
        }
        if s.len() > MAX_ID_BYTES {
            return Err(format!(
                "is {} bytes long, at most {MAX_ID_BYTES} allowed",
                s.len()
            ));
        }
        Ok(if s == "*" {
            Pattern::PerValue
        } else {
            Pattern::Exact(s.to_string())
        })
    }
}

// ---------------------------------------------------------------------------
// Rule

/// One validated rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    /// Unique id: 1..=256 bytes of `[A-Za-z0-9_.:-]`.
    pub id: String,
    /// How the tenant id is matched.
    pub tenant: Pattern,
    /// How the route id is matched.
    pub route: Pattern,
    /// Refill rate of each bucket.
    pub rate: Rate,
    /// Bucket capacity, `1..=MAX_BURST`.
    pub burst: u64,
    /// Behaviour while the allocator is unreachable.
    pub fail_policy: FailPolicy,
    /// Ids of rules this rule replaces for the requests it matches.
    pub overrides: Vec<String>,
    /// Decide and report, never deny.
    pub shadow: bool,
    /// Rule namespace (Envoy `domain`); `None` serves every domain.
    pub domain: Option<String>,
    /// Cap on the number of distinct keys (buckets) of this rule.
    pub max_keys: Option<u64>,
}

impl Rule {
    fn to_proto(&self) -> PbRule {
        PbRule {
            id: self.id.clone(),
            tenant: self.tenant.to_proto(),
            route: self.route.to_proto(),
            rate_tokens: self.rate.tokens,
            rate_period_s: self.rate.period_s,
            burst: self.burst,
            fail_policy: self.fail_policy.to_proto() as i32,
            overrides: self.overrides.clone(),
            shadow: self.shadow,
            domain: self.domain.clone().unwrap_or_default(),
            max_keys: self.max_keys.unwrap_or(0),
        }
    }
}

// ---------------------------------------------------------------------------
// Errors

/// One problem found in a rule file.
///
/// `rule_id` is the id of the rule at fault when it has a usable, unique id.
/// Otherwise `rule_id` is `None` and `field` is a path from the file's root:
/// `rules[3].rate` for a rule known only by its index, `rules[3]` for the
/// entry as a whole, `rules` for the top-level list, `yaml` for a syntax
/// error, `file` for an unreadable file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleError {
    /// The file (path, or `<allocator>` for a rule set received by protobuf).
    pub file: String,
    /// The id of the rule at fault, when it has a usable one.
    pub rule_id: Option<String>,
    /// The field at fault, e.g. `burst` or `match.tenant` (see the type docs).
    pub field: String,
    /// What is wrong, for a human.
    pub reason: String,
}

impl fmt::Display for RuleError {
    /// `FILE: rule ID: field FIELD: REASON`, `FILE: rules[3]: field FIELD: REASON`,
    /// `FILE: yaml: REASON` (with line and column), `FILE: FIELD: REASON`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.rule_id {
            Some(id) if self.field.is_empty() => {
                write!(f, "{}: rule {}: {}", self.file, id, self.reason)
            }
            Some(id) => write!(
                f,
                "{}: rule {}: field {}: {}",
                self.file, id, self.field, self.reason
            ),
            None => match split_indexed_field(&self.field) {
                Some((entry, field)) => write!(
                    f,
                    "{}: {}: field {}: {}",
                    self.file, entry, field, self.reason
                ),
                None => write!(f, "{}: {}: {}", self.file, self.field, self.reason),
            },
        }
    }
}

impl std::error::Error for RuleError {}

/// Splits `rules[3].rate` into `("rules[3]", "rate")`.
fn split_indexed_field(field: &str) -> Option<(&str, &str)> {
    if !field.starts_with("rules[") && !field.starts_with("permit_rules[") {
        return None;
    }
    let close = field.find("].")?;
    Some((&field[..=close], &field[close + 2..]))
}

/// Where a rule sits in the file and how errors name it.
struct RuleLoc {
    /// The list the entry is in, for errors naming it by index: `rules`,
    /// or `permit_rules` in a protobuf rule set.
    list: &'static str,
    index: usize,
    /// The id errors are reported under: `Some` only for a valid id at its
    /// first occurrence; otherwise errors name the rule by index.
    id: Option<String>,
}

/// Collects errors for one file.
struct Errors<'f> {
    file: &'f str,
    list: Vec<RuleError>,
}

impl<'f> Errors<'f> {
    fn new(file: &'f str) -> Self {
        Errors {
            file,
            list: Vec::new(),
        }
    }

    fn len(&self) -> usize {
        self.list.len()
    }

    /// An error not tied to one rule; `field` is a path from the root.
    fn root(&mut self, field: &str, reason: impl Into<String>) {
        self.list.push(RuleError {
            file: self.file.to_string(),
            rule_id: None,
            field: field.to_string(),
            reason: reason.into(),
        });
    }

    /// An error in a rule's `field` (empty: the whole entry).
    fn rule(&mut self, at: &RuleLoc, field: &str, reason: impl Into<String>) {
        let (rule_id, field) = match &at.id {
            Some(id) => (Some(id.clone()), field.to_string()),
            None if field.is_empty() => (None, format!("{}[{}]", at.list, at.index)),
            None => (None, format!("{}[{}].{field}", at.list, at.index)),
        };
        self.list.push(RuleError {
            file: self.file.to_string(),
            rule_id,
            field,
            reason: reason.into(),
        });
    }
}

// ---------------------------------------------------------------------------
// Field checks shared by the YAML and protobuf paths

fn check_id(id: &str) -> Result<(), String> {
    if id.is_empty() {
        return Err("must not be empty".into());
    }
    if id.len() > MAX_ID_BYTES {
        return Err(format!(
            "is {} bytes long, at most {MAX_ID_BYTES} allowed",
            id.len()
        ));
    }
    if let Some(c) = id
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | ':' | '-')))
    {
        return Err(format!(
            "{id:?} contains {c:?}: only letters, digits, '_', '.', ':' and '-' are allowed"
        ));
    }
    Ok(())
}

fn check_burst(n: u64) -> Result<u64, String> {
    if (1..=MAX_BURST).contains(&n) {
        Ok(n)
    } else {
        Err(format!("must be from 1 to {MAX_BURST}, got {n}"))
    }
}

fn check_domain(d: &str) -> Result<String, String> {
    if d.is_empty() {
        return Err("must not be empty (leave the field out to serve every domain)".into());
    }
    if d.len() > MAX_ID_BYTES {
        return Err(format!(
            "is {} bytes long, at most {MAX_ID_BYTES} allowed",
            d.len()
        ));
    }
    Ok(d.to_string())
}

#[cfg(feature = "yaml")]
fn check_max_keys(n: u64) -> Result<u64, String> {
    if n == 0 {
        Err("must be at least 1 (leave the field out for no cap)".into())
    } else {
        Ok(n)
    }
}

const MATCHES_EVERYTHING: &str =
    "matches every request: give tenant and/or route (\"*\" means one bucket per distinct value)";

/// Checks the `overrides` entries that are strings.
fn check_overrides(
    at: &RuleLoc,
    own_id: Option<&str>,
    list: &[String],
    ids: &HashMap<&str, usize>,
    errs: &mut Errors<'_>,
) {
    for (i, o) in list.iter().enumerate() {
        if Some(o.as_str()) == own_id {
            errs.rule(at, "overrides", "a rule cannot override itself");
        } else if !ids.contains_key(o.as_str()) {
            errs.rule(at, "overrides", format!("no rule has id {o:?}"));
        } else if list[..i].contains(o) {
            errs.rule(at, "overrides", format!("{o:?} is listed twice"));
        }
    }
}

/// Decides how each rule is named in errors. `ids[i]` is rule `i`'s id when
/// it is a valid id. Returns the locations and the map from id to the index
/// of its first use. Later uses of an id are named by index.
fn locate<'a>(
    list: &'static str,
    ids: &[Option<&'a str>],
) -> (Vec<RuleLoc>, HashMap<&'a str, usize>) {
    let mut first: HashMap<&'a str, usize> = HashMap::new();
    let mut locs = Vec::with_capacity(ids.len());
    for (index, id) in ids.iter().enumerate() {
        let id = match id {
            Some(id) if !first.contains_key(id) => {
                first.insert(id, index);
                Some(id.to_string())
            }
            _ => None,
        };
        locs.push(RuleLoc { list, index, id });
    }
    (locs, first)
}

/// The id check done by both paths, with the duplicate report.
fn check_id_at(
    at: &RuleLoc,
    id: &str,
    first: &HashMap<&str, usize>,
    errs: &mut Errors<'_>,
) -> bool {
    if let Err(e) = check_id(id) {
        errs.rule(at, "id", e);
        return false;
    }
    match first.get(id) {
        Some(&f) if f != at.index => {
            errs.rule(
                at,
                "id",
                format!("duplicate id {id:?}: rules[{f}] already uses it"),
            );
            false
        }
        _ => true,
    }
}

/// What one rule entry produced: the rule when it has no error, and what the
/// cross-rule checks need even when it has errors.
struct Draft {
    /// `None` when the entry has an error.
    made: Option<Made>,
    overrides: Vec<String>,
}

/// What a valid rule entry is: a rate rule, a permit rule or both.
struct Made {
    rate: Option<Rule>,
    permit: Option<PermitRule>,
}

/// Reports override cycles among rules with usable ids.
fn check_cycles(
    locs: &[RuleLoc],
    drafts: &[Draft],
    first: &HashMap<&str, usize>,
    errs: &mut Errors<'_>,
) {
    // Edges i -> j for "rule i overrides rule j", between first occurrences.
    let edges: Vec<Vec<usize>> = drafts
        .iter()
        .zip(locs)
        .map(|(d, at)| {
            if at.id.is_none() {
                return Vec::new();
            }
            let mut out: Vec<usize> = d
                .overrides
                .iter()
                .filter_map(|o| first.get(o.as_str()).copied())
                .filter(|&j| j != at.index && locs[j].id.is_some())
                .collect();
            out.dedup();
            out
        })
        .collect();

    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        New,
        OnPath,
        Done,
    }
    let mut mark = vec![Mark::New; edges.len()];
    for start in 0..edges.len() {
        if mark[start] != Mark::New {
            continue;
        }
        // Iterative DFS: (node, next edge to follow).
        let mut path: Vec<(usize, usize)> = vec![(start, 0)];
        mark[start] = Mark::OnPath;
        while let Some(top) = path.last_mut() {
            let (node, next) = *top;
            if let Some(&to) = edges[node].get(next) {
                top.1 += 1;
                match mark[to] {
                    Mark::New => {
                        mark[to] = Mark::OnPath;
                        path.push((to, 0));
                    }
                    Mark::OnPath => {
                        let from = path.iter().position(|&(n, _)| n == to).unwrap_or(0);
                        let mut names: Vec<&str> = path[from..]
                            .iter()
                            .map(|&(n, _)| locs[n].id.as_deref().unwrap_or("?"))
                            .collect();
                        names.push(locs[to].id.as_deref().unwrap_or("?"));
                        errs.rule(
                            &locs[node],
                            "overrides",
                            format!(
                                "override cycle {}: a rule cannot override itself, even indirectly",
                                names.join(" -> ")
                            ),
                        );
                    }
                    Mark::Done => {}
                }
            } else {
                mark[node] = Mark::Done;
                path.pop();
            }
        }
    }
}

/// A protobuf rule's match patterns (an empty field: not matched on),
/// checked as the YAML path checks them.
fn match_from_proto(
    tenant: &str,
    route: &str,
    at: &RuleLoc,
    errs: &mut Errors<'_>,
) -> (Pattern, Pattern) {
    let mut pattern = |field: &str, s: &str| -> Pattern {
        if s.is_empty() {
            return Pattern::Any;
        }
        Pattern::from_text(s).unwrap_or_else(|e| {
            errs.rule(at, field, e);
            Pattern::PerValue
        })
    };
    let tenant = pattern("match.tenant", tenant);
    let route = pattern("match.route", route);
    if tenant == Pattern::Any && route == Pattern::Any {
        errs.rule(at, "match", MATCHES_EVERYTHING);
    }
    (tenant, route)
}

/// Checks one protobuf rule.
fn rule_from_proto(
    pb: &PbRule,
    at: &RuleLoc,
    first: &HashMap<&str, usize>,
    errs: &mut Errors<'_>,
) -> Draft {
    let before = errs.len();
    check_id_at(at, &pb.id, first, errs);
    let (tenant, route) = match_from_proto(&pb.tenant, &pb.route, at, errs);
    let rate = Rate {
        tokens: pb.rate_tokens,
        period_s: pb.rate_period_s,
    }
    .validate()
    .unwrap_or_else(|e| {
        errs.rule(at, "rate", e);
        Rate {
            tokens: 1,
            period_s: 1,
        }
    });
    let burst = check_burst(pb.burst).unwrap_or_else(|e| {
        errs.rule(at, "burst", e);
        1
    });
    let fail_policy = FailPolicy::from_proto(pb.fail_policy).unwrap_or_else(|e| {
        errs.rule(at, "fail_policy", e);
        FailPolicy::default()
    });
    let own = (!pb.id.is_empty()).then_some(pb.id.as_str());
    check_overrides(at, own, &pb.overrides, first, errs);
    let domain = if pb.domain.is_empty() {
        None
    } else {
        match check_domain(&pb.domain) {
            Ok(d) => Some(d),
            Err(e) => {
                errs.rule(at, "domain", e);
                None
            }
        }
    };
    let max_keys = (pb.max_keys != 0).then_some(pb.max_keys);

    let made = (errs.len() == before).then(|| Made {
        rate: Some(Rule {
            id: pb.id.clone(),
            tenant,
            route,
            rate,
            burst,
            fail_policy,
            overrides: pb.overrides.clone(),
            shadow: pb.shadow,
            domain,
            max_keys,
        }),
        permit: None,
    });
    Draft {
        made,
        overrides: pb.overrides.clone(),
    }
}

/// Reports each request that would match more than [`MAX_MATCHED`] rules
/// (the matcher refuses such a request, so every one would be answered as
/// invalid), on the first rule past the limit, naming all the rules.
fn check_match_limit(locs: &[&RuleLoc], rules: &[Rule], errs: &mut Errors<'_>) {
    for o in overfull_requests(rules) {
        let named: Vec<String> = [
            ("tenant", o.tenant),
            ("route", o.route),
            ("domain", o.domain),
        ]
        .into_iter()
        .filter_map(|(name, v)| v.map(|v| format!("{name} {}", shown(v))))
        .collect();
        let which = if named.is_empty() {
            "every request".to_string()
        } else {
            format!("every request with {}", named.join(" and "))
        };
        let ids: Vec<&str> = o.rules.iter().map(|&i| rules[i].id.as_str()).collect();
        errs.rule(
            locs[o.rules[MAX_MATCHED]],
            "match",
            format!(
                "{which} matches {} rules, more than the {MAX_MATCHED} one request may match (each such request would be refused): {}",
                o.rules.len(),
                ids.join(", ")
            ),
        );
    }
}

/// Cross-rule checks, then the rule set if no error was found anywhere.
/// `permits` are the permit rules of a protobuf rule set (YAML entries
/// carry theirs in their drafts), with where each is.
fn finish(
    version: u64,
    locs: &[RuleLoc],
    drafts: Vec<Draft>,
    first: &HashMap<&str, usize>,
    permits: Vec<(&RuleLoc, PermitRule)>,
    mut errs: Errors<'_>,
) -> Result<RuleSet, Vec<RuleError>> {
    check_cycles(locs, &drafts, first, &mut errs);
    if !errs.list.is_empty() {
        return Err(errs.list);
    }
    let Some(made) = drafts
        .into_iter()
        .map(|d| d.made)
        .collect::<Option<Vec<Made>>>()
    else {
        // Unreachable: a draft without a rule always recorded an error.
        errs.root(
            "rules",
            "internal error: a rule failed validation without a reason",
        );
        return Err(errs.list);
    };
    let mut rules = Vec::new();
    let mut rate_locs = Vec::new();
    let mut permit_rules = Vec::new();
    let mut permit_locs = Vec::new();
    for (m, at) in made.into_iter().zip(locs) {
        if let Some(r) = m.rate {
            rules.push(r);
            rate_locs.push(at);
        }
        if let Some(p) = m.permit {
            permit_rules.push(p);
            permit_locs.push(at);
        }
    }
    for (at, p) in permits {
        permit_rules.push(p);
        permit_locs.push(at);
    }
    // Overrides replace one rate limit with another: they name rules with
    // a rate.
    for (r, at) in rules.iter().zip(&rate_locs) {
        for o in &r.overrides {
            if !rules.iter().any(|t| &t.id == o) {
                errs.rule(
                    at,
                    "overrides",
                    format!("{o:?} has no rate (a concurrency-only rule): overrides name rules with a rate"),
                );
            }
        }
    }
    check_match_limit(&rate_locs, &rules, &mut errs);
    let selectors: Vec<Rule> = permit_rules.iter().map(PermitRule::as_selector).collect();
    check_match_limit(&permit_locs, &selectors, &mut errs);
    if errs.list.is_empty() {
        Ok(RuleSet {
            version,
            rules,
            permit_rules,
        })
    } else {
        Err(errs.list)
    }
}

// ---------------------------------------------------------------------------
// RuleSet

/// A validated set of rules with the version it was published under.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RuleSet {
    /// Publish version (monotonically increasing).
    pub version: u64,
    /// The rate rules (entries with `rate` and `burst`), in file order.
    pub rules: Vec<Rule>,
    /// The permit rules (entries with `concurrency`), in file order; an
    /// entry with both is in both lists under one id.
    pub permit_rules: Vec<PermitRule>,
}

impl RuleSet {
    /// Whether `other` limits exactly what this set does: the same rate
    /// rules and the same permit rules (the version aside).
    pub fn same_limits(&self, other: &RuleSet) -> bool {
        self.rules == other.rules && self.permit_rules == other.permit_rules
    }

    /// The rule with this id.
    pub fn get(&self, id: &str) -> Option<&Rule> {
        self.rules.iter().find(|r| r.id == id)
    }

    /// The protobuf form sent to agents.
    pub fn to_proto(&self) -> PbRuleSet {
        PbRuleSet {
            version: self.version,
            rules: self.rules.iter().map(Rule::to_proto).collect(),
            permit_rules: self.permit_rules.iter().map(PermitRule::to_proto).collect(),
        }
    }

    /// The permit rule with this id.
    pub fn permit_rule(&self, id: &str) -> Option<&PermitRule> {
        self.permit_rules.iter().find(|r| r.id == id)
    }

    /// Decodes and validates a protobuf rule set (errors name the file
    /// `<allocator>`). In the message, an empty tenant/route means "not
    /// matched on", an empty domain means none, `max_keys` 0 means no cap.
    pub fn from_proto(pb: &PbRuleSet) -> Result<RuleSet, Vec<RuleError>> {
        let mut errs = Errors::new(PROTO_FILE);
        let ids: Vec<Option<&str>> = pb
            .rules
            .iter()
            .map(|r| Some(r.id.as_str()).filter(|id| check_id(id).is_ok()))
            .collect();
        let (locs, first) = locate("rules", &ids);
        let drafts: Vec<Draft> = pb
            .rules
            .iter()
            .zip(&locs)
            .map(|(r, at)| rule_from_proto(r, at, &first, &mut errs))
            .collect();
        let permit_ids: Vec<Option<&str>> = pb
            .permit_rules
            .iter()
            .map(|r| Some(r.id.as_str()).filter(|id| check_id(id).is_ok()))
            .collect();
        let (permit_locs, permit_first) = locate("permit_rules", &permit_ids);
        let rates: Vec<Rule> = drafts
            .iter()
            .filter_map(|d| d.made.as_ref()?.rate.clone())
            .collect();
        let permits: Vec<(&RuleLoc, PermitRule)> = pb
            .permit_rules
            .iter()
            .zip(&permit_locs)
            .filter_map(|(r, at)| {
                concurrency::permit_rule_from_proto(r, at, &permit_first, &rates, &mut errs)
                    .map(|p| (at, p))
            })
            .collect();
        finish(pb.version, &locs, drafts, &first, permits, errs)
    }

    /// Human summary for `rules validate`: one line per rule with id, match,
    /// rate, burst, fail policy and flags (shadow, domain, max_keys,
    /// overrides), then `concurrency=N permit_ttl=.. max_hold=..` for a
    /// rule that limits requests in flight (concurrency-only rules after the
    /// rate rules); `(no rules)` for an empty set.
    pub fn summary(&self) -> String {
        if self.rules.is_empty() && self.permit_rules.is_empty() {
            return "(no rules)\n".to_string();
        }
        let lines = self.rule_lines();
        let id_w = lines.iter().map(|l| l.id.len()).max().unwrap_or(0);
        let m_w = lines
            .iter()
            .map(|l| l.matched.chars().count())
            .max()
            .unwrap_or(0);
        let mut out = String::new();
        for l in lines {
            let line = format!("{:<id_w$}  {:<m_w$}  {}", l.id, l.matched, l.fields);
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }

    /// One line per rule entry (both parts of a rule with a rate and a
    /// concurrency on one line), as [`RuleSet::summary`] shows them.
    pub fn rule_lines(&self) -> Vec<RuleLine<'_>> {
        let permit_text = |p: &PermitRule| {
            format!(
                "concurrency={} permit_ttl={} max_hold={}",
                p.concurrency,
                duration_text(p.permit_ttl_ms),
                duration_text(p.max_hold_ms)
            )
        };
        let flags = |domain: &Option<String>, max_keys: Option<u64>, line: &mut String| {
            if let Some(d) = domain {
                line.push_str(&format!(" domain={}", shown(d)));
            }
            if let Some(n) = max_keys {
                line.push_str(&format!(" max_keys={n}"));
            }
        };
        let mut lines = Vec::new();
        for r in &self.rules {
            let mut fields = format!("rate={} burst={}", r.rate, r.burst);
            if let Some(p) = self.permit_rule(&r.id) {
                fields.push(' ');
                fields.push_str(&permit_text(p));
            }
            fields.push_str(&format!(" fail_policy={}", r.fail_policy));
            if r.shadow {
                fields.push_str(" shadow");
            }
            flags(&r.domain, r.max_keys, &mut fields);
            if !r.overrides.is_empty() {
                fields.push_str(&format!(" overrides={}", r.overrides.join(",")));
            }
            lines.push(RuleLine {
                id: &r.id,
                matched: match_text(&r.tenant, &r.route),
                fields,
            });
        }
        for p in &self.permit_rules {
            if self.get(&p.id).is_some() {
                continue;
            }
            let mut fields = format!("{} fail_policy={}", permit_text(p), p.fail_policy);
            flags(&p.domain, p.max_keys, &mut fields);
            lines.push(RuleLine {
                id: &p.id,
                matched: match_text(&p.tenant, &p.route),
                fields,
            });
        }
        lines
    }
}

/// A rule entry as [`RuleSet::summary`] shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleLine<'a> {
    /// The rule's id.
    pub id: &'a str,
    /// What it matches: `tenant=* route=/api/orders`.
    pub matched: String,
    /// Its limits and flags: `rate=60/m burst=20 fail_policy=open`.
    pub fields: String,
}

impl fmt::Display for RuleLine<'_> {
    /// `ID  MATCH  FIELDS`, unpadded.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let line = format!("{}  {}  {}", self.id, self.matched, self.fields);
        f.write_str(line.trim_end())
    }
}

/// `tenant=* route=/api/orders` (fields matched on only).
fn match_text(tenant: &Pattern, route: &Pattern) -> String {
    let mut parts = Vec::new();
    for (name, p) in [("tenant", tenant), ("route", route)] {
        match p {
            Pattern::Any => {}
            Pattern::PerValue => parts.push(format!("{name}=*")),
            Pattern::Exact(s) => parts.push(format!("{name}={}", shown(s))),
        }
    }
    parts.join(" ")
}

/// A value as shown in the summary: quoted when it could break the line or
/// be misread.
fn shown(s: &str) -> String {
    if s.is_empty()
        || s == "*"
        || s.chars()
            .any(|c| c.is_whitespace() || c.is_control() || matches!(c, '"' | '=' | ','))
    {
        format!("{s:?}")
    } else {
        s.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[cfg(feature = "yaml")]
    const SPEC_EXAMPLE: &str = r#"
rules:
  - id: orders
    match: { tenant: "*", route: /api/orders }   # "*": one bucket per distinct value
    rate: 60/m          # N/s, N/m, N/h, N/d; N >= 1 (slowest: 1/d)
    burst: 20
    fail_policy: open   # open | closed | lease_only   (default: open)
  - id: login
    match: { tenant: "*", route: /api/login }
    rate: 5/m
    burst: 5
    fail_policy: closed
  - id: tenant-total
    match: { tenant: "*" }                       # all routes of a tenant share it
    rate: 1000/s
    burst: 2000
  - id: acme-orders
    match: { tenant: acme, route: /api/orders }
    rate: 600/m
    burst: 200
    overrides: [orders]  # acme uses this instead of `orders`
    shadow: true         # decide and report, never deny
"#;

    #[cfg(feature = "yaml")]
    fn spec() -> RuleSet {
        RuleSet::parse(SPEC_EXAMPLE, "rules.yaml", 7).expect("the SPEC example is valid")
    }

    #[cfg(feature = "yaml")]
    fn errors(text: &str) -> Vec<RuleError> {
        match RuleSet::parse(text, "f.yaml", 1) {
            Ok(rs) => panic!("expected errors, parsed {rs:?}"),
            Err(e) => e,
        }
    }

    /// A rule whose other fields are valid, with `extra` lines appended.
    #[cfg(feature = "yaml")]
    fn one_rule(extra: &str) -> String {
        format!("rules:\n  - id: r\n    match: {{ tenant: \"*\" }}\n    rate: 1/s\n    burst: 1\n{extra}")
    }

    /// The only error of `text`, which must be on rule `rule` and `field`.
    #[cfg(feature = "yaml")]
    fn single_error(text: &str, rule: Option<&str>, field: &str) -> RuleError {
        let errs = errors(text);
        assert_eq!(errs.len(), 1, "expected one error, got {errs:#?}");
        let e = errs.into_iter().next().unwrap();
        assert_eq!(e.rule_id.as_deref(), rule, "{e}");
        assert_eq!(e.field, field, "{e}");
        assert_eq!(e.file, "f.yaml");
        e
    }

    fn rule(id: &str, tenant: Pattern, route: Pattern) -> Rule {
        Rule {
            id: id.to_string(),
            tenant,
            route,
            rate: Rate {
                tokens: 10,
                period_s: 1,
            },
            burst: 10,
            fail_policy: FailPolicy::Open,
            overrides: vec![],
            shadow: false,
            domain: None,
            max_keys: None,
        }
    }

    fn ids(rules: Result<Vec<&Rule>, crate::matching::TooManyMatches>) -> Vec<&str> {
        let rules = rules.expect("at most MAX_MATCHED rules match");
        rules.into_iter().map(|r| r.id.as_str()).collect()
    }

    // --- the SPEC example and well-formed files

    #[cfg(feature = "yaml")]
    #[test]
    fn spec_example_parses() {
        let rs = spec();
        assert_eq!(rs.version, 7);
        let exact = |s: &str| Pattern::Exact(s.to_string());
        let expected = vec![
            Rule {
                id: "orders".into(),
                tenant: Pattern::PerValue,
                route: exact("/api/orders"),
                rate: Rate {
                    tokens: 60,
                    period_s: 60,
                },
                burst: 20,
                fail_policy: FailPolicy::Open,
                overrides: vec![],
                shadow: false,
                domain: None,
                max_keys: None,
            },
            Rule {
                id: "login".into(),
                tenant: Pattern::PerValue,
                route: exact("/api/login"),
                rate: Rate {
                    tokens: 5,
                    period_s: 60,
                },
                burst: 5,
                fail_policy: FailPolicy::Closed,
                overrides: vec![],
                shadow: false,
                domain: None,
                max_keys: None,
            },
            Rule {
                id: "tenant-total".into(),
                tenant: Pattern::PerValue,
                route: Pattern::Any,
                rate: Rate {
                    tokens: 1000,
                    period_s: 1,
                },
                burst: 2000,
                fail_policy: FailPolicy::Open,
                overrides: vec![],
                shadow: false,
                domain: None,
                max_keys: None,
            },
            Rule {
                id: "acme-orders".into(),
                tenant: exact("acme"),
                route: exact("/api/orders"),
                rate: Rate {
                    tokens: 600,
                    period_s: 60,
                },
                burst: 200,
                fail_policy: FailPolicy::Open,
                overrides: vec!["orders".into()],
                shadow: true,
                domain: None,
                max_keys: None,
            },
        ];
        assert_eq!(rs.rules, expected);
        assert_eq!(rs.get("login").map(|r| r.burst), Some(5));
        assert!(rs.get("nope").is_none());
    }

    #[cfg(feature = "yaml")]
    #[test]
    fn optional_fields_parse() {
        let rs = RuleSet::parse(
            &one_rule(
                "    fail_policy: lease_only\n    shadow: false\n    domain: edge\n    max_keys: 100000\n",
            ),
            "f.yaml",
            1,
        )
        .unwrap();
        let r = &rs.rules[0];
        assert_eq!(r.fail_policy, FailPolicy::LeaseOnly);
        assert!(!r.shadow);
        assert_eq!(r.domain.as_deref(), Some("edge"));
        assert_eq!(r.max_keys, Some(100_000));
        assert_eq!(r.tenant, Pattern::PerValue);
        assert_eq!(r.route, Pattern::Any);
    }

    #[cfg(feature = "yaml")]
    #[test]
    fn block_style_match_and_route_only() {
        let text = "rules:\n  - id: a\n    match:\n      route: /x\n    rate: 2/h\n    burst: 3\n";
        let rs = RuleSet::parse(text, "f.yaml", 1).unwrap();
        assert_eq!(rs.rules[0].tenant, Pattern::Any);
        assert_eq!(rs.rules[0].route, Pattern::Exact("/x".into()));
        assert_eq!(
            rs.rules[0].rate,
            Rate {
                tokens: 2,
                period_s: 3600
            }
        );
    }

    #[cfg(feature = "yaml")]
    #[test]
    fn empty_rule_lists_are_valid() {
        for text in ["rules: []", "rules:", "rules:\n# nothing yet\n"] {
            let rs = RuleSet::parse(text, "f.yaml", 3).unwrap();
            assert_eq!(
                rs,
                RuleSet {
                    version: 3,
                    rules: vec![],
                    ..Default::default()
                },
                "{text:?}"
            );
        }
    }

    #[cfg(feature = "yaml")]
    #[test]
    fn merge_keys_are_applied() {
        let text = r#"
rules:
  - id: a
    match: { tenant: "*" }
    <<: &common { rate: 10/s, burst: 20 }
  - id: b
    match: { route: /b }
    <<: *common
"#;
        let rs = RuleSet::parse(text, "f.yaml", 1).unwrap();
        assert_eq!(
            rs.rules[1].rate,
            Rate {
                tokens: 10,
                period_s: 1
            }
        );
        assert_eq!(rs.rules[1].burst, 20);
    }

    #[cfg(feature = "yaml")]
    #[test]
    fn limits_are_inclusive() {
        let id = "a".repeat(MAX_ID_BYTES);
        let pat = "p".repeat(MAX_ID_BYTES);
        let text = format!(
            "rules:\n  - id: {id}\n    match: {{ tenant: {pat}, route: {pat} }}\n    rate: {MAX_RATE_TOKENS}/s\n    burst: {MAX_BURST}\n    domain: {pat}\n    max_keys: 1\n"
        );
        let rs = RuleSet::parse(&text, "f.yaml", 1).unwrap();
        assert_eq!(rs.rules[0].burst, MAX_BURST);
        assert_eq!(rs.rules[0].rate.tokens, MAX_RATE_TOKENS);
    }

    // --- file-level errors

    #[cfg(feature = "yaml")]
    #[test]
    fn syntax_error_is_one_error_with_location() {
        let errs = errors("rules:\n  - id: a\n    match: { tenant: \"*\"\n    rate: 1/s\n");
        assert_eq!(errs.len(), 1, "{errs:?}");
        assert_eq!(errs[0].field, "yaml");
        assert!(errs[0].reason.contains("line"), "{}", errs[0].reason);
        assert!(
            errs[0].to_string().starts_with("f.yaml: yaml: "),
            "{}",
            errs[0]
        );

        let errs = errors("rules:\n  - id: a\n    id: b\n");
        assert_eq!(errs.len(), 1);
        assert_eq!(errs[0].field, "yaml");
        assert!(errs[0].reason.contains("duplicate"), "{}", errs[0].reason);
        assert!(errs[0].reason.contains("line"), "{}", errs[0].reason);

        let errs = errors("rules: []\n---\nrules: []\n");
        assert_eq!(errs[0].field, "yaml");
    }

    #[cfg(feature = "yaml")]
    #[test]
    fn bad_top_level_shapes() {
        let e = single_error("", None, "rules");
        assert!(e.reason.contains("empty"), "{e}");
        single_error("# only a comment\n", None, "rules");
        single_error("- id: a\n", None, "rules");
        single_error("rules: 3\n", None, "rules");
        let errs = errors("rules: []\nversion: 3\n");
        assert_eq!(errs.len(), 1);
        assert_eq!(errs[0].field, "version");
        assert!(errs[0].reason.contains("unknown"));
        assert_eq!(
            errs[0].to_string(),
            "f.yaml: version: unknown top-level field (expected only `rules`)"
        );
    }

    #[cfg(feature = "yaml")]
    #[test]
    fn typo_in_rules_key_reports_both() {
        let errs = errors("rule: []\n");
        let fields: Vec<&str> = errs.iter().map(|e| e.field.as_str()).collect();
        assert_eq!(fields, ["rule", "rules"]);
    }

    // --- per-field errors

    #[cfg(feature = "yaml")]
    #[test]
    fn id_errors() {
        let body = "    match: { tenant: \"*\" }\n    rate: 1/s\n    burst: 1\n";
        let e = single_error(
            &format!("rules:\n  - {}", body.trim_start()),
            None,
            "rules[0].id",
        );
        assert_eq!(e.reason, "required");
        assert_eq!(e.to_string(), "f.yaml: rules[0]: field id: required");

        for bad in ["\"\"", "\"a b\"", "x/y", "é", "7", "true", "[a]"] {
            let text = format!("rules:\n  - id: {bad}\n{body}");
            single_error(&text, None, "rules[0].id");
        }
        let long = "a".repeat(MAX_ID_BYTES + 1);
        let e = single_error(
            &format!("rules:\n  - id: {long}\n{body}"),
            None,
            "rules[0].id",
        );
        assert!(e.reason.contains("257"), "{e}");
        let e = single_error(&format!("rules:\n  - id: 7\n{body}"), None, "rules[0].id");
        assert!(e.reason.contains("quote"), "{e}");

        // Every allowed character.
        let ok = format!("rules:\n  - id: Az09_.:-\n{body}");
        assert!(RuleSet::parse(&ok, "f.yaml", 1).is_ok());
    }

    #[cfg(feature = "yaml")]
    #[test]
    fn duplicate_id_names_the_later_rule_by_index() {
        let text = "rules:
  - id: a
    match: { tenant: \"*\" }
    rate: 1/s
    burst: 1
  - id: a
    match: { route: /x }
    rate: 1/s
    burst: 0
";
        let errs = errors(text);
        assert_eq!(errs.len(), 2, "{errs:#?}");
        assert_eq!(errs[0].rule_id, None);
        assert_eq!(errs[0].field, "rules[1].id");
        assert!(errs[0].reason.contains("rules[0]"), "{}", errs[0]);
        assert_eq!(errs[1].field, "rules[1].burst");
    }

    #[cfg(feature = "yaml")]
    #[test]
    fn match_errors() {
        let base = "rules:\n  - id: r\n    rate: 1/s\n    burst: 1\n";
        let e = single_error(base, Some("r"), "match");
        assert!(e.reason.contains("required"));
        let e = single_error(&format!("{base}    match: {{}}\n"), Some("r"), "match");
        assert!(e.reason.contains("matches every request"), "{e}");
        single_error(&format!("{base}    match: /api\n"), Some("r"), "match");
        single_error(
            &format!("{base}    match: {{ tenant: \"\" }}\n"),
            Some("r"),
            "match.tenant",
        );
        single_error(
            &format!("{base}    match: {{ tenant: 42 }}\n"),
            Some("r"),
            "match.tenant",
        );
        single_error(
            &format!("{base}    match: {{ tenant: }}\n"),
            Some("r"),
            "match.tenant",
        );
        let long = "x".repeat(MAX_ID_BYTES + 1);
        single_error(
            &format!("{base}    match: {{ route: {long} }}\n"),
            Some("r"),
            "match.route",
        );
        let errs = errors(&format!("{base}    match: {{ tenant: a, path: /x }}\n"));
        assert_eq!(errs.len(), 1, "{errs:?}");
        assert_eq!(errs[0].field, "match.path");
        // An unknown key alone still leaves a rule matching everything.
        let errs = errors(&format!("{base}    match: {{ tenat: a }}\n"));
        let fields: Vec<&str> = errs.iter().map(|e| e.field.as_str()).collect();
        assert_eq!(fields, ["match.tenat", "match"]);
    }

    #[cfg(feature = "yaml")]
    #[test]
    fn rate_errors() {
        let base = "rules:\n  - id: r\n    match: { tenant: \"*\" }\n    burst: 1\n";
        let e = single_error(base, Some("r"), "rate");
        assert!(e.reason.contains("required"));
        for bad in [
            "0/s",
            "5/x",
            "abc",
            "-1/s",
            "1.5/s",
            "99999999999/s",
            "60",
            "\"60\"",
            "/s",
            "5/",
            "[1]",
        ] {
            single_error(&format!("{base}    rate: {bad}\n"), Some("r"), "rate");
        }
        let e = single_error(&format!("{base}    rate: 60\n"), Some("r"), "rate");
        assert!(e.reason.contains("60/m"), "{e}");
    }

    #[cfg(feature = "yaml")]
    #[test]
    fn burst_errors() {
        let base = "rules:\n  - id: r\n    match: { tenant: \"*\" }\n    rate: 1/s\n";
        let e = single_error(base, Some("r"), "burst");
        assert!(e.reason.contains("required"));
        for bad in [
            "0",
            "-3",
            "1.5",
            "1000000001",
            "1e30",
            "\"20\"",
            "abc",
            "",
            "[1]",
        ] {
            single_error(&format!("{base}    burst: {bad}\n"), Some("r"), "burst");
        }
        // Integers beyond 64 bits are a YAML error (serde_yaml rejected them;
        // serde-saphyr reads them as floats, the parser checks): one located error.
        let e = single_error(
            &format!("{base}    burst: 99999999999999999999999\n"),
            None,
            "yaml",
        );
        assert!(e.reason.contains("line 5"), "{e}");
        let e = single_error(&format!("{base}    burst: \"20\"\n"), Some("r"), "burst");
        assert!(e.reason.contains("quotes"), "{e}");
        let e = single_error(&format!("{base}    burst: 0\n"), Some("r"), "burst");
        assert_eq!(
            e.to_string(),
            "f.yaml: rule r: field burst: must be from 1 to 1000000000, got 0"
        );
    }

    #[cfg(feature = "yaml")]
    #[test]
    fn optional_field_errors() {
        let cases = [
            ("    fail_policy: fail_open\n", "fail_policy"),
            ("    fail_policy: Open\n", "fail_policy"),
            ("    fail_policy:\n", "fail_policy"),
            ("    shadow: yes\n", "shadow"),
            ("    shadow: 1\n", "shadow"),
            ("    domain: \"\"\n", "domain"),
            ("    domain: 3\n", "domain"),
            ("    max_keys: 0\n", "max_keys"),
            ("    max_keys: -1\n", "max_keys"),
            ("    max_keys: lots\n", "max_keys"),
            ("    overrides: r2\n", "overrides"),
            ("    overrides: [r]\n", "overrides"),
            ("    overrides: [missing]\n", "overrides"),
            ("    overrides: [3]\n", "overrides"),
            ("    overrides: {a: b}\n", "overrides"),
            ("    burts: 3\n", "burts"),
        ];
        for (extra, field) in cases {
            single_error(&one_rule(extra), Some("r"), field);
        }
        let e = single_error(&one_rule("    overrides: [r]\n"), Some("r"), "overrides");
        assert!(e.reason.contains("itself"), "{e}");
        let e = single_error(
            &one_rule("    overrides: [missing]\n"),
            Some("r"),
            "overrides",
        );
        assert!(e.reason.contains("\"missing\""), "{e}");
        let e = single_error(&one_rule("    burts: 3\n"), Some("r"), "burts");
        assert!(e.reason.contains("unknown field"), "{e}");
    }

    /// YAML 1.2 (core schema), as serde_yaml read rule files: no YAML 1.1
    /// booleans or octals, tags other than the core ones are not values.
    #[cfg(feature = "yaml")]
    #[test]
    fn yaml_1_2_dialect() {
        for (extra, field, why) in [
            ("    shadow: on\n", "shadow", "a string"),
            ("    shadow: No\n", "shadow", "a string"),
            ("    shadow: !flag true\n", "shadow", "a tagged value"),
            ("    max_keys: 010\n", "max_keys", "remove the quotes"),
            ("    max_keys: 1_000\n", "max_keys", "a string"),
            ("    max_keys: .inf\n", "max_keys", "got .inf"),
            ("    max_keys: 1e3\n", "max_keys", "got 1000.0"),
            ("    domain: 0x10\n", "domain", "a number"),
        ] {
            let e = single_error(&one_rule(extra), Some("r"), field);
            assert!(e.reason.contains(why), "{extra:?}: {e}");
        }
        let rs = RuleSet::parse(
            &one_rule(
                "    shadow: TRUE\n    max_keys: 0o17\n    domain: !!str 010\n    fail_policy: ! closed\n",
            ),
            "f.yaml",
            1,
        )
        .unwrap();
        let r = &rs.rules[0];
        assert!(r.shadow);
        assert_eq!(r.max_keys, Some(15));
        assert_eq!(r.domain.as_deref(), Some("010"));
        assert_eq!(r.fail_policy, FailPolicy::Closed);
        // A merged key the entry also gives is no duplicate; a repeated key is.
        let e = single_error(
            &one_rule("    rate: 2/s\n").replace("rate: 1/s", "rate: 3/s"),
            None,
            "yaml",
        );
        assert!(
            e.reason.contains("duplicate") && e.reason.contains("line 6"),
            "{e}"
        );
        // Beyond 64 bits, negative or through an alias: still located.
        let e = single_error(
            &one_rule("    max_keys: -99999999999999999999\n"),
            None,
            "yaml",
        );
        assert!(e.reason.contains("line 6"), "{e}");
        let text = "rules:\n  - id: r\n    match: { tenant: \"*\" }\n    rate: 1/s\n    burst: &b 99999999999999999999\n    max_keys: *b\n";
        let e = single_error(text, None, "yaml");
        assert!(e.reason.contains("line 5"), "{e}");
        // Deep nesting is refused (the parser's depth budget), not a stack overflow.
        let deep = format!("rules:\n  - id: r\n    match: {}", "[".repeat(100_000));
        single_error(&deep, None, "yaml");
    }

    #[cfg(feature = "yaml")]
    #[test]
    fn entry_that_is_not_a_mapping() {
        let e = single_error("rules:\n  - orders\n", None, "rules[0]");
        assert_eq!(e.to_string(), format!("f.yaml: rules[0]: {}", e.reason));
    }

    #[cfg(feature = "yaml")]
    #[test]
    fn override_errors() {
        let text = "rules:
  - id: a
    match: { tenant: \"*\" }
    rate: 1/s
    burst: 1
    overrides: [b, b]
  - id: b
    match: { route: /x }
    rate: 1/s
    burst: 1
";
        let e = single_error(text, Some("a"), "overrides");
        assert!(e.reason.contains("twice"), "{e}");

        // A target that exists but has its own errors is still "existing".
        let text = "rules:
  - id: a
    match: { tenant: \"*\" }
    rate: 1/s
    burst: 1
    overrides: [b]
  - id: b
    match: { route: /x }
    rate: 1/x
    burst: 1
";
        single_error(text, Some("b"), "rate");
    }

    #[cfg(feature = "yaml")]
    #[test]
    fn override_cycles_are_rejected() {
        let text = "rules:
  - id: a
    match: { tenant: \"*\" }
    rate: 1/s
    burst: 1
    overrides: [b]
  - id: b
    match: { route: /x }
    rate: 1/s
    burst: 1
    overrides: [c]
  - id: c
    match: { route: /y }
    rate: 1/s
    burst: 1
    overrides: [a]
";
        let e = single_error(text, Some("c"), "overrides");
        assert!(e.reason.contains("a -> b -> c -> a"), "{e}");

        let two = "rules:
  - id: a
    match: { tenant: \"*\" }
    rate: 1/s
    burst: 1
    overrides: [b]
  - id: b
    match: { route: /x }
    rate: 1/s
    burst: 1
    overrides: [a]
";
        let e = single_error(two, Some("b"), "overrides");
        assert!(e.reason.contains("a -> b -> a"), "{e}");
    }

    /// `n` rule entries `{prefix}{i}` with the given match and extra lines.
    #[cfg(feature = "yaml")]
    fn entries(prefix: &str, n: usize, matching: &str, extra: &str) -> String {
        (0..n)
            .map(|i| format!("  - id: {prefix}{i}\n    match: {{ {matching} }}\n    rate: 1/s\n    burst: 1\n{extra}"))
            .collect()
    }

    #[cfg(feature = "yaml")]
    #[test]
    fn a_request_matching_more_than_sixteen_rules_is_an_error() {
        // 16 rules of every tenant, then one for acme: acme's requests match
        // 17, which the matcher refuses; the error is on the 17th.
        let text = format!(
            "rules:\n{}  - id: acme\n    match: {{ tenant: acme }}\n    rate: 1/s\n    burst: 1\n",
            entries("all", 16, "tenant: \"*\"", "")
        );
        let e = single_error(&text, Some("acme"), "match");
        let all: Vec<String> = (0..16).map(|i| format!("all{i}")).collect();
        assert_eq!(
            e.to_string(),
            format!(
                "f.yaml: rule acme: field match: every request with tenant acme matches 17 rules, \
                 more than the 16 one request may match (each such request would be refused): {}, acme",
                all.join(", ")
            )
        );
        // 16 is the limit, not an error.
        let sixteen = format!("rules:\n{}", entries("all", 16, "tenant: \"*\"", ""));
        assert_eq!(
            RuleSet::parse(&sixteen, "f.yaml", 1).unwrap().rules.len(),
            16
        );
        // Overrides act after the limit: they do not make 17 matches valid.
        let overriding = format!(
            "rules:\n{}  - id: acme\n    match: {{ tenant: acme }}\n    rate: 1/s\n    burst: 1\n    overrides: [all0]\n",
            entries("all", 16, "tenant: \"*\"", "")
        );
        single_error(&overriding, Some("acme"), "match");
    }

    #[cfg(feature = "yaml")]
    #[test]
    fn the_match_limit_counts_requests_no_rule_names_whole() {
        // 9 rules of route /pay, 8 of tenant acme, 30 of one route each:
        // (acme, /pay) matches 17 though no rule names both.
        let own: String = (0..30)
            .map(|i| {
                entries(
                    &format!("own{i}-"),
                    1,
                    &format!("tenant: \"*\", route: /own{i}"),
                    "",
                )
            })
            .collect();
        let text = format!(
            "rules:\n{}{}{own}",
            entries("pay", 9, "tenant: \"*\", route: /pay", ""),
            entries("acme", 8, "tenant: acme", ""),
        );
        let e = single_error(&text, Some("acme7"), "match");
        assert_eq!(
            e.reason,
            "every request with tenant acme and route /pay matches 17 rules, more than the 16 \
             one request may match (each such request would be refused): pay0, pay1, pay2, pay3, \
             pay4, pay5, pay6, pay7, pay8, acme0, acme1, acme2, acme3, acme4, acme5, acme6, acme7"
        );
        // Without one of them, valid.
        let text = text.replacen("tenant: acme", "tenant: globex", 1);
        RuleSet::parse(&text, "f.yaml", 1).expect("16 rules at most per request");
    }

    #[cfg(feature = "yaml")]
    #[test]
    fn the_match_limit_is_per_domain() {
        let text = format!(
            "rules:\n{}{}{}",
            entries("all", 10, "route: /x", ""),
            entries("edge", 6, "tenant: \"*\"", "    domain: edge\n"),
            entries("core", 6, "tenant: \"*\"", "    domain: core\n"),
        );
        RuleSet::parse(&text, "f.yaml", 1).expect("16 rules at most in each domain");
        let text = text + &entries("core-more", 1, "tenant: \"*\"", "    domain: core\n");
        let e = single_error(&text, Some("core-more0"), "match");
        assert!(
            e.reason
                .starts_with("every request with route /x and domain core matches 17 rules"),
            "{e}"
        );
        assert!(!e.reason.contains("edge"), "{e}");
    }

    #[cfg(feature = "yaml")]
    #[test]
    fn from_proto_checks_the_match_limit() {
        let text = format!("rules:\n{}", entries("all", 16, "tenant: \"*\"", ""));
        let mut pb = RuleSet::parse(&text, "f.yaml", 1).unwrap().to_proto();
        let mut more = pb.rules[0].clone();
        more.id = "more".into();
        more.route = "/x".into();
        pb.rules.push(more);
        let errs = RuleSet::from_proto(&pb).unwrap_err();
        assert_eq!(errs.len(), 1, "{errs:#?}");
        assert_eq!(
            (
                errs[0].file.as_str(),
                errs[0].rule_id.as_deref(),
                errs[0].field.as_str()
            ),
            ("<allocator>", Some("more"), "match")
        );
        assert!(
            errs[0]
                .reason
                .contains("every request with route /x matches 17 rules"),
            "{}",
            errs[0]
        );
    }

    #[cfg(feature = "yaml")]
    #[test]
    fn several_bad_rules_give_several_errors() {
        let text = r#"
rules:
  - id: good
    match: { tenant: "*" }
    rate: 1/s
    burst: 1
  - id: bad-rate
    match: { tenant: "*" }
    rate: 0/s
    burst: 1
  - match: { tenant: "*" }
    rate: 1/s
    burst: 1
  - id: everything-wrong
    match: {}
    rate: fast
    burst: 0
    fail_policy: maybe
    overrides: [nobody]
    shadow: "no"
    domain: ""
    max_keys: 0
    colour: red
  - id: "has space"
    match: { route: /x }
    rate: 1/s
    burst: 1
    shadow: maybe
"#;
        let errs = errors(text);
        let got: Vec<(Option<&str>, &str)> = errs
            .iter()
            .map(|e| (e.rule_id.as_deref(), e.field.as_str()))
            .collect();
        let w = Some("everything-wrong");
        assert_eq!(
            got,
            vec![
                (Some("bad-rate"), "rate"),
                (None, "rules[2].id"),
                (w, "colour"),
                (w, "match"),
                (w, "rate"),
                (w, "burst"),
                (w, "fail_policy"),
                (w, "overrides"),
                (w, "shadow"),
                (w, "domain"),
                (w, "max_keys"),
                (None, "rules[4].id"),
                (None, "rules[4].shadow"),
            ],
            "{errs:#?}"
        );
        // Every error prints on one line naming file, rule and field.
        for e in &errs {
            let s = e.to_string();
            assert!(s.starts_with("f.yaml: "), "{s}");
            assert!(!s.contains('\n'), "{s}");
        }
        assert_eq!(errs[1].to_string(), "f.yaml: rules[2]: field id: required");
    }

    // --- matching

    #[cfg(feature = "yaml")]
    #[test]
    fn matching_spec_example() {
        let rs = spec();
        // acme's orders: acme-orders replaces orders; tenant-total still applies.
        assert_eq!(
            ids(rs.matching(None, "acme", "/api/orders")),
            ["tenant-total", "acme-orders"]
        );
        // Another tenant: orders applies, acme-orders does not match.
        assert_eq!(
            ids(rs.matching(None, "globex", "/api/orders")),
            ["orders", "tenant-total"]
        );
        // The override only acts where the overriding rule matches.
        assert_eq!(
            ids(rs.matching(None, "acme", "/api/login")),
            ["login", "tenant-total"]
        );
        assert_eq!(ids(rs.matching(None, "acme", "/other")), ["tenant-total"]);
        // Rules without a domain serve every domain.
        assert_eq!(
            ids(rs.matching(Some("edge"), "x", "/api/login")),
            ["login", "tenant-total"]
        );
        assert!(RuleSet::default()
            .matching(None, "a", "b")
            .unwrap()
            .is_empty());
    }

    #[test]
    fn matching_domains() {
        let mut edge = rule("edge-only", Pattern::PerValue, Pattern::Any);
        edge.domain = Some("edge".into());
        let all = rule("all", Pattern::Any, Pattern::Exact("/r".into()));
        let rs = RuleSet {
            version: 1,
            rules: vec![edge, all],
            ..Default::default()
        };
        assert_eq!(
            ids(rs.matching(Some("edge"), "t", "/r")),
            ["edge-only", "all"]
        );
        assert_eq!(ids(rs.matching(Some("other"), "t", "/r")), ["all"]);
        assert_eq!(ids(rs.matching(None, "t", "/r")), ["all"]);
        assert!(rs.matching(Some("other"), "t", "/s").unwrap().is_empty());
        assert_eq!(ids(rs.matching(Some("edge"), "t", "/s")), ["edge-only"]);
    }

    #[test]
    fn matching_overrides_are_transitive_and_domain_aware() {
        let base = rule("base", Pattern::PerValue, Pattern::Any);
        let mut mid = rule("mid", Pattern::Exact("acme".into()), Pattern::Any);
        mid.overrides = vec!["base".into()];
        let mut top = rule(
            "top",
            Pattern::Exact("acme".into()),
            Pattern::Exact("/vip".into()),
        );
        top.overrides = vec!["mid".into()];
        top.domain = Some("edge".into());
        let rs = RuleSet {
            version: 1,
            rules: vec![base, mid, top],
            ..Default::default()
        };
        assert_eq!(ids(rs.matching(Some("edge"), "acme", "/vip")), ["top"]);
        assert_eq!(ids(rs.matching(None, "acme", "/vip")), ["mid"]);
        assert_eq!(ids(rs.matching(Some("edge"), "acme", "/x")), ["mid"]);
        assert_eq!(ids(rs.matching(Some("edge"), "other", "/vip")), ["base"]);
    }

    #[test]
    fn pattern_matches_and_key_part() {
        let exact = Pattern::Exact("acme".into());
        assert!(Pattern::Any.matches("x") && Pattern::Any.matches(""));
        assert!(Pattern::PerValue.matches("x"));
        assert!(exact.matches("acme") && !exact.matches("acm") && !exact.matches("ACME"));
        assert_eq!(Pattern::Any.key_part("x"), "");
        assert_eq!(Pattern::PerValue.key_part("x"), "x");
        assert_eq!(exact.key_part("acme"), "acme");
    }

    // --- Rate

    #[test]
    fn rate_parse_good() {
        let cases = [
            ("1/d", 1, 86_400),
            ("5/m", 5, 60),
            ("60/m", 60, 60),
            ("1000/s", 1000, 1),
            ("2/h", 2, 3_600),
            ("5/min", 5, 60),
            ("3/sec", 3, 1),
            ("4/hour", 4, 3_600),
            ("7/day", 7, 86_400),
            (" 10 / s ", 10, 1),
            ("1000000000/s", MAX_RATE_TOKENS, 1),
        ];
        for (s, tokens, period_s) in cases {
            assert_eq!(Rate::parse(s), Ok(Rate { tokens, period_s }), "{s:?}");
        }
    }

    #[test]
    fn rate_parse_bad() {
        for s in [
            "0/s",
            "5/x",
            "abc",
            "-1/s",
            "1.5/s",
            "99999999999/s",
            "1000000001/s",
            "99999999999999999999999999/s",
            "+5/s",
            "5",
            "/s",
            "5/",
            "",
            "5/S",
            "5/m/s",
            "1e3/s",
            "5 0/s",
            "５/s",
        ] {
            let r = Rate::parse(s);
            assert!(r.is_err(), "{s:?} parsed as {r:?}");
        }
        assert!(Rate::parse("5/x").unwrap_err().contains("unit"));
        assert!(Rate::parse("0/s").unwrap_err().contains("at least 1"));
        assert!(Rate::parse("99999999999/s")
            .unwrap_err()
            .contains("too large"));
    }

    #[test]
    fn rate_display_and_period() {
        for s in ["1/d", "5/m", "60/m", "1000/s", "2/h"] {
            let r = Rate::parse(s).unwrap();
            assert_eq!(r.to_string(), s);
            assert_eq!(Rate::parse(&r.to_string()), Ok(r));
        }
        assert_eq!(Rate::parse("5/min").unwrap().to_string(), "5/m");
        assert_eq!(
            Rate {
                tokens: 1,
                period_s: 86_400
            }
            .period_ns(),
            86_400_000_000_000
        );
        assert_eq!(
            Rate {
                tokens: 1,
                period_s: 1
            }
            .period_ns(),
            1_000_000_000
        );
        assert_eq!(
            Rate {
                tokens: 1,
                period_s: u64::MAX
            }
            .period_ns(),
            u64::MAX
        );
        assert_eq!(
            Rate {
                tokens: 7,
                period_s: 90
            }
            .to_string(),
            "7/90s"
        );
    }

    // --- proto

    #[cfg(feature = "yaml")]
    #[test]
    fn proto_round_trip() {
        let mut rs = spec();
        rs.rules[1].domain = Some("edge".into());
        rs.rules[2].max_keys = Some(5);
        rs.rules[2].fail_policy = FailPolicy::LeaseOnly;
        let pb = rs.to_proto();
        assert_eq!(pb.version, 7);
        assert_eq!(pb.rules[0].tenant, "*");
        assert_eq!(pb.rules[2].route, "");
        assert_eq!(pb.rules[0].domain, "");
        assert_eq!(pb.rules[0].max_keys, 0);
        assert_eq!(pb.rules[1].fail_policy, PbFailPolicy::Closed as i32);
        assert_eq!(RuleSet::from_proto(&pb), Ok(rs));
        assert_eq!(
            RuleSet::from_proto(&PbRuleSet::default()),
            Ok(RuleSet::default())
        );
    }

    #[cfg(feature = "yaml")]
    #[test]
    fn from_proto_validates() {
        let good = spec().to_proto();
        let mut pb = good.clone();
        pb.rules[0].rate_period_s = 7;
        pb.rules[1].fail_policy = 9;
        pb.rules[2].tenant = String::new();
        pb.rules[3].overrides = vec!["ghost".into()];
        pb.rules[3].burst = 0;
        let errs = RuleSet::from_proto(&pb).unwrap_err();
        let got: Vec<(&str, Option<&str>, &str)> = errs
            .iter()
            .map(|e| (e.file.as_str(), e.rule_id.as_deref(), e.field.as_str()))
            .collect();
        assert_eq!(
            got,
            vec![
                ("<allocator>", Some("orders"), "rate"),
                ("<allocator>", Some("login"), "fail_policy"),
                ("<allocator>", Some("tenant-total"), "match"),
                ("<allocator>", Some("acme-orders"), "burst"),
                ("<allocator>", Some("acme-orders"), "overrides"),
            ]
        );

        let mut pb = good.clone();
        pb.rules[1].id = "orders".into();
        pb.rules[2].id = String::new();
        pb.rules[3].rate_tokens = MAX_RATE_TOKENS + 1;
        let errs = RuleSet::from_proto(&pb).unwrap_err();
        let fields: Vec<&str> = errs.iter().map(|e| e.field.as_str()).collect();
        assert_eq!(fields, ["rules[1].id", "rules[2].id", "rate"]);
    }

    // --- summary, load, Display

    #[cfg(feature = "yaml")]
    #[test]
    fn summary_has_one_line_per_rule() {
        let s = spec().summary();
        let lines: Vec<&str> = s.lines().collect();
        assert_eq!(lines.len(), 4, "{s}");
        assert!(lines[0].starts_with("orders "), "{s}");
        assert!(lines[0].contains("tenant=* route=/api/orders"), "{s}");
        assert!(
            lines[0].contains("rate=60/m burst=20 fail_policy=open"),
            "{s}"
        );
        assert!(lines[1].contains("fail_policy=closed"), "{s}");
        assert!(
            lines[3].contains("shadow") && lines[3].contains("overrides=orders"),
            "{s}"
        );
        assert!(lines[3].contains("tenant=acme"), "{s}");
        assert_eq!(RuleSet::default().summary(), "(no rules)\n");

        let mut r = rule("odd", Pattern::Exact("a b\nc".into()), Pattern::Any);
        r.domain = Some("edge".into());
        r.max_keys = Some(9);
        let s = RuleSet {
            version: 1,
            rules: vec![r],
            ..Default::default()
        }
        .summary();
        assert_eq!(s.lines().count(), 1, "{s}");
        assert!(
            s.contains("tenant=\"a b\\nc\"") && s.contains("domain=edge max_keys=9"),
            "{s}"
        );
    }

    #[cfg(feature = "yaml")]
    #[test]
    fn load_reads_files_and_reports_io_errors() {
        let dir =
            std::env::temp_dir().join(format!("quotalease-rules-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("rules.yaml");
        std::fs::write(&path, SPEC_EXAMPLE).unwrap();
        let rs = RuleSet::load(&path, 4).unwrap();
        assert_eq!(rs.version, 4);
        assert_eq!(rs.rules.len(), 4);

        std::fs::write(&path, "rules:\n  - id: x\n").unwrap();
        let errs = RuleSet::load(&path, 4).unwrap_err();
        assert!(errs.iter().all(|e| e.file == path.display().to_string()));

        std::fs::write(&path, [0xff, 0xfe, b'\n']).unwrap();
        let errs = RuleSet::load(&path, 4).unwrap_err();
        assert_eq!(errs.len(), 1);
        assert_eq!(errs[0].field, "file");

        std::fs::remove_file(&path).unwrap();
        let errs = RuleSet::load(&path, 4).unwrap_err();
        assert_eq!(errs.len(), 1);
        assert_eq!(errs[0].field, "file");
        assert!(
            errs[0].to_string().contains(": file: cannot read: "),
            "{}",
            errs[0]
        );
        let _ = std::fs::remove_dir(&dir);
    }

    #[test]
    fn display_formats() {
        let e = |rule_id: Option<&str>, field: &str| RuleError {
            file: "f".into(),
            rule_id: rule_id.map(String::from),
            field: field.into(),
            reason: "why".into(),
        };
        assert_eq!(
            e(Some("a"), "burst").to_string(),
            "f: rule a: field burst: why"
        );
        assert_eq!(
            e(None, "rules[3].match.tenant").to_string(),
            "f: rules[3]: field match.tenant: why"
        );
        assert_eq!(e(None, "rules[3]").to_string(), "f: rules[3]: why");
        assert_eq!(e(None, "yaml").to_string(), "f: yaml: why");
        assert_eq!(e(Some("a"), "").to_string(), "f: rule a: why");
    }

    // --- properties

    /// Lines built from rule-file fragments, to reach deeper than random text.
    #[cfg(feature = "yaml")]
    fn fragment() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("rules:".to_string()),
            Just("  - id: a".to_string()),
            Just("  - id: b".to_string()),
            Just("    match: { tenant: \"*\" }".to_string()),
            Just("    match: {}".to_string()),
            Just("    rate: 1/s".to_string()),
            Just("    burst: 5".to_string()),
            Just("    overrides: [a, b]".to_string()),
            Just("    <<: *x".to_string()),
            Just("  - &x { rate: 1/m }".to_string()),
            "[ -~]{0,30}",
            "    [a-z_]{1,12}: [ -~]{0,20}",
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[cfg(feature = "yaml")]
        #[test]
        fn parse_never_panics_on_random_text(text in "\\PC{0,300}") {
            let _ = RuleSet::parse(&text, "f", 1);
        }

        #[cfg(feature = "yaml")]
        #[test]
        fn parse_never_panics_on_rule_like_text(lines in prop::collection::vec(fragment(), 0..20)) {
            let text = lines.join("\n");
            match RuleSet::parse(&text, "f", 1) {
                // Anything accepted survives the protobuf round trip.
                Ok(rs) => prop_assert_eq!(RuleSet::from_proto(&rs.to_proto()), Ok(rs)),
                Err(errs) => prop_assert!(!errs.is_empty()),
            }
        }

        #[test]
        fn rate_parse_never_panics(s in "\\PC{0,20}") {
            if let Ok(r) = Rate::parse(&s) {
                prop_assert!((1..=MAX_RATE_TOKENS).contains(&r.tokens));
                prop_assert_eq!(Rate::parse(&r.to_string()), Ok(r));
            }
        }

        #[test]
        fn from_proto_never_panics(
            id in "[a-z*]{0,3}", tenant in "[a*]{0,2}", route in "[a*]{0,2}",
            tokens in 0u64..3, period in prop::sample::select(vec![0u64, 1, 60, 61]),
            burst in 0u64..3, fp in -1i32..4, over in prop::collection::vec("[a-z]{0,2}", 0..3),
        ) {
            let pb = PbRuleSet {
                version: 1,
                rules: vec![PbRule {
                    id, tenant, route, rate_tokens: tokens, rate_period_s: period, burst,
                    fail_policy: fp, overrides: over, ..Default::default()
                }],
                ..Default::default()
            };
            if let Ok(rs) = RuleSet::from_proto(&pb) {
                prop_assert_eq!(rs.to_proto(), pb);
            }
        }
    }
}

//! The YAML rule file (SPEC §4), behind the `yaml` feature: reading it
//! with serde-saphyr into a small tree of our own ([`Value`]) and checking
//! each entry field by field.
//!
//! The dialect is YAML 1.2 (core schema), as serde_yaml read it before:
//! only `true`/`false` (`True`, `TRUE`, ...) are booleans (`yes`, `no`,
//! `on`, `off` are text), `0x`/`0o`/`0b` integers, decimal numbers with a
//! leading zero or with underscores stay text, duplicate keys and several
//! documents are errors, merge keys (`<<`) are applied, and an integer
//! beyond 64 bits is a located error (serde-saphyr would read it as a
//! float).

use std::collections::HashMap;
use std::fmt;
use std::io::Read;
use std::path::Path;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_saphyr::{Location, Spanned, Tagged};

use super::*;

/// [`RuleSet::load`] refuses files larger than this.
const MAX_FILE_BYTES: u64 = 16 * 1024 * 1024;
/// Fields a rule entry may have.
const RULE_FIELDS: [&str; 12] = [
    "id",
    "match",
    "rate",
    "burst",
    "concurrency",
    "permit_ttl",
    "max_hold",
    "fail_policy",
    "overrides",
    "shadow",
    "domain",
    "max_keys",
];

// ---------------------------------------------------------------------------
// The YAML tree

/// A YAML node as read (serde-saphyr has no dynamic value type of its own).
#[derive(Clone, Debug, PartialEq)]
enum Value {
    Null,
    Bool(bool),
    Number(Number),
    String(String),
    Sequence(Vec<Value>),
    Mapping(Mapping),
    /// A node with an application tag (`!name`); the YAML core tags
    /// (`!!str`, `!!int`, ...) and `!` give the plain value.
    Tagged(Box<Value>),
}

/// A YAML number.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Number {
    /// Non-negative integers.
    Unsigned(u64),
    /// Negative integers.
    Negative(i64),
    /// Floats, with where the literal is (unknown for mapping keys and the
    /// document root): [`too_large_integer`] looks at its text.
    Float(f64, Location),
}

impl Number {
    fn as_u64(&self) -> Option<u64> {
        match *self {
            Number::Unsigned(u) => Some(u),
            _ => None,
        }
    }

    fn as_i64(&self) -> Option<i64> {
        match *self {
            Number::Unsigned(u) => i64::try_from(u).ok(),
            Number::Negative(i) => Some(i),
            Number::Float(..) => None,
        }
    }
}

impl fmt::Display for Number {
    /// As serde_yaml printed numbers: `.inf`, `-.inf`, `.nan` for the
    /// non-finite floats.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Number::Unsigned(u) => write!(f, "{u}"),
            Number::Negative(i) => write!(f, "{i}"),
            Number::Float(x, _) if x.is_nan() => f.write_str(".nan"),
            Number::Float(x, _) if x.is_infinite() => {
                f.write_str(if x > 0.0 { ".inf" } else { "-.inf" })
            }
            Number::Float(x, _) => write!(f, "{x:?}"),
        }
    }
}

/// A YAML mapping, in document order (keys are unique: the parser
/// rejects duplicates).
#[derive(Clone, Debug, Default, PartialEq)]
struct Mapping(Vec<(Value, Value)>);

impl Mapping {
    fn get(&self, key: &str) -> Option<&Value> {
        self.0
            .iter()
            .find(|(k, _)| k.as_str() == Some(key))
            .map(|(_, v)| v)
    }

    fn keys(&self) -> impl Iterator<Item = &Value> {
        self.0.iter().map(|(k, _)| k)
    }
}

impl Value {
    fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    /// `self[key]` of a mapping.
    fn get(&self, key: &str) -> Option<&Value> {
        match self {
            Value::Mapping(m) => m.get(key),
            _ => None,
        }
    }

    /// A child node read with where it is and its tag.
    fn from_child(node: Spanned<Tagged<Value>>) -> Value {
        let Tagged(mut value, tag) = node.value;
        if let Value::Number(Number::Float(_, at)) = &mut value {
            *at = node.defined;
        }
        match tag {
            Some(t) if t != "!" && !t.starts_with("tag:yaml.org,2002:") => {
                Value::Tagged(Box::new(value))
            }
            _ => value,
        }
    }
}

impl<'de> Deserialize<'de> for Value {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Value, D::Error> {
        d.deserialize_any(ValueVisitor)
    }
}

struct ValueVisitor;

impl<'de> Visitor<'de> for ValueVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any YAML value")
    }

    fn visit_bool<E>(self, b: bool) -> Result<Value, E> {
        Ok(Value::Bool(b))
    }

    fn visit_u64<E>(self, u: u64) -> Result<Value, E> {
        Ok(Value::Number(Number::Unsigned(u)))
    }

    fn visit_i64<E>(self, i: i64) -> Result<Value, E> {
        Ok(Value::Number(match u64::try_from(i) {
            Ok(u) => Number::Unsigned(u),
            Err(_) => Number::Negative(i),
        }))
    }

    fn visit_u128<E: de::Error>(self, u: u128) -> Result<Value, E> {
        match u64::try_from(u) {
            Ok(u) => self.visit_u64(u),
            Err(_) => Err(E::custom(format!("integer {u} is beyond 64 bits"))),
        }
    }

    fn visit_i128<E: de::Error>(self, i: i128) -> Result<Value, E> {
        match i64::try_from(i) {
            Ok(i) => self.visit_i64(i),
            Err(_) => Err(E::custom(format!("integer {i} is beyond 64 bits"))),
        }
    }

    fn visit_f64<E>(self, x: f64) -> Result<Value, E> {
        Ok(Value::Number(Number::Float(x, Location::UNKNOWN)))
    }

    fn visit_str<E>(self, s: &str) -> Result<Value, E> {
        Ok(Value::String(s.to_string()))
    }

    fn visit_string<E>(self, s: String) -> Result<Value, E> {
        Ok(Value::String(s))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        Value::deserialize(d)
    }

    fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        Value::deserialize(d)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(node) = seq.next_element::<Spanned<Tagged<Value>>>()? {
            items.push(Value::from_child(node));
        }
        Ok(Value::Sequence(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut entries = Vec::new();
        while let Some(key) = map.next_key::<Value>()? {
            let node = map.next_value::<Spanned<Tagged<Value>>>()?;
            entries.push((key, Value::from_child(node)));
        }
        Ok(Value::Mapping(Mapping(entries)))
    }
}

/// How quotalease reads YAML (rule files here; scenario files, the
/// swarm's plans and the tests' look at shipped files use it too): the
/// YAML 1.2 reading of the module doc, errors without source snippets.
pub fn options() -> serde_saphyr::Options {
    // The default budget stops at 250 000 nodes and 1 000 000 parser
    // events: fewer than a rule file within MAX_FILE_BYTES may hold (about
    // 300 000 rules in flow style). Every node and event takes at least a
    // byte, so the file size limit is the bound; the default nesting
    // (64), alias and anchor limits stay.
    let budget = serde_saphyr::budget! {
        max_events: MAX_FILE_BYTES as usize,
        max_nodes: MAX_FILE_BYTES as usize,
    };
    serde_saphyr::options! {
        budget: budget,
        strict_booleans: true,
        leading_zero_numbers_as_strings: true,
        underscored_numbers_as_strings: true,
        non_finite_float_policy: serde_saphyr::NonFiniteFloatPolicy::PassThrough,
        with_snippet: false,
    }
}

/// A serde-saphyr error with its location, on one line.
fn yaml_reason(e: &serde_saphyr::Error) -> String {
    let msg = e.render_with_formatter(&serde_saphyr::UserMessageFormatter);
    let msg = msg.split_whitespace().collect::<Vec<_>>().join(" ");
    match e.location() {
        Some(loc) if !msg.contains(" at line ") && loc != Location::UNKNOWN => {
            format!("{msg} at line {}, column {}", loc.line(), loc.column())
        }
        _ => msg,
    }
}

/// The first integer literal in `v` too large for 64 bits (serde-saphyr
/// reads it as a float), as an error with its location.
fn too_large_integer(text: &str, v: &Value) -> Option<String> {
    match v {
        Value::Number(Number::Float(_, at)) => {
            let span = at.span();
            let start = usize::try_from(span.byte_offset()?).ok()?;
            let len = usize::try_from(span.byte_len()?).ok()?;
            let literal = text.get(start..start.checked_add(len)?)?.trim();
            let digits = literal.strip_prefix(['+', '-']).unwrap_or(literal);
            (!digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit())).then(|| {
                format!(
                    "integer {literal} is beyond 64 bits at line {}, column {}",
                    at.line(),
                    at.column()
                )
            })
        }
        Value::Sequence(items) => items.iter().find_map(|i| too_large_integer(text, i)),
        Value::Mapping(m) => m.0.iter().find_map(|(_, v)| too_large_integer(text, v)),
        Value::Tagged(v) => too_large_integer(text, v),
        Value::Null | Value::Bool(_) | Value::Number(_) | Value::String(_) => None,
    }
}

// ---------------------------------------------------------------------------
// YAML helpers

/// "a number", "a list", ... for error messages.
fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "nothing (null)",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Sequence(_) => "a list",
        Value::Mapping(_) => "a mapping",
        Value::Tagged(_) => "a tagged value",
    }
}

/// A mapping key as text for error messages.
fn key_name(k: &Value) -> String {
    match k {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        Value::Bool(b) => b.to_string(),
        Value::Null => "null".to_string(),
        other => format!("<{} key>", kind(other)),
    }
}

fn yaml_str(v: &Value) -> Result<&str, String> {
    match v {
        Value::String(s) => Ok(s),
        Value::Number(_) | Value::Bool(_) => Err(format!(
            "must be a string, got {} (quote it to use it as text)",
            kind(v)
        )),
        other => Err(format!("must be a string, got {}", kind(other))),
    }
}

fn yaml_uint(v: &Value) -> Result<u64, String> {
    match v {
        Value::Number(n) => {
            if let Some(u) = n.as_u64() {
                Ok(u)
            } else if let Some(i) = n.as_i64() {
                Err(format!("must not be negative, got {i}"))
            } else {
                Err(format!("must be a whole number, got {n}"))
            }
        }
        Value::String(s) if s.trim().parse::<u64>().is_ok() => Err(format!(
            "must be a number, got the string {s:?} (remove the quotes)"
        )),
        other => Err(format!("must be a whole number, got {}", kind(other))),
    }
}

/// Checks one YAML rule entry field by field.
fn rule_from_yaml(
    entry: &Value,
    at: &RuleLoc,
    first: &HashMap<&str, usize>,
    errs: &mut Errors<'_>,
) -> Draft {
    let before = errs.len();
    let mut draft = Draft {
        made: None,
        overrides: Vec::new(),
    };
    let Value::Mapping(map) = entry else {
        errs.rule(
            at,
            "",
            format!(
                "must be a mapping with id, match, rate and burst, got {}",
                kind(entry)
            ),
        );
        return draft;
    };
    for k in map.keys() {
        if !k.as_str().is_some_and(|k| RULE_FIELDS.contains(&k)) {
            errs.rule(
                at,
                &key_name(k),
                format!("unknown field (known: {})", RULE_FIELDS.join(", ")),
            );
        }
    }

    // id
    let mut id = String::new();
    match map.get("id") {
        None => errs.rule(at, "id", "required"),
        Some(v) => match yaml_str(v) {
            Ok(s) => {
                id = s.to_string();
                check_id_at(at, s, first, errs);
            }
            Err(e) => errs.rule(at, "id", e),
        },
    }

    // match
    let (tenant, route) = match_from_yaml(map.get("match"), at, errs);

    // concurrency, permit_ttl, max_hold (concurrency.rs)
    let limits_in_flight = map.get("concurrency").is_some();
    let permit = concurrency_from_yaml(map, at, errs);

    // rate and burst: required unless the rule limits requests in flight
    // only (then both are left out).
    let has_rate = !limits_in_flight || map.get("rate").is_some() || map.get("burst").is_some();
    let mut rate = Rate {
        tokens: 1,
        period_s: 1,
    };
    let mut burst = 1;
    if has_rate {
        match map.get("rate") {
            None if limits_in_flight => errs.rule(
                at,
                "rate",
                "required with burst (or leave both out for a rule with concurrency only)",
            ),
            None => errs.rule(at, "rate", "required (N/s, N/m, N/h or N/d, e.g. 60/m)"),
            Some(Value::String(s)) => match Rate::parse(s) {
                Ok(r) => rate = r,
                Err(e) => errs.rule(at, "rate", e),
            },
            Some(other) => errs.rule(
                at,
                "rate",
                format!("must be text like 60/m, got {}", kind(other)),
            ),
        }
        match map.get("burst") {
            None => errs.rule(at, "burst", format!("required (1 to {MAX_BURST})")),
            Some(v) => match yaml_uint(v).and_then(check_burst) {
                Ok(b) => burst = b,
                Err(e) => errs.rule(at, "burst", e),
            },
        }
    }

    // fail_policy
    let mut fail_policy = FailPolicy::default();
    if let Some(v) = map.get("fail_policy") {
        match yaml_str(v).and_then(FailPolicy::from_yaml_str) {
            Ok(p) => fail_policy = p,
            Err(e) => errs.rule(at, "fail_policy", e),
        }
    }

    // overrides
    if let Some(v) = map.get("overrides") {
        match v {
            Value::Sequence(items) => {
                for (i, item) in items.iter().enumerate() {
                    match yaml_str(item) {
                        Ok(s) => draft.overrides.push(s.to_string()),
                        Err(e) => errs.rule(at, "overrides", format!("entry {i}: {e}")),
                    }
                }
                let own = (!id.is_empty()).then_some(id.as_str());
                if !limits_in_flight {
                    check_overrides(at, own, &draft.overrides, first, errs);
                }
            }
            Value::String(s) => errs.rule(
                at,
                "overrides",
                format!("must be a list of rule ids, e.g. [{s}]"),
            ),
            other => errs.rule(
                at,
                "overrides",
                format!("must be a list of rule ids, got {}", kind(other)),
            ),
        }
    }

    // shadow
    let mut shadow = false;
    if let Some(v) = map.get("shadow") {
        match v {
            Value::Bool(b) => shadow = *b,
            other => errs.rule(
                at,
                "shadow",
                format!("must be true or false, got {}", kind(other)),
            ),
        }
    }

    // domain
    let mut domain = None;
    if let Some(v) = map.get("domain") {
        match yaml_str(v).and_then(check_domain) {
            Ok(d) => domain = Some(d),
            Err(e) => errs.rule(at, "domain", e),
        }
    }

    // max_keys
    let mut max_keys = None;
    if let Some(v) = map.get("max_keys") {
        match yaml_uint(v).and_then(check_max_keys) {
            Ok(n) => max_keys = Some(n),
            Err(e) => errs.rule(at, "max_keys", e),
        }
    }

    // Overrides and shadow mode are the rate part's: a rule limiting
    // requests in flight does not take them (yet; docs/permits.md).
    if limits_in_flight {
        for (name, given) in [
            ("overrides", map.get("overrides").is_some()),
            ("shadow", shadow),
        ] {
            if given {
                errs.rule(
                    at,
                    name,
                    "not supported on a rule with concurrency (give the rate limit a rule of its own)",
                );
            }
        }
    }
    let permit = permit.and_then(|p| {
        p.finish(
            at,
            &id,
            &tenant,
            &route,
            fail_policy,
            &domain,
            max_keys,
            errs,
        )
    });

    if errs.len() == before {
        draft.made = Some(Made {
            rate: has_rate.then(|| Rule {
                id,
                tenant,
                route,
                rate,
                burst,
                fail_policy,
                overrides: draft.overrides.clone(),
                shadow,
                domain,
                max_keys,
            }),
            permit,
        });
    }
    draft
}

/// Reads an entry's `concurrency`, `permit_ttl` and `max_hold`; `None`
/// when one of them has an error (recorded).
fn concurrency_from_yaml(
    map: &Mapping,
    at: &RuleLoc,
    errs: &mut Errors<'_>,
) -> Option<concurrency::ConcurrencyFields> {
    let before = errs.len();
    let concurrency = map.get("concurrency").and_then(|v| {
        yaml_uint(v)
            .and_then(concurrency::check_concurrency)
            .map_err(|e| errs.rule(at, "concurrency", e))
            .ok()
    });
    let mut duration = |name: &str| -> Option<u64> {
        let v = map.get(name)?;
        let ms = match v {
            Value::String(s) => parse_duration_ms(s),
            Value::Number(_) => Err(format!(
                "must be a duration with a unit, like 10s or 500ms, got the number {}",
                match v {
                    Value::Number(n) => n.to_string(),
                    _ => String::new(),
                }
            )),
            other => Err(format!("must be a duration like 10s, got {}", kind(other))),
        };
        ms.map_err(|e| errs.rule(at, name, e)).ok()
    };
    let permit_ttl_ms = duration("permit_ttl");
    let max_hold_ms = duration("max_hold");
    let permit_ttl_ms = permit_ttl_ms.and_then(|ms| {
        concurrency::check_permit_ttl(ms)
            .map_err(|e| errs.rule(at, "permit_ttl", e))
            .ok()
    });
    (errs.len() == before).then_some(concurrency::ConcurrencyFields {
        concurrency,
        permit_ttl_ms,
        max_hold_ms,
    })
}

/// Checks a rule's `match` mapping; returns (tenant, route).
fn match_from_yaml(v: Option<&Value>, at: &RuleLoc, errs: &mut Errors<'_>) -> (Pattern, Pattern) {
    let any = (Pattern::Any, Pattern::Any);
    let map: &Mapping = match v {
        None => {
            errs.rule(at, "match", "required: give tenant and/or route");
            return any;
        }
        Some(Value::Mapping(m)) => m,
        Some(other) => {
            errs.rule(
                at,
                "match",
                format!(
                    "must be a mapping like {{ tenant: \"*\", route: /api/orders }}, got {}",
                    kind(other)
                ),
            );
            return any;
        }
    };
    for k in map.keys() {
        if !matches!(k.as_str(), Some("tenant" | "route")) {
            errs.rule(
                at,
                &format!("match.{}", key_name(k)),
                "unknown field (known: tenant, route)",
            );
        }
    }
    let mut one = |name: &str| -> Pattern {
        match map.get(name) {
            None => Pattern::Any,
            Some(v) => match yaml_str(v).and_then(Pattern::from_text) {
                Ok(p) => p,
                Err(e) => {
                    errs.rule(at, &format!("match.{name}"), e);
                    // Not `Any`: the field was given, so "matches everything"
                    // would be a misleading second error.
                    Pattern::PerValue
                }
            },
        }
    };
    let tenant = one("tenant");
    let route = one("route");
    if tenant == Pattern::Any && route == Pattern::Any {
        errs.rule(at, "match", MATCHES_EVERYTHING);
    }
    (tenant, route)
}

impl RuleSet {
    /// Parse and validate YAML text. Returns every error found, not just the first.
    ///
    /// `file` names the source in errors; `version` is stored as is. The text
    /// must be a mapping with a `rules` list (`rules:` with no entries is a
    /// valid empty set; an empty file is an error). YAML merge keys (`<<`)
    /// are applied; the dialect is YAML 1.2 (see the module doc).
    pub fn parse(text: &str, file: &str, version: u64) -> Result<RuleSet, Vec<RuleError>> {
        let mut errs = Errors::new(file);
        let root: Value = match serde_saphyr::from_str_with_options(text, options()) {
            Ok(v) => v,
            Err(e) => {
                errs.root("yaml", yaml_reason(&e));
                return Err(errs.list);
            }
        };
        if let Some(reason) = too_large_integer(text, &root) {
            errs.root("yaml", reason);
            return Err(errs.list);
        }

        let entries: &[Value] = match &root {
            Value::Mapping(map) => {
                for k in map.keys() {
                    if k.as_str() != Some("rules") {
                        errs.root(
                            &key_name(k),
                            "unknown top-level field (expected only `rules`)",
                        );
                    }
                }
                match map.get("rules") {
                    None => {
                        errs.root(
                            "rules",
                            "required: the file must have a top-level `rules:` list",
                        );
                        &[]
                    }
                    Some(Value::Null) => &[],
                    Some(Value::Sequence(s)) => s,
                    Some(other) => {
                        errs.root(
                            "rules",
                            format!("must be a list of rules, got {}", kind(other)),
                        );
                        &[]
                    }
                }
            }
            Value::Null => {
                errs.root(
                    "rules",
                    "the file is empty: expected a top-level `rules:` list",
                );
                &[]
            }
            other => {
                errs.root(
                    "rules",
                    format!(
                        "the file must be a mapping with a top-level `rules:` list, got {}",
                        kind(other)
                    ),
                );
                &[]
            }
        };

        let ids: Vec<Option<&str>> = entries
            .iter()
            .map(|e| {
                e.get("id")
                    .and_then(Value::as_str)
                    .filter(|id| check_id(id).is_ok())
            })
            .collect();
        let (locs, first) = locate("rules", &ids);
        let drafts: Vec<Draft> = entries
            .iter()
            .zip(&locs)
            .map(|(entry, at)| rule_from_yaml(entry, at, &first, &mut errs))
            .collect();
        finish(version, &locs, drafts, &first, Vec::new(), errs)
    }

    /// Reads and parses a rule file. An unreadable file (missing, not UTF-8,
    /// larger than 16 MiB) gives one error with field `file`.
    pub fn load(path: &Path, version: u64) -> Result<RuleSet, Vec<RuleError>> {
        let file = path.display().to_string();
        let fail = |reason: String| {
            Err(vec![RuleError {
                file: file.clone(),
                rule_id: None,
                field: "file".to_string(),
                reason,
            }])
        };
        let mut text = String::new();
        let read = std::fs::File::open(path)
            .and_then(|f| f.take(MAX_FILE_BYTES + 1).read_to_string(&mut text));
        match read {
            Err(e) => fail(format!("cannot read: {e}")),
            Ok(n) if n as u64 > MAX_FILE_BYTES => {
                fail(format!("larger than {MAX_FILE_BYTES} bytes"))
            }
            Ok(_) => RuleSet::parse(&text, &file, version),
        }
    }
}

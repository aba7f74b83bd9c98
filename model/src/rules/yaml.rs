//! The YAML rule file (SPEC §4), behind the `yaml` feature: reading it
//! with serde_yaml and checking each entry field by field.

use std::collections::HashMap;
use std::io::Read;
use std::path::Path;

use serde_yaml::{Mapping, Value};

use super::*;

/// [`RuleSet::load`] refuses files larger than this.
const MAX_FILE_BYTES: u64 = 16 * 1024 * 1024;
/// Fields a rule entry may have.
const RULE_FIELDS: [&str; 9] = [
    "id",
    "match",
    "rate",
    "burst",
    "fail_policy",
    "overrides",
    "shadow",
    "domain",
    "max_keys",
];

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

/// A serde_yaml error with its location.
fn yaml_reason(e: &serde_yaml::Error) -> String {
    let msg = e.to_string();
    match e.location() {
        Some(loc) if !msg.contains(" at line ") => {
            format!("{msg} at line {} column {}", loc.line(), loc.column())
        }
        _ => msg,
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
        rule: None,
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

    // rate
    let mut rate = Rate {
        tokens: 1,
        period_s: 1,
    };
    match map.get("rate") {
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

    // burst
    let mut burst = 1;
    match map.get("burst") {
        None => errs.rule(at, "burst", format!("required (1 to {MAX_BURST})")),
        Some(v) => match yaml_uint(v).and_then(check_burst) {
            Ok(b) => burst = b,
            Err(e) => errs.rule(at, "burst", e),
        },
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
                check_overrides(at, own, &draft.overrides, first, errs);
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

    if errs.len() == before {
        draft.rule = Some(Rule {
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
        });
    }
    draft
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
    /// are applied.
    pub fn parse(text: &str, file: &str, version: u64) -> Result<RuleSet, Vec<RuleError>> {
        let mut errs = Errors::new(file);
        let mut root: Value = match serde_yaml::from_str(text) {
            Ok(v) => v,
            Err(e) => {
                errs.root("yaml", yaml_reason(&e));
                return Err(errs.list);
            }
        };
        if let Err(e) = root.apply_merge() {
            errs.root("yaml", yaml_reason(&e));
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
        let (locs, first) = locate(&ids);
        let drafts: Vec<Draft> = entries
            .iter()
            .zip(&locs)
            .map(|(entry, at)| rule_from_yaml(entry, at, &first, &mut errs))
            .collect();
        finish(version, &locs, drafts, &first, errs)
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

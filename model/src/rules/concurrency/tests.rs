use super::*;

const MODEL_CALLS: &str = r#"
rules:
  - id: model-calls
    match: { tenant: "*", route: /v1/generate }
    concurrency: 16
    permit_ttl: 10s
    max_hold: 30m
    fail_policy: closed
"#;

fn parse(text: &str) -> Result<RuleSet, Vec<RuleError>> {
    RuleSet::parse(text, "f.yaml", 1)
}

/// A rule with `concurrency: 4` and the other fields valid, with `extra`
/// lines appended.
fn permit_rule(extra: &str) -> String {
    format!("rules:\n  - id: p\n    match: {{ tenant: \"*\" }}\n    concurrency: 4\n{extra}")
}

/// The only error of `text`, on rule `rule` and `field`; its reason.
fn single_error(text: &str, rule: Option<&str>, field: &str) -> String {
    let errs = match parse(text) {
        Ok(rs) => panic!("expected an error, parsed {rs:?}"),
        Err(e) => e,
    };
    assert_eq!(errs.len(), 1, "expected one error, got {errs:#?}");
    let e = &errs[0];
    assert_eq!(e.rule_id.as_deref(), rule, "{e}");
    assert_eq!(e.field, field, "{e}");
    e.reason.clone()
}

#[test]
fn the_spec_example_is_a_permit_rule_without_a_rate() {
    let rs = parse(MODEL_CALLS).unwrap();
    assert!(rs.rules.is_empty(), "{rs:?}");
    assert_eq!(
        rs.permit_rules,
        vec![PermitRule {
            id: "model-calls".into(),
            tenant: Pattern::PerValue,
            route: Pattern::Exact("/v1/generate".into()),
            concurrency: 16,
            permit_ttl_ms: 10_000,
            max_hold_ms: 30 * 60_000,
            fail_policy: FailPolicy::Closed,
            domain: None,
            max_keys: None,
        }]
    );
    assert_eq!(
        rs.summary(),
        "model-calls  tenant=* route=/v1/generate  concurrency=16 permit_ttl=10s max_hold=30m fail_policy=closed\n"
    );
}

#[test]
fn a_rule_with_both_is_in_both_lists_under_one_id() {
    let rs = parse(&permit_rule(
        "    rate: 10/s\n    burst: 20\n    permit_ttl: 500ms\n    domain: edge\n    max_keys: 9\n",
    ))
    .unwrap();
    assert_eq!(rs.rules.len(), 1);
    assert_eq!(rs.permit_rules.len(), 1);
    let (r, p) = (&rs.rules[0], &rs.permit_rules[0]);
    assert_eq!((r.id.as_str(), p.id.as_str()), ("p", "p"));
    assert_eq!((r.burst, p.concurrency, p.permit_ttl_ms), (20, 4, 500));
    assert_eq!(p.max_hold_ms, DEFAULT_MAX_HOLD_MS);
    assert_eq!((p.domain.as_deref(), p.max_keys), (Some("edge"), Some(9)));
    assert_eq!(rs.get("p"), Some(r));
    assert_eq!(rs.permit_rule("p"), Some(p));
    assert_eq!(
        rs.summary(),
        "p  tenant=*  rate=10/s burst=20 concurrency=4 permit_ttl=500ms max_hold=30m fail_policy=open domain=edge max_keys=9\n"
    );
}

#[test]
fn defaults_and_a_long_ttl_without_max_hold() {
    let p = &parse(&permit_rule("")).unwrap().permit_rules[0];
    assert_eq!(
        (p.permit_ttl_ms, p.max_hold_ms),
        (DEFAULT_PERMIT_TTL_MS, DEFAULT_MAX_HOLD_MS)
    );
    let p = &parse(&permit_rule("    permit_ttl: 1m\n"))
        .unwrap()
        .permit_rules[0];
    assert_eq!(
        (p.permit_ttl_ms, p.max_hold_ms),
        (60_000, DEFAULT_MAX_HOLD_MS)
    );
    let p = &parse(&permit_rule("    permit_ttl: 1m\n    max_hold: 1m\n"))
        .unwrap()
        .permit_rules[0];
    assert_eq!(p.max_hold_ms, 60_000);
}

#[test]
fn bad_fields_are_errors_naming_the_field() {
    let cases: &[(&str, &str, &str)] = &[
        ("    concurrency: 0\n", "concurrency", "from 1 to"),
        ("    concurrency: 1000001\n", "concurrency", "from 1 to"),
        ("    concurrency: -3\n", "concurrency", "negative"),
        (
            "    concurrency: \"4\"\n",
            "concurrency",
            "remove the quotes",
        ),
        ("    permit_ttl: 0s\n", "permit_ttl", "from 100ms to 1m"),
        ("    permit_ttl: 50ms\n", "permit_ttl", "from 100ms to 1m"),
        ("    permit_ttl: 61s\n", "permit_ttl", "longest lease"),
        ("    permit_ttl: 10\n", "permit_ttl", "with a unit"),
        ("    permit_ttl: ten s\n", "permit_ttl", "not a duration"),
        ("    permit_ttl: 10y\n", "permit_ttl", "not a duration"),
        (
            "    permit_ttl: 99999999999999999999s\n",
            "permit_ttl",
            "too long",
        ),
        ("    permit_ttl: [1s]\n", "permit_ttl", "a list"),
        (
            "    max_hold: 5s\n",
            "max_hold",
            "at least permit_ttl (10s)",
        ),
        ("    max_hold: 8d\n", "max_hold", "at most 7d"),
        ("    rate: 1/s\n", "burst", "required"),
        ("    burst: 5\n", "rate", "required with burst"),
        ("    overrides: [x]\n", "overrides", "not supported"),
        ("    shadow: true\n", "shadow", "not supported"),
    ];
    for (extra, field, reason) in cases {
        let text = match extra.trim_start().starts_with("concurrency:") {
            true => format!("rules:\n  - id: p\n    match: {{ tenant: \"*\" }}\n{extra}"),
            false => permit_rule(extra),
        };
        let got = single_error(&text, Some("p"), field);
        assert!(got.contains(reason), "{extra:?}: {got}");
    }
    // Without concurrency, a permit's settings mean nothing.
    let text = "rules:\n  - id: r\n    match: { tenant: \"*\" }\n    rate: 1/s\n    burst: 1\n    permit_ttl: 10s\n";
    let got = single_error(text, Some("r"), "permit_ttl");
    assert!(got.contains("only with concurrency"), "{got}");
    // A rule with neither a rate nor a concurrency still asks for a rate.
    let errs = parse("rules:\n  - id: r\n    match: { tenant: \"*\" }\n").unwrap_err();
    let fields: Vec<&str> = errs.iter().map(|e| e.field.as_str()).collect();
    assert_eq!(fields, ["rate", "burst"], "{errs:#?}");
}

#[test]
fn overrides_name_rules_with_a_rate() {
    let text = format!(
        "{}  - id: r\n    match: {{ tenant: \"*\" }}\n    rate: 1/s\n    burst: 1\n    overrides: [p]\n",
        permit_rule("")
    );
    let got = single_error(&text, Some("r"), "overrides");
    assert!(got.contains("has no rate"), "{got}");
}

#[test]
fn the_wire_form_round_trips_and_is_checked_again() {
    let text = format!(
        "{}  - id: both\n    match: {{ route: /x }}\n    rate: 1/m\n    burst: 2\n    concurrency: 3\n    max_hold: 2h\n",
        permit_rule("    domain: d\n")
    );
    let rs = parse(&text).unwrap();
    let pb = rs.to_proto();
    assert_eq!(pb.rules.len(), 1);
    assert_eq!(pb.permit_rules.len(), 2);
    assert_eq!(RuleSet::from_proto(&pb).unwrap(), rs);

    let mut bad = pb.clone();
    bad.permit_rules[1].route = "/y".into();
    let errs = RuleSet::from_proto(&bad).unwrap_err();
    assert_eq!(errs.len(), 1, "{errs:#?}");
    assert_eq!(
        (errs[0].rule_id.as_deref(), errs[0].field.as_str()),
        (Some("both"), "match")
    );

    let mut bad = pb.clone();
    bad.permit_rules[0].concurrency = 0;
    bad.permit_rules[0].permit_ttl_ms = 90_000;
    bad.permit_rules[1].id = "no spaces".into();
    bad.permit_rules[1].max_hold_ms = 1;
    let errs = RuleSet::from_proto(&bad).unwrap_err();
    let shown: Vec<String> = errs.iter().map(|e| e.to_string()).collect();
    assert_eq!(shown.len(), 4, "{shown:#?}");
    assert!(
        shown[0].starts_with("<allocator>: rule p: field concurrency:"),
        "{shown:#?}"
    );
    assert!(
        shown[1].starts_with("<allocator>: rule p: field permit_ttl:"),
        "{shown:#?}"
    );
    assert!(
        shown[2].starts_with("<allocator>: permit_rules[1]: field id:"),
        "{shown:#?}"
    );
    assert!(
        shown[3].starts_with("<allocator>: permit_rules[1]: field max_hold:"),
        "{shown:#?}"
    );

    let mut dup = pb;
    dup.permit_rules[1].id = "p".into();
    let errs = RuleSet::from_proto(&dup).unwrap_err();
    assert!(
        errs.iter()
            .any(|e| e.field == "permit_rules[1].id" && e.reason.contains("duplicate")),
        "{errs:#?}"
    );
}

#[test]
fn matching_keeps_the_two_kinds_apart() {
    let text = format!(
        "{}  - id: r\n    match: {{ route: /x }}\n    rate: 1/s\n    burst: 1\n  - id: q\n    match: {{ tenant: acme, route: /x }}\n    concurrency: 1\n    domain: edge\n",
        permit_rule("")
    );
    let rs = parse(&text).unwrap();
    let permits = |d: Option<&str>, t: &str, r: &str| -> Vec<&str> {
        let m = rs.match_permit_rules(d, t, r).unwrap();
        m.indices()
            .iter()
            .map(|&i| rs.permit_rules[i as usize].id.as_str())
            .collect()
    };
    assert_eq!(permits(None, "acme", "/x"), ["p"]);
    assert_eq!(permits(Some("edge"), "acme", "/x"), ["p", "q"]);
    assert_eq!(permits(Some("edge"), "acme", "/y"), ["p"]);
    let rates: Vec<&str> = rs
        .matching(Some("edge"), "acme", "/x")
        .unwrap()
        .iter()
        .map(|r| r.id.as_str())
        .collect();
    assert_eq!(rates, ["r"]);
}

#[test]
fn more_permit_rules_on_one_request_than_a_request_may_match_is_an_error() {
    let mut text = String::from("rules:\n");
    for i in 0..=crate::matching::MAX_MATCHED {
        text.push_str(&format!(
            "  - id: p{i}\n    match: {{ tenant: \"*\", route: /r{i} }}\n    concurrency: 1\n  - id: q{i}\n    match: {{ tenant: t }}\n    concurrency: 1\n    domain: d{i}\n"
        ));
    }
    // Each domain adds one rule for tenant t: 2 per request at most.
    assert_eq!(parse(&text).unwrap().permit_rules.len(), 34);
    let mut text = String::from("rules:\n");
    for i in 0..=crate::matching::MAX_MATCHED {
        text.push_str(&format!(
            "  - id: more{i}\n    match: {{ tenant: t }}\n    concurrency: 2\n"
        ));
    }
    let errs = parse(&text).unwrap_err();
    assert_eq!(errs.len(), 1, "{errs:#?}");
    assert_eq!(errs[0].field, "match");
    assert!(
        errs[0].reason.contains("every request with tenant t"),
        "{}",
        errs[0]
    );
}

#[test]
fn durations_read_and_print() {
    for (text, ms) in [
        ("250ms", 250),
        ("10s", 10_000),
        (" 30m ", 1_800_000),
        ("2h", 7_200_000),
        ("1d", 86_400_000),
        ("0s", 0),
    ] {
        assert_eq!(parse_duration_ms(text), Ok(ms), "{text:?}");
    }
    for bad in ["", "s", "10", "1.5s", "-1s", "10 s", "1w"] {
        assert!(parse_duration_ms(bad).is_err(), "{bad:?}");
    }
    for (ms, text) in [
        (250, "250ms"),
        (1_500, "1500ms"),
        (10_000, "10s"),
        (90_000, "90s"),
        (1_800_000, "30m"),
        (86_400_000, "1d"),
        (0, "0ms"),
    ] {
        assert_eq!(duration_text(ms), text);
    }
}

/// Two sets limit the same only when their rate and permit rules are the
/// same: a change of `concurrency` alone is a change (a reload once
/// ignored it).
#[test]
fn a_change_of_concurrency_alone_changes_the_limits() {
    let a = RuleSet::parse(MODEL_CALLS, "f.yaml", 1).unwrap();
    let same = RuleSet::parse(MODEL_CALLS, "f.yaml", 2).unwrap();
    let lowered = RuleSet::parse(
        &MODEL_CALLS.replace("concurrency: 16", "concurrency: 2"),
        "f.yaml",
        3,
    )
    .unwrap();
    assert!(a.same_limits(&same));
    assert_eq!(a.rules, lowered.rules, "no rate rule differs");
    assert!(!a.same_limits(&lowered));
}

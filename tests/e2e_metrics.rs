//! End to end, `/metrics` of real processes: a global allocator, a regional
//! allocator under it, and an agent under each, all child processes with
//! some traffic through them. Their live output
//!
//! * passes `promtool check metrics` (HELP on every metric, base units,
//!   counters named `_total`; promtool is Debian's, installed by
//!   scripts/test.sh: under `CI` a missing promtool fails the test);
//! * is served as the Prometheus text format (its Content-Type);
//! * has the renewal latency as a histogram in seconds, with the
//!   renewals counted;
//! * names no tenant or route value;
//! * holds every metric that the Grafana dashboard
//!   (`deploy/grafana/quotalease.json`) queries.

mod common;

use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use common::*;

const RULES: &str = r#"
rules:
  - id: orders
    match: { tenant: "*", route: /api/orders }
    rate: 100/s
    burst: 5
    fail_policy: open
  - id: login
    match: { tenant: "*", route: /api/login }
    rate: 5/m
    burst: 2
    fail_policy: closed
"#;

/// The tenant the traffic uses: it must never show in a metric.
const TENANT: &str = "tenant-c0ffee";

/// One live scrape of each process.
struct Scrape {
    name: &'static str,
    content_type: String,
    body: String,
}

/// Start the processes, send traffic, scrape each once, stop them (so
/// nothing outlives the test binary), and keep the scrapes for every test.
fn scrapes() -> &'static [Scrape] {
    static SCRAPES: OnceLock<Vec<Scrape>> = OnceLock::new();
    SCRAPES.get_or_init(|| {
        let dir = tempdir("metrics");
        let rules = write_rules(&dir, RULES);
        let global = allocator(&rules, &dir.join("state"), None, "2s");
        wait_ok(global.http, "/readyz", Duration::from_secs(10));
        let regional = regional(&global.url(), "eu", None, &[]);
        wait_ok(regional.http, "/readyz", Duration::from_secs(10));
        let agent_g = agent("metrics-g", &global.url(), None, &[]);
        let agent_r = agent("metrics-r", &regional.url(), None, &[]);
        for a in [&agent_g, &agent_r] {
            wait_ok(a.http, "/readyz", Duration::from_secs(10));
        }
        // Admissions and denials on both rules, a check no rule matches,
        // and a replay, at both agents.
        for a in [&agent_g, &agent_r] {
            for route in ["/api/orders", "/api/login", "/api/none"] {
                for _ in 0..8 {
                    let (status, body) =
                        http_get(a.http, &format!("/v1/check?tenant={TENANT}&route={route}"));
                    assert!(
                        [200, 429].contains(&status),
                        "{}: check {route}: {status} {body}",
                        a.name
                    );
                }
            }
        }
        // Wait until each agent has a renewal round trip recorded and the
        // regional has been through its parent (heartbeats or leases).
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let renewed = [&agent_g, &agent_r].iter().all(|a| {
                let (_, m) = http_get(a.http, "/metrics");
                metric(&m, "quotalease_agent_renewal_latency_seconds_count").unwrap_or(0.0) > 0.0
            });
            let (_, rm) = http_get(regional.http, "/metrics");
            let upstream =
                metric(&rm, "quotalease_regional_upstream_replies_total").unwrap_or(0.0) > 0.0;
            if renewed && upstream {
                break;
            }
            assert!(Instant::now() < deadline, "no renewal recorded within 10 s");
            std::thread::sleep(Duration::from_millis(100));
        }
        [
            ("global allocator", &global),
            ("regional allocator", &regional),
            ("agent (global)", &agent_g),
            ("agent (regional)", &agent_r),
        ]
        .into_iter()
        .map(|(name, p)| {
            let (status, headers, body) = http_get_with_headers(p.http, "/metrics");
            assert_eq!(status, 200, "{name}: /metrics: {body}");
            let content_type = headers
                .iter()
                .find(|(k, _)| k == "content-type")
                .map(|(_, v)| v.clone())
                .unwrap_or_default();
            Scrape {
                name,
                content_type,
                body,
            }
        })
        .collect()
    })
}

fn scrape(name: &str) -> &'static Scrape {
    scrapes()
        .iter()
        .find(|s| s.name == name)
        .unwrap_or_else(|| panic!("no scrape of {name}"))
}

/// promtool from `PROMTOOL` or `PATH`. Missing: a failure under `CI`
/// (scripts/test.sh installs it), else a skip notice.
fn promtool() -> Option<PathBuf> {
    let found = std::env::var_os("PROMTOOL").map(PathBuf::from).or_else(|| {
        std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
            .map(|d| d.join("promtool"))
            .find(|p| p.is_file())
    });
    match found {
        Some(p) => Some(p),
        None if std::env::var_os("CI").is_some() => panic!(
            "promtool is not installed, and CI is set: run scripts/test.sh (it extracts \
             /usr/local/bin/promtool from Debian's prometheus package), or set PROMTOOL"
        ),
        None => {
            // Straight to stderr: the test harness captures eprintln! of
            // passing tests, and this notice must be seen.
            let _ = writeln!(
                std::io::stderr(),
                "SKIP: promtool not found (PATH or PROMTOOL); scripts/test.sh installs it. \
                 Under CI this is a failure."
            );
            None
        }
    }
}

/// `promtool check metrics` on `text`: (success, what it printed).
fn promtool_check(promtool: &Path, text: &str) -> (bool, String) {
    let mut child = Command::new(promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("run {}: {e}", promtool.display()));
    child
        .stdin
        .take()
        .expect("piped stdin")
        .write_all(text.as_bytes())
        .expect("write to promtool");
    let out = child.wait_with_output().expect("promtool output");
    let printed = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), printed)
}

#[test]
fn promtool_finds_no_problem_in_live_metrics() {
    let Some(promtool) = promtool() else {
        return;
    };
    let mut problems = Vec::new();
    for s in scrapes() {
        // Not vacuous: every process exports a good number of families.
        let families = s.body.lines().filter(|l| l.starts_with("# TYPE ")).count();
        assert!(
            families >= 15,
            "{}: only {families} metrics:\n{}",
            s.name,
            s.body
        );
        let (ok, printed) = promtool_check(&promtool, &s.body);
        if !ok || !printed.trim().is_empty() {
            problems.push(format!("{} (ok: {ok}):\n{printed}", s.name));
        }
    }
    assert!(
        problems.is_empty(),
        "promtool check metrics:\n{}",
        problems.join("\n")
    );
}

/// The check above can fail: the same promtool flags what the old
/// hand-written exposition had (no HELP, microseconds, a summary).
#[test]
fn promtool_flags_the_old_conventions() {
    let Some(promtool) = promtool() else {
        return;
    };
    let old = "# TYPE quotalease_agent_keys_held gauge\nquotalease_agent_keys_held 3\n\
               # HELP quotalease_agent_renewal_latency_us x\n\
               # TYPE quotalease_agent_renewal_latency_us summary\n\
               quotalease_agent_renewal_latency_us{quantile=\"0.5\"} 700\n";
    let (ok, printed) = promtool_check(&promtool, old);
    assert!(!ok, "promtool accepted:\n{old}\nsaying {printed}");
    assert!(printed.contains("no help text"), "{printed}");
    assert!(printed.contains("_us"), "{printed}");
}

#[test]
fn metrics_are_served_as_prometheus_text() {
    for s in scrapes() {
        assert_eq!(
            s.content_type, "text/plain; version=0.0.4; charset=utf-8",
            "{}",
            s.name
        );
        // Every sample has a HELP and a TYPE before it (the text format
        // names the family of `_bucket`, `_sum`, `_count` samples).
        let described: BTreeSet<&str> = s
            .body
            .lines()
            .filter_map(|l| l.strip_prefix("# HELP "))
            .filter_map(|l| l.split_whitespace().next())
            .collect();
        for name in sample_names(&s.body) {
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|suf| name.strip_suffix(suf).filter(|f| described.contains(f)))
                .unwrap_or(name.as_str());
            assert!(
                described.contains(family),
                "{}: {name} has no HELP:\n{}",
                s.name,
                s.body
            );
        }
        assert!(
            !s.body.contains(TENANT) && !s.body.contains("/api/"),
            "{}: a tenant or route value in the metrics:\n{}",
            s.name,
            s.body
        );
    }
}

#[test]
fn renewal_latency_is_a_histogram_in_seconds() {
    for name in ["agent (global)", "agent (regional)"] {
        let m = &scrape(name).body;
        assert!(
            m.lines()
                .any(|l| l == "# TYPE quotalease_agent_renewal_latency_seconds histogram"),
            "{name}:\n{m}"
        );
        assert!(!m.contains("_us"), "{name}: a metric in microseconds:\n{m}");
        let count = metric(m, "quotalease_agent_renewal_latency_seconds_count").unwrap_or(0.0);
        let inf = m
            .lines()
            .find(|l| l.starts_with("quotalease_agent_renewal_latency_seconds_bucket{le=\"+Inf\"}"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<f64>().ok());
        assert!(count > 0.0, "{name}: no renewal counted:\n{m}");
        assert_eq!(inf, Some(count), "{name}: +Inf bucket is not the count");
        // Seconds: a loopback renewal takes well under a second on average.
        let sum = metric(m, "quotalease_agent_renewal_latency_seconds_sum").unwrap_or(f64::NAN);
        assert!(sum / count < 1.0, "{name}: mean renewal {} s", sum / count);
        // Buckets from 100 us to 10 s.
        for le in ["0.0001", "10"] {
            assert!(
                m.contains(&format!(
                    "quotalease_agent_renewal_latency_seconds_bucket{{le=\"{le}\"}}"
                )),
                "{name}: no bucket le={le}"
            );
        }
    }
}

/// Names of the samples in a Prometheus text body.
fn sample_names(body: &str) -> BTreeSet<String> {
    body.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_string)
        .collect()
}

/// Metric names (`quotalease_…`) in a PromQL expression.
fn metric_names_in(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = expr;
    while let Some(i) = rest.find("quotalease_") {
        // Not the tail of a longer identifier.
        let before = rest[..i].chars().next_back();
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
            .unwrap_or(tail.len());
        if !before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
            out.push(tail[..end].to_string());
        }
        rest = &tail[end..];
    }
    out
}

/// Every string under a key named `key`, anywhere in `v`.
fn strings_under<'a>(v: &'a serde_json::Value, key: &str, out: &mut Vec<&'a str>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, x) in m {
                match x {
                    serde_json::Value::String(s) if k == key => out.push(s),
                    _ => strings_under(x, key, out),
                }
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|x| strings_under(x, key, out)),
        _ => {}
    }
}

#[test]
fn dashboard_queries_only_exported_metrics() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/grafana/quotalease.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let dashboard: serde_json::Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(dashboard["title"], "quotalease");

    let exported: BTreeSet<String> = scrapes()
        .iter()
        .flat_map(|s| sample_names(&s.body))
        .collect();
    let mut exprs = Vec::new();
    strings_under(&dashboard, "expr", &mut exprs);
    assert!(
        exprs.len() >= 20,
        "only {} queries in the dashboard",
        exprs.len()
    );
    let mut unknown = Vec::new();
    let mut used = BTreeSet::new();
    for expr in &exprs {
        let names = metric_names_in(expr);
        assert!(
            !names.is_empty(),
            "a query that names no quotalease metric: {expr}"
        );
        for n in names {
            if !exported.contains(&n) {
                unknown.push(format!("{n} (in {expr})"));
            }
            used.insert(n);
        }
    }
    // Variables (templating) may query metrics too.
    let mut queries = Vec::new();
    strings_under(&dashboard["templating"], "query", &mut queries);
    for q in queries {
        for n in metric_names_in(q) {
            if !exported.contains(&n) {
                unknown.push(format!("{n} (in variable query {q})"));
            }
        }
    }
    assert!(
        unknown.is_empty(),
        "the dashboard queries metrics no process exports:\n{}\nexported: {exported:?}",
        unknown.join("\n")
    );
    // It covers the agent, the allocator and the regional allocator.
    for prefix in [
        "quotalease_agent_",
        "quotalease_allocator_",
        "quotalease_regional_",
    ] {
        assert!(
            used.iter().any(|n| n.starts_with(prefix)),
            "no {prefix}* metric on the dashboard"
        );
    }
}

/// docs/operations.md lists every metric the processes export, with its
/// type, and no other.
#[test]
fn operations_doc_lists_the_exported_metrics() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/operations.md");
    let doc = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    // Table rows: | `name` | type | ...
    let documented: BTreeSet<(String, String)> = doc
        .lines()
        .filter_map(|l| {
            let mut cells = l.split('|').map(str::trim).skip(1);
            let name = cells.next()?.strip_prefix('`')?.strip_suffix('`')?;
            let kind = cells.next()?;
            name.starts_with("quotalease_")
                .then(|| (name.to_string(), kind.to_string()))
        })
        .collect();
    let exported: BTreeSet<(String, String)> = scrapes()
        .iter()
        .flat_map(|s| s.body.lines())
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_once(' '))
        .map(|(n, t)| (n.to_string(), t.to_string()))
        .collect();
    assert!(
        exported.len() >= 45,
        "only {} families exported",
        exported.len()
    );
    let missing: Vec<_> = exported.difference(&documented).collect();
    let extra: Vec<_> = documented.difference(&exported).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "docs/operations.md is not true to /metrics:\nexported, not documented: {missing:?}\ndocumented, not exported: {extra:?}"
    );
}

#[test]
fn metric_names_are_found_in_promql() {
    assert_eq!(
        metric_names_in(
            "histogram_quantile(0.99, sum by (le) (rate(quotalease_agent_renewal_latency_seconds_bucket[5m]))) / x_quotalease_no"
        ),
        ["quotalease_agent_renewal_latency_seconds_bucket"]
    );
    assert_eq!(
        metric_names_in("sum(quotalease_a{rule=\"x\"}) + quotalease_b"),
        ["quotalease_a", "quotalease_b"]
    );
}

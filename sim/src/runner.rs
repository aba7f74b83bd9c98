//! Runs scenarios: one seed (a report with tables, CSV series and SVG
//! plots) or a sweep over many seeds (every failing seed named with the
//! command that replays it).

use std::path::Path;

use quotalease_model::rules::FailPolicy;

use crate::quality;
use crate::report::{LinePlot, Report, Section, Table};
use crate::scenario::Scenario;
use crate::world::{KeyStats, Outcome, World};

const SEC: u64 = 1_000_000_000;

/// Run every variant of `sc` with `seed` (and, if it judges liveness, the
/// reference run of each, [`crate::liveness::reference`]).
pub fn run_all(sc: &Scenario, seed: u64) -> Result<Vec<Outcome>, String> {
    sc.runs()
        .iter()
        .map(|v| {
            let mut o = World::new(sc.clone(), v, seed)?.run();
            with_reference(sc, v, seed, &mut o)?;
            Ok(o)
        })
        .collect()
}

/// Attach the reference run to `o` when `sc` judges liveness.
fn with_reference(
    sc: &Scenario,
    v: &crate::scenario::Variant,
    seed: u64,
    o: &mut Outcome,
) -> Result<(), String> {
    if sc.liveness {
        let r = World::new(crate::liveness::reference(sc), v, seed)?.run();
        o.reference = Some(Box::new(r));
    }
    Ok(())
}

/// [`run_all`], printing a progress line to stderr every 10 simulated
/// seconds of each variant (wall time since `started`).
pub fn run_all_with_progress(
    sc: &Scenario,
    seed: u64,
    started: std::time::Instant,
) -> Result<Vec<Outcome>, String> {
    let mut out = Vec::new();
    for v in sc.runs() {
        let w = World::new(sc.clone(), &v, seed)?;
        let name = if v.name.is_empty() {
            sc.name.clone()
        } else {
            format!("{}/{}", sc.name, v.name)
        };
        let mut o = w.run_with_progress(10 * SEC, |t, end| {
            eprintln!(
                "{name}: seed {seed}: {} / {} simulated s ({:.1} s wall)",
                t / SEC,
                end / SEC,
                started.elapsed().as_secs_f64()
            );
        });
        with_reference(sc, &v, seed, &mut o)?;
        out.push(o);
    }
    Ok(out)
}

/// Run `scenario` with `seed`, write the report into `out`; returns the
/// failures (empty: every invariant held). Progress goes to stderr.
pub fn run_to_dir(sc: &Scenario, seed: u64, out: &Path) -> Result<Vec<String>, String> {
    let outcomes = run_all_with_progress(sc, seed, std::time::Instant::now())?;
    let report = build_report(sc, seed, &outcomes);
    std::fs::create_dir_all(out).map_err(|e| format!("--out {}: {e}", out.display()))?;
    crate::report::write(&report, out).map_err(|e| format!("--out {}: {e}", out.display()))?;
    Ok(outcomes
        .iter()
        .flat_map(|o| o.failures().into_iter().map(|f| format!("{}: {f}", o.name)))
        .collect())
}

/// One failing seed of a sweep.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    /// The seed.
    pub seed: u64,
    /// What broke.
    pub what: Vec<String>,
}

/// Run seeds `from..=to` on `jobs` threads (0: one per core); the failing
/// ones, in seed order (the same for any number of jobs: every run is its
/// own world).
pub fn sweep(sc: &Scenario, from: u64, to: u64, jobs: usize) -> Result<Vec<Failure>, String> {
    sweep_indexed(sc, from, to, jobs).map(|(failed, _)| failed)
}

/// [`sweep`], and the sweep's index: one row per seed, variant and
/// tracked key with its quality figures, and their spread over the seeds
/// (`quotalease sim --seeds A..B --out DIR` writes it as `DIR/report.md`).
pub fn sweep_indexed(
    sc: &Scenario,
    from: u64,
    to: u64,
    jobs: usize,
) -> Result<(Vec<Failure>, Report), String> {
    let mut failed = Vec::new();
    let mut rows: Vec<SweepRow> = Vec::new();
    let mut error = None;
    for_seeds(
        from..=to,
        jobs,
        |seed| {
            run_all(sc, seed).map(|outcomes| {
                let what = outcomes
                    .iter()
                    .flat_map(|o| o.failures().into_iter().map(|f| format!("{}: {f}", o.name)))
                    .collect::<Vec<String>>();
                let rows = outcomes.iter().flat_map(sweep_rows).collect::<Vec<_>>();
                (what, rows)
            })
        },
        |seed, result| match result {
            Ok((what, r)) => {
                rows.extend(r);
                if !what.is_empty() {
                    failed.push(Failure { seed, what });
                }
            }
            Err(e) => {
                error.get_or_insert(e);
            }
        },
    );
    match error {
        Some(e) => Err(e),
        None => {
            let index = sweep_index(sc, from, to, &rows, &failed);
            Ok((failed, index))
        }
    }
}

/// One seed's figures for one tracked key of one variant.
#[derive(Clone, Debug)]
struct SweepRow {
    seed: u64,
    variant: String,
    key: String,
    ok: bool,
    /// Largest `admitted - (B + R*T)` over every window (<= 0: I1 held).
    excess: i64,
    /// `(name, value)` of each quality figure, in the index's column order.
    figures: [f64; 6],
}

/// The index's quality columns: name, and how many decimals.
const SWEEP_COLUMNS: [(&str, usize); 6] = [
    ("util. min %", 1),
    ("util. mean %", 1),
    ("false rejects %", 3),
    ("vs ideal %", 1),
    ("checks/msg agent tier", 1),
    ("region share p95/p5", 2),
];

fn sweep_rows(o: &Outcome) -> Vec<SweepRow> {
    let ok = o.failures().is_empty();
    shown(o)
        .into_iter()
        .filter(|k| k.tracked.is_some())
        .map(|k| {
            let f = figures(o, k);
            SweepRow {
                seed: o.seed,
                variant: o.name.clone(),
                key: key_name(k),
                ok,
                excess: k.checker.worst().excess,
                figures: [
                    f.utilization_min * 100.0,
                    f.utilization_mean * 100.0,
                    f.false_reject_ratio * 100.0,
                    f.versus_ideal * 100.0,
                    f.checks_per_msg_agent,
                    f.share_p95_p5,
                ],
            }
        })
        .collect()
}

/// The sweep's report: the spread over seeds of each variant's tracked
/// keys (min, median, max of every figure, and the seed of each extreme),
/// then every seed's row.
fn sweep_index(sc: &Scenario, from: u64, to: u64, rows: &[SweepRow], failed: &[Failure]) -> Report {
    let mut groups: Vec<(String, String)> = Vec::new();
    for r in rows {
        let g = (r.variant.clone(), r.key.clone());
        if !groups.contains(&g) {
            groups.push(g);
        }
    }
    let mut spread_rows = Vec::new();
    for (variant, key) in &groups {
        let of: Vec<&SweepRow> = rows
            .iter()
            .filter(|r| &r.variant == variant && &r.key == key)
            .collect();
        let worst = of.iter().max_by_key(|r| (r.excess, r.seed)).expect("a row");
        let mut row = vec![
            variant.clone(),
            key.clone(),
            of.len().to_string(),
            format!("{} (seed {})", worst.excess, worst.seed),
        ];
        for (c, (_, digits)) in SWEEP_COLUMNS.iter().enumerate() {
            let mut v: Vec<(f64, u64)> = of
                .iter()
                .map(|r| (r.figures[c], r.seed))
                .filter(|(x, _)| x.is_finite())
                .collect();
            if v.is_empty() {
                row.push("-".into());
                continue;
            }
            v.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
            let (lo, hi, mid) = (v[0], v[v.len() - 1], v[v.len() / 2].0);
            row.push(format!(
                "{} / {} / {} (seeds {}, {})",
                fmt_f(lo.0, *digits),
                fmt_f(mid, *digits),
                fmt_f(hi.0, *digits),
                lo.1,
                hi.1
            ));
        }
        spread_rows.push(row);
    }
    let mut headers: Vec<String> = [
        "variant",
        "key",
        "seeds",
        "largest window excess (worst seed)",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    headers.extend(
        SWEEP_COLUMNS
            .iter()
            .map(|(n, _)| format!("{n}: min / median / max")),
    );
    let spread = Table {
        title: "Spread over the seeds".into(),
        headers,
        rows: spread_rows,
    };
    let mut headers: Vec<String> = ["seed", "variant", "key", "verdict", "largest window excess"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    headers.extend(SWEEP_COLUMNS.iter().map(|(n, _)| n.to_string()));
    let per_seed = Table {
        title: "Every seed".into(),
        headers,
        rows: rows
            .iter()
            .map(|r| {
                let mut row = vec![
                    r.seed.to_string(),
                    r.variant.clone(),
                    r.key.clone(),
                    if r.ok { "ok".into() } else { "FAILED".into() },
                    r.excess.to_string(),
                ];
                row.extend(
                    r.figures
                        .iter()
                        .zip(SWEEP_COLUMNS)
                        .map(|(x, (_, d))| fmt_f(*x, d)),
                );
                row
            })
            .collect(),
    };
    let total = to - from + 1;
    Report {
        title: format!("{}: seeds {from}..{to}", sc.name),
        preamble: vec![
            format!(
                "{} of {total} seeds passed (I1, I2, I3 and liveness checked in every run){}.",
                total - failed.len() as u64,
                if failed.is_empty() {
                    String::new()
                } else {
                    format!(
                        "; failed: {}",
                        failed
                            .iter()
                            .map(|f| f.seed.to_string())
                            .collect::<Vec<_>>()
                            .join(", ")
                    )
                }
            ),
            "One row per seed, variant and tracked key; the figures are the ones of each run's report (its Keys table explains them): utilization is admitted / (R*T) over windows of 10 x TTL_max after warm-up, *vs ideal* the tokens admitted over those one ideal global bucket admits over the same arrivals, *region share p95/p5* the steadiness of the regions' shares (SPEC §2: <= 1.2). Replay a seed with `quotalease sim --scenario FILE --seed N` for its plots.".into(),
        ],
        sections: vec![Section {
            title: "Quality over the seeds".into(),
            paragraphs: Vec::new(),
            tables: vec![spread, per_seed],
            plots: Vec::new(),
            csv: Vec::new(),
        }],
    }
}

/// Threads for `jobs` (0: one per core the process may use).
pub fn jobs_or_cores(jobs: usize) -> usize {
    if jobs > 0 {
        jobs
    } else {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    }
}

/// Run `run` for every seed of `seeds` on `jobs` threads (0: one per
/// core; independent seeds share nothing, docs/simulation.md "Sweeps");
/// `sink` gets each result on the calling thread, in seed order, as soon
/// as it and every earlier seed's are done (a sweep's output is the same
/// bytes for any number of jobs).
pub fn for_seeds<T: Send>(
    seeds: std::ops::RangeInclusive<u64>,
    jobs: usize,
    run: impl Fn(u64) -> T + Sync,
    mut sink: impl FnMut(u64, T),
) {
    use std::sync::atomic::{AtomicU64, Ordering};
    let (from, to) = (*seeds.start(), *seeds.end());
    if from > to {
        return;
    }
    let next = AtomicU64::new(from);
    let jobs = jobs_or_cores(jobs).min(usize::try_from(to - from + 1).unwrap_or(usize::MAX));
    std::thread::scope(|s| {
        let (tx, rx) = std::sync::mpsc::channel();
        for _ in 0..jobs {
            let (tx, next, run) = (tx.clone(), &next, &run);
            std::thread::Builder::new()
                // The event loop's worlds are big; the main thread's 8 MiB,
                // not a spawned thread's 2 MiB.
                .stack_size(8 << 20)
                .spawn_scoped(s, move || loop {
                    let seed = next.fetch_add(1, Ordering::Relaxed);
                    if seed > to || seed < from || tx.send((seed, run(seed))).is_err() {
                        break;
                    }
                })
                .expect("a sweep thread starts");
        }
        drop(tx);
        let mut done = std::collections::BTreeMap::new();
        let mut due = from;
        for (seed, result) in rx {
            done.insert(seed, result);
            while let Some(result) = done.remove(&due) {
                sink(due, result);
                due = due.saturating_add(1);
            }
        }
    });
}

/// The scenario's faults as shaded x ranges of its plots (simulated s): a
/// cut, storm or suspend for its length, a crash or shutdown until its
/// restart (or the end), a rule change as a sliver of a fiftieth of the
/// run (at least 0.2 s) from its instant.
pub fn fault_spans(sc: &Scenario) -> Vec<(f64, f64)> {
    let end = sc.duration_s;
    let f = &sc.faults;
    let instant = (end / 50.0).max(0.2);
    let mut spans: Vec<(f64, f64)> = f
        .cuts
        .iter()
        .map(|c| (c.at_s, c.at_s + c.for_s))
        .chain(f.storms.iter().map(|c| (c.at_s, c.at_s + c.for_s)))
        .chain(f.suspends.iter().map(|c| (c.at_s, c.at_s + c.for_s)))
        .chain(
            f.crashes
                .iter()
                .chain(&f.shutdowns)
                .map(|c| (c.at_s, c.restart_after_s.map_or(end, |r| c.at_s + r))),
        )
        .chain(f.rule_changes.iter().map(|c| (c.at_s, c.at_s + instant)))
        .collect();
    spans.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)));
    spans
}

fn fmt_f(x: f64, digits: usize) -> String {
    if x.is_finite() {
        format!("{x:.digits$}")
    } else {
        "-".into()
    }
}

/// Quality figures of one key.
#[derive(Clone, Debug)]
pub struct KeyFigures {
    /// `B + R*T` over the run.
    pub bound: f64,
    /// Lowest utilization over windows of 10 x TTL_max after warm-up.
    pub utilization_min: f64,
    /// Mean utilization over those windows.
    pub utilization_mean: f64,
    /// Falsely rejected requests / all requests.
    pub false_reject_ratio: f64,
    /// Shortfall: tokens admitted / tokens one ideal global bucket admits
    /// over the same arrivals.
    pub versus_ideal: f64,
    /// Denied requests.
    pub denied: u64,
    /// Checks per allocator message, agent tier.
    pub checks_per_msg_agent: f64,
    /// Checks per allocator message, regional tier.
    pub checks_per_msg_regional: f64,
    /// The renewal economy target `min(100, B / (2 * agents))`.
    pub economy_target: f64,
    /// Fairness of the per-region shares (min of actual / max-min share).
    pub fairness: f64,
    /// Steadiness of the per-region shares: over the whole seconds after
    /// warm-up, the largest over regions of p95 / p5 of the region's
    /// admitted tokens per second (SPEC §2: <= 1.2 at steady demand).
    pub share_p95_p5: f64,
}

/// The quality figures of `k` (utilization over windows of 10 x `TTL_max`
/// after warm-up and false rejects, computed during the run).
pub fn figures(o: &Outcome, k: &KeyStats) -> KeyFigures {
    let r_per_s = k.rate.tokens as f64 / k.rate.period_s as f64;
    let bound = k.burst as f64 + r_per_s * o.duration_s;
    let (mut umin, mut umean) = (f64::NAN, f64::NAN);
    let (mut fr, mut denied) = (f64::NAN, k.denied);
    let mut versus_ideal = f64::NAN;
    if let Some(q) = k.quality() {
        let u = q.utilization();
        if !u.is_empty() {
            umin = u.iter().copied().fold(f64::INFINITY, f64::min);
            umean = u.iter().sum::<f64>() / u.len() as f64;
        }
        let f = q.false_rejects();
        versus_ideal = q.versus_ideal();
        denied = f.denied;
        if f.requests > 0 {
            fr = f.false_denied as f64 / f.requests as f64;
        }
    }
    let agents = f64::from(k.agent_count.max(1));
    let economy_target = (k.burst as f64 / (2.0 * agents)).min(100.0);
    let per_msg = |m: u64| {
        if m == 0 {
            f64::NAN
        } else {
            k.requests as f64 / m as f64
        }
    };
    let fairness = if o.regions > 1 {
        let actual: Vec<f64> = (0..usize::from(o.regions))
            .map(|r| k.per_second().iter().map(|s| s[r]).sum::<u64>() as f64)
            .collect();
        let demand: Vec<f64> = k.per_region_requests.iter().map(|&d| d as f64).collect();
        let supply: f64 = actual.iter().sum();
        if supply > 0.0 {
            quality::fairness(&actual, &demand, supply)
        } else {
            f64::NAN
        }
    } else {
        f64::NAN
    };
    let share_p95_p5 = if o.regions > 1 {
        let from = o.warmup_s.ceil() as usize;
        (0..usize::from(o.regions))
            .map(|r| {
                let mut v: Vec<u64> = k.per_second().iter().skip(from).map(|s| s[r]).collect();
                v.sort_unstable();
                if v.is_empty() {
                    return f64::NAN;
                }
                let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize] as f64;
                at(0.95) / at(0.05)
            })
            .fold(f64::NAN, f64::max)
    } else {
        f64::NAN
    };
    KeyFigures {
        bound,
        utilization_min: umin,
        utilization_mean: umean,
        false_reject_ratio: fr,
        versus_ideal,
        denied,
        checks_per_msg_agent: per_msg(k.msgs_agent_tier),
        checks_per_msg_regional: per_msg(k.msgs_regional_tier),
        economy_target,
        fairness,
        share_p95_p5,
    }
}

/// Every key of a rule together (the keys table shows only a few): what
/// its many cold keys got, against one ideal bucket per key over the same
/// arrivals.
fn rule_table(o: &Outcome) -> Table {
    #[derive(Default)]
    struct Sum {
        keys: u64,
        requests: u64,
        denied: u64,
        false_denied: u64,
        admitted: u64,
        ideal: u64,
    }
    let mut by_rule: std::collections::BTreeMap<&str, Sum> = Default::default();
    for k in &o.keys {
        let s = by_rule.entry(k.key.rule()).or_default();
        s.keys += 1;
        s.requests += k.requests;
        s.denied += k.denied;
        if let Some((f, ours, ideal)) = k.versus_ideal() {
            s.false_denied += f.false_denied;
            s.admitted += ours;
            s.ideal += ideal;
        }
    }
    let pct = |a: u64, b: u64| {
        if b == 0 {
            "-".to_string()
        } else {
            fmt_f(a as f64 * 100.0 / b as f64, 3)
        }
    };
    let rows = by_rule
        .into_iter()
        .map(|(rule, s)| {
            vec![
                rule.to_string(),
                s.keys.to_string(),
                s.requests.to_string(),
                pct(s.denied, s.requests),
                pct(s.false_denied, s.requests),
                pct(s.admitted, s.ideal),
            ]
        })
        .collect();
    Table {
        title: "Rules (every key of the rule)".into(),
        headers: [
            "rule",
            "keys",
            "requests",
            "denied %",
            "false rejects %",
            "vs ideal %",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect(),
        rows,
    }
}

/// Keys shown in a report: tracked ones, then the busiest, at most 8.
fn shown(o: &Outcome) -> Vec<&KeyStats> {
    let mut ks: Vec<&KeyStats> = o.keys.iter().collect();
    ks.sort_by(|a, b| {
        b.tracked
            .is_some()
            .cmp(&a.tracked.is_some())
            .then(b.admitted.cmp(&a.admitted))
            .then(a.key.cmp(&b.key))
    });
    ks.truncate(8);
    ks
}

fn key_name(k: &KeyStats) -> String {
    let mut s = k.key.rule().to_string();
    if !k.key.tenant().is_empty() {
        s.push('/');
        s.push_str(k.key.tenant());
    }
    if !k.key.route().is_empty() {
        s.push('/');
        s.push_str(k.key.route());
    }
    s
}

fn policy(p: FailPolicy) -> &'static str {
    match p {
        FailPolicy::Open => "open",
        FailPolicy::Closed => "closed",
        FailPolicy::LeaseOnly => "lease_only",
    }
}

/// The report of one scenario file run with one seed.
pub fn build_report(sc: &Scenario, seed: u64, outcomes: &[Outcome]) -> Report {
    let mut sections = Vec::new();
    for (vi, o) in outcomes.iter().enumerate() {
        let failures = o.failures();
        let verdict = if failures.is_empty() {
            "**held**: I1 exact over every window of every closed / lease_only key, I2 at every step, I3 within its allowance for open keys".to_string()
        } else {
            format!("**BROKEN**: {}", failures.join("; "))
        };
        let secs = o.duration_s;
        let mut paragraphs = vec![
            format!(
                "{} agents in {} region(s), {:.0} simulated s, {} checks ({:.0}/s); messages: agent tier {:.0}/s, regional tier {:.0}/s; unavailable answers {}.",
                o.agents,
                o.regions,
                secs,
                o.checks,
                o.checks as f64 / secs,
                o.msgs_agent_tier as f64 / secs,
                o.msgs_regional_tier as f64 / secs,
                o.unavailable
            ),
            format!("Verdict: {verdict}."),
            {
                let w = &o.waits;
                let ms = |ns: u64| ns as f64 / 1e6;
                format!(
                    "Checks that waited for a grant (not decided on arrival): {} of {} ({:.2} %); their wait p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms.",
                    w.waited,
                    w.checks,
                    if w.checks == 0 { 0.0 } else { w.waited as f64 * 100.0 / w.checks as f64 },
                    ms(w.quantile_ns(0.5)),
                    ms(w.quantile_ns(0.99)),
                    ms(w.max_ns)
                )
            },
        ];
        for n in &o.tier_notes {
            paragraphs.push(format!("- {n}"));
        }
        if o.i2_violations.is_empty() {
            paragraphs
                .push("I2 checked after every message an allocator handled: no violation.".into());
        }
        let mut rows = Vec::new();
        for k in shown(o) {
            let f = figures(o, k);
            let w = k.checker.worst();
            rows.push(vec![
                key_name(k),
                policy(k.fail_policy).to_string(),
                k.requests.to_string(),
                k.admitted.to_string(),
                k.failure_mode_allowed.to_string(),
                fmt_f(f.bound, 0),
                w.excess.to_string(),
                if k.fail_policy == FailPolicy::Open {
                    fmt_f(k.i3_allowance, 0)
                } else {
                    "-".into()
                },
                fmt_f(f.utilization_min * 100.0, 1),
                fmt_f(f.utilization_mean * 100.0, 1),
                fmt_f(f.false_reject_ratio * 100.0, 3),
                fmt_f(f.versus_ideal * 100.0, 1),
                fmt_f(f.checks_per_msg_agent, 1),
                fmt_f(f.checks_per_msg_regional, 1),
                fmt_f(f.economy_target, 1),
                fmt_f(f.fairness, 3),
                fmt_f(f.share_p95_p5, 2),
            ]);
        }
        let table = Table {
            title: "Keys".into(),
            headers: [
                "key",
                "policy",
                "requests",
                "admitted",
                "of which fail-open",
                "bound B+R*T",
                "largest window excess",
                "I3 allowance",
                "util. min %",
                "util. mean %",
                "false rejects %",
                "vs ideal %",
                "checks/msg agent tier",
                "checks/msg regional tier",
                "economy target",
                "region fairness",
                "region share p95/p5",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect(),
            rows,
        };
        let rules_table = rule_table(o);
        let mut plots = Vec::new();
        let mut csv = Vec::new();
        if let Some(k) = shown(o).into_iter().find(|k| k.tracked.is_some()) {
            let r_per_s = k.rate.tokens as f64 / k.rate.period_s as f64;
            let mut cum = 0u64;
            let mut admitted = Vec::new();
            let mut bound = Vec::new();
            let mut rows = Vec::new();
            let regions = usize::from(o.regions.max(1));
            let mut per_region: Vec<Vec<(f64, f64)>> = vec![Vec::new(); regions];
            let denials = k.quality().map(|q| q.denials_per_second()).unwrap_or(&[]);
            let (mut denied_pts, mut false_pts) = (Vec::new(), Vec::new());
            let mut headroom = Vec::new();
            for (s, per) in k.per_second().iter().enumerate() {
                let total: u64 = per.iter().sum();
                cum += total;
                let x = (s + 1) as f64;
                admitted.push((x, cum as f64));
                bound.push((x, k.burst as f64 + r_per_s * x));
                headroom.push((x, k.burst as f64 + r_per_s * x - cum as f64));
                for (r, v) in per.iter().enumerate() {
                    per_region[r].push((x, *v as f64));
                }
                let (denied, false_denied) = denials.get(s).copied().unwrap_or((0, 0));
                denied_pts.push((x, denied as f64));
                false_pts.push((x, false_denied as f64));
                let mut row = vec![(s + 1).to_string(), total.to_string(), cum.to_string()];
                row.extend(per.iter().map(|v| v.to_string()));
                row.push(denied.to_string());
                row.push(false_denied.to_string());
                rows.push(row);
            }
            let stem = format!("{}-{}", sc.name, vi);
            let spans = fault_spans(sc);
            // Per second, admitted / R against SPEC §2's 97 % (meaningful
            // where demand is at or above R), the faults shaded.
            let utilization: Vec<(f64, f64)> = k
                .per_second()
                .iter()
                .enumerate()
                .map(|(s, per)| {
                    (
                        (s + 1) as f64,
                        100.0 * per.iter().sum::<u64>() as f64 / r_per_s,
                    )
                })
                .collect();
            let line: Vec<(f64, f64)> = [0.0, k.per_second().len() as f64]
                .into_iter()
                .map(|x| (x, 97.0))
                .collect();
            plots.push(LinePlot {
                title: format!("{}: admitted per second / R", key_name(k)),
                x_label: "simulated s (faults shaded)".into(),
                y_label: "% of R".into(),
                series: vec![("admitted / R".into(), utilization), ("97 %".into(), line)],
                file: format!("{stem}-utilization.svg"),
                spans: spans.clone(),
            });
            plots.push(LinePlot {
                title: format!("{}: admitted vs the bound B + R*t", key_name(k)),
                x_label: "simulated s".into(),
                y_label: "tokens (cumulative)".into(),
                series: vec![("admitted".into(), admitted), ("B + R*t".into(), bound)],
                file: format!("{stem}-admitted-vs-bound.svg"),
                spans: spans.clone(),
            });
            if regions > 1 {
                plots.push(LinePlot {
                    title: format!("{}: admitted per second by region", key_name(k)),
                    x_label: "simulated s".into(),
                    y_label: "tokens / s".into(),
                    series: per_region
                        .into_iter()
                        .enumerate()
                        .map(|(r, pts)| (format!("region {r}"), pts))
                        .collect(),
                    file: format!("{stem}-share-per-region.svg"),
                    spans: spans.clone(),
                });
            }
            // The bound over [0, t] minus what was admitted in it: read in
            // tokens, not millions (I1 checks every window; this is the
            // windows that start at 0).
            plots.push(LinePlot {
                title: format!(
                    "{}: headroom below the bound, B + R*t - admitted in [0, t]",
                    key_name(k)
                ),
                x_label: "simulated s (faults shaded)".into(),
                y_label: "tokens".into(),
                series: vec![("headroom".into(), headroom)],
                file: format!("{stem}-headroom.svg"),
                spans: spans.clone(),
            });
            // Shortfall over time: what we admitted against one ideal
            // global bucket over the same arrivals, per second.
            let tokens = k.quality().map(|q| q.tokens_per_second()).unwrap_or(&[]);
            let per_s = |pick: fn(&(u64, u64)) -> u64| -> Vec<(f64, f64)> {
                tokens
                    .iter()
                    .enumerate()
                    .map(|(s, v)| ((s + 1) as f64, pick(v) as f64))
                    .collect()
            };
            let (ours, ideal) = (per_s(|v| v.0), per_s(|v| v.1));
            plots.push(LinePlot {
                title: format!(
                    "{}: admitted against one ideal global bucket, per second",
                    key_name(k)
                ),
                x_label: "simulated s (faults shaded)".into(),
                y_label: "tokens / s".into(),
                series: vec![("admitted".into(), ours), ("ideal bucket".into(), ideal)],
                file: format!("{stem}-versus-ideal.svg"),
                spans: spans.clone(),
            });
            plots.push(LinePlot {
                title: format!("{}: denied and falsely denied per second", key_name(k)),
                x_label: "simulated s".into(),
                y_label: "requests / s".into(),
                series: vec![
                    ("denied".into(), denied_pts),
                    ("false rejects".into(), false_pts),
                ],
                file: format!("{stem}-denials.svg"),
                spans,
            });
            let mut header = vec!["second".into(), "admitted".into(), "cumulative".into()];
            header.extend((0..regions).map(|r| format!("region_{r}")));
            header.push("denied".into());
            header.push("false_rejects".into());
            csv.push((format!("{stem}-series.csv"), header, rows));
        }
        sections.push(Section {
            title: o.name.clone(),
            paragraphs,
            tables: vec![table, rules_table],
            plots,
            csv,
        });
    }
    Report {
        title: format!("quotalease simulation: {}", sc.name),
        preamble: vec![
            sc.description.clone(),
            format!(
                "Seed {seed}. Replay: `quotalease sim --scenario sim/scenarios/{}.yaml --seed {seed} --out DIR`.",
                sc.name
            ),
            "Columns: *bound* is B + R*T over the whole run; *largest window excess* is the largest `admitted - (B + R*T)` over every window [t, t+T] (<= 0: I1 held); *I3 allowance* is the sum over emergency buckets opened of b_e + r_e*T for the fault window; utilization is admitted / (R*T) over windows of 10 x TTL_max after warm-up (meaningful when demand exceeds R); a false reject is a denial that one ideal global bucket would have admitted under every shift of arrivals by up to one regional round trip (docs/simulation.md); *vs ideal* is the shortfall figure: tokens admitted / tokens one ideal global bucket (exact, starting full) admits over the same arrivals, over the whole run; the economy target is min(100, B / (2 x agents using the key)); *region share p95/p5* is, over the whole seconds after warm-up, the largest over regions of the 95th over the 5th percentile of the region's admitted tokens per second (steady shares: close to 1).".into(),
        ],
        sections,
    }
}

/// One seed of a swarm run: its plan and what each run of it produced.
pub struct SwarmRun {
    /// The plan (scenario and printable YAML).
    pub plan: crate::swarm::Plan,
    /// One outcome per variant (the plan has one).
    pub outcomes: Vec<Outcome>,
}

impl SwarmRun {
    /// Every failure: I1, I2, I3 and liveness.
    pub fn failures(&self) -> Vec<String> {
        self.outcomes
            .iter()
            .flat_map(|o| o.failures().into_iter().map(|f| format!("{}: {f}", o.name)))
            .collect()
    }

    /// One line: the plan in counts, when it heals, the verdicts and the
    /// lowest liveness ratio over the tracked keys.
    pub fn summary(&self) -> String {
        let sc = &self.plan.scenario;
        let f = &sc.faults;
        let mut parts = Vec::new();
        for (n, what) in [
            (f.cuts.len(), "cut"),
            (f.storms.len(), "storm"),
            (f.crashes.len(), "crash"),
            (f.shutdowns.len(), "shutdown"),
            (f.suspends.len(), "suspend"),
            (f.rule_changes.len(), "rule change"),
        ] {
            if n > 0 {
                parts.push(format!("{n} {what}"));
            }
        }
        if f.clock_drift_ppm > 0.0 {
            parts.push(format!("drift {:.0} ppm", f.clock_drift_ppm));
        }
        if let Some(s) = f.sweep_every_s {
            parts.push(format!("sweep {s} s"));
        }
        if let Some(fo) = &sc.failover {
            parts.push(format!(
                "replicas (etcd lease {} ms, election {} ms, writes {} ms)",
                fo.lease_ttl_ms, fo.election_ms, fo.write_lag_ms
            ));
        }
        let faults = if parts.is_empty() {
            "no faults".to_string()
        } else {
            parts.join(", ")
        };
        let from = sc.live_from_ns();
        let live = self
            .outcomes
            .iter()
            .filter_map(|o| o.liveness_from(from).ok())
            .flatten()
            .map(|(_, l)| l.ratio)
            .fold(f64::NAN, f64::min);
        let verdict = if self.failures().is_empty() {
            "ok"
        } else {
            "FAILED"
        };
        format!(
            "seed {}: {} ({}): {faults}; heals at {:.1} s; liveness from {} s: {:.1}% of target: {verdict}",
            self.plan.seed,
            sc.name,
            sc.variants.first().map_or("", |v| v.name.as_str()),
            sc.heal_ns() as f64 / SEC as f64,
            from.div_ceil(SEC),
            live * 100.0
        )
    }
}

/// Draw seed `seed`'s plan on `base` (a built-in base if `None`) and run it.
pub fn swarm_run(base: Option<&Scenario>, seed: u64) -> Result<SwarmRun, String> {
    let plan = crate::swarm::plan(base, seed);
    let outcomes = run_all(&plan.scenario, seed)?;
    Ok(SwarmRun { plan, outcomes })
}

/// The report of one swarm seed: the plan first, then the usual report
/// (every check; liveness among the failures if it broke).
pub fn swarm_report(run: &SwarmRun, replay: &str) -> Report {
    let mut report = build_report(&run.plan.scenario, run.plan.seed, &run.outcomes);
    let sc = &run.plan.scenario;
    let mut live = vec![format!(
        "Liveness: the last fault heals at {:.3} s; from {} s (3 x TTL_max later, whole seconds) to the end, every tracked key must admit at least {:.0}% of min(tokens requested, R x T) (docs/simulation.md, \"Swarm mode\").",
        sc.heal_ns() as f64 / SEC as f64,
        sc.live_from_ns().div_ceil(SEC),
        crate::liveness::THRESHOLD * 100.0
    )];
    for o in &run.outcomes {
        match o.liveness_from(sc.live_from_ns()) {
            Err(why) => live.push(format!("- {}: {why}", o.name)),
            Ok(keys) => live.extend(keys.iter().map(|(k, l)| {
                format!(
                    "- {}: key {k}: requested {}, admitted {}{} of a target of {:.0}: {:.1}%{}",
                    o.name,
                    l.requested,
                    l.admitted,
                    l.reference.map_or(String::new(), |r| format!(
                        " (the reference run without the faults that heal: {r})"
                    )),
                    l.target,
                    l.ratio * 100.0,
                    if l.held() { "" } else { " (BROKEN)" }
                )
            })),
        }
    }
    report.preamble = vec![
        sc.description.clone(),
        format!("Swarm seed {}. Replay: `{replay}`. The plan (the `faults` and fields it set, as a scenario file takes them):", run.plan.seed),
        format!("```yaml\n{}```", run.plan.yaml),
        live.join("\n"),
    ]
    .into_iter()
    .chain(report.preamble.into_iter().skip(2))
    .collect();
    report
}

#[cfg(test)]
mod tests {
    use super::{fault_spans, for_seeds};
    use crate::scenario::Scenario;

    #[test]
    fn faults_become_spans_of_their_length() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("scenarios")
            .join("global-crash.yaml");
        let sc = Scenario::load(&path).expect("the shipped scenario is valid");
        // The global allocator down 20-25 s, region 1 40-42 s.
        assert_eq!(fault_spans(&sc), vec![(20.0, 25.0), (40.0, 42.0)]);
        let path = path.with_file_name("region-cut.yaml");
        let sc = Scenario::load(&path).expect("the shipped scenario is valid");
        assert_eq!(fault_spans(&sc), vec![(45.0, 105.0)]);
    }

    #[test]
    fn seeds_run_on_many_threads_come_back_in_seed_order() {
        for jobs in [1, 2, 3, 16] {
            let mut got = Vec::new();
            for_seeds(
                5..=40,
                jobs,
                |seed| {
                    // Later seeds finish first: the sink still sees seed
                    // order.
                    std::thread::sleep(std::time::Duration::from_micros(50 * (40 - seed)));
                    (seed * seed, std::thread::current().id())
                },
                |seed, (sq, _)| got.push((seed, sq)),
            );
            let want: Vec<(u64, u64)> = (5..=40).map(|s| (s, s * s)).collect();
            assert_eq!(got, want, "jobs {jobs}");
        }
        let (from, to) = (3, 2);
        let mut none = 0;
        for_seeds(from..=to, 2, |s| s, |_, _| none += 1);
        assert_eq!(none, 0);
    }
}

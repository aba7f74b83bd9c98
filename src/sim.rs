//! `quotalease sim`: one deterministic run with a report, or a seed sweep
//! that names every failing seed with the command that replays it; with
//! `--swarm`, every seed draws its own fault plan (sim/src/swarm.rs) and
//! liveness is judged after the faults heal.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{anyhow, bail};
use clap::Args;
use quotalease_sim::runner;
use quotalease_sim::scenario::Scenario;

/// `quotalease sim` flags.
#[derive(Args, Debug)]
pub struct SimArgs {
    /// Scenario file (see sim/scenarios/); optional with --swarm (a
    /// built-in small base is used).
    #[arg(long, required_unless_present = "swarm")]
    scenario: Option<PathBuf>,
    /// Swarm mode: each seed draws a fault plan on top of the scenario
    /// (or a built-in base), prints it, and liveness is checked after the
    /// faults heal.
    #[arg(long)]
    swarm: bool,
    /// The permit model: with --scenario, a permit scenario
    /// (sim/scenarios/permits/*.yaml; report.md in --out); with --swarm,
    /// the permit swarm (every seed draws a permit run: topology, `N`,
    /// load, holds, faults; I4 on every event and liveness after the
    /// faults; sim/src/permits/swarm.rs).
    #[arg(long)]
    permits: bool,
    /// Seed of the run.
    #[arg(long, default_value_t = 1, conflicts_with = "seeds")]
    seed: u64,
    /// Run many seeds, A..B inclusive (e.g. 1..50); prints every failing
    /// seed with the command that replays it.
    #[arg(long, value_parser = parse_seeds)]
    seeds: Option<(u64, u64)>,
    /// Directory for report.md, CSV series and SVG plots [default:
    /// sim-out]; with --seeds (not --swarm), the sweep's index: every
    /// seed's quality figures and their spread (written only when given).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Shrink agents, tenants and load by this factor (0 < F <= 1), e.g.
    /// for quick sweeps.
    #[arg(long, default_value_t = 1.0)]
    scale: f64,
    /// Seeds of a sweep run at once, each in its own thread (0: one per
    /// core). The output is the same for any number.
    #[arg(long, default_value_t = 0)]
    jobs: usize,
}

impl SimArgs {
    /// `--out`, or `sim-out`.
    fn out_dir(&self) -> PathBuf {
        self.out.clone().unwrap_or_else(|| PathBuf::from("sim-out"))
    }
}

fn parse_seeds(s: &str) -> Result<(u64, u64), String> {
    let (a, b) = s
        .split_once("..")
        .ok_or_else(|| format!("{s:?}: expected A..B, e.g. 1..50"))?;
    let a: u64 = a
        .trim()
        .parse()
        .map_err(|_| format!("{s:?}: A is not a number"))?;
    let b: u64 = b
        .trim()
        .trim_start_matches('=')
        .parse()
        .map_err(|_| format!("{s:?}: B is not a number"))?;
    if b < a {
        return Err(format!("{s:?}: B must not be below A"));
    }
    Ok((a, b))
}

pub fn run(args: SimArgs) -> anyhow::Result<()> {
    if args.permits && !args.swarm {
        return permit_scenario(&args);
    }
    if !(args.scale > 0.0 && args.scale <= 1.0) {
        bail!("--scale {}: must be in (0, 1]", args.scale);
    }
    if args.scale < 1.0 && args.scenario.is_none() {
        bail!(
            "--scale {}: needs --scenario (the built-in swarm bases are already small)",
            args.scale
        );
    }
    let scale = if args.scale < 1.0 {
        format!(" --scale {}", args.scale)
    } else {
        String::new()
    };
    let base = match &args.scenario {
        Some(path) => {
            let sc = Scenario::load(path).map_err(|e| anyhow!("{e}"))?;
            Some(if args.scale < 1.0 {
                sc.scaled(args.scale)
            } else {
                sc
            })
        }
        None => None,
    };
    if args.permits {
        if args.scenario.is_some() || args.scale < 1.0 || args.out.is_some() {
            bail!("--permits: runs the permit model's own plans; --scenario, --scale and --out do not apply");
        }
        return permit_swarm(&args);
    }
    if args.swarm {
        let scenario = args
            .scenario
            .as_ref()
            .map(|p| format!(" --scenario {}", p.display()))
            .unwrap_or_default();
        return swarm(&args, base.as_ref(), &format!("{scenario}{scale}"));
    }
    let (Some(sc), Some(path)) = (base, &args.scenario) else {
        bail!("--scenario FILE is required without --swarm");
    };
    let started = Instant::now();
    match args.seeds {
        None => {
            let out = args.out_dir();
            let failures = runner::run_to_dir(&sc, args.seed, &out).map_err(|e| anyhow!("{e}"))?;
            println!(
                "{}: seed {}: report in {} ({:.1} s wall)",
                sc.name,
                args.seed,
                out.join("report.md").display(),
                started.elapsed().as_secs_f64()
            );
            if !failures.is_empty() {
                for f in &failures {
                    println!("  FAILED {f}");
                }
                bail!("{}: invariant broken with seed {}", sc.name, args.seed);
            }
            Ok(())
        }
        Some((a, b)) => {
            let (failed, index) =
                runner::sweep_indexed(&sc, a, b, args.jobs).map_err(|e| anyhow!("{e}"))?;
            if let Some(out) = &args.out {
                quotalease_sim::report::write(&index, out)
                    .map_err(|e| anyhow!("--out {}: {e}", out.display()))?;
                println!("index in {}", out.join("report.md").display());
            }
            let total = b - a + 1;
            for f in &failed {
                println!(
                    "FAILED seed {}: replay: quotalease sim --scenario {} --seed {}{scale} --out sim-out",
                    f.seed,
                    path.display(),
                    f.seed
                );
                for w in &f.what {
                    println!("  {w}");
                }
            }
            println!(
                "{}: {} passed, {} failed ({:.1} s wall)",
                sc.name,
                total - failed.len() as u64,
                failed.len(),
                started.elapsed().as_secs_f64()
            );
            if failed.is_empty() {
                Ok(())
            } else {
                bail!("{}: {} seed(s) failed", sc.name, failed.len())
            }
        }
    }
}

/// `--permits --scenario FILE`: a permit scenario: with `--seed`, its
/// report in `--out`; with `--seeds`, one line per seed. Fails when I4
/// broke.
fn permit_scenario(args: &SimArgs) -> anyhow::Result<()> {
    use quotalease_sim::permits::scenario::{report_md, wait_target_ns, PermitScenario};
    let Some(path) = &args.scenario else {
        bail!("--permits: needs --scenario FILE (a permit scenario, sim/scenarios/permits/*.yaml) or --swarm");
    };
    if args.scale < 1.0 {
        bail!("--scale: does not apply to a permit scenario");
    }
    let sc = PermitScenario::load(path).map_err(|e| anyhow!("{e}"))?;
    let started = Instant::now();
    match args.seeds {
        None => {
            let r = quotalease_sim::permits::run(&sc.config(args.seed));
            let out = args.out_dir();
            std::fs::create_dir_all(&out).map_err(|e| anyhow!("--out {}: {e}", out.display()))?;
            let file = out.join("report.md");
            std::fs::write(&file, report_md(&sc, args.seed, &r))
                .map_err(|e| anyhow!("{}: {e}", file.display()))?;
            println!(
                "{}: seed {}: report in {} ({:.1} s wall)",
                sc.name,
                args.seed,
                file.display(),
                started.elapsed().as_secs_f64()
            );
            match r.i4_broken {
                Some(why) => bail!("{}: seed {}: {why}", sc.name, args.seed),
                None => Ok(()),
            }
        }
        Some((a, b)) => {
            let mut failed = Vec::new();
            let run = |seed: u64| quotalease_sim::permits::run(&sc.config(seed));
            runner::for_seeds(a..=b, args.jobs, run, |seed, r| {
                let target = wait_target_ns(&sc, r.ideal_p99_ns);
                println!(
                    "{} seed {seed} (N = {}): {}; wait target {:.0} ms: {}{}",
                    sc.name,
                    sc.concurrency,
                    permit_figures(&r),
                    target as f64 / 1e6,
                    if r.wait_p99_ns <= target {
                        "met"
                    } else {
                        "missed"
                    },
                    r.i4_broken
                        .as_ref()
                        .map(|w| format!(": FAILED {w}"))
                        .unwrap_or_default()
                );
                if r.i4_broken.is_some() {
                    failed.push(seed);
                }
            });
            eprintln!(
                "{}: seeds {a}..{b} in {:.1} s wall",
                sc.name,
                started.elapsed().as_secs_f64()
            );
            if failed.is_empty() {
                Ok(())
            } else {
                bail!("{}: I4 broken with seed(s) {failed:?}", sc.name)
            }
        }
    }
}

/// A permit run's figures on one line (the swarm's and a scenario's
/// sweep).
fn permit_figures(r: &quotalease_sim::permits::PermitReport) -> String {
    format!(
        "{} permits, {} timeouts, max held {}, slots in use {:.1} % while demand >= N, wait p99 {:.0} ms (ideal {:.0} ms)",
        r.permits,
        r.timeouts,
        r.max_held,
        100.0 * r.saturated_use,
        r.wait_p99_ns as f64 / 1e6,
        r.ideal_p99_ns as f64 / 1e6,
    )
}

/// `--swarm --permits`: the permit model's swarm, one line per seed (its
/// draw and what it measured; the wall time on stderr, so stdout is the
/// same bytes for the same seeds).
fn permit_swarm(args: &SimArgs) -> anyhow::Result<()> {
    use quotalease_sim::permits::swarm::run_seed;
    let started = Instant::now();
    let (a, b) = args.seeds.unwrap_or((args.seed, args.seed));
    let mut failed = Vec::new();
    runner::for_seeds(a..=b, args.jobs, run_seed, |seed, (what, r, failures)| {
        println!(
            "permits seed {seed}: {what}: {}{}",
            permit_figures(&r),
            if failures.is_empty() { "" } else { ": FAILED" }
        );
        if !failures.is_empty() {
            println!("  replay: quotalease sim --swarm --permits --seed {seed}");
            for f in &failures {
                println!("  {f}");
            }
            failed.push(seed);
        }
    });
    println!(
        "permits swarm: {} passed, {} failed",
        b - a + 1 - failed.len() as u64,
        failed.len()
    );
    eprintln!(
        "permits swarm: seeds {a}..{b} in {:.1} s wall",
        started.elapsed().as_secs_f64()
    );
    if failed.is_empty() {
        Ok(())
    } else {
        bail!("permits swarm: {} seed(s) failed", failed.len())
    }
}

/// `--swarm`: one seed (plan on stdout, report in `--out`) or a sweep (one
/// line per seed on stdout, the plan and the failures of failing ones; the
/// wall time on stderr, so stdout is the same bytes for the same seeds).
fn swarm(args: &SimArgs, base: Option<&Scenario>, flags: &str) -> anyhow::Result<()> {
    let started = Instant::now();
    let replay = |seed: u64| format!("quotalease sim --swarm{flags} --seed {seed} --out sim-out");
    match args.seeds {
        None => {
            let run = runner::swarm_run(base, args.seed).map_err(|e| anyhow!("{e}"))?;
            let report = runner::swarm_report(&run, &replay(args.seed));
            let out = args.out_dir();
            std::fs::create_dir_all(&out).map_err(|e| anyhow!("--out {}: {e}", out.display()))?;
            quotalease_sim::report::write(&report, &out)
                .map_err(|e| anyhow!("--out {}: {e}", out.display()))?;
            print!("{}", run.plan.yaml);
            println!("{}", run.summary());
            println!("report in {}", out.join("report.md").display());
            let failures = run.failures();
            for f in &failures {
                println!("  FAILED {f}");
            }
            eprintln!("({:.1} s wall)", started.elapsed().as_secs_f64());
            if failures.is_empty() {
                Ok(())
            } else {
                bail!("swarm seed {} failed", args.seed)
            }
        }
        Some((a, b)) => {
            let mut failed = Vec::new();
            let mut error = None;
            runner::for_seeds(
                a..=b,
                args.jobs,
                |seed| runner::swarm_run(base, seed),
                |seed, run| {
                    let run = match run {
                        Ok(run) if error.is_none() => run,
                        Ok(_) => return,
                        Err(e) => {
                            error.get_or_insert(e);
                            return;
                        }
                    };
                    println!("{}", run.summary());
                    let failures = run.failures();
                    if !failures.is_empty() {
                        println!("FAILED seed {seed}: replay: {}", replay(seed));
                        for f in &failures {
                            println!("  {f}");
                        }
                        for line in run.plan.yaml.lines() {
                            println!("  | {line}");
                        }
                        failed.push(seed);
                    }
                },
            );
            if let Some(e) = error {
                bail!("{e}");
            }
            let total = b - a + 1;
            println!(
                "swarm: {} passed, {} failed",
                total - failed.len() as u64,
                failed.len()
            );
            eprintln!(
                "swarm: seeds {a}..{b} in {:.1} s wall",
                started.elapsed().as_secs_f64()
            );
            if failed.is_empty() {
                Ok(())
            } else {
                bail!("swarm: {} seed(s) failed: {failed:?}", failed.len())
            }
        }
    }
}

//! `quotalease sim`: one deterministic run with a report, or a seed sweep
//! that names every failing seed with the command that replays it.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{anyhow, bail};
use clap::Args;
use quotalease_sim::runner;
use quotalease_sim::scenario::Scenario;

/// `quotalease sim` flags.
#[derive(Args, Debug)]
pub struct SimArgs {
    /// Scenario file (see sim/scenarios/).
    #[arg(long)]
    scenario: PathBuf,
    /// Seed of the run.
    #[arg(long, default_value_t = 1, conflicts_with = "seeds")]
    seed: u64,
    /// Run many seeds, A..B inclusive (e.g. 1..50); prints every failing
    /// seed with the command that replays it.
    #[arg(long, value_parser = parse_seeds)]
    seeds: Option<(u64, u64)>,
    /// Directory for report.md, CSV series and SVG plots.
    #[arg(long, default_value = "sim-out")]
    out: PathBuf,
    /// Shrink agents, tenants and load by this factor (0 < F <= 1), e.g.
    /// for quick sweeps.
    #[arg(long, default_value_t = 1.0)]
    scale: f64,
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
    if !(args.scale > 0.0 && args.scale <= 1.0) {
        bail!("--scale {}: must be in (0, 1]", args.scale);
    }
    let mut sc = Scenario::load(&args.scenario).map_err(|e| anyhow!("{e}"))?;
    if args.scale < 1.0 {
        sc = sc.scaled(args.scale);
    }
    let scale = if args.scale < 1.0 {
        format!(" --scale {}", args.scale)
    } else {
        String::new()
    };
    let started = Instant::now();
    match args.seeds {
        None => {
            let failures =
                runner::run_to_dir(&sc, args.seed, &args.out).map_err(|e| anyhow!("{e}"))?;
            println!(
                "{}: seed {}: report in {} ({:.1} s wall)",
                sc.name,
                args.seed,
                args.out.join("report.md").display(),
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
            let failed = runner::sweep(&sc, a, b).map_err(|e| anyhow!("{e}"))?;
            let total = b - a + 1;
            for f in &failed {
                println!(
                    "FAILED seed {}: replay: quotalease sim --scenario {} --seed {}{scale} --out sim-out",
                    f.seed,
                    args.scenario.display(),
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

//! Permit scenarios: a file that describes one permit run (issue 34's
//! simulator item: "in the scenarios"), for `quotalease sim --permits
//! --scenario FILE`: `N`, the topology and its one-way delays, the offered
//! load and how it moves between agents or regions, hold times, the
//! clients' deadlines, and faults. The run is the permit model's
//! ([`super::run`]: the agents' own asking policy, the allocator's slot
//! ledger, the regionals' chains; I4 on every event); [`report_md`]
//! writes what a planner reads: I4, slots in use while demand is at least
//! `N`, waits against an ideal global semaphore over the same arrivals,
//! timeouts per agent, messages per permit.
//!
//! Files live in `sim/scenarios/permits/*.yaml`; the format is
//! [`PermitScenario`]. An error names the field at fault.

use serde::Deserialize;

use super::{PermitFaults, PermitRegions, PermitReport, PermitSimConfig};
use crate::scenario::from_yaml;

const MS: u64 = 1_000_000;

/// A permit scenario file.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PermitScenario {
    /// Short name (report title).
    pub name: String,
    /// What it shows (a paragraph for the report).
    #[serde(default)]
    pub description: String,
    /// The rule's `concurrency` (1 to 1 000 000).
    pub concurrency: u64,
    /// Agents talking to the allocator, each with its one-way delay (ms).
    /// Exactly one of `agents` and `regions`.
    #[serde(default)]
    pub agents: Vec<PermitAgent>,
    /// Regional allocators, each with its one-way delay to the allocator
    /// (ms) and its agents (1 ms from it unless said).
    #[serde(default)]
    pub regions: Vec<PermitRegion>,
    /// Offered load, as a multiple of `concurrency`: arrival rate x mean
    /// hold (0 < load <= 10).
    pub load: f64,
    /// Hold times: lognormal with this median (ms) and spread (sigma,
    /// default 0.8).
    pub hold: Hold,
    /// How the load is shared, phase by phase: each phase lasts `for_s`
    /// and gives each agent (or, with `regions`, each region: its agents
    /// share it evenly) a weight; the run lasts as long as its phases.
    pub phases: Vec<Phase>,
    /// How long a client waits for a permit before it gives up (ms,
    /// default 5000).
    #[serde(default = "d_wait")]
    pub wait_ms: u64,
    /// The allocators' `TTL_max` (ms, default 2000).
    #[serde(default = "d_ttl_max")]
    pub ttl_max_ms: u64,
    /// Clients renew the permits they hold this often (ms, default 250).
    #[serde(default = "d_renew")]
    pub renew_every_ms: u64,
    /// The `WaitSlots` wake-ups (default true, as in production).
    #[serde(default = "d_true")]
    pub wakeups: bool,
    /// A restarted regional resumes its predecessor's slot leases
    /// (`--experimental-regional-resume`; default false, as in
    /// production).
    #[serde(default)]
    pub region_resume: bool,
    /// Faults (none by default).
    #[serde(default)]
    pub faults: Faults,
}

/// An agent of the allocator.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PermitAgent {
    /// One-way delay to the allocator (ms).
    pub delay_ms: u64,
}

/// A regional allocator and its agents.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PermitRegion {
    /// One-way delay to the allocator (ms).
    pub delay_ms: u64,
    /// Its agents (at least 1).
    pub agents: u32,
    /// One-way delay from each agent to the regional (ms, default 1).
    #[serde(default = "d_one")]
    pub agent_delay_ms: u64,
}

/// Hold times.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hold {
    /// Median (ms).
    pub median_ms: u64,
    /// Lognormal spread (default 0.8).
    #[serde(default = "d_sigma")]
    pub sigma: f64,
}

/// A phase of the run.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Phase {
    /// Its length (s).
    pub for_s: f64,
    /// Weight of each agent, or each region (one per entry of `agents` or
    /// `regions`; at least one above 0).
    pub weights: Vec<f64>,
}

/// Faults of a permit scenario.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Faults {
    /// Each ask and each reply is lost with this probability (0 to 0.5).
    #[serde(default)]
    pub loss: f64,
    /// The allocator crashes and restarts at once at these instants (s).
    #[serde(default)]
    pub restarts_s: Vec<f64>,
    /// Agents that crash (and start again at once, empty): their clients'
    /// permits count on until their expiries.
    #[serde(default)]
    pub crashes: Vec<Crash>,
    /// Regions cut from the allocator (with `regions`).
    #[serde(default)]
    pub cuts: Vec<Cut>,
    /// Regional allocators that crash and start again at once (with
    /// `regions`): their agents renew with the new process, which resumes
    /// the parent slot lease.
    #[serde(default)]
    pub region_restarts: Vec<RegionRestart>,
}

/// A regional allocator's restart.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegionRestart {
    /// When (s).
    pub at_s: f64,
    /// Which region (numbered from 0).
    pub region: usize,
}

/// An agent's crash.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Crash {
    /// When (s).
    pub at_s: f64,
    /// Which agent (numbered from 0, across regions in order).
    pub agent: usize,
}

/// A region cut from the allocator: every message between them is lost.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Cut {
    /// From (s).
    pub at_s: f64,
    /// For (s).
    pub for_s: f64,
    /// Which region (numbered from 0).
    pub region: usize,
}

fn d_wait() -> u64 {
    5_000
}
fn d_ttl_max() -> u64 {
    2_000
}
fn d_renew() -> u64 {
    250
}
fn d_true() -> bool {
    true
}
fn d_one() -> u64 {
    1
}
fn d_sigma() -> f64 {
    0.8
}

/// The longest one-way delay a scenario may give (ms).
const MAX_DELAY_MS: u64 = 10_000;
/// The most agents a permit scenario may have.
const MAX_AGENTS: usize = 1_000;
/// The longest run (s).
const MAX_RUN_S: f64 = 3_600.0;

impl PermitScenario {
    /// Reads and checks a scenario file.
    pub fn load(path: &std::path::Path) -> Result<PermitScenario, String> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| format!("{file}: {e}"))?;
        PermitScenario::parse(&text, &file)
    }

    /// Parses and checks scenario text; `file` names it in errors.
    pub fn parse(text: &str, file: &str) -> Result<PermitScenario, String> {
        let sc: PermitScenario = from_yaml(text).map_err(|e| format!("{file}: {e}"))?;
        let errors: Vec<String> = sc
            .check()
            .into_iter()
            .map(|(field, why)| format!("{file}: {field}: {why}"))
            .collect();
        if errors.is_empty() {
            Ok(sc)
        } else {
            Err(errors.join("\n"))
        }
    }

    /// The agents in order (across regions).
    pub fn total_agents(&self) -> usize {
        if self.regions.is_empty() {
            self.agents.len()
        } else {
            self.regions.iter().map(|r| r.agents as usize).sum()
        }
    }

    /// The run's length (s).
    pub fn duration_s(&self) -> f64 {
        self.phases.iter().map(|p| p.for_s).sum()
    }

    /// (field, what is wrong) for every problem.
    fn check(&self) -> Vec<(String, String)> {
        let mut e = Vec::new();
        let mut bad = |f: &str, why: String| e.push((f.to_string(), why));
        if !(1..=1_000_000).contains(&self.concurrency) {
            bad(
                "concurrency",
                format!("{}: must be 1 to 1000000", self.concurrency),
            );
        }
        let places = match (self.agents.is_empty(), self.regions.is_empty()) {
            (false, false) => {
                bad("regions", "give agents or regions, not both".into());
                0
            }
            (true, true) => {
                bad("agents", "give agents (or regions): none given".into());
                0
            }
            (false, true) => self.agents.len(),
            (true, false) => self.regions.len(),
        };
        for (i, a) in self.agents.iter().enumerate() {
            if a.delay_ms > MAX_DELAY_MS {
                bad(
                    &format!("agents[{i}].delay_ms"),
                    format!("{}: at most {MAX_DELAY_MS}", a.delay_ms),
                );
            }
        }
        for (i, r) in self.regions.iter().enumerate() {
            if r.delay_ms > MAX_DELAY_MS {
                bad(
                    &format!("regions[{i}].delay_ms"),
                    format!("{}: at most {MAX_DELAY_MS}", r.delay_ms),
                );
            }
            if r.agent_delay_ms > MAX_DELAY_MS {
                bad(
                    &format!("regions[{i}].agent_delay_ms"),
                    format!("{}: at most {MAX_DELAY_MS}", r.agent_delay_ms),
                );
            }
            if r.agents == 0 {
                bad(&format!("regions[{i}].agents"), "at least 1".into());
            }
        }
        if self.total_agents() > MAX_AGENTS {
            bad(
                "agents",
                format!("{}: at most {MAX_AGENTS} agents", self.total_agents()),
            );
        }
        if !(self.load > 0.0 && self.load <= 10.0) {
            bad(
                "load",
                format!("{}: must be above 0 and at most 10", self.load),
            );
        }
        if !(1..=3_600_000).contains(&self.hold.median_ms) {
            bad(
                "hold.median_ms",
                format!("{}: must be 1 to 3600000", self.hold.median_ms),
            );
        }
        if !(self.hold.sigma >= 0.0 && self.hold.sigma <= 3.0) {
            bad("hold.sigma", format!("{}: must be 0 to 3", self.hold.sigma));
        }
        if self.phases.is_empty() {
            bad("phases", "at least one".into());
        }
        for (i, p) in self.phases.iter().enumerate() {
            if !(p.for_s > 0.0 && p.for_s.is_finite()) {
                bad(
                    &format!("phases[{i}].for_s"),
                    format!("{}: must be above 0", p.for_s),
                );
            }
            if places > 0 && p.weights.len() != places {
                bad(
                    &format!("phases[{i}].weights"),
                    format!(
                        "{} weights for {places} {}",
                        p.weights.len(),
                        if self.regions.is_empty() {
                            "agents"
                        } else {
                            "regions"
                        }
                    ),
                );
            }
            if p.weights.iter().any(|w| !(*w >= 0.0 && w.is_finite()))
                || !p.weights.iter().any(|w| *w > 0.0)
            {
                bad(
                    &format!("phases[{i}].weights"),
                    "each at least 0, one above 0".into(),
                );
            }
        }
        let run_s = self.duration_s();
        if run_s > MAX_RUN_S {
            bad("phases", format!("{run_s} s in all: at most {MAX_RUN_S}"));
        }
        if !(1..=3_600_000).contains(&self.wait_ms) {
            bad("wait_ms", format!("{}: must be 1 to 3600000", self.wait_ms));
        }
        if !(100..=3_600_000).contains(&self.ttl_max_ms) {
            bad(
                "ttl_max_ms",
                format!("{}: must be 100 to 3600000", self.ttl_max_ms),
            );
        }
        if !(1..=3_600_000).contains(&self.renew_every_ms) {
            bad(
                "renew_every_ms",
                format!("{}: must be 1 to 3600000", self.renew_every_ms),
            );
        }
        let f = &self.faults;
        if !(0.0..=0.5).contains(&f.loss) {
            bad("faults.loss", format!("{}: must be 0 to 0.5", f.loss));
        }
        for (i, t) in f.restarts_s.iter().enumerate() {
            if !(*t >= 0.0 && *t < run_s) {
                bad(
                    &format!("faults.restarts_s[{i}]"),
                    format!("{t}: must be within the run (0 to {run_s} s)"),
                );
            }
        }
        for (i, c) in f.crashes.iter().enumerate() {
            if !(c.at_s >= 0.0 && c.at_s < run_s) {
                bad(
                    &format!("faults.crashes[{i}].at_s"),
                    format!("{}: must be within the run", c.at_s),
                );
            }
            if c.agent >= self.total_agents() {
                bad(
                    &format!("faults.crashes[{i}].agent"),
                    format!("{}: there are {} agents", c.agent, self.total_agents()),
                );
            }
        }
        for (i, c) in f.cuts.iter().enumerate() {
            if self.regions.is_empty() {
                bad(&format!("faults.cuts[{i}]"), "cuts need regions".into());
            } else if c.region >= self.regions.len() {
                bad(
                    &format!("faults.cuts[{i}].region"),
                    format!("{}: there are {} regions", c.region, self.regions.len()),
                );
            }
            if !(c.at_s >= 0.0 && c.for_s > 0.0 && c.at_s + c.for_s <= run_s) {
                bad(
                    &format!("faults.cuts[{i}]"),
                    "must start at 0 or later, last above 0 and end within the run".into(),
                );
            }
        }
        for (i, x) in f.region_restarts.iter().enumerate() {
            if self.regions.is_empty() {
                bad(
                    &format!("faults.region_restarts[{i}]"),
                    "regional restarts need regions".into(),
                );
            } else if x.region >= self.regions.len() {
                bad(
                    &format!("faults.region_restarts[{i}].region"),
                    format!("{}: there are {} regions", x.region, self.regions.len()),
                );
            }
            if !(x.at_s >= 0.0 && x.at_s < run_s) {
                bad(
                    &format!("faults.region_restarts[{i}].at_s"),
                    format!("{}: must be within the run (0 to {run_s} s)", x.at_s),
                );
            }
        }
        e
    }

    /// The permit model's run of this scenario with `seed`.
    pub fn config(&self, seed: u64) -> PermitSimConfig {
        let ns = |s: f64| (s * 1e9).round() as u64;
        let mean_hold_s = self.hold.median_ms as f64 / 1e3 * (self.hold.sigma.powi(2) / 2.0).exp();
        let total = self.load * self.concurrency as f64 / mean_hold_s;
        // Each agent's weight in a phase: its own, or its region's shared
        // evenly among the region's agents.
        let per_agent = |p: &Phase| -> Vec<f64> {
            if self.regions.is_empty() {
                p.weights.clone()
            } else {
                self.regions
                    .iter()
                    .zip(&p.weights)
                    .flat_map(|(r, w)| {
                        std::iter::repeat_n(w / f64::from(r.agents), r.agents as usize)
                    })
                    .collect()
            }
        };
        let phases = self
            .phases
            .iter()
            .map(|p| {
                let w = per_agent(p);
                let sum: f64 = w.iter().sum();
                (ns(p.for_s), w.iter().map(|x| x / sum * total).collect())
            })
            .collect();
        let (delays_ns, regions) = if self.regions.is_empty() {
            (self.agents.iter().map(|a| a.delay_ms * MS).collect(), None)
        } else {
            let delays = self
                .regions
                .iter()
                .flat_map(|r| std::iter::repeat_n(r.agent_delay_ms * MS, r.agents as usize))
                .collect();
            let agent_region = self
                .regions
                .iter()
                .enumerate()
                .flat_map(|(i, r)| std::iter::repeat_n(i, r.agents as usize))
                .collect();
            let cuts = self
                .faults
                .cuts
                .iter()
                .map(|c| (ns(c.at_s), ns(c.at_s + c.for_s), c.region))
                .collect();
            let r = PermitRegions {
                agent_region,
                delays_ns: self.regions.iter().map(|r| r.delay_ms * MS).collect(),
                cuts,
            };
            (delays, Some(r))
        };
        PermitSimConfig {
            seed,
            n: self.concurrency,
            delays_ns,
            phases,
            hold_median_ns: self.hold.median_ms * MS,
            hold_sigma: self.hold.sigma,
            wait_ns: self.wait_ms * MS,
            ttl_max_ns: self.ttl_max_ms * MS,
            renew_every_ns: self.renew_every_ms * MS,
            faults: PermitFaults {
                loss: self.faults.loss,
                restarts_ns: self.faults.restarts_s.iter().map(|&t| ns(t)).collect(),
                crashes: self
                    .faults
                    .crashes
                    .iter()
                    .map(|c| (ns(c.at_s), c.agent))
                    .collect(),
                region_restarts: self
                    .faults
                    .region_restarts
                    .iter()
                    .map(|x| (ns(x.at_s), x.region))
                    .collect(),
            },
            regions,
            wakeups: self.wakeups,
            shares: true,
            region_resume: self.region_resume,
            grant_on_wake: false,
        }
    }
}

/// The wait target of issue 34: an acquire's wait p99 within two round
/// trips (of the farthest agent or region) plus the agents' tick of an
/// ideal global semaphore's p99 over the same arrivals.
pub fn wait_target_ns(sc: &PermitScenario, ideal_p99_ns: u64) -> u64 {
    let far_ms = if sc.regions.is_empty() {
        sc.agents.iter().map(|a| a.delay_ms).max().unwrap_or(0)
    } else {
        sc.regions
            .iter()
            .map(|r| r.delay_ms + r.agent_delay_ms)
            .max()
            .unwrap_or(0)
    };
    ideal_p99_ns + 4 * far_ms * MS + quotalease_agent::permits::policy::TICK_NS
}

/// `report.md` of a run: what a planner reads.
pub fn report_md(sc: &PermitScenario, seed: u64, r: &PermitReport) -> String {
    use std::fmt::Write;
    let ms = |ns: u64| ns as f64 / 1e6;
    let mut s = String::new();
    let _ = writeln!(s, "# {} (seed {seed})\n", sc.name);
    if !sc.description.is_empty() {
        let _ = writeln!(s, "{}\n", sc.description.trim());
    }
    let topology = if sc.regions.is_empty() {
        format!(
            "{} agents of the allocator, {} ms away",
            sc.agents.len(),
            sc.agents
                .iter()
                .map(|a| a.delay_ms.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )
    } else {
        format!(
            "{} regions {} ms from the allocator, {} agents",
            sc.regions.len(),
            sc.regions
                .iter()
                .map(|r| r.delay_ms.to_string())
                .collect::<Vec<_>>()
                .join(", "),
            sc.total_agents()
        )
    };
    let _ = writeln!(
        s,
        "`concurrency: {}`; {topology}; offered load {} x N, holds of median {} ms (spread {}); clients wait up to {} ms; {:.0} s in all.\n",
        sc.concurrency, sc.load, sc.hold.median_ms, sc.hold.sigma, sc.wait_ms, sc.duration_s()
    );
    let i4 = match &r.i4_broken {
        None => format!(
            "**held**: at most {} slots of valid permits at any instant, N = {}",
            r.max_held, sc.concurrency
        ),
        Some(why) => format!("**BROKEN**: {why}"),
    };
    let target = wait_target_ns(sc, r.ideal_p99_ns);
    let offered: u64 = r.arrivals_by_agent.iter().sum();
    let _ = writeln!(s, "| figure | value |\n| --- | --- |");
    let _ = writeln!(s, "| I4 (checked on every event) | {i4} |");
    let _ = writeln!(
        s,
        "| permits granted | {} of {offered} acquires |",
        r.permits
    );
    let _ = writeln!(
        s,
        "| slots in use while demand >= N | {:.1} % (over {:.1} s) |",
        100.0 * r.saturated_use,
        r.saturated_s
    );
    let _ = writeln!(
        s,
        "| acquire wait p50 / p99 | {:.0} / {:.0} ms |",
        ms(r.wait_p50_ns),
        ms(r.wait_p99_ns)
    );
    let _ = writeln!(
        s,
        "| ideal global semaphore, same arrivals: wait p50 / p99 | {:.0} / {:.0} ms |",
        ms(r.ideal_p50_ns),
        ms(r.ideal_p99_ns)
    );
    let _ = writeln!(
        s,
        "| wait target (ideal p99 + two round trips + a tick) | {:.0} ms: {} |",
        ms(target),
        if r.ideal_p99_ns + MS >= sc.wait_ms * MS {
            "the ideal semaphore's waiters too reach the deadline: the target says nothing here"
        } else if r.wait_p99_ns <= target {
            "met"
        } else {
            "missed"
        }
    );
    let _ = writeln!(
        s,
        "| timeouts | {} ({:.1} %; ideal {}); the worst agent's share: {:.1} % |",
        r.timeouts,
        100.0 * r.timeouts as f64 / offered.max(1) as f64,
        r.ideal_timeouts,
        100.0 * r.worst_agent_timeouts()
    );
    let _ = writeln!(s, "| permits lost under their clients | {} |", r.lost);
    let _ = writeln!(
        s,
        "| asks per permit (agents) | {:.2} ({} asks, {} sent again) |",
        r.asks_per_permit(),
        r.asks,
        r.retries
    );
    if !sc.regions.is_empty() {
        let _ = writeln!(
            s,
            "| regionals' asks of the allocator | {} ({:.2} per permit), {} sent again, {} chain breaks, {} lapses |",
            r.region_asks,
            r.region_asks as f64 / r.permits.max(1) as f64,
            r.region_retries,
            r.region_breaks,
            r.region_lapses
        );
    }
    let _ = writeln!(
        s,
        "| wake-ups | {} ({} answered with room or contention) |",
        r.wakeups, r.wakeups_answered
    );
    if sc.faults.loss > 0.0
        || !sc.faults.restarts_s.is_empty()
        || !sc.faults.crashes.is_empty()
        || !sc.faults.region_restarts.is_empty()
    {
        let _ = writeln!(
            s,
            "| faults | {} messages lost, {} allocator restarts, {} permits orphaned by agent crashes, {} regional restarts ({} slots resumed, {} asks answered RESUMING) |",
            r.lost_messages,
            sc.faults.restarts_s.len(),
            r.orphaned,
            r.region_restarts,
            r.slots_resumed,
            r.resume_waits
        );
    }
    let _ = writeln!(
        s,
        "\nPer agent:\n\n| agent | acquires | timed out |\n| --- | --- | --- |"
    );
    for (a, (&n, &t)) in r
        .arrivals_by_agent
        .iter()
        .zip(&r.timeouts_by_agent)
        .enumerate()
    {
        let _ = writeln!(
            s,
            "| {a} | {n} | {t} ({:.1} %) |",
            100.0 * t as f64 / n.max(1) as f64
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    const OK: &str = r#"
name: t
concurrency: 8
agents: [{ delay_ms: 10 }, { delay_ms: 20 }]
load: 1.2
hold: { median_ms: 100 }
phases:
  - { for_s: 2, weights: [1, 1] }
  - { for_s: 2, weights: [0.9, 0.1] }
"#;

    #[test]
    fn a_scenario_runs_and_reports() {
        let sc = PermitScenario::parse(OK, "t.yaml").expect("valid");
        let cfg = sc.config(3);
        assert_eq!(cfg.delays_ns, vec![10 * MS, 20 * MS]);
        assert_eq!(cfg.phases.len(), 2);
        let r = super::super::run(&cfg);
        assert!(r.i4_broken.is_none() && r.max_held <= 8, "{r:?}");
        let md = report_md(&sc, 3, &r);
        assert!(md.contains("**held**: at most"), "{md}");
        assert!(md.contains("| 1 |"), "a row per agent: {md}");
    }

    #[test]
    fn bad_fields_are_named() {
        let cases = [
            ("concurrency: 8", "concurrency: 0", "concurrency: 0"),
            ("load: 1.2", "load: -1", "load: -1"),
            (
                "weights: [0.9, 0.1]",
                "weights: [1]",
                "phases[1].weights: 1 weights for 2 agents",
            ),
            ("median_ms: 100", "median_ms: 0", "hold.median_ms"),
            (
                "load: 1.2",
                "load: 1.2\nfaults: { crashes: [{ at_s: 1, agent: 5 }] }",
                "faults.crashes[0].agent: 5: there are 2 agents",
            ),
            (
                "load: 1.2",
                "load: 1.2\nfaults: { cuts: [{ at_s: 1, for_s: 1, region: 0 }] }",
                "cuts need regions",
            ),
            ("load: 1.2", "load: 1.2\nlod: 3", "unknown field"),
        ];
        for (from, to, want) in cases {
            let text = OK.replace(from, to);
            let e = PermitScenario::parse(&text, "t.yaml").expect_err(to);
            assert!(e.contains(want), "{to}: {e}");
        }
    }

    #[test]
    fn regions_share_their_weight_among_their_agents() {
        let text = r#"
name: r
concurrency: 4
regions:
  - { delay_ms: 15, agents: 2 }
  - { delay_ms: 40, agents: 1, agent_delay_ms: 3 }
load: 1
hold: { median_ms: 100, sigma: 0 }
phases: [{ for_s: 1, weights: [1, 1] }]
faults: { cuts: [{ at_s: 0.2, for_s: 0.3, region: 1 }] }
"#;
        let sc = PermitScenario::parse(text, "r.yaml").expect("valid");
        let cfg = sc.config(1);
        assert_eq!(cfg.delays_ns, vec![MS, MS, 3 * MS]);
        let rates = &cfg.phases[0].1;
        assert!(
            (rates[0] - rates[1]).abs() < 1e-9 && (rates[2] - 2.0 * rates[0]).abs() < 1e-9,
            "{rates:?}"
        );
        let g = cfg.regions.expect("regions");
        assert_eq!(g.agent_region, vec![0, 0, 1]);
        assert_eq!(g.cuts, vec![(200 * MS, 500 * MS, 1)]);
        // 40 + 3 ms to the farthest agent: 4 one-way trips and a tick.
        assert_eq!(wait_target_ns(&sc, 0), 172 * MS + 50 * MS);
    }
}

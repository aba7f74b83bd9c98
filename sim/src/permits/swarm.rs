//! Permits in swarm mode (issue 34; after the token world's
//! `crate::swarm`): every seed draws its own permit run — topology (one
//! allocator, or two to four regions), `N`, agents, their delays, the
//! load moving between them, hold times, the wake-ups on or off — and its
//! own faults (message loss, allocator restarts, agent crashes, region
//! cuts), all from a stream of the seed's generator the run itself never
//! touches. I4 is checked on every event; liveness: once the faults are
//! over, permits are granted again.
//!
//! `quotalease sim --swarm --permits --seeds A..B` runs it; a failing seed
//! replays with `--seed N`.

use super::{PermitFaults, PermitRegions, PermitReport, PermitSimConfig};
use crate::rng::SimRng;

const MS: u64 = 1_000_000;
const S: u64 = 1_000 * MS;

/// The stream of the seed's generator a permit plan is drawn from.
pub const PERMIT_PLAN_STREAM: u64 = 0x5045_524D; // "PERM"

/// Faults happen within this window (ns from the start); the run lasts
/// [`RUN_NS`].
pub const FAULTS_NS: (u64, u64) = (4 * S, 18 * S);

/// Length of a swarm run.
pub const RUN_NS: u64 = 30 * S;

/// A seed's permit run, and a one-line description of what it drew.
pub fn plan(seed: u64) -> (PermitSimConfig, String) {
    let mut g = SimRng::new(seed).fork(PERMIT_PLAN_STREAM);
    let n = [1, 2, 3, 5, 8, 16, 32][g.below(7) as usize];
    let regions = if g.chance(0.5) {
        2 + g.below(3) as usize
    } else {
        0
    };
    let agents = if regions > 0 {
        regions * (1 + g.below(2) as usize)
    } else {
        2 + g.below(5) as usize
    };
    let load = 0.5 + 1.5 * g.unit_f64();
    let median = (50 + g.below(450)) * MS;
    let sigma = 0.3 + g.unit_f64();
    let mean_hold_s = median as f64 / 1e9 * (sigma * sigma / 2.0).exp();
    let total = load * n as f64 / mean_hold_s;
    // Three phases of 10 s, each with its own split of the load.
    let phases = (0..3)
        .map(|_| {
            let w: Vec<f64> = (0..agents).map(|_| 0.05 + g.unit_f64()).collect();
            let sum: f64 = w.iter().sum();
            (10 * S, w.iter().map(|x| x / sum * total).collect())
        })
        .collect();
    let far = |g: &mut SimRng| (1 + g.below(50)) * MS;
    let (delays_ns, regions_cfg) = if regions > 0 {
        let delays = (0..agents).map(|_| (1 + g.below(3)) * MS).collect();
        let cfg = PermitRegions {
            agent_region: (0..agents).map(|a| a % regions).collect(),
            delays_ns: (0..regions).map(|_| far(&mut g)).collect(),
            cuts: Vec::new(),
        };
        (delays, Some(cfg))
    } else {
        ((0..agents).map(|_| far(&mut g)).collect(), None)
    };
    let at = |g: &mut SimRng| FAULTS_NS.0 + g.below(FAULTS_NS.1 - FAULTS_NS.0);
    let loss = if g.chance(0.4) {
        0.1 * g.unit_f64()
    } else {
        0.0
    };
    let restarts_ns = (0..g.below(3)).map(|_| at(&mut g)).collect::<Vec<_>>();
    let crashes = (0..g.below(3))
        .map(|_| (at(&mut g), g.below(agents as u64) as usize))
        .collect::<Vec<_>>();
    let mut regions_cfg = regions_cfg;
    if let Some(rc) = regions_cfg.as_mut() {
        for _ in 0..g.below(3) {
            let from = at(&mut g);
            let len = (500 + g.below(3_500)) * MS;
            rc.cuts
                .push((from, from + len, g.below(regions as u64) as usize));
        }
    }
    let wakeups = g.chance(0.8);
    // Drawn last: the plans of seeds without regions are as before.
    let region_restarts = if regions > 0 {
        (0..g.below(3))
            .map(|_| (at(&mut g), g.below(regions as u64) as usize))
            .collect()
    } else {
        Vec::new()
    };
    let region_resume = regions > 0 && g.chance(0.5);
    let cfg = PermitSimConfig {
        seed,
        n,
        delays_ns,
        phases,
        hold_median_ns: median,
        hold_sigma: sigma,
        wait_ns: 5 * S,
        ttl_max_ns: 2 * S,
        renew_every_ns: 250 * MS,
        faults: PermitFaults {
            loss,
            restarts_ns,
            crashes,
            region_restarts,
        },
        regions: regions_cfg,
        wakeups,
        shares: true,
        region_resume,
        grant_on_wake: false,
    };
    let what = format!(
        "N {n}, {agents} agents{}, load {load:.2} x N, holds median {} ms, loss {:.1} %, {} restarts, {} crashes, {} cuts, {} regional restarts{}, wake-ups {}",
        if regions > 0 {
            format!(" in {regions} regions")
        } else {
            String::new()
        },
        median / MS,
        100.0 * loss,
        cfg.faults.restarts_ns.len(),
        cfg.faults.crashes.len(),
        cfg.regions.as_ref().map_or(0, |r| r.cuts.len()),
        cfg.faults.region_restarts.len(),
        if region_resume { " (resumed)" } else { "" },
        if wakeups { "on" } else { "off" },
    );
    (cfg, what)
}

/// When every fault of a plan is over and its effects have passed: the
/// fault window's end, the longest cut (4 s), a restart's wait (`TTL_max`
/// and its margins, under 3 s).
pub const HEALED_NS: u64 = FAULTS_NS.1 + 7 * S;

/// What failed in a seed's run (empty: it passed): I4, and liveness (an
/// acquire arriving once the faults have healed is granted, unless none
/// of those arriving then is: load above `N` may time some out, never
/// all).
pub fn check(r: &PermitReport, cfg: &PermitSimConfig) -> Vec<String> {
    let mut failed = Vec::new();
    if let Some(why) = &r.i4_broken {
        failed.push(why.clone());
        return failed;
    }
    let arrived = r.arrivals_ns.iter().filter(|&&t| t >= HEALED_NS).count();
    let granted = r.grants_ns.iter().filter(|&&t| t >= HEALED_NS).count();
    // None granted is a failure unless the slots were in use throughout:
    // a permit held longer than the deadline with `N` = 1 (holds are
    // lognormal; seed 8703 holds one for 18.6 s from 20.7 s) times out
    // everything behind it, as it would at an ideal semaphore.
    let busy = r.stalls.iter().all(|&(from, len)| from + len < HEALED_NS);
    if arrived > 0 && granted == 0 && !busy {
        failed.push(format!(
            "liveness: {arrived} acquires arrived after the faults healed ({:.0} s), none was granted",
            HEALED_NS as f64 / 1e9
        ));
    }
    // Acquires waiting beside free slots for seconds after the faults
    // healed: the slots are stuck somewhere. Lost messages delay a slot's
    // move by fetch timeouts and resends at each tier (250 ms and 500 ms,
    // up to 3 resends), so with loss (up to 10 % of messages) a stall
    // fails from twice `TTL_max` (every slot lease has expired by then).
    let stuck = if cfg.faults.loss > 0.0 {
        2 * cfg.ttl_max_ns
    } else {
        super::STALL_NS
    };
    for &(from, len) in &r.stalls {
        if from + len >= HEALED_NS && len >= stuck {
            failed.push(format!(
                "liveness: acquires waited {:.1} s from {:.1} s while fewer than N slots were in use and none was granted",
                len as f64 / 1e9,
                from as f64 / 1e9
            ));
        }
    }
    failed
}

/// Run seed `seed`: its description, report and failures.
pub fn run_seed(seed: u64) -> (String, PermitReport, Vec<String>) {
    let (cfg, what) = plan(seed);
    let r = super::run(&cfg);
    let failed = check(&r, &cfg);
    (what, r, failed)
}

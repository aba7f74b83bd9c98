//! The simulator's permit model (`quotalease_sim::permits`, issue 34): I4
//! is asserted on every event inside the run; here the runs must also
//! serve (no permit lost, most acquires granted) and their figures are
//! printed beside an ideal global semaphore's (docs/permits.md "In the
//! simulator" has them).

use quotalease_sim::permits::{run, PermitReport, PermitSimConfig};

fn show(what: &str, seed: u64, cfg: &PermitSimConfig, r: &PermitReport) {
    eprintln!(
        "permits sim {what} seed {seed}: {} permits, {} timeouts (ideal {}), {} lost, max held {} of N = {}; slots in use {:.1} % while demand >= N ({:.1} s); wait p50 {:.0} ms p99 {:.0} ms (ideal {:.0} / {:.0} ms); {:.2} asks per permit",
        r.permits,
        r.timeouts,
        r.ideal_timeouts,
        r.lost,
        r.max_held,
        cfg.n,
        100.0 * r.saturated_use,
        r.saturated_s,
        r.wait_p50_ns as f64 / 1e6,
        r.wait_p99_ns as f64 / 1e6,
        r.ideal_p50_ns as f64 / 1e6,
        r.ideal_p99_ns as f64 / 1e6,
        r.asks_per_permit(),
    );
}

/// Offered load 1.5 x N: demand exceeds N throughout; the slots stay in use.
#[test]
fn over_n_keeps_i4_and_the_slots_in_use() {
    for seed in 1..=3 {
        let cfg = PermitSimConfig::shape(seed, 1.5);
        let r = run(&cfg);
        show("load 1.5", seed, &cfg, &r);
        assert!(r.max_held <= cfg.n);
        assert_eq!(r.lost, 0, "a held permit expired under its client");
        assert!(r.permits > 1_000, "{r:?}");
        assert!(r.saturated_s > 10.0, "demand hardly exceeded N: {r:?}");
    }
}

/// Offered load 0.9 x N: queues come and go; waits against the ideal
/// semaphore's.
#[test]
fn below_n_keeps_i4_and_serves_nearly_as_an_ideal_semaphore() {
    for seed in 1..=3 {
        let cfg = PermitSimConfig::shape(seed, 0.9);
        let r = run(&cfg);
        show("load 0.9", seed, &cfg, &r);
        assert!(r.max_held <= cfg.n);
        assert_eq!(r.lost, 0, "a held permit expired under its client");
        assert!(r.permits > 1_000, "{r:?}");
    }
}

/// Faults: 5 % of asks and of replies lost, the allocator restarted at 8 s
/// and 21 s (adoption, the phantom), agent 1 crashed at 12 s and agent 0
/// at 25 s with permits held (they count on until their expiries). I4 on
/// every event, and service goes on.
#[test]
fn faults_keep_i4_and_service_goes_on() {
    use quotalease_sim::permits::PermitFaults;
    const S: u64 = 1_000_000_000;
    for seed in 1..=5 {
        let mut cfg = PermitSimConfig::shape(seed, 1.2);
        cfg.faults = PermitFaults {
            loss: 0.05,
            restarts_ns: vec![8 * S, 21 * S],
            crashes: vec![(12 * S, 1), (25 * S, 0)],
            region_restarts: Vec::new(),
        };
        let r = run(&cfg);
        show("faults", seed, &cfg, &r);
        eprintln!(
            "  {} messages lost, {} permits orphaned by crashes",
            r.lost_messages, r.orphaned
        );
        assert!(r.max_held <= cfg.n);
        assert!(r.lost_messages > 0 && r.orphaned > 0, "{r:?}");
        assert!(r.permits > 1_000, "{r:?}");
    }
}

#[test]
#[ignore]
fn probe_faults() {
    use quotalease_sim::permits::PermitFaults;
    const S: u64 = 1_000_000_000;
    for (name, f) in [
        ("none", PermitFaults::default()),
        (
            "loss",
            PermitFaults {
                loss: 0.05,
                ..PermitFaults::default()
            },
        ),
        (
            "restarts",
            PermitFaults {
                restarts_ns: vec![8 * S, 21 * S],
                ..PermitFaults::default()
            },
        ),
        (
            "crashes",
            PermitFaults {
                crashes: vec![(12 * S, 1), (25 * S, 0)],
                ..PermitFaults::default()
            },
        ),
    ] {
        let mut cfg = PermitSimConfig::shape(1, 1.2);
        cfg.faults = f;
        let r = run(&cfg);
        show(name, 1, &cfg, &r);
    }
}

/// Through regional allocators (docs/permits.md "Through regional
/// allocators"): three regions 30-80 ms round trips from the allocator,
/// two agents each, load 1.5 x N moving between the regions. I4 on every
/// event; slots in use while demand >= N against the 97 %.
#[test]
fn through_regions_keeps_i4_and_the_slots_in_use() {
    for seed in 1..=3 {
        let cfg = PermitSimConfig::regions_shape(seed, 1.5);
        let r = run(&cfg);
        show("regions load 1.5", seed, &cfg, &r);
        eprintln!(
            "  regionals: {} slot asks, {} sent again, {} breaks, {} lapses",
            r.region_asks, r.region_retries, r.region_breaks, r.region_lapses
        );
        assert!(r.max_held <= cfg.n);
        assert_eq!(r.lost, 0, "a held permit expired under its client");
        assert!(r.permits > 1_000, "{r:?}");
        assert!(r.region_asks > 0, "{r:?}");
    }
}

/// Through regions with load 0.9 x N: waits against the ideal semaphore.
#[test]
fn through_regions_below_n_serves_nearly_as_an_ideal_semaphore() {
    for seed in 1..=3 {
        let cfg = PermitSimConfig::regions_shape(seed, 0.9);
        let r = run(&cfg);
        show("regions load 0.9", seed, &cfg, &r);
        assert!(r.max_held <= cfg.n);
        assert_eq!(r.lost, 0, "a held permit expired under its client");
    }
}

/// Through regions with faults: 5 % loss on every link, the allocator
/// restarted at 8 s, region 2 cut from it over 14-18 s (its permits run
/// to the parent lease's end and are not renewed past it; its slots come
/// back to the others), agent 1 crashed at 22 s. I4 on every event.
#[test]
fn through_regions_with_faults_keeps_i4() {
    use quotalease_sim::permits::PermitFaults;
    const S: u64 = 1_000_000_000;
    for seed in 1..=3 {
        let mut cfg = PermitSimConfig::regions_shape(seed, 1.2);
        cfg.faults = PermitFaults {
            loss: 0.05,
            restarts_ns: vec![8 * S],
            crashes: vec![(22 * S, 1)],
            region_restarts: vec![(11 * S, 0), (25 * S, 2)],
        };
        if let Some(g) = cfg.regions.as_mut() {
            g.cuts = vec![(14 * S, 18 * S, 2)];
        }
        let r = run(&cfg);
        show("regions faults", seed, &cfg, &r);
        eprintln!(
            "  regionals: {} slot asks, {} sent again, {} breaks, {} lapses; {} messages lost, {} permits lost under their clients",
            r.region_asks, r.region_retries, r.region_breaks, r.region_lapses, r.lost_messages, r.lost
        );
        assert!(r.max_held <= cfg.n);
        assert!(r.region_lapses > 0, "the cut region's lease lapsed: {r:?}");
        assert!(r.permits > 1_000, "{r:?}");
    }
}

/// Regional allocators restarted while their agents hold permits longer
/// than a slot lease lives (holds of median 3 s, `TTL_max` 2 s): the new
/// process resumes each parent slot lease and the agents' renewals adopt
/// their leases, so no client loses its permit, and I4 holds on every
/// event (docs/permits.md "A regional restart"). Without the resume every
/// permit still held at the restart and running past its lease's use-by
/// is lost.
#[test]
fn regional_restarts_keep_i4_and_the_permits_held_across_them() {
    use quotalease_sim::permits::PermitFaults;
    const S: u64 = 1_000_000_000;
    for seed in 1..=3 {
        // About 0.8 x N with these holds (the shape's load is for holds
        // of median 200 ms).
        let mut cfg = PermitSimConfig::regions_shape(seed, 0.07);
        cfg.region_resume = true;
        cfg.hold_median_ns = 3 * S;
        cfg.hold_sigma = 0.3;
        cfg.faults = PermitFaults {
            region_restarts: vec![
                (6 * S, 0),
                (12 * S, 1),
                (12 * S, 2),
                (20 * S, 0),
                (20_100_000_000, 0),
            ],
            ..PermitFaults::default()
        };
        let r = run(&cfg);
        show("regional restarts", seed, &cfg, &r);
        eprintln!(
            "  {} regional restarts, {} slots resumed, {} asks answered RESUMING, {} permits lost under their clients",
            r.region_restarts, r.slots_resumed, r.resume_waits, r.lost
        );
        assert!(r.i4_broken.is_none(), "{:?}", r.i4_broken);
        assert!(r.max_held <= cfg.n);
        assert_eq!(r.region_restarts, 5);
        assert!(r.slots_resumed > 0, "{r:?}");
        assert_eq!(r.lost, 0, "permits lost across the restarts");
        assert!(r.permits > 100, "{r:?}");
    }
}

/// The wake-up long poll against the lease protocol's polling alone, side
/// by side on the same arrivals (docs/permits.md "Slots follow demand"):
/// I4 on every event either way; figures printed.
#[test]
fn wakeups_against_polling_alone() {
    for (name, regions) in [("one allocator", false), ("three regions", true)] {
        for load in [0.9, 1.5] {
            for seed in 1..=3 {
                let mut cfg = if regions {
                    PermitSimConfig::regions_shape(seed, load)
                } else {
                    PermitSimConfig::shape(seed, load)
                };
                let woken = run(&cfg);
                cfg.wakeups = false;
                let polled = run(&cfg);
                eprintln!(
                    "permits sim {name} load {load} seed {seed}: slots in use {:.1} % (polling {:.1} %), wait p50 {:.0} / p99 {:.0} ms (polling {:.0} / {:.0} ms; ideal {:.0} / {:.0} ms), asks per permit {:.2} (polling {:.2}), {} wake-ups ({} answered with room or contention)",
                    100.0 * woken.saturated_use,
                    100.0 * polled.saturated_use,
                    woken.wait_p50_ns as f64 / 1e6,
                    woken.wait_p99_ns as f64 / 1e6,
                    polled.wait_p50_ns as f64 / 1e6,
                    polled.wait_p99_ns as f64 / 1e6,
                    woken.ideal_p50_ns as f64 / 1e6,
                    woken.ideal_p99_ns as f64 / 1e6,
                    woken.asks_per_permit(),
                    polled.asks_per_permit(),
                    woken.wakeups,
                    woken.wakeups_answered,
                );
                assert!(woken.max_held <= cfg.n && polled.max_held <= cfg.n);
                assert!(woken.wakeups_answered > 0, "{woken:?}");
                assert_eq!(polled.wakeups, 0);
            }
        }
    }
}

/// [`wakeups_against_polling_alone`] over seeds 1-10 at load 0.9, the
/// medians of each figure across seeds (run by hand: `cargo test -p
/// quotalease-sim --release --test permits -- --ignored --nocapture`).
#[test]
#[ignore = "a figure for docs/permits.md, about 30 s in a debug build"]
fn wakeups_against_polling_alone_ten_seeds() {
    fn median(mut v: Vec<f64>) -> f64 {
        v.sort_by(f64::total_cmp);
        (v[v.len() / 2 - 1] + v[v.len() / 2]) / 2.0
    }
    for (name, regions) in [("one allocator", false), ("three regions", true)] {
        let mut figs: [Vec<f64>; 6] = Default::default();
        for seed in 1..=10 {
            let mut cfg = if regions {
                PermitSimConfig::regions_shape(seed, 0.9)
            } else {
                PermitSimConfig::shape(seed, 0.9)
            };
            for (i, wakeups) in [true, false].into_iter().enumerate() {
                cfg.wakeups = wakeups;
                let r = run(&cfg);
                figs[3 * i].push(100.0 * r.saturated_use);
                figs[3 * i + 1].push(r.wait_p99_ns as f64 / 1e6);
                figs[3 * i + 2].push(r.ideal_p99_ns as f64 / 1e6);
            }
        }
        let [uw, pw, iw, up, pp, _] = figs;
        eprintln!(
            "permits sim {name} load 0.9, seeds 1-10, medians: wake-ups: slots in use {:.1} %, wait p99 {:.0} ms (p99 range {:.0}-{:.0}); polling alone: {:.1} %, p99 {:.0} ms (range {:.0}-{:.0}); ideal p99 {:.0} ms",
            median(uw),
            median(pw.clone()),
            pw.iter().cloned().fold(f64::MAX, f64::min),
            pw.iter().cloned().fold(0.0, f64::max),
            median(up),
            median(pp.clone()),
            pp.iter().cloned().fold(f64::MAX, f64::min),
            pp.iter().cloned().fold(0.0, f64::max),
            median(iw),
        );
    }
}

/// The permit model's swarm (`quotalease sim --swarm --permits`): every
/// seed draws its own run and faults; I4 on every event, liveness after
/// the faults; the same seed draws the same run.
#[test]
fn a_permit_swarm_keeps_i4_and_recovers() {
    use quotalease_sim::permits::swarm::{plan, run_seed};
    assert_eq!(plan(7).1, plan(7).1);
    assert_ne!(plan(7).1, plan(8).1);
    let mut regions = 0;
    for seed in 1..=24 {
        let (what, r, failed) = run_seed(seed);
        eprintln!(
            "permits swarm seed {seed}: {what}: {} permits, max held {}",
            r.permits, r.max_held
        );
        assert!(failed.is_empty(), "seed {seed} ({what}): {failed:?}");
        regions += usize::from(what.contains("regions"));
    }
    assert!(regions > 0, "no seed drew regions");
}

/// The issue's wait target, "within two round trips plus the poll
/// interval" of an ideal global semaphore over the same arrivals, where it
/// is met (docs/permits.md "Wait tail"): one allocator at loads up to
/// 0.8 x `N`, through regions at 0.5 x `N` (round trips to the allocator
/// of 30-80 ms: the target is the ideal's p99 + 160 ms + 50 ms). At 0.9 x
/// `N` it is not (printed by `wait_tail_by_load`).
#[test]
fn the_wait_tail_is_within_two_round_trips_and_a_tick_of_the_ideal_below_saturation() {
    const TARGET_SLACK_NS: u64 = 2 * 80_000_000 + 50_000_000;
    for (regions, load) in [(false, 0.8), (true, 0.5)] {
        for seed in 1..=3 {
            let cfg = if regions {
                PermitSimConfig::regions_shape(seed, load)
            } else {
                PermitSimConfig::shape(seed, load)
            };
            let r = run(&cfg);
            show(&format!("regions {regions} load {load}"), seed, &cfg, &r);
            assert!(r.max_held <= cfg.n);
            assert!(
                r.wait_p99_ns <= r.ideal_p99_ns + TARGET_SLACK_NS,
                "regions {regions} load {load} seed {seed}: p99 {} ms, ideal {} ms",
                r.wait_p99_ns / 1_000_000,
                r.ideal_p99_ns / 1_000_000
            );
        }
    }
}

/// Figures for docs/permits.md "Wait tail" and "Max-min on what is held":
/// per topology and offered load, seeds 1-10, the medians of slots in use
/// while demand >= `N`, wait p99 (and its range), how many seeds meet the
/// wait target, asks per permit, timeouts and the worst agent's share of
/// its acquires timed out, with the grants' shares on and off, and with
/// shares on beside the best a long-poll grant could give
/// (`PermitSimConfig::grant_on_wake`) (run by hand: `cargo test -p quotalease-sim --release --test permits --
/// --ignored --nocapture wait_tail_by_load`).
#[test]
#[ignore = "a figure for docs/permits.md"]
fn wait_tail_by_load() {
    fn median(mut v: Vec<f64>) -> f64 {
        v.sort_by(f64::total_cmp);
        (v[v.len() / 2 - 1] + v[v.len() / 2]) / 2.0
    }
    for regions in [false, true] {
        for load in [0.5, 0.7, 0.8, 0.9, 1.5] {
            let mut line = format!(
                "permits sim {} load {load}, seeds 1-10, medians:",
                if regions {
                    "three regions"
                } else {
                    "one allocator"
                }
            );
            for (shares, grant_on_wake) in [(true, false), (false, false), (true, true)] {
                let (mut used, mut p99, mut asks, mut met) =
                    (Vec::new(), Vec::new(), Vec::new(), 0);
                let (mut timeouts, mut worst, mut up) = (Vec::new(), Vec::new(), Vec::new());
                for seed in 1..=10 {
                    let mut cfg = if regions {
                        PermitSimConfig::regions_shape(seed, load)
                    } else {
                        PermitSimConfig::shape(seed, load)
                    };
                    cfg.shares = shares;
                    cfg.grant_on_wake = grant_on_wake;
                    let r = run(&cfg);
                    assert!(r.max_held <= cfg.n, "{r:?}");
                    used.push(100.0 * r.saturated_use);
                    p99.push(r.wait_p99_ns as f64 / 1e6);
                    asks.push(r.asks_per_permit());
                    met += u32::from(r.wait_p99_ns <= r.ideal_p99_ns + 210_000_000);
                    let offered = r.arrivals_by_agent.iter().sum::<u64>().max(1);
                    timeouts.push(100.0 * r.timeouts as f64 / offered as f64);
                    worst.push(100.0 * r.worst_agent_timeouts());
                    up.push(r.region_asks as f64 / r.permits.max(1) as f64);
                }
                let lo = p99.iter().cloned().fold(f64::MAX, f64::min);
                let hi = p99.iter().cloned().fold(0.0, f64::max);
                line += &format!(
                    " | shares {}{}: in use {:.1} %, p99 {:.0} ms ({lo:.0}-{hi:.0}), target met {met}/10, asks/permit {:.2} (regionals' {:.2}), timeouts {:.1} % (worst agent {:.1} %)",
                    if shares { "on" } else { "off" },
                    if grant_on_wake { ", grant on wake-up (bound)" } else { "" },
                    median(used),
                    median(p99),
                    median(asks),
                    median(up),
                    median(timeouts),
                    median(worst),
                );
            }
            eprintln!("{line}");
        }
    }
}

/// The shipped permit scenarios (`sim/scenarios/permits/`, `quotalease sim
/// --permits --scenario FILE`) load and run: I4 on every event, permits
/// served, a report; `below-n` meets the wait target.
#[test]
fn shipped_permit_scenarios_run() {
    use quotalease_sim::permits::scenario::{report_md, wait_target_ns, PermitScenario};
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("scenarios")
        .join("permits");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .expect("sim/scenarios/permits")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    assert!(files.len() >= 3, "{files:?}");
    for f in &files {
        let sc = PermitScenario::load(f).unwrap_or_else(|e| panic!("{e}"));
        let r = run(&sc.config(1));
        assert_eq!(r.i4_broken, None, "{}", f.display());
        assert!(
            r.max_held <= sc.concurrency && r.permits > 1_000,
            "{}: {r:?}",
            f.display()
        );
        assert!(report_md(&sc, 1, &r).contains("**held**"));
        if sc.name.ends_with("below-n") {
            assert!(
                r.wait_p99_ns <= wait_target_ns(&sc, r.ideal_p99_ns),
                "{r:?}"
            );
        }
    }
}

/// The swarm's liveness check (docs/simulation.md "The permit swarm"): a
/// stall (acquires waiting beside free slots, none granted) reaching past
/// the faults' healing fails a seed, from 2 s, or from twice `TTL_max`
/// when messages are lost; none granted after the healing fails only if
/// the slots were not in use throughout (one long hold with `N` = 1 times
/// everything out behind it, at an ideal semaphore too).
#[test]
fn the_swarm_check_fails_stalls_past_the_healing_not_long_holds() {
    use quotalease_sim::permits::swarm::{check, plan, HEALED_NS};
    const S: u64 = 1_000_000_000;
    let (mut cfg, _) = plan(1);
    cfg.faults.loss = 0.0;
    let mut r = PermitReport {
        arrivals_ns: vec![HEALED_NS + S],
        ..PermitReport::default()
    };
    assert!(check(&r, &cfg).is_empty(), "slots in use throughout");
    r.stalls = vec![(HEALED_NS - S, 3 * S)];
    assert_eq!(check(&r, &cfg).len(), 2, "{:?}", check(&r, &cfg));
    r.grants_ns = vec![HEALED_NS + 3 * S];
    assert_eq!(check(&r, &cfg).len(), 1, "the stall alone");
    cfg.faults.loss = 0.05;
    assert!(
        check(&r, &cfg).is_empty(),
        "3 s with loss: under 2 x TTL_max"
    );
    r.stalls = vec![(HEALED_NS - S, 5 * S)];
    assert_eq!(check(&r, &cfg).len(), 1);
    r.stalls = vec![(HEALED_NS - 5 * S, 3 * S)];
    cfg.faults.loss = 0.0;
    assert!(check(&r, &cfg).is_empty(), "healed before it ended");
}

/// Figures for docs/permits.md "The agent's driver" (the retry hint of an
/// acquire that timed out): per topology and overload, seeds 1-10, the
/// hints against how long after the timeout its agent had started as many
/// permits as were queued up to its place (run by hand: `cargo test -p
/// quotalease-sim --release --test permits -- --ignored --nocapture
/// retry_hints_against_what_followed`).
#[test]
#[ignore = "a figure for docs/permits.md"]
fn retry_hints_against_what_followed() {
    for regions in [false, true] {
        for load in [1.2, 1.5, 2.0] {
            let (mut ratios, mut never, mut n) = (Vec::new(), 0usize, 0usize);
            let (mut hints, mut truths) = (Vec::new(), Vec::new());
            for seed in 1..=10 {
                let cfg = if regions {
                    PermitSimConfig::regions_shape(seed, load)
                } else {
                    PermitSimConfig::shape(seed, load)
                };
                let r = run(&cfg);
                assert!(r.max_held <= cfg.n, "{r:?}");
                assert_eq!(r.retry_hints.len() as u64, r.timeouts);
                for &(hint, truth) in &r.retry_hints {
                    n += 1;
                    hints.push(hint);
                    match truth {
                        Some(t) => {
                            truths.push(t);
                            ratios.push(hint as f64 / t.max(1) as f64);
                        }
                        None => never += 1,
                    }
                }
            }
            ratios.sort_by(f64::total_cmp);
            hints.sort_unstable();
            truths.sort_unstable();
            let q = |v: &[f64], f: f64| v[((v.len() as f64 * f) as usize).min(v.len() - 1)];
            let within = ratios.iter().filter(|&&x| (0.5..=2.0).contains(&x)).count();
            eprintln!(
                "retry hints, {} load {load}: {n} timeouts; hint median {} ms, what followed median {} ms; hint / what followed p10 {:.2}, median {:.2}, p90 {:.2}; within 0.5-2 x: {:.0} %; never followed: {never}",
                if regions { "three regions" } else { "one allocator" },
                hints[hints.len() / 2] / 1_000_000,
                truths[truths.len() / 2] / 1_000_000,
                q(&ratios, 0.1),
                q(&ratios, 0.5),
                q(&ratios, 0.9),
                100.0 * within as f64 / ratios.len() as f64,
            );
        }
    }
}

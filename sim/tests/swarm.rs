//! Swarm mode: a seed's plan and report are the same bytes every time,
//! plans differ between seeds, and the liveness check fails when a fault
//! never heals (and passes when it does).

use quotalease_sim::report::markdown;
use quotalease_sim::runner::{run_all, swarm_report, swarm_run};
use quotalease_sim::scenario::{CrashSpec, CutSpec, Scenario};
use quotalease_sim::swarm::{builtin_bases, plan};

#[test]
fn a_seed_gives_the_same_plan_and_report() {
    {
        let seed = 8;
        let a = swarm_run(None, seed).expect("runs");
        let b = swarm_run(None, seed).expect("runs");
        assert_eq!(a.plan.yaml, b.plan.yaml);
        assert_eq!(a.summary(), b.summary());
        assert_eq!(
            markdown(&swarm_report(&a, "replay")),
            markdown(&swarm_report(&b, "replay"))
        );
        assert!(a.failures().is_empty(), "seed {seed}: {:?}", a.failures());
    }
    assert_ne!(plan(None, 3).yaml, plan(None, 4).yaml);
}

#[test]
fn a_plan_on_a_scenario_keeps_its_topology() {
    let mut base = builtin_bases().remove(0);
    base.name = "mine".into();
    let p = plan(Some(&base), 11);
    assert_eq!(p.scenario.regions, base.regions);
    assert_eq!(p.scenario.total_agents(), base.total_agents());
    assert!(p.scenario.liveness);
    assert_eq!(p.yaml, plan(Some(&base), 11).yaml);
}

/// The flat base with one fault and liveness judged.
fn flat_with(edit: impl FnOnce(&mut Scenario)) -> Scenario {
    let mut sc = builtin_bases().remove(1);
    assert_eq!(sc.regions, 0);
    sc.duration_s = 24.0;
    sc.liveness = true;
    edit(&mut sc);
    sc
}

#[test]
fn liveness_is_judged_on_what_remains() {
    // The global allocator crashes for good: the reference run (without
    // the faults that heal, with the nodes that never come back gone from
    // the start) serves nothing either, so there is nothing to recover.
    let sc = flat_with(|sc| {
        sc.faults.crashes.push(CrashSpec {
            at_s: 5.0,
            node: "global".into(),
            restart_after_s: None,
        })
    });
    let out = run_all(&sc, 1).expect("runs");
    assert!(out[0].failures().is_empty(), "{:?}", out[0].failures());
    let live = out[0].liveness_from(sc.live_from_ns()).expect("judged");
    let hot = live.iter().find(|(k, _)| k.starts_with("hot/")).unwrap();
    assert_eq!(hot.1.reference, Some(0), "{hot:?}");
    assert!(hot.1.held() && hot.1.target == 0.0, "{hot:?}");
}

#[test]
fn liveness_fails_when_the_faults_have_not_healed() {
    // Every agent cut from the global allocator from 5 s to 20 s of 24.
    let cut = |for_s: f64, agent: u32| CutSpec {
        at_s: 5.0,
        for_s,
        region: None,
        agent: Some(agent),
        one_way: None,
    };
    let mut sc = flat_with(|_| {});
    sc.faults.cuts = (0..sc.total_agents()).map(|a| cut(15.0, a)).collect();
    let mut out = run_all(&sc, 2).expect("runs");
    let o = &mut out[0];
    // No room left after the heal to judge recovery: a failure.
    let f = o.failures();
    assert!(
        f.len() == 1 && f[0].contains("liveness not judged"),
        "{f:?}"
    );
    // Judged as if the cut had ended at 5 s (from 8 s): the starved hot key
    // fails against its reference run; I1 held.
    o.live_from_ns = Some(8_000_000_000);
    let f = o.failures();
    assert!(
        !f.is_empty() && f.iter().all(|f| f.starts_with("liveness: key ")),
        "{f:?}"
    );
    assert!(
        f.iter().any(|f| f.starts_with("liveness: key hot/")),
        "{f:?}"
    );

    // The same cut ending at 9 s: recovered, live.
    let mut sc = flat_with(|_| {});
    sc.faults.cuts = (0..sc.total_agents()).map(|a| cut(4.0, a)).collect();
    let out = run_all(&sc, 2).expect("runs");
    assert!(out[0].failures().is_empty(), "{:?}", out[0].failures());
    let healed = out[0].liveness_from(sc.live_from_ns()).expect("judged");
    assert!(healed.iter().all(|(_, l)| l.held()), "{healed:?}");
    assert!(healed.iter().all(|(_, l)| l.reference.is_some()));
}

#[test]
fn liveness_needs_room_to_judge() {
    let text = "name: x\nduration_s: 12\nagents: 5\nttl_max_ms: 1000\nlease_ttl_ms: 1000\nliveness: true\nrules: |\n  rules:\n    - { id: hot, match: { tenant: t0 }, rate: 10/s, burst: 5 }\nworkloads:\n  - { kind: hot, tenant: 0, rps: 20 }\nfaults:\n  crashes:\n    - { at_s: 5, node: agent/1, restart_after_s: 1 }\n";
    let e = Scenario::parse(text, "x.yaml").unwrap_err();
    assert!(
        e.contains("x.yaml: liveness: the last fault heals at 6.000 s"),
        "{e}"
    );
}

/// The global allocator's count of tokens released, from its report line.
fn released(o: &quotalease_sim::world::Outcome) -> u64 {
    let line = o
        .tier_notes
        .iter()
        .find(|n| n.starts_with("global:"))
        .expect("the global allocator reports");
    let words: Vec<&str> = line.split_whitespace().collect();
    let i = words
        .iter()
        .position(|w| w.starts_with("released"))
        .expect("a released count");
    words[i - 1].parse().expect("a number")
}

#[test]
fn faults_take_effect() {
    // Liveness is not judged here (no reference runs: a quicker test).
    let flat_with = |edit: &dyn Fn(&mut Scenario)| {
        flat_with(|sc| {
            sc.liveness = false;
            edit(sc)
        })
    };
    // A graceful shutdown goes through the agent core's shutdown path: its
    // leases come back to the allocator as a release.
    let plain = run_all(&flat_with(&|_| {}), 4).expect("runs");
    let shut = run_all(
        &flat_with(&|sc: &mut Scenario| {
            sc.faults.shutdowns.push(CrashSpec {
                at_s: 6.0,
                node: "agent/0".into(),
                restart_after_s: Some(1.0),
            })
        }),
        4,
    )
    .expect("runs");
    assert!(shut[0].failures().is_empty(), "{:?}", shut[0].failures());
    assert!(
        released(&shut[0]) > released(&plain[0]),
        "{} vs {}",
        released(&shut[0]),
        released(&plain[0])
    );
    // A suspended agent's gateway answers nothing while it sleeps.
    let slept = run_all(
        &flat_with(&|sc: &mut Scenario| {
            sc.faults
                .suspends
                .push(quotalease_sim::scenario::SuspendSpec {
                    at_s: 6.0,
                    for_s: 2.0,
                    node: "agent/1".into(),
                })
        }),
        4,
    )
    .expect("runs");
    assert!(slept[0].failures().is_empty(), "{:?}", slept[0].failures());
    // A rule change reaches the allocator: the hot key follows the new
    // rate (500/s from 1000/s) once the old leases are gone.
    let changed = run_all(
        &flat_with(&|sc: &mut Scenario| {
            sc.faults
                .rule_changes
                .push(quotalease_sim::scenario::RuleChangeSpec {
                    at_s: 6.0,
                    rule: "hot".into(),
                    rate: "500/s".into(),
                    burst: 100,
                })
        }),
        4,
    )
    .expect("runs");
    assert!(
        changed[0].failures().is_empty(),
        "{:?}",
        changed[0].failures()
    );
    let live = changed[0].liveness_from(10_000_000_000).expect("judged");
    let hot = &live.iter().find(|(k, _)| k.starts_with("hot/")).unwrap().1;
    let window_s = 14.0;
    assert!(
        (hot.admitted as f64) <= 500.0 * window_s + 100.0
            && hot.admitted as f64 >= 0.95 * 500.0 * window_s,
        "{hot:?}"
    );
    assert!(
        slept[0].unavailable > plain[0].unavailable + 500,
        "{} vs {}",
        slept[0].unavailable,
        plain[0].unavailable
    );
}

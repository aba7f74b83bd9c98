//! Swarm mode, after TigerBeetle's VOPR: every seed draws its own fault
//! plan — which faults happen, where and when — on top of a base scenario
//! (a built-in small one, or any scenario file), and the run keeps every
//! check of a plain run (I1, I2, I3) and adds liveness
//! ([`crate::liveness`]): after the last fault heals, the tracked keys
//! must recover within `3 x TTL_max`.
//!
//! The plan comes from its own stream of the seed's generator
//! ([`PLAN_STREAM`]), which the run's streams (clocks, network, workload)
//! never touch: the same seed gives the same plan and the same bytes, and
//! the plan is printed as the `faults:` YAML of a scenario file, so a
//! failing seed can be read and replayed as a plain scenario too.
//!
//! What a plan draws (each kind with its own probability, all inside the
//! fault phase `[warmup, warmup + FAULT_PHASE_S]`): link storms (loss,
//! duplication, latency tails that reorder), cuts of every kind, crashes
//! and restarts of every node kind, graceful shutdowns of agents and
//! regional allocators, suspends (a machine sleeps while its monotonic
//! clock keeps counting), clock drift up to `rho`, rule changes of rate and
//! burst, allocator key sweeps, a short agent idle release (keys
//! forgotten and fetched again), and the fail policy of the rules.

use crate::net::{LinkSpec, Node};
use crate::rng::SimRng;
use crate::scenario::{
    rate_unit, CrashSpec, CutSpec, Faults, OneWaySpec, RuleChangeSpec, Scenario, StormSpec,
    SuspendSpec, Variant,
};
use quotalease_model::rules::FailPolicy;

/// The stream of the seed's generator the plan is drawn from (the run
/// uses 1, 2 and 3).
pub const PLAN_STREAM: u64 = 0x5741_524D; // "SWARM"

/// Length of the phase in which faults start (s, after the warm-up).
pub const FAULT_PHASE_S: f64 = 12.0;

const BASE_REGIONS: &str = r#"
name: regions
description: "Swarm base: 2 regions x 3 agents, one hot tenant at 2x its rule's rate, 40 Zipf tenants."
duration_s: 30
warmup_s: 3
regions: 2
agents_per_region: 3
ttl_max_ms: 1000
lease_ttl_ms: 1000
rules: |
  rules:
    - id: hot
      match: { tenant: t0, route: /api }
      rate: 1000/s
      burst: 200
      fail_policy: closed
      overrides: [per-tenant]
    - id: per-tenant
      match: { tenant: "*", route: /api }
      rate: 40/s
      burst: 20
      fail_policy: lease_only
workloads:
  - { kind: hot, tenant: 0, rps: 2000 }
  - { kind: zipf, tenants: 40, s: 1.0, rps: 300 }
net:
  agent_parent: { median_ms: 0.5, p99_ms: 2 }
  regional_global: { median_ms: 15, p99_ms: 40 }
"#;

const BASE_FLAT: &str = r#"
name: flat
description: "Swarm base: 5 agents talking to the global allocator, one hot tenant at 2x its rule's rate, 40 Zipf tenants."
duration_s: 30
warmup_s: 3
agents: 5
ttl_max_ms: 1000
lease_ttl_ms: 1000
rules: |
  rules:
    - id: hot
      match: { tenant: t0, route: /api }
      rate: 1000/s
      burst: 200
      fail_policy: closed
      overrides: [per-tenant]
    - id: per-tenant
      match: { tenant: "*", route: /api }
      rate: 40/s
      burst: 20
      fail_policy: lease_only
workloads:
  - { kind: hot, tenant: 0, rps: 2000 }
  - { kind: zipf, tenants: 40, s: 1.0, rps: 300 }
net:
  agent_parent: { median_ms: 1, p99_ms: 5 }
"#;

/// The built-in bases: `regions` and `flat`.
pub fn builtin_bases() -> Vec<Scenario> {
    [BASE_REGIONS, BASE_FLAT]
        .iter()
        .map(|t| Scenario::parse(t, "<swarm base>").expect("the built-in swarm bases are valid"))
        .collect()
}

/// One seed's plan: the base with the drawn faults on top.
#[derive(Clone, Debug)]
pub struct Plan {
    /// The seed.
    pub seed: u64,
    /// The scenario to run (liveness on, duration long enough to judge it).
    pub scenario: Scenario,
    /// What was drawn, as YAML a scenario file accepts (its `faults`, and
    /// the top-level fields the plan set).
    pub yaml: String,
}

/// Draw the plan of `seed` on `base` (without a base: one of the built-in
/// bases, drawn too). Deterministic: same base and seed, same plan.
pub fn plan(base: Option<&Scenario>, seed: u64) -> Plan {
    let mut rng = SimRng::new(seed).fork(PLAN_STREAM);
    let mut sc = match base {
        Some(b) => b.clone(),
        None => {
            let mut bases = builtin_bases();
            let i = rng.below(bases.len() as u64) as usize;
            bases.swap_remove(i)
        }
    };
    let mut d = Draw {
        rng,
        from_s: sc.warmup_s,
        regions: sc.regions,
        agents: sc.total_agents(),
        one_stays_down: false,
    };
    let mut f = Faults {
        clock_drift_ppm: if d.rng.chance(0.7) {
            d.whole(0.0, 1000.0)
        } else {
            0.0
        },
        ..Faults::default()
    };
    for _ in 0..d.rng.below(3) {
        f.storms.push(d.storm(&sc));
    }
    for _ in 0..d.rng.below(4) {
        f.cuts.push(d.cut());
    }
    for _ in 0..d.rng.below(3) {
        let node = d.any_node();
        f.crashes.push(d.down(node, 0.1, 5.0));
    }
    for _ in 0..d.rng.below(2) {
        let node = d.child_node();
        f.shutdowns.push(d.down(node, 0.2, 5.0));
    }
    for _ in 0..d.rng.below(3) {
        let (at_s, for_s) = d.span(0.05, 3.0);
        f.suspends.push(SuspendSpec {
            at_s,
            for_s,
            node: d.any_node().to_string(),
        });
    }
    let charged: Vec<usize> = (0..sc.rule_set.rules.len())
        .filter(|&i| !sc.rule_set.rules[i].shadow)
        .collect();
    if !charged.is_empty() {
        for _ in 0..d.rng.below(3) {
            let rule = &sc.rule_set.rules[charged[d.rng.below(charged.len() as u64) as usize]];
            // From 0.5x to 1.25x: the built-in bases' hot demand (2x the
            // rate) then stays at or above 1.25x the max-min share of each
            // agent and each region, SPEC §2's premise for utilization,
            // even with one agent down for good (a region's demand stays
            // above half the rate; see docs/simulation.md "Swarm mode").
            let factor = |d: &mut Draw| 0.5 + 0.75 * d.rng.unit_f64();
            let tokens = ((rule.rate.tokens as f64 * factor(&mut d)).round() as u64).max(1);
            let burst = ((rule.burst as f64 * factor(&mut d)).round() as u64).max(max_cost(&sc));
            f.rule_changes.push(RuleChangeSpec {
                at_s: d.at(),
                rule: rule.id.clone(),
                rate: format!("{tokens}/{}", rate_unit(rule.rate.period_s)),
                burst,
            });
        }
    }
    f.rule_changes.sort_by(|a, b| a.at_s.total_cmp(&b.at_s));
    if d.rng.chance(0.5) {
        f.sweep_every_s = Some(d.whole(0.2, 2.0));
    }
    let idle_release_ms = d
        .rng
        .chance(0.5)
        .then(|| 300 + d.rng.below(2700))
        .filter(|&ms| ms > sc.low_water_ms);
    let policies = [FailPolicy::Closed, FailPolicy::LeaseOnly, FailPolicy::Open];
    let policy = policies[d.rng.below(3) as usize];

    // One plan in three runs the global allocator as --etcd replicas (from
    // a stream of its own, so that the other draws stay what they were): a
    // crash of `global` is then the leader's death (a successor is
    // elected, nothing restarts in place), a suspend a frozen leader.
    let mut fo_rng = SimRng::new(seed).fork(PLAN_STREAM + 1);
    let restarts_global = sc
        .faults
        .crashes
        .iter()
        .any(|c| c.node == "global" && c.restart_after_s.is_some());
    let failover =
        (sc.failover.is_none() && !restarts_global && fo_rng.chance(1.0 / 3.0)).then(|| {
            crate::scenario::FailoverSpec {
                lease_ttl_ms: 2000 + fo_rng.below(2001),
                election_ms: 10 + fo_rng.below(491),
                write_lag_ms: 1 + fo_rng.below(20),
            }
        });
    if let Some(fo) = failover {
        for c in f.crashes.iter_mut().filter(|c| c.node == "global") {
            c.restart_after_s = None;
        }
        // Make the replicas work: the leader killed, or frozen past its
        // etcd lease (deposed, then woken), in most such plans.
        let mut fd = Draw {
            rng: fo_rng,
            from_s: d.from_s,
            regions: d.regions,
            agents: d.agents,
            one_stays_down: true,
        };
        if fd.rng.chance(0.5) {
            f.crashes.push(CrashSpec {
                at_s: fd.at(),
                node: "global".into(),
                restart_after_s: None,
            });
        }
        if fd.rng.chance(0.5) {
            let ttl_s = fo.lease_ttl_ms as f64 / 1000.0;
            let (at_s, for_s) = fd.span(ttl_s + 0.1, ttl_s + 3.0);
            f.suspends.push(SuspendSpec {
                at_s,
                for_s,
                node: "global".into(),
            });
        }
        sc.failover = failover;
    }
    // The base's own faults stay; the drawn ones come on top.
    let base_faults = std::mem::take(&mut sc.faults);
    sc.faults = Faults {
        cuts: [base_faults.cuts, f.cuts.clone()].concat(),
        crashes: [base_faults.crashes, f.crashes.clone()].concat(),
        clock_drift_ppm: base_faults.clock_drift_ppm.max(f.clock_drift_ppm),
        storms: [base_faults.storms, f.storms.clone()].concat(),
        suspends: [base_faults.suspends, f.suspends.clone()].concat(),
        shutdowns: [base_faults.shutdowns, f.shutdowns.clone()].concat(),
        rule_changes: [base_faults.rule_changes, f.rule_changes.clone()].concat(),
        sweep_every_s: base_faults.sweep_every_s.or(f.sweep_every_s),
    };
    if let Some(ms) = idle_release_ms {
        sc.idle_release_ms = ms;
    }
    sc.variants = vec![Variant {
        name: policy.as_str().to_string(),
        fail_policy: Some(policy.as_str().to_string()),
    }];
    sc.liveness = true;
    // Long enough to recover and to judge it (see crate::liveness).
    let need_ms = sc.live_from_ns().div_ceil(1_000_000_000) * 1000
        + crate::liveness::MIN_WINDOW_TTLS * sc.ttl_max_ms;
    let duration_s = sc.duration_s.max(need_ms as f64 / 1000.0);
    sc.duration_s = duration_s;
    sc.name = format!("{}-swarm-{seed}", sc.name);

    let mut yaml = format!(
        "# swarm plan, seed {seed}, on {}\nduration_s: {duration_s}\n",
        base.map_or("a built-in base", |_| "the scenario")
    );
    if let Some(ms) = idle_release_ms {
        yaml.push_str(&format!("idle_release_ms: {ms}\n"));
    }
    if let Some(fo) = failover {
        yaml.push_str(&format!(
            "failover: {{ lease_ttl_ms: {}, election_ms: {}, write_lag_ms: {} }}\n",
            fo.lease_ttl_ms, fo.election_ms, fo.write_lag_ms
        ));
    }
    yaml.push_str(&format!(
        "variants: [{{ name: {0}, fail_policy: {0} }}]\nliveness: true\nfaults:\n",
        policy.as_str()
    ));
    let body = serde_saphyr::to_string(&f).expect("a fault plan serializes");
    for line in body.lines() {
        yaml.push_str("  ");
        yaml.push_str(line);
        yaml.push('\n');
    }
    Plan {
        seed,
        scenario: sc,
        yaml,
    }
}

fn max_cost(sc: &Scenario) -> u64 {
    sc.workloads
        .iter()
        .map(|w| u64::from(w.cost()))
        .max()
        .unwrap_or(1)
}

/// The plan's random choices.
struct Draw {
    rng: SimRng,
    /// Start of the fault phase (s).
    from_s: f64,
    regions: u16,
    agents: u32,
    /// An agent that never restarts was drawn (at most one per plan).
    one_stays_down: bool,
}

impl Draw {
    /// A number in `[lo, hi)`, to the millisecond (plans print short).
    fn whole(&mut self, lo: f64, hi: f64) -> f64 {
        ((lo + (hi - lo) * self.rng.unit_f64()) * 1000.0).round() / 1000.0
    }

    /// A start inside the fault phase.
    fn at(&mut self) -> f64 {
        self.whole(self.from_s, self.from_s + FAULT_PHASE_S)
    }

    /// `(at_s, for_s)`, the length in `[lo, hi)` (at least 1 ms).
    fn span(&mut self, lo: f64, hi: f64) -> (f64, f64) {
        (self.at(), self.whole(lo, hi).max(0.001))
    }

    fn agent(&mut self) -> u32 {
        self.rng.below(u64::from(self.agents)) as u32
    }

    fn region(&mut self) -> u16 {
        self.rng.below(u64::from(self.regions)) as u16
    }

    /// An agent or (with regions) a regional allocator.
    fn child_node(&mut self) -> Node {
        if self.regions > 0 && self.rng.chance(0.3) {
            Node::Regional(self.region())
        } else {
            Node::Agent(self.agent())
        }
    }

    /// Any node: the global allocator, a regional one, an agent.
    fn any_node(&mut self) -> Node {
        if self.rng.chance(0.25) {
            Node::Global
        } else {
            self.child_node()
        }
    }

    /// A crash or shutdown of `node`; it restarts after `[lo, hi)` s,
    /// except that one agent of a plan may stay down (one in five):
    /// liveness is then judged on the agents that remain.
    fn down(&mut self, node: Node, lo: f64, hi: f64) -> CrashSpec {
        let at_s = self.at();
        let stays_down =
            matches!(node, Node::Agent(_)) && !self.one_stays_down && self.rng.chance(0.2);
        self.one_stays_down |= stays_down;
        CrashSpec {
            at_s,
            node: node.to_string(),
            restart_after_s: (!stays_down).then(|| self.whole(lo, hi).max(0.001)),
        }
    }

    fn cut(&mut self) -> CutSpec {
        let (at_s, for_s) = self.span(0.2, 6.0);
        let mut c = CutSpec {
            at_s,
            for_s,
            region: None,
            agent: None,
            one_way: None,
        };
        let agent_parent = |d: &mut Draw, a: u32| {
            if d.regions == 0 {
                Node::Global
            } else {
                Node::Regional((a / (d.agents / u32::from(d.regions)).max(1)) as u16)
            }
        };
        match self.rng.below(3) {
            0 if self.regions > 0 => c.region = Some(self.region()),
            1 => c.agent = Some(self.agent()),
            _ => {
                // One direction of a link the protocol uses.
                let (a, b) = if self.regions > 0 && self.rng.chance(0.5) {
                    (Node::Regional(self.region()), Node::Global)
                } else {
                    let a = self.agent();
                    (Node::Agent(a), agent_parent(self, a))
                };
                let (from, to) = if self.rng.chance(0.5) { (a, b) } else { (b, a) };
                c.one_way = Some(OneWaySpec {
                    from: from.to_string(),
                    to: to.to_string(),
                });
            }
        }
        c
    }

    /// A storm on one kind of link: loss, duplication and a heavy latency
    /// tail (copies overtake each other).
    fn storm(&mut self, sc: &Scenario) -> StormSpec {
        let (at_s, for_s) = self.span(0.5, 5.0);
        let regional = self.regions > 0 && self.rng.chance(0.5);
        let base = if regional {
            sc.net.regional_global
        } else {
            sc.net.agent_parent
        };
        let median_ms = self.whole(1.0, 4.0) * base.median_ms.max(0.1);
        let median_ms = (median_ms * 1000.0).round() / 1000.0;
        let p99_ms = (median_ms * self.whole(2.0, 40.0) * 1000.0).round() / 1000.0;
        StormSpec {
            at_s,
            for_s,
            link: if regional {
                "regional_global"
            } else {
                "agent_parent"
            }
            .into(),
            net: LinkSpec {
                median_ms,
                p99_ms,
                loss: self.whole(0.0, 0.3),
                duplicate: self.whole(0.0, 0.2),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_bases_parse() {
        assert_eq!(builtin_bases().len(), 2);
    }

    #[test]
    fn plans_are_deterministic_and_valid() {
        let mut kinds = [0usize; 8];
        for seed in 1..=200 {
            let a = plan(None, seed);
            let b = plan(None, seed);
            assert_eq!(a.yaml, b.yaml, "seed {seed}");
            let f = &a.scenario.faults;
            for (i, n) in [
                f.cuts.len(),
                f.crashes.len(),
                f.storms.len(),
                f.suspends.len(),
                f.shutdowns.len(),
                f.rule_changes.len(),
                usize::from(f.sweep_every_s.is_some()),
                usize::from(a.scenario.failover.is_some()),
            ]
            .into_iter()
            .enumerate()
            {
                kinds[i] += n;
            }
            // What the plan prints is what runs: a scenario file made of
            // the base and the printed plan parses to the same faults.
            let sc = &a.scenario;
            assert!(sc.liveness);
            assert_eq!(
                sc.failover.is_some(),
                a.yaml.contains("failover:"),
                "seed {seed}: the printed plan says whether it runs replicas"
            );
            // The printed plan is YAML whose faults read back as printed.
            #[derive(serde::Deserialize)]
            struct Printed {
                faults: Faults,
            }
            let printed: Printed = crate::scenario::from_yaml(&a.yaml)
                .unwrap_or_else(|e| panic!("seed {seed}: {e}\n{}", a.yaml));
            let again = serde_saphyr::to_string(&printed.faults).unwrap();
            let again: String = again.lines().map(|l| format!("  {l}\n")).collect();
            assert!(a.yaml.ends_with(&again), "seed {seed}:\n{}", a.yaml);
            let errors = Scenario::parse(&scenario_text(sc), "plan.yaml");
            assert!(
                errors.is_ok(),
                "seed {seed}: {:?}\n{}",
                errors.err(),
                a.yaml
            );
        }
        assert!(kinds.iter().all(|&k| k > 10), "{kinds:?}");
        assert_ne!(plan(None, 1).yaml, plan(None, 2).yaml);
    }

    /// The plan's scenario as a file: base fields, rules and the faults.
    fn scenario_text(sc: &Scenario) -> String {
        #[derive(serde::Serialize)]
        struct Out<'a> {
            name: &'a str,
            duration_s: f64,
            warmup_s: f64,
            regions: u16,
            agents_per_region: u32,
            agents: u32,
            ttl_max_ms: u64,
            lease_ttl_ms: u64,
            idle_release_ms: u64,
            liveness: bool,
            rules: &'a str,
            faults: &'a Faults,
            variants: &'a [Variant],
            #[serde(skip_serializing_if = "Option::is_none")]
            failover: Option<crate::scenario::FailoverSpec>,
        }
        let mut text = serde_saphyr::to_string(&Out {
            name: &sc.name,
            duration_s: sc.duration_s,
            warmup_s: sc.warmup_s,
            regions: sc.regions,
            agents_per_region: sc.agents_per_region,
            agents: sc.agents,
            ttl_max_ms: sc.ttl_max_ms,
            lease_ttl_ms: sc.lease_ttl_ms,
            idle_release_ms: sc.idle_release_ms,
            liveness: sc.liveness,
            rules: &sc.rules,
            faults: &sc.faults,
            variants: &sc.variants,
            failover: sc.failover,
        })
        .unwrap();
        text.push_str("workloads:\n  - { kind: hot, tenant: 0, rps: 2000 }\n");
        text
    }
}

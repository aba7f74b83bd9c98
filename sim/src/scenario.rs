//! Scenario files: what one simulation run (or one run per variant) sets
//! up — topology, lease timings, rules, workloads, network and faults.
//!
//! A scenario is YAML (unknown fields are errors). [`Scenario::load`]
//! parses and validates it and returns every problem, each naming the file
//! and the field. Times in the file are seconds (`*_s`) or milliseconds
//! (`*_ms`); the event loop works in nanoseconds and gets them from the
//! conversion methods here ([`Scenario::cuts`], [`Scenario::crashes`]).
//!
//! Agents are numbered `0..total_agents()` across regions: with `R`
//! regions of `A` agents each, agent `i` belongs to region `i / A`.

use crate::net::{Cut, CutKind, LinkSpec, NetConfig, Node, Storm};
use crate::rng::SimRng;
use crate::workload::WorkloadSpec;
use quotalease_model::rules::{yaml, FailPolicy, Rate, RuleSet};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use std::path::Path;

fn d_warmup() -> f64 {
    5.0
}
fn d_true() -> bool {
    true
}
fn d_2000() -> u64 {
    2000
}
fn d_renew() -> u64 {
    50
}
fn d_low_water() -> u64 {
    100
}
fn d_fetch_timeout() -> u64 {
    250
}
fn d_idle_release() -> u64 {
    10_000
}

/// One simulation scenario.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// Short name (report title).
    pub name: String,
    /// What it shows (a markdown paragraph for the report).
    #[serde(default)]
    pub description: String,
    /// Simulated length of a run (s, > 0).
    pub duration_s: f64,
    /// Start of the measured part (s, default 5): quality figures ignore
    /// what happens before.
    #[serde(default = "d_warmup")]
    pub warmup_s: f64,
    /// Regional allocators; 0 = agents talk to the global allocator.
    #[serde(default)]
    pub regions: u16,
    /// Agents per region (with `regions > 0`).
    #[serde(default)]
    pub agents_per_region: u32,
    /// Agents (with `regions: 0`).
    #[serde(default)]
    pub agents: u32,
    /// The allocators' `TTL_max` (ms, default 2000).
    #[serde(default = "d_2000")]
    pub ttl_max_ms: u64,
    /// Lease TTL granted (ms, default 2000, at most `ttl_max_ms`).
    #[serde(default = "d_2000")]
    pub lease_ttl_ms: u64,
    /// Agents' background renewal interval (ms, default 50).
    #[serde(default = "d_renew")]
    pub renew_interval_ms: u64,
    /// Renew when a lease has less than this left (ms, default 100).
    #[serde(default = "d_low_water")]
    pub low_water_ms: u64,
    /// An agent gives up waiting for a grant after this long (ms, default 250).
    #[serde(default = "d_fetch_timeout")]
    pub fetch_timeout_ms: u64,
    /// Agents release and forget a key idle this long (ms, default 10000).
    #[serde(default = "d_idle_release")]
    pub idle_release_ms: u64,
    /// Judge liveness: after the last fault heals, the tracked keys'
    /// utilization must recover (see [`crate::liveness`]). Default false
    /// (`quotalease sim --swarm` sets it).
    #[serde(default)]
    pub liveness: bool,
    /// Regional allocators ask their parent for leases that carry a rate
    /// (default true, as in production; false: leases of tokens only, as a
    /// protocol-2 parent grants).
    #[serde(default = "d_true")]
    pub upstream_rates: bool,
    /// Agents ask for leases that carry a rate (default true, as in
    /// production; a regional allocator's pool lends none yet, so this
    /// matters for agents on the global allocator).
    #[serde(default = "d_true")]
    pub agent_rates: bool,
    /// The rules, as a rules YAML document (SPEC §4).
    pub rules: String,
    /// The parsed rules (filled by [`Scenario::load`] / [`Scenario::parse`];
    /// scaled by [`Scenario::scaled`]): what the event loop enforces. Use
    /// [`Scenario::rules_for`] for a variant.
    #[serde(skip)]
    pub rule_set: RuleSet,
    /// Sources of checks.
    pub workloads: Vec<WorkloadSpec>,
    /// Links.
    #[serde(default)]
    pub net: NetConfig,
    /// Injected faults.
    #[serde(default)]
    pub faults: Faults,
    /// The global allocator as `--etcd` replicas electing a leader (SPEC
    /// §7; see [`crate::failover`]): a crash or a long suspend of `global`
    /// is then the leader's, and a successor takes over from the
    /// reservations in etcd. `None`: one allocator, restarted in place.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failover: Option<FailoverSpec>,
    /// Empty: one run. Otherwise one run per variant.
    #[serde(default)]
    pub variants: Vec<Variant>,
    /// Factor for the test suite's reduced-scale runs (see
    /// [`Scenario::scaled`]); `None` = the suite runs it at full scale.
    #[serde(default)]
    pub scale: Option<f64>,
}

/// The global allocator's replicas and etcd, as the failover model sees
/// them (all in ms).
#[derive(Clone, Copy, Debug, PartialEq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct FailoverSpec {
    /// TTL of the leader's etcd lease (`--etcd-lease-ttl`, default 3000,
    /// 2000..=60000): kept alive every sixth of it; a leader stops granting
    /// `max(TTL/3, 1 s)` before it could expire.
    #[serde(default = "d_3000")]
    pub lease_ttl_ms: u64,
    /// From the lease's expiry until the successor serves: its campaign
    /// returns, it reads the reservations and writes its promises (default
    /// 50, at most 10000).
    #[serde(default = "d_50")]
    pub election_ms: u64,
    /// How long a write of reservations takes to be durable in etcd
    /// (default 5, at most 1000): replies that need one wait this long.
    #[serde(default = "d_5")]
    pub write_lag_ms: u64,
}

fn d_3000() -> u64 {
    3000
}
fn d_50() -> u64 {
    50
}
fn d_5() -> u64 {
    5
}

/// Faults injected into a run.
#[derive(Clone, Debug, Default, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct Faults {
    /// Network cuts.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cuts: Vec<CutSpec>,
    /// Process crashes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub crashes: Vec<CrashSpec>,
    /// Each node's clock runs at a rate drawn uniformly in `[-x, +x]` ppm
    /// (at most 1000, the protocol's `rho`).
    #[serde(default)]
    pub clock_drift_ppm: f64,
    /// Spells during which one kind of link has other latency, loss and
    /// duplication (the base `net` again afterwards).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub storms: Vec<StormSpec>,
    /// Suspends: a node's machine sleeps (it runs nothing, hears nothing)
    /// while its monotonic clock keeps counting, as `CLOCK_BOOTTIME` does;
    /// from the process's view its clock steps forward by `for_s`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub suspends: Vec<SuspendSpec>,
    /// Graceful shutdowns (SIGTERM): the node releases what it holds
    /// through its own shutdown path, then is down; optionally restarted.
    /// Agents and regional allocators (`agent/N`, `region/N`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shutdowns: Vec<CrashSpec>,
    /// Rule changes: a new rules document (the one in force with one rule's
    /// rate and burst changed) published to the global allocator with the
    /// next version, as a rules-file reload does.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rule_changes: Vec<RuleChangeSpec>,
    /// Every allocator runs its housekeeping sweep (expired leases
    /// collected, full idle keys dropped) this often (s); `None`: never.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sweep_every_s: Option<f64>,
}

/// A spell of bad weather on one kind of link.
#[derive(Clone, Debug, PartialEq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct StormSpec {
    /// Start (s).
    pub at_s: f64,
    /// Length (s, > 0).
    pub for_s: f64,
    /// `agent_parent` or `regional_global`.
    pub link: String,
    /// The link's behaviour during the storm.
    pub net: LinkSpec,
}

/// A suspend of one node.
#[derive(Clone, Debug, PartialEq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct SuspendSpec {
    /// Start (s).
    pub at_s: f64,
    /// Length (s, > 0).
    pub for_s: f64,
    /// `global`, `region/N` or `agent/N`.
    pub node: String,
}

/// A change of one rule's rate and burst.
#[derive(Clone, Debug, PartialEq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct RuleChangeSpec {
    /// When it is published (s).
    pub at_s: f64,
    /// The rule's id.
    pub rule: String,
    /// New rate (`N/s`, `N/m`, ...).
    pub rate: String,
    /// New burst (>= 1).
    pub burst: u64,
}

/// A one-way cut, by node names (`global`, `region/N`, `agent/N`).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct OneWaySpec {
    /// Sender.
    pub from: String,
    /// Receiver.
    pub to: String,
}

/// A cut: exactly one of `region`, `agent`, `one_way`.
#[derive(Clone, Debug, PartialEq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct CutSpec {
    /// Start (s).
    pub at_s: f64,
    /// Length (s, > 0).
    pub for_s: f64,
    /// Cut this region's allocator from the global one (both directions).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub region: Option<u16>,
    /// Cut this agent from its allocator (both directions).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<u32>,
    /// Drop only the messages from one node to another.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub one_way: Option<OneWaySpec>,
}

/// A crash of one node (it loses all memory), optionally restarted.
#[derive(Clone, Debug, PartialEq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct CrashSpec {
    /// When (s).
    pub at_s: f64,
    /// `global`, `region/N` or `agent/N`.
    pub node: String,
    /// Restart this long after the crash (s); `None`: stays down.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart_after_s: Option<f64>,
}

/// A crash in simulated time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Crash {
    /// When (ns).
    pub at_ns: u64,
    /// Which node.
    pub node: Node,
    /// When it starts again (ns), if it does.
    pub restart_ns: Option<u64>,
}

/// One run of a scenario with every rule's fail policy overridden.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct Variant {
    /// Name (report section).
    pub name: String,
    /// `open`, `closed` or `lease_only`; `None` keeps the rules' own.
    #[serde(default)]
    pub fail_policy: Option<String>,
}

impl Variant {
    /// The parsed fail policy override.
    pub fn policy(&self) -> Result<Option<FailPolicy>, String> {
        self.fail_policy.as_deref().map(parse_policy).transpose()
    }
}

fn parse_policy(s: &str) -> Result<FailPolicy, String> {
    [FailPolicy::Open, FailPolicy::Closed, FailPolicy::LeaseOnly]
        .into_iter()
        .find(|p| p.as_str() == s)
        .ok_or_else(|| format!("must be open, closed or lease_only, got {s:?}"))
}

/// Crashes or shutdowns in simulated time (invalid node names skipped).
fn to_crashes(specs: &[CrashSpec]) -> Vec<Crash> {
    specs
        .iter()
        .filter_map(|c| {
            let at_ns = secs_to_ns(c.at_s);
            Some(Crash {
                at_ns,
                node: Node::parse(&c.node).ok()?,
                restart_ns: c
                    .restart_after_s
                    .map(|r| at_ns.saturating_add(secs_to_ns(r))),
            })
        })
        .collect()
}

/// A rule change in simulated time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleChange {
    /// When it is published (ns).
    pub at_ns: u64,
    /// The rule.
    pub rule: String,
    /// Its new rate.
    pub rate: Rate,
    /// Its new burst.
    pub burst: u64,
}

/// The unit of a rate's period, as the rules files spell it.
pub fn rate_unit(period_s: u64) -> &'static str {
    match period_s {
        60 => "m",
        3600 => "h",
        86400 => "d",
        _ => "s",
    }
}

fn secs_to_ns(s: f64) -> u64 {
    // Validated finite and >= 0; the cast saturates anyway.
    (s * 1e9).round() as u64
}

impl Scenario {
    /// Reads, parses and validates a scenario file. The error lists every
    /// problem found, one per line, each `FILE: FIELD: REASON`.
    pub fn load(path: &Path) -> Result<Scenario, String> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| format!("{file}: {e}"))?;
        Scenario::parse(&text, &file)
    }

    /// Parses and validates scenario text; `file` names it in errors.
    pub fn parse(text: &str, file: &str) -> Result<Scenario, String> {
        let mut sc: Scenario = from_yaml(text).map_err(|e| format!("{file}: {e}"))?;
        let mut errors = Vec::new();
        match RuleSet::parse(&sc.rules, &format!("{file}: rules"), 1) {
            Ok(rs) => sc.rule_set = rs,
            Err(errs) => errors.extend(errs.iter().map(|e| e.to_string())),
        }
        for (field, reason) in sc.check() {
            errors.push(format!("{file}: {field}: {reason}"));
        }
        if errors.is_empty() {
            Ok(sc)
        } else {
            Err(errors.join("\n"))
        }
    }

    /// Every agent of the deployment.
    pub fn total_agents(&self) -> u32 {
        if self.regions == 0 {
            self.agents
        } else {
            u32::from(self.regions).saturating_mul(self.agents_per_region)
        }
    }

    /// The region of agent `agent` (`None` without regions).
    pub fn region_of(&self, agent: u32) -> Option<u16> {
        if self.regions == 0 || self.agents_per_region == 0 {
            None
        } else {
            u16::try_from(agent / self.agents_per_region).ok()
        }
    }

    /// The allocator agent `agent` talks to.
    pub fn parent_of(&self, agent: u32) -> Node {
        self.region_of(agent).map_or(Node::Global, Node::Regional)
    }

    /// Run length in ns.
    pub fn duration_ns(&self) -> u64 {
        secs_to_ns(self.duration_s)
    }

    /// Warm-up length in ns.
    pub fn warmup_ns(&self) -> u64 {
        secs_to_ns(self.warmup_s)
    }

    /// Whether `node` exists in this deployment.
    pub fn has_node(&self, node: Node) -> bool {
        match node {
            Node::Global => true,
            Node::Regional(r) => r < self.regions,
            Node::Agent(a) => a < self.total_agents(),
        }
    }

    /// The clock rate error of `node` in ppm, uniform in
    /// `[-clock_drift_ppm, +clock_drift_ppm]`, drawn from its own stream of
    /// `rng` (so it does not depend on the order nodes are asked for, nor
    /// on how many there are). A node's clock then reads
    /// `t * (1 + ppm * 1e-6)` after `t` of true time. 0 without drift.
    pub fn drift_ppm(&self, node: Node, rng: &SimRng) -> f64 {
        let x = self.faults.clock_drift_ppm;
        if x <= 0.0 || !x.is_finite() {
            return 0.0;
        }
        let stream = match node {
            Node::Global => 0,
            Node::Regional(r) => (1 << 32) | u64::from(r),
            Node::Agent(a) => (2 << 32) | u64::from(a),
        };
        let u = rng.fork(stream).unit_f64();
        (2.0 * u - 1.0) * x
    }

    /// One regional round trip, the shift of [`crate::quality::false_rejects`]:
    /// twice the median latency between a regional allocator and the global
    /// one (between an agent and the global allocator without regions).
    pub fn regional_round_trip_ns(&self) -> u64 {
        let link = if self.regions == 0 {
            &self.net.agent_parent
        } else {
            &self.net.regional_global
        };
        (2.0 * link.median_ms * 1e6).round() as u64
    }

    /// The rules with every rule's fail policy replaced by the variant's
    /// (if it sets one). Shadow, rates and bursts are kept.
    pub fn rules_for(&self, variant: Option<&Variant>) -> RuleSet {
        let mut rs = self.rule_set.clone();
        if let Some(Ok(Some(policy))) = variant.map(Variant::policy) {
            for r in &mut rs.rules {
                r.fail_policy = policy;
            }
        }
        rs
    }

    /// The variants to run: the declared ones, or a single unnamed one
    /// (`name` empty, no override) when none is declared.
    pub fn runs(&self) -> Vec<Variant> {
        if self.variants.is_empty() {
            vec![Variant {
                name: String::new(),
                fail_policy: None,
            }]
        } else {
            self.variants.clone()
        }
    }

    /// The cuts as the network applies them. Call on a validated scenario
    /// (invalid node names are skipped).
    pub fn cuts(&self) -> Vec<Cut> {
        self.faults
            .cuts
            .iter()
            .filter_map(|c| {
                let kind = if let Some(r) = c.region {
                    CutKind::RegionFromGlobal(r)
                } else if let Some(a) = c.agent {
                    CutKind::AgentFromParent(a)
                } else {
                    let ow = c.one_way.as_ref()?;
                    CutKind::OneWay {
                        from: Node::parse(&ow.from).ok()?,
                        to: Node::parse(&ow.to).ok()?,
                    }
                };
                let from_ns = secs_to_ns(c.at_s);
                Some(Cut {
                    from_ns,
                    until_ns: from_ns.saturating_add(secs_to_ns(c.for_s)),
                    kind,
                })
            })
            .collect()
    }

    /// The crashes in simulated time, in file order. Call on a validated
    /// scenario (invalid node names are skipped).
    pub fn crashes(&self) -> Vec<Crash> {
        to_crashes(&self.faults.crashes)
    }

    /// The storms as the network applies them. Call on a validated
    /// scenario (unknown link names are skipped).
    pub fn storms(&self) -> Vec<Storm> {
        self.faults
            .storms
            .iter()
            .filter_map(|s| {
                let from_ns = secs_to_ns(s.at_s);
                Some(Storm {
                    from_ns,
                    until_ns: from_ns.saturating_add(secs_to_ns(s.for_s)),
                    regional_global: match s.link.as_str() {
                        "agent_parent" => false,
                        "regional_global" => true,
                        _ => return None,
                    },
                    spec: s.net,
                })
            })
            .collect()
    }

    /// The suspends in simulated time: `(node, from_ns, until_ns)`. Call on
    /// a validated scenario (invalid node names are skipped).
    pub fn suspends(&self) -> Vec<(Node, u64, u64)> {
        self.faults
            .suspends
            .iter()
            .filter_map(|s| {
                let from = secs_to_ns(s.at_s);
                Some((
                    Node::parse(&s.node).ok()?,
                    from,
                    from.saturating_add(secs_to_ns(s.for_s)),
                ))
            })
            .collect()
    }

    /// The graceful shutdowns in simulated time (as crashes: when, which
    /// node, when it starts again). Call on a validated scenario.
    pub fn shutdowns(&self) -> Vec<Crash> {
        to_crashes(&self.faults.shutdowns)
    }

    /// The rule changes in simulated time, in file order. Call on a
    /// validated scenario (unparsable rates are skipped).
    pub fn rule_changes(&self) -> Vec<RuleChange> {
        self.faults
            .rule_changes
            .iter()
            .filter_map(|c| {
                Some(RuleChange {
                    at_ns: secs_to_ns(c.at_s),
                    rule: c.rule.clone(),
                    rate: Rate::parse(&c.rate).ok()?,
                    burst: c.burst,
                })
            })
            .collect()
    }

    /// How long after a rule change the old rule may still be in force
    /// somewhere, in true time: the allocator's `TTL_max * (1 + 2 rho) +
    /// epsilon` on its own clock (SPEC §2), plus the clock's own rate
    /// error (rho) to turn it into true time.
    pub fn rule_change_lag_ns(&self) -> u64 {
        let cfg = quotalease_allocator::core::CoreConfig {
            ttl_max_ns: self.ttl_max_ms * 1_000_000,
            ..Default::default()
        };
        let d = cfg.restart_wait_ns();
        d + d / 1000 + 1
    }

    /// Every fault that makes a node unreachable or its messages fail,
    /// as `(start, end)` in ns (`None`: it never ends — a node that never
    /// restarts): cuts, storms, suspends, crashes and shutdowns. Clock
    /// drift is constant (within `rho`) and rule changes are not failures:
    /// neither is here.
    pub fn fault_spans(&self) -> Vec<(u64, Option<u64>)> {
        let mut spans: Vec<(u64, Option<u64>)> = self
            .cuts()
            .iter()
            .map(|c| (c.from_ns, Some(c.until_ns)))
            .collect();
        spans.extend(self.storms().iter().map(|s| (s.from_ns, Some(s.until_ns))));
        spans.extend(self.suspends().iter().map(|s| (s.1, Some(s.2))));
        // With failover a successor serves once the dead leader's lease has
        // expired and the election is over.
        let successor = self
            .failover
            .map(|f| (f.lease_ttl_ms + f.election_ms) * 1_000_000);
        spans.extend(
            self.crashes()
                .iter()
                .chain(self.shutdowns().iter())
                .map(|c| match (c.node, successor) {
                    (crate::net::Node::Global, Some(d)) => (c.at_ns, Some(c.at_ns + d)),
                    _ => (c.at_ns, c.restart_ns),
                }),
        );
        spans
    }

    /// When the last fault that ends has healed (ns; 0 without faults):
    /// every span of [`Scenario::fault_spans`] that ends over, and every
    /// rule change in force everywhere ([`Scenario::rule_change_lag_ns`]
    /// after it). A node that never restarts does not count: it stays
    /// down, and liveness is judged on what remains.
    pub fn heal_ns(&self) -> u64 {
        let lag = self.rule_change_lag_ns();
        let spans = self.fault_spans().into_iter().filter_map(|s| s.1);
        let changes = self.rule_changes().into_iter().map(|c| c.at_ns + lag);
        spans.chain(changes).max().unwrap_or(0)
    }

    /// Where liveness is judged from: `RECOVERY_TTLS x TTL_max` after
    /// [`Scenario::heal_ns`].
    pub fn live_from_ns(&self) -> u64 {
        self.heal_ns() + crate::liveness::RECOVERY_TTLS * self.ttl_max_ms * 1_000_000
    }

    /// A reduced-scale copy for quick test runs: agents per region (or
    /// agents) times `f`, at least 2 per region; workload rates and Zipf
    /// tenant counts times `f`; every rule's rate and burst times `f` (at
    /// least 1 token per period, burst at least the largest workload cost),
    /// so each key keeps its ratio of demand to rate. Regions, durations,
    /// timings, network and faults are kept; cuts and crashes naming agents
    /// are mapped onto the smaller numbering (agent `i` becomes
    /// `i * new / old`), and workload agent ranges likewise. `f` is clamped
    /// to `(0, 1]`; `rules` keeps the original text, `rule_set` holds the
    /// scaled rules.
    pub fn scaled(&self, f: f64) -> Scenario {
        let f = if f.is_finite() && f > 0.0 {
            f.min(1.0)
        } else {
            1.0
        };
        let mut sc = self.clone();
        let old_agents = self.total_agents();
        let shrink = |n: u32| ((f64::from(n) * f).round() as u32).max(2).min(n.max(2));
        if sc.regions == 0 {
            sc.agents = shrink(sc.agents);
        } else {
            sc.agents_per_region = shrink(sc.agents_per_region);
        }
        let new_agents = sc.total_agents();
        let map_agent = |a: u32| -> u32 {
            if old_agents == 0 {
                return a;
            }
            let y = u64::from(a) * u64::from(new_agents) / u64::from(old_agents);
            (y as u32).min(new_agents.saturating_sub(1))
        };
        let map_node = |s: &str| -> String {
            match Node::parse(s) {
                Ok(Node::Agent(a)) => Node::Agent(map_agent(a)).to_string(),
                _ => s.to_string(),
            }
        };
        sc.workloads = self
            .workloads
            .iter()
            .map(|w| w.scaled(f, old_agents, new_agents))
            .collect();
        let max_cost = sc
            .workloads
            .iter()
            .map(|w| u64::from(w.cost()))
            .max()
            .unwrap_or(1);
        for r in &mut sc.rule_set.rules {
            r.rate.tokens = ((r.rate.tokens as f64 * f).round() as u64).max(1);
            r.burst = ((r.burst as f64 * f).round() as u64).max(max_cost).max(1);
        }
        for c in &mut sc.faults.cuts {
            c.agent = c.agent.map(map_agent);
            if let Some(ow) = &mut c.one_way {
                ow.from = map_node(&ow.from);
                ow.to = map_node(&ow.to);
            }
        }
        for c in sc
            .faults
            .crashes
            .iter_mut()
            .chain(sc.faults.shutdowns.iter_mut())
        {
            c.node = map_node(&c.node);
        }
        for s in &mut sc.faults.suspends {
            s.node = map_node(&s.node);
        }
        // Mapping can make two crashes (or shutdowns) of different agents
        // hit the same one; keep the first of each node.
        for list in [&mut sc.faults.crashes, &mut sc.faults.shutdowns] {
            let mut seen = Vec::new();
            list.retain(|c| {
                if seen.contains(&c.node) {
                    false
                } else {
                    seen.push(c.node.clone());
                    true
                }
            });
        }
        for c in &mut sc.faults.rule_changes {
            if let Ok(r) = Rate::parse(&c.rate) {
                let tokens = ((r.tokens as f64 * f).round() as u64).max(1);
                c.rate = format!("{tokens}/{}", rate_unit(r.period_s));
            }
            c.burst = ((c.burst as f64 * f).round() as u64).max(max_cost).max(1);
        }
        sc.scale = None;
        sc
    }

    /// Every validation problem as `(field, reason)`, in file order.
    fn check(&self) -> Vec<(String, String)> {
        let mut e: Vec<(String, String)> = Vec::new();
        let mut err = |field: &str, reason: String| e.push((field.to_string(), reason));
        let pos = |v: f64| v.is_finite() && v > 0.0;
        let nonneg = |v: f64| v.is_finite() && v >= 0.0;
        if self.name.trim().is_empty() {
            err("name", "must not be empty".into());
        }
        if !pos(self.duration_s) {
            err(
                "duration_s",
                format!("must be > 0, got {}", self.duration_s),
            );
        }
        if !nonneg(self.warmup_s) || (pos(self.duration_s) && self.warmup_s >= self.duration_s) {
            err(
                "warmup_s",
                format!(
                    "must be >= 0 and below duration_s ({}), got {}",
                    self.duration_s, self.warmup_s
                ),
            );
        }
        if self.regions == 0 {
            if self.agents == 0 {
                err("agents", "must be at least 1 when regions is 0".into());
            }
            if self.agents_per_region != 0 {
                err(
                    "agents_per_region",
                    "only with regions > 0 (use agents with regions: 0)".into(),
                );
            }
        } else {
            if self.agents_per_region == 0 {
                err(
                    "agents_per_region",
                    "must be at least 1 when regions > 0".into(),
                );
            }
            if self.agents != 0 {
                err(
                    "agents",
                    "only with regions: 0 (use agents_per_region with regions)".into(),
                );
            }
        }
        for (name, v) in [
            ("ttl_max_ms", self.ttl_max_ms),
            ("lease_ttl_ms", self.lease_ttl_ms),
            ("renew_interval_ms", self.renew_interval_ms),
            ("fetch_timeout_ms", self.fetch_timeout_ms),
            ("idle_release_ms", self.idle_release_ms),
        ] {
            if v == 0 {
                err(name, "must be > 0".into());
            }
        }
        if self.lease_ttl_ms > self.ttl_max_ms {
            err(
                "lease_ttl_ms",
                format!(
                    "must be at most ttl_max_ms ({}), got {}",
                    self.ttl_max_ms, self.lease_ttl_ms
                ),
            );
        }
        if self.low_water_ms >= self.lease_ttl_ms {
            err(
                "low_water_ms",
                format!(
                    "must be below lease_ttl_ms ({}), got {}",
                    self.lease_ttl_ms, self.low_water_ms
                ),
            );
        }
        if self.workloads.is_empty() {
            err("workloads", "must list at least one workload".into());
        }
        let agents = self.total_agents();
        for (i, w) in self.workloads.iter().enumerate() {
            if let Err(reason) = w.validate(agents) {
                err(&format!("workloads[{i}].{reason}"), String::new());
            }
        }
        if self.workloads.len() > usize::from(u16::MAX) {
            err("workloads", format!("at most {} workloads", u16::MAX));
        }
        for (name, link) in [
            ("net.agent_parent", &self.net.agent_parent),
            ("net.regional_global", &self.net.regional_global),
        ] {
            if let Err(reason) = link.validate() {
                err(&format!("{name}.{reason}"), String::new());
            }
        }
        let d = &self.faults.clock_drift_ppm;
        if !nonneg(*d) || *d > 1000.0 {
            err(
                "faults.clock_drift_ppm",
                format!("must be from 0 to 1000 (the protocol's rho), got {d}"),
            );
        }
        let node_ok = |s: &str| -> Result<Node, String> {
            let n = Node::parse(s)?;
            if self.has_node(n) {
                Ok(n)
            } else {
                Err(format!(
                    "{s:?} does not exist ({} regions, {} agents)",
                    self.regions, agents
                ))
            }
        };
        for (i, c) in self.faults.cuts.iter().enumerate() {
            let at = format!("faults.cuts[{i}]");
            if !nonneg(c.at_s) {
                err(
                    &format!("{at}.at_s"),
                    format!("must be >= 0, got {}", c.at_s),
                );
            }
            if !pos(c.for_s) {
                err(
                    &format!("{at}.for_s"),
                    format!("must be > 0, got {}", c.for_s),
                );
            } else if nonneg(c.at_s) && pos(self.duration_s) && c.at_s + c.for_s > self.duration_s {
                err(
                    &format!("{at}.for_s"),
                    format!(
                        "the cut ends at {} s, after the run (duration_s {})",
                        c.at_s + c.for_s,
                        self.duration_s
                    ),
                );
            }
            let set = [c.region.is_some(), c.agent.is_some(), c.one_way.is_some()];
            if set.iter().filter(|&&s| s).count() != 1 {
                err(&at, "set exactly one of region, agent and one_way".into());
            }
            if let Some(r) = c.region {
                if r >= self.regions {
                    err(
                        &format!("{at}.region"),
                        format!("region {r} does not exist ({} regions)", self.regions),
                    );
                }
            }
            if let Some(a) = c.agent {
                if a >= agents {
                    err(
                        &format!("{at}.agent"),
                        format!("agent {a} does not exist ({agents} agents)"),
                    );
                }
            }
            if let Some(ow) = &c.one_way {
                let from = node_ok(&ow.from);
                let to = node_ok(&ow.to);
                if let Err(r) = &from {
                    err(&format!("{at}.one_way.from"), r.clone());
                }
                if let Err(r) = &to {
                    err(&format!("{at}.one_way.to"), r.clone());
                }
                if let (Ok(f), Ok(t)) = (from, to) {
                    if f == t {
                        err(
                            &format!("{at}.one_way"),
                            "from and to are the same node".into(),
                        );
                    }
                }
            }
        }
        if let Some(f) = &self.failover {
            if !(2000..=60_000).contains(&f.lease_ttl_ms) {
                err(
                    "failover.lease_ttl_ms",
                    format!("must be 2000..=60000, got {}", f.lease_ttl_ms),
                );
            }
            if f.election_ms > 10_000 {
                err(
                    "failover.election_ms",
                    format!("must be at most 10000, got {}", f.election_ms),
                );
            }
            if f.write_lag_ms > 1000 {
                err(
                    "failover.write_lag_ms",
                    format!("must be at most 1000, got {}", f.write_lag_ms),
                );
            }
            for (i, c) in self.faults.crashes.iter().enumerate() {
                if c.node == "global" && c.restart_after_s.is_some() {
                    err(
                        &format!("faults.crashes[{i}].restart_after_s"),
                        "with failover the leader's successor is elected; the crashed replica's return is not modelled".into(),
                    );
                }
            }
        }
        // Crashes and graceful shutdowns: when, which node, the restart.
        let downs = self
            .faults
            .crashes
            .iter()
            .enumerate()
            .map(|(i, c)| (format!("faults.crashes[{i}]"), c, true))
            .chain(
                self.faults
                    .shutdowns
                    .iter()
                    .enumerate()
                    .map(|(i, c)| (format!("faults.shutdowns[{i}]"), c, false)),
            );
        for (at, c, global_ok) in downs {
            if !nonneg(c.at_s) || (pos(self.duration_s) && c.at_s >= self.duration_s) {
                err(
                    &format!("{at}.at_s"),
                    format!(
                        "must be >= 0 and within the run (duration_s {}), got {}",
                        self.duration_s, c.at_s
                    ),
                );
            }
            match node_ok(&c.node) {
                Err(r) => err(&format!("{at}.node"), r),
                Ok(Node::Global) if !global_ok => err(
                    &format!("{at}.node"),
                    "the global allocator has no graceful shutdown to model (its state is durable): use crashes".into(),
                ),
                Ok(_) => {}
            }
            if let Some(r) = c.restart_after_s {
                if !pos(r) {
                    err(
                        &format!("{at}.restart_after_s"),
                        format!("must be > 0, got {r}"),
                    );
                }
            }
        }
        // Problems of a span [at_s, at_s + for_s) that must lie in the run.
        let duration_s = self.duration_s;
        let span = |at: &str, at_s: f64, for_s: f64| {
            let mut out = Vec::new();
            if !nonneg(at_s) {
                out.push((format!("{at}.at_s"), format!("must be >= 0, got {at_s}")));
            }
            if !pos(for_s) {
                out.push((format!("{at}.for_s"), format!("must be > 0, got {for_s}")));
            } else if nonneg(at_s) && pos(duration_s) && at_s + for_s > duration_s {
                out.push((
                    format!("{at}.for_s"),
                    format!(
                        "ends at {} s, after the run (duration_s {duration_s})",
                        at_s + for_s
                    ),
                ));
            }
            out
        };
        for (i, st) in self.faults.storms.iter().enumerate() {
            let at = format!("faults.storms[{i}]");
            for (f, r) in span(&at, st.at_s, st.for_s) {
                err(&f, r);
            }
            if !["agent_parent", "regional_global"].contains(&st.link.as_str()) {
                err(
                    &format!("{at}.link"),
                    format!("must be agent_parent or regional_global, got {:?}", st.link),
                );
            }
            if let Err(reason) = st.net.validate() {
                err(&format!("{at}.net.{reason}"), String::new());
            }
        }
        for (i, su) in self.faults.suspends.iter().enumerate() {
            let at = format!("faults.suspends[{i}]");
            for (f, r) in span(&at, su.at_s, su.for_s) {
                err(&f, r);
            }
            if let Err(r) = node_ok(&su.node) {
                err(&format!("{at}.node"), r);
            }
        }
        for (i, c) in self.faults.rule_changes.iter().enumerate() {
            let at = format!("faults.rule_changes[{i}]");
            if !nonneg(c.at_s) || (pos(self.duration_s) && c.at_s >= self.duration_s) {
                err(
                    &format!("{at}.at_s"),
                    format!(
                        "must be >= 0 and within the run (duration_s {}), got {}",
                        self.duration_s, c.at_s
                    ),
                );
            }
            if self.rule_set.get(&c.rule).is_none() && !self.rule_set.rules.is_empty() {
                err(
                    &format!("{at}.rule"),
                    format!("no rule {:?} in rules", c.rule),
                );
            }
            if let Err(r) = Rate::parse(&c.rate) {
                err(&format!("{at}.rate"), r);
            }
            if c.burst == 0 {
                err(&format!("{at}.burst"), "must be >= 1".into());
            }
        }
        if self.liveness && pos(self.duration_s) {
            let from = self.live_from_ns().div_ceil(1_000_000_000);
            let need = from * 1000 + crate::liveness::MIN_WINDOW_TTLS * self.ttl_max_ms;
            if (self.duration_s * 1000.0) < need as f64 {
                err(
                    "liveness",
                    format!(
                        "the last fault heals at {:.3} s: judging recovery needs duration_s >= {} (3 x TTL_max to recover, 10 x TTL_max to measure)",
                        self.heal_ns() as f64 / 1e9,
                        need as f64 / 1000.0
                    ),
                );
            }
        }
        if let Some(x) = self.faults.sweep_every_s {
            if !pos(x) {
                err("faults.sweep_every_s", format!("must be > 0, got {x}"));
            }
        }
        let mut names: Vec<&str> = Vec::new();
        for (i, v) in self.variants.iter().enumerate() {
            let at = format!("variants[{i}]");
            if v.name.trim().is_empty() {
                err(&format!("{at}.name"), "must not be empty".into());
            } else if names.contains(&v.name.as_str()) {
                err(&format!("{at}.name"), format!("{:?} is used twice", v.name));
            } else if !v
                .name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            {
                err(
                    &format!("{at}.name"),
                    format!(
                        "{:?}: use letters, digits, - and _ (it names a directory)",
                        v.name
                    ),
                );
            }
            names.push(&v.name);
            if let Err(r) = v.policy() {
                err(&format!("{at}.fail_policy"), r);
            }
        }
        if let Some(s) = self.scale {
            if !(pos(s) && s <= 1.0) {
                err("scale", format!("must be in (0, 1], got {s}"));
            }
        }
        // `field.reason` pairs from nested validators come as one string.
        e.into_iter()
            .map(|(f, r)| {
                if r.is_empty() {
                    match f.split_once(": ") {
                        Some((field, reason)) => (field.to_string(), reason.to_string()),
                        None => (f, r),
                    }
                } else {
                    (f, r)
                }
            })
            .collect()
    }
}

/// Reads YAML into `T` the way rule files are read (YAML 1.2, see
/// [`quotalease_model::rules::yaml`]: only `true`/`false` are booleans,
/// duplicate keys and several documents are errors); an error names the
/// field at fault (`faults.cuts[0].regio: unknown field ...`, also inside
/// the internally tagged workload entries: `workloads[1]: ...`) and its
/// line and column.
pub fn from_yaml<T: DeserializeOwned>(text: &str) -> Result<T, String> {
    let mut path = None;
    serde_saphyr::with_deserializer_from_str_with_options(text, yaml::options(), |de| {
        serde_path_to_error::deserialize(de).map_err(|e| {
            path = Some(e.path().to_string());
            e.into_inner()
        })
    })
    .map_err(|e| {
        let msg = e.render_with_formatter(&serde_saphyr::UserMessageFormatter);
        let msg = msg.split_whitespace().collect::<Vec<_>>().join(" ");
        match path {
            // `.`: the document itself; `?`: a place the path cannot name.
            Some(p) if p != "." && p != "?" => format!("{p}: {msg}"),
            _ => msg,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
name: t
duration_s: 30
regions: 2
agents_per_region: 10
rules: |
  rules:
    - id: hot
      match: { tenant: t0, route: /api }
      rate: 1000/s
      burst: 200
      fail_policy: closed
    - id: per-tenant
      match: { tenant: "*", route: /api }
      rate: 100/s
      burst: 50
workloads:
  - { kind: hot, tenant: 0, rps: 3000, agents: [0, 19] }
  - { kind: zipf, tenants: 1000, s: 1.0, rps: 5000 }
net:
  regional_global: { median_ms: 20, p99_ms: 60, loss: 0.01 }
faults:
  cuts:
    - { at_s: 10, for_s: 5, region: 1 }
    - { at_s: 1, for_s: 2, agent: 19 }
    - { at_s: 2, for_s: 1, one_way: { from: global, to: region/0 } }
  crashes:
    - { at_s: 12, node: agent/15, restart_after_s: 3 }
    - { at_s: 20, node: global }
  clock_drift_ppm: 500
variants:
  - { name: open, fail_policy: open }
  - { name: closed, fail_policy: closed }
scale: 0.1
"#;

    #[test]
    fn parses_a_good_file() {
        let sc = Scenario::parse(GOOD, "good.yaml").unwrap();
        assert_eq!(sc.total_agents(), 20);
        assert_eq!(sc.warmup_s, 5.0);
        assert_eq!(sc.lease_ttl_ms, 2000);
        assert_eq!(sc.renew_interval_ms, 50);
        assert_eq!(sc.rule_set.rules.len(), 2);
        assert_eq!(sc.region_of(15), Some(1));
        assert_eq!(sc.parent_of(3), Node::Regional(0));
        assert_eq!(sc.net.agent_parent.median_ms, 1.0);
        assert_eq!(sc.net.regional_global.median_ms, 20.0);
        let cuts = sc.cuts();
        assert_eq!(cuts.len(), 3);
        assert_eq!(
            cuts[0],
            Cut {
                from_ns: 10_000_000_000,
                until_ns: 15_000_000_000,
                kind: CutKind::RegionFromGlobal(1)
            }
        );
        assert_eq!(cuts[1].kind, CutKind::AgentFromParent(19));
        assert_eq!(
            cuts[2].kind,
            CutKind::OneWay {
                from: Node::Global,
                to: Node::Regional(0)
            }
        );
        let crashes = sc.crashes();
        assert_eq!(
            crashes[0],
            Crash {
                at_ns: 12_000_000_000,
                node: Node::Agent(15),
                restart_ns: Some(15_000_000_000)
            }
        );
        assert_eq!(crashes[1].restart_ns, None);
        let v = &sc.variants[0];
        let rs = sc.rules_for(Some(v));
        assert!(rs.rules.iter().all(|r| r.fail_policy == FailPolicy::Open));
        assert_eq!(sc.rules_for(None).rules[0].fail_policy, FailPolicy::Closed);
        assert_eq!(sc.runs().len(), 2);
        assert_eq!(sc.regional_round_trip_ns(), 40_000_000);
        let rng = SimRng::new(3);
        let d: Vec<f64> = (0..200)
            .map(|a| sc.drift_ppm(Node::Agent(a), &rng))
            .collect();
        assert!(d.iter().all(|x| x.abs() <= 500.0));
        assert!(d.iter().any(|&x| x > 250.0) && d.iter().any(|&x| x < -250.0));
        assert_eq!(sc.drift_ppm(Node::Agent(7), &rng), d[7]);
        assert_ne!(
            sc.drift_ppm(Node::Global, &rng),
            sc.drift_ppm(Node::Regional(0), &rng)
        );
    }

    #[test]
    fn scaled_keeps_regions_and_ratios() {
        let sc = Scenario::parse(GOOD, "good.yaml").unwrap();
        let s = sc.scaled(0.1);
        assert_eq!(s.regions, 2);
        assert_eq!(s.agents_per_region, 2);
        assert_eq!(s.total_agents(), 4);
        assert_eq!(s.rule_set.rules[0].rate.tokens, 100);
        assert_eq!(s.rule_set.rules[0].burst, 20);
        match &s.workloads[0] {
            WorkloadSpec::Hot { rps, agents, .. } => {
                assert!((rps - 300.0).abs() < 1e-9);
                assert_eq!(*agents, Some((0, 3)));
            }
            w => panic!("{w:?}"),
        }
        match &s.workloads[1] {
            WorkloadSpec::Zipf { tenants, .. } => assert_eq!(*tenants, 100),
            w => panic!("{w:?}"),
        }
        assert_eq!(s.faults.cuts[1].agent, Some(3));
        assert_eq!(s.faults.crashes[0].node, "agent/3");
        for w in &s.workloads {
            w.validate(s.total_agents()).unwrap();
        }
        assert!(s.check().is_empty(), "{:?}", s.check());
    }

    #[test]
    fn errors_name_file_and_field() {
        let bad = GOOD
            .replace("duration_s: 30", "duration_s: 0")
            .replace("clock_drift_ppm: 500", "clock_drift_ppm: 5000")
            .replace("node: agent/15", "node: agent/99")
            .replace("fail_policy: closed }", "fail_policy: shut }")
            .replace("rate: 100/s", "rate: 100/y")
            .replace("s: 1.0, rps: 5000", "s: -1.0, rps: 5000");
        let e = Scenario::parse(&bad, "bad.yaml").unwrap_err();
        for want in [
            "bad.yaml: duration_s: must be > 0",
            "bad.yaml: faults.clock_drift_ppm:",
            "bad.yaml: faults.crashes[0].node: \"agent/99\" does not exist",
            "bad.yaml: variants[1].fail_policy: must be open, closed or lease_only",
            "bad.yaml: rules: rule per-tenant: field rate:",
            "bad.yaml: workloads[1].s: must be",
        ] {
            assert!(e.contains(want), "missing {want:?} in:\n{e}");
        }
        let e = Scenario::parse(&GOOD.replace("regions: 2", "regionz: 2"), "x.yaml").unwrap_err();
        assert!(e.starts_with("x.yaml: ") && e.contains("regionz"), "{e}");
        let e = Scenario::parse(
            &GOOD.replace("{ kind: hot, tenant: 0,", "{ kind: hot, tenant: 0, rsp: 1,"),
            "x.yaml",
        )
        .unwrap_err();
        assert!(e.contains("workloads[0]") && e.contains("rsp"), "{e}");
        let e = Scenario::parse(
            &GOOD.replace(
                "{ at_s: 10, for_s: 5, region: 1 }",
                "{ at_s: 28, for_s: 5, region: 2 }",
            ),
            "x.yaml",
        )
        .unwrap_err();
        assert!(
            e.contains("x.yaml: faults.cuts[0].for_s: the cut ends at 33 s"),
            "{e}"
        );
        assert!(
            e.contains("x.yaml: faults.cuts[0].region: region 2 does not exist"),
            "{e}"
        );
        let e = Scenario::load(Path::new("/nonexistent/s.yaml")).unwrap_err();
        assert!(e.starts_with("/nonexistent/s.yaml: "), "{e}");
    }

    #[test]
    fn scenarios_are_yaml_1_2_and_errors_are_located() {
        let e = Scenario::parse(
            &GOOD.replace("scale: 0.1", "scale: 0.1\nliveness: yes"),
            "x.yaml",
        )
        .unwrap_err();
        assert!(
            e.starts_with("x.yaml: liveness: ") && e.contains("line 35"),
            "{e}"
        );
        let e = Scenario::parse(
            &GOOD.replace("regions: 2", "regions: 2\nregions: 3"),
            "x.yaml",
        )
        .unwrap_err();
        assert!(
            e.starts_with("x.yaml: ") && e.contains("duplicate") && e.contains("line 5"),
            "{e}"
        );
        let e = Scenario::parse(&format!("{GOOD}---\n{GOOD}"), "x.yaml").unwrap_err();
        assert!(e.starts_with("x.yaml: ") && e.contains("line"), "{e}");
        let e = Scenario::parse(
            &GOOD.replace(
                "{ at_s: 10, for_s: 5, region: 1 }",
                "{ at_s: x, for_s: 5, region: 1 }",
            ),
            "x.yaml",
        )
        .unwrap_err();
        assert!(e.starts_with("x.yaml: faults.cuts[0].at_s: "), "{e}");
    }

    #[test]
    fn new_fault_kinds_parse_and_errors_name_the_field() {
        let with = |faults: &str| GOOD.replace("  clock_drift_ppm: 500\n", faults);
        let good = with(
            "  clock_drift_ppm: 500
  storms:
    - { at_s: 3, for_s: 2, link: regional_global, net: { median_ms: 40, p99_ms: 400, loss: 0.2 } }
  suspends:
    - { at_s: 4, for_s: 1.5, node: region/1 }
  shutdowns:
    - { at_s: 5, node: agent/3, restart_after_s: 1 }
    - { at_s: 6, node: region/0 }
  rule_changes:
    - { at_s: 7, rule: hot, rate: 1500/s, burst: 300 }
  sweep_every_s: 0.5
",
        );
        let sc = Scenario::parse(&good, "good.yaml").unwrap();
        assert_eq!(sc.storms()[0].from_ns, 3_000_000_000);
        assert!(sc.storms()[0].regional_global);
        assert_eq!(
            sc.suspends(),
            vec![(Node::Regional(1), 4_000_000_000, 5_500_000_000)]
        );
        assert_eq!(sc.shutdowns()[0].restart_ns, Some(6_000_000_000));
        assert_eq!(sc.shutdowns()[1].restart_ns, None);
        assert_eq!(sc.rule_changes()[0].rate.tokens, 1500);
        // The last to heal: the crash of agent/15 restarts at 15 s; the
        // rule change at 7 s is in force everywhere a TTL_max later.
        assert_eq!(sc.heal_ns(), 15_000_000_000);
        let bad = with(
            "  storms:
    - { at_s: 3, for_s: 40, link: wan, net: { loss: 2 } }
  suspends:
    - { at_s: 4, for_s: 0, node: agent/99 }
  shutdowns:
    - { at_s: 5, node: global }
  rule_changes:
    - { at_s: 7, rule: nope, rate: 5/y, burst: 0 }
  sweep_every_s: 0
",
        );
        let e = Scenario::parse(&bad, "bad.yaml").unwrap_err();
        for want in [
            "bad.yaml: faults.storms[0].for_s: ends at 43 s, after the run",
            "bad.yaml: faults.storms[0].link: must be agent_parent or regional_global",
            "bad.yaml: faults.storms[0].net.loss: must be a probability",
            "bad.yaml: faults.suspends[0].for_s: must be > 0",
            "bad.yaml: faults.suspends[0].node: \"agent/99\" does not exist",
            "bad.yaml: faults.shutdowns[0].node: the global allocator has no graceful shutdown",
            "bad.yaml: faults.rule_changes[0].rule: no rule \"nope\"",
            "bad.yaml: faults.rule_changes[0].rate:",
            "bad.yaml: faults.rule_changes[0].burst: must be >= 1",
            "bad.yaml: faults.sweep_every_s: must be > 0",
        ] {
            assert!(e.contains(want), "missing {want:?} in:\n{e}");
        }
    }

    #[test]
    fn failover_parses_and_errors_name_the_field() {
        let good = format!("{GOOD}failover: {{ lease_ttl_ms: 4000 }}\n");
        let sc = Scenario::parse(&good, "good.yaml").unwrap();
        assert_eq!(
            sc.failover,
            Some(FailoverSpec {
                lease_ttl_ms: 4000,
                election_ms: 50,
                write_lag_ms: 5
            })
        );
        let bad = format!(
            "{}failover: {{ lease_ttl_ms: 1000, election_ms: 20000, write_lag_ms: 5000 }}\n",
            GOOD.replace(
                "    - { at_s: 20, node: global }\n",
                "    - { at_s: 20, node: global, restart_after_s: 1 }\n"
            )
        );
        let e = Scenario::parse(&bad, "bad.yaml").unwrap_err();
        for want in [
            "bad.yaml: failover.lease_ttl_ms: must be 2000..=60000",
            "bad.yaml: failover.election_ms: must be at most 10000",
            "bad.yaml: failover.write_lag_ms: must be at most 1000",
            "bad.yaml: faults.crashes[1].restart_after_s: with failover",
        ] {
            assert!(e.contains(want), "missing {want:?} in:\n{e}");
        }
    }

    #[test]
    fn shipped_scenarios_load() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios");
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .map(|d| d.filter_map(|e| e.ok()).map(|e| e.path()).collect())
            .unwrap_or_default();
        files.retain(|p| p.extension().is_some_and(|x| x == "yaml"));
        files.sort();
        assert!(files.len() >= 7, "scenarios missing in {}", dir.display());
        for f in &files {
            let sc = Scenario::load(f).unwrap_or_else(|e| panic!("{e}"));
            let small = sc.scaled(sc.scale.unwrap_or(0.1));
            assert!(
                small.check().is_empty(),
                "{}: {:?}",
                f.display(),
                small.check()
            );
        }
    }
}

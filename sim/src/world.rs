//! The simulator's event loop: one seed drives a simulated clock and network
//! carrying the real cores — [`AllocatorCore`] for the global allocator,
//! [`RegionalCore`] for regional allocators, and [`Agent`] for the agents
//! (requests through `Agent::step`, as every face of the agent; its sans-IO core pumped through
//! `handle_timeout`, `handle_reply`, `poll_transmit`, `poll_event` and
//! `poll_timeout`, as the tokio driver pumps it). There is no second
//! implementation of the protocol here: this module only moves messages,
//! owns time and watches. Its parts: `replicas.rs` the allocator replicas
//! and etcd when the scenario models failover, `observe.rs` what is
//! watched and summed up, `outcome.rs` what a run returns.
//!
//! Time: the loop runs on true time `t` (ns). Every node reads its own
//! clock, `local(t) = BASE + t + t * drift_ppb / 1e9`, with a drift drawn
//! per node from the scenario's `clock_drift_ppm`. Timers (ticks, fetch
//! timeouts) are scheduled in true time; the drift only changes what the
//! cores read, which is what a drifting crystal does.
//!
//! Faults: cuts and storms live in [`Net`]; crashes, graceful shutdowns
//! (the cores' own `shutdown`), suspends (a sleeping node handles nothing
//! until it wakes, its clock counting on), rule changes (`set_rules` on the
//! global allocator) and housekeeping sweeps are events here.
//!
//! Determinism: events are ordered by (time, insertion number); every map
//! that is iterated is a `BTreeMap` or a `Vec`; random draws come from
//! [`SimRng`] streams forked per purpose. Same seed and build, same bytes.
//!
//! What is checked while it runs:
//! - I1 exactly, over every window, for every key (a [`StreamChecker`] per
//!   key fed with every admission at its true instant);
//! - I2 after every message an allocator handles, for the keys it touched
//!   (I2 can only change at such events: between them, refill is capped at
//!   `B - outstanding` and expiries only lower `outstanding`);
//! - I3 for fail-open keys: the excess against the sum over the emergency
//!   buckets the agents opened of `b_e + r_e * T`;
//! - liveness, when the scenario asks ([`crate::liveness`]), from the
//!   per-second demand and `OK` admissions of the tracked keys.

use std::collections::BTreeMap;
use std::time::Duration;

use quotalease_agent::agent::{Agent, AgentConfig, CheckInput, Parked, Step};
use quotalease_agent::core::Event as CoreEvent;
use quotalease_agent::lease_table::Slot;
use quotalease_agent::renewal::PlanConfig;
use quotalease_allocator::core::{AllocatorCore, CoreConfig};
use quotalease_allocator::regional::{RegionalConfig, RegionalCore};
use quotalease_model::clock::{ClockSource, ManualClock};
use quotalease_model::key::{KeyId, KeyRef};
use quotalease_model::rules::{FailPolicy, Rate, RuleSet};
use quotalease_proto::lease::{LeaseBatch, LeaseReply};
use quotalease_proto::v1::Reason;

use crate::checker::{StreamChecker, Worst};
use crate::failover::{Deposed, Failover};
use crate::liveness::{self, KeyLiveness};
use crate::net::{Net, Node};
use crate::quality::{FalseRejectStream, FalseRejects, KeyQuality, WaitHistogram};
use crate::rng::SimRng;
use crate::scenario::{Scenario, Variant};
use crate::workload::{tenant_name, Arrival, Workload, WorkloadSpec};

/// Origin of every node's clock reading (so that no reading is near 0).
const CLOCK_BASE_NS: u64 = 1_000_000_000_000;
/// How long an agent's renewal task takes to react to a wake-up.
const WAKE_DELAY_NS: u64 = 100_000;
/// Length of a workload slice.
const SLICE_NS: u64 = 1_000_000;
const SEC: u64 = 1_000_000_000;

mod observe;
mod outcome;
mod parked;
mod queue;
mod replicas;

use observe::{check_i2_core, fault_window_ns};
pub use outcome::{worst, KeyStats, Outcome, Tracked};
use parked::ParkedRequests;
use queue::EventQueue;

/// A lease message in flight.
#[derive(Debug)]
enum Msg {
    Batch(LeaseBatch),
    Reply(LeaseReply),
}

#[derive(Debug)]
enum Event {
    /// Renewal tick of an agent or a regional allocator.
    Tick(Node),
    /// A message arrives. `term`: with failover, the epoch of the leader
    /// a message to the global allocator was sent to (0: none known).
    Deliver {
        from: Node,
        to: Node,
        msg: Box<Msg>,
        term: u64,
    },
    /// Failover: the leader of `epoch` sends a keep-alive of its lease.
    KeepAlive(u64),
    /// Failover: if the leader's lease has expired (and the election is
    /// over), a successor takes over.
    Election,
    /// Failover: records of the leader of `epoch` (its core's count `seq`)
    /// are durable in etcd, if that leader is still the current one.
    Durable {
        epoch: u64,
        seq: u64,
        records: Vec<quotalease_allocator::reservations::Record>,
    },
    /// No reply to `seq` within the fetch timeout (`life` = the node's life
    /// when it was sent: a restarted node ignores its predecessor's timers).
    Timeout {
        node: Node,
        seq: u64,
        life: u32,
    },
    /// A parked request re-checks after the fetch timeout.
    Recheck {
        agent: u32,
        park: u64,
        life: u32,
    },
    Crash(Node),
    Restart(Node),
    /// A graceful shutdown: the node releases what it holds, then is down.
    Shutdown(Node),
    /// The node's machine sleeps until the given true time.
    Suspend(Node, u64),
    Resume(Node),
    /// Rule change number `n` of the scenario is published.
    RuleChange(usize),
    /// Housekeeping sweep of every allocator.
    Sweep,
}

/// A node's clock: true time to its own reading.
#[derive(Clone, Copy, Debug)]
struct NodeClock {
    drift_ppb: i64,
}
impl NodeClock {
    #[inline]
    fn local(&self, t: u64) -> u64 {
        if self.drift_ppb == 0 {
            return CLOCK_BASE_NS + t;
        }
        // The same truncating division in 64 bits while the product fits
        // (|drift| <= 1e6 ppb: up to ~290 simulated years).
        if let Some(p) = i64::try_from(t)
            .ok()
            .and_then(|t| t.checked_mul(self.drift_ppb))
        {
            let d = p / 1_000_000_000;
            return (i128::from(CLOCK_BASE_NS) + i128::from(t) + i128::from(d)) as u64;
        }
        let d = (i128::from(t) * i128::from(self.drift_ppb)) / 1_000_000_000;
        (i128::from(CLOCK_BASE_NS) + i128::from(t) + d) as u64
    }

    /// The first true time at which the reading is at least `local`.
    fn global(&self, local: u64) -> u64 {
        let x = i128::from(local) - i128::from(CLOCK_BASE_NS);
        if x <= 0 {
            return 0;
        }
        if self.drift_ppb == 0 {
            return x as u64;
        }
        let mut t = (x * 1_000_000_000 / (1_000_000_000 + i128::from(self.drift_ppb))) as u64;
        while self.local(t) < local {
            t += 1;
        }
        while t > 0 && self.local(t - 1) >= local {
            t -= 1;
        }
        t
    }
}

/// Index of the simulator's per-key records by key, searched with the
/// borrowed [`KeyRef`] of a batch item (no allocation): a fixed-key hash
/// of the key to the first record with that hash, and, for the rare 64-bit
/// hash shared by two keys, the further ones in a second map (one entry a
/// key in the first map: `zipf-100k` keeps 100 000 of them). Only looked
/// up, never iterated, so its order cannot leak into a report.
#[derive(Default)]
struct KeyIndex {
    first: std::collections::HashMap<u64, usize, foldhash::fast::FixedState>,
    more: std::collections::HashMap<u64, Vec<usize>, foldhash::fast::FixedState>,
}

impl KeyIndex {
    fn hash(key: KeyRef<'_>) -> u64 {
        use std::hash::BuildHasher;
        foldhash::fast::FixedState::with_seed(0).hash_one(key)
    }

    fn get(&self, keys: &[KeyStats], key: KeyRef<'_>) -> Option<usize> {
        self.get_hashed(Self::hash(key), |k| keys[k].key.as_key_ref() == key)
    }

    /// Record `k` for `key` (not yet in the index).
    fn insert(&mut self, key: KeyRef<'_>, k: usize) {
        self.insert_hashed(Self::hash(key), k);
    }

    /// The record with hash `h` that `is_it`.
    fn get_hashed(&self, h: u64, is_it: impl Fn(usize) -> bool) -> Option<usize> {
        let k = *self.first.get(&h)?;
        if is_it(k) {
            return Some(k);
        }
        self.more.get(&h)?.iter().copied().find(|&k| is_it(k))
    }

    fn insert_hashed(&mut self, h: u64, k: usize) {
        match self.first.entry(h) {
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(k);
            }
            std::collections::hash_map::Entry::Occupied(_) => {
                self.more.entry(h).or_default().push(k)
            }
        }
    }
}

#[cfg(test)]
mod key_index_tests {
    use super::KeyIndex;

    #[test]
    fn keys_sharing_a_hash_are_all_found() {
        let names = ["a", "b", "c", "d"];
        let mut index = KeyIndex::default();
        // "a", "b" and "c" share hash 7 (a 64-bit collision, forced here).
        index.insert_hashed(7, 0);
        index.insert_hashed(7, 1);
        index.insert_hashed(7, 2);
        index.insert_hashed(9, 3);
        for (k, name) in names.iter().enumerate() {
            let h = if k < 3 { 7 } else { 9 };
            assert_eq!(index.get_hashed(h, |i| names[i] == *name), Some(k));
        }
        assert_eq!(index.get_hashed(7, |i| names[i] == "e"), None);
        assert_eq!(index.get_hashed(8, |_| true), None);
        assert_eq!(
            index.first.len() + index.more.values().map(Vec::len).sum::<usize>(),
            4
        );
    }
}

/// A regional's upstream batch in flight: seq -> batch.
type Awaiting = BTreeMap<u64, LeaseBatch>;

struct AgentNode {
    agent: Option<Agent>,
    clock_cell: ManualClock,
    clock: NodeClock,
    parent: Node,
    region: u16,
    life: u32,
    /// True time of the pending core timer (a `Tick` at another time is
    /// stale).
    timer_at: u64,
    /// Parked requests: park id -> (arrival, the request between its
    /// steps, the key it waits on).
    parked: ParkedRequests,
    /// Suspended until this true time (0: awake).
    asleep_until: u64,
}

struct RegionalNode {
    core: Option<RegionalCore>,
    clock: NodeClock,
    life: u32,
    awaiting: Awaiting,
    /// True time of the pending poll (a `Tick` at another time is stale).
    poll_at: u64,
    /// Suspended until this true time (0: awake).
    asleep_until: u64,
}

struct GlobalNode {
    core: Option<AllocatorCore>,
    clock: NodeClock,
    life: u32,
    /// Suspended until this true time (0: awake).
    asleep_until: u64,
}

/// The simulation of one scenario with one seed.
pub struct World {
    sc: Scenario,
    seed: u64,
    t: u64,
    end: u64,
    queue: EventQueue<Event>,
    net: Net,
    workload: Workload,
    rules: RuleSet,
    global: GlobalNode,
    regionals: Vec<RegionalNode>,
    agents: Vec<AgentNode>,
    next_park: u64,
    /// Per (tenant id, route index): index into `tenant_slots`. Only
    /// looked up, never iterated.
    tenants: std::collections::HashMap<(u32, u16), usize>,
    /// (tenant string, indices into `keys` the requests charge).
    tenant_slots: Vec<(String, Vec<usize>)>,
    keys: Vec<KeyStats>,
    /// Only looked up, never iterated: hash order cannot leak out.
    key_index: KeyIndex,
    checks: u64,
    msgs_agent_tier: u64,
    msgs_regional_tier: u64,
    i2_violations: Vec<String>,
    unavailable: u64,
    waits: WaitHistogram,
    tracked_tenants: std::collections::BTreeSet<u32>,
    fault_window_ns: u64,
    /// Rule changes published so far: (true time, change).
    rule_history: Vec<(u64, RuleChange)>,
    /// The replicas and etcd, when the scenario models failover.
    failover: Option<Failover>,
}

/// A published rule change, as the checkers need it.
#[derive(Clone, Debug)]
struct RuleChange {
    rule: String,
    /// Rate and burst before it.
    old: (Rate, u64),
    rate: Rate,
    burst: u64,
}

impl World {
    /// Build the world for `sc` run as `variant` with `seed`.
    pub fn new(mut sc: Scenario, variant: &Variant, seed: u64) -> Result<World, String> {
        let rules = sc.rules_for(Some(variant));
        variant
            .policy()
            .map_err(|e| format!("variants: {}: {e}", variant.name))?;
        if !variant.name.is_empty() {
            sc.name = format!("{}/{}", sc.name, variant.name);
        }
        let root = SimRng::new(seed);
        let clocks = root.fork(1);
        let draw_clock = |node: Node| NodeClock {
            drift_ppb: (sc.drift_ppm(node, &clocks) * 1000.0) as i64,
        };
        let regions = sc.regions;
        let n_agents = sc.total_agents();
        let global = GlobalNode {
            core: None,
            clock: draw_clock(Node::Global),
            life: 0,
            asleep_until: 0,
        };
        let regionals = (0..regions)
            .map(|r| RegionalNode {
                core: None,
                clock: draw_clock(Node::Regional(r)),
                life: 0,
                awaiting: BTreeMap::new(),
                poll_at: u64::MAX,
                asleep_until: 0,
            })
            .collect();
        let agents = (0..n_agents)
            .map(|i| {
                let region = sc.region_of(i).unwrap_or(0);
                AgentNode {
                    agent: None,
                    clock_cell: ManualClock::new(CLOCK_BASE_NS),
                    clock: draw_clock(Node::Agent(i)),
                    parent: sc.parent_of(i),
                    region,
                    life: 0,
                    timer_at: u64::MAX,
                    parked: ParkedRequests::default(),
                    asleep_until: 0,
                }
            })
            .collect();
        let net = Net::new(sc.net, sc.cuts(), root.fork(2)).with_storms(&sc.storms());
        let workload = Workload::new(&sc.workloads, n_agents, root.fork(3));
        let mut tracked_tenants = std::collections::BTreeSet::new();
        for w in &sc.workloads {
            match w {
                WorkloadSpec::Hot { tenant, .. }
                | WorkloadSpec::FlashCrowd { tenant, .. }
                | WorkloadSpec::Diurnal { tenant, .. } => {
                    tracked_tenants.insert(*tenant);
                }
                WorkloadSpec::Zipf { .. } => {}
            }
        }
        if tracked_tenants.is_empty() {
            tracked_tenants.extend(0..=2);
        }
        let end = sc.duration_ns();
        let fault_window_ns = fault_window_ns(&sc);
        let mut w = World {
            seed,
            t: 0,
            end,
            queue: EventQueue::new(),
            net,
            workload,
            rules,
            global,
            regionals,
            agents,
            next_park: 0,
            tenants: std::collections::HashMap::new(),
            tenant_slots: Vec::new(),
            keys: Vec::new(),
            key_index: KeyIndex::default(),
            checks: 0,
            msgs_agent_tier: 0,
            msgs_regional_tier: 0,
            i2_violations: Vec::new(),
            unavailable: 0,
            waits: WaitHistogram::default(),
            tracked_tenants,
            fault_window_ns,
            rule_history: Vec::new(),
            failover: sc.failover.as_ref().map(Failover::new),
            sc,
        };
        w.boot_global(true);
        for r in 0..regions {
            w.boot_regional(r);
        }
        for a in 0..n_agents {
            w.boot_agent(a);
        }
        for c in w.sc.crashes() {
            w.schedule(c.at_ns, Event::Crash(c.node));
            if let Some(back) = c.restart_ns {
                w.schedule(back, Event::Restart(c.node));
            }
        }
        for c in w.sc.shutdowns() {
            w.schedule(c.at_ns, Event::Shutdown(c.node));
            if let Some(back) = c.restart_ns {
                w.schedule(back, Event::Restart(c.node));
            }
        }
        for (node, from, until) in w.sc.suspends() {
            w.schedule(from, Event::Suspend(node, until));
            w.schedule(until, Event::Resume(node));
        }
        for (i, c) in w.sc.rule_changes().into_iter().enumerate() {
            w.schedule(c.at_ns, Event::RuleChange(i));
        }
        if let Some(every) = w.sc.faults.sweep_every_s {
            w.schedule((every * SEC as f64) as u64, Event::Sweep);
        }
        Ok(w)
    }

    fn schedule(&mut self, t: u64, ev: Event) {
        self.queue.push(t, ev);
    }

    fn renew_interval_ns(&self) -> u64 {
        self.sc.renew_interval_ms * 1_000_000
    }

    fn boot_global(&mut self, first: bool) {
        if let Some(fo) = self.failover.as_mut() {
            // A leader elected (the first, or a successor): its core resumes
            // from the reservations in etcd; its keep-alives start.
            let g = &mut self.global;
            g.life += 1;
            let now = g.clock.local(self.t);
            let core = fo.elect(
                self.t,
                now,
                self.sc.ttl_max_ms * 1_000_000,
                self.rules.clone(),
            );
            g.core = Some(core);
            let (epoch, every, next) = (fo.epoch, fo.cfg.keep_alive_ns, fo.successor_at());
            self.schedule(self.t + every, Event::KeepAlive(epoch));
            self.schedule(next, Event::Election);
            return;
        }
        let g = &mut self.global;
        g.life += 1;
        let now = g.clock.local(self.t);
        let cfg = CoreConfig {
            ttl_max_ns: self.sc.ttl_max_ms * 1_000_000,
            // The very first start has no predecessor; every restart waits.
            no_predecessor: first,
            ..CoreConfig::default()
        };
        let life = u64::from(g.life);
        g.core = Some(AllocatorCore::new(
            cfg,
            self.rules.clone(),
            life,
            life << 40,
            now,
        ));
    }

    fn boot_regional(&mut self, r: u16) {
        let interval = self.renew_interval_ns();
        let node = &mut self.regionals[r as usize];
        node.life += 1;
        node.awaiting.clear();
        let now = node.clock.local(self.t);
        let cfg = RegionalConfig {
            core: CoreConfig {
                ttl_max_ns: self.sc.ttl_max_ms * 1_000_000,
                no_predecessor: true,
                ..CoreConfig::default()
            },
            region: format!("r{r}"),
            renew_interval_ns: interval,
            low_water_ns: self.sc.low_water_ms * 1_000_000,
            fetch_timeout_ns: self.sc.fetch_timeout_ms * 1_000_000,
            lease_ttl_ns: self.sc.lease_ttl_ms * 1_000_000,
            epsilon_ns: 10_000_000,
            // A new process, a new instance (drawn deterministically).
            instance: (u64::from(r) + 1) << 32 | u64::from(node.life),
            rate_leases: self.sc.upstream_rates,
        };
        let life = u64::from(node.life);
        node.core = Some(RegionalCore::new(
            cfg,
            Some(self.rules.clone()),
            life * SEC,
            (u64::from(r) + 1) << 48 | life << 40,
            now,
        ));
        // Stagger the first polls deterministically.
        let first = self.t + (u64::from(r) * 7_919_000) % interval;
        node.poll_at = first;
        self.schedule(first, Event::Tick(Node::Regional(r)));
    }

    fn boot_agent(&mut self, i: u32) {
        let interval = self.renew_interval_ns();
        let sc = &self.sc;
        let node = &mut self.agents[i as usize];
        node.life += 1;
        node.parked.clear();
        node.clock_cell.set(node.clock.local(self.t));
        let cfg = AgentConfig {
            agent_id: format!("agent-{i}"),
            lease_ttl: Duration::from_millis(sc.lease_ttl_ms),
            plan: PlanConfig {
                renew_interval: Duration::from_millis(sc.renew_interval_ms),
                low_water: Duration::from_millis(sc.low_water_ms),
                rate_leases: sc.agent_rates,
                idle_release: Duration::from_millis(sc.idle_release_ms),
                ..PlanConfig::default()
            },
            fetch_timeout: Duration::from_millis(sc.fetch_timeout_ms),
            clock: ClockSource::Manual(node.clock_cell.clone()),
            incarnation: Some(u64::from(node.life)),
            // A new process, a new instance (drawn deterministically).
            instance: Some((u64::from(i) + 1) << 32 | u64::from(node.life)),
            record_emergency: true,
            ..AgentConfig::default()
        };
        let agent = Agent::new(cfg, None, Some(self.rules.clone()))
            .expect("an agent without an admission log cannot fail to start");
        node.agent = Some(agent);
        // Stagger the first ticks deterministically.
        let first = self.t + (u64::from(i) * 104_729) % interval;
        node.timer_at = first;
        self.schedule(first, Event::Tick(Node::Agent(i)));
    }

    /// Run to the end; the outcome with every check's result.
    pub fn run(self) -> Outcome {
        self.run_with_progress(u64::MAX, |_, _| {})
    }

    /// [`World::run`], calling `progress(simulated ns, end ns)` each time
    /// simulated time passes a multiple of `every_ns` (nothing it does can
    /// change the run).
    pub fn run_with_progress(
        mut self,
        every_ns: u64,
        mut progress: impl FnMut(u64, u64),
    ) -> Outcome {
        // Every tier's keys are on this thread: one copy of a key's bytes
        // serves them all (memory only; `zipf-100k` holds 100 000 keys in
        // up to five places each).
        let _shared_keys = KeyId::share_on_this_thread();
        let every_ns = every_ns.max(1);
        let mut next_report = every_ns;
        let mut arrivals: Vec<Arrival> = Vec::new();
        let mut slice_start = 0;
        while slice_start < self.end {
            if slice_start >= next_report {
                progress(slice_start, self.end);
                next_report = next_report.saturating_add(every_ns);
            }
            let slice_end = (slice_start + SLICE_NS).min(self.end);
            arrivals.clear();
            self.workload.fill(slice_start, slice_end, &mut arrivals);
            for a in arrivals.iter().copied() {
                self.run_events_until(a.t_ns);
                self.t = a.t_ns;
                self.arrive(a, None);
            }
            self.run_events_until(slice_end.saturating_sub(1));
            slice_start = slice_end;
        }
        self.finish()
    }

    fn run_events_until(&mut self, until: u64) {
        while let Some((t, ev)) = self.queue.pop_until(until) {
            self.t = t;
            self.handle(ev);
        }
    }

    fn handle(&mut self, ev: Event) {
        // A sleeping machine runs nothing: what would reach or wake it
        // waits until it resumes (its clock, CLOCK_BOOTTIME, kept
        // counting); its own timers are re-armed when it resumes.
        let target = match &ev {
            Event::Tick(n) | Event::Timeout { node: n, .. } => Some(*n),
            Event::Deliver { to, .. } => Some(*to),
            Event::Durable { .. } => Some(Node::Global),
            Event::Recheck { agent, .. } => Some(Node::Agent(*agent)),
            // SIGTERM is handled when the machine wakes (a power loss,
            // `Crash`, is not).
            Event::Shutdown(n) => Some(*n),
            _ => None,
        };
        if let Some(node) = target {
            // A deposed leader's messages and writes wait for its own wake.
            let epoch = match &ev {
                Event::Deliver { term, .. } => *term,
                Event::Durable { epoch, .. } => *epoch,
                _ => 0,
            };
            let until = match self.failover.as_ref().and_then(|f| f.deposed.as_ref()) {
                Some(d) if node == Node::Global && epoch != 0 && d.term.epoch == epoch => {
                    d.asleep_until
                }
                _ => self.asleep_until(node),
            };
            if self.t < until {
                if !matches!(ev, Event::Tick(_)) {
                    self.schedule(until, ev);
                }
                return;
            }
        }
        match ev {
            Event::Tick(node) => self.tick(node),
            Event::Deliver {
                from,
                to,
                msg,
                term,
            } => self.deliver(from, to, *msg, term),
            Event::KeepAlive(epoch) => self.keep_alive(epoch),
            Event::Election => self.election(),
            Event::Durable {
                epoch,
                seq,
                records,
            } => self.durable(epoch, seq, records),
            Event::Timeout { node, seq, life } => self.timeout(node, seq, life),
            Event::Recheck { agent, park, life } => {
                let node = &mut self.agents[agent as usize];
                if node.life != life {
                    return;
                }
                if let Some((a, parked, _)) = node.parked.remove(park) {
                    self.arrive(a, Some(parked));
                }
            }
            Event::Crash(node) => self.crash(node),
            Event::Restart(node) => match node {
                Node::Global => self.boot_global(false),
                Node::Regional(r) => self.boot_regional(r),
                Node::Agent(i) => self.boot_agent(i),
            },
            Event::Shutdown(node) => self.shutdown(node),
            Event::Suspend(node, until) => *self.asleep_mut(node) = until,
            Event::Resume(Node::Global)
                if self
                    .failover
                    .as_ref()
                    .is_some_and(|f| f.deposed.as_ref().is_some_and(|d| d.asleep_until > 0)) =>
            {
                // The deposed leader's machine wakes (its successor runs on
                // another).
                if let Some(d) = self.failover.as_mut().and_then(|f| f.deposed.as_mut()) {
                    d.asleep_until = 0;
                }
            }
            Event::Resume(node) => {
                *self.asleep_mut(node) = 0;
                if node == Node::Global {
                    if let Some(epoch) = self
                        .failover
                        .as_ref()
                        .and_then(|f| f.term.as_ref())
                        .map(|t| t.epoch)
                    {
                        // Its keep-alives go out again at once.
                        self.schedule(self.t, Event::KeepAlive(epoch));
                    }
                }
                // Its timers fire now (they were due while it slept).
                match node {
                    Node::Agent(i) => {
                        self.agents[i as usize].timer_at = self.t;
                        self.tick(node);
                    }
                    Node::Regional(r) => {
                        self.regionals[r as usize].poll_at = self.t;
                        self.tick(node);
                    }
                    Node::Global => {}
                }
            }
            Event::RuleChange(i) => self.change_rule(i),
            Event::Sweep => {
                let t = self.t;
                if let Some(core) = self.global.core.as_mut() {
                    if t >= self.global.asleep_until {
                        core.sweep(self.global.clock.local(t));
                    }
                }
                // The sweep's records (raised floors, keys at rest) are
                // written like any others.
                self.write_records();
                for n in &mut self.regionals {
                    if let Some(core) = n.core.as_mut() {
                        if t >= n.asleep_until {
                            core.core_mut().sweep(n.clock.local(t));
                        }
                    }
                }
                if let Some(every) = self.sc.faults.sweep_every_s {
                    self.schedule(t + (every * SEC as f64) as u64, Event::Sweep);
                }
            }
        }
    }

    fn asleep_until(&self, node: Node) -> u64 {
        match node {
            Node::Global => self.global.asleep_until,
            Node::Regional(r) => self.regionals[r as usize].asleep_until,
            Node::Agent(i) => self.agents[i as usize].asleep_until,
        }
    }

    fn asleep_mut(&mut self, node: Node) -> &mut u64 {
        match node {
            Node::Global => &mut self.global.asleep_until,
            Node::Regional(r) => &mut self.regionals[r as usize].asleep_until,
            Node::Agent(i) => &mut self.agents[i as usize].asleep_until,
        }
    }

    /// A graceful shutdown (SIGTERM), as the drivers do it: the core's
    /// `shutdown` returns the batch that gives back what it holds, sent
    /// once, best effort; then the process is gone (as after a crash).
    fn shutdown(&mut self, node: Node) {
        let t = self.t;
        let (batch, parent) = match node {
            Node::Agent(i) => {
                let n = &mut self.agents[i as usize];
                let Some(agent) = n.agent.as_ref() else {
                    return;
                };
                n.clock_cell.set(n.clock.local(t));
                (agent.core().shutdown(n.clock.local(t)), n.parent)
            }
            Node::Regional(r) => {
                let n = &mut self.regionals[r as usize];
                let Some(core) = n.core.as_mut() else { return };
                (core.shutdown(n.clock.local(t)), Node::Global)
            }
            Node::Global => return,
        };
        if let Some(batch) = batch {
            self.count_message(node, &batch);
            self.transmit(node, parent, Msg::Batch(batch));
        }
        self.crash(node);
    }

    /// Publish rule change `i` of the scenario: the rules in force with
    /// that rule's rate and burst changed, under the next version, handed
    /// to the global allocator as a rules-file reload does (`set_rules`);
    /// agents and regional allocators adopt it from the replies. A node
    /// that boots later starts from it (its rules file on disk). Each
    /// checker of the rule's keys takes the change (SPEC §4's bound).
    fn change_rule(&mut self, i: usize) {
        let Some(c) = self.sc.rule_changes().into_iter().nth(i) else {
            return;
        };
        let mut rules = self.rules.clone();
        rules.version += 1;
        let Some(rule) = rules.rules.iter_mut().find(|r| r.id == c.rule) else {
            return;
        };
        let old = (rule.rate, rule.burst);
        rule.rate = c.rate;
        rule.burst = c.burst;
        self.rules = rules;
        let t = self.t;
        self.rule_history.push((
            t,
            RuleChange {
                old,
                rate: c.rate,
                burst: c.burst,
                rule: c.rule.clone(),
            },
        ));
        if let Some(core) = self.global.core.as_mut() {
            core.set_rules(self.rules.clone(), self.global.clock.local(t));
        }
        let lag = self.sc.rule_change_lag_ns();
        for k in &mut self.keys {
            if k.key.rule() == c.rule {
                k.checker.change(t, lag, c.rate, c.burst);
                k.rate = c.rate;
                k.burst = c.burst;
            }
        }
    }

    fn crash(&mut self, node: Node) {
        match node {
            Node::Global => {
                self.global.core = None;
                self.global.life += 1;
                // With failover: the leader died; its replies waiting for
                // records die with it; the election follows its lease.
                if let Some(t) = self.failover.as_mut().and_then(|f| f.term.as_mut()) {
                    t.held.clear();
                }
            }
            Node::Regional(r) => {
                let n = &mut self.regionals[r as usize];
                n.core = None;
                n.life += 1;
                n.awaiting.clear();
            }
            Node::Agent(i) => {
                let n = &mut self.agents[i as usize];
                n.agent = None;
                n.life += 1;
                n.timer_at = u64::MAX;
                let parked = std::mem::take(&mut n.parked);
                self.unavailable += parked.len() as u64;
            }
        }
    }

    fn tick(&mut self, node: Node) {
        match node {
            Node::Agent(i) => {
                let t = self.t;
                let n = &mut self.agents[i as usize];
                if n.timer_at != t {
                    return; // superseded by an earlier timer
                }
                n.timer_at = u64::MAX;
                let Some(agent) = n.agent.as_ref() else {
                    return;
                };
                let now = n.clock.local(t);
                n.clock_cell.set(now);
                agent.core().handle_timeout(now);
                self.agent_pump(i);
            }
            Node::Regional(r) => {
                if self.regionals[r as usize].poll_at != self.t {
                    return; // superseded by an earlier poll
                }
                self.regionals[r as usize].poll_at = u64::MAX;
                self.regional_poll(r);
            }
            Node::Global => {}
        }
    }

    /// Pump regional `r`'s upstream side, as `upstream::run` does: poll; a
    /// batch goes out and the next poll follows its outcome (reply, or the
    /// core's deadline for it); otherwise sleep until the core's
    /// `poll_timeout` or until a child finds a pool dry. While a heartbeat
    /// is out it polls too: a batch opening a key a child waits for
    /// supersedes it (its reply is then ignored).
    fn regional_poll(&mut self, r: u16) {
        let t = self.t;
        let n = &mut self.regionals[r as usize];
        let Some(core) = n.core.as_mut() else { return };
        if !n.awaiting.is_empty() && !core.heartbeat_in_flight() {
            return; // a batch is out: its reply or timeout polls again
        }
        let now = n.clock.local(t);
        match core.poll_transmit(now) {
            Some(batch) => {
                n.awaiting.clear(); // a heartbeat superseded, if any
                let deadline = core.upstream_deadline().unwrap_or(now);
                let at = n.clock.global(deadline).max(t);
                self.send_batch(Node::Regional(r), Node::Global, batch, at);
            }
            None => {
                let at = n.clock.global(core.poll_timeout(now)).max(t + 1);
                self.regional_wake(r, at);
            }
        }
    }

    /// Make sure regional `r` polls no later than `at`.
    fn regional_wake(&mut self, r: u16, at: u64) {
        let n = &mut self.regionals[r as usize];
        let Some(core) = n.core.as_ref() else { return };
        if (!n.awaiting.is_empty() && !core.heartbeat_in_flight()) || n.poll_at <= at {
            return;
        }
        n.poll_at = at;
        self.schedule(at, Event::Tick(Node::Regional(r)));
    }

    /// Pump agent `i`'s core, as the tokio driver does: send what it
    /// transmits, act on its events (re-check parked requests, note
    /// emergency buckets), and set its timer to `poll_timeout` (a timer due
    /// now fires after the driver's wake-up latency).
    fn agent_pump(&mut self, i: u32) {
        let t = self.t;
        let node = &mut self.agents[i as usize];
        let Some(agent) = node.agent.as_ref() else {
            return;
        };
        let (transmits, events, timeout) = {
            let mut core = agent.core();
            let transmits: Vec<_> = std::iter::from_fn(|| core.poll_transmit()).collect();
            let events: Vec<_> = std::iter::from_fn(|| core.poll_event()).collect();
            (transmits, events, core.poll_timeout())
        };
        let now = node.clock.local(t);
        let parent = node.parent;
        if let Some(at) = timeout {
            let at = if at <= now {
                t + WAKE_DELAY_NS
            } else {
                node.clock.global(at).max(t + 1)
            };
            if at < node.timer_at || node.timer_at < t {
                node.timer_at = at;
                self.schedule(at, Event::Tick(Node::Agent(i)));
            }
        }
        for tx in transmits {
            self.count_message(Node::Agent(i), &tx.batch);
            self.transmit(Node::Agent(i), parent, Msg::Batch(tx.batch));
        }
        let mut settled = Vec::new();
        for ev in events {
            match ev {
                CoreEvent::Settled(slot) => settled.push(slot),
                CoreEvent::EmergencyOpened(e) => {
                    let key = KeyId::new(e.rule_id, e.tenant, e.route);
                    self.note_emergency(&key, e.rate, e.burst);
                }
            }
        }
        if !settled.is_empty() {
            self.recheck_parked(i, &settled);
        }
    }

    fn life_of(&self, node: Node) -> u32 {
        match node {
            Node::Global => self.global.life,
            Node::Regional(r) => self.regionals[r as usize].life,
            Node::Agent(i) => self.agents[i as usize].life,
        }
    }

    fn awaiting(&mut self, node: Node) -> Option<&mut Awaiting> {
        match node {
            Node::Global => None,
            Node::Regional(r) => Some(&mut self.regionals[r as usize].awaiting),
            Node::Agent(_) => None,
        }
    }

    /// Send a batch with a fetch timeout; one retry with the same sequence
    /// number, like the production drivers.
    /// Send a regional's upstream batch; at `timeout_at` (true time) the
    /// core's deadline for it has passed.
    fn send_batch(&mut self, from: Node, to: Node, batch: LeaseBatch, timeout_at: u64) {
        let seq = batch.header.as_ref().map(|h| h.seq).unwrap_or(0);
        self.count_message(from, &batch);
        self.transmit(from, to, Msg::Batch(batch.clone()));
        if let Some(aw) = self.awaiting(from) {
            aw.insert(seq, batch);
        }
        let life = self.life_of(from);
        let at = timeout_at;
        self.schedule(
            at,
            Event::Timeout {
                node: from,
                seq,
                life,
            },
        );
    }

    fn count_message(&mut self, from: Node, batch: &LeaseBatch) {
        let regional_tier = matches!(from, Node::Regional(_));
        if regional_tier {
            self.msgs_regional_tier += 1;
        } else {
            self.msgs_agent_tier += 1;
        }
        for item in &batch.items {
            let key = KeyRef::new(&item.rule_id, &item.tenant, &item.route);
            if let Some(k) = self.key_index.get(&self.keys, key) {
                let ks = &mut self.keys[k];
                if regional_tier {
                    ks.msgs_regional_tier += 1;
                } else {
                    ks.msgs_agent_tier += 1;
                }
            }
        }
    }

    fn transmit(&mut self, from: Node, to: Node, msg: Msg) {
        // Agents and regionals send to the leader they know of.
        let term = match (&self.failover, to) {
            (Some(f), Node::Global) => f.term.as_ref().map_or(0, |t| t.epoch),
            _ => 0,
        };
        let times: Vec<u64> = self.net.deliveries(self.t, from, to).into_iter().collect();
        match times.len() {
            0 => {}
            1 => self.schedule(
                times[0],
                Event::Deliver {
                    from,
                    to,
                    msg: Box::new(msg),
                    term,
                },
            ),
            _ => {
                let copy = match &msg {
                    Msg::Batch(b) => Msg::Batch(b.clone()),
                    Msg::Reply(r) => Msg::Reply(r.clone()),
                };
                self.schedule(
                    times[0],
                    Event::Deliver {
                        from,
                        to,
                        msg: Box::new(msg),
                        term,
                    },
                );
                self.schedule(
                    times[1],
                    Event::Deliver {
                        from,
                        to,
                        msg: Box::new(copy),
                        term,
                    },
                );
            }
        }
    }

    fn timeout(&mut self, node: Node, seq: u64, life: u32) {
        if self.life_of(node) != life {
            return;
        }
        let Some(aw) = self.awaiting(node) else {
            return;
        };
        if aw.remove(&seq).is_none() {
            return;
        }
        let t = self.t;
        if let Node::Regional(r) = node {
            let n = &mut self.regionals[r as usize];
            if let Some(core) = n.core.as_mut() {
                core.handle_timeout(n.clock.local(t));
            }
            self.regional_poll(r);
        }
    }

    fn deliver(&mut self, from: Node, to: Node, msg: Msg, term: u64) {
        let t = self.t;
        match (to, msg) {
            (Node::Global, Msg::Batch(batch)) if self.failover.is_some() => {
                self.deliver_to_replicas(from, batch, term)
            }
            (Node::Global, Msg::Batch(batch)) => {
                let g = &mut self.global;
                let Some(core) = g.core.as_mut() else { return };
                let now = g.clock.local(t);
                let reply = core.handle(now, &batch);
                check_i2_core(core, now, &batch, &mut self.i2_violations, t);
                self.transmit(to, from, Msg::Reply(reply));
            }
            (Node::Regional(r), Msg::Batch(batch)) => {
                let n = &mut self.regionals[r as usize];
                let Some(core) = n.core.as_mut() else { return };
                let now = n.clock.local(t);
                let reply = core.handle(now, &batch);
                if let Err(why) = core.check_i2_batch(now, &batch) {
                    if self.i2_violations.len() < 10 {
                        self.i2_violations
                            .push(format!("region {r} at t={t} ns: {why}"));
                    }
                }
                let wake = RegionalCore::wants_upstream_now(&reply);
                self.transmit(to, from, Msg::Reply(reply));
                if wake {
                    self.regional_wake(r, t);
                }
            }
            (Node::Regional(r), Msg::Reply(reply)) => {
                let n = &mut self.regionals[r as usize];
                let Some(core) = n.core.as_mut() else { return };
                let sent = n.awaiting.remove(&reply.seq);
                let now = n.clock.local(t);
                core.handle_reply(now, &reply);
                // The keys the reply can change are those of its batch.
                let checked = match &sent {
                    Some(batch) => core.check_i2_batch(now, batch),
                    None => Ok(()),
                };
                if let Err(why) = checked {
                    if self.i2_violations.len() < 10 {
                        self.i2_violations.push(format!(
                            "region {r} at t={t} ns after a parent reply: {why}"
                        ));
                    }
                }
                self.regional_poll(r);
            }
            (Node::Agent(i), Msg::Reply(reply)) => {
                let n = &mut self.agents[i as usize];
                let Some(agent) = n.agent.as_ref() else {
                    return;
                };
                let now = n.clock.local(t);
                n.clock_cell.set(now);
                agent.core().handle_reply(now, reply.seq, reply);
                self.agent_pump(i);
            }
            // Agents receive no batches; the global allocator no replies.
            _ => {}
        }
    }

    /// The requests parked on a key that settled re-check (as the tokio
    /// driver wakes only those: a settle of another key is no round of
    /// theirs).
    fn recheck_parked(&mut self, i: u32, settled: &[Slot]) {
        let due = self.agents[i as usize].parked.on(settled);
        for park in due {
            if let Some((a, parked, _)) = self.agents[i as usize].parked.remove(park) {
                self.arrive(a, Some(parked));
            }
        }
    }

    /// A request arrives at its agent, or steps again after parking.
    fn arrive(&mut self, a: Arrival, parked: Option<Parked>) {
        let t = self.t;
        let slot = self.tenant_keys(a.tenant, a.route);
        let node = &mut self.agents[a.agent as usize];
        let Some(agent) = node.agent.as_ref().filter(|_| t >= node.asleep_until) else {
            // The gateway's sidecar is down (or its machine asleep): the
            // gateway fails the request.
            self.unavailable += 1;
            return;
        };
        let now = node.clock.local(t);
        node.clock_cell.set(now);
        let name = &self.tenant_slots[slot].0;
        let input = CheckInput {
            tenant: name,
            route: self.workload.route(a.route),
            cost: a.cost,
            request_id: "",
            domain: None,
        };
        // As every face of the agent does (`Agent::check_by`): a request,
        // stepped; the fast path through a cached handle first.
        let req = match parked {
            Some(p) => Ok(p.resume(input)),
            None => {
                self.checks += 1;
                agent.request(input)
            }
        };
        let step = match req {
            Ok(mut req) => match agent.step(&mut req, now) {
                Step::Wait(w) => Err((req.park(), w)),
                Step::Answer(answer) => Ok(answer),
            },
            Err(invalid) => Ok(Err(invalid)),
        };
        let answer = match step {
            Ok(Ok(resp)) => Ok((
                resp.allowed,
                resp.reason == Reason::FailureModeAllowed as i32,
            )),
            Ok(Err(_)) => {
                self.unavailable += 1;
                Ok((false, false))
            }
            Err(waits) => Err(waits),
        };
        let (allowed, emergency) = match answer {
            Ok(decided) => {
                self.waits.push(t.saturating_sub(a.t_ns));
                decided
            }
            Err((parked, wait)) => {
                self.next_park += 1;
                let park = self.next_park;
                let life = node.life;
                // The step said until when (the agent's clock): as long on
                // the true clock.
                let at = t + wait.until.saturating_sub(now);
                node.parked.insert(park, (a, parked, wait.slot));
                self.schedule(
                    at,
                    Event::Recheck {
                        agent: a.agent,
                        park,
                        life,
                    },
                );
                // The core plans the key now (as the tokio driver is woken).
                self.agent_pump(a.agent);
                return;
            }
        };
        // Emergency buckets opened or keys asked for: pump (a plain denial
        // leaves the core nothing to do).
        if emergency || agent.core().has_output() {
            self.agent_pump(a.agent);
        }
        let region = self.agents[a.agent as usize].region as usize;
        let sec = (t / SEC) as usize;
        let regions = usize::from(self.sc.regions.max(1));
        for &k in &self.tenant_slots[slot].1 {
            let ks = &mut self.keys[k];
            ks.requests += 1;
            ks.per_region_requests[region] += 1;
            let (word, bit) = (a.agent as usize / 64, 1u64 << (a.agent % 64));
            if ks.agents[word] & bit == 0 {
                ks.agents[word] |= bit;
                ks.agent_count += 1;
            }
            if let Some(tr) = ks.tracked.as_mut() {
                tr.quality.push(t, u64::from(a.cost), allowed);
                if tr.live_per_second.len() <= sec {
                    tr.live_per_second.resize(sec + 1, (0, 0));
                }
                let live = &mut tr.live_per_second[sec];
                live.0 += u64::from(a.cost);
                if allowed && !emergency {
                    live.1 += u64::from(a.cost);
                }
            } else if let Some(f) = ks.ideal.as_mut() {
                f.push(t, u64::from(a.cost), allowed);
            }
            if allowed {
                ks.admitted += u64::from(a.cost);
                ks.checker.push(t, u64::from(a.cost));
                if emergency {
                    ks.failure_mode_allowed += u64::from(a.cost);
                }
                if let Some(tr) = ks.tracked.as_mut() {
                    if tr.per_second.len() <= sec {
                        tr.per_second.resize(sec + 1, vec![0; regions]);
                    }
                    tr.per_second[sec][region] += u64::from(a.cost);
                }
            } else {
                ks.denied += 1;
            }
        }
    }
}

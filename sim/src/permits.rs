//! Permits in the simulator (issue 34, docs/permits.md): agents' local
//! semaphores ([`PermitKey`]) asking with the agent's own policy
//! ([`AskPolicy`], the code the tokio driver runs) of one allocator's slot
//! ledger ([`SlotLedger`]) over links with delays, under a hold-time
//! workload: Poisson arrivals per agent whose rates move between agents
//! in phases, lognormal holds, a deadline per acquire, clients renewing
//! while they hold. Discrete events in simulated time; no threads, no
//! sockets.
//!
//! Checked on every event: **I4**, the slots of the permits valid at that
//! instant over every agent, at most `N`. Measured: slots in use while
//! demand (in use and waiting) is at least `N`, time-averaged; the
//! acquire wait at p50 and p99 against an ideal global FIFO semaphore of
//! `N` fed the same arrivals, holds and deadlines; asks (messages to the
//! allocator, each with its reply) per permit.

use std::collections::{BTreeMap, HashMap};

use quotalease_agent::permits::policy::{AskPolicy, TICK_NS};
use quotalease_agent::permits::{AcquireError, Granted, PermitKey, PermitSettings, SentAsk};
use quotalease_allocator::core::TTL_MAX_CAP_NS;
use quotalease_allocator::slots::chain::{
    ChainChange, ChainTimes, ParentSlotAsk, ParentSlotGrant, SlotChain, FENCES_PER_PARENT_GRANT,
};
use quotalease_allocator::slots::{SlotAsk, SlotLedger};

use quotalease_model::protocol::RHO_PPM;

use crate::rng::SimRng;

const MS: u64 = 1_000_000;

/// A permit workload and topology.
#[derive(Clone, Debug)]
pub struct PermitSimConfig {
    /// Seed of the arrivals and holds.
    pub seed: u64,
    /// The rule's `concurrency`.
    pub n: u64,
    /// One-way delay from each agent to the allocator (ns); one agent each.
    pub delays_ns: Vec<u64>,
    /// Phases: (length ns, arrivals per second at each agent).
    pub phases: Vec<(u64, Vec<f64>)>,
    /// Median hold (ns) and the spread of its logarithm.
    pub hold_median_ns: u64,
    /// See `hold_median_ns`.
    pub hold_sigma: f64,
    /// How long an acquire waits at most.
    pub wait_ns: u64,
    /// The allocator's `TTL_max` (slot leases last at most this).
    pub ttl_max_ns: u64,
    /// A client renews its permit this often while it holds it.
    pub renew_every_ns: u64,
    /// Faults (none by default).
    pub faults: PermitFaults,
    /// Regional allocators between the agents and the allocator (`None`:
    /// the agents ask the allocator).
    pub regions: Option<PermitRegions>,
    /// The `WaitSlots` wake-ups (docs/permits.md "Slots follow demand"),
    /// as the agents and regionals use them; off: the lease protocol's
    /// polling alone.
    pub wakeups: bool,
    /// Grants carry the holder's max-min share while some holder misses
    /// slots, and holders above it give back as permits end
    /// (docs/permits.md "Max-min on what is held"); off: as before
    /// session 33, max-min shapes fresh slots only.
    pub shares: bool,
    /// A restarted regional resumes its predecessor's parent slot leases
    /// and its agents adopt theirs (`--experimental-regional-resume`,
    /// docs/permits.md "A regional restart"); off: their permits end at
    /// their use-by.
    pub region_resume: bool,
    /// What a long-poll *grant* could give at best (docs/permits.md "Wait
    /// tail"), not a protocol we run: a wake-up answered because slots
    /// came free is answered at once and the ask it triggers reaches the
    /// lender at that instant, so the slots go out the moment they are
    /// free and reach the waiter one way later (as if the wake-up had
    /// carried the grant). Off: the wake-up's answer and the ask travel.
    pub grant_on_wake: bool,
}

pub mod scenario;
pub mod swarm;

/// How long a wake-up waits at its allocator at most (4/5 of the
/// agents' fetch timeout, as the driver asks).
const WAKE_WAIT_NS: u64 = 200 * MS;

/// After a wake-up the allocator did not serve, none for this long.
const WAKE_BACKOFF_NS: u64 = 1_000 * MS;

/// Who waits for a wake-up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Waker {
    Agent { a: usize, inc: u32 },
    Region { r: usize },
}

/// Where a wake-up waits: a regional's pool, or the allocator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Lender {
    Pool(usize),
    Global,
}

/// A wake-up waiting at its lender.
#[derive(Clone, Copy, Debug)]
struct WakeWait {
    lender: Lender,
    who: Waker,
    room: bool,
    contended: bool,
    /// The lender's free slots when it arrived (it answers when they grow).
    room0: u64,
    until: u64,
}

/// Regional allocators in a permit run: each lends its agents the slots
/// of one parent slot lease with the regional's own code
/// ([`SlotChain`] over a pool, `allocator-core/src/slots/chain.rs`).
#[derive(Clone, Debug, Default)]
pub struct PermitRegions {
    /// The region of each agent; the agents' `delays_ns` are then to
    /// their regional.
    pub agent_region: Vec<usize>,
    /// One-way delay from each regional to the allocator (ns).
    pub delays_ns: Vec<u64>,
    /// Region `.2` is cut from the allocator over `[.0, .1)`: every
    /// message between them is lost.
    pub cuts: Vec<(u64, u64, usize)>,
}

/// Faults of a permit run.
#[derive(Clone, Debug, Default)]
pub struct PermitFaults {
    /// Each ask, and each reply, is lost with this probability (the
    /// agent gives up on it after its fetch timeout, 250 ms, and asks
    /// again; the promise of the lost ask stands).
    pub loss: f64,
    /// The allocator crashes and restarts at once at these instants: a
    /// new ledger whose phantom holds all `N` for the restart wait and
    /// adopts the leases agents' asks name.
    pub restarts_ns: Vec<u64>,
    /// Agent `.1` crashes at `.0` and starts again at once, empty: its
    /// clients' permits go on counting until their expiries (they do not
    /// know), its waiters are gone.
    pub crashes: Vec<(u64, usize)>,
    /// Regional `.1` crashes at `.0` and a new process starts at once: its
    /// pool, chain and reply cache are gone; its agents keep their leases
    /// and renew them with the new one, which resumes its parent slot
    /// lease (docs/permits.md "A regional restart").
    pub region_restarts: Vec<(u64, usize)>,
}

/// The shortest stall a run reports (see [`PermitReport::stalls`]): with
/// round trips under 100 ms, a tick of 50 ms and slot leases of at most
/// 2 s, no grant for this long while a waiter is beside a free slot means
/// the slots are stuck.
pub const STALL_NS: u64 = 2_000 * MS;

/// How long a regional waits for its parent's reply (its default
/// `fetch_timeout`) before it sends the batch again.
const REGION_FETCH_TIMEOUT_NS: u64 = 500 * MS;

/// The regionals' settings for their parent slot leases (their defaults:
/// renew interval, low water, epsilon).
const REGION_TIMES: ChainTimes = ChainTimes {
    tick_ns: 50 * MS,
    low_water_ns: 500 * MS,
    epsilon_ns: 50 * MS,
};

/// How long an agent waits for a reply before it asks again (the
/// driver's default fetch timeout).
const FETCH_TIMEOUT_NS: u64 = 250 * MS;

/// Times an agent sends an unanswered ask's batch again (the driver's
/// `BATCH_RETRIES`).
const RETRIES: u32 = quotalease_agent::permit_driver::BATCH_RETRIES;

impl PermitSimConfig {
    /// The shape the issue asks about: `N` = 32, three agents 15, 25 and
    /// 40 ms from the allocator (round trips 30-80 ms), holds of median
    /// 200 ms (spread 0.8), offered load `load` x `N` (arrival rate x mean
    /// hold) moving between the agents every 10 s (even, then most at
    /// agent 0, then most at agent 2), 30 s in all.
    pub fn shape(seed: u64, load: f64) -> Self {
        let n = 32u64;
        let median = 200 * MS;
        let sigma = 0.8f64;
        let mean_hold_s = median as f64 / 1e9 * (sigma * sigma / 2.0).exp();
        let total = load * n as f64 / mean_hold_s;
        let split = |w: [f64; 3]| w.iter().map(|x| x * total).collect::<Vec<_>>();
        Self {
            seed,
            n,
            delays_ns: vec![15 * MS, 25 * MS, 40 * MS],
            phases: vec![
                (10_000 * MS, split([1.0 / 3.0, 1.0 / 3.0, 1.0 / 3.0])),
                (10_000 * MS, split([0.8, 0.1, 0.1])),
                (10_000 * MS, split([0.1, 0.1, 0.8])),
            ],
            hold_median_ns: median,
            hold_sigma: sigma,
            wait_ns: 5_000 * MS,
            ttl_max_ns: 2_000 * MS,
            renew_every_ns: 250 * MS,
            faults: PermitFaults::default(),
            regions: None,
            wakeups: true,
            shares: true,
            region_resume: false,
            grant_on_wake: false,
        }
    }

    /// [`PermitSimConfig::shape`] through regional allocators: three
    /// regions 15, 25 and 40 ms from the allocator (round trips 30-80 ms,
    /// the figure), two agents in each 1 ms from their regional,
    /// the load moving between the regions every 10 s (even, then most in
    /// the first region, then most in the third).
    pub fn regions_shape(seed: u64, load: f64) -> Self {
        let mut c = Self::shape(seed, load);
        let total: f64 = c.phases[0].1.iter().sum();
        let split = |w: [f64; 3]| {
            w.iter()
                .flat_map(|x| [x * total / 2.0, x * total / 2.0])
                .collect::<Vec<_>>()
        };
        c.delays_ns = vec![MS; 6];
        c.phases = vec![
            (10_000 * MS, split([1.0 / 3.0, 1.0 / 3.0, 1.0 / 3.0])),
            (10_000 * MS, split([0.8, 0.1, 0.1])),
            (10_000 * MS, split([0.1, 0.1, 0.8])),
        ];
        c.regions = Some(PermitRegions {
            agent_region: vec![0, 0, 1, 1, 2, 2],
            delays_ns: vec![15 * MS, 25 * MS, 40 * MS],
            cuts: Vec::new(),
        });
        c
    }
}

/// What a run measured.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PermitReport {
    /// Permits granted.
    pub permits: u64,
    /// Acquires whose deadline passed.
    pub timeouts: u64,
    /// Acquires offered at each agent.
    pub arrivals_by_agent: Vec<u64>,
    /// Acquires that reached their deadline waiting, at each agent (an
    /// ideal global semaphore serves in arrival order whatever the agent,
    /// so its timeouts fall on the agents as their arrivals do).
    pub timeouts_by_agent: Vec<u64>,
    /// Permits that expired while their client still held them (a renew
    /// answered expired): should be none.
    pub lost: u64,
    /// The most slots of valid permits at one instant (I4: at most `N`).
    pub max_held: u64,
    /// Slots in use over `N`, time-averaged over the instants when demand
    /// (in use and waiting) was at least `N`.
    pub saturated_use: f64,
    /// Simulated seconds with demand at least `N`.
    pub saturated_s: f64,
    /// Acquire waits of granted permits: p50 and p99 (ns).
    pub wait_p50_ns: u64,
    /// See `wait_p50_ns`.
    pub wait_p99_ns: u64,
    /// The same for an ideal global FIFO semaphore of `N`.
    pub ideal_p50_ns: u64,
    /// See `ideal_p50_ns`.
    pub ideal_p99_ns: u64,
    /// Its timeouts.
    pub ideal_timeouts: u64,
    /// Asks sent to the allocator (each a message and its reply).
    pub asks: u64,
    /// Asks or replies lost (faults).
    pub lost_messages: u64,
    /// Permits whose agent crashed under them (they counted on until
    /// their expiries).
    pub orphaned: u64,
    /// Unanswered asks sent again (the same batch).
    pub retries: u64,
    /// With regions: slot asks from the regionals to the allocator, those
    /// sent again, parent slot leases that broke and that lapsed.
    pub region_asks: u64,
    /// See `region_asks`.
    pub region_retries: u64,
    /// See `region_asks`.
    pub region_breaks: u64,
    /// See `region_asks`.
    pub region_lapses: u64,
    /// Regional restarts, the slots their resumes kept of the
    /// predecessors' parent leases, and the agents' asks answered
    /// `RESUMING` meanwhile.
    pub region_restarts: u64,
    /// See `region_restarts`.
    pub slots_resumed: u64,
    /// See `region_restarts`.
    pub resume_waits: u64,
    /// Wake-ups sent (agents' and regionals'), and those answered with
    /// room or contention.
    pub wakeups: u64,
    /// See `wakeups`.
    pub wakeups_answered: u64,
    /// The first instant I4 was broken, if it was (the run stopped there).
    pub i4_broken: Option<String>,
    /// When the last permit was granted (ns).
    pub last_permit_ns: u64,
    /// When each acquire arrived, and when each permit was granted (ns),
    /// in time order (for liveness after faults).
    pub arrivals_ns: Vec<u64>,
    /// See `arrivals_ns`.
    pub grants_ns: Vec<u64>,
    /// When the ideal global semaphore granted each permit it granted (ns,
    /// in time order).
    pub ideal_grants_ns: Vec<u64>,
    /// Stretches of at least [`STALL_NS`] in which acquires waited while
    /// fewer than `N` slots were held by valid permits and none was
    /// granted: (from, length) ns.
    pub stalls: Vec<(u64, u64)>,
    /// For each acquire that timed out: the retry hint its agent gave
    /// (`PermitKey::retry_hint_ns`) and how long after the timeout that
    /// agent had started as many permits as were queued up to the
    /// acquire's place (when it stayed, it would have been served by
    /// then; `None`: not before the run ended or the agent crashed).
    pub retry_hints: Vec<(u64, Option<u64>)>,
}

impl PermitReport {
    /// Asks per permit granted.
    pub fn asks_per_permit(&self) -> f64 {
        self.asks as f64 / self.permits.max(1) as f64
    }

    /// The largest fraction of one agent's acquires that timed out (an
    /// agent starved of slots shows here; an ideal global semaphore times
    /// out every agent's acquires alike).
    pub fn worst_agent_timeouts(&self) -> f64 {
        self.timeouts_by_agent
            .iter()
            .zip(&self.arrivals_by_agent)
            .map(|(&t, &a)| t as f64 / a.max(1) as f64)
            .fold(0.0, f64::max)
    }
}

/// What happens at an instant.
#[derive(Clone, Copy, Debug)]
enum Ev {
    Arrival {
        a: usize,
    },
    Tick {
        a: usize,
    },
    Deadline {
        a: usize,
        inc: u32,
        waiter: u64,
    },
    Renew {
        a: usize,
        inc: u32,
        id: u64,
    },
    Release {
        a: usize,
        inc: u32,
        id: u64,
    },
    AskArrives {
        a: usize,
        inc: u32,
        sent: SentAsk,
        lost_reply: bool,
    },
    /// The agent's fetch timeout for the ask `seq`: it sends the same
    /// batch again (the allocator's reply cache answers a copy that
    /// already arrived with the grant it made), up to [`RETRIES`] times,
    /// then gives up and asks anew.
    Reply {
        a: usize,
        inc: u32,
        sent: SentAsk,
        g: Granted,
        contended: bool,
        holders: u32,
    },
    GiveUp {
        a: usize,
        inc: u32,
        sent: SentAsk,
        tries: u32,
    },
    Restart,
    Crash {
        a: usize,
    },
    RegionRestart {
        r: usize,
    },
    /// A regional that restarted answered agent `a`'s ask `RESUMING`:
    /// nothing applied.
    NotApplied {
        a: usize,
        inc: u32,
        seq: u64,
    },
    /// A regional looks at its parent slot lease (every tick, and at once
    /// when a child missed slots).
    RegionTick {
        r: usize,
        periodic: bool,
    },
    /// A regional's ask reaches the allocator.
    RegionAsk {
        r: usize,
        seq: u64,
        ask: ParentSlotAsk,
        lost_reply: bool,
    },
    RegionReply {
        r: usize,
        seq: u64,
        g: ParentSlotGrant,
    },
    /// The regional's fetch timeout for its ask `seq`.
    RegionGiveUp {
        r: usize,
        seq: u64,
        tries: u32,
    },
    /// A wake-up reaches its lender.
    WakeArrives {
        lender: Lender,
        who: Waker,
        room: bool,
        contended: bool,
    },
    /// A wake-up's wait is over: its lender looks (and answers).
    WakeLook,
    /// A wake-up's answer reaches who waited (`served`: the lender
    /// answered it).
    WakeAnswer {
        who: Waker,
        served: bool,
        room: bool,
        contended: bool,
    },
}

/// A regional allocator of a permit run: its parent slot lease and pool.
struct Regional {
    chain: SlotChain,
    pool: SlotLedger,
    /// The ask in flight: its sequence number and what it asked.
    asking: Option<(u64, ParentSlotAsk)>,
    seq: u64,
    /// See [`Agent::instant_at`].
    instant_at: Option<u64>,
}

struct Agent {
    pk: PermitKey,
    policy: AskPolicy,
    /// Its incarnation (events of an earlier one are dropped).
    inc: u32,
    /// The ask in flight, by sequence number.
    asking: Option<u64>,
    /// Waiters: id -> (arrival, hold).
    waiters: HashMap<u64, (u64, u64)>,
    /// Permits held: id -> release time.
    held: HashMap<u64, u64>,
    /// A wake-up is out, or none before this.
    waking: bool,
    wake_after: u64,
    /// [`PermitSimConfig::grant_on_wake`]: an ask sent at this instant
    /// reaches the lender at once.
    instant_at: Option<u64>,
}

impl Agent {
    /// Grant waiters (agent `a`) the slots now free: each waiter's wait is
    /// recorded and its permit starts (held until its hold ends).
    fn serve(
        &mut self,
        now: u64,
        a: usize,
        waits: &mut Vec<u64>,
        started: &mut Vec<(usize, u64, u64)>,
    ) {
        for (w, p) in self.pk.serve_waiters(now) {
            let (arrived, h) = self.waiters.remove(&w).expect("a waiter");
            waits.push(now - arrived);
            started.push((a, p.id, now + h));
        }
    }
}

/// Run `cfg` to its end.
pub fn run(cfg: &PermitSimConfig) -> PermitReport {
    let settings = PermitSettings {
        n: cfg.n,
        permit_ttl_ns: 10_000 * MS,
        max_hold_ns: 1_800_000 * MS,
        lease_ttl_ns: 10_000 * MS,
        epsilon_ns: 10 * MS,
    };
    let ttl_max = cfg.ttl_max_ns.min(TTL_MAX_CAP_NS);
    let fresh_agent = |inc: u32| Agent {
        pk: PermitKey::new(settings),
        policy: AskPolicy::new(settings.lease_ttl_ns),
        inc,
        asking: None,
        waiters: HashMap::new(),
        held: HashMap::new(),
        waking: false,
        wake_after: 0,
        instant_at: None,
    };
    let mut agents: Vec<Agent> = cfg.delays_ns.iter().map(|_| fresh_agent(0)).collect();
    let end: u64 = cfg.phases.iter().map(|p| p.0).sum();
    let rate_at = |a: usize, t: u64| {
        let mut from = 0;
        for (len, rates) in &cfg.phases {
            if t < from + len {
                return rates.get(a).copied().unwrap_or(0.0);
            }
            from += len;
        }
        0.0
    };
    let max_rate: Vec<f64> = (0..agents.len())
        .map(|a| {
            cfg.phases
                .iter()
                .map(|p| p.1.get(a).copied().unwrap_or(0.0))
                .fold(1e-9, f64::max)
        })
        .collect();
    let rng = SimRng::new(cfg.seed);
    let mut arrivals_rng: Vec<SimRng> = (0..agents.len()).map(|a| rng.fork(a as u64 + 1)).collect();
    let mut holds_rng = rng.fork(100);
    let mut faults_rng = rng.fork(200);
    let mut hold = || {
        let x = cfg.hold_median_ns as f64 * (cfg.hold_sigma * holds_rng.normal()).exp();
        (x as u64).max(1)
    };
    let mut ledger = SlotLedger::new(cfg.n, 1 << 32);
    let mut q = Queue::default();
    let no_regions = PermitRegions::default();
    let regions = cfg.regions.as_ref().unwrap_or(&no_regions);
    // A regional's process: a pool whose children may name leases of a
    // predecessor (ids below `own_ids_from`) until its chain resumed.
    let regional = |own_ids_from: u64, seq: u64| {
        let mut pool = SlotLedger::new_pool(0);
        if cfg.region_resume {
            pool.await_resume(own_ids_from);
        }
        Regional {
            chain: SlotChain::default(),
            pool,
            asking: None,
            seq,
            instant_at: None,
        }
    };
    let mut regionals: Vec<Regional> = regions.delays_ns.iter().map(|_| regional(1, 0)).collect();
    for r in 0..regionals.len() {
        q.post(r as u64 * 11 * MS, Ev::RegionTick { r, periodic: true });
    }
    // Wake-ups waiting at their lenders.
    let mut wake_waits: Vec<WakeWait> = Vec::new();
    // The allocator's reply cache for the regionals: (region, seq) -> answer.
    let mut region_replies: HashMap<(usize, u64), ParentSlotGrant> = HashMap::new();
    let cut = |r: usize, t: u64| {
        regions
            .cuts
            .iter()
            .any(|&(from, to, c)| c == r && from <= t && t < to)
    };
    for a in 0..agents.len() {
        q.post(a as u64 * 7 * MS, Ev::Tick { a });
        q.post(0, Ev::Arrival { a });
    }
    for &t in &cfg.faults.restarts_ns {
        q.post(t, Ev::Restart);
    }
    for &(t, a) in &cfg.faults.crashes {
        q.post(t, Ev::Crash { a });
    }
    for &(t, r) in &cfg.faults.region_restarts {
        if r < regionals.len() {
            q.post(t, Ev::RegionRestart { r });
        }
    }
    let mut r = PermitReport {
        arrivals_by_agent: vec![0; cfg.delays_ns.len()],
        timeouts_by_agent: vec![0; cfg.delays_ns.len()],
        ..PermitReport::default()
    };
    let mut waits = Vec::new();
    // Timeouts (agent, incarnation, when, slots queued up to its place,
    // hint), and each agent incarnation's permit starts, for the hints'
    // check.
    let mut timed_out: Vec<(usize, u32, u64, u64, u64)> = Vec::new();
    let mut starts: HashMap<(usize, u32), Vec<u64>> = HashMap::new();
    // For the ideal semaphore: every arrival (time, hold).
    let mut offered: Vec<(u64, u64)> = Vec::new();
    // Permits of crashed agents: (slots, expiry); their clients hold them.
    let mut orphans: Vec<(u64, u64)> = Vec::new();
    let mut next_lease = 1u64;
    let mut restarts = 0u64;
    // The allocator's reply cache: (agent, incarnation, ask) -> answer.
    let mut replies: HashMap<(usize, u32, u64), (Granted, bool, u32)> = HashMap::new();
    let (mut last_t, mut busy_area, mut busy_ns) = (0u64, 0.0f64, 0u64);
    let mut stall_from: Option<u64> = None;
    while let Some((now, ev)) = q.next() {
        if now > end + cfg.wait_ns + 10_000 * MS {
            break;
        }
        // Demand and use over [last_t, now), as they stood.
        {
            let (mut used, mut waiting) = (0u64, 0u64);
            for ag in &mut agents {
                used += ag.pk.permits(last_t).iter().map(|p| p.slots).sum::<u64>();
                waiting += ag.pk.waiting_slots();
            }
            if used + waiting >= cfg.n && now > last_t && last_t < end {
                let dt = now.min(end) - last_t;
                busy_area += used as f64 * dt as f64;
                busy_ns += dt;
            }
            // A stall: acquires wait while fewer than `N` slots are in use
            // (crashed agents' permits counted) and none is granted.
            let orphaned: u64 = orphans.iter().filter(|o| o.1 > last_t).map(|o| o.0).sum();
            if waiting > 0 && used + orphaned < cfg.n {
                stall_from.get_or_insert(last_t);
            } else if let Some(from) = stall_from.take() {
                if now - from >= STALL_NS {
                    r.stalls.push((from, now - from));
                }
            }
            last_t = now;
        }
        let mut started: Vec<(usize, u64, u64)> = Vec::new();
        let mut ask_now: Option<usize> = None;
        match ev {
            Ev::Arrival { a } => {
                // Poisson arrivals at a rate that changes by phase, by
                // thinning: candidates at the agent's highest rate, each
                // kept with probability rate now / highest rate.
                let rng = &mut arrivals_rng[a];
                let next = now + rng.exp_ns(1e9 / max_rate[a]);
                if next < end {
                    q.post(next, Ev::Arrival { a });
                }
                if rng.unit_f64() * max_rate[a] < rate_at(a, now) {
                    let h = hold();
                    offered.push((now, h));
                    r.arrivals_ns.push(now);
                    r.arrivals_by_agent[a] += 1;
                    let ag = &mut agents[a];
                    match ag.pk.acquire(now, 1) {
                        Ok(p) => {
                            waits.push(0);
                            started.push((a, p.id, now + h));
                        }
                        Err(AcquireError::Queued(w)) => {
                            ag.waiters.insert(w, (now, h));
                            let inc = ag.inc;
                            q.post(now + cfg.wait_ns, Ev::Deadline { a, inc, waiter: w });
                            ask_now = Some(a);
                        }
                        Err(AcquireError::Invalid) => unreachable!("one slot of N >= 1"),
                    }
                }
            }
            Ev::Tick { a } => {
                q.post(now + TICK_NS, Ev::Tick { a });
                ask_now = Some(a);
            }
            Ev::Deadline { a, inc, waiter } => {
                let ag = &mut agents[a];
                if ag.inc == inc && ag.waiters.remove(&waiter).is_some() {
                    let places = ag.pk.queued_up_to(waiter);
                    timed_out.push((a, inc, now, places, ag.pk.retry_hint_ns(now, waiter)));
                    ag.pk.cancel(waiter);
                    r.timeouts += 1;
                    r.timeouts_by_agent[a] += 1;
                }
            }
            Ev::Renew { a, inc, id } => {
                let ag = &mut agents[a];
                if ag.inc == inc && ag.held.contains_key(&id) {
                    if ag.pk.renew(now, id).is_err() {
                        ag.held.remove(&id);
                        r.lost += 1;
                    } else {
                        q.post(now + cfg.renew_every_ns, Ev::Renew { a, inc, id });
                    }
                }
            }
            Ev::Release { a, inc, id } => {
                let ag = &mut agents[a];
                if ag.inc == inc && ag.held.remove(&id).is_some() {
                    ag.pk.release(now, id);
                    ag.serve(now, a, &mut waits, &mut started);
                    ask_now = Some(a);
                }
            }
            Ev::AskArrives {
                a,
                inc,
                sent,
                lost_reply,
            } => {
                // The reply cache: a copy of a batch already applied (by
                // this allocator: a restart empties it) gets the same
                // answer.
                let cached = replies.get(&(a, inc, sent.seq)).copied();
                let region = regions.agent_region.get(a).copied();
                if cached.is_none()
                    && region.is_some_and(|rg| regionals[rg].pool.needs_resume(sent.lease_id))
                {
                    // A restarted regional before its resume: nothing
                    // applied (`RESUMING`); its upstream side looks at once.
                    r.resume_waits += 1;
                    let rg = region.expect("checked");
                    q.post(
                        now,
                        Ev::RegionTick {
                            r: rg,
                            periodic: false,
                        },
                    );
                    if !lost_reply {
                        q.post(
                            now + cfg.delays_ns[a],
                            Ev::NotApplied {
                                a,
                                inc,
                                seq: sent.seq,
                            },
                        );
                    }
                    continue;
                }
                let (granted, contended, holders) = match cached {
                    Some(c) => c,
                    None => {
                        let id = next_lease;
                        next_lease += 1;
                        // The agent's allocator: its regional's pool, or
                        // the allocator's ledger.
                        let lender = match region {
                            Some(rg) => &mut regionals[rg].pool,
                            None => &mut ledger,
                        };
                        let g = lender.ask(
                            now,
                            SlotAsk {
                                holder: (inc << 8) | a as u32,
                                lease_id: sent.lease_id,
                                keep: sent.keep,
                                want: sent.want,
                                ttl_ns: settings.lease_ttl_ns.min(ttl_max),
                                new_id: id,
                                ..SlotAsk::default()
                            },
                        );
                        let granted = Granted {
                            lease_id: g.lease_id,
                            slots: g.slots,
                            kept: g.kept,
                            fence: g.fence,
                            over: g.over,
                            ttl_ns: g.expires_ns.saturating_sub(now),
                            share: g.share.filter(|_| cfg.shares),
                        };
                        let holders = lender.holders();
                        if let Some(rg) = region.filter(|_| g.fresh < sent.want) {
                            // The regional's upstream side looks at once.
                            q.post(
                                now,
                                Ev::RegionTick {
                                    r: rg,
                                    periodic: false,
                                },
                            );
                        }
                        replies.insert((a, inc, sent.seq), (granted, g.contended, holders));
                        (granted, g.contended, holders)
                    }
                };
                if lost_reply {
                    r.lost_messages += 1;
                } else {
                    q.post(
                        now + cfg.delays_ns[a],
                        Ev::Reply {
                            a,
                            inc,
                            sent,
                            g: granted,
                            contended,
                            holders,
                        },
                    );
                }
            }
            Ev::Reply {
                a,
                inc,
                sent,
                g,
                contended,
                holders,
            } => {
                let ag = &mut agents[a];
                // A reply after the agent gave up is dropped, as the
                // driver's timed-out call drops it.
                if ag.inc == inc && ag.asking == Some(sent.seq) {
                    ag.asking = None;
                    ag.policy
                        .on_grant(&mut ag.pk, now, sent, g, contended, holders);
                    ag.serve(now, a, &mut waits, &mut started);
                    ask_now = Some(a);
                }
            }
            Ev::GiveUp {
                a,
                inc,
                sent,
                tries,
            } => {
                let ag = &mut agents[a];
                if ag.inc == inc && ag.asking == Some(sent.seq) {
                    if tries < RETRIES {
                        r.retries += 1;
                        q.send(
                            now,
                            &mut faults_rng,
                            cfg,
                            &mut r,
                            (a, inc),
                            sent,
                            (tries + 1, false),
                        );
                    } else {
                        ag.asking = None;
                        ag.policy.not_answered();
                    }
                }
            }
            Ev::Restart => {
                restarts += 1;
                // The allocator's reply cache (the agents' is their
                // regional's when there are regions).
                if regionals.is_empty() {
                    replies.clear();
                }
                region_replies.clear();
                // Wake-ups waiting at the allocator die with it: their
                // calls fail.
                wake_waits.retain(|w| {
                    if w.lender == Lender::Global {
                        let back = match w.who {
                            Waker::Agent { a, .. } => cfg.delays_ns[a],
                            Waker::Region { r: rg } => regions.delays_ns[rg],
                        };
                        q.post(
                            now + back,
                            Ev::WakeAnswer {
                                who: w.who,
                                served: false,
                                room: false,
                                contended: false,
                            },
                        );
                        false
                    } else {
                        true
                    }
                });
                let wait = ttl_max + ttl_max * 2 * RHO_PPM / 1_000_000 + settings.epsilon_ns + 1;
                ledger =
                    SlotLedger::after_restart(cfg.n, (restarts + 1) << 32, now + wait, next_lease);
            }
            Ev::NotApplied { a, inc, seq } => {
                let ag = &mut agents[a];
                if ag.inc == inc && ag.asking == Some(seq) {
                    // As the driver: the lease stands; asked again on the
                    // next tick.
                    ag.asking = None;
                    ag.policy.not_answered();
                }
            }
            Ev::RegionRestart { r: rg } => {
                r.region_restarts += 1;
                // Its sequence numbers go on (the parent's reply cache of
                // the old process is then never hit); its children's reply
                // cache is gone.
                let seq = regionals[rg].seq;
                regionals[rg] = regional(next_lease, seq);
                replies.retain(|&(a, _, _), _| regions.agent_region.get(a) != Some(&rg));
                // Wake-ups waiting at its pool fail.
                wake_waits.retain(|w| {
                    if let (Lender::Pool(p), Waker::Agent { a, .. }) = (w.lender, w.who) {
                        if p == rg {
                            q.post(
                                now + cfg.delays_ns[a],
                                Ev::WakeAnswer {
                                    who: w.who,
                                    served: false,
                                    room: false,
                                    contended: false,
                                },
                            );
                            return false;
                        }
                    }
                    true
                });
                q.post(
                    now,
                    Ev::RegionTick {
                        r: rg,
                        periodic: false,
                    },
                );
            }
            Ev::Crash { a } => {
                let ag = &mut agents[a];
                let held: Vec<(u64, u64)> = ag
                    .pk
                    .permits(now)
                    .iter()
                    .map(|p| (p.slots, p.expiry_ns))
                    .collect();
                r.orphaned += held.len() as u64;
                orphans.extend(held);
                let inc = ag.inc + 1;
                *ag = fresh_agent(inc);
            }
            Ev::RegionTick { r: rg, periodic } => {
                if periodic {
                    q.post(
                        now + REGION_TIMES.tick_ns,
                        Ev::RegionTick { r: rg, periodic },
                    );
                }
                let reg = &mut regionals[rg];
                if reg.asking.is_none() {
                    reg.pool.advance(now);
                    if reg.chain.lapse(now, &mut reg.pool) {
                        r.region_lapses += 1;
                    }
                    if let Some(ask) = reg.chain.plan(now, &mut reg.pool, &REGION_TIMES) {
                        reg.chain.sent(now, ask, &mut reg.pool, &REGION_TIMES);
                        reg.seq += 1;
                        reg.asking = Some((reg.seq, ask));
                        r.region_asks += 1;
                        let seq = reg.seq;
                        let instant = reg.instant_at.take() == Some(now);
                        q.send_region(
                            now,
                            &mut faults_rng,
                            cfg,
                            &mut r,
                            &cut,
                            (rg, seq),
                            ask,
                            (0, instant),
                        );
                    }
                }
            }
            Ev::RegionAsk {
                r: rg,
                seq,
                ask,
                lost_reply,
            } => {
                let g = match region_replies.get(&(rg, seq)) {
                    Some(g) => *g,
                    None => {
                        let id = next_lease;
                        next_lease += 1;
                        let g = ledger.ask(
                            now,
                            SlotAsk {
                                holder: 1 << 20 | rg as u32,
                                lease_id: ask.lease_id,
                                keep: ask.keep,
                                want: ask.want,
                                ttl_ns: (2_000 * MS).min(ttl_max),
                                new_id: id,
                                fences: FENCES_PER_PARENT_GRANT,
                                resume: ask.resume,
                            },
                        );
                        let pg = ParentSlotGrant {
                            applied: true,
                            lease_id: g.lease_id,
                            slots: g.slots,
                            kept: g.kept,
                            folded: g.folded,
                            ttl_ns: g.expires_ns.saturating_sub(now),
                            fence: g.fence,
                            contended: g.contended,
                            over: g.over,
                            share: g.share.filter(|_| cfg.shares),
                            retry_after_ns: 0,
                            holders: ledger.holders(),
                        };
                        region_replies.insert((rg, seq), pg);
                        pg
                    }
                };
                if lost_reply || cut(rg, now) {
                    r.lost_messages += 1;
                } else {
                    q.post(
                        now + regions.delays_ns[rg],
                        Ev::RegionReply { r: rg, seq, g },
                    );
                }
            }
            Ev::RegionReply { r: rg, seq, g } => {
                let reg = &mut regionals[rg];
                if reg.asking.is_some_and(|(s, _)| s == seq) {
                    reg.asking = None;
                    match reg.chain.on_grant(now, &g, &mut reg.pool, &REGION_TIMES) {
                        ChainChange::Broke => r.region_breaks += 1,
                        ChainChange::Resumed(kept) => r.slots_resumed += kept,
                        ChainChange::None => {}
                    }
                }
            }
            Ev::WakeArrives {
                lender,
                who,
                room,
                contended,
            } => {
                let l = match lender {
                    Lender::Pool(rg) => &mut regionals[rg].pool,
                    Lender::Global => &mut ledger,
                };
                l.advance(now);
                // Looked at with the others below (a contended key answers
                // at once).
                wake_waits.push(WakeWait {
                    lender,
                    who,
                    room,
                    contended,
                    room0: l.room(now),
                    until: now + WAKE_WAIT_NS,
                });
                q.post(now + WAKE_WAIT_NS, Ev::WakeLook);
            }
            Ev::WakeLook => {}
            Ev::WakeAnswer {
                who,
                served,
                room,
                contended,
            } => match who {
                Waker::Agent { a, inc } => {
                    let ag = &mut agents[a];
                    if ag.inc == inc {
                        ag.waking = false;
                        if !served {
                            ag.wake_after = now + WAKE_BACKOFF_NS;
                        }
                        ag.policy.on_wake(room, contended, false);
                        if room || contended {
                            r.wakeups_answered += 1;
                        }
                        ask_now = Some(a);
                    }
                }
                Waker::Region { r: rg } => {
                    let reg = &mut regionals[rg];
                    reg.chain
                        .on_wake(now, served, room, contended, &mut reg.pool);
                    if served && (room || contended) {
                        r.wakeups_answered += 1;
                        q.post(
                            now,
                            Ev::RegionTick {
                                r: rg,
                                periodic: false,
                            },
                        );
                    }
                }
            },
            Ev::RegionGiveUp { r: rg, seq, tries } => {
                let reg = &mut regionals[rg];
                if let Some((s, ask)) = reg.asking.filter(|(s, _)| *s == seq) {
                    if tries < quotalease_allocator::regional::SLOT_RESENDS {
                        r.region_retries += 1;
                        q.send_region(
                            now,
                            &mut faults_rng,
                            cfg,
                            &mut r,
                            &cut,
                            (rg, s),
                            ask,
                            (tries + 1, false),
                        );
                    } else {
                        reg.asking = None;
                        reg.chain.abandon();
                    }
                }
            }
        }
        // A grant ends a stall: the slots move.
        if !started.is_empty() {
            if let Some(from) = stall_from.take() {
                if now - from >= STALL_NS {
                    r.stalls.push((from, now - from));
                }
            }
        }
        for (a, id, until) in started {
            r.permits += 1;
            r.last_permit_ns = now;
            r.grants_ns.push(now);
            let inc = agents[a].inc;
            starts.entry((a, inc)).or_default().push(now);
            agents[a].held.insert(id, until);
            q.post(until, Ev::Release { a, inc, id });
            q.post(now + cfg.renew_every_ns, Ev::Renew { a, inc, id });
        }
        if let Some(a) = ask_now {
            let ag = &mut agents[a];
            if let Some(sent) = ag.policy.due(&mut ag.pk, now) {
                r.asks += 1;
                ag.asking = Some(sent.seq);
                let inc = ag.inc;
                let instant = ag.instant_at.take() == Some(now);
                q.send(
                    now,
                    &mut faults_rng,
                    cfg,
                    &mut r,
                    (a, inc),
                    sent,
                    (0, instant),
                );
            }
            // Its wake-up, as the driver starts them.
            if cfg.wakeups && !ag.waking && now >= ag.wake_after {
                if let Some(w) = ag.policy.wake_wanted(&ag.pk) {
                    ag.waking = true;
                    r.wakeups += 1;
                    let lender = regions
                        .agent_region
                        .get(a)
                        .map_or(Lender::Global, |&rg| Lender::Pool(rg));
                    let who = Waker::Agent { a, inc: ag.inc };
                    q.post(
                        now + cfg.delays_ns[a],
                        Ev::WakeArrives {
                            lender,
                            who,
                            room: w.room,
                            contended: w.contended,
                        },
                    );
                }
            }
        }
        // Regionals' wake-ups of the allocator (their upstream loops start
        // them on every look).
        if cfg.wakeups {
            for (rg, reg) in regionals.iter_mut().enumerate() {
                if let Some(w) = reg.chain.take_wake(now) {
                    r.wakeups += 1;
                    if cut(rg, now) {
                        q.post(
                            now + REGION_FETCH_TIMEOUT_NS,
                            Ev::WakeAnswer {
                                who: Waker::Region { r: rg },
                                served: false,
                                room: false,
                                contended: false,
                            },
                        );
                    } else {
                        q.post(
                            now + regions.delays_ns[rg],
                            Ev::WakeArrives {
                                lender: Lender::Global,
                                who: Waker::Region { r: rg },
                                room: w.room,
                                contended: w.contended,
                            },
                        );
                    }
                }
            }
        }
        // The lenders look at their waiting wake-ups (after every event:
        // any ask may have changed a ledger or pool).
        if !wake_waits.is_empty() {
            let mut i = 0;
            while i < wake_waits.len() {
                let w = wake_waits[i];
                let l = match w.lender {
                    Lender::Pool(rg) => &mut regionals[rg].pool,
                    Lender::Global => &mut ledger,
                };
                l.advance(now);
                let (room, contended) = (l.room(now), l.contended());
                if (w.room && room > w.room0) || (w.contended && contended) || now >= w.until {
                    wake_waits.swap_remove(i);
                    let mut back = match (w.lender, w.who) {
                        (_, Waker::Agent { a, .. }) => cfg.delays_ns[a],
                        (_, Waker::Region { r: rg }) => regions.delays_ns[rg],
                    };
                    if cfg.grant_on_wake && w.room && room > w.room0 {
                        back = 0;
                        match w.who {
                            Waker::Agent { a, .. } => agents[a].instant_at = Some(now),
                            Waker::Region { r: rg } => regionals[rg].instant_at = Some(now),
                        }
                    }
                    q.post(
                        now + back,
                        Ev::WakeAnswer {
                            who: w.who,
                            served: true,
                            room: w.room && room > 0,
                            contended: w.contended && contended,
                        },
                    );
                } else {
                    i += 1;
                }
            }
        }
        // I4 at this instant: the permits valid at every agent, and those
        // of crashed agents until their expiries.
        orphans.retain(|o| o.1 > now);
        let held: u64 = agents
            .iter_mut()
            .map(|ag| ag.pk.permits(now).iter().map(|p| p.slots).sum::<u64>())
            .sum::<u64>()
            + orphans.iter().map(|o| o.0).sum::<u64>();
        r.max_held = r.max_held.max(held);
        if held > cfg.n {
            // The run stops at the first instant I4 is broken (a swarm
            // seed reports it; the tests assert it is never so).
            r.i4_broken = Some(format!(
                "I4: {held} slots of valid permits at {now} ns > N = {}",
                cfg.n
            ));
            break;
        }
    }
    if let Some(from) = stall_from.filter(|&f| last_t - f >= STALL_NS) {
        r.stalls.push((from, last_t - from));
    }
    r.retry_hints = timed_out
        .iter()
        .map(|&(a, inc, at, places, hint)| {
            let s = starts.get(&(a, inc)).map_or(&[][..], |v| &v[..]);
            let after = s.partition_point(|&t| t <= at);
            let truth = s.get(after + places as usize - 1).map(|&t| t - at);
            (hint, truth)
        })
        .collect();
    r.saturated_s = busy_ns as f64 / 1e9;
    r.saturated_use = busy_area / busy_ns.max(1) as f64 / cfg.n as f64;
    (r.wait_p50_ns, r.wait_p99_ns) = quantiles(&mut waits);
    let (ideal, ideal_timeouts, mut ideal_grants) = ideal_waits(cfg.n, cfg.wait_ns, &offered);
    let mut ideal = ideal;
    (r.ideal_p50_ns, r.ideal_p99_ns) = quantiles(&mut ideal);
    r.ideal_timeouts = ideal_timeouts;
    ideal_grants.sort_unstable();
    r.ideal_grants_ns = ideal_grants;
    r
}

/// The events to come, in time order (ties in the order posted).
#[derive(Default)]
struct Queue {
    events: BTreeMap<(u64, u64), Ev>,
    seq: u64,
}

impl Queue {
    fn post(&mut self, at: u64, ev: Ev) {
        self.seq += 1;
        self.events.insert((at, self.seq), ev);
    }

    fn next(&mut self) -> Option<(u64, Ev)> {
        let (&(at, s), &ev) = self.events.iter().next()?;
        self.events.remove(&(at, s));
        Some((at, ev))
    }

    /// Agent `a` (incarnation `inc`) sends `sent` at `now` (`tries` times
    /// before): its fetch timeout, and its arrival unless lost (or its
    /// reply, decided here too).
    #[allow(clippy::too_many_arguments)]
    fn send(
        &mut self,
        now: u64,
        rng: &mut SimRng,
        cfg: &PermitSimConfig,
        r: &mut PermitReport,
        (a, inc): (usize, u32),
        sent: SentAsk,
        (tries, instant): (u32, bool),
    ) {
        self.post(
            now + FETCH_TIMEOUT_NS,
            Ev::GiveUp {
                a,
                inc,
                sent,
                tries,
            },
        );
        if rng.chance(cfg.faults.loss) {
            r.lost_messages += 1;
            return;
        }
        let lost_reply = rng.chance(cfg.faults.loss);
        self.post(
            now + if instant { 0 } else { cfg.delays_ns[a] },
            Ev::AskArrives {
                a,
                inc,
                sent,
                lost_reply,
            },
        );
    }
}

impl Queue {
    /// Regional `r` sends its ask `seq` at `now` (`tries` times before):
    /// its fetch timeout, and its arrival unless lost or cut (its reply's
    /// loss decided here too).
    #[allow(clippy::too_many_arguments)]
    fn send_region(
        &mut self,
        now: u64,
        rng: &mut SimRng,
        cfg: &PermitSimConfig,
        rep: &mut PermitReport,
        cut: &dyn Fn(usize, u64) -> bool,
        (r, seq): (usize, u64),
        ask: ParentSlotAsk,
        (tries, instant): (u32, bool),
    ) {
        self.post(
            now + REGION_FETCH_TIMEOUT_NS,
            Ev::RegionGiveUp { r, seq, tries },
        );
        let delays = cfg.regions.as_ref().map_or(&[][..], |g| &g.delays_ns[..]);
        if rng.chance(cfg.faults.loss) || cut(r, now) {
            rep.lost_messages += 1;
            return;
        }
        let lost_reply = rng.chance(cfg.faults.loss);
        self.post(
            now + if instant { 0 } else { delays[r] },
            Ev::RegionAsk {
                r,
                seq,
                ask,
                lost_reply,
            },
        );
    }
}

/// p50 and p99 of `v` (0 when empty).
fn quantiles(v: &mut [u64]) -> (u64, u64) {
    v.sort_unstable();
    let q = |f: f64| {
        v.get(((v.len() as f64 * f) as usize).min(v.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0)
    };
    (q(0.5), q(0.99))
}

/// An ideal global FIFO semaphore of `n` over `offered` (arrival, hold),
/// each waiting at most `wait_ns`: the waits of those served, how many
/// timed out, and when each was served.
fn ideal_waits(n: u64, wait_ns: u64, offered: &[(u64, u64)]) -> (Vec<u64>, u64, Vec<u64>) {
    let mut sorted = offered.to_vec();
    sorted.sort_unstable();
    // When each slot is free next (a min-heap).
    let mut free: std::collections::BinaryHeap<std::cmp::Reverse<u64>> =
        (0..n).map(|_| std::cmp::Reverse(0)).collect();
    let (mut waits, mut timeouts, mut starts) = (Vec::new(), 0, Vec::new());
    for (t, h) in sorted {
        let std::cmp::Reverse(at) = *free.peek().expect("n >= 1");
        let start = at.max(t);
        if start - t > wait_ns {
            timeouts += 1;
            continue;
        }
        free.pop();
        free.push(std::cmp::Reverse(start + h));
        waits.push(start - t);
        starts.push(start);
    }
    (waits, timeouts, starts)
}

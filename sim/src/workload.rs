//! Request arrivals: the checks the simulated gateways send to their agents.
//!
//! A scenario lists [`WorkloadSpec`]s; each is an independent
//! (inhomogeneous) Poisson stream of checks with its own random stream
//! (`rng.fork(index)`), so adding a workload does not change the arrivals
//! of the others. Time-varying rates are produced by thinning against a
//! piecewise-constant envelope. Each arrival picks its agent uniformly in
//! the workload's agent range and its tenant from the workload's tenant
//! distribution.
//!
//! Tenants are numbers; the event loop names tenant `n` [`tenant_name`]`(n)`
//! (`t<n>`), so a rules document matches tenant 7 as `tenant: t7`. Every
//! workload sends to one route, its `route` (default `/api`); an
//! [`Arrival`] carries the index of its workload, and [`Workload::route`]
//! gives the route string.

use crate::rng::SimRng;
use serde::Deserialize;

/// One check request arriving at an agent.
///
/// Ordered by time, then agent, then tenant (then cost and workload), the
/// order [`Workload::fill`] emits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Arrival {
    /// Simulated time of arrival (ns).
    pub t_ns: u64,
    /// Agent index (0-based, across all regions).
    pub agent: u32,
    /// Tenant number (see [`tenant_name`]).
    pub tenant: u32,
    /// Request cost in tokens (>= 1).
    pub cost: u32,
    /// Index of the workload spec that produced it; its route is
    /// [`Workload::route`]`(route)`.
    pub route: u16,
}

/// The tenant id string for tenant number `n`: `t<n>`.
pub fn tenant_name(n: u32) -> String {
    format!("t{n}")
}

fn default_cost() -> u32 {
    1
}

fn default_route() -> String {
    "/api".to_string()
}

/// One source of checks (YAML: a mapping tagged by `kind`).
///
/// Common optional fields: `agents: [first, last]` (inclusive range of
/// agent indices that send it; default every agent, uniformly), `cost`
/// (tokens per check, default 1), `route` (default `/api`).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum WorkloadSpec {
    /// One tenant at a constant rate (Poisson arrivals).
    Hot {
        /// The tenant.
        tenant: u32,
        /// Checks per second.
        rps: f64,
        /// Inclusive agent index range; default all agents.
        #[serde(default)]
        agents: Option<(u32, u32)>,
        /// Tokens per check.
        #[serde(default = "default_cost")]
        cost: u32,
        /// Route of every check.
        #[serde(default = "default_route")]
        route: String,
    },
    /// Tenants `1..=tenants` with Zipf(`s`) popularity (tenant `k` has
    /// weight `k^-s`), constant total rate.
    Zipf {
        /// Number of tenants.
        tenants: u32,
        /// Zipf exponent (>= 0; 0 is uniform).
        s: f64,
        /// Total checks per second.
        rps: f64,
        /// Inclusive agent index range; default all agents.
        #[serde(default)]
        agents: Option<(u32, u32)>,
        /// Tokens per check.
        #[serde(default = "default_cost")]
        cost: u32,
        /// Route of every check.
        #[serde(default = "default_route")]
        route: String,
    },
    /// One tenant at `base_rps`; from `at_s` the rate rises linearly to
    /// `peak_rps` over `ramp_s`, stays there for `for_s`, falls back
    /// linearly over `ramp_s`, and is `base_rps` again.
    FlashCrowd {
        /// The tenant.
        tenant: u32,
        /// Rate outside the crowd.
        base_rps: f64,
        /// Rate at the top of the crowd.
        peak_rps: f64,
        /// Start of the ramp (simulated seconds).
        at_s: f64,
        /// Length of each ramp (s); 0 is a step.
        ramp_s: f64,
        /// Time at the peak (s).
        for_s: f64,
        /// Inclusive agent index range; default all agents.
        #[serde(default)]
        agents: Option<(u32, u32)>,
        /// Tokens per check.
        #[serde(default = "default_cost")]
        cost: u32,
        /// Route of every check.
        #[serde(default = "default_route")]
        route: String,
    },
    /// One tenant at `mean_rps * (1 + amplitude * sin(2 pi t / period_s))`.
    Diurnal {
        /// The tenant.
        tenant: u32,
        /// Mean rate.
        mean_rps: f64,
        /// Relative amplitude in `[0, 1]`.
        amplitude: f64,
        /// Period (s).
        period_s: f64,
        /// Inclusive agent index range; default all agents.
        #[serde(default)]
        agents: Option<(u32, u32)>,
        /// Tokens per check.
        #[serde(default = "default_cost")]
        cost: u32,
        /// Route of every check.
        #[serde(default = "default_route")]
        route: String,
    },
}

impl WorkloadSpec {
    /// The `kind` tag.
    pub fn kind(&self) -> &'static str {
        match self {
            WorkloadSpec::Hot { .. } => "hot",
            WorkloadSpec::Zipf { .. } => "zipf",
            WorkloadSpec::FlashCrowd { .. } => "flash_crowd",
            WorkloadSpec::Diurnal { .. } => "diurnal",
        }
    }

    /// The agent range, if restricted.
    pub fn agents(&self) -> Option<(u32, u32)> {
        match self {
            WorkloadSpec::Hot { agents, .. }
            | WorkloadSpec::Zipf { agents, .. }
            | WorkloadSpec::FlashCrowd { agents, .. }
            | WorkloadSpec::Diurnal { agents, .. } => *agents,
        }
    }

    /// Tokens per check.
    pub fn cost(&self) -> u32 {
        match self {
            WorkloadSpec::Hot { cost, .. }
            | WorkloadSpec::Zipf { cost, .. }
            | WorkloadSpec::FlashCrowd { cost, .. }
            | WorkloadSpec::Diurnal { cost, .. } => *cost,
        }
    }

    /// The route of every check.
    pub fn route(&self) -> &str {
        match self {
            WorkloadSpec::Hot { route, .. }
            | WorkloadSpec::Zipf { route, .. }
            | WorkloadSpec::FlashCrowd { route, .. }
            | WorkloadSpec::Diurnal { route, .. } => route,
        }
    }

    /// The largest rate (checks/s) this workload reaches.
    pub fn peak_rps(&self) -> f64 {
        match *self {
            WorkloadSpec::Hot { rps, .. } | WorkloadSpec::Zipf { rps, .. } => rps,
            WorkloadSpec::FlashCrowd {
                base_rps, peak_rps, ..
            } => base_rps.max(peak_rps),
            WorkloadSpec::Diurnal {
                mean_rps,
                amplitude,
                ..
            } => mean_rps * (1.0 + amplitude),
        }
    }

    /// Checks the values for a deployment of `agents` agents. The error
    /// starts with the field name.
    pub fn validate(&self, agents: u32) -> Result<(), String> {
        let rate = |name: &str, v: f64| {
            if v.is_finite() && v >= 0.0 {
                Ok(())
            } else {
                Err(format!("{name}: must be a finite number >= 0, got {v}"))
            }
        };
        let secs = |name: &str, v: f64, positive: bool| {
            if v.is_finite() && (v > 0.0 || (!positive && v == 0.0)) {
                Ok(())
            } else {
                let what = if positive { "> 0" } else { ">= 0" };
                Err(format!("{name}: must be a finite number {what}, got {v}"))
            }
        };
        match *self {
            WorkloadSpec::Hot { rps, .. } => rate("rps", rps)?,
            WorkloadSpec::Zipf {
                tenants, s, rps, ..
            } => {
                if tenants == 0 {
                    return Err("tenants: must be at least 1".into());
                }
                if tenants > 10_000_000 {
                    return Err(format!("tenants: at most 10000000, got {tenants}"));
                }
                if !(s.is_finite() && s >= 0.0) {
                    return Err(format!("s: must be a finite number >= 0, got {s}"));
                }
                rate("rps", rps)?;
            }
            WorkloadSpec::FlashCrowd {
                base_rps,
                peak_rps,
                at_s,
                ramp_s,
                for_s,
                ..
            } => {
                rate("base_rps", base_rps)?;
                rate("peak_rps", peak_rps)?;
                secs("at_s", at_s, false)?;
                secs("ramp_s", ramp_s, false)?;
                secs("for_s", for_s, false)?;
            }
            WorkloadSpec::Diurnal {
                mean_rps,
                amplitude,
                period_s,
                ..
            } => {
                rate("mean_rps", mean_rps)?;
                if !(0.0..=1.0).contains(&amplitude) {
                    return Err(format!("amplitude: must be in [0, 1], got {amplitude}"));
                }
                secs("period_s", period_s, true)?;
            }
        }
        if self.cost() == 0 {
            return Err("cost: must be at least 1".into());
        }
        if let Some((first, last)) = self.agents() {
            if first > last || last >= agents {
                return Err(format!(
                    "agents: [{first}, {last}] must be an inclusive range within 0..={}",
                    agents.saturating_sub(1)
                ));
            }
        }
        Ok(())
    }

    /// This workload with its rates multiplied by `f` (and, for Zipf, the
    /// number of tenants, at least 1) and its agent range mapped onto a
    /// deployment shrunk from `agents_from` to `agents_to` agents.
    pub fn scaled(&self, f: f64, agents_from: u32, agents_to: u32) -> WorkloadSpec {
        let mut w = self.clone();
        let map_agents = |a: &mut Option<(u32, u32)>| {
            if let Some((first, last)) = *a {
                let m = |x: u32| -> u32 {
                    if agents_from == 0 {
                        return 0;
                    }
                    let y = (u64::from(x) * u64::from(agents_to) / u64::from(agents_from)) as u32;
                    y.min(agents_to.saturating_sub(1))
                };
                *a = Some((m(first), m(last).max(m(first))));
            }
        };
        match &mut w {
            WorkloadSpec::Hot { rps, agents, .. } => {
                *rps *= f;
                map_agents(agents);
            }
            WorkloadSpec::Zipf {
                tenants,
                rps,
                agents,
                ..
            } => {
                *rps *= f;
                *tenants = ((f64::from(*tenants) * f).round() as u32).max(1);
                map_agents(agents);
            }
            WorkloadSpec::FlashCrowd {
                base_rps,
                peak_rps,
                agents,
                ..
            } => {
                *base_rps *= f;
                *peak_rps *= f;
                map_agents(agents);
            }
            WorkloadSpec::Diurnal {
                mean_rps, agents, ..
            } => {
                *mean_rps *= f;
                map_agents(agents);
            }
        }
        w
    }
}

/// Walker/Vose alias table: O(1) sampling from a discrete distribution
/// with one random draw and one memory access.
#[derive(Clone, Debug)]
struct Alias {
    /// Per slot: acceptance threshold (high 32 bits, `u32::MAX` = always
    /// keep the slot) and the alias outcome (low 32 bits).
    slots: Vec<u64>,
}

impl Alias {
    /// Zipf(`s`) over `n` outcomes (outcome `i` has weight `(i+1)^-s`).
    /// Built in a fixed order, so the table is identical on every run.
    fn zipf(n: u32, s: f64) -> Alias {
        let n_us = n as usize;
        let w: Vec<f64> = (1..=n).map(|k| f64::from(k).powf(-s)).collect();
        let total: f64 = w.iter().sum();
        let mut scaled: Vec<f64> = w.iter().map(|x| x * f64::from(n) / total).collect();
        let mut prob = vec![u32::MAX; n_us];
        let mut alias: Vec<u32> = (0..n).collect();
        let mut small: Vec<u32> = Vec::new();
        let mut large: Vec<u32> = Vec::new();
        for (i, &p) in scaled.iter().enumerate() {
            if p < 1.0 {
                small.push(i as u32);
            } else {
                large.push(i as u32);
            }
        }
        while let (Some(&l), Some(&g)) = (small.last(), large.last()) {
            small.pop();
            let (li, gi) = (l as usize, g as usize);
            prob[li] = to_threshold(scaled[li]);
            alias[li] = g;
            scaled[gi] = (scaled[gi] + scaled[li]) - 1.0;
            if scaled[gi] < 1.0 {
                large.pop();
                small.push(g);
            }
        }
        // Leftovers (rounding) keep their own slot with probability 1.
        let slots = prob
            .iter()
            .zip(&alias)
            .map(|(&p, &a)| (u64::from(p) << 32) | u64::from(a))
            .collect();
        Alias { slots }
    }

    /// One draw: the high 32 bits pick the slot (multiply-shift; the bias
    /// is below n / 2^32), the low 32 bits decide slot or alias.
    #[inline]
    fn sample(&self, rng: &mut SimRng) -> u32 {
        let r = rng.next_u64();
        let i = ((r >> 32) * self.slots.len() as u64) >> 32;
        let slot = self.slots[i as usize];
        let threshold = (slot >> 32) as u32;
        if threshold == u32::MAX || (r as u32) < threshold {
            i as u32
        } else {
            slot as u32
        }
    }
}

fn to_threshold(p: f64) -> u32 {
    if p >= 1.0 {
        u32::MAX
    } else if p <= 0.0 {
        0
    } else {
        (p * 4_294_967_296.0) as u32
    }
}

/// How a stream picks tenants.
#[derive(Clone, Debug)]
enum Tenants {
    One(u32),
    /// Tenant `1 + sample`.
    Zipf(Alias),
}

/// Rate shape in checks per nanosecond.
#[derive(Clone, Copy, Debug)]
enum Shape {
    Constant(f64),
    Flash {
        base: f64,
        peak: f64,
        /// Ramp start, top start, top end, ramp end (ns).
        t: [f64; 4],
    },
    Diurnal {
        mean: f64,
        amplitude: f64,
        period_ns: f64,
    },
}

impl Shape {
    /// Rate at `t` (per ns).
    fn rate(&self, t: f64) -> f64 {
        match *self {
            Shape::Constant(r) => r,
            Shape::Flash {
                base,
                peak,
                t: [a, b, c, d],
            } => {
                if t < a || t >= d {
                    base
                } else if t < b {
                    base + (peak - base) * (t - a) / (b - a)
                } else if t < c {
                    peak
                } else {
                    peak + (base - peak) * (t - c) / (d - c)
                }
            }
            Shape::Diurnal {
                mean,
                amplitude,
                period_ns,
            } => {
                let x = mean * (1.0 + amplitude * (std::f64::consts::TAU * t / period_ns).sin());
                x.max(0.0)
            }
        }
    }

    /// An upper bound on the rate from `t` on, and where that bound stops
    /// holding (`f64::INFINITY`: forever). Whether the rate is exact (no
    /// thinning needed) is the third value.
    fn envelope(&self, t: f64) -> (f64, f64, bool) {
        match *self {
            Shape::Constant(r) => (r, f64::INFINITY, true),
            Shape::Flash {
                base,
                peak,
                t: [a, b, c, d],
            } => {
                let hi = base.max(peak);
                if t < a {
                    (base, a, true)
                } else if t < b {
                    (hi, b, base == peak)
                } else if t < c {
                    (peak, c, true)
                } else if t < d {
                    (hi, d, base == peak)
                } else {
                    (base, f64::INFINITY, true)
                }
            }
            Shape::Diurnal {
                mean, amplitude, ..
            } => (mean * (1.0 + amplitude), f64::INFINITY, amplitude == 0.0),
        }
    }
}

/// One workload's state.
#[derive(Clone, Debug)]
struct Stream {
    shape: Shape,
    tenants: Tenants,
    agent_first: u32,
    agent_count: u32,
    cost: u32,
    index: u16,
    rng: SimRng,
    /// Time of the next candidate arrival (ns, fractional), not yet decided.
    next: f64,
}

impl Stream {
    /// The candidate arrival after `from` (`from` itself was consumed), or
    /// infinity if the rate stays 0 for ever.
    #[inline]
    fn advance(&mut self, mut from: f64) -> f64 {
        loop {
            let (rate, until, _) = self.shape.envelope(from);
            if rate <= 0.0 {
                if until.is_infinite() {
                    return f64::INFINITY;
                }
                from = until;
                continue;
            }
            // -ln(1 - u) / rate, with 1 - u in (0, 1].
            let gap = -(1.0 - self.rng.unit_f64()).ln() / rate;
            let t = from + gap;
            if t < until {
                return t;
            }
            // Memoryless: restart at the segment boundary.
            from = until;
        }
    }
}

/// The arrivals of a scenario's workloads. Deterministic given the specs,
/// the number of agents and the generator.
#[derive(Clone, Debug)]
pub struct Workload {
    streams: Vec<Stream>,
    routes: Vec<String>,
    done_to: u64,
    /// Per-stream scratch buffers for one window, merged into the output.
    scratch: Vec<Vec<Arrival>>,
}

impl Workload {
    /// Arrival streams for `specs` over `agents` agents. Stream `i` draws
    /// from `rng.fork(i)`. Values [`WorkloadSpec::validate`] would reject are
    /// clamped (negative rates to 0, out-of-range agents to the last agent)
    /// rather than panicking.
    pub fn new(specs: &[WorkloadSpec], agents: u32, rng: SimRng) -> Workload {
        let mut streams = Vec::with_capacity(specs.len());
        let mut routes = Vec::with_capacity(specs.len());
        let per_ns = |rps: f64| {
            if rps.is_finite() {
                rps.max(0.0) / 1e9
            } else {
                0.0
            }
        };
        for (i, spec) in specs.iter().enumerate() {
            let (shape, tenants) = match *spec {
                WorkloadSpec::Hot { tenant, rps, .. } => {
                    (Shape::Constant(per_ns(rps)), Tenants::One(tenant))
                }
                WorkloadSpec::Zipf {
                    tenants, s, rps, ..
                } => (
                    Shape::Constant(per_ns(rps)),
                    Tenants::Zipf(Alias::zipf(tenants.max(1), s.max(0.0))),
                ),
                WorkloadSpec::FlashCrowd {
                    tenant,
                    base_rps,
                    peak_rps,
                    at_s,
                    ramp_s,
                    for_s,
                    ..
                } => {
                    let a = at_s.max(0.0) * 1e9;
                    let b = a + ramp_s.max(0.0) * 1e9;
                    let c = b + for_s.max(0.0) * 1e9;
                    let d = c + ramp_s.max(0.0) * 1e9;
                    (
                        Shape::Flash {
                            base: per_ns(base_rps),
                            peak: per_ns(peak_rps),
                            t: [a, b, c, d],
                        },
                        Tenants::One(tenant),
                    )
                }
                WorkloadSpec::Diurnal {
                    tenant,
                    mean_rps,
                    amplitude,
                    period_s,
                    ..
                } => (
                    Shape::Diurnal {
                        mean: per_ns(mean_rps),
                        amplitude: amplitude.clamp(0.0, 1.0),
                        period_ns: (period_s * 1e9).max(1.0),
                    },
                    Tenants::One(tenant),
                ),
            };
            let last_agent = agents.saturating_sub(1);
            let (first, last) = spec.agents().unwrap_or((0, last_agent));
            let first = first.min(last_agent);
            let last = last.clamp(first, last_agent);
            let mut stream = Stream {
                shape,
                tenants,
                agent_first: first,
                agent_count: last - first + 1,
                cost: spec.cost().max(1),
                index: u16::try_from(i).unwrap_or(u16::MAX),
                rng: rng.fork(i as u64),
                next: 0.0,
            };
            stream.next = stream.advance(0.0);
            streams.push(stream);
            routes.push(spec.route().to_string());
        }
        Workload {
            streams,
            scratch: vec![Vec::new(); specs.len()],
            routes,
            done_to: 0,
        }
    }

    /// The route of workload `index` (an [`Arrival::route`]).
    pub fn route(&self, index: u16) -> &str {
        self.routes
            .get(usize::from(index))
            .map(String::as_str)
            .unwrap_or("")
    }

    /// Appends every arrival with `from_ns <= t_ns < to_ns` to `out`, sorted
    /// by ([`Arrival`]'s order) time, agent, tenant. Windows are meant to be
    /// consecutive (`from_ns` of one call = `to_ns` of the previous); the
    /// arrivals of a skipped stretch are dropped, and a window before the
    /// last one gives nothing. The arrivals do not depend on how the time
    /// is cut into windows.
    pub fn fill(&mut self, from_ns: u64, to_ns: u64, out: &mut Vec<Arrival>) {
        let from_ns = from_ns.max(self.done_to);
        if to_ns <= from_ns {
            return;
        }
        self.done_to = to_ns;
        let to = to_ns as f64;
        for (stream, buf) in self.streams.iter_mut().zip(self.scratch.iter_mut()) {
            buf.clear();
            while stream.next < to {
                let t = stream.next;
                let (hi, _, exact) = stream.shape.envelope(t);
                let keep = exact || stream.rng.unit_f64() * hi < stream.shape.rate(t);
                if keep {
                    let t_ns = t as u64;
                    if t_ns >= from_ns {
                        let agent = stream.agent_first
                            + stream.rng.below(u64::from(stream.agent_count)) as u32;
                        let tenant = match &stream.tenants {
                            Tenants::One(t) => *t,
                            Tenants::Zipf(table) => 1 + table.sample(&mut stream.rng),
                        };
                        push_sorted(
                            buf,
                            Arrival {
                                t_ns,
                                agent,
                                tenant,
                                cost: stream.cost,
                                route: stream.index,
                            },
                        );
                    }
                }
                stream.next = stream.advance(t);
            }
        }
        merge(&self.scratch, out);
    }
}

/// Appends the merge of the sorted `runs` to `out` (k-way, by scanning the
/// heads: the number of workloads is small).
fn merge(runs: &[Vec<Arrival>], out: &mut Vec<Arrival>) {
    let mut live: Vec<&[Arrival]> = runs
        .iter()
        .filter(|r| !r.is_empty())
        .map(Vec::as_slice)
        .collect();
    out.reserve(live.iter().map(|r| r.len()).sum());
    while live.len() > 1 {
        let mut best = 0;
        for i in 1..live.len() {
            if live[i][0] < live[best][0] {
                best = i;
            }
        }
        out.push(live[best][0]);
        live[best] = &live[best][1..];
        if live[best].is_empty() {
            live.swap_remove(best);
        }
    }
    if let Some(last) = live.first() {
        out.extend_from_slice(last);
    }
}

/// Pushes `a` keeping `out` sorted; `a` is never earlier than the previous
/// arrival's time, so this only reorders ties on `t_ns`.
#[inline]
fn push_sorted(out: &mut Vec<Arrival>, a: Arrival) {
    out.push(a);
    let mut i = out.len() - 1;
    while i > 0 && out[i - 1] > out[i] {
        out.swap(i - 1, i);
        i -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hot(rps: f64) -> WorkloadSpec {
        WorkloadSpec::Hot {
            tenant: 0,
            rps,
            agents: None,
            cost: 1,
            route: "/api".into(),
        }
    }

    fn collect(
        specs: &[WorkloadSpec],
        agents: u32,
        seed: u64,
        to_s: f64,
        step_ns: u64,
    ) -> Vec<Arrival> {
        let mut w = Workload::new(specs, agents, SimRng::new(seed));
        let mut out = Vec::new();
        let end = (to_s * 1e9) as u64;
        let mut t = 0;
        while t < end {
            let next = (t + step_ns).min(end);
            w.fill(t, next, &mut out);
            t = next;
        }
        out
    }

    fn sorted(v: &[Arrival]) -> bool {
        v.windows(2).all(|w| w[0] <= w[1])
    }

    #[test]
    fn poisson_rate_and_order() {
        let a = collect(&[hot(10_000.0)], 10, 1, 2.0, 1_000_000);
        assert!(sorted(&a));
        let n = a.len() as f64;
        assert!((n - 20_000.0).abs() < 4.0 * 20_000f64.sqrt(), "{n}");
        assert!(a
            .iter()
            .all(|x| x.agent < 10 && x.tenant == 0 && x.cost == 1));
        let mut per_agent = [0u32; 10];
        for x in &a {
            per_agent[x.agent as usize] += 1;
        }
        assert!(
            per_agent.iter().all(|&c| (1700..2300).contains(&c)),
            "{per_agent:?}"
        );
    }

    #[test]
    fn windows_do_not_change_arrivals() {
        let specs = [
            hot(5_000.0),
            WorkloadSpec::Zipf {
                tenants: 100,
                s: 1.1,
                rps: 20_000.0,
                agents: Some((2, 5)),
                cost: 2,
                route: "/z".into(),
            },
        ];
        let a = collect(&specs, 8, 3, 1.0, 1_000_000);
        let b = collect(&specs, 8, 3, 1.0, 77_777);
        assert_eq!(a, b);
        assert!(sorted(&a));
        let c = collect(&specs, 8, 4, 1.0, 1_000_000);
        assert_ne!(a, c);
        let z: Vec<_> = a.iter().filter(|x| x.route == 1).collect();
        assert!(z.iter().all(|x| (2..=5).contains(&x.agent) && x.cost == 2));
        assert!(z.iter().all(|x| (1..=100).contains(&x.tenant)));
    }

    #[test]
    fn adding_a_workload_keeps_the_others() {
        let a = collect(&[hot(1000.0)], 4, 9, 1.0, 10_000_000);
        let b = collect(&[hot(1000.0), hot(3000.0)], 4, 9, 1.0, 10_000_000);
        let b0: Vec<_> = b.into_iter().filter(|x| x.route == 0).collect();
        assert_eq!(a, b0);
    }

    #[test]
    fn zipf_popularity() {
        let spec = WorkloadSpec::Zipf {
            tenants: 100_000,
            s: 1.0,
            rps: 1_000_000.0,
            agents: None,
            cost: 1,
            route: "/api".into(),
        };
        let a = collect(&[spec], 300, 5, 1.0, 1_000_000);
        let mut counts = vec![0u32; 100_001];
        for x in &a {
            counts[x.tenant as usize] += 1;
        }
        assert_eq!(counts[0], 0);
        // H(100000) ~ 12.09: tenant 1 gets ~8.27%, tenant 2 ~4.14%.
        let n = a.len() as f64;
        let p1 = f64::from(counts[1]) / n;
        let p2 = f64::from(counts[2]) / n;
        assert!((p1 - 0.0827).abs() < 0.002, "{p1}");
        assert!((p2 - 0.0414).abs() < 0.002, "{p2}");
        assert!(counts[100_000] < 20);
    }

    #[test]
    fn flash_crowd_shape() {
        let spec = WorkloadSpec::FlashCrowd {
            tenant: 3,
            base_rps: 1_000.0,
            peak_rps: 20_000.0,
            at_s: 1.0,
            ramp_s: 0.5,
            for_s: 1.0,
            agents: None,
            cost: 1,
            route: "/api".into(),
        };
        let a = collect(&[spec], 4, 2, 4.0, 1_000_000);
        let count = |from: f64, to: f64| {
            a.iter()
                .filter(|x| x.t_ns >= (from * 1e9) as u64 && x.t_ns < (to * 1e9) as u64)
                .count() as f64
        };
        assert!((count(0.0, 1.0) - 1_000.0).abs() < 150.0);
        assert!((count(1.5, 2.5) - 20_000.0).abs() < 600.0);
        // Ramps average (base + peak) / 2 over 0.5 s each.
        assert!((count(1.0, 1.5) - 5_250.0).abs() < 350.0);
        assert!((count(2.5, 3.0) - 5_250.0).abs() < 350.0);
        assert!((count(3.0, 4.0) - 1_000.0).abs() < 150.0);
        assert!(sorted(&a));
    }

    #[test]
    fn diurnal_shape() {
        let spec = WorkloadSpec::Diurnal {
            tenant: 1,
            mean_rps: 10_000.0,
            amplitude: 0.5,
            period_s: 4.0,
            agents: None,
            cost: 1,
            route: "/api".into(),
        };
        let a = collect(&[spec], 4, 2, 4.0, 1_000_000);
        let first_half = a.iter().filter(|x| x.t_ns < 2_000_000_000).count() as f64;
        let second_half = a.len() as f64 - first_half;
        // Integral of 1 + 0.5 sin over each half: 2 s * (1 +- 1/pi).
        assert!((first_half - 20_000.0 * (1.0 + 1.0 / std::f64::consts::PI)).abs() < 600.0);
        assert!((second_half - 20_000.0 * (1.0 - 1.0 / std::f64::consts::PI)).abs() < 600.0);
    }

    #[test]
    fn yaml_and_validation() {
        let specs: Vec<WorkloadSpec> = crate::scenario::from_yaml(
            "- { kind: hot, tenant: 0, rps: 100 }\n\
             - { kind: zipf, tenants: 10, s: 1.0, rps: 5, agents: [0, 3], cost: 2, route: /x }\n\
             - { kind: flash_crowd, tenant: 1, base_rps: 1, peak_rps: 9, at_s: 1, ramp_s: 0, for_s: 2 }\n\
             - { kind: diurnal, tenant: 2, mean_rps: 4, amplitude: 0.3, period_s: 60 }\n",
        )
        .unwrap();
        assert_eq!(specs.len(), 4);
        assert_eq!(specs[1].agents(), Some((0, 3)));
        assert_eq!(specs[1].route(), "/x");
        assert_eq!(specs[0].route(), "/api");
        for s in &specs {
            s.validate(4).unwrap();
        }
        assert!(specs[1].validate(3).unwrap_err().starts_with("agents"));
        assert!(crate::scenario::from_yaml::<WorkloadSpec>(
            "{ kind: hot, tenant: 0, rps: 1, x: 1 }"
        )
        .is_err());
        assert!(crate::scenario::from_yaml::<WorkloadSpec>("{ kind: cold, tenant: 0 }").is_err());
        let bad = WorkloadSpec::Diurnal {
            tenant: 0,
            mean_rps: 1.0,
            amplitude: 2.0,
            period_s: 1.0,
            agents: None,
            cost: 1,
            route: "/".into(),
        };
        assert!(bad.validate(1).unwrap_err().starts_with("amplitude"));
    }

    #[test]
    fn zero_rate_and_skipped_windows() {
        let mut w = Workload::new(&[hot(0.0)], 1, SimRng::new(0));
        let mut out = Vec::new();
        w.fill(0, 10_000_000_000, &mut out);
        assert!(out.is_empty());
        let mut w = Workload::new(&[hot(1000.0)], 1, SimRng::new(0));
        w.fill(500_000_000, 1_000_000_000, &mut out);
        assert!(out.iter().all(|a| a.t_ns >= 500_000_000));
        let n = out.len();
        w.fill(0, 2_000_000, &mut out); // in the past: nothing
        assert_eq!(out.len(), n);
    }
}

//! The simulated network: per-link latency, loss, duplication and cuts.
//!
//! The event loop asks [`Net::deliveries`] when each message it sends will
//! arrive. A message arrives zero times (lost, or the link is cut), once, or
//! twice (duplicated); every copy draws its own latency, so messages on one
//! link overtake each other naturally. A copy is lost when the link is cut
//! at the send instant or at its arrival instant.
//!
//! Latency on a link is lognormal, fitted to the link's median and 99th
//! percentile: `ln(latency) ~ N(ln(median), sigma)` with
//! `sigma = ln(p99 / median) / z_0.99`. A p99 equal to the median makes the
//! latency fixed.

use crate::rng::SimRng;
use serde::Deserialize;
use std::fmt;

/// The 0.99 quantile of the standard normal distribution.
const Z_99: f64 = 2.326_347_874_040_841;

/// A node of the simulated deployment.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Node {
    /// The global allocator.
    Global,
    /// Regional allocator number `n` (0-based).
    Regional(u16),
    /// Agent number `n` (0-based, numbered across all regions).
    Agent(u32),
}

impl Node {
    /// Parses the scenario spelling: `global`, `region/N` or `agent/N`.
    pub fn parse(s: &str) -> Result<Node, String> {
        let s = s.trim();
        if s == "global" {
            return Ok(Node::Global);
        }
        let bad = || format!("{s:?} is not a node: use global, region/N or agent/N");
        let (kind, n) = s.split_once('/').ok_or_else(bad)?;
        if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        match kind {
            "region" => n
                .parse()
                .map(Node::Regional)
                .map_err(|_| format!("{s:?}: region number must be from 0 to {}", u16::MAX)),
            "agent" => n
                .parse()
                .map(Node::Agent)
                .map_err(|_| format!("{s:?}: agent number must be from 0 to {}", u32::MAX)),
            _ => Err(bad()),
        }
    }
}

impl fmt::Display for Node {
    /// The scenario spelling: `global`, `region/N`, `agent/N`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Node::Global => f.write_str("global"),
            Node::Regional(n) => write!(f, "region/{n}"),
            Node::Agent(n) => write!(f, "agent/{n}"),
        }
    }
}

fn default_median() -> f64 {
    1.0
}

fn default_p99() -> f64 {
    5.0
}

/// One kind of link: one-way latency distribution, loss and duplication.
#[derive(Clone, Copy, Debug, PartialEq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct LinkSpec {
    /// Median one-way latency in milliseconds (default 1).
    #[serde(default = "default_median")]
    pub median_ms: f64,
    /// 99th percentile of the one-way latency in milliseconds, at least the
    /// median (default 5). Equal to the median: fixed latency.
    #[serde(default = "default_p99")]
    pub p99_ms: f64,
    /// Probability that a message is lost, in `[0, 1]` (default 0).
    #[serde(default)]
    pub loss: f64,
    /// Probability that a delivered message arrives twice, in `[0, 1]`
    /// (default 0).
    #[serde(default)]
    pub duplicate: f64,
}

impl Default for LinkSpec {
    fn default() -> Self {
        LinkSpec {
            median_ms: default_median(),
            p99_ms: default_p99(),
            loss: 0.0,
            duplicate: 0.0,
        }
    }
}

impl LinkSpec {
    /// Checks the values; the error names the field (relative to the link).
    pub fn validate(&self) -> Result<(), String> {
        let finite = |v: f64| v.is_finite();
        if !finite(self.median_ms) || self.median_ms < 0.0 {
            return Err(format!(
                "median_ms: must be a finite number >= 0, got {}",
                self.median_ms
            ));
        }
        if !finite(self.p99_ms) || self.p99_ms < self.median_ms {
            return Err(format!(
                "p99_ms: must be a finite number >= median_ms ({}), got {}",
                self.median_ms, self.p99_ms
            ));
        }
        if self.p99_ms > 0.0 && self.median_ms == 0.0 {
            return Err("median_ms: must be > 0 when p99_ms is > 0".to_string());
        }
        for (name, v) in [("loss", self.loss), ("duplicate", self.duplicate)] {
            if !(0.0..=1.0).contains(&v) {
                return Err(format!("{name}: must be a probability in [0, 1], got {v}"));
            }
        }
        Ok(())
    }
}

/// The links of a deployment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetConfig {
    /// Between an agent and its allocator (regional, or global when the
    /// scenario has no regions).
    #[serde(default)]
    pub agent_parent: LinkSpec,
    /// Between a regional allocator and the global one.
    #[serde(default)]
    pub regional_global: LinkSpec,
}

/// What a cut separates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CutKind {
    /// Regional allocator `n` and the global allocator, both directions
    /// (the region's agents still reach their regional allocator).
    RegionFromGlobal(u16),
    /// Agent `n` and every allocator (its parent), both directions.
    AgentFromParent(u32),
    /// Only messages from `from` to `to`.
    OneWay {
        /// Sender whose messages are dropped.
        from: Node,
        /// Receiver that stops hearing from `from`.
        to: Node,
    },
}

impl CutKind {
    /// Whether this cut drops a message from `from` to `to`.
    pub fn separates(&self, from: Node, to: Node) -> bool {
        match *self {
            CutKind::RegionFromGlobal(r) => matches!(
                (from, to),
                (Node::Regional(a), Node::Global) | (Node::Global, Node::Regional(a)) if a == r
            ),
            CutKind::AgentFromParent(n) => matches!(
                (from, to),
                (Node::Agent(a), Node::Regional(_) | Node::Global)
                    | (Node::Regional(_) | Node::Global, Node::Agent(a)) if a == n
            ),
            CutKind::OneWay { from: f, to: t } => from == f && to == t,
        }
    }
}

/// A cut active during `[from_ns, until_ns)` of simulated time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cut {
    /// First instant of the cut.
    pub from_ns: u64,
    /// First instant after the cut (exclusive end).
    pub until_ns: u64,
    /// What it separates.
    pub kind: CutKind,
}

/// A spell during `[from_ns, until_ns)` when one kind of link behaves as
/// `spec` instead of its base configuration.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Storm {
    /// First instant.
    pub from_ns: u64,
    /// First instant after it (exclusive end).
    pub until_ns: u64,
    /// The regional-global links (else the agent-parent ones).
    pub regional_global: bool,
    /// How the link behaves meanwhile.
    pub spec: LinkSpec,
}

/// When the copies of one message arrive: 0, 1 or 2 instants, in the order
/// drawn (not sorted). Iterate it, or use [`Deliveries::as_slice`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Deliveries {
    at: [u64; 2],
    len: u8,
}

impl Deliveries {
    /// No copy arrives.
    pub const NONE: Deliveries = Deliveries { at: [0; 2], len: 0 };

    fn push(&mut self, t: u64) {
        self.at[usize::from(self.len)] = t;
        self.len += 1;
    }

    /// The arrival instants.
    pub fn as_slice(&self) -> &[u64] {
        &self.at[..usize::from(self.len)]
    }

    /// Number of copies that arrive (0, 1 or 2).
    pub fn len(&self) -> usize {
        usize::from(self.len)
    }

    /// Whether the message is lost.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl IntoIterator for Deliveries {
    type Item = u64;
    type IntoIter = std::iter::Take<std::array::IntoIter<u64, 2>>;

    fn into_iter(self) -> Self::IntoIter {
        self.at.into_iter().take(usize::from(self.len))
    }
}

impl<'a> IntoIterator for &'a Deliveries {
    type Item = &'a u64;
    type IntoIter = std::slice::Iter<'a, u64>;

    fn into_iter(self) -> Self::IntoIter {
        self.as_slice().iter()
    }
}

/// A link's precomputed latency distribution.
#[derive(Clone, Copy, Debug)]
struct Link {
    median_ns: f64,
    sigma: f64,
    loss: f64,
    duplicate: f64,
}

impl Link {
    fn new(spec: &LinkSpec) -> Link {
        let median_ns = spec.median_ms.max(0.0) * 1e6;
        let sigma = if spec.median_ms > 0.0 && spec.p99_ms > spec.median_ms {
            (spec.p99_ms / spec.median_ms).ln() / Z_99
        } else {
            0.0
        };
        Link {
            median_ns,
            sigma,
            loss: spec.loss,
            duplicate: spec.duplicate,
        }
    }

    fn latency_ns(&self, rng: &mut SimRng) -> u64 {
        if self.sigma == 0.0 {
            return self.median_ns as u64;
        }
        let x = self.median_ns * (self.sigma * rng.normal()).exp();
        // Saturating float-to-int cast; latencies are far below u64::MAX.
        x as u64
    }
}

/// The simulated network. Deterministic given its configuration, cuts,
/// generator and the sequence of calls.
#[derive(Clone, Debug)]
pub struct Net {
    agent_parent: Link,
    regional_global: Link,
    cuts: Vec<Cut>,
    /// Storms with their links precomputed.
    storms: Vec<(Storm, Link)>,
    rng: SimRng,
}

impl Net {
    /// A network with these links and cuts, drawing from `rng` (give it its
    /// own stream, e.g. `seed_rng.fork(1)`).
    pub fn new(cfg: NetConfig, cuts: Vec<Cut>, rng: SimRng) -> Net {
        Net {
            agent_parent: Link::new(&cfg.agent_parent),
            regional_global: Link::new(&cfg.regional_global),
            cuts,
            storms: Vec::new(),
            rng,
        }
    }

    /// The same network with storms: while one is on, its links behave
    /// as it says (the first storm that covers an instant wins).
    pub fn with_storms(mut self, storms: &[Storm]) -> Net {
        self.storms = storms.iter().map(|s| (*s, Link::new(&s.spec))).collect();
        self
    }

    /// The cuts this network applies.
    pub fn cuts(&self) -> &[Cut] {
        &self.cuts
    }

    /// Whether a message from `from` to `to` is dropped by a cut at `now_ns`.
    pub fn is_cut(&self, now_ns: u64, from: Node, to: Node) -> bool {
        self.cuts
            .iter()
            .any(|c| c.from_ns <= now_ns && now_ns < c.until_ns && c.kind.separates(from, to))
    }

    /// The link between two nodes: `agent_parent` for an agent and an
    /// allocator, `regional_global` for a regional and the global allocator.
    /// Other pairs (which the protocol does not use) get `agent_parent` if
    /// an agent is involved and `regional_global` otherwise.
    /// A storm on that kind of link at `now_ns` replaces it.
    fn link(&self, now_ns: u64, from: Node, to: Node) -> &Link {
        let regional_global = !(matches!(from, Node::Agent(_)) || matches!(to, Node::Agent(_)));
        if let Some((_, l)) = self.storms.iter().find(|(s, _)| {
            s.regional_global == regional_global && s.from_ns <= now_ns && now_ns < s.until_ns
        }) {
            return l;
        }
        if regional_global {
            &self.regional_global
        } else {
            &self.agent_parent
        }
    }

    /// When a message sent at `now_ns` from `from` to `to` arrives.
    ///
    /// Draws, in this order: loss, duplication, then one latency per copy.
    /// A message sent into a cut draws nothing. A copy whose arrival instant
    /// falls inside a cut is dropped.
    pub fn deliveries(&mut self, now_ns: u64, from: Node, to: Node) -> Deliveries {
        if self.is_cut(now_ns, from, to) {
            return Deliveries::NONE;
        }
        let link = *self.link(now_ns, from, to);
        if self.rng.chance(link.loss) {
            return Deliveries::NONE;
        }
        let copies = if self.rng.chance(link.duplicate) {
            2
        } else {
            1
        };
        let mut out = Deliveries::NONE;
        for _ in 0..copies {
            let at = now_ns.saturating_add(link.latency_ns(&mut self.rng));
            if !self.is_cut(at, from, to) {
                out.push(at);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(median: f64, p99: f64, loss: f64, dup: f64) -> LinkSpec {
        LinkSpec {
            median_ms: median,
            p99_ms: p99,
            loss,
            duplicate: dup,
        }
    }

    fn cfg(l: LinkSpec) -> NetConfig {
        NetConfig {
            agent_parent: l,
            regional_global: l,
        }
    }

    #[test]
    fn a_storm_replaces_its_kind_of_link_while_it_lasts() {
        let storm = Storm {
            from_ns: 10,
            until_ns: 20,
            regional_global: false,
            spec: spec(50.0, 50.0, 1.0, 0.0),
        };
        let mut net = Net::new(cfg(spec(1.0, 1.0, 0.0, 0.0)), Vec::new(), SimRng::new(1))
            .with_storms(&[storm]);
        let (a, g, r) = (Node::Agent(0), Node::Global, Node::Regional(0));
        assert_eq!(net.deliveries(5, a, g).as_slice(), &[1_000_005]);
        assert!(net.deliveries(15, a, g).is_empty(), "all lost in the storm");
        assert_eq!(net.deliveries(15, r, g).as_slice(), &[1_000_015]);
        assert_eq!(net.deliveries(20, g, a).as_slice(), &[1_000_020]);
    }

    #[test]
    fn node_names_round_trip() {
        for n in [Node::Global, Node::Regional(3), Node::Agent(299)] {
            assert_eq!(Node::parse(&n.to_string()), Ok(n));
        }
        for bad in [
            "",
            "globals",
            "region/",
            "region/x",
            "agent/-1",
            "agent/99999999999",
            "zone/1",
        ] {
            assert!(Node::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn fixed_latency() {
        let mut net = Net::new(cfg(spec(2.0, 2.0, 0.0, 0.0)), vec![], SimRng::new(1));
        let d = net.deliveries(10, Node::Agent(0), Node::Global);
        assert_eq!(d.as_slice(), &[10 + 2_000_000]);
        assert_eq!(d.into_iter().collect::<Vec<_>>(), vec![2_000_010]);
    }

    #[test]
    fn lognormal_fits_median_and_p99() {
        let mut net = Net::new(cfg(spec(1.0, 5.0, 0.0, 0.0)), vec![], SimRng::new(2));
        let mut lat: Vec<u64> = (0..100_000)
            .map(|_| {
                net.deliveries(0, Node::Agent(1), Node::Regional(0))
                    .as_slice()[0]
            })
            .collect();
        lat.sort_unstable();
        let median = lat[lat.len() / 2] as f64 / 1e6;
        let p99 = lat[lat.len() * 99 / 100] as f64 / 1e6;
        assert!((median - 1.0).abs() < 0.03, "{median}");
        assert!((p99 - 5.0).abs() < 0.3, "{p99}");
    }

    #[test]
    fn loss_and_duplication_rates() {
        let mut net = Net::new(cfg(spec(1.0, 3.0, 0.1, 0.2)), vec![], SimRng::new(3));
        let n = 100_000;
        let mut counts = [0u32; 3];
        let mut reordered = 0;
        for i in 0..n {
            let d = net.deliveries(i, Node::Regional(0), Node::Global);
            counts[d.len()] += 1;
            if d.len() == 2 && d.as_slice()[1] < d.as_slice()[0] {
                reordered += 1;
            }
        }
        let lost = f64::from(counts[0]) / n as f64;
        let dup = f64::from(counts[2]) / n as f64;
        assert!((lost - 0.1).abs() < 0.005, "{lost}");
        assert!((dup - 0.9 * 0.2).abs() < 0.005, "{dup}");
        assert!(reordered > 0);
    }

    #[test]
    fn same_seed_same_deliveries() {
        let run = |seed| {
            let mut net = Net::new(cfg(spec(1.0, 10.0, 0.05, 0.05)), vec![], SimRng::new(seed));
            (0..1000)
                .map(|i| net.deliveries(i * 1000, Node::Agent(i as u32), Node::Global))
                .collect::<Vec<_>>()
        };
        assert_eq!(run(5), run(5));
        assert_ne!(run(5), run(6));
    }

    #[test]
    fn cuts() {
        let cuts = vec![
            Cut {
                from_ns: 100,
                until_ns: 200,
                kind: CutKind::RegionFromGlobal(1),
            },
            Cut {
                from_ns: 0,
                until_ns: 1_000,
                kind: CutKind::AgentFromParent(7),
            },
            Cut {
                from_ns: 0,
                until_ns: 1_000,
                kind: CutKind::OneWay {
                    from: Node::Global,
                    to: Node::Regional(2),
                },
            },
        ];
        let net = Net::new(NetConfig::default(), cuts, SimRng::new(0));
        let (g, r1, r2) = (Node::Global, Node::Regional(1), Node::Regional(2));
        assert!(!net.is_cut(99, r1, g));
        assert!(net.is_cut(100, r1, g));
        assert!(net.is_cut(199, g, r1));
        assert!(!net.is_cut(200, g, r1));
        assert!(!net.is_cut(150, Node::Agent(3), r1));
        assert!(net.is_cut(5, Node::Agent(7), r1));
        assert!(net.is_cut(5, g, Node::Agent(7)));
        assert!(!net.is_cut(5, Node::Agent(8), r1));
        assert!(net.is_cut(5, g, r2));
        assert!(!net.is_cut(5, r2, g));
    }

    #[test]
    fn cut_at_arrival_drops_the_copy() {
        let cuts = vec![Cut {
            from_ns: 1_500_000,
            until_ns: 3_000_000,
            kind: CutKind::AgentFromParent(0),
        }];
        let mut net = Net::new(cfg(spec(2.0, 2.0, 0.0, 0.0)), cuts, SimRng::new(0));
        // Sent before the cut, arrives inside it: lost.
        assert!(net.deliveries(0, Node::Agent(0), Node::Global).is_empty());
        // Sent inside: lost.
        assert!(net
            .deliveries(2_000_000, Node::Agent(0), Node::Global)
            .is_empty());
        // Sent before, arrives after: delivered.
        let d = net.deliveries(1_100_000, Node::Agent(0), Node::Global);
        assert_eq!(d.as_slice(), &[3_100_000]);
    }

    #[test]
    fn link_spec_validation() {
        assert!(LinkSpec::default().validate().is_ok());
        assert!(spec(2.0, 1.0, 0.0, 0.0)
            .validate()
            .unwrap_err()
            .starts_with("p99_ms"));
        assert!(spec(1.0, 1.0, 1.5, 0.0)
            .validate()
            .unwrap_err()
            .starts_with("loss"));
        assert!(spec(-1.0, 1.0, 0.0, 0.0)
            .validate()
            .unwrap_err()
            .starts_with("median_ms"));
        let y: NetConfig =
            crate::scenario::from_yaml("agent_parent: { median_ms: 3, p99_ms: 9 }").unwrap();
        assert_eq!(y.agent_parent.median_ms, 3.0);
        assert_eq!(y.regional_global, LinkSpec::default());
        assert!(crate::scenario::from_yaml::<NetConfig>("agent_parent: { median: 3 }").is_err());
    }
}

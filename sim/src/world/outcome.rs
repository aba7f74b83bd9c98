//! What a run observed, as its callers read it: per-key statistics and
//! the run's [`Outcome`] with the failures it found.

use super::*;

/// Per-key observations.
#[derive(Clone, Debug)]
pub struct KeyStats {
    /// The key.
    pub key: KeyId,
    /// Rate and burst of its rule.
    pub rate: Rate,
    /// Burst.
    pub burst: u64,
    /// Fail policy of its rule.
    pub fail_policy: FailPolicy,
    /// Requests that were charged to this key (admitted or not).
    pub requests: u64,
    /// Tokens admitted.
    pub admitted: u64,
    /// Of which through emergency buckets.
    pub failure_mode_allowed: u64,
    /// Denied requests.
    pub denied: u64,
    /// Batches that carried this key, agent tier.
    pub msgs_agent_tier: u64,
    /// Batches that carried this key, regional tier.
    pub msgs_regional_tier: u64,
    /// Agents that charged this key (one bit per agent, agent `i` in word
    /// `i / 64`: `zipf-100k` keeps 100 000 of these).
    pub agents: Box<[u64]>,
    /// How many flags are set.
    pub agent_count: u32,
    /// I1 checker.
    pub checker: StreamChecker,
    /// I3 allowance: sum over emergency buckets opened of `b_e + r_e * T`
    /// (T = the whole fault window, see `i3_window_ns`), in tokens.
    pub i3_allowance: f64,
    /// What only tracked keys keep (boxed: a few keys have it, and
    /// `zipf-100k` has 100 000 keys).
    pub tracked: Option<Box<Tracked>>,
    /// The other keys (cold ones, Zipf tenants): false rejects and
    /// shortfall against an ideal bucket over their arrivals, for the
    /// per-rule table (a user's cold tenants are most of their keys).
    pub ideal: Option<FalseRejectStream>,
    /// Requests per region (demand, for fairness).
    pub per_region_requests: Box<[u64]>,
}

/// A tracked key's figures, beyond every key's.
#[derive(Clone, Debug)]
pub struct Tracked {
    /// Quality figures (false rejects, utilization), computed as the run
    /// goes.
    pub quality: KeyQuality,
    /// Admitted per second per region.
    pub per_second: Vec<Vec<u64>>,
    /// Per second: tokens requested at agents that were up, and tokens
    /// admitted `OK` (not through an emergency bucket); for liveness.
    pub live_per_second: Vec<(u64, u64)>,
}

impl KeyStats {
    /// A tracked key's quality figures.
    pub fn quality(&self) -> Option<&KeyQuality> {
        self.tracked.as_ref().map(|t| &t.quality)
    }

    /// Admitted per second per region (tracked keys; empty for the others).
    pub fn per_second(&self) -> &[Vec<u64>] {
        self.tracked.as_ref().map_or(&[], |t| &t.per_second)
    }

    /// Per second, tokens requested at agents that were up and tokens
    /// admitted `OK` (tracked keys; empty for the others).
    pub fn live_per_second(&self) -> &[(u64, u64)] {
        self.tracked.as_ref().map_or(&[], |t| &t.live_per_second)
    }

    /// False rejects, and the tokens admitted here and by one ideal bucket
    /// over the same arrivals (every key has them: tracked keys through
    /// their quality figures).
    pub fn versus_ideal(&self) -> Option<(FalseRejects, u64, u64)> {
        let (f, (ours, ideal)) = match (self.quality(), &self.ideal) {
            (Some(q), _) => (q.false_rejects(), q.versus_ideal_tokens()),
            (None, Some(s)) => (s.so_far(), s.versus_ideal()),
            (None, None) => return None,
        };
        Some((f, ours, ideal))
    }
}

/// Everything a run produced.
#[derive(Debug)]
pub struct Outcome {
    /// Scenario name (with variant).
    pub name: String,
    /// Seed.
    pub seed: u64,
    /// Simulated seconds.
    pub duration_s: f64,
    /// Warm-up seconds.
    pub warmup_s: f64,
    /// Regions (0: agents talk to the global allocator).
    pub regions: u16,
    /// Agents.
    pub agents: u32,
    /// Keys, sorted.
    pub keys: Vec<KeyStats>,
    /// Checks made.
    pub checks: u64,
    /// Messages from agents to their allocator.
    pub msgs_agent_tier: u64,
    /// Messages from regional allocators to the global one.
    pub msgs_regional_tier: u64,
    /// I2 violations seen (message, first few).
    pub i2_violations: Vec<String>,
    /// Shadow-bucket alarms raised by allocators.
    pub shadow_violations: u64,
    /// Requests answered "unavailable" (fail closed, crashed agent).
    pub unavailable: u64,
    /// How long the agents' checks waited for their answers.
    pub waits: WaitHistogram,
    /// One regional round trip, ns (the false-reject shift).
    pub round_trip_ns: u64,
    /// Length of the fault window (for I3), ns.
    pub i3_window_ns: u64,
    /// What the allocators counted, one line per node (for the report).
    pub tier_notes: Vec<String>,
    /// Judge liveness from this true time on (whole seconds), if asked.
    pub live_from_ns: Option<u64>,
    /// `TTL_max` (ns).
    pub ttl_max_ns: u64,
    /// Failover: batches a deposed leader granted (must stay 0).
    pub deposed_grants: u64,
    /// The run of [`liveness::reference`] with the same seed, when
    /// liveness is judged: what the deployment admits without the faults
    /// that heal.
    pub reference: Option<Box<Outcome>>,
}

impl Outcome {
    /// The liveness of every tracked key over `[from_ns, end)` (`from_ns`
    /// rounded up to a whole second), or why it cannot be judged (the
    /// window is shorter than [`liveness::MIN_WINDOW_TTLS`] x `TTL_max`).
    pub fn liveness_from(&self, from_ns: u64) -> Result<Vec<(String, KeyLiveness)>, String> {
        let from_s = from_ns.div_ceil(SEC);
        let end_s = (self.duration_s * SEC as f64) as u64 / SEC;
        let window_ns = end_s.saturating_sub(from_s) * SEC;
        if window_ns < liveness::MIN_WINDOW_TTLS * self.ttl_max_ns {
            return Err(format!(
                "liveness not judged: the window from {from_s} s to {end_s} s is shorter than {} x TTL_max",
                liveness::MIN_WINDOW_TTLS
            ));
        }
        Ok(self
            .keys
            .iter()
            .filter(|k| k.tracked.is_some())
            .map(|k| {
                let window = |k: &KeyStats| {
                    let (mut req, mut ok) = (0, 0);
                    for &(r, a) in k
                        .live_per_second()
                        .iter()
                        .take(end_s as usize)
                        .skip(from_s as usize)
                    {
                        req += r;
                        ok += a;
                    }
                    (req, ok)
                };
                let (req, ok) = window(k);
                let reference = self.reference.as_ref().map(|r| {
                    r.keys
                        .binary_search_by(|x| x.key.cmp(&k.key))
                        .map_or(0, |i| window(&r.keys[i]).1)
                });
                let name = format!("{}/{}/{}", k.key.rule(), k.key.tenant(), k.key.route());
                (name, liveness::judge(req, ok, k.rate, window_ns, reference))
            })
            .collect())
    }

    /// Liveness failures over the scenario's judged window (none if the
    /// scenario does not ask for liveness).
    fn liveness_failures(&self) -> Vec<String> {
        let Some(from) = self.live_from_ns else {
            return Vec::new();
        };
        match self.liveness_from(from) {
            Err(why) => vec![format!("liveness: {why}")],
            Ok(keys) => keys
                .into_iter()
                .filter(|(_, l)| !l.held())
                .map(|(name, l)| {
                    format!(
                        "liveness: key {name}: {} of a target of {:.0} tokens admitted from {:.0} s ({:.1}% < {:.0}%)",
                        l.admitted,
                        l.target,
                        (from as f64 / SEC as f64).ceil(),
                        l.ratio * 100.0,
                        liveness::THRESHOLD * 100.0
                    )
                })
                .collect(),
        }
    }

    /// I1 held for every key whose rule is `closed` or `lease_only`, and
    /// I3 for every `open` key; I2 held at every step.
    pub fn failures(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .i2_violations
            .iter()
            .map(|v| format!("I2: {v}"))
            .collect();
        if self.deposed_grants > 0 {
            out.push(format!(
                "fencing: a deposed leader granted {} batch(es) after its successor was elected",
                self.deposed_grants
            ));
        }
        if self.shadow_violations > 0 {
            out.push(format!(
                "shadow bucket alarms: {} (a grant the independent bucket says breaks I1)",
                self.shadow_violations
            ));
        }
        for k in &self.keys {
            let w = k.checker.worst();
            match k.fail_policy {
                FailPolicy::Open => {
                    if w.excess as f64 > k.i3_allowance.ceil() {
                        out.push(format!(
                            "I3: key {}/{}/{}: excess {} > allowance {:.0} (window {}..{} ns)",
                            k.key.rule(),
                            k.key.tenant(),
                            k.key.route(),
                            w.excess,
                            k.i3_allowance,
                            w.from_ns,
                            w.to_ns
                        ));
                    }
                }
                _ => {
                    if !w.held() {
                        out.push(format!(
                            "I1: key {}/{}/{}: {} admitted in [{}, {}] ns, {} over B + R*T",
                            k.key.rule(),
                            k.key.tenant(),
                            k.key.route(),
                            w.admitted,
                            w.from_ns,
                            w.to_ns,
                            w.excess
                        ));
                    }
                }
            }
        }
        out.extend(self.liveness_failures());
        out
    }
}

/// The worst window of a key, for reports.
pub fn worst(k: &KeyStats) -> Worst {
    k.checker.worst()
}

//! What the world watches while it runs and how it sums up: the keys a
//! tenant's requests charge and their checkers, the emergency buckets
//! opened (I3's allowance), I2 at the global allocator, and the outcome at
//! the end.

use super::*;

impl World {
    pub(super) fn note_emergency(&mut self, key: &KeyId, rate: Rate, burst: u64) {
        if let Some(k) = self.key_index.get(&self.keys, key.as_key_ref()) {
            let t_s = self.fault_window_ns as f64 / SEC as f64;
            let r_per_s = rate.tokens as f64 / rate.period_s as f64;
            self.keys[k].i3_allowance += burst as f64 + r_per_s * t_s;
        }
    }

    /// The slot of the keys a tenant's requests on a route charge (cached).
    pub(super) fn tenant_keys(&mut self, tenant: u32, route_idx: u16) -> usize {
        if let Some(&slot) = self.tenants.get(&(tenant, route_idx)) {
            return slot;
        }
        let name = tenant_name(tenant);
        let route = self.workload.route(route_idx).to_string();
        let idx = Agent::charged_rules(&self.rules, None, &name, &route).unwrap_or_default();
        let mut keys = Vec::with_capacity(idx.len());
        for ri in idx {
            let rule = &self.rules.rules[ri];
            let key = KeyId::new(
                &rule.id,
                rule.tenant.key_part(&name),
                rule.route.key_part(&route),
            );
            let k = match self.key_index.get(&self.keys, key.as_key_ref()) {
                Some(k) => k,
                None => {
                    let k = self.keys.len();
                    let tracked = self.tracked_tenants.contains(&tenant) || key.tenant().is_empty();
                    self.keys.push(KeyStats {
                        key: key.clone(),
                        rate: rule.rate,
                        burst: rule.burst,
                        fail_policy: rule.fail_policy,
                        requests: 0,
                        admitted: 0,
                        failure_mode_allowed: 0,
                        denied: 0,
                        msgs_agent_tier: 0,
                        msgs_regional_tier: 0,
                        agents: vec![0; self.agents.len().div_ceil(64)].into_boxed_slice(),
                        agent_count: 0,
                        checker: self.checker_for(&rule.id, rule.rate, rule.burst),
                        i3_allowance: 0.0,
                        tracked: tracked.then(|| {
                            Box::new(Tracked {
                                quality: KeyQuality::new(
                                    rule.rate,
                                    rule.burst,
                                    self.sc.regional_round_trip_ns(),
                                    (self.sc.warmup_s * SEC as f64) as u64,
                                    (self.sc.duration_s * SEC as f64) as u64,
                                    10 * self.sc.ttl_max_ms * 1_000_000,
                                ),
                                per_second: Vec::new(),
                                live_per_second: Vec::new(),
                            })
                        }),
                        ideal: (!tracked).then(|| {
                            FalseRejectStream::new(
                                rule.rate,
                                rule.burst,
                                self.sc.regional_round_trip_ns(),
                            )
                            .without_series()
                        }),
                        per_region_requests: vec![0; usize::from(self.sc.regions.max(1))]
                            .into_boxed_slice(),
                    });
                    self.key_index.insert(key.as_key_ref(), k);
                    k
                }
            };
            keys.push(k);
        }
        let slot = self.tenant_slots.len();
        self.tenant_slots.push((name, keys));
        self.tenants.insert((tenant, route_idx), slot);
        slot
    }

    /// An I1 checker for a key of rule `id` (now at `rate` and `burst`)
    /// first seen now: the rule as it started, with every change published
    /// so far (one still lagging counts for this key too).
    pub(super) fn checker_for(&self, id: &str, rate: Rate, burst: u64) -> StreamChecker {
        let lag = self.sc.rule_change_lag_ns();
        let changes: Vec<&(u64, RuleChange)> = self
            .rule_history
            .iter()
            .filter(|(_, c)| c.rule == id)
            .collect();
        let Some(first) = changes.first() else {
            return StreamChecker::new(rate, burst);
        };
        let (r0, b0) = first.1.old;
        let mut c = StreamChecker::new(r0, b0);
        for (at, ch) in changes {
            c.change(*at, lag, ch.rate, ch.burst);
        }
        c
    }

    pub(super) fn finish(self) -> Outcome {
        let shadow_violations = self
            .global
            .core
            .as_ref()
            .map(|c| c.stats().shadow_violations.values().sum())
            .unwrap_or(0);
        let mut tier_notes = Vec::new();
        if let Some(c) = self.global.core.as_ref() {
            let s = c.stats();
            tier_notes.push(format!(
                "global: {} batches, {} grants, {} tokens granted, {} carried, {} released, {} expired unused, {} duplicates, {} stale",
                s.messages, s.grants, s.tokens_granted, s.tokens_carried, s.tokens_released, s.tokens_expired_unused, s.duplicates, s.stale
            ));
        }
        for (r, n) in self.regionals.iter().enumerate() {
            if let Some(c) = n.core.as_ref() {
                let s = c.stats();
                tier_notes.push(format!(
                    "region {r}: {} upstream batches ({} heartbeats, {} failed), {} tokens from the parent, {} returned, {} handed back, {} destroyed, {} chain breaks, {} chains lapsed; walks visited {} keys and passed {} by",
                    s.upstream_messages, s.upstream_heartbeats, s.upstream_failures, s.tokens_from_parent, s.tokens_returned, s.tokens_handed_back, s.tokens_destroyed, s.chain_breaks, s.chains_lapsed, s.walk_keys_planned, s.walk_keys_skipped
                ));
            }
        }
        let mut keys = self.keys;
        for k in &mut keys {
            if let Some(t) = k.tracked.as_mut() {
                t.quality.finish();
            }
            if let Some(f) = k.ideal.as_mut() {
                f.finish();
            }
        }
        // Keys are distinct: the unstable sort gives the same order, in
        // place (a stable one takes scratch of half the records, at the end
        // of a run when every part of the world is still held).
        keys.sort_unstable_by(|a, b| a.key.cmp(&b.key));
        if let Some(f) = &self.failover {
            tier_notes.push(format!("replicas: {}", f.summary()));
        }
        let rtt = self.sc.regional_round_trip_ns();
        Outcome {
            name: self.sc.name.clone(),
            seed: self.seed,
            duration_s: self.sc.duration_s,
            warmup_s: self.sc.warmup_s,
            regions: self.sc.regions,
            agents: self.agents.len() as u32,
            keys,
            checks: self.checks,
            msgs_agent_tier: self.msgs_agent_tier,
            msgs_regional_tier: self.msgs_regional_tier,
            i2_violations: self.i2_violations,
            shadow_violations,
            unavailable: self.unavailable,
            waits: self.waits,
            round_trip_ns: rtt,
            i3_window_ns: self.fault_window_ns,
            tier_notes,
            live_from_ns: self.sc.liveness.then(|| self.sc.live_from_ns()),
            ttl_max_ns: self.sc.ttl_max_ms * 1_000_000,
            deposed_grants: self.failover.as_ref().map_or(0, |f| f.deposed_grants),
            reference: None,
        }
    }
}

/// The window of I3's allowance: from the first fault to the end of the
/// last one (one that never ends lasts to the end), plus `TTL_max`.
pub(super) fn fault_window_ns(sc: &Scenario) -> u64 {
    let end = sc.duration_ns();
    let spans: Vec<(u64, u64)> = sc
        .fault_spans()
        .into_iter()
        .map(|(from, until)| (from, until.unwrap_or(end)))
        .collect();
    let Some(first) = spans.iter().map(|s| s.0).min() else {
        return 0;
    };
    let last = spans.iter().map(|s| s.1).max().unwrap_or(first);
    (last - first).min(end) + sc.ttl_max_ms * 1_000_000
}

/// I2 for the keys a batch touched, at the global allocator.
pub(super) fn check_i2_core(
    core: &mut AllocatorCore,
    now: u64,
    batch: &LeaseBatch,
    out: &mut Vec<String>,
    t: u64,
) {
    for item in &batch.items {
        let key = KeyId::new(&item.rule_id, &item.tenant, &item.route);
        if core.i2_holds(now, &key) == Some(false) && out.len() < 10 {
            out.push(format!(
                "global allocator at t={t} ns, key {key:?}: available + outstanding > B"
            ));
        }
    }
}

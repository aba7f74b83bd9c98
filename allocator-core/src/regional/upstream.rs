//! The upstream side: what the regional asks its parent for (each key's
//! plan over the chains it holds), and the batches it sends.

use super::*;

impl RegionalCore {
    /// The next batch for the parent, or `None`: renewals of due chains
    /// (with `spent = G - H`), requests for new chains where children wait,
    /// releases of idle chains, or a heartbeat. At most one batch is in
    /// flight; every batch has a new, higher `seq`. A heartbeat in flight
    /// (no items) is superseded by a batch that opens a key a child waits
    /// for: its reply, when it comes, is ignored (it asked for nothing);
    /// a driver polls while a heartbeat is out when a child waits
    /// ([`RegionalCore::heartbeat_in_flight`]).
    pub fn poll_transmit(&mut self, now_ns: u64) -> Option<LeaseBatch> {
        self.update_reachable(now_ns);
        self.core.set_parent_unreachable(!self.reachable);
        self.lapse_chains(now_ns);
        // Keys the children created since the last poll.
        for key in self.core.take_new_keys() {
            self.keys.entry(key.clone()).or_insert_with(|| {
                Box::new(KeyState {
                    sample_ns: now_ns,
                    ..KeyState::default()
                })
            });
            self.wanting.push(key);
        }
        // Keys a child's item named since: the next walk visits them.
        for key in self.core.take_touched_keys() {
            if let Some(ks) = self.keys.get_mut(&key) {
                ks.due_ns = 0;
            }
        }
        // The throttle: plans that are not urgent go out once per renew
        // interval, with the walk over every key.
        let throttled = self
            .last_walk_ns
            .is_some_and(|t| now_ns < t.saturating_add(self.cfg.renew_interval_ns));
        let held_back = self.stopping || now_ns < self.not_before_ns;
        self.tend_slot_chains(now_ns);
        // Slot asks in a batch of their own when nothing is in flight;
        // the walk over the token chains goes first when it is due and
        // the last batch was one of slot asks (and the slot asks right
        // after it when it sends nothing).
        let slots_may = self.in_flight.is_none() && !held_back;
        let slots_first = throttled || !self.last_batch_slots;
        if slots_may && slots_first {
            if let Some(b) = self.poll_slots(now_ns) {
                self.last_batch_slots = true;
                return Some(b);
            }
        }
        let tokens = self.poll_tokens(now_ns, throttled, held_back);
        if tokens.is_none() && slots_may && !slots_first && self.in_flight.is_none() {
            if let Some(b) = self.poll_slots(now_ns) {
                self.last_batch_slots = true;
                return Some(b);
            }
        }
        tokens
    }

    /// The token chains' part of [`RegionalCore::poll_transmit`].
    fn poll_tokens(&mut self, now_ns: u64, throttled: bool, held_back: bool) -> Option<LeaseBatch> {
        // A key opened while a heartbeat was out waited a whole round trip
        // for it (a third of the openings behind a regional holding chains
        // at 75 ms from its parent; `small-burst-few`: the region whose
        // first poll was a heartbeat opened the hot key a round trip after
        // the others and got what their rates left, most of the run's
        // false rejects).
        let supersede = !held_back && self.heartbeat_in_flight() && !self.wanting.is_empty();
        let blocked = (self.in_flight.is_some() && !supersede) || held_back;
        let must_walk = !supersede && (self.walk_all || self.walked_reachable != self.reachable);
        let prev_walk_ns = self.last_walk_ns;
        // Within the throttle only urgent plans go out, and only a key a
        // child found without tokens can be urgent: plan just those and the
        // keys the last upstream answer named (their chains and retry times
        // changed, so their pools' hints for children). Every key once per
        // renew interval (renewals ahead of the deadline, reports,
        // releases: the walk waits for a batch in flight to be answered)
        // and when reachability changed (every pool's hints, at once).
        let plans = if (throttled || supersede) && !must_walk {
            if blocked {
                // Nothing can go out; the answer in flight plans its keys.
                return None;
            }
            let mut keys = std::mem::take(&mut self.wanting);
            keys.sort_unstable();
            keys.dedup();
            self.plan_keys(now_ns, prev_walk_ns, &keys)
        } else if blocked && !must_walk {
            return None;
        } else {
            if !blocked {
                self.wanting.clear();
                self.last_walk_ns = Some(now_ns);
            }
            // Every key when reachability (and with it every pool's hints)
            // may have changed; otherwise the keys that are due.
            let all = must_walk;
            self.walk_all = false;
            self.walked_reachable = self.reachable;
            self.plan(now_ns, prev_walk_ns, all)
        };
        if blocked {
            return None;
        }
        let urgent = plans.iter().any(|(_, p)| {
            matches!(
                p,
                Plan::Open { urgent: true, .. } | Plan::Renew { urgent: true, .. }
            )
        });
        let mut items = Vec::new();
        let mut sent = Vec::new();
        let mut forget = Vec::new();
        for (key, plan) in plans {
            match plan {
                Plan::Nothing => {}
                Plan::Forget => forget.push(key),
                _ if (throttled || supersede) && !urgent => {}
                Plan::Open {
                    want, want_rate, ..
                } => {
                    let mut item = self.item(&key, ItemKind::Renew, 0, 0, want);
                    item.want_rate_utps = want_rate;
                    items.push(item);
                    sent.push(SentItem {
                        key,
                        release: false,
                        chain_serial: None,
                        carry_asked: 0,
                        asked_rate_utps: want_rate,
                    });
                }
                Plan::Renew {
                    want, want_rate, ..
                } => {
                    let h = self.holding(now_ns, &key);
                    let c = self.keys[&key].chain.clone().expect("planned for a chain");
                    let mut carry_asked = 0;
                    let mut handed_back = 0;
                    let mut item = if c.is_rate() {
                        // A rate chain names the version it acknowledges;
                        // spent reports mean nothing for it.
                        if let Some(c) = self.keys.get_mut(&key).and_then(|k| k.chain.as_mut()) {
                            // Naming a newer version: what its shrink did
                            // not fit goes back with it (the parent credits
                            // it as the older versions stop counting,
                            // once).
                            if c.told_ack_id != c.ack_id {
                                handed_back = std::mem::take(&mut c.returnable);
                            }
                            c.told_ack_id = c.ack_id;
                            if c.ack_id == c.parent_lease_id {
                                // Only the newest version is counted now
                                // (and the one this renewal brings).
                                c.counted_capacity = c.capacity;
                                c.counted_rate_utps = c.rate_utps;
                                c.unnamed_tokens = false;
                            }
                        }
                        self.item(&key, ItemKind::Renew, c.ack_id, 0, want)
                    } else {
                        let spent = c.granted.saturating_sub(h);
                        carry_asked = c.granted - spent;
                        self.item(&key, ItemKind::Renew, c.parent_lease_id, spent, want)
                    };
                    item.want_rate_utps = want_rate;
                    item.left = handed_back;
                    self.stats.tokens_handed_back += handed_back;
                    items.push(item);
                    sent.push(SentItem {
                        key,
                        release: false,
                        chain_serial: Some(c.serial),
                        carry_asked,
                        asked_rate_utps: want_rate,
                    });
                }
                Plan::Release => {
                    self.release_into(now_ns, key, &mut items, &mut sent);
                }
            }
        }
        for key in forget {
            self.keys.remove(&key);
            self.core.remove_key(&key);
        }
        let heartbeat = items.is_empty()
            && match self.last_sent_ns {
                None => true,
                Some(t) if !self.rules_known || self.last_failed => {
                    now_ns >= t.saturating_add(self.cfg.renew_interval_ns)
                }
                Some(t) => {
                    let every = if self.chain_deadlines.is_empty() {
                        HEARTBEAT_NS
                    } else {
                        HEARTBEAT_HOLDING_NS
                    };
                    now_ns >= t.saturating_add(every)
                }
            };
        if items.is_empty() && (!heartbeat || supersede) {
            return None;
        }
        if supersede {
            tracing::debug!(
                seq = self.seq,
                "a heartbeat in flight superseded by an opening"
            );
            self.stats.upstream_heartbeats_superseded += 1;
        }
        Some(self.send(now_ns, items, sent))
    }

    pub(super) fn item(
        &self,
        key: &KeyId,
        kind: ItemKind,
        lease_id: u64,
        spent: u64,
        want: u64,
    ) -> LeaseItem {
        LeaseItem {
            rule_id: key.rule().to_string(),
            tenant: key.tenant().to_string(),
            route: key.route().to_string(),
            kind: kind as i32,
            lease_id,
            spent,
            want,
            ..LeaseItem::default()
        }
    }

    /// The release of `key`'s chain, if it has one, added to a batch's
    /// `items` and what was `sent`.
    pub(super) fn release_into(
        &mut self,
        now_ns: u64,
        key: KeyId,
        items: &mut Vec<LeaseItem>,
        sent: &mut Vec<SentItem>,
    ) {
        if let Some(item) = self.release_item(now_ns, &key) {
            items.push(item);
            sent.push(SentItem {
                key,
                release: true,
                chain_serial: None,
                carry_asked: 0,
                asked_rate_utps: 0,
            });
        }
    }

    /// Release the chain of `key`: the pool goes back to the parent (spent
    /// = `G - pool`, which is `G - H` since nothing is sub-leased, or
    /// counts what is still sub-leased as spent otherwise — never used
    /// then, see `shutdown`); the chain ends here.
    pub(super) fn release_item(&mut self, now_ns: u64, key: &KeyId) -> Option<LeaseItem> {
        let ks = self.keys.get_mut(key)?;
        let c = ks.chain.take()?;
        let ledger = self.core.ledger_mut(key)?;
        let pool = ledger.drain_pool(now_ns);
        ledger.set_pool(PoolTerm::Deadline(0));
        debug_assert_eq!(
            ledger.outstanding(),
            0,
            "released only with nothing sub-leased"
        );
        ks.sample_h = ks.sample_h.saturating_sub(pool);
        self.stats.tokens_returned += pool;
        if c.is_rate() {
            // Every version up to the newest stops counting; the pool goes
            // back, with what a shrink did not fit and was not handed back
            // yet (the versions that counted it count until now).
            let mut item = self.item(key, ItemKind::Release, c.parent_lease_id, 0, 0);
            item.left = pool + c.returnable;
            self.stats.tokens_handed_back += c.returnable;
            return Some(item);
        }
        let spent = c.granted.saturating_sub(pool);
        Some(self.item(key, ItemKind::Release, c.parent_lease_id, spent, 0))
    }

    pub(super) fn send(
        &mut self,
        now_ns: u64,
        items: Vec<LeaseItem>,
        sent: Vec<SentItem>,
    ) -> LeaseBatch {
        self.seq += 1;
        self.stats.upstream_messages += 1;
        // What a child named, once; else the parent's ledger and run.
        let (ledger_id, (run_id, record_seq), ledger_cluster) =
            match std::mem::take(&mut self.child_ledger_id) {
                0 => (
                    self.parent_ledger_id,
                    self.parent_run,
                    self.parent_cluster.clone(),
                ),
                theirs => (
                    theirs,
                    std::mem::take(&mut self.child_run),
                    std::mem::take(&mut self.child_ledger_cluster),
                ),
            };
        self.stats.upstream_items += items.len() as u64;
        if items.is_empty() {
            self.stats.upstream_heartbeats += 1;
        }
        self.last_sent_ns = Some(now_ns);
        self.last_batch_slots = false;
        let batch = LeaseBatch {
            header: Some(RequestHeader {
                agent_id: self.agent_id.clone(),
                incarnation: self.incarnation,
                seq: self.seq,
                protocol_version: PROTOCOL_VERSION,
                rules_version: if self.rules_known {
                    self.core.rules().version
                } else {
                    0
                },
                instance: self.cfg.instance,
                ledger_id,
                run_id,
                record_seq,
                // Its children's cluster is its own: one check at each tier.
                cluster: self.cfg.core.cluster.clone(),
                ledger_cluster,
            }),
            items,
            ttl_ms: self.cfg.lease_ttl_ns / MS,
            shard: 0,
        };
        let mut batch = batch;
        self.in_flight = Some(self.in_flight_of(&mut batch, now_ns, sent));
        batch
    }

    /// What is remembered of `batch` sent at `now_ns` until its answer.
    pub(super) fn in_flight_of(
        &self,
        batch: &mut LeaseBatch,
        now_ns: u64,
        sent: Vec<SentItem>,
    ) -> InFlight {
        let (digest, digest_v3, digest_v2) = quotalease_proto::request_digests(batch);
        InFlight {
            seq: batch.header.as_ref().map_or(0, |h| h.seq),
            digest,
            digest_v3,
            digest_v2,
            sent_ns: now_ns,
            items: sent,
            slots: Vec::new(),
            batch: None,
            tries: 0,
        }
    }

    pub(super) fn holding(&mut self, now_ns: u64, key: &KeyId) -> u64 {
        self.core.ledger_mut(key).map_or(0, |l| l.holding(now_ns))
    }

    /// Decide per key (sorted): sample consumption, then whether to open,
    /// renew, release or forget. `all`: every key; otherwise the keys that
    /// are due (`KeyState::due_ns`) or that a child or the parent named
    /// since their last visit. `prev_walk_ns`: the walk before this one.
    fn plan(&mut self, now_ns: u64, prev_walk_ns: Option<u64>, all: bool) -> Vec<(KeyId, Plan)> {
        let ctx = self.plan_ctx(prev_walk_ns);
        let mut out = Vec::new();
        for (key, ks) in self.keys.iter_mut() {
            if !all && ks.due_ns > now_ns {
                self.stats.walk_keys_skipped += 1;
                continue;
            }
            self.stats.walk_keys_planned += 1;
            if let Some(plan) = plan_key(&ctx, &mut self.core, now_ns, key, ks) {
                out.push((key.clone(), plan));
            }
        }
        // Each key's plan is its own; the batch goes out in key order
        // (whatever the hash order: the simulator replays exactly).
        out.sort_unstable_by(|(a, _), (b, _)| a.cmp(b));
        out
    }

    /// [`RegionalCore::plan`] for these keys only (sorted, distinct).
    fn plan_keys(
        &mut self,
        now_ns: u64,
        prev_walk_ns: Option<u64>,
        keys: &[KeyId],
    ) -> Vec<(KeyId, Plan)> {
        let ctx = self.plan_ctx(prev_walk_ns);
        let mut out = Vec::new();
        for key in keys {
            let Some(ks) = self.keys.get_mut(key) else {
                continue;
            };
            if let Some(plan) = plan_key(&ctx, &mut self.core, now_ns, key, ks) {
                out.push((key.clone(), plan));
            }
        }
        out
    }

    fn plan_ctx(&self, prev_walk_ns: Option<u64>) -> PlanCtx {
        let cfg = &self.cfg;
        // A child the pool cannot serve comes back when the next upstream
        // answer can be in: about two round trips when the regional may
        // ask now (it is woken by that child), at least MIN_CHILD_RETRY_MS,
        // at most one renew interval; later if the parent said so.
        let rtt_ms = (2 * self.rtt_ns).div_ceil(MS).clamp(
            MIN_CHILD_RETRY_MS,
            cfg.renew_interval_ns.div_ceil(MS).max(MIN_CHILD_RETRY_MS),
        );
        PlanCtx {
            window: cfg.core.active_window_ns,
            idle_ns: cfg.idle_release_ns(),
            // A renewal ahead of the deadline must be answered before it:
            // planned at least two walks and two round trips early. (At a low
            // water of 100 ms, a parent 15-40 ms away and walks held back
            // while a batch is out, renewals planned 20 ms before the
            // deadline came back after it: the chain lapsed under its
            // children, who had to open the key again.)
            ahead_ns: cfg
                .low_water_ns
                .max(2 * (cfg.renew_interval_ns + self.rtt_ns)),
            // The same lead at the longest round trip an answer can take
            // (a later one is a failure, after which every key is walked).
            ahead_max_ns: cfg
                .low_water_ns
                .max(2 * (cfg.renew_interval_ns + self.rtt_ns.max(cfg.fetch_timeout_ns))),
            renew_interval_ns: cfg.renew_interval_ns,
            low_water_s: cfg.low_water_ns as f64 / 1e9,
            horizon_s: (2 * cfg.low_water_ns + cfg.renew_interval_ns) as f64 / 1e9,
            rtt_ms,
            reachable: self.reachable,
            rate_leases: cfg.rate_leases,
            prev_walk_ns,
        }
    }
}

/// What [`plan_key`] needs of the regional's settings and state.
struct PlanCtx {
    window: u64,
    idle_ns: u64,
    ahead_ns: u64,
    /// `ahead_ns` at the longest round trip (`fetch_timeout`).
    ahead_max_ns: u64,
    renew_interval_ns: u64,
    low_water_s: f64,
    horizon_s: f64,
    rtt_ms: u64,
    reachable: bool,
    rate_leases: bool,
    /// When the walk before this one was (None: this is the first).
    prev_walk_ns: Option<u64>,
}

/// Plan one key (None: nothing to do); also samples its consumption and
/// sets its pool's hints for children.
fn plan_key(
    ctx: &PlanCtx,
    core: &mut AllocatorCore,
    now_ns: u64,
    key: &KeyId,
    ks: &mut KeyState,
) -> Option<Plan> {
    let Some(ledger) = core.ledger_mut(key) else {
        return ks.chain.is_none().then_some(Plan::Forget);
    };
    ledger.untouch();
    let h = ledger.holding(now_ns);
    // What a rate lease refilled joined H as a deposit does.
    ks.sample_h = ks.sample_h.saturating_add(ledger.take_refilled());
    // A key the walks passed by (not due, named by no child) had nothing
    // taken from H by a child since its last visit: each walk would have
    // sampled 0. Folded in as one sample up to the walk before this one
    // (exactly what those samples of 0 give an EWMA), so what children
    // took since is sampled over one walk's time, as when every walk
    // visited every key. (Sub-leases that expired unrenewed meanwhile
    // count at this visit instead of at the walk after their expiry.)
    if let Some(prev) = ctx.prev_walk_ns {
        if prev >= ks.sample_ns.saturating_add(ctx.renew_interval_ns.max(1)) && prev <= now_ns {
            ks.sample(0, (prev - ks.sample_ns) as f64 / 1e9);
            ks.sample_ns = prev;
        }
    }
    // Consumption estimate: what left H since the last sample.
    let dt = now_ns.saturating_sub(ks.sample_ns);
    if dt >= ctx.renew_interval_ns.max(1) {
        ks.sample(ks.sample_h.saturating_sub(h), dt as f64 / 1e9);
        ks.sample_h = h;
        ks.sample_ns = now_ns;
    }
    let pool = ledger.available();
    let outstanding = ledger.outstanding();
    let unmet = ledger.unmet_demand(now_ns, ctx.window);
    let burst = ledger.burst();
    // A key served centrally (docs/protocol.md "Slow rules, served
    // centrally") asks for what its children wait for, nothing ahead and
    // no rate, and gives back what is left once no child waits.
    let central = ledger.rate().served_centrally();
    let (low, target) = if central {
        (0, 0)
    } else {
        (
            (ks.consumption() * ctx.low_water_s).ceil() as u64,
            (ks.consumption() * ctx.horizon_s).ceil() as u64,
        )
    };
    let want = unmet.saturating_add(target).saturating_sub(pool).min(burst);
    let idle = now_ns.saturating_sub(ledger.last_used_ns()) >= ctx.idle_ns;
    let may_ask = now_ns >= ks.retry_at_ns;
    ledger.set_pool(PoolTerm::ParentDry(!may_ask));
    // The rate to ask for: what the children consume, with room to grow;
    // twice the current rate while children miss tokens; what they ask
    // for now, spread over the consumption estimate's time constant (what
    // the estimate will say after one sample of it: a key the region does
    // not hold yet has no estimate). At most the rule's rate. Spread over
    // a low-water time instead, one request of a cold key asked for the
    // whole rate of a 10/s rule, and with it the whole burst as capacity,
    // counted at the parent until the chain shrank while the key's other
    // region found no room (300 cold tenants of the demo's shape: 18-57 %
    // of their checks denied, where an ideal bucket denies none).
    let rule_tps = ledger.rate().tokens as f64 / ledger.rate().period_s.max(1) as f64;
    let want_rate = if ctx.rate_leases && !central {
        let current = ks.chain.as_ref().map_or(0.0, |c| c.rate_utps as f64 / 1e6);
        let grow = if unmet > 0 { 2.0 * current } else { 0.0 };
        let asked = unmet as f64 / EWMA_TAU_S;
        let tps = (ks.consumption() * RATE_HEADROOM)
            .max(grow)
            .max(asked)
            .min(rule_tps);
        ((tps * 1e6) as u64).max(1)
    } else {
        0
    };
    if let Some(c) = ks.chain.as_mut().filter(|c| c.is_rate()) {
        // What the region holds fits under the newest version now: the
        // next renewal acknowledges it, and sub-leases may live as long.
        if c.ack_id != c.parent_lease_id && outstanding <= c.capacity {
            c.ack_id = c.parent_lease_id;
            c.ack_capacity = c.capacity;
            c.ack_deadline_ns = c.deadline_ns;
            ledger.set_pool(PoolTerm::Deadline(c.deadline_ns));
        }
    }
    let plan = match &ks.chain {
        None if unmet > 0 && may_ask => Plan::Open {
            want: want.max(1),
            want_rate,
            urgent: true,
        },
        None if idle && outstanding == 0 && pool == 0 => Plan::Forget,
        None => Plan::Nothing,
        Some(_) if idle && outstanding == 0 => Plan::Release,
        // Served centrally: given back once no child waits; a rate chain
        // (the key was leased before a rule change) at once when nothing
        // is sub-leased: its capacity, counted at the parent, may be the
        // whole burst, refilled by a rate of 0 once the key asks none.
        Some(c) if central && (unmet == 0 || c.is_rate()) && outstanding == 0 => Plan::Release,
        Some(c) if c.is_rate() => {
            let ahead = c.deadline_ns.saturating_sub(now_ns) <= ctx.ahead_ns && !idle;
            let short = may_ask && want > 0 && unmet > pool;
            // The rate asked for moved by more than a quarter (a share
            // freed or needed), or a shrink waits to be acknowledged.
            // Not downwards while the rate held is the parent's floor: it
            // answers a smaller ask with the same rate (a cold key asking
            // 0.5/s of a 50/s rule behind three regions, `zipf-100k` at
            // scale 0.25, got 4.2/s back and renewed on every walk to ask
            // again: nine in ten of the regionals' plans). Once per active
            // window it asks again (see `Chain::floored_until_ns`).
            let floor_held = now_ns < c.floored_until_ns && want_rate <= c.rate_utps;
            let moved =
                !floor_held && want_rate.abs_diff(c.rate_utps) > c.rate_utps / 4 + 1_000_000;
            // Below nine tenths of an equal share of the holders the
            // parent named while children miss tokens, a larger rate is
            // asked for without waiting out the parent's retry hint: that
            // hint is about the bucket's tokens (none while the rates are
            // lent), not about the rate another holder's renewal frees.
            // Waiting it out, a region that opened a key at 375/s sat there
            // 250 ms while its children asked for 37 000/s
            // (small-burst-below-rate: most false rejects were in that
            // first second); at a quarter of a share (session 14) one that
            // got 9 990/s of 20 000 sat there as long (seed 7). At an equal
            // share (max-min gives every holder that asks more at least
            // that, 19 980/s of 20 000 once rho is taken) the hint holds,
            // so an overloaded key does not renew every walk.
            let starved = unmet > 0
                && ks.parent_holders > 0
                && want_rate > c.rate_utps
                && (c.rate_utps as f64 / 1e6) * f64::from(ks.parent_holders) < 0.9 * rule_tps;
            // The parent counts the older versions until told: a shrink
            // (of capacity, or of rate once the newest version is the one
            // acknowledged) is told at once, a version that brought tokens
            // (counted on top of its capacity until named) at the next
            // walk; a grown or equal version without tokens waits for the
            // next renewal. What a shrink frees is another holder's share:
            // told at the next walk, a region that opened a key late got
            // half its share for another round trip
            // (small-burst-below-rate seed 7).
            let untold = c.ack_id != c.told_ack_id;
            let shrink = untold
                && (c.counted_capacity > c.capacity.max(c.ack_capacity)
                    || (c.ack_id == c.parent_lease_id && c.counted_rate_utps > c.rate_utps));
            let ack = shrink || (untold && c.unnamed_tokens);
            if ahead || short || (moved && (may_ask || starved)) || ack {
                Plan::Renew {
                    want: if may_ask && short { want } else { 0 },
                    want_rate,
                    urgent: shrink || (unmet > 0 && pool == 0 && may_ask),
                }
            } else {
                Plan::Nothing
            }
        }
        Some(c) => {
            let ahead = c.deadline_ns.saturating_sub(now_ns) <= ctx.ahead_ns && !idle;
            let short = may_ask && want > 0 && (unmet > pool || pool < low);
            // Spending the parent does not know of yet keeps its
            // bucket from refilling (refill is capped at
            // B - outstanding): report it (at most once per renew
            // interval, even while told to wait for new tokens)
            // once it is a useful part of B.
            let report = c.granted.saturating_sub(h) >= (burst / 32).max(1);
            if ahead || short || report {
                Plan::Renew {
                    want: if may_ask { want } else { 0 },
                    want_rate,
                    urgent: unmet > 0 && pool == 0 && may_ask,
                }
            } else {
                Plan::Nothing
            }
        }
    };
    // Children's pool hint: until the next upstream answer can be in: the
    // parent's retry hint and a round trip beyond it. A pool that has no
    // rate yet (no chain, or a first version with a capacity and rate 0)
    // grows only by that answer, so when this walk asks the parent (an
    // open, or a renewal that goes out despite the hint: `starved`,
    // `ack`, `ahead`) its children are told one round trip: told the
    // parent's hint as well, the hundred agents of a region whose first
    // grant was a capacity without a rate waited 300 ms, none came back
    // when the renewal brought 9 990/s 45 ms later, and the pool sat full
    // meanwhile (small-burst-below-rate seed 7: region 0 admitted 9 486 of
    // 18 000 in its first second). A pool that refills at a rate tells
    // its children its own refill (the ledger's hint) within this one.
    let rated = ks.chain.as_ref().is_some_and(|c| c.rate_utps > 0);
    let wait_ms = match plan {
        Plan::Open { .. } | Plan::Renew { .. } if !rated => 0,
        _ => ks.retry_at_ns.saturating_sub(now_ns).div_ceil(MS),
    };
    let hint = if ctx.reachable {
        if central && wait_ms > 0 {
            // The parent's next-token instant, which children cache their
            // denials until: no later than the token can exist.
            wait_ms
        } else {
            ctx.rtt_ms + wait_ms
        }
    } else {
        ctx.renew_interval_ns.div_ceil(MS).max(1) + wait_ms
    };
    ledger.set_pool(PoolTerm::RetryMs(hint));
    ks.due_ns = match plan {
        Plan::Nothing => {
            let leases_end = ledger.leases().iter().map(|l| l.expires_ns).min();
            let quiet = may_ask && !central;
            // Children took tokens since the last sample, which this visit
            // (too soon after it) did not take: the walk that would have.
            let unsampled = ks.sample_h != h;
            let times = VisitTimes {
                last_used_ns: ledger.last_used_ns(),
                leases_end_ns: leases_end,
                unmet_changes_ns: ledger.unmet_changes_at(ctx.window),
            };
            next_visit(ctx, now_ns, ks, &times, quiet, unsampled)
        }
        // Planned (sent, or held back by the throttle or a batch in
        // flight): looked at again by the next walk.
        _ => 0,
    };
    (!matches!(plan, Plan::Nothing)).then_some(plan)
}

/// A key's ledger's instants [`next_visit`] looks at.
struct VisitTimes {
    last_used_ns: u64,
    /// The first of its sub-leases' expiries.
    leases_end_ns: Option<u64>,
    /// When what its children miss next changes without an ask.
    unmet_changes_ns: Option<u64>,
}

/// When a walk must next visit a key that planned nothing at `now_ns`
/// (docs/protocol.md "Which keys a walk visits"): 0 (every walk) while it
/// is not `quiet` (the parent's retry hint runs, which the children's
/// hints are told relative to, or the key is served centrally) and once
/// its chain's deadline is within the largest
/// lead a renewal ahead of it can need (the round trip may grow after
/// this visit: a renewal planned late lapses the chain under its
/// children); otherwise the first instant a plan can change without a
/// child's item or the parent's answer naming the key (which make it due
/// at once): that lead, its idle release, the end of its parent's floor,
/// the expiry of a sub-lease (what the region holds, and whether a shrink
/// fits, change then), the expiry of a child's unmet want (what the key
/// asks for falls then), the next consumption sample while children took
/// tokens this visit did not sample, and at the latest one active window
/// on (what its consumption estimate falls to without use).
fn next_visit(
    ctx: &PlanCtx,
    now_ns: u64,
    ks: &KeyState,
    times: &VisitTimes,
    quiet: bool,
    unsampled: bool,
) -> u64 {
    if !quiet {
        return 0;
    }
    let mut due = now_ns.saturating_add(ctx.window.max(1));
    let mut at = |t: u64| {
        if t > now_ns {
            due = due.min(t);
        }
    };
    at(times.last_used_ns.saturating_add(ctx.idle_ns));
    if let Some(c) = &ks.chain {
        let lead_at = c.deadline_ns.saturating_sub(ctx.ahead_max_ns);
        if now_ns >= lead_at {
            return 0;
        }
        at(lead_at);
        at(c.floored_until_ns);
    }
    for t in [times.leases_end_ns, times.unmet_changes_ns]
        .into_iter()
        .flatten()
    {
        at(t);
    }
    if unsampled {
        at(ks.sample_ns.saturating_add(ctx.renew_interval_ns.max(1)));
    }
    due
}

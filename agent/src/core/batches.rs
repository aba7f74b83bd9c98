//! Batches in flight: the allocator's replies and failures, retries and
//! giving up, and the batches sent (one per shard).

use super::*;

impl AgentCore {
    /// Attempt `attempt` of batch `seq` failed at `now` (an error from the
    /// transport): retry at once, or give up after [`SEND_ATTEMPTS`].
    pub fn handle_failure(&mut self, now: u64, seq: u64, attempt: u32, why: &str) {
        self.attempt_failed(now, seq, attempt, why);
    }

    /// The reply to batch `seq` arrived at `now`. A reply that does not
    /// answer the request (seq, grant count, digest) is ignored and the
    /// batch given up on; a reply to a batch given up on only releases the
    /// fresh tokens it granted; a repeated reply is ignored.
    pub fn handle_reply(&mut self, now: u64, seq: u64, mut reply: LeaseReply) {
        let Some(p) = self.pending.get(&seq) else {
            return;
        };
        let shard = answering_shard(&reply, p.batch.shard);
        // The shard count, learned from every reply: keys the allocator
        // says belong elsewhere are asked again at once, each from its
        // shard's leader.
        let count = reply.shard_count.clamp(1, MAX_SHARDS) as usize;
        let resharded = count != self.ups.len();
        if resharded {
            tracing::info!(
                from = self.ups.len(),
                to = count,
                "the allocator's shard count changed"
            );
            self.ups.resize(count, Upstream::default());
        }
        if reply.not_leader && reply.grants.is_empty() {
            // An allocator replica without a leader (the transport follows
            // a named one): nothing was applied. Reachable but empty, for
            // as long as an election takes: every key is answered "dry,
            // ask again after the hint", and the leases held stay usable
            // under their own deadlines (a grant naming no lease).
            let since = *up_of(&mut self.ups, shard)
                .no_leader_since_ns
                .get_or_insert(now);
            if now.saturating_sub(since) > NO_LEADER_GRACE.as_nanos() as u64 {
                let attempt = p.attempt;
                self.attempt_failed(now, seq, attempt, "no allocator leader");
                return;
            }
            let retry_ms = reply.retry_after_ms.max(1);
            if since == now {
                tracing::warn!(retry_ms, "the allocator replicas have no leader yet; requests that need new tokens are denied until one is elected");
            }
            // Releases come first, then the renewals in `renews` order. A
            // key keeps what it knew of its holders and of the bucket (the
            // emergency bucket of a later outage is sized by the former).
            let releases = p.batch.items.len().saturating_sub(p.renews.len());
            reply.grants = p
                .batch
                .items
                .iter()
                .enumerate()
                .map(|(n, i)| {
                    if i.kind == ItemKind::Release as i32 {
                        return Grant {
                            status: GrantStatus::Released as i32,
                            ..Grant::default()
                        };
                    }
                    let known = n
                        .checked_sub(releases)
                        .and_then(|j| p.renews.get(j))
                        .map(|r| KeyState::load(&r.slot));
                    Grant {
                        status: GrantStatus::Granted as i32,
                        retry_after_ms: retry_ms,
                        holders: known
                            .as_ref()
                            .map_or(1, |k| u32::try_from(k.holders).unwrap_or(u32::MAX)),
                        bucket_available: known.as_ref().map_or(0, |k| k.bucket_available),
                        ..Grant::default()
                    }
                })
                .collect();
        } else if up_of(&mut self.ups, shard)
            .no_leader_since_ns
            .take()
            .is_some()
        {
            tracing::info!("the allocator replicas have a leader again");
        }
        if !self.cfg.cluster.is_empty()
            && !reply.cluster.is_empty()
            && reply.cluster != self.cfg.cluster
        {
            // An allocator of another cluster (a staging agent pointed at
            // production, or the reverse): none of its grants is used.
            self.metrics.mismatched_replies.add(1);
            if now >= self.wrong_cluster_logged_ns.saturating_add(10_000_000_000) {
                self.wrong_cluster_logged_ns = now;
                tracing::error!(
                    theirs = %reply.cluster,
                    ours = %self.cfg.cluster,
                    "the allocator serves another cluster: its replies are not used (logged once every 10 s)"
                );
            }
            // As if it had not answered: retried, then the allocator is
            // taken for unreachable (fail policies apply, and the core
            // probes it at its own pace instead of asking per request).
            let attempt = self.pending.get(&seq).map_or(0, |p| p.attempt);
            self.attempt_failed(now, seq, attempt, "the allocator serves another cluster");
            return;
        }
        let digest_ok = reply.request_digest == 0
            || reply.request_digest == p.digest
            || (reply.protocol_version < 4
                && reply.request_digest == quotalease_proto::request_digest_v3(&p.batch));
        if reply.seq != seq || reply.grants.len() != p.batch.items.len() || !digest_ok {
            self.metrics.mismatched_replies.add(1);
            tracing::error!(
                seq,
                reply_seq = reply.seq,
                items = p.batch.items.len(),
                grants = reply.grants.len(),
                digest_ok,
                "allocator reply does not answer our request; ignored"
            );
            self.abandon(seq);
            return;
        }
        let p = self.pending.remove(&seq).expect("looked up above");
        let up = self.up(shard);
        up.last_reply_ns = Some(now);
        up.down = false;
        (up.probe_at_ns, up.probe_gap_ns) = (0, 0);
        if !up.connected {
            up.connected = true;
            tracing::info!(shard, "allocator reachable");
        }
        self.metrics
            .record_renewal(Duration::from_nanos(now.saturating_sub(p.first_sent_ns)));
        let again = self.apply_reply(reply, seq, &p, now, resharded);
        if p.abandoned {
            return;
        }
        // Keys whose item was not applied (STALE: the allocator saw newer
        // sequence numbers first; SEQ_CONFLICT) are asked again at once
        // under a new seq; their waiting requests keep waiting, so a
        // reordering costs them no attempt.
        let settled: Vec<Slot> = p
            .renews
            .iter()
            .map(|r| &r.slot)
            .filter(|s| !again.contains(s))
            .cloned()
            .collect();
        self.settle(seq, &settled);
        for slot in again {
            let mut k = KeyState::load(&slot);
            if k.held {
                if k.in_flight == Some(seq_tag(seq)) {
                    k.in_flight = None;
                }
                k.quiet_until_ns = 0;
                k.store(&slot);
                self.wanted.push(slot);
            }
        }
    }

    pub(super) fn attempt_failed(&mut self, now: u64, seq: u64, attempt: u32, why: &str) {
        let Some(p) = self.pending.get_mut(&seq) else {
            return;
        };
        if p.abandoned || p.attempt != attempt {
            return;
        }
        self.metrics.rpc_errors.add(1);
        if p.attempt < SEND_ATTEMPTS {
            // The same batch, the same sequence number: the allocator
            // answers a duplicate from its cache and never grants twice.
            p.attempt += 1;
            p.deadline_ns = now.saturating_add(self.cfg.fetch_timeout.as_nanos() as u64);
            let t = Transmit {
                seq,
                attempt: p.attempt,
                batch: p.batch.clone(),
            };
            self.transmits.push_back(t);
            return;
        }
        // Overload is not an outage: only a batch that saw no reply at all
        // since it was first sent makes the allocator unreachable.
        let first_sent = p.first_sent_ns;
        let shard = p.batch.shard as usize;
        self.abandon(seq);
        let outages = self.outages + 1;
        let up = self.up(shard);
        let heard_since = up.last_reply_ns.is_some_and(|r| r >= first_sent);
        if heard_since {
            tracing::debug!(seq, %why, "batch given up on; the allocator answers others (overload, not an outage)");
            return;
        }
        if !up.down {
            up.down = true;
            up.outage = outages;
            self.outages = outages;
        }
        let up = self.up(shard);
        if up.connected {
            up.connected = false;
            tracing::warn!(shard, %why, "allocator unreachable; serving from leases, then fail policies");
        }
    }

    /// Give up on batch `seq`: its releases go back to the queue, its keys
    /// may ask again, and a late reply only releases what it granted.
    pub(super) fn abandon(&mut self, seq: u64) {
        let Some(p) = self.pending.get_mut(&seq).filter(|p| !p.abandoned) else {
            return;
        };
        p.abandoned = true;
        let releases: Vec<LeaseItem> = p
            .batch
            .items
            .iter()
            .filter(|i| i.kind == ItemKind::Release as i32)
            .cloned()
            .collect();
        let renews: Vec<Slot> = p.renews.iter().map(|r| r.slot.clone()).collect();
        self.late_releases.extend(releases);
        self.settle(seq, &renews);
    }

    /// Batch `seq` is answered or given up: its keys may ask again and the
    /// requests parked on them re-check.
    pub(super) fn settle(&mut self, seq: u64, renews: &[Slot]) {
        for slot in renews {
            let mut k = KeyState::load(slot);
            if !k.held {
                continue;
            }
            if k.in_flight == Some(seq_tag(seq)) {
                k.in_flight = None;
            }
            k.quiet_until_ns = 0;
            k.store(slot);
            slot.clear_waiting();
            slot.note_settled();
            self.events.push_back(Event::Settled(slot.clone()));
        }
    }

    /// Plan and queue the next batch at `t` (renewals, releases, or a
    /// heartbeat); a wake-up pass (`woken`) plans only the wanted keys.
    pub(super) fn poll(&mut self, t: u64, woken: bool) {
        // Forget abandoned batches whose grants have surely expired.
        let keep_ns = 2 * self.cfg.lease_ttl.as_nanos() as u64;
        self.pending
            .retain(|_, p| !p.abandoned || p.first_sent_ns.saturating_add(keep_ns) > t);
        if let Some((items, renews)) = self.plan_all(t, woken) {
            self.send(t, items, renews);
        }
    }

    /// Send planned items (releases first, then renewals with their slot
    /// ids in item order) in batches of at most [`MAX_BATCH_ITEMS`], or a
    /// heartbeat when nothing is planned and one is due.
    pub(super) fn send(&mut self, t: u64, mut items: Vec<LeaseItem>, renews: Vec<Renewing>) {
        // A renewal names the key's newest version: what a shrink clipped
        // goes back with it, once (the allocator credits it as the older
        // versions stop counting).
        let first_renewal = items.len() - renews.len();
        for (item, r) in items[first_renewal..].iter_mut().zip(&renews) {
            if let Some(rare) = self.rare.get_mut(&r.slot) {
                if rare.returnable > 0 && item.lease_id != 0 {
                    item.left = std::mem::take(&mut rare.returnable);
                    self.metrics.tokens_handed_back.add(item.left);
                    if rare.refused.is_none() && rare.emergency.is_none() {
                        self.rare.remove(&r.slot);
                    }
                }
            }
        }
        // A heartbeat is due when nothing was sent for its interval, while
        // no rules are known, and to a shard not reached yet.
        let quiet = self.in_flight() == 0;
        let due =
            quiet && t.saturating_sub(self.last_sent_ns) >= self.cfg.heartbeat.as_nanos() as u64;
        // Sooner while no rules are known or the shard is not reached yet,
        // at the pace of its probes.
        let no_rules = !self.rules.has_rules();
        let heartbeat_due =
            |u: &Upstream| due || (quiet && (no_rules || !u.connected) && t >= u.probe_at_ns);
        if items.is_empty() && !self.ups.iter().any(heartbeat_due) {
            return;
        }
        self.last_sent_ns = t;
        let count = self.ups.len();
        if count == 1 {
            self.send_to(t, 0, items, renews);
            return;
        }
        // One batch (or more) per shard, each item to its key's shard; a
        // heartbeat to every shard.
        let releases = items.len() - renews.len();
        let mut per: Vec<(Vec<LeaseItem>, Vec<Renewing>)> =
            (0..count).map(|_| (Vec::new(), Vec::new())).collect();
        let mut items = items.into_iter();
        for item in items.by_ref().take(releases) {
            let s =
                quotalease_proto::shard_of(&item.rule_id, &item.tenant, &item.route, count as u32);
            per[s as usize].0.push(item);
        }
        for (item, r) in items.zip(renews) {
            let s = key_shard(&r.slot, count);
            per[s].0.push(item);
            per[s].1.push(r);
        }
        let due: Vec<bool> = self.ups.iter().map(heartbeat_due).collect();
        for (s, (items, renews)) in per.into_iter().enumerate() {
            if !items.is_empty() || due[s] {
                self.send_to(t, s as u32, items, renews);
            }
        }
    }

    /// [`AgentCore::send`] of items of one shard.
    pub(super) fn send_to(
        &mut self,
        t: u64,
        shard: u32,
        mut items: Vec<LeaseItem>,
        mut renews: Vec<Renewing>,
    ) {
        // The first `releases` items are releases, the rest renewals.
        let mut releases = items.len() - renews.len();
        loop {
            let take = items.len().min(MAX_BATCH_ITEMS);
            let rest = items.split_off(take);
            let rest_renews = renews.split_off(take.saturating_sub(releases));
            releases = releases.saturating_sub(take);
            self.send_one(t, shard, items, renews);
            items = rest;
            renews = rest_renews;
            if items.is_empty() {
                return;
            }
        }
    }

    pub(super) fn send_one(
        &mut self,
        t: u64,
        shard: u32,
        items: Vec<LeaseItem>,
        renews: Vec<Renewing>,
    ) {
        self.seq += 1;
        let seq = self.seq;
        for r in &renews {
            let mut k = KeyState::load(&r.slot);
            if k.held && k.in_flight.is_some() {
                k.in_flight = Some(seq_tag(seq));
                k.store(&r.slot);
            }
        }
        let mut batch = self.batch(seq, items, self.cfg.lease_ttl.as_millis() as u64);
        batch.shard = shard;
        if let Some(h) = &mut batch.header {
            let up = self.ups.get(shard as usize);
            h.ledger_id = up.map_or(0, |u| u.ledger_id);
            (h.run_id, h.record_seq) = up.map_or((0, 0), |u| u.run);
            h.ledger_cluster = up.map_or(String::new(), |u| u.ledger_cluster.clone());
        }
        let digest = quotalease_proto::request_digest(&batch);
        let floor = self.interval_ns();
        let most = (self.cfg.heartbeat.as_nanos() as u64).max(floor);
        let up = self.up(shard as usize);
        if !up.connected {
            // A probe: the next one waits longer while none is answered.
            let gap = up.probe_gap_ns.max(floor);
            up.probe_at_ns = t.saturating_add(gap);
            up.probe_gap_ns = gap.saturating_mul(2).min(most);
        }
        self.transmits.push_back(Transmit {
            seq,
            attempt: 1,
            batch: batch.clone(),
        });
        self.pending.insert(
            seq,
            Pending {
                batch,
                first_sent_ns: t,
                attempt: 1,
                deadline_ns: t.saturating_add(self.cfg.fetch_timeout.as_nanos() as u64),
                digest,
                renews,
                abandoned: false,
                shards: self.ups.len(),
            },
        );
    }

    pub(super) fn batch(&self, seq: u64, items: Vec<LeaseItem>, ttl_ms: u64) -> LeaseBatch {
        LeaseBatch {
            header: Some(RequestHeader {
                agent_id: self.cfg.agent_id.clone(),
                incarnation: self.incarnation,
                seq,
                protocol_version: PROTOCOL_VERSION,
                rules_version: self.rules.version(),
                instance: self.cfg.instance,
                ledger_id: self.ups[0].ledger_id,
                run_id: self.ups[0].run.0,
                record_seq: self.ups[0].run.1,
                cluster: self.cfg.cluster.clone(),
                ledger_cluster: self.ups[0].ledger_cluster.clone(),
            }),
            ttl_ms,
            items,
            shard: 0,
        }
    }
}

//! A batch from a holder: its header checked (protocol, identity, run,
//! duplicates by seq), then each item granted, renewed or released.

use super::*;

impl AllocatorCore {
    pub(super) fn handle_batch(
        &mut self,
        now_ns: u64,
        batch: &LeaseBatch,
        principal: &str,
    ) -> LeaseReply {
        self.stats.messages += 1;
        self.stats.items += batch.items.len() as u64;
        let Some(header) = batch.header.as_ref() else {
            return self.refuse(batch, 0, GrantStatus::BadItem, "header: missing");
        };
        if self.closed {
            return self.refuse(
                batch,
                header.seq,
                GrantStatus::Stale,
                "allocator shutting down: nothing applied",
            );
        }
        let seq = header.seq;
        if header.agent_id.is_empty() || header.agent_id.len() > MAX_ID_BYTES {
            return self.refuse(
                batch,
                seq,
                GrantStatus::BadItem,
                "header.agent_id: must be 1..=256 bytes",
            );
        }
        if header.protocol_version.abs_diff(PROTOCOL_VERSION) > 1 {
            return self.refuse(
                batch,
                seq,
                GrantStatus::Unsupported,
                "header.protocol_version: unsupported",
            );
        }
        if !self.cfg.cluster.is_empty() && header.cluster != self.cfg.cluster {
            // Another cluster's agent (staging pointed at production, a
            // blue/green switch): refused whole, before its ledger id is
            // looked at.
            self.stats.wrong_cluster += 1;
            let theirs = match header.cluster.as_str() {
                "" => "no cluster (start it with --cluster)".to_string(),
                c => format!("cluster {c:?}"),
            };
            let why = format!(
                "header.cluster: this allocator serves cluster {:?}; the requester is of {theirs}",
                self.cfg.cluster
            );
            if now_ns >= self.wrong_cluster_logged_ns.saturating_add(LOG_EVERY_NS) {
                self.wrong_cluster_logged_ns = now_ns;
                tracing::warn!(
                    agent = %header.agent_id,
                    principal,
                    refused = self.stats.wrong_cluster,
                    "{why}: refused (logged once every 10 s)"
                );
            }
            return self.refuse(batch, seq, GrantStatus::BadItem, &why);
        }
        self.check_presented(now_ns, batch, header);
        // Holder, incarnation and duplicate suppression.
        let digest = quotalease_proto::request_digest(batch);
        let holder_key = HolderName {
            principal: principal.to_owned(),
            agent_id: header.agent_id.clone(),
            instance: header.instance,
        };
        let holder = match self.holders.get_mut(&holder_key) {
            Some(h) => h,
            None => {
                let id = self.next_holder;
                self.next_holder = self.next_holder.wrapping_add(1);
                self.holder_names.insert(id, holder_key.clone());
                self.holders.entry(holder_key.clone()).or_insert(Holder {
                    id,
                    incarnation: header.incarnation,
                    replies: BTreeMap::new(),
                    floor: 0,
                    rules_version: 0,
                    last_seen_ns: now_ns,
                })
            }
        };
        if header.incarnation < holder.incarnation {
            self.stats.stale += 1;
            let current = holder.incarnation;
            let mut reply = self.refuse(
                batch,
                seq,
                GrantStatus::Stale,
                "header.incarnation: older than the holder's current one",
            );
            reply.holder_incarnation = current;
            return reply;
        }
        if header.incarnation > holder.incarnation {
            holder.incarnation = header.incarnation;
            holder.replies.clear();
            holder.floor = 0;
            // Releases forwarded to the old incarnation's permits: gone
            // with them.
            let id = holder.id;
            self.forwarded.remove(&id);
        }
        let holder = self
            .holders
            .get_mut(&holder_key)
            .expect("found or inserted above");
        holder.last_seen_ns = holder.last_seen_ns.max(now_ns);
        holder.rules_version = holder.rules_version.max(header.rules_version);
        if let Some((cached_digest, cached)) = holder.replies.get(&seq) {
            if *cached_digest == digest {
                self.stats.duplicates += 1;
                return <LeaseReply as prost::Message>::decode(cached.as_slice())
                    .expect("a reply this core encoded decodes");
            }
            // Same (agent, instance, incarnation, seq), other content: two
            // processes share an identity, or a requester reuses sequence
            // numbers. Answering from the cache would hand one lease to
            // two spenders (SPEC §2 "Messages").
            self.stats.seq_conflicts += 1;
            tracing::warn!(
                agent_id = %header.agent_id,
                instance = header.instance,
                incarnation = header.incarnation,
                seq,
                "lease request repeats a sequence number with other content; refused"
            );
            return self.refuse(
                batch,
                seq,
                GrantStatus::SeqConflict,
                "header.seq: repeated with other content",
            );
        }
        if seq <= holder.floor {
            self.stats.stale += 1;
            return self.refuse(
                batch,
                seq,
                GrantStatus::Stale,
                "header.seq: older than the duplicate window",
            );
        }
        let holder_id = holder.id;
        let ttl_ns = if batch.ttl_ms == 0 {
            self.cfg.ttl_max_ns
        } else {
            batch
                .ttl_ms
                .saturating_mul(1_000_000)
                .min(self.cfg.ttl_max_ns)
        };
        let grants = batch
            .items
            .iter()
            .map(|item| self.handle_item(now_ns, holder_id, item, ttl_ns))
            .collect();
        // Forwarded releases are rare: no lookup on the hot path while none wait.
        let released_permits = match self.forwarded.is_empty() {
            true => Vec::new(),
            false => self.forwarded.remove(&holder_id).unwrap_or_default(),
        };
        let reply = LeaseReply {
            released_permits,
            seq,
            epoch: self.epoch,
            protocol_version: PROTOCOL_VERSION,
            holder_incarnation: header.incarnation,
            grants,
            rules: (header.rules_version < self.rules.version).then(|| self.rules.to_proto()),
            request_digest: digest,
            ledger_id: self.cfg.ledger_id,
            shard: self.cfg.shard.0,
            shard_count: self.cfg.shard.1,
            ..LeaseReply::default()
        };
        let cap = self.cfg.reply_cache.max(1);
        let holder = self
            .holders
            .get_mut(&holder_key)
            .expect("holder inserted above");
        holder
            .replies
            .insert(seq, (digest, prost::Message::encode_to_vec(&reply)));
        while holder.replies.len() > cap {
            let (old, _) = holder.replies.pop_first().expect("len > cap >= 1");
            holder.floor = holder.floor.max(old);
        }
        reply
    }

    pub(super) fn refuse(
        &self,
        batch: &LeaseBatch,
        seq: u64,
        status: GrantStatus,
        why: &str,
    ) -> LeaseReply {
        LeaseReply {
            seq,
            epoch: self.epoch,
            protocol_version: PROTOCOL_VERSION,
            grants: batch
                .items
                .iter()
                .map(|_| Grant {
                    status: status as i32,
                    detail: why.to_string(),
                    ..Grant::default()
                })
                .collect(),
            rules: None,
            holder_incarnation: 0,
            // Refusals answer this request too: the requester matches them.
            request_digest: quotalease_proto::request_digest(batch),
            ledger_id: self.cfg.ledger_id,
            ..LeaseReply::default()
        }
    }

    pub(super) fn handle_item(
        &mut self,
        now_ns: u64,
        holder: HolderId,
        item: &LeaseItem,
        ttl_ns: u64,
    ) -> Grant {
        let version = self.rules.version;
        let bad = |detail: String| bad_item(version, detail);
        let (shard, shards) = self.cfg.shard;
        if shards > 1
            && quotalease_proto::shard_of(&item.rule_id, &item.tenant, &item.route, shards) != shard
        {
            return Grant {
                status: GrantStatus::WrongShard as i32,
                rule_version: version,
                detail: format!("the key belongs to another shard than {shard} of {shards}"),
                ..Grant::default()
            };
        }
        if matches!(
            ItemKind::try_from(item.kind),
            Ok(ItemKind::Slots | ItemKind::SlotsRelease | ItemKind::PermitRelease)
        ) {
            return self.slot_item(now_ns, holder, item, ttl_ns);
        }
        let Some(rule) = self.rules.get(&item.rule_id) else {
            // A release for a rule that is gone still frees its lease.
            if item.kind == ItemKind::Release as i32 {
                return self.release(now_ns, holder, item);
            }
            return Grant {
                status: GrantStatus::UnknownRule as i32,
                rule_version: version,
                detail: format!("rule_id: unknown rule {:?}", item.rule_id),
                ..Grant::default()
            };
        };
        if let Err(why) = key_part_ok(&rule.tenant, &item.tenant) {
            return bad(format!("tenant: {why}"));
        }
        if let Err(why) = key_part_ok(&rule.route, &item.route) {
            return bad(format!("route: {why}"));
        }
        let kind = ItemKind::try_from(item.kind);
        match kind {
            Ok(ItemKind::Release) => self.release(now_ns, holder, item),
            Ok(ItemKind::Renew) => self.renew(now_ns, holder, item, ttl_ns),
            // Answered above (before the rate rule is looked up).
            Ok(ItemKind::Slots | ItemKind::SlotsRelease | ItemKind::PermitRelease) => {
                self.slot_item(now_ns, holder, item, ttl_ns)
            }
            Err(_) => bad(format!("kind: unknown value {}", item.kind)),
        }
    }

    pub(super) fn key_of(item: &LeaseItem) -> KeyId {
        KeyId::new(&item.rule_id, &item.tenant, &item.route)
    }

    pub(super) fn release(&mut self, now_ns: u64, holder: HolderId, item: &LeaseItem) -> Grant {
        let key = Self::key_of(item);
        if let Some(ledger) = self.keys.get_mut(&key) {
            Self::touch(self.pooled.is_some(), &mut self.touched_keys, &key, ledger);
            if let Some(rest) =
                ledger.release_with(now_ns, holder, item.lease_id, item.spent, item.left)
            {
                self.stats.releases += 1;
                self.stats.tokens_released += rest;
            }
        }
        Grant {
            status: GrantStatus::Released as i32,
            rule_version: self.rules.version,
            ..Grant::default()
        }
    }

    pub(super) fn renew(
        &mut self,
        now_ns: u64,
        holder: HolderId,
        item: &LeaseItem,
        ttl_ns: u64,
    ) -> Grant {
        if now_ns < self.grace_until_ns {
            // A new ledger's grace: nothing yet, come back when it ends.
            return Grant {
                status: GrantStatus::Granted as i32,
                rule_version: self.rules.version,
                retry_after_ms: (self.grace_until_ns - now_ns).div_ceil(1_000_000),
                starting: true,
                ..Grant::default()
            };
        }
        let rule: &Rule = self
            .rules
            .get(&item.rule_id)
            .expect("renew is only called for a known rule");
        let (rate, burst, max_keys) = (rule.rate, rule.burst, rule.max_keys);
        let version = self.rules.version;
        let key = Self::key_of(item);
        if !self.keys.contains_key(&key) {
            let count = self.keys_per_rule.get(&item.rule_id).copied().unwrap_or(0);
            if max_keys.is_some_and(|m| count >= m) {
                self.stats.key_limit_refusals += 1;
                return Grant {
                    status: GrantStatus::KeyLimit as i32,
                    rule_version: version,
                    detail: format!("rule {}: max_keys {} reached", item.rule_id, count),
                    ..Grant::default()
                };
            }
            *self.keys_per_rule.entry(item.rule_id.clone()).or_insert(0) += 1;
            let ledger = if self.pooled.is_some() {
                KeyLedger::new_pooled(rate, burst, now_ns)
            } else {
                KeyLedger::new(rate, burst, now_ns, self.ready_at_ns)
            };
            if self.pooled.is_some() {
                self.new_keys.push(key.clone());
            }
            self.keys.insert(key.clone(), Box::new(ledger));
        }
        let ledger = self.keys.get_mut(&key).expect("inserted above");
        Self::touch(self.pooled.is_some(), &mut self.touched_keys, &key, ledger);
        if ledger.sweep_due_ns == 0 {
            // Looked at no earlier than this lease can expire.
            ledger.sweep_due_ns = now_ns.saturating_add(ttl_ns).max(1);
            let due = std::cmp::Reverse((ledger.sweep_due_ns, key.clone()));
            self.sweep_due.push(due);
        }
        let mut ttl_ns = ttl_ns;
        let mut parent_unreachable = false;
        let mut opening = false;
        let mut fetch_retry_ms = u64::MAX;
        if let (Some(mode), Some(pool)) = (self.pooled, ledger.pool()) {
            // No parent lease yet, or the pool is short while the parent
            // has tokens: the regional is fetching, the child should wait.
            // A pool refilled by a rate lease fetches too while the parent
            // last said it has tokens beyond the region's lease (the
            // regional renews with a larger rate and capacity at once); a
            // key the parent has nothing more of (a hot key at its rate)
            // waits for its refill here, and the retry hint says when.
            opening = (pool.deadline_ns <= now_ns
                || (!pool.parent_dry && (pool.rate_utps == 0 || pool.parent_available > 0)))
                && !mode.parent_unreachable;
            // Fetching: come back when the parent's answer can be in (not
            // when the pool's own refill would have a token).
            fetch_retry_ms = pool.retry_ms.max(1);
            // A sub-lease never outlives the parent lease: whole
            // milliseconds up to the pool's deadline, and nothing new from
            // the pool when that is too short to be of use (the ledger
            // still records the want, which the regional passes upstream).
            parent_unreachable = mode.parent_unreachable;
            let left_ms = pool.deadline_ns.saturating_sub(now_ns) / 1_000_000;
            ttl_ns = ttl_ns.min(left_ms.saturating_mul(1_000_000));
            ledger.set_pool(PoolTerm::MinTtl(2 * self.cfg.epsilon_ns));
        }
        let new_id = self.next_lease_id;
        self.next_lease_id += 1;
        let g = ledger.renew(
            now_ns,
            Renewal {
                holder,
                lease_id: item.lease_id,
                spent: item.spent,
                want: item.want.min(burst),
                ttl_ns,
                new_id,
                want_rate_utps: item.want_rate_utps,
                returned: item.left,
            },
            self.cfg.active_window_ns,
        );
        // What is left in the bucket beyond the leases, at the grant's
        // instant (the ledger is advanced to `now_ns` by the renewal): the
        // holder's estimate of the key's global remaining (SPEC §5). A
        // pooled ledger's is its pool's plus what the parent last
        // reported above the region's lease. Part of the reply, so a
        // duplicate gets the same figure.
        let bucket_available = ledger
            .available()
            .saturating_add(ledger.pool().map_or(0, |p| p.parent_available));
        if let Some(r) = &mut self.reservations {
            r.after_grant(
                &key,
                ledger.available(),
                ledger.rates_out_utps(),
                rate,
                burst,
            );
        }
        if g.shadow_violation {
            *self
                .stats
                .shadow_violations
                .entry(item.rule_id.clone())
                .or_insert(0) += 1;
            tracing::error!(rule = %item.rule_id, fresh = g.fresh, "shadow bucket: this grant would break I1");
        }
        if g.fresh > 0 {
            self.stats.grants += 1;
            self.stats.tokens_granted += g.fresh;
        }
        if g.capacity > 0 && g.lease_id != 0 {
            self.stats.rate_grants += 1;
        }
        self.stats.tokens_carried += g.carried;
        self.stats.tokens_handed_back += g.handed_back;
        Grant {
            status: GrantStatus::Granted as i32,
            lease_id: g.lease_id,
            tokens: g.tokens,
            carried: g.carried,
            ttl_ms: ttl_ns / 1_000_000,
            rule_version: version,
            retry_after_ms: if opening && g.tokens == 0 {
                g.retry_after_ms.min(fetch_retry_ms)
            } else {
                g.retry_after_ms
            },
            parent_unreachable,
            detail: String::new(),
            holders: g.holders,
            opening: opening && g.tokens == 0,
            rate_utps: g.rate_utps,
            capacity: g.capacity,
            version_of: g.version_of,
            bucket_available,
            // Nothing because a restart's (or a lost state's) wait has not
            // ended: the key's phantom still counts the whole burst.
            starting: self.pooled.is_none()
                && g.lease_id == 0
                && self.ready_at_ns.is_some_and(|r| now_ns < r),
            ..Grant::default()
        }
    }
}

/// A `BAD_ITEM` answer naming the field in `detail`.
pub(super) fn bad_item(rule_version: u64, detail: String) -> Grant {
    Grant {
        status: GrantStatus::BadItem as i32,
        rule_version,
        detail,
        ..Grant::default()
    }
}

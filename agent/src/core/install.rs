//! Replies: a batch's grants installed into the lease table (or asked
//! again, or given back), and the emergency buckets of an outage sized.

use super::*;

impl AgentCore {
    /// Apply a reply; returns the keys whose item was not applied and
    /// should be asked again.
    pub(super) fn apply_reply(
        &mut self,
        reply: LeaseReply,
        seq: u64,
        p: &Pending,
        t: u64,
        resharded: bool,
    ) -> Vec<Slot> {
        let shard = answering_shard(&reply, p.batch.shard);
        if reply.ledger_id != 0 {
            // The ledger that served us: presented from now on (SPEC §2
            // "First start"), with the newest run of it we have seen.
            let up = self.up(shard);
            up.run = quotalease_proto::newest_run(up.ledger_id, up.run, &reply);
            up.ledger_id = reply.ledger_id;
            up.ledger_cluster.clone_from(&reply.cluster);
        }
        if reply.holder_incarnation > self.incarnation {
            // The allocator knows this identity under a higher incarnation
            // (our clock stepped back across a restart): take a higher one,
            // so our batches are not refused as stale.
            let next = reply.holder_incarnation + 1;
            tracing::warn!(
                from = self.incarnation,
                to = next,
                "raised the agent incarnation above the allocator's record"
            );
            self.incarnation = next;
        }
        if let Some(pb) = &reply.rules {
            let current = self.rules.version();
            if pb.version > current {
                match RuleSet::from_proto(pb) {
                    Ok(rs) => {
                        tracing::info!(
                            version = rs.version,
                            rules = rs.rules.len(),
                            "adopted rules from the allocator"
                        );
                        self.rules.publish(rs, &self.metrics);
                    }
                    Err(errs) => {
                        tracing::error!(errors = errs.len(), first = %errs[0], "allocator sent invalid rules; keeping the last good ones")
                    }
                }
            }
        }
        let version = self.rules.version();
        // Releases the allocator did not apply go back to the queue.
        for (item, g) in p.batch.items.iter().zip(reply.grants.iter()) {
            let not_applied = g.status == GrantStatus::Stale as i32
                || g.status == GrantStatus::SeqConflict as i32
                || (g.status == GrantStatus::WrongShard as i32 && resharded);
            if item.kind == ItemKind::Release as i32 && not_applied {
                self.late_releases.push(item.clone());
            }
        }
        let renews = p
            .batch
            .items
            .iter()
            .zip(reply.grants.iter())
            .filter(|(i, _)| i.kind == ItemKind::Renew as i32)
            .map(|(_, g)| g);
        let sent_ns = p.first_sent_ns;
        let mut again = Vec::new();
        for (grant, r) in renews.zip(p.renews.iter()) {
            let ks = key_shard(&r.slot, self.ups.len());
            if grant.status == GrantStatus::WrongShard as i32 && ks != shard {
                if p.shards != self.ups.len() {
                    // Split under another shard count (before it was
                    // known): nothing applied, ask the key's shard at once.
                    again.push(r.slot.clone());
                    continue;
                }
                // Meant for its shard but answered by another: the
                // transport knows no way to that shard's leader yet.
                // Reachable but empty for the key (ask again after a
                // while), and for its shard "no leader yet" (its fail
                // policies after the grace).
                r.slot.set_dry_until(t.saturating_add(NO_ROUTE_RETRY_NS));
                let outages = self.outages + 1;
                let up = up_of(&mut self.ups, ks);
                let since = *up.no_leader_since_ns.get_or_insert(t);
                if t.saturating_sub(since) > NO_LEADER_GRACE.as_nanos() as u64 && !up.down {
                    up.down = true;
                    up.connected = false;
                    up.outage = outages;
                    self.outages = outages;
                    tracing::warn!(
                        shard = ks,
                        "no way to an allocator shard's leader; its keys apply their fail policies"
                    );
                }
                continue;
            }
            if self.install(r, grant, seq, sent_ns, version, t) == Installed::AskAgain {
                again.push(r.slot.clone());
            }
        }
        again
    }

    fn install(
        &mut self,
        r: &Renewing,
        g: &Grant,
        seq: u64,
        sent_ns: u64,
        version: u64,
        t: u64,
    ) -> Installed {
        let mut k = KeyState::load(&r.slot);
        if !k.held {
            // The key was forgotten meanwhile: give fresh tokens back, as
            // for a batch given up on (a grant that carried or continues
            // the old lease is left to expire).
            if g.carried == 0 && g.version_of == 0 && g.lease_id != 0 {
                tracing::debug!(lease = g.lease_id, "grant for a forgotten key; released");
                self.late_releases
                    .push(r.slot.release_item(g.lease_id, 0, g.tokens));
            }
            return Installed::Done;
        }
        let out = self.install_key(&mut k, r, g, seq, sent_ns, version, t);
        k.store(&r.slot);
        out
    }

    #[allow(clippy::too_many_arguments)]
    fn install_key(
        &mut self,
        k: &mut KeyState,
        f: &Renewing,
        g: &Grant,
        seq: u64,
        sent_ns: u64,
        version: u64,
        t: u64,
    ) -> Installed {
        let metrics = &self.metrics;
        let late = &mut self.late_releases;
        let slot = f.slot.clone();
        // A grant that carries a rate: its `tokens` are an increment on the
        // holder's level, its `carried` the rest of a lease of tokens.
        let rate_grant = g.capacity > 0;
        // (lease id, spent, left) of a RELEASE to send.
        let mut release = |lease_id: u64, spent: u64, left: u64| {
            if lease_id != 0 {
                late.push(slot.release_item(lease_id, spent, left));
            }
        };
        if k.in_flight != Some(seq_tag(seq)) {
            // A grant for a request we gave up on. Fresh tokens go back; a
            // grant that carried our old lease (or continues our rate
            // chain) is left to expire, because the old lease may still be
            // spending that part.
            if g.carried == 0 && g.version_of == 0 {
                release(g.lease_id, 0, g.tokens);
            }
            return Installed::Done;
        };
        k.in_flight = None;
        k.asked_rate_utps = f.asked_rate_utps;
        if g.carried > g.tokens && !rate_grant {
            tracing::error!(rule = %slot.rule_id(), tokens = g.tokens, carried = g.carried, "malformed grant ignored");
            return Installed::Done;
        }
        if self.stopping {
            // Shutting down: the lease word is retired; the grant expires.
            return Installed::Done;
        }
        let status = GrantStatus::try_from(g.status).unwrap_or(GrantStatus::BadItem);
        match status {
            GrantStatus::Granted => {}
            GrantStatus::Stale => {
                metrics.stale_replies.add(1);
                return Installed::AskAgain;
            }
            GrantStatus::Unsupported => return Installed::Done,
            GrantStatus::SeqConflict => {
                // Cannot happen with a unique (id, instance); if it does,
                // nothing was applied: ask again under a new seq.
                metrics.seq_conflicts.add(1);
                return Installed::AskAgain;
            }
            other => {
                self.rare.entry(f.slot.clone()).or_default().refused =
                    Some((other, g.detail.clone()));
                f.slot.set_dry_until(t + 1_000_000_000);
                return Installed::Done;
            }
        }
        // What the allocator knows is left in the bucket beyond our lease
        // (0 from an allocator that predates the field: `remaining` is
        // then the lease's level, as it was).
        k.bucket_available = g.bucket_available;
        if let Some(rare) = self.rare.get_mut(&f.slot) {
            rare.refused = None;
            if rare.emergency.is_none() && rare.returnable == 0 {
                self.rare.remove(&f.slot);
            }
        }
        // A regional allocator tells whether its own parent is reachable; a
        // cut-off region's agents apply fail policies once its pool is dry.
        let outages = self.outages + 1;
        let n = self.ups.len();
        let up = &mut self.ups[key_shard(&f.slot, n)];
        if g.parent_unreachable {
            if !up.parent_down {
                up.parent_down = true;
                up.outage = outages;
                self.outages = outages;
                tracing::warn!("the regional allocator reports its parent unreachable");
            }
        } else if up.parent_down {
            up.parent_down = false;
            tracing::info!("the regional allocator reaches its parent again");
        }
        k.holders = u64::from(g.holders.max(1));
        let same_lease = k.generation == f.generation;
        // The grant continues what the word holds: it carried our lease of
        // tokens, or the allocator knew the rate version we named.
        let continues = same_lease && (g.carried > 0 || (rate_grant && g.version_of != 0));
        // A grant we cannot use: give it back. If it continues the lease we
        // hold, retire that lease first, so that what we report is final.
        let give_back = |k: &mut KeyState, release: &mut dyn FnMut(u64, u64, u64)| {
            if !continues {
                if g.carried == 0 {
                    release(g.lease_id, 0, g.tokens);
                } else {
                    // The generation the carry came from is already dead.
                    release(g.lease_id, g.carried, 0);
                }
                return;
            }
            let was_rate = f.slot.word.refill().is_rate();
            let (left, new_gen) = f.slot.word.retire(t);
            if rate_grant {
                // What we held plus the increment we never added.
                release(g.lease_id, 0, left + g.tokens);
            } else if was_rate {
                release(g.lease_id, 0, left);
            } else {
                let spent_since = f.tokens_at_send.saturating_sub(left).min(g.carried);
                release(g.lease_id, spent_since, 0);
            }
            k.generation = new_gen;
            k.baseline = 0;
            k.lease_id = 0;
            k.granted = 0;
        };
        if g.rule_version > version {
            // Never spend a grant stamped with a rule version we do not enforce.
            give_back(k, &mut release);
            return Installed::Done;
        }
        // A regional allocator still opening the key upstream: the waiting
        // requests keep waiting for the next ask (after the hint) instead
        // of being denied — a cold key pays the round trip to the top, once.
        let opening = g.opening
            && g.tokens == 0
            && g.retry_after_ms < self.cfg.fetch_timeout.as_millis() as u64;
        slot.set_opening(opening);
        // Nothing because the allocator is starting: not a limit.
        slot.set_starting(g.starting && g.tokens == 0);
        let dry = if g.retry_after_ms > 0 {
            // A key served centrally caches its denials until the
            // allocator's next-token instant, counted from when the ask
            // left (the allocator decided after that): never later than
            // the token can exist. Others count from now.
            let central = self.cfg.plan.central
                && self
                    .rules
                    .rules()
                    .and_then(|r| r.get(slot.rule_id()).map(|r| r.rate.served_centrally()))
                    .unwrap_or(false);
            let from = if central { sent_ns.min(t) } else { t };
            from.saturating_add(g.retry_after_ms.saturating_mul(1_000_000))
        } else {
            0
        };
        slot.set_dry_until(dry);
        if g.lease_id == 0 {
            // Nothing leased and nothing carried: the lease we named is
            // unknown to the allocator (rolled by a lost reply, expired, or
            // a predecessor's), or it had no room for a new rate version;
            // ours stays usable under its own deadline.
            return Installed::Done;
        }
        // deadline = first send + TTL * (1 - 2 rho) - epsilon
        let ttl_ns = g.ttl_ms.saturating_mul(1_000_000);
        let deadline = use_by_ns(sent_ns, ttl_ns, self.cfg.epsilon.as_nanos() as u64);
        if t >= deadline {
            give_back(k, &mut release);
            return Installed::Done;
        }
        let old_refill = slot.word.refill();
        let old_deadline = slot.word.deadline_ns();
        let refill = if rate_grant {
            Refill::of_grant(g.rate_utps, g.capacity)
        } else {
            Refill::NONE
        };
        let (old_seen, new_gen, new_tokens) = slot.word.install(deadline, refill, t, |cur| {
            if rate_grant {
                // The level goes on, clipped to the new capacity (the word
                // clips), plus the increment; a new chain starts at it.
                if continues {
                    cur.saturating_add(g.tokens)
                } else {
                    g.tokens
                }
            } else if same_lease {
                // Carried = what the lease held at the cut; what was spent
                // since then comes out of the new lease.
                let spent_since = f.tokens_at_send.saturating_sub(cur);
                g.tokens.saturating_sub(spent_since.min(g.carried))
            } else {
                // The generation the carry came from is dead: keep only the
                // fresh tokens.
                g.tokens - g.carried
            }
        });
        if same_lease && !old_refill.is_rate() {
            k.usage.since_tick += k.baseline.saturating_sub(old_seen);
        }
        if rate_grant && continues {
            // What the word clipped (a smaller capacity, or no room for
            // the increment) goes back with the renewal naming this
            // version: the allocator counts it until then.
            let clipped = old_seen.saturating_add(g.tokens).saturating_sub(new_tokens);
            if clipped > 0 {
                self.rare.entry(slot.clone()).or_default().returnable += clipped;
            }
        }
        if g.carried == 0 && g.version_of == 0 && old_deadline <= t && k.lease_id != 0 {
            // The old lease ran out before it was renewed: what it still held
            // is lost.
            metrics.tokens_expired_unused.add(old_seen);
        }
        k.lease_id = g.lease_id;
        // What a lease of tokens was granted (its spent reports count from
        // it); a rate lease reports no spent.
        k.granted = if rate_grant { 0 } else { g.tokens };
        k.generation = new_gen;
        k.baseline = new_tokens;
        metrics.tokens_leased.add(if rate_grant {
            g.tokens
        } else {
            g.tokens - g.carried
        });
        Installed::Done
    }
}

/// What installing one grant came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Installed {
    /// Applied, refused, or given back: the key's batch is settled.
    Done,
    /// Not applied by the allocator: ask again under a new seq.
    AskAgain,
}

/// Size of the per-key emergency bucket of `open` rules (SPEC §2 I3, §6).
/// Defaults: rate `max(this agent's recent admitted rate, R / holders)`,
/// burst `B / holders`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EmergencyConfig {
    /// Fixed rate as a fraction of the rule's rate (instead of the default).
    pub rate_fraction: Option<f64>,
    /// Fixed burst as a fraction of the rule's burst (instead of the default).
    pub burst_fraction: Option<f64>,
}

/// An emergency bucket opened for a fail-open key (SPEC §2 I3).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EmergencyOpened {
    /// Agent clock instant.
    pub at_ns: u64,
    /// Rule id.
    pub rule_id: String,
    /// Tenant part of the key.
    pub tenant: String,
    /// Route part of the key.
    pub route: String,
    /// `r_e`.
    pub rate: Rate,
    /// `b_e`.
    pub burst: u64,
}

/// `(r_e, b_e)` of an emergency bucket: rate `max(recent admitted rate,
/// R / holders)`, burst `B / holders`, each at least 1 and at most the
/// rule's, unless the configuration fixes fractions.
pub(super) fn emergency_size(
    cfg: &EmergencyConfig,
    rule: &Rule,
    recent_per_s: f64,
    holders: u64,
) -> (Rate, u64) {
    let holders = holders.max(1);
    let r = rule.rate;
    let tokens = match cfg.rate_fraction {
        Some(f) => (r.tokens as f64 * f).ceil() as u64,
        None => {
            let recent = (recent_per_s * r.period_s as f64).ceil() as u64;
            recent.max(r.tokens / holders)
        }
    }
    .clamp(1, r.tokens);
    let burst = match cfg.burst_fraction {
        Some(f) => (rule.burst as f64 * f).ceil() as u64,
        None => rule.burst / holders,
    }
    .clamp(1, rule.burst);
    (
        Rate {
            tokens,
            period_s: r.period_s,
        },
        burst,
    )
}

//! The parent's replies: grants applied to the chains (tokens, rates,
//! new chains), and failed calls.

use super::*;

impl RegionalCore {
    /// Apply the parent's reply to the in-flight batch (ignored if it
    /// answers another one: another seq, or a digest that is not our
    /// request's).
    pub fn handle_reply(&mut self, now_ns: u64, reply: &LeaseReply) {
        if reply.shard_count > 1 && !self.warned_sharded {
            // Not built: a regional allocator sends all its keys to one
            // parent; the keys of the parent's other shards are refused.
            self.warned_sharded = true;
            tracing::error!(
                shards = reply.shard_count,
                "the parent allocator is sharded; a regional allocator does not route keys by shard (docs/operations.md \"Sharding\"): keys of the other shards are refused"
            );
        }
        if reply.not_leader && reply.grants.is_empty() {
            // The parent's replicas have no leader yet (SPEC §7; a named
            // leader is followed by the transport): nothing was applied.
            // The pools serve what they hold meanwhile.
            tracing::debug!(
                seq = reply.seq,
                retry_ms = reply.retry_after_ms,
                "the parent's replicas have no leader yet"
            );
            self.handle_failure(now_ns, reply.seq);
            return;
        }
        let Some(f) = self.in_flight.take_if(|f| {
            f.seq == reply.seq
                && (reply.request_digest == 0
                    || reply.request_digest == f.digest
                    || (reply.protocol_version < 4 && reply.request_digest == f.digest_v3)
                    || (reply.protocol_version < 3 && reply.request_digest == f.digest_v2))
        }) else {
            if self.in_flight.as_ref().is_some_and(|f| f.seq == reply.seq) {
                self.stats.upstream_mismatched_replies += 1;
                tracing::error!(
                    seq = reply.seq,
                    "parent reply answers another request (digest differs); ignored"
                );
            }
            return;
        };
        // The answered keys' chains and retry times change: plan them next
        // (their pools' hints for children with them).
        self.wanting.extend(f.items.iter().map(|i| i.key.clone()));
        if reply.ledger_id != 0 {
            self.parent_run =
                quotalease_proto::newest_run(self.parent_ledger_id, self.parent_run, reply);
            self.parent_ledger_id = reply.ledger_id;
            self.parent_cluster.clone_from(&reply.cluster);
        }
        if reply.holder_incarnation > self.incarnation {
            // Our clock stepped back across a restart: move above.
            self.incarnation = reply.holder_incarnation + 1;
        }
        let refused = reply.grants.iter().any(|g| {
            g.status == GrantStatus::Stale as i32
                || g.status == GrantStatus::Unsupported as i32
                || g.status == GrantStatus::SeqConflict as i32
        });
        if refused || reply.grants.len() != f.items.len() + f.slots.len() {
            // Nothing was applied (or the reply is malformed: treat it so;
            // every chain keeps its old lease and deadline).
            self.slot_batch_failed(f);
            self.fail(now_ns);
            return;
        }
        self.stats.upstream_replies += 1;
        let rtt = now_ns.saturating_sub(f.sent_ns);
        self.rtt_ns = if self.rtt_ns == 0 {
            rtt
        } else {
            (self.rtt_ns * 7 + rtt) / 8
        };
        self.last_success_ns = Some(now_ns);
        self.last_failed = false;
        // Rules first, as an agent does.
        if let Some(pb) = &reply.rules {
            if !self.rules_known || pb.version > self.core.rules().version {
                match RuleSet::from_proto(pb) {
                    Ok(rules) => {
                        self.core.set_rules(rules, now_ns);
                        self.rules_known = true;
                        // The parent's hints were about the old rules (a
                        // key served centrally caches a day's denial of
                        // `1/d`): every key may ask again.
                        // So may a chain at the parent's floor: the rule's
                        // rate, and with it the floor, may be lower now.
                        for ks in self.keys.values_mut() {
                            ks.retry_at_ns = 0;
                            ks.due_ns = 0;
                            if let Some(c) = ks.chain.as_mut() {
                                c.floored_until_ns = 0;
                            }
                        }
                        self.stats.rules_adopted += 1;
                    }
                    Err(errs) => {
                        tracing::error!(errors = errs.len(), "rules from the parent rejected");
                    }
                }
            }
        }
        let (token_grants, slot_grants) = reply.grants.split_at(f.items.len());
        self.apply_slot_grants(now_ns, &f.slots, slot_grants);
        for (sent, g) in f.items.iter().zip(token_grants) {
            if sent.release {
                continue;
            }
            self.apply_grant(now_ns, f.sent_ns, sent, g);
            if g.status == GrantStatus::Granted as i32 {
                // What the parent knows is left beyond the region's lease:
                // the pool adds it to its own on every grant to a child
                // (SPEC §5 "What the headers say").
                if let Some(ledger) = self.core.ledger_mut(&sent.key) {
                    ledger.set_pool(PoolTerm::ParentAvailable(g.bucket_available));
                }
            }
        }
        self.update_reachable(now_ns);
    }

    fn apply_grant(&mut self, now_ns: u64, sent_ns: u64, sent: &SentItem, g: &Grant) {
        if g.starting {
            // The parent is starting: children that get nothing are told
            // so (not a limit), until it said it ends.
            let until = now_ns.saturating_add(g.retry_after_ms.saturating_mul(MS));
            self.parent_starting_until_ns = self.parent_starting_until_ns.max(until);
        }
        let deadline = self.deadline(sent_ns, g.ttl_ms);
        let key = &sent.key;
        let ks = self.keys.entry(key.clone()).or_insert_with(|| {
            Box::new(KeyState {
                sample_ns: now_ns,
                ..KeyState::default()
            })
        });
        // The answer changes the key's chain and hints: the next walk
        // visits it.
        ks.due_ns = 0;
        if g.retry_after_ms > 0 {
            // A key served centrally is told the parent's next-token
            // instant, which its children cache their denials until:
            // counted from when the ask left (the parent decided after),
            // never later than the token can exist. Others from now.
            let central = self
                .core
                .rules()
                .get(key.rule())
                .is_some_and(|r| r.rate.served_centrally());
            let from = if central { sent_ns.min(now_ns) } else { now_ns };
            ks.retry_at_ns = from.saturating_add(g.retry_after_ms.saturating_mul(MS));
        }
        if g.status != GrantStatus::Granted as i32 {
            // Refused (unknown rule, key limit, bad item): nothing applied
            // at the parent; the chain, if any, keeps its lease. Ask again
            // in a second at the earliest.
            ks.retry_at_ns = ks.retry_at_ns.max(now_ns.saturating_add(1_000 * MS));
            return;
        }
        if g.holders > 0 {
            ks.parent_holders = g.holders;
        }
        // A rate lease, or an answer to a rate chain's renewal (even one
        // without a new version: "no room", the chain keeps its versions).
        let rate_chain = ks.chain.as_ref().is_some_and(Chain::is_rate);
        if g.capacity > 0 || g.version_of != 0 || rate_chain {
            self.apply_rate_grant(now_ns, deadline, sent, g);
            return;
        }
        if g.carried > g.tokens {
            tracing::error!(rule = %key.rule(), tokens = g.tokens, carried = g.carried, "malformed grant from the parent ignored");
            return;
        }
        let fresh = g.tokens - g.carried;
        let same_chain =
            sent.chain_serial.is_some() && ks.chain.as_ref().map(|c| c.serial) == sent.chain_serial;
        // A parent carries less than the rest asked only when a lowered
        // burst leaves no room for it (SPEC §2 "Rule changes"): the
        // children's sub-leases would then hold more than the new lease
        // backs. That is a break: the old pool is destroyed, the old
        // sub-leases (cut from a lease granted before the change, so
        // ending before it takes effect) are forgotten, and the carried
        // part is left unused.
        let clamped = g.carried < sent.carry_asked;
        if same_chain && g.carried > 0 && g.lease_id != 0 && !clamped {
            // The chain continues: G := carried + fresh, the pool gains fresh.
            let c = ks.chain.as_mut().expect("same_chain");
            c.parent_lease_id = g.lease_id;
            c.granted = g.tokens;
            move_deadline(&mut self.chain_deadlines, c, key, deadline);
            let Some(ledger) = self.core.ledger_mut(key) else {
                return;
            };
            ledger.set_pool(PoolTerm::Deadline(deadline));
            let took = ledger.deposit(now_ns, fresh);
            self.stats.tokens_from_parent += fresh;
            self.stats.tokens_destroyed += fresh - took;
            ks.sample_h += took;
            // Never hold more than the parent lease backs.
            let h = ledger.holding(now_ns);
            if h > g.tokens {
                let d = ledger.drain(now_ns, h - g.tokens);
                self.stats.tokens_destroyed += d;
                ks.sample_h = ks.sample_h.saturating_sub(d);
            }
            return;
        }
        // Not carried: a new chain (or none). The old chain's pool is
        // destroyed; its sub-leases are forgotten by the new ledger, stay
        // valid at the children until their own expiry (<= the old E) and
        // are backed by the old parent lease, which the parent counts until
        // it expires.
        self.new_chain(now_ns, deadline, sent, g, fresh);
    }

    /// A grant of a lease that carries a rate (SPEC §2): the pool refills
    /// here at the rate (slowed by the drift margin) up to the capacity
    /// until `deadline`. A new version of this chain's lease (the parent
    /// knew the version named, or carried the rest of its lease of tokens)
    /// continues the chain: the pool keeps its level (clipped to the new
    /// capacity) and gains the grant's tokens; the version is acknowledged
    /// once what the region holds fits under it. Anything else starts a new
    /// chain, as a break does for leases of tokens.
    fn apply_rate_grant(&mut self, now_ns: u64, deadline: u64, sent: &SentItem, g: &Grant) {
        let key = &sent.key;
        let Some(ks) = self.keys.get_mut(key) else {
            return;
        };
        let same_chain = sent.chain_serial.is_some()
            && ks.chain.as_ref().map(|c| c.serial) == sent.chain_serial
            && (g.version_of != 0 || g.carried > 0);
        if same_chain && g.lease_id == 0 {
            // No new version (no room at the parent): the chain keeps the
            // versions it has.
            return;
        }
        if same_chain && now_ns < deadline {
            let c = ks.chain.as_mut().expect("same_chain");
            let was_rate = c.is_rate();
            c.parent_lease_id = g.lease_id;
            c.rate_utps = g.rate_utps;
            c.floored_until_ns = floored_until(now_ns, self.cfg.core.active_window_ns, sent, g);
            c.capacity = g.capacity;
            c.counted_capacity = c.counted_capacity.max(g.capacity);
            c.counted_rate_utps = c.counted_rate_utps.max(g.rate_utps);
            c.unnamed_tokens |= g.tokens > 0;
            if !was_rate {
                // From a lease of tokens: the parent removed it and counts
                // the new version alone (its capacity covers the rest).
                c.ack_id = g.lease_id;
                c.ack_capacity = g.capacity;
                c.ack_deadline_ns = deadline;
                c.told_ack_id = g.lease_id;
                c.counted_capacity = g.capacity;
                c.counted_rate_utps = g.rate_utps;
                c.unnamed_tokens = false;
            }
            move_deadline(&mut self.chain_deadlines, c, key, deadline);
            let Some(ledger) = self.core.ledger_mut(key) else {
                return;
            };
            // What a smaller capacity does not fit leaves the pool; it is
            // handed back when this chain next names a newer version.
            let d = ledger.set_pool_rate(now_ns, slowed(g.rate_utps), g.capacity);
            c.returnable += d;
            ks.sample_h = ks.sample_h.saturating_sub(d);
            let took = ledger.deposit(now_ns, g.tokens);
            self.stats.tokens_from_parent += g.tokens;
            // Tokens the pool has no room for: the parent counts them on
            // top of the capacity until this version is named, so they go
            // back with the naming, as a shrink's do.
            c.returnable += g.tokens - took;
            ks.sample_h += took;
            if ledger.outstanding() <= g.capacity {
                c.ack_id = g.lease_id;
                c.ack_capacity = g.capacity;
                c.ack_deadline_ns = deadline;
            }
            // Sub-leases live no longer than the acknowledged version
            // (the newest, unless a smaller one waits, see `ack_deadline_ns`).
            ledger.set_pool(PoolTerm::Deadline(c.ack_deadline_ns));
            return;
        }
        // A new chain, as for leases of tokens.
        self.new_chain(now_ns, deadline, sent, g, g.tokens);
    }

    /// Start a new chain for `sent.key` on grant `g` (or none, if it holds
    /// nothing to build one on: a parent lease arriving past its deadline
    /// is left to expire at the parent), depositing `deposit` of its tokens
    /// in a fresh pool; a grant that carries a rate makes the pool refill
    /// at it. The old chain's pool is destroyed; its sub-leases stay backed
    /// by the old parent lease, which the parent counts until it expires.
    fn new_chain(&mut self, now_ns: u64, deadline: u64, sent: &SentItem, g: &Grant, deposit: u64) {
        let key = &sent.key;
        let Some(ks) = self.keys.get_mut(key) else {
            return;
        };
        let old_chain = ks.chain.take();
        let had_chain = old_chain.is_some();
        // What a shrink did not fit and was not handed back is lost with
        // the old chain (the parent counts its versions until they expire).
        self.stats.tokens_destroyed += old_chain.map_or(0, |c| c.returnable);
        let rule = self.core.rules().get(key.rule()).map(|r| (r.rate, r.burst));
        let mut old = self.core.ledger_mut(key);
        // A renewal of a chain that held nothing (every token spent) is not
        // carried by the parent and needs no carrying: not a break.
        let held = old.as_mut().map_or(0, |l| l.holding(now_ns));
        if had_chain && sent.chain_serial.is_some() && held > 0 {
            self.stats.chain_breaks += 1;
        }
        let mut fresh_ledger = match (old, rule) {
            (Some(l), _) => {
                let d = l.drain_pool(now_ns);
                self.stats.tokens_destroyed += d;
                l.fresh_chain(now_ns)
            }
            (None, Some((rate, burst))) => KeyLedger::new_pooled(rate, burst, now_ns),
            (None, None) => return,
        };
        let carries_rate = g.capacity > 0;
        // A lease of tokens with none is nothing; one with a rate refills.
        if g.lease_id == 0 || (g.tokens == 0 && !carries_rate) || now_ns >= deadline {
            if had_chain {
                self.core.replace_ledger(key, fresh_ledger);
            }
            ks.sample_h = 0;
            return;
        }
        fresh_ledger.set_pool(PoolTerm::Deadline(deadline));
        if carries_rate {
            fresh_ledger.set_pool_rate(now_ns, slowed(g.rate_utps), g.capacity);
        }
        let took = fresh_ledger.deposit(now_ns, deposit);
        self.stats.tokens_from_parent += deposit;
        self.stats.tokens_destroyed += deposit - took;
        self.core.replace_ledger(key, fresh_ledger);
        ks.sample_h = took;
        ks.sample_ns = now_ns;
        ks.chain = Some(Chain {
            serial: self.next_serial,
            parent_lease_id: g.lease_id,
            granted: g.tokens,
            deadline_ns: deadline,
            rate_utps: g.rate_utps,
            capacity: g.capacity,
            ack_id: g.lease_id,
            ack_capacity: g.capacity,
            ack_deadline_ns: deadline,
            told_ack_id: g.lease_id,
            counted_capacity: g.capacity,
            counted_rate_utps: g.rate_utps,
            unnamed_tokens: false,
            returnable: 0,
            floored_until_ns: floored_until(now_ns, self.cfg.core.active_window_ns, sent, g),
        });
        self.chain_deadlines
            .push(Reverse((deadline, self.next_serial, key.clone())));
        self.next_serial += 1;
    }

    /// The in-flight batch `seq` failed or timed out (the driver decides the
    /// timeout). Chains keep their leases and deadlines; the next batch has
    /// a new `seq` (a renewal the parent did apply shows up as a chain
    /// break then).
    pub fn handle_failure(&mut self, now_ns: u64, seq: u64) {
        if let Some(f) = self.in_flight.take_if(|f| f.seq == seq) {
            self.slot_batch_failed(f);
            self.fail(now_ns);
        }
    }

    fn fail(&mut self, now_ns: u64) {
        self.walk_all = true;
        self.stats.upstream_failures += 1;
        self.last_failed = true;
        self.not_before_ns = now_ns.saturating_add(self.cfg.renew_interval_ns);
        self.update_reachable(now_ns);
        self.core.set_parent_unreachable(!self.reachable);
    }
}

/// When a chain's new version `g`, granted for `sent`, stops counting as
/// the parent's floor (`Chain::floored_until_ns`): one active window from
/// `now_ns` if it brought more rate than was asked for, else 0.
fn floored_until(now_ns: u64, window_ns: u64, sent: &SentItem, g: &Grant) -> u64 {
    if g.rate_utps > sent.asked_rate_utps {
        now_ns.saturating_add(window_ns)
    } else {
        0
    }
}

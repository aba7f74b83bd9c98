//! The request path: one sans-IO decision for every face.
//!
//! A request is one value ([`Request`]): its input, its cost, when its
//! first step ran, its round, and what it is charged to ([`ChargePlan`]:
//! the rules it matched, the charged ones and the shadow ones, found once
//! per shape by its cached handle, else once per request). [`Agent::step`] decides it at an agent-clock instant over
//! the lease table and the core: an answer, or "wait for the next grant of
//! this key until `until`" ([`Wait`]). How long a round waits is decided
//! here, once; a driver only waits: the tokio one in [`Agent::check_by`]
//! (which every face, Envoy RLS, Check, HTTP and embedders, calls), the
//! simulator by scheduling the next step.
//!
//! The in-process fast path ([`Agent::check_fast`], [`Agent::check_handle`])
//! is the first part of a step for shapes resolved before; a step starts
//! with it.

use super::*;

/// Rounds a request waits for a grant before it is denied.
const MAX_ATTEMPTS: u32 = 2;
/// While the allocator is opening the key upstream a request waits up to
/// `fetch_timeout` from its arrival (or its caller's deadline), asking again
/// as the allocator's hints say, in at most this many rounds. Counting
/// rounds alone let a regional's quick "still opening" answers use them up
/// in 4 ms while its parent's grant was a millisecond away (the demo's cold
/// tenants: most of their denials).
const MAX_ROUNDS_OPENING: u32 = 16;

/// The longest a request waits for an allocator that says it is starting
/// (its 3 s start grace, a restart's wait): its caller's deadline bounds
/// it sooner; an HTTP caller, who cannot give one, is answered within a
/// second (a 503 with `Retry-After`, which HTTP clients understand). Then
/// it is answered `STARTING` (see `Agent::starting`).
const STARTING_WAIT_NS: u64 = 1_000_000_000;

/// How long one waiting round on `slot` of a request that arrived at
/// `since` lasts at `now`: `fetch_timeout`, or for a key being opened what
/// is left of its opening wait (`fetch_timeout` from its arrival, at least
/// 1 ns) — unless the allocator is starting, whose wait outlasts any
/// opening and has its own bound (see `STARTING_WAIT_NS`; a round cut to
/// nothing there spun the simulator, and would the driver).
fn wait_round_ns(slot: &Slot, fetch_timeout_ns: u64, since: u64, now: u64) -> u64 {
    if slot.opening() && !slot.starting() {
        let left = since.saturating_add(fetch_timeout_ns).saturating_sub(now);
        left.clamp(1, fetch_timeout_ns)
    } else {
        fetch_timeout_ns
    }
}

/// One request's charge as the decision sees it: `cost` against the rules
/// of `charges` in `rules`, on the keys of (tenant, route).
#[derive(Clone, Copy)]
struct Charge<'r> {
    rules: &'r RuleSet,
    charges: &'r Charges,
    tenant: &'r str,
    route: &'r str,
    cost: u64,
}

impl<'r> Charge<'r> {
    /// The charge of a request on `input` that matched `m` in `rules`.
    fn of(rules: &'r RuleSet, charges: &'r Charges, input: &CheckInput<'r>, cost: u64) -> Self {
        Charge {
            rules,
            charges,
            tenant: input.tenant,
            route: input.route,
            cost,
        }
    }

    fn rule(&self, i: u32) -> &'r Rule {
        &self.rules.rules[i as usize]
    }
}

/// A request being decided. Made by [`Agent::request`] (which validates
/// it), decided by [`Agent::step`] until it has an answer.
#[derive(Clone, Debug)]
pub struct Request<'a> {
    input: CheckInput<'a>,
    cost: u64,
    parked: Parked,
}

/// A request between its steps without its strings, for a driver that
/// keeps those elsewhere (the simulator): [`Request::park`] and
/// [`Parked::resume`].
#[derive(Clone, Debug, Default)]
pub struct Parked {
    /// When its first step ran (agent clock); None before it.
    since: Option<u64>,
    /// The round: 0 on the first step, `u32::MAX` once the caller's time
    /// is up.
    attempt: u32,
    /// Found by the first step that went past the fast path.
    plan: Option<ChargePlan>,
}

impl<'a> Request<'a> {
    /// The input.
    pub fn input(&self) -> &CheckInput<'a> {
        &self.input
    }

    /// The caller's deadline passed: the next step answers without waiting
    /// (denied with a retry hint, or its fail policy while the allocator
    /// is out of reach or starting).
    pub fn time_up(&mut self) {
        self.parked.attempt = u32::MAX;
    }

    /// The request without its strings, to [`Parked::resume`] later.
    pub fn park(self) -> Parked {
        self.parked
    }
}

impl Parked {
    /// The parked request again, on the same input it was made from.
    pub fn resume(self, input: CheckInput<'_>) -> Request<'_> {
        Request {
            cost: u64::from(input.cost.max(1)),
            input,
            parked: self,
        }
    }
}

/// What a step decided.
#[derive(Clone, Debug, PartialEq)]
pub enum Step {
    /// The answer.
    Answer(Result<CheckResponse, CheckError>),
    /// The request waits for the next grant of a key: the driver pumps
    /// the core and steps again once the core reported the key settled
    /// ([`Event::Settled`], or [`Wait::settled`]) or at `until`.
    Wait(Wait),
}

/// A request's wait for the next grant of `slot`.
#[derive(Clone, Debug, PartialEq)]
pub struct Wait {
    /// The key waited on.
    pub slot: Slot,
    /// `slot.settles()` when the request registered (under the core's
    /// lock): it waits until the count moves on.
    seen: u32,
    /// The latest agent-clock instant to step again at.
    pub until: u64,
}

impl Wait {
    /// The key's batch settled since the request registered.
    pub fn settled(&self) -> bool {
        self.slot.settles() != self.seen
    }
}

/// One round of the slow path decided.
enum Decided {
    Done(Result<CheckResponse, CheckError>),
    /// Registered with the core: wait for the next grant of `slot`.
    Park {
        slot: Slot,
        seen: u32,
    },
}

impl Agent {
    /// A request on `input`, validated (an invalid one is counted and
    /// answered by its error).
    pub fn request<'a>(&self, input: CheckInput<'a>) -> Result<Request<'a>, CheckError> {
        match validate(&input) {
            Ok(cost) => Ok(Request {
                input,
                cost,
                parked: Parked::default(),
            }),
            Err(e) => {
                self.inner.metrics.invalid.add(1);
                Err(e)
            }
        }
    }

    /// Decide `req` at agent-clock instant `now`: its answer, or the key
    /// it waits on and until when. The first step tries this thread's
    /// cached handle of the shape, then matches the rules once; every step
    /// charges the leases or decides what not charging them means.
    /// Replays by request id are [`Agent::check_by`]'s.
    pub fn step(&self, req: &mut Request<'_>, now: u64) -> Step {
        let since = *req.parked.since.get_or_insert(now);
        let plan = match req.parked.plan.take() {
            Some(plan) => plan,
            None => match self.plan(&req.input, req.cost, now) {
                Err(e) => return Step::Answer(Err(e)),
                Ok(Ok(answer)) => return Step::Answer(Ok(answer)),
                Ok(Err(plan)) => plan,
            },
        };
        let charge = Charge::of(&plan.rules, &plan.charges, &req.input, req.cost);
        let decided = self.decide_round(charge, req.parked.attempt, since, now);
        // Kept for the request's next rounds.
        req.parked.plan = Some(plan);
        match decided {
            Decided::Done(answer) => Step::Answer(answer),
            Decided::Park { slot, seen } => {
                let attempt = &mut req.parked.attempt;
                *attempt = attempt.saturating_add(1);
                let fetch_ns = self.inner.cfg.fetch_timeout.as_nanos() as u64;
                let until = now.saturating_add(wait_round_ns(&slot, fetch_ns, since, now));
                Step::Wait(Wait { slot, seen, until })
            }
        }
    }

    /// The start of a request's first step: no rules (unavailable), the
    /// fast path through this thread's cached handle (`Ok(Ok(answer))`),
    /// no rule matched, a cost above a burst (invalid), or what it is
    /// charged to (`Ok(Err(plan))`): the cached handle's plan, found once
    /// per shape, else the rules matched here, once. A shape this thread
    /// has no handle for is decided by the slow path itself (its first
    /// round charges leases that hold enough), not by an uncached fast
    /// attempt first.
    fn plan(
        &self,
        input: &CheckInput<'_>,
        cost: u64,
        t: u64,
    ) -> Result<Result<CheckResponse, ChargePlan>, CheckError> {
        let inner = &*self.inner;
        let Some(snap) = inner.rules.load_full() else {
            inner.metrics.unavailable.add(1);
            return Err(CheckError::Unavailable(
                "no rules yet: the allocator has not been reached".into(),
            ));
        };
        let plan = match self.fast_or_plan(input, cost, t) {
            Ok(a) => {
                // The answer names its rule by index in the rules it was
                // decided under: a publish in between means newer rules
                // than `snap`.
                let rules = match a.rule_version == snap.rules.version {
                    true => snap.rules.clone(),
                    false => inner.rules.rules().unwrap_or_else(|| snap.rules.clone()),
                };
                return Ok(Ok(a.to_response(&rules)));
            }
            // The shape's cached handle could not pay: its plan.
            Err(Some(plan)) => plan,
            Err(None) => {
                let rules = snap.rules.clone();
                let m = match_rules(&rules, input.domain, input.tenant, input.route)?;
                if m.is_empty() {
                    inner.metrics.no_rule.add(1);
                    return Ok(Ok(FastAdmit::no_rule(rules.version).to_response(&rules)));
                }
                let charges = Charges::of(&rules, &m);
                ChargePlan { rules, charges }
            }
        };
        let (rules, charges) = (&plan.rules, &plan.charges);
        for &i in charges.charged() {
            let r = &rules.rules[i as usize];
            if cost > r.burst {
                inner.metrics.invalid.add(1);
                return Err(CheckError::Invalid {
                    field: "cost",
                    reason: format!("{cost} is above the burst {} of rule {}", r.burst, r.id),
                });
            }
        }
        Ok(Err(plan))
    }

    /// The uncached fast path on a shape matched in `snap`'s rules:
    /// admitted when every charged rule's lease pays, else `None` (nothing
    /// charged).
    pub(super) fn fast_charge(
        &self,
        snap: &Snapshot,
        input: &CheckInput<'_>,
        cost: u64,
        t: u64,
    ) -> Option<FastAdmit> {
        let inner = &*self.inner;
        let rules = &*snap.rules;
        let m = match_rules(rules, input.domain, input.tenant, input.route).ok()?;
        if m.is_empty() {
            inner.metrics.no_rule.add(1);
            return Some(FastAdmit::no_rule(rules.version));
        }
        let charges = Charges::of(rules, &m);
        let c = Charge::of(rules, &charges, input, cost);
        if charges.charged().iter().any(|&i| cost > c.rule(i).burst) {
            return None;
        }
        let (remaining, rule_idx) = self.try_charge(c, t).ok()?;
        let reason = self.charge_shadow(c, t);
        inner.metrics.allowed.add(1);
        count_admitted(&snap.counters, charges.all());
        Some(FastAdmit {
            remaining,
            rule_index: Some(rule_idx),
            rule_version: rules.version,
            reason,
        })
    }

    /// One round of the slow path at `t`: charge, deny, apply a fail
    /// policy, or park for the next grant.
    fn decide_round(&self, c: Charge<'_>, attempt: u32, since: u64, t: u64) -> Decided {
        let inner = &*self.inner;
        let rules = c.rules;
        match self.try_charge(c, t) {
            Ok((remaining, rule_idx)) => {
                let reason = self.charge_shadow(c, t);
                inner.metrics.allowed.add(1);
                self.count_admitted(c);
                Decided::Done(Ok(FastAdmit {
                    remaining,
                    rule_index: Some(rule_idx),
                    rule_version: rules.version,
                    reason,
                }
                .to_response(rules)))
            }
            Err((rule_idx, found)) => {
                let rule = &rules.rules[rule_idx];
                let mut core = inner.core.lock();
                let slot = match found {
                    // Still the key's slot (the core forgets a key from the
                    // table and its own state together, under this lock).
                    Some(s) if core.holds(&s) => Some(s),
                    _ => core.slot_for(rule, c.tenant, c.route),
                };
                let Some(slot) = slot else {
                    drop(core);
                    return Decided::Done(self.fail_policy(
                        rule,
                        rules,
                        "the agent holds max_keys keys",
                    ));
                };
                if let Some((status, why)) = core.refused(&slot) {
                    drop(core);
                    inner.metrics.over_limit.add(1);
                    tracing::debug!(rule = %rule.id, ?status, %why, "key refused by the allocator");
                    return Decided::Done(Ok(self.over_limit(rule, rules, 1_000)));
                }
                let dry_until = slot.dry_until();
                let reach = core.reach_of(&slot);
                // Behind a regional allocator whose parent is unreachable the
                // regional's pool still counts as leased: ask it once; when
                // it is dry, the fail policy applies (SPEC §2 I3, §6).
                let parent_cut = reach.parent_down && (attempt > 0 || dry_until > t);
                let cut_off = parent_cut || reach.down || (!reach.connected && attempt > 0);
                // A key the allocator is still fetching from its parent
                // waits for it (see MAX_ROUNDS_OPENING).
                let fetch_ns = inner.cfg.fetch_timeout.as_nanos() as u64;
                let opening_wait = slot.opening()
                    && attempt < MAX_ROUNDS_OPENING
                    && t.saturating_sub(since) < fetch_ns;
                if dry_until > t && !parent_cut && opening_wait {
                    return self.register_wait(&mut core, c, rule_idx, slot, t);
                }
                // The allocator is starting (its grace, a restart's wait):
                // wait through it up to the caller's deadline (at most
                // STARTING_WAIT without one), then say so, never "over
                // limit".
                // (The allocator's last word on the key: its hint may have
                // passed while the next ask is on its way.)
                if slot.starting() && !cut_off {
                    if attempt != u32::MAX && t.saturating_sub(since) < STARTING_WAIT_NS {
                        return self.register_wait(&mut core, c, rule_idx, slot, t);
                    }
                    drop(core);
                    let left_ms = dry_until.saturating_sub(t).div_ceil(1_000_000);
                    return Decided::Done(self.starting(rule, rules, left_ms));
                }
                if dry_until > t && !parent_cut {
                    drop(core);
                    slot.add_denied(c.cost);
                    inner.metrics.over_limit.add(1);
                    // The answer names the denying rule with the largest retry.
                    let first_wait = denial_wait_ns(&slot, rule, c.cost, t);
                    let (ms, idx) = self.largest_retry(c, t, rule_idx, first_wait);
                    return Decided::Done(Ok(self.over_limit(&rules.rules[idx], rules, ms)));
                }
                if cut_off {
                    if rule.fail_policy == FailPolicy::Open {
                        let paid = self.try_charge_emergency(&mut core, c, t);
                        drop(core);
                        return Decided::Done(match paid {
                            Ok((remaining, idx)) => {
                                inner.metrics.failure_mode_allowed.add(1);
                                self.count_rule(&rule.id, |c| &c.failure_mode_allowed);
                                Ok(FastAdmit {
                                    remaining,
                                    rule_index: Some(idx),
                                    rule_version: rules.version,
                                    reason: Reason::FailureModeAllowed,
                                }
                                .to_response(rules))
                            }
                            Err(k) => self.fail_policy(
                                &rules.rules[k],
                                rules,
                                "allocator unreachable; emergency bucket empty",
                            ),
                        });
                    }
                    drop(core);
                    return Decided::Done(self.fail_policy(rule, rules, "allocator unreachable"));
                }
                if attempt >= MAX_ATTEMPTS && !opening_wait {
                    drop(core);
                    slot.add_denied(c.cost);
                    inner.metrics.over_limit.add(1);
                    let ms = inner.cfg.plan.renew_interval.as_millis() as u64;
                    return Decided::Done(Ok(self.over_limit(rule, rules, ms.max(1))));
                }
                self.register_wait(&mut core, c, rule_idx, slot, t)
            }
        }
    }

    /// Register a waiting request with the core: every charged rule of it
    /// that cannot pay asks in the next batch; wake the driver. The request
    /// parks on `slot` (rule `rule_idx`, which could not pay).
    fn register_wait(
        &self,
        core: &mut AgentCore,
        c: Charge<'_>,
        rule_idx: usize,
        slot: Slot,
        t: u64,
    ) -> Decided {
        core.want(slot.clone(), c.cost);
        for &ri in c.charges.charged() {
            if ri as usize == rule_idx {
                continue;
            }
            if let Some(s) = core.slot_for(c.rule(ri), c.tenant, c.route) {
                if s.word.peek(t).is_none_or(|held| held < c.cost) {
                    core.want(s, c.cost);
                }
            }
        }
        self.inner.wake.notify_one();
        let seen = slot.settles();
        Decided::Park { slot, seen }
    }

    /// The lease charge behind the fast path and each round: charge every
    /// charged rule from its lease, or none. `Ok((min remaining, rule
    /// index))` or `Err(index of the first rule that could not pay)`.
    fn try_charge(&self, c: Charge<'_>, t: u64) -> Result<(u64, usize), Unpaid> {
        let table = self.inner.table.pin();
        // (slot, generation) of each charge, for an all-or-none refund.
        let mut taken: [Option<(SlotRef<'_>, u64)>; MAX_MATCHED] = [None; MAX_MATCHED];
        let mut min_remaining = u64::MAX;
        let mut min_rule = c.charges.first as usize;
        for (j, &ri) in c.charges.charged().iter().enumerate() {
            let r = c.rule(ri);
            let slot = table.get(&Lookup::of(r, c.tenant, c.route));
            let take = slot.map_or(Take::NoLease, |s| s.word.try_take(c.cost, t));
            match take {
                Take::Taken {
                    generation,
                    remaining,
                } => {
                    taken[j] = slot.map(|s| (s, generation));
                    let remaining =
                        slot.map_or(remaining, |s| s.global_remaining(remaining, r.burst));
                    if remaining < min_remaining {
                        min_remaining = remaining;
                        min_rule = ri as usize;
                    }
                }
                Take::Short { .. } | Take::NoLease => {
                    // All or none: give back what this request took.
                    for (s, generation) in taken[..j].iter().flatten() {
                        s.word.refund(*generation, c.cost);
                    }
                    // The slot that could not pay, so the slow path need
                    // not look it up again.
                    return Err((ri as usize, slot.map(|s| s.to_owned())));
                }
            }
        }
        self.log_admission(c, t);
        Ok((
            if min_remaining == u64::MAX {
                0
            } else {
                min_remaining
            },
            min_rule,
        ))
    }

    /// Among the charged rules that cannot pay now, the one that asks to
    /// wait longest: (retry in ms, rule index). `first` is the rule already
    /// found denying with `first_wait_ns`.
    fn largest_retry(
        &self,
        c: Charge<'_>,
        t: u64,
        first: usize,
        first_wait_ns: u64,
    ) -> (u64, usize) {
        let table = self.inner.table.pin();
        let mut best = (first_wait_ns, first);
        for &ri in c.charges.charged() {
            if ri as usize == first {
                continue;
            }
            let r = c.rule(ri);
            let Some(slot) = table.get(&Lookup::of(r, c.tenant, c.route)) else {
                continue;
            };
            let short = slot.word.peek(t).is_none_or(|held| held < c.cost);
            let wait = denial_wait_ns(&slot, r, c.cost, t);
            if short && wait > best.0 {
                best = (wait, ri as usize);
            }
        }
        (best.0.div_ceil(1_000_000).max(1), best.1)
    }

    /// Test-only admission log: one line per charged rule.
    fn log_admission(&self, c: Charge<'_>, t: u64) {
        let Some(log) = &self.inner.admission_log else {
            return;
        };
        let mut w = log.lock();
        for &ri in c.charges.charged() {
            let r = c.rule(ri);
            let _ = writeln!(
                w,
                "{t}\t{}\t{}\t{}\t{}",
                r.id,
                r.tenant.key_part(c.tenant),
                r.route.key_part(c.route),
                c.cost
            );
        }
    }

    /// Fail-open admission while the allocator is unreachable (SPEC §2 I3):
    /// every charged rule pays from its lease if it can, and an `open` rule
    /// that cannot pays from its key's emergency bucket. All or none.
    /// `Ok((min remaining, rule index))` or `Err(index of the rule that
    /// could not pay)`.
    fn try_charge_emergency(
        &self,
        core: &mut AgentCore,
        c: Charge<'_>,
        t: u64,
    ) -> Result<(u64, usize), usize> {
        enum Paid {
            Lease(Slot, u64),
            Emergency(Slot),
        }
        let cost = c.cost;
        let mut paid: Vec<Paid> = Vec::with_capacity(c.charges.charged().len());
        let mut min = (u64::MAX, c.charges.first as usize);
        let mut failed = None;
        for &ri in c.charges.charged() {
            let r = c.rule(ri);
            let Some(slot) = core.slot_for(r, c.tenant, c.route) else {
                failed = Some(ri as usize);
                break;
            };
            if let Take::Taken {
                generation,
                remaining,
            } = slot.word.try_take(cost, t)
            {
                let remaining = slot.global_remaining(remaining, r.burst);
                if remaining < min.0 {
                    min = (remaining, ri as usize);
                }
                paid.push(Paid::Lease(slot, generation));
                continue;
            }
            if r.fail_policy != FailPolicy::Open {
                failed = Some(ri as usize);
                break;
            }
            let took = core.emergency_take(&slot, r, cost, t);
            match took {
                Some(remaining) => {
                    if remaining < min.0 {
                        min = (remaining, ri as usize);
                    }
                    paid.push(Paid::Emergency(slot));
                }
                None => {
                    failed = Some(ri as usize);
                    break;
                }
            }
        }
        if let Some(ri) = failed {
            for p in paid {
                match p {
                    Paid::Lease(slot, generation) => {
                        slot.word.refund(generation, cost);
                    }
                    Paid::Emergency(slot) => core.emergency_refund(&slot, cost, t),
                }
            }
            return Err(ri);
        }
        self.log_admission(c, t);
        Ok((if min.0 == u64::MAX { 0 } else { min.0 }, min.1))
    }

    /// Shadow rules decide and report, never deny, never refund.
    fn charge_shadow(&self, c: Charge<'_>, t: u64) -> Reason {
        let mut reason = Reason::Ok;
        for &ri in c.charges.shadow() {
            let r = c.rule(ri);
            let key = Lookup::of(r, c.tenant, c.route);
            let take = self
                .inner
                .table
                .pin()
                .get(&key)
                .map(|s| s.word.try_take(c.cost, t));
            match take {
                Some(Take::Taken { .. }) => {}
                other => {
                    let mut core = self.inner.core.lock();
                    if let Some(slot) = core.slot_for(r, c.tenant, c.route) {
                        let dry = slot.dry_until() > t;
                        // Dry by the allocator's word: over the limit
                        // whether the lease is short or already given
                        // back (a key served centrally holds none).
                        if dry && matches!(other, Some(Take::Short { .. } | Take::NoLease)) {
                            reason = Reason::ShadowOverLimit;
                            self.inner.metrics.shadow_over_limit.add(1);
                        } else {
                            core.want(slot, c.cost);
                            drop(core);
                            self.inner.wake.notify_one();
                        }
                    }
                }
            }
        }
        reason
    }

    /// Count an admission for every rule the request matched (slow path:
    /// the counters in force, if they belong to its rules).
    fn count_admitted(&self, c: Charge<'_>) {
        let counters = self.inner.metrics.by_rule.load();
        if counters.version == c.rules.version {
            count_admitted(&counters, c.charges.all());
        }
    }

    /// Count one result for one rule.
    fn count_rule(&self, rule_id: &str, which: impl Fn(&RuleCounters) -> &Counter) {
        if let Some(c) = self.inner.metrics.by_rule.load().get(rule_id) {
            which(c).add(1);
        }
    }

    fn over_limit(&self, rule: &Rule, rules: &RuleSet, retry_after_ms: u64) -> CheckResponse {
        self.count_rule(&rule.id, |c| &c.over_limit);
        CheckResponse {
            allowed: false,
            remaining: 0,
            retry_after_ms,
            rule_id: rule.id.clone(),
            applied_rule_version: rules.version,
            reason: Reason::OverLimit as i32,
        }
    }

    /// The answer while the allocator is starting (SPEC §2 "First start"):
    /// not a limit. The fail policy's answer with a reason of its own:
    /// `closed` answers unavailable, `open` and `lease_only` deny with
    /// `STARTING` and the time until the wait ends. Counted as a fail
    /// policy's denial. (`open` does not admit through the emergency
    /// bucket here: the allocator is reachable, and I3 allows excess only
    /// while it is not.)
    fn starting(
        &self,
        rule: &Rule,
        rules: &RuleSet,
        left_ms: u64,
    ) -> Result<CheckResponse, CheckError> {
        let why = format!("the allocator is starting (granting in {left_ms} ms)");
        self.policy_denial(rule, rules, &why, left_ms.max(1), Reason::Starting)
    }

    fn fail_policy(
        &self,
        rule: &Rule,
        rules: &RuleSet,
        why: &str,
    ) -> Result<CheckResponse, CheckError> {
        let retry_ms = self.inner.cfg.fetch_timeout.as_millis() as u64;
        self.policy_denial(rule, rules, why, retry_ms, Reason::FailureModeDenied)
    }

    /// A fail policy's denial, counted as one: `closed` answers
    /// unavailable saying `why`; `open` and `lease_only` deny with
    /// `reason`, to retry after `retry_after_ms`.
    fn policy_denial(
        &self,
        rule: &Rule,
        rules: &RuleSet,
        why: &str,
        retry_after_ms: u64,
        reason: Reason,
    ) -> Result<CheckResponse, CheckError> {
        let m = &self.inner.metrics;
        self.count_rule(&rule.id, |c| &c.failure_mode_denied);
        match rule.fail_policy {
            FailPolicy::Closed => {
                m.unavailable.add(1);
                m.closed_unavailable.add(1);
                Err(CheckError::Unavailable(format!(
                    "rule {}: {why}; fail_policy closed",
                    rule.id
                )))
            }
            FailPolicy::Open | FailPolicy::LeaseOnly => {
                m.failure_mode_denied.add(1);
                Ok(CheckResponse {
                    allowed: false,
                    remaining: 0,
                    retry_after_ms,
                    rule_id: rule.id.clone(),
                    applied_rule_version: rules.version,
                    reason: reason as i32,
                })
            }
        }
    }
}

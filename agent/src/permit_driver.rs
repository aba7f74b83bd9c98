//! The agent's permits, driven (issue 34, docs/permits.md "The agent's
//! driver"): one [`PermitKey`] per concurrency key behind one mutex,
//! acquires that wait in arrival order up to a deadline, and a tokio task
//! that carries the keys' asks to the allocator as `SLOTS` items and the
//! grants back.
//!
//! * **Its own holder.** The driver sends its batches under the agent's
//!   id with an instance nonce of its own: the allocator keeps its
//!   sequence numbers, reply cache and leases apart from the token
//!   side's, so the two never wait on each other's messages.
//! * **When it asks**: a key whose waiters miss slots and that has no ask
//!   out; a lease within half its TTL of its use-by while permits stand on
//!   it or acquires wait; a lease with free slots while the allocator says
//!   another holder misses some (`contended`: give back what no permit
//!   uses) or while nothing uses it at renewal time (give it all back).
//! * **A lost reply** is safe: the ask's promise stands (at most `keep`
//!   permits on the lease it named) and the next ask goes out on the next
//!   tick under a new sequence number; permits never outlive their
//!   lease's use-by, which falls before the allocator's expiry of it.
//! * **A waiter that goes away** (its future dropped, or its deadline
//!   passed) is cancelled; a permit that reached it in the race is
//!   released at once.
//! * Not yet: fail policies while the allocator is unreachable (today an
//!   acquire waits for slots up to its deadline under every policy),
//!   forwarded releases, sharded allocators beyond shard routing of the
//!   batch (a `WRONG_SHARD` answer is asked again), SIGTERM keeping the
//!   slots that back permits (a stop gives nothing back: the leases run
//!   out).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use quotalease_model::clock::ClockSource;
use quotalease_model::key::KeyId;
use quotalease_model::rules::{FailPolicy, PermitRule, RuleSet};
use quotalease_proto::lease::{
    ForwardedRelease, GrantStatus, ItemKind, LeaseBatch, LeaseItem, LeaseReply, RequestHeader,
    SlotWait,
};
use quotalease_proto::PROTOCOL_VERSION;
use tokio::sync::{oneshot, Notify};

use crate::permits::policy::AskPolicy;
use crate::permits::{
    AcquireError, Granted, Permit, PermitKey, PermitSettings, RenewError, SentAsk,
    RETRY_HINT_UNKNOWN_NS,
};
use crate::transport::Transport;

/// How often the driver looks at its keys when nothing wakes it.
const TICK: Duration = Duration::from_millis(50);

/// Times the driver sends an unanswered batch of slot asks again, the
/// same batch (same sequence number), before it gives its asks up and
/// asks anew: a copy that reached the allocator is answered from its reply
/// cache with the grant already made, so a lost or late reply does not
/// leave a lease that no one uses counted until it expires.
pub const BATCH_RETRIES: u32 = 3;

/// Acquires that may wait for one key at one agent: beyond this an
/// acquire is answered [`PermitError::QueueFull`] at once (a queue that
/// long is a backlog, not a semaphore; SPEC §8: bounded, with a clear
/// answer).
pub const MAX_WAITERS_PER_KEY: usize = 4096;

/// Acquires' request ids remembered at most (see [`Permits::remember`]).
pub const MAX_REMEMBERED: usize = 100_000;

/// While the allocator is unreachable, a batch goes out at least this
/// often (a probe: the fail policies stop applying once it is answered).
const PROBE_EVERY_NS: u64 = 250_000_000;

/// Ids of emergency permits (fail-open, below) start here: never those of
/// a key's semaphore.
const EMERGENCY_IDS: u64 = 1 << 62;

/// What a waiter is sent: a permit, or why it gets none.
type Answer = Result<Permit, PermitError>;

/// A batch sent and not answered yet: the batch, what each of its items
/// asked, and how many times it was sent.
type Unanswered = (LeaseBatch, Vec<(KeyId, SentAsk)>, u32);

/// One shard's asks: the items, what each asked, the batch TTL (ns).
type ShardAsks = (Vec<LeaseItem>, Vec<(KeyId, SentAsk)>, u64);

/// A permit as the driver hands it out: its key and the permit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeldPermit {
    /// The concurrency key it counts against.
    pub key: KeyId,
    /// The permit (its id, slots, expiry and fencing token).
    pub permit: Permit,
    /// Granted by the fail-open emergency semaphore while the allocator
    /// was unreachable: outside I4 (counted as failure-mode allowed).
    pub failure_mode: bool,
}

/// Why an acquire got no permit.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PermitError {
    /// No rule with `concurrency` selects the request.
    #[error("no rule with concurrency matches the request")]
    NoRule,
    /// More slots than the rule's `N` (or 0).
    #[error("slots: {0}")]
    Invalid(String),
    /// The deadline passed before slots were free: nothing is held. Try
    /// again after `retry_after_ms` (this agent's estimate,
    /// [`crate::permits::PermitKey::retry_hint_ns`]).
    #[error("no slot was free before the deadline; retry after {retry_after_ms} ms")]
    Timeout {
        /// When to try again.
        retry_after_ms: u64,
    },
    /// The permit is past its expiry or was released: never revived.
    #[error("the permit expired or was released")]
    Expired,
    /// The agent is stopping.
    #[error("the agent is stopping")]
    Stopping,
    /// This many acquires already wait for the key at this agent: not
    /// queued (try again later, or at another agent).
    #[error("{0} acquires already wait for this key at this agent; not queued")]
    QueueFull(usize),
    /// The allocator is unreachable and the rule is fail-closed.
    #[error("{0}")]
    Unavailable(String),
    /// A rate rule of the request denied it: the permits taken were
    /// released.
    #[error("a rate rule denied the request (rule {rule_id}); retry after {retry_after_ms} ms")]
    RateLimited {
        /// The denying rule.
        rule_id: String,
        /// When to try again.
        retry_after_ms: u64,
    },
    /// The request is invalid for a rate rule beside it, or rules are not
    /// known yet.
    #[error("{0}")]
    Check(String),
}

/// Settings the driver needs of its agent.
#[derive(Clone, Debug)]
pub struct PermitsConfig {
    /// The agent id sent in headers.
    pub agent_id: String,
    /// The instance nonce of this holder (not the token side's).
    pub instance: u64,
    /// The incarnation sent.
    pub incarnation: u64,
    /// `--cluster` ("" when not set).
    pub cluster: String,
    /// Slot lease TTL asked for.
    pub lease_ttl: Duration,
    /// Stall allowance (`epsilon`).
    pub epsilon: Duration,
    /// Bound on one allocator call.
    pub fetch_timeout: Duration,
    /// The agent's clock.
    pub clock: ClockSource,
    /// The agent's metrics (the permit counters are `metrics.permits`).
    pub metrics: Arc<crate::metrics::AgentMetrics>,
}

struct KeyEntry {
    pk: PermitKey,
    /// Acquires waiting, by the key's waiter id.
    waiters: HashMap<u64, oneshot::Sender<Answer>>,
    /// The rule's id and fail policy (SPEC §4: `closed` answers at once
    /// while the allocator is unreachable, `lease_only` waits on the
    /// slots held, `open` adds an emergency semaphore).
    rule_id: String,
    policy: FailPolicy,
    /// Permits of the emergency semaphore, held.
    emergency: Vec<Permit>,
    /// When to ask (one copy of the policy, shared with the simulator);
    /// its holders count sizes the emergency semaphore, `max(1, N /
    /// holders)` (1 while unknown).
    asking: AskPolicy,
    /// A `WaitSlots` wake-up of this key is out.
    waking: bool,
    /// No wake-up before this (the allocator did not serve the last one).
    wake_after_ns: u64,
}

/// After a wake-up the allocator did not serve (an older allocator, a
/// replica that does not lead, an error), the key waits this long before
/// the next one (it asks on its tick meanwhile).
const WAKE_BACKOFF_NS: u64 = 1_000_000_000;

#[derive(Default)]
struct State {
    keys: HashMap<KeyId, KeyEntry>,
    next_seq: u64,
    /// Shards the allocator last said it has (1 before any reply).
    shard_count: u32,
    /// Since when calls fail (an error or a timeout; cleared by a reply).
    failing_since: Option<u64>,
    /// Since when replicas answer without a leader (cleared by a grant).
    no_leader_since: Option<u64>,
    next_emergency_id: u64,
    /// When the last batch went out (for the probe while unreachable).
    last_probe_ns: u64,
}

impl State {
    /// The allocator is taken for unreachable (its fail policies apply):
    /// the last call failed, or replicas have had no leader for longer
    /// than an election takes (the token side's grace).
    fn unreachable(&self, now: u64) -> bool {
        self.failing_since.is_some()
            || self.no_leader_since.is_some_and(|t| {
                now.saturating_sub(t) > crate::core::NO_LEADER_GRACE.as_nanos() as u64
            })
    }
}

struct Inner {
    /// Acquires' request ids (with tenant, route and slots) and the
    /// permits they got, while those live ([`Permits::remembered`]).
    requests: Mutex<HashMap<String, Vec<(KeyId, u64)>>>,
    /// The driver task (awaited by [`Permits::shutdown`]).
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
    cfg: PermitsConfig,
    transport: Arc<dyn Transport>,
    state: Mutex<State>,
    wake: Notify,
    stop: AtomicBool,
}

/// The agent's permits (cheap to clone).
#[derive(Clone)]
pub struct Permits {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Permits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Permits")
            .field("keys", &self.inner.state.lock().keys.len())
            .finish()
    }
}

/// Cancels a waiter whose acquire future is dropped or timed out.
struct Waiting<'a> {
    permits: &'a Permits,
    key: KeyId,
    waiter: u64,
    rx: Option<oneshot::Receiver<Answer>>,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let Some(mut rx) = self.rx.take() else {
            return;
        };
        let mut st = self.permits.inner.state.lock();
        if let Some(e) = st.keys.get_mut(&self.key) {
            e.pk.cancel(self.waiter);
            e.waiters.remove(&self.waiter);
            // A permit that reached it in the race goes back at once.
            if let Ok(Ok(p)) = rx.try_recv() {
                let now = self.permits.inner.cfg.clock.now();
                if !take_emergency(e, p.id) {
                    e.pk.release(now, p.id);
                }
            }
        }
        drop(st);
        self.permits.inner.wake.notify_one();
    }
}

impl Permits {
    /// Permits over `transport`, with the driver task spawned on the
    /// current runtime.
    pub fn start(cfg: PermitsConfig, transport: Arc<dyn Transport>) -> Permits {
        let p = Permits {
            inner: Arc::new(Inner {
                requests: Mutex::new(HashMap::new()),
                task: Mutex::new(None),
                cfg,
                transport,
                state: Mutex::new(State {
                    next_seq: 1,
                    shard_count: 1,
                    next_emergency_id: EMERGENCY_IDS,
                    ..State::default()
                }),
                wake: Notify::new(),
                stop: AtomicBool::new(false),
            }),
        };
        let bg = p.clone();
        *p.inner.task.lock() = Some(tokio::spawn(async move { bg.run().await }));
        p
    }

    /// Stop the driver (leases held run out on their own).
    pub fn stop(&self) {
        self.inner.stop.store(true, Ordering::Release);
        self.inner.wake.notify_one();
    }

    /// Stop (SIGTERM): waiters are answered [`PermitError::Stopping`], and
    /// every key's slot lease is renewed keeping only the slots that back
    /// permits still held (they run to their expiries; the allocator
    /// counts their slots until then) while the unused ones go back at
    /// once. Bounded by the fetch timeout; what cannot be given back
    /// expires on its own.
    pub async fn shutdown(&self) {
        self.stop();
        // The driver's batch in flight first: the last word on each key is
        // this one.
        let task = self.inner.task.lock().take();
        if let Some(t) = task {
            let _ = tokio::time::timeout(self.inner.cfg.fetch_timeout, t).await;
        }
        let now = self.inner.cfg.clock.now();
        let asked: Vec<(KeyId, SentAsk, LeaseItem)> = {
            let mut st = self.inner.state.lock();
            let mut out = Vec::new();
            for (key, e) in st.keys.iter_mut() {
                for (w, _) in e.waiters.drain() {
                    e.pk.cancel(w);
                }
                if e.pk.current().is_none() {
                    continue;
                }
                let sent = e.asking.send(&mut e.pk, now, true);
                let item = slots_item(key, &sent);
                out.push((key.clone(), sent, item));
            }
            out
        };
        if asked.is_empty() {
            return;
        }
        let shards = self.inner.state.lock().shard_count.max(1);
        let mut by_shard: HashMap<u32, Vec<LeaseItem>> = HashMap::new();
        for (key, _, item) in asked {
            let shard = quotalease_proto::shard_of(key.rule(), key.tenant(), key.route(), shards);
            by_shard.entry(shard).or_default().push(item);
        }
        for (shard, items) in by_shard {
            let n = items.len();
            let batch = self.batch(shard, items, self.inner.cfg.lease_ttl.as_nanos() as u64);
            match tokio::time::timeout(
                self.inner.cfg.fetch_timeout,
                self.inner.transport.lease(batch),
            )
            .await
            {
                Ok(Ok(_)) => {
                    tracing::info!(keys = n, "permits: unused slots given back on shutdown")
                }
                _ => tracing::warn!(
                    "permits: could not give slots back on shutdown; they expire on their own"
                ),
            }
        }
    }

    /// A batch of `items` for `shard` under the next sequence number.
    fn batch(&self, shard: u32, items: Vec<LeaseItem>, ttl_ns: u64) -> LeaseBatch {
        let seq = {
            let mut st = self.inner.state.lock();
            let seq = st.next_seq;
            st.next_seq += 1;
            seq
        };
        let cfg = &self.inner.cfg;
        LeaseBatch {
            header: Some(RequestHeader {
                agent_id: cfg.agent_id.clone(),
                incarnation: cfg.incarnation,
                seq,
                protocol_version: PROTOCOL_VERSION,
                instance: cfg.instance,
                cluster: cfg.cluster.clone(),
                // The rules come to the agent through its token side.
                rules_version: u64::MAX,
                ..RequestHeader::default()
            }),
            items,
            ttl_ms: ttl_ns.div_ceil(1_000_000),
            shard,
        }
    }

    /// Acquire `slots` of the key `rule` selects for (tenant, route),
    /// waiting in arrival order up to `wait`. Counted in the agent's
    /// metrics by result.
    pub async fn acquire(
        &self,
        rule: &PermitRule,
        tenant: &str,
        route: &str,
        slots: u64,
        wait: Duration,
    ) -> Result<HeldPermit, PermitError> {
        let start = tokio::time::Instant::now();
        let r = self.acquire_inner(rule, tenant, route, slots, wait).await;
        let m = &self.inner.cfg.metrics.permits;
        match &r {
            Ok(h) if h.failure_mode => m.failure_mode.add(1),
            Ok(_) => {
                m.acquired.add(1);
                m.record_wait(start.elapsed());
            }
            Err(PermitError::Timeout { .. }) => m.timeouts.add(1),
            Err(PermitError::Unavailable(_)) => m.unavailable.add(1),
            Err(PermitError::QueueFull(_)) => m.queue_full.add(1),
            Err(_) => {}
        }
        r
    }

    async fn acquire_inner(
        &self,
        rule: &PermitRule,
        tenant: &str,
        route: &str,
        slots: u64,
        wait: Duration,
    ) -> Result<HeldPermit, PermitError> {
        if self.inner.stop.load(Ordering::Acquire) {
            return Err(PermitError::Stopping);
        }
        let key = KeyId::new(
            &rule.id,
            rule.tenant.key_part(tenant),
            rule.route.key_part(route),
        );
        let settings = PermitSettings {
            n: rule.concurrency,
            permit_ttl_ns: rule.permit_ttl_ms.saturating_mul(1_000_000),
            max_hold_ns: rule.max_hold_ms.saturating_mul(1_000_000),
            // A permit lives on one slot lease: ask for leases as long as
            // the permit TTL (the allocator grants at most its TTL_max).
            lease_ttl_ns: (self.inner.cfg.lease_ttl.as_nanos() as u64)
                .max(rule.permit_ttl_ms.saturating_mul(1_000_000)),
            epsilon_ns: self.inner.cfg.epsilon.as_nanos() as u64,
        };
        let now = self.inner.cfg.clock.now();
        let (waiter, rx) = {
            let mut st = self.inner.state.lock();
            let unreachable = st.unreachable(now);
            let emergency_id = st.next_emergency_id;
            let e = st.keys.entry(key.clone()).or_insert_with(|| KeyEntry {
                pk: PermitKey::new(settings),
                waiters: HashMap::new(),
                rule_id: rule.id.clone(),
                policy: rule.fail_policy,
                emergency: Vec::new(),
                asking: AskPolicy::new(settings.lease_ttl_ns),
                waking: false,
                wake_after_ns: 0,
            });
            if e.pk.settings() != settings {
                e.pk.set_settings(settings);
            }
            e.policy = rule.fail_policy;
            if e.waiters.len() >= MAX_WAITERS_PER_KEY {
                return Err(PermitError::QueueFull(MAX_WAITERS_PER_KEY));
            }
            match e.pk.acquire(now, slots) {
                Ok(permit) => {
                    return Ok(HeldPermit {
                        key,
                        permit,
                        failure_mode: false,
                    })
                }
                Err(AcquireError::Invalid) => {
                    return Err(PermitError::Invalid(format!(
                        "{slots} is not within 1..={} (the concurrency of rule {})",
                        rule.concurrency, rule.id
                    )))
                }
                Err(AcquireError::Queued(w)) => {
                    match unreachable
                        .then(|| fail_policy(e, now, slots, emergency_id))
                        .flatten()
                    {
                        Some(answer) => {
                            e.pk.cancel(w);
                            if answer.is_ok() {
                                st.next_emergency_id += 1;
                            }
                            return answer.map(|permit| HeldPermit {
                                key,
                                permit,
                                failure_mode: true,
                            });
                        }
                        // Reachable, `lease_only`, or the emergency
                        // semaphore is full: wait for slots.
                        None => {
                            let (tx, rx) = oneshot::channel();
                            e.waiters.insert(w, tx);
                            (w, rx)
                        }
                    }
                }
            }
        };
        self.inner.wake.notify_one();
        let mut waiting = Waiting {
            permits: self,
            key: key.clone(),
            waiter,
            rx: Some(rx),
        };
        let rx = waiting.rx.as_mut().expect("set above");
        match tokio::time::timeout(wait, rx).await {
            Ok(Ok(Ok(permit))) => {
                waiting.rx = None;
                let failure_mode = permit.id >= EMERGENCY_IDS;
                Ok(HeldPermit {
                    key,
                    permit,
                    failure_mode,
                })
            }
            Ok(Ok(Err(e))) => {
                waiting.rx = None;
                Err(e)
            }
            // The driver stopped (its sender dropped).
            Ok(Err(_)) => Err(PermitError::Stopping),
            // Dropping `waiting` cancels the waiter (and releases a permit
            // that reached it in the race); first its place tells when to
            // come back.
            Err(_) => {
                let now = self.inner.cfg.clock.now();
                let hint_ns = self
                    .inner
                    .state
                    .lock()
                    .keys
                    .get(&key)
                    .map_or(RETRY_HINT_UNKNOWN_NS, |e| e.pk.retry_hint_ns(now, waiter));
                Err(PermitError::Timeout {
                    retry_after_ms: hint_ns.div_ceil(1_000_000),
                })
            }
        }
    }

    /// Extend permit `id` of `key` by its rule's permit TTL (within its
    /// lease's use-by and `max_hold`): its new expiry, agent clock.
    pub fn renew(&self, key: &KeyId, id: u64) -> Result<u64, PermitError> {
        let now = self.inner.cfg.clock.now();
        let mut st = self.inner.state.lock();
        let Some(e) = st.keys.get_mut(key) else {
            return Err(PermitError::Expired);
        };
        if id >= EMERGENCY_IDS {
            return renew_emergency(e, now, id);
        }
        e.pk.renew(now, id)
            .map_err(|RenewError::Expired| PermitError::Expired)
    }

    /// Release permit `id` of `key` (idempotent): whether it was held.
    /// Waiters behind it are served at once.
    pub fn release(&self, key: &KeyId, id: u64) -> bool {
        let now = self.inner.cfg.clock.now();
        let released = {
            let mut st = self.inner.state.lock();
            let Some(e) = st.keys.get_mut(key) else {
                return false;
            };
            if id >= EMERGENCY_IDS {
                expire_emergency(e, now);
                let released = take_emergency(e, id);
                if released {
                    self.inner.cfg.metrics.permits.released.add(1);
                }
                return released;
            }
            let released = e.pk.release(now, id);
            if released {
                serve(e, now);
            }
            released
        };
        if released {
            self.inner.cfg.metrics.permits.released.add(1);
            self.inner.wake.notify_one();
        }
        released
    }

    /// The permits an earlier acquire under `request` got, when every one
    /// of them is still held (a retried acquire gets the same permits).
    pub fn remembered(&self, request: &str) -> Option<Vec<HeldPermit>> {
        let ids = self.inner.requests.lock().get(request)?.clone();
        let now = self.inner.cfg.clock.now();
        let mut st = self.inner.state.lock();
        let mut out = Vec::with_capacity(ids.len());
        for (key, id) in ids {
            let e = st.keys.get_mut(&key)?;
            expire_emergency(e, now);
            let permit =
                e.pk.permits(now)
                    .iter()
                    .chain(e.emergency.iter())
                    .find(|p| p.id == id)
                    .copied()?;
            out.push(HeldPermit {
                key,
                permit,
                failure_mode: id >= EMERGENCY_IDS,
            });
        }
        Some(out)
    }

    /// Remember what an acquire under `request` got. At most
    /// [`MAX_REMEMBERED`] requests: past that, those whose permits are
    /// all gone are forgotten first, then the map is cleared (a retry then
    /// takes a new permit, as a retry without an id does).
    pub fn remember(&self, request: String, got: &[HeldPermit]) {
        let ids: Vec<(KeyId, u64)> = got.iter().map(|h| (h.key.clone(), h.permit.id)).collect();
        let full = self.inner.requests.lock().len() >= MAX_REMEMBERED;
        if full {
            let all: Vec<String> = self.inner.requests.lock().keys().cloned().collect();
            let gone: Vec<String> = all
                .into_iter()
                .filter(|r| self.remembered(r).is_none())
                .collect();
            let mut requests = self.inner.requests.lock();
            for r in gone {
                requests.remove(&r);
            }
            if requests.len() >= MAX_REMEMBERED {
                requests.clear();
            }
        }
        self.inner.requests.lock().insert(request, ids);
    }

    /// The permits of `key` valid now.
    pub fn held(&self, key: &KeyId) -> Vec<Permit> {
        let now = self.inner.cfg.clock.now();
        let mut st = self.inner.state.lock();
        st.keys
            .get_mut(key)
            .map(|e| {
                expire_emergency(e, now);
                let mut all = e.pk.permits(now).to_vec();
                all.extend(e.emergency.iter().copied());
                all
            })
            .unwrap_or_default()
    }

    /// The driver: ask, send, apply; until stopped.
    async fn run(self) {
        // Batches whose call failed or timed out, to send again as they
        // are (their keys stay in flight meanwhile): (batch, its asks,
        // sends so far).
        let mut retry: Vec<Unanswered> = Vec::new();
        while !self.inner.stop.load(Ordering::Acquire) {
            let _ = tokio::time::timeout(TICK, self.inner.wake.notified()).await;
            if self.inner.stop.load(Ordering::Acquire) {
                break;
            }
            let mut out = std::mem::take(&mut retry);
            out.extend(self.batches().into_iter().map(|(b, a)| (b, a, 1)));
            for (batch, asked, sends) in out {
                let sent_at = self.inner.cfg.clock.now();
                let reply = tokio::time::timeout(
                    self.inner.cfg.fetch_timeout,
                    self.inner.transport.lease(batch.clone()),
                )
                .await;
                match reply {
                    Ok(Ok(reply)) if reply.grants.len() == asked.len() => {
                        {
                            let mut st = self.inner.state.lock();
                            st.failing_since = None;
                            st.no_leader_since = None;
                        }
                        self.apply(reply, asked)
                    }
                    Ok(Ok(reply)) => {
                        // A replica without a leader answers with no grants
                        // (nothing applied): asked anew once one leads.
                        tracing::debug!(
                            not_leader = reply.not_leader,
                            "permits: slot asks not applied; asked again on the next tick"
                        );
                        {
                            let mut st = self.inner.state.lock();
                            st.failing_since = None;
                            st.no_leader_since.get_or_insert(sent_at);
                        }
                        self.not_answered(&asked);
                    }
                    failed => {
                        // Failed or timed out: it may have been applied and
                        // its reply lost. The same batch again is answered
                        // from the allocator's reply cache if so (BATCH_RETRIES).
                        match &failed {
                            Ok(Err(why)) => {
                                tracing::debug!(%why, sends, "permits: slot asks not answered")
                            }
                            _ => tracing::debug!(
                                waited_ms = (self.inner.cfg.clock.now().saturating_sub(sent_at))
                                    / 1_000_000,
                                sends,
                                "permits: slot asks timed out"
                            ),
                        }
                        self.inner.state.lock().failing_since.get_or_insert(sent_at);
                        if sends <= BATCH_RETRIES {
                            retry.push((batch, asked, sends + 1));
                        } else {
                            self.not_answered(&asked);
                        }
                    }
                }
            }
            self.apply_fail_policies();
            self.forget_idle();
            self.start_wakes();
        }
        // Waiters learn the driver is gone (their receivers see the
        // senders dropped); the leases stay for `shutdown`.
        for e in self.inner.state.lock().keys.values_mut() {
            for (w, _) in e.waiters.drain() {
                e.pk.cancel(w);
            }
        }
    }

    /// Wake-ups for the keys that want one and have none out
    /// (docs/permits.md "Slots follow demand"): a task per key waits for
    /// the allocator's `WaitSlots` answer (bounded by the fetch timeout,
    /// which bounds every call on the channel) and hands it to the key's
    /// policy; the driver then asks at once.
    fn start_wakes(&self) {
        let now = self.inner.cfg.clock.now();
        let fetch = self.inner.cfg.fetch_timeout;
        // The channel's call timeout is the fetch timeout: wait less.
        let wait_ms = (fetch.as_millis() as u64 * 4 / 5).clamp(20, 1_000);
        let mut st = self.inner.state.lock();
        if st.unreachable(now) {
            return;
        }
        let shards = st.shard_count.max(1);
        for (key, e) in st.keys.iter_mut() {
            if e.waking || now < e.wake_after_ns {
                continue;
            }
            let Some(want) = e.asking.wake_wanted(&e.pk) else {
                continue;
            };
            e.waking = true;
            let w = SlotWait {
                rule_id: key.rule().to_string(),
                tenant: key.tenant().to_string(),
                route: key.route().to_string(),
                room: want.room,
                contended: want.contended,
                releases: want.releases,
                wait_ms: wait_ms as u32,
                shard: quotalease_proto::shard_of(key.rule(), key.tenant(), key.route(), shards),
                agent_id: self.inner.cfg.agent_id.clone(),
                instance: self.inner.cfg.instance,
            };
            let inner = self.inner.clone();
            let key = key.clone();
            tokio::spawn(async move {
                let answer = tokio::time::timeout(fetch, inner.transport.wait_slots(w)).await;
                let now = inner.cfg.clock.now();
                let (room, contended, released) = match answer {
                    Ok(Ok(a)) if !a.not_here => (
                        want.room && a.room > 0,
                        want.contended && a.contended,
                        a.released,
                    ),
                    _ => (false, false, false),
                };
                let served = matches!(answer, Ok(Ok(ref a)) if !a.not_here);
                {
                    let mut st = inner.state.lock();
                    if let Some(e) = st.keys.get_mut(&key) {
                        e.waking = false;
                        if !served {
                            e.wake_after_ns = now.saturating_add(WAKE_BACKOFF_NS);
                        }
                        e.asking.on_wake(room, contended, released);
                    }
                }
                let m = &inner.cfg.metrics.permits;
                if room {
                    m.wakeups_room.add(1);
                }
                if contended {
                    m.wakeups_contended.add(1);
                }
                if room || contended || released {
                    inner.wake.notify_one();
                }
            });
        }
    }

    /// The asks due now, one batch per shard.
    fn batches(&self) -> Vec<(LeaseBatch, Vec<(KeyId, SentAsk)>)> {
        let now = self.inner.cfg.clock.now();
        let mut st = self.inner.state.lock();
        let shards = st.shard_count.max(1);
        let mut by_shard: HashMap<u32, ShardAsks> = HashMap::new();
        for (key, e) in st.keys.iter_mut() {
            let ttl_ns = e.pk.settings().lease_ttl_ns;
            let Some(sent) = e.asking.due(&mut e.pk, now) else {
                continue;
            };
            let item = slots_item(key, &sent);
            let shard = quotalease_proto::shard_of(key.rule(), key.tenant(), key.route(), shards);
            let b = by_shard.entry(shard).or_default();
            b.0.push(item);
            b.1.push((key.clone(), sent));
            // One TTL per batch: the longest its keys ask for (a key that
            // asked for less counts its use-by from its own).
            b.2 = b.2.max(ttl_ns);
        }
        // While unreachable, one key asks every PROBE_EVERY_NS even with
        // nothing to ask for: fail policies answer acquires at once, so
        // without a probe nothing would learn that the allocator is back.
        if by_shard.is_empty()
            && st.unreachable(now)
            && now.saturating_sub(st.last_probe_ns) >= PROBE_EVERY_NS
        {
            if let Some((key, e)) = st.keys.iter_mut().find(|(_, e)| !e.asking.in_flight()) {
                let sent = e.asking.send(&mut e.pk, now, false);
                let ttl_ns = e.pk.settings().lease_ttl_ns;
                let shard =
                    quotalease_proto::shard_of(key.rule(), key.tenant(), key.route(), shards);
                by_shard.insert(
                    shard,
                    (
                        vec![slots_item(key, &sent)],
                        vec![(key.clone(), sent)],
                        ttl_ns,
                    ),
                );
            }
        }
        if !by_shard.is_empty() {
            st.last_probe_ns = now;
        }
        drop(st);
        by_shard
            .into_iter()
            .map(|(shard, (items, asked, ttl_ns))| (self.batch(shard, items, ttl_ns), asked))
            .collect()
    }

    /// A reply: each grant to its key, then the waiters served.
    fn apply(&self, mut reply: LeaseReply, asked: Vec<(KeyId, SentAsk)>) {
        self.apply_forwarded(std::mem::take(&mut reply.released_permits));
        let now = self.inner.cfg.clock.now();
        let mut st = self.inner.state.lock();
        if reply.shard_count > 0 {
            st.shard_count = reply.shard_count;
        }
        for ((key, sent), g) in asked.into_iter().zip(reply.grants) {
            let Some(e) = st.keys.get_mut(&key) else {
                continue;
            };
            if g.status == GrantStatus::Resuming as i32 {
                // A regional that restarted does not know yet whether its
                // parent still covers the lease the ask named: nothing was
                // applied and the lease stands as it was; asked again (a
                // tick later) as after a call that got no answer.
                tracing::debug!(detail = %g.detail, rule = %key.rule(), "permits: slot ask not applied (a regional starting); asked again");
                e.asking.not_answered();
                continue;
            }
            let granted = if g.status == GrantStatus::Granted as i32 {
                Granted {
                    lease_id: g.lease_id,
                    slots: g.tokens,
                    kept: g.carried,
                    fence: g.fence,
                    over: g.over,
                    ttl_ns: g.ttl_ms.saturating_mul(1_000_000),
                    share: g.share,
                }
            } else {
                // Refused (a rule change, a wrong shard, a key limit):
                // nothing was applied. Taken as an empty grant: the lease
                // the ask named takes no new permit (its standing ones run
                // to their expiries, which its use-by bounds), and the
                // next ask names no lease: never more than is held.
                tracing::debug!(status = g.status, detail = %g.detail, rule = %key.rule(), "permits: slot ask refused");
                Granted {
                    lease_id: 0,
                    slots: 0,
                    kept: 0,
                    fence: 0,
                    over: false,
                    ttl_ns: 0,
                    share: None,
                }
            };
            e.asking
                .on_grant(&mut e.pk, now, sent, granted, g.contended, g.holders);
            serve(e, now);
        }
    }

    /// Releases of permits held here that came through another agent
    /// (docs/permits.md "Forwarded releases"): each releases its permit
    /// if this incarnation still holds it (idempotent, so one handed over
    /// twice changes nothing).
    fn apply_forwarded(&self, releases: Vec<ForwardedRelease>) {
        for f in releases {
            if f.incarnation != self.inner.cfg.incarnation {
                continue;
            }
            let key = KeyId::new(f.rule_id, f.tenant, f.route);
            if self.release(&key, f.permit) {
                self.inner.cfg.metrics.permits.forwarded_applied.add(1);
            }
        }
    }

    /// Release a permit another agent holds (its id names that agent's
    /// permit holder): forwarded through the allocator, which hands it to
    /// the holder in its next reply when both are of one principal.
    /// `Forwarded` then; `NotHere` when the allocator knows no such
    /// holder (it stopped, or the allocator restarted: the permit frees at
    /// its expiry).
    pub async fn forward_release(&self, r: &PermitRef) -> Result<PermitStatus, PermitError> {
        let shards = self.inner.state.lock().shard_count.max(1);
        let shard = quotalease_proto::shard_of(r.key.rule(), r.key.tenant(), r.key.route(), shards);
        let item = LeaseItem {
            rule_id: r.key.rule().to_string(),
            tenant: r.key.tenant().to_string(),
            route: r.key.route().to_string(),
            kind: ItemKind::PermitRelease as i32,
            holder_instance: r.instance,
            holder_incarnation: r.incarnation,
            permit: r.id,
            ..LeaseItem::default()
        };
        let batch = self.batch(shard, vec![item], 0);
        let unavailable = |why: String| {
            PermitError::Unavailable(format!(
                "the release could not be forwarded to the permit's holder ({why}); the permit frees at its expiry"
            ))
        };
        let reply = tokio::time::timeout(
            self.inner.cfg.fetch_timeout,
            self.inner.transport.lease(batch),
        )
        .await
        .map_err(|_| unavailable("the allocator did not answer in time".into()))?
        .map_err(|e| unavailable(e.to_string()))?;
        let LeaseReply {
            grants,
            released_permits,
            ..
        } = reply;
        self.apply_forwarded(released_permits);
        match grants.first() {
            Some(g) if g.status == GrantStatus::Released as i32 => {
                self.inner.cfg.metrics.permits.forwarded_sent.add(1);
                Ok(PermitStatus::Forwarded)
            }
            Some(g) if g.status == GrantStatus::UnknownHolder as i32 => Ok(PermitStatus::NotHere),
            Some(g) => Err(unavailable(g.detail.clone())),
            None => Err(unavailable("no allocator leader".into())),
        }
    }

    /// A batch got no usable reply: its keys may ask again.
    fn not_answered(&self, asked: &[(KeyId, SentAsk)]) {
        let mut st = self.inner.state.lock();
        for (key, _) in asked {
            if let Some(e) = st.keys.get_mut(key) {
                e.asking.not_answered();
            }
        }
    }

    /// While the allocator is unreachable, waiters are answered by their
    /// rules' fail policies: `closed` at once, `open` from the emergency
    /// semaphore while it has room; `lease_only` waiters (and `open` ones
    /// beyond the semaphore) wait on the slots held until their deadline.
    fn apply_fail_policies(&self) {
        let now = self.inner.cfg.clock.now();
        let mut st = self.inner.state.lock();
        if !st.unreachable(now) {
            return;
        }
        let mut next_id = st.next_emergency_id;
        for e in st.keys.values_mut() {
            if e.waiters.is_empty() || e.policy == FailPolicy::LeaseOnly {
                continue;
            }
            for (w, slots) in e.pk.waiters() {
                let Some(answer) = fail_policy(e, now, slots, next_id) else {
                    break;
                };
                if answer.is_ok() {
                    next_id += 1;
                }
                e.pk.cancel(w);
                if let Some(tx) = e.waiters.remove(&w) {
                    if let Err(Ok(p)) = tx.send(answer) {
                        // Its acquire went away meanwhile.
                        take_emergency(e, p.id);
                    }
                }
            }
        }
        st.next_emergency_id = next_id;
    }

    /// Keys with nothing held, waiting or asked are forgotten; the
    /// permit gauges and the expired count are brought up to date.
    fn forget_idle(&self) {
        let now = self.inner.cfg.clock.now();
        let (mut held, mut waiting, mut expired) = (0u64, 0u64, 0u64);
        self.inner.state.lock().keys.retain(|_, e| {
            expired += expire_emergency(e, now) + e.pk.take_expired();
            held += (e.pk.permits(now).len() + e.emergency.len()) as u64;
            expired += e.pk.take_expired();
            waiting += e.waiters.len() as u64;
            e.asking.in_flight() || !e.pk.is_idle(now) || !e.emergency.is_empty()
        });
        let m = &self.inner.cfg.metrics.permits;
        m.expired.add(expired);
        m.held.store(held, Ordering::Relaxed);
        m.waiting.store(waiting, Ordering::Relaxed);
    }
}

/// A waiter's answer under its rule's fail policy while the allocator is
/// unreachable: `closed` refuses, `open` takes `slots` of the emergency
/// semaphore (`max(1, N / holders)`, 1 while no grant said how many
/// holders the key has) as permit `id` when they fit; `None`: wait.
fn fail_policy(e: &mut KeyEntry, now: u64, slots: u64, id: u64) -> Option<Answer> {
    match e.policy {
        FailPolicy::Closed => Some(Err(PermitError::Unavailable(format!(
            "the allocator is unreachable and rule {} is fail-closed",
            e.rule_id
        )))),
        FailPolicy::LeaseOnly => None,
        FailPolicy::Open => {
            expire_emergency(e, now);
            let s = e.pk.settings();
            let cap = match e.asking.holders() {
                0 => 1,
                h => (s.n / u64::from(h)).max(1),
            };
            let used: u64 = e.emergency.iter().map(|p| p.slots).sum();
            if used + slots > cap {
                return None;
            }
            let p = Permit {
                id,
                slots,
                acquired_ns: now,
                expiry_ns: now
                    .saturating_add(s.permit_ttl_ns)
                    .min(now.saturating_add(s.max_hold_ns)),
                // Not backed by a grant: no fencing number.
                fence: 0,
                lease_id: 0,
            };
            e.emergency.push(p);
            Some(Ok(p))
        }
    }
}

/// Drops the expired emergency permits: how many.
fn expire_emergency(e: &mut KeyEntry, now: u64) -> u64 {
    let before = e.emergency.len();
    e.emergency.retain(|p| p.expiry_ns > now);
    (before - e.emergency.len()) as u64
}

/// Give emergency permit `id` back: whether it was held.
fn take_emergency(e: &mut KeyEntry, id: u64) -> bool {
    let before = e.emergency.len();
    e.emergency.retain(|p| p.id != id);
    e.emergency.len() < before
}

fn renew_emergency(e: &mut KeyEntry, now: u64, id: u64) -> Result<u64, PermitError> {
    expire_emergency(e, now);
    let s = e.pk.settings();
    let p = e
        .emergency
        .iter_mut()
        .find(|p| p.id == id)
        .ok_or(PermitError::Expired)?;
    p.expiry_ns = now
        .saturating_add(s.permit_ttl_ns)
        .min(p.acquired_ns.saturating_add(s.max_hold_ns))
        .max(p.expiry_ns);
    Ok(p.expiry_ns)
}

/// The `SLOTS` item of an ask.
fn slots_item(key: &KeyId, sent: &SentAsk) -> LeaseItem {
    LeaseItem {
        rule_id: key.rule().to_string(),
        tenant: key.tenant().to_string(),
        route: key.route().to_string(),
        kind: ItemKind::Slots as i32,
        lease_id: sent.lease_id,
        keep: sent.keep,
        want: sent.want,
        ..LeaseItem::default()
    }
}

/// Grant a key's waiters in arrival order; a permit whose waiter went
/// away is released at once.
fn serve(e: &mut KeyEntry, now: u64) {
    loop {
        let served = e.pk.serve_waiters(now);
        if served.is_empty() {
            return;
        }
        let mut gave_back = false;
        for (w, p) in served {
            match e.waiters.remove(&w) {
                Some(tx) => {
                    if let Err(Ok(p)) = tx.send(Ok(p)) {
                        e.pk.release(now, p.id);
                        gave_back = true;
                    }
                }
                None => {
                    e.pk.release(now, p.id);
                    gave_back = true;
                }
            }
        }
        if !gave_back {
            return;
        }
    }
}

/// The permit rules of `rules` selecting (domain, tenant, route), in file
/// order.
pub fn permit_rules_for<'a>(
    rules: &'a RuleSet,
    domain: Option<&str>,
    tenant: &str,
    route: &str,
) -> Vec<&'a PermitRule> {
    rules
        .permit_rules
        .iter()
        .filter(|p| p.applies(domain, tenant, route))
        .collect()
}

/// What a permit's id names: the holder (its permit instance and
/// incarnation), the key and the permit. Its text form
/// ([`PermitRef::encode`]) is path-safe: `p1.` then the fields separated
/// by `.`, every byte of the key's parts other than ASCII letters, digits,
/// `-` and `_` written `%XX`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PermitRef {
    /// The holder's permit instance nonce.
    pub instance: u64,
    /// The holder's incarnation.
    pub incarnation: u64,
    /// The key.
    pub key: KeyId,
    /// The permit's id at its holder.
    pub id: u64,
}

impl PermitRef {
    /// The text form.
    pub fn encode(&self) -> String {
        format!(
            "p1.{:x}.{:x}.{:x}.{}.{}.{}",
            self.instance,
            self.incarnation,
            self.id,
            pct(self.key.rule()),
            pct(self.key.tenant()),
            pct(self.key.route())
        )
    }

    /// Reads the text form; the error says what is wrong.
    pub fn decode(s: &str) -> Result<PermitRef, String> {
        if s.len() > 4 * 1024 {
            return Err("too long to be a permit id".into());
        }
        let parts: Vec<&str> = s.split('.').collect();
        let [p1, instance, incarnation, id, rule, tenant, route] = parts[..] else {
            return Err("not a permit id (expected p1. and six fields)".into());
        };
        if p1 != "p1" {
            return Err("not a permit id of this release (expected p1.)".into());
        }
        let hex = |f: &str, what: &str| {
            u64::from_str_radix(f, 16).map_err(|_| format!("not a permit id ({what})"))
        };
        Ok(PermitRef {
            instance: hex(instance, "instance")?,
            incarnation: hex(incarnation, "incarnation")?,
            id: hex(id, "id")?,
            key: KeyId::new(unpct(rule)?, unpct(tenant)?, unpct(route)?),
        })
    }
}

fn pct(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b == b'-' || b == b'_' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn unpct(s: &str) -> Result<String, String> {
    let bad = || "not a permit id (a key part is not encoded as it should be)".to_string();
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let h = b.get(i + 1..i + 3).ok_or_else(bad)?;
            let h = std::str::from_utf8(h).map_err(|_| bad())?;
            out.push(u8::from_str_radix(h, 16).map_err(|_| bad())?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| bad())
}

/// Where a permit stands, as renew and release by id answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PermitStatus {
    /// Held here until this instant (agent clock, ns).
    Held(u64),
    /// Past its expiry or released: never revived.
    Expired,
    /// Held by another agent, or an earlier run of this one (on a
    /// release: no such holder of this agent's principal is known to the
    /// allocator).
    NotHere,
    /// Release only: held by another agent; the release went to the
    /// allocator, which hands it to that agent in its next reply.
    Forwarded,
}

impl Permits {
    /// The holder identity permit ids name: (instance, incarnation).
    pub fn identity(&self) -> (u64, u64) {
        (self.inner.cfg.instance, self.inner.cfg.incarnation)
    }

    /// The id a client is given for `p`.
    pub fn permit_ref(&self, p: &HeldPermit) -> PermitRef {
        let (instance, incarnation) = self.identity();
        PermitRef {
            instance,
            incarnation,
            key: p.key.clone(),
            id: p.permit.id,
        }
    }

    fn is_mine(&self, r: &PermitRef) -> bool {
        self.identity() == (r.instance, r.incarnation)
    }

    /// Renew by id.
    pub fn renew_ref(&self, r: &PermitRef) -> PermitStatus {
        if !self.is_mine(r) {
            return PermitStatus::NotHere;
        }
        match self.renew(&r.key, r.id) {
            Ok(expiry) => PermitStatus::Held(expiry),
            Err(_) => PermitStatus::Expired,
        }
    }

    /// Release by id: `Held(now)` when it was held and is released now.
    pub fn release_ref(&self, r: &PermitRef) -> PermitStatus {
        if !self.is_mine(r) {
            return PermitStatus::NotHere;
        }
        match self.release(&r.key, r.id) {
            true => PermitStatus::Held(self.inner.cfg.clock.now()),
            false => PermitStatus::Expired,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permit_ids_round_trip_and_bad_ones_say_why() {
        let r = PermitRef {
            instance: u64::MAX,
            incarnation: 1_796_000_000_000_000_000,
            id: 42,
            key: KeyId::new("model-calls", "a.b/c d%é", String::new()),
        };
        let s = r.encode();
        assert!(
            s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.%".contains(&b)),
            "{s}"
        );
        assert_eq!(PermitRef::decode(&s), Ok(r));
        for bad in [
            "",
            "p1",
            "p2.1.1.1.r.t.u",
            "p1.x.1.1.r.t.u",
            "p1.1.1.1.r.t.u.v",
            "p1.1.1.1.r.%4.u",
            "p1.1.1.1.r.%FF.u",
        ] {
            assert!(PermitRef::decode(bad).is_err(), "{bad:?}");
        }
        assert!(PermitRef::decode(&"p".repeat(5000)).is_err());
    }
}

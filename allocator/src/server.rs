//! The allocator's tokio drivers: the gRPC `Allocator/Lease` service over an
//! [`AllocatorCore`] (global) or a [`RegionalCore`] (regional) behind one
//! mutex, the rules-file watcher, the housekeeping sweep, and the HTTP admin
//! face (`/metrics`, `/healthz`, `/readyz`, `GET /v1/keys`). The regional's
//! upstream loop is in [`crate::upstream`].

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::{Query, State};
use axum::http::header::CONTENT_TYPE;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response as HttpResponse};
use axum::routing::get;
use axum::{Json, Router};
use parking_lot::Mutex;
use quotalease_proto::lease::allocator_server::{Allocator, AllocatorServer};
use quotalease_proto::lease::{ItemKind, LeaseBatch, LeaseReply, SlotWait, SlotWake};
use quotalease_proto::MAX_MESSAGE_BYTES;
use tonic::{Request, Response, Status};

use quotalease_model::clock::{Clock, ClockSource};
use quotalease_model::key::KeyId;
use quotalease_model::rules::RuleSet;

use crate::core::{AllocatorCore, CoreConfig};
use crate::leadership::Arrival;
use crate::ledger::KeyCheckpoint;
use crate::metrics::Snapshot;
use crate::regional::{RegionalConfig, RegionalCore};
use quotalease_model::exposition;

/// Wall-clock milliseconds since the Unix epoch (only for versions and
/// epochs, never for refill arithmetic).
pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Wall-clock nanoseconds since the Unix epoch (incarnations, lease id
/// bases; never for refill arithmetic).
pub fn unix_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// The state machine a process runs: a global allocator or a regional one.
// One per process: the size difference between the variants costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
enum Node {
    Global(AllocatorCore),
    Regional(RegionalCore),
}

impl Node {
    fn core(&mut self) -> &mut AllocatorCore {
        match self {
            Node::Global(c) => c,
            Node::Regional(r) => r.core_mut(),
        }
    }
}

/// Shared state of a running allocator.
#[derive(Debug)]
pub struct Shared {
    core: Mutex<Node>,
    /// Woken when a child could not be served from a pool (regional).
    upstream_wake: tokio::sync::Notify,
    /// Woken when a reply added reservation records (the log's writer).
    reservations_wake: tokio::sync::Notify,
    /// Path of the rules file, if rules come from a file.
    rules_path: Option<PathBuf>,
    /// Last reload error (reported on /metrics and /readyz stays ready:
    /// the last good rules keep serving).
    last_reload_error: Mutex<Option<String>>,
    reload_failures: std::sync::atomic::AtomicU64,
    /// Set by [`Shared::checkpoint_and_close`]: lease calls are answered
    /// UNAVAILABLE without taking the core's lock.
    closed: std::sync::atomic::AtomicBool,
    /// Where the drivers read time: `CLOCK_BOOTTIME` unless a test driver
    /// (turmoil) supplies its own.
    clock: ClockSource,
    /// With `--etcd`: the replica's leadership (for /readyz and /metrics).
    leadership: std::sync::OnceLock<Arc<crate::leadership::Leadership>>,
    /// Bumped when slot ledgers may have changed (a batch with slot
    /// items, a regional's parent reply, housekeeping: leases expire):
    /// `WaitSlots` calls look again.
    slots_changed: tokio::sync::watch::Sender<u64>,
    /// `WaitSlots` calls waiting now (at most [`MAX_SLOT_WAITS`]).
    slot_waits: std::sync::atomic::AtomicUsize,
}

/// `WaitSlots` calls that may wait at once; more are answered at once
/// (`not_here`: the agent asks on its tick as without them).
pub const MAX_SLOT_WAITS: usize = 10_000;

/// The longest a `WaitSlots` call waits.
pub const MAX_SLOT_WAIT: Duration = Duration::from_secs(1);

impl Shared {
    /// This is a replica of `--etcd` replicas: `/readyz` and `/metrics`
    /// say whether it leads.
    pub fn set_leadership(&self, l: Arc<crate::leadership::Leadership>) {
        let _ = self.leadership.set(l);
    }

    /// A fresh allocator core started now.
    pub fn new(cfg: CoreConfig, rules: RuleSet, rules_path: Option<PathBuf>) -> Arc<Self> {
        Self::build_global(cfg, rules, rules_path, ClockSource::Boot)
    }

    /// [`Shared::new`] reading time from `clock` instead of
    /// `CLOCK_BOOTTIME` (tests that own time: `tests/turmoil_net.rs`).
    pub fn new_with_clock(
        cfg: CoreConfig,
        rules: RuleSet,
        rules_path: Option<PathBuf>,
        clock: Arc<dyn Clock>,
    ) -> Arc<Self> {
        Self::build_global(cfg, rules, rules_path, ClockSource::Other(clock))
    }

    fn build_global(
        cfg: CoreConfig,
        rules: RuleSet,
        rules_path: Option<PathBuf>,
        clock: ClockSource,
    ) -> Arc<Self> {
        let core = AllocatorCore::new(cfg, rules, unix_ms(), unix_ns(), clock.now());
        Arc::new(Self {
            core: Mutex::new(Node::Global(core)),
            upstream_wake: tokio::sync::Notify::new(),
            slots_changed: tokio::sync::watch::Sender::new(0),
            slot_waits: std::sync::atomic::AtomicUsize::new(0),
            reservations_wake: tokio::sync::Notify::new(),
            rules_path,
            last_reload_error: Mutex::new(None),
            reload_failures: Default::default(),
            closed: Default::default(),
            clock,
            leadership: Default::default(),
        })
    }

    /// A regional allocator started now, with optional bootstrap rules
    /// (rules then come from the parent; no rules file is watched).
    pub fn new_regional(cfg: RegionalConfig, rules: Option<RuleSet>) -> Arc<Self> {
        Self::build_regional(cfg, rules, ClockSource::Boot)
    }

    /// [`Shared::new_regional`] reading time from `clock`.
    pub fn new_regional_with_clock(
        cfg: RegionalConfig,
        rules: Option<RuleSet>,
        clock: Arc<dyn Clock>,
    ) -> Arc<Self> {
        Self::build_regional(cfg, rules, ClockSource::Other(clock))
    }

    fn build_regional(
        cfg: RegionalConfig,
        rules: Option<RuleSet>,
        clock: ClockSource,
    ) -> Arc<Self> {
        let cfg = RegionalConfig {
            instance: quotalease_proto::random_instance(),
            ..cfg
        };
        let core = RegionalCore::new(cfg, rules, unix_ns(), unix_ns(), clock.now());
        Arc::new(Self {
            core: Mutex::new(Node::Regional(core)),
            upstream_wake: tokio::sync::Notify::new(),
            slots_changed: tokio::sync::watch::Sender::new(0),
            slot_waits: std::sync::atomic::AtomicUsize::new(0),
            reservations_wake: tokio::sync::Notify::new(),
            rules_path: None,
            last_reload_error: Mutex::new(None),
            reload_failures: Default::default(),
            closed: Default::default(),
            clock,
            leadership: Default::default(),
        })
    }

    /// The drivers' clock reading, in nanoseconds.
    #[inline]
    pub fn now(&self) -> u64 {
        self.clock.now()
    }

    /// Handle one batch now (a requester without TLS).
    pub fn handle(&self, batch: &LeaseBatch) -> LeaseReply {
        self.handle_from(batch, "")
    }

    /// Handle one batch now from a requester whose client certificate
    /// names `principal` ("" without TLS; see
    /// [`AllocatorCore::handle_from`]).
    pub fn handle_from(&self, batch: &LeaseBatch, principal: &str) -> LeaseReply {
        self.handle_durably(batch, principal).0
    }

    /// See [`AllocatorCore::observe`] (a regional allocator keeps no
    /// runs: nothing to do).
    pub fn observe(&self, batch: &LeaseBatch) {
        let now = self.now();
        if let Node::Global(core) = &mut *self.core.lock() {
            core.observe(now, batch);
        }
    }

    /// Slot ledgers may have changed: `WaitSlots` calls look again.
    pub fn slots_changed(&self) {
        self.slots_changed.send_modify(|v| *v = v.wrapping_add(1));
    }

    /// [`Shared::handle_from`], and how many reservation records must be
    /// durable before the reply may be sent (0 without reservations).
    pub fn handle_durably(&self, batch: &LeaseBatch, principal: &str) -> (LeaseReply, u64) {
        let out = self.handle_durably_inner(batch, principal);
        // Only while a `WaitSlots` call waits (it subscribes before it
        // reads the ledger, so a batch after that read sees it): the lease
        // path does not look at its items for nothing.
        if self.slots_changed.receiver_count() > 0
            && batch.items.iter().any(|i| {
                i.kind == ItemKind::Slots as i32
                    || i.kind == ItemKind::SlotsRelease as i32
                    || i.kind == ItemKind::PermitRelease as i32
            })
        {
            self.slots_changed();
        }
        out
    }

    fn handle_durably_inner(&self, batch: &LeaseBatch, principal: &str) -> (LeaseReply, u64) {
        let mut node = self.core.lock();
        match &mut *node {
            Node::Global(core) => {
                let before = core.reservation_seq();
                let reply = core.handle_from(self.now(), batch, principal);
                let seq = core.reservation_seq();
                drop(node);
                if seq != before {
                    self.reservations_wake.notify_one();
                }
                (reply, seq)
            }
            Node::Regional(r) => {
                let reply = r.handle_from(self.now(), batch, principal);
                drop(node);
                if RegionalCore::wants_upstream_now(&reply) {
                    self.upstream_wake.notify_one();
                }
                (reply, 0)
            }
        }
    }

    /// A new term of a global allocator (with `--etcd`, each won
    /// election): the core is replaced by a new one with `cfg`, `rules` and
    /// `epoch`, whose lease ids start at `lease_id_base`. Everything the
    /// old core knew is dropped (a successor may have granted since).
    pub fn new_term(&self, cfg: CoreConfig, rules: RuleSet, epoch: u64, lease_id_base: u64) {
        let core = AllocatorCore::new(cfg, rules, epoch, lease_id_base, self.now());
        *self.core.lock() = Node::Global(core);
        self.closed
            .store(false, std::sync::atomic::Ordering::Release);
    }

    /// Resolves when a reply added reservation records.
    pub async fn reservations_wanted(&self) {
        self.reservations_wake.notified().await
    }

    /// Run `f` on the (child-facing) core.
    pub fn with_core<T>(&self, f: impl FnOnce(&mut AllocatorCore) -> T) -> T {
        f(self.core.lock().core())
    }

    /// Run `f` on the regional core; `None` for a global allocator.
    pub fn with_regional<T>(&self, f: impl FnOnce(&mut RegionalCore) -> T) -> Option<T> {
        match &mut *self.core.lock() {
            Node::Regional(r) => Some(f(r)),
            Node::Global(_) => None,
        }
    }

    /// A clean shutdown: every key's checkpoint (see
    /// [`AllocatorCore::checkpoint_and_close`]); later lease calls are
    /// refused.
    pub fn checkpoint_and_close(&self) -> Vec<(KeyId, KeyCheckpoint)> {
        self.closed
            .store(true, std::sync::atomic::Ordering::Release);
        let now = self.now();
        self.with_core(|c| c.checkpoint_and_close(now))
    }

    /// True for a regional allocator.
    pub fn is_regional(&self) -> bool {
        matches!(&*self.core.lock(), Node::Regional(_))
    }

    /// Make the upstream loop look at once (a regional).
    pub fn wake_upstream(&self) {
        self.upstream_wake.notify_one();
    }

    /// Resolves when a child could not be served from a pool.
    pub async fn upstream_wanted(&self) {
        self.upstream_wake.notified().await
    }

    /// Re-read the rules file if it changed; keep the last good rules on error.
    pub fn reload(&self) {
        let Some(path) = &self.rules_path else { return };
        let version = unix_ms().max(self.with_core(|c| c.rules().version) + 1);
        self.apply_rules(RuleSet::load(path, version));
    }

    /// Apply rules published as YAML `text` (with `--etcd`: the rules key;
    /// `source` names it in errors) if they differ from the rules in force;
    /// keep the last good rules on error.
    pub fn reload_text(&self, text: &str, source: &str) {
        let version = unix_ms().max(self.with_core(|c| c.rules().version) + 1);
        self.apply_rules(RuleSet::parse(text, source, version));
    }

    fn apply_rules(&self, loaded: Result<RuleSet, Vec<quotalease_model::rules::RuleError>>) {
        match loaded {
            Ok(rules) => {
                let mut node = self.core.lock();
                let core = node.core();
                // Both lists: a change of `concurrency` alone is a change
                // (it was ignored until a restart: found by a session 35
                // review, `N` lowered from 5 to 2 and 5 held at once).
                if rules.same_limits(core.rules()) {
                    return;
                }
                tracing::info!(
                    version = rules.version,
                    rules = rules.rules.len(),
                    permit_rules = rules.permit_rules.len(),
                    "rules reloaded"
                );
                core.set_rules(rules, self.now());
                *self.last_reload_error.lock() = None;
            }
            Err(errs) => {
                let msg = errs
                    .iter()
                    .map(|e| e.to_string())
                    .collect::<Vec<_>>()
                    .join("; ");
                let mut last = self.last_reload_error.lock();
                if last.as_deref() != Some(msg.as_str()) {
                    tracing::error!(errors = errs.len(), %msg, "rules rejected; the last good rules keep serving");
                    self.reload_failures
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    *last = Some(msg);
                }
            }
        }
    }
}

/// The gRPC service.
#[derive(Clone, Debug)]
pub struct LeaseService {
    shared: Arc<Shared>,
    /// With write-ahead reservations: replies wait until the records they
    /// depend on are durable.
    durability: Option<crate::reservation_log::Durability>,
    /// With `--etcd`: only the leader grants, while its leadership is valid.
    leadership: Option<Arc<crate::leadership::Leadership>>,
}

impl LeaseService {
    /// Wrap shared state.
    pub fn new(shared: Arc<Shared>) -> Self {
        Self {
            shared,
            durability: None,
            leadership: None,
        }
    }

    /// Grant only while `leadership` says this replica leads; other
    /// replicas' replies redirect (SPEC §7).
    pub fn with_leadership(mut self, leadership: Arc<crate::leadership::Leadership>) -> Self {
        self.leadership = Some(leadership);
        self
    }

    /// Replies wait for `durability` (write-ahead reservations).
    pub fn with_durability(mut self, durability: crate::reservation_log::Durability) -> Self {
        self.durability = Some(durability);
        self
    }

    /// As a tonic server with message size limits.
    pub fn into_server(self) -> AllocatorServer<Self> {
        AllocatorServer::new(self)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES)
    }
}

#[tonic::async_trait]
impl Allocator for LeaseService {
    async fn lease(&self, request: Request<LeaseBatch>) -> Result<Response<LeaseReply>, Status> {
        // Over mTLS the listener put the client certificate's principal in
        // the request (quotalease_tls::incoming); without TLS there is none.
        let principal = request
            .extensions()
            .get::<quotalease_tls::PeerInfo>()
            .map(|p| p.principal.clone());
        let batch = request.into_inner();
        // The term the grants are decided in: they go out only if it is
        // still the current one, and still valid, when the reply is ready.
        // Leadership runs on the boot clock (the etcd driver's).
        let boot = quotalease_model::clock::BootClock::now;
        let term = match &self.leadership {
            Some(l) => match l.arrive(&batch, boot()) {
                Arrival::Serve(term) => Some(term),
                Arrival::Refuse { reply, observe } => {
                    if observe {
                        self.shared.observe(&batch);
                    }
                    return Ok(Response::new(*reply));
                }
            },
            None => None,
        };
        if self
            .shared
            .closed
            .load(std::sync::atomic::Ordering::Acquire)
        {
            return Err(Status::unavailable("allocator shutting down"));
        }
        let (reply, seq) = self
            .shared
            .handle_durably(&batch, principal.as_deref().unwrap_or(""));
        if let Some(d) = &self.durability {
            // Write-ahead: a grant that broke a key's durable promise goes
            // out only once the new promise is on disk (SPEC §2 "Restarts").
            if !d.wait(seq).await {
                return Err(Status::unavailable(
                    "allocator cannot make its reservations durable",
                ));
            }
        }
        Ok(Response::new(match (&self.leadership, term) {
            (Some(l), Some(term)) => l.depart(term, &batch, reply, boot()),
            _ => reply,
        }))
    }

    async fn wait_slots(&self, request: Request<SlotWait>) -> Result<Response<SlotWake>, Status> {
        let principal = request
            .extensions()
            .get::<quotalease_tls::PeerInfo>()
            .map(|p| p.principal.clone())
            .unwrap_or_default();
        let w = request.into_inner();
        Ok(Response::new(
            self.shared
                .wait_slots(&w, &principal, self.leadership.as_deref())
                .await,
        ))
    }
}

impl Shared {
    /// A `WaitSlots` call (docs/permits.md "Slots follow demand"): answers
    /// when the key's free slots grow beyond what they were when it
    /// arrived (`room`), when some holder misses slots (`contended`), when
    /// a release of the caller's (`principal`, `agent_id`, `instance`)
    /// forwarded by another agent waits for its next reply (`releases`), or after
    /// `wait_ms` (at most [`MAX_SLOT_WAIT`]). A replica that does not
    /// lead, a key without a ledger here, or too many calls waiting
    /// answer `not_here` at once. Changes nothing.
    pub async fn wait_slots(
        &self,
        w: &SlotWait,
        principal: &str,
        leadership: Option<&crate::leadership::Leadership>,
    ) -> SlotWake {
        let not_here = SlotWake {
            not_here: true,
            ..SlotWake::default()
        };
        let boot = quotalease_model::clock::BootClock::now();
        if leadership.is_some_and(|l| !l.serving(boot))
            || self.closed.load(std::sync::atomic::Ordering::Acquire)
        {
            return not_here;
        }
        let key = KeyId::new(&w.rule_id, &w.tenant, &w.route);
        let holder = crate::core::HolderName {
            principal: principal.to_string(),
            agent_id: w.agent_id.clone(),
            instance: w.instance,
        };
        let mut changed = self.slots_changed.subscribe();
        // (free slots, someone misses slots, a release waits for the caller)
        let state = || {
            let now = self.now();
            self.with_core(|c| {
                let released = w.releases && c.releases_waiting(&holder);
                c.slot_wake(now, &key).map(|(r, m)| (r, m, released))
            })
        };
        let Some((room0, contended0, released0)) = state() else {
            return not_here;
        };
        let wake = |(room, contended, released): (u64, bool, bool)| SlotWake {
            room,
            contended,
            not_here: false,
            released,
        };
        if (w.contended && contended0) || released0 {
            return wake((room0, contended0, released0));
        }
        let waits = &self.slot_waits;
        if waits.fetch_add(1, std::sync::atomic::Ordering::AcqRel) >= MAX_SLOT_WAITS {
            waits.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
            return not_here;
        }
        let wait = Duration::from_millis(u64::from(w.wait_ms)).min(MAX_SLOT_WAIT);
        let deadline = tokio::time::Instant::now() + wait;
        let mut last = (room0, contended0, released0);
        loop {
            match tokio::time::timeout_at(deadline, changed.changed()).await {
                Ok(Ok(())) => {}
                _ => break,
            }
            let Some(now) = state() else { break };
            last = now;
            if (w.room && now.0 > room0) || (w.contended && now.1) || now.2 {
                break;
            }
        }
        waits.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
        wake(last)
    }
}

/// Keys one housekeeping step looks at under the core's lock.
const SWEEP_STEP_KEYS: usize = 1024;

/// Background work: reload rules on change, sweep idle keys.
pub async fn housekeeping(shared: Arc<Shared>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    let mut last_mtime = None;
    loop {
        tick.tick().await;
        if let Some(path) = &shared.rules_path {
            let mtime = std::fs::metadata(path).and_then(|m| m.modified()).ok();
            if mtime != last_mtime {
                last_mtime = mtime;
                shared.reload();
            }
        }
        // In steps, the lock released between them: grants go on.
        let now = shared.now();
        while shared.with_core(|c| c.sweep_step(now, SWEEP_STEP_KEYS)) {
            tokio::task::yield_now().await;
        }
        // Slot leases expire without a message: waiting wake-ups look.
        if shared.with_core(|c| c.slot_key_count()) > 0 {
            shared.slots_changed();
        }
    }
}

// ---------------------------------------------------------------------------
// HTTP

#[derive(serde::Deserialize)]
struct KeyQuery {
    rule: Option<String>,
    tenant: Option<String>,
    route: Option<String>,
}

/// The slots of the key of a rule with `concurrency` (docs/permits.md),
/// with the key as that rule spells it; `None` when the rule has none.
fn slots_json(
    core: &mut AllocatorCore,
    now: u64,
    key: &KeyId,
) -> Option<(KeyId, serde_json::Value)> {
    let p = core.rules().permit_rule(key.rule())?.clone();
    let key = KeyId::new(
        key.rule(),
        p.tenant.key_part(key.tenant()),
        p.route.key_part(key.route()),
    );
    let view = core.slot_view(now, &key);
    let json = serde_json::json!({
        "known": view.is_some(),
        "concurrency": p.concurrency,
        "held": view.as_ref().map_or(0, |v| v.held),
        "leases": view.map(|v| v.leases.iter().map(|(name, l)| serde_json::json!({
            "holder": name.agent_id, "principal": name.principal,
            "instance": format!("{:016x}", name.instance), "lease_id": l.id,
            "slots": l.slots, "fence": l.fence,
            "expires_in_ms": l.expires_ns.saturating_sub(now) / 1_000_000,
        })).collect::<Vec<_>>()).unwrap_or_default(),
    });
    Some((key, json))
}

async fn keys(State(shared): State<Arc<Shared>>, Query(q): Query<KeyQuery>) -> HttpResponse {
    let Some(rule) = q.rule else {
        return (
            StatusCode::BAD_REQUEST,
            Json(serde_json::json!({"error": "missing query parameter", "field": "rule"})),
        )
            .into_response();
    };
    let key = KeyId::new(
        rule,
        q.tenant.unwrap_or_default(),
        q.route.unwrap_or_default(),
    );
    let now = shared.now();
    let regional = shared.is_regional();
    let chain = shared
        .with_regional(|r| {
            let rule = r.core().rules().get(key.rule()).cloned()?;
            let k = KeyId::new(
                key.rule(),
                rule.tenant.key_part(key.tenant()),
                rule.route.key_part(key.route()),
            );
            r.chain_view(&k)
        })
        .flatten();
    shared.with_core(|core| {
        let slots = slots_json(core, now, &key);
        let Some(rule) = core.rules().get(key.rule()).cloned() else {
            // A rule with concurrency only: its slots.
            if let Some((key, slots)) = slots {
                return Json(serde_json::json!({
                    "rule": key.rule(), "tenant": key.tenant(), "route": key.route(),
                    "known": slots["known"], "slots": slots,
                }))
                .into_response();
            }
            return (
                StatusCode::NOT_FOUND,
                Json(serde_json::json!({"error": "unknown rule", "field": "rule"})),
            )
                .into_response();
        };
        let key = KeyId::new(key.rule(), rule.tenant.key_part(key.tenant()), rule.route.key_part(key.route()));
        let mut body = match core.key_view(now, &key) {
            Some(v) => serde_json::json!({
                "rule": key.rule(), "tenant": key.tenant(), "route": key.route(),
                "known": true,
                "available": v.available, "outstanding": v.outstanding, "burst": v.burst,
                "rate": rule.rate.to_string(),
                "holders": v.holders.iter().map(|(name, l)| serde_json::json!({
                    "holder": name.agent_id, "principal": name.principal, "instance": format!("{:016x}", name.instance), "lease_id": l.id, "granted": l.granted, "spent": l.spent,
                    "rate_utps": l.rate_utps, "capacity": l.capacity,
                    "expires_in_ms": l.expires_ns.saturating_sub(now) / 1_000_000,
                })).collect::<Vec<_>>(),
            }),
            None => serde_json::json!({
                "rule": key.rule(), "tenant": key.tenant(), "route": key.route(),
                "known": false,
                "available": rule.burst, "outstanding": 0, "burst": rule.burst,
                "rate": rule.rate.to_string(), "holders": [],
            }),
        };
        // A rule with a rate and a concurrency: its slots too.
        body["slots"] = slots.map_or(serde_json::Value::Null, |(_, s)| s);
        // The key's durable promise (write-ahead reservations): what a
        // crash now would resume it at. Null: at rest, or no reservations.
        body["reservation"] = match core.reservations_mut().and_then(|r| r.get(&key)) {
            Some(r) => serde_json::json!({"floor": r.floor, "rate_cap_utps": r.rate_cap_utps}),
            None => serde_json::Value::Null,
        };
        if regional {
            // A regional holds only what its parent leases back: an unknown
            // key holds nothing.
            if body["known"] == false {
                body["available"] = 0.into();
            }
            body["parent_lease"] = match &chain {
                Some(c) => serde_json::json!({
                    "lease_id": c.parent_lease_id, "granted": c.granted,
                    "rate_utps": c.rate_utps, "capacity": c.capacity, "backs": c.backs,
                    "expires_in_ms": c.deadline_ns.saturating_sub(now) / 1_000_000,
                }),
                None => serde_json::Value::Null,
            };
        }
        (StatusCode::OK, Json(body)).into_response()
    })
}

async fn metrics(State(shared): State<Arc<Shared>>) -> impl IntoResponse {
    let reload_failures = shared
        .reload_failures
        .load(std::sync::atomic::Ordering::Relaxed);
    let snapshot = {
        let mut node = shared.core.lock();
        match &mut *node {
            Node::Global(core) => {
                Snapshot::of_core(core, reload_failures).with_alarm(core, shared.now())
            }
            Node::Regional(r) => Snapshot::of_core(r.core_mut(), reload_failures).with_regional(r),
        }
    };
    // A global allocator without --etcd always leads; a regional has no
    // leadership.
    let snapshot = match shared.leadership.get() {
        Some(l) => snapshot.with_leader(l.serving(quotalease_model::clock::BootClock::now())),
        None if !shared.is_regional() => snapshot.with_leader(true),
        None => snapshot,
    };
    (
        [(CONTENT_TYPE, exposition::CONTENT_TYPE)],
        snapshot.render(),
    )
}

async fn readyz(State(shared): State<Arc<Shared>>) -> (StatusCode, String) {
    if let Some(has_rules) = shared.with_regional(|r| r.has_rules()) {
        return if has_rules {
            (StatusCode::OK, "ready\n".into())
        } else {
            (
                StatusCode::SERVICE_UNAVAILABLE,
                "not ready: no rules yet (the parent allocator was not reached and no --rules were given)\n".into(),
            )
        };
    }
    if let Some(l) = shared.leadership.get() {
        let boot = quotalease_model::clock::BootClock::now();
        if let Some(until) = l.waiting_until(boot) {
            return (
                StatusCode::OK,
                format!(
                    "ready: leader, granting in {} ms (its predecessor's grants may not have ended)\n",
                    (until - boot).div_ceil(1_000_000)
                ),
            );
        }
        // A follower answers (it redirects): ready, and says to whom.
        if !l.serving(boot) {
            let v = l.view(boot);
            let leader = if v.leader_url.is_empty() || v.leader_url == l.advertise() {
                "no leader yet".to_string()
            } else {
                format!("leader {} epoch {}", v.leader_url, v.epoch)
            };
            return (StatusCode::OK, format!("ready: follower; {leader}\n"));
        }
    }
    let now = shared.now();
    let ready_at = shared.with_core(|c| c.ready_at_ns());
    let boot = quotalease_model::clock::BootClock::now();
    if shared.leadership.get().is_some_and(|l| l.serving(boot)) {
        let epoch = shared.with_core(|c| c.epoch());
        if now >= ready_at {
            return (StatusCode::OK, format!("ready: leader epoch {epoch}\n"));
        }
    }
    let grace_until = shared.with_core(|c| c.grace_until_ns());
    if now >= ready_at {
        (StatusCode::OK, "ready\n".into())
    } else if ready_at <= grace_until {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "not ready: starting, granting in {} ms (requesters holding leases of this ledger, or of a newer copy of its state, present them first)\n",
                (ready_at - now).div_ceil(1_000_000)
            ),
        )
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "not ready: waiting {} ms for leases of a predecessor to expire\n",
                (ready_at - now) / 1_000_000
            ),
        )
    }
}

/// `POST /v1/slots/release`: an operator frees a slot lease of a holder
/// known to be dead (docs/operations.md "In-flight limits"). Body:
/// `{"rule", "tenant", "route", "lease_id", "reason"}` (the key as
/// `/v1/keys` takes it, the lease id `/v1/keys` shows, and why: required,
/// it goes into the audit line). Audited: a warning on target
/// `quotalease::audit` with the lease, its holder and the reason, and a
/// counter. Only the leader (or a lone allocator) does it; a regional
/// allocator has no slots.
async fn force_release_slots(
    State(shared): State<Arc<Shared>>,
    body: axum::body::Bytes,
) -> HttpResponse {
    let bad = |field: &str, why: &str| {
        (
            StatusCode::BAD_REQUEST,
            Json(serde_json::json!({"error": why, "field": field})),
        )
            .into_response()
    };
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(&body) else {
        return bad("body", "not a JSON object");
    };
    let Some(obj) = v.as_object() else {
        return bad("body", "not a JSON object");
    };
    for field in obj.keys() {
        if !["rule", "tenant", "route", "lease_id", "reason"].contains(&field.as_str()) {
            return bad(field, "unknown field");
        }
    }
    let text = |field: &str| obj.get(field).map(|v| v.as_str().map(str::to_string));
    let Some(Some(rule)) = text("rule") else {
        return bad("rule", "required, a string");
    };
    let (Some(tenant), Some(route)) = (
        text("tenant").unwrap_or(Some(String::new())),
        text("route").unwrap_or(Some(String::new())),
    ) else {
        return bad("tenant", "tenant and route must be strings");
    };
    let Some(lease_id) = obj
        .get("lease_id")
        .and_then(|v| v.as_u64())
        .filter(|&id| id > 0)
    else {
        return bad("lease_id", "required, a lease id /v1/keys shows (not 0)");
    };
    let Some(Some(reason)) =
        text("reason").filter(|r| r.as_ref().is_some_and(|r| !r.trim().is_empty()))
    else {
        return bad(
            "reason",
            "required: why the holder is known to be dead (it is audited)",
        );
    };
    // A regional frees the lease in its pool (its parent slot lease still
    // counts the slots; the pool lends them again).
    let boot = quotalease_model::clock::BootClock::now();
    if shared.leadership.get().is_some_and(|l| !l.serving(boot)) {
        return (
            StatusCode::MISDIRECTED_REQUEST,
            Json(serde_json::json!({"error": "not the leader: ask the replica that leads (its /readyz says so)", "field": "rule"})),
        )
            .into_response();
    }
    let now = shared.now();
    let freed = shared.with_core(|core| {
        let p = core.rules().permit_rule(&rule)?.clone();
        let key = KeyId::new(&rule, p.tenant.key_part(&tenant), p.route.key_part(&route));
        core.force_release_slots(now, &key, lease_id)
            .map(|f| (key, f))
    });
    let Some((key, (holder, lease))) = freed else {
        return (
            StatusCode::NOT_FOUND,
            Json(serde_json::json!({"error": "no such slot lease held (expired, released, or another key's)", "field": "lease_id"})),
        )
            .into_response();
    };
    // Waiters' wake-ups see the free slots.
    shared.slots_changed();
    tracing::warn!(
        target: "quotalease::audit",
        rule = %key.rule(),
        tenant = %key.tenant(),
        route = %key.route(),
        lease_id,
        slots = lease.slots,
        holder = %holder.agent_id,
        principal = %holder.principal,
        instance = format_args!("{:016x}", holder.instance),
        expires_in_ms = lease.expires_ns.saturating_sub(now) / 1_000_000,
        reason = %reason,
        "slot lease force-released by an operator: its slots are free now (I4 rests on the holder being dead)"
    );
    Json(serde_json::json!({
        "released": {
            "rule": key.rule(), "tenant": key.tenant(), "route": key.route(),
            "lease_id": lease_id, "slots": lease.slots,
            "holder": holder.agent_id, "principal": holder.principal,
            "instance": format!("{:016x}", holder.instance),
            "expires_in_ms": lease.expires_ns.saturating_sub(now) / 1_000_000,
        }
    }))
    .into_response()
}

/// The allocator's HTTP admin router.
pub fn admin_router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/v1/keys", get(keys))
        .route(
            "/v1/slots/release",
            axum::routing::post(force_release_slots),
        )
        .with_state(shared)
}

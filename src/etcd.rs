//! `quotalease allocator --etcd`: replicas of the global allocator that
//! elect a leader, fence it and keep the durable ledger in etcd (SPEC §7).
//! etcd does the consensus; this is the driver around the sans-IO core.
//!
//! - **Session**: an etcd lease of `--etcd-lease-ttl`, kept alive every
//!   sixth of it. Its validity is measured from when each keep-alive was
//!   *sent* (etcd cannot let the lease expire before `sent + TTL` on its
//!   clock), less a margin of a third of the TTL (at least 1 s).
//! - **Election**: the replica campaigns (etcd's election API) with its
//!   `--advertise` URL under the session lease; the winner's leader key
//!   revision is its epoch. Followers observe the election and redirect
//!   agents to the leader; every reply carries the leader URL, the epoch
//!   and the replica list (`{prefix}/replicas/`, kept under each session).
//! - **Term**: the winner reads the ledger record (`{prefix}/ledger`) and
//!   every key's write-ahead reservation (`{prefix}/res/...`), resumes each
//!   key at its floor with the rest of its burst as a phantom until the
//!   longest lease the predecessor could have granted has expired (keys
//!   without one are full), and only then grants. Every write of a term is
//!   a transaction guarded by the leader key's revision, so a deposed
//!   leader's writes fail; grants wait for the reservations they need.
//! - **Deposition**: when the validity runs out (keep-alives unanswered,
//!   etcd unreachable, the process frozen) the lease service refuses
//!   before the next grant ([`Leadership`]); the term ends, the core is
//!   dropped, and the replica starts a new session and campaigns again.
//!
//! Its parts: this file the replica, its sessions, keep-alives and
//! followers' watches; `etcd/leading.rs` a term as leader (the leader key's
//! confirmations, the resume, the serving loop, the handover's
//! checkpoint); `etcd/store.rs` the key layout and the reservation store;
//! `etcd/shards.rs` the cluster and shard-map checks and the lists replies
//! carry; `etcd/publish.rs` `quotalease publish`.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, Context};
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, GetOptions, LeaderKey, PutOptions, ResignOptions,
    Txn, TxnOp,
};
use parking_lot::Mutex;
use quotalease_allocator::core::{CoreConfig, TTL_MAX_CAP_NS};
use quotalease_allocator::leadership::{self, Leadership};
use quotalease_allocator::reservation_log::{self, hex, unhex, Durability, Store};
use quotalease_allocator::reservations::{Record, Reservation};
use quotalease_allocator::server::{self as alloc_server, Shared};
use quotalease_allocator::term;
use quotalease_model::key::KeyId;
use quotalease_model::rules::RuleSet;
use quotalease_proto::lease::ShardRoute;

use crate::serve::{self, Termination};
use crate::AllocatorArgs;
use quotalease_allocator::durable::{self, LedgerRecord};

mod leading;
mod publish;
mod shards;
mod store;

use leading::*;
pub use publish::publish;
use shards::*;
use store::*;

/// HTTP/2 pings on etcd connections: no more often than etcd's default
/// `--grpc-keepalive-min-time` (5 s) allows. Pinging every second made
/// etcd close the connections (too many pings) and broke every idle
/// campaign every few seconds (a fourth adversarial review saw the churn).
const ETCD_PING: Duration = Duration::from_secs(6);
const ETCD_PING_TIMEOUT: Duration = Duration::from_secs(3);

/// Keys per checkpoint chunk (one etcd value, one transaction each): at
/// most about 1.6 KB per key line, well below etcd's 1.5 MiB request limit.
const CHECKPOINT_CHUNK_KEYS: usize = 400;
/// Operations per etcd transaction: below etcd's default `--max-txn-ops`
/// (128), and with keys of at most 3 x 256 bytes (hex) well below its
/// default request size limit (1.5 MiB).
const TXN_OPS: usize = 100;
/// Each term's lease ids start this far above the previous term's base,
/// whatever the replicas' clocks say.
const TERM_LEASE_IDS: u64 = 1 << 42;
/// How long a replica without a leader tells agents to wait.
const NO_LEADER_RETRY_MS: u64 = 500;

/// Attempts of one etcd call: with a member down, calls that the client's
/// balancer sends to it fail at once (a connect error) while the others
/// answer, so a call is tried again, 50 ms apart, before it counts as
/// failed.
const ETCD_ATTEMPTS: usize = 8;

/// Run `op` up to [`ETCD_ATTEMPTS`] times until it succeeds. Only for
/// calls that may be repeated: reads, puts of the same value, and guarded
/// transactions of puts and deletes (a repeat of one that committed
/// commits the same again, or fails its guard).
async fn retried<T, F, Fut>(mut op: F) -> Result<T, etcd_client::Error>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, etcd_client::Error>>,
{
    let mut attempt = 1;
    loop {
        match op().await {
            Ok(v) => return Ok(v),
            Err(e) if attempt >= ETCD_ATTEMPTS => return Err(e),
            Err(e) => {
                tracing::debug!(error = %e, attempt, "etcd call failed; trying again");
                attempt += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// `client.get(key, opts)`, [`retried`].
async fn get(
    client: &Client,
    key: &str,
    opts: Option<GetOptions>,
) -> Result<etcd_client::GetResponse, etcd_client::Error> {
    retried(|| {
        let (mut c, opts) = (client.clone(), opts.clone());
        async move { c.get(key, opts).await }
    })
    .await
}

/// `client.txn(txn)`, [`retried`].
async fn txn(client: &Client, txn: Txn) -> Result<etcd_client::TxnResponse, etcd_client::Error> {
    retried(|| {
        let (mut c, t) = (client.clone(), txn.clone());
        async move { c.txn(t).await }
    })
    .await
}

/// What every task of a replica shares.
struct Replica {
    client: Client,
    /// One client per etcd member (see `allocator`).
    members: Vec<Client>,
    /// For campaigns, which block until this replica leads: no request
    /// timeout.
    campaigner: Client,
    keys: Keys,
    args: AllocatorArgs,
    shared: Arc<Shared>,
    leadership: Arc<Leadership>,
    durability: Durability,
    lease_ttl_s: i64,
    /// Validity margin under the session lease's TTL.
    margin: Duration,
    stopping: AtomicBool,
    /// The epoch of the term under way (0: none), for keep-alives.
    term: AtomicU64,
    /// Without `--rules`: the rules text last published in etcd (`None`:
    /// nothing published yet).
    rules_text: Option<Mutex<Option<String>>>,
}

/// `quotalease allocator --etcd`.
pub async fn allocator(args: AllocatorArgs, stop: Termination) -> anyhow::Result<()> {
    if args.state_dir.is_some() {
        return Err(anyhow!(
            "--state-dir: with --etcd the ledger is kept in etcd, not in a state directory"
        ));
    }
    let advertise = match &args.advertise {
        Some(u) => u.clone(),
        None if !args.listen.ip().is_unspecified() => format!("http://{}", args.listen),
        None => {
            return Err(anyhow!(
            "--advertise URL is required with --etcd when --listen is {} (agents are sent to it)",
            args.listen
        ))
        }
    };
    if !(advertise.starts_with("http://") || advertise.starts_with("https://")) {
        return Err(anyhow!(
            "--advertise: {advertise:?} is not a URL (http://HOST:PORT or https://HOST:PORT)"
        ));
    }
    let lease_ttl_s = i64::try_from(args.etcd_lease_ttl.as_secs()).unwrap_or(i64::MAX);
    if !(2..=60).contains(&lease_ttl_s) {
        return Err(anyhow!(
            "--etcd-lease-ttl: {:?} is outside 2s..=60s",
            args.etcd_lease_ttl
        ));
    }
    serve::ttl_max_ms(&args)?;
    // Rules from --rules FILE (re-read on change), else as published in
    // etcd (`quotalease rules publish`, watched). A file must be good
    // before anything else happens.
    let rules = match &args.rules {
        Some(path) => serve::load_rules(path, 1)?,
        None => RuleSet::default(),
    };
    let rules_path = args.rules.clone();
    let tls = serve::server_tls(&args)?;
    // Calls time out after 500 ms and are tried again (see `retried`): a
    // frozen etcd member (its sockets open, nothing answered) costs a call
    // that long, not the whole grant path its 2 s write-ahead wait.
    let options = || {
        ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(1))
            .with_timeout(Duration::from_millis(500))
            .with_keep_alive(ETCD_PING, ETCD_PING_TIMEOUT)
    };
    let client = Client::connect(&args.etcd, Some(options()))
        .await
        .with_context(|| format!("--etcd {}: cannot connect", args.etcd.join(",")))?;
    // One client per member too: keep-alives and leader-key confirmations
    // go to every member at once, and the first answer counts, so that one
    // frozen member does not cost the leader its validity.
    let mut members = Vec::new();
    for url in &args.etcd {
        members.push(
            Client::connect([url.as_str()], Some(options()))
                .await
                .with_context(|| format!("--etcd {url}: cannot connect"))?,
        );
    }
    let campaigner = Client::connect(
        &args.etcd,
        Some(
            ConnectOptions::new()
                .with_connect_timeout(Duration::from_secs(2))
                .with_keep_alive(ETCD_PING, ETCD_PING_TIMEOUT),
        ),
    )
    .await
    .with_context(|| format!("--etcd {}: cannot connect", args.etcd.join(",")))?;
    let root = args.etcd_prefix.trim_end_matches('/').to_string();
    let keys = match args.shard {
        Some((k, _)) => Keys::of_shard(&root, k),
        None => Keys::unsharded(&root),
    };
    check_shard_map(&client, &keys, args.shard).await?;
    check_cluster(&client, &keys, args.cluster.as_deref()).await?;
    // Until it leads, the replica's core grants nothing (the lease
    // service refuses first); each term replaces it.
    let shared = Shared::new(
        CoreConfig {
            ttl_max_ns: args.ttl_max.as_nanos() as u64,
            reservations: true,
            shard: args.shard.unwrap_or((0, 1)),
            ..CoreConfig::default()
        },
        rules,
        rules_path,
    );
    let leadership = Arc::new(Leadership::new(advertise.clone(), NO_LEADER_RETRY_MS));
    if let Some((k, n)) = args.shard {
        leadership.set_shard(k, n, SHARD_MAP_VERSION);
    }
    shared.set_leadership(leadership.clone());
    let durability = Durability::none();
    let grpc = serve::bind("--listen", args.listen).await?;
    let http = serve::bind("--http", args.http).await?;
    println!(
        "quotalease allocator grpc={} http={}",
        grpc.local_addr()?,
        http.local_addr()?
    );
    tracing::info!(grpc = %grpc.local_addr()?, %advertise, etcd = %args.etcd.join(","), prefix = %keys.prefix, lease_ttl_s, "allocator replica started; campaigning for leadership through etcd");
    let (tx, rx) = tokio::sync::watch::channel(false);
    let (server, admin) = serve::serve_allocator(
        shared.clone(),
        grpc,
        http,
        tls,
        Some(durability.clone()),
        Some(leadership.clone()),
        rx,
    );
    let hk = tokio::spawn(alloc_server::housekeeping(
        shared.clone(),
        Duration::from_millis(500),
    ));
    let margin = Duration::from_nanos(leadership::key_window_ns(
        Duration::from_secs(lease_ttl_s as u64).as_nanos() as u64,
    ));
    let args_rules_from_etcd = args.rules.is_none();
    let replica = Arc::new(Replica {
        client,
        members,
        campaigner,
        keys,
        args,
        shared: shared.clone(),
        leadership: leadership.clone(),
        durability,
        lease_ttl_s,
        margin,
        stopping: AtomicBool::new(false),
        term: AtomicU64::new(0),
        rules_text: args_rules_from_etcd.then(|| Mutex::new(None)),
    });
    let rules_watch = replica
        .rules_text
        .is_some()
        .then(|| tokio::spawn(watch_rules(replica.clone())));
    let observer = tokio::spawn(observe(replica.clone()));
    let lister = tokio::spawn(list_replicas(replica.clone()));
    let router = replica
        .args
        .shard
        .map(|(_, n)| tokio::spawn(shard_routes(replica.clone(), n)));
    let sessions = tokio::spawn(sessions(replica.clone()));
    stop.wait().await;
    tracing::info!("stopping");
    replica.stopping.store(true, Ordering::Release);
    // No grant after this point; the term ends by resigning, so another
    // replica is elected at once instead of after the lease TTL.
    leadership.step_down();
    let _ = tokio::time::timeout(Duration::from_secs(5), sessions).await;
    observer.abort();
    lister.abort();
    if let Some(r) = router {
        r.abort();
    }
    if let Some(w) = rules_watch {
        w.abort();
    }
    let _ = tx.send(true);
    hk.abort();
    let _ = tokio::time::timeout(Duration::from_secs(5), server).await;
    let _ = tokio::time::timeout(Duration::from_secs(5), admin).await;
    Ok(())
}

/// Without `--rules`: follow the rules key (a read, then a watch from the
/// next revision), keep the latest text, and apply it to the core.
async fn watch_rules(r: Arc<Replica>) {
    let Some(latest) = &r.rules_text else { return };
    let source = format!("etcd {}", r.keys.rules());
    let mut warned = false;
    loop {
        let mut c = r.client.clone();
        let got = match get(&r.client, &r.keys.rules(), None).await {
            Ok(g) => g,
            Err(e) => {
                tracing::debug!(error = %e, "cannot read the rules from etcd");
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        let revision = got.header().map_or(0, |h| h.revision());
        match got.kvs().first().and_then(|kv| kv.value_str().ok()) {
            Some(text) => {
                *latest.lock() = Some(text.to_string());
                r.shared.reload_text(text, &source);
            }
            None if !warned => {
                tracing::warn!(key = %r.keys.rules(), "no rules published in etcd yet (quotalease rules publish FILE --etcd URL): every rule id is unknown");
                warned = true;
            }
            None => {}
        }
        let from = etcd_client::WatchOptions::new().with_start_revision(revision + 1);
        let mut stream = match c.watch(r.keys.rules(), Some(from)).await {
            Ok(stream) => stream,
            Err(e) => {
                tracing::debug!(error = %e, "cannot watch the rules in etcd");
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        while let Ok(Some(resp)) = stream.message().await {
            for ev in resp.events() {
                let Some(kv) = ev.kv() else { continue };
                if ev.event_type() != etcd_client::EventType::Put {
                    tracing::warn!(key = %r.keys.rules(), "the rules key was deleted in etcd; the last rules keep serving");
                    continue;
                }
                let text = kv.value_str().unwrap_or("");
                *latest.lock() = Some(text.to_string());
                r.shared.reload_text(text, &source);
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Followers learn the leader from the election.
async fn observe(r: Arc<Replica>) {
    loop {
        let mut c = r.client.clone();
        match c.observe(r.keys.election()).await {
            Ok(mut stream) => loop {
                match stream.message().await {
                    Ok(Some(resp)) => {
                        if let Some(kv) = resp.kv() {
                            let url = kv.value_str().unwrap_or("");
                            r.leadership
                                .observed_leader(url, kv.create_revision() as u64);
                        }
                    }
                    Ok(None) => break,
                    Err(e) => {
                        tracing::debug!(error = %e, "observing the election failed");
                        break;
                    }
                }
            },
            Err(e) => tracing::debug!(error = %e, "cannot observe the election"),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Sessions one after another: each holds an etcd lease, registers the
/// replica, campaigns, and leads a term when elected.
async fn sessions(r: Arc<Replica>) {
    while !r.stopping.load(Ordering::Acquire) {
        if let Err(e) = session(&r).await {
            tracing::warn!(error = %format!("{e:#}"), "etcd session ended; starting another");
        }
        r.leadership.step_down();
        r.term.store(0, Ordering::Release);
        if !r.stopping.load(Ordering::Acquire) {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// Until when (a `CLOCK_BOOTTIME` reading, ns: it counts while the machine
/// is suspended) the session lease is surely still alive (see the module
/// docs).
type Validity = Arc<Mutex<u64>>;

fn boot_now() -> u64 {
    quotalease_model::clock::BootClock::now()
}

async fn session(r: &Arc<Replica>) -> anyhow::Result<()> {
    let mut c = r.client.clone();
    let sent = boot_now();
    let lease = retried(|| {
        let mut c = r.client.clone();
        async move { c.lease_grant(r.lease_ttl_s, None).await }
    })
    .await
    .context("granting an etcd lease")?;
    let id = lease.id();
    let validity: Validity = Arc::new(Mutex::new(sent + r.lease_validity_ns(lease.ttl())));
    let (done_tx, mut done) = tokio::sync::watch::channel(false);
    let done_tx = Arc::new(done_tx);
    let keepers: Vec<_> = r
        .members
        .iter()
        .map(|m| {
            tokio::spawn(keep_alive(
                r.clone(),
                m.clone(),
                id,
                validity.clone(),
                done_tx.clone(),
            ))
        })
        .collect();
    let result = async {
        retried(|| {
            let mut c = r.client.clone();
            let key = r.keys.replica(r.leadership.advertise());
            async move {
                c.put(key, r.leadership.advertise(), Some(PutOptions::new().with_lease(id)))
                    .await
            }
        })
        .await
        .context("registering the replica")?;
        // A campaign blocks until this replica leads. One broken off (its
        // etcd member died or froze) ends the session: never campaign again
        // under the same lease, whose election key that member may still
        // delete when it wakes (its clean-up of the cancelled campaign),
        // after a later campaign of ours has won on another member.
        let mut campaigner = r.campaigner.clone();
        let won = tokio::select! {
            res = campaigner.campaign(r.keys.election(), r.leadership.advertise(), id) => res.context("campaigning (broken off: a new session, a new lease)")?,
            _ = done.wait_for(|d| *d) => return Err(anyhow!("the etcd lease was lost while campaigning")),
        };
        let leader = won
            .leader()
            .cloned()
            .ok_or_else(|| anyhow!("etcd elected us without a leader key"))?;
        // Where the other shards' replicas send this shard's keys, under
        // the session lease, written again every 2 s while the session
        // lasts (a hint only: a stale one is corrected by a redirect, and
        // a late write of a predecessor is overwritten).
        let hint = r.args.shard.map(|(k, _)| {
            let r = r.clone();
            tokio::spawn(async move {
                loop {
                    let mut c = r.client.clone();
                    let put = PutOptions::new().with_lease(id);
                    if let Err(e) = c
                        .put(r.keys.leader_hint(k), r.leadership.advertise(), Some(put))
                        .await
                    {
                        tracing::debug!(error = %e, "cannot write the shard's leader hint");
                    }
                    tokio::time::sleep(Duration::from_secs(2)).await;
                }
            })
        });
        let led = lead(r, &leader, &validity, &mut done).await;
        if let Some(h) = hint {
            h.abort();
        }
        led?;
        Ok(())
    }
    .await;
    for k in keepers {
        k.abort();
    }
    // The lease's keys go at once (the registration, and the leader key if
    // a term did not resign it), so that a successor need not wait for its
    // TTL; tried again in the background while etcd does not answer.
    if tokio::time::timeout(Duration::from_secs(1), c.lease_revoke(id))
        .await
        .is_err()
    {
        let ttl = r.lease_ttl_s as u64;
        tokio::spawn(async move {
            for _ in 0..ttl * 2 {
                tokio::time::sleep(Duration::from_millis(500)).await;
                if let Ok(Ok(_)) =
                    tokio::time::timeout(Duration::from_secs(1), c.lease_revoke(id)).await
                {
                    return;
                }
            }
        });
    }
    result
}

/// Keep the session lease alive; sets `done` when its validity ran out.
async fn keep_alive(
    r: Arc<Replica>,
    member: Client,
    id: i64,
    validity: Validity,
    done: Arc<tokio::sync::watch::Sender<bool>>,
) {
    let every = r.keep_alive_every();
    let mut c = member;
    let mut stream = None;
    loop {
        if boot_now() >= *validity.lock() {
            tracing::warn!("etcd lease validity ran out (keep-alives unanswered)");
            let _ = done.send(true);
            return;
        }
        if stream.is_none() {
            stream = tokio::time::timeout(every, c.lease_keep_alive(id))
                .await
                .ok()
                .and_then(Result::ok);
        }
        if let Some((keeper, answers)) = &mut stream {
            let sent = boot_now();
            let answered = async {
                keeper.keep_alive().await.ok()?;
                answers.message().await.ok()?
            };
            match tokio::time::timeout(every, answered).await {
                Ok(Some(resp)) if resp.ttl() > 0 => {
                    let until = sent + r.lease_validity_ns(resp.ttl());
                    let mut v = validity.lock();
                    *v = (*v).max(until);
                }
                Ok(Some(_)) => {
                    tracing::warn!("etcd says the session lease has expired");
                    let _ = done.send(true);
                    return;
                }
                Ok(None) | Err(_) => {
                    // Its etcd member may be gone: another stream at once.
                    stream = None;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            }
        }
        tokio::time::sleep(if stream.is_some() {
            every
        } else {
            Duration::from_millis(50)
        })
        .await;
    }
}

impl Replica {
    /// How long a confirmation of the leader key keeps a leader valid (the
    /// margin, `max(TTL/3, 1 s)`; confirmations go every sixth of the TTL),
    /// and so how long a successor waits before it grants.
    fn key_window_ns(&self) -> u64 {
        self.margin.as_nanos() as u64
    }

    /// The session lease's TTL.
    fn lease_ttl_ns(&self) -> u64 {
        self.lease_ttl_s.max(0) as u64 * 1_000_000_000
    }

    /// How long a keep-alive etcd answered with `ttl_s` keeps this replica
    /// valid, from its send ([`leadership::lease_validity_ns`]).
    fn lease_validity_ns(&self, ttl_s: i64) -> u64 {
        let answered = ttl_s.max(0) as u64 * 1_000_000_000;
        leadership::lease_validity_ns(answered, self.lease_ttl_ns())
    }

    /// Between keep-alives, and between confirmations of the leader key
    /// ([`leadership::keep_alive_every_ns`]).
    fn keep_alive_every(&self) -> Duration {
        Duration::from_nanos(leadership::keep_alive_every_ns(self.lease_ttl_ns()))
    }
}

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

/// etcd key names under `--etcd-prefix`.
#[derive(Clone, Debug)]
struct Keys {
    /// `--etcd-prefix`: the cluster's rules and shard map.
    root: String,
    /// This replica's ledger, election and registrations: the root, or
    /// `ROOT/shard/K` for shard K.
    prefix: String,
}

impl Keys {
    /// A stopping leader's exact key states, in chunks `ckpt/NNNNNN`.
    fn checkpoints(&self) -> String {
        format!("{}/ckpt/", self.prefix)
    }
    fn checkpoint(&self, i: usize) -> String {
        format!("{}{i:06}", self.checkpoints())
    }
    /// Written last: the checkpoint is whole (its value: the chunk count).
    fn checkpoint_done(&self) -> String {
        format!("{}/ckpt-done", self.prefix)
    }
    fn rules(&self) -> String {
        format!("{}/rules", self.root)
    }
    /// The shard map: the shard count, written once by the first replica.
    fn shard_map(&self) -> String {
        format!("{}/shards", self.root)
    }
    /// The shard count again, under this replica's own prefix: a replica
    /// started without `--shard` on a shard's prefix finds it there.
    fn shard_marker(&self) -> String {
        format!("{}/shards", self.prefix)
    }
    /// Where each shard's leader writes its URL under its session lease
    /// (`ROOT/leaders/K`): every shard's leader in one range read.
    fn leader_hints(&self) -> String {
        format!("{}/leaders/", self.root)
    }
    fn leader_hint(&self, shard: u32) -> String {
        format!("{}{shard}", self.leader_hints())
    }
    /// Keys of a sharded cluster's shard `shard`.
    fn of_shard(root: &str, shard: u32) -> Self {
        Self {
            root: root.to_string(),
            prefix: format!("{root}/shard/{shard}"),
        }
    }
    /// Keys of a cluster that is not sharded.
    fn unsharded(root: &str) -> Self {
        Self {
            root: root.to_string(),
            prefix: root.to_string(),
        }
    }
    fn election(&self) -> String {
        format!("{}/election", self.prefix)
    }
    fn ledger(&self) -> String {
        format!("{}/ledger", self.prefix)
    }
    fn replicas(&self) -> String {
        format!("{}/replicas/", self.prefix)
    }
    fn replica(&self, url: &str) -> String {
        format!("{}{}", self.replicas(), hex(url))
    }
    /// Present while the reservations do not describe the ledger (its
    /// state was lost): a new leader then waits the compiled TTL_max cap.
    fn reservations_lost(&self) -> String {
        format!("{}/reservations-lost", self.prefix)
    }
    fn reservations(&self) -> String {
        format!("{}/res/", self.prefix)
    }
    /// The run in progress and how many of its reservation records are
    /// durable (`RUN SEQ`, the run in hex): written with the last chunk of
    /// each group of records, so a restored older copy of etcd holds fewer
    /// of a run's records than a requester that was served after it saw
    /// (SPEC §2 "First start").
    fn run_seq(&self) -> String {
        format!("{}/run-seq", self.prefix)
    }
    fn reservation(&self, k: &KeyId) -> String {
        format!(
            "{}{}/{}/{}",
            self.reservations(),
            hex(&k.rule),
            hex(&k.tenant),
            hex(&k.route)
        )
    }
    /// The key of a reservation's etcd key name.
    fn key_of(&self, name: &str) -> Option<KeyId> {
        let rest = name.strip_prefix(&self.reservations())?;
        let mut parts = rest.split('/');
        let k = KeyId {
            rule: unhex(parts.next()?)?,
            tenant: unhex(parts.next()?)?,
            route: unhex(parts.next()?)?,
        };
        parts.next().is_none().then_some(k)
    }
}

fn reservation_value(r: &Reservation) -> String {
    format!("{} {}", r.floor, r.rate_cap_utps)
}

/// A `run-seq` value: (run, durable records).
fn parse_run_seq(v: &str) -> Option<(u64, u64)> {
    let (r, n) = v.split_once(' ')?;
    Some((u64::from_str_radix(r, 16).ok()?, n.parse().ok()?))
}

fn parse_reservation(v: &str) -> Option<Reservation> {
    let (f, c) = v.split_once(' ')?;
    Some(Reservation {
        floor: f.parse().ok()?,
        rate_cap_utps: c.parse().ok()?,
    })
}

/// The write-ahead reservations in etcd, written by one term: every
/// transaction is guarded by the term's leader key.
struct EtcdStore {
    client: Client,
    keys: Keys,
    guard: (Vec<u8>, i64),
    deposed: Arc<AtomicBool>,
    /// This term's run: its record count goes to `run-seq`.
    run: u64,
    /// The mod revision of every reservation key as this term last wrote
    /// or read it (absent: not in etcd). Each write compares it, so that a
    /// write whose answer was lost and that commits late (after a newer one
    /// of the same key) fails instead of putting an older floor back.
    revs: HashMap<String, i64>,
}

/// Attempts of one chunk against keys that changed under it (a late
/// commit of an earlier attempt) before the write counts as failed.
const CHUNK_ATTEMPTS: usize = 4;

impl EtcdStore {
    fn guard(&self) -> Compare {
        Compare::create_revision(self.guard.0.clone(), CompareOp::Equal, self.guard.1)
    }

    /// Write `chunk` (at most [`TXN_OPS`] keys: a put of the value, or a
    /// delete) in one transaction guarded by the leader key and by each
    /// key's revision as this term knows it.
    async fn write_chunk(
        &mut self,
        chunk: &[(String, Option<Reservation>)],
        seq: Option<u64>,
    ) -> Result<(), String> {
        for _ in 0..CHUNK_ATTEMPTS {
            let resp = self::txn(&self.client, self.chunk_txn(chunk, seq))
                .await
                .map_err(|e| format!("etcd: {e}"))?;
            if resp.succeeded() {
                let rev = resp.header().map_or(0, |h| h.revision());
                for (name, v) in chunk {
                    match v {
                        Some(_) => self.revs.insert(name.clone(), rev),
                        None => self.revs.remove(name),
                    };
                }
                return Ok(());
            }
            self.refresh(chunk).await?;
        }
        Err("etcd: reservations kept changing under this term's writes".into())
    }

    /// The transaction that writes `chunk` (and, with `seq`, the run's
    /// record count) if the leader key and every key are as this term
    /// knows them.
    fn chunk_txn(&self, chunk: &[(String, Option<Reservation>)], seq: Option<u64>) -> Txn {
        let mut cmp = vec![self.guard()];
        cmp.extend(chunk.iter().map(|(name, _)| match self.revs.get(name) {
            Some(&rev) => Compare::mod_revision(name.clone(), CompareOp::Equal, rev),
            None => Compare::version(name.clone(), CompareOp::Equal, 0),
        }));
        let mut ops: Vec<TxnOp> = chunk
            .iter()
            .map(|(name, v)| match v {
                Some(v) => TxnOp::put(name.clone(), reservation_value(v), None),
                None => TxnOp::delete(name.clone(), None),
            })
            .collect();
        if let Some(seq) = seq {
            let value = format!("{:016x} {seq}", self.run);
            ops.push(TxnOp::put(self.keys.run_seq(), value, None));
        }
        Txn::new().when(cmp).and_then(ops)
    }

    /// After a failed compare: deposed (the leader key is gone), or some
    /// key of `chunk` is not as this term left it; read them again.
    async fn refresh(&mut self, chunk: &[(String, Option<Reservation>)]) -> Result<(), String> {
        let mut reads = vec![TxnOp::get(self.guard.0.clone(), None)];
        reads.extend(chunk.iter().map(|(name, _)| TxnOp::get(name.clone(), None)));
        let resp = self::txn(&self.client, Txn::new().and_then(reads))
            .await
            .map_err(|e| format!("etcd: {e}"))?;
        let got = resp.op_responses();
        let leader_alive = matches!(got.first(), Some(etcd_client::TxnOpResponse::Get(g))
            if g.kvs().first().is_some_and(|kv| kv.create_revision() == self.guard.1));
        if !leader_alive {
            self.deposed.store(true, Ordering::Release);
            return Err("etcd: this replica's leader key is gone (deposed)".into());
        }
        for ((name, _), r) in chunk.iter().zip(got.iter().skip(1)) {
            if let etcd_client::TxnOpResponse::Get(g) = r {
                match g.kvs().first() {
                    Some(kv) => self.revs.insert(name.clone(), kv.mod_revision()),
                    None => self.revs.remove(name),
                };
            }
        }
        Ok(())
    }
}

impl Store for EtcdStore {
    async fn append(&mut self, seq: u64, records: Vec<Record>) -> Result<(), String> {
        // One operation per key (etcd refuses a key twice in one
        // transaction): the last record of each wins, as on replay.
        let mut last: BTreeMap<String, Option<Reservation>> = BTreeMap::new();
        for r in &records {
            match r {
                Record::Set(k, v) => last.insert(self.keys.reservation(k), Some(*v)),
                Record::AtRest(k) => last.insert(self.keys.reservation(k), None),
            };
        }
        let entries: Vec<(String, Option<Reservation>)> = last.into_iter().collect();
        // The run's record count goes with the last chunk only: once it
        // says `seq`, every record up to `seq` is in etcd.
        let mut chunks: Vec<&[(String, Option<Reservation>)]> = entries.chunks(TXN_OPS).collect();
        if chunks.is_empty() {
            chunks.push(&[]);
        }
        let last = chunks.len() - 1;
        for (i, chunk) in chunks.into_iter().enumerate() {
            self.write_chunk(chunk, (i == last).then_some(seq)).await?;
        }
        Ok(())
    }

    async fn invalidate(&mut self) -> Result<(), String> {
        // Guarded by the leader key only: whatever is there goes. A late
        // write of ours compares a revision the delete changed, and fails.
        let all = etcd_client::DeleteOptions::new().with_prefix();
        let t = Txn::new().when([self.guard()]).and_then([
            TxnOp::put(self.keys.reservations_lost(), "1", None),
            TxnOp::delete(self.keys.reservations(), Some(all)),
        ]);
        let resp = self::txn(&self.client, t)
            .await
            .map_err(|e| format!("etcd: {e}"))?;
        if !resp.succeeded() {
            self.deposed.store(true, Ordering::Release);
            return Err("etcd: this replica's leader key is gone (deposed)".into());
        }
        self.revs.clear();
        Ok(())
    }
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

/// The shard map's version in replies (the map is only a shard count,
/// written once).
const SHARD_MAP_VERSION: u64 = 1;

/// The cluster recorded with the ledger in etcd (by the first leader
/// started with `--cluster`) must be `--cluster`'s: a replica of another
/// cluster exits before it campaigns.
async fn check_cluster(client: &Client, keys: &Keys, arg: Option<&str>) -> anyhow::Result<()> {
    let got = get(client, &keys.ledger(), None)
        .await
        .context("reading the ledger record")?;
    let Some(kv) = got.kvs().first() else {
        return Ok(());
    };
    let record = LedgerRecord::decode(kv.value_str().unwrap_or(""))
        .map_err(|e| anyhow!("etcd {}: {e}", keys.ledger()))?;
    record.cluster_with(arg).map(drop).map_err(|theirs| {
        anyhow!(
            "--cluster {}: the ledger under {} belongs to cluster {theirs} (start without --cluster, or give each cluster its own --etcd-prefix)",
            arg.unwrap_or_default(),
            keys.ledger()
        )
    })
}

/// The cluster's shard count as recorded in etcd must be `--shard`'s (the
/// first replica of a sharded cluster records it): a replica that splits
/// keys otherwise would serve keys another shard's leader serves too.
async fn check_shard_map(
    client: &Client,
    keys: &Keys,
    shard: Option<(u32, u32)>,
) -> anyhow::Result<()> {
    let want = shard.map_or(1, |(_, n)| n);
    check_shard_key(client, keys, shard, want, keys.shard_map()).await?;
    if keys.shard_marker() != keys.shard_map() {
        check_shard_key(client, keys, shard, want, keys.shard_marker()).await?;
    }
    Ok(())
}

/// [`check_shard_map`] of one key: put `want` there if it is absent, else
/// it must hold `want`.
async fn check_shard_key(
    client: &Client,
    keys: &Keys,
    shard: Option<(u32, u32)>,
    want: u32,
    key: String,
) -> anyhow::Result<()> {
    let put = Txn::new()
        .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
        .and_then([TxnOp::put(key.as_str(), want.to_string(), None)])
        .or_else([TxnOp::get(key.as_str(), None)]);
    let resp = txn(client, put)
        .await
        .with_context(|| format!("reading the shard map {key}"))?;
    if resp.succeeded() {
        if want > 1 {
            tracing::info!(%key, shards = want, "recorded the shard map");
        }
        return Ok(());
    }
    let recorded = resp
        .op_responses()
        .into_iter()
        .find_map(|op| match op {
            etcd_client::TxnOpResponse::Get(g) => g
                .kvs()
                .first()
                .and_then(|kv| kv.value_str().ok().map(str::to_string)),
            _ => None,
        })
        .unwrap_or_default();
    let have: u32 = recorded
        .trim()
        .parse()
        .map_err(|_| anyhow!("the shard map {key} holds {recorded:?}, not a shard count"))?;
    if have != want {
        return Err(match shard {
            None => anyhow!(
                "--shard: the cluster under {} is split into {have} shards ({key}); start each replica with --shard K/{have}",
                keys.root
            ),
            Some((_, n)) => anyhow!(
                "--shard K/{n}: the cluster under {} is split into {have} shards ({key}); the shard count cannot change",
                keys.root
            ),
        });
    }
    Ok(())
}

/// A sharded cluster: every shard's leader, from the leaders' hints
/// (`ROOT/leaders/K`, one range read a second whatever the shard count),
/// for the replies' `shard_routes`. A route names the leader only: a
/// shard's own replies name its replicas. A failed read keeps the routes
/// known.
async fn shard_routes(r: Arc<Replica>, count: u32) {
    loop {
        let all = GetOptions::new().with_prefix();
        if let Ok(resp) = get(&r.client, &r.keys.leader_hints(), Some(all)).await {
            let mut routes: Vec<ShardRoute> = resp
                .kvs()
                .iter()
                .filter_map(|kv| {
                    let shard = kv
                        .key_str()
                        .ok()?
                        .strip_prefix(&r.keys.leader_hints())?
                        .parse::<u32>()
                        .ok()
                        .filter(|s| *s < count)?;
                    Some(ShardRoute {
                        shard,
                        leader_url: kv.value_str().ok()?.to_string(),
                        replicas: Vec::new(),
                    })
                })
                .collect();
            routes.sort_by_key(|r| r.shard);
            r.leadership.set_shard_routes(routes);
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Every replica's URL, from their registrations.
async fn list_replicas(r: Arc<Replica>) {
    loop {
        let all = GetOptions::new().with_prefix();
        if let Ok(resp) = get(&r.client, &r.keys.replicas(), Some(all)).await {
            let urls = resp
                .kvs()
                .iter()
                .filter_map(|kv| kv.value_str().ok().map(str::to_string))
                .collect();
            r.leadership.set_replicas(urls);
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
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

/// Keep the leader valid while both its lease (keep-alives) and its leader
/// key (a guarded read, every keep-alive period) are confirmed: validity
/// is the earlier of the lease's and `sent + key window` of the last
/// confirmation of the key. A key found gone deposes the term at once.
async fn confirm_leadership(
    r: Arc<Replica>,
    leader: LeaderKey,
    validity: Validity,
    deposed: Arc<AtomicBool>,
) {
    let every = r.keep_alive_every();
    let epoch = leader.rev() as u64;
    loop {
        tokio::time::sleep(every).await;
        let sent = boot_now();
        match confirm_key(&r, &leader, every * 2).await {
            Some(true) => {
                let until = (*validity.lock()).min(sent + r.key_window_ns());
                r.leadership.extend(epoch, until);
            }
            Some(false) => {
                tracing::warn!(epoch, "this replica's leader key is gone: deposed");
                deposed.store(true, Ordering::Release);
                r.leadership.step_down();
                return;
            }
            None => {} // unanswered: the validity is not extended
        }
    }
}

/// Whether `leader`'s key exists, asked of every member at once within
/// `within` (the first answer counts; `None`: none answered). The
/// transaction reads the key with a linearizable range: a transaction
/// with no operations is served from a member's local state, and a member
/// cut off from its peers answered "the key is there" for a key deleted
/// elsewhere (a third adversarial review).
async fn confirm_key(r: &Replica, leader: &LeaderKey, within: Duration) -> Option<bool> {
    let key = leader.key().to_vec();
    let check = Txn::new()
        .when([Compare::create_revision(
            key.clone(),
            CompareOp::Equal,
            leader.rev(),
        )])
        .and_then([TxnOp::get(key, None)]);
    let mut asks = tokio::task::JoinSet::new();
    for m in &r.members {
        let (mut c, t) = (m.clone(), check.clone());
        asks.spawn(async move { c.txn(t).await });
    }
    let answer = tokio::time::timeout(within, async {
        while let Some(done) = asks.join_next().await {
            if let Ok(Ok(resp)) = done {
                return Some(resp.succeeded());
            }
        }
        None
    })
    .await
    .ok()
    .flatten();
    asks.abort_all();
    answer
}

/// A term as leader: resume from etcd, serve, end on deposition or stop.
async fn lead(
    r: &Arc<Replica>,
    leader: &LeaderKey,
    validity: &Validity,
    done: &mut tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let epoch = leader.rev() as u64;
    let mut c = r.client.clone();
    let guard = || Compare::create_revision(leader.key().to_vec(), CompareOp::Equal, leader.rev());
    // The ledger record and every reservation, as the predecessor left them.
    let got = get(&r.client, &r.keys.ledger(), None)
        .await
        .context("reading the ledger record")?;
    let recorded = match got.kvs().first() {
        Some(kv) => Some(
            LedgerRecord::decode(kv.value_str().unwrap_or("")).map_err(|e| {
                anyhow!("etcd {}: {e}; nothing is granted from it", r.keys.ledger())
            })?,
        ),
        None => None,
    };
    let all = GetOptions::new().with_prefix();
    let got = get(&r.client, &r.keys.reservations(), Some(all))
        .await
        .context("reading the reservations")?;
    let mut reserved = Vec::new();
    let mut revs = HashMap::new();
    for kv in got.kvs() {
        let name = kv.key_str().unwrap_or("");
        let (Some(k), Some(v)) = (
            r.keys.key_of(name),
            kv.value_str().ok().and_then(parse_reservation),
        ) else {
            return Err(anyhow!(
                "etcd {name:?}: not a reservation; nothing is granted from it"
            ));
        };
        reserved.push((k, v));
        revs.insert(name.to_string(), kv.mod_revision());
    }
    // A predecessor that stopped cleanly left its exact state: used when
    // whole (the done marker names every chunk) and of this ledger;
    // otherwise the reservations, which it left in place, still hold.
    let checkpoint = read_checkpoint(&r.client, &r.keys, recorded.as_ref().map(|l| l.id)).await;
    let lost = !get(&r.client, &r.keys.reservations_lost(), None)
        .await
        .context("reading the ledger record")?
        .kvs()
        .is_empty();
    // No ledger and no reservations: a new ledger. Reservations without a
    // ledger record: a predecessor of unknown TTL_max (the compiled cap).
    let first = recorded.is_none() && reserved.is_empty() && !lost;
    let ttl_max_ms = r.args.ttl_max.as_millis() as u64;
    let prev = recorded.unwrap_or(LedgerRecord {
        id: quotalease_proto::random_instance().max(1),
        ttl_max_ms: if first { 0 } else { TTL_MAX_CAP_NS / 1_000_000 },
        rules_version: 0,
        lease_id_base: 0,
        run: 0,
        runs: Vec::new(),
        cluster: String::new(),
    });
    let version = alloc_server::unix_ms().max(prev.rules_version + 1);
    let rules = match (&r.args.rules, &r.rules_text) {
        (Some(p), _) => serve::load_rules(p, version)?,
        (None, Some(latest)) => {
            let text = latest.lock().clone();
            match text {
                // Published texts were validated; one that is not valid
                // (written by hand) leaves the rules empty until fixed.
                Some(t) => RuleSet::parse(&t, &r.keys.rules(), version).unwrap_or_else(|errs| {
                    tracing::error!(
                        errors = errs.len(),
                        "the rules in etcd are not valid; no rules until they are"
                    );
                    RuleSet {
                        version,
                        rules: Vec::new(),
                    }
                }),
                None => RuleSet {
                    version,
                    rules: Vec::new(),
                },
            }
        }
        (None, None) => unreachable!("rules come from a file or from etcd"),
    };
    let lease_id_base =
        alloc_server::unix_ns().max(prev.lease_id_base.saturating_add(TERM_LEASE_IDS));
    // Each term is a run of the ledger (SPEC §2 "First start"): the
    // predecessor's ends at the records `run-seq` says are durable (none
    // if it names another run: that one wrote nothing).
    let got = get(&r.client, &r.keys.run_seq(), None)
        .await
        .context("reading the run's record count")?;
    let last_seq = match got.kvs().first().map(|kv| kv.value_str().unwrap_or("")) {
        None => 0,
        Some(v) => match parse_run_seq(v) {
            Some((run, seq)) if run == prev.run => seq,
            Some(_) => 0,
            None => {
                return Err(anyhow!(
                    "etcd {}: {v:?} is not `RUN SEQ`; nothing is granted from it",
                    r.keys.run_seq()
                ))
            }
        },
    };
    let cluster = prev
        .cluster_with(r.args.cluster.as_deref())
        .map_err(|theirs| {
            anyhow!(
                "--cluster: the ledger under {} belongs to cluster {theirs}",
                r.keys.ledger()
            )
        })?;
    let run_id = quotalease_proto::random_instance().max(1);
    let mut record = LedgerRecord {
        // A lowered --ttl-max never lowers the recorded one with --etcd:
        // the next leader waits the largest any replica used.
        ttl_max_ms: prev.ttl_max_ms.max(ttl_max_ms),
        rules_version: version,
        lease_id_base,
        cluster,
        ..prev.clone()
    };
    record.start_run(run_id, last_seq);
    let put =
        Txn::new()
            .when([guard()])
            .and_then([TxnOp::put(r.keys.ledger(), record.encode(), None)]);
    // This guarded write confirms our leader key: validity from its send.
    let confirmed_at = boot_now();
    if !txn(&r.client, put)
        .await
        .context("writing the ledger record")?
        .succeeded()
    {
        return Err(anyhow!("deposed before the term began"));
    }
    let durable = term::Durable {
        first,
        lost,
        // The predecessor may decide grants up to a key window after the
        // successor's read (see `lead` below): its leases outlive the read
        // by TTL_max plus that window.
        predecessor_ttl_max_ns: prev
            .ttl_max_ms
            .saturating_mul(1_000_000)
            .saturating_add(r.key_window_ns()),
        ledger_id: record.id,
        reservations: reserved,
        checkpoint: checkpoint.filter(|_| !lost),
    };
    let cfg = term::config(
        CoreConfig {
            ttl_max_ns: r.args.ttl_max.as_nanos() as u64,
            shard: r.args.shard.unwrap_or((0, 1)),
            cluster: record.cluster.clone(),
            runs: record.runs(),
            ..CoreConfig::default()
        },
        &durable,
        term::Grace {
            first_ns: term::START_GRACE.as_nanos() as u64,
            // Every later term waits too, as a restart does: requesters
            // that saw a newer state than etcd holds (a restored snapshot)
            // name its run before a brand-new one can take from it.
            later_ns: term::restart_grace(r.args.ttl_max).as_nanos() as u64,
        },
        r.args.new_ledger,
    );
    let shared = &r.shared;
    shared.new_term(cfg, rules, epoch, lease_id_base);
    let now = shared.now();
    let (resumed, promises) = shared.with_core(|core| term::resume(core, now, durable));
    let deposed = Arc::new(AtomicBool::new(false));
    let mut store = EtcdStore {
        client: r.client.clone(),
        keys: r.keys.clone(),
        guard: (leader.key().to_vec(), leader.rev()),
        deposed: deposed.clone(),
        run: run_id,
        revs,
    };
    let seq = shared.with_core(|core| core.reservation_seq());
    store
        .append(
            seq,
            promises
                .into_iter()
                .map(|(k, v)| Record::Set(k, v))
                .collect(),
        )
        .await
        .map_err(|e| anyhow!(e))?;
    // The checkpoint is used up: gone before anything is granted (a later
    // failover resumes from the reservations just written).
    let del = Txn::new().when([guard()]).and_then([
        TxnOp::delete(
            r.keys.checkpoints(),
            Some(etcd_client::DeleteOptions::new().with_prefix()),
        ),
        TxnOp::delete(r.keys.checkpoint_done(), None),
    ]);
    if !txn(&r.client, del)
        .await
        .context("removing the checkpoint")?
        .succeeded()
    {
        return Err(anyhow!("deposed before the term began"));
    }
    // The term's setup can outlast the key window: confirm the key once
    // more before leading, so that the term does not start already lapsed.
    let confirmed_at = {
        let sent = boot_now();
        match confirm_key(r, leader, Duration::from_secs(1)).await {
            Some(true) => sent,
            Some(false) => return Err(anyhow!("deposed before the term began")),
            None => confirmed_at,
        }
    };
    let (durability, writer) = reservation_log::start(shared.clone(), store);
    r.durability.replace_with(&durability);
    r.term.store(epoch, Ordering::Release);
    // A predecessor that did not hand over (crashed, cut off, or deposed
    // by a deletion of its key while its lease lived) may grant until its
    // last key confirmation's send + the key window: wait that out (with
    // the clocks' rate error) before granting from what the reservations
    // left.
    let window = r.key_window_ns();
    let serve_from = match resumed {
        term::Resumed::Reserved(_) => leadership::successor_serves_from(boot_now(), window),
        _ => 0,
    };
    r.leadership.lead(
        epoch,
        (*validity.lock()).min(confirmed_at + window),
        serve_from,
    );
    let confirmer = tokio::spawn(confirm_leadership(
        r.clone(),
        leader.clone(),
        validity.clone(),
        deposed.clone(),
    ));
    let ledger = format_args!("{:016x}", record.id).to_string();
    match resumed {
        term::Resumed::Lost => {
            tracing::warn!(epoch, %ledger, wait_ms = TTL_MAX_CAP_NS / 1_000_000, "leading: the reservations were given up (a lost ledger); every key counts as fully leased out until the TTL_max cap has passed")
        }
        term::Resumed::Checkpoint(keys) => {
            tracing::info!(epoch, %ledger, keys, "leading: keys resume from the predecessor's checkpoint in etcd (a clean handover: what was leased counts until it has expired, nothing else is lost)")
        }
        term::Resumed::First => {
            tracing::info!(epoch, %ledger, "leading: no ledger in etcd, a new one; buckets start full")
        }
        term::Resumed::Reserved(keys) => {
            tracing::info!(epoch, %ledger, keys, predecessor_ttl_max_ms = prev.ttl_max_ms, "leading: keys resume from their reservations in etcd (each at its floor, the rest of its burst leased out until the predecessor's longest lease has expired); keys without one are full")
        }
    }
    let mut written = record;
    let mut lost_marker = lost;
    let ended = loop {
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(100)) => {}
            _ = done.wait_for(|d| *d) => {}
        }
        if r.stopping.load(Ordering::Acquire) {
            break "stopping";
        }
        if *done.borrow() {
            break "the etcd lease was lost";
        }
        if !r.leadership.leading(boot_now()) {
            break "leadership validity ran out (etcd unreachable, or the lease or the key not confirmed in time)";
        }
        if deposed.load(Ordering::Acquire) {
            break "deposed: the leader key is gone";
        }
        // The wait for a lost ledger's leases is over: the reservations
        // describe the ledger again.
        if lost_marker && shared.now() >= shared.with_core(|core| core.ready_at_ns()) {
            let del = Txn::new()
                .when([guard()])
                .and_then([TxnOp::delete(r.keys.reservations_lost(), None)]);
            if let Ok(resp) = txn(&r.client, del).await {
                lost_marker = !resp.succeeded();
            }
        }
        // Versions never go backwards for the next leader.
        let v = shared.with_core(|core| core.rules().version);
        if v > written.rules_version {
            let next = LedgerRecord {
                rules_version: v,
                ..written.clone()
            };
            let put = Txn::new().when([guard()]).and_then([TxnOp::put(
                r.keys.ledger(),
                next.encode(),
                None,
            )]);
            match txn(&r.client, put).await {
                Ok(resp) if resp.succeeded() => written = next,
                Ok(_) => break "deposed: the leader key is gone",
                Err(e) => tracing::warn!(error = %e, "cannot update the ledger record"),
            }
        }
    };
    r.leadership.step_down();
    r.term.store(0, Ordering::Release);
    confirmer.abort();
    writer.abort();
    tracing::warn!(epoch, why = ended, "no longer leading");
    if ended == "stopping" {
        // A clean handover: the exact state after the last grant, for the
        // successor, written while the leader key is still ours.
        let keys = shared.checkpoint_and_close();
        match write_checkpoint(&r.client, &r.keys, guard(), written.id, &keys).await {
            Ok(()) => tracing::info!(
                keys = keys.len(),
                "checkpoint written to etcd for the next leader"
            ),
            Err(e) => {
                tracing::warn!(error = %format!("{e:#}"), "no checkpoint for the next leader: it resumes from the reservations")
            }
        }
        let _ = tokio::time::timeout(
            Duration::from_secs(1),
            c.resign(Some(ResignOptions::new().with_leader(leader.clone()))),
        )
        .await;
    }
    Ok(())
}

/// The whole checkpoint of ledger `ledger` in etcd, if there is one.
async fn read_checkpoint(
    client: &Client,
    keys: &Keys,
    ledger: Option<u64>,
) -> Option<Vec<(KeyId, quotalease_allocator::ledger::KeyCheckpoint)>> {
    let done = get(client, &keys.checkpoint_done(), None).await.ok()?;
    let chunks: usize = done.kvs().first()?.value_str().ok()?.trim().parse().ok()?;
    let all = get(
        client,
        &keys.checkpoints(),
        Some(GetOptions::new().with_prefix()),
    )
    .await
    .ok()?;
    if all.kvs().len() != chunks {
        tracing::warn!(
            chunks,
            found = all.kvs().len(),
            "the checkpoint in etcd is not whole: not used"
        );
        return None;
    }
    let mut out = Vec::new();
    for kv in all.kvs() {
        match durable::decode_checkpoint(kv.value_str().unwrap_or("")) {
            Ok((id, part)) if Some(id) == ledger => out.extend(part),
            Ok((id, _)) => {
                tracing::warn!(
                    theirs = format_args!("{id:016x}"),
                    "the checkpoint in etcd is of another ledger: not used"
                );
                return None;
            }
            Err(e) => {
                tracing::warn!(error = %e, "the checkpoint in etcd is unreadable: not used");
                return None;
            }
        }
    }
    Some(out)
}

/// Write `keys` as the checkpoint for the next leader: chunks, then the
/// done marker, every transaction guarded by `guard`.
async fn write_checkpoint(
    client: &Client,
    keys: &Keys,
    guard: Compare,
    ledger: u64,
    states: &[(KeyId, quotalease_allocator::ledger::KeyCheckpoint)],
) -> anyhow::Result<()> {
    let chunks: Vec<_> = states.chunks(CHECKPOINT_CHUNK_KEYS).collect();
    for (i, chunk) in chunks.iter().enumerate() {
        let t = Txn::new().when([guard.clone()]).and_then([TxnOp::put(
            keys.checkpoint(i),
            durable::encode_checkpoint(ledger, chunk),
            None,
        )]);
        if !txn(client, t).await?.succeeded() {
            return Err(anyhow!("deposed while writing the checkpoint"));
        }
    }
    let t = Txn::new().when([guard]).and_then([TxnOp::put(
        keys.checkpoint_done(),
        chunks.len().to_string(),
        None,
    )]);
    if !txn(client, t).await?.succeeded() {
        return Err(anyhow!("deposed while writing the checkpoint"));
    }
    Ok(())
}

/// One line per rule that differs between `old` and `new` (by id):
/// `+ rule`, `- rule`, `~ rule: old -> new`.
fn diff(old: &RuleSet, new: &RuleSet) -> Vec<String> {
    let line = |r: &quotalease_model::rules::Rule| {
        RuleSet {
            version: 0,
            rules: vec![r.clone()],
        }
        .summary()
        .trim()
        .to_string()
    };
    let mut out = Vec::new();
    for r in &old.rules {
        match new.get(&r.id) {
            None => out.push(format!("- {}", line(r))),
            Some(n) if n != r => out.push(format!("~ {}\n    now {}", line(r), line(n))),
            Some(_) => {}
        }
    }
    for r in &new.rules {
        if old.get(&r.id).is_none() {
            out.push(format!("+ {}", line(r)));
        }
    }
    out
}

/// `quotalease rules publish FILE --etcd URL`: validate (every error),
/// print the diff against the live rules, publish (a transaction that
/// fails if someone published in between).
pub async fn publish(file: &Path, etcd: &[String], prefix: &str) -> anyhow::Result<()> {
    if etcd.is_empty() {
        return Err(anyhow!("--etcd URL[,URL] is required"));
    }
    let new = serve::load_rules(file, 0)?;
    let text = std::fs::read_to_string(file)
        .with_context(|| format!("{}: cannot read", file.display()))?;
    let keys = Keys {
        root: prefix.trim_end_matches('/').to_string(),
        prefix: prefix.trim_end_matches('/').to_string(),
    };
    let options = ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(3))
        .with_timeout(Duration::from_secs(5));
    let c = Client::connect(etcd, Some(options))
        .await
        .with_context(|| format!("--etcd {}: cannot connect", etcd.join(",")))?;
    let got = get(&c, &keys.rules(), None)
        .await
        .with_context(|| format!("--etcd {}: cannot read {}", etcd.join(","), keys.rules()))?;
    let (live, mod_rev) = match got.kvs().first() {
        Some(kv) => {
            let live = RuleSet::parse(kv.value_str().unwrap_or(""), &keys.rules(), 0)
                .unwrap_or_else(|errs| {
                    eprintln!(
                        "the live rules in etcd are not valid ({} error(s)); diff against none",
                        errs.len()
                    );
                    RuleSet::default()
                });
            (live, kv.mod_revision())
        }
        None => (RuleSet::default(), 0),
    };
    let changes = diff(&live, &new);
    if changes.is_empty() {
        println!(
            "{}: {} rule(s), the same as live in etcd {}: nothing published",
            file.display(),
            new.rules.len(),
            keys.rules()
        );
        return Ok(());
    }
    for l in &changes {
        println!("{l}");
    }
    // Unchanged since we read it (mod revision 0: absent).
    let same = Compare::mod_revision(keys.rules(), CompareOp::Equal, mod_rev);
    let t = Txn::new()
        .when([same])
        .and_then([TxnOp::put(keys.rules(), text, None)]);
    let resp = txn(&c, t).await.context("publishing")?;
    if !resp.succeeded() {
        return Err(anyhow!(
            "the rules in etcd changed while this was publishing: nothing published; run it again"
        ));
    }
    let rev = resp.header().map_or(0, |h| h.revision());
    println!(
        "published {} rule(s) to etcd {} (revision {rev}): {} change(s); allocators apply them within a second",
        new.rules.len(),
        keys.rules(),
        changes.len()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservation_keys_round_trip_any_key_and_refuse_others() {
        let keys = Keys::unsharded("/ql");
        let k = KeyId {
            rule: "r/1".into(),
            tenant: "t é".into(),
            route: String::new(),
        };
        assert_eq!(keys.key_of(&keys.reservation(&k)), Some(k));
        assert_eq!(keys.key_of("/ql/res/zz/00/00"), None);
        assert_eq!(keys.key_of("/ql/res/61/62"), None);
        assert_eq!(keys.key_of("/other/res/61/62/63"), None);
        let r = Reservation {
            floor: 7,
            rate_cap_utps: 9,
        };
        assert_eq!(parse_reservation(&reservation_value(&r)), Some(r));
        assert_eq!(parse_reservation("7"), None);
    }

    /// With a real etcd (`etcd` on PATH; skipped without one outside CI):
    /// a reservation write that commits late, after a newer write of the
    /// same key, fails instead of putting the older floor back; a write
    /// after the leader key is gone fails and marks the store deposed.
    #[tokio::test]
    async fn a_late_write_cannot_put_an_older_floor_back() {
        let Some(bin) = std::env::var_os("PATH").and_then(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join("etcd"))
                .find(|p| p.is_file())
        }) else {
            assert!(std::env::var_os("CI").is_none(), "etcd is missing");
            eprintln!("SKIPPED: no etcd on PATH");
            return;
        };
        let port = |_| {
            std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port()
        };
        let (client_port, peer_port) = (port(0), port(1));
        let dir = std::env::temp_dir().join(format!("ql-etcd-unit-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let url = format!("http://127.0.0.1:{client_port}");
        let peer = format!("http://127.0.0.1:{peer_port}");
        /// Killed when dropped, also when an assertion fails.
        struct Child(std::process::Child);
        impl Drop for Child {
            fn drop(&mut self) {
                let _ = self.0.kill();
                let _ = self.0.wait();
            }
        }
        let _etcd = Child(
            std::process::Command::new(bin)
                .args([
                    "--data-dir",
                    &dir.display().to_string(),
                    "--listen-client-urls",
                    &url,
                    "--advertise-client-urls",
                    &url,
                    "--listen-peer-urls",
                    &peer,
                    "--initial-advertise-peer-urls",
                    &peer,
                    "--initial-cluster",
                    &format!("default={peer}"),
                ])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .expect("spawn etcd"),
        );
        let mut c = None;
        for _ in 0..100 {
            if let Ok(mut cl) = Client::connect([url.as_str()], None).await {
                if cl.put("/probe", "1", None).await.is_ok() {
                    c = Some(cl);
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let mut c = c.expect("etcd answers");
        let lease = c.lease_grant(30, None).await.unwrap().id();
        let leader = c
            .put(
                "/t/election/x",
                "me",
                Some(PutOptions::new().with_lease(lease).with_prev_key()),
            )
            .await
            .unwrap();
        let rev = leader.header().unwrap().revision();
        let keys = Keys::unsharded("/t");
        let deposed = Arc::new(AtomicBool::new(false));
        let mut store = EtcdStore {
            client: c.clone(),
            keys: keys.clone(),
            guard: (b"/t/election/x".to_vec(), rev),
            deposed: deposed.clone(),
            run: 0xab,
            revs: HashMap::new(),
        };
        let k = KeyId {
            rule: "r".into(),
            tenant: "t".into(),
            route: String::new(),
        };
        let name = keys.reservation(&k);
        let at = |floor| {
            vec![(
                name.clone(),
                Some(Reservation {
                    floor,
                    rate_cap_utps: 0,
                }),
            )]
        };
        store.write_chunk(&at(20), None).await.unwrap();
        // An attempt built now, whose answer is lost and which commits late.
        let late = store.chunk_txn(&at(20), Some(3));
        store.write_chunk(&at(12), Some(4)).await.unwrap();
        assert!(
            !c.txn(late).await.unwrap().succeeded(),
            "the late write was applied"
        );
        let got = c.get(name.as_str(), None).await.unwrap();
        assert_eq!(got.kvs()[0].value_str().unwrap(), "12 0");
        // The run's record count went with the records, and not back.
        let got = c.get(keys.run_seq(), None).await.unwrap();
        let v = got.kvs()[0].value_str().unwrap();
        assert_eq!(parse_run_seq(v), Some((0xab, 4)), "{v:?}");
        // The leader key goes: writes fail, the store is deposed.
        c.lease_revoke(lease).await.unwrap();
        assert!(store.write_chunk(&at(5), Some(5)).await.is_err());
        assert!(deposed.load(Ordering::Acquire));
        drop(_etcd);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_publish_diff_names_added_removed_and_changed_rules() {
        let set = |yaml: &str| RuleSet::parse(yaml, "t", 0).expect("valid");
        let old = set("rules:\n  - {id: a, match: {tenant: '*'}, rate: 10/s, burst: 20}\n  - {id: b, match: {tenant: '*'}, rate: 1/s, burst: 1}\n");
        let new = set("rules:\n  - {id: a, match: {tenant: '*'}, rate: 10/s, burst: 30}\n  - {id: c, match: {route: '/x'}, rate: 5/m, burst: 5}\n");
        let d = diff(&old, &new);
        assert_eq!(d.len(), 3, "{d:?}");
        assert!(
            d[0].starts_with("~ a") && d[0].contains("burst=20") && d[0].contains("burst=30"),
            "{d:?}"
        );
        assert!(d[1].starts_with("- b"), "{d:?}");
        assert!(d[2].starts_with("+ c"), "{d:?}");
        assert!(diff(&new, &new).is_empty());
    }
}

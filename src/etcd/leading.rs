//! A term as leader: confirm the leader key while it leads, resume from
//! what etcd holds, serve, and hand over a checkpoint on a clean stop.

use super::*;

/// Keep the leader valid while both its lease (keep-alives) and its leader
/// key (a guarded read, every keep-alive period) are confirmed: validity
/// is the earlier of the lease's and `sent + key window` of the last
/// confirmation of the key. A key found gone deposes the term at once.
pub(super) async fn confirm_leadership(
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
pub(super) async fn confirm_key(r: &Replica, leader: &LeaderKey, within: Duration) -> Option<bool> {
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

/// What etcd holds of the ledger when a term begins.
struct Found {
    recorded: Option<LedgerRecord>,
    reserved: Vec<(KeyId, Reservation)>,
    /// Each reservation's etcd key and mod revision (the store guards its
    /// writes by them).
    revs: HashMap<String, i64>,
    checkpoint: Option<Vec<(KeyId, quotalease_allocator::ledger::KeyCheckpoint)>>,
    lost: bool,
}

/// Read what etcd holds of the ledger. A value that is not what it should
/// be is an error: nothing is granted from it.
async fn read_durable(r: &Replica) -> anyhow::Result<Found> {
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
    Ok(Found {
        recorded,
        reserved,
        revs,
        checkpoint,
        lost,
    })
}

/// The rules a term starts with, at `version`: the `--rules` file, or the
/// text published to etcd (a text that is not valid, written by hand,
/// leaves the rules empty until fixed).
fn rules_for_term(r: &Replica, version: u64) -> anyhow::Result<RuleSet> {
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
                        ..Default::default()
                    }
                }),
                None => RuleSet {
                    version,
                    rules: Vec::new(),
                    ..Default::default()
                },
            }
        }
        (None, None) => unreachable!("rules come from a file or from etcd"),
    };
    Ok(rules)
}

/// A term as leader: begin from what etcd holds, serve, end on deposition
/// or stop (a clean stop hands its exact state over).
pub(super) async fn lead(
    r: &Arc<Replica>,
    leader: &LeaderKey,
    validity: &Validity,
    done: &mut tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let epoch = leader.rev() as u64;
    let guard = || Compare::create_revision(leader.key().to_vec(), CompareOp::Equal, leader.rev());
    let Found {
        recorded,
        reserved,
        revs,
        checkpoint,
        lost,
    } = read_durable(r).await?;
    // No ledger and no reservations: a new ledger. Reservations without a
    // ledger record: a predecessor of unknown TTL_max (the compiled cap).
    let first = recorded.is_none() && reserved.is_empty() && !lost;
    // Each term is a run of the ledger (SPEC §2 "First start"): the
    // predecessor's ends at the records `run-seq` says are durable (none
    // if it names another run: that one wrote nothing).
    let prev_run = recorded.as_ref().map_or(0, |p| p.run);
    let got = get(&r.client, &r.keys.run_seq(), None)
        .await
        .context("reading the run's record count")?;
    let last_seq = match got.kvs().first().map(|kv| kv.value_str().unwrap_or("")) {
        None => 0,
        Some(v) => match parse_run_seq(v) {
            Some((run, seq)) if run == prev_run => seq,
            Some(_) => 0,
            None => {
                return Err(anyhow!(
                    "etcd {}: {v:?} is not `RUN SEQ`; nothing is granted from it",
                    r.keys.run_seq()
                ))
            }
        },
    };
    // Each term's leases are numbered above the last term's, whatever the
    // replicas' clocks say.
    let prev_base = recorded.as_ref().map_or(0, |p| p.lease_id_base);
    let lease_id_base = alloc_server::unix_ns().max(prev_base.saturating_add(TERM_LEASE_IDS));
    let run_id = quotalease_proto::random_instance().max(1);
    let next = term::next_record(
        recorded,
        first,
        term::Starting {
            new_ledger_id: quotalease_proto::random_instance(),
            run: run_id,
            last_seq,
            unix_ms: alloc_server::unix_ms(),
            ttl_max_ms: r.args.ttl_max.as_millis() as u64,
            cluster: r.args.cluster.as_deref(),
            lease_id_base: Some(lease_id_base),
        },
    )
    .map_err(|theirs| {
        anyhow!(
            "--cluster: the ledger under {} belongs to cluster {theirs}",
            r.keys.ledger()
        )
    })?;
    let version = next.rules_version;
    let rules = rules_for_term(r, version)?;
    let record = next.record;
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
        // A lost ledger's: the compiled cap.
        predecessor_ttl_max_ns: if lost {
            TTL_MAX_CAP_NS
        } else {
            next.predecessor_ttl_max_ms
                .saturating_mul(1_000_000)
                .saturating_add(r.key_window_ns())
        },
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
            tracing::info!(epoch, %ledger, keys, predecessor_ttl_max_ms = next.predecessor_ttl_max_ms, "leading: keys resume from their reservations in etcd (each at its floor, the rest of its burst leased out until the predecessor's longest lease has expired); keys without one are full")
        }
    }
    let mut serving = Serving {
        written: record,
        lost_marker: lost,
        deposed,
    };
    let ended = serve(r, &guard, &mut serving, done).await;
    r.leadership.step_down();
    r.term.store(0, Ordering::Release);
    confirmer.abort();
    writer.abort();
    tracing::warn!(epoch, why = ended, "no longer leading");
    if ended == STOPPING {
        hand_over(r, leader, guard(), serving.written.id).await;
    }
    Ok(())
}

/// What a term keeps while it serves.
struct Serving {
    /// The ledger record as last written.
    written: LedgerRecord,
    /// The lost marker is still in etcd.
    lost_marker: bool,
    /// Set when a guarded write found the leader key gone.
    deposed: Arc<AtomicBool>,
}

/// Why a term ended on a stop (a clean handover follows).
const STOPPING: &str = "stopping";

/// Serve until the term ends, every 100 ms (or at once when the lease is
/// lost): end on a stop, a lost lease, a lapsed validity or deposition;
/// delete the lost marker once a lost ledger's wait is over; keep the
/// ledger record's rule version up with the core's. Returns why it ended.
async fn serve(
    r: &Replica,
    guard: &(dyn Fn() -> Compare + Sync),
    t: &mut Serving,
    done: &mut tokio::sync::watch::Receiver<bool>,
) -> &'static str {
    let shared = &r.shared;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(100)) => {}
            _ = done.wait_for(|d| *d) => {}
        }
        if r.stopping.load(Ordering::Acquire) {
            return STOPPING;
        }
        if *done.borrow() {
            return "the etcd lease was lost";
        }
        if !r.leadership.leading(boot_now()) {
            return "leadership validity ran out (etcd unreachable, or the lease or the key not confirmed in time)";
        }
        if t.deposed.load(Ordering::Acquire) {
            return "deposed: the leader key is gone";
        }
        // The wait for a lost ledger's leases is over: the reservations
        // describe the ledger again.
        if t.lost_marker && shared.now() >= shared.with_core(|core| core.ready_at_ns()) {
            let del = Txn::new()
                .when([guard()])
                .and_then([TxnOp::delete(r.keys.reservations_lost(), None)]);
            if let Ok(resp) = txn(&r.client, del).await {
                t.lost_marker = !resp.succeeded();
            }
        }
        // Versions never go backwards for the next leader.
        let v = shared.with_core(|core| core.rules().version);
        if v > t.written.rules_version {
            let next = LedgerRecord {
                rules_version: v,
                ..t.written.clone()
            };
            let put = Txn::new().when([guard()]).and_then([TxnOp::put(
                r.keys.ledger(),
                next.encode(),
                None,
            )]);
            match txn(&r.client, put).await {
                Ok(resp) if resp.succeeded() => t.written = next,
                Ok(_) => return "deposed: the leader key is gone",
                Err(e) => tracing::warn!(error = %e, "cannot update the ledger record"),
            }
        }
    }
}

/// A clean handover: the exact state after the last grant, for the
/// successor, written while the leader key is still ours; then resign.
async fn hand_over(r: &Replica, leader: &LeaderKey, guard: Compare, ledger: u64) {
    let keys = r.shared.checkpoint_and_close();
    match write_checkpoint(&r.client, &r.keys, guard, ledger, &keys).await {
        Ok(()) => tracing::info!(
            keys = keys.len(),
            "checkpoint written to etcd for the next leader"
        ),
        Err(e) => {
            tracing::warn!(error = %format!("{e:#}"), "no checkpoint for the next leader: it resumes from the reservations")
        }
    }
    let mut c = r.client.clone();
    let _ = tokio::time::timeout(
        Duration::from_secs(1),
        c.resign(Some(ResignOptions::new().with_leader(leader.clone()))),
    )
    .await;
}

/// The whole checkpoint of ledger `ledger` in etcd, if there is one.
pub(super) async fn read_checkpoint(
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
pub(super) async fn write_checkpoint(
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

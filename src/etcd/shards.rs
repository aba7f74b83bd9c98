//! A replica's checks against what etcd records before it campaigns (its
//! cluster, the shard map) and the lists it keeps for replies (the shards'
//! leaders, the replicas).

use super::*;

/// The shard map's version in replies (the map is only a shard count,
/// written once).
pub(super) const SHARD_MAP_VERSION: u64 = 1;

/// The cluster recorded with the ledger in etcd (by the first leader
/// started with `--cluster`) must be `--cluster`'s: a replica of another
/// cluster exits before it campaigns.
pub(super) async fn check_cluster(
    client: &Client,
    keys: &Keys,
    arg: Option<&str>,
) -> anyhow::Result<()> {
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
pub(super) async fn check_shard_map(
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
pub(super) async fn check_shard_key(
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
pub(super) async fn shard_routes(r: Arc<Replica>, count: u32) {
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
pub(super) async fn list_replicas(r: Arc<Replica>) {
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

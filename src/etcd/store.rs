//! Where the ledger lives in etcd: the key layout under a prefix
//! ([`Keys`]), the reservation and run-seq encodings, and [`EtcdStore`], the
//! write-ahead reservation store a term writes through (every write guarded
//! by the leader key).

use super::*;

/// etcd key names under `--etcd-prefix`.
#[derive(Clone, Debug)]
pub(super) struct Keys {
    /// `--etcd-prefix`: the cluster's rules and shard map.
    pub(super) root: String,
    /// This replica's ledger, election and registrations: the root, or
    /// `ROOT/shard/K` for shard K.
    pub(super) prefix: String,
}

impl Keys {
    /// A stopping leader's exact key states, in chunks `ckpt/NNNNNN`.
    pub(super) fn checkpoints(&self) -> String {
        format!("{}/ckpt/", self.prefix)
    }
    pub(super) fn checkpoint(&self, i: usize) -> String {
        format!("{}{i:06}", self.checkpoints())
    }
    /// Written last: the checkpoint is whole (its value: the chunk count).
    pub(super) fn checkpoint_done(&self) -> String {
        format!("{}/ckpt-done", self.prefix)
    }
    pub(super) fn rules(&self) -> String {
        format!("{}/rules", self.root)
    }
    /// The shard map: the shard count, written once by the first replica.
    pub(super) fn shard_map(&self) -> String {
        format!("{}/shards", self.root)
    }
    /// The shard count again, under this replica's own prefix: a replica
    /// started without `--shard` on a shard's prefix finds it there.
    pub(super) fn shard_marker(&self) -> String {
        format!("{}/shards", self.prefix)
    }
    /// Where each shard's leader writes its URL under its session lease
    /// (`ROOT/leaders/K`): every shard's leader in one range read.
    pub(super) fn leader_hints(&self) -> String {
        format!("{}/leaders/", self.root)
    }
    pub(super) fn leader_hint(&self, shard: u32) -> String {
        format!("{}{shard}", self.leader_hints())
    }
    /// Keys of a sharded cluster's shard `shard`.
    pub(super) fn of_shard(root: &str, shard: u32) -> Self {
        Self {
            root: root.to_string(),
            prefix: format!("{root}/shard/{shard}"),
        }
    }
    /// Keys of a cluster that is not sharded.
    pub(super) fn unsharded(root: &str) -> Self {
        Self {
            root: root.to_string(),
            prefix: root.to_string(),
        }
    }
    pub(super) fn election(&self) -> String {
        format!("{}/election", self.prefix)
    }
    pub(super) fn ledger(&self) -> String {
        format!("{}/ledger", self.prefix)
    }
    pub(super) fn replicas(&self) -> String {
        format!("{}/replicas/", self.prefix)
    }
    pub(super) fn replica(&self, url: &str) -> String {
        format!("{}{}", self.replicas(), hex(url))
    }
    /// Present while the reservations do not describe the ledger (its
    /// state was lost): a new leader then waits the compiled TTL_max cap.
    pub(super) fn reservations_lost(&self) -> String {
        format!("{}/reservations-lost", self.prefix)
    }
    pub(super) fn reservations(&self) -> String {
        format!("{}/res/", self.prefix)
    }
    /// The run in progress and how many of its reservation records are
    /// durable (`RUN SEQ`, the run in hex): written with the last chunk of
    /// each group of records, so a restored older copy of etcd holds fewer
    /// of a run's records than a requester that was served after it saw
    /// (SPEC §2 "First start").
    pub(super) fn run_seq(&self) -> String {
        format!("{}/run-seq", self.prefix)
    }
    pub(super) fn reservation(&self, k: &KeyId) -> String {
        format!(
            "{}{}/{}/{}",
            self.reservations(),
            hex(k.rule()),
            hex(k.tenant()),
            hex(k.route())
        )
    }
    /// The key of a reservation's etcd key name.
    pub(super) fn key_of(&self, name: &str) -> Option<KeyId> {
        let rest = name.strip_prefix(&self.reservations())?;
        let mut parts = rest.split('/');
        let k = KeyId::new(
            unhex(parts.next()?)?,
            unhex(parts.next()?)?,
            unhex(parts.next()?)?,
        );
        parts.next().is_none().then_some(k)
    }
}

pub(super) fn reservation_value(r: &Reservation) -> String {
    format!("{} {}", r.floor, r.rate_cap_utps)
}

/// A `run-seq` value: (run, durable records).
pub(super) fn parse_run_seq(v: &str) -> Option<(u64, u64)> {
    let (r, n) = v.split_once(' ')?;
    Some((u64::from_str_radix(r, 16).ok()?, n.parse().ok()?))
}

pub(super) fn parse_reservation(v: &str) -> Option<Reservation> {
    let (f, c) = v.split_once(' ')?;
    Some(Reservation {
        floor: f.parse().ok()?,
        rate_cap_utps: c.parse().ok()?,
    })
}

/// The write-ahead reservations in etcd, written by one term: every
/// transaction is guarded by the term's leader key.
pub(super) struct EtcdStore {
    pub(super) client: Client,
    pub(super) keys: Keys,
    pub(super) guard: (Vec<u8>, i64),
    pub(super) deposed: Arc<AtomicBool>,
    /// This term's run: its record count goes to `run-seq`.
    pub(super) run: u64,
    /// The mod revision of every reservation key as this term last wrote
    /// or read it (absent: not in etcd). Each write compares it, so that a
    /// write whose answer was lost and that commits late (after a newer one
    /// of the same key) fails instead of putting an older floor back.
    pub(super) revs: HashMap<String, i64>,
}

/// Attempts of one chunk against keys that changed under it (a late
/// commit of an earlier attempt) before the write counts as failed.
pub(super) const CHUNK_ATTEMPTS: usize = 4;

impl EtcdStore {
    pub(super) fn guard(&self) -> Compare {
        Compare::create_revision(self.guard.0.clone(), CompareOp::Equal, self.guard.1)
    }

    /// Write `chunk` (at most [`TXN_OPS`] keys: a put of the value, or a
    /// delete) in one transaction guarded by the leader key and by each
    /// key's revision as this term knows it.
    pub(super) async fn write_chunk(
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
    pub(super) fn chunk_txn(
        &self,
        chunk: &[(String, Option<Reservation>)],
        seq: Option<u64>,
    ) -> Txn {
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
    pub(super) async fn refresh(
        &mut self,
        chunk: &[(String, Option<Reservation>)],
    ) -> Result<(), String> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservation_keys_round_trip_any_key_and_refuse_others() {
        let keys = Keys::unsharded("/ql");
        let k = KeyId::new("r/1", "t é", String::new());
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
        let k = KeyId::new("r", "t", String::new());
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
}

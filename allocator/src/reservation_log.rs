//! The reservation log's file and its writer (the driver of
//! [`crate::reservations`]): `reservations` in the global allocator's state
//! directory, one text line per record, appended and made durable
//! (`fdatasync`) in groups — every record taken from the core since the
//! last write goes into the next one, so a busy allocator makes many keys
//! durable per write. Replies wait until the records they depend on are
//! durable ([`Durability::wait`]). The log is compacted into a fresh file
//! (written aside, synced, renamed over) when it grows past
//! [`COMPACT_BYTES`].
//!
//! Format (version 2; version 1 had no `s` lines):
//!
//! ```text
//! quotalease-reservations 2
//! ledger <16 hex digits>
//! r <floor> <rate cap, micro-tokens/s> <rule> <tenant> <route>    (ids in hex)
//! d <rule> <tenant> <route>                                      (at rest)
//! s <records of this run durable with this line>
//! ```
//!
//! Every group (and a compacted log's snapshot) ends with its `s` line:
//! the run's record sequence, which replies carry (SPEC §2 "First start").
//! The last complete one says how far the run got when it ended, so a
//! requester that saw more of it exposes a log that lost its tail.
//!
//! A last line without its newline was being written when the process
//! died: no reply waited on it, so it is ignored. Any other bad line is an
//! error naming the file and the line.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use quotalease_model::key::KeyId;

use crate::reservations::{Record, Reservation};
use crate::server::Shared;

/// The log's file name in the state directory.
pub const FILE: &str = "reservations";
const FORMAT: u64 = 2;
/// Compact the log when it grows past this.
pub const COMPACT_BYTES: u64 = 8 << 20;

pub use quotalease_allocator_core::durable::{hex, unhex};

/// A key as three hex fields separated by spaces.
pub fn key_fields(k: &KeyId) -> String {
    format!("{} {} {}", hex(k.rule()), hex(k.tenant()), hex(k.route()))
}

/// A record as a line of the log.
pub fn line(r: &Record) -> String {
    match r {
        Record::Set(k, v) => format!("r {} {} {}\n", v.floor, v.rate_cap_utps, key_fields(k)),
        Record::AtRest(k) => format!("d {}\n", key_fields(k)),
    }
}

fn header(ledger: u64) -> String {
    format!("quotalease-reservations {FORMAT}\nledger {ledger:016x}\n")
}

/// Parse a log's text for `ledger`: the promises it leaves, by key.
pub fn decode(text: &str, ledger: u64) -> Result<Vec<(KeyId, Reservation)>, String> {
    let mut lines = text.split_inclusive('\n');
    let head = lines.next().unwrap_or("").trim_end();
    let format = head
        .strip_prefix("quotalease-reservations ")
        .and_then(|v| v.trim().parse::<u64>().ok())
        .ok_or_else(|| format!("first line {head:?}: not a quotalease reservation log"))?;
    if format > FORMAT {
        return Err(format!(
            "format {format} is newer than this binary's ({FORMAT}): run a newer quotalease"
        ));
    }
    let second = lines.next().unwrap_or("").trim_end();
    let theirs = second
        .strip_prefix("ledger ")
        .and_then(|v| u64::from_str_radix(v, 16).ok())
        .ok_or_else(|| format!("second line {second:?}: want `ledger ID`"))?;
    if theirs != ledger {
        return Err(format!(
            "it belongs to ledger {theirs:016x}, the state directory's ledger is {ledger:016x}"
        ));
    }
    let mut by_key = std::collections::BTreeMap::new();
    for (n, raw) in lines.enumerate() {
        let Some(l) = raw.strip_suffix('\n') else {
            break; // torn: being written when the process died
        };
        let w: Vec<&str> = l.split(' ').collect();
        let bad = || format!("line {}: {l:?}", n + 3);
        let key = |i: usize| -> Result<KeyId, String> {
            Ok(KeyId::new(
                unhex(w.get(i).ok_or_else(bad)?).ok_or_else(bad)?,
                unhex(w.get(i + 1).ok_or_else(bad)?).ok_or_else(bad)?,
                unhex(w.get(i + 2).ok_or_else(bad)?).ok_or_else(bad)?,
            ))
        };
        match (w.first().copied(), w.len()) {
            (Some("r"), 6) => {
                let num = |i: usize| w[i].parse::<u64>().map_err(|_| bad());
                by_key.insert(
                    key(3)?,
                    Reservation {
                        floor: num(1)?,
                        rate_cap_utps: num(2)?,
                    },
                );
            }
            (Some("d"), 4) => {
                by_key.remove(&key(1)?);
            }
            (Some("s"), 2) => {
                w[1].parse::<u64>().map_err(|_| bad())?;
            }
            _ => return Err(bad()),
        }
    }
    Ok(by_key.into_iter().collect())
}

/// The record sequence of a log's last complete `s` line (0 for none: a
/// version-1 log, or nothing made durable).
pub fn last_seq(text: &str) -> u64 {
    text.split_inclusive('\n')
        .rev()
        .find_map(|l| l.strip_suffix('\n')?.strip_prefix("s ")?.parse().ok())
        .unwrap_or(0)
}

/// A log as [`read`] finds it: the promises it leaves, and the record
/// sequence of its last complete `s` line.
pub type Read = (Vec<(KeyId, Reservation)>, u64);

/// Read the log in `dir` for `ledger`: its promises and its last durable
/// record sequence ([`last_seq`]); `Ok(None)` when there is none (a ledger
/// from before reservations, or one whose log was invalidated).
pub fn read(dir: &Path, ledger: u64) -> Result<Option<Read>, String> {
    let path = dir.join(FILE);
    match std::fs::read_to_string(&path) {
        Ok(text) => decode(&text, ledger)
            .map(|r| Some((r, last_seq(&text))))
            .map_err(|e| {
                format!(
                    "{}: {e}; nothing is granted from it (fix or move it away)",
                    path.display()
                )
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

/// Remove the log (and make the removal durable): after a clean
/// shutdown's checkpoint, or when it was invalidated.
pub fn remove(dir: &Path) -> std::io::Result<()> {
    match std::fs::remove_file(dir.join(FILE)) {
        Ok(()) => sync_dir(dir),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

/// An open log, appended to by the writer.
#[derive(Debug)]
pub struct Log {
    dir: PathBuf,
    ledger: u64,
    file: std::fs::File,
    bytes: u64,
}

impl Log {
    /// Start a fresh log in `dir` holding `records`, the state at record
    /// sequence `seq` (written aside, synced and renamed over any old one,
    /// so a crash leaves one or the other).
    pub fn create(
        dir: &Path,
        ledger: u64,
        seq: u64,
        records: &[(KeyId, Reservation)],
    ) -> std::io::Result<Self> {
        let mut text = header(ledger);
        for (k, r) in records {
            text.push_str(&line(&Record::Set(k.clone(), *r)));
        }
        text.push_str(&format!("s {seq}\n"));
        let tmp = dir.join(format!("{FILE}.tmp"));
        {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(text.as_bytes())?;
            f.sync_all()?;
        }
        std::fs::rename(&tmp, dir.join(FILE))?;
        sync_dir(dir)?;
        let file = std::fs::OpenOptions::new()
            .append(true)
            .open(dir.join(FILE))?;
        Ok(Self {
            dir: dir.to_path_buf(),
            ledger,
            file,
            bytes: text.len() as u64,
        })
    }

    /// Append `records`, which bring the run to record sequence `seq`,
    /// and make them durable.
    pub fn append(&mut self, seq: u64, records: &[Record]) -> std::io::Result<()> {
        if records.is_empty() {
            return Ok(());
        }
        let mut text = String::new();
        for r in records {
            text.push_str(&line(r));
        }
        text.push_str(&format!("s {seq}\n"));
        self.file.write_all(text.as_bytes())?;
        self.file.sync_data()?;
        self.bytes += text.len() as u64;
        Ok(())
    }

    /// Whether the log should be compacted.
    pub fn wants_compaction(&self) -> bool {
        self.bytes > COMPACT_BYTES
    }

    /// Replace the log by one holding exactly `records` (at `seq`).
    pub fn compact(&mut self, seq: u64, records: &[(KeyId, Reservation)]) -> std::io::Result<()> {
        *self = Self::create(&self.dir, self.ledger, seq, records)?;
        Ok(())
    }
}

/// Where reservation records are made durable: the state directory's
/// [`Log`] ([`FileStore`]), or etcd with `--etcd` (the binary's driver).
pub trait Store: Send + 'static {
    /// Make `records` durable, in order, with the record sequence `seq`
    /// they bring the run to; on an error none of them may be taken for
    /// durable (the writer retries them).
    fn append(
        &mut self,
        seq: u64,
        records: Vec<Record>,
    ) -> impl std::future::Future<Output = Result<(), String>> + Send;
    /// Whether [`Store::compact`] should run now: never for a store that
    /// keeps one value per key (etcd), only for an appended log.
    fn wants_compaction(&self) -> bool {
        false
    }
    /// Replace everything stored by exactly `records`, the state at
    /// record sequence `seq` (only called when [`Store::wants_compaction`]
    /// says so).
    fn compact(
        &mut self,
        seq: u64,
        records: Vec<(KeyId, Reservation)>,
    ) -> impl std::future::Future<Output = Result<(), String>> + Send {
        let _ = (seq, records);
        async { Err("this store is never compacted".to_string()) }
    }
    /// The records no longer describe the ledger (its state was lost):
    /// remove them, so that a restart waits the whole recorded `TTL_max`.
    fn invalidate(&mut self) -> impl std::future::Future<Output = Result<(), String>> + Send;
}

/// The state directory's [`Log`] as a [`Store`]: file I/O off the runtime.
#[derive(Debug)]
pub struct FileStore {
    log: Option<Log>,
    dir: PathBuf,
}

impl FileStore {
    /// Write through `log`.
    pub fn new(log: Log) -> Self {
        Self {
            dir: log.dir.clone(),
            log: Some(log),
        }
    }

    async fn with_log(
        &mut self,
        f: impl FnOnce(&mut Log) -> std::io::Result<()> + Send + 'static,
    ) -> Result<(), String> {
        let Some(mut log) = self.log.take() else {
            return Err("the reservation log writer failed before".into());
        };
        let (log, res) = tokio::task::spawn_blocking(move || {
            let r = f(&mut log);
            (log, r)
        })
        .await
        .map_err(|e| format!("reservation log writer failed: {e}"))?;
        self.log = Some(log);
        res.map_err(|e| e.to_string())
    }
}

impl Store for FileStore {
    async fn append(&mut self, seq: u64, records: Vec<Record>) -> Result<(), String> {
        self.with_log(move |l| l.append(seq, &records)).await
    }

    fn wants_compaction(&self) -> bool {
        self.log.as_ref().is_some_and(Log::wants_compaction)
    }

    async fn compact(
        &mut self,
        seq: u64,
        records: Vec<(KeyId, Reservation)>,
    ) -> Result<(), String> {
        self.with_log(move |l| l.compact(seq, &records)).await
    }

    async fn invalidate(&mut self) -> Result<(), String> {
        let dir = self.dir.clone();
        tokio::task::spawn_blocking(move || remove(&dir))
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())
    }
}

/// Where replies learn that the records they depend on are durable.
///
/// Clones share one slot: [`Durability::replace_with`] points them all at
/// another writer (with `--etcd`, each term has its own core and writer).
#[derive(Clone, Debug)]
pub struct Durability {
    durable: Arc<parking_lot::Mutex<tokio::sync::watch::Receiver<u64>>>,
}

/// How long a reply waits for its records before the call fails
/// (`UNAVAILABLE`): a grant is never sent before its record is durable.
pub const DURABLE_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

impl Durability {
    /// One that no writer confirms: every wait for a record fails (a
    /// replica that does not lead grants nothing that needs one).
    pub fn none() -> Self {
        let (_, rx) = tokio::sync::watch::channel(0);
        Self {
            durable: Arc::new(parking_lot::Mutex::new(rx)),
        }
    }

    /// From now on, wait on `other`'s writer (a new term's).
    pub fn replace_with(&self, other: &Durability) {
        let rx = other.durable.lock().clone();
        *self.durable.lock() = rx;
    }

    /// Wait until at least `seq` records are durable; `false` if that took
    /// longer than [`DURABLE_WAIT`] (or the writer stopped).
    pub async fn wait(&self, seq: u64) -> bool {
        let mut rx = self.durable.lock().clone();
        if *rx.borrow() >= seq {
            return true;
        }
        let reached = tokio::time::timeout(DURABLE_WAIT, async {
            rx.wait_for(|d| *d >= seq).await.is_ok()
        })
        .await;
        reached == Ok(true)
    }
}

/// Start the writer of `store` for `shared`'s core: it takes the records
/// the core appended, writes them in one group, makes them durable, and
/// tells waiting replies. Returns the [`Durability`] replies wait on, and
/// the writer's task (abort it before removing what it wrote).
pub fn start<S: Store>(
    shared: Arc<Shared>,
    mut store: S,
) -> (Durability, tokio::task::JoinHandle<()>) {
    let initial = shared.with_core(|c| c.reservation_seq());
    let (tx, rx) = tokio::sync::watch::channel(initial);
    let task = tokio::spawn(async move {
        // Taken from the core but not yet durable (kept across a failed write).
        let mut unwritten: Vec<Record> = Vec::new();
        loop {
            let (seq, invalid, snapshot) = shared.with_core(|c| {
                let Some(r) = c.reservations_mut() else {
                    return (0, true, None);
                };
                if r.is_invalid() {
                    return (r.seq(), true, None);
                }
                let (seq, records) = r.take();
                unwritten.extend(records);
                let snapshot = store.wants_compaction().then(|| r.snapshot().1);
                (seq, false, snapshot)
            });
            if invalid {
                match store.invalidate().await {
                    Ok(()) => tracing::warn!(
                        "reservations removed: a restart waits the whole recorded TTL_max"
                    ),
                    Err(e) => tracing::error!(error = %e, "cannot remove the reservations"),
                }
                return;
            }
            if unwritten.is_empty() && snapshot.is_none() {
                // Replies that add records wake the writer; the sweep's
                // (which nothing waits for) go out within 100 ms.
                tokio::select! {
                    _ = shared.reservations_wanted() => {}
                    _ = tokio::time::sleep(std::time::Duration::from_millis(100)) => {}
                }
                continue;
            }
            let res = match snapshot {
                Some(all) => store.compact(seq, all).await,
                None => store.append(seq, unwritten.clone()).await,
            };
            match res {
                Ok(()) => {
                    unwritten.clear();
                    let _ = tx.send(seq);
                }
                Err(e) => {
                    // Nothing that depends on these records is sent (those
                    // replies time out); write them again shortly.
                    tracing::error!(error = %e, "cannot make the reservations durable; grants that need them wait");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
            }
        }
    });
    (
        Durability {
            durable: Arc::new(parking_lot::Mutex::new(rx)),
        },
        task,
    )
}

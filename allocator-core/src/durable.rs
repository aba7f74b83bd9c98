//! What a global allocator keeps durably, in its state directory or in
//! etcd (SPEC §2 "Restarts", "First start"): the ledger record (ledger id,
//! the largest `TTL_max`, the last rule version, runs, cluster) and a clean
//! stop's checkpoint of every key, as text. Formats only: where they are
//! kept is the drivers' business (`src/run.rs`, `src/etcd.rs`).

use quotalease_model::key::KeyId;

use crate::ledger::KeyCheckpoint;

/// Bytes as lowercase hex (ids in state files: any UTF-8, no escaping).
pub fn hex(s: &str) -> String {
    s.bytes().map(|b| format!("{b:02x}")).collect()
}

/// The inverse of [`hex`]; `None` if `h` is not hex of UTF-8.
pub fn unhex(h: &str) -> Option<String> {
    if !h.len().is_multiple_of(2) {
        return None;
    }
    let bytes: Option<Vec<u8>> = (0..h.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(h.get(i..i + 2)?, 16).ok())
        .collect();
    String::from_utf8(bytes?).ok()
}

/// A cluster name: 1..=128 of letters, digits, `.`, `_` and `-` (it is
/// written as one word in the ledger record).
pub fn parse_cluster(s: &str) -> Result<String, String> {
    let ok = (1..=128).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(s.to_string())
    } else {
        Err(format!(
            "{s:?}: a cluster name is 1 to 128 letters, digits, '.', '_' or '-'"
        ))
    }
}

/// What a global allocator keeps in its state directory (`ledger`): its
/// ledger id, the largest `TTL_max` it may have granted leases under, the
/// largest rule version it served, and its runs. Durations and counters
/// only.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LedgerRecord {
    /// The ledger's id (never 0): agents present it.
    pub id: u64,
    /// The largest `TTL_max` leases may have been granted under (ms).
    pub ttl_max_ms: u64,
    /// The largest rule version served: versions never go backwards.
    pub rules_version: u64,
    /// With `--etcd`: the lease id base of the latest term (each term
    /// starts above it, whatever the replicas' clocks say). 0 otherwise.
    pub lease_id_base: u64,
    /// The run in progress (0: none; a clean stop moves it to `runs`).
    pub run: u64,
    /// Earlier runs, oldest first: (run id, its durable records; `u64::MAX`
    /// when that is unknown), at most [`RUNS_KEPT`].
    pub runs: Vec<(u64, u64)>,
    /// The cluster this ledger belongs to ("": none set).
    pub cluster: String,
}

/// Runs a ledger record keeps: a requester that last talked to this ledger
/// this many starts ago is taken for one that saw a lost state.
pub const RUNS_KEPT: usize = 4096;

const LEDGER_FORMAT: u64 = 1;

impl LedgerRecord {
    /// The record as text (`decode` reads it back).
    pub fn encode(&self) -> String {
        let mut s = format!(
            "quotalease-ledger {LEDGER_FORMAT}\nid {:016x}\nttl_max_ms {}\nrules_version {}\n",
            self.id, self.ttl_max_ms, self.rules_version
        );
        if self.lease_id_base != 0 {
            s.push_str(&format!("lease_id_base {}\n", self.lease_id_base));
        }
        if self.run != 0 {
            s.push_str(&format!("run {:016x}\n", self.run));
        }
        if !self.cluster.is_empty() {
            s.push_str(&format!("cluster {}\n", self.cluster));
        }
        if !self.runs.is_empty() {
            s.push_str("runs");
            for (run, seq) in &self.runs {
                s.push_str(&format!(" {run:016x}:{seq}"));
            }
            s.push('\n');
        }
        s
    }

    /// The record of a new start: the run in progress, if any, becomes
    /// an earlier one that got to record `last_seq`, and `run` starts.
    pub fn start_run(&mut self, run: u64, last_seq: u64) {
        if self.run != 0 {
            self.runs.push((self.run, last_seq));
        }
        self.run = run;
        let over = self.runs.len().saturating_sub(RUNS_KEPT);
        self.runs.drain(..over);
    }

    /// The cluster this ledger belongs to when started with `--cluster`
    /// `arg`: the recorded one, or `arg` when none is recorded yet (the
    /// first start that names one records it). `Err`: the recorded
    /// cluster, which `arg` is not.
    pub fn cluster_with(&self, arg: Option<&str>) -> Result<String, String> {
        match (arg, self.cluster.as_str()) {
            (Some(c), "") => Ok(c.to_string()),
            (Some(c), theirs) if c != theirs => Err(theirs.to_string()),
            (_, theirs) => Ok(theirs.to_string()),
        }
    }

    /// A clean stop: the run in progress ended at record `last_seq`.
    pub fn end_run(&mut self, last_seq: u64) {
        self.start_run(0, last_seq);
    }

    /// The runs as the core checks them (`None` without a run).
    pub fn runs(&self) -> Option<crate::core::Runs> {
        (self.run != 0).then(|| crate::core::Runs {
            current: self.run,
            past: self.runs.clone(),
        })
    }

    /// Parse a ledger file; an error names what is wrong.
    pub fn decode(text: &str) -> Result<Self, String> {
        let mut lines = text.lines();
        let head = lines.next().unwrap_or("");
        let format = head
            .strip_prefix("quotalease-ledger ")
            .and_then(|v| v.trim().parse::<u64>().ok())
            .ok_or_else(|| format!("first line {head:?}: not a quotalease ledger"))?;
        if format > LEDGER_FORMAT {
            return Err(format!(
                "format {format} is newer than this binary's ({LEDGER_FORMAT}): run a newer quotalease"
            ));
        }
        let (mut id, mut ttl, mut version, mut base) = (None, None, None, 0);
        let (mut run, mut runs, mut cluster) = (0, Vec::new(), String::new());
        for line in lines {
            let (k, v) = line
                .split_once(' ')
                .ok_or_else(|| format!("line {line:?}: want `name value`"))?;
            let bad = |what: &str| format!("{k}: {v:?} is not {what}");
            match k {
                "id" => id = Some(u64::from_str_radix(v, 16).map_err(|_| bad("hex"))?),
                "ttl_max_ms" => ttl = Some(v.parse().map_err(|_| bad("a number"))?),
                "rules_version" => version = Some(v.parse().map_err(|_| bad("a number"))?),
                "lease_id_base" => base = v.parse().map_err(|_| bad("a number"))?,
                "run" => run = u64::from_str_radix(v, 16).map_err(|_| bad("hex"))?,
                "cluster" => cluster = parse_cluster(v).map_err(|e| format!("cluster: {e}"))?,
                "runs" => {
                    for r in v.split(' ') {
                        let (id, seq) = r
                            .split_once(':')
                            .and_then(|(i, s)| {
                                Some((u64::from_str_radix(i, 16).ok()?, s.parse().ok()?))
                            })
                            .ok_or_else(|| bad("`RUN:SEQ` pairs (hex run ids)"))?;
                        runs.push((id, seq));
                    }
                }
                _ => {} // a later format's field
            }
        }
        let missing = |f: &str| format!("{f}: missing");
        let id: u64 = id.ok_or_else(|| missing("id"))?;
        if id == 0 {
            return Err("id: must not be 0".into());
        }
        Ok(Self {
            id,
            ttl_max_ms: ttl.ok_or_else(|| missing("ttl_max_ms"))?,
            rules_version: version.ok_or_else(|| missing("rules_version"))?,
            lease_id_base: base,
            run,
            runs,
            cluster,
        })
    }
}

const CHECKPOINT_FORMAT: u64 = 1;

/// A clean shutdown's key states, for the ledger `ledger`.
pub fn encode_checkpoint(ledger: u64, keys: &[(KeyId, KeyCheckpoint)]) -> String {
    let mut out = format!("quotalease-checkpoint {CHECKPOINT_FORMAT}\nledger {ledger:016x}\n");
    for (k, c) in keys {
        out.push_str(&format!(
            "key {} {} {} {} {} {} {}\n",
            hex(k.rule()),
            hex(k.tenant()),
            hex(k.route()),
            c.available,
            c.outstanding,
            c.rates_out_utps,
            c.leases_end_in_ns
        ));
    }
    out.push_str("end\n");
    out
}

/// (ledger id, keys) of a checkpoint file; an error names what is wrong.
pub fn decode_checkpoint(text: &str) -> Result<(u64, Vec<(KeyId, KeyCheckpoint)>), String> {
    let mut lines = text.lines();
    let head = lines.next().unwrap_or("");
    let format = head
        .strip_prefix("quotalease-checkpoint ")
        .and_then(|v| v.trim().parse::<u64>().ok())
        .ok_or_else(|| format!("first line {head:?}: not a quotalease checkpoint"))?;
    if format > CHECKPOINT_FORMAT {
        return Err(format!("format {format} is newer than this binary's"));
    }
    let ledger = lines
        .next()
        .and_then(|l| l.strip_prefix("ledger "))
        .and_then(|v| u64::from_str_radix(v, 16).ok())
        .ok_or("second line: want `ledger ID`")?;
    let mut keys = Vec::new();
    for (n, line) in lines.by_ref().enumerate() {
        if line == "end" {
            return Ok((ledger, keys));
        }
        let w: Vec<&str> = line.split(' ').collect();
        let bad = || format!("key line {}: {line:?}", n + 1);
        if w.len() != 8 || w[0] != "key" {
            return Err(bad());
        }
        let num = |i: usize| w[i].parse::<u64>().map_err(|_| bad());
        keys.push((
            KeyId::new(
                unhex(w[1]).ok_or_else(bad)?,
                unhex(w[2]).ok_or_else(bad)?,
                unhex(w[3]).ok_or_else(bad)?,
            ),
            KeyCheckpoint {
                available: num(4)?,
                outstanding: num(5)?,
                rates_out_utps: num(6)?,
                leases_end_in_ns: num(7)?,
            },
        ));
    }
    Err("no `end` line: the checkpoint was cut short".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ledger_record_round_trips_and_bad_ones_name_the_field() {
        let r = LedgerRecord {
            id: 0xdead_beef,
            ttl_max_ms: 2_000,
            rules_version: 1_796_000_000_000,
            lease_id_base: 0,
            run: 0,
            runs: Vec::new(),
            cluster: String::new(),
        };
        assert_eq!(LedgerRecord::decode(&r.encode()), Ok(r.clone()));
        let named = LedgerRecord {
            cluster: "prod-eu.1".into(),
            ..r.clone()
        };
        assert_eq!(LedgerRecord::decode(&named.encode()), Ok(named.clone()));
        let bad = LedgerRecord::decode(&format!("{}cluster a b\n", r.encode())).unwrap_err();
        assert!(bad.starts_with("cluster:"), "{bad}");
        let r = LedgerRecord {
            lease_id_base: 1 << 61,
            ..r
        };
        assert_eq!(LedgerRecord::decode(&r.encode()), Ok(r.clone()));
        // Runs: a start moves the run in progress to the history with its
        // last record; a clean stop does the same and leaves none running.
        let mut r = r;
        r.start_run(0xa1, 0);
        assert_eq!((r.run, r.runs.clone()), (0xa1, vec![]));
        r.start_run(0xb2, 17);
        r.end_run(5);
        assert_eq!((r.run, r.runs.clone()), (0, vec![(0xa1, 17), (0xb2, 5)]));
        r.start_run(0xc3, 0);
        r.start_run(0xd4, u64::MAX);
        assert_eq!(LedgerRecord::decode(&r.encode()), Ok(r.clone()));
        let runs = r.runs().expect("a run in progress");
        assert_eq!(runs.current, 0xd4);
        assert!(runs.knows(0xa1, 17, 0) && !runs.knows(0xa1, 18, 0));
        assert!(
            runs.knows(0xc3, 1 << 40, 0),
            "an unknown end accepts any record"
        );
        assert!(!runs.knows(0xe5, 0, 0), "a run it never had");
        assert!(runs.knows(0xd4, 3, 3) && !runs.knows(0xd4, 4, 3));
        for i in 0..RUNS_KEPT as u64 + 10 {
            r.start_run(i + 1, i);
        }
        assert_eq!(r.runs.len(), RUNS_KEPT, "the oldest runs are dropped");
        let bad = LedgerRecord::decode(&format!("{}runs 12:x\n", r.encode())).unwrap_err();
        assert!(bad.contains("runs"), "{bad}");
        let err = |t: &str| LedgerRecord::decode(t).unwrap_err();
        assert!(err("quotalease-ledger 1\nttl_max_ms 1\nrules_version 1\n").contains("id: missing"));
        assert!(
            err("quotalease-ledger 1\nid 0\nttl_max_ms 1\nrules_version 1\n")
                .contains("id: must not be 0")
        );
        assert!(
            err("quotalease-ledger 1\nid 1\nttl_max_ms x\nrules_version 1\n")
                .contains("ttl_max_ms")
        );
        assert!(err("quotalease-ledger 2\n").contains("newer"));
        assert!(err("").contains("not a quotalease ledger"));
        // A later format's extra field is ignored by a reader of the same format.
        let extra = format!("{}later_field 7\n", r.encode());
        assert_eq!(LedgerRecord::decode(&extra), Ok(r));
    }

    #[test]
    fn a_checkpoint_round_trips_any_key_and_a_cut_one_is_refused() {
        let keys = vec![(
            KeyId::new("orders", "a b\nc é", ""),
            KeyCheckpoint {
                available: 7,
                outstanding: 3,
                rates_out_utps: 1_000_000,
                leases_end_in_ns: 1_500_000_000,
            },
        )];
        let text = encode_checkpoint(0xabc, &keys);
        assert_eq!(decode_checkpoint(&text), Ok((0xabc, keys)));
        let cut = text.trim_end_matches("end\n");
        assert!(decode_checkpoint(cut).unwrap_err().contains("cut short"));
        assert!(decode_checkpoint("quotalease-checkpoint 1\nledger 1\nkey zz\nend\n").is_err());
    }
}

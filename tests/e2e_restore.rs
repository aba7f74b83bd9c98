//! A root allocator started from an older copy of its own state directory
//! (SPEC §2 "First start"), in the three ways an adversarial run found it
//! accepted silently, each past I1 by about a burst:
//!
//! * a backup taken with the allocator stopped, restored after more
//!   traffic (seen: a `5/m b5` key +4.58 over `B + R*T`, a hot key +780);
//! * a copy of the live directory, restored after a SIGKILL (+4.58);
//! * a reservation log cut at a line boundary after a SIGKILL (+2.66).
//!
//! Each time a brand-new agent (which presents nothing) asks first and an
//! agent that drained the burst from the newer state asks second; I1 is
//! checked exactly over both agents' admissions, windows spanning the
//! restore included. The older copy is caught by its run history: the old
//! agent presents a run (or more of a run's records) the copy does not
//! hold, and every start waits three agent heartbeats before granting.
//!
//! The same with `--etcd`: etcd's data directory copied with etcd stopped,
//! and put back after the drain (a rolled-back volume, an etcd restored
//! from an older backup). Each leader term is a run; its record count is
//! kept in etcd with the records.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::etcd::*;
use common::*;

const SLOW: &str = SLOW_1M_B20;

fn check(a: &Proc) -> u16 {
    check_acme(a, "/r")
}

fn hammer(a: &Proc, for_: Duration) -> u64 {
    hammer_acme(a, "/r", for_)
}

/// Copy the files of state directory `from` into a fresh `to`.
fn copy_state(from: &Path, to: &Path) {
    let _ = std::fs::remove_dir_all(to);
    std::fs::create_dir_all(to).expect("create copy");
    for e in std::fs::read_dir(from).expect("read state dir") {
        let e = e.expect("entry");
        if e.file_type().expect("type").is_file() {
            std::fs::copy(e.path(), to.join(e.file_name())).expect("copy");
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum Restore {
    /// Stopped cleanly, backed up, started; traffic; stopped; restored.
    StoppedBackup,
    /// Copied while running (idle); traffic; SIGKILL; restored.
    LiveCopy,
    /// Traffic; SIGKILL; the reservation log cut after its first group.
    CutLog,
}

fn restored_state_is_caught(how: Restore) {
    let dir = tempdir(&format!("restore-{how:?}"));
    let rules = write_rules(&dir, SLOW);
    let state = dir.join("state");
    let backup = dir.join("backup");
    let mut root = allocator(&rules, &state, None, "2s");
    wait_ok(root.http, "/readyz", Duration::from_secs(10));
    let listen = root.grpc;
    match how {
        Restore::StoppedBackup => {
            assert!(root.terminate().success());
            copy_state(&state, &backup);
            root = allocator(&rules, &state, Some(listen), "2s");
            wait_ok(root.http, "/readyz", Duration::from_secs(10));
        }
        Restore::LiveCopy => copy_state(&state, &backup),
        Restore::CutLog => {}
    }
    // The newer state: an agent drains the burst (after the start's grace).
    let (lx, ly) = (dir.join("old.tsv"), dir.join("new.tsv"));
    let x = agent("restore", &root.url(), Some(&lx), &[]);
    wait_ok(x.http, "/readyz", Duration::from_secs(10));
    let before = hammer(&x, Duration::from_secs(5));
    assert_eq!(before, 20, "the burst passes first");
    std::thread::sleep(Duration::from_millis(300));

    match how {
        Restore::StoppedBackup => {
            assert!(root.terminate().success());
            std::fs::remove_dir_all(&state).expect("remove state");
            copy_state(&backup, &state);
        }
        Restore::LiveCopy => {
            root.kill9();
            std::fs::remove_dir_all(&state).expect("remove state");
            copy_state(&backup, &state);
        }
        Restore::CutLog => {
            root.kill9();
            // Keep the header and the start's snapshot (up to its `s`
            // line): the drain's records are lost, at a line boundary.
            let path = state.join("reservations");
            let text = std::fs::read_to_string(&path).expect("a reservation log");
            let end = text.find("\ns ").expect("an s line") + 1;
            let end = end + text[end..].find('\n').expect("whole line") + 1;
            assert!(end < text.len(), "the drain wrote records: {text:?}");
            std::fs::write(&path, &text[..end]).expect("cut the log");
        }
    }
    let root = allocator(&rules, &state, Some(listen), "2s");
    after_the_restore(&format!("{how:?}"), &root, x, before, (lx, ly));
}

/// After a restore to `root`: a brand-new agent asks first, `x` (which
/// admitted `before` from the newer state, logging to `logs.0`) second,
/// then both keep asking past the start's wait; I1 over both agents'
/// admissions, and the older state caught once.
fn after_the_restore(what: &str, root: &Proc, x: Proc, before: u64, logs: (PathBuf, PathBuf)) {
    let (lx, ly) = logs;
    let y = agent(&format!("{}-new", x.name), &root.url(), Some(&ly), &[]);
    let mut after = hammer(&y, Duration::from_millis(300));
    after += u64::from(check(&x) == 200);
    after += hammer(&y, Duration::from_secs(5));
    after += u64::from(check(&x) == 200);
    assert!(x.terminate().success());
    assert!(y.terminate().success());
    let (_, metrics) = http_get(root.http, "/metrics");
    let lost = metric(&metrics, "quotalease_allocator_ledgers_lost_total");
    eprintln!(
        "{what}: {before} admitted before, {after} after the restore; ledgers_lost_total {lost:?}"
    );
    let rate = quotalease_model::rules::Rate {
        tokens: 1,
        period_s: 60,
    };
    check_key_i1_at(&[lx, ly], ("slow", "acme", "/r"), rate, 20, before + after);
    assert_eq!(lost, Some(1.0), "{what}: the older state was caught");
}

#[test]
fn a_backup_restored_after_more_traffic_is_caught() {
    restored_state_is_caught(Restore::StoppedBackup);
}

#[test]
fn a_copy_of_the_live_directory_restored_after_a_kill_is_caught() {
    restored_state_is_caught(Restore::LiveCopy);
}

#[test]
fn a_reservation_log_cut_after_a_kill_is_caught() {
    restored_state_is_caught(Restore::CutLog);
}

/// Copy directory `from` with everything under it to a fresh `to`.
fn copy_tree(from: &Path, to: &Path) {
    let _ = std::fs::remove_dir_all(to);
    let ok = std::process::Command::new("cp")
        .arg("-a")
        .arg(from)
        .arg(to)
        .status()
        .expect("cp")
        .success();
    assert!(ok, "cp -a {} {}", from.display(), to.display());
}

#[test]
fn an_etcd_rolled_back_to_an_older_copy_is_caught() {
    let Some(bin) = etcd_bin() else { return };
    let dir = tempdir("restore-etcd");
    let rules = write_rules(&dir, SLOW);
    let mut etcd = Etcd::start(&bin, &dir, 1);
    let urls = etcd.urls();
    let listen = free_addr();
    let start = |log: &str| {
        let log = dir.join(log);
        // The default `--ttl-max 2s`: a term waits 2 s (as a restart
        // does) for requesters that saw a newer state to name its run.
        let extra = ["--ttl-max", "2s"];
        vec![Some(replica_on(
            listen,
            &dir,
            Some(&rules),
            &urls,
            0,
            &log,
            &extra,
        ))]
    };
    let mut replicas = start("replica-0.log");
    leader_of(&replicas, None, Duration::from_secs(20));
    // The backup: etcd's data directory, copied with etcd stopped.
    let backup = dir.join("etcd-backup");
    etcd.stop(0);
    copy_tree(&etcd.data_dir(0), &backup);
    etcd.restart(0);
    leader_of(&replicas, None, Duration::from_secs(30));
    // The newer state: an agent drains the burst.
    let (lx, ly) = (dir.join("old.tsv"), dir.join("new.tsv"));
    let url = replicas[0].as_ref().expect("the replica").url();
    let x = agent("restore-etcd", &url, Some(&lx), &[]);
    wait_ok(x.http, "/readyz", Duration::from_secs(20));
    let before = hammer(&x, Duration::from_secs(5));
    assert_eq!(before, 20, "the burst passes first");
    std::thread::sleep(Duration::from_millis(300));
    // etcd rolled back to the copy, and the replica started again (it
    // held the newer state in memory): it leads from what the copy holds.
    replicas[0].take().expect("the replica").kill9();
    etcd.stop(0);
    std::fs::remove_dir_all(etcd.data_dir(0)).expect("remove etcd data");
    copy_tree(&backup, &etcd.data_dir(0));
    etcd.restart(0);
    replicas = start("replica-1.log");
    let root = replicas[0].as_ref().expect("the replica");
    // Until it leads (then it is waiting: its predecessor's validity, its
    // start's wait).
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !http_get(root.http, "/readyz").1.contains("leader") {
        assert!(std::time::Instant::now() < deadline, "no replica leads");
        std::thread::sleep(Duration::from_millis(50));
    }
    after_the_restore("etcd", root, x, before, (lx, ly));
}

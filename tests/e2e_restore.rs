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

mod common;

use std::path::Path;
use std::time::Duration;

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
    let x = agent("restore-old", &root.url(), Some(&lx), &[]);
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
    // A brand-new agent asks first; the old one second, then both keep
    // asking past the start's grace.
    let y = agent("restore-new", &root.url(), Some(&ly), &[]);
    let mut after = hammer(&y, Duration::from_millis(300));
    after += u64::from(check(&x) == 200);
    after += hammer(&y, Duration::from_secs(5));
    after += u64::from(check(&x) == 200);
    assert!(x.terminate().success());
    assert!(y.terminate().success());
    let (_, metrics) = http_get(root.http, "/metrics");
    let lost = metric(&metrics, "quotalease_allocator_ledgers_lost_total");
    eprintln!(
        "{how:?}: {before} admitted before, {after} after the restore; ledgers_lost_total {lost:?}"
    );
    let rate = quotalease_model::rules::Rate {
        tokens: 1,
        period_s: 60,
    };
    check_key_i1_at(&[lx, ly], ("slow", "acme", "/r"), rate, 20, before + after);
    assert_eq!(lost, Some(1.0), "the older state was caught");
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

//! Adjacent releases (issue 29 item 5, docs/protocol.md "Versions"): an
//! agent of the previous release and one of this release share one key
//! while the allocator is upgraded from the previous release to this one
//! and downgraded back, each time stopped cleanly on the same state
//! directory and address. I1 is checked exactly over both agents'
//! admissions, windows spanning both switches included, and each agent
//! must be served by each allocator.
//!
//! The previous release is the binary `$QUOTALEASE_PREVIOUS`, which the
//! test command builds from the commit named in `compat/previous-release`
//! (the last commit of protocol version 3). Outside CI, without it, the
//! test says so and passes; under CI it fails unless the test command
//! said why it could not build one (`$QUOTALEASE_PREVIOUS_SKIP`: a clone
//! without that commit).

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;

const RULES: &str = r#"
rules:
  - id: mixed
    match: { tenant: "*", route: /r }
    rate: 50/s
    burst: 20
    fail_policy: lease_only
"#;

/// The previous release's binary, or `None` (and why) when there is none.
fn previous() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("QUOTALEASE_PREVIOUS") {
        let p = PathBuf::from(p);
        assert!(
            p.is_file(),
            "QUOTALEASE_PREVIOUS={}: no such file",
            p.display()
        );
        return Some(p);
    }
    if let Ok(why) = std::env::var("QUOTALEASE_PREVIOUS_SKIP") {
        eprintln!("SKIPPED: no previous release to test against: {why}");
        return None;
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "QUOTALEASE_PREVIOUS is not set: the test command (scripts/test.sh) builds the previous release"
    );
    eprintln!("SKIPPED: set QUOTALEASE_PREVIOUS to a previous release's quotalease binary (scripts/test.sh builds one)");
    None
}

/// Both agents hammer the key for `for_` at once: (previous, this).
fn phase(old: &Proc, new: &Proc, for_: Duration) -> (u64, u64) {
    std::thread::scope(|s| {
        let a = s.spawn(|| hammer_acme(old, "/r", for_));
        let b = s.spawn(|| hammer_acme(new, "/r", for_));
        (
            a.join().expect("previous agent's load"),
            b.join().expect("this agent's load"),
        )
    })
}

fn start(bin: &Path, rules: &Path, state: &Path, listen: Option<std::net::SocketAddr>) -> Proc {
    let a = allocator_of(bin, rules, state, listen, "2s", &[]);
    wait_ok(a.http, "/healthz", Duration::from_secs(10));
    a
}

#[test]
fn agents_of_two_releases_share_a_key_across_an_upgrade_and_a_downgrade() {
    let Some(prev) = previous() else { return };
    let this = Path::new(BIN);
    let dir = tempdir("compat");
    let rules = write_rules(&dir, RULES);
    let state = dir.join("state");
    let root = start(&prev, &rules, &state, None);
    let listen = root.grpc;
    let (lo, ln) = (dir.join("previous.tsv"), dir.join("this.tsv"));
    let old = agent_of(&prev, "compat-previous", &root.url(), Some(&lo), &[]);
    let new = agent("compat-this", &root.url(), Some(&ln), &[]);
    wait_ok(old.http, "/readyz", Duration::from_secs(20));
    wait_ok(new.http, "/readyz", Duration::from_secs(20));
    let for_ = Duration::from_secs(5);
    let mut phases = Vec::new();
    // The previous release's allocator, then this one's (an upgrade),
    // then the previous one's again (a downgrade after a clean stop).
    let mut root = Some(root);
    for (name, bin) in [
        ("the previous release's", &*prev),
        ("this release's", this),
        ("the previous release's again", &*prev),
    ] {
        if !phases.is_empty() {
            assert!(root.take().expect("allocator").terminate().success());
            root = Some(start(bin, &rules, &state, Some(listen)));
        }
        let got = phase(&old, &new, for_);
        eprintln!(
            "{name} allocator: previous agent {}, this agent {}",
            got.0, got.1
        );
        phases.push((name, got));
    }
    assert!(old.terminate().success());
    assert!(new.terminate().success());
    drop(root);
    let total: u64 = phases.iter().map(|(_, (a, b))| a + b).sum();
    let k = check_key_i1(&[lo, ln], ("mixed", "acme", "/r"), 50, 20, total);
    eprintln!(
        "compat: {} admitted over {:.1} s, {:.1} % of B + R*T",
        k.admitted,
        k.t_s,
        k.util * 100.0
    );
    // Each agent is served by each allocator: the other release's
    // messages are understood both ways (a restart's wait and the leases
    // running out across it cost some of each phase).
    for (name, (a, b)) in &phases {
        assert!(
            *a >= 10 && *b >= 10,
            "{name} allocator: previous agent {a}, this agent {b}"
        );
        assert!(
            a + b >= 50 * 5 * 3 / 10,
            "{name} allocator delivered {} of 250",
            a + b
        );
    }
}

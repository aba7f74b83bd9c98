//! A rate grant whose bucket span is 2^38 ns or more is held as tokens,
//! and the level installed from it is still clipped to its capacity (what
//! core.rs `install_key` passes is the old level plus the increment; an
//! adversarial review found the level at 600 under a capacity of 301).
use quotalease_agent::lease_table::{LeaseWord, Refill};

#[test]
fn a_rate_grant_held_as_tokens_is_clipped_to_its_capacity() {
    let w = LeaseWord::new();
    const S: u64 = 1_000_000_000;
    // 2/s burst 600, half the rate to this agent: 1/s, capacity 301.
    let v1 = Refill::of_grant(1_000_000, 301);
    w.install(2 * S, v1, 0, |_| 301);
    let v2 = Refill::of_grant(1_000_000, 301);
    // A continuing version: the level goes on plus the increment (299).
    w.install(2 * S, v2, 1_000_000, |cur| cur.saturating_add(299));
    assert!(!w.refill().is_rate(), "held as tokens");
    let level = w.peek(2_000_000).unwrap();
    assert!(
        level <= 301,
        "level {level} above the version's capacity 301"
    );
}

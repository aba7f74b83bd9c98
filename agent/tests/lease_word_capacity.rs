//! A rate grant is never held above its capacity: held as a rate (its
//! capacity made smaller when the word cannot time its refill), or, for a
//! rate too slow for even one token in the word's span, as tokens, and the
//! level installed from it is still clipped to its capacity (what core.rs
//! `install_key` passes is the old level plus the increment; an
//! adversarial review found the level at 600 under a capacity of 301).
use quotalease_agent::lease_table::{LeaseWord, Refill, RATE_SPAN_NS};

const S: u64 = 1_000_000_000;

#[test]
fn a_rate_grant_held_as_tokens_is_clipped_to_its_capacity() {
    let w = LeaseWord::new();
    // One token per 500 s (slower than the word's 275 s span), capacity 301.
    let v1 = Refill::of_grant(2_000, 301);
    w.install(2 * S, v1, 0, |_| 301);
    let v2 = Refill::of_grant(2_000, 301);
    // A continuing version: the level goes on plus the increment (299).
    w.install(2 * S, v2, 1_000_000, |cur| cur.saturating_add(299));
    assert!(!w.refill().is_rate(), "held as tokens");
    let level = w.peek(2_000_000).unwrap();
    assert!(
        level <= 301,
        "level {level} above the version's capacity 301"
    );
}

#[test]
fn a_rate_grant_too_large_to_time_is_held_as_a_smaller_rate_lease() {
    let w = LeaseWord::new();
    // 2/s burst 600, half the rate to this agent: 1/s, capacity 301 (301 s
    // to fill: more than the word's span).
    let v1 = Refill::of_grant(1_000_000, 301);
    w.install(2 * S, v1, 0, |_| 301);
    let v2 = Refill::of_grant(1_000_000, 301);
    w.install(2 * S, v2, 1_000_000, |cur| cur.saturating_add(299));
    let held = w.refill();
    assert!(held.is_rate(), "still refills");
    assert!(held.capacity < 301 && held.capacity * held.ns_per_token < RATE_SPAN_NS);
    let level = w.peek(2_000_000).unwrap();
    assert!(
        level <= held.capacity,
        "level {level} above the held capacity {}",
        held.capacity
    );
}

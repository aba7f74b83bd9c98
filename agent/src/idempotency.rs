//! Idempotent checks (SPEC §5): the same `request_id`, tenant, route and
//! cost at the same agent within the window return the first answer and
//! charge nothing.
//!
//! A request id is *claimed* before it is decided. The first claim gets a
//! [`Ticket`] and decides; a retry that arrives while the first is still
//! deciding (waiting for a cold fetch, say) gets a [`Waiter`] and is given
//! the first answer when it comes — it is never decided, so never charged,
//! a second time. An answer the first request marks as not replayable
//! (the allocator was unreachable) is not kept: waiters and later retries
//! decide afresh, so a 503 does not outlive the outage. A ticket dropped
//! undecided (the caller went away) wakes its waiters to decide
//! themselves.
//!
//! Memory is capped: each of the shards keeps at most `capacity / SHARDS`
//! entries and evicts its oldest first. An evicted entry that was still
//! being decided keeps its waiters; only later retries miss it.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use tokio::sync::watch;

const SHARDS: usize = 16;

/// How the first request with an id ended, as its waiters see it.
#[derive(Clone, Debug)]
enum Outcome<V> {
    /// Still deciding.
    Pending,
    /// The answer, to be replayed.
    Answer(V),
    /// No replayable answer: decide yourself.
    GaveUp,
}

#[derive(Clone, Debug)]
enum State<V> {
    Done(V),
    Deciding(watch::Receiver<Outcome<V>>),
}

#[derive(Clone, Debug)]
struct Entry<V> {
    tenant: String,
    route: String,
    cost: u32,
    at_ns: u64,
    /// Tells this entry from a later one under the same id.
    serial: u64,
    state: State<V>,
}

impl<V> Entry<V> {
    fn same_request(&self, tenant: &str, route: &str, cost: u32, now_ns: u64, window: u64) -> bool {
        self.tenant == tenant
            && self.route == route
            && self.cost == cost
            && now_ns.saturating_sub(self.at_ns) < window
    }
}

#[derive(Debug)]
struct Shard<V> {
    map: HashMap<String, Entry<V>>,
    order: VecDeque<(u64, String)>,
}

/// A bounded, time-limited memory of answers by request id.
#[derive(Debug)]
pub struct ReplayCache<V> {
    shards: Vec<Mutex<Shard<V>>>,
    per_shard: usize,
    window_ns: u64,
    hasher: RandomState,
    replays: AtomicU64,
    serial: AtomicU64,
}

/// What a claim found.
#[derive(Debug)]
pub enum Claim<'a, V: Clone> {
    /// A retry of a decided request: its first answer.
    Replay(V),
    /// A retry of a request still being decided: wait for its answer.
    Wait(Waiter<V>),
    /// The first request with this id: decide, then [`Ticket::finish`].
    First(Ticket<'a, V>),
}

/// The right and duty to decide a request id (see the module docs).
#[derive(Debug)]
pub struct Ticket<'a, V: Clone> {
    cache: &'a ReplayCache<V>,
    id: String,
    serial: u64,
    tx: Option<watch::Sender<Outcome<V>>>,
}

/// A retry waiting for the first request's answer.
#[derive(Debug)]
pub struct Waiter<V> {
    rx: watch::Receiver<Outcome<V>>,
}

impl<V: Clone> Waiter<V> {
    /// The first request's answer, or `None` when there is none to replay
    /// (it was not replayable, or the first request went away): then
    /// claim again.
    pub async fn wait(mut self) -> Option<V> {
        let seen = self
            .rx
            .wait_for(|o| !matches!(o, Outcome::Pending))
            .await
            .ok()?;
        match &*seen {
            Outcome::Answer(v) => Some(v.clone()),
            Outcome::Pending | Outcome::GaveUp => None,
        }
    }
}

impl<V: Clone> Ticket<'_, V> {
    /// Record the answer (kept for replays if `replayable`), wake the
    /// waiters, and return it.
    pub fn finish(mut self, value: V, replayable: bool) -> V {
        let tx = self.tx.take().expect("a ticket finishes once");
        {
            let mut shard = self.cache.shard(&self.id).lock();
            let mine = shard
                .map
                .get(&self.id)
                .is_some_and(|e| e.serial == self.serial);
            if mine {
                if replayable {
                    let e = shard.map.get_mut(&self.id).expect("checked above");
                    e.state = State::Done(value.clone());
                } else {
                    shard.map.remove(&self.id);
                }
            }
        }
        let _ = tx.send(if replayable {
            Outcome::Answer(value.clone())
        } else {
            Outcome::GaveUp
        });
        value
    }
}

impl<V: Clone> Drop for Ticket<'_, V> {
    fn drop(&mut self) {
        let Some(tx) = self.tx.take() else {
            return;
        };
        // Given up undecided: forget the entry, let the waiters decide.
        let mut shard = self.cache.shard(&self.id).lock();
        if shard
            .map
            .get(&self.id)
            .is_some_and(|e| e.serial == self.serial)
        {
            shard.map.remove(&self.id);
        }
        drop(shard);
        let _ = tx.send(Outcome::GaveUp);
    }
}

impl<V: Clone> ReplayCache<V> {
    /// A cache holding at most `capacity` answers for `window_ns`.
    pub fn new(capacity: usize, window_ns: u64) -> Self {
        Self {
            shards: (0..SHARDS)
                .map(|_| {
                    Mutex::new(Shard {
                        map: HashMap::new(),
                        order: VecDeque::new(),
                    })
                })
                .collect(),
            per_shard: capacity.div_ceil(SHARDS).max(1),
            window_ns,
            hasher: RandomState::new(),
            replays: AtomicU64::new(0),
            serial: AtomicU64::new(0),
        }
    }

    fn shard(&self, id: &str) -> &Mutex<Shard<V>> {
        &self.shards[(self.hasher.hash_one(id) as usize) % SHARDS]
    }

    /// Claim request `id` of (tenant, route, cost) at `now_ns`. A request
    /// with the same id but another tenant, route or cost is not a retry:
    /// it replaces the entry and is decided on its own.
    pub fn claim(
        &self,
        id: &str,
        tenant: &str,
        route: &str,
        cost: u32,
        now_ns: u64,
    ) -> Claim<'_, V> {
        let mut shard = self.shard(id).lock();
        if let Some(e) = shard.map.get(id) {
            if e.same_request(tenant, route, cost, now_ns, self.window_ns) {
                return match &e.state {
                    State::Done(v) => {
                        self.replays.fetch_add(1, Ordering::Relaxed);
                        Claim::Replay(v.clone())
                    }
                    State::Deciding(rx) => Claim::Wait(Waiter { rx: rx.clone() }),
                };
            }
        }
        // Evict expired and over-capacity entries, oldest first.
        while let Some((at, _)) = shard.order.front() {
            let expired = now_ns.saturating_sub(*at) >= self.window_ns;
            if !expired && shard.order.len() < self.per_shard {
                break;
            }
            let (at, old) = shard.order.pop_front().expect("front exists");
            if shard.map.get(&old).is_some_and(|e| e.at_ns == at) {
                shard.map.remove(&old);
            }
        }
        let serial = self.serial.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = watch::channel(Outcome::Pending);
        shard.order.push_back((now_ns, id.to_string()));
        shard.map.insert(
            id.to_string(),
            Entry {
                tenant: tenant.to_string(),
                route: route.to_string(),
                cost,
                at_ns: now_ns,
                serial,
                state: State::Deciding(rx),
            },
        );
        Claim::First(Ticket {
            cache: self,
            id: id.to_string(),
            serial,
            tx: Some(tx),
        })
    }

    /// Count a replay answered to a waiter.
    pub fn count_replay(&self) {
        self.replays.fetch_add(1, Ordering::Relaxed);
    }

    /// Replays answered so far.
    pub fn replays(&self) -> u64 {
        self.replays.load(Ordering::Relaxed)
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().map.len()).sum()
    }

    /// No entries held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: u64 = 1_000_000_000;

    fn first<'a>(c: Claim<'a, u32>) -> Ticket<'a, u32> {
        match c {
            Claim::First(t) => t,
            other => panic!("expected First, got {other:?}"),
        }
    }

    fn replay(c: Claim<'_, u32>) -> Option<u32> {
        match c {
            Claim::Replay(v) => Some(v),
            Claim::First(_) => None,
            Claim::Wait(_) => panic!("unexpected Wait"),
        }
    }

    #[test]
    fn replay_within_window_returns_first_answer() {
        let c = ReplayCache::new(100, 60 * SEC);
        let t = first(c.claim("r1", "t", "/a", 1, 0));
        assert_eq!(t.finish(7u32, true), 7);
        assert_eq!(replay(c.claim("r1", "t", "/a", 1, 10 * SEC)), Some(7));
        assert_eq!(c.replays(), 1);
        // Different cost or tenant: not a replay (and it replaces the entry).
        assert_eq!(replay(c.claim("r1", "t", "/a", 2, SEC)), None);
        assert_eq!(replay(c.claim("r1", "u", "/a", 1, SEC)), None);
        // After the window: not a replay.
        let c = ReplayCache::new(100, 60 * SEC);
        first(c.claim("r1", "t", "/a", 1, 0)).finish(7, true);
        assert_eq!(replay(c.claim("r1", "t", "/a", 1, 61 * SEC)), None);
    }

    #[tokio::test]
    async fn a_retry_during_the_first_decision_waits_for_its_answer() {
        let c = ReplayCache::new(100, 60 * SEC);
        let t = first(c.claim("r1", "t", "/a", 1, 0));
        let Claim::Wait(w) = c.claim("r1", "t", "/a", 1, SEC) else {
            panic!("a retry while deciding must wait");
        };
        assert_eq!(t.finish(9u32, true), 9);
        assert_eq!(w.wait().await, Some(9));
        assert_eq!(replay(c.claim("r1", "t", "/a", 1, 2 * SEC)), Some(9));
    }

    #[tokio::test]
    async fn answers_that_are_not_replayable_are_not_kept() {
        let c = ReplayCache::new(100, 60 * SEC);
        let t = first(c.claim("r1", "t", "/a", 1, 0));
        let Claim::Wait(w) = c.claim("r1", "t", "/a", 1, 0) else {
            panic!("must wait");
        };
        t.finish(503u32, false);
        assert_eq!(w.wait().await, None, "waiters decide themselves");
        // A later retry is decided afresh.
        first(c.claim("r1", "t", "/a", 1, SEC));
        assert_eq!(c.replays(), 0);
    }

    #[tokio::test]
    async fn a_dropped_ticket_wakes_its_waiters() {
        let c = ReplayCache::new(100, 60 * SEC);
        let t = first(c.claim("r1", "t", "/a", 1, 0));
        let Claim::Wait(w) = c.claim("r1", "t", "/a", 1, 0) else {
            panic!("must wait");
        };
        drop(t);
        assert_eq!(w.wait().await, None);
        first(c.claim("r1", "t", "/a", 1, 0)).finish(1, true);
    }

    #[test]
    fn memory_is_capped() {
        let c = ReplayCache::new(160, 60 * SEC);
        for i in 0..100_000u64 {
            first(c.claim(&format!("req-{i}"), "t", "/a", 1, i)).finish(i as u32, true);
        }
        assert!(c.len() <= 160, "len {}", c.len());
        // The newest survive.
        assert_eq!(
            replay(c.claim("req-99999", "t", "/a", 1, 100_000)),
            Some(99_999)
        );
    }
}

//! Idempotent checks (SPEC §5): the same `request_id`, tenant, route and
//! cost at the same agent within the window return the first answer and
//! charge nothing. Memory is capped: each of the shards keeps at most
//! `capacity / SHARDS` entries and evicts its oldest first.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

const SHARDS: usize = 16;

#[derive(Clone, Debug)]
struct Entry<V> {
    tenant: String,
    route: String,
    cost: u32,
    at_ns: u64,
    value: V,
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
        }
    }

    fn shard(&self, id: &str) -> &Mutex<Shard<V>> {
        &self.shards[(self.hasher.hash_one(id) as usize) % SHARDS]
    }

    /// The first answer for this request, if it is a replay.
    pub fn get(&self, id: &str, tenant: &str, route: &str, cost: u32, now_ns: u64) -> Option<V> {
        let shard = self.shard(id).lock();
        let e = shard.map.get(id)?;
        if e.tenant == tenant
            && e.route == route
            && e.cost == cost
            && now_ns.saturating_sub(e.at_ns) < self.window_ns
        {
            self.replays.fetch_add(1, Ordering::Relaxed);
            Some(e.value.clone())
        } else {
            None
        }
    }

    /// Remember the answer to a request. Returns the answer to use: an
    /// earlier one if a concurrent twin got there first.
    pub fn put(&self, id: &str, tenant: &str, route: &str, cost: u32, now_ns: u64, value: V) -> V {
        let mut shard = self.shard(id).lock();
        if let Some(e) = shard.map.get(id) {
            if e.tenant == tenant
                && e.route == route
                && e.cost == cost
                && now_ns.saturating_sub(e.at_ns) < self.window_ns
            {
                self.replays.fetch_add(1, Ordering::Relaxed);
                return e.value.clone();
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
        shard.order.push_back((now_ns, id.to_string()));
        shard.map.insert(
            id.to_string(),
            Entry {
                tenant: tenant.to_string(),
                route: route.to_string(),
                cost,
                at_ns: now_ns,
                value: value.clone(),
            },
        );
        value
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

    #[test]
    fn replay_within_window_returns_first_answer() {
        let c = ReplayCache::new(100, 60 * SEC);
        assert_eq!(c.get("r1", "t", "/a", 1, 0), None);
        assert_eq!(c.put("r1", "t", "/a", 1, 0, 7u32), 7);
        assert_eq!(c.get("r1", "t", "/a", 1, 10 * SEC), Some(7));
        // Different cost or tenant: not a replay.
        assert_eq!(c.get("r1", "t", "/a", 2, SEC), None);
        assert_eq!(c.get("r1", "u", "/a", 1, SEC), None);
        // After the window: not a replay.
        assert_eq!(c.get("r1", "t", "/a", 1, 61 * SEC), None);
        assert_eq!(c.replays(), 1);
    }

    #[test]
    fn memory_is_capped() {
        let c = ReplayCache::new(160, 60 * SEC);
        for i in 0..100_000u64 {
            c.put(&format!("req-{i}"), "t", "/a", 1, i, i);
        }
        assert!(c.len() <= 160, "len {}", c.len());
        // The newest survive.
        assert_eq!(c.get("req-99999", "t", "/a", 1, 100_000), Some(99_999));
    }
}

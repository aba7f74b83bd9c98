//! A per-thread cache of resolved request shapes, for `Agent::check_fast`.
//!
//! A shape is what decides which buckets a request draws from: (domain,
//! tenant, route). Resolving one means matching every rule and looking up
//! each matched rule's key in the lease table — hashing and comparing the
//! key's strings once per rule. This cache does it once per shape and
//! thread: a decision on a shape seen before hashes its strings once,
//! compares them with the entry's, and charges the [`KeyHandle`] the entry
//! holds (the same path as `Agent::check_handle`).
//!
//! Direct-mapped, [`ENTRIES`] per thread and agent, keyed by shape. An entry
//! is valid for one rules generation (the handle's). It holds the keys'
//! slots by `Arc`: a key the agent forgets meanwhile has its word retired
//! (no lease, deadline 0), the fast path answers `None` on it, and the
//! caller drops the entry, so the next decision resolves the shape again
//! and finds the key's new slot.
//! Nothing here is shared between threads; nothing is written on a hit.

use std::cell::RefCell;
use std::collections::HashMap;

use quotalease_model::key::{bytes_eq, str_eq};

use crate::handle::KeyHandle;

/// Entries per thread (a power of two).
const ENTRIES: usize = 512;

struct Entry {
    agent: u64,
    domain: Option<Box<str>>,
    tenant: Text,
    route: Text,
    handle: KeyHandle,
}

impl Entry {
    #[inline]
    fn is(&self, agent: u64, domain: Option<&str>, tenant: &str, route: &str) -> bool {
        self.agent == agent
            && self.tenant.is(tenant)
            && self.route.is(route)
            && match (&self.domain, domain) {
                (None, None) => true,
                (Some(a), Some(b)) => str_eq(a, b),
                _ => false,
            }
    }
}

/// Bytes of a tenant or route kept in the entry itself.
const INLINE: usize = 22;

/// A shape's tenant or route: in the entry when short (ids mostly are), so
/// that a hit compares it without loading another cache line (a process
/// with hundreds of agents, the simulator, missed on nearly every one).
enum Text {
    Inline { len: u8, bytes: [u8; INLINE] },
    Heap(Box<str>),
}

impl Text {
    fn new(s: &str) -> Self {
        match u8::try_from(s.len()) {
            Ok(len) if s.len() <= INLINE => {
                let mut bytes = [0; INLINE];
                bytes[..s.len()].copy_from_slice(s.as_bytes());
                Self::Inline { len, bytes }
            }
            _ => Self::Heap(s.into()),
        }
    }

    #[inline]
    fn is(&self, s: &str) -> bool {
        match self {
            Self::Inline { len, bytes } => bytes_eq(&bytes[..usize::from(*len)], s.as_bytes()),
            Self::Heap(h) => str_eq(h, s),
        }
    }
}

/// One place of the cache: the shape it holds, and the hash of the last
/// shape that missed here. A shape is cached on its second miss in a row
/// at its place: shapes seen once (a scan over many cold tenants) then cost
/// a hash, not a handle built and thrown away.
#[derive(Default)]
struct Place {
    entry: Option<Entry>,
    candidate: u64,
}

/// Most threads serve one agent; a process with several (the simulator,
/// tests, an embedder with one agent per upstream) gives each its own
/// places, so agents do not evict each other's shapes.
struct Cache {
    /// The agent whose places `current` indexes.
    agent: u64,
    current: usize,
    places: Vec<Vec<Place>>,
    /// Agent -> index into `places`.
    index: HashMap<u64, usize, foldhash::fast::FixedState>,
}

/// At most this many agents' places per thread; one more starts afresh
/// (agents created and dropped by the thousand must not pile up here).
const MAX_AGENTS: usize = 1024;

impl Cache {
    /// The places of `agent`, made current.
    #[inline(always)]
    fn places(&mut self, agent: u64) -> &mut [Place] {
        if self.agent != agent || self.places.is_empty() {
            self.switch(agent);
        }
        &mut self.places[self.current]
    }

    #[inline(never)]
    fn switch(&mut self, agent: u64) {
        if !self.index.contains_key(&agent) && self.index.len() >= MAX_AGENTS {
            self.index.clear();
            self.places.clear();
        }
        let next = self.places.len();
        let at = *self.index.entry(agent).or_insert(next);
        if at == next {
            self.places.push(
                std::iter::repeat_with(Place::default)
                    .take(ENTRIES)
                    .collect(),
            );
        }
        self.agent = agent;
        self.current = at;
    }
}

thread_local! {
    static CACHE: RefCell<Cache> = const {
        RefCell::new(Cache {
            agent: 0,
            current: 0,
            places: Vec::new(),
            index: HashMap::with_hasher(foldhash::fast::FixedState::with_seed(0)),
        })
    };
}

/// The shape's hash: a cheap multiply-shift mix of each string's length
/// and its first and last bytes (up to 8 of each); its top bits place the
/// shape in this thread's cache. Shapes that collide evict each other (a
/// slower decision, never a wrong one), since a hit compares every byte.
#[inline]
fn hash(agent: u64, domain: Option<&str>, tenant: &str, route: &str) -> u64 {
    let h = sample(tenant).wrapping_mul(0x9e37_79b9_7f4a_7c15)
        ^ sample(route).wrapping_mul(0xc2b2_ae3d_27d4_eb4f)
        ^ domain.map_or(0, sample).wrapping_mul(0x1656_67b1_9e37_79f9)
        ^ agent.wrapping_mul(0x27d4_eb2f_1656_67c5);
    // Never 0: 0 is "no candidate".
    h.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1
}

/// Length and up to 16 bytes of `s` (its first and last 8) in one word.
#[inline]
fn sample(s: &str) -> u64 {
    let b = s.as_bytes();
    let n = b.len();
    let word = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
    let half = |i: usize| u64::from(u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes")));
    let w = match n {
        0 => 0,
        1..=3 => u64::from(b[0]) | u64::from(b[n / 2]) << 8 | u64::from(b[n - 1]) << 16,
        4..=7 => half(0) | half(n - 4) << 32,
        _ => word(0) ^ word(n - 8).rotate_left(29),
    };
    w ^ (n as u64).rotate_right(8)
}

/// Decide with the shape's cached handle: `hit` on it when this thread
/// has one for this agent and `generation` (`hit` also says whether to
/// keep the entry: not when its handle can no longer charge); else `miss`,
/// told whether its
/// handle would be cached (the shape's second miss in a row here); the
/// handle it returns, if any, is. Neither may call back into this cache
/// (they run under its borrow); a re-entered call runs `miss` uncached.
#[inline(always)]
pub(crate) fn with<R>(
    agent: u64,
    generation: u64,
    domain: Option<&str>,
    tenant: &str,
    route: &str,
    hit: impl FnOnce(&KeyHandle) -> (Option<R>, bool),
    miss: impl FnOnce(bool) -> (Option<R>, Option<KeyHandle>),
) -> Option<R> {
    CACHE.with(|c| {
        let Ok(mut c) = c.try_borrow_mut() else {
            return miss(false).0;
        };
        let h = hash(agent, domain, tenant, route);
        let place = &mut c.places(agent)[(h >> (64 - ENTRIES.trailing_zeros())) as usize];
        if let Some(cached) = place
            .entry
            .as_ref()
            .filter(|e| e.handle.generation() == generation && e.is(agent, domain, tenant, route))
        {
            let (r, keep) = hit(&cached.handle);
            if !keep {
                place.entry = None;
            }
            return r;
        }
        let second = place.candidate == h;
        place.candidate = h;
        let (r, handle) = miss(second);
        if let Some(handle) = handle {
            place.entry = Some(Entry {
                agent,
                domain: domain.map(Into::into),
                tenant: Text::new(tenant),
                route: Text::new(route),
                handle,
            });
        }
        r
    })
}

#[cfg(test)]
mod tests {
    use super::Text;

    #[test]
    fn texts_compare_every_byte_inline_and_on_the_heap() {
        let long = "a-tenant-name-longer-than-the-inline-room";
        for n in 0..=long.len() {
            let s = &long[..n];
            let t = Text::new(s);
            assert_eq!(matches!(t, Text::Inline { .. }), n <= super::INLINE, "{n}");
            assert!(t.is(s), "{n}");
            if n > 0 {
                assert!(!t.is(&long[..n - 1]), "{n}");
            }
            for i in 0..n {
                let mut b = s.as_bytes().to_vec();
                b[i] ^= 1;
                assert!(!t.is(std::str::from_utf8(&b).expect("ascii")), "{n} {i}");
            }
            assert!(!t.is(&format!("{s}x")), "{n}");
        }
    }
}

//! The core's per-key renewal state, stored densely.
//!
//! A hash map of the state itself keeps it in a table between half and
//! seven-eighths full, and its last doubling copies all of it; here the
//! states sit in fixed chunks, full except the last, and a small map finds
//! a key's position by its slot id. Removal moves the last state into the
//! hole. SPEC §9 counts the agent's bytes per key held.

use std::collections::HashMap;

/// States per chunk.
const CHUNK: usize = 1024;

/// Dense storage of `T`s found by a `u64` id (`id_of` tells an entry's id).
#[derive(Debug)]
pub(crate) struct KeySlab<T> {
    chunks: Vec<Vec<T>>,
    /// id -> position (chunk * CHUNK + index).
    index: HashMap<u64, u32, foldhash::fast::FixedState>,
    id_of: fn(&T) -> u64,
}

impl<T> KeySlab<T> {
    pub(crate) fn new(id_of: fn(&T) -> u64) -> Self {
        Self {
            chunks: Vec::new(),
            index: HashMap::with_hasher(foldhash::fast::FixedState::with_seed(0)),
            id_of,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.index.len()
    }

    fn at(&mut self, pos: u32) -> &mut T {
        let pos = pos as usize;
        &mut self.chunks[pos / CHUNK][pos % CHUNK]
    }

    pub(crate) fn get(&self, id: &u64) -> Option<&T> {
        let pos = *self.index.get(id)? as usize;
        Some(&self.chunks[pos / CHUNK][pos % CHUNK])
    }

    pub(crate) fn get_mut(&mut self, id: &u64) -> Option<&mut T> {
        let pos = *self.index.get(id)?;
        Some(self.at(pos))
    }

    /// The entry of `id`, created by `make` if there is none.
    pub(crate) fn get_or_insert_with(&mut self, id: u64, make: impl FnOnce() -> T) -> &mut T {
        if let Some(&pos) = self.index.get(&id) {
            return self.at(pos);
        }
        let value = make();
        debug_assert_eq!((self.id_of)(&value), id);
        if self.chunks.last().is_none_or(|c| c.len() == CHUNK) {
            self.chunks.push(Vec::with_capacity(CHUNK));
        }
        let pos = self.len();
        let pos = u32::try_from(pos).expect("fewer than 2^32 keys");
        self.chunks.last_mut().expect("pushed above").push(value);
        self.index.insert(id, pos);
        self.at(pos)
    }

    /// Remove and return the entry of `id`.
    pub(crate) fn remove(&mut self, id: &u64) -> Option<T> {
        let pos = self.index.remove(id)? as usize;
        let last = self.chunks.last_mut().expect("an entry exists");
        let mut removed = last.pop().expect("the last chunk is never empty");
        if last.is_empty() {
            self.chunks.pop();
        }
        let end = self.index.len(); // position the popped entry had
        if pos != end {
            // The popped entry was another key's: it fills the hole.
            let moved_id = (self.id_of)(&removed);
            std::mem::swap(&mut removed, &mut self.chunks[pos / CHUNK][pos % CHUNK]);
            self.index.insert(moved_id, pos as u32);
        }
        if self.index.capacity() > 4 * self.index.len().max(1024) {
            self.index.shrink_to_fit();
        }
        Some(removed)
    }

    #[cfg(test)]
    pub(crate) fn values(&self) -> impl Iterator<Item = &T> {
        self.chunks.iter().flatten()
    }

    pub(crate) fn values_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.chunks.iter_mut().flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against a reference map: every insert, lookup and removal (from the
    /// middle, the end, until empty and again) agrees.
    #[test]
    fn agrees_with_a_map_through_inserts_and_removals() {
        let mut slab: KeySlab<(u64, u64)> = KeySlab::new(|e| e.0);
        let mut reference = std::collections::BTreeMap::new();
        let mut x: u64 = 12345;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for round in 0..3 {
            for _ in 0..5_000 {
                let id = next() % 4_000;
                if next() % 3 == 0 {
                    assert_eq!(slab.remove(&id), reference.remove(&id).map(|v| (id, v)));
                } else {
                    let v = next();
                    let e = slab.get_or_insert_with(id, || (id, v));
                    let r = reference.entry(id).or_insert(v);
                    assert_eq!(e.1, *r);
                    e.1 += 1;
                    *r += 1;
                }
                assert_eq!(slab.len(), reference.len());
            }
            for (id, v) in &reference {
                assert_eq!(slab.get(id), Some(&(*id, *v)));
            }
            let mut all: Vec<_> = slab.values_mut().map(|e| *e).collect();
            all.sort_unstable();
            assert_eq!(
                all,
                reference.iter().map(|(k, v)| (*k, *v)).collect::<Vec<_>>()
            );
            if round == 1 {
                for id in reference.keys().copied().collect::<Vec<_>>() {
                    assert!(slab.remove(&id).is_some());
                    reference.remove(&id);
                }
                assert_eq!(slab.len(), 0);
                assert!(slab.chunks.is_empty());
            }
        }
    }
}

//! An agent's parked requests: by park id (the order they re-check in),
//! and by the key they wait on, so that a key settling finds its own
//! waiters without a walk over every request parked at the agent
//! (hot-tenant parks about a tenth of a million checks a second).

use std::collections::{BTreeMap, HashMap};

use quotalease_agent::agent::Parked;
use quotalease_agent::lease_table::Slot;

use crate::workload::Arrival;

/// One parked request: its arrival, the request between its steps, and
/// the key it waits on.
pub(super) type Entry = (Arrival, Parked, Slot);

#[derive(Default)]
pub(super) struct ParkedRequests {
    by_park: BTreeMap<u64, Entry>,
    /// Slot address -> park ids waiting on it, ascending.
    by_slot: HashMap<usize, Vec<u64>, foldhash::fast::FixedState>,
}

impl ParkedRequests {
    /// Park `entry` as `park` (ids grow with every park).
    pub(super) fn insert(&mut self, park: u64, entry: Entry) {
        self.by_slot.entry(entry.2.addr()).or_default().push(park);
        self.by_park.insert(park, entry);
    }

    /// Take request `park` out, if it is still parked.
    pub(super) fn remove(&mut self, park: u64) -> Option<Entry> {
        let entry = self.by_park.remove(&park)?;
        let addr = entry.2.addr();
        if let Some(parks) = self.by_slot.get_mut(&addr) {
            if let Ok(i) = parks.binary_search(&park) {
                parks.remove(i);
            }
            if parks.is_empty() {
                self.by_slot.remove(&addr);
            }
        }
        Some(entry)
    }

    /// The requests parked on any of `settled`, in park order.
    pub(super) fn on(&self, settled: &[Slot]) -> Vec<u64> {
        let mut due = Vec::new();
        for (i, slot) in settled.iter().enumerate() {
            if settled[..i].contains(slot) {
                continue;
            }
            if let Some(parks) = self.by_slot.get(&slot.addr()) {
                due.extend_from_slice(parks);
            }
        }
        due.sort_unstable();
        due
    }

    /// How many requests are parked.
    pub(super) fn len(&self) -> usize {
        self.by_park.len()
    }

    /// Forget every parked request.
    pub(super) fn clear(&mut self) {
        self.by_park.clear();
        self.by_slot.clear();
    }
}

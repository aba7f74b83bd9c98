//! The event queue: events in time order, ties in the order they were
//! scheduled.
//!
//! The heap holds only `(t, n, slot)` (24 bytes) and the events wait in a
//! slab beside it: a pop sifts small keys through the heap's levels rather
//! than whole events (hot-tenant keeps tens of thousands of timers queued;
//! with the events in the heap, its pops were an eighth of a run).

use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// Events of type `E` by `(t, n)`, `n` counting every push.
pub(super) struct EventQueue<E> {
    heap: BinaryHeap<Reverse<(u64, u64, u32)>>,
    slab: Vec<Option<E>>,
    free: Vec<u32>,
    n: u64,
}

impl<E> EventQueue<E> {
    pub(super) fn new() -> Self {
        Self {
            heap: BinaryHeap::new(),
            slab: Vec::new(),
            free: Vec::new(),
            n: 0,
        }
    }

    /// Queue `ev` at `t`, after every event already queued at `t`.
    pub(super) fn push(&mut self, t: u64, ev: E) {
        self.n += 1;
        let slot = match self.free.pop() {
            Some(i) => {
                self.slab[i as usize] = Some(ev);
                i
            }
            None => {
                self.slab.push(Some(ev));
                u32::try_from(self.slab.len() - 1).expect("fewer than 2^32 events queued")
            }
        };
        self.heap.push(Reverse((t, self.n, slot)));
    }

    /// The earliest event if it is due at or before `until`, with its time.
    pub(super) fn pop_until(&mut self, until: u64) -> Option<(u64, E)> {
        let &Reverse((t, _, _)) = self.heap.peek()?;
        if t > until {
            return None;
        }
        let Reverse((t, _, slot)) = self.heap.pop().expect("peeked");
        let ev = self.slab[slot as usize]
            .take()
            .expect("a queued slot holds its event");
        self.free.push(slot);
        Some((t, ev))
    }
}

#[cfg(test)]
mod tests {
    use super::EventQueue;

    #[test]
    fn events_come_out_by_time_then_in_the_order_pushed() {
        let mut q = EventQueue::new();
        for (t, name) in [(5, "a"), (3, "b"), (5, "c"), (1, "d"), (3, "e"), (9, "f")] {
            q.push(t, name);
        }
        assert_eq!(q.pop_until(0), None);
        let mut out = Vec::new();
        while let Some((t, e)) = q.pop_until(5) {
            out.push((t, e));
            // Slots freed by pops are reused without disturbing the order.
            if e == "b" {
                q.push(4, "g");
                q.push(3, "h");
            }
        }
        assert_eq!(
            out,
            [
                (1, "d"),
                (3, "b"),
                (3, "e"),
                (3, "h"),
                (4, "g"),
                (5, "a"),
                (5, "c")
            ]
        );
        assert_eq!(q.pop_until(u64::MAX), Some((9, "f")));
        assert_eq!(q.pop_until(u64::MAX), None);
    }
}

//! The lease table's index: the slots of the keys held, found by key.
//! Lock-free for readers, one writer at a time.
//!
//! An open-addressing array of slot addresses (linear probing, a power of
//! two long, at most 3/4 full counting tombstones), 8 bytes a cell and no
//! node per key (SPEC §9 counts the agent's bytes per key held: a map with
//! a heap node per entry costs ~50 B a key, this ~17 at 1 M keys). A cell
//! is empty (null), a tombstone (address 0, low bit set: a removed key
//! whose probe chain must stay unbroken), or a slot's block address (16-
//! aligned) with 4 bits of the key's hash in its low bits, so a probe
//! compares keys only on a tag match.
//!
//! **Writers** (insert, remove, resize) are the agent core only and are
//! serialized by a mutex inside the table that readers never touch. The
//! table owns one [`Slot`] handle per key it holds (given up with
//! [`Slot::into_raw`] at insert).
//!
//! **Readers** pin a guard of the table's `seize` collector (the epoch-like
//! reclamation papaya uses: entering writes only thread-local state),
//! load the array and its cells through the guard, and may use a slot
//! found for the guard's life ([`SlotRef`]), or take a handle of their own
//! ([`SlotRef::to_owned`]). A lookup writes no shared cache line (taking
//! an owned handle writes the slot's reference count).
//!
//! **Reclamation.** A removed key's cell becomes a tombstone, then the
//! table's handle to its slot is *retired*: the collector drops it only
//! after every guard that was active at the retirement is gone, so a
//! reader that loaded the address before the tombstone went in can still
//! read the slot. A resize builds a new array from the live cells (the
//! handles move to it; nothing is released), publishes it, and retires
//! the old array (freed the same way, without touching the slots). A
//! reader still probing an old array sees only slots that were in it when
//! its guard could see it, so slots retired later are protected by the
//! same guard: retirements happen in the writer's order, after the
//! publication that made the old array unreachable to new guards.

use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};

use seize::{Collector, Guard, LocalGuard};

use super::{str_eq, KeyRef, Lookup, Slot, SlotRef, SLOT_ALIGN};

/// Low address bits of a cell that hold the key's hash tag.
const TAG_MASK: usize = SLOT_ALIGN - 1;
/// Fewest cells of an array.
const MIN_CELLS: usize = 16;

/// What a cell holds.
enum Cell {
    Empty,
    Tombstone,
    /// A slot's block address and its tag.
    Live(*mut u8, usize),
}

fn decode(v: *mut u8) -> Cell {
    if v.is_null() {
        return Cell::Empty;
    }
    let addr = v.addr();
    if addr & !TAG_MASK == 0 {
        return Cell::Tombstone;
    }
    Cell::Live(v.map_addr(|a| a & !TAG_MASK), addr & TAG_MASK)
}

fn tombstone() -> *mut u8 {
    std::ptr::without_provenance_mut(1)
}

/// One array of cells.
struct Cells {
    mask: usize,
    cells: Box<[AtomicPtr<u8>]>,
}

impl Cells {
    fn new(len: usize) -> Box<Self> {
        debug_assert!(len.is_power_of_two());
        Box::new(Self {
            mask: len - 1,
            cells: (0..len)
                .map(|_| AtomicPtr::new(std::ptr::null_mut()))
                .collect(),
        })
    }
}

/// Writer-side counts (under the writer mutex).
#[derive(Debug, Default)]
struct Writer {
    tombstones: usize,
}

/// The lease table: the slots of the keys held, found by key. See the
/// module docs. The hasher is seeded per process.
pub struct Table {
    collector: Collector,
    cells: AtomicPtr<Cells>,
    len: AtomicUsize,
    writer: parking_lot::Mutex<Writer>,
    hasher: foldhash::fast::RandomState,
}

// SAFETY: the table shares slots (`Send + Sync`) and arrays of atomics
// between threads; every raw pointer in it is reached through the
// collector's guards (readers) or the writer mutex (writers), as the
// module docs argue.
unsafe impl Send for Table {}
// SAFETY: as above.
unsafe impl Sync for Table {}

impl std::fmt::Debug for Table {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Table").field("len", &self.len()).finish()
    }
}

impl Default for Table {
    fn default() -> Self {
        Self::new()
    }
}

/// `reclaim` for a retired slot handle: drop it.
///
/// # Safety
///
/// `p` is a handle the table gave up with [`Slot::into_raw`] and no longer
/// holds in any array reachable by a new guard.
unsafe fn drop_slot(p: *mut u8, _: &Collector) {
    // SAFETY: per the contract, the table's handle, passed here once.
    drop(unsafe { Slot::from_raw(p) });
}

/// `reclaim` of the entries that fill a batch: nothing to free.
///
/// # Safety
///
/// None needed: it touches nothing.
unsafe fn free_nothing(_: *mut u8, _: &Collector) {}

/// Entries added after an array's retirement so that its batch can be
/// handed off, then flushed. seize hands a batch off once it holds an
/// entry per thread inside a guard at that moment; `Collector::new()`
/// batches max(CPUs, 32). With more threads pinned at once a retired array
/// waits for later retirements (memory only, never safety); each thread
/// that removed keys may keep up to 31 retired slots alive until it
/// retires more or the table is dropped.
const RETIRE_BATCH: usize = 32;

/// `reclaim` for a retired array: free it, not the slots it points to
/// (their handles moved to the array that replaced it).
///
/// # Safety
///
/// `p` came from `Box::into_raw` of an array no new guard can reach.
unsafe fn drop_cells(p: *mut Cells, _: &Collector) {
    // SAFETY: per the contract.
    drop(unsafe { Box::from_raw(p) });
}

impl Table {
    /// An empty table.
    pub fn new() -> Self {
        Self {
            collector: Collector::new(),
            cells: AtomicPtr::new(Box::into_raw(Cells::new(MIN_CELLS))),
            len: AtomicUsize::new(0),
            writer: parking_lot::Mutex::new(Writer::default()),
            hasher: foldhash::fast::RandomState::default(),
        }
    }

    /// Number of keys held.
    pub fn len(&self) -> usize {
        self.len.load(Ordering::Relaxed)
    }

    /// Whether no key is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Cells of the current array (for memory accounting).
    pub fn capacity(&self) -> usize {
        self.pin().array().mask + 1
    }

    fn hash(&self, k: KeyRef<'_>) -> u64 {
        use std::hash::BuildHasher;
        self.hasher.hash_one(k)
    }

    /// Pin a guard: lookups (and, for the writer, changes) through it.
    #[inline]
    pub fn pin(&self) -> Pinned<'_> {
        Pinned {
            table: self,
            guard: self.collector.enter(),
        }
    }
}

impl Drop for Table {
    fn drop(&mut self) {
        let cells = *self.cells.get_mut();
        // SAFETY: `&mut self`: no guard of this table is alive (a guard
        // borrows the table), so the current array and the handles in it
        // are this thread's alone. Retired arrays and handles are freed by
        // the collector's own drop, which runs after this.
        let cells = unsafe { Box::from_raw(cells) };
        for c in cells.cells.iter() {
            if let Cell::Live(p, _) = decode(c.load(Ordering::Relaxed)) {
                // SAFETY: a live cell holds one of the table's handles.
                drop(unsafe { Slot::from_raw(p) });
            }
        }
    }
}

/// The table under a pinned guard: reads for the guard's life.
pub struct Pinned<'t> {
    table: &'t Table,
    guard: LocalGuard<'t>,
}

impl<'t> Pinned<'t> {
    /// The current array, for this guard's life.
    #[inline]
    fn array(&self) -> &Cells {
        let cells = self.guard.protect(&self.table.cells, Ordering::Acquire);
        // SAFETY: the array pointer is never null, and an array is freed
        // only through the collector after it stopped being current: the
        // guard keeps this one alive for its life.
        unsafe { &*cells }
    }

    /// Number of keys held.
    pub fn len(&self) -> usize {
        self.table.len()
    }

    /// Whether no key is held.
    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    /// The slot of `key`, if the table holds one. Atomics only: loads of
    /// the cells on the key's probe chain, a key compare on a tag match.
    #[inline]
    pub fn get(&self, key: &Lookup<'_>) -> Option<SlotRef<'_>> {
        let h = self.table.hash(key.0);
        self.find(self.array(), key.0, h).map(|(_, s)| s)
    }

    /// The cell index and slot of `key` in `cells`.
    #[inline]
    fn find(&self, cells: &Cells, key: KeyRef<'_>, h: u64) -> Option<(usize, SlotRef<'_>)> {
        let tag = (h >> 60) as usize & TAG_MASK;
        let mut i = h as usize & cells.mask;
        // An array is never full (at most 3/4, tombstones counted), so a
        // probe ends at an empty cell; the bound is belt and braces.
        for _ in 0..=cells.mask {
            match decode(self.guard.protect(&cells.cells[i], Ordering::Acquire)) {
                Cell::Empty => return None,
                Cell::Tombstone => {}
                Cell::Live(p, t) if t == tag => {
                    // SAFETY: `p` was in a live cell of an array this guard
                    // reached, so the table held a handle to it while this
                    // guard was active; that handle is released only through
                    // the collector, after this guard is gone.
                    let s = unsafe { Slot::borrow_raw(p) };
                    let b = s.key_ref();
                    if str_eq(key.tenant, b.tenant)
                        && str_eq(key.route, b.route)
                        && str_eq(key.rule, b.rule)
                    {
                        return Some((i, s));
                    }
                }
                Cell::Live(..) => {}
            }
            i = (i + 1) & cells.mask;
        }
        None
    }

    /// Every slot held (the writer's view: call it from the writer).
    pub fn iter(&self) -> impl Iterator<Item = SlotRef<'_>> + '_ {
        self.array().cells.iter().filter_map(|c| {
            match decode(self.guard.protect(c, Ordering::Acquire)) {
                // SAFETY: as in `find`.
                Cell::Live(p, _) => Some(unsafe { Slot::borrow_raw(p) }),
                _ => None,
            }
        })
    }

    /// Hold `slot` under its key. Returns false (and drops `slot`) if the
    /// table holds that key already. For the agent core.
    pub fn insert(&self, slot: Slot) -> bool {
        let table = self.table;
        let mut w = table.writer.lock();
        let key = slot.key_ref();
        let h = table.hash(key);
        let mut cells = self.array();
        if (table.len() + w.tombstones + 1) * 4 > (cells.mask + 1) * 3 {
            self.resize(&mut w, table.len() + 1);
            cells = self.array();
        }
        if self.find(cells, key, h).is_some() {
            return false;
        }
        let tag = (h >> 60) as usize & TAG_MASK;
        let mut i = h as usize & cells.mask;
        loop {
            let cell = &cells.cells[i];
            match decode(cell.load(Ordering::Relaxed)) {
                Cell::Live(..) => i = (i + 1) & cells.mask,
                found => {
                    if matches!(found, Cell::Tombstone) {
                        w.tombstones -= 1;
                    }
                    let p = slot.into_raw();
                    debug_assert_eq!(p.addr() & TAG_MASK, 0, "slot blocks are 16-aligned");
                    let p = p.map_addr(|a| a | tag);
                    // Release: a reader that loads the address sees the
                    // slot as it was made.
                    cell.store(p, Ordering::Release);
                    table.len.fetch_add(1, Ordering::Relaxed);
                    return true;
                }
            }
        }
    }

    /// Forget `key`'s slot: its cell becomes a tombstone and the table's
    /// handle is released once no reader can still be looking at it.
    /// Returns whether the table held the key. For the agent core.
    pub fn remove(&self, key: &Lookup<'_>) -> bool {
        let table = self.table;
        let mut w = table.writer.lock();
        let cells = self.array();
        let h = table.hash(key.0);
        let Some((i, _)) = self.find(cells, key.0, h) else {
            return false;
        };
        let old = cells.cells[i].swap(tombstone(), Ordering::AcqRel);
        table.len.fetch_sub(1, Ordering::Relaxed);
        w.tombstones += 1;
        let Cell::Live(p, _) = decode(old) else {
            unreachable!("only the writer changes cells, and it found this one live")
        };
        // SAFETY: `p` is the table's handle, now in no cell of the current
        // array; older arrays were retired before (and only guards older
        // than their retirement can reach them, which are older than this
        // retirement too). Deferred: this guard may still read it.
        unsafe { self.guard.defer_retire(p, drop_slot) };
        let len = table.len();
        if w.tombstones * 4 > cells.mask + 1
            || (len * 16 < cells.mask + 1 && cells.mask >= MIN_CELLS)
        {
            self.resize(&mut w, len);
        }
        true
    }

    /// Rebuild the array for `len` keys (at most half full), dropping the
    /// tombstones, publish it and retire the old one.
    fn resize(&self, w: &mut Writer, len: usize) {
        let table = self.table;
        let old = self.array();
        let new = Cells::new((2 * len).next_power_of_two().max(MIN_CELLS));
        for c in old.cells.iter() {
            let v = c.load(Ordering::Relaxed);
            if let Cell::Live(p, _) = decode(v) {
                // SAFETY: a live cell's slot, alive (the table's handle).
                let s = unsafe { Slot::borrow_raw(p) };
                let mut i = table.hash(s.key_ref()) as usize & new.mask;
                while !new.cells[i].load(Ordering::Relaxed).is_null() {
                    i = (i + 1) & new.mask;
                }
                // The handle moves to the new array, tag and all.
                new.cells[i].store(v, Ordering::Relaxed);
            }
        }
        // Release: a reader that loads the new array sees its cells.
        let old = table.cells.swap(Box::into_raw(new), Ordering::AcqRel);
        w.tombstones = 0;
        // SAFETY: `old` is no longer reachable by a new guard (the swap
        // above); it was made by `Box::into_raw`; its handles now belong
        // to the new array, and `drop_cells` does not touch them.
        unsafe { self.guard.defer_retire(old, drop_cells) };
        // The collector frees a thread's retirements in batches of at least
        // one entry per active thread (32 by default): an array retired
        // alone would wait for 31 more removals on this thread, which a
        // table that only grows never makes. Fill the batch with entries
        // that free nothing, so the old array goes once the guards that
        // may read it are gone.
        for _ in 0..RETIRE_BATCH {
            // SAFETY: a dangling, never-shared pointer, and a reclaimer
            // that ignores it.
            unsafe {
                self.guard
                    .defer_retire(std::ptr::NonNull::<u8>::dangling().as_ptr(), free_nothing)
            };
        }
        self.guard.flush();
    }
}

#[cfg(all(test, not(quotalease_loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

    fn key(i: usize) -> String {
        format!("t{i}")
    }

    /// Inserts, lookups, removals and resizes against a reference set: the
    /// table finds exactly the keys held, grows and shrinks, and drops
    /// every handle it took once removed (and when dropped).
    #[test]
    fn agrees_with_a_set_through_growth_and_removal() {
        let table = Table::new();
        let mut mine: Vec<Slot> = Vec::new();
        {
            let t = table.pin();
            for i in 0..5_000 {
                let s = Slot::new("r", &key(i), "");
                assert!(t.insert(s.clone()));
                mine.push(s);
            }
            assert_eq!(t.len(), 5_000);
            assert!(table.capacity() >= 5_000 * 4 / 3);
            for (i, s) in mine.iter().enumerate() {
                let k = key(i);
                let got = t
                    .get(&Lookup(KeyRef::new("r", &k, "")))
                    .map(|s| s.to_owned());
                assert_eq!(got.as_ref(), Some(s));
            }
            assert!(t.get(&Lookup(KeyRef::new("r", "absent", ""))).is_none());
            assert!(t.get(&Lookup(KeyRef::new("q", "t1", ""))).is_none());
            for i in (0..5_000).step_by(2) {
                let k = key(i);
                assert!(t.remove(&Lookup(KeyRef::new("r", &k, ""))));
                assert!(!t.remove(&Lookup(KeyRef::new("r", &k, ""))));
            }
            assert_eq!(t.len(), 2_500);
            assert_eq!(t.iter().count(), 2_500);
            for i in 0..5_000 {
                let k = key(i);
                let found = t.get(&Lookup(KeyRef::new("r", &k, ""))).is_some();
                assert_eq!(found, i % 2 == 1, "{k}");
            }
            for i in (1..5_000).step_by(2) {
                let k = key(i);
                assert!(t.remove(&Lookup(KeyRef::new("r", &k, ""))));
            }
            assert!(t.is_empty());
        }
        assert!(table.capacity() < 1024, "shrank: {}", table.capacity());
        let t = table.pin();
        assert!(t.insert(Slot::new("r", "again", "")));
        drop(t);
        drop(table);
        // Every handle the table took came back (retired ones through the
        // collector, live ones at the drop): ours are the last.
        for s in &mine {
            assert_eq!(s.refs.load(Ordering::Relaxed), 1);
        }
    }

    /// Readers on 3 threads look keys up while the writer inserts, removes
    /// and re-creates them (resizing all along): a reader only ever gets
    /// the slot of the key it asked for, alive (its lease word readable),
    /// and a key that is held throughout is always found. Run under
    /// `--release` for more interleavings.
    #[test]
    fn readers_race_a_writer_and_only_see_live_slots_of_their_key() {
        const KEYS: usize = 2_000;
        let table = Arc::new(Table::new());
        let stop = Arc::new(AtomicBool::new(false));
        // Keys 0..100 stay held: a reader must always find them.
        {
            let t = table.pin();
            for i in 0..100 {
                t.insert(Slot::new("r", &key(i), ""));
            }
        }
        let readers: Vec<_> = (0..3)
            .map(|r| {
                let (table, stop) = (table.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ r;
                    let (mut hits, mut lookups) = (0u64, 0u64);
                    while !stop.load(Ordering::Relaxed) {
                        let t = table.pin();
                        for _ in 0..64 {
                            x ^= x << 13;
                            x ^= x >> 7;
                            x ^= x << 17;
                            let i = (x % KEYS as u64) as usize;
                            let k = key(i);
                            lookups += 1;
                            match t.get(&Lookup(KeyRef::new("r", &k, ""))) {
                                Some(s) => {
                                    hits += 1;
                                    assert_eq!(s.tenant(), k);
                                    let _ = s.word.load_raw();
                                    if x.is_multiple_of(7) {
                                        drop(s.to_owned());
                                    }
                                }
                                None => assert!(i >= 100, "held key {k} not found"),
                            }
                        }
                    }
                    (hits, lookups)
                })
            })
            .collect();
        let mut x = 12345u64;
        for _ in 0..60_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let i = 100 + (x % (KEYS as u64 - 100)) as usize;
            let k = key(i);
            let t = table.pin();
            if t.get(&Lookup(KeyRef::new("r", &k, ""))).is_some() {
                assert!(t.remove(&Lookup(KeyRef::new("r", &k, ""))));
            } else {
                assert!(t.insert(Slot::new("r", &k, "")));
            }
        }
        stop.store(true, Ordering::Relaxed);
        for r in readers {
            let (hits, lookups) = r.join().unwrap();
            assert!(hits > 0 && lookups > 0);
        }
        let held = table.pin().iter().count();
        assert_eq!(held, table.len());
    }

    /// xorshift64.
    fn next(x: &mut u64) -> u64 {
        *x ^= *x << 13;
        *x ^= *x >> 7;
        *x ^= *x << 17;
        *x
    }

    /// Readers look keys up, take handles of their own (kept for a while,
    /// some carried out of the thread when it ends, some dropped when it
    /// ends) while the writer grows the table to thousands of keys, removes
    /// nearly all (shrinking it), re-creates them (new slots), and churns
    /// single keys (tombstone rebuilds). Every handle a reader took reads
    /// its own key; once the table is gone, handles carried out are the
    /// last of their blocks. Run it under AddressSanitizer to catch a
    /// handle freed under a reader.
    #[test]
    fn owned_handles_survive_removals_and_resizes_both_ways() {
        const KEYS: usize = 3_000;
        let table = Arc::new(Table::new());
        let stop = Arc::new(AtomicBool::new(false));
        let readers: Vec<_> = (0..3u64)
            .map(|r| {
                let (table, stop) = (table.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mut x = 0x2545_f491_4f6c_dd1du64 ^ (r + 1);
                    let mut kept: Vec<Slot> = Vec::new();
                    let mut carried: Vec<Slot> = Vec::new();
                    let mut rounds = 0u64;
                    // At least some rounds, however fast the writer is.
                    while rounds < 200 || !stop.load(Ordering::Relaxed) {
                        rounds += 1;
                        let t = table.pin();
                        for _ in 0..32 {
                            let i = (next(&mut x) % KEYS as u64) as usize;
                            let k = key(i);
                            if let Some(s) = t.get(&Lookup(KeyRef::new("r", &k, ""))) {
                                assert_eq!(s.tenant(), k);
                                let _ = s.word.load_raw();
                                let owned = s.to_owned();
                                assert_eq!(owned.tenant(), k);
                                if kept.len() < 64 {
                                    kept.push(owned);
                                } else {
                                    let j = (x % 64) as usize;
                                    kept[j] = owned;
                                }
                            }
                        }
                        drop(t);
                        // Handles kept across guards still read their key.
                        for s in &kept {
                            assert!(s.tenant().starts_with('t'));
                            let _ = s.word.deadline_ns();
                        }
                        if rounds.is_multiple_of(50) && carried.len() < 256 {
                            carried.append(&mut kept);
                        }
                    }
                    // `kept` is dropped as the thread ends; `carried`
                    // outlives it.
                    carried
                })
            })
            .collect();
        let mut x = 99u64;
        for phase in 0..6 {
            {
                let t = table.pin();
                for i in 0..KEYS {
                    t.insert(Slot::new("r", &key(i), ""));
                }
                assert_eq!(t.len(), KEYS);
            }
            // Churn: single keys out and back in (tombstones, rebuilds).
            for _ in 0..2_000 {
                let i = (next(&mut x) % KEYS as u64) as usize;
                let k = key(i);
                let t = table.pin();
                if !t.remove(&Lookup(KeyRef::new("r", &k, ""))) {
                    assert!(t.insert(Slot::new("r", &k, "")));
                }
            }
            // Nearly all out: the table shrinks (keep a few on odd phases).
            let t = table.pin();
            for i in 0..KEYS {
                if phase % 2 == 0 || i % 100 != 0 {
                    t.remove(&Lookup(KeyRef::new("r", &key(i), "")));
                }
            }
            drop(t);
            assert!(table.capacity() <= 256, "shrank: {}", table.capacity());
        }
        stop.store(true, Ordering::Relaxed);
        let carried: Vec<Slot> = readers
            .into_iter()
            .flat_map(|r| r.join().expect("a reader panicked"))
            .collect();
        assert!(!carried.is_empty());
        drop(table);
        // A reader may have taken several handles to one block.
        let mut handles = std::collections::HashMap::<usize, u32>::new();
        for s in &carried {
            *handles.entry(s.addr()).or_default() += 1;
        }
        for s in &carried {
            assert!(s.tenant().starts_with('t'));
            assert_eq!(
                s.refs.load(Ordering::Relaxed),
                handles[&s.addr()],
                "{:?}",
                s.tenant()
            );
        }
    }

    /// A reader pins one guard, borrows the slots of every key, and keeps
    /// them while another thread removes every key, re-creates them and
    /// resizes the table many times over (hundreds of retirements, in full
    /// batches): every borrowed slot stays readable, with its own key,
    /// until the guard goes. Afterwards the retired handles are released:
    /// handles the reader took then are (nearly all) the last.
    #[test]
    fn a_long_guard_keeps_every_retired_slot_readable() {
        const KEYS: usize = 1_000;
        let table = Arc::new(Table::new());
        {
            let t = table.pin();
            for i in 0..KEYS {
                t.insert(Slot::new("r", &key(i), ""));
            }
        }
        let (pinned_tx, pinned_rx) = std::sync::mpsc::channel::<()>();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let reader = {
            let table = table.clone();
            std::thread::spawn(move || {
                let t = table.pin();
                let borrowed: Vec<SlotRef<'_>> = (0..KEYS)
                    .map(|i| t.get(&Lookup(KeyRef::new("r", &key(i), ""))).expect("held"))
                    .collect();
                let owned: Vec<Slot> = borrowed.iter().map(|&s| s.to_owned()).collect();
                pinned_tx.send(()).unwrap();
                done_rx.recv().unwrap();
                for (i, s) in borrowed.iter().enumerate() {
                    assert_eq!(s.tenant(), key(i));
                    let _ = s.word.load_raw();
                    // Still a slot with a handle: the table's (retired,
                    // not yet released) and ours.
                    assert!(s.refs.load(Ordering::Relaxed) >= 2);
                    // Nothing of the table's is current under this guard
                    // any more (every key has a new slot).
                    let now = t.get(&Lookup(KeyRef::new("r", &key(i), "")));
                    assert!(now.is_some_and(|n| !std::ptr::eq(n.head(), s.head())));
                }
                drop(borrowed);
                drop(t);
                owned
            })
        };
        pinned_rx.recv().unwrap();
        let writer = {
            let table = table.clone();
            std::thread::spawn(move || {
                for _ in 0..5 {
                    let t = table.pin();
                    for i in 0..KEYS {
                        assert!(t.remove(&Lookup(KeyRef::new("r", &key(i), ""))));
                    }
                    for i in 0..KEYS {
                        assert!(t.insert(Slot::new("r", &key(i), "")));
                    }
                }
            })
        };
        writer.join().expect("the writer panicked");
        done_tx.send(()).unwrap();
        let owned = reader.join().expect("the reader panicked");
        // The reader's guard was the last to see the first slots: its exit
        // released the retired batches. Only a writer's batch not yet full
        // (fewer than the collector's batch size) may still hold some.
        let pending = owned
            .iter()
            .filter(|s| s.refs.load(Ordering::Relaxed) != 1)
            .count();
        assert!(pending < 64, "{pending} retired handles not released");
        drop(table);
        assert!(owned.iter().all(|s| s.refs.load(Ordering::Relaxed) == 1));
    }
}

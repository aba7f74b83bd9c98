//! The agent's lease table: the hot path.
//!
//! Each key has a [`Slot`](crate::agent::Slot) whose lease lives in one `AtomicU64` word:
//! `[generation: 24 bits | tokens: 40 bits]`, plus the lease's deadline on
//! the agent clock in a second atomic. A decision with a lease held is
//! `load deadline, load word, compare_exchange_weak` — no lock, no
//! allocation, no await; a denial writes nothing.
//!
//! Ordering. A checker reads the deadline *before* the word; an installer
//! swaps the word (new generation) *before* storing the new deadline. So a
//! checker that saw the new deadline also sees the new word; a checker that
//! saw the old deadline and then wins its CAS on the old generation spent
//! from the old lease while the old deadline was valid at the time it read
//! the clock (the stall between that read and the CAS is covered by
//! `epsilon`, see docs/protocol.md). A checker that read the old deadline
//! and the new word uses the new lease under the earlier deadline of the
//! two only if renewals never shorten deadlines, which the installer
//! guarantees by refusing leases whose deadline already passed.
//!
//! Refunds (a request matched several rules and a later one denied) go back
//! only into the generation they were taken from; a refund into a replaced
//! or retired lease is dropped.

#[cfg(quotalease_loom)]
use loom::sync::atomic::AtomicU64;
#[cfg(not(quotalease_loom))]
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;

const TOKEN_BITS: u32 = 40;
const TOKEN_MASK: u64 = (1 << TOKEN_BITS) - 1;
const GEN_MASK: u64 = (1 << (64 - TOKEN_BITS)) - 1;

/// Largest token count a lease word holds.
pub const MAX_WORD_TOKENS: u64 = TOKEN_MASK;

/// Pack a generation and a token count.
#[inline]
pub const fn pack(generation: u64, tokens: u64) -> u64 {
    ((generation & GEN_MASK) << TOKEN_BITS) | (tokens & TOKEN_MASK)
}

/// Split a word into (generation, tokens).
#[inline]
pub const fn unpack(word: u64) -> (u64, u64) {
    (word >> TOKEN_BITS, word & TOKEN_MASK)
}

/// Outcome of one consumption attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Take {
    /// Charged; the generation charged and the tokens left.
    Taken {
        /// Generation the tokens came from (for a refund).
        generation: u64,
        /// Tokens left in the lease.
        remaining: u64,
    },
    /// The lease is valid but holds fewer tokens than the cost.
    Short {
        /// Tokens the lease holds.
        remaining: u64,
    },
    /// No valid lease (none installed, expired or retired).
    NoLease,
}

/// The atomic part of a key's lease: the word and its deadline, side by
/// side (a decision reads the deadline and CASes the word), 64 bytes into
/// the key's [`Slot`] block, whose own bytes fill the word's cache line
/// wherever the block starts: two keys' words never share a line, nor does
/// any other allocation; the slot's other fields on that line are written
/// only on slow paths and by the core (at most once a renew interval).
#[derive(Debug)]
#[repr(C)]
pub struct LeaseWord {
    word: AtomicU64,
    deadline_ns: AtomicU64,
}

impl Default for LeaseWord {
    fn default() -> Self {
        Self::new()
    }
}

impl LeaseWord {
    /// An empty word: generation 0, no tokens, deadline 0 (expired).
    pub fn new() -> Self {
        Self {
            word: AtomicU64::new(0),
            deadline_ns: AtomicU64::new(0),
        }
    }

    /// The hot path: take `cost` tokens at `now_ns` if a valid lease holds them.
    #[inline]
    pub fn try_take(&self, cost: u64, now_ns: u64) -> Take {
        if now_ns >= self.deadline_ns.load(Ordering::Acquire) {
            return Take::NoLease;
        }
        let mut w = self.word.load(Ordering::Acquire);
        loop {
            let (generation, tokens) = unpack(w);
            if tokens < cost {
                return Take::Short { remaining: tokens };
            }
            let next = pack(generation, tokens - cost);
            match self
                .word
                .compare_exchange_weak(w, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    return Take::Taken {
                        generation,
                        remaining: tokens - cost,
                    }
                }
                Err(seen) => w = seen,
            }
        }
    }

    /// Tokens of a valid lease at `now_ns` (None when there is none). Reads only.
    pub fn peek(&self, now_ns: u64) -> Option<u64> {
        if now_ns >= self.deadline_ns.load(Ordering::Acquire) {
            return None;
        }
        Some(unpack(self.word.load(Ordering::Acquire)).1)
    }

    /// Give `cost` back to `generation`; dropped if the lease was replaced
    /// or retired meanwhile. Returns whether it was applied.
    pub fn refund(&self, generation: u64, cost: u64) -> bool {
        let mut w = self.word.load(Ordering::Acquire);
        loop {
            let (g, tokens) = unpack(w);
            if g != generation & GEN_MASK {
                return false;
            }
            let next = pack(g, (tokens + cost).min(TOKEN_MASK));
            match self
                .word
                .compare_exchange_weak(w, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return true,
                Err(seen) => w = seen,
            }
        }
    }

    /// Current (generation, tokens).
    pub fn load(&self) -> (u64, u64) {
        unpack(self.word.load(Ordering::Acquire))
    }

    /// Deadline of the current lease.
    pub fn deadline_ns(&self) -> u64 {
        self.deadline_ns.load(Ordering::Acquire)
    }

    /// Replace the lease: compute the new token count from the current one
    /// (which may still be falling under concurrent checks) and bump the
    /// generation, then publish the deadline. Returns (old tokens seen,
    /// new generation, new tokens). Callers serialize installs per key.
    pub fn install(&self, deadline_ns: u64, tokens_from: impl Fn(u64) -> u64) -> (u64, u64, u64) {
        let mut w = self.word.load(Ordering::Acquire);
        loop {
            let (g, tokens) = unpack(w);
            let new_tokens = tokens_from(tokens).min(TOKEN_MASK);
            let new_gen = (g + 1) & GEN_MASK;
            match self.word.compare_exchange_weak(
                w,
                pack(new_gen, new_tokens),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    self.deadline_ns.store(deadline_ns, Ordering::Release);
                    return (tokens, new_gen, new_tokens);
                }
                Err(seen) => w = seen,
            }
        }
    }

    /// Retire the lease: no tokens, expired. Returns (the tokens it held
    /// when retired, the new generation); nothing can be taken from it, or
    /// refunded into it, afterwards.
    pub fn retire(&self) -> (u64, u64) {
        self.deadline_ns.store(0, Ordering::Release);
        let (old, generation, _) = self.install(0, |_| 0);
        (old, generation)
    }

    /// Start a new generation holding the same tokens under the same
    /// deadline: charges taken before this point can no longer be refunded.
    /// Used when the tokens spent so far are reported to the allocator.
    /// Returns (tokens at the cut, new generation).
    pub fn cut(&self) -> (u64, u64) {
        let deadline = self.deadline_ns.load(Ordering::Acquire);
        let (seen, generation, _) = self.install(deadline, |cur| cur);
        (seen, generation)
    }
}

// ---------------------------------------------------------------------------
// Keys and slots

pub use quotalease_model::key::{str_eq, KeyId, KeyRef};

/// A [`KeyRef`] as a lease-table lookup: the table hashes it as it hashes
/// its slots' keys and compares part by part, so a lookup builds nothing.
#[derive(Clone, Copy, Debug, Hash)]
pub struct Lookup<'a>(pub KeyRef<'a>);

impl<'a> Lookup<'a> {
    /// The key of `rule` for a request on (tenant, route).
    #[inline]
    pub fn of(rule: &'a quotalease_model::rules::Rule, tenant: &'a str, route: &'a str) -> Self {
        Self(KeyRef::of(rule, tenant, route))
    }
}

/// The fixed part of a key's [`Slot`], at the start of its one heap block;
/// the key's bytes (rule id, tenant, route) follow it in the same block.
///
/// Three kinds of fields:
///
/// * the lease word (the hot path reads its deadline and CASes it), 64
///   bytes into the block, so that its cache line, wherever the block
///   starts (blocks are 16-aligned, not line-aligned), holds only this
///   block's bytes: no other allocation, hot or not, shares it;
/// * atomics the request slow path reads or writes (`dry_until`, waiting
///   demand, denied demand, the settle count) and the reference count;
/// * words only the agent core reads and writes (`core_a`, `core_b`,
///   `core_flags`): its renewal state of the key, kept here so that a key
///   costs one allocation (SPEC §9 counts the agent's bytes per key held).
///   They are atomics so that a slot can be shared (`Sync`) without
///   `unsafe`; the core accesses them with `Relaxed` ordering, always
///   under its own mutex, which orders its accesses, and writes a word
///   only when its value changed (at most once a visit, every renew
///   interval for a busy key).
#[derive(Debug)]
#[repr(C)]
pub struct SlotHead {
    /// The allocator said the bucket is dry until then (ns; bit 63: the
    /// allocator is still opening this never-leased key upstream).
    dry_until_ns: std::sync::atomic::AtomicU64,
    /// Sum of the costs of requests waiting for this key's next grant.
    waiting_cost: std::sync::atomic::AtomicU64,
    /// Tokens asked for but denied since the last visit (demand the lease
    /// could not serve).
    denied: std::sync::atomic::AtomicU64,
    /// Where the tenant and the route parts start in the key bytes, and
    /// their total length.
    tenant_at: u16,
    route_at: u16,
    key_len: u16,
    /// Core-owned flags (see [`crate::core`]).
    pub(crate) core_flags: std::sync::atomic::AtomicU16,
    /// Handles ([`Slot`]) to this block.
    refs: std::sync::atomic::AtomicU32,
    /// Counts the key's batches settled (answered or given up on): a parked
    /// request waits until it moves past what it saw when it registered.
    settles: std::sync::atomic::AtomicU32,
    /// Core-owned words 0-2 of the key's renewal state, packed (see
    /// [`crate::core`]). Nothing but the core touches them.
    core_a: [std::sync::atomic::AtomicU64; 3],
    /// The lease word (hot path), 64 bytes in.
    pub word: LeaseWord,
    /// Core-owned words 3-7.
    core_b: [std::sync::atomic::AtomicU64; 5],
}

/// Offset of the lease word in a slot's block.
pub const WORD_OFFSET: usize = std::mem::offset_of!(SlotHead, word);
const _: () = assert!(
    WORD_OFFSET == 64,
    "the word's line holds only its own block"
);

impl SlotHead {
    /// Core-owned word `i` (0..8) of the key's renewal state.
    #[inline]
    pub(crate) fn core(&self, i: usize) -> &std::sync::atomic::AtomicU64 {
        match i {
            0..3 => &self.core_a[i],
            _ => &self.core_b[i - 3],
        }
    }
}

const OPENING_BIT: u64 = 1 << 63;
/// Bytes of the fixed part of a slot; the key's bytes start there.
pub const SLOT_HEAD_BYTES: usize = std::mem::size_of::<SlotHead>();
/// Alignment of a slot's block: 16, so a table can keep a 4-bit tag in the
/// low bits of a slot's address.
pub const SLOT_ALIGN: usize = 16;

/// One key held by the agent: a counted handle to its block (one heap
/// allocation holding [`SlotHead`] and the key's bytes; a thin pointer).
/// What the request path reads and writes is atomics only; the renewal
/// side of the key lives in the same block, in words only the agent core
/// ([`crate::core`]) touches, and the core alone installs, cuts and
/// retires the word. No waker of its own: requests parked on a key wait
/// on the agent's striped wakers, keyed by [`Slot::addr`].
///
/// Two handles are equal when they are handles to the same block: a key
/// forgotten and created again has a new slot, so a late refund cannot
/// land in it.
pub struct Slot {
    ptr: std::ptr::NonNull<SlotHead>,
}

// SAFETY: a slot's block holds only atomics and integers that never change
// after creation (the key's offsets and bytes), so sharing and sending
// handles across threads is as safe as sharing `&SlotHead` and `&[u8]`;
// the block is freed only by the last handle's drop (see `Drop`).
unsafe impl Send for Slot {}
// SAFETY: as above.
unsafe impl Sync for Slot {}

impl Slot {
    /// Bytes of the heap block of a slot whose key has `key_len` bytes (for
    /// memory accounting: `examples/agent_memory.rs` prints it).
    pub fn block_bytes(key_len: usize) -> usize {
        Self::layout(key_len).size()
    }

    /// The layout of a block with a key of `key_len` bytes.
    ///
    /// Not padded to its alignment: no Rust value spans the whole block
    /// (the head is a `SlotHead`, the rest bytes), and the allocator then
    /// rounds only once (glibc's 16-byte chunks).
    fn layout(key_len: usize) -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(
            SLOT_HEAD_BYTES + key_len,
            SLOT_ALIGN.max(std::mem::align_of::<SlotHead>()),
        )
        .expect("a slot block is small")
    }

    /// An empty slot for a key. Parts are ids of at most
    /// `MAX_ID_BYTES` (256) bytes each, so their offsets fit 16 bits.
    pub fn new(rule_id: &str, tenant: &str, route: &str) -> Self {
        use std::sync::atomic::{AtomicU16, AtomicU32, AtomicU64};
        let offset = |n: usize| u16::try_from(n).expect("key parts are ids of at most 256 bytes");
        let len = rule_id.len() + tenant.len() + route.len();
        let head = SlotHead {
            dry_until_ns: AtomicU64::new(0),
            waiting_cost: AtomicU64::new(0),
            denied: AtomicU64::new(0),
            tenant_at: offset(rule_id.len()),
            route_at: offset(rule_id.len() + tenant.len()),
            key_len: offset(len),
            core_flags: AtomicU16::new(0),
            refs: AtomicU32::new(1),
            settles: AtomicU32::new(0),
            core_a: Default::default(),
            word: LeaseWord::new(),
            core_b: Default::default(),
        };
        let layout = Self::layout(len);
        // SAFETY: the layout has a non-zero size (the head alone is more
        // than 100 bytes).
        let block = unsafe { std::alloc::alloc(layout) };
        let Some(ptr) = std::ptr::NonNull::new(block) else {
            std::alloc::handle_alloc_error(layout)
        };
        // SAFETY: `block` is valid for writes of `layout.size()` =
        // SLOT_HEAD_BYTES + len bytes (at least) and aligned for
        // `SlotHead`; the head goes first, the parts after it, each copied
        // from a `&str` that cannot overlap a fresh allocation.
        unsafe {
            block.cast::<SlotHead>().write(head);
            let mut at = block.add(SLOT_HEAD_BYTES);
            for part in [rule_id, tenant, route] {
                std::ptr::copy_nonoverlapping(part.as_ptr(), at, part.len());
                at = at.add(part.len());
            }
        }
        Self { ptr: ptr.cast() }
    }

    /// A borrowed view of this slot.
    #[inline]
    pub fn borrow(&self) -> SlotRef<'_> {
        SlotRef {
            ptr: self.ptr,
            _life: std::marker::PhantomData,
        }
    }

    /// The key, borrowed.
    #[inline]
    pub fn key_ref(&self) -> KeyRef<'_> {
        self.borrow().key_ref()
    }
    /// The rule id of the key.
    #[inline]
    pub fn rule_id(&self) -> &str {
        self.borrow().rule_id()
    }
    /// The tenant part of the key.
    #[inline]
    pub fn tenant(&self) -> &str {
        self.borrow().tenant()
    }
    /// The route part of the key.
    #[inline]
    pub fn route(&self) -> &str {
        self.borrow().route()
    }

    /// The block's address: unique among live slots (a forgotten key's
    /// slot lives on while a handle to it does), stable for its life.
    #[inline]
    pub fn addr(&self) -> usize {
        self.ptr.as_ptr().addr()
    }

    /// Give up this handle as a raw pointer to its block (for a table);
    /// [`Slot::from_raw`] takes it back.
    pub(crate) fn into_raw(self) -> *mut u8 {
        let p = self.ptr.as_ptr().cast::<u8>();
        std::mem::forget(self);
        p
    }

    /// The handle [`Slot::into_raw`] gave up.
    ///
    /// # Safety
    ///
    /// `p` came from [`Slot::into_raw`] and is passed here once.
    pub(crate) unsafe fn from_raw(p: *mut u8) -> Self {
        // SAFETY: per the contract, `p` is a live block's non-null address.
        Self {
            ptr: unsafe { std::ptr::NonNull::new_unchecked(p.cast()) },
        }
    }

    /// A borrowed view of the block at `p`.
    ///
    /// # Safety
    ///
    /// `p` is a block's address (from [`Slot::into_raw`]) whose handle
    /// stays alive for `'a`.
    pub(crate) unsafe fn borrow_raw<'a>(p: *mut u8) -> SlotRef<'a> {
        SlotRef {
            // SAFETY: per the contract, `p` is non-null.
            ptr: unsafe { std::ptr::NonNull::new_unchecked(p.cast()) },
            _life: std::marker::PhantomData,
        }
    }
}

impl Clone for Slot {
    #[inline]
    fn clone(&self) -> Self {
        self.borrow().to_owned()
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        use std::sync::atomic::{fence, Ordering};
        // As `std::sync::Arc`: the decrement releases this handle's
        // accesses; the last one acquires all the others' before freeing.
        if self.refs.fetch_sub(1, Ordering::Release) != 1 {
            return;
        }
        fence(Ordering::Acquire);
        let layout = Self::layout(usize::from(self.key_len));
        // SAFETY: this was the last handle, so nothing else can reach the
        // block; it was allocated in `Slot::new` with this very layout
        // (same key length). `SlotHead` holds atomics and integers only:
        // there is nothing to drop in place.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr().cast(), layout) }
    }
}

impl std::ops::Deref for Slot {
    type Target = SlotHead;
    #[inline]
    fn deref(&self) -> &SlotHead {
        // SAFETY: the block lives as long as this handle does.
        unsafe { self.ptr.as_ref() }
    }
}

impl PartialEq for Slot {
    fn eq(&self, other: &Self) -> bool {
        self.ptr == other.ptr
    }
}
impl Eq for Slot {}

/// By block, as equality (the table finds slots by key).
impl std::hash::Hash for Slot {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        self.addr().hash(h)
    }
}

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slot")
            .field("key", &self.key_ref())
            .field("word", &self.word.load())
            .field("deadline_ns", &self.word.deadline_ns())
            .finish()
    }
}

/// A borrowed slot: valid while some handle to it lives for `'a` (a
/// table's guard, or a [`Slot`]). Reads like a `&Slot`.
#[derive(Clone, Copy)]
pub struct SlotRef<'a> {
    ptr: std::ptr::NonNull<SlotHead>,
    _life: std::marker::PhantomData<&'a SlotHead>,
}

// SAFETY: as for `Slot`: a view of atomics and immutable bytes.
unsafe impl Send for SlotRef<'_> {}
// SAFETY: as above.
unsafe impl Sync for SlotRef<'_> {}

impl<'a> SlotRef<'a> {
    /// The head, for `'a`.
    #[inline]
    pub fn head(self) -> &'a SlotHead {
        // SAFETY: the block lives for 'a (the type's contract).
        unsafe { self.ptr.as_ref() }
    }

    /// The key's bytes (rule id, tenant, route).
    #[inline]
    fn key_bytes(self) -> &'a [u8] {
        let len = usize::from(self.head().key_len);
        // SAFETY: the block holds `len` initialized key bytes right after
        // the head (written in `Slot::new`, never changed), and lives for
        // 'a. The pointer is the block's own (not derived from a reference
        // to the head), so it may reach past the head.
        unsafe {
            std::slice::from_raw_parts(self.ptr.as_ptr().cast::<u8>().add(SLOT_HEAD_BYTES), len)
        }
    }

    /// Bytes `from..to` of the key as a string.
    #[inline]
    fn part(self, from: u16, to: u16) -> &'a str {
        let bytes = &self.key_bytes()[usize::from(from)..usize::from(to)];
        // SAFETY: the key's bytes are three `&str`s copied one after the
        // other, and `from..to` is one of them (their boundaries are
        // `tenant_at`, `route_at` and `key_len`): valid UTF-8.
        unsafe { std::str::from_utf8_unchecked(bytes) }
    }

    /// The rule id of the key.
    #[inline]
    pub fn rule_id(self) -> &'a str {
        self.part(0, self.head().tenant_at)
    }
    /// The tenant part of the key.
    #[inline]
    pub fn tenant(self) -> &'a str {
        let h = self.head();
        self.part(h.tenant_at, h.route_at)
    }
    /// The route part of the key.
    #[inline]
    pub fn route(self) -> &'a str {
        let h = self.head();
        self.part(h.route_at, h.key_len)
    }
    /// The key, borrowed.
    #[inline]
    pub fn key_ref(self) -> KeyRef<'a> {
        KeyRef::new(self.rule_id(), self.tenant(), self.route())
    }

    /// A handle of its own to this slot.
    #[inline]
    pub fn to_owned(self) -> Slot {
        // Relaxed as in `std::sync::Arc::clone`: a new handle is made from
        // a live one, which keeps the block alive meanwhile.
        let old = self
            .head()
            .refs
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if old > u32::MAX / 2 {
            // Never in practice (handles are per key and thread); as
            // `Arc`, abort rather than risk an overflow.
            std::process::abort();
        }
        Slot { ptr: self.ptr }
    }
}

impl std::ops::Deref for SlotRef<'_> {
    type Target = SlotHead;
    #[inline]
    fn deref(&self) -> &SlotHead {
        self.head()
    }
}

impl SlotHead {
    /// Until when the allocator said the bucket is dry.
    pub fn dry_until(&self) -> u64 {
        self.dry_until_ns.load(Ordering::Acquire) & !OPENING_BIT
    }
    pub(crate) fn set_dry_until(&self, t: u64) {
        let t = t.min(!OPENING_BIT);
        let _ = self
            .dry_until_ns
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                Some((v & OPENING_BIT) | t)
            });
    }
    /// Whether the allocator is still opening the key upstream.
    pub fn opening(&self) -> bool {
        self.dry_until_ns.load(Ordering::Acquire) & OPENING_BIT != 0
    }
    pub(crate) fn set_opening(&self, v: bool) {
        if v {
            self.dry_until_ns.fetch_or(OPENING_BIT, Ordering::AcqRel);
        } else {
            self.dry_until_ns.fetch_and(!OPENING_BIT, Ordering::AcqRel);
        }
    }
    /// How many of the key's batches have settled (wrapping: a waiter only
    /// asks whether it moved).
    pub fn settles(&self) -> u32 {
        self.settles.load(Ordering::Acquire)
    }
    pub(crate) fn note_settled(&self) {
        self.settles.fetch_add(1, Ordering::AcqRel);
    }
    pub(crate) fn add_waiting(&self, cost: u64) {
        self.waiting_cost.fetch_add(cost, Ordering::AcqRel);
    }
    pub(crate) fn waiting(&self) -> u64 {
        self.waiting_cost.load(Ordering::Acquire)
    }
    pub(crate) fn clear_waiting(&self) {
        self.waiting_cost.store(0, Ordering::Release)
    }
    pub(crate) fn add_denied(&self, cost: u64) {
        self.denied.fetch_add(cost, Ordering::Relaxed);
    }
    pub(crate) fn denied_peek(&self) -> u64 {
        self.denied.load(Ordering::Relaxed)
    }
    pub(crate) fn take_denied(&self) -> u64 {
        self.denied.swap(0, Ordering::Relaxed)
    }
}

impl Slot {
    /// A RELEASE item for this key.
    pub(crate) fn release_item(
        &self,
        lease_id: u64,
        spent: u64,
    ) -> quotalease_proto::lease::LeaseItem {
        use quotalease_proto::lease::{ItemKind, LeaseItem};
        LeaseItem {
            rule_id: self.rule_id().to_string(),
            tenant: self.tenant().to_string(),
            route: self.route().to_string(),
            kind: ItemKind::Release as i32,
            lease_id,
            spent,
            want: 0,
            ..LeaseItem::default()
        }
    }
}

mod table;
pub use table::{Pinned, Table};

#[cfg(all(test, not(quotalease_loom)))]
mod tests {
    use super::*;

    #[test]
    fn take_until_short_then_refund_same_generation_only() {
        let w = LeaseWord::new();
        assert_eq!(w.try_take(1, 0), Take::NoLease);
        let (_, g1, t) = w.install(100, |_| 5);
        assert_eq!(t, 5);
        assert_eq!(
            w.try_take(3, 10),
            Take::Taken {
                generation: g1,
                remaining: 2
            }
        );
        assert_eq!(w.try_take(3, 10), Take::Short { remaining: 2 });
        assert!(w.refund(g1, 3));
        assert_eq!(w.load(), (g1, 5));
        // A renewal replaces the lease: a late refund into g1 is dropped.
        let (old, g2, _) = w.install(200, |cur| cur + 10);
        assert_eq!(old, 5);
        assert!(!w.refund(g1, 3));
        assert_eq!(w.load(), (g2, 15));
        // Expiry is checked on every decision.
        assert_eq!(w.try_take(1, 200), Take::NoLease);
        // A cut keeps tokens and deadline but drops refunds of older charges.
        let Take::Taken {
            generation: g2b, ..
        } = w.try_take(1, 150)
        else {
            panic!("lease valid at 150")
        };
        let (seen, g3) = w.cut();
        assert_eq!((seen, w.deadline_ns()), (14, 200));
        assert!(!w.refund(g2b, 1));
        assert_eq!(w.load(), (g3, 14));
        assert_eq!(w.retire().0, 14);
        assert_eq!(w.try_take(1, 10), Take::NoLease);
    }

    /// One block, many handles: parts come back apart (any lengths, any
    /// UTF-8), clones and drops on several threads keep the count exact.
    #[test]
    fn slot_handles_share_one_block() {
        let long = "x".repeat(256);
        for (r, t, u) in [
            ("r", "ab", "c"),
            ("rule", "tenant-\u{e9}", ""),
            ("r", "", ""),
        ] {
            let s = Slot::new(r, t, u);
            assert_eq!((s.rule_id(), s.tenant(), s.route()), (r, t, u));
        }
        let s = Slot::new(&long, &long, &long);
        assert_eq!(
            (s.rule_id(), s.tenant(), s.route()),
            (&*long, &*long, &*long)
        );
        assert_eq!(s.addr() % SLOT_ALIGN, 0);
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let c = s.clone();
                std::thread::spawn(move || {
                    for _ in 0..10_000 {
                        drop(c.clone());
                    }
                    c
                })
            })
            .collect();
        let back: Vec<Slot> = threads.into_iter().map(|h| h.join().unwrap()).collect();
        assert!(back.iter().all(|b| *b == s));
        assert_eq!(s.refs.load(Ordering::Relaxed), 5);
        drop(back);
        assert_eq!(s.refs.load(Ordering::Relaxed), 1);
        assert_ne!(Slot::new("r", "ab", "c"), Slot::new("r", "ab", "c"));
        // The opening flag and the dry instant share a word.
        s.set_dry_until(123);
        s.set_opening(true);
        assert_eq!((s.dry_until(), s.opening()), (123, true));
        s.set_dry_until(7);
        assert_eq!((s.dry_until(), s.opening()), (7, true));
        s.set_opening(false);
        assert_eq!((s.dry_until(), s.opening()), (7, false));
    }

    #[test]
    fn pack_round_trips_at_extremes() {
        assert_eq!(unpack(pack(GEN_MASK, TOKEN_MASK)), (GEN_MASK, TOKEN_MASK));
        assert_eq!(unpack(pack(GEN_MASK + 1, 0)), (0, 0));
    }

    #[test]
    fn concurrent_takes_never_exceed_the_lease() {
        let w = std::sync::Arc::new(LeaseWord::new());
        w.install(u64::MAX, |_| 10_000);
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let w = w.clone();
                std::thread::spawn(move || {
                    let mut n = 0u64;
                    while let Take::Taken { .. } = w.try_take(1, 1) {
                        n += 1;
                    }
                    n
                })
            })
            .collect();
        let total: u64 = handles.into_iter().map(|h| h.join().unwrap()).sum();
        assert_eq!(total, 10_000);
    }
}

#[cfg(all(test, quotalease_loom))]
mod loom_tests {
    //! `RUSTFLAGS="--cfg quotalease_loom" cargo test -p quotalease-agent --release loom`
    use super::*;
    use loom::sync::Arc;
    use loom::thread;

    /// Two takers and a refund racing an install: granted never exceeds
    /// what the leases held, and a stale refund never lands in a new lease.
    #[test]
    fn loom_takes_refunds_and_install() {
        loom::model(|| {
            let w = Arc::new(LeaseWord::new());
            let (_, g1, _) = w.install(100, |_| 2);
            let taker = |w: Arc<LeaseWord>| {
                thread::spawn(move || match w.try_take(1, 1) {
                    Take::Taken { .. } => 1u64,
                    _ => 0,
                })
            };
            let a = taker(w.clone());
            let b = taker(w.clone());
            let w2 = w.clone();
            let c = thread::spawn(move || {
                // Renewal carries the current remainder and adds 1 new token.
                let (seen, _, new_tokens) = w2.install(200, |cur| cur + 1);
                (seen, new_tokens)
            });
            let ta = a.join().unwrap();
            let tb = b.join().unwrap();
            let (seen, new_tokens) = c.join().unwrap();
            let (_, left) = w.load();
            // Old lease: 2 tokens; the install saw `seen` of them still there and
            // carried them plus 1. Everything taken + left == 2 + 1.
            assert_eq!(ta + tb + left, 3, "seen {seen} new {new_tokens}");
            // The install replaced generation g1: a refund into it is dropped.
            assert!(!w.refund(g1, 1));
        });
    }
}

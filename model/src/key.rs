//! Key ids: which bucket a request draws from — the rule id plus the tenant
//! and route parts the rule keys on ("" for a dimension it does not match
//! on). [`KeyId`] is the owned form (allocator ledgers, the agent's lease
//! table, the simulator); [`KeyRef`] the borrowed lookup form, built on the
//! request path without allocating.
//!
//! Both hash alike (the three parts in order; `str` hashing ends each part
//! with 0xff, which UTF-8 never contains, so the parts cannot run into each
//! other) and compare equal part by part, so a map keyed by [`KeyId`] can
//! be searched with a [`KeyRef`] (the agent implements papaya's
//! `Equivalent` on top of this).

use crate::rules::Rule;

/// Identity of one bucket (owned): the rule id, tenant part and route part
/// in one shared allocation. Cloning it is a reference count (the
/// allocator tiers clone a key into every plan, reply and record);
/// comparing two compares the part lengths and then one run of bytes (one
/// pointer a side, where three `String`s were three). Hashes, orders and
/// prints like the struct of three `String`s it replaced (rule, tenant,
/// route, in that order).
#[derive(Clone)]
pub struct KeyId {
    /// `rule`, `tenant` and `route`, one after the other.
    parts: std::sync::Arc<str>,
    rule_len: u32,
    tenant_len: u32,
}

impl KeyId {
    /// A key from its parts (while this thread shares keys, see
    /// [`KeyId::share_on_this_thread`], the one made before with the same
    /// parts).
    pub fn new(rule: impl AsRef<str>, tenant: impl AsRef<str>, route: impl AsRef<str>) -> Self {
        let (rule, tenant, route) = (rule.as_ref(), tenant.as_ref(), route.as_ref());
        // One plain thread-local load when this thread does not share (a
        // production process): the set's cell has a destructor, so every
        // access to it checks whether it was registered.
        if SHARING.get() {
            return Self::shared(rule, tenant, route);
        }
        Self::build(rule, tenant, route)
    }

    /// [`KeyId::new`] while this thread shares keys.
    #[cold]
    #[inline(never)]
    fn shared(rule: &str, tenant: &str, route: &str) -> Self {
        let shared = SHARED.try_with(|set| {
            let mut set = set.borrow_mut();
            let set = set.as_mut()?;
            let wanted = KeyRef::new(rule, tenant, route);
            if let Some(k) = set.get(&wanted as &dyn AsKeyRef) {
                return Some(k.clone());
            }
            let k = Self::build(rule, tenant, route);
            set.insert(k.clone());
            Some(k)
        });
        match shared {
            Ok(Some(k)) => k,
            _ => Self::build(rule, tenant, route),
        }
    }

    /// Until the guard this returns drops, keys made on this thread with
    /// equal parts share one allocation: [`KeyId::new`] hands out the key
    /// made before. Nothing a key does changes (it compares, hashes and
    /// orders by its parts). For a process that holds several tiers' state
    /// of the same keys on one thread, the simulator: every allocator core,
    /// regional and the simulator's own records then keep one copy of each
    /// key's bytes between them, where each made its own. The keys made
    /// meanwhile stay alive until the guard drops. Calling it again while a
    /// guard is alive changes nothing (the inner guard shares the outer
    /// one's keys).
    pub fn share_on_this_thread() -> SharedKeys {
        let installed = SHARED.with(|set| {
            let mut set = set.borrow_mut();
            if set.is_some() {
                return false;
            }
            *set = Some(std::collections::HashSet::new());
            true
        });
        if installed {
            SHARING.set(true);
        }
        SharedKeys {
            installed,
            _this_thread: std::marker::PhantomData,
        }
    }

    #[inline]
    fn build(rule: &str, tenant: &str, route: &str) -> Self {
        let mut s = String::with_capacity(rule.len() + tenant.len() + route.len());
        s.push_str(rule);
        s.push_str(tenant);
        s.push_str(route);
        Self {
            parts: s.into(),
            // Key parts are ids and patterns of at most a few hundred
            // bytes (the rule loader and the wire limit them); a part
            // over 4 GiB could not have been read.
            rule_len: u32::try_from(rule.len()).expect("key part under 4 GiB"),
            tenant_len: u32::try_from(tenant.len()).expect("key part under 4 GiB"),
        }
    }

    /// Rule id.
    #[inline]
    pub fn rule(&self) -> &str {
        &self.parts[..self.rule_len as usize]
    }

    /// Tenant part.
    #[inline]
    pub fn tenant(&self) -> &str {
        let a = self.rule_len as usize;
        &self.parts[a..a + self.tenant_len as usize]
    }

    /// Route part.
    #[inline]
    pub fn route(&self) -> &str {
        &self.parts[(self.rule_len + self.tenant_len) as usize..]
    }

    /// The borrowed form.
    #[inline]
    pub fn as_key_ref(&self) -> KeyRef<'_> {
        KeyRef::new(self.rule(), self.tenant(), self.route())
    }
}

thread_local! {
    /// The keys made on this thread while it shares them.
    static SHARED: std::cell::RefCell<Option<std::collections::HashSet<KeyId>>> =
        const { std::cell::RefCell::new(None) };
    /// Whether `SHARED` holds a set (read first, without a destructor).
    static SHARING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// While alive, keys made on this thread share one allocation for equal
/// parts ([`KeyId::share_on_this_thread`]). Not `Send`: it belongs to the
/// thread that made it.
#[must_use = "keys are shared only while the guard is alive"]
pub struct SharedKeys {
    installed: bool,
    _this_thread: std::marker::PhantomData<*const ()>,
}

impl Drop for SharedKeys {
    fn drop(&mut self) {
        if self.installed {
            SHARING.set(false);
            // Out of the cell first: dropping the keys runs no code that
            // looks at it, but keep the borrow short anyway.
            let set = SHARED.with(|set| set.borrow_mut().take());
            drop(set);
        }
    }
}

/// A key a set of [`KeyId`] can be searched with without building one.
trait AsKeyRef {
    fn key_ref(&self) -> KeyRef<'_>;
}

impl AsKeyRef for KeyId {
    fn key_ref(&self) -> KeyRef<'_> {
        self.as_key_ref()
    }
}

impl AsKeyRef for KeyRef<'_> {
    fn key_ref(&self) -> KeyRef<'_> {
        *self
    }
}

// A `KeyId` hashes and compares as its `KeyRef` (see the impls below), as
// `Borrow` requires.
impl<'a> std::borrow::Borrow<dyn AsKeyRef + 'a> for KeyId {
    fn borrow(&self) -> &(dyn AsKeyRef + 'a) {
        self
    }
}

impl std::hash::Hash for dyn AsKeyRef + '_ {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.key_ref().hash(state);
    }
}

impl PartialEq for dyn AsKeyRef + '_ {
    fn eq(&self, other: &Self) -> bool {
        self.key_ref() == other.key_ref()
    }
}

impl Eq for dyn AsKeyRef + '_ {}

impl Default for KeyId {
    fn default() -> Self {
        Self::new("", "", "")
    }
}

impl PartialEq for KeyId {
    #[inline]
    fn eq(&self, other: &Self) -> bool {
        // Equal part lengths split equal runs of bytes alike.
        std::sync::Arc::ptr_eq(&self.parts, &other.parts)
            || (self.rule_len == other.rule_len
                && self.tenant_len == other.tenant_len
                && str_eq(&self.parts, &other.parts))
    }
}

impl Eq for KeyId {}

impl std::hash::Hash for KeyId {
    #[inline]
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.as_key_ref().hash(state);
    }
}

impl PartialOrd for KeyId {
    #[inline]
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for KeyId {
    /// Rule, then tenant, then route.
    #[inline]
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.as_key_ref().cmp(&other.as_key_ref())
    }
}

impl std::fmt::Debug for KeyId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyId")
            .field("rule", &self.rule())
            .field("tenant", &self.tenant())
            .field("route", &self.route())
            .finish()
    }
}

/// Identity of one bucket (borrowed): hashes and compares like [`KeyId`]
/// without building anything.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub struct KeyRef<'a> {
    /// Rule id.
    pub rule: &'a str,
    /// Tenant part.
    pub tenant: &'a str,
    /// Route part.
    pub route: &'a str,
}

impl<'a> KeyRef<'a> {
    /// A key from its parts.
    #[inline]
    pub fn new(rule: &'a str, tenant: &'a str, route: &'a str) -> Self {
        Self {
            rule,
            tenant,
            route,
        }
    }

    /// The key of `rule` for a request on (tenant, route).
    #[inline]
    pub fn of(rule: &'a Rule, tenant: &'a str, route: &'a str) -> Self {
        Self::new(
            &rule.id,
            rule.tenant.key_part(tenant),
            rule.route.key_part(route),
        )
    }

    /// The owned form.
    pub fn to_key_id(self) -> KeyId {
        KeyId::new(self.rule, self.tenant, self.route)
    }
}

impl PartialEq<KeyId> for KeyRef<'_> {
    /// Part by part, the part most likely to differ first.
    #[inline]
    fn eq(&self, k: &KeyId) -> bool {
        str_eq(self.tenant, k.tenant())
            && str_eq(self.route, k.route())
            && str_eq(self.rule, k.rule())
    }
}

/// `a == b`, without a call into `memcmp` for the short ids that keys and
/// rule patterns mostly are (up to 16 bytes: two overlapping 8-byte loads
/// a side, or two 4-byte ones); longer strings compare as usual. On every decision.
#[inline]
pub fn str_eq(a: &str, b: &str) -> bool {
    bytes_eq(a.as_bytes(), b.as_bytes())
}

/// [`str_eq`] on bytes.
#[inline]
pub fn bytes_eq(a: &[u8], b: &[u8]) -> bool {
    let n = a.len();
    if n != b.len() {
        return false;
    }
    let word = |x: &[u8], i: usize| u64::from_le_bytes(x[i..i + 8].try_into().expect("8 bytes"));
    let half = |x: &[u8], i: usize| u32::from_le_bytes(x[i..i + 4].try_into().expect("4 bytes"));
    match n {
        0 => true,
        // Bytes 0, n/2 and n-1 are every byte of a 1-3 byte string.
        1..=3 => a[0] == b[0] && a[n / 2] == b[n / 2] && a[n - 1] == b[n - 1],
        4..=7 => half(a, 0) == half(b, 0) && half(a, n - 4) == half(b, n - 4),
        8..=16 => word(a, 0) == word(b, 0) && word(a, n - 8) == word(b, n - 8),
        _ => a == b,
    }
}

impl From<KeyRef<'_>> for KeyId {
    fn from(k: KeyRef<'_>) -> Self {
        k.to_key_id()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_made_while_sharing_share_their_bytes_and_nothing_else_changes() {
        let apart = (KeyId::new("r", "t", "/a"), KeyId::new("r", "t", "/a"));
        assert!(!std::sync::Arc::ptr_eq(&apart.0.parts, &apart.1.parts));
        let guard = KeyId::share_on_this_thread();
        let a = KeyId::new("r", "t", "/a");
        let b = KeyId::new(String::from("r"), "t", "/a");
        let c = KeyId::new("r", "t", "/b");
        // The rule/tenant boundary is part of the key: "rt" + "" is not "r" + "t".
        let d = KeyId::new("rt", "", "/a");
        assert!(std::sync::Arc::ptr_eq(&a.parts, &b.parts));
        assert!(!std::sync::Arc::ptr_eq(&a.parts, &c.parts));
        assert!(!std::sync::Arc::ptr_eq(&a.parts, &d.parts));
        assert_eq!(a, apart.0);
        assert_ne!(a, d);
        assert_eq!((d.rule(), d.tenant(), d.route()), ("rt", "", "/a"));
        // An inner guard shares the outer one's keys, and its drop ends nothing.
        drop(KeyId::share_on_this_thread());
        assert!(std::sync::Arc::ptr_eq(
            &a.parts,
            &KeyId::new("r", "t", "/a").parts
        ));
        // Another thread does not share this one's keys.
        let other = std::thread::spawn(|| KeyId::new("r", "t", "/a"))
            .join()
            .expect("thread");
        assert!(!std::sync::Arc::ptr_eq(&a.parts, &other.parts));
        drop(guard);
        let after = KeyId::new("r", "t", "/a");
        assert!(!std::sync::Arc::ptr_eq(&a.parts, &after.parts));
        assert_eq!(a, after);
    }
    use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};

    #[test]
    fn short_string_equality_agrees_with_eq_at_every_length() {
        let base = "abcdefghijklmnopqrstuvwxyz0123456789";
        for n in 0..=base.len() {
            let a = &base[..n];
            let copy = String::from(a);
            assert!(str_eq(a, copy.as_str()), "{n}");
            for i in 0..n {
                let mut b = a.as_bytes().to_vec();
                b[i] ^= 1;
                let b = String::from_utf8(b).expect("ascii");
                assert!(!str_eq(a, &b), "{n} {i}");
            }
            if n > 0 {
                assert!(!str_eq(a, &base[..n - 1]));
            }
        }
    }

    #[test]
    fn owned_keys_split_order_and_print_like_three_strings() {
        // Same bytes, other splits: different keys.
        let a = KeyId::new("r", "ab", "c");
        let b = KeyId::new("r", "a", "bc");
        let c = KeyId::new("ra", "b", "c");
        assert_ne!(a, b);
        assert_ne!(a, c);
        assert_ne!(b, c);
        assert_eq!(a, KeyId::new(String::from("r"), "ab", "c"));
        assert_eq!((a.rule(), a.tenant(), a.route()), ("r", "ab", "c"));
        assert_eq!((b.rule(), b.tenant(), b.route()), ("r", "a", "bc"));
        // Ordered by rule, then tenant, then route (as the struct of three
        // strings was: reports list keys in this order).
        let parts = [
            ("a", "", "z"),
            ("a", "b", ""),
            ("a", "b", "c"),
            ("ab", "", ""),
            ("r", "a", "bc"),
            ("r", "ab", "c"),
            ("ra", "b", "c"),
        ];
        for x in parts {
            for y in parts {
                let (kx, ky) = (KeyId::new(x.0, x.1, x.2), KeyId::new(y.0, y.1, y.2));
                assert_eq!(kx.cmp(&ky), x.cmp(&y), "{x:?} {y:?}");
                assert_eq!(kx == ky, x == y, "{x:?} {y:?}");
            }
        }
        assert_eq!(
            format!("{a:?}"),
            r#"KeyId { rule: "r", tenant: "ab", route: "c" }"#
        );
        assert_eq!(KeyId::default().as_key_ref(), KeyRef::new("", "", ""));
        let long = KeyId::new("rule-with-a-long-id", "tenant-with-a-long-name", "/v1/x");
        assert_eq!(long, long.as_key_ref().to_key_id());
        assert_ne!(
            long,
            KeyId::new("rule-with-a-long-id", "tenant-with-a-long-nbme", "/v1/x")
        );
    }

    #[test]
    fn owned_and_borrowed_keys_hash_and_compare_alike() {
        let h = BuildHasherDefault::<DefaultHasher>::default();
        let a = KeyRef::new("r", "ab", "c");
        let b = KeyRef::new("r", "a", "bc");
        assert_ne!(h.hash_one(a), h.hash_one(b));
        assert_ne!(a, b.to_key_id());
        assert_eq!(a, a.to_key_id());
        assert_eq!(h.hash_one(a), h.hash_one(a.to_key_id()));
        let owned = KeyId::from(b);
        assert_eq!(owned.as_key_ref(), b);
        assert_eq!(h.hash_one(owned.as_key_ref()), h.hash_one(&owned));
    }
}

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

/// Identity of one bucket (owned).
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub struct KeyId {
    /// Rule id.
    pub rule: String,
    /// Tenant part.
    pub tenant: String,
    /// Route part.
    pub route: String,
}

impl KeyId {
    /// The borrowed form.
    #[inline]
    pub fn as_key_ref(&self) -> KeyRef<'_> {
        KeyRef::new(&self.rule, &self.tenant, &self.route)
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
        KeyId {
            rule: self.rule.into(),
            tenant: self.tenant.into(),
            route: self.route.into(),
        }
    }
}

impl PartialEq<KeyId> for KeyRef<'_> {
    /// Part by part, the part most likely to differ first.
    #[inline]
    fn eq(&self, k: &KeyId) -> bool {
        str_eq(self.tenant, &k.tenant) && str_eq(self.route, &k.route) && str_eq(self.rule, &k.rule)
    }
}

/// `a == b`, without a call into `memcmp` for the short ids that keys and
/// rule patterns mostly are (up to 16 bytes: two overlapping 8-byte loads
/// a side, or two 4-byte ones); longer strings compare as usual. On every decision.
#[inline]
pub fn str_eq(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
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

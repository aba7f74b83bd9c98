//! Unit tests of the agent's private parts (keys, input validation). The
//! tests against a real allocator in process are in the root crate's
//! `tests/agent_inprocess.rs`, so that this library needs no allocator even
//! as a dev-dependency.

use super::*;

#[test]
fn keys_are_unambiguous() {
    use std::hash::BuildHasher;
    let h = foldhash::fast::FixedState::with_seed(7);
    let a = Lookup(KeyRef::new("r", "ab", "c"));
    let b = Lookup(KeyRef::new("r", "a", "bc"));
    assert_ne!(h.hash_one(a), h.hash_one(b));
    // A slot keeps its parts in one string: they come back apart.
    let held = |k: KeyRef<'_>| Held(Slot::new(k.rule, k.tenant, k.route));
    let (ha, hb) = (held(a.0), held(b.0));
    assert_eq!((ha.rule_id(), ha.tenant(), ha.route()), ("r", "ab", "c"));
    assert_eq!((hb.rule_id(), hb.tenant(), hb.route()), ("r", "a", "bc"));
    assert!(!papaya::Equivalent::equivalent(&a, &hb));
    assert!(papaya::Equivalent::equivalent(&a, &ha));
    assert_ne!(ha, hb);
    assert_eq!(h.hash_one(a), h.hash_one(&ha));
    assert_eq!(h.hash_one(b), h.hash_one(&hb));
    let empty = held(KeyRef::new("r", "", ""));
    assert_eq!(
        (empty.rule_id(), empty.tenant(), empty.route()),
        ("r", "", "")
    );
}

#[test]
fn validation_names_the_field() {
    let bad = |tenant: &str, route: &str, request_id: &str| {
        validate(&CheckInput {
            tenant,
            route,
            cost: 0,
            request_id,
            domain: None,
        })
    };
    assert_eq!(bad("t", "r", ""), Ok(1), "cost 0 means 1");
    let long = "y".repeat(257);
    assert!(matches!(
        bad("", "r", ""),
        Err(CheckError::Invalid {
            field: "tenant_id",
            ..
        })
    ));
    assert!(matches!(
        bad(&long, "r", ""),
        Err(CheckError::Invalid {
            field: "tenant_id",
            ..
        })
    ));
    assert!(matches!(
        bad("t", &long, ""),
        Err(CheckError::Invalid {
            field: "route_id",
            ..
        })
    ));
    assert!(matches!(
        bad("t", "r", &long),
        Err(CheckError::Invalid {
            field: "request_id",
            ..
        })
    ));
}

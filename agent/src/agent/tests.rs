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
    // A slot keeps its parts in one block: they come back apart.
    let (sa, sb) = (
        Slot::new(a.0.rule, a.0.tenant, a.0.route),
        Slot::new(b.0.rule, b.0.tenant, b.0.route),
    );
    assert_eq!((sa.rule_id(), sa.tenant(), sa.route()), ("r", "ab", "c"));
    assert_eq!((sb.rule_id(), sb.tenant(), sb.route()), ("r", "a", "bc"));
    assert_ne!(sa, sb);
    assert_eq!(h.hash_one(a), h.hash_one(Lookup(sa.key_ref())));
    // The table tells them apart.
    let table = Table::new();
    let pinned = table.pin();
    assert!(pinned.insert(sa.clone()));
    assert!(pinned.get(&b).is_none());
    assert!(pinned.insert(sb.clone()));
    assert!(!pinned.insert(Slot::new("r", "ab", "c")), "one slot a key");
    assert_eq!(pinned.get(&a).map(|s| s.to_owned()), Some(sa));
    assert_eq!(pinned.get(&b).map(|s| s.to_owned()), Some(sb));
    let empty = Slot::new("r", "", "");
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

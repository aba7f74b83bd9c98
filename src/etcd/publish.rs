//! `quotalease publish`: a rules file validated and written to etcd, with
//! what changed.

use super::*;

/// One line per rule that differs between `old` and `new` (by id):
/// `+ rule`, `- rule`, `~ rule: old -> new` (a rule's rate and
/// concurrency parts together).
pub(super) fn diff(old: &RuleSet, new: &RuleSet) -> Vec<String> {
    let old_lines = old.rule_lines();
    let new_lines = new.rule_lines();
    let find = |lines: &[quotalease_model::rules::RuleLine<'_>], id: &str| {
        lines.iter().find(|l| l.id == id).map(|l| l.to_string())
    };
    let mut out = Vec::new();
    for l in &old_lines {
        let was = l.to_string();
        match find(&new_lines, l.id) {
            None => out.push(format!("- {was}")),
            Some(now) if now != was => out.push(format!("~ {was}\n    now {now}")),
            Some(_) => {}
        }
    }
    for l in &new_lines {
        if find(&old_lines, l.id).is_none() {
            out.push(format!("+ {l}"));
        }
    }
    out
}

/// `quotalease rules publish FILE --etcd URL`: validate (every error),
/// print the diff against the live rules, publish (a transaction that
/// fails if someone published in between).
pub async fn publish(file: &Path, etcd: &[String], prefix: &str) -> anyhow::Result<()> {
    if etcd.is_empty() {
        return Err(anyhow!("--etcd URL[,URL] is required"));
    }
    let new = serve::load_rules(file, 0)?;
    let text = std::fs::read_to_string(file)
        .with_context(|| format!("{}: cannot read", file.display()))?;
    let keys = Keys {
        root: prefix.trim_end_matches('/').to_string(),
        prefix: prefix.trim_end_matches('/').to_string(),
    };
    let options = ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(3))
        .with_timeout(Duration::from_secs(5));
    let c = Client::connect(etcd, Some(options))
        .await
        .with_context(|| format!("--etcd {}: cannot connect", etcd.join(",")))?;
    let got = get(&c, &keys.rules(), None)
        .await
        .with_context(|| format!("--etcd {}: cannot read {}", etcd.join(","), keys.rules()))?;
    let (live, mod_rev) = match got.kvs().first() {
        Some(kv) => {
            let live = RuleSet::parse(kv.value_str().unwrap_or(""), &keys.rules(), 0)
                .unwrap_or_else(|errs| {
                    eprintln!(
                        "the live rules in etcd are not valid ({} error(s)); diff against none",
                        errs.len()
                    );
                    RuleSet::default()
                });
            (live, kv.mod_revision())
        }
        None => (RuleSet::default(), 0),
    };
    let changes = diff(&live, &new);
    if changes.is_empty() {
        println!(
            "{}: {} rule(s), the same as live in etcd {}: nothing published",
            file.display(),
            new.rules.len(),
            keys.rules()
        );
        return Ok(());
    }
    for l in &changes {
        println!("{l}");
    }
    // Unchanged since we read it (mod revision 0: absent).
    let same = Compare::mod_revision(keys.rules(), CompareOp::Equal, mod_rev);
    let t = Txn::new()
        .when([same])
        .and_then([TxnOp::put(keys.rules(), text, None)]);
    let resp = txn(&c, t).await.context("publishing")?;
    if !resp.succeeded() {
        return Err(anyhow!(
            "the rules in etcd changed while this was publishing: nothing published; run it again"
        ));
    }
    let rev = resp.header().map_or(0, |h| h.revision());
    println!(
        "published {} rule(s) to etcd {} (revision {rev}): {} change(s); allocators apply them within a second",
        new.rules.len(),
        keys.rules(),
        changes.len()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_publish_diff_names_added_removed_and_changed_rules() {
        let set = |yaml: &str| RuleSet::parse(yaml, "t", 0).expect("valid");
        let old = set("rules:\n  - {id: a, match: {tenant: '*'}, rate: 10/s, burst: 20}\n  - {id: b, match: {tenant: '*'}, rate: 1/s, burst: 1}\n");
        let new = set("rules:\n  - {id: a, match: {tenant: '*'}, rate: 10/s, burst: 30}\n  - {id: c, match: {route: '/x'}, rate: 5/m, burst: 5}\n");
        let d = diff(&old, &new);
        assert_eq!(d.len(), 3, "{d:?}");
        assert!(
            d[0].starts_with("~ a") && d[0].contains("burst=20") && d[0].contains("burst=30"),
            "{d:?}"
        );
        assert!(d[1].starts_with("- b"), "{d:?}");
        assert!(d[2].starts_with("+ c"), "{d:?}");
        assert!(diff(&new, &new).is_empty());
    }
}

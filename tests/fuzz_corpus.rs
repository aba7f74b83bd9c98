//! The fuzz targets' corpora (`fuzz/corpus/`, a sample of the runs in
//! docs/fuzzing.md) replayed in the ordinary suite through the targets'
//! own bodies (`quotalease_sim::fuzzing`, `gateway::http_api::fuzzing`):
//! any input that ever crashed a target stays here as a regression.

use std::path::Path;

use quotalease_gateway::http_api::fuzzing as http;
use quotalease_sim::fuzzing;

fn corpus(target: &str) -> Vec<Vec<u8>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target);
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "{}: an empty corpus", dir.display());
    files.iter().map(|f| std::fs::read(f).unwrap()).collect()
}

#[test]
fn rules_corpus() {
    let accepted = corpus("rules").iter().filter(|d| fuzzing::rules(d)).count();
    assert!(accepted > 0, "the seeds (examples/*.yaml) parse");
}

#[test]
fn lease_batch_corpus() {
    for data in corpus("lease_batch") {
        fuzzing::lease_batch(&data);
    }
}

#[test]
fn http_check_corpus() {
    for data in corpus("http_check") {
        let _ = http::json(&data);
        if let Ok(q) = std::str::from_utf8(&data) {
            let _ = http::query(q);
        }
    }
    assert!(http::query("tenant=a&route=/x&cost=2"));
    assert!(!http::query("tenant=a&bogus=1"));
    assert!(http::json(br#"{"tenant_id":"a","route_id":"/x"}"#));
}

#[test]
fn scenario_corpus() {
    for data in corpus("scenario") {
        fuzzing::scenario(&data);
    }
}

#[test]
fn check_request_corpus() {
    for data in corpus("check_request") {
        fuzzing::check_request(&data);
    }
}

#[test]
fn should_rate_limit_corpus() {
    for data in corpus("should_rate_limit") {
        fuzzing::should_rate_limit(&data);
    }
}

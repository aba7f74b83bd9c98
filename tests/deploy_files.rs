//! `deploy/`: the container recipe, the Kubernetes manifests and the
//! systemd units parse and name only flags, ports, endpoints and
//! subcommands the binary really has; and the rules hot reload works when
//! the rules file is mounted the way Kubernetes mounts a ConfigMap (the
//! directory's `..data` symlink swapped atomically, the file never written
//! in place).

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
// YAML read as the product reads it (YAML 1.2), into a JSON value: the
// manifests use string keys only.
use serde_json::Value;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Long flags `quotalease SUB --help` lists.
fn flags_of(sub: &str) -> BTreeSet<String> {
    let out = Command::new(BIN)
        .args([sub, "--help"])
        .output()
        .expect("run --help");
    assert!(out.status.success(), "quotalease {sub} --help");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .filter(|w| w.starts_with("--"))
        .map(|w| w.trim_end_matches(',').to_string())
        .collect()
}

/// Each `--flag[=value]` / `--flag value` of `args` after the subcommand,
/// as (flag, value or "").
fn parse_args(args: &[String]) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut i = 1;
    while i < args.len() {
        let a = &args[i];
        assert!(a.starts_with("--"), "argument {a:?} is not a --flag");
        if let Some((f, v)) = a.split_once('=') {
            out.push((f.to_string(), v.to_string()));
        } else if args.get(i + 1).is_some_and(|n| !n.starts_with("--")) {
            out.push((a.clone(), args[i + 1].clone()));
            i += 1;
        } else {
            out.push((a.clone(), String::new()));
        }
        i += 1;
    }
    out
}

/// Check a quotalease command line: a real subcommand, real flags, parseable
/// addresses and durations. Returns its flags.
fn check_command(args: &[String], whence: &str) -> BTreeMap<String, String> {
    let sub = args
        .first()
        .unwrap_or_else(|| panic!("{whence}: no subcommand"));
    assert!(
        ["allocator", "agent"].contains(&sub.as_str()),
        "{whence}: subcommand {sub:?}"
    );
    let known = flags_of(sub);
    let mut flags = BTreeMap::new();
    for (f, v) in parse_args(args) {
        assert!(
            known.contains(&f),
            "{whence}: `quotalease {sub}` has no flag {f}"
        );
        match f.as_str() {
            "--listen" | "--http" | "--grpc" => {
                v.parse::<std::net::SocketAddr>()
                    .unwrap_or_else(|e| panic!("{whence}: {f}={v}: {e}"));
            }
            "--ttl-max" | "--lease-ttl" | "--renew-interval" => {
                assert!(
                    v.ends_with("ms") || v.ends_with('s') || v.ends_with('m'),
                    "{whence}: {f}={v}: a duration"
                );
            }
            "--parent" | "--allocator" => {
                assert!(
                    v.starts_with("http://") || v.starts_with("https://"),
                    "{whence}: {f}={v}: an http:// or https:// URL"
                );
            }
            _ => {}
        }
        flags.insert(f, v);
    }
    flags
}

fn port_of(addr: &str) -> u64 {
    addr.parse::<std::net::SocketAddr>()
        .expect("address")
        .port()
        .into()
}

fn docs(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).expect("read manifest");
    text.split("\n---\n")
        .map(|d| {
            serde_saphyr::from_str_with_options::<Value>(
                d,
                quotalease_model::rules::yaml::options(),
            )
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        })
        .collect()
}

fn s(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        other => panic!("not a scalar: {other:?}"),
    }
}

#[test]
fn kubernetes_manifests_name_real_flags_ports_and_probes() {
    let dir = root().join("deploy/k8s");
    let mut services: BTreeMap<String, BTreeSet<u64>> = BTreeMap::new();
    let mut urls = Vec::new();
    let mut quotalease_containers = 0;
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .expect("deploy/k8s")
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert!(
        files.len() >= 3,
        "allocator, regional and gateway manifests"
    );
    for f in &files {
        for d in docs(f) {
            let whence = format!("{}: {}", f.display(), s(&d["metadata"]["name"]));
            assert!(
                d["apiVersion"].is_string() && d["kind"].is_string(),
                "{whence}"
            );
            let kind = s(&d["kind"]);
            if kind == "Service" {
                let ports = d["spec"]["ports"].as_array().expect("ports");
                services.insert(
                    s(&d["metadata"]["name"]),
                    ports.iter().map(|p| p["port"].as_u64().unwrap()).collect(),
                );
                continue;
            }
            if !["Deployment", "StatefulSet"].contains(&kind.as_str()) {
                continue;
            }
            let pod = &d["spec"]["template"];
            let grace = pod["spec"]["terminationGracePeriodSeconds"].as_u64();
            assert!(
                grace.is_some_and(|g| g >= 10),
                "{whence}: a SIGTERM grace long enough to release leases"
            );
            let annotations = &pod["metadata"]["annotations"];
            for c in pod["spec"]["containers"].as_array().expect("containers") {
                if !s(&c["image"]).starts_with("quotalease") {
                    continue;
                }
                quotalease_containers += 1;
                let args: Vec<String> = c["args"].as_array().expect("args").iter().map(s).collect();
                let flags = check_command(&args, &whence);
                let http = port_of(&flags["--http"]);
                assert!(
                    flags["--http"].starts_with("0.0.0.0:"),
                    "{whence}: probes and Prometheus reach --http on the pod address"
                );
                let ports: BTreeMap<String, u64> = c["ports"]
                    .as_array()
                    .expect("ports")
                    .iter()
                    .map(|p| (s(&p["name"]), p["containerPort"].as_u64().unwrap()))
                    .collect();
                assert_eq!(
                    ports.get("http"),
                    Some(&http),
                    "{whence}: the http port is --http's"
                );
                if let Some(grpc) = flags.get("--listen") {
                    assert_eq!(
                        ports.get("grpc"),
                        Some(&port_of(grpc)),
                        "{whence}: grpc is --listen's"
                    );
                }
                for probe in ["readinessProbe", "livenessProbe"] {
                    let g = &c[probe]["httpGet"];
                    let path = s(&g["path"]);
                    assert!(
                        ["/readyz", "/healthz"].contains(&path.as_str()),
                        "{whence}: {probe} path {path}"
                    );
                    assert_eq!(
                        ports.get(&s(&g["port"])),
                        Some(&http),
                        "{whence}: {probe} port"
                    );
                }
                assert_eq!(
                    s(&annotations["prometheus.io/port"]).parse::<u64>().ok(),
                    Some(http),
                    "{whence}: Prometheus scrapes --http"
                );
                for f in ["--parent", "--allocator", "--advertise", "--etcd"] {
                    if let Some(list) = flags.get(f) {
                        for u in list.split(',') {
                            urls.push((whence.clone(), u.to_string()));
                        }
                    }
                }
                if let Some(a) = flags.get("--advertise") {
                    // Agents are redirected there, with the client
                    // certificate they use for the first contact.
                    assert!(
                        flags.contains_key("--etcd"),
                        "{whence}: --advertise without --etcd"
                    );
                    assert_eq!(
                        a.starts_with("https://"),
                        flags.contains_key("--tls-cert"),
                        "{whence}: --advertise {a} and the TLS flags disagree"
                    );
                }
                // mTLS: certificates come from a mounted Secret, a gRPC port
                // open on the pod network requires client certificates, and
                // an https:// URL comes with a client certificate.
                let secret_mounts: Vec<String> = c["volumeMounts"]
                    .as_array()
                    .map(|ms| {
                        ms.iter()
                            .filter(|m| {
                                pod["spec"]["volumes"]
                                    .as_array()
                                    .into_iter()
                                    .flatten()
                                    .any(|v| v["name"] == m["name"] && v["secret"].is_object())
                            })
                            .map(|m| s(&m["mountPath"]))
                            .collect()
                    })
                    .unwrap_or_default();
                for f in [
                    "--tls-cert",
                    "--tls-key",
                    "--tls-client-ca",
                    "--tls-ca",
                    "--tls-parent-ca",
                ] {
                    if let Some(path) = flags.get(f) {
                        assert!(
                            secret_mounts
                                .iter()
                                .any(|m| Path::new(path).parent() == Some(Path::new(m))),
                            "{whence}: {f} {path} is in a mounted Secret"
                        );
                    }
                }
                if flags
                    .get("--listen")
                    .is_some_and(|l| l.starts_with("0.0.0.0:"))
                {
                    assert!(
                        flags.contains_key("--tls-cert") && flags.contains_key("--tls-client-ca"),
                        "{whence}: a lease port on the pod network requires client certificates"
                    );
                }
                for f in ["--parent", "--allocator"] {
                    if flags.get(f).is_some_and(|u| u.starts_with("https://")) {
                        assert!(
                            flags.contains_key("--tls-cert") && flags.contains_key("--tls-key"),
                            "{whence}: {f} is https:// but no client certificate is given"
                        );
                    }
                }
                if let Some(path) = flags.get("--rules") {
                    // The rules file comes from a mounted ConfigMap directory.
                    let mounts = c["volumeMounts"].as_array().expect("volumeMounts");
                    assert!(
                        mounts
                            .iter()
                            .any(|m| Path::new(path).parent()
                                == Some(Path::new(&s(&m["mountPath"])))),
                        "{whence}: --rules {path} is in a mounted directory"
                    );
                }
            }
        }
    }
    assert!(quotalease_containers >= 3, "allocator, regional, agent");
    // Every URL names a Service of the manifests and one of its ports.
    for (whence, u) in urls {
        let hostport = u
            .trim_start_matches("https://")
            .trim_start_matches("http://");
        let (host, port) = hostport.split_once(':').expect("host:port");
        // A pod of a headless Service is `POD.SERVICE`.
        let service = host.rsplit('.').next().unwrap_or(host);
        let ports = services
            .get(service)
            .unwrap_or_else(|| panic!("{whence}: {u} names no Service"));
        assert!(
            ports.contains(&port.parse().unwrap()),
            "{whence}: {u}: no such port"
        );
    }
}

#[test]
fn systemd_units_and_the_container_recipe_name_the_real_binary() {
    for unit in ["quotalease-allocator.service", "quotalease-agent.service"] {
        let path = root().join("deploy/systemd").join(unit);
        let text = std::fs::read_to_string(&path).expect("unit");
        let exec = text
            .lines()
            .find_map(|l| l.strip_prefix("ExecStart="))
            .unwrap_or_else(|| panic!("{unit}: ExecStart"));
        let words: Vec<String> = exec.split_whitespace().map(String::from).collect();
        assert_eq!(words[0], "/usr/local/bin/quotalease", "{unit}");
        check_command(&words[1..], unit);
        for section in ["[Unit]", "[Service]", "[Install]"] {
            assert!(text.contains(section), "{unit}: {section}");
        }
        assert!(
            text.contains("TimeoutStopSec="),
            "{unit}: time to release leases on SIGTERM"
        );
    }
    let docker = std::fs::read_to_string(root().join("deploy/Dockerfile")).expect("Dockerfile");
    let froms = docker.lines().filter(|l| l.starts_with("FROM ")).count();
    assert!(froms >= 2, "a multi-stage build");
    let user = docker
        .lines()
        .filter_map(|l| l.strip_prefix("USER "))
        .next_back()
        .expect("a USER line");
    assert!(
        !user.starts_with('0') && !user.starts_with("root"),
        "non-root: {user}"
    );
    assert!(docker.contains("--bin quotalease"), "the one binary");
    assert!(docker.contains(r#"ENTRYPOINT ["/usr/local/bin/quotalease"]"#));
    // The default ports the binary listens on are the ones exposed.
    let exposed: BTreeSet<u64> = docker
        .lines()
        .filter_map(|l| l.strip_prefix("EXPOSE "))
        .flat_map(|l| l.split_whitespace().map(|p| p.parse::<u64>().unwrap()))
        .collect();
    for (sub, flag) in [
        ("allocator", "--listen"),
        ("allocator", "--http"),
        ("agent", "--grpc"),
        ("agent", "--http"),
    ] {
        let out = Command::new(BIN).args([sub, "--help"]).output().unwrap();
        let help = String::from_utf8_lossy(&out.stdout).into_owned();
        let at = help.find(&format!("{flag} <")).expect("flag in help");
        let default = help[at..]
            .split("[default: ")
            .nth(1)
            .and_then(|r| r.split(']').next())
            .unwrap_or_else(|| panic!("{sub} {flag}: a default"));
        assert!(
            exposed.contains(&port_of(default)),
            "{sub} {flag} default {default} is exposed"
        );
    }
}

/// Kubernetes mounts a ConfigMap as a directory whose files are symlinks
/// through `..data`, itself a symlink to a timestamped directory; an update
/// writes a new directory and renames a new `..data` over the old one. The
/// allocator re-reads its rules then, without the file being written in
/// place.
#[test]
fn rules_reload_through_a_configmap_style_symlink_swap() {
    let dir = tempdir("configmap");
    let mount = dir.join("mount");
    std::fs::create_dir_all(&mount).unwrap();
    let v1 = mount.join("..2026_12_02_v1");
    std::fs::create_dir_all(&v1).unwrap();
    std::fs::write(
        v1.join("rules.yaml"),
        "rules:\n  - id: orders\n    match: { tenant: \"*\", route: /api/orders }\n    rate: 1/s\n    burst: 2\n",
    )
    .unwrap();
    std::os::unix::fs::symlink("..2026_12_02_v1", mount.join("..data")).unwrap();
    std::os::unix::fs::symlink("..data/rules.yaml", mount.join("rules.yaml")).unwrap();
    let alloc = allocator(&mount.join("rules.yaml"), &dir.join("state"), None, "2s");
    wait_ok(alloc.http, "/readyz", Duration::from_secs(5));
    let keys = |rule: &str| {
        http_get(
            alloc.http,
            &format!("/v1/keys?rule={rule}&tenant=t&route=/api/{rule}"),
        )
        .0
    };
    assert_eq!(keys("orders"), 200);
    assert_eq!(keys("search"), 404, "no such rule yet");

    // The update, as the kubelet does it.
    let v2 = mount.join("..2026_12_02_v2");
    std::fs::create_dir_all(&v2).unwrap();
    std::fs::write(
        v2.join("rules.yaml"),
        "rules:\n  - id: orders\n    match: { tenant: \"*\", route: /api/orders }\n    rate: 1/s\n    burst: 2\n  - id: search\n    match: { tenant: \"*\", route: /api/search }\n    rate: 5/s\n    burst: 5\n",
    )
    .unwrap();
    std::os::unix::fs::symlink("..2026_12_02_v2", mount.join("..data_tmp")).unwrap();
    std::fs::rename(mount.join("..data_tmp"), mount.join("..data")).unwrap();
    std::fs::remove_dir_all(&v1).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while keys("search") != 200 {
        assert!(
            Instant::now() < deadline,
            "the swapped rules were not loaded within 10 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(keys("orders"), 200, "the rule kept from before");
}

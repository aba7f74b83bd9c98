//! End to end: `quotalease bench` against `quotalease bench --serve-echo`,
//! both real child processes on 127.0.0.1, for the three interfaces, and
//! its bad-flag errors. Nothing here asserts timing: only counts and that
//! the summary is printed.

mod common;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;

/// The echo server, killed when dropped.
struct Echo {
    child: Child,
    grpc: SocketAddr,
    http: SocketAddr,
}

impl Echo {
    fn start() -> Echo {
        let mut child = Command::new(BIN)
            .args([
                "bench",
                "--serve-echo",
                "--grpc",
                "127.0.0.1:0",
                "--http",
                "127.0.0.1:0",
            ])
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn the echo server");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("piped stdout"))
            .read_line(&mut line)
            .expect("read the start line");
        assert!(line.starts_with("quotalease echo "), "start line {line:?}");
        let field = |k: &str| -> SocketAddr {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(&format!("{k}=")))
                .unwrap_or_else(|| panic!("no {k}= in start line {line:?}"))
                .parse()
                .expect("socket address")
        };
        let (grpc, http) = (field("grpc"), field("http"));
        Echo { child, grpc, http }
    }
}

impl Drop for Echo {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Run `quotalease bench ARGS`: (exit code, stdout, stderr).
fn bench(args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(BIN)
        .arg("bench")
        .args(args)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .output()
        .expect("run quotalease bench");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `key=N` from the summary line that starts with `sent=`.
fn summary_field(stdout: &str, key: &str) -> u64 {
    let line = stdout
        .lines()
        .find(|l| l.starts_with("sent="))
        .unwrap_or_else(|| panic!("no summary line in {stdout}"));
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{key}=")))
        .unwrap_or_else(|| panic!("no {key}= in {line:?}"))
        .parse()
        .expect("a number")
}

#[test]
fn open_loop_against_the_echo_server_on_every_interface() {
    let echo = Echo::start();
    wait_ok(echo.http, "/healthz", Duration::from_secs(10));
    for (interface, addr) in [
        ("check", echo.grpc),
        ("envoy", echo.grpc),
        ("http", echo.http),
    ] {
        let target = format!("http://{addr}");
        let (code, out, err) = bench(&[
            "--target",
            &target,
            "--interface",
            interface,
            "--rate",
            "200",
            "--duration",
            "2s",
            "--keys",
            "zipf:50:1.1",
        ]);
        assert_eq!(code, Some(0), "{interface}: stdout {out}\nstderr {err}");
        let sent = summary_field(&out, "sent");
        assert!(
            (380..=420).contains(&sent),
            "{interface}: sent={sent}\n{out}"
        );
        assert_eq!(summary_field(&out, "errors"), 0, "{interface}:\n{out}");
        assert_eq!(summary_field(&out, "admitted"), sent, "{interface}:\n{out}");
        assert!(
            out.lines()
                .any(|l| l.starts_with("latency") && l.contains("p99=") && l.contains("p999=")),
            "{interface}: no latency line\n{out}"
        );
        assert!(out.contains("admitted per second: "), "{interface}:\n{out}");
        assert!(out.contains("errors by kind: none"), "{interface}:\n{out}");
    }
}

#[test]
fn closed_loop_against_the_echo_server() {
    let echo = Echo::start();
    wait_ok(echo.http, "/healthz", Duration::from_secs(10));
    for (interface, addr) in [("envoy", echo.grpc), ("http", echo.http)] {
        let target = format!("http://{addr}");
        let (code, out, err) = bench(&[
            "--target",
            &target,
            "--interface",
            interface,
            "--closed-loop",
            "--concurrency",
            "4",
            "--duration",
            "1s",
        ]);
        assert_eq!(code, Some(0), "{interface}: stdout {out}\nstderr {err}");
        assert!(summary_field(&out, "sent") > 0, "{interface}:\n{out}");
        assert_eq!(summary_field(&out, "errors"), 0, "{interface}:\n{out}");
        assert!(out.contains("throughput="), "{interface}:\n{out}");
    }
}

#[test]
fn echo_answers_http_and_stops_on_sigterm() {
    let mut echo = Echo::start();
    wait_ok(echo.http, "/healthz", Duration::from_secs(10));
    let (status, body) = http_get(echo.http, "/v1/check?tenant=a&route=%2Fx");
    assert_eq!(status, 200);
    assert!(body.contains("\"allowed\":true"), "{body}");
    // SAFETY: kill(2) on our own child's pid.
    unsafe {
        libc::kill(echo.child.id() as i32, libc::SIGTERM);
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(st) = echo.child.try_wait().expect("wait") {
            assert!(st.success(), "echo exited with {st}");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "echo ignored SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn bad_flags_give_errors_naming_the_flag() {
    let cases: &[(&[&str], &str)] = &[
        (
            &["--target", "http://127.0.0.1:1", "--interface", "envoy"],
            "--rate",
        ),
        (
            &[
                "--target",
                "http://127.0.0.1:1",
                "--interface",
                "envoy",
                "--rate",
                "0",
            ],
            "--rate",
        ),
        (
            &[
                "--target",
                "http://127.0.0.1:1",
                "--interface",
                "envoy",
                "--rate",
                "10",
                "--keys",
                "zipf:10",
            ],
            "--keys",
        ),
        (
            &[
                "--target",
                "https://127.0.0.1:1",
                "--interface",
                "check",
                "--rate",
                "10",
            ],
            "--target",
        ),
        (
            &[
                "--target",
                "http://127.0.0.1:1",
                "--interface",
                "grpc",
                "--rate",
                "10",
            ],
            "--interface",
        ),
        (
            &[
                "--target",
                "http://127.0.0.1:1",
                "--interface",
                "http",
                "--rate",
                "10",
                "--duration",
                "soon",
            ],
            "--duration",
        ),
        // Nothing listens on port 1: the run fails before it starts.
        (
            &[
                "--target",
                "http://127.0.0.1:1",
                "--interface",
                "http",
                "--rate",
                "10",
            ],
            "--target",
        ),
        (
            &[
                "--target",
                "http://127.0.0.1:1",
                "--interface",
                "check",
                "--rate",
                "10",
            ],
            "--target",
        ),
    ];
    for (args, flag) in cases {
        let (code, out, err) = bench(args);
        assert!(code.is_some_and(|c| c != 0), "{args:?}: exit {code:?}");
        let first = err.lines().next().unwrap_or("");
        assert!(
            first.contains(flag),
            "{args:?}: first stderr line {first:?} does not name {flag}\n{err}"
        );
        assert!(!out.contains("--- summary ---"), "{args:?}: {out}");
    }
}

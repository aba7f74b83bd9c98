#!/usr/bin/env bash
# The whole test suite, on a fresh machine: installs what is missing, then
# checks formatting and lints, runs every unit, property, loom and
# end-to-end test. End-to-end tests start real allocator and agent
# processes on 127.0.0.1 only; they stop by themselves.
#
# Nothing external is needed beyond Rust and a C compiler: protos compile
# with protox (no protoc), and no etcd is used yet.
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
  echo "cargo is missing: install Rust 1.88 or newer (https://rustup.rs)" >&2
  exit 1
fi
command -v cc >/dev/null 2>&1 || apt_install build-essential
if command -v rustup >/dev/null 2>&1; then
  cargo fmt --version >/dev/null 2>&1 || rustup component add rustfmt
  cargo clippy --version >/dev/null 2>&1 || rustup component add clippy
fi

log "cargo fmt --check"
cargo fmt --all --check

log "cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings

log "unit, property and end-to-end tests"
cargo test --workspace

log "loom model of the lease word"
RUSTFLAGS="--cfg quotalease_loom" CARGO_TARGET_DIR=target/loom \
  cargo test -p quotalease-agent --release --lib loom

log "all tests passed"

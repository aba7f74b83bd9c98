#!/usr/bin/env bash
# A structural change must not change behaviour (issue 30): the simulator's
# reports of every shipped scenario at seeds 1 and 7, scale 0.1, and at
# full scale for small-burst and demo-shape, byte for byte, from two
# builds of quotalease.
#
#   scripts/sim-identical.sh BEFORE_BINARY AFTER_BINARY [OUT_DIR]
#
# Build each with `cargo build --release --bin quotalease` (for the older
# one, from a worktree or `git archive` of its commit). Exit 0 when every
# report matches; otherwise the first differences and exit 1.
set -euo pipefail
before=${1:?before binary}
after=${2:?after binary}
out=${3:-$(mktemp -d)}
cd "$(dirname "$0")/.."
runs=()
for f in sim/scenarios/*.yaml; do
  for seed in 1 7; do runs+=("$f 0.1 $seed"); done
done
for f in small-burst demo-shape; do
  for seed in 1 7; do runs+=("sim/scenarios/$f.yaml 1 $seed"); done
done
differ=0
for r in "${runs[@]}"; do
  read -r file scale seed <<<"$r"
  name="$(basename "$file" .yaml)-s$scale-seed$seed"
  for which in before after; do
    bin=$before; [ "$which" = after ] && bin=$after
    # Exit 1 is a broken invariant: compared like the rest.
    "$bin" sim --scenario "$file" --scale "$scale" --seed "$seed" --out "$out/$which/$name" >/dev/null || true
  done
  if diff -r "$out/before/$name" "$out/after/$name" >/dev/null; then
    echo "same: $name"
  else
    echo "DIFFERENT: $name"
    diff -r "$out/before/$name" "$out/after/$name" | head -20 || true
    differ=1
  fi
done
exit $differ

#!/usr/bin/env bash
# Runs on the GPU machine: an A/B of bench binaries built by scripts/gpu-variant.sh, side by side in one
# call (separate calls may land on different machines, which moves the same binary by a few percent).
# Each round runs every variant once, in the order given; criterion's mean estimate of each row is
# printed per variant and round, and the logs go to $OUT/ab.
# Usage: scripts/gpu-ab.sh FILTER NAME... (ROUNDS=2 by default; FILTER is a criterion name filter;
#        BENCH_ARGS adds criterion options, as in scripts/gpu-run.sh)
#   e.g. scripts/gpu-ab.sh 'gpu_experts/t(1|4|16)$' before after
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
[ $# -ge 2 ] || { sed -n '2,7p' "$0"; exit 2; }
filter=$1
shift
out=${OUT:-$PWD/gpu-out}/ab
mkdir -p "$out"
export KDTREE_FIXTURES=$PWD/fixtures
export CRITERION_HOME=$PWD/target/criterion-ab
export KDTREE_REQUIRE_GPU=1  # a bench that finds no device fails instead of timing CPU rows only
for name in "$@"; do
    xz -dkf "gpu-pack/variants/$name.xz" && chmod +x "gpu-pack/variants/$name"
done
for round in $(seq "${ROUNDS:-2}"); do
    for name in "$@"; do
        log=$out/$name-$round.log
        # shellcheck disable=SC2086  # BENCH_ARGS holds several options
        "gpu-pack/variants/$name" --bench "$filter" --noplot ${BENCH_ARGS:-} >"$log" 2>&1
        echo "$name round $round: $(awk '/^[a-z_0-9]+\// {id = $1}
            /time:/ && !/%/ {for (i = 1; i <= NF; i++) if ($i == "time:") printf "%s %s %s | ", id, $(i + 3), $(i + 4)}' "$log")"
    done
done

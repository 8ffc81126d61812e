#!/usr/bin/env bash
# Runs on the GPU machine from the repository root, after scripts/gpu-pack.sh built gpu-pack/ here:
# every GPU test, compute-sanitizer memcheck and racecheck over the fixture tests, then the benches.
# Logs and the criterion results go under $OUT (default ./gpu-out); a short table is printed last.
# Usage: scripts/gpu-run.sh [tests|sanitize|bench]...   (default: all three)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
export KDTREE_FIXTURES=$PWD/fixtures
steps=${*:-tests sanitize bench}
summary=()

run_tests() {
    for t in gpu-pack/tests/*; do
        local name log
        name=$(basename "$t")
        log="$out/test-$name.log"
        "$t" --test-threads 4 >"$log" 2>&1
        summary+=("test $name: exit $? | $(grep -h '^test result' "$log" | tail -1)")
    done
}

run_sanitizer() {
    local tool=$1
    for t in gpu-pack/tests/*; do
        local name log
        name=$(basename "$t")
        log="$out/$tool-$name.log"
        compute-sanitizer --tool "$tool" --error-exitcode 99 "$t" gpu_matches_every_fixture --test-threads 1 >"$log" 2>&1
        summary+=("$tool $name: exit $? | $(grep -h 'ERROR SUMMARY\|RACECHECK SUMMARY' "$log" | tail -1)")
    done
}

run_benches() {
    for b in gpu-pack/benches/*; do
        local name
        name=$(basename "$b")
        "$b" --bench >"$out/bench-$name.log" 2>&1
        summary+=("bench $name: exit $?")
    done
    tar -czf "$out/criterion.tar.gz" -C target criterion 2>/dev/null
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >"$out/gpu.txt" 2>&1
for step in $steps; do
    case $step in
        tests) run_tests ;;
        sanitize) run_sanitizer memcheck; run_sanitizer racecheck ;;
        bench) run_benches ;;
        *) echo "unknown step $step" >&2; exit 2 ;;
    esac
done
cat "$out/gpu.txt"
printf '%s\n' "${summary[@]}"

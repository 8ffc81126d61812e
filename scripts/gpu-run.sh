#!/usr/bin/env bash
# Runs on the GPU machine from the repository root, after scripts/gpu-pack.sh built gpu-pack/ here:
# every GPU test, compute-sanitizer memcheck and racecheck over the fixture tests, then the benches.
# Logs and the criterion results go under $OUT (default ./gpu-out); a short table is printed last.
# Usage: scripts/gpu-run.sh [tests|sanitize|bench|bench:NAME]...   (default: tests sanitize bench)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-$PWD/gpu-out}
logs=$out/logs
mkdir -p "$logs"
export KDTREE_FIXTURES=$PWD/fixtures
export CRITERION_HOME=$PWD/target/criterion
steps=${*:-tests sanitize bench}
summary=()

run_tests() {
    for t in gpu-pack/tests/*; do
        local name log
        name=$(basename "$t")
        log="$logs/test-$name.log"
        "$t" --test-threads 4 >"$log" 2>&1
        summary+=("test $name: exit $? | $(grep -h '^test result' "$log" | tail -1)")
    done
}

run_sanitizer() {
    local tool=$1
    for t in gpu-pack/tests/*; do
        local name log
        name=$(basename "$t")
        log="$logs/$tool-$name.log"
        compute-sanitizer --tool "$tool" --error-exitcode 99 "$t" gpu_matches_every_fixture --test-threads 1 >"$log" 2>&1
        summary+=("$tool $name: exit $? | $(grep -h 'ERROR SUMMARY\|RACECHECK SUMMARY' "$log" | tail -1)")
    done
}

run_bench() {
    local name=$1
    gpu-pack/benches/"$name" --bench >"$logs/bench-$name.log" 2>&1
    summary+=("bench $name: exit $?")
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >"$out/gpu.txt" 2>&1
date -u >>"$out/gpu.txt"
for step in $steps; do
    case $step in
        tests) run_tests ;;
        sanitize) run_sanitizer memcheck; run_sanitizer racecheck ;;
        bench) for b in gpu-pack/benches/*; do run_bench "$(basename "$b")"; done ;;
        bench:*) run_bench "${step#bench:}" ;;
        *) echo "unknown step $step" >&2; exit 2 ;;
    esac
done
[ -d target/criterion ] && tar -czf "$out/criterion.tar.gz" -C target criterion
tar -czf "$out/logs.tar.gz" -C "$out" logs && rm -rf "$logs"
printf '%s\n' "${summary[@]}" >"$out/summary.txt"
cat "$out/gpu.txt" "$out/summary.txt"
[ -d target/criterion ] && python3 benches/report.py target/criterion

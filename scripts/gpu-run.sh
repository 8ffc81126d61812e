#!/usr/bin/env bash
# Runs on the GPU machine from the repository root, after scripts/gpu-pack.sh built gpu-pack/ here:
# every GPU test, compute-sanitizer memcheck and racecheck over every test of every test binary, then
# the benches. Logs and the criterion results go under $OUT (default ./gpu-out); a short table is printed
# last. The proptest regression files (tests/*.proptest-regressions, where proptest persists a failing
# case next to the test source) are copied to $OUT/proptest-regressions/, so that a case found here can
# be committed in the repository (this machine has no git).
# TESTS="gpu-pack/tests/NAME ..." limits the tests step to those binaries.
# Usage: scripts/gpu-run.sh [tests|engine|kernels|spec|perplexity|serving|step|mma|sanitize|sanitize:quick|sanitize:NAME|profile|profile:moe|profile:mla|bench|bench:NAME|bench:NAME:FILTER]...
#        (FILTER: a criterion name filter, e.g. bench:mla:gpu_decode runs only those rows)
#        step: the Kimi-K2-shaped step table (examples/bench_step, random weights, 64 and 8 heads)
#        engine: the engine's tok/s table beside transformers' (examples/bench_generate, scripts/hf_generate_bench.py)
#        kernels: the tiny checkpoint's decode step, each kernel timed alone by ncu, summed
#        spec: greedy generation in every speculative mode (examples/generate --mode) on the shipped model
#        with held-out prompts, drafts from its DFlash drafter at batch SPEC_BATCHES (default 1 4 8 16 64)
#        and from prompt lookup at SPEC_NGRAM_BATCHES (default 1 8 64); SPEC_PROPOSERS picks (dflash ngram)
#        SPEC_MAX_TOKENS tokens per sequence (default 256; longer runs move less from call to call)
#        SPEC_ROUNDS batches one after another per run (default 1), SPEC_MODES the mode:budget list
#        mma: the mma.sync rate (benches/microbench/mma_rate.cu), given to benches/report.py
#        perplexity: the shipped model's held-out perplexity on CUDA beside PyTorch's (examples/perplexity)
#        serving: examples/serve --gpu in each of SERVE_MODES under examples/bench_serving's sweep
#        sanitize: memcheck and racecheck of every test of every binary, SANITIZE_JOBS (default 8)
#        (tool, binary) jobs at a time, each with --test-threads SANITIZE_THREADS (default 2) and, when
#        SANITIZE_TIMEOUT (seconds) is set, killed after that long; sanitize:quick only the fixture and
#        batch-invariance tests (matches_every_fixture, batch_invariant) of every binary; sanitize:NAME
#        every test of gpu-pack/tests/NAME; SANITIZE_TOOLS (default "racecheck memcheck") picks the tools;
#        SANITIZE_SPLIT=1 runs every test as its own job (logs
#        TOOL-BINARY-TEST.log), so that the slow ones run side by side
#        BENCH_ARGS="..." adds criterion options to every bench, e.g. BENCH_ARGS="--warm-up-time 2
#        --measurement-time 8" for the sustained runs of notes/benchmarks-history-2026-11.md, session 23
#        (default: tests sanitize bench)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
out=${OUT:-$PWD/gpu-out}
logs=$out/logs
mkdir -p "$logs"
[ -f gpu-pack/bundle.tar.xz ] && tar -xJf gpu-pack/bundle.tar.xz -C gpu-pack
export KDTREE_FIXTURES=$PWD/fixtures
export CRITERION_HOME=$PWD/target/criterion
# The GPU machine may keep ignored folders from an earlier call: start from no results, so that the
# tables printed last (benches/report.py reads every group there) are this call's alone.
rm -rf "$CRITERION_HOME"
export KDTREE_REQUIRE_GPU=1  # a GPU test that finds no device fails instead of skipping
steps=${*:-tests sanitize bench}
: >"$out/summary.txt"
note() { echo "$1" >>"$out/summary.txt"; }  # written as it goes, so a run cut short still reports

run_examples() {
    gpu-pack/examples/build_tree --gpu --budget 16 >"$logs/example-build_tree-gpu.log" 2>&1
    note "example build_tree --gpu: exit $? | $(head -1 "$logs/example-build_tree-gpu.log")"
    for backend in cpu gpu; do
        local flag=""
        [ $backend = gpu ] && flag=--gpu
        gpu-pack/examples/generate $flag --model fixtures/tiny_model --max-tokens 32 \
            --prompt "The capital of France is" >"$logs/example-generate-$backend.log" 2>&1
        note "example generate ($backend): exit $? | $(tail -c 300 "$logs/example-generate-$backend.log" | tr '\n' ' ')"
    done
}

run_tests() {
    # A bundle packed with KEEP may leave the examples out.
    if [ -x gpu-pack/examples/build_tree ] && [ -x gpu-pack/examples/generate ]; then
        run_examples
    else
        note "examples: not in this bundle"
    fi
    for t in ${TESTS:-gpu-pack/tests/*}; do
        local name log
        name=$(basename "$t")
        log="$logs/test-$name.log"
        "$t" --test-threads 4 --show-output >"$log" 2>&1
        note "test $name: exit $? | $(grep -h '^test result' "$log" | tail -1)"
    done
}

# One compute-sanitizer job: tool $1 over test binary $2, with the libtest arguments after them (a name
# filter, the thread count); its log is $logs/TOOL-NAME.log. The summary line is written when the job
# ends, so with jobs in parallel the lines come in the order they end.
sanitize_one() {
    local tool=$1 t=$2 name log start rc
    shift 2
    name=$(basename "$t")${SANITIZE_SPLIT:+-$1}
    name=${name//::/-}
    log="$logs/$tool-$name.log"
    start=$SECONDS
    timeout --kill-after=30 "${SANITIZE_TIMEOUT:-0}" \
        compute-sanitizer --tool "$tool" --error-exitcode 99 "$t" "$@" >"$log" 2>&1
    rc=$?
    if grep -q "terminated before first instrumented API call" "$log"; then
        note "$tool $name: no CUDA calls in the selected tests (CPU-only binary)"
    else
        if [ -n "${SANITIZE_TIMEOUT:-}" ] && { [ $rc = 124 ] || [ $rc = 137 ]; }; then
            echo "timed out after $SANITIZE_TIMEOUT s" >>"$log"
        fi
        note "$tool $name: exit $rc, $((SECONDS - start)) s | $(grep -h 'ERROR SUMMARY\|RACECHECK SUMMARY\|^timed out' "$log" | tail -1)"
    fi
}

# memcheck and racecheck of the test binaries gpu-pack/tests/$1, with the libtest arguments after it
# (none: every test), as parallel (tool, binary) jobs. The GPU has room for several test processes at
# once, and racecheck of the heavy tests takes much longer than memcheck, so its jobs start first.
run_sanitizer() {
    local only=$1 tool t
    shift
    for tool in ${SANITIZE_TOOLS:-racecheck memcheck}; do
        for t in gpu-pack/tests/$only; do
            if [ -n "${SANITIZE_SPLIT:-}" ] && [ $# = 0 ]; then
                # One job per test (libtest's terse list: "name: test").
                for name in $("$t" --list --format terse 2>/dev/null | sed -n 's/: test$//p'); do
                    while [ "$(jobs -rp | wc -l)" -ge "${SANITIZE_JOBS:-8}" ]; do wait -n; done
                    sanitize_one "$tool" "$t" "$name" --exact --test-threads 1 &
                done
                continue
            fi
            while [ "$(jobs -rp | wc -l)" -ge "${SANITIZE_JOBS:-8}" ]; do wait -n; done
            sanitize_one "$tool" "$t" "$@" --test-threads "${SANITIZE_THREADS:-2}" &
        done
    done
    wait
}

# Copies every proptest regression file to $OUT/proptest-regressions/ (after each step, so that a run
# cut short still brings back a failure found before; `final` also notes which files gained cases here).
regressions_before=$(mktemp -d)
cp tests/*.proptest-regressions "$regressions_before"/ 2>/dev/null
save_regressions() {
    local f
    mkdir -p "$out/proptest-regressions"
    for f in tests/*.proptest-regressions; do
        [ -f "$f" ] || continue
        cp "$f" "$out/proptest-regressions/"
        if [ "${1:-}" = final ] && ! cmp -s "$f" "$regressions_before/$(basename "$f")"; then
            note "proptest: new failing case(s) persisted in $f (copy in \$OUT/proptest-regressions/; commit it)"
        fi
    done
}

# Nsight Compute on one launch of each bandwidth-bound kernel at the issue's headline shapes.
# `profile:moe` profiles only the MoE GEMMs.
run_profile() {
    local sections=(--section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis --section LaunchStats)
    ncu --clock-control none --kernel-name regex:'topk_chunk_f32|topk_merge' --launch-count 2 "${sections[@]}" \
        gpu-pack/benches/topk --bench 'topk/gpu_f32/bs64_b64_v163840' --warm-up-time 0.05 --measurement-time 0.05 \
        >"$logs/ncu-topk.log" 2>&1
    note "ncu topk: exit $?"
    ncu --clock-control none --kernel-name regex:'greedy_accept_f32' --launch-count 1 "${sections[@]}" \
        gpu-pack/benches/greedy_accept --bench 'greedy_accept/gpu_f32/bs64_b64_v163840' --warm-up-time 0.05 \
        --measurement-time 0.05 >"$logs/ncu-greedy_accept.log" 2>&1
    note "ncu greedy_accept: exit $?"
    ncu --clock-control none --kernel-name tree_build --launch-count 1 "${sections[@]}" \
        gpu-pack/benches/tree_build --bench 'tree_build/gpu/bs64_b64' --warm-up-time 0.05 --measurement-time 0.05 \
        >"$logs/ncu-tree_build.log" 2>&1
    note "ncu tree_build: exit $?"
}

run_profile_moe() {
    local sections=(--section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section LaunchStats)
    for b in moe_int4 moe_int4_tiled; do
        ncu --clock-control none --kernel-name regex:'moe_(gate_up|down)' --launch-count 2 "${sections[@]}" \
            gpu-pack/benches/$b --bench "$b/gpu_experts/t1\$" --warm-up-time 0.05 --measurement-time 0.05 \
            >"$logs/ncu-$b.log" 2>&1
        note "ncu $b: exit $?"
    done
}

# `profile:mla` profiles one timed launch (past the warm-up check launches) of the MLA kernels at the
# decode rows that miss their target, an H 64 decode and a tree verify.
run_profile_mla() {
    local sections=(--section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section LaunchStats --section SourceCounters)
    for id in gpu_decode/h8_bs1_s65536 gpu_decode/h8_bs8_s16384 gpu_decode/h8_bs64_s1024 gpu_decode/h16_bs32_s4096 \
        gpu_decode/h64_bs8_s4096 gpu_tree/n65_h8_bs8_s4096; do
        ncu --clock-control none --kernel-name regex:'mla_' --launch-skip 20 --launch-count 2 "${sections[@]}" \
            gpu-pack/benches/mla --bench "mla/$id\$" --warm-up-time 0.05 --measurement-time 0.05 \
            >"$logs/ncu-mla-${id//\//-}.log" 2>&1
        note "ncu mla $id: exit $?"
    done
}

# The engine's greedy throughput (examples/bench_generate.rs) on the GPU and, in the same call, Hugging Face
# transformers' generate on the same checkpoint (scripts/hf_generate_bench.py); CSVs under $OUT.
run_engine() {
    gpu-pack/examples/bench_generate --gpu --out "$out/engine-gpu.csv" >"$logs/engine-gpu.log" 2>&1
    note "engine bench_generate --gpu: exit $? | $(tr '\n' ' ' <"$logs/engine-gpu.log" | tail -c 1500)"
    python3 scripts/hf_generate_bench.py --out "$out/transformers.csv" >"$logs/transformers.log" 2>&1
    note "transformers generate: exit $? | $(tr '\n' ' ' <"$logs/transformers.log" | tail -c 1200)"
}

# The tiny checkpoint's decode step, kernel by kernel: Nsight Compute times each kernel of one eager
# decode step alone (examples/bench_generate --profile-step; clocks and caches as in the step) at batch
# 1 and 32; scripts/ncu_sum.py sums them, to set beside the replayed step time of the `engine` step.
run_kernel_sum() {
    local batch
    for batch in 1 32; do
        ncu --profile-from-start off --clock-control none --cache-control none --metrics gpu__time_duration.sum \
            --csv gpu-pack/examples/bench_generate --gpu --tokens 16 --batches $batch --profile-step \
            >"$logs/kernels-bs$batch.log" 2>&1
        note "kernels of one decode step, batch $batch: exit $? | $(python3 scripts/ncu_sum.py "$logs/kernels-bs$batch.log" 2>&1 | tr '\n' ' ')"
    done
}

# Greedy generation through the speculative engine (examples/generate, prompt-lookup drafts) on the tiny
# checkpoint: every mode at batch 1 and 8, 256 tokens; the rate and the acceptance counters of each.
run_spec() {
    local batch batches spec mode budget proposer flag log
    note "spec | proposer | mode | budget | batch | tok/s | mean accepted length | steps by budget | stages"
    for proposer in ${SPEC_PROPOSERS:-dflash ngram}; do
        flag="" batches=${SPEC_BATCHES:-1 4 8 16 64}
        [ $proposer = ngram ] && flag="--ngram" batches=${SPEC_NGRAM_BATCHES:-1 8 64}
        for batch in $batches; do
            for spec in ${SPEC_MODES:-ar:16 chain:16 ddtree:8 ddtree:16 ddtree:32 ddtree:64 auto:64}; do
                mode=${spec%%:*} budget=${spec#*:}
                log=$logs/spec-$proposer-$mode-b$budget-bs$batch.log
                # shellcheck disable=SC2086  # flag is empty or one word
                gpu-pack/examples/generate --gpu --mode "$mode" --budget "$budget" --batch $batch --max-tokens "${SPEC_MAX_TOKENS:-256}" \
                    --rounds "${SPEC_ROUNDS:-1}" \
                    --prompts fixtures/models/heldout.txt $flag >"$log" 2>&1
                note "spec | $proposer | $mode | $budget | $batch | $(grep -o '[0-9.]* tok/s' "$log" | tail -1) | \
$(grep -o 'mean accepted length [0-9.]*' "$log" | awk '{print $4}') | $(grep 'steps by tree budget' "$log" | cut -d: -f2-) | \
$(grep '^stages' "$log" | cut -d: -f2-)"
            done
        done
    done
}

# The server on CUDA (examples/serve --gpu) in each mode, loaded by examples/bench_serving over the
# concurrency sweep: SGLang-style tables, one CSV and plot for all modes, and a check that every
# prompt's greedy output is the same at every concurrency. SERVE_MODES (default "ar chain ddtree auto").
run_serving() {
    local mode port=8100 pid
    rm -f "$out/bench_serving.csv"
    for mode in ${SERVE_MODES:-ar chain ddtree auto}; do
        gpu-pack/examples/serve --gpu --mode "$mode" --port $port --max-batch 64 >"$logs/serve-$mode.log" 2>&1 &
        pid=$!
        for _ in $(seq 1 120); do
            (echo >"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
            sleep 0.5
        done
        gpu-pack/examples/bench_serving --base-url "http://127.0.0.1:$port" --label "$mode" --append \
            --csv "$out/bench_serving.csv" --plot "$out/bench_serving.svg" >"$logs/bench_serving-$mode.log" 2>&1
        note "serving $mode: exit $? | $(grep -i 'greedy outputs' "$logs/bench_serving-$mode.log")"
        note "$(grep -A 8 '^label ' "$logs/bench_serving-$mode.log")"
        kill $pid
        wait $pid 2>/dev/null
        port=$((port + 1))
    done
}

# Held-out perplexity of the shipped model on CUDA beside PyTorch's (examples/perplexity).
run_perplexity() {
    gpu-pack/examples/perplexity --gpu >"$logs/perplexity-gpu.log" 2>&1
    note "perplexity (cuda): exit $? | $(tr '\n' ' ' <"$logs/perplexity-gpu.log" | tail -c 400)"
}

# The model step at Kimi-K2 dimensions with random weights (examples/bench_step.rs), 64 heads and 8 (one GPU's
# share of eight): step times, per-stage tables, 61-layer projections; CSVs under $OUT.
run_step_bench() {
    local heads
    for heads in 64 8; do
        gpu-pack/examples/bench_step --gpu --heads $heads --out "$out/step-h$heads.csv" >"$logs/step-h$heads.log" 2>&1
        note "bench_step --heads $heads: exit $? | $(tail -c 2500 "$logs/step-h$heads.log")"
    done
}

# The mma.sync m16n8k16 bf16 rate (benches/microbench/mma_rate.cu, compiled here), the compute ceiling
# the GEMM table is read against; the best rate goes to $out/mma_rate.txt for benches/report.py.
run_mma_rate() {
    (cd benches/microbench && nvcc -arch=sm_90 -O3 -std=c++17 mma_rate.cu -o "$out/mma_rate") >"$logs/mma_rate.log" 2>&1 &&
        "$out/mma_rate" >>"$logs/mma_rate.log" 2>&1
    grep -o '[0-9.]* TFLOP/s' "$logs/mma_rate.log" | sort -n | tail -1 | cut -d' ' -f1 >"$out/mma_rate.txt"
    rm -f "$out/mma_rate"
    note "mma.sync rate: $(cat "$out/mma_rate.txt") TFLOP/s"
}

run_bench() {
    local name=$1 filter=${2:-}
    # shellcheck disable=SC2086  # BENCH_ARGS holds several options
    gpu-pack/benches/"$name" --bench $filter ${BENCH_ARGS:-} >>"$logs/bench-$name.log" 2>&1
    note "bench $name $filter: exit $?"
    tar -czf "$out/criterion.tar.gz" -C target criterion
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >"$out/gpu.txt" 2>&1
date -u >>"$out/gpu.txt"
for step in $steps; do
    case $step in
        tests) run_tests ;;
        engine) run_engine ;;
        step) run_step_bench ;;
        kernels) run_kernel_sum ;;
        spec) run_spec ;;
        mma) run_mma_rate ;;
        perplexity) run_perplexity ;;
        serving) run_serving ;;
        sanitize) run_sanitizer '*' ;;
        sanitize:quick) run_sanitizer '*' matches_every_fixture batch_invariant ;;
        sanitize:*) run_sanitizer "${step#sanitize:}" ;;
        bench) for b in gpu-pack/benches/*; do run_bench "$(basename "$b")"; done ;;
        bench:*:*) spec=${step#bench:}; run_bench "${spec%%:*}" "${spec#*:}" ;;
        bench:*) run_bench "${step#bench:}" ;;
        profile) run_profile; run_profile_moe ;;
        profile:moe) run_profile_moe ;;
        profile:mla) run_profile_mla ;;
        *) echo "unknown step $step" >&2; exit 2 ;;
    esac
    save_regressions
done
save_regressions final
rm -rf "$regressions_before"
[ -d target/criterion ] && tar -czf "$out/criterion.tar.gz" -C target criterion
tar -czf "$out/logs.tar.gz" -C "$out" logs && rm -rf "$logs"
cat "$out/gpu.txt" "$out/summary.txt"
mma_args=()
[ -s "$out/mma_rate.txt" ] && mma_args=(--mma-rate "$(cat "$out/mma_rate.txt")")
if [ -d target/criterion ]; then python3 benches/report.py target/criterion "${mma_args[@]}"; fi

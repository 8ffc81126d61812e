#!/usr/bin/env bash
# Builds the CUDA test and bench binaries (release, no debug info), strips them and packs them into
# gpu-pack/bundle.tar.xz (git-ignored; about a quarter of their size, since the working tree that travels
# to the GPU machine is limited to 64 MiB with the fixtures), where scripts/gpu-run.sh unpacks and runs them.
# Needs NVCC (scripts/install-nvcc.sh). Usage: [KEEP="PATTERN ..."] scripts/gpu-pack.sh [extra cargo features]
# KEEP packs only the binaries whose paths match one of the glob patterns (e.g. KEEP="tests/* benches/topk"):
# every binary embeds the kernels' fatbin, so all of them and the fixtures no longer fit the 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${NVCC:?set NVCC to the nvcc that scripts/install-nvcc.sh printed}"
features="cuda-13000${1:+,$1}"
# gpu-pack/variants/ (scripts/gpu-variant.sh) is kept: remove what should not travel.
rm -rf gpu-pack/tests gpu-pack/benches gpu-pack/examples gpu-pack/bundle.tar.xz
mkdir -p gpu-pack/tests gpu-pack/benches gpu-pack/examples
copy_executables() { # $1: destination, $2: target kind (test or bench); stdin: cargo's JSON messages
    python3 -c '
import json, shutil, sys
for line in sys.stdin:
    msg = json.loads(line)
    exe = msg.get("executable")
    if msg.get("reason") == "compiler-artifact" and exe and msg["target"]["kind"] == [sys.argv[2]]:
        shutil.copy(exe, sys.argv[1] + "/" + msg["target"]["name"])
        print(sys.argv[1] + "/" + msg["target"]["name"])
' "$1" "$2"
}
cargo test --release --features "$features" --no-run --message-format=json | copy_executables gpu-pack/tests test
cargo bench --features "$features" --no-run --message-format=json | copy_executables gpu-pack/benches bench
# The MoE tests and bench once more under the other INT4 layout: both must pass the same fixtures.
mkdir -p gpu-pack/tiled
cargo test --release --no-default-features --features "$features,int4-tiled" --no-run --test moe_int4 \
    --message-format=json |
    copy_executables gpu-pack/tiled test
mv gpu-pack/tiled/moe_int4 gpu-pack/tests/moe_int4_tiled
cargo bench --no-default-features --features "$features,int4-tiled" --no-run --bench moe_int4 \
    --message-format=json | copy_executables gpu-pack/tiled bench
mv gpu-pack/tiled/moe_int4 gpu-pack/benches/moe_int4_tiled && rmdir gpu-pack/tiled
cargo build --release --features "$features" --example build_tree --example generate --example perplexity --example bench_generate \
    --example bench_step
examples=${CARGO_TARGET_DIR:-target}/release/examples
cp "$examples"/build_tree "$examples"/generate "$examples"/perplexity "$examples"/bench_generate \
    "$examples"/bench_step gpu-pack/examples/
if [ -n "${KEEP:-}" ]; then
    read -ra patterns <<<"$KEEP"  # split on blanks, with no pathname expansion
    for f in gpu-pack/tests/* gpu-pack/benches/* gpu-pack/examples/*; do
        keep=0
        for pattern in "${patterns[@]}"; do
            # shellcheck disable=SC2053  # the pattern is a glob on purpose
            [[ ${f#gpu-pack/} == $pattern ]] && keep=1
        done
        [ $keep = 1 ] || rm "$f"
    done
fi
shopt -s nullglob  # KEEP may leave a folder empty
strip gpu-pack/tests/* gpu-pack/benches/* gpu-pack/examples/*
# Every binary embeds the same kernels: a dictionary larger than the binaries lets xz store them once
# (four test binaries: 10.7 MB with xz's default, 4.2 MB so).
tar -cf - -C gpu-pack tests benches examples | xz -9 --lzma2=preset=9,dict=128MiB >gpu-pack/bundle.tar.xz
rm -rf gpu-pack/tests gpu-pack/benches gpu-pack/examples
du -sh gpu-pack

#!/usr/bin/env bash
# Builds one criterion bench binary at a git revision, for a side-by-side A/B on the GPU machine
# (scripts/gpu-ab.sh): the bench at REV is built in a temporary worktree (its target folder kept under
# target/variants/ so later builds are incremental), stripped and compressed to gpu-pack/variants/NAME.xz,
# which travels with gpu-pack/. Run it after scripts/gpu-pack.sh, which keeps gpu-pack/variants/.
# Needs NVCC (scripts/install-nvcc.sh).
# Usage: scripts/gpu-variant.sh REV NAME BENCH [cargo feature arguments, default --features cuda-13000]
#   e.g. scripts/gpu-variant.sh HEAD~1 before moe_int4 --no-default-features --features cuda-13000,int4-tiled
set -euo pipefail
cd "$(dirname "$0")/.."
: "${NVCC:?set NVCC to the nvcc that scripts/install-nvcc.sh printed}"
[ $# -ge 3 ] || { sed -n '2,8p' "$0"; exit 2; }
rev=$1 name=$2 bench=$3
shift 3
features=("$@")
[ ${#features[@]} -gt 0 ] || features=(--features cuda-13000)
commit=$(git rev-parse --verify "$rev^{commit}")
tree=$(mktemp -d)
trap 'git worktree remove --force "$tree"' EXIT
git worktree add --detach -q "$tree" "$commit"
top=$PWD
exe=$(cd "$tree" && CARGO_TARGET_DIR="$top/target/variants" \
    cargo bench "${features[@]}" --no-run --bench "$bench" --message-format=json |
    python3 -c '
import json, sys
for line in sys.stdin:
    msg = json.loads(line)
    if msg.get("reason") == "compiler-artifact" and msg.get("executable") and msg["target"]["kind"] == ["bench"]:
        print(msg["executable"])
')
mkdir -p gpu-pack/variants
strip -o "gpu-pack/variants/$name" "$exe"
xz -f -T2 -3 "gpu-pack/variants/$name"
echo "gpu-pack/variants/$name.xz: bench $bench at ${commit:0:7} (${features[*]})"

#!/usr/bin/env bash
# Runs on the GPU machine from the repository root: trains the shipped model's target (train/target.py)
# or its drafter (train/drafter.py) with train/data/ carried along, and leaves the log and the written
# model folder (the drafter's alone for drafter), as one tar, under $OUT (default ./gpu-out).
# Usage: scripts/gpu-train.sh target|drafter   (extra arguments go to the script)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
what=${1:?target or drafter}
shift
python3 "train/$what.py" "$@" 2>&1 | tee "$out/$what.log"
status=${PIPESTATUS[0]}
folder=tiny-k2
[ "$what" = drafter ] && folder=tiny-k2/drafter
tar -cf "$out/$what.tar" -C fixtures/models "$folder"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >>"$out/$what.log"
exit "$status"

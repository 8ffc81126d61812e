#!/usr/bin/env bash
# Installs the pinned CUDA 13.0 compiler wheels from PyPI into a venv, so that `--features cuda` builds on a
# machine without a CUDA toolkit. Every wheel is pinned: the nvcc wheel's own dependencies are unpinned and
# would resolve to a newer toolkit whose PTX the H200's driver (580, CUDA 13.0) rejects.
# Usage: scripts/install-nvcc.sh [VENV_DIR]   (default: .cuda-venv in the repository root)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-$root/.cuda-venv}
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --disable-pip-version-check \
    nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 \
    nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85
nvcc=$(ls "$venv"/lib/python3*/site-packages/nvidia/cu13/bin/nvcc)
"$nvcc" --version | grep -q 'release 13.0' || { echo "error: $nvcc is not release 13.0" >&2; exit 1; }
echo "nvcc installed: $nvcc"
echo "to build the CUDA kernels:  export NVCC=$nvcc PATH=$(dirname "$nvcc"):\$PATH"
echo "(build.rs uses \$NVCC; the \`cuda\` feature alone also runs \`nvcc --version\` from PATH to pick the CUDA version)"

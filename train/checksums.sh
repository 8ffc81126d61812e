#!/usr/bin/env bash
# Writes fixtures/models/SHA256SUMS: every shipped file of the trained model (and the held-out text),
# which tests/trained_model.rs checks. Run after train/target.py and train/drafter.py.
set -euo pipefail
cd "$(dirname "$0")/../fixtures/models"
find . -type f ! -name SHA256SUMS | sed 's|^\./||' | LC_ALL=C sort | xargs sha256sum >SHA256SUMS
cat SHA256SUMS

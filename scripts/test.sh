#!/usr/bin/env bash
# The whole test suite on a fresh machine: set up the venv, then pytest (unit + real TorchServe).
# One inductor cache directory is shared by the test process and every TorchServe worker it starts.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$PWD/.cache/inductor}
echo "[test] ruff check"
.venv/bin/ruff check handlers scripts tests benchmarks
exec .venv/bin/python -m pytest "$@"

#!/usr/bin/env bash
# One command from a fresh clone to a served embedding: venv + install, package the embedded
# all-MiniLM-L6-v2, start TorchServe with compile on, send a sample request, show the answer and the rung.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
.venv/bin/python -m handlers package
bash scripts/stop.sh >/dev/null 2>&1 || true
bash scripts/start.sh
exec .venv/bin/python scripts/sample_request.py

#!/usr/bin/env bash
# Create (or reuse) the project venv and install the default profile: torch 2.13.0 CPU first, pinned,
# so nothing later pulls a multi-GB CUDA build; then TorchServe, transformers and the test tools.
# The pt2-handlers package itself is NOT left installed: archives carry their own copy of `handlers`,
# and the tests prove they load on a host without it.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
started=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  python3 -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
if ! "$VENV/bin/python" -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
  echo "[setup] installing torch==2.13.0 (CPU)"
  "${PIP[@]}" install torch==2.13.0
fi
echo "[setup] installing pt2-handlers dependencies (.[cpu,test])"
"${PIP[@]}" install ".[cpu,test]"
"${PIP[@]}" uninstall -y pt2-handlers >/dev/null
command -v java >/dev/null || { echo "[setup] TorchServe needs Java 17 (apt-get install openjdk-17-jre-headless)"; exit 1; }
echo "[setup] done in $(( $(date +%s) - started ))s: $("$VENV/bin/python" -c 'import torch, transformers, ts; print("torch", torch.__version__, "transformers", transformers.__version__, "torchserve", ts.__version__)')"

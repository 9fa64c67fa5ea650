#!/usr/bin/env bash
# Create (or reuse) a profile's venv.
#
#   bash scripts/setup.sh                   default profile in .venv: torch 2.13.0 CPU, TorchServe, transformers
#   bash scripts/setup.sh --profile ipex    ipex profile in .venv-ipex: torch 2.8.0 + intel-extension-for-pytorch 2.8.0
#   bash scripts/setup.sh --ipex-wheel      print a directory holding the unpacked IPEX 2.8.0 wheel (no install),
#                                           for the test that puts it beside torch 2.13 (a version mismatch)
#   bash scripts/setup.sh --qa-reference    print a directory holding transformers 4.57.1 (no install into a venv):
#                                           its question-answering pipeline, which transformers 5 dropped, is the
#                                           reference the QA task is proven against (tests/pipeline_reference.py)
#
# Default: torch 2.13.0 CPU is installed first, pinned, so nothing later pulls a multi-GB CUDA build.
# ipex: IPEX 2.8 works only with torch 2.8.*, and the only torch 2.8.0 wheel the registry has is the CUDA
# build, which does not import without its nvidia-* libraries (~7.4 GB installed, ~3 min). So that venv
# lives outside the clone, under $PT2_PROFILES_DIR (default ~/.cache/pt2-handlers), keyed by the Python
# version and the dependency lists in pyproject.toml; repeat runs and new clones reuse it, and .venv-ipex links to it.
# The pt2-handlers package itself is NOT left installed: archives carry their own copy of `handlers`,
# and the tests prove they load on a host without it.
set -euo pipefail
cd "$(dirname "$0")/.."
PROFILE=default
case "${1:-}" in
  "") ;;
  --profile) PROFILE=${2:?--profile needs a name: default or ipex} ;;
  --ipex-wheel) PROFILE=ipex-wheel ;;
  --qa-reference) PROFILE=qa-reference ;;
  *) echo "usage: $0 [--profile default|ipex] [--ipex-wheel] [--qa-reference]" >&2; exit 2 ;;
esac
PROFILES_DIR=${PT2_PROFILES_DIR:-$HOME/.cache/pt2-handlers}
IPEX_PIN="intel-extension-for-pytorch==2.8.0"
# The last transformers with the question-answering pipeline, and the versions of its own dependencies it accepts.
QA_REFERENCE_PINS=(transformers==4.57.1 tokenizers==0.22.2 huggingface-hub==0.36.2 requests==2.34.2 urllib3==2.8.0
                   idna==3.20 charset-normalizer==3.5.2 certifi==2026.10.18)
started=$(date +%s)

pip_in() { "$1/bin/python" -m pip --disable-pip-version-check -q "${@:2}"; }

report() {
  echo "[setup] $PROFILE done in $(( $(date +%s) - started ))s: $("$1/bin/python" -c 'import torch, transformers, ts; print("torch", torch.__version__, "transformers", transformers.__version__, "torchserve", ts.__version__)' 2>/dev/null)"
}

case "$PROFILE" in
  default)
    VENV=${VENV:-.venv}
    if [ ! -x "$VENV/bin/python" ]; then
      echo "[setup] creating $VENV"
      python3 -m venv "$VENV"
    fi
    if ! "$VENV/bin/python" -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
      echo "[setup] installing torch==2.13.0 (CPU)"
      pip_in "$VENV" install torch==2.13.0
    fi
    echo "[setup] installing pt2-handlers dependencies (.[cpu,test,grpc,deploy,example])"
    pip_in "$VENV" install ".[cpu,test,grpc,deploy,example]"
    pip_in "$VENV" uninstall -y pt2-handlers >/dev/null
    command -v java >/dev/null || { echo "[setup] TorchServe needs Java 17 (apt-get install openjdk-17-jre-headless)"; exit 1; }
    report "$VENV"
    ;;
  ipex)
    # Keyed by what the venv holds: the Python version and the dependency lists it installs.
    key=$(python3 -c 'import hashlib, json, sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
pins = [sys.version.split()[0], project["dependencies"], project["optional-dependencies"]["ipex"],
        project["optional-dependencies"]["test"], project["optional-dependencies"]["example"]]
print(hashlib.sha256(json.dumps(pins).encode()).hexdigest()[:12])')
    VENV="$PROFILES_DIR/venv-ipex-$key"
    if [ -f "$VENV/.complete" ]; then
      echo "[setup] reusing $VENV (same Python and dependency pins)"
    else
      rm -rf "$VENV"
      mkdir -p "$PROFILES_DIR"
      echo "[setup] creating $VENV: torch 2.8.0 (CUDA build + nvidia-* libraries, several GB) + $IPEX_PIN"
      python3 -m venv "$VENV"
      pip_in "$VENV" install ".[ipex,test,example]"
      pip_in "$VENV" uninstall -y pt2-handlers >/dev/null
      echo "[setup] ipex venv: $(du -sh "$VENV" | cut -f1) in $(( $(date +%s) - started ))s"
      touch "$VENV/.complete"
      # Venvs of older pins are not reused by anything: reclaim their disk.
      find "$PROFILES_DIR" -maxdepth 1 -name 'venv-ipex-*' ! -path "$VENV" -exec rm -rf {} +
    fi
    ln -sfn "$VENV" .venv-ipex
    report "$VENV"
    ;;
  ipex-wheel)
    unpacked="$PROFILES_DIR/${IPEX_PIN/==/-}-unpacked"
    if [ ! -f "$unpacked/.complete" ]; then
      rm -rf "$unpacked" "$PROFILES_DIR/wheels"
      mkdir -p "$PROFILES_DIR/wheels" "$unpacked"
      python=$(command -v .venv/bin/python || command -v python3)
      "$python" -m pip --disable-pip-version-check -q download --no-deps -d "$PROFILES_DIR/wheels" "$IPEX_PIN" >&2
      "$python" -m zipfile -e "$PROFILES_DIR"/wheels/intel_extension_for_pytorch-*.whl "$unpacked"
      touch "$unpacked/.complete"
    fi
    echo "$unpacked"
    ;;
  qa-reference)
    target="$PROFILES_DIR/transformers-4.57.1-reference"
    if [ ! -f "$target/.complete" ]; then
      rm -rf "$target"
      mkdir -p "$target"
      python=$(command -v .venv/bin/python || command -v python3)
      "$python" -m pip --disable-pip-version-check -q install --no-deps --target "$target" "${QA_REFERENCE_PINS[@]}" >&2
      touch "$target/.complete"
    fi
    echo "$target"
    ;;
  *) echo "[setup] unknown profile $PROFILE (default or ipex)" >&2; exit 2 ;;
esac

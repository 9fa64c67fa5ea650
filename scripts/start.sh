#!/usr/bin/env bash
# python -m handlers start: torchserve --start with model_configs/config.properties (loopback, token auth on), wait
# for READY, print how to call it. Arguments: models as name=file.mar (default: minilm=minilm.mar), and its options
# (--config, --run-dir, --model-store, --timeout).
# VENV=.venv-ipex serves under the ipex profile (scripts/setup.sh --profile ipex).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${VENV:-.venv}/bin/python" -m handlers start "$@"

#!/usr/bin/env bash
# torchserve --start with model_configs/config.properties (loopback, token auth on), wait for READY,
# print how to call it. Arguments: models as name=file.mar (default: minilm=minilm.mar).
# VENV=.venv-ipex serves under the ipex profile (scripts/setup.sh --profile ipex).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${VENV:-.venv}/bin/python" scripts/tsctl.py start "$@"

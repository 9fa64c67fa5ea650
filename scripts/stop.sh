#!/usr/bin/env bash
# python -m handlers stop: torchserve --stop for the server scripts/start.sh started (its pid file lives in .run/tmp).
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m handlers stop "$@"

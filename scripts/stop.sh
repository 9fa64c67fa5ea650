#!/usr/bin/env bash
# torchserve --stop for the server scripts/start.sh started (its pid file lives in .run/tmp).
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python scripts/tsctl.py stop "$@"

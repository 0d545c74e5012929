#!/usr/bin/env bash
# The test suite: install with test extras, then run pytest (arguments go to pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
exec .venv/bin/python -m pytest -q "$@"

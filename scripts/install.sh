#!/usr/bin/env bash
# Create .venv (if absent) and install offload into it with the CPU build of torch.
# Usage: bash scripts/install.sh [EXTRAS]   e.g. bash scripts/install.sh test (default: plot, for the demo's PNG)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="[${1:-plot}]"
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
# torch is pinned to the CPU build; an unpinned torch would pull a multi-GB CUDA build.
.venv/bin/python -m pip install --quiet "torch==2.13.0" -e ".${extras}"

#!/usr/bin/env bash
# Create .venv (if absent) and install offload into it with the CPU build of torch.
# Usage: bash scripts/install.sh [EXTRAS]   e.g. bash scripts/install.sh test (default: plot, for the demo's PNG)
# pip runs only when the install's inputs changed since the last install of this extra (pyproject.toml, setup.py,
# this file, csrc/, the Python version: scripts/install_stamp.py keeps their hash in .venv/.install-stamp), so a
# kernel edit rebuilds and an unchanged checkout starts at once. OFFLOAD_REINSTALL=1 runs pip regardless.
set -euo pipefail
cd "$(dirname "$0")/.."
extra="${1:-plot}"
stamp=.venv/.install-stamp
[ -x .venv/bin/python ] || python3 -m venv .venv
if [ "${OFFLOAD_REINSTALL:-0}" != 1 ] && .venv/bin/python scripts/install_stamp.py check "$stamp" "$extra"; then
    echo "install.sh: .venv is current for [$extra] (its inputs are unchanged since it was installed); pip skipped" >&2
    exit 0
fi
.venv/bin/python scripts/install_stamp.py begin "$stamp"
.venv/bin/python -m pip install --quiet --upgrade pip
# torch is pinned to the CPU build; an unpinned torch would pull a multi-GB CUDA build. xgrammar (structured outputs)
# requires torch too: resolved in this one command, it takes the pinned CPU build.
.venv/bin/python -m pip install --quiet "torch==2.13.0" -e ".[${extra}]"
.venv/bin/python scripts/install_stamp.py record "$stamp" "$extra"

#!/usr/bin/env bash
# The main job: install, then run configs/demo.yaml, a batch of nine short prompts (among them
# "What is the capital of France?") through the default model (SmolLM2-135M-Instruct), printing each
# answer, then the report of where the time went. Extra arguments go to `offload run`. The install is skipped
# when .venv is current (install.sh's stamp): a second run starts the job at once.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/offload run configs/demo.yaml --restart "$@"

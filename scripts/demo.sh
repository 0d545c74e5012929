#!/usr/bin/env bash
# The main job: install, then answer a question with the default model (SmolLM2-135M-Instruct).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/offload generate --model default --prompt "${1:-What is the capital of France?}"

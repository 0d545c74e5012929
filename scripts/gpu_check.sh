#!/usr/bin/env bash
# The GPU check: CUDA tests, then a Llama-3.1-70B-shaped q4_0 model (random weights, built in memory)
# planned for a 22 GiB GPU budget. Needs no network: torch, transformers, safetensors, numba and pybind11
# must already be installed. Finishes in a few minutes on one H200.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --no-deps --no-build-isolation -e . 2>&1 | tail -n 3 || true
python - <<'PY'
import torch, offload.kernels as k
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
print("cpu kernels:", k.ACTIVE_PATH)
PY
python -m pytest -q -m cuda tests/ -p no:cacheprovider
timeout 480 python scripts/bench_offload.py --model configs/models/llama-3.1-70b --quantization q4_0 \
    --gpu-memory 22GiB --hardware configs/hardware/h200-server.yaml --backend cuda --prompt-len 512 \
    --decode-tokens 8 --batches 1,32

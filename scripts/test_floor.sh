#!/usr/bin/env bash
# The model families against the oldest transformers offload supports (pyproject.toml's floor, the first release
# with all of them: gpt-oss came in 4.55) as well as the newest the main suite installs: a venv of its own with that
# release and offload's other requirements, offload from this checkout (the kernels scripts/install.sh built in
# place), and the tests that hold each family's Hugging Face folders to transformers in fp32. (GGUF files' tokenizers
# are read by transformers too: the test files' byte-level ones need 5's GGUF converter, so those tests run in the
# main suite only.)
# Usage: bash scripts/test_floor.sh [pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
floor=$(sed -n 's/^ *"transformers>=\([0-9.]*\)".*/\1/p' pyproject.toml)
venv=.venv-floor
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet "torch==2.13.0" "transformers==$floor" safetensors numpy numba "gguf>=0.10" \
    "pydantic>=2" pyyaml pytest accelerate tqdm protobuf sentencepiece
echo "test_floor.sh: transformers $("$venv/bin/python" -c 'import transformers; print(transformers.__version__)')" >&2
PYTHONPATH=. exec "$venv/bin/python" -m pytest -q -p no:cacheprovider -m "not slow" tests/test_families.py \
    tests/test_mxfp4_checkpoint.py tests/test_model_reference.py "$@"

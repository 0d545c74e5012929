#!/usr/bin/env bash
# The GPU check: measures first and writes as it goes. From a cold machine: the C++ kernels built in place (in
# parallel), the kernel-path check, the environment, then ten items in order (scripts/gpu_check/steps.py lists them
# with their limits and the arithmetic behind each), then ten representative CUDA tests. Each step runs in a
# process of its own and appends one JSON line to $OUT/items.jsonl as it ends (flushed: a kill mid-run keeps every
# finished line).
#   bash scripts/gpu_check.sh           on a machine with a CUDA GPU (no network needed: torch, transformers,
#                                       safetensors, gguf, triton, pybind11 and pytest must be installed)
#   bash scripts/gpu_check.sh --smoke   every item's code path on the strict simulated device at tiny sizes (CI)
#   --fresh                             forget what an earlier run finished
# Packages a GPU machine without network lacks are installed from .whl/ (git-ignored), filled beforehand with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 -d .whl gguf pydantic pydantic_core annotated-types typing-inspection \
#       setuptools
# Every step runs even if an earlier one failed; the exit code is non-zero if any failed. The whole check has a
# deadline, GPU_CHECK_BUDGET_S (330 s: the device's 15 minutes hold a machine start, this run and a rerun); each
# step's limit is cut to what is left, and a step that would get too little is not started. A rerun skips the
# steps that finished (state in .gpu_check/, git-ignored, or GPU_CHECK_STATE).
# Output, in $OUT (the device tool's folder) or a fresh temporary one: items.jsonl, summary.json, env.txt and
# logs.tar.gz (every step's log, at most 16 MiB).
set -uo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)
smoke=0
fresh=0
for arg in "$@"; do
    case $arg in
        --smoke) smoke=1 ;;
        --fresh) fresh=1 ;;
        *) echo "gpu_check.sh: unknown option $arg; use --smoke and/or --fresh" >&2; exit 2 ;;
    esac
done
mode=$([ "$smoke" -eq 1 ] && echo smoke || echo cuda)
state=${GPU_CHECK_STATE:-.gpu_check/$mode}
[ "$fresh" -eq 1 ] && rm -rf "$state"
mkdir -p "$state"
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
py=python3
[ -x .venv/bin/python ] && py=.venv/bin/python
if [ "$smoke" -eq 0 ] && compgen -G ".whl/*.whl" > /dev/null; then
    # gguf, pydantic, a setuptools new enough for pyproject's license field; offload runs from this folder
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        > "$state/wheels.log" 2>&1 || echo "gpu_check.sh: the wheels in .whl/ did not install (see wheels.log)"
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD/scripts:$PWD${PYTHONPATH:+:$PYTHONPATH}
flags=()
[ "$smoke" -eq 1 ] && flags=(--smoke)
$py -m gpu_check run "${flags[@]}" --out "$out" --state "$state" --budget-s "${GPU_CHECK_BUDGET_S:-330}" \
    --started "$started"
rc=$?
# every step's log in one archive, each log cut to its last MiB where the whole would pass 16 MiB
tar -czf "$out/logs.tar.gz" -C "$(dirname "$state")" "$(basename "$state")" 2>/dev/null
if [ "$(stat -c %s "$out/logs.tar.gz")" -gt $(( 16 * 1024 * 1024 )) ]; then
    for f in "$state"/*.log; do tail -c 1048576 "$f" > "$f.tail" && mv "$f.tail" "$f"; done
    tar -czf "$out/logs.tar.gz" -C "$(dirname "$state")" "$(basename "$state")"
fi
echo "gpu_check.sh: $out holds $(ls "$out" | tr '\n' ' ')"
exit $rc

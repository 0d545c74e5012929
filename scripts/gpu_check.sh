#!/usr/bin/env bash
# The GPU check: the full `offload calibrate` (the figures the plans below use: on the GPU, matmul rates by rows of
# each weight format's kernels, the launch and hand-over seconds; under a minute of its time), the CUDA tests (the fused
# dequant kernels of q8_0/q4_0 and GGUF's q4_1/K-quants among them), a Llama-3.1-70B-shaped q4_0 model (random
# weights in memory) planned for a 22 GiB budget, offload against accelerate on a random 3B bf16 checkpoint with
# a 2 GiB GPU budget (scripts/bench_gpu_offload.py), then the fused dequant kernels against the torch fallback;
# one JSON summary at the end.
#   bash scripts/gpu_check.sh           on a machine with a CUDA GPU (no network needed: torch, transformers,
#                                       safetensors, gguf, triton, numba, pybind11 and pytest must be installed)
#   bash scripts/gpu_check.sh --smoke   the same steps on a CPU-only machine: the simulated asynchronous GPU in
#                                       place of CUDA and a scaled-down model (what CI runs)
# Packages a GPU machine without network lacks are installed from .whl/ (git-ignored), filled beforehand with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 -d .whl gguf pydantic pydantic_core annotated-types typing-inspection setuptools
# (the versions matching each other: pydantic's pins pydantic_core's).
# Every step runs even if an earlier one failed; the exit code is non-zero if any step failed.
# Time: the whole check has a deadline (GPU_CHECK_BUDGET_S, default 330 s: the device's 15 minutes hold a machine
# start, this run and a rerun); each step has its own limit, cut to what is left of the budget, and a step that
# would get under 10 s is not started (rc 124, "no time"). A rerun on the same machine skips the steps that
# finished (their logs and figures are kept in .gpu_check/, git-ignored; --fresh clears it).
# Output: $OUT (the device tool's output folder, of which only 8 files come back) or a fresh temporary folder gets
# two files: summary.json and logs.tar.gz (every step's log and JSON figures, at most 16 MiB).
set -uo pipefail
cd "$(dirname "$0")/.."
smoke=0
for arg in "$@"; do
    case $arg in
        --smoke) smoke=1 ;;
        --fresh) rm -rf .gpu_check ;;
        *) echo "gpu_check.sh: unknown option $arg; use --smoke and/or --fresh" >&2; exit 2 ;;
    esac
done
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
state=.gpu_check/$([ "$smoke" -eq 1 ] && echo smoke || echo cuda)  # what finished, kept between reruns
mkdir -p "$state"
logs=$state  # every step's log and figures; archived into $out at the end
py=python3
[ -x .venv/bin/python ] && py=.venv/bin/python
budget=${GPU_CHECK_BUDGET_S:-330}
began=$(date +%s)
: > "$logs/steps.jsonl.new"
failed=0

step() {  # step NAME TIMEOUT_S COMMAND...: run it (unless a rerun finds it done), keep its log, record it
    local name=$1 limit=$2 start rc left
    shift 2
    start=$(date +%s)
    if [ -f "$state/$name.done" ]; then
        echo "== $name: finished in an earlier run, skipped (--fresh reruns it)"
        record "$name" 0 "$start" true
        return 0
    fi
    left=$(( budget - (start - began) ))
    [ "$limit" -gt "$left" ] && limit=$left
    if [ "$limit" -lt 10 ]; then
        echo "== $name: not started, the check's budget of ${budget}s is spent"
        record "$name" 124 "$start"
        return 124
    fi
    echo "== $name (at most ${limit}s): $*"
    timeout "$limit" "$@" > "$logs/$name.log" 2>&1
    rc=$?
    tail -n 30 "$logs/$name.log"
    [ "$rc" -eq 0 ] && touch "$state/$name.done"
    record "$name" "$rc" "$start"
}

record() {  # record NAME RC START [SKIPPED]: a step's exit code and seconds in steps.jsonl; returns RC
    echo "{\"step\": \"$1\", \"rc\": $2, \"seconds\": $(( $(date +%s) - $3 )), \"skipped\": ${4:-false}}" \
        >> "$logs/steps.jsonl.new"
    [ "$2" -eq 0 ] || failed=1
    return "$2"
}

if [ "$smoke" -eq 0 ]; then
    # Packages the GPU machine lacks travel as wheels in .whl/ (gguf, pydantic, a setuptools new enough for
    # pyproject's license field); offload itself runs from this folder with its kernels built in place.
    if compgen -G ".whl/*.whl" > /dev/null; then
        step wheels 120 $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    step install 300 $py setup.py -q build_ext --inplace
fi
step environment 60 $py -c "import os, torch, offload.kernels as k, offload.kernels.triton_dequant as t
print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else '(no GPU)')
print('cpu kernels:', k.ACTIVE_PATH, '| triton:', t.TRITON_AVAILABLE, '| cores:', os.cpu_count(),
      '| RAM:', os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') >> 30, 'GiB')"
if [ "$smoke" -eq 0 ]; then
    # the 3B checkpoint for bench_gpu_offload is written beside the tests (one CPU core; the tests use the GPU)
    model3b=$(mktemp -d)/llama-3b
    $py scripts/make_llama.py --out "$model3b" --hidden 3072 --layers 28 --intermediate 8192 --heads 24 \
        --kv-heads 8 --vocab 32000 > "$logs/make_llama.log" 2>&1 &
    maker=$!
    hardware=(--hardware configs/hardware/h200-server.yaml)  # the preset, unless calibrate measures this GPU
    step calibrate 240 $py -m offload calibrate && hardware=()
    # only the CUDA test modules are collected: they need nothing the GPU machine lacks
    # (-m cuda: the tests that run Triton interpreted are for machines without a GPU; Triton 3.6 interprets them
    # wrongly under numpy 2.5, as the H200 image has them)
    step cuda_tests 300 $py -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda.py tests/test_triton_dequant.py \
        tests/test_device_dequant_gguf.py
    step offload_70b 300 $py scripts/bench_offload.py --model configs/models/llama-3.1-70b --quantization q4_0 \
        --gpu-memory 22GiB --cpu-memory 100GiB "${hardware[@]}" --backend cuda --prompt-len 512 --decode-tokens 8 --batches 1,32,auto \
        --json "$logs/offload.json"
    start=$(date +%s)
    wait "$maker"
    record make_llama $? "$start"
    tail -n 3 "$logs/make_llama.log"
    step offload_vs_accelerate 400 $py scripts/bench_gpu_offload.py --model "$model3b" --gpu-memory 2GiB \
        "${hardware[@]}" --batches 1,16 --prompt-len 32 --tokens 16 --repeats 1 --timeout 180 --json "$logs/gpu_offload.json"
    rm -rf "$(dirname "$model3b")"
    step triton_dequant 120 $py scripts/bench_triton_dequant.py
else
    step sim_tests 300 $py -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_sim.py
    step offload_sim 300 $py scripts/bench_offload.py --model configs/models/smollm2-135m --quantization q4_0 \
        --gpu-memory 680MiB --hardware configs/hardware/rtx4090-ddr5.yaml --backend sim --prompt-len 4 \
        --decode-tokens 2 --batches 1,4,auto --offline-len 64 --json "$logs/offload.json"
fi
mv "$logs/steps.jsonl.new" "$logs/steps.jsonl"

$py - "$logs" "$smoke" "$out" <<'PY'
import json, sys
from pathlib import Path
logs, smoke, out = Path(sys.argv[1]), sys.argv[2] == "1", Path(sys.argv[3])
steps = [json.loads(line) for line in (logs / "steps.jsonl").read_text().splitlines() if line.strip()]
summary = {"mode": "smoke (simulated GPU)" if smoke else "cuda", "steps": steps,
           "ok": all(s["rc"] == 0 for s in steps)}
bench = logs / "offload.json"
if bench.is_file():
    data = json.loads(bench.read_text())
    summary["offload"] = {b: {"peak_within_budget": r["peak_within_budget"],
                              "decode_link_goal_met": r["decode_link_goal_met"],
                              **{p: {k: r[p][k] for k in ("tokens_per_s", "pcie_busy_share", "pcie_over_pinned",
                                                           "copy_hidden_share", "gpu_wait_s",
                                                           "predicted_over_measured")}
                                 for p in ("prefill", "decode")}}
                          for b, r in data["batches"].items()}
    summary["offload"]["build_s"] = data["build_s"]
    summary["ok"] = summary["ok"] and all(r["peak_within_budget"] for r in data["batches"].values())
calibrated = [s for s in steps if s["step"] == "calibrate" and s["rc"] == 0]
if calibrated:  # the GPU figures the profile the plans used holds
    from offload.hardware import cache_path, gpu_calibration_summary, load_hardware
    summary["calibration"] = gpu_calibration_summary(load_hardware(cache_path()))
(logs / "summary.json").write_text(json.dumps(summary, indent=2))
(out / "summary.json").write_text(json.dumps(summary, indent=2))
print(json.dumps(summary, indent=2))
sys.exit(0 if summary["ok"] else 1)
PY
[ $? -eq 0 ] || failed=1
# one archive of the logs and figures, cut to 16 MiB: each log's last MiB where the whole would not fit
tar -czf "$out/logs.tar.gz" -C "$(dirname "$logs")" "$(basename "$logs")" 2>/dev/null
if [ "$(stat -c %s "$out/logs.tar.gz")" -gt $(( 16 * 1024 * 1024 )) ]; then
    for f in "$logs"/*.log; do tail -c 1048576 "$f" > "$f.tail" && mv "$f.tail" "$f"; done
    tar -czf "$out/logs.tar.gz" -C "$(dirname "$logs")" "$(basename "$logs")"
fi
exit $failed

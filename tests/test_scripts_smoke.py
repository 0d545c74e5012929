"""Every script under scripts/ runs its smoke mode (`--smoke`: a tiny model, seconds) to the end, so that none rots
unseen. Each is a fresh process with offload's cache in a temporary folder (no calibrated hardware profile is read;
the default model's file is linked in, for make_gguf); each must exit 0 and print the line its measurement ends
with. Parts that need what the machine lacks (a GPU, llama-cpp-python) are skipped by the scripts, with a message.
The selected scripts start together, two at a time: most of each run is Python importing torch on one core."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
pytestmark = pytest.mark.slow  # seconds each

# script: the line its smoke run must print (a regex searched in stdout)
SMOKE = {
    "bench_batch.py": r"offload's best \(.*\) / transformers bf16: [\d.]+x",
    "bench_bf16_cpu.py": r"bf16 unfused +[\d.]+ +[\d.]+ +[\d.]+x +[\d.]+x",
    "bench_contention.py": r"offload \(fixed threads\) +idle +[\d.]+ tok/s +busy +[\d.]+ tok/s +busy / idle [\d.]+",
    "bench_cpu_decode.py": r"offload q4_0 .* 32-token prompt: prefill +[\d.]+ tok/s, decode +[\d.]+ tok/s",
    "bench_disk.py": r"tok/s: decode rate \(N-1\)/\(t_N - t_1\)",
    "bench_fused_gemma.py": r"q4_0 decode, .* fused / reference [\d.]+x",
    "bench_gpu_offload.py": r"offload: load [\d.]+ s",
    "bench_kernels.py": r"q4_0 +\d+\.\d+ +[\d.]+ +[\d.]+x +[\d.]+x",
    "bench_kl.py": r"PPL of the F32 reference: offload [\d.]+",
    "bench_load.py": r"second / first: [\d.]+",
    "bench_moe.py": r"offload q4_0 .* decode +[\d.]+ tok/s",
    "bench_offload.py": r"batch +2 peak device memory .* \(within\)",
    "bench_overlap.py": r"interleaved is -?[\d.]+x the in-order schedule's decode speed",
    "bench_plan.py": r"batch 128, depth 2 +: median [\d.]+ ms",
    "bench_prefix_cache.py": r"answers identical off vs on: 4/4",
    "bench_ray.py": r"same answers in every run: True",
    "bench_serve.py": r"identical \d+, parting at a near-tie \(top-2 gap < [\d.]+\) \d+, parting at a larger gap 0",
    "bench_spec.py": r"identical \d+, parting at a near-tie \(top-2 gap < [\d.]+\) \d+, parting at a larger gap 0",
    "bench_structured.py": r"batch \d+: constrained / unconstrained throughput [\d.]+x",
    "bench_triton_dequant.py": r"nothing to measure here|speedup +[\d.]+x",
    "check_schemas.py": r"temperature 0.0: \d+ of 6 answers parse and validate",
    "hostile_check.py": r"\d+ of \d+ hostile inputs clean: [\d.]+% \(target 95%\)",
    "install_stamp.py": r"3 of 3 checks as expected",
    "lm_eval_compare.py": r"hf \(transformers fp32\): acc [\d.]+|lm-eval is not installed",
    "make_gguf.py": r"wrote converted\.f16\.gguf: [\d.]+ MiB",
    "make_llama.py": r"byte-level tokenizer: .* decodes back",
    "predictions.py": r"\d+ of \d+ rows within 0.85-1.15",
    "sim_vs_plan.py": r"largest \|predicted / simulated - 1\|: [\d.]+",
}
# scripts without a smoke run here, and why
EXEMPT = {
    "install.sh": "the install itself (tests/test_install_stamp.py runs it against a stub pip)",
    "test.sh": "the install, then pytest: this suite",
    "demo.sh": "the install (tests/test_install_stamp.py) then `offload run configs/demo.yaml` (tests/test_cli.py)",
    "gpu_check.sh": "has its own --smoke, which CI runs apart from the tests",
    "test_floor.sh": "a venv with the oldest transformers, then pytest over the families: CI runs it after this suite",
}
MARKS = {"bench_ray.py": [pytest.mark.ray]}  # `-m "not ray"` skips it with the other Ray tests
TIMEOUT_S = 300
WORKERS = 2  # smoke runs at once: CI's two cores


def test_every_script_is_smoked_or_exempt():
    """A new script must get a smoke mode (and a line here), or a reason to go without."""
    found = {p.name for p in SCRIPTS.iterdir() if p.suffix in (".py", ".sh")}
    assert found == set(SMOKE) | set(EXEMPT), (
        f"not listed: {sorted(found - set(SMOKE) - set(EXEMPT))}; listed but gone: "
        f"{sorted((set(SMOKE) | set(EXEMPT)) - found)}")


def smoke_env(cache: Path) -> dict:
    """This process's environment with offload's cache in cache (so no calibrated profile is read), the default
    model's file linked into it."""
    from offload.weights.default_model import GGUF_NAME, find_gguf

    downloads = cache / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    if not (downloads / GGUF_NAME).exists():
        (downloads / GGUF_NAME).symlink_to(find_gguf())
    env = {**os.environ, "OFFLOAD_CACHE": str(cache), "TOKENIZERS_PARALLELISM": "false"}
    env.pop("OFFLOAD_PACKED_CACHE", None)  # as a user runs them (bench_load times the cache); it is in cache too
    return env


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """script -> the future of its smoke run (CompletedProcess), for the scripts this session selected."""
    selected = [item.callspec.params["script"] for item in request.session.items
                if item.path == Path(__file__) and item.originalname == "test_smoke"]
    env = smoke_env(tmp_path_factory.mktemp("offload-cache"))
    pool = ThreadPoolExecutor(max_workers=WORKERS)
    futures = {script: pool.submit(subprocess.run, [sys.executable, str(SCRIPTS / script), "--smoke"],
                                   capture_output=True, text=True, cwd=ROOT, env=env, timeout=TIMEOUT_S)
               for script in selected}
    yield futures
    pool.shutdown(cancel_futures=True)


@pytest.mark.parametrize("script", [pytest.param(name, marks=MARKS.get(name, [])) for name in sorted(SMOKE)])
def test_smoke(script, runs: dict[str, Future]):
    out = runs[script].result()
    tail = f"\nstdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-3000:]}"
    assert out.returncode == 0, f"{script} --smoke exited {out.returncode}{tail}"
    assert re.search(SMOKE[script], out.stdout), f"{script} --smoke did not print /{SMOKE[script]}/{tail}"
    assert "Traceback" not in out.stderr, f"{script} --smoke printed a traceback{tail}"

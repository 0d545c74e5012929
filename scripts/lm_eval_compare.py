"""lm-evaluation-harness on the same fp32 weights two ways: its HF backend, and its local-completions backend
against `offload serve`; the two accuracies must be equal within noise.

The task is offload_mc50 (scripts/lm_eval_task/: 50 four-way multiple-choice questions written for this repository,
read from disk, no download). The weights are the default model's GGUF file dequantized to fp32 safetensors by
transformers (tests/conftest.py's convert_gguf, the float reference the tests hold offload's fp32 paths to),
written once into --folder. Then, one after another:
- lm-eval's HF backend: --model hf --model_args pretrained=<folder>,dtype=float32 (transformers on the CPU);
- offload serve --model <folder> --quantization none --dtype fp32 on 127.0.0.1 at a free port, and lm-eval's
  local-completions backend against it (loglikelihood by the server's echo + logprobs, the HF tokenizer of the
  folder, --concurrent requests at once).
Prints acc and acc_norm of each with their stderr, and each difference against the stderr of a difference
(sqrt(se_a^2 + se_b^2); both runs see the same items, so this overstates the noise: equal weights should give
differences of ~0).

Usage: python scripts/lm_eval_compare.py [--folder <offload's cache>/lm-eval-fp32] [--limit N] [--concurrent 4]
--smoke runs both on a tiny random model and 4 items: seconds. Needs `pip install 'lm-eval[api]'` (not a
dependency of offload; the api extra is local-completions'); without it, it says so and exits 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TASK = "offload_mc50"
TASK_DIR = HERE / "lm_eval_task"
METRICS = ("acc", "acc_norm")

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing to download: the task and the weights are local
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def write_fp32(folder: Path) -> Path:
    """The default model dequantized to fp32 safetensors in folder (kept: written once)."""
    if (folder / "model.safetensors").is_file():
        return folder
    sys.path.insert(0, str(HERE.parent / "tests"))
    from conftest import convert_gguf

    from offload.weights.default_model import find_gguf

    folder.parent.mkdir(parents=True, exist_ok=True)
    part = folder.with_name(folder.name + ".part")
    convert_gguf(find_gguf(), part)
    part.rename(folder)
    return folder


def evaluate(model: str, model_args: str, limit: int | None) -> dict:
    """metric -> (value, stderr) of offload_mc50 through lm-eval's backend model with model_args, and under
    'loglikelihoods' {(item, choice): the choice's loglikelihood}."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK], limit=limit,
                                  task_manager=TaskManager(include_path=str(TASK_DIR)), batch_size=1,
                                  device="cpu", log_samples=True)
    results = out["results"][TASK]
    lls = {(s["doc_id"], k): float(r[0]) for s in out["samples"][TASK] for k, r in enumerate(s["filtered_resps"])}
    return {**{m: (results[f"{m},none"], results[f"{m}_stderr,none"]) for m in METRICS}, "loglikelihoods": lls}


def against_offload(folder: Path, limit: int | None, concurrent: int) -> dict | str:
    """offload_mc50 through local-completions against offload serve on folder; or why it could not run."""
    if importlib.util.find_spec("tenacity") is None:
        return "lm-eval's api extra is not installed (pip install 'lm-eval[api]')"
    sys.path.insert(0, str(HERE))
    from bench_serve import free_port, offload_cmd, serving

    port = free_port()
    cmd = offload_cmd(str(folder), port, ["--quantization", "none", "--dtype", "fp32", "--max-model-len", "512"])
    print(f"  {' '.join(cmd[2:])}")
    with tempfile.TemporaryDirectory(prefix="lm-eval-") as tmp, \
            serving(cmd, port, "/health", Path(tmp) / "serve.log") as (base, _):
        missing = echo_logprobs_missing(base)
        if missing:
            return missing
        args = (f"model={folder},base_url={base}/completions,tokenizer={folder},tokenizer_backend=huggingface,"
                f"num_concurrent={concurrent},max_retries=1,max_length=512")
        print(f"  lm_eval --model local-completions --model_args {args} --tasks {TASK} --include_path {TASK_DIR}")
        return evaluate("local-completions", args, limit)


def echo_logprobs_missing(base: str) -> str | None:
    """Why the server cannot answer lm-eval's loglikelihood request (echo, logprobs, a batched token prompt), or
    None."""
    import httpx

    body = {"prompt": [[1, 2, 3]], "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True, "seed": 1234}
    r = httpx.post(f"{base}/completions", json=body, timeout=60)
    if r.status_code != 200:
        return f"offload serve answered {r.status_code} to lm-eval's loglikelihood request ({r.text[:300]})"
    logprobs = r.json()["choices"][0].get("logprobs") or {}
    if len(logprobs.get("token_logprobs") or []) != 4:
        return f"offload serve's answer to echo + logprobs has no logprob per prompt token: {r.text[:300]}"
    return None


def report(name: str, scores: dict) -> None:
    print(f"{name:>33}: " + ", ".join(f"{m} {scores[m][0]:.3f} ± {scores[m][1]:.3f}" for m in METRICS))


def compare(args) -> None:
    folder = write_fp32(Path(args.folder)) if args.folder_is_model is False else Path(args.folder)
    print(f"lm-eval {version()} on {TASK} ({'all 50' if args.limit is None else args.limit} items), fp32 weights "
          f"in {folder}")
    start = time.perf_counter()
    hf_args = f"pretrained={folder},dtype=float32"
    print(f"  lm_eval --model hf --model_args {hf_args} --tasks {TASK} --include_path {TASK_DIR} --device cpu")
    hf = evaluate("hf", hf_args, args.limit)
    print(f"  ({time.perf_counter() - start:.0f} s)")
    start = time.perf_counter()
    served = against_offload(folder, args.limit, args.concurrent)
    print(f"  ({time.perf_counter() - start:.0f} s)")
    report("hf (transformers fp32)", hf)
    if isinstance(served, str):
        print(f"local-completions against offload serve could not run: {served}")
        return
    report("local-completions (offload serve)", served)
    for m in METRICS:
        diff, se = served[m][0] - hf[m][0], math.hypot(served[m][1], hf[m][1])
        print(f"{m}: offload serve - hf = {diff:+.3f} (stderr of the difference {se:.3f}; "
              f"{'within' if abs(diff) <= 2 * se else 'OUTSIDE'} 2 stderr)")
    a, b = hf["loglikelihoods"], served["loglikelihoods"]
    gaps = [abs(a[key] - b[key]) for key in a]
    print(f"loglikelihood of each (item, choice), offload serve against hf: largest |difference| {max(gaps):.2e} "
          f"nats over {len(gaps)} (median {sorted(gaps)[len(gaps) // 2]:.2e})")


def version() -> str:
    from importlib.metadata import version as of

    return of("lm-eval")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    from offload.paths import cache_dir

    parser.add_argument("--folder", default=str(cache_dir() / "lm-eval-fp32"),
                        help="where the fp32 checkpoint is written (once)")
    parser.add_argument("--limit", type=int, default=None, help="items of the task (default: all 50)")
    parser.add_argument("--concurrent", type=int, default=4, help="requests local-completions sends at once")
    parser.add_argument("--smoke", action="store_true", help="a tiny random model, 4 items: seconds")
    args = parser.parse_args()
    args.folder_is_model = False
    if importlib.util.find_spec("lm_eval") is None:
        print("lm-eval is not installed (pip install 'lm-eval[api]'): nothing to compare")
        return
    if args.smoke:
        sys.path.insert(0, str(HERE))
        from make_llama import tiny

        with tempfile.TemporaryDirectory(prefix="lm-eval-") as tmp:
            args.folder, args.folder_is_model, args.limit = str(tiny(Path(tmp) / "tiny", tokenizer=True)), True, 4
            return compare(args)
    compare(args)


if __name__ == "__main__":
    main()

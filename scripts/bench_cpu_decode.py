"""CPU prefill and decode tokens/s: offload against llama.cpp on the same GGUF file, same threads, same run.

Default: the default model (SmolLM2-135M, its Q4_1 GGUF file), offload with each quantization.
With --gguf PATH: that file, offload using its tensors as stored. llama.cpp runs through llama-cpp-python
(its column is skipped with a message if that package is not installed). Prints the median of --repeats runs
and offload's ratio against llama.cpp.

  python scripts/bench_cpu_decode.py --threads 2 --decode-tokens 64
  python scripts/bench_cpu_decode.py --gguf model.Q4_K_M.gguf
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from offload import LLM, SamplingParams
from offload.planner.placement import Placement
from offload.weights.default_model import find_gguf

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle. " * 3


def bench_offload(model: str, quantization: str, prompt_ids: list[int], n_decode: int,
                  repeats: int) -> tuple[float, float]:
    """Median (prefill tok/s, decode tok/s) of offload with every block computed on the CPU."""
    llm = LLM(model, quantization=quantization, backend="cpu", max_batch_size=1, placement=_all_cpu(model))
    params = SamplingParams(max_tokens=n_decode, temperature=0, ignore_eos=True)
    llm.generate({"prompt_token_ids": prompt_ids}, params)  # warm-up
    prefill, decode = [], []
    for _ in range(repeats):
        llm.timeline.clear()
        llm.generate({"prompt_token_ids": prompt_ids}, params)
        t = llm.timeline
        prefill.append(t.phase_tokens["prefill"] / t.phase_time_s["prefill"])
        decode.append(t.phase_tokens["decode"] / t.phase_time_s["decode"])
    return statistics.median(prefill), statistics.median(decode)


def _all_cpu(model: str) -> Placement:
    from offload.weights.default_model import resolve_model
    from offload.weights.model_files import model_spec

    return Placement.uniform(model_spec(resolve_model(model)), "cpu", "cpu")


def bench_llama_cpp(gguf: str, prompt_ids: list[int], n_decode: int, threads: int, repeats: int):
    """Median (prefill tok/s, decode tok/s) of llama.cpp on the GGUF file, or None if it is not installed.

    Runs in a child process: llama-cpp-python redirects the process's stdout while it loads.
    """
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "llama_cpp.json"
        args = json.dumps([gguf, prompt_ids, n_decode, threads, repeats])
        out = subprocess.run([sys.executable, __file__, "--llama-cpp-child", args, str(result)],
                             capture_output=True, text=True)
        if out.returncode != 0 or not result.is_file():
            print(f"llama.cpp run failed: {out.stderr.strip().splitlines()[-1:]}")
            return None
        return tuple(json.loads(result.read_text()))


def _llama_cpp_child(gguf: str, prompt_ids: list[int], n_decode: int, threads: int,
                     repeats: int) -> tuple[float, float]:
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads, n_ctx=1024,
                n_batch=512, verbose=False)
    prefill, decode = [], []
    for _ in range(repeats + 1):
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt_ids)
        mid = time.perf_counter()
        for _ in range(n_decode):
            llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        end = time.perf_counter()
        prefill.append(len(prompt_ids) / (mid - start))
        decode.append(n_decode / (end - mid))
    return statistics.median(prefill[1:]), statistics.median(decode[1:])


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--llama-cpp-child":  # the result goes to a file: see above
        Path(sys.argv[3]).write_text(json.dumps(_llama_cpp_child(*json.loads(sys.argv[2]))))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gguf", help="a GGUF file: offload (tensors as stored) and llama.cpp both run it")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = args.gguf or "default"
    gguf = args.gguf or str(find_gguf())
    tokenizer = LLM(model, placement=_all_cpu(model), backend="cpu").tokenizer
    prompt_ids = tokenizer.encode(PROMPT)
    print(f"{Path(gguf).name}, {len(prompt_ids)}-token prompt, {args.decode_tokens} decode tokens, "
          f"{args.threads} threads, median of {args.repeats}")
    variants = ("none",) if args.gguf else ("none", "q8_0", "q4_0")
    results = {q: bench_offload(model, q, prompt_ids, args.decode_tokens, args.repeats) for q in variants}
    ref = bench_llama_cpp(gguf, prompt_ids, args.decode_tokens, args.threads, args.repeats)
    if ref is None:
        print("llama.cpp column skipped: llama-cpp-python is not installed (pip install llama-cpp-python)")
    else:
        print(f"llama.cpp (same GGUF)   prefill {ref[0]:8.1f} tok/s   decode {ref[1]:7.1f} tok/s")
    base = results["none"]
    for q, (pre, dec) in results.items():
        name = "as stored" if args.gguf else q
        line = (f"offload {name:9s}       prefill {pre:8.1f} tok/s   decode {dec:7.1f} tok/s   "
                f"decode vs first row {dec / base[1]:.2f}x")
        if ref is not None:
            line += f"   vs llama.cpp: prefill {pre / ref[0]:.2f}x, decode {dec / ref[1]:.2f}x"
        print(line)


if __name__ == "__main__":
    main()

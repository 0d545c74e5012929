"""Tokens/s under a shared CPU: the demo prompts on the default model, idle and with one busy-looping process
on the machine, in the same run; offload with its thread governor, offload with a fixed thread count, and
llama.cpp on the same GGUF file (if llama-cpp-python is installed). Prints each one's busy ÷ idle ratio.

  python scripts/bench_contention.py --max-tokens 128
  python scripts/bench_contention.py --smoke     # a tiny model with a byte-level tokenizer, 4 tokens, one repeat
"""

from __future__ import annotations

import argparse
import json
import statistics
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
BUSY_LOOP = "while True: pass"


def demo_prompts() -> list[list[dict]]:
    lines = (ROOT / "configs" / "prompts" / "demo.jsonl").read_text().splitlines()
    bodies = [json.loads(line)["body"] for line in lines if line.strip()]
    return [b["messages"] for b in bodies if "messages" in b]  # the chat requests


def offload_tok_s(llm, prompts, max_tokens: int) -> float:
    """Generated tokens per second of one batch of the demo prompts."""
    from offload import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.chat(prompts, params)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def gguf_for(model: str, tmp: Path) -> str | None:
    """The GGUF file llama.cpp runs for --model: the default model's, the file itself, or a Hugging Face folder
    written as F16 (make_gguf); None without llama-cpp-python."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    from offload.weights.default_model import find_gguf

    if model == "default" or Path(model).is_file():
        return str(find_gguf() if model == "default" else model)
    from make_gguf import write_f16_from_hf

    write_f16_from_hf(tmp / "model.f16.gguf", Path(model))
    return str(tmp / "model.f16.gguf")


def llama_cpp_tok_s(gguf: str | None, prompt_ids: list[int], n_decode: int, threads: int) -> float | None:
    """llama.cpp's decode tok/s on the GGUF file (a child process), or None without llama-cpp-python (gguf is None
    only then)."""
    from bench_cpu_decode import bench_llama_cpp

    result = bench_llama_cpp(gguf, [prompt_ids], n_decode, threads, repeats=1)
    return None if result is None else result[0][1]


def measure(args, llm_adaptive, llm_fixed, prompts, prompt_ids) -> dict:
    """Median tok/s of --repeats runs each, offload's two variants alternating."""
    runs: dict[str, list[float]] = {"offload (thread governor)": [], "offload (fixed threads)": []}
    for _ in range(args.repeats):
        runs["offload (thread governor)"].append(offload_tok_s(llm_adaptive, prompts, args.max_tokens))
        runs["offload (fixed threads)"].append(offload_tok_s(llm_fixed, prompts, args.max_tokens))
    out = {name: statistics.median(values) for name, values in runs.items()}
    out["llama.cpp"] = llama_cpp_tok_s(args.gguf, prompt_ids, args.max_tokens, args.threads)
    return out


def run(args) -> None:
    torch.set_num_threads(args.threads)
    from offload import LLM
    from offload.runtime.threads import ThreadGovernor

    llm_adaptive = LLM(args.model, quantization=args.quantization, batch_size=16)
    llm_fixed = LLM(args.model, quantization=args.quantization, batch_size=16)
    llm_fixed.model.threads = ThreadGovernor(args.threads, enabled=False)
    prompts = demo_prompts()
    prompt_ids = llm_adaptive.apply_chat_template(prompts[0])
    offload_tok_s(llm_adaptive, prompts[:1], 4)  # warm-up
    idle = measure(args, llm_adaptive, llm_fixed, prompts, prompt_ids)
    busy_proc = subprocess.Popen([sys.executable, "-c", BUSY_LOOP])
    try:
        busy = measure(args, llm_adaptive, llm_fixed, prompts, prompt_ids)
    finally:
        busy_proc.kill()
    print(f"{Path(args.model).name}: demo prompts, {args.quantization}, {args.max_tokens} new tokens each, "
          f"{args.threads} threads, median of {args.repeats} (llama.cpp: one prompt, one run); busy: one process "
          f"spinning on the machine")
    for name in idle:
        if idle[name] is None:
            print(f"{name:26s} skipped: llama-cpp-python is not installed (pip install llama-cpp-python)")
            continue
        print(f"{name:26s} idle {idle[name]:7.1f} tok/s   busy {busy[name]:7.1f} tok/s   busy / idle "
              f"{busy[name] / idle[name]:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--quantization", default="q8_0")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default="default", help="'default', a GGUF file or a Hugging Face folder with a "
                    "tokenizer (llama.cpp gets it written as F16)")
    ap.add_argument("--smoke", action="store_true", help="a tiny model, 4 tokens, one repeat: seconds")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-contention-") as tmp:
        if args.smoke:
            from make_gguf import smoke_vocab_size
            from make_llama import tiny

            args.model = str(tiny(Path(tmp) / "tiny", smoke_vocab_size(), tokenizer=True))
            args.max_tokens, args.repeats = 4, 1
        args.gguf = gguf_for(args.model, Path(tmp))
        run(args)


if __name__ == "__main__":
    main()

"""CPU layers in a GPU plan's compute format: prefill and decode tokens/s of an all-CPU placement computing in bf16
against the same placement computing in fp32, same weights, same run.

A GPU plan computes in bf16, so the CPU units of a mixed plan get bf16 hidden states and keep bf16 KV caches. This
runs every unit on the CPU (so the CPU's speed is all that is measured) for each model and quantization:
- fp32: activations and KV caches in fp32, through the fused C++ layer;
- bf16: activations and KV caches in bf16, through the same fused C++ layer (each layer widens its input once and
  rounds its output; the caches stay bf16);
- bf16 unfused (--unfused): the reference block math in torch bf16, what a bf16 plan's CPU units ran before.
Prints each row's tokens/s (medians of --repeats, the variants alternating run by run) and bf16 / fp32.

  python scripts/bench_bf16_cpu.py --model /tmp/llama-0.8b --quantization q4_0,q8_0
  python scripts/bench_bf16_cpu.py --model default --quantization none
  python scripts/bench_bf16_cpu.py --smoke
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from offload import LLM, SamplingParams
from offload.planner.placement import Placement
from offload.weights.model_files import model_spec
from offload.weights.default_model import resolve_model


def prompt_ids(n: int, vocab: int) -> list[int]:
    return [100 + (i * 7919) % max(vocab - 200, 1) for i in range(n)]


class Variant:
    """One compute format over one model, loaded once; run() times a prompt and its decode."""

    def __init__(self, model: str, quantization: str, dtype: str, fuse: bool, prompt: list[int], n_decode: int):
        spec = model_spec(resolve_model(model))
        placement = Placement.uniform(spec, "cpu", "cpu")
        self.llm = LLM(model, quantization=quantization, dtype=dtype, backend="cpu", batch_size=1,
                       placement=placement, max_model_len=len(prompt) + n_decode + 8, host_baseline=0)
        self.llm.model.fuse = fuse
        self.prompt, self.params = prompt, SamplingParams(max_tokens=n_decode, temperature=0, ignore_eos=True)
        self.run()  # warm-up

    def run(self) -> tuple[float, float]:
        t = self.llm.timeline
        t.clear()
        self.llm.generate({"prompt_token_ids": self.prompt}, self.params)
        return (t.phase_tokens["prefill"] / t.phase_time_s["prefill"],
                t.phase_tokens["decode"] / t.phase_time_s["decode"])


def bench(model: str, quantization: str, args) -> list[str]:
    spec = model_spec(resolve_model(model))
    prompt = prompt_ids(args.prompt_len, spec.vocab_size)
    variants = {"fp32": ("fp32", True), "bf16": ("bf16", True)}
    if args.unfused:
        variants["bf16 unfused"] = ("bf16", False)
    runners = {name: Variant(model, quantization, dtype, fuse, prompt, args.decode_tokens)
               for name, (dtype, fuse) in variants.items()}
    got: dict[str, list[tuple[float, float]]] = {name: [] for name in runners}
    for _ in range(args.repeats):
        for name, runner in runners.items():
            got[name].append(runner.run())
    med = {name: (statistics.median(p for p, _ in r), statistics.median(d for _, d in r)) for name, r in got.items()}
    base = med["fp32"]
    rows = []
    for name, (p, d) in med.items():
        ratio = "" if name == "fp32" else f"  {p / base[0]:.2f}x  {d / base[1]:.2f}x"
        rows.append(f"{Path(model).name:<16} {quantization:<6} {name:<13} {p:9.1f} {d:8.2f}{ratio}")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default", help="a Hugging Face folder, a GGUF file, or default")
    ap.add_argument("--quantization", default="q4_0", help="comma-separated (none: the weights as stored)")
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--unfused", action="store_true", help="also time bf16 through the unfused torch path")
    ap.add_argument("--smoke", action="store_true", help="a tiny random model, one repeat: checks the script runs")
    args = ap.parse_args(argv)
    models = [args.model]
    if args.smoke:
        sys.path.insert(0, str(Path(__file__).parent))
        import make_llama

        folder = Path(tempfile.mkdtemp()) / "tiny"
        make_llama.main(["--out", str(folder), "--hidden", "256", "--layers", "2", "--intermediate", "512",
                         "--heads", "4", "--kv-heads", "2", "--vocab", "512"])
        models, args.prompt_len, args.decode_tokens, args.repeats, args.unfused = [str(folder)], 24, 4, 1, True
    print(f"threads {torch.get_num_threads()}; prompt {args.prompt_len} tokens, {args.decode_tokens} decoded; "
          f"medians of {args.repeats}")
    print(f"{'model':<16} {'quant':<6} {'compute':<13} {'prefill':>9} {'decode':>8}  bf16/fp32 (prefill, decode)")
    for model in models:
        for q in args.quantization.split(","):
            for row in bench(model, q, args):
                print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

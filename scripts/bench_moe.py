"""CPU decode of a bandwidth-bound mixture of experts: offload against llama.cpp on the same weights, same threads,
same run, with the bytes each token reads and the bandwidth that makes.

The model: --model, a Hugging Face MoE folder (Mixtral, Qwen2-MoE, Qwen3-MoE), or by default a random Qwen3-MoE
made by scripts/make_llama.py in a temporary folder: hidden 1024, 24 layers, 64 experts of width 256, 4 per token
(1.37 B parameters, 0.19 B of them used per token), the default model's vocabulary (so make_gguf can borrow its
tokenizer). With llama-cpp-python installed, the folder is written as an F16 GGUF file and quantized by llama.cpp
to Q8_0 and Q4_0; offload reads each file as stored and llama.cpp runs it (scripts/bench_cpu_decode.py's runs: the
two tools alternate run by run, llama.cpp in a fresh child, both warmed up). Without it offload quantizes the
folder itself (q8_0, q4_0) and the llama.cpp column is skipped.

Bytes per token: what one decode step at batch 1 must read of the weights in the format it holds them: every
layer's attention and norms, each MoE layer's router and the top_k experts the token is routed to (exactly k
distinct experts per layer for one token), the final norm, the lm_head and one embedding row; the KV cache (a few
hundred KB at these lengths) is left out. Effective bandwidth = decode tok/s x bytes per token, shown against the
CPU memory bandwidth of offload's hardware profile (`offload calibrate`'s measurement, else an estimate). "All
experts" is what a token would read were every expert run: the same model's dense cost, which the routing spares.
The ratio is offload's decode tok/s over llama.cpp's.

  python scripts/bench_moe.py --threads 2
  python scripts/bench_moe.py --model path/to/qwen3-moe-folder --decode-tokens 32 --repeats 2
  python scripts/bench_moe.py --smoke    # 2 layers of 4 experts of width 64, 4 tokens, one repeat: seconds
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu_decode import alternate, prompt_ids, variants  # noqa: E402

from offload.formats import AS_STORED, compute_format  # noqa: E402
from offload.hardware import default_hardware  # noqa: E402
from offload.spec import ModelSpec, load_spec  # noqa: E402
from offload.weights.model_files import model_spec  # noqa: E402


def make_model(out: Path, args: argparse.Namespace) -> Path:
    """A random Qwen3-MoE of the asked shape in out (bf16 safetensors), with the default model's vocabulary."""
    import make_llama
    from make_gguf import default_vocab_size

    argv = ["--out", str(out), "--hidden", str(args.hidden), "--layers", str(args.layers),
            "--heads", str(args.hidden // 64), "--kv-heads", str(max(1, args.hidden // 256)),
            "--experts", str(args.experts), "--top-k", str(args.top_k), "--intermediate", str(args.expert_width),
            "--vocab", str(args.vocab or default_vocab_size())]
    if make_llama.main(argv) != 0:
        sys.exit(f"could not write the model into {out}")
    return out


def bytes_per_token(spec: ModelSpec, fmt: str, compute: str) -> tuple[int, int]:
    """(touched, all experts): weight bytes one decode token reads at batch 1 with linears in fmt, and what it would
    read were every expert run."""
    touched = every = 0
    for unit in spec.units():
        n = unit.nbytes(fmt, compute)
        if unit.kind == "embed":
            n //= spec.vocab_size  # one row
        if unit.kind == "experts":
            router = unit.tensors[0].nbytes(fmt, compute)
            touched += router + (n - router) * unit.moe.top_k // unit.moe.n_experts
        else:
            touched += n
        every += n
    return touched, every


def params(spec: ModelSpec) -> tuple[int, int]:
    """(total, per token) parameters; per token: the routed share of each experts unit, no embedding."""
    total = sum(t.numel for t in spec.tensors())
    active = sum(u.numel * (u.moe.top_k / u.moe.n_experts if u.moe else 1) for u in spec.units() if u.kind != "embed")
    return total, int(active)


def report(label: str, spec: ModelSpec, fmt: str, dec: float, ref: float | None, gguf: str | None,
           bandwidth: float) -> str:
    """One row: offload's decode tok/s, its bytes per token and effective bandwidth; llama.cpp's and the ratio."""
    touched, every = bytes_per_token(spec, fmt, compute_format("auto", False))
    line = (f"offload {label:16s} decode {dec:6.1f} tok/s | reads {touched / 1e6:6.1f} MB/token -> "
            f"{dec * touched / 1e9:5.2f} GB/s ({dec * touched / bandwidth:4.0%} of {bandwidth / 1e9:.1f}) | "
            f"all experts {every / 1e6:6.0f} MB/token")
    if ref is not None:
        line += (f" | llama.cpp {Path(gguf).name}: decode {ref:6.1f} tok/s, {ref * touched / 1e9:5.2f} GB/s"
                 f" | ratio {dec / ref:.2f}x")
    return line


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a Hugging Face MoE folder (default: a random Qwen3-MoE of the shape below)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--expert-width", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vocab", type=int, help="vocabulary of the random model (default: the default model's, whose "
                    "tokenizer make_gguf borrows for llama.cpp's file)")
    ap.add_argument("--smoke", action="store_true", help="a tiny random MoE, 4 tokens, one repeat: seconds")
    args = ap.parse_args()
    if args.smoke:
        args.hidden, args.layers, args.experts, args.expert_width, args.top_k = 128, 2, 4, 64, 2
        args.prompt_tokens, args.decode_tokens, args.repeats, args.model = 8, 4, 1, None
        from make_gguf import smoke_vocab_size

        args.vocab = smoke_vocab_size()
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    has_llama_cpp = importlib.util.find_spec("llama_cpp") is not None
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.model) if args.model else make_model(Path(tmp) / "random-qwen3-moe", args)
        spec = load_spec(folder)
        if spec.moe is None:
            sys.exit(f"--model {folder}: a {spec.architecture} model has no experts; pass a MoE folder")
        rows = variants(str(folder), Path(tmp), args.threads)  # offload quantizes the folder without llama.cpp
        prompts = [prompt_ids(args.prompt_tokens, spec.vocab_size)]
        hw = default_hardware()
        total, active = params(spec)
        print(f"{folder.name}: {spec.architecture}, {spec.moe.n_experts} experts of {spec.moe.expert_size}, "
              f"{spec.moe.top_k} per token; {total / 1e9:.2f} B parameters, {active / 1e9:.2f} B per token | "
              f"{args.prompt_tokens}-token prompt, then {args.decode_tokens} greedy tokens; {args.threads} threads; "
              f"median of {args.repeats} | memory bandwidth {hw.cpu_mem_bps / 1e9:.1f} GB/s ({hw.name} profile)",
              flush=True)
        for label, offload_model, quant, gguf in rows:
            ours, ref = alternate(offload_model, quant, gguf, prompts, args.decode_tokens, args.threads, args.repeats)
            fmt = AS_STORED if quant == "none" else quant
            print(report(label, model_spec(Path(offload_model)), fmt, ours[0][1], ref[0][1] if ref else None, gguf,
                         hw.cpu_mem_bps), flush=True)
        if not has_llama_cpp:
            print("llama.cpp column skipped: llama-cpp-python is not installed (pip install llama-cpp-python)")


if __name__ == "__main__":
    main()

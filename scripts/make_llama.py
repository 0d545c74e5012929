"""Write a random Llama-shaped Hugging Face checkpoint (config.json + model.safetensors), for benchmarks; with
--experts N, a Qwen3-MoE-shaped one (every layer a mixture of N experts of width --intermediate, --top-k per token).

transformers' config class writes config.json; offload's ModelSpec of that config names every tensor the checkpoint
must hold (routed experts one tensor each, as Hugging Face checkpoints store them), each filled in chunks of rows
with normal(0, --std) weights (norms are ones), in the --dtype the file stores. Embeddings are untied
(tie_word_embeddings false: lm_head.weight is its own tensor). No tokenizer is written: the benchmarks feed token
ids. The defaults give a ~0.82 B-parameter model, ~1.65 GB in bf16:

  python scripts/make_llama.py --out /tmp/llama-1.6b
  python scripts/make_llama.py --out /tmp/llama-small --hidden 512 --layers 4 --intermediate 1024 \\
      --heads 8 --kv-heads 4 --vocab 8000
  python scripts/make_llama.py --out /tmp/moe-1.4b --hidden 1024 --layers 24 --heads 16 --kv-heads 4 \\
      --experts 64 --top-k 4 --intermediate 256
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
CHUNK_ELEMS = 1 << 24  # random numbers drawn at once (64 MiB of fp32): bounds the peak beside the tensors


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder to write (created; existing model files are replaced)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--intermediate", type=int, default=4608)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--max-position", type=int, default=4096)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--std", type=float, default=0.02, help="standard deviation of the random weights")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--experts", type=int, default=0,
                    help="routed experts per layer (0: a dense Llama; else a Qwen3-MoE of experts --intermediate wide)")
    ap.add_argument("--top-k", type=int, default=4, help="experts each token runs (with --experts)")
    args = ap.parse_args(argv)
    if args.experts and not 1 <= args.top_k <= args.experts:
        ap.error(f"--top-k must be between 1 and --experts {args.experts}, got {args.top_k}")
    for name in ("hidden", "layers", "intermediate", "heads", "kv_heads", "vocab", "max_position"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be 1 or more, got {getattr(args, name)}")
    if args.hidden % args.heads:
        ap.error(f"--hidden {args.hidden} is not a multiple of --heads {args.heads}")
    if args.heads % args.kv_heads:
        ap.error(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    if (args.hidden // args.heads) % 2:
        ap.error(f"the head size {args.hidden // args.heads} must be even (rotary embeddings)")
    return args


def fill(shape, dtype, std: float, gen):
    """A tensor of shape filled with normal(0, std), drawn CHUNK_ELEMS at a time (rows of the first dim)."""
    import torch

    out = torch.empty(shape, dtype=dtype)
    flat = out.view(-1)
    for start in range(0, flat.numel(), CHUNK_ELEMS):
        n = min(CHUNK_ELEMS, flat.numel() - start)
        flat[start:start + n] = torch.randn(n, generator=gen, dtype=torch.float32).mul_(std).to(dtype)
    return out


def make_config(args: argparse.Namespace):
    """The transformers config of the model asked for: Llama, or Qwen3-MoE with every layer a mixture of experts."""
    from transformers import LlamaConfig, Qwen3MoeConfig

    common = dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                  num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                  max_position_embeddings=args.max_position, tie_word_embeddings=False, initializer_range=args.std,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=None)
    if not args.experts:
        config = LlamaConfig(**common)
    else:  # top-k weights renormalised, as Qwen3-30B-A3B does (and llama.cpp's qwen3moe always does)
        config = Qwen3MoeConfig(**common, head_dim=args.hidden // args.heads, num_experts=args.experts,
                                num_experts_per_tok=args.top_k, moe_intermediate_size=args.intermediate,
                                norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    config.dtype = DTYPES[args.dtype]
    return config


def write_config(config, out: Path, dtype: str) -> dict:
    """config.json in out; the dict written (with the keys older readers look for)."""
    config.save_pretrained(out)
    # older readers (and offload's spec parser, if it predates transformers 5's rope_parameters) look for these
    cfg = json.loads((out / "config.json").read_text())
    cfg.setdefault("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    cfg.setdefault("torch_dtype", DTYPES[dtype])
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return cfg


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from safetensors.torch import save_file

    from offload.spec import spec_from_config

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        print(f"error: --out {out} exists and is not a folder", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, DTYPES[args.dtype])
    t0 = time.perf_counter()
    spec = spec_from_config(write_config(make_config(args), out, args.dtype), source=str(out / "config.json"))
    gen = torch.Generator().manual_seed(args.seed)
    state = {t.name: torch.ones(t.shape, dtype=dtype) if t.role == "norm" else fill(t.shape, dtype, args.std, gen)
             for t in spec.tensors()}
    if "lm_head.weight" not in state:  # untied: the checkpoint must hold its own output matrix
        raise SystemExit("error: the config ties lm_head to the embeddings despite tie_word_embeddings=False")
    n_params = sum(t.numel() for t in state.values())
    model_file = out / "model.safetensors"
    for stale in out.glob("model*.safetensors*"):
        stale.unlink()
    save_file(state, str(model_file), metadata={"format": "pt"})
    size = model_file.stat().st_size
    moe = f", {args.experts} experts of {args.intermediate} ({args.top_k} per token)" if args.experts else ""
    print(f"wrote {out}: {n_params / 1e6:.1f} M parameters, {args.layers} layers, hidden {args.hidden}{moe}, "
          f"vocab {args.vocab}, {args.dtype}; model.safetensors {size / 1e9:.3f} GB ({size / 2**30:.3f} GiB) "
          f"in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

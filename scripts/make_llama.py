"""Write a random Llama-shaped Hugging Face checkpoint (config.json + model.safetensors), for benchmarks.

The model is transformers' LlamaForCausalLM built on the meta device (no memory), then filled tensor by tensor,
in chunks of rows, with normal(0, --std) weights (norms are ones), in the --dtype the file stores. Embeddings
are untied (tie_word_embeddings false: lm_head.weight is its own tensor). No tokenizer is written: the
benchmarks feed token ids. The defaults give a ~0.82 B-parameter model, ~1.65 GB in bf16:

  python scripts/make_llama.py --out /tmp/llama-1.6b
  python scripts/make_llama.py --out /tmp/llama-small --hidden 512 --layers 4 --intermediate 1024 \\
      --heads 8 --kv-heads 4 --vocab 8000
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
    args = ap.parse_args(argv)
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


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        print(f"error: --out {out} exists and is not a folder", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, DTYPES[args.dtype])
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.max_position, tie_word_embeddings=False, initializer_range=args.std,
        rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=None)
    config.dtype = DTYPES[args.dtype]
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(args.seed)
    state = {}
    for name, p in model.state_dict().items():
        if name.endswith("norm.weight"):
            state[name] = torch.ones(p.shape, dtype=dtype)
        else:
            state[name] = fill(p.shape, dtype, args.std, gen)
    if "lm_head.weight" not in state:  # untied: the checkpoint must hold its own output matrix
        raise SystemExit("error: transformers tied lm_head to the embeddings despite tie_word_embeddings=False")
    n_params = sum(t.numel() for t in state.values())
    model_file = out / "model.safetensors"
    for stale in out.glob("model*.safetensors*"):
        stale.unlink()
    save_file(state, str(model_file), metadata={"format": "pt"})
    config.save_pretrained(out)
    # older readers (and offload's spec parser, if it predates transformers 5's rope_parameters) look for these
    cfg = json.loads((out / "config.json").read_text())
    cfg.setdefault("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    cfg.setdefault("torch_dtype", DTYPES[args.dtype])
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    size = model_file.stat().st_size
    print(f"wrote {out}: {n_params / 1e6:.1f} M parameters, {args.layers} layers, hidden {args.hidden}, "
          f"vocab {args.vocab}, {args.dtype}; model.safetensors {size / 1e9:.3f} GB ({size / 2**30:.3f} GiB) "
          f"in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

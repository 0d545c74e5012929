"""Write a random Llama-shaped Hugging Face checkpoint (config.json + model.safetensors), for benchmarks; with
--experts N, a Qwen3-MoE-shaped one (every layer a mixture of N experts of width --intermediate, --top-k per token).

transformers' config class writes config.json; offload's ModelSpec of that config names every tensor the checkpoint
must hold (routed experts one tensor each, as Hugging Face checkpoints store them), each filled in chunks of rows
with normal(0, --std) weights (norms are ones), in the --dtype the file stores. Embeddings are untied
(tie_word_embeddings false: lm_head.weight is its own tensor). No tokenizer is written: the benchmarks feed token
ids (tiny(), the scripts' smoke model, can add a byte-level one). The defaults give a ~0.82 B-parameter model, ~1.65 GB
in bf16:

  python scripts/make_llama.py --out /tmp/llama-1.6b
  python scripts/make_llama.py --out /tmp/llama-small --hidden 512 --layers 4 --intermediate 1024 \\
      --heads 8 --kv-heads 4 --vocab 8000
  python scripts/make_llama.py --out /tmp/moe-1.4b --hidden 1024 --layers 24 --heads 16 --kv-heads 4 \\
      --experts 64 --top-k 4 --intermediate 256
  python scripts/make_llama.py --smoke     # a tiny dense and a tiny MoE model in a temp folder, read back: seconds
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
CHUNK_ELEMS = 1 << 24  # random numbers drawn at once (64 MiB of fp32): bounds the peak beside the tensors
# the smoke modes' model: K of every matrix is whole q4_0 blocks (32 weights)
TINY = ("--hidden", "64", "--layers", "2", "--intermediate", "128", "--heads", "4", "--kv-heads", "2")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="folder to write (created; existing model files are replaced)")
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
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny dense and a tiny MoE model in a temp folder, read back")
    args = ap.parse_args(argv)
    if not args.out and not args.smoke:
        ap.error("--out is required (or --smoke)")
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


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHATML_EXAMPLE = "<|im_start|>user\nHé!<|im_end|>\n<|im_start|>assistant\n"


def write_byte_tokenizer(out: Path, vocab: int) -> None:
    """A byte-level tokenizer of vocab ids into out (tokenizer.json and its config): <|endoftext|>, <|im_start|> and
    <|im_end|> at 0, 1 and 2 (the config's bos and eos), the 256 byte symbols, no merges, unused specials up to
    vocab; a ChatML chat template. Any text and any chat runs through it; the default model is not needed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials, alphabet = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], sorted(pre_tokenizers.ByteLevel.alphabet())
    if vocab < len(specials) + len(alphabet):
        raise SystemExit(f"a byte-level tokenizer needs a vocabulary of {len(specials) + len(alphabet)} or more")
    unused = [f"<unused{i}>" for i in range(vocab - len(specials) - len(alphabet))]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(specials + alphabet + unused)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials + unused)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=specials[1], eos_token=specials[2], pad_token=specials[0],
                            chat_template=CHATML).save_pretrained(out)


def tiny(out: Path, vocab: int = 512, experts: int = 0, tokenizer: bool = False) -> Path:
    """A tiny random model in out, for the scripts' smoke modes: 2 layers, hidden 64; with experts, a Qwen3-MoE of
    that many experts (2 per token); with tokenizer, a byte-level tokenizer and chat template (write_byte_tokenizer),
    so text prompts and chat messages run."""
    argv = ["--out", str(out), *TINY, "--vocab", str(vocab)] + (["--experts", str(experts), "--top-k", "2"]
                                                                  if experts else [])
    if main(argv) != 0:
        raise SystemExit(f"could not write a tiny model into {out}")
    if tokenizer:
        write_byte_tokenizer(out, vocab)
    return out


def smoke() -> int:
    """Write a tiny dense and a tiny MoE model and read each back with offload's spec and checkpoint reader."""
    from offload.spec import load_spec
    from offload.weights.loader import Checkpoint
    from offload.weights.model_files import load_tokenizer

    with tempfile.TemporaryDirectory(prefix="make-llama-smoke-") as tmp:
        for experts in (0, 4):
            folder = tiny(Path(tmp) / f"tiny-{experts}", experts=experts, tokenizer=not experts)
            spec, ckpt = load_spec(folder), Checkpoint(folder)
            missing = [t.name for t in spec.tensors() if tuple(ckpt.get(t.name).shape) != tuple(t.shape)]
            if missing:
                print(f"error: {folder.name}: {len(missing)} tensors differ from the spec, e.g. {missing[0]}")
                return 1
            print(f"read back {folder.name}: {spec.architecture}, {len(spec.tensors())} tensors as the spec says")
        tokenizer = load_tokenizer(Path(tmp) / "tiny-0")
        text = tokenizer.apply_chat_template([{"role": "user", "content": "Hé!"}], add_generation_prompt=True,
                                             tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if text != CHATML_EXAMPLE or tokenizer.decode(ids) != text:
            print(f"error: the byte-level tokenizer gives {tokenizer.decode(ids)!r}, not {CHATML_EXAMPLE!r}")
            return 1
        print(f"byte-level tokenizer: a chat of one message is {len(ids)} tokens and decodes back")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        return smoke()
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

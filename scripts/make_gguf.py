"""Write GGUF files for benchmarks as llama.cpp's tools do: random Llama-shaped weights quantized by llama.cpp
itself (llama-cpp-python), or a Hugging Face folder's weights as an F16 file (write_f16_from_hf: Llama, Mistral,
Mixtral, Qwen2-MoE, Qwen3-MoE, Qwen3 and Gemma 2, named and laid out as convert_hf_to_gguf.py writes them); with
--family, a random model of that family at a ~0.6-0.7B shape with its real vocabulary's size (FAMILY_SHAPES) made
as a Hugging Face folder, converted and quantized.

The random weights are normal, scaled by 1/sqrt(in); the tokenizer and chat template are the default model's
(SmolLM2's, read from its GGUF file), so real prompts tokenize. llama.cpp's own quantizer makes the file
(`--type Q4_K_M`, `Q5_K_M`, `Q6_K`, `Q8_0`, `Q4_0`...), as users get it from llama-quantize.

  python scripts/make_gguf.py /tmp/llama-0.9b.Q4_K_M.gguf --type Q4_K_M
  python scripts/make_gguf.py /tmp/qwen3-0.6b.Q4_0.gguf --type Q4_0 --family qwen3
  python scripts/make_gguf.py --smoke     # tiny F16 files in a temp folder (quantized too where llama.cpp is installed)
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

SHAPES = {  # name: (hidden, intermediate, layers, heads, kv heads)
    "0.9b": (2048, 5632, 16, 32, 8),
    "0.3b": (1024, 2816, 16, 16, 4),
    "8b": (4096, 14336, 32, 32, 8),
    "tiny": (64, 128, 2, 4, 2),  # the smoke modes' (K: two 32-weight blocks)
    "smol-2l": (576, 1536, 2, 9, 3),  # SmolLM2-135M's widths, 2 layers: rows not a multiple of 256 (Q4_K -> Q5_0)
}
# --family: transformers config class prefix and config. Qwen3: Qwen3-0.6B's shape (its model card's config.json);
# Gemma 2: Gemma 2's vocabulary, heads of 256 with one KV head, windows of 4096 on alternate layers and its
# soft-caps, at ~0.7B (gemma-2-2b's 26 layers of 2304 cut to 14 of 1152); both tie the embedding, as released
FAMILY_SHAPES = {
    "qwen3": ("Qwen3", dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                            num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                            rope_theta=1000000.0, max_position_embeddings=40960)),
    "gemma2": ("Gemma2", dict(vocab_size=256000, hidden_size=1152, intermediate_size=6912, num_hidden_layers=14,
                              num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                              sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                              tie_word_embeddings=True, max_position_embeddings=8192)),
}


@functools.lru_cache(maxsize=1)
def _default_tokenizer() -> tuple[list[str], list[str], str]:
    """The default model's tokens, merges and chat template (parsing its GGUF file takes seconds: once a process)."""
    import gguf

    from offload.weights.default_model import find_gguf

    src = gguf.GGUFReader(find_gguf())
    fields = src.fields
    tokens = [bytes(fields["tokenizer.ggml.tokens"].parts[i]).decode() for i in fields["tokenizer.ggml.tokens"].data]
    merges = [bytes(fields["tokenizer.ggml.merges"].parts[i]).decode() for i in fields["tokenizer.ggml.merges"].data]
    return tokens, merges, fields["tokenizer.chat_template"].contents()


def _f16_writer(path: Path, name: str, hidden: int, inter: int, layers: int, heads: int, kv: int,
                context: int = 4096, eps: float = 1e-5, rope_theta: float = 10000.0, arch: str = "llama",
                head_dim: int | None = None, f32: bool = False, vocab: int | None = None):
    """A GGUFWriter for an F16 (or all-F32) file of llama.cpp architecture arch with its header and the default
    model's tokenizer metadata (SmolLM2's vocabulary: the size the caller's embedding must have, or vocab, padded
    with unused tokens: a family's vocabulary size without its tokenizer)."""
    import gguf

    tokens, merges, chat_template = _default_tokenizer()
    tokens = tokens + [f"<unused{i}>" for i in range((vocab or len(tokens)) - len(tokens))]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_block_count(layers)
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    if head_dim and (head_dim != hidden // heads or arch != "llama"):  # llama.cpp's default is hidden / heads
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(eps)
    w.add_rope_freq_base(rope_theta)
    w.add_vocab_size(len(tokens))
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if f32 else gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(chat_template)
    return w


def default_vocab_size() -> int:
    """Tokens in the default model's vocabulary (the tokenizer every file written here carries)."""
    return len(_default_tokenizer()[0])


def smoke_vocab_size(small: int = 512) -> int:
    """The vocabulary of a smoke mode's tiny model: the default model's where llama.cpp is installed (the GGUF file
    written for it borrows that tokenizer), else small."""
    return default_vocab_size() if importlib.util.find_spec("llama_cpp") is not None else small


def write_f16(path: Path, shape: str, seed: int = 0) -> None:
    """An F16 GGUF file of random weights with the default model's tokenizer metadata."""
    hidden, inter, layers, heads, kv = SHAPES[shape]
    vocab = default_vocab_size()
    w = _f16_writer(path, f"random-llama-{shape}", hidden, inter, layers, heads, kv)
    rng = np.random.default_rng(seed)
    head_dim = hidden // heads

    def linear(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * cols ** -0.5).astype(np.float16)

    w.add_tensor("token_embd.weight", linear(vocab, hidden))
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(p + "attn_q.weight", linear(heads * head_dim, hidden))
        w.add_tensor(p + "attn_k.weight", linear(kv * head_dim, hidden))
        w.add_tensor(p + "attn_v.weight", linear(kv * head_dim, hidden))
        w.add_tensor(p + "attn_output.weight", linear(hidden, heads * head_dim))
        w.add_tensor(p + "ffn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(p + "ffn_gate.weight", linear(inter, hidden))
        w.add_tensor(p + "ffn_up.weight", linear(inter, hidden))
        w.add_tensor(p + "ffn_down.weight", linear(hidden, inter))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    w.add_tensor("output.weight", linear(vocab, hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _permute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF's q/k rows (rotate-half pairs) in GGUF's llama order (interleaved pairs), as llama.cpp's converter does."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# offload's architecture -> llama.cpp's (convert_hf_to_gguf.py writes Mistral and Mixtral as llama)
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2_moe": "qwen2moe",
                      "qwen3_moe": "qwen3moe", "qwen3": "qwen3", "gemma2": "gemma2"}
# whether llama.cpp's graph renormalises each token's top-k expert weights (hard-coded per architecture there:
# src/models/llama.cpp, qwen2moe.cpp, qwen3moe.cpp; none of them reads expert_weights_norm)
LLAMA_CPP_NORM_TOPK = {"mixtral": True, "qwen2_moe": False, "qwen3_moe": True}


def _check_writable(spec, folder: Path) -> None:
    """Exit with one sentence when llama.cpp would not run the folder's model as transformers does."""
    arch = spec.architecture
    if arch not in GGUF_ARCHITECTURES:
        sys.exit(f"{folder}: a {arch} model cannot be written as GGUF here; this writer takes "
                 f"{', '.join(GGUF_ARCHITECTURES)} folders")
    if spec.o_bias or spec.mlp_bias or (spec.qkv_bias and arch != "qwen2_moe"):
        sys.exit(f"{folder}: attention or MLP biases are not written here; use llama.cpp's convert_hf_to_gguf.py")
    if spec.rope.type != "default":
        sys.exit(f"{folder}: rope scaling {spec.rope.type!r} is not written here; use convert_hf_to_gguf.py")
    if spec.vocab_size < default_vocab_size():
        sys.exit(f"{folder}: vocabulary of {spec.vocab_size} tokens; the GGUF written here borrows the default "
                 f"model's tokenizer of {default_vocab_size()} (padded to larger ones), so pass a GGUF file of this "
                 f"model instead")
    if arch == "gemma2" and (spec.attn_scale != spec.head_dim ** -0.5 or not spec.tie_word_embeddings):
        sys.exit(f"{folder}: llama.cpp's gemma2 scales scores by head_dim and ties the output to the embedding; set "
                 f"query_pre_attn_scalar to head_dim and tie_word_embeddings in config.json")
    if spec.moe is None:
        return
    if spec.moe.dense_layers:
        sys.exit(f"{folder}: layers {list(spec.moe.dense_layers)} have a dense MLP (mlp_only_layers / "
                 f"decoder_sparse_step), which llama.cpp's {GGUF_ARCHITECTURES[arch]} cannot hold; every layer must "
                 f"be MoE")
    if spec.moe.norm_topk != LLAMA_CPP_NORM_TOPK[arch]:
        sys.exit(f"{folder}: norm_topk_prob is {spec.moe.norm_topk} but llama.cpp's {GGUF_ARCHITECTURES[arch]} "
                 f"always uses {LLAMA_CPP_NORM_TOPK[arch]}; set it to {LLAMA_CPP_NORM_TOPK[arch]} in config.json")


def _safetensors_reader(folder: Path):
    """get(name, dtype) -> numpy array of one tensor of the folder's safetensors files, read when asked for."""
    import torch
    from safetensors import safe_open

    where = {}
    for f in sorted(folder.glob("*.safetensors")):
        st = safe_open(str(f), "pt")  # kept open: a MoE model has thousands of expert tensors to read one by one
        where.update({name: st for name in st.keys()})

    def get(name: str, dtype) -> np.ndarray:
        return where[name].get_tensor(name).to(torch.float32).numpy().astype(dtype, copy=False)

    return get


def _layer_tensors(spec, i: int, get, dtype):
    """(GGUF name, array) of layer i, named and laid out as convert_hf_to_gguf.py writes them: llama's q/k rows
    permuted, each MoE layer's experts stacked into [n_experts, out, in] tensors, routers and norms F32."""
    p, h = f"blk.{i}.", f"model.layers.{i}."
    permute = GGUF_ARCHITECTURES[spec.architecture] == "llama"
    gemma = spec.architecture == "gemma2"
    yield p + "attn_norm.weight", _norm(spec, get(h + "input_layernorm.weight", np.float32))
    for x, heads in (("q", spec.n_heads), ("k", spec.n_kv_heads), ("v", 0)):
        w = get(f"{h}self_attn.{x}_proj.weight", dtype)
        yield f"{p}attn_{x}.weight", _permute_rope(w, heads) if permute and heads else w
        if spec.qkv_bias:
            yield f"{p}attn_{x}.bias", get(f"{h}self_attn.{x}_proj.bias", np.float32)
    if spec.qk_norm:
        for x in "qk":
            yield f"{p}attn_{x}_norm.weight", get(f"{h}self_attn.{x}_norm.weight", np.float32)
    yield p + "attn_output.weight", get(h + "self_attn.o_proj.weight", dtype)
    if gemma:  # its norms after attention and the MLP, and before the MLP
        yield p + "post_attention_norm.weight", _norm(spec, get(h + "post_attention_layernorm.weight", np.float32))
        yield p + "ffn_norm.weight", _norm(spec, get(h + "pre_feedforward_layernorm.weight", np.float32))
        yield p + "post_ffw_norm.weight", _norm(spec, get(h + "post_feedforward_layernorm.weight", np.float32))
    else:
        yield p + "ffn_norm.weight", get(h + "post_attention_layernorm.weight", np.float32)
    if not spec.is_moe_layer(i):
        for x in ("gate", "up", "down"):
            yield f"{p}ffn_{x}.weight", get(f"{h}mlp.{x}_proj.weight", dtype)
        return
    yield p + "ffn_gate_inp.weight", get(spec.router_name(i), np.float32)
    for k, x in enumerate(("gate", "up", "down")):
        yield f"{p}ffn_{x}_exps.weight", np.stack([get(spec.expert_names(i, e)[k], dtype)
                                                  for e in range(spec.moe.n_experts)])
    if spec.moe.shared_size:
        yield p + "ffn_gate_inp_shexp.weight", get(h + "mlp.shared_expert_gate.weight", np.float32)
        for x in ("gate", "up", "down"):
            yield f"{p}ffn_{x}_shexp.weight", get(f"{h}mlp.shared_expert.{x}_proj.weight", dtype)


def _norm(spec, w: np.ndarray) -> np.ndarray:
    """A norm's weight as the converter writes it: Gemma's plus 1 (llama.cpp multiplies by the weight itself)."""
    return w + np.float32(1) if spec.architecture == "gemma2" else w


def _add_gemma2_keys(w, spec) -> None:
    """Gemma2Model's keys: the window of its sliding layers and its soft-caps."""
    w.add_sliding_window(next(x for x in spec.variant.layer_windows if x is not None))
    w.add_attn_logit_softcapping(spec.variant.attn_softcap)
    w.add_final_logit_softcapping(spec.variant.final_softcap)


def _add_moe_keys(w, spec) -> None:
    """The expert counts and widths llama.cpp reads (Mixtral's expert width is its feed_forward_length)."""
    w.add_expert_count(spec.moe.n_experts)
    w.add_expert_used_count(spec.moe.top_k)
    if spec.architecture != "mixtral":
        w.add_expert_feed_forward_length(spec.moe.expert_size)
    if spec.moe.shared_size:
        w.add_expert_shared_feed_forward_length(spec.moe.shared_size)


def write_f16_from_hf(path: Path, folder: Path, f32: bool = False) -> None:
    """An F16 (f32: all-F32) GGUF file of a Hugging Face folder's weights (config.json + safetensors) as llama.cpp's
    convert_hf_to_gguf.py writes it, for llama.cpp to run the same weights: Llama, Mistral and Mixtral as llama,
    Qwen2-MoE as qwen2moe, Qwen3-MoE as qwen3moe. The tokenizer metadata is the default model's (the benchmarks
    feed token ids): the folder's vocabulary must have its size."""
    from offload.spec import load_spec

    spec = load_spec(folder)
    _check_writable(spec, folder)
    get, dtype = _safetensors_reader(folder), np.float32 if f32 else np.float16
    w = _f16_writer(path, folder.name, spec.hidden_size, spec.intermediate_size, spec.n_layers, spec.n_heads,
                    spec.n_kv_heads, spec.max_position_embeddings, spec.rms_norm_eps, spec.rope.theta,
                    GGUF_ARCHITECTURES[spec.architecture], spec.head_dim, f32, spec.vocab_size)
    if spec.moe is not None:
        _add_moe_keys(w, spec)
    if spec.architecture == "gemma2":
        _add_gemma2_keys(w, spec)
    w.add_tensor("token_embd.weight", get("model.embed_tokens.weight", dtype))
    for i in range(spec.n_layers):
        for name, array in _layer_tensors(spec, i, get, dtype):
            w.add_tensor(name, array)
    w.add_tensor("output_norm.weight", _norm(spec, get("model.norm.weight", np.float32)))
    if spec.architecture != "gemma2":  # llama.cpp's gemma2 reads the embedding as its output
        w.add_tensor("output.weight", get("model.embed_tokens.weight" if spec.tie_word_embeddings else
                                          "lm_head.weight", dtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def family_folder(folder: Path, family: str, smoke: bool = False) -> Path:
    """A random model of a FAMILY_SHAPES family saved as a Hugging Face folder (bf16; smoke: 2 tiny layers, the
    family's features kept, the default model's vocabulary size)."""
    import torch
    import transformers

    prefix, config = FAMILY_SHAPES[family]
    if smoke:
        config = {**config, "vocab_size": default_vocab_size(), "hidden_size": 64, "intermediate_size": 128,
                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                  **({"query_pre_attn_scalar": 16, "sliding_window": 8} if family == "gemma2" else {})}
    torch.manual_seed(0)
    model = getattr(transformers, f"{prefix}ForCausalLM")(getattr(transformers, f"{prefix}Config")(**config))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    return folder


def quantize(src: Path, dst: Path, kind: str, threads: int) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
    params.nthread = threads
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params) != 0:
        sys.exit(f"llama.cpp could not quantize {src} to {kind}")


def smoke() -> int:
    """A random tiny F16 file (main's path) and a tiny Hugging Face folder converted (write_f16_from_hf, what the
    benchmarks hand llama.cpp), each quantized by llama.cpp where it is installed. tests/test_gguf.py holds offload
    reading such files back."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from make_llama import tiny

    with tempfile.TemporaryDirectory(prefix="make-gguf-smoke-") as tmp:
        files = [Path(tmp) / "random.f16.gguf", Path(tmp) / "converted.f16.gguf"]
        write_f16(files[0], "tiny")
        write_f16_from_hf(files[1], tiny(Path(tmp) / "hf", vocab=default_vocab_size()))
        for family in FAMILY_SHAPES:
            files.append(Path(tmp) / f"{family}.f16.gguf")
            write_f16_from_hf(files[-1], family_folder(Path(tmp) / family, family, smoke=True))
        if importlib.util.find_spec("llama_cpp") is None:
            print("llama.cpp quantization skipped: llama-cpp-python is not installed (pip install llama-cpp-python)")
        else:
            for f in list(files):
                files.append(f.with_suffix(".Q4_0.gguf"))
                quantize(f, files[-1], "Q4_0", 1)
        for f in files:
            print(f"wrote {f.name}: {f.stat().st_size / 2**20:.1f} MiB")
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, nargs="?")
    ap.add_argument("--type", default="Q4_K_M", help="llama.cpp file type: Q4_K_M, Q5_K_M, Q6_K, Q8_0, Q4_0, F16")
    ap.add_argument("--shape", default="0.9b", choices=sorted(SHAPES))
    ap.add_argument("--family", choices=sorted(FAMILY_SHAPES), help="a random model of this family (its shape)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--smoke", action="store_true", help="tiny files in a temp folder (seconds)")
    args = ap.parse_args()
    if args.smoke:
        sys.exit(smoke())
    if args.out is None:
        ap.error("the output file is required (or --smoke)")
    with tempfile.TemporaryDirectory(dir=args.out.parent) as tmp:
        f16 = args.out if args.type == "F16" else Path(tmp) / "f16.gguf"
        if args.family:
            write_f16_from_hf(f16, family_folder(Path(tmp) / args.family, args.family))
        else:
            write_f16(f16, args.shape)
        if args.type != "F16":
            quantize(f16, args.out, args.type, args.threads)
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**30:.2f} GiB, {args.type}, "
          f"{args.family or 'shape ' + args.shape})")


if __name__ == "__main__":
    main()

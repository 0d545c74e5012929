"""Write a random Llama-shaped GGUF file for benchmarks, quantized by llama.cpp itself (llama-cpp-python).

The weights are random (normal, scaled by 1/sqrt(in)); the tokenizer and chat template are the default model's
(SmolLM2's, read from its GGUF file), so real prompts tokenize. llama.cpp's own quantizer makes the file
(`--type Q4_K_M`, `Q5_K_M`, `Q6_K`, `Q8_0`, `Q4_0`...), as users get it from llama-quantize.

  python scripts/make_gguf.py /tmp/llama-0.9b.Q4_K_M.gguf --type Q4_K_M
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

SHAPES = {  # name: (hidden, intermediate, layers, heads, kv heads)
    "0.9b": (2048, 5632, 16, 32, 8),
    "0.3b": (1024, 2816, 16, 16, 4),
    "8b": (4096, 14336, 32, 32, 8),
}


def _f16_writer(path: Path, name: str, hidden: int, inter: int, layers: int, heads: int, kv: int,
                context: int = 4096, eps: float = 1e-5, rope_theta: float = 10000.0):
    """A GGUFWriter for an F16 Llama file with its header and the default model's tokenizer metadata (SmolLM2's
    vocabulary: the size the caller's embedding must have)."""
    import gguf

    from offload.weights.default_model import find_gguf

    src = gguf.GGUFReader(find_gguf())
    tokens = [bytes(src.fields["tokenizer.ggml.tokens"].parts[i]).decode() for i in src.fields["tokenizer.ggml.tokens"].data]
    merges = [bytes(src.fields["tokenizer.ggml.merges"].parts[i]).decode() for i in src.fields["tokenizer.ggml.merges"].data]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_block_count(layers)
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(eps)
    w.add_rope_freq_base(rope_theta)
    w.add_vocab_size(len(tokens))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(src.fields["tokenizer.chat_template"].contents())
    return w


def default_vocab_size() -> int:
    """Tokens in the default model's vocabulary (the tokenizer every file written here carries)."""
    import gguf

    from offload.weights.default_model import find_gguf

    return len(gguf.GGUFReader(find_gguf()).fields["tokenizer.ggml.tokens"].data)


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


def write_f16_from_hf(path: Path, folder: Path) -> None:
    """An F16 GGUF file of a Hugging Face Llama-architecture folder's weights (config.json + safetensors), for
    llama.cpp to run the same weights. The tokenizer metadata is the default model's (the benchmarks feed token
    ids): the folder's vocabulary must have its size."""
    import json

    import torch
    from safetensors import safe_open

    config = json.loads((folder / "config.json").read_text())
    if config.get("model_type") not in ("llama", "mistral") or config.get("attention_bias") or config.get("mlp_bias"):
        sys.exit(f"{folder}: only Llama/Mistral-architecture folders without biases can be written as GGUF here")
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    if vocab != default_vocab_size():
        sys.exit(f"{folder}: vocabulary of {vocab} tokens; the GGUF written here borrows the default model's "
                 f"tokenizer of {default_vocab_size()}, so pass a GGUF file of this model instead")
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                tensors[name] = st.get_tensor(name)

    def get(name: str, dtype=np.float16) -> np.ndarray:
        return tensors[name].to(torch.float32).numpy().astype(dtype)

    rope = config.get("rope_parameters") or {}
    w = _f16_writer(path, folder.name, hidden, config["intermediate_size"], config["num_hidden_layers"], heads, kv,
                    config.get("max_position_embeddings", 4096), config.get("rms_norm_eps", 1e-5),
                    float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    w.add_tensor("token_embd.weight", get("model.embed_tokens.weight"))
    for i in range(config["num_hidden_layers"]):
        p, h = f"blk.{i}.", f"model.layers.{i}."
        w.add_tensor(p + "attn_norm.weight", get(h + "input_layernorm.weight", np.float32))
        w.add_tensor(p + "attn_q.weight", _permute_rope(get(h + "self_attn.q_proj.weight"), heads))
        w.add_tensor(p + "attn_k.weight", _permute_rope(get(h + "self_attn.k_proj.weight"), kv))
        w.add_tensor(p + "attn_v.weight", get(h + "self_attn.v_proj.weight"))
        w.add_tensor(p + "attn_output.weight", get(h + "self_attn.o_proj.weight"))
        w.add_tensor(p + "ffn_norm.weight", get(h + "post_attention_layernorm.weight", np.float32))
        w.add_tensor(p + "ffn_gate.weight", get(h + "mlp.gate_proj.weight"))
        w.add_tensor(p + "ffn_up.weight", get(h + "mlp.up_proj.weight"))
        w.add_tensor(p + "ffn_down.weight", get(h + "mlp.down_proj.weight"))
    w.add_tensor("output_norm.weight", get("model.norm.weight", np.float32))
    head = "lm_head.weight" if "lm_head.weight" in tensors else "model.embed_tokens.weight"
    w.add_tensor("output.weight", get(head))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def quantize(src: Path, dst: Path, kind: str, threads: int) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
    params.nthread = threads
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params) != 0:
        sys.exit(f"llama.cpp could not quantize {src} to {kind}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--type", default="Q4_K_M", help="llama.cpp file type: Q4_K_M, Q5_K_M, Q6_K, Q8_0, Q4_0, F16")
    ap.add_argument("--shape", default="0.9b", choices=sorted(SHAPES))
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    if args.type == "F16":
        write_f16(args.out, args.shape)
        return
    with tempfile.TemporaryDirectory(dir=args.out.parent) as tmp:
        f16 = Path(tmp) / "f16.gguf"
        write_f16(f16, args.shape)
        quantize(f16, args.out, args.type, args.threads)
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**30:.2f} GiB, {args.type}, shape {args.shape})")


if __name__ == "__main__":
    main()

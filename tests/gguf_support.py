"""Tiny GGUF models written with gguf-py's writer, as llama.cpp's converter lays them out (for the tests): tensors
named by gguf-py's own TensorNameMap (not offload's table), with the converter's changes per architecture (llama's
q/k rows permuted, Gemma's 1 added to every norm, Phi-3's LongRoPE factors as tensors, gpt-oss's stacked experts
transposed and their gate|up de-interleaved) and the metadata keys its converter writes (convert_hf_to_gguf.py:
Gemma2Model, Gemma3Model, Phi3MiniModel, GptOssModel, TextModel: YaRN's too)."""

from __future__ import annotations

import functools
import math
import zlib
from pathlib import Path

import numpy as np

from offload.formats import GGUF_TYPES
from offload.kernels.quant import put_scales

K_TINY = dict(vocab_size=160, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False)
# transformers' model_type -> the general.architecture llama.cpp's converter writes for it
ARCH_NAMES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
              "gemma3_text": "gemma3", "phi3": "phi3", "gpt_oss": "gpt-oss", "olmo2": "olmo2", "seed_oss": "seed_oss"}
# types gguf.quants.quantize writes (0.19)
GGPY_QUANTIZES = {"BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "TQ1_0", "TQ2_0", "MXFP4"}
GEMMA3_PATTERN = 6  # llama.cpp's period of Gemma 3's global layers where a file states none (llama-model.cpp)


@functools.cache
def _name_map(arch: str):
    import gguf

    kind = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    return gguf.get_tensor_name_map(kind, 64)


def gguf_name(hf: str, arch: str = "llama") -> str:
    """The GGUF name gguf-py's TensorNameMap gives a Hugging Face tensor in a file of GGUF architecture arch."""
    module, _, suffix = hf.rpartition(".")
    name = _name_map(arch).get_name(module)
    assert name, f"gguf-py's {arch} architecture has no tensor for {hf}"
    return f"{name}.{suffix}"


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of a llama q or k weight (rows per head interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of permute: GGUF's llama q/k rows back in transformers' order."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_from_gguf(model, path: Path):
    """A copy of a transformers model holding the weights of the GGUF file at path, dequantized by gguf-py and put
    back in transformers' layout: llama's q/k rows unpermuted, Gemma's norms less the converter's 1, each layer's
    stacked experts as transformers 5's fused [E, 2F, D] gate_up_proj and [E, D, F] down_proj. The reference for a
    file offload reads as stored."""
    import copy

    import gguf
    import torch

    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    llama = arch == "llama"
    values = {t.name: np.array(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
              for t in reader.tensors}
    cfg, ref = model.config, copy.deepcopy(model)
    state = {}
    for name, p in ref.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith("mlp.experts.gate_up_proj"):
            v = np.concatenate([values[f"blk.{layer}.ffn_gate_exps.weight"],
                                values[f"blk.{layer}.ffn_up_exps.weight"]], axis=1)
        elif name.endswith("mlp.experts.down_proj"):
            v = values[f"blk.{layer}.ffn_down_exps.weight"]
        else:
            v = values[gguf_name(name, arch)]
            if llama and (".q_proj." in name or ".k_proj." in name):
                v = unpermute(v, cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads)
            if arch.startswith("gemma") and name.endswith("norm.weight"):
                v = v - np.float32(1)  # transformers' Gemma adds the 1 the converter stored
        state[name] = torch.from_numpy(np.ascontiguousarray(v)).reshape(p.shape)
    result = ref.load_state_dict(state, strict=False)  # a tied lm_head is the embedding
    assert set(result.missing_keys) <= {"lm_head.weight"} and not result.unexpected_keys, result
    return ref


def random_blocks(qtype, shape: tuple[int, int], seed: int = 0) -> np.ndarray:
    """Random bytes of a quantized type with small, finite scales: uint8 [rows, row bytes]."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

    block, size = GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scale = np.float32(0.15) / np.sqrt(cols)

    def put(offset: int, values) -> None:
        raw[:, :, offset:offset + 2] = np.asarray(values, np.float16).view(np.uint8).reshape(rows, cols // block, 2)

    def rand(lo, hi):
        return rng.uniform(lo, hi, (rows, cols // block, 1)).astype(np.float32)

    if qtype in (T.Q4_K, T.Q5_K):
        put(0, (rand(0.5, 1.5) * scale / 8)[..., 0])  # d: weights d * sc * q, sc < 64, q < 16 (32)
        put(2, (rand(0.5, 1.5) * scale / 4)[..., 0])  # dmin
    elif qtype == T.Q6_K:
        put(size - 2, (rand(0.5, 1.5) * scale / 64)[..., 0])
    elif qtype == T.Q4_1:
        put(0, (rand(0.5, 1.5) * scale / 4)[..., 0])
        put(2, (-rand(0.5, 1.5) * scale * 2)[..., 0])
    elif qtype in (T.Q8_0, T.Q4_0):
        put(0, (rand(0.5, 1.5) * scale / 8)[..., 0])
    else:  # any other type of offload's table: each scale field set so that the weights' mean size is about scale
        kind = next((t for t in GGUF_TYPES if t.ggml_name == qtype.name), None)
        if kind is None:  # a type offload does not read: random bytes are all it needs
            return raw.reshape(rows, -1)
        blocks = raw.reshape(-1, size)
        put_scales(blocks, kind.name, np.ones)
        unit = np.abs(kind.dequantize_np(blocks[:64])).mean()
        put_scales(blocks, kind.name, lambda n: rng.uniform(0.5, 1.5, n).astype(np.float32) * scale / unit)
    return raw.reshape(rows, -1)


def write_gguf(model, path: Path, qtype: str = "F32", tokenizer: bool = True, arch: str = "llama",
               types: dict[str, str] | None = None, random_quants: bool = False, mkdir: bool = False,
               split_max_tensors: int = 0, raw: dict[str, tuple[np.ndarray, str]] | None = None) -> Path:
    """Write a transformers model as a GGUF file: linear weights in qtype (or types[gguf name]), norms, biases and
    routers F32; raw[gguf name]: (bytes, GGUF type) written in a tensor's place (gpt-oss's MXFP4 experts as the
    converter repacks a release's blocks).

    Types gguf-py cannot quantize to (the K-quants, the IQ types) get random blocks (random_quants must be set): the model is
    then the one those blocks encode, which transformers reads back the same way."""
    import gguf
    from gguf import GGMLQuantizationType as T

    cfg = model.config
    name = ARCH_NAMES[arch]
    if mkdir:
        path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), name, split_max_tensors=split_max_tensors)
    w.add_name(f"tiny-{arch}")  # "mistral" in the name: llama.cpp's (and transformers') sign of a mistral model
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    theta = getattr(cfg, "rope_theta", None)  # set on a config by a test that writes a bad value
    w.add_rope_freq_base(_rope(cfg)["rope_theta"] if theta is None else theta)
    w.add_vocab_size(cfg.vocab_size)
    _add_family_keys(w, cfg, arch)
    if tokenizer:
        add_byte_tokenizer(w, cfg.vocab_size)
    for g, t in _converted_tensors(model, arch):
        kind = (types or {}).get(g, qtype) if t.ndim >= 2 and g.endswith(".weight") and "_inp." not in g else "F32"
        qt = T[kind]
        if g in (raw or {}):
            w.add_tensor(g, raw[g][0], raw_dtype=T[raw[g][1]])
        elif qt == T.F32:
            w.add_tensor(g, np.ascontiguousarray(t))
        elif qt in (T.F16,):
            w.add_tensor(g, t.astype(np.float16))
        elif kind not in GGPY_QUANTIZES:
            assert random_quants, f"gguf-py cannot quantize to {kind}: pass random_quants=True"
            w.add_tensor(g, random_blocks(qt, t.shape, seed=zlib.crc32(g.encode())), raw_dtype=qt)
        else:
            w.add_tensor(g, gguf.quants.quantize(t, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _rope(cfg, kind: str = "full_attention") -> dict:
    """The rope parameters of a transformers config (Gemma 3's of one attention kind)."""
    params = getattr(cfg, "rope_parameters", None) or {"rope_theta": getattr(cfg, "rope_theta", 10000.0)}
    return params.get(kind, params)


def _converted_tensors(model, arch: str):
    """(GGUF name, fp32 array) of each tensor, changed as the converter changes it: llama's q/k rows permuted,
    Gemma's norms plus 1, Gemma 2's lm_head dropped (its files always tie), Phi-3's LongRoPE factors added."""
    cfg, name = model.config, ARCH_NAMES[arch]
    n_heads, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    assert not (arch == "gemma2" and not cfg.tie_word_embeddings), "llama.cpp's gemma2 has no output tensor"
    for hf, p in model.state_dict().items():
        if hf == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        t = p.detach().float().numpy()
        if name == "gpt-oss" and ".mlp.experts." in hf:
            yield from _gpt_oss_experts(hf, t)
            continue
        if name == "llama" and (".q_proj." in hf or ".k_proj." in hf):
            t = permute(t, n_heads if ".q_proj." in hf else n_kv)
        if name.startswith("gemma") and hf.endswith("norm.weight"):
            t = t + np.float32(1)
        yield gguf_name(hf + ".weight" if hf.endswith(".sinks") else hf, name), t
    rope = _rope(cfg)
    if name == "phi3" and rope.get("long_factor"):
        yield "rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32)
        yield "rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32)


def _gpt_oss_experts(hf: str, t: np.ndarray):
    """GptOssModel.modify_tensors on float experts: transformers' stacked [E, in, out] weights transposed to
    GGUF's [E, out, in], the interleaved gate|up (its even outputs gate, odd up) split into gate and up."""
    stem, what = hf.rsplit(".", 1)  # model.layers.N.mlp.experts, gate_up_proj[_bias] or down_proj[_bias]
    bias = what.endswith("_bias")
    if not bias:
        t = t.swapaxes(1, 2)  # [E, out, in]
    if what.startswith("down_proj"):
        yield gguf_name(f"{stem}.down_proj.{'bias' if bias else 'weight'}", "gpt-oss"), np.ascontiguousarray(t)
        return
    for proj, rows in (("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2))):
        yield gguf_name(f"{stem}.{proj}.{'bias' if bias else 'weight'}", "gpt-oss"), np.ascontiguousarray(t[:, rows])


def _add_family_keys(w, cfg, arch: str) -> None:
    """The metadata keys llama.cpp's converter writes for the architecture beyond Llama's."""
    import gguf

    _add_yarn_keys(w, _rope(cfg))
    if arch == "gpt_oss":  # GptOssModel's and TextModel's keys of a mixture of experts
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_sliding_window(cfg.sliding_window)
        w.add_expert_count(cfg.num_local_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.intermediate_size)
    if arch in ("qwen3", "gemma2", "gemma3_text", "seed_oss"):  # TextModel's and the Gemmas': config.json's head_dim
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if arch in ("gemma2", "gemma3_text"):
        # the converter writes no query_pre_attn_scalar: llama.cpp scales by head_dim (but for the 27B models)
        assert cfg.query_pre_attn_scalar == cfg.head_dim, "a GGUF file cannot state query_pre_attn_scalar"
        w.add_sliding_window(cfg.sliding_window)
        if cfg.final_logit_softcapping:
            w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    if arch == "gemma3_text":
        full, local = _rope(cfg), _rope(cfg, "sliding_attention")
        if full.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
        w.add_rope_freq_base_swa(local["rope_theta"])
        pattern = getattr(cfg, "sliding_window_pattern", GEMMA3_PATTERN)
        if pattern != GEMMA3_PATTERN:  # a newer file's key; llama.cpp's converter leaves it at 6
            w.add_sliding_window_pattern(pattern)
    if arch == "phi3":
        _add_phi3_keys(w, cfg)


def _add_yarn_keys(w, rope: dict) -> None:
    """TextModel's keys of YaRN rope scaling: the factor, the trained context, and the band and attention factor
    where the config states them (not truncate: GGUF has no key for it)."""
    import gguf

    if rope.get("rope_type", rope.get("type")) != "yarn":
        return
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    for key, add in (("attention_factor", w.add_rope_scaling_yarn_attn_factor),
                     ("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                     ("beta_slow", w.add_rope_scaling_yarn_beta_slow)):
        if rope.get(key) is not None:
            add(rope[key])


def _add_phi3_keys(w, cfg) -> None:
    """Phi3MiniModel's keys: the rotated dimensions, the trained context, the window (0: none), LongRoPE's."""
    import gguf

    rope = _rope(cfg)
    partial = rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
    original = rope.get("original_max_position_embeddings", cfg.original_max_position_embeddings)
    w.add_rope_dimension_count(int(partial * cfg.hidden_size) // cfg.num_attention_heads)
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_sliding_window(cfg.sliding_window or 0)
    if rope.get("long_factor"):
        scale = cfg.max_position_embeddings / original
        w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)


def add_byte_tokenizer(w, vocab_size: int) -> None:
    """A GPT-2 style byte-level BPE vocabulary: the 256 byte symbols, a few merges, then specials up to vocab."""
    symbols = list(_bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he"][: max(0, vocab_size - 256 - 3)]
    tokens = symbols + [m.replace(" ", "") for m in merges]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens += specials + [f"<unused{i}>" for i in range(vocab_size - len(tokens) - len(specials))]
    tokens = tokens[:vocab_size]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE symbols)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))

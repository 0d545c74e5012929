"""A GGUF file's metadata as a config.json-style dict (what spec_from_config reads), as llama.cpp reads it, and the
ModelSpec made of it.

llama.cpp's converter (convert_hf_to_gguf.py) writes a model's hyperparameters under its architecture's namespace
(gemma2.attention.sliding_window, ...); where it leaves one out, llama.cpp's loader (llama-model.cpp) hard-codes
it per architecture, and so does this reader: Gemma 3's every-sixth global layer and local rope base of 10000,
the Gemmas' attention scale (GGUF files hold no query_pre_attn_scalar). Which keys a family reads follows its
entry in offload/families.py (soft-caps, windows, local rope, partial rotary, YaRN's rounding), not its name.
"""

from __future__ import annotations

import math

import numpy as np

from offload.errors import WeightsError
from offload.families import BY_MODEL_TYPE, GGUF_ARCHITECTURES, Family
from offload.spec import ModelSpec, spec_from_config
from offload.weights.gguf import GGUFFile, tensor_map

_LLAMA3_FACTORS = (8.0, 16.0, 32.0)  # rope factors of the Llama 3.1 / 3.2 / 3.3 releases, tried against rope_freqs


def gguf_spec(gf: GGUFFile) -> ModelSpec:
    """The ModelSpec of a GGUF model, with each tensor's stored format."""
    spec = spec_from_config(gguf_config(gf), source=str(gf.path))
    return spec.with_stored_formats({hf: t.fmt or t.ggml_type for hf, t in tensor_map(gf, spec).items()})


def gguf_config(gf: GGUFFile) -> dict:
    """A config.json-style dict for the model in gf (what spec_from_config reads)."""
    arch = gf.architecture
    if arch not in GGUF_ARCHITECTURES:
        raise WeightsError(f"{gf.path}: GGUF architecture {arch or 'missing'!r} is not supported; offload runs "
                           f"{', '.join(GGUF_ARCHITECTURES)} models")
    model_type = GGUF_ARCHITECTURES[arch]
    if model_type == "llama" and gf.arch_key("expert_count"):
        model_type = "mixtral"  # llama.cpp stores Mixtral as llama with experts
    elif model_type == "llama" and "mistral" in str(gf.get("general.name", "")).lower():
        model_type = "mistral"  # llama.cpp stores mistral models as llama
    elif model_type == "olmo2" and gf.arch_key("attention.sliding_window"):  # llama.cpp stores OLMo 3 as olmo2
        raise WeightsError(f"{gf.path}: this olmo2 GGUF file has sliding-window layers, so it holds an OLMo 3 model, "
                           f"which offload does not run yet; use an OLMo 2 model")
    n_heads = gf.arch_key("attention.head_count")
    hidden = gf.arch_key("embedding_length")
    embed = gf.tensors.get("token_embd.weight")
    vocab = (gf.arch_key("vocab_size") or gf.array_lengths.get("tokenizer.ggml.tokens")
             or len(gf.get("tokenizer.ggml.tokens") or ()) or (embed.shape[0] if embed else None))
    config = {
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": gf.arch_key("feed_forward_length"),
        "num_hidden_layers": gf.arch_key("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": gf.arch_key("attention.head_count_kv") or n_heads,
        "rms_norm_eps": gf.arch_key("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": gf.arch_key("rope.freq_base", 10000.0),
        "max_position_embeddings": gf.arch_key("context_length"),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in gf.tensors,
        "bos_token_id": gf.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": gf.get("tokenizer.ggml.eos_token_id"),
        "attention_bias": model_type not in ("qwen2", "qwen2_moe") and "blk.0.attn_q.bias" in gf.tensors,
        "qkv_bias": "blk.0.attn_q.bias" in gf.tensors,  # read for qwen2_moe
        "attention_out_bias": "blk.0.attn_output.bias" in gf.tensors,  # o_proj's own (Seed-OSS)
        "mlp_bias": "blk.0.ffn_up.bias" in gf.tensors,
        "torch_dtype": "float32",
        **_moe_config(gf, model_type),
    }
    key_length = gf.arch_key("attention.key_length")
    if key_length:
        config["head_dim"] = key_length
    family = BY_MODEL_TYPE[model_type]
    config.update(_family_config(gf, family, config))
    rope = _rope_scaling(gf, family, config)
    if rope:
        config["rope_scaling"] = rope
    return config


def _family_config(gf: GGUFFile, family: Family, config: dict) -> dict:
    """The config.json keys of where the family differs from Llama, from the metadata llama.cpp's converter writes:
    sliding windows, soft-caps, the Gemmas' attention scale and local rope base, Phi-3's partial rotary."""
    out: dict = {}
    window = gf.arch_key("attention.sliding_window")
    if window and family.windows != "qwen":  # Qwen slides only with use_sliding_window, which its files do not hold
        out["sliding_window"] = window
    pattern = gf.arch_key("attention.sliding_window_pattern")  # newer files: a period, or each layer's bool
    if family.windows in ("alternate", "pattern") and isinstance(pattern, list):
        out["layer_types"] = ["sliding_attention" if s else "full_attention" for s in pattern]
    elif family.windows == "pattern" and pattern:
        out["sliding_window_pattern"] = pattern
    if family.local_rope and gf.arch_key("rope.freq_base_swa"):
        out["rope_local_base_freq"] = gf.arch_key("rope.freq_base_swa")  # else llama.cpp's (and offload's) 10000
    if family.softcaps:
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            out[key] = gf.arch_key(key)  # None where the file has none: no cap
    head_dim, width = _head_dim(config), _head_dim({**config, "head_dim": None})
    if family.query_pre_attn_scalar and head_dim:
        wide = config["num_hidden_layers"] in family.gguf_width_scaled
        out["query_pre_attn_scalar"] = width if wide else head_dim
    rotary = gf.arch_key("rope.dimension_count")
    if family.partial_rotary and head_dim and isinstance(rotary, int) and 0 < rotary < head_dim:
        out["partial_rotary_factor"] = (rotary + 0.5) / head_dim  # the half keeps int(head_dim * factor) at rotary
    return out


def _head_dim(config: dict) -> int | None:
    """The heads' width: head_dim (key_length), else hidden / heads; None where the metadata cannot tell (the spec
    then names the bad key)."""
    hidden, n_heads = config["hidden_size"], config["num_attention_heads"]
    if config.get("head_dim"):
        return config["head_dim"]
    return hidden // n_heads if isinstance(hidden, int) and isinstance(n_heads, int) and n_heads > 0 else None


def _moe_config(gf: GGUFFile, model_type: str) -> dict:
    """The config.json keys of a Mixtral, Qwen2-MoE, Qwen3-MoE or gpt-oss file's experts, as llama.cpp reads its
    metadata. gpt-oss's clamped SwiGLU (alpha 1.702, limit 7) is not in its files: llama.cpp's graph holds the
    release's numbers, as MoESpec's defaults do."""
    if model_type not in ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss"):
        return {}
    n_experts, top_k = gf.arch_key("expert_count"), gf.arch_key("expert_used_count")
    for key, value in (("expert_count", n_experts), ("expert_used_count", top_k)):
        if not value:
            raise WeightsError(f"{gf.path}: metadata key {gf.architecture}.{key} is missing or 0, which a "
                               f"{gf.architecture} mixture of experts needs; convert the model again with llama.cpp")
    if model_type == "mixtral":  # its feed_forward_length is the expert width; every layer is MoE
        return {"num_local_experts": n_experts, "num_experts_per_tok": top_k}
    if model_type == "gpt_oss":  # every layer is MoE; the converter writes the width as both keys
        width = gf.arch_key("expert_feed_forward_length") or gf.arch_key("feed_forward_length")
        return {"num_local_experts": n_experts, "num_experts_per_tok": top_k, "intermediate_size": width}
    ff = gf.arch_key("feed_forward_length") or 0
    config = {"num_experts": n_experts, "num_experts_per_tok": top_k, "decoder_sparse_step": 1, "mlp_only_layers": [],
              # llama.cpp's defaults where a width is absent (src/models/qwen2moe.cpp, qwen3moe.cpp)
              "moe_intermediate_size": gf.arch_key("expert_feed_forward_length") or ff // top_k,
              # llama.cpp's qwen3moe graph always renormalises each token's top-k weights and its qwen2moe graph
              # never does; neither reads expert_weights_norm, so neither does offload
              "norm_topk_prob": model_type == "qwen3_moe"}
    if model_type == "qwen2_moe":
        config["shared_expert_intermediate_size"] = gf.arch_key("expert_shared_feed_forward_length") or ff
    config["intermediate_size"] = ff or config["moe_intermediate_size"]  # a dense MLP's width: no layer has one
    return config


def _rope_scaling(gf: GGUFFile, family: Family, config: dict) -> dict | None:
    """rope_scaling from GGUF metadata: linear scaling and YaRN by key; LongRoPE by its factor tensors; Llama 3's by
    matching the rope_freqs tensor."""
    kind = gf.arch_key("rope.scaling.type")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(gf.arch_key("rope.scaling.factor", 1.0))}
    if kind == "yarn":
        return _yarn(gf, family)
    if kind == "longrope" or (kind is None and "rope_factors_long.weight" in gf.tensors):
        return _longrope(gf, config)
    if kind not in (None, "none"):
        raise WeightsError(f"{gf.path}: rope scaling {kind!r} is not supported; offload supports linear scaling, "
                           f"YaRN, LongRoPE and Llama 3's")
    freqs = gf.tensors.get("rope_freqs.weight")
    if freqs is None:
        return None
    factors = gf.read(freqs).view(np.float32) if freqs.ggml_type == "F32" else None
    head_dim = _head_dim(config)
    for factor in _LLAMA3_FACTORS:
        rope = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
        if factors is not None and np.allclose(factors, _llama3_factors(rope, config["rope_theta"], head_dim),
                                               rtol=1e-3):
            return rope
    raise WeightsError(f"{gf.path}: its rope_freqs tensor matches no Llama 3 rope scaling offload knows "
                       f"(factors {', '.join(str(f) for f in _LLAMA3_FACTORS)}); use the model's safetensors release")


def _yarn(gf: GGUFFile, family: Family) -> dict:
    """YaRN as the converter writes config.json's rope_scaling: the factor, the context the model was trained at,
    and the band (beta_fast, beta_slow) and attention factor where the config stated them (else transformers'
    defaults, as the spec's). Whether the band's edges are rounded is the family's (Family.gguf_yarn_truncate)."""
    def key(name: str):
        return gf.arch_key(f"rope.scaling.{name}")

    original = key("original_context_length")
    if not original:
        raise WeightsError(f"{gf.path}: YaRN rope scaling needs metadata key {gf.architecture}.rope.scaling."
                           f"original_context_length; convert the model again with llama.cpp")
    # llama.cpp's other YaRN knobs (DeepSeek's log multiplier, a partial extrapolation mix) are not transformers'
    if key("yarn_log_multiplier") or key("yarn_ext_factor") not in (None, 1.0):
        raise WeightsError(f"{gf.path}: YaRN with rope.scaling.yarn_log_multiplier {key('yarn_log_multiplier')} "
                           f"and yarn_ext_factor {key('yarn_ext_factor')} is not supported (offload's YaRN is "
                           f"transformers': 0 and 1); use the model's safetensors release")
    rope = {"rope_type": "yarn", "factor": float(key("factor") or 1.0), "original_max_position_embeddings": original,
            "truncate": family.gguf_yarn_truncate}
    for name, as_named in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                           ("yarn_attn_factor", "attention_factor")):
        if key(name) is not None:
            rope[as_named] = float(key(name))
    return rope


def _longrope(gf: GGUFFile, config: dict) -> dict:
    """Phi-3's LongRoPE: the per-frequency factors llama.cpp's converter stores as the rope_factors_short and
    rope_factors_long tensors, the context length the model was trained at, and the attention factor."""
    factors = {}
    for key in ("short", "long"):
        t = gf.tensors.get(f"rope_factors_{key}.weight")
        if t is None or t.ggml_type != "F32":
            raise WeightsError(f"{gf.path}: LongRoPE scaling needs an F32 tensor rope_factors_{key}.weight, found "
                               f"{t.ggml_type if t else 'none'}; convert the model again with llama.cpp")
        factors[f"{key}_factor"] = [float(v) for v in gf.read(t).view(np.float32)]
    original = gf.arch_key("rope.scaling.original_context_length")
    if not original:
        raise WeightsError(f"{gf.path}: LongRoPE scaling needs metadata key {gf.architecture}.rope.scaling."
                           f"original_context_length; convert the model again with llama.cpp")
    config["original_max_position_embeddings"] = original
    rope = {"rope_type": "longrope", "original_max_position_embeddings": original, **factors}
    # the converter's attention factor is transformers' sqrt(1 + ln(scale) / ln(original)), stored in float32; the
    # spec computes it again from the two context lengths unless the file states another
    stated, scale = gf.arch_key("rope.scaling.attn_factor"), (config["max_position_embeddings"] or original) / original
    derived = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
    if stated is not None and not math.isclose(stated, derived, rel_tol=1e-6):
        rope["attention_factor"] = float(stated)
    return rope


def _llama3_factors(rope: dict, theta: float, head_dim: int) -> np.ndarray:
    """The per-frequency divisors llama.cpp stores as rope_freqs for Llama 3 rope scaling."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    old = rope["original_max_position_embeddings"]
    low, high = old / rope["low_freq_factor"], old / rope["high_freq_factor"]
    smooth = (old / wavelen - rope["low_freq_factor"]) / (rope["high_freq_factor"] - rope["low_freq_factor"])
    out = np.where(wavelen < high, 1.0, np.where(wavelen > low, rope["factor"],
                                                 1.0 / ((1 - smooth) / rope["factor"] + smooth)))
    return out.astype(np.float32)

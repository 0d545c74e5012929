"""The model families offload runs, one entry each, stating only how a family differs from Llama: its norms (and
Gemma's `1 + weight`), activation, q/k norms, attention scale and soft-capping, which layers slide and by how much,
rope variants, embedding scale, biases, fused tensors, its tensor names in Hugging Face checkpoints and GGUF files, and
how its chat answers read (the reasoning parser that splits them, the tokens that end them). The spec
(offload/spec.py), the loaders, the planner's unit sizes, the block math and the chat code read the entry; nothing
else names a family.

Adding a family: an entry in FAMILIES (for GGUF files: the general.architecture llama.cpp's converter writes for it
in gguf_archs, and its tensor names where they differ from GGUF_LAYER_NAMES in gguf_names), a tiny random model of it
in the tests' make_hf_model, and its tests (tests/test_families.py; tests/test_gguf_families.py for GGUF files)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from offload.config_values import count, fix, real
from offload.errors import ConfigError
from offload.reasoning import HARMONY_PARSER
from offload.rope_spec import RopeSpec, rope_from_config


def _never(config: dict) -> bool:
    return False


def _attention_bias(config: dict) -> bool:
    return bool(config.get("attention_bias", False))


@dataclass(frozen=True)
class Family:
    """One model family: Llama's defaults, and where it differs. Names are a layer's modules (under
    model.layers.N.) in Hugging Face checkpoints; a module of None is one the family does not have."""

    name: str
    model_types: tuple[str, ...]  # config.json model_type values
    attn_norm: str | None = "input_layernorm"  # the norm before attention (OLMo 2 has none)
    mlp_norm: str | None = "post_attention_layernorm"  # the norm before the MLP (Gemma's pre_feedforward_layernorm)
    post_attn_norm: str | None = None  # Gemma 2/3: the attention's output is normed before the residual add
    post_mlp_norm: str | None = None  # Gemma 2/3: and the MLP's
    qkv: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")  # Phi-3: one fused tensor
    o: str = "self_attn.o_proj"
    gate_up: tuple[str, ...] = ("mlp.gate_proj", "mlp.up_proj")  # Phi-3: one fused tensor
    down: str = "mlp.down_proj"
    norm_offset: float = 0.0  # Gemma's RMSNorm multiplies by 1 + weight (added to the weights as they load)
    activation: str = "silu"  # of the gate: silu, gelu_tanh
    qk_norm: bool = False  # RMSNorm over each head of q and k before rope (Qwen3, Gemma 3)
    qk_norm_over: str = "head"  # or "all": over the whole q and k projections (OLMo 2)
    tied: bool = False  # whether lm_head is the embedding where the config does not say (Gemma's default)
    embed_scale: bool = False  # Gemma: embeddings times sqrt(hidden), rounded to the compute dtype
    query_pre_attn_scalar: bool = False  # Gemma: scores scaled by query_pre_attn_scalar ** -0.5, not head_dim's
    softcaps: bool = False  # Gemma 2: attention logits and final logits soft-capped (cap * tanh(x / cap))
    windows: str = "all"  # which layers slide: all (sliding_window, if set), qwen (only with use_sliding_window),
    # alternate (Gemma 2: even layers), pattern (Gemma 3: all but every sliding_window_pattern-th)
    local_rope: bool = False  # Gemma 3: sliding layers turn at rope_local_base_freq, unscaled
    partial_rotary: bool = False  # Phi-3 family: rope turns the first partial_rotary_factor of each head
    sinks: bool = False  # gpt-oss: each head's softmax has one more logit (self_attn.sinks), with no value
    qkv_bias: object = field(default=_attention_bias)  # config -> bool
    o_bias: object = field(default=_attention_bias)
    mlp_bias: object = field(default=_never)
    moe: str | None = None  # mixtral or qwen: the experts' naming (MoESpec.naming); None: dense
    gguf_permuted: bool = False  # llama.cpp's converter permutes q and k rows for its rope (llama-type files)
    gguf_archs: tuple[str, ...] = ()  # the general.architecture of its GGUF files (Mixtral's: llama, with experts)
    gguf_names: tuple[tuple[str, str], ...] = ()  # (module, GGUF name) where it differs from GGUF_LAYER_NAMES
    # layer counts at which llama.cpp scales attention scores by (hidden / heads) ** -0.5 rather than head_dim's: its
    # stand-in for query_pre_attn_scalar, which GGUF files do not hold (the 27B Gemmas)
    gguf_width_scaled: tuple[int, ...] = ()
    # whether YaRN rounds its band's edges to whole dimensions in this family's GGUF files, which cannot say so:
    # llama.cpp always rounds them; gpt-oss's releases (rope_scaling.truncate false) and OpenAI's own code do not
    gguf_yarn_truncate: bool = True
    # the reasoning parser (offload/reasoning.py) that serve.reasoning_parser auto picks for its chat answers (None:
    # <think> where the chat template mentions it); gpt-oss answers in harmony's channels
    reasoning_parser: str | None = None
    # tokens that end an answer beside the eos ids its files name, where its tokenizer has them: a GGUF file names
    # one eos id, but a gpt-oss answer ends at <|return|>, or at <|call|> where it calls a tool
    stop_tokens: tuple[str, ...] = ()


# a layer's Hugging Face modules -> their GGUF tensors (blk.N.<name>), as gguf-py's TensorNameMap names Llama's and the
# MoE families'; a MoE layer's routed experts are not here (each is a slice of the layer's stacked ffn_*_exps tensors)
GGUF_LAYER_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
                    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
                    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
                    "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
                    "mlp.shared_expert_gate": "ffn_gate_inp_shexp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
                    "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp"}
# Gemma's four norms: llama.cpp's ffn_norm is the norm before the MLP (pre_feedforward_layernorm); the converter adds
# Gemma's 1 to every norm's weights, so a GGUF file's norms are used as stored
_GEMMA_GGUF_NAMES = (("post_attention_layernorm", "post_attention_norm"), ("pre_feedforward_layernorm", "ffn_norm"),
                     ("post_feedforward_layernorm", "post_ffw_norm"))

# OLMo 2's norms after attention and the MLP, as gguf-py names them in its olmo2 files
_OLMO_GGUF_NAMES = (("post_attention_layernorm", "post_attention_norm"),
                    ("post_feedforward_layernorm", "post_ffw_norm"))

FAMILIES = (
    Family("llama", ("llama",), mlp_bias=lambda c: bool(c.get("mlp_bias", False)), gguf_permuted=True,
           gguf_archs=("llama",)),
    Family("mistral", ("mistral",), gguf_permuted=True, gguf_archs=("mistral",)),
    Family("qwen2", ("qwen2",), qkv_bias=lambda c: True, o_bias=_never, windows="qwen", gguf_archs=("qwen2",)),
    Family("qwen3", ("qwen3",), qk_norm=True, windows="qwen", gguf_archs=("qwen3",)),
    Family("gemma2", ("gemma2",), mlp_norm="pre_feedforward_layernorm", post_attn_norm="post_attention_layernorm",
           post_mlp_norm="post_feedforward_layernorm", norm_offset=1.0, activation="gelu_tanh", tied=True,
           embed_scale=True, query_pre_attn_scalar=True, softcaps=True, windows="alternate",
           gguf_archs=("gemma2",), gguf_names=_GEMMA_GGUF_NAMES, gguf_width_scaled=(46,)),
    Family("gemma3", ("gemma3_text", "gemma3"), mlp_norm="pre_feedforward_layernorm",
           post_attn_norm="post_attention_layernorm", post_mlp_norm="post_feedforward_layernorm", norm_offset=1.0,
           activation="gelu_tanh", qk_norm=True, tied=True, embed_scale=True, query_pre_attn_scalar=True, softcaps=True,
           windows="pattern", local_rope=True, gguf_archs=("gemma3",), gguf_names=_GEMMA_GGUF_NAMES,
           gguf_width_scaled=(62,)),
    Family("phi3", ("phi3",), qkv=("self_attn.qkv_proj",), gate_up=("mlp.gate_up_proj",), partial_rotary=True,
           gguf_archs=("phi3",), gguf_names=(("self_attn.qkv_proj", "attn_qkv"), ("mlp.gate_up_proj", "ffn_up"))),
    Family("olmo2", ("olmo2",), attn_norm=None, mlp_norm=None, post_attn_norm="post_attention_layernorm",
           post_mlp_norm="post_feedforward_layernorm", qk_norm=True, qk_norm_over="all", gguf_archs=("olmo2",),
           gguf_names=_OLMO_GGUF_NAMES),
    Family("seed_oss", ("seed_oss",), o_bias=lambda c: bool(c.get("attention_out_bias", False)),
           mlp_bias=lambda c: bool(c.get("mlp_bias", False)), gguf_archs=("seed_oss",),
           gguf_names=(("post_attention_layernorm", "post_attention_norm"),)),
    Family("mixtral", ("mixtral",), moe="mixtral", gguf_permuted=True),
    # its GGUF files: the experts' gate and up de-interleaved into ffn_gate_exps and ffn_up_exps (gguf_locations)
    Family("gpt_oss", ("gpt_oss",), sinks=True, windows="alternate", moe="gpt_oss", gguf_archs=("gpt-oss",),
           gguf_names=(("post_attention_layernorm", "post_attention_norm"), ("self_attn.sinks", "attn_sinks"),
                       ("mlp.router", "ffn_gate_inp")), gguf_yarn_truncate=False,
           reasoning_parser=HARMONY_PARSER, stop_tokens=("<|return|>", "<|call|>")),
    Family("qwen2_moe", ("qwen2_moe",), qkv_bias=lambda c: bool(c.get("qkv_bias", True)), o_bias=_never,
           windows="qwen", moe="qwen", gguf_archs=("qwen2moe",)),
    Family("qwen3_moe", ("qwen3_moe",), qk_norm=True, windows="qwen", moe="qwen", gguf_archs=("qwen3moe",)),
)
BY_MODEL_TYPE = {t: f for f in FAMILIES for t in f.model_types}
SUPPORTED_ARCHITECTURES = tuple(BY_MODEL_TYPE)
MOE_ARCHITECTURES = tuple(t for f in FAMILIES if f.moe for t in f.model_types)
# GGUF general.architecture -> the model_type it is read as (a llama file with experts is Mixtral: gguf_config)
GGUF_ARCHITECTURES = {a: f.model_types[0] for f in FAMILIES for a in f.gguf_archs}


def gguf_layer_names(family: Family) -> dict[str, str]:
    """A layer's Hugging Face modules -> their GGUF tensor names in this family's files."""
    return {**GGUF_LAYER_NAMES, **dict(family.gguf_names)}


def family_of(config: dict, source: str) -> Family:
    """The family of a config.json (a multimodal Gemma 3 folder's text_config is read by text_config)."""
    arch = config.get("model_type")
    if arch not in BY_MODEL_TYPE:
        found = arch or (config.get("architectures") or ["nothing"])[0]
        raise ConfigError(f"{source}: architecture {found!r} is not supported; "
                          f"supported model_type values are {', '.join(SUPPORTED_ARCHITECTURES)}")
    return BY_MODEL_TYPE[arch]


def text_config(config: dict) -> dict:
    """The text model's config of a multimodal folder (Gemma 3's Gemma3ForConditionalGeneration holds it under
    text_config; its tensors under language_model.), else the config itself."""
    inner = config.get("text_config")
    if config.get("model_type") == "gemma3" and isinstance(inner, dict):
        return {"model_type": "gemma3_text", **{k: v for k, v in config.items() if k in ("eos_token_id",
                                                                                             "bos_token_id")},
                **inner}
    return config


@dataclass(frozen=True)
class FamilyMath:
    """The numbers of a family's math that its config sets (ModelSpec holds them)."""

    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None
    final_softcap: float | None = None
    layer_windows: tuple[int | None, ...] = ()  # per layer; () when every layer has the model's sliding_window
    sliding_window: int | None = None
    local_rope: RopeSpec | None = None  # the rope of sliding layers, where it differs
    rotary_dim: int | None = None  # None: the whole head
    embed_scale: float | None = None


def family_math(family: Family, config: dict, source: str, n_layers: int, head_dim: int) -> FamilyMath:
    """The FamilyMath of a config of this family: its window per layer, scale, caps and rope variants."""
    window = count(config, "sliding_window", source) if config.get("sliding_window") else None
    if family.windows == "qwen" and not config.get("use_sliding_window", False):
        window = None
    layer_windows = _layer_windows(family, config, source, n_layers, window)
    scale = None
    if family.query_pre_attn_scalar and config.get("query_pre_attn_scalar") is not None:
        scale = real(config["query_pre_attn_scalar"], "query_pre_attn_scalar", source) ** -0.5
    caps = {}
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = config.get(key) if family.softcaps else None
        caps[key] = None if value is None else real(value, key, source)
    rotary = None
    if family.partial_rotary:
        v5 = config.get("rope_parameters") or {}
        factor = v5.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
        factor = real(factor, "partial_rotary_factor", source)
        rotary = int(head_dim * factor)
        if rotary % 2 or rotary < 2:
            raise ConfigError(f"{source}: partial_rotary_factor {factor} turns {rotary} of the heads' {head_dim} "
                              f"dimensions, which must be an even number of 2 or more; {fix(source)}")
        rotary = None if rotary == head_dim else rotary
    local = _local_rope(config, source) if family.local_rope else None
    embed = math.sqrt(count(config, "hidden_size", source)) if family.embed_scale else None
    return FamilyMath(scale, caps["attn_logit_softcapping"], caps["final_logit_softcapping"], layer_windows,
                      window if not layer_windows else None, local, rotary, embed)


def _layer_windows(family: Family, config: dict, source: str, n_layers: int,
                   window: int | None) -> tuple[int | None, ...]:
    """Each layer's window where they differ: from layer_types (transformers 5 writes it), else the family's
    pattern; () where every layer has the same."""
    if family.windows not in ("alternate", "pattern") or window is None:
        return ()
    kinds = config.get("layer_types")
    if isinstance(kinds, list) and len(kinds) == n_layers:
        unknown = set(kinds) - {"sliding_attention", "full_attention"}
        if unknown:
            raise ConfigError(f"{source}: key 'layer_types' holds {sorted(unknown)}; each layer's type must be "
                              f"'sliding_attention' or 'full_attention'; {fix(source)}")
        sliding = [k == "sliding_attention" for k in kinds]
    elif family.windows == "alternate":
        sliding = [i % 2 == 0 for i in range(n_layers)]
    else:
        pattern = count(config, "sliding_window_pattern", source,
                        default=config.get("_sliding_window_pattern") or 6)
        sliding = [(i + 1) % pattern != 0 for i in range(n_layers)]
    return tuple(window if s else None for s in sliding)


def _local_rope(config: dict, source: str) -> RopeSpec:
    """Gemma 3's sliding layers' rope: rope_parameters.sliding_attention (transformers 5), else
    rope_local_base_freq with no scaling."""
    if "sliding_attention" in (config.get("rope_parameters") or {}):
        return rope_from_config(config, source, kind="sliding_attention")
    base = real(config.get("rope_local_base_freq", 10000.0), "rope_theta", source, "rope_local_base_freq")
    return RopeSpec(theta=base)

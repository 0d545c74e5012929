"""Numbers read from a model's config.json (a GGUF file's metadata is made into one first): whole numbers within
the caps below, and the floats the model's math uses, finite and in range. Each error names the key, what was
expected and what was found, and says to fix the file."""

from __future__ import annotations

import math

from offload.errors import ConfigError


def fix(source: str) -> str:
    """What to do about a bad value: a config.json is fixed by hand; a GGUF file's metadata (read as a config.json's
    keys) is not, so the file is fetched or converted again."""
    if str(source).lower().endswith(".gguf"):
        return "the GGUF file's metadata holds it: download the file again or convert it again from the model's source"
    return "fix config.json (or restore it from the model's source)"


# The largest sizes offload plans for. The planner walks every layer and expert (10,000 layers plan in seconds on
# one core), and no released model comes near: Llama 3.1 405B has 126 layers 16,384 wide with 128 heads of 128 and
# an MLP 53,248 wide; Gemma 3 a vocabulary of 262,144; Kimi K2 384 experts (23,040 over its layers); Llama 4 Scout a
# context of 10M tokens.
CAPS = {
    "num_hidden_layers": 10_000,
    "hidden_size": 65_536,
    "num_attention_heads": 1_024,
    "num_key_value_heads": 1_024,
    "head_dim": 65_536,
    "intermediate_size": 1_048_576,
    "moe_intermediate_size": 1_048_576,
    "shared_expert_intermediate_size": 1_048_576,
    "vocab_size": 4_194_304,
    "max_position_embeddings": 16_777_216,
    "original_max_position_embeddings": 16_777_216,
    "sliding_window": 16_777_216,
    "num_local_experts": 1_024,
    "num_experts": 1_024,
    "num_experts_per_tok": 1_024,
    "decoder_sparse_step": 10_000,
}
MAX_EXPERTS_OVER_LAYERS = 65_536  # experts units times their experts: the planner sizes each expert's tensors

# The floats the math uses: (lowest, highest, whether the lowest itself is allowed)
RANGES = {
    "rms_norm_eps": (0.0, 1.0, False),  # added to the mean square before its root: 0 divides by zero
    "rope_theta": (1.0, 1e12, False),  # the base of the rotary frequencies: at 1 or less they no longer fall
    "factor": (1.0, 1e6, True),  # rope scaling stretches positions; transformers refuses a factor below 1 too
    "low_freq_factor": (0.0, 1e6, False),
    "high_freq_factor": (0.0, 1e6, False),
    "query_pre_attn_scalar": (0.0, 1e9, False),  # Gemma's attention scale is its inverse square root
    "attn_logit_softcapping": (0.0, 1e6, False),  # cap * tanh(x / cap): 0 divides by zero
    "final_logit_softcapping": (0.0, 1e6, False),
    "partial_rotary_factor": (0.0, 1.0, False),  # the share of each head rope turns
    "swiglu_alpha": (0.0, 1e3, False),  # gpt-oss's gate: gate * sigmoid(alpha * gate)
    "swiglu_limit": (0.0, 1e6, False),  # and its clamp of gate and up
}


def require(config: dict, key: str, source: str):
    if key not in config or config[key] is None:
        raise ConfigError(f"{source}: required key {key!r} is missing; a Llama-family config.json must set it")
    return config[key]


def count(config: dict, key: str, source: str, default: int | None = None, least: int = 1) -> int:
    """A whole number from least to its cap (CAPS) from config; required unless a default is given."""
    value = require(config, key, source) if default is None else config.get(key)
    value = default if value is None else value  # a 0 is refused below, not taken for the default
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(f"{source}: key {key!r} must be a whole number of {least} or more, found {value!r}; {fix(source)}")
    return capped(value, key, source)


def capped(value: int, key: str, source: str) -> int:
    cap = CAPS.get(key)
    if cap is not None and value > cap:
        raise ConfigError(f"{source}: key {key!r} is {value:,}, above the {cap:,} offload plans for (no released "
                          f"model comes near it); {fix(source)}")
    return value


def real(value, key: str, source: str, name: str | None = None) -> float:
    """A float of the math, finite and within RANGES[key]; name: the key as the file spells it (a nested one)."""
    name = name or key
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{source}: key {name!r} must be a number, found {value!r}; {fix(source)}")
    low, high, low_ok = RANGES[key]
    if not math.isfinite(value) or not (low <= value <= high if low_ok else low < value <= high):
        bound = f"from {low:g} to {high:g}" if low_ok else f"greater than {low:g} and at most {high:g}"
        raise ConfigError(f"{source}: key {name!r} must be a finite number {bound}, found {value!r}; {fix(source)}")
    return float(value)


def layer_list(config: dict, key: str, source: str, n_layers: int) -> frozenset[int]:
    """A list of layer indices (mlp_only_layers), as a set."""
    value = config.get(key) or []
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise ConfigError(f"{source}: key {key!r} must be a list of layer numbers, found {value!r}; {fix(source)}")
    return frozenset(i for i in value if 0 <= i < n_layers)

"""Rotary embedding parameters as data (RopeSpec), read from a config's rope section in transformers' v4 layout
(rope_theta + rope_scaling) or v5's (rope_parameters, which may hold one section per attention kind: Gemma 3's
sliding layers turn at a base of their own)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from offload.config_values import count, fix, real
from offload.errors import ConfigError

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "longrope", "yarn")


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding parameters, normalised from the v4 and v5 config layouts. longrope (Phi-3's LongRoPE)
    divides each frequency by short_factor's entry, or long_factor's once a step reaches past
    original_max_position_embeddings, and scales cos and sin by attention_factor."""

    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True


def check_rope_sections(config: dict, source: str) -> None:
    """ConfigError unless the config's rope sections are objects (or absent): rope_scaling, rope_parameters and, in
    the v5 layout, its section per attention kind."""
    v5 = config.get("rope_parameters")
    named = {"rope_scaling": config.get("rope_scaling"), "rope_parameters": v5}
    if isinstance(v5, dict):
        named |= {f"rope_parameters.{k}": v for k, v in v5.items() if k in ("full_attention", "sliding_attention")}
    for key, value in named.items():
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"{source}: key {key!r} must be an object of rope settings such as {{\"rope_type\": "
                              f"\"default\", \"rope_theta\": 10000.0}}, found {str(value)[:80]!r}; {fix(source)}")


def rope_sections(config: dict) -> tuple[dict, dict, dict]:
    """(v5 parameters, v4 scaling, the two merged) of a config; a v5 layout with one section per attention kind
    gives its full-attention section (rope_for_kind reads the others)."""
    v5 = dict(config.get("rope_parameters") or {})
    if "full_attention" in v5:
        v5 = dict(v5["full_attention"] or {})
    scaling = dict(config.get("rope_scaling") or {})
    return v5, scaling, {**scaling, **v5}


def rope_from_config(config: dict, source: str, rotary_dim: int | None = None, kind: str | None = None) -> RopeSpec:
    """The RopeSpec of a config (of its layers of attention kind `kind` where the v5 layout has one section per
    kind). rotary_dim: the dimensions rope turns (LongRoPE's factors hold one per pair of them)."""
    v5, scaling, params = rope_sections(config)
    if kind is not None:
        v5 = dict((config.get("rope_parameters") or {}).get(kind) or {})
        params = {**scaling, **v5} if kind == "full_attention" else v5

    def named(key: str) -> str:  # the key as the file spells it
        return f"rope_parameters.{key}" if key in v5 else f"rope_scaling.{key}" if key in scaling else key

    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    if config.get("rope_theta") is not None:  # checked where the v5 layout's own theta wins over it too
        real(config["rope_theta"], "rope_theta", source)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{source}: rope scaling type {rope_type!r} is not supported; "
                          f"supported types are {', '.join(ROPE_TYPES)}")
    original = params.get("original_max_position_embeddings", config.get("original_max_position_embeddings")
                          if rope_type == "longrope" else None)
    if rope_type == "yarn" and original is None:
        original = config.get("max_position_embeddings")
    if rope_type in ("llama3", "longrope", "yarn") and original is None:
        raise ConfigError(f"{source}: {rope_type} rope scaling needs original_max_position_embeddings; add it to "
                          f"rope_scaling")
    if original is not None:
        count({"original_max_position_embeddings": original}, "original_max_position_embeddings", source)
    floats = {key: real(params.get(key, default), key, source, named(key))
              for key, default in (("factor", 1.0), ("low_freq_factor", 1.0), ("high_freq_factor", 4.0))}
    if rope_type == "llama3" and floats["high_freq_factor"] <= floats["low_freq_factor"]:
        raise ConfigError(f"{source}: key {named('high_freq_factor')!r} must be above {named('low_freq_factor')!r} "
                          f"(llama3 rope scaling blends the band between them), found {floats['high_freq_factor']} "
                          f"and {floats['low_freq_factor']}; {fix(source)}")
    extra = _longrope(config, params, source, original, rotary_dim, named) if rope_type == "longrope" else \
        _yarn(params, source, floats["factor"], named) if rope_type == "yarn" else {}
    return RopeSpec(theta=real(theta, "rope_theta", source, named("rope_theta")), type=rope_type,
                    original_max_position_embeddings=original, **floats, **extra)


def _longrope(config: dict, params: dict, source: str, original: int, rotary_dim: int | None, named) -> dict:
    """LongRoPE's per-frequency factors and its attention factor, as transformers computes them: the factor is
    max_position_embeddings over original_max_position_embeddings where the config has the latter at its top."""
    pairs = (rotary_dim or 0) // 2
    factors = {}
    for key in ("short_factor", "long_factor"):
        value = params.get(key)
        if not isinstance(value, list) or (pairs and len(value) != pairs) or not value:
            raise ConfigError(f"{source}: key {named(key)!r} must be a list of {pairs or 'the'} numbers (one per pair "
                              f"of rotated dimensions), found {value!r}; {fix(source)}")
        factors[key] = tuple(_positive(v, named(key), source) for v in value)
    factor = params.get("factor", 1.0)
    if config.get("original_max_position_embeddings"):
        factor = count(config, "max_position_embeddings", source, default=original) / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {**factors, "attention_factor": float(attention)}


def _yarn(params: dict, source: str, factor: float, named) -> dict:
    """YaRN's band and attention factor, as transformers computes them (mscale and mscale_all_dim as DeepSeek
    writes them)."""
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention, m, m_all = (params.get(k) for k in ("attention_factor", "mscale", "mscale_all_dim"))
    if attention is None:
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    bands = {k: _positive(params.get(k) or d, named(k), source) for k, d in (("beta_fast", 32.0), ("beta_slow", 1.0))}
    return {"attention_factor": _positive(attention, named("attention_factor"), source), **bands,
            "truncate": bool(params.get("truncate", True))}


def _positive(value, name: str, source: str) -> float:
    """A LongRoPE factor: finite and above 0 (below 1 shortens a wavelength)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{source}: key {name!r} must hold finite numbers above 0, found {value!r}; {fix(source)}")
    return float(value)

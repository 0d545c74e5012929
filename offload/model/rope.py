"""Rotary position embeddings: inverse frequencies by rope type (linear, dynamic NTK, Llama 3), cos/sin tables for
a step's positions, and their application to q and k."""

from __future__ import annotations

import functools
import math

import torch

from offload.spec import ModelSpec, RopeSpec


def rope_inv_freq(rope: RopeSpec, head_dim: int, seq_len: int, max_positions: int) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] for the rope type; dynamic NTK depends on seq_len."""
    return _shared_inv_freq(rope, head_dim, seq_len, max_positions).clone()


def _shared_inv_freq(rope: RopeSpec, head_dim: int, seq_len: int, max_positions: int) -> torch.Tensor:
    """rope_inv_freq's tensor, made once per model (and per length past max_positions for dynamic NTK):
    read only."""
    if rope.type != "dynamic" or seq_len <= max_positions:
        seq_len = 0  # the frequencies do not depend on it
    return _make_inv_freq(rope, head_dim, seq_len, max_positions)


@functools.lru_cache(maxsize=32)
def _make_inv_freq(rope: RopeSpec, head_dim: int, seq_len: int, max_positions: int) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    base = rope.theta
    if rope.type == "dynamic" and seq_len > max_positions:
        base = base * ((rope.factor * seq_len / max_positions) - (rope.factor - 1)) ** (head_dim / (head_dim - 2))
    inv_freq = 1.0 / (base ** exponents)
    if rope.type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.type == "llama3":
        inv_freq = _llama3_scale(inv_freq, rope)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeSpec) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths divided by factor, a smooth band between."""
    old_len = rope.original_max_position_embeddings
    low_wavelen, high_wavelen = old_len / rope.low_freq_factor, old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(spec: ModelSpec, positions: torch.Tensor, dtype: torch.dtype):
    """cos and signed sin [B, 1, S, head_dim] for positions [B, S]."""
    seq_len = int(positions.max()) + 1 if spec.rope.type == "dynamic" and positions.numel() else 1
    inv_freq = _shared_inv_freq(spec.rope, spec.head_dim, seq_len, spec.max_position_embeddings)
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)  # [B, S, Dh/2]
    sin = freqs.sin()
    cos = torch.cat((freqs.cos(),) * 2, dim=-1)[:, None]
    signed_sin = torch.cat((-sin, sin), dim=-1)[:, None]  # rotate_half's sign folded in
    return cos.to(dtype), signed_sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half(x) * sin = roll(x, Dh/2) * signed_sin."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin

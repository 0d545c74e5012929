"""Rotary position embeddings: inverse frequencies by rope type (linear, dynamic NTK, Llama 3, LongRoPE), cos/sin
tables for a step's positions, and their application to q and k (to the first rotary_dim dimensions of each head,
where a family turns only part of it).

A model whose sliding layers turn by a rope of their own (Gemma 3) has both tables side by side in a step's cos
and sin: [..., rotary_dim] of the model's rope, then [..., rotary_dim] of the sliding layers' (rope_table)."""

from __future__ import annotations

import functools
import math

import torch

from offload.rope_spec import RopeSpec
from offload.spec import ModelSpec


def rope_inv_freq(rope: RopeSpec, head_dim: int, seq_len: int, max_positions: int) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] for the rope type; dynamic NTK depends on seq_len."""
    return _shared_inv_freq(rope, head_dim, seq_len, max_positions).clone()


def _shared_inv_freq(rope: RopeSpec, head_dim: int, seq_len: int, max_positions: int) -> torch.Tensor:
    """rope_inv_freq's tensor, made once per model (and per length past max_positions for dynamic NTK, or past
    original_max_position_embeddings for LongRoPE): read only."""
    return _make_inv_freq(rope, head_dim, _freq_len(rope, seq_len, max_positions), max_positions)


def _freq_len(rope: RopeSpec, seq_len: int, max_positions: int) -> int:
    """What the frequencies depend on of seq_len: 0 (nothing), 1 (LongRoPE past its original length: the long
    factors), or seq_len itself (dynamic NTK past max_positions)."""
    if rope.type == "longrope":
        return int(seq_len > rope.original_max_position_embeddings)
    return seq_len if rope.type == "dynamic" and seq_len > max_positions else 0


@functools.lru_cache(maxsize=32)
def _make_inv_freq(rope: RopeSpec, head_dim: int, seq_len: int, max_positions: int) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    base = rope.theta
    if rope.type == "dynamic" and seq_len > max_positions:
        base = base * ((rope.factor * seq_len / max_positions) - (rope.factor - 1)) ** (head_dim / (head_dim - 2))
    inv_freq = 1.0 / (base ** exponents)
    if rope.type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.type == "yarn":
        inv_freq = _yarn_blend(inv_freq, rope, head_dim)
    elif rope.type == "longrope":  # LongRoPE: each frequency divided by its factor, long ones past the original
        inv_freq = inv_freq / torch.tensor(rope.long_factor if seq_len else rope.short_factor, dtype=torch.float32)
    elif rope.type == "llama3":
        inv_freq = _llama3_scale(inv_freq, rope)
    return inv_freq


def _yarn_blend(inv_freq: torch.Tensor, rope: RopeSpec, dim: int) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than beta_slow times over the original context are interpolated (divided
    by factor), more than beta_fast times kept, a linear ramp between (as transformers computes it)."""
    def correction(rotations: float) -> float:
        old = rope.original_max_position_embeddings
        return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction(rope.beta_fast), correction(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    kept = 1 - ramp
    return inv_freq / rope.factor * (1 - kept) + inv_freq * kept


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


def rope_cos_sin(spec: ModelSpec, positions: torch.Tensor, dtype: torch.dtype, last: int | None = None):
    """cos and signed sin [B, 1, S, rotary_dim] for positions [B, S] (twice as wide where the sliding layers turn
    by a rope of their own: rope_table picks a layer's); last: the largest position, where the caller knows it."""
    ropes = [spec.rope] + ([spec.variant.local_rope] if spec.variant.local_rope is not None else [])
    if last is None:
        last = int(positions.max()) if positions.numel() else 0
    tables = [_cos_sin(rope, spec.rotary_dim, positions, spec.max_position_embeddings, last) for rope in ropes]
    cos = torch.cat([c for c, _ in tables], dim=-1) if len(tables) > 1 else tables[0][0]
    sin = torch.cat([s for _, s in tables], dim=-1) if len(tables) > 1 else tables[0][1]
    return cos.to(dtype), sin.to(dtype)


def _cos_sin(rope: RopeSpec, dim: int, positions: torch.Tensor, max_positions: int, last: int):
    n = _freq_len(rope, last + 1, max_positions)
    if last < ROPE_ROWS and positions.device.type == "cpu" and (rope.type != "dynamic" or n == 0):
        cos, sin = _rope_rows(rope, dim, n, max_positions)  # a decode step's rows looked up, not computed
        rows = positions.reshape(-1)
        return tuple(t.index_select(0, rows).view(*positions.shape, dim)[:, None] for t in (cos, sin))
    return _cos_sin_of(rope, _make_inv_freq(rope, dim, n, max_positions), positions)


ROPE_ROWS = 4096  # the positions whose cos and sin rows are kept, per rope (4 MB for a rotary_dim of 128)


@functools.lru_cache(maxsize=8)
def _rope_rows(rope: RopeSpec, dim: int, freq_len: int, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin [ROPE_ROWS, dim] of positions 0 .. ROPE_ROWS - 1 (read only)."""
    cos, sin = _cos_sin_of(rope, _make_inv_freq(rope, dim, freq_len, max_positions), torch.arange(ROPE_ROWS)[None])
    return cos[0, 0], sin[0, 0]


def _cos_sin_of(rope: RopeSpec, inv_freq: torch.Tensor, positions: torch.Tensor):
    """cos and signed sin [B, 1, S, dim] of positions [B, S] turned by inv_freq."""
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)  # [B, S, dim/2]
    sin = freqs.sin()
    cos = torch.cat((freqs.cos(),) * 2, dim=-1)[:, None]
    signed_sin = torch.cat((-sin, sin), dim=-1)[:, None]  # rotate_half's sign folded in
    if rope.attention_factor != 1.0:  # LongRoPE scales both
        cos, signed_sin = cos * rope.attention_factor, signed_sin * rope.attention_factor
    return cos, signed_sin


def rope_table(spec: ModelSpec, table: torch.Tensor, window: int | None) -> torch.Tensor:
    """The part of a step's cos (or sin) that layers with this window turn by."""
    if spec.variant.local_rope is None:
        return table
    d = spec.rotary_dim
    return table[..., d:] if window is not None else table[..., :d]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half(x) * sin = roll(x, Dh/2) * signed_sin; where cos is
    narrower than x's heads (partial rotary), its first dimensions turn and the rest pass."""
    d = cos.shape[-1]
    if d != x.shape[-1]:
        turned = x[..., :d]
        return torch.cat((turned * cos + turned.roll(d // 2, dims=-1) * signed_sin, x[..., d:]), dim=-1)
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin

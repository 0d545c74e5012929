"""Llama-family block math (llama, mistral, qwen2, and the attention part of Mixtral / Qwen-MoE layers):
device-agnostic, weights passed in, gpt-fast style. The routed experts are offload.model.moe's."""

from __future__ import annotations

import functools
import math
import mmap
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from offload.model.attention import attend
from offload.spec import ModelSpec, RopeSpec

Weight = object  # a torch.Tensor [out, in], an offload.kernels.PackedWeight, a DeviceQuantWeight or a StackedWeight


@dataclass(frozen=True)
class StackedWeight:
    """Weights of different formats stacked along the output dimension, as one [sum(out), in] weight: a GGUF
    layer whose q, k and v (or gate and up) are stored in different types. Each part computes its own slice."""

    parts: tuple

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]


@dataclass
class LayerWeights:
    """One decoder layer; q/k/v and gate/up are fused along the output dimension. Of a MoE layer, the attention
    part: gate_up and down are its shared expert's (None: it has none) and shared_gate that expert's gate."""

    attn_norm: torch.Tensor
    qkv: Weight
    qkv_bias: torch.Tensor | None
    o: Weight
    o_bias: torch.Tensor | None
    mlp_norm: torch.Tensor
    gate_up: Weight
    gate_up_bias: torch.Tensor | None
    down: Weight
    down_bias: torch.Tensor | None
    q_norm: torch.Tensor | None = None  # [head_dim], Qwen3's per-head RMSNorm of q and k
    k_norm: torch.Tensor | None = None
    shared_gate: torch.Tensor | None = None  # [1, hidden], a MoE layer's shared-expert gate


@dataclass
class MLPWeights:
    """A dense layer's MLP as a unit of its own (its attention part hands it [residual | normed h])."""

    gate_up: Weight
    gate_up_bias: torch.Tensor | None
    down: Weight
    down_bias: torch.Tensor | None


@dataclass
class Step:
    """What one forward pass needs besides weights: where each new token sits and what it may see.

    A plain step is a grid of B sequences by S new tokens (padding marked invalid). A ragged step (groups set)
    holds the tokens of several grids back to back as one row of T tokens: a mixed step's decode tokens (one
    grid [b, 1]) and prompt chunks (a grid [1, c] each). The linears run once over all T tokens; attention runs
    per group. Its top-level tensors are the flat [1, T] ones; each group is a plain step of its own.
    """

    positions: torch.Tensor  # [B, S] long, position of each new token (pads: 0)
    write_index: torch.Tensor  # [B, S] long, KV slot to write within the row (bases added; pads: the trash slot)
    valid: torch.Tensor  # [B, S] bool, real tokens (not padding)
    n_keys: int  # keys the step's queries see: slots base .. base + n_keys - 1 of each row
    cos: torch.Tensor  # [B, 1, S, head_dim]
    sin: torch.Tensor  # [B, 1, S, head_dim], first half negated (see apply_rope)
    rows: torch.Tensor | None = None  # [B] cache rows these sequences use; None: all rows, in order
    phase: str = "prefill"  # prefill | decode: the plan may compute a block differently in each
    sliding_window: int | None = None
    bases: torch.Tensor | None = None  # [B] first KV slot of each sequence in its row (a pooled cache); None: 0
    groups: tuple["Step", ...] | None = None  # a ragged step's grids, each b == 1 or s == 1
    offsets: tuple[int, ...] = ()  # where each group's tokens begin in the flat row
    _mask: torch.Tensor | None = field(default=None, repr=False)
    _host: "Step | None" = field(default=None, repr=False)  # this step on the host (of a step moved to a device)
    _tables: dict = field(default_factory=dict, repr=False)  # its KV block tables by cache row length (attention)

    @property
    def n_seqs(self) -> int:
        """Sequences in this step (a ragged step's groups together)."""
        if self.groups is not None:
            return sum(g.n_seqs for g in self.groups)
        return self.positions.shape[0]

    @property
    def n_tokens(self) -> int:
        return self.positions.numel()

    @property
    def mask(self) -> torch.Tensor:
        """[B, 1, S, n_keys] bool, keys each query may attend to; made on first use (the fused CPU layer
        reads positions instead, so a decode step on the CPU never builds it)."""
        if self.groups is not None:
            raise ValueError("a ragged step has one mask per group: use step.groups[i].mask")
        if self._mask is None:
            self._mask = attention_mask(self.positions, self.valid, self.n_keys, self.sliding_window)
        return self._mask

    def slice(self, start: int, stop: int) -> "Step":
        """The part of this step for new tokens start..stop-1 of every row (one chunk of a long prefill); of a
        ragged step, flat tokens start..stop-1."""
        if self.groups is not None:
            return self._slice_ragged(start, stop)
        positions, valid = self.positions[:, start:stop], self.valid[:, start:stop]
        n_keys = int(torch.where(valid, positions, 0).max()) + 1 if positions.numel() else 1
        mask = None if self._mask is None else self._mask[:, :, start:stop, :n_keys]  # where the step's mask is
        host = None if self._host is None else self._host.slice(start, stop)
        return Step(positions, self.write_index[:, start:stop], valid, n_keys, self.cos[:, :, start:stop],
                    self.sin[:, :, start:stop], self.rows, self.phase, self.sliding_window, self.bases, _mask=mask,
                    _host=host)

    def _rows_slice(self, start: int, stop: int) -> "Step":
        """Rows start..stop-1 of a plain step."""
        positions, valid = self.positions[start:stop], self.valid[start:stop]
        n_keys = int(torch.where(valid, positions, 0).max()) + 1 if positions.numel() else 1
        rows = self.rows[start:stop] if self.rows is not None else torch.arange(start, stop,
                                                                                  device=self.write_index.device)
        bases = None if self.bases is None else self.bases[start:stop]
        mask = None if self._mask is None else self._mask[start:stop, :, :, :n_keys]
        host = None if self._host is None else self._host._rows_slice(start, stop)
        return Step(positions, self.write_index[start:stop], valid, n_keys, self.cos[start:stop],
                    self.sin[start:stop], rows, self.phase, self.sliding_window, bases, _mask=mask, _host=host)

    def _slice_ragged(self, start: int, stop: int) -> "Step":
        groups, offsets, at = [], [], 0
        for g, t0 in zip(self.groups, self.offsets):
            b, s = g.positions.shape
            a, z = max(start, t0) - t0, min(stop, t0 + b * s) - t0
            if z <= a:
                continue
            part = g if (a, z) == (0, b * s) else (g._rows_slice(a, z) if s == 1 else g.slice(a, z))
            groups.append(part)
            offsets.append(at)
            at += z - a
        return _ragged(groups, offsets, self.positions[:, start:stop], self.write_index[:, start:stop],
                       self.valid[:, start:stop], self.cos[:, :, start:stop], self.sin[:, :, start:stop], self.phase,
                       self.sliding_window)

    def to(self, device, move=None) -> "Step":
        """This step with its tensors on device (positions stay where they are), moved once for every layer; move
        (tensor -> tensor on device), where given, moves them (the executor's backend: from page-locked memory,
        without waiting for the device)."""
        move = move or (lambda t: t.to(device, non_blocking=True))
        if self.groups is not None:
            return _ragged([g.to(device, move) for g in self.groups], list(self.offsets), self.positions,
                           move(self.write_index), self.valid, move(self.cos), move(self.sin), self.phase,
                           self.sliding_window)
        rows = None if self.rows is None else move(self.rows)
        bases = None if self.bases is None else move(self.bases)
        return Step(self.positions, move(self.write_index), self.valid, self.n_keys, move(self.cos), move(self.sin),
                    rows, self.phase, self.sliding_window, bases, _mask=move(self.mask), _host=self)


def _ragged(groups, offsets, positions, write_index, valid, cos, sin, phase, sliding_window) -> Step:
    n_keys = max((g.n_keys for g in groups), default=1)
    return Step(positions, write_index, valid, n_keys, cos, sin, None, phase, sliding_window, None,
                tuple(groups), tuple(offsets))


class LayerKV:
    """KV cache of one layer, token-major: [B, T + 1, n_kv_heads, head_dim]; slot T takes writes of padding."""

    def __init__(self, batch: int, n_kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        shape = (batch, max_len + 1, n_kv_heads, head_dim)
        self.k, self.v = (_zeros(shape, dtype, device) for _ in range(2))

    def write(self, step: "Step", k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [b, H, S, Dh] at step.write_index in rows step.rows (None: every cache row, in order); the
        cache may live on another device than k, v (KV lives where a block decodes)."""
        dev, (batch, slots, heads, dh) = self.k.device, self.k.shape
        rows = torch.arange(k.shape[0], device=dev) if step.rows is None else step.rows.to(dev)
        flat = (rows[:, None] * slots + step.write_index.to(dev)).reshape(-1)
        for cache, new in ((self.k, k), (self.v, v)):
            new = new.transpose(1, 2).reshape(-1, heads, dh)
            cache.view(batch * slots, heads, dh).index_copy_(0, flat, _to(new, dev, cache.dtype))

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


LAZY_ZEROS_BYTES = 1 << 20  # host caches from this size on are zero pages until written (see _zeros)


def _zeros(shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """A zeroed cache tensor. On the host, a large one is an anonymous mapping: its pages are the kernel's zero
    page until a sequence writes them, so a pool sized for the plan's whole batch holds memory as it fills (a
    server's idle pool costs nothing), not all at once as torch.zeros's memset makes it."""
    n_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or n_bytes < LAZY_ZEROS_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    private = mmap.mmap(-1, n_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # reads map the zero page
    return torch.frombuffer(private, dtype=dtype).view(shape)  # the tensor keeps the mapping


def _to(t: torch.Tensor, device, dtype) -> torch.Tensor:
    return t if t.device == device and t.dtype == dtype else t.to(device, dtype)


HALF_KERNEL_ROWS = 2  # up to this many rows, offload's kernel beats torch's bf16 matmul on the CPU (~1.5x at 1)
HALF_ACTIVATIONS = (torch.float32, torch.bfloat16)  # what offload's CPU kernels take
HALF_WEIGHTS = {torch.bfloat16: "bf16", torch.float16: "fp16"}  # dense weights they take as a PackedWeight view


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ w.T + bias, for dense tensors or packed (quantized) weights. Half-precision weights on the
    CPU, for a row or two (a decode step), go through offload's kernel, which streams them faster than torch; bf16
    weights against bf16 activations at any rows too, where the CPU has AVX-512 BF16 (offload's tiles), and against
    activations of another dtype at any rows (a GGUF file's bf16 weights kept as stored)."""
    if isinstance(w, torch.Tensor):
        few_rows = x.numel() <= HALF_KERNEL_ROWS * x.shape[-1]
        if ((few_rows or _bf16_tiles(x, w) or x.dtype != w.dtype) and w.dtype in HALF_WEIGHTS
                and w.device.type == "cpu" and x.dtype in HALF_ACTIVATIONS and w.dim() == 2 and w.is_contiguous()):
            as_packed = _half_kernel()
            if as_packed is not None:  # its bias in fp32, as the kernel adds it
                return linear(x, as_packed(w), None if bias is None else bias.float())
        if w.dtype != x.dtype:  # a weight kept in its stored format (a GGUF file's bf16) under another compute dtype
            return F.linear(x, w.to(x.dtype), None if bias is None else bias.to(x.dtype))
        return F.linear(x, w, bias)
    if isinstance(w, StackedWeight):
        biases = bias.split([p.shape[0] for p in w.parts]) if bias is not None else [None] * len(w.parts)
        return torch.cat([linear(x, p, b).to(x.dtype) for p, b in zip(w.parts, biases)], dim=-1)
    if hasattr(w, "apply"):  # weights that compute on their own device (dequantized there)
        return w.apply(x, bias)
    from offload.kernels import linear as packed_linear

    out = packed_linear(x.reshape(-1, x.shape[-1]).contiguous(), w, bias)
    return out.view(*x.shape[:-1], out.shape[-1]).to(x.dtype)


def _bf16_tiles(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether offload's AVX-512 BF16 tiles take x @ w.T (bf16 both, whole 32-element blocks)."""
    return x.dtype is torch.bfloat16 and w.dtype is torch.bfloat16 and x.shape[-1] % 32 == 0 and _bf16_available()


@functools.lru_cache(maxsize=None)
def _bf16_available() -> bool:
    from offload.kernels import BF16_TILES

    return BF16_TILES


@functools.lru_cache(maxsize=None)
def _half_kernel():
    """A function making a dense half-precision weight a PackedWeight view for offload's C++ kernels (None
    without them)."""
    from offload.kernels import ACTIVE_PATH, PackedWeight

    if ACTIVE_PATH == "numba":  # no C++ extension: torch's matmul is the faster one
        return None
    return lambda w: PackedWeight(HALF_WEIGHTS[w.dtype], tuple(w.shape), w, None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32 as transformers does, returned in x's dtype."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


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


def attention_mask(positions: torch.Tensor, valid: torch.Tensor, n_keys: int,
                   sliding_window: int | None) -> torch.Tensor:
    """[B, 1, S, n_keys] bool: causal over each row's own cache; padding queries see key 0 only."""
    keys = torch.arange(n_keys, device=positions.device)[None, None, :]  # [1, 1, T]
    q = positions[:, :, None]  # [B, S, 1]
    mask = keys <= q
    if sliding_window is not None:
        mask &= (q - keys) < sliding_window
    mask &= valid[:, :, None]
    mask |= (~valid[:, :, None]) & (keys == 0)
    return mask[:, None]


def make_step(spec: ModelSpec, dtype: torch.dtype, positions: torch.Tensor, valid: torch.Tensor, trash_slot: int,
              rows: torch.Tensor | None = None, phase: str = "prefill", bases: torch.Tensor | None = None) -> Step:
    """Describe one forward pass: new tokens at positions [B, S]; valid [B, S] marks real tokens; bases [B]: the
    first KV slot of each sequence in its cache row (a pooled cache)."""
    n_keys = int(torch.where(valid, positions, 0).max()) + 1 if positions.numel() else 1  # no valid token: 1
    slots = positions if bases is None else positions + bases[:, None]
    write_index = torch.where(valid, slots, trash_slot)
    cos, sin = rope_cos_sin(spec, positions, dtype)
    return Step(positions=positions, write_index=write_index, valid=valid, n_keys=n_keys, cos=cos, sin=sin, rows=rows,
                phase=phase, sliding_window=spec.sliding_window, bases=bases)


def ragged_step(spec: ModelSpec, dtype: torch.dtype, groups: list[tuple[torch.Tensor, torch.Tensor]],
                trash_slot: int, phase: str) -> Step:
    """A ragged step over one pooled cache row: groups of (positions [b, s], bases [b]), each b == 1 or s == 1
    and every token real; the tokens of the groups follow one another in the flat row."""
    parts, offsets, at = [], [], 0
    for positions, bases in groups:
        b, s = positions.shape
        if b != 1 and s != 1:
            raise ValueError(f"a ragged step's groups are [b, 1] or [1, s] grids, found [{b}, {s}]")
        valid = torch.ones_like(positions, dtype=torch.bool)
        parts.append(make_step(spec, dtype, positions, valid, trash_slot, torch.zeros(b, dtype=torch.long), phase,
                               bases))
        offsets.append(at)
        at += b * s
    flat = lambda name: torch.cat([getattr(g, name).reshape(1, -1) for g in parts], dim=1)  # noqa: E731
    cos = torch.cat([g.cos.permute(1, 0, 2, 3).reshape(1, 1, -1, spec.head_dim) for g in parts], dim=2)
    sin = torch.cat([g.sin.permute(1, 0, 2, 3).reshape(1, 1, -1, spec.head_dim) for g in parts], dim=2)
    return _ragged(parts, offsets, flat("positions"), flat("write_index"), flat("valid"), cos, sin, phase,
                   spec.sliding_window)


def qk_norm(spec: ModelSpec, w: LayerWeights, qkv: torch.Tensor) -> torch.Tensor:
    """qkv [..., q | k | v] with each head of q and k RMS-normed (Qwen3), v as it was."""
    q, k, v = qkv.split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
    q = rms_norm(q.unflatten(-1, (spec.n_heads, spec.head_dim)), w.q_norm, spec.rms_norm_eps).flatten(-2)
    k = rms_norm(k.unflatten(-1, (spec.n_kv_heads, spec.head_dim)), w.k_norm, spec.rms_norm_eps).flatten(-2)
    return torch.cat([q, k, v], dim=-1)


def mlp(width: int, w: LayerWeights | MLPWeights, h: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(h)) * up(h)) with gate and up (each width rows) fused in w.gate_up."""
    gate, up = linear(h, w.gate_up, w.gate_up_bias).split(width, dim=-1)
    return linear(F.silu(gate) * up, w.down, w.down_bias)


def layer_forward(spec: ModelSpec, w: LayerWeights, x: torch.Tensor, step: Step, kv: LayerKV,
                  attention=None, moe: bool = False) -> torch.Tensor:
    """One decoder layer on hidden states x [B, S, D]; appends this step's K, V to kv. attention, if given,
    replaces rope, the KV append and attention: qkv [B * S, q | k | v] -> [B * S, n_heads * head_dim] (the
    executor passes the fused layer's attention for CPU layers whose linears run through torch).

    moe: a layer whose MLP is a unit of its own (a MoE layer's routed experts, offload.model.moe, or a dense MLP
    split off); it returns [B, S, 2D]: the residual stream (with a MoE layer's shared expert's output added) and
    the normed hidden state that unit takes."""
    b, s, _ = x.shape
    h = rms_norm(x, w.attn_norm, spec.rms_norm_eps)
    qkv = linear(h, w.qkv, w.qkv_bias)
    if w.q_norm is not None:
        qkv = qk_norm(spec, w, qkv)
    if attention is not None:
        o = attention(qkv.reshape(b * s, -1).contiguous()).view(b, s, spec.q_size)
    else:
        q, k, v = qkv.split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
        q = q.view(b, s, spec.n_heads, spec.head_dim).transpose(1, 2)  # [B, H, S, Dh]
        k = k.view(b, s, spec.n_kv_heads, spec.head_dim).transpose(1, 2)
        v = v.view(b, s, spec.n_kv_heads, spec.head_dim).transpose(1, 2)
        q, k = apply_rope(q, step.cos, step.sin), apply_rope(k, step.cos, step.sin)
        o = attend(spec, q, k, v, step, kv).transpose(1, 2).reshape(b, s, spec.q_size)
    x = x + linear(o, w.o, w.o_bias)
    h = rms_norm(x, w.mlp_norm, spec.rms_norm_eps)
    if not moe:
        return x + mlp(spec.intermediate_size, w, h)
    if w.gate_up is not None:  # the shared expert, scaled by its sigmoid gate
        x = x + torch.sigmoid(linear(h, w.shared_gate, None)) * mlp(spec.moe.shared_size, w, h)
    return torch.cat([x, h], dim=-1)


def mlp_forward(spec: ModelSpec, w: MLPWeights, x: torch.Tensor) -> torch.Tensor:
    """A split-off dense MLP: x [..., 2D] = [residual | normed h] -> residual + mlp(h)."""
    d = x.shape[-1] // 2
    return x[..., :d] + mlp(spec.intermediate_size, w, x[..., d:])

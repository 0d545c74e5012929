"""Fused CPU decoder layer: one C++ call (csrc/layer.cpp) instead of ~25 torch ops per layer and token.

Same math as offload.model.llama.layer_forward (the reference, which tests compare against) for CPU blocks
with packed linears and fp32 activations; the per-step token table is built once and reused by every layer.
"""

from __future__ import annotations

import torch

from offload.errors import KernelError
from offload.kernels import _C, ACTIVE_PATH, PackedWeight
from offload.kernels.dispatch import PATH_IDS

_F32 = torch.float32
_FUSABLE = _C is not None and hasattr(_C, "layer_forward")
_PATH_ID = PATH_IDS.get(ACTIVE_PATH, 0)


def _is_f32_cpu(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype is _F32 and t.device.type == "cpu" and t.is_contiguous()


def can_fuse(w, x: torch.Tensor, kv) -> bool:
    """Whether fused_layer_forward can run this layer: extension built, fp32 CPU activations and cache,
    packed (q8_0/q4_0/bf16/fp16) linears, fp32 norms and biases."""
    if not _FUSABLE or x.dtype is not _F32 or x.device.type != "cpu":
        return False
    if not (_is_f32_cpu(kv.k) and _is_f32_cpu(kv.v)):
        return False
    if not all(isinstance(m, PackedWeight) for m in (w.qkv, w.o, w.gate_up, w.down)):
        return False
    biases = (w.qkv_bias, w.o_bias, w.gate_up_bias, w.down_bias)
    return _is_f32_cpu(w.attn_norm) and _is_f32_cpu(w.mlp_norm) and all(b is None or _is_f32_cpu(b) for b in biases)


def fused_layer_forward(spec, w, x: torch.Tensor, step, kv) -> torch.Tensor:
    """layer_forward(spec, w, x, step, kv) in one C++ call: x [B, S, D] fp32 -> [B, S, D]; appends K, V to kv."""
    b, s, d = x.shape
    tokens, cos, sin = _token_table(spec, step, kv)
    if tokens.shape[0] != b * s:
        raise KernelError(f"fused layer: hidden states [{b}, {s}, {d}] do not match the step's positions "
                          f"{list(step.positions.shape)}; build the step for this batch")
    x = x.reshape(b * s, d).contiguous()
    out = torch.empty_like(x)
    _C.layer_forward(_fused_weights(spec, w), _PATH_ID, torch.get_num_threads(), b * s, x.data_ptr(),
                     out.data_ptr(), cos.data_ptr(), sin.data_ptr(), tokens.data_ptr(), kv.k.data_ptr(),
                     kv.v.data_ptr())
    return out.view(b, s, d)


def token_table(step, n_rows: int, n_slots: int, sliding_window: int | None) -> torch.Tensor:
    """[B * S, 4] int64 per new token: flat KV slot (-1: padding), flat slot of its row's key 0, first and
    last key it sees; the same keys as llama.attention_mask (padding tokens see key 0 only)."""
    positions, write_index = step.positions.cpu(), step.write_index.cpu()
    b, s = positions.shape
    rows = torch.arange(b) if step.rows is None else step.rows.cpu().long()
    valid = write_index != n_slots - 1  # padding writes to the trash slot T
    if rows.numel() != b or (b and (int(rows.min()) < 0 or int(rows.max()) >= n_rows)):
        raise KernelError(f"fused layer: step rows {rows.tolist()} do not fit a KV cache of {n_rows} rows for "
                          f"a batch of {b}; allocate the cache with more rows")
    if bool(((positions >= n_slots - 1) | (write_index >= n_slots) | (write_index < 0))[valid].any()):
        raise KernelError(f"fused layer: positions reach past the KV cache's {n_slots - 1} slots; "
                          f"allocate the cache with a larger max_len")
    base = (rows * n_slots)[:, None].expand(b, s)
    hi = torch.where(valid, positions, 0)
    lo = torch.zeros_like(hi) if sliding_window is None else (hi - sliding_window + 1).clamp_min(0)
    slot = torch.where(valid, base + write_index, -1)
    return torch.stack((slot, base, lo, hi), dim=-1).reshape(b * s, 4).contiguous()


def _token_table(spec, step, kv):
    """(token table, cos [N, Dh], sin [N, Dh]) of this step for this cache shape, made once per step."""
    key = (kv.k.shape[0], kv.k.shape[1], spec.sliding_window)
    cached = getattr(step, "_fused_table", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    dh = spec.head_dim
    table = (token_table(step, kv.k.shape[0], kv.k.shape[1], spec.sliding_window),
             step.cos.reshape(-1, dh).to("cpu", _F32).contiguous(), step.sin.reshape(-1, dh).to("cpu", _F32).contiguous())
    step._fused_table = (key, table)
    return table


def _fused_weights(spec, w):
    """The C++ view of w's weights (raw pointers), made once per layer; remade if a weight is replaced."""
    parts = (w.attn_norm, w.mlp_norm, w.qkv, w.qkv_bias, w.o, w.o_bias, w.gate_up, w.gate_up_bias, w.down, w.down_bias)
    cached = getattr(w, "_fused_weights", None)
    if cached is not None and all(a is b for a, b in zip(cached[0], parts)):
        return cached[1]
    linears = [_linear_tuple(m, bias, name) for m, bias, name in
               ((w.qkv, w.qkv_bias, "qkv"), (w.o, w.o_bias, "o"), (w.gate_up, w.gate_up_bias, "gate_up"),
                (w.down, w.down_bias, "down"))]
    for name, norm in (("attn_norm", w.attn_norm), ("mlp_norm", w.mlp_norm)):
        if tuple(norm.shape) != (spec.hidden_size,):
            raise KernelError(f"fused layer: {name} must be [{spec.hidden_size}], got {list(norm.shape)}")
    shape = (spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.intermediate_size, spec.rms_norm_eps)
    fused = _C.fused_weights(shape, w.attn_norm.data_ptr(), w.mlp_norm.data_ptr(), linears)
    w._fused_weights = (parts, fused)
    return fused


def _linear_tuple(m: PackedWeight, bias: torch.Tensor | None, name: str) -> tuple:
    rows, cols = m.shape
    if bias is not None and tuple(bias.shape) != (rows,):
        raise KernelError(f"fused layer: {name} bias must be [{rows}], got {list(bias.shape)}")
    return (m.fmt_id, m.qs_ptr, m.d_ptr, 0 if bias is None else bias.data_ptr(), rows, cols)

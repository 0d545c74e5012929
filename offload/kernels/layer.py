"""Fused CPU decoder layer: one C++ call (csrc/layer.cpp) instead of ~25 torch ops per layer and token.

Same math as offload.model.llama.layer_forward (the reference, which tests compare against) for CPU blocks
with packed linears and fp32 activations; the per-step token table is built once and reused by every layer.
"""

from __future__ import annotations

import operator

import torch

from offload.errors import KernelError
from offload.kernels import _C, ACTIVE_PATH, PackedWeight
from offload.kernels.dispatch import PATH_IDS

_F32 = torch.float32
_FUSABLE = _C is not None and hasattr(_C, "layer_forward")
_PATH_ID = PATH_IDS.get(ACTIVE_PATH, 0)


def _is_f32_cpu(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype is _F32 and t.device.type == "cpu" and t.is_contiguous()


_PARTS = operator.attrgetter("attn_norm", "mlp_norm", "qkv", "qkv_bias", "o", "o_bias", "gate_up", "gate_up_bias",
                             "down", "down_bias")


def can_fuse(w, x: torch.Tensor, kv) -> bool:
    """Whether fused_layer_forward can run this layer: extension built, fp32 CPU activations and cache,
    packed (q8_0/q4_0/bf16/fp16) linears, fp32 norms and biases.

    Runs for every layer of every step, so what depends on w or kv alone is checked once: a cache is
    checked once (while its tensors stay the same), and weights whose C++ view exists passed already."""
    if not _FUSABLE or x.dtype is not _F32 or not x.is_cpu or not _kv_fusable(kv):
        return False
    return _fused_view(w) is not None or _weights_fusable(w)


def _kv_fusable(kv) -> bool:
    cached = getattr(kv, "_fusable", None)
    if cached is None or cached[0] is not kv.k or cached[1] is not kv.v:
        cached = (kv.k, kv.v, _is_f32_cpu(kv.k) and _is_f32_cpu(kv.v))
        kv._fusable = cached
    return cached[2]


def _weights_fusable(w) -> bool:
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
    x = x.contiguous()
    out = torch.empty_like(x)
    _C.layer_forward(_fused_weights(spec, w), _PATH_ID, torch.get_num_threads(), b * s, x.data_ptr(),
                     out.data_ptr(), cos.data_ptr(), sin.data_ptr(), tokens.data_ptr(), kv.k.data_ptr(),
                     kv.v.data_ptr())
    return out


def token_table(step, n_rows: int, n_slots: int, sliding_window: int | None) -> torch.Tensor:
    """[B * S, 4] int64 per new token: flat KV slot (-1: padding), flat slot of its row's key 0, first and
    last key it sees; the same keys as llama.attention_mask (padding tokens see key 0 only).

    Built from Python lists: a decode step has a few tokens, where a dozen tiny tensor ops would cost more
    than the table is worth."""
    positions, write_index = step.positions.tolist(), step.write_index.tolist()
    b = len(positions)
    rows = list(range(b)) if step.rows is None else step.rows.tolist()
    if len(rows) != b or any(not 0 <= r < n_rows for r in rows):
        raise KernelError(f"fused layer: step rows {rows} do not fit a KV cache of {n_rows} rows for "
                          f"a batch of {b}; allocate the cache with more rows")
    table = []
    for row, row_positions, row_slots in zip(rows, positions, write_index):
        base = row * n_slots
        for pos, slot in zip(row_positions, row_slots):
            if slot == n_slots - 1:  # padding writes to the trash slot T
                table.append((-1, base, 0, 0))
                continue
            if pos >= n_slots - 1 or not 0 <= slot < n_slots:
                raise KernelError(f"fused layer: positions reach past the KV cache's {n_slots - 1} slots; "
                                  f"allocate the cache with a larger max_len")
            table.append((base + slot, base, 0 if sliding_window is None else max(pos - sliding_window + 1, 0), pos))
    return torch.tensor(table, dtype=torch.long).reshape(len(table), 4)


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
    fused = _fused_view(w)
    if fused is None:
        fused = _make_fused_weights(spec, w)
        w._fused_weights = (_PARTS(w), fused)
    return fused


def _fused_view(w):
    """w's C++ view if made already and none of w's weights has been replaced since, else None."""
    cached = getattr(w, "_fused_weights", None)
    if cached is None or not all(map(operator.is_, cached[0], _PARTS(w))):
        return None
    return cached[1]


def _make_fused_weights(spec, w):
    linears = [_linear_tuple(m, bias, name) for m, bias, name in
               ((w.qkv, w.qkv_bias, "qkv"), (w.o, w.o_bias, "o"), (w.gate_up, w.gate_up_bias, "gate_up"),
                (w.down, w.down_bias, "down"))]
    for name, norm in (("attn_norm", w.attn_norm), ("mlp_norm", w.mlp_norm)):
        if tuple(norm.shape) != (spec.hidden_size,):
            raise KernelError(f"fused layer: {name} must be [{spec.hidden_size}], got {list(norm.shape)}")
    shape = (spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.intermediate_size, spec.rms_norm_eps)
    return _C.fused_weights(shape, w.attn_norm.data_ptr(), w.mlp_norm.data_ptr(), linears)


def _linear_tuple(m: PackedWeight, bias: torch.Tensor | None, name: str) -> tuple:
    rows, cols = m.shape
    if bias is not None and tuple(bias.shape) != (rows,):
        raise KernelError(f"fused layer: {name} bias must be [{rows}], got {list(bias.shape)}")
    return (m.fmt_id, m.qs_ptr, m.d_ptr, 0 if bias is None else bias.data_ptr(), rows, cols)

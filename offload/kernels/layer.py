"""Fused CPU decoder layer: one C++ call (csrc/layer.cpp) instead of ~25 torch ops per layer and token.

Same math as offload.model.llama.layer_forward (the reference, which tests compare against) for CPU blocks
with packed linears and fp32 activations; the per-step token table is built once and reused by every layer.
"""

from __future__ import annotations

import operator
import time

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

    Runs for every layer of every step, so what depends on w or kv alone is not redone: a cache is checked
    once while its tensors stay the same, and weights whose C++ view exists have passed already."""
    if not _FUSABLE or x.dtype is not _F32 or not x.is_cpu or not _kv_view(kv)[0]:
        return False
    return _fused_view(w) is not None or _weights_fusable(w)


def _kv_view(kv) -> tuple[bool, int, int, int, int]:
    """(fusable, rows, slots, K pointer, V pointer) of a KV cache, kept on it while its tensors stay the same."""
    cached = getattr(kv, "_fused_view", None)
    if cached is None or cached[0] is not kv.k or cached[1] is not kv.v:
        k, v = kv.k, kv.v
        cached = (k, v, (_is_f32_cpu(k) and _is_f32_cpu(v), k.shape[0], k.shape[1], k.data_ptr(), v.data_ptr()))
        kv._fused_view = cached
    return cached[2]


def _weights_fusable(w) -> bool:
    if not all(isinstance(m, PackedWeight) for m in (w.qkv, w.o, w.gate_up, w.down)):
        return False
    biases = (w.qkv_bias, w.o_bias, w.gate_up_bias, w.down_bias)
    return _is_f32_cpu(w.attn_norm) and _is_f32_cpu(w.mlp_norm) and all(b is None or _is_f32_cpu(b) for b in biases)


def fused_layer_forward(spec, w, x: torch.Tensor, step, kv) -> torch.Tensor:
    """layer_forward(spec, w, x, step, kv) in one C++ call: x [B, S, D] fp32 -> [B, S, D]; appends K, V to kv."""
    return fused_layers_forward(spec, [w], x, step, [kv])


def fused_layers_forward(spec, ws: list, x: torch.Tensor, step, kvs: list, ends: list[float] | None = None):
    """fused_layer_forward over consecutive layers ws with caches kvs: x [B, S, D] fp32 -> [B, S, D].

    Everything per layer but the C++ call is done before the first one: the layers stream megabytes of weights
    through the CPU caches, so Python run between two of them runs cold and costs several times its usual time.
    Appends each layer's end time (time.perf_counter) to ends if given, for the timeline.
    """
    if len(ws) != len(kvs):
        raise KernelError(f"fused layers: {len(ws)} layers but {len(kvs)} KV caches; pass one cache per layer")
    if not ws:
        return x
    b, s, d = x.shape
    tokens, cos, sin = _token_table(spec, step, kvs[0])  # one table serves caches of one shape
    if tokens.shape[0] != b * s:
        raise KernelError(f"fused layer: hidden states [{b}, {s}, {d}] do not match the step's positions "
                          f"{list(step.positions.shape)}; build the step for this batch")
    caches = [_kv_view(kv) for kv in kvs]
    if any(c[1:3] != caches[0][1:3] for c in caches):
        raise KernelError(f"fused layers: KV caches of different shapes {[list(kv.k.shape) for kv in kvs]}; "
                          f"make every layer's cache with the same batch and max_len")
    layers = [(_fused_weights(spec, w), c[3], c[4]) for w, c in zip(ws, caches)]
    x = x.contiguous()
    outs = [torch.empty_like(x) for _ in range(min(len(layers), 2))]  # layer j writes outs[j % 2]
    out_ptrs = [t.data_ptr() for t in outs]
    n_tokens, n_threads, x_ptr = b * s, torch.get_num_threads(), x.data_ptr()
    table = (cos.data_ptr(), sin.data_ptr(), tokens.data_ptr())
    for j, (fused, k_ptr, v_ptr) in enumerate(layers):
        _C.layer_forward(fused, _PATH_ID, n_threads, n_tokens, x_ptr, out_ptrs[j % 2], *table, k_ptr, v_ptr)
        x_ptr = out_ptrs[j % 2]
        if ends is not None:
            ends.append(time.perf_counter())
    return outs[(len(layers) - 1) % 2]


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
    return torch.tensor(table, dtype=torch.long) if table else torch.empty(0, 4, dtype=torch.long)


def _token_table(spec, step, kv):
    """(token table, cos, sin) of this step for this cache shape, made once per step; cos and sin hold
    [N, Dh] fp32 rows (any shape)."""
    key = (kv.k.shape[0], kv.k.shape[1], spec.sliding_window)
    cached = getattr(step, "_fused_table", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    table = (token_table(step, kv.k.shape[0], kv.k.shape[1], spec.sliding_window),
             _rows_f32(step.cos, spec.head_dim), _rows_f32(step.sin, spec.head_dim))
    step._fused_table = (key, table)
    return table


def _rows_f32(t: torch.Tensor, dh: int) -> torch.Tensor:
    """t [B, 1, S, dh] as contiguous fp32 CPU memory of [B * S, dh] (t itself when it is already: every op
    between the layers' C++ calls runs with cold caches)."""
    return t if _is_f32_cpu(t) else t.reshape(-1, dh).to("cpu", _F32).contiguous()


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

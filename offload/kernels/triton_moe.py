"""Grouped expert matmuls for the GPU in Triton: a mixture-of-experts layer's routed experts in two launches.

The (token, slot) pairs a router picked are sorted by expert on the device (torch.sort and torch.searchsorted; no
count ever reaches the host) and cut into tiles of at most BN rows of one expert. Each projection is then one
launch over (tile, BM rows of the weight) programs, each reading its expert's weight rows through a table of
per-expert element offsets, so nothing waits for the host to learn which experts were picked:

- gate_up: act [P, F] = silu(h[token] @ gate.T) * (h[token] @ up.T), rows in sorted order (gate and up are the
  two halves of an expert's fused [2F, D] weight; both accumulate in fp32 and meet once in registers);
- down: y [P, D] = scale * (act @ down.T), each row stored at its pair's place (token * k + slot), scaled by its
  routing weight, so the caller's sum over the k slots of a token needs no scatter.

Weights: dense bf16/fp16/fp32 in the activations' dtype, and q8_0/q4_0 quants with fp16 scales (row or tiled
block order), dequantized in registers as offload.kernels.triton_dequant does, whose loaders this module reuses.
Not covered (group_weights returns None and the caller keeps its per-expert loop): GGUF block formats (q4_1 and
the K-quants), experts whose gate and up differ in format (a StackedWeight), mixed formats across experts, and
dense weights in another dtype than the activations. Under TRITON_INTERPRET=1 the kernels run on CPU tensors.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import torch

from offload.errors import KernelError
from offload.formats import QK, QUANT_QS_BYTES
from offload.kernels.triton_dequant import (_LAUNCH, GEMV_MAX_ROWS, QK_C, TRITON_AVAILABLE, _dequant_part, _jit,
                                            _load_weights, _load_x, tl, triton)

MOE_TILE_ROWS = (16, 64)  # rows of a tile for tl.dot: at least 16 (its smallest tile), at most 64 (gemm's BN)
OFFSET_TABLES = 64  # per-expert offset tables kept on the device (one per unit buffer or staging slot in use)


class GroupedWeights(NamedTuple):
    """One projection's experts as one grouped operand: expert e's planes start offsets[e] elements past expert
    0's (dense weights or quants in column 0, fp16 scales in column 1)."""

    kind: str  # "dense" or the quantized format (q8_0 / q4_0)
    shape: tuple[int, int]  # [M, K] of each expert
    tiled: bool
    w: torch.Tensor  # expert 0's dense weight or quants
    d: torch.Tensor | None  # expert 0's fp16 scales (quantized)
    offsets: torch.Tensor  # int64 [E, 2] on the weights' device


def group_weights(leaves: Sequence, x: torch.Tensor) -> GroupedWeights | None:
    """The experts' weights of one projection as a GroupedWeights, or None where the grouped kernels do not take
    them (see the module docstring): dense tensors in x's dtype, or q8_0/q4_0 weights with fp16 scales, all of one
    format, shape and block order, contiguous, on x's device."""
    first, dtype = leaves[0], x.dtype
    if isinstance(first, torch.Tensor):
        planes = [(w, None) for w in leaves if isinstance(w, torch.Tensor)]
        kind, tiled = "dense", False
        if first.dtype != dtype or any(w.dtype != dtype for w, _ in planes):
            return None
    else:
        kind, tiled = getattr(first, "fmt", None), bool(getattr(first, "tiled", False))
        if kind not in QUANT_QS_BYTES or getattr(first, "d", None) is None:
            return None
        planes = [(w.qs, w.d) for w in leaves if getattr(w, "fmt", None) == kind and w.d is not None
                  and bool(getattr(w, "tiled", False)) == tiled and tuple(w.shape) == tuple(first.shape)]
    w0, d0 = planes[0]
    if len(planes) != len(leaves) or w0.device != x.device or not all(_alike(w, w0) and (d is None or _alike(d, d0)) for w, d in planes):
        return None
    shape = tuple(first.shape)
    ptrs = tuple((w.data_ptr(), 0 if d is None else d.data_ptr()) for w, d in planes)
    sizes = (w0.element_size(), 1 if d0 is None else d0.element_size())
    return GroupedWeights(kind, shape, tiled, w0, d0, _offset_table(str(w0.device), ptrs, sizes))


def _alike(t: torch.Tensor, first: torch.Tensor) -> bool:
    return (t.shape == first.shape and t.dtype == first.dtype and t.device == first.device and t.is_contiguous()
            and (t.data_ptr() - first.data_ptr()) % t.element_size() == 0)


@functools.lru_cache(maxsize=OFFSET_TABLES)
def _offset_table(device: str, ptrs: tuple, sizes: tuple[int, int]) -> torch.Tensor:
    """int64 [E, 2]: each expert's planes' element offsets from expert 0's, on device. Keyed by the addresses
    themselves, so a resident unit or a staging slot builds it once; the copy up is from pinned memory and
    asynchronous (a plain copy from pageable memory would wait for the device)."""
    base = ptrs[0]
    table = torch.tensor([[(w - base[0]) // sizes[0], (d - base[1]) // sizes[1]] for w, d in ptrs], dtype=torch.int64)
    if device.startswith("cpu"):  # the interpreter's tensors
        return table
    return table.pin_memory().to(device, non_blocking=True)


class ExpertTiles(NamedTuple):
    """The picked (token, slot) pairs sorted by expert and cut into tiles of at most block_rows rows of one
    expert: tile j of expert e covers sorted rows bounds[e] + (j - first) * block_rows onwards, up to bounds[e + 1],
    first = tile_end[e] - ceil((bounds[e + 1] - bounds[e]) / block_rows) its first tile."""

    order: torch.Tensor  # int64 [P]: pair ids (token * k + slot) sorted by expert, stable
    bounds: torch.Tensor  # int64 [E + 1]: where each expert's sorted rows start; bounds[E] = P
    tile_end: torch.Tensor  # int64 [E]: tiles of the experts up to and including each
    expert: torch.Tensor  # int64 [n_tiles]: each tile's expert; E for the tiles past the ones used
    block_rows: int


def expert_tiles(ids: torch.Tensor, n_experts: int, block_rows: int) -> ExpertTiles:
    """ExpertTiles for expert ids [T, k], with device ops only. The tile count is the bound over every routing
    (each picked expert adds at most one partial tile); the programs of the tiles past the ones used return at
    once."""
    flat = ids.reshape(-1)
    p, dev = flat.numel(), flat.device
    sorted_ids, order = torch.sort(flat, stable=True)
    bounds = torch.searchsorted(sorted_ids, torch.arange(n_experts + 1, device=dev, dtype=sorted_ids.dtype))
    tile_end = ((bounds[1:] - bounds[:-1] + block_rows - 1) // block_rows).cumsum(0)
    n_tiles = (p + min(n_experts, p) * (block_rows - 1)) // block_rows
    expert = torch.searchsorted(tile_end, torch.arange(n_tiles, device=dev), right=True)
    return ExpertTiles(order, bounds, tile_end, expert, block_rows)


def tile_rows(n_tokens: int, top_k: int, n_experts: int) -> int:
    """BN for n_tokens routed top_k of n_experts: 1 (the CUDA-core product, as triton_dequant's gemv) where each
    expert gets one row, else the expected rows per picked expert, a power of 2 within MOE_TILE_ROWS."""
    if n_tokens <= GEMV_MAX_ROWS:
        return 1
    expected = -(-n_tokens * top_k // n_experts)
    return min(MOE_TILE_ROWS[1], max(MOE_TILE_ROWS[0], 1 << max(0, expected - 1).bit_length()))


@_jit
def _acc(acc, xt, w, DOT: tl.constexpr, IEEE: tl.constexpr):
    """acc [BN, BM] + xt [BN, C] @ w [BM, C].T: tl.dot with w rounded once to x's dtype, or products on the CUDA
    cores in fp32 (one row of x)."""
    if DOT:
        if IEEE:
            out = tl.dot(xt, tl.trans(w.to(xt.dtype)), acc, input_precision="ieee")
        else:
            out = tl.dot(xt, tl.trans(w.to(xt.dtype)), acc)
    else:
        out = acc + tl.sum(xt.to(tl.float32)[:, None, :] * w[None, :, :], axis=2)
    return out


@_jit
def _dense_step(x_ptr, w_ptr, n, N, stride_x, rows, M, K, k0, BK: tl.constexpr):
    """x [BN, BK] (rows n, zeros past N) and fp32 w [BM, BK] (rows of W, zeros past M) at columns k0.."""
    cols = k0 + tl.arange(0, BK)
    xt = tl.load(x_ptr + n[:, None] * stride_x + cols[None, :], mask=(n[:, None] < N) & (cols[None, :] < K),
                 other=0.0)
    w = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=(rows[:, None] < M) & (cols[None, :] < K), other=0.0)
    return xt, w.to(tl.float32)


@_jit
def _project(acc, x_ptr, w_ptr, d_ptr, n, N, stride_x, rows, M, K,
             KIND: tl.constexpr, TILED: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr, G: tl.constexpr):
    """acc + x[n] @ W[rows].T over all of K; KIND 0 dense (G columns a step), 1 q8_0, 2 q4_0 (G blocks a step)."""
    if KIND == 0:
        for k0 in range(0, K, G):
            xt, w = _dense_step(x_ptr, w_ptr, n, N, stride_x, rows, M, K, k0, G)
            acc = _acc(acc, xt, w, DOT, IEEE)
    else:
        QB: tl.constexpr = 16 if KIND == 2 else 32
        PARTS: tl.constexpr = 2 if KIND == 2 else 1
        nb = K // QK_C
        for kb in range(0, nb, G):
            q, s = _load_weights(w_ptr, d_ptr, rows, kb, nb, M, QB, G, TILED)  # [BM, G, QB], [BM, G]
            for p in tl.static_range(PARTS):
                xt = _load_x(x_ptr, n, N, stride_x, kb, nb, p, QB, G)  # [BN, G*QB]
                acc = _acc(acc, xt, _dequant_part(q, s, p, KIND == 2), DOT, IEEE)
    return acc


@_jit
def _grouped_kernel(x_ptr, w_ptr, d_ptr, offsets_ptr, order_ptr, bounds_ptr, tile_end_ptr, expert_ptr, scale_ptr,
                    y_ptr, N, M, K, top_k, n_experts, stride_x, stride_y,
                    GATED: tl.constexpr, KIND: tl.constexpr, TILED: tl.constexpr, DOT: tl.constexpr,
                    IEEE: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, G: tl.constexpr):
    """One tile of one expert's rows by BM output columns. GATED (gate_up): x rows are tokens (order // top_k), W
    is [2M, K], y[sorted row] = silu(gate) * up. Else (down): x rows are sorted rows, y[pair] = scale * out."""
    tile = tl.program_id(0)
    e = tl.load(expert_ptr + tile)
    if e >= n_experts:
        return
    lo = tl.load(bounds_ptr + e)
    hi = tl.load(bounds_ptr + e + 1)
    first = tl.load(tile_end_ptr + e) - (hi - lo + BN - 1) // BN  # the expert's first tile
    pos = lo + (tile - first) * BN + tl.arange(0, BN)  # [BN] sorted rows
    valid = pos < hi
    pair = tl.load(order_ptr + pos, mask=valid, other=0)  # [BN] token * top_k + slot
    cols = tl.program_id(1).to(tl.int64) * BM + tl.arange(0, BM)  # [BM] output columns
    w_e = w_ptr + tl.load(offsets_ptr + e * 2)
    d_e = d_ptr + tl.load(offsets_ptr + e * 2 + 1)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    if GATED:
        n = tl.where(valid, pair // top_k, N)  # [BN] token rows of x; N (masked) past the tile's
        up = _project(tl.zeros((BN, BM), dtype=tl.float32), x_ptr, w_e, d_e, n, N, stride_x, cols + M, 2 * M, K,
                      KIND, TILED, DOT, IEEE, G)
        gate = _project(acc, x_ptr, w_e, d_e, n, N, stride_x, cols, 2 * M, K, KIND, TILED, DOT, IEEE, G)
        out = gate / (1.0 + tl.exp(-gate)) * up
        dst = pos
    else:
        n = tl.where(valid, pos, N)
        out = _project(acc, x_ptr, w_e, d_e, n, N, stride_x, cols, M, K, KIND, TILED, DOT, IEEE, G)
        out = out * tl.load(scale_ptr + pair, mask=valid, other=0.0)[:, None]
        dst = pair
    mask = valid[:, None] & (cols[None, :] < M)
    tl.store(y_ptr + dst[:, None] * stride_y + cols[None, :], out.to(y_ptr.dtype.element_ty), mask=mask)


def grouped_gate_up(h: torch.Tensor, t: ExpertTiles, w: GroupedWeights, top_k: int) -> torch.Tensor:
    """act [P, F] in h's dtype, rows in t.order's order: silu(h[token] @ gate_e.T) * (h[token] @ up_e.T), for
    h [T, D] and each expert's fused gate|up [2F, D]."""
    f = w.shape[0] // 2
    act = torch.empty((t.order.numel(), f), dtype=h.dtype, device=h.device)
    _launch(h, w, t, act, f, top_k, None, gated=True)
    return act


def grouped_down(act: torch.Tensor, t: ExpertTiles, w: GroupedWeights, scale: torch.Tensor) -> torch.Tensor:
    """y [P, D] in act's dtype, row pair = scale[pair] * (act[sorted row of pair] @ down_e.T), for each expert's down
    [D, F] and the routing weights scale [P] fp32 by pair."""
    y = torch.empty((act.shape[0], w.shape[0]), dtype=act.dtype, device=act.device)
    _launch(act, w, t, y, w.shape[0], 1, scale, gated=False)
    return y


def _launch(x: torch.Tensor, w: GroupedWeights, t: ExpertTiles, y: torch.Tensor, m: int, top_k: int,
            scale: torch.Tensor | None, gated: bool) -> None:
    """One launch of the grouped kernel over (tiles, m / BM) programs."""
    k = w.shape[1]
    _check(x, w, k)
    if x.shape[0] == 0 or t.order.numel() == 0:
        return
    cfg = _config(w.kind, t.block_rows, x.dtype)
    kind = 0 if w.kind == "dense" else 1 + (w.kind == "q4_0")
    _grouped_kernel[(t.expert.numel(), triton.cdiv(m, cfg["BM"]))](
        x, w.w, w.w if w.d is None else w.d, w.offsets, t.order, t.bounds, t.tile_end, t.expert,
        y if scale is None else scale, y, x.shape[0], m, k, top_k, t.bounds.numel() - 1, x.stride(0), y.stride(0),
        GATED=gated, KIND=kind, TILED=w.tiled, **cfg)


def _config(kind: str, bn: int, dtype: torch.dtype) -> dict:
    """Tile sizes: one row of x against 16 rows of W and up to 256 values of K (the gemv shape), or BN rows against
    64 rows of W and 64 values of K per tl.dot (the gemm shape); G in values (dense) or blocks (quantized)."""
    dot = bn > 1
    width = 64 if dot else 256
    g = width if kind == "dense" else width // QUANT_QS_BYTES[kind]
    return {"DOT": dot, "IEEE": dtype == torch.float32, "BN": bn, "BM": 64 if dot else 16, "G": g, **_LAUNCH}


def _check(x: torch.Tensor, w: GroupedWeights, k: int) -> None:
    """Raise KernelError naming what the grouped kernels cannot take."""
    if not TRITON_AVAILABLE:
        raise KernelError("the grouped expert kernels need Triton; pip install triton, or compute the experts one "
                          "by one (offload.model.moe)")
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1 or x.device != w.w.device:
        raise KernelError(f"grouped experts take activations [rows, {k}] with unit column stride on {w.w.device}, "
                          f"got {list(x.shape)} strides {list(x.stride())} on {x.device}")
    if w.kind != "dense" and k % QK:
        raise KernelError(f"grouped {w.kind} experts need K divisible by {QK}, got {list(w.shape)}")

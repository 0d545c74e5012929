"""Fused dequant-matmul kernels for the GPU in Triton: y = x @ W.T (+ bias) over q8_0/q4_0 weights (GGUF's
q4_1 and K-quants: offload.kernels.triton_gguf, which shares this module's tile choices and store).

Each kernel reads the quantized bytes and the fp16 scales of W once, dequantizes them in registers (scales
converted there, no bf16 copy of W is ever made) and accumulates in fp32. Two kernels:

- gemv: a few rows of x (decode, N <= GEMV_MAX_ROWS): products summed on the CUDA cores, no tensor-core padding.
- gemm: tiles of x rows (prefill, large batch): tl.dot on dequantized tiles.

Both read row (GGUF) and tiled block order (offload.kernels.packed: rows in tiles of 4, block pairs of the 4
rows side by side, odd last block after the pairs, rows past the last whole tile in row order). The module
imports without Triton (TRITON_AVAILABLE is then False); offload.runtime.device_quant falls back to torch ops.
Under TRITON_INTERPRET=1 the kernels run on CPU tensors, which is how the tests check them without a GPU.
"""

from __future__ import annotations

import torch

from offload.errors import KernelError
from offload.formats import QK, QUANT_QS_BYTES

try:
    import triton
    import triton.language as tl

    TRITON_AVAILABLE = True
except ImportError:  # the torch fallback in offload.runtime.device_quant takes over
    triton = tl = None
    TRITON_AVAILABLE = False

# Up to this many rows of x the gemv kernel runs, beyond it the gemm kernel: gemv does N multiply-adds per
# weight on the CUDA cores, tl.dot pads x to 16 rows on the tensor cores. Measured on an H200
# (scripts/bench_triton_dequant.py, Llama-3.1-8B's o and gate_up in q4_0 and q8_0): gemv's time grows with every
# row (gate_up q4_0: 114 us at 1 row, 1131 us at 8) while gemm's stays flat up to 16 rows (86 us); at 1 row gemv
# is 1.4x faster on o and 1.3x slower on gate_up, from 2 rows on gemm is faster on the sum of both.
GEMV_MAX_ROWS = 1
# gemv holds BN x BM x (blocks x bytes) products in registers: 8192 fp32 values is 64 per thread at 4 warps.
GEMV_PRODUCTS = 8192
_X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# launch options: 4 warps (Triton's default); fused multiply-adds (faster, and one rounding instead of two;
# said explicitly because Triton 3.9 warns that its default turns to off in 3.10)
_LAUNCH = {"num_warps": 4, "enable_fp_fusion": True}
QK_C = tl.constexpr(QK) if TRITON_AVAILABLE else QK  # QK as a global a Triton kernel may read


def _jit(fn):
    """triton.jit where Triton is installed; the plain function (never launched) where it is not."""
    return triton.jit(fn) if TRITON_AVAILABLE else fn


@_jit
def _block_index(m, b, nb, m4, TILED: tl.constexpr):
    """Index (in blocks) of block b of row m in the quants/scales planes; m int64 [BM, 1], b [1, G]."""
    if TILED:
        r = m % 4
        pair_pos = (m - r) * nb + ((b // 2) * 4 + r) * 2 + b % 2  # a tile is [pairs, 4 rows, 2 blocks]
        odd_pos = (m - r) * nb + (nb // 2) * 8 + r  # then [4 rows, odd last block]
        in_tile = tl.where(b < (nb // 2) * 2, pair_pos, odd_pos)
        return tl.where(m < m4, in_tile, m * nb + b)
    return m * nb + b


@_jit
def _load_weights(qs_ptr, d_ptr, rows, kb, nb, M, QB: tl.constexpr, G: tl.constexpr, TILED: tl.constexpr):
    """Quant bytes [BM, G, QB] and fp32 scales [BM, G] of blocks kb..kb+G-1 of rows (int64 [BM])."""
    blk = kb + tl.arange(0, G)  # [G]
    mask = (rows[:, None] < M) & (blk[None, :] < nb)  # [BM, G]
    idx = _block_index(rows[:, None], blk[None, :], nb, M // 4 * 4, TILED)  # [BM, G]
    # QB bytes in a row from a multiple of QB: Triton sees that and loads 16 bytes per instruction
    q = tl.load(qs_ptr + idx[:, :, None] * QB + tl.arange(0, QB)[None, None, :], mask=mask[:, :, None], other=0)
    s = tl.load(d_ptr + idx, mask=mask, other=0.0).to(tl.float32)  # fp16 scales converted in registers
    return q, s


@_jit
def _dequant_part(q, s, P: tl.constexpr, Q4: tl.constexpr):
    """fp32 weights [BM, G*QB] of part P of the blocks q [BM, G, QB]: q4_0 part 0 is the low nibbles (elements
    0..15), part 1 the high; q8_0 has one part."""
    if Q4:
        v = ((q >> (4 * P)) & 15).to(tl.int32) - 8
    else:
        v = q.to(tl.int32)
    w = v.to(tl.float32) * s[:, :, None]
    return tl.reshape(w, (w.shape[0], w.shape[1] * w.shape[2]))


@_jit
def _load_x(x_ptr, n, N, stride_x, kb, nb, P: tl.constexpr, QB: tl.constexpr, G: tl.constexpr):
    """The columns of x [BN, G*QB] that meet part P of blocks kb..kb+G-1 (rows n [BN]), in x's dtype."""
    blk = kb + tl.arange(0, G)  # [G]
    cols = blk[:, None] * QK_C + P * QB + tl.arange(0, QB)[None, :]  # [G, QB]
    mask = (n[:, None, None] < N) & (blk[None, :, None] < nb)
    xt = tl.load(x_ptr + n[:, None, None] * stride_x + cols[None, :, :], mask=mask, other=0.0)  # [BN, G, QB]
    return tl.reshape(xt, (xt.shape[0], G * QB))


@_jit
def _gemv_kernel(x_ptr, qs_ptr, d_ptr, bias_ptr, y_ptr, N, M, nb, stride_x, stride_y,
                 Q4: tl.constexpr, TILED: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BN: tl.constexpr, BM: tl.constexpr, G: tl.constexpr):
    """y [N, M] = x [N, K] @ W.T + bias for N <= BN; one program per BM rows of W, products on CUDA cores."""
    QB: tl.constexpr = 16 if Q4 else 32
    PARTS: tl.constexpr = 2 if Q4 else 1
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)  # [BM] rows of W
    n = tl.arange(0, BN)  # [BN] rows of x
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for kb in range(0, nb, G):
        q, s = _load_weights(qs_ptr, d_ptr, rows, kb, nb, M, QB, G, TILED)  # [BM, G, QB], [BM, G]
        for p in tl.static_range(PARTS):
            xt = _load_x(x_ptr, n, N, stride_x, kb, nb, p, QB, G).to(tl.float32)  # [BN, G*QB]
            w = _dequant_part(q, s, p, Q4)  # [BM, G*QB]
            acc += tl.sum(xt[:, None, :] * w[None, :, :], axis=2)  # [BN, BM]
    _store(acc, bias_ptr, y_ptr, n, rows, N, M, stride_y, HAS_BIAS)


@_jit
def _gemm_kernel(x_ptr, qs_ptr, d_ptr, bias_ptr, y_ptr, N, M, nb, stride_x, stride_y,
                 Q4: tl.constexpr, TILED: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BN: tl.constexpr, BM: tl.constexpr, G: tl.constexpr, IEEE: tl.constexpr):
    """y [N, M] = x [N, K] @ W.T + bias; one program per BN x BM tile of y, tl.dot on dequantized W tiles."""
    QB: tl.constexpr = 16 if Q4 else 32
    PARTS: tl.constexpr = 2 if Q4 else 1
    n = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)  # [BN] rows of x
    rows = tl.program_id(1).to(tl.int64) * BM + tl.arange(0, BM)  # [BM] rows of W
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for kb in range(0, nb, G):
        q, s = _load_weights(qs_ptr, d_ptr, rows, kb, nb, M, QB, G, TILED)  # [BM, G, QB], [BM, G]
        for p in tl.static_range(PARTS):
            xt = _load_x(x_ptr, n, N, stride_x, kb, nb, p, QB, G)  # [BN, G*QB]
            w = _dequant_part(q, s, p, Q4).to(xt.dtype)  # rounded once to x's dtype, as a bf16 matmul would
            if IEEE:
                acc = tl.dot(xt, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(xt, tl.trans(w), acc)
    _store(acc, bias_ptr, y_ptr, n, rows, N, M, stride_y, HAS_BIAS)


@_jit
def _store(acc, bias_ptr, y_ptr, n, rows, N, M, stride_y, HAS_BIAS: tl.constexpr):
    """y[n, rows] = acc (+ bias[rows]) in y's dtype; acc fp32 [BN, BM]."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=rows < M, other=0.0).to(tl.float32)[None, :]
    mask = (n[:, None] < N) & (rows[None, :] < M)
    tl.store(y_ptr + n[:, None] * stride_y + rows[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


def linear(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, fmt: str, shape: tuple[int, int],
           tiled: bool = False, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W.T + bias in x's dtype; W [M, K] as q8_0/q4_0 quants and fp16 scales on x's device."""
    m, k = shape
    _check(x, qs, d, fmt, (m, k), bias)
    x2 = x.reshape(-1, k)  # [N, K]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty((x2.shape[0], m), dtype=x.dtype, device=x.device)  # [N, M]
    if x2.shape[0]:
        (gemv if x2.shape[0] <= GEMV_MAX_ROWS else gemm)(x2, qs, d, fmt, tiled, bias, y)
    return y.reshape(*x.shape[:-1], m)


def gemv(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, fmt: str, tiled: bool,
         bias: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
    """y [N, M] = x [N, K] @ W.T + bias with the gemv kernel (N <= 16, x's rows unit-stride); returns y."""
    n, m, nb = x.shape[0], d.shape[0], d.shape[1]
    if n > 16:
        raise KernelError(f"gemv takes at most 16 rows of x, got {n}; use gemm")
    cfg = gemv_config(n, fmt)
    _gemv_kernel[(triton.cdiv(m, cfg["BM"]),)](
        x, qs, d, y if bias is None else bias, y, n, m, nb, x.stride(0), y.stride(0),
        Q4=fmt == "q4_0", TILED=bool(tiled), HAS_BIAS=bias is not None, **cfg)
    return y


def gemm(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, fmt: str, tiled: bool,
         bias: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
    """y [N, M] = x [N, K] @ W.T + bias with the tl.dot kernel (x's rows unit-stride); returns y."""
    n, m, nb = x.shape[0], d.shape[0], d.shape[1]
    cfg = gemm_config(n, fmt, x.dtype)
    _gemm_kernel[(triton.cdiv(n, cfg["BN"]), triton.cdiv(m, cfg["BM"]))](
        x, qs, d, y if bias is None else bias, y, n, m, nb, x.stride(0), y.stride(0),
        Q4=fmt == "q4_0", TILED=bool(tiled), HAS_BIAS=bias is not None, **cfg)
    return y


def gemv_config(n: int, fmt: str) -> dict:
    """Tile sizes of the gemv kernel for n rows of x: BN x 16 rows of W x G blocks, within GEMV_PRODUCTS."""
    qb, bn = QUANT_QS_BYTES[fmt], 1 << max(0, n - 1).bit_length()
    width = max(qb, min(256, GEMV_PRODUCTS // (bn * 16)))  # quant bytes per row of W per step, >= a block
    return {"BN": bn, "BM": 16, "G": width // qb, **_LAUNCH}


def gemm_config(n: int, fmt: str, dtype: torch.dtype) -> dict:
    """Tile sizes of the gemm kernel for n rows of x: BN x 64 rows of W x 64 values of K per tl.dot."""
    bn = min(64, max(16, 1 << max(0, n - 1).bit_length()))  # tl.dot takes tiles of at least 16
    return {"BN": bn, "BM": 64, "G": 64 // QUANT_QS_BYTES[fmt], "IEEE": dtype == torch.float32, **_LAUNCH}


def _check(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, fmt: str, shape: tuple[int, int],
           bias: torch.Tensor | None) -> None:
    """Raise KernelError naming what the kernels cannot take."""
    m, k = shape
    if not TRITON_AVAILABLE:
        raise KernelError("the fused dequant kernels need Triton; pip install triton, or use the torch fallback "
                          "(offload.runtime.device_quant)")
    if fmt not in QUANT_QS_BYTES or k % QK:
        raise KernelError(f"fused dequant takes q8_0/q4_0 weights with K divisible by {QK}, got {fmt} {list(shape)}")
    want_qs = ((m, k * QUANT_QS_BYTES[fmt] // QK), torch.int8 if fmt == "q8_0" else torch.uint8)
    for name, t, want in (("quants", qs, want_qs), ("scales", d, ((m, k // QK), torch.float16))):
        if (tuple(t.shape), t.dtype) != want or not t.is_contiguous() or t.device != x.device:
            raise KernelError(f"{fmt} weight {list(shape)}: {name} must be a contiguous {want[1]} tensor "
                              f"{list(want[0])} on {x.device}, got {t.dtype} {list(t.shape)} on {t.device}")
    check_x_and_bias(x, (m, k), bias)


def check_x_and_bias(x: torch.Tensor, shape: tuple[int, int], bias: torch.Tensor | None) -> None:
    """Raise KernelError unless x [..., K] and bias [M] suit a fused dequant product with a weight of shape."""
    m, k = shape
    if x.dtype not in _X_DTYPES or x.shape[-1] != k:
        raise KernelError(f"fused dequant needs fp32/bf16/fp16 activations [..., {k}], got {x.dtype} "
                          f"{list(x.shape)}")
    if bias is not None and (tuple(bias.shape) != (m,) or not bias.is_contiguous() or bias.device != x.device):
        raise KernelError(f"bias must be a contiguous tensor [{m}] on {x.device}, got {list(bias.shape)} on "
                          f"{bias.device}")

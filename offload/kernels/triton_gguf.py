"""Fused dequant-matmul Triton kernels over GGUF block bytes: y = x @ W.T (+ bias), W in q4_1, q2_k, q4_k, q5_k,
q6_k.

The weights stay as stored (formats.GGUF_BLOCKS: uint8 [M, K/per_block*block_bytes], blocks in row order, no
scale plane); each kernel reads the bytes of W once, dequantizes them in registers in gguf-py's arithmetic
(gguf.quants) and accumulates in fp32, as offload.kernels.triton_dequant does for q8_0/q4_0, whose gemv/gemm
split, tile sizes and store this module shares. A row of W is read as a run of sub-blocks, the units one
scale covers: q4_1 1 per block of 32, q4_k/q5_k 8 of 32 per block of 256, q2_k and q6_k 16 of 16. A step takes NS
consecutive sub-blocks (part of a super-block, or several q4_1 blocks) and the K columns of x they meet.

Each weight's quant bits are gathered by computed byte offsets (bytes with two nibbles are loaded twice, from
cache); not yet timed on a GPU. Under TRITON_INTERPRET=1 the kernels run on CPU tensors (the tests).
"""

from __future__ import annotations

import torch

from offload.errors import KernelError
from offload.formats import GGUF_BLOCKS, GGUF_TYPES
from offload.kernels.triton_dequant import (_LAUNCH, check_x_and_bias, GEMV_MAX_ROWS, GEMV_PRODUCTS, TRITON_AVAILABLE,
                                            _jit, _store, tl, triton)

# fmt: (kernel id, sub-blocks per block, weights per sub-block), for the types formats.GGUF_TYPES gives a kernel
LAYOUTS = {t.name: (t.triton[0], t.triton[1], t.block_weights // t.triton[1]) for t in GGUF_TYPES if t.triton}


@_jit
def _half(ptr, off, mask):
    """The fp16 at byte offsets off (even) of a uint8 buffer, as fp32; off and mask of one shape."""
    lo = tl.load(ptr + off, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + off + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@_jit
def _byte(ptr, off, mask):
    """The uint8 at byte offsets off, as int32."""
    return tl.load(ptr + off, mask=mask, other=0).to(tl.int32)


@_jit
def _k_scale_min(qs_ptr, base, s, mask):
    """Q4_K/Q5_K sub-block scale and min (6 bits each) of sub-blocks s [NS]; base [BM, NS] the blocks' offsets.

    Bytes 4..15 of a block (gguf.quants.Q4_K.get_scale_min): sub-block s < 4 has sc = a & 63, m = b & 63;
    s >= 4 has sc = (c & 15) | (a >> 6) << 4, m = (c >> 4) | (b >> 6) << 4; a, b, c the bytes 4, 8, 12 + s % 4.
    """
    j = (s % 4)[None, :]
    a = _byte(qs_ptr, base + 4 + j, mask)
    b = _byte(qs_ptr, base + 8 + j, mask)
    c = _byte(qs_ptr, base + 12 + j, mask)
    low = (s < 4)[None, :]
    sc = tl.where(low, a & 63, (c & 15) | ((a >> 6) << 4))
    mn = tl.where(low, b & 63, (c >> 4) | ((b >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@_jit
def _dequant(qs_ptr, rows, g0, n_sub, row_bytes, M,
             FMT: tl.constexpr, S: tl.constexpr, SUB: tl.constexpr, BB: tl.constexpr, NS: tl.constexpr):
    """fp32 weights [BM, NS*SUB] of sub-blocks g0..g0+NS-1 of rows (int64 [BM]); zeros past M or the row."""
    g = g0 + tl.arange(0, NS)  # [NS] sub-blocks along the row
    s = g % S  # [NS] sub-block within its block
    mask = (rows[:, None] < M) & (g[None, :] < n_sub)  # [BM, NS]
    base = rows[:, None] * row_bytes + (g // S)[None, :] * BB  # [BM, NS] byte offset of the block
    i = tl.arange(0, SUB)[None, None, :]  # [1, 1, SUB] weight within the sub-block
    at = base[:, :, None]
    m3 = mask[:, :, None]
    if FMT == 0:  # q4_1 {d, m, qs[16]}: byte 4 + i % 16, low nibbles first; d * q + m
        q = (_byte(qs_ptr, at + 4 + i % 16, m3) >> ((i // 16) * 4)) & 15
        w = q.to(tl.float32) * _half(qs_ptr, base, mask)[:, :, None] + _half(qs_ptr, base + 2, mask)[:, :, None]
    elif FMT == 3:  # q6_k {ql[128], qh[64], scales[16], d}: two halves of 128 weights; (d * scale) * (q - 32)
        e = (s[:, None] * SUB + tl.arange(0, SUB)[None, :])[None, :, :]  # [1, NS, SUB] weight within the block
        h, r = e // 128, e % 128
        low = (_byte(qs_ptr, at + h * 64 + r % 64, m3) >> ((r // 64) * 4)) & 15
        high = (_byte(qs_ptr, at + 128 + h * 32 + r % 32, m3) >> ((r // 32) * 2)) & 3
        sc = tl.load(qs_ptr + base + 192 + s[None, :], mask=mask, other=0).to(tl.int8, bitcast=True)
        scale = _half(qs_ptr, base + 208, mask) * sc.to(tl.float32)
        w = scale[:, :, None] * ((low | (high << 4)) - 32).to(tl.float32)
    elif FMT == 4:  # q2_k {scales[16], qs[64], d, dmin}: two halves of 128 weights, 2 bits each; sub-block s's
        # byte s holds its scale (low nibble) and min (high); (d * sc) * q - dmin * m, as gguf.quants.Q2_K
        e = (s[:, None] * SUB + tl.arange(0, SUB)[None, :])[None, :, :]  # [1, NS, SUB] weight within the block
        h, r = e // 128, e % 128
        q = (_byte(qs_ptr, at + 16 + h * 32 + r % 32, m3) >> ((r // 32) * 2)) & 3
        sc = _byte(qs_ptr, base + s[None, :], mask)
        scale = _half(qs_ptr, base + 80, mask) * (sc & 15).to(tl.float32)
        offset = _half(qs_ptr, base + 82, mask) * (sc >> 4).to(tl.float32)
        w = scale[:, :, None] * q.to(tl.float32) - offset[:, :, None]
    else:  # q4_k {d, dmin, scales[12], qs[128]}, q5_k adds qh[32] before qs; (d * sc) * q - dmin * m
        QS0: tl.constexpr = 16 if FMT == 1 else 48
        sc, mn = _k_scale_min(qs_ptr, base, s, mask)
        shift = ((s % 2) * 4)[None, :, None]
        q = (_byte(qs_ptr, at + QS0 + (s // 2)[None, :, None] * 32 + i, m3) >> shift) & 15
        if FMT == 2:
            q = q | (((_byte(qs_ptr, at + 16 + i, m3) >> s[None, :, None]) & 1) << 4)
        scale = _half(qs_ptr, base, mask) * sc
        offset = _half(qs_ptr, base + 2, mask) * mn
        w = scale[:, :, None] * q.to(tl.float32) - offset[:, :, None]
    return tl.reshape(w, (w.shape[0], NS * SUB))


@_jit
def _load_x(x_ptr, n, N, stride_x, c0, K, C: tl.constexpr):
    """Columns c0..c0+C-1 of x [BN, C] (rows n [BN]), zeros past N or K, in x's dtype."""
    cols = c0 + tl.arange(0, C)
    mask = (n[:, None] < N) & (cols[None, :] < K)
    return tl.load(x_ptr + n[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)


@_jit
def _gemv_kernel(x_ptr, qs_ptr, bias_ptr, y_ptr, N, M, n_sub, row_bytes, stride_x, stride_y,
                 FMT: tl.constexpr, S: tl.constexpr, SUB: tl.constexpr, BB: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BN: tl.constexpr, BM: tl.constexpr, NS: tl.constexpr):
    """y [N, M] = x [N, K] @ W.T + bias for N <= BN; one program per BM rows of W, products on CUDA cores."""
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)  # [BM] rows of W
    n = tl.arange(0, BN)  # [BN] rows of x
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for g0 in range(0, n_sub, NS):
        w = _dequant(qs_ptr, rows, g0, n_sub, row_bytes, M, FMT, S, SUB, BB, NS)  # [BM, NS*SUB]
        xt = _load_x(x_ptr, n, N, stride_x, g0 * SUB, n_sub * SUB, NS * SUB).to(tl.float32)  # [BN, NS*SUB]
        acc += tl.sum(xt[:, None, :] * w[None, :, :], axis=2)  # [BN, BM]
    _store(acc, bias_ptr, y_ptr, n, rows, N, M, stride_y, HAS_BIAS)


@_jit
def _gemm_kernel(x_ptr, qs_ptr, bias_ptr, y_ptr, N, M, n_sub, row_bytes, stride_x, stride_y,
                 FMT: tl.constexpr, S: tl.constexpr, SUB: tl.constexpr, BB: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BN: tl.constexpr, BM: tl.constexpr, NS: tl.constexpr, IEEE: tl.constexpr):
    """y [N, M] = x [N, K] @ W.T + bias; one program per BN x BM tile of y, tl.dot on dequantized W tiles."""
    n = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)  # [BN] rows of x
    rows = tl.program_id(1).to(tl.int64) * BM + tl.arange(0, BM)  # [BM] rows of W
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for g0 in range(0, n_sub, NS):
        xt = _load_x(x_ptr, n, N, stride_x, g0 * SUB, n_sub * SUB, NS * SUB)  # [BN, NS*SUB]
        w = _dequant(qs_ptr, rows, g0, n_sub, row_bytes, M, FMT, S, SUB, BB, NS).to(xt.dtype)  # rounded once
        if IEEE:
            acc = tl.dot(xt, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(xt, tl.trans(w), acc)
    _store(acc, bias_ptr, y_ptr, n, rows, N, M, stride_y, HAS_BIAS)


def linear(x: torch.Tensor, qs: torch.Tensor, fmt: str, shape: tuple[int, int],
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W.T + bias in x's dtype; W [M, K] as GGUF block bytes uint8 [M, row_bytes] on x's device."""
    m, k = shape
    _check(x, qs, fmt, (m, k), bias)
    x2 = x.reshape(-1, k)  # [N, K]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty((x2.shape[0], m), dtype=x.dtype, device=x.device)  # [N, M]
    if x2.shape[0]:
        (gemv if x2.shape[0] <= GEMV_MAX_ROWS else gemm)(x2, qs, fmt, bias, y)
    return y.reshape(*x.shape[:-1], m)


def gemv(x: torch.Tensor, qs: torch.Tensor, fmt: str, bias: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
    """y [N, M] = x [N, K] @ W.T + bias with the gemv kernel (N <= 16, x's rows unit-stride); returns y."""
    n, (m, row_bytes) = x.shape[0], qs.shape
    if n > 16:
        raise KernelError(f"gemv takes at most 16 rows of x, got {n}; use gemm")
    cfg = gemv_config(n, fmt)
    _gemv_kernel[(triton.cdiv(m, cfg["BM"]),)](
        x, qs, y if bias is None else bias, y, n, m, _n_sub(fmt, row_bytes), row_bytes, x.stride(0), y.stride(0),
        **_layout(fmt), HAS_BIAS=bias is not None, **cfg)
    return y


def gemm(x: torch.Tensor, qs: torch.Tensor, fmt: str, bias: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
    """y [N, M] = x [N, K] @ W.T + bias with the tl.dot kernel (x's rows unit-stride); returns y."""
    n, (m, row_bytes) = x.shape[0], qs.shape
    cfg = gemm_config(n, fmt, x.dtype)
    _gemm_kernel[(triton.cdiv(n, cfg["BN"]), triton.cdiv(m, cfg["BM"]))](
        x, qs, y if bias is None else bias, y, n, m, _n_sub(fmt, row_bytes), row_bytes, x.stride(0), y.stride(0),
        **_layout(fmt), HAS_BIAS=bias is not None, **cfg)
    return y


def gemv_config(n: int, fmt: str) -> dict:
    """Tile sizes of the gemv kernel for n rows of x: BN x 16 rows of W x NS sub-blocks, within GEMV_PRODUCTS
    (up to 512 weights of a row per step, as the q4_0 kernel's widest step)."""
    sub, bn = LAYOUTS[fmt][2], 1 << max(0, n - 1).bit_length()
    width = max(sub, min(512, GEMV_PRODUCTS // (bn * 16)))  # weights of a row of W per step, >= a sub-block
    return {"BN": bn, "BM": 16, "NS": width // sub, **_LAUNCH}


def gemm_config(n: int, fmt: str, dtype: torch.dtype) -> dict:
    """Tile sizes of the gemm kernel for n rows of x: BN x 64 rows of W x 64 values of K per tl.dot."""
    bn = min(64, max(16, 1 << max(0, n - 1).bit_length()))  # tl.dot takes tiles of at least 16
    return {"BN": bn, "BM": 64, "NS": 64 // LAYOUTS[fmt][2], "IEEE": dtype == torch.float32, **_LAUNCH}


def _layout(fmt: str) -> dict:
    """The kernels' format constants: FMT id, S sub-blocks per block, SUB weights per sub-block, BB block bytes."""
    kernel_id, subs, sub = LAYOUTS[fmt]
    return {"FMT": kernel_id, "S": subs, "SUB": sub, "BB": GGUF_BLOCKS[fmt][1]}


def _n_sub(fmt: str, row_bytes: int) -> int:
    """Sub-blocks in a row of row_bytes bytes."""
    return row_bytes // GGUF_BLOCKS[fmt][1] * LAYOUTS[fmt][1]


def _check(x: torch.Tensor, qs: torch.Tensor, fmt: str, shape: tuple[int, int], bias: torch.Tensor | None) -> None:
    """Raise KernelError naming what the kernels cannot take."""
    m, k = shape
    if not TRITON_AVAILABLE:
        raise KernelError("the fused dequant kernels need Triton; pip install triton, or use the torch fallback "
                          "(offload.runtime.device_quant)")
    if fmt not in LAYOUTS or k % GGUF_BLOCKS[fmt][0]:
        raise KernelError(f"GGUF fused dequant takes {'/'.join(LAYOUTS)} weights with K divisible by the "
                          f"block size, got {fmt} {list(shape)}")
    want = (m, k // GGUF_BLOCKS[fmt][0] * GGUF_BLOCKS[fmt][1])
    if tuple(qs.shape) != want or qs.dtype != torch.uint8 or not qs.is_contiguous() or qs.device != x.device:
        raise KernelError(f"{fmt} weight {list(shape)}: block bytes must be a contiguous uint8 tensor {list(want)} "
                          f"on {x.device}, got {qs.dtype} {list(qs.shape)} on {qs.device}")
    check_x_and_bias(x, shape, bias)

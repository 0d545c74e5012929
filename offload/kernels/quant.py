"""GGUF block layouts and numpy references: q8_0 / q4_0 quantizers with ggml's exact rounding, and dequantizers.

GGUF stores a q8_0 row as blocks of 34 bytes (fp16 scale d, then 32 int8 quants) and a q4_0 row
as blocks of 18 bytes (fp16 d, then 16 bytes whose low nibbles are elements 0..15 and high nibbles
elements 16..31, each value (q - 8) * d). The kernels keep the same bytes in a split layout: all
quants of a row contiguous ([M, K] int8 or [M, K/2] uint8) and the scales apart ([M, K/32] fp16).
The formats of GGUF_BLOCKS (q4_1 and the K-quants, layouts in csrc/kquant.h) stay in GGUF's own block bytes.
"""

from __future__ import annotations

import numpy as np

from offload.formats import GGUF_BLOCKS, QK, QUANT_BLOCK_BYTES, QUANT_QS_BYTES

DEQUANT_CHUNK_BLOCKS = 4096  # GGUF blocks dequantized per step: temporaries stay in the L2 cache. Measured on
# 512 x 4096 matrices: 1.3x (q4_k, q5_k, q6_k) to 1.9x (q4_1) faster than gguf-py's dequantize, same bits


def split_gguf_blocks(raw: np.ndarray, fmt: str, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """GGUF block bytes of a [M, K] matrix -> (quants [M, K*qb/32] uint8, scales [M, K/32] float16)."""
    m, k = shape
    nb = k // QK
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(m * nb, QUANT_BLOCK_BYTES[fmt])
    d = np.ascontiguousarray(blocks[:, :2]).view(np.float16).reshape(m, nb)
    qs = np.ascontiguousarray(blocks[:, 2:]).reshape(m, nb * QUANT_QS_BYTES[fmt])
    return qs, d


def join_gguf_blocks(qs: np.ndarray, d: np.ndarray, fmt: str) -> np.ndarray:
    """Inverse of split_gguf_blocks: (quants, fp16 scales) -> GGUF block bytes [M, nb * block_bytes]."""
    m, nb = d.shape
    blocks = np.empty((m * nb, QUANT_BLOCK_BYTES[fmt]), dtype=np.uint8)
    blocks[:, :2] = np.ascontiguousarray(d, dtype=np.float16).view(np.uint8).reshape(m * nb, 2)
    blocks[:, 2:] = np.ascontiguousarray(qs).view(np.uint8).reshape(m * nb, QUANT_QS_BYTES[fmt])
    return blocks.reshape(m, nb * QUANT_BLOCK_BYTES[fmt])


def quantize_q8_0_np(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """fp32 [M, K] -> (int8 quants [M, K], fp16 scales [M, K/32]); rounding as ggml's quantize_row_q8_0_ref."""
    m, k = w.shape
    blocks = np.ascontiguousarray(w, dtype=np.float32).reshape(-1, QK)
    d = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    a = np.abs(blocks * inv)
    fl = np.floor(a)
    q = np.sign(blocks) * (fl + np.floor(2 * (a - fl)))  # half away from zero, exact (no a + 0.5 rounding)
    return q.astype(np.int8).reshape(m, k), d.astype(np.float16).reshape(m, k // QK)


def quantize_q4_0_np(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """fp32 [M, K] -> (nibbles [M, K/2] uint8, fp16 scales [M, K/32]); rounding as ggml's quantize_row_q4_0_ref."""
    m, k = w.shape
    blocks = np.ascontiguousarray(w, dtype=np.float32).reshape(-1, QK)
    imax = np.abs(blocks).argmax(axis=1)[:, None]
    d = np.take_along_axis(blocks, imax, axis=1) / np.float32(-8)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    q = np.minimum(np.trunc(blocks * inv + np.float32(8.5)), 15).astype(np.uint8)
    nibbles = q[:, : QK // 2] | (q[:, QK // 2:] << np.uint8(4))
    return nibbles.reshape(m, k // 2), d.astype(np.float16).reshape(m, k // QK)


def dequantize_np(qs: np.ndarray, d: np.ndarray, fmt: str) -> np.ndarray:
    """Split-layout quants and scales -> fp32 [M, K]."""
    m, nb = d.shape
    if fmt == "q8_0":
        q = qs.view(np.int8).reshape(m, nb, QK).astype(np.float32)
    else:
        b = qs.reshape(m, nb, QK // 2)
        q = np.concatenate([b & 15, b >> 4], axis=2).astype(np.float32) - 8
    return (q * d.astype(np.float32)[:, :, None]).reshape(m, nb * QK)


def dequantize_torch(qs, d, fmt: str):
    """dequantize_np with torch's threads, for whole matrices (an embedding): fp32 [M, K], the same values."""
    import torch

    m, nb = d.shape
    if fmt == "q8_0":
        q = qs.view(torch.int8).reshape(m, nb, QK).float()
    else:
        b = qs.view(torch.uint8).reshape(m, nb, QK // 2)
        q = torch.cat([b & 15, b >> 4], dim=2).float().sub_(8)
    return q.mul_(d.float()[:, :, None]).reshape(m, nb * QK)


def _nibbles(qs: np.ndarray, groups: int) -> np.ndarray:
    """uint8 [n, groups * 32] -> [n, 2 * groups, 32]: each 32 bytes' low nibbles, then their high nibbles."""
    q = qs.reshape(qs.shape[0], groups, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & np.uint8(15)).reshape(qs.shape[0], 2 * groups, 32)


def _fp16(b: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte `at` of each block [n, bytes], as fp32 [n, 1]."""
    return np.ascontiguousarray(b[:, at: at + 2]).view(np.float16).astype(np.float32)


def _k4_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 6-bit scales and minimums [n, 8] of q4_k / q5_k blocks (12 packed bytes at offset 4; csrc/kquant.h)."""
    w = np.ascontiguousarray(b[:, 4:16]).view(np.uint32)
    out = np.empty((b.shape[0], 4), dtype=np.uint32)
    out[:, 0] = w[:, 0] & 0x3F3F3F3F
    out[:, 1] = (w[:, 2] & 0x0F0F0F0F) | ((w[:, 0] >> 2) & 0x30303030)
    out[:, 2] = w[:, 1] & 0x3F3F3F3F
    out[:, 3] = ((w[:, 2] >> 4) & 0x0F0F0F0F) | ((w[:, 1] >> 2) & 0x30303030)
    sm = out.view(np.uint8).astype(np.float32)
    return sm[:, :8], sm[:, 8:]


def _q4_1(b: np.ndarray) -> np.ndarray:
    q = (b[:, None, 4:20] >> np.array([0, 4], dtype=np.uint8)[None, :, None]) & np.uint8(15)  # [n, 2, 16]
    return _fp16(b, 0) * q.reshape(-1, 32).astype(np.float32) + _fp16(b, 2)


def _q4_k(b: np.ndarray) -> np.ndarray:
    sc, m = _k4_scales(b)
    d, dm = (_fp16(b, 0) * sc)[:, :, None], (_fp16(b, 2) * m)[:, :, None]
    return (d * _nibbles(b[:, 16:], 4).astype(np.float32) - dm).reshape(-1, 256)


def _q5_k(b: np.ndarray) -> np.ndarray:
    sc, m = _k4_scales(b)
    d, dm = (_fp16(b, 0) * sc)[:, :, None], (_fp16(b, 2) * m)[:, :, None]
    high = (b[:, None, 16:48] >> np.arange(8, dtype=np.uint8)[None, :, None]) & np.uint8(1)  # [n, 8, 32]
    q = _nibbles(b[:, 48:], 4) | (high << np.uint8(4))
    return (d * q.astype(np.float32) - dm).reshape(-1, 256)


def _q6_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d = (_fp16(b, 208) * b[:, 192:208].view(np.int8).astype(np.float32))[:, :, None]  # [n, 16, 1]
    ql = b[:, :128].reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    ql = (ql & np.uint8(15)).reshape(n, 8, 32)
    qh = b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    qh = (qh & np.uint8(3)).reshape(n, 8, 32)
    q = ((ql | (qh << np.uint8(4))).view(np.int8) - np.int8(32)).reshape(n, 16, 16).astype(np.float32)
    return (d * q).reshape(n, 256)


_DEQUANT = {"q4_1": _q4_1, "q4_k": _q4_k, "q5_k": _q5_k, "q6_k": _q6_k}
_FP16_FIELDS = {"q4_1": (0, 2), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}  # byte offsets of d (and m / dmin)


def dequantize_gguf_np(raw: np.ndarray, fmt: str, shape: tuple[int, int]) -> np.ndarray:
    """GGUF block bytes of a [M, K] matrix in a GGUF_BLOCKS format -> fp32 [M, K], bit for bit as gguf-py's
    gguf.quants.dequantize (same fp32 operations in the same order), a chunk of blocks at a time."""
    per_block, block_bytes = GGUF_BLOCKS[fmt]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, block_bytes)
    out = np.empty((blocks.shape[0], per_block), dtype=np.float32)
    fn = _DEQUANT[fmt]
    for i in range(0, blocks.shape[0], DEQUANT_CHUNK_BLOCKS):
        out[i: i + DEQUANT_CHUNK_BLOCKS] = fn(blocks[i: i + DEQUANT_CHUNK_BLOCKS])
    return out.reshape(shape)


def random_gguf_blocks(fmt: str, m: int, k: int, seed: int = 0) -> np.ndarray:
    """Random GGUF bytes uint8 [m, K / per_block * block_bytes] of a GGUF_BLOCKS format, fp16 fields set to small
    positive values (random bytes there would make infinities and NaNs): weights to time kernels on."""
    per_block, block_bytes = GGUF_BLOCKS[fmt]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (m * (k // per_block), block_bytes), dtype=np.uint8)
    for at in _FP16_FIELDS[fmt]:
        blocks[:, at: at + 2] = rng.uniform(1e-4, 1e-2, (blocks.shape[0], 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(m, -1)

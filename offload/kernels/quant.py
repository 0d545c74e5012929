"""GGUF block layouts and numpy references: q8_0 / q4_0 quantizers with ggml's exact rounding, and dequantizers.

GGUF stores a q8_0 row as blocks of 34 bytes (fp16 scale d, then 32 int8 quants) and a q4_0 row
as blocks of 18 bytes (fp16 d, then 16 bytes whose low nibbles are elements 0..15 and high nibbles
elements 16..31, each value (q - 8) * d). The kernels keep the same bytes in a split layout: all
quants of a row contiguous ([M, K] int8 or [M, K/2] uint8) and the scales apart ([M, K/32] fp16).
The formats of GGUF_BLOCKS (q4_1, q5_0/q5_1, the K-quants, the IQ, ternary and fp4 types) stay in GGUF's own block
bytes; their numpy references live beside the table of formats (offload.formats.dequant_np).
"""

from __future__ import annotations

import numpy as np

from offload.formats import GGUF_TYPE, QK, QUANT_BLOCK_BYTES, QUANT_QS_BYTES

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


def dequantize_gguf_np(raw: np.ndarray, fmt: str, shape: tuple[int, int]) -> np.ndarray:
    """GGUF block bytes of a [M, K] matrix in a GGUF_BLOCKS format -> fp32 [M, K], bit for bit as gguf-py's
    gguf.quants.dequantize (same fp32 operations in the same order), a chunk of blocks at a time."""
    kind = GGUF_TYPE[fmt]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, kind.block_bytes)
    out = np.empty((blocks.shape[0], kind.block_weights), dtype=np.float32)
    for i in range(0, blocks.shape[0], DEQUANT_CHUNK_BLOCKS):
        out[i: i + DEQUANT_CHUNK_BLOCKS] = kind.dequantize_np(blocks[i: i + DEQUANT_CHUNK_BLOCKS])
    return out.reshape(shape)


def random_gguf_blocks(fmt: str, m: int, k: int, seed: int = 0) -> np.ndarray:
    """Random GGUF bytes uint8 [m, K / per_block * block_bytes] of a GGUF_BLOCKS format, scales set to small
    positive values (random bytes there would make infinities and NaNs): weights to time kernels on."""
    kind = GGUF_TYPE[fmt]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (m * (k // kind.block_weights), kind.block_bytes), dtype=np.uint8)
    put_scales(blocks, fmt, lambda n: rng.uniform(1e-4, 1e-2, n))
    return blocks.reshape(m, -1)


def put_scales(blocks: np.ndarray, fmt: str, draw) -> None:
    """Set the scale fields of blocks uint8 [n, block_bytes] of fmt in place, each to draw(n) (values [n], drawn
    afresh per field and per NVFP4 sub-block) as near as the field holds it: fp16 fields, IQ1_M's fp16 d (the top
    nibbles of its uint16 scales), MXFP4's e8m0 and NVFP4's ue4m3 bytes (the smallest code at or above |value|:
    the dequantizers' scale rises with the code, ue4m3's up to 0x7E)."""
    from offload.formats.dequant_np import fp4_tables

    n, at = blocks.shape[0], 0
    for _, n_bytes, kind in GGUF_TYPE[fmt].fields:
        if kind == "f16":
            blocks[:, at: at + 2] = np.asarray(draw(n), np.float16).view(np.uint8).reshape(n, 2)
        elif kind == "bits+f16":  # d's nibbles, lowest first, into bytes at + 1, + 3, + 5, + 7
            d = np.asarray(draw(n), np.float16).view(np.uint16)[:, None] >> np.array([0, 4, 8, 12], np.uint16)
            top = blocks[:, at + 1: at + 8: 2]
            blocks[:, at + 1: at + 8: 2] = (top & np.uint8(15)) | ((d & np.uint16(15)).astype(np.uint8) << 4)
        elif kind in ("e8m0", "ue4m3"):
            codes = fp4_tables()[kind][: 0x7F if kind == "ue4m3" else 256]
            for i in range(n_bytes):
                blocks[:, at + i] = np.clip(np.searchsorted(codes, np.abs(draw(n))), 1, len(codes) - 1)
        at += n_bytes

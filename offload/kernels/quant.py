"""GGUF block layouts (q8_0, q4_0) and numpy reference quantizers with ggml's exact rounding.

GGUF stores a q8_0 row as blocks of 34 bytes (fp16 scale d, then 32 int8 quants) and a q4_0 row
as blocks of 18 bytes (fp16 d, then 16 bytes whose low nibbles are elements 0..15 and high nibbles
elements 16..31, each value (q - 8) * d). The kernels keep the same bytes in a split layout: all
quants of a row contiguous ([M, K] int8 or [M, K/2] uint8) and the scales apart ([M, K/32] fp16).
"""

from __future__ import annotations

import numpy as np

from offload.formats import QK, QUANT_BLOCK_BYTES, QUANT_QS_BYTES



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

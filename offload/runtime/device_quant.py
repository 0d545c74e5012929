"""Quantized weights on the compute device: q8_0/q4_0 planes, or GGUF block bytes (q4_1, q4_k, q5_k, q6_k),
multiplied there without a dequantized copy.

Streamed blocks cross PCIe in this form (a quarter to an eighth of fp32's bytes). On a CUDA device the fused
Triton kernels (offload.kernels.triton_dequant) read the planes directly; elsewhere, or without Triton, the
torch fallback below dequantizes into x's dtype for the call and multiplies. The fallback runs on the CPU
under the CPU backend, so CI checks it.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import NamedTuple

import torch
import torch.nn.functional as F

from offload.errors import KernelError
from offload.formats import GGUF_BLOCKS, QK
from offload.hardware import gpu_kernel

DEQUANT_CHUNK_ELEMENTS = 1 << 26  # dequantize big matrices (a 70B lm_head) in row slices of at most this many
# {fmt: rows}: from how many activation rows dequantize + cuBLAS beat the fused kernel on this process's GPU, as
# the hardware profile an LLM was planned with measured it (HardwareProfile.gpu_crossover); empty: fused always
_CROSSOVER: dict[str, int] = {}


def set_gpu_crossover(table: dict[str, int]) -> None:
    """Make `table` ({fmt: rows}) the measured crossovers DeviceQuantWeight.apply picks its kernel by."""
    _CROSSOVER.clear()
    _CROSSOVER.update(table)


def dequantize(qs: torch.Tensor, d: torch.Tensor, fmt: str, dtype: torch.dtype, tiled: bool = False) -> torch.Tensor:
    """Split-layout quants and fp16 scales [M, K/32] (row or tiled block order) -> weights [M, K] in dtype."""
    if tiled:
        from offload.kernels.packed import untile_blocks

        qs, d = untile_blocks(qs, d, fmt)
    m, nb = d.shape
    if fmt == "q8_0":
        q = qs.view(torch.int8).reshape(m, nb, QK).to(dtype)
    elif fmt == "q4_0":
        b = qs.view(torch.uint8).reshape(m, nb, QK // 2)
        q = torch.cat((b & 15, b >> 4), dim=2).to(dtype) - 8  # low nibbles are elements 0..15
    else:
        raise ValueError(f"unknown quantized format {fmt!r}")
    return (q * d.to(dtype)[:, :, None]).reshape(m, nb * QK)


def dequantize_gguf(raw: torch.Tensor, fmt: str, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """GGUF block bytes uint8 [M, K/per_block*block_bytes] -> weights [M, K] in dtype, on raw's device.

    Computed in fp32 in gguf-py's order of operations (gguf.quants), so the fp32 result is bit for bit
    gguf-py's; other dtypes are that result rounded once.
    """
    m, k = shape
    per_block, block_bytes = GGUF_BLOCKS[fmt]
    if k % per_block or tuple(raw.shape) != (m, k // per_block * block_bytes):
        raise KernelError(f"{fmt} weight {list(shape)} needs block bytes [{m}, {k // per_block * block_bytes}] "
                          f"(K a multiple of {per_block}), got {list(raw.shape)}")
    blocks = raw.view(torch.uint8).reshape(m, k // per_block, block_bytes)
    return _GGUF_DEQUANT[fmt](blocks).reshape(m, k).to(dtype)


def _half(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 field at byte `at` of each block [M, nb, bytes], as fp32 [M, nb, 1]."""
    return blocks[..., at: at + 2].contiguous().view(torch.float16).float()


def _unpack(b: torch.Tensor, groups: int, bits: int) -> torch.Tensor:
    """Bit fields of bytes [M, nb, groups * n] -> uint8 [M, nb, groups * (8 // bits) * n]: within each group
    of n bytes, the n lowest fields first, then the next bits up (ggml's order for nibbles and high bits)."""
    m, nb, _ = b.shape
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=b.device)[:, None]  # [8 / bits, 1]
    fields = (b.reshape(m, nb, groups, 1, -1) >> shifts) & ((1 << bits) - 1)  # [M, nb, groups, 8 / bits, n]
    return fields.reshape(m, nb, -1)


def _k_scales(blocks: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: the 8 sub-block scales d*sc and offsets dmin*m, fp32 [M, nb, 8, 1], from 12 bytes of 6-bit
    fields (gguf.quants.Q4_K.get_scale_min): bytes 0-3 and 4-7 hold sc and m of sub-blocks 0-3 in their low 6
    bits, bytes 8-11 the low 4 bits of sub-blocks 4-7, whose top 2 bits are the top bits of bytes 0-7."""
    m, nb, _ = blocks.shape
    s = blocks[..., 4:16].reshape(m, nb, 3, 4)
    lo, mins, hi = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = torch.cat((lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)), dim=-1).float()  # [M, nb, 8]
    mn = torch.cat((mins & 0x3F, (hi >> 4) | ((mins >> 2) & 0x30)), dim=-1).float()
    return (d * sc)[..., None], (dmin * mn)[..., None]


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """block_q4_1 {fp16 d, fp16 m, qs[16]} [M, nb, 20] -> fp32 [M, nb, 32]: d * q + m."""
    q = _unpack(blocks[..., 4:], 1, 4).float()
    return q.mul_(_half(blocks, 0)).add_(_half(blocks, 2))


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """block_q4_K {fp16 d, fp16 dmin, scales[12], qs[128]} [M, nb, 144] -> fp32 [M, nb, 256]: sub-block s of 32
    is (d*sc[s]) * q - dmin*m[s]."""
    m, nb, _ = blocks.shape
    scale, offset = _k_scales(blocks, _half(blocks, 0), _half(blocks, 2))
    q = _unpack(blocks[..., 16:], 4, 4).float().reshape(m, nb, 8, 32)
    return q.mul_(scale).sub_(offset).reshape(m, nb, 256)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    """block_q5_K {fp16 d, fp16 dmin, scales[12], qh[32], qs[128]} [M, nb, 176] -> fp32 [M, nb, 256]: as Q4_K,
    with bit s of qh[i] the fifth bit of element i of sub-block s."""
    m, nb, _ = blocks.shape
    scale, offset = _k_scales(blocks, _half(blocks, 0), _half(blocks, 2))
    q = _unpack(blocks[..., 48:], 4, 4) | (_unpack(blocks[..., 16:48], 1, 1) << 4)
    return q.float().reshape(m, nb, 8, 32).mul_(scale).sub_(offset).reshape(m, nb, 256)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """block_q6_K {ql[128], qh[64], int8 scales[16], fp16 d} [M, nb, 210] -> fp32 [M, nb, 256]: sub-block s of
    16 is (d*scales[s]) * (q - 32), q's low 4 bits from ql and top 2 from qh, each in two halves of 128."""
    m, nb, _ = blocks.shape
    scale = (_half(blocks, 208) * blocks[..., 192:208].view(torch.int8).float())[..., None]  # [M, nb, 16, 1]
    q = (_unpack(blocks[..., :128], 2, 4) | (_unpack(blocks[..., 128:192], 2, 2) << 4)).to(torch.int8) - 32
    return q.float().reshape(m, nb, 16, 16).mul_(scale).reshape(m, nb, 256)


_GGUF_DEQUANT = {"q4_1": _q4_1, "q4_k": _q4_k, "q5_k": _q5_k, "q6_k": _q6_k}


@dataclass
class DeviceQuantWeight:
    """A quantized matrix [M, K] living on the compute device; apply() dequantizes then multiplies.

    q8_0/q4_0: quants qs and fp16 scales d [M, K/32]. GGUF formats (formats.GGUF_BLOCKS): qs holds the block
    bytes uint8 [M, K/per_block*block_bytes] in row order and d is None.
    """

    fmt: str
    shape: tuple[int, int]
    qs: torch.Tensor
    d: torch.Tensor | None
    tiled: bool = False  # tiled block order (offload.kernels.packed); slices of whole 4-row tiles stay valid

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] @ W.T + bias in x's dtype: on a CUDA device the fused kernels, or dequantize + cuBLAS where
        the measured crossover says it is faster at x's rows (gpu_kernel); elsewhere the torch fallback."""
        rows = x.numel() // max(x.shape[-1], 1)
        if x.device.type == "cuda" and self.qs.device.type == "cuda" and \
                gpu_kernel(_CROSSOVER, self.fmt, rows) == "fused":
            fused = _fused_kernels()
            if fused is not None:
                if self.d is None:  # GGUF block bytes
                    return fused.gguf.linear(x, self.qs, self.fmt, self.shape, bias)
                return fused.quant.linear(x, self.qs, self.d, self.fmt, self.shape, self.tiled, bias)
        return self.apply_torch(x, bias)

    def apply_torch(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The torch fallback of apply(): W dequantized into x's dtype for this call only, in row slices."""
        bias = None if bias is None else bias.to(x.dtype)
        m, k = self.shape
        rows = max(4, DEQUANT_CHUNK_ELEMENTS // k // 4 * 4)  # whole tiles
        if rows >= m:
            return F.linear(x, self.dequantize_rows(0, m, x.dtype), bias)
        parts = [F.linear(x, self.dequantize_rows(r, min(r + rows, m), x.dtype),
                          None if bias is None else bias[r: r + rows]) for r in range(0, m, rows)]
        return torch.cat(parts, dim=-1)

    def dequantize_rows(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows start..stop-1 of W as [stop - start, K] in dtype (where tiled, start a multiple of 4)."""
        if self.d is None:
            return dequantize_gguf(self.qs[start:stop], self.fmt, (stop - start, self.shape[1]), dtype)
        return dequantize(self.qs[start:stop], self.d[start:stop], self.fmt, dtype, self.tiled)

    @property
    def nbytes(self) -> int:
        return self.qs.nbytes + (0 if self.d is None else self.d.nbytes)


class _FusedKernels(NamedTuple):
    quant: ModuleType  # offload.kernels.triton_dequant: q8_0/q4_0
    gguf: ModuleType  # offload.kernels.triton_gguf: GGUF block formats


@functools.cache
def _fused_kernels() -> _FusedKernels | None:
    """The Triton kernel modules where Triton is installed, else None (warned once)."""
    from offload.kernels import triton_dequant, triton_gguf

    if triton_dequant.TRITON_AVAILABLE:
        return _FusedKernels(triton_dequant, triton_gguf)
    warnings.warn("offload: Triton is not installed, so quantized GPU layers are dequantized with torch ops "
                  "(slower, a bf16 copy per call); pip install triton", stacklevel=3)
    return None

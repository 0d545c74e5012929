"""Quantized weights on the compute device: q8_0/q4_0 planes multiplied there without a dequantized copy.

Streamed blocks cross PCIe in this form (a quarter to an eighth of fp32's bytes). On a CUDA device the fused
Triton kernels (offload.kernels.triton_dequant) read the planes directly; elsewhere, or without Triton, the
torch fallback below dequantizes into x's dtype for the call and multiplies. The fallback runs on the CPU
under the CPU backend, so CI checks it.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from offload.formats import QK
DEQUANT_CHUNK_ELEMENTS = 1 << 26  # dequantize big matrices (a 70B lm_head) in row slices of at most this many


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


@dataclass
class DeviceQuantWeight:
    """A q8_0/q4_0 matrix [M, K] whose planes live on the compute device; apply() dequantizes then multiplies."""

    fmt: str
    shape: tuple[int, int]
    qs: torch.Tensor
    d: torch.Tensor
    tiled: bool = False  # tiled block order (offload.kernels.packed); slices of whole 4-row tiles stay valid

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] @ W.T + bias in x's dtype: fused kernels on a CUDA device, else the torch fallback."""
        if x.device.type == "cuda" and self.qs.device.type == "cuda":
            fused = _fused_kernels()
            if fused is not None:
                return fused.linear(x, self.qs, self.d, self.fmt, self.shape, self.tiled, bias)
        return self.apply_torch(x, bias)

    def apply_torch(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The torch fallback of apply(): W dequantized into x's dtype for this call only, in row slices."""
        bias = None if bias is None else bias.to(x.dtype)
        m, k = self.shape
        rows = max(4, DEQUANT_CHUNK_ELEMENTS // k // 4 * 4)  # whole tiles
        if rows >= m:
            return F.linear(x, dequantize(self.qs, self.d, self.fmt, x.dtype, self.tiled), bias)
        parts = [F.linear(x, dequantize(self.qs[r: r + rows], self.d[r: r + rows], self.fmt, x.dtype, self.tiled),
                          None if bias is None else bias[r: r + rows]) for r in range(0, m, rows)]
        return torch.cat(parts, dim=-1)

    @property
    def nbytes(self) -> int:
        return self.qs.nbytes + self.d.nbytes


@functools.cache
def _fused_kernels():
    """offload.kernels.triton_dequant where Triton is installed, else None (warned once)."""
    from offload.kernels import triton_dequant

    if triton_dequant.TRITON_AVAILABLE:
        return triton_dequant
    warnings.warn("offload: Triton is not installed, so quantized GPU layers are dequantized with torch ops "
                  "(slower, a bf16 copy per call); pip install triton", stacklevel=3)
    return None

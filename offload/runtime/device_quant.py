"""Quantized weights on the compute device: q8_0/q4_0 planes dequantized there with torch ops before the matmul.

Streamed blocks cross PCIe in this form (a quarter to an eighth of fp32's bytes); the same torch code runs on
CUDA and, under the CPU backend, on the CPU, so CI checks it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

QK = 32


def dequantize(qs: torch.Tensor, d: torch.Tensor, fmt: str, dtype: torch.dtype) -> torch.Tensor:
    """Split-layout quants and fp16 scales [M, K/32] -> weights [M, K] in dtype, on their device."""
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

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] @ W.T + bias, with W dequantized into x's dtype for this call only."""
        w = dequantize(self.qs, self.d, self.fmt, x.dtype)
        return F.linear(x, w, None if bias is None else bias.to(x.dtype))

    @property
    def nbytes(self) -> int:
        return self.qs.nbytes + self.d.nbytes

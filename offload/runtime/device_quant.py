"""Quantized weights on the compute device: q8_0/q4_0 planes, or GGUF block bytes (formats.GGUF_BLOCKS), multiplied
there without a dequantized copy where a fused Triton kernel exists (formats.GGUFType.triton).

Streamed blocks cross PCIe in this form (a quarter to an eighth of fp32's bytes). On a CUDA device the fused
Triton kernels (offload.kernels.triton_dequant, triton_gguf) read the planes directly; elsewhere, without
Triton, or for a type without a Triton kernel, the torch fallback below dequantizes row slices into x's dtype
for the call (offload.formats.dequant_torch) and multiplies. The fallback runs on the CPU under the CPU
backend, so CI checks it.
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
from offload.formats import GGUF_TYPE, QK
from offload.rate_curves import gpu_kernel

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

    Computed in fp32 in gguf-py's order of operations (offload.formats.dequant_torch), so the fp32 result is bit
    for bit gguf-py's; other dtypes are that result rounded once.
    """
    m, k = shape
    kind = GGUF_TYPE[fmt]
    per_block, block_bytes = kind.block_weights, kind.block_bytes
    if k % per_block or tuple(raw.shape) != (m, k // per_block * block_bytes):
        raise KernelError(f"{fmt} weight {list(shape)} needs block bytes [{m}, {k // per_block * block_bytes}] "
                          f"(K a multiple of {per_block}), got {list(raw.shape)}")
    blocks = raw.view(torch.uint8).reshape(m, k // per_block, block_bytes)
    return kind.dequantize_torch(blocks).reshape(m, k).to(dtype)


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
            if fused is not None and (self.d is not None or GGUF_TYPE[self.fmt].triton is not None):
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

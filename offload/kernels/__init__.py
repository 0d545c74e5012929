"""CPU matmul kernels over packed weights (q8_0, q4_0, bf16, fp16, GGUF's block types), dispatched at import.

GGUF types with fused kernels (formats.CPU_KERNELS: q4_1, q5_0, q5_1, iq4_nl, iq4_xs, mxfp4 and the K-quants) run in
csrc/; the others (the IQ1-IQ3 and ternary types, nvfp4) are dequantized a slice of rows at a time and multiplied in
fp32.

ACTIVE_PATH is "avx512", "avx2", "scalar" (extension built, no SIMD) or "numba" (no extension).
OFFLOAD_KERNELS=numba|scalar|avx2|avx512 forces a path (one this CPU can run).
Activations are quantized per block of 32 on the fly: to int16 against q8_0 and q4_1 weights (results within
1e-4 of the dequantized fp32 matmul) and to int8 against q4_0 and the K-quants (as llama.cpp; within ~1e-2).
"""

from __future__ import annotations

import os
import warnings

import torch

from offload.errors import KernelError
from offload.kernels.dispatch import ENV_VAR, PATH_IDS, choose_path, load_extension
from offload.formats import GGUF_BLOCKS, GGUF_TYPE, PACKED_FORMATS
from offload.kernels.packed import PackedWeight
from offload.kernels.packed import pack as _pack

_C = load_extension()
CPU_FEATURES: frozenset[str] = frozenset(_C.cpu_features()) if _C is not None else frozenset()
ACTIVE_PATH: str = choose_path(CPU_FEATURES, _C is not None, os.environ.get(ENV_VAR))
if ACTIVE_PATH == "numba":
    warnings.warn("offload: C++ kernel extension not available; using the slower numba kernels", stacklevel=2)
    from offload.kernels import numba_ops as _nb
ACTIVE_PATH_ID: int = PATH_IDS.get(ACTIVE_PATH, 0)  # the id csrc/ takes for ACTIVE_PATH
TILED: bool = ACTIVE_PATH != "numba"  # pack() makes tiled q8_0/q4_0 weights for the C++ kernels
# bf16 weights x bf16 activations run in AVX-512 BF16 tiles (vdpbf16ps) at any row count: near torch's oneDNN
# matmul from 256 rows, faster below, at the memory's rate for a row or two (csrc/qgemm_avx512.cpp)
BF16_TILES: bool = ACTIVE_PATH == "avx512" and "avx512bf16" in CPU_FEATURES
_XTYPES = {torch.float32: 0, torch.bfloat16: 1}
# fp32 weights a type without fused CPU kernels dequantizes per step (its temporaries take ~3x more): small enough to
# stay in a server's L2 + L3 share, large enough that torch's matmul runs at speed
DEQUANT_SLICE_BYTES = 4 << 20
_F32 = torch.float32


def pack(w: torch.Tensor, fmt: str) -> PackedWeight:
    """Quantize/convert w [M, K] (fp32/bf16/fp16) to fmt, multi-threaded; q8_0/q4_0 equal gguf-py's.

    Quantized weights come in the tiled block order the C++ kernels read fastest (to_rows() gives GGUF's).
    """
    p = _pack(w, fmt, _C)
    return p.to_tiled() if TILED else p


def _check(x, w: PackedWeight, bias) -> None:
    """Raise KernelError naming what linear() cannot take."""
    if not isinstance(w, PackedWeight):
        raise KernelError(f"linear() needs a PackedWeight (from offload.kernels.pack), got {type(w).__name__}")
    if not isinstance(x, torch.Tensor) or x.dtype not in _XTYPES:
        raise KernelError(f"linear() takes float32 or bfloat16 activations, got {getattr(x, 'dtype', type(x))}; "
                          f"convert with x.float()")
    if x.device.type != "cpu" or x.dim() != 2 or x.shape[1] != w.shape[1]:
        raise KernelError(f"linear() needs CPU activations [N, {w.shape[1]}] for weight {list(w.shape)}, "
                          f"got {list(x.shape)} on {x.device}; reshape to 2-D first")
    if not x.is_contiguous():
        raise KernelError("linear() needs contiguous activations; call x.contiguous() first")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.dtype != torch.float32
                             or tuple(bias.shape) != (w.shape[0],) or not bias.is_contiguous()
                             or bias.device.type != "cpu"):
        raise KernelError(f"linear() bias must be a contiguous float32 CPU tensor [{w.shape[0]}], got "
                          f"{getattr(bias, 'dtype', type(bias))} {list(getattr(bias, 'shape', []))}; use bias.float()")


def linear(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [N, M] fp32 = x [N, K] (fp32/bf16, contiguous) @ w.T + bias; multi-threaded, releases the GIL."""
    if not isinstance(w, PackedWeight):
        _check(x, w, bias)
    xt = _XTYPES.get(x.dtype)
    shape = x.shape
    m, k = w.shape
    if (xt is None or len(shape) != 2 or shape[1] != k or not x.is_contiguous() or not x.is_cpu
            or (bias is not None and (bias.dtype is not _F32 or bias.dim() != 1 or bias.shape[0] != m
                                      or not bias.is_contiguous() or not bias.is_cpu))):
        _check(x, w, bias)
    n = shape[0]
    y = torch.empty(n, m)  # twice as fast as passing dtype=; checked below
    if y.dtype is not _F32:
        y = torch.empty((n, m), dtype=_F32)
    if n == 0:
        return y
    if w.fmt_id < 0:
        return _linear_dequantized(x, w, bias, y)
    if _C is None:
        return _linear_numba(x, w, bias, y)
    _C.linear(ACTIVE_PATH_ID, x.data_ptr(), xt, n, k, w.fmt_id, w.qs_ptr, w.d_ptr, m,
              0 if bias is None else bias.data_ptr(), y.data_ptr(), torch.get_num_threads())
    return y


def linear_path(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None, path: str) -> torch.Tensor:
    """linear() on a named path ("scalar", "avx2", "avx512", "numba"); for tests and benchmarks."""
    _check(x, w, bias)
    y = torch.empty((x.shape[0], w.shape[0]), dtype=torch.float32)
    if w.fmt_id < 0:  # one path for a type without fused kernels
        return _linear_dequantized(x, w, bias, y)
    if path == "numba":
        return _linear_numba(x, w, bias, y)
    if _C is None or path not in PATH_IDS:
        raise KernelError(f"kernel path {path!r} is not available here (active path: {ACTIVE_PATH})")
    _C.linear(PATH_IDS[path], x.data_ptr(), _XTYPES[x.dtype], x.shape[0], w.shape[1], w.fmt_id, w.qs_ptr, w.d_ptr,
              w.shape[0], 0 if bias is None else bias.data_ptr(), y.data_ptr(), torch.get_num_threads())
    return y


def linear_ref(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The scalar reference of linear(): same integer math, plain loops (C++ ref, or numba without it)."""
    return linear_path(x, w, bias, "scalar" if _C is not None else "numba")


def _linear_dequantized(x: torch.Tensor, w: PackedWeight, bias, y: torch.Tensor) -> torch.Tensor:
    """y = x @ w.T + bias for a GGUF type without fused CPU kernels: slices of w's rows dequantized to fp32 (torch,
    gguf-py's values) and multiplied by torch's matmul in fp32, DEQUANT_SLICE_BYTES of weights at a time."""
    m, k = w.shape
    kind = GGUF_TYPE[w.fmt]
    blocks = w.qs.view(m, k // kind.block_weights, kind.block_bytes)
    xf = x.float()
    rows = max(1, DEQUANT_SLICE_BYTES // (4 * k))
    for r in range(0, m, rows):
        y[:, r: r + rows] = xf @ kind.dequantize_torch(blocks[r: r + rows]).reshape(-1, k).T
    return y if bias is None else y.add_(bias)


def _linear_numba(x: torch.Tensor, w: PackedWeight, bias, y: torch.Tensor) -> torch.Tensor:
    """The numba fallback; bf16/fp16 weights and the GGUF block formats go through torch's matmul."""
    from offload.kernels import numba_ops

    if w.fmt in GGUF_BLOCKS:  # no numba kernels for these: the numpy dequantizer, then torch's matmul in fp32
        y.copy_(x.float() @ w.dequantize().T)
    elif w.d is None:
        y = x.float() @ w.qs.float().T
    else:
        w = w.to_rows()
        if w.fmt == "q8_0":  # int16 activations against q8_0 weights, int8 against q4_0, as in csrc/
            xq, xd = numba_ops.quantize_x16(x.float().numpy())
            numba_ops.gemm_q8_0(w.qs.numpy(), w.scales_f32().numpy(), xq, xd, y.numpy())
        else:
            xq, xd, _ = numba_ops.quantize_x(x.float().numpy())
            numba_ops.gemm_q4_0(w.qs.numpy(), w.scales_f32().numpy(), xq, xd, y.numpy())
    return y if bias is None else y.add_(bias)


__all__ = ["ACTIVE_PATH", "BF16_TILES", "CPU_FEATURES", "PACKED_FORMATS", "TILED", "KernelError", "PackedWeight", "choose_path", "linear",
           "linear_path", "linear_ref", "pack"]

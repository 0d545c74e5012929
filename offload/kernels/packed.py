"""PackedWeight: a [M, K] weight matrix in a kernel format (q8_0, q4_0, bf16, fp16), and pack()."""

from __future__ import annotations

import numpy as np
import torch

from offload.errors import KernelError
from offload.weights import quant

FORMATS = ("q8_0", "q4_0", "bf16", "fp16")
FMT_IDS = {"q8_0": 0, "q4_0": 1, "bf16": 2, "fp16": 3}  # csrc/kernels.h enum WFmt
_HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


class PackedWeight:
    """Weight [M, K] (out_features, in_features): quants [M, K*qb/32] + fp16 scales [M, K/32], or a half tensor."""

    __slots__ = ("fmt", "shape", "qs", "d", "fmt_id", "qs_ptr", "d_ptr", "_d32")

    def __init__(self, fmt: str, shape: tuple[int, int], qs: torch.Tensor, d: torch.Tensor | None):
        self.fmt, self.shape = fmt, _check_shape(fmt, tuple(shape))
        _check_parts(fmt, self.shape, qs, d)
        self.qs, self.d = qs.contiguous(), None if d is None else d.contiguous()
        self.fmt_id = FMT_IDS[fmt]
        self.qs_ptr = self.qs.data_ptr()
        self.d_ptr = 0 if self.d is None else self.d.data_ptr()
        self._d32 = None  # fp32 scales, made on demand for the numba path

    @property
    def nbytes(self) -> int:
        """Bytes of storage (equal to GGUF's size for q8_0 / q4_0)."""
        return self.qs.nbytes + (0 if self.d is None else self.d.nbytes)

    def scales_f32(self) -> torch.Tensor:
        """Block scales as fp32 [M, K/32] (cached)."""
        if self._d32 is None:
            self._d32 = self.d.float()
        return self._d32

    def dequantize(self) -> torch.Tensor:
        """The weights as fp32 [M, K]."""
        if self.d is None:
            return self.qs.float()
        return torch.from_numpy(quant.dequantize_np(self.qs.numpy().view(np.uint8), self.d.numpy(), self.fmt))

    def to_gguf(self) -> np.ndarray:
        """GGUF bytes of this matrix: uint8 [M, row_bytes] blocks, or the half values' bytes."""
        if self.d is None:
            return self.qs.view(torch.uint8).numpy().reshape(self.shape[0], -1)
        return quant.join_gguf_blocks(self.qs.numpy(), self.d.numpy(), self.fmt)

    @classmethod
    def from_gguf(cls, raw, fmt: str, shape: tuple[int, int]) -> "PackedWeight":
        """Wrap GGUF tensor bytes (bytes / uint8 array, GGUF block layout) of torch shape [M, K], no requantizing."""
        m, k = _check_shape(fmt, shape)
        raw = np.frombuffer(raw, dtype=np.uint8) if isinstance(raw, (bytes, bytearray, memoryview)) else np.asarray(raw)
        raw = raw.reshape(-1).view(np.uint8)
        want = m * k * 2 if fmt in _HALF else m * (k // quant.QK) * quant.BLOCK_BYTES[fmt]
        if raw.nbytes != want:
            raise KernelError(f"GGUF tensor of type {fmt} and shape [{m}, {k}] needs {want} bytes, got {raw.nbytes}; "
                              f"check the tensor's type and shape (GGUF lists dims innermost first)")
        if fmt in _HALF:
            return cls(fmt, (m, k), torch.from_numpy(raw.copy()).view(_HALF[fmt]).reshape(m, k), None)
        qs, d = quant.split_gguf_blocks(raw, fmt, (m, k))
        qs_t = torch.from_numpy(qs)
        return cls(fmt, (m, k), qs_t.view(torch.int8) if fmt == "q8_0" else qs_t, torch.from_numpy(d))

    def __repr__(self) -> str:
        return f"PackedWeight(fmt={self.fmt!r}, shape={list(self.shape)}, nbytes={self.nbytes})"


def _check_shape(fmt: str, shape) -> tuple[int, int]:
    if fmt not in FORMATS:
        raise KernelError(f"weight format {fmt!r} is not supported; use one of {', '.join(FORMATS)}")
    if len(shape) != 2 or shape[0] < 1 or shape[1] < 1:
        raise KernelError(f"a packed weight must be a non-empty 2-D [out, in] matrix, got shape {list(shape)}")
    if fmt in ("q8_0", "q4_0") and shape[1] % quant.QK:
        raise KernelError(f"{fmt} needs in_features divisible by {quant.QK}, got shape {list(shape)}; "
                          f"keep this layer in bf16/fp16 or pad it")
    return int(shape[0]), int(shape[1])


def _check_parts(fmt: str, shape: tuple[int, int], qs: torch.Tensor, d: torch.Tensor | None) -> None:
    """The kernels read raw memory: refuse parts whose dtype, shape or device is not the layout's."""
    m, k = shape
    if fmt in _HALF:
        want_qs, want_d = ((m, k), _HALF[fmt]), None
    else:
        width = k if fmt == "q8_0" else k // 2
        want_qs = ((m, width), torch.int8 if fmt == "q8_0" else torch.uint8)
        want_d = ((m, k // quant.QK), torch.float16)
    for name, t, want in (("quants", qs, want_qs), ("scales", d, want_d)):
        if want is None and t is None:
            continue
        if (t is None or want is None or tuple(t.shape) != want[0] or t.dtype != want[1]
                or t.device.type != "cpu"):
            raise KernelError(f"{fmt} weight [{m}, {k}]: {name} must be a CPU {want and want[1]} tensor of shape "
                              f"{want and list(want[0])}, got {None if t is None else (t.dtype, list(t.shape), t.device.type)}")


def pack(w: torch.Tensor, fmt: str, ext=None, n_threads: int | None = None) -> PackedWeight:
    """Quantize or convert w [M, K] (fp32/bf16/fp16) to fmt; q8_0/q4_0 match gguf-py's quantize bit for bit."""
    if not isinstance(w, torch.Tensor) or w.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise KernelError(f"pack() needs a float32/bfloat16/float16 torch tensor, got {getattr(w, 'dtype', type(w))}")
    m, k = _check_shape(fmt, tuple(w.shape))
    w = w.detach().to("cpu")
    if fmt in _HALF:
        return PackedWeight(fmt, (m, k), w.to(_HALF[fmt]).contiguous(), None)
    w32 = w.float().contiguous()
    if ext is None:
        fn = quant.quantize_q8_0_np if fmt == "q8_0" else quant.quantize_q4_0_np
        qs, d = fn(w32.numpy())
        return PackedWeight(fmt, (m, k), torch.from_numpy(qs), torch.from_numpy(d))
    qs_t = torch.empty((m, k if fmt == "q8_0" else k // 2), dtype=torch.int8 if fmt == "q8_0" else torch.uint8)
    d_t = torch.empty((m, k // quant.QK), dtype=torch.float16)
    ext.quantize_weights(FMT_IDS[fmt], w32.data_ptr(), m, k, qs_t.data_ptr(), d_t.data_ptr(),
                         n_threads or torch.get_num_threads())
    return PackedWeight(fmt, (m, k), qs_t, d_t)

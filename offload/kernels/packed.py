"""PackedWeight: a [M, K] weight matrix in a kernel format (q8_0, q4_0, bf16, fp16, fp32, GGUF's block types), and
pack()."""

from __future__ import annotations

import numpy as np
import torch

from offload.errors import KernelError
from offload.formats import CPU_KERNELS, GGUF_BLOCKS, PACKED_FORMATS, QK, QUANT_BLOCK_BYTES, QUANT_QS_BYTES, format_nbytes
from offload.kernels import quant

NO_KERNEL_ID = -1  # fmt_id of a format without fused CPU kernels (formats.CPU_KERNELS): kernels.linear dequantizes
TILED_ID = 4  # csrc/kernels.h W_TILED: added to a quantized format's id for tiled block order
_HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
# float formats a PackedWeight holds: the half ones, and fp32 (the model keeps fp32 weights as plain tensors;
# kernels.ops.linear views them as a PackedWeight for a step's few rows, which offload's fp32 kernels run)
_FLOAT = {**_HALF, "fp32": torch.float32}


class PackedWeight:
    """Weight [M, K] (out_features, in_features): quants [M, K*qb/32] + fp16 scales [M, K/32], or a half tensor,
    or (GGUF_BLOCKS formats) GGUF's block bytes unchanged, uint8 [M, K / per_block * block_bytes], with d None.

    q8_0/q4_0 blocks are in row order (GGUF's) or, with tiled=True, in the tiled order the CPU kernels read
    fastest (csrc/kernels.h: rows in tiles of 4, block pairs of the 4 rows side by side). Both hold the same
    bytes; to_tiled() / to_rows() convert. The GGUF_BLOCKS formats are always in row order.
    """

    __slots__ = ("fmt", "shape", "qs", "d", "tiled", "fmt_id", "qs_ptr", "d_ptr", "_d32")

    def __init__(self, fmt: str, shape: tuple[int, int], qs: torch.Tensor, d: torch.Tensor | None,
                 tiled: bool = False):
        self.fmt, self.shape = fmt, _check_shape(fmt, tuple(shape))
        _check_parts(fmt, self.shape, qs, d)
        if tiled and d is None:
            raise KernelError(f"only q8_0/q4_0 weights have a tiled block order, not {fmt}")
        self.qs, self.d = qs.contiguous(), None if d is None else d.contiguous()
        self.tiled = bool(tiled)
        self.fmt_id = CPU_KERNELS.get(fmt, NO_KERNEL_ID) + (TILED_ID if tiled else 0)
        self.qs_ptr = self.qs.data_ptr()
        self.d_ptr = 0 if self.d is None else self.d.data_ptr()
        self._d32 = None  # fp32 scales, made on demand for the numba path

    @property
    def nbytes(self) -> int:
        """Bytes of storage (equal to GGUF's size for q8_0 / q4_0)."""
        return self.qs.nbytes + (0 if self.d is None else self.d.nbytes)

    def scales_f32(self) -> torch.Tensor:
        """Block scales as fp32 [M, K/32] in row order (cached)."""
        if self._d32 is None:
            self._d32 = self.to_rows().d.float()
        return self._d32

    def to_tiled(self) -> "PackedWeight":
        """This matrix in tiled block order (a copy; self if already tiled or not quantized)."""
        if self.tiled or self.d is None:
            return self
        qs, d = tile_blocks(self.qs, self.d, self.fmt)
        return PackedWeight(self.fmt, self.shape, qs, d, tiled=True)

    def to_rows(self) -> "PackedWeight":
        """This matrix in row (GGUF) block order (a copy; self if already in row order)."""
        if not self.tiled:
            return self
        qs, d = untile_blocks(self.qs, self.d, self.fmt)
        return PackedWeight(self.fmt, self.shape, qs, d)

    def dequantize(self) -> torch.Tensor:
        """The weights as fp32 [M, K] (GGUF_BLOCKS formats: bit for bit as gguf-py dequantizes them)."""
        if self.fmt in GGUF_BLOCKS:
            return torch.from_numpy(quant.dequantize_gguf_np(self.qs.numpy(), self.fmt, self.shape))
        if self.d is None:
            return self.qs.float()
        rows = self.to_rows()
        return quant.dequantize_torch(rows.qs, rows.d, self.fmt)

    def to_gguf(self) -> np.ndarray:
        """GGUF bytes of this matrix: uint8 [M, row_bytes] blocks, or the half values' bytes."""
        if self.d is None:  # half values, or GGUF_BLOCKS formats (held as GGUF's bytes)
            return self.qs.view(torch.uint8).numpy().reshape(self.shape[0], -1)
        rows = self.to_rows()
        return quant.join_gguf_blocks(rows.qs.numpy(), rows.d.numpy(), self.fmt)

    @classmethod
    def from_gguf(cls, raw, fmt: str, shape: tuple[int, int]) -> "PackedWeight":
        """Wrap GGUF tensor bytes (bytes / uint8 array, GGUF block layout) of torch shape [M, K], no requantizing.

        GGUF_BLOCKS formats keep the bytes as they are: a writable contiguous array is wrapped without a copy
        (the PackedWeight then shares its memory), anything else is copied once."""
        m, k = _check_shape(fmt, shape)
        raw = np.frombuffer(raw, dtype=np.uint8) if isinstance(raw, (bytes, bytearray, memoryview)) else np.asarray(raw)
        raw = raw.reshape(-1).view(np.uint8)
        want = format_nbytes(m * k, fmt)
        if raw.nbytes != want:
            raise KernelError(f"GGUF tensor of type {fmt} and shape [{m}, {k}] needs {want} bytes, got {raw.nbytes}; "
                              f"check the tensor's type and shape (GGUF lists dims innermost first)")
        if fmt in _FLOAT:
            return cls(fmt, (m, k), torch.from_numpy(raw.copy()).view(_FLOAT[fmt]).reshape(m, k), None)
        if fmt in GGUF_BLOCKS:
            if not (raw.flags.writeable and raw.flags.c_contiguous):
                raw = raw.copy()  # torch cannot wrap read-only memory
            return cls(fmt, (m, k), torch.from_numpy(raw).reshape(m, -1), None)
        qs, d = quant.split_gguf_blocks(raw, fmt, (m, k))
        qs_t = torch.from_numpy(qs)
        return cls(fmt, (m, k), qs_t.view(torch.int8) if fmt == "q8_0" else qs_t, torch.from_numpy(d))

    def __repr__(self) -> str:
        order = ", tiled" if self.tiled else ""
        return f"PackedWeight(fmt={self.fmt!r}, shape={list(self.shape)}, nbytes={self.nbytes}{order})"


def _block_order(qs: torch.Tensor, d: torch.Tensor, fmt: str, to_tiled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Quants and scales reordered between row and tiled block order (csrc/kernels.h), on their device.

    Works on any leading slice of whole 4-row tiles too: the device dequantizer slices big matrices that way.
    """
    m, nb = d.shape
    m4, pairs = m // 4 * 4, nb // 2
    if m4 == 0:
        return qs, d
    out = []
    for plane, unit in ((qs.view(torch.uint8), QUANT_QS_BYTES[fmt]), (d.view(torch.int16), 1)):
        top = plane[:m4].reshape(m4 // 4, 4, nb * unit)
        if to_tiled:
            even = top[:, :, : 2 * pairs * unit].reshape(m4 // 4, 4, pairs, 2 * unit).transpose(1, 2)
            odd = top[:, :, 2 * pairs * unit:]
        else:  # a tile is [pairs, 4 rows, 2 blocks] then [4 rows, odd block]
            flat = top.reshape(m4 // 4, 4 * nb * unit)
            even = flat[:, : 8 * pairs * unit].reshape(m4 // 4, pairs, 4, 2 * unit).transpose(1, 2)
            odd = flat[:, 8 * pairs * unit:].reshape(m4 // 4, 4, nb % 2 * unit)
        if to_tiled:
            top = torch.cat((even.reshape(m4 // 4, -1), odd.reshape(m4 // 4, -1)), dim=1)
        else:
            top = torch.cat((even.reshape(m4 // 4, 4, -1), odd), dim=2)
        out.append(torch.cat((top.reshape(m4, nb * unit), plane[m4:])))
    return out[0].view(qs.dtype).reshape(qs.shape), out[1].view(d.dtype).reshape(d.shape)


def tile_blocks(qs: torch.Tensor, d: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-order quants [M, ...] and scales [M, K/32] -> tiled order (new tensors)."""
    return _block_order(qs, d, fmt, True)


def untile_blocks(qs: torch.Tensor, d: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiled-order quants and scales -> row order (new tensors)."""
    return _block_order(qs, d, fmt, False)


def _check_shape(fmt: str, shape) -> tuple[int, int]:
    if fmt not in PACKED_FORMATS and fmt not in _FLOAT:
        raise KernelError(f"weight format {fmt!r} is not supported; use one of {', '.join(PACKED_FORMATS)}")
    if len(shape) != 2 or shape[0] < 1 or shape[1] < 1:
        raise KernelError(f"a packed weight must be a non-empty 2-D [out, in] matrix, got shape {list(shape)}")
    if fmt in QUANT_BLOCK_BYTES and shape[1] % QK:
        raise KernelError(f"{fmt} needs in_features divisible by {QK}, got shape {list(shape)}; "
                          f"keep this layer in bf16/fp16 or pad it")
    if fmt in GGUF_BLOCKS and shape[1] % GGUF_BLOCKS[fmt][0]:
        raise KernelError(f"{fmt} stores rows in blocks of {GGUF_BLOCKS[fmt][0]} weights, but the matrix has shape "
                          f"{list(shape)}; check the tensor's shape (GGUF lists dims innermost first)")
    return int(shape[0]), int(shape[1])


def _check_parts(fmt: str, shape: tuple[int, int], qs: torch.Tensor, d: torch.Tensor | None) -> None:
    """The kernels read raw memory: refuse parts whose dtype, shape or device is not the layout's."""
    m, k = shape
    if fmt in _FLOAT:
        want_qs, want_d = ((m, k), _FLOAT[fmt]), None
    elif fmt in GGUF_BLOCKS:
        want_qs, want_d = ((m, format_nbytes(k, fmt)), torch.uint8), None
    else:
        width = k if fmt == "q8_0" else k // 2
        want_qs = ((m, width), torch.int8 if fmt == "q8_0" else torch.uint8)
        want_d = ((m, k // QK), torch.float16)
    for name, t, want in (("quants", qs, want_qs), ("scales", d, want_d)):
        if want is None and t is None:
            continue
        if (t is None or want is None or tuple(t.shape) != want[0] or t.dtype != want[1]
                or t.device.type not in ("cpu", "meta")):  # meta: sizes without bytes (a timed simulation)
            raise KernelError(f"{fmt} weight [{m}, {k}]: {name} must be a CPU {want and want[1]} tensor of shape "
                              f"{want and list(want[0])}, got {None if t is None else (t.dtype, list(t.shape), t.device.type)}")


def pack(w: torch.Tensor, fmt: str, ext=None, n_threads: int | None = None) -> PackedWeight:
    """Quantize or convert w [M, K] (fp32/bf16/fp16) to fmt; q8_0/q4_0 match gguf-py's quantize bit for bit."""
    if not isinstance(w, torch.Tensor) or w.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise KernelError(f"pack() needs a float32/bfloat16/float16 torch tensor, got {getattr(w, 'dtype', type(w))}")
    if fmt in GGUF_BLOCKS:
        raise KernelError(f"offload reads {fmt} weights from GGUF files but does not quantize to {fmt}; "
                          f"pack to q8_0 or q4_0 instead")
    m, k = _check_shape(fmt, tuple(w.shape))
    w = w.detach().to("cpu")
    if fmt in _FLOAT:
        return PackedWeight(fmt, (m, k), w.to(_FLOAT[fmt]).contiguous(), None)
    w32 = w.float().contiguous()
    if ext is None:
        fn = quant.quantize_q8_0_np if fmt == "q8_0" else quant.quantize_q4_0_np
        qs, d = fn(w32.numpy())
        return PackedWeight(fmt, (m, k), torch.from_numpy(qs), torch.from_numpy(d))
    qs_t = torch.empty((m, k if fmt == "q8_0" else k // 2), dtype=torch.int8 if fmt == "q8_0" else torch.uint8)
    d_t = torch.empty((m, k // QK), dtype=torch.float16)
    ext.quantize_weights(CPU_KERNELS[fmt], w32.data_ptr(), m, k, qs_t.data_ptr(), d_t.data_ptr(),
                         n_threads or torch.get_num_threads())
    return PackedWeight(fmt, (m, k), qs_t, d_t)

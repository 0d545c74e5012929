"""The one door from the block math to the kernels: the model code states the math (a linear, a mixture of
experts' matmuls) and this module picks how it runs from the weight's form, the activations' device and dtype,
and the rows, as each kernel states what it takes. No model file names a device or a format.

- linear: offload's C++ kernels for dense fp32 weights against fp32 activations up to F32_KERNEL_ROWS rows (a
  decode step, a verify pass), torch's matmul for the other dense weights; offload's C++ kernels for packed
  (quantized, GGUF block) weights on the CPU, and for half-precision weights on the CPU at a row or two (a decode
  step), bf16 against bf16 where the CPU has AVX-512 BF16 tiles, or against activations of another dtype (a GGUF
  file's bf16 kept as stored); weights that compute on their own device (DeviceQuantWeight) dequantize there; a
  StackedWeight runs part by part.
- norm_rows: offload's C++ RMSNorm for fp32 CPU rows (a model's final norm), torch's elsewhere.
- grouped_experts: the grouped Triton launches for a MoE layer's routed experts where the activations are on a
  CUDA device, Triton is installed and the experts are SiLU-gated without biases; None elsewhere (the model's
  loop over the picked experts runs).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from offload.formats import F32_KERNEL_ROWS

Weight = object  # a torch.Tensor [out, in], an offload.kernels.PackedWeight, a DeviceQuantWeight or a StackedWeight


@dataclass(frozen=True)
class StackedWeight:
    """Weights of different formats stacked along the output dimension, as one [sum(out), in] weight: a GGUF
    layer whose q, k and v (or gate and up) are stored in different types. Each part computes its own slice."""

    parts: tuple

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]


HALF_KERNEL_ROWS = 2  # up to this many rows, offload's kernel beats torch's bf16 matmul on a CPU with native bf16
HALF_ACTIVATIONS = (torch.float32, torch.bfloat16)  # what offload's CPU kernels take
HALF_WEIGHTS = {torch.bfloat16: "bf16", torch.float16: "fp16"}  # dense weights they take as a PackedWeight view


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ w.T + bias, for dense tensors or packed (quantized) weights. Half-precision weights on the
    CPU go through offload's kernels, except for more than a row or two of bf16 against bf16 on a CPU that multiplies
    bf16 itself (AVX-512 BF16, AMX) in a shape its bf16 tiles do not take: there torch's matmul is the faster. On a
    CPU without native bf16, torch widens bf16 slowly (a batch job ran 3-7x slower than offload's fp32-widening
    tiles on an AVX2 EPYC); a decode step's rows stream faster through offload's kernel on any CPU."""
    if isinstance(w, torch.Tensor):
        if w.dtype is torch.float32 and _f32_kernel_takes(x, w):
            return linear(x, _f32_view(w), None if bias is None else bias.contiguous())
        few_rows = x.numel() <= HALF_KERNEL_ROWS * x.shape[-1]
        if ((few_rows or _bf16_tiles(x, w) or x.dtype != w.dtype or not _bf16_available()) and w.dtype in HALF_WEIGHTS
                and w.device.type == "cpu" and x.dtype in HALF_ACTIVATIONS and w.dim() == 2 and w.is_contiguous()):
            as_packed = _half_kernel()
            if as_packed is not None:  # its bias in fp32, as the kernel adds it
                return linear(x, as_packed(w), None if bias is None else bias.float())
        if w.dtype != x.dtype:  # a weight kept in its stored format (a GGUF file's bf16) under another compute dtype
            return F.linear(x, w.to(x.dtype), None if bias is None else bias.to(x.dtype))
        return F.linear(x, w, bias)
    if isinstance(w, StackedWeight):
        biases = bias.split([p.shape[0] for p in w.parts]) if bias is not None else [None] * len(w.parts)
        return torch.cat([linear(x, p, b).to(x.dtype) for p, b in zip(w.parts, biases)], dim=-1)
    if hasattr(w, "apply"):  # weights that compute on their own device (dequantized there)
        return w.apply(x, bias)
    from offload.kernels import linear as packed_linear

    out = packed_linear(x.reshape(-1, x.shape[-1]).contiguous(), w, bias)
    return out.view(*x.shape[:-1], out.shape[-1]).to(x.dtype)


def norm_rows(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x's rows times w (rms_norm): offload's C++ norm for fp32 CPU tensors, torch's
    elsewhere. A decode step's final norm comes just after the layers have streamed their weights through the
    caches: torch's took 90-250 us there (13 us warm), for one row of 1024."""
    d = x.shape[-1]
    if (x.dtype is torch.float32 and w.dtype is torch.float32 and x.device.type == "cpu" and w.device.type == "cpu"
            and tuple(w.shape) == (d,) and w.is_contiguous() and x.numel() and _half_kernel() is not None):
        from offload.kernels import _C

        x, y = x.contiguous(), torch.empty_like(x, memory_format=torch.contiguous_format)
        _C.rms_norm(x.data_ptr(), w.data_ptr(), x.numel() // d, d, eps, y.data_ptr(), torch.get_num_threads())
        return y
    return rms_norm(x, w, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32 as transformers does, returned in x's dtype."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _f32_kernel_takes(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether offload's fp32 kernels run x @ w.T for an fp32 weight: fp32 CPU activations, few rows, a contiguous
    2-D CPU weight, and the C++ extension (not the numba path, whose fp32 matmul is torch's)."""
    return (x.dtype is torch.float32 and x.numel() <= F32_KERNEL_ROWS * x.shape[-1] and x.device.type == "cpu"
            and w.device.type == "cpu" and w.dim() == 2 and w.is_contiguous() and _half_kernel() is not None)


def _f32_view(w: torch.Tensor):
    """A dense fp32 weight as a PackedWeight view for offload's fp32 kernels (no copy)."""
    from offload.kernels import PackedWeight

    return PackedWeight("fp32", tuple(w.shape), w, None)


def _bf16_tiles(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether offload's AVX-512 BF16 tiles take x @ w.T (bf16 both, whole 32-element blocks)."""
    return x.dtype is torch.bfloat16 and w.dtype is torch.bfloat16 and x.shape[-1] % 32 == 0 and _bf16_available()


@functools.lru_cache(maxsize=None)
def _bf16_available() -> bool:
    from offload.kernels import BF16_TILES

    return BF16_TILES


@functools.lru_cache(maxsize=None)
def _half_kernel():
    """A function making a dense half-precision weight a PackedWeight view for offload's C++ kernels (None
    without them)."""
    from offload.kernels import ACTIVE_PATH, PackedWeight

    if ACTIVE_PATH == "numba":  # no C++ extension: torch's matmul is the faster one
        return None
    return lambda w: PackedWeight(HALF_WEIGHTS[w.dtype], tuple(w.shape), w, None)


# Each ExpertWeights' grouped operands for the Triton kernels (grouped_weights), keyed by the object itself and
# dropped with it: a resident unit's weights live as long as the model, a streamed unit's are views of its staging
# slot made once per slot and layout (runtime/streamer.py).
_GROUPED = WeakIdKeyDictionary()


def grouped_experts(moe, w, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor | None:
    """sum over each token's top-k experts of weight * expert(h) for h [T, D], routed (weights, ids [T, k]), in
    two grouped Triton launches (gate_up with SiLU, down with the routing weights) over the (token, slot) pairs
    sorted by expert on the device: nothing here waits for the device. [T, D] in fp32, or None where these
    kernels do not run it (the device, Triton, the experts' gate or biases, their weights' form)."""
    if h.device.type != "cuda" or _triton_moe() is None:
        return None
    return run_grouped(moe, w, h, weights, ids)


def run_grouped(moe, w, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor | None:
    """grouped_experts on whatever device h is (tests run it on the CPU under TRITON_INTERPRET=1); None where the
    experts' gate, biases or weights are not what the kernels take."""
    kernels = _triton_moe()
    if kernels is None or moe.activation != "silu" or moe.biases:
        return None
    gate_up, down = grouped_weights(w, h)
    if gate_up is None or down is None:
        return None
    tiles = kernels.expert_tiles(ids, moe.n_experts, kernels.tile_rows(h.shape[0], moe.top_k, moe.n_experts))
    act = kernels.grouped_gate_up(h, tiles, gate_up, moe.top_k)  # [T*k, F] by expert
    y = kernels.grouped_down(act, tiles, down, weights.reshape(-1))  # [T*k, D] by (token, slot)
    return y.view(-1, moe.top_k, h.shape[-1]).sum(dim=1, dtype=torch.float32)


@functools.cache
def _triton_moe():
    from offload.kernels import triton_moe

    return triton_moe if triton_moe.TRITON_AVAILABLE else None


def grouped_weights(w, h: torch.Tensor) -> tuple:
    """(gate_up, down) as triton_moe.GroupedWeights for activations like h (None where the kernels do not take
    them), built on w's first call and reused (a rebuild walks every expert: 0.4 ms for 128). They hold views of
    the weights and their addresses, never copies, so a staging slot's stay right while the slot is refilled."""
    from offload.kernels import triton_moe

    like = (h.device, h.dtype)
    held = _GROUPED.get(w)
    if held is not None and held[0] == like and held[1] is w.gate_up and held[2] is w.down:
        return held[3]
    grouped = triton_moe.group_weights(w.gate_up, h), triton_moe.group_weights(w.down, h)
    _GROUPED[w] = (like, w.gate_up, w.down, grouped)
    return grouped

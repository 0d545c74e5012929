"""GGUFSource: the units of a GGUF model, one at a time, with each tensor in the form the kernels take.

Quantized linears keep their file's blocks (q8_0/q4_0 in offload's tiled order, the other types as GGUF blocks);
bf16 linears stay bf16, other float linears take the compute dtype; embeddings are dequantized for lookup. With a quantization
asked for, tensors of another type are dequantized and quantized to it (those already in it are kept). A MoE
layer's routed experts are read each from its slice of the layer's stacked experts tensors, which is a tensor of
its own in every respect (contiguous rows of whole blocks), so disk units read it straight from the file too.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from offload.formats import FLOAT_FORMATS, GGUF_BLOCKS, KEPT_FLOAT, QK, is_quantized
from offload.kernels.ops import StackedWeight
from offload.model.llama import LayerWeights
from offload.model.moe import ExpertWeights
from offload.spec import ModelSpec, UnitSpec
from offload.weights.extents import Extent, unit_extents
from offload.weights.gguf import GGUFFile, GGUFTensor, check_tensors, tensor_map
from offload.weights.sources import LINEAR_FIELDS, expert_tensor_names, layer_tensor_names, unit_tensor_names

log = logging.getLogger(__name__)
_FLOAT_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class GGUFSource:
    """Reads one unit at a time from a GGUF file (or split set)."""

    def __init__(self, gf: GGUFFile, spec: ModelSpec, dtype: torch.dtype, quantization: str = "none"):
        check_tensors(gf, spec, requantize=quantization != "none")
        self.gf, self.spec, self.dtype, self.quantization = gf, spec, dtype, quantization
        self.by_name: dict[str, GGUFTensor] = tensor_map(gf, spec)  # an expert's entry: its slice of the stack
        # llama.cpp permutes the q and k rows of the models it stores as llama (Mixtral too); norms are as stored
        # (Gemma's converter adds the 1 that read_norm adds to a Hugging Face checkpoint's)
        self.unpermute = spec.family.gguf_permuted
        if quantization != "none":
            other = sorted({t.fmt for t in self.by_name.values() if t.fmt and t.fmt != quantization
                            and t.fmt not in FLOAT_FORMATS})
            if other:
                log.info(f"{gf.path.name}: {', '.join(other)} tensors are dequantized and quantized to {quantization} "
                         f"(quantization 'none' keeps them as stored)")

    def load(self, unit: UnitSpec):
        """LayerWeights for a layer; ExpertWeights for experts; a tensor for embed and norm; a weight for the
        lm_head."""
        if unit.kind == "layer":
            return self._layer(unit.index)
        if unit.kind == "experts":
            return self._experts(unit.index)
        name = unit.tensors[0].name
        return self.linear(name) if unit.kind == "lm_head" else self.dense(name).contiguous()

    def _layer(self, i: int) -> LayerWeights:
        def field(name: str, group: tuple[str, ...] | None):
            if group is None:
                return None
            if name in LINEAR_FIELDS:
                return stack([self.linear(n) for n in group])
            parts = [self.dense(n) for n in group]  # a norm, a gate, or biases fused like their weights
            return parts[0] if len(parts) == 1 else torch.cat(parts)

        return LayerWeights(**{name: field(name, group) for name, group in layer_tensor_names(self.spec, i).items()})

    def _experts(self, i: int) -> ExpertWeights:
        """The router (compute dtype, as stored in F32 by llama.cpp's converter) and each expert's fused gate|up
        and down, read from its slice of the stacked tensors; gpt-oss's biases too (the router's in the compute
        dtype, the experts' in fp32, as load_experts reads a checkpoint's)."""
        names, n = expert_tensor_names(self.spec, i), self.spec.moe.n_experts
        biases = {}
        if self.spec.moe.biases:
            biases["router_bias"] = self.dense(names["router_bias"][0])
            for kind in ("gate_up_bias", "down_bias"):
                biases[kind] = tuple(torch.cat([self.values(t).float() for t in names[f"{kind}#{e}"]])
                                     for e in range(n))
        return ExpertWeights(self.dense(names["router"][0]).contiguous(),
                             tuple(stack([self.linear(t) for t in names[f"gate_up#{e}"]]) for e in range(n)),
                             tuple(self.linear(names[f"down#{e}"][0]) for e in range(n)), **biases)

    def extents(self, unit: UnitSpec, layout) -> tuple[Extent, ...] | None:
        """Where the unit's buffer (layout) sits in the GGUF file: entries kept as GGUF blocks (q4_1, K-quants) or
        as floats of the compute dtype are; q8_0/q4_0 (split into planes, tiled) and converted ones are not."""
        if self.quantization != "none":
            return None

        def locate(name: str, entry):
            t = self.by_name.get(name)
            if t is None:
                return None
            as_blocks = entry.part == "qs" and entry.fmt in GGUF_BLOCKS and entry.fmt == t.fmt
            as_floats = entry.part == "dense" and t.fmt in FLOAT_FORMATS and _FLOAT_DTYPES[t.fmt] == entry.dtype
            if not (as_blocks or as_floats):
                return None
            rows = None
            if self.unpermute and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name):
                heads = self.spec.n_heads if ".q_proj." in name else self.spec.n_kv_heads
                rows = tuple(_unpermute_rows(t.shape[0], heads).tolist())
            return t.path, t.offset, t.n_bytes, rows

        return unit_extents(layout, unit_tensor_names(self.spec, unit), locate)

    def drop_after_read(self, drop: bool) -> None:
        """Whether reads of the file leave their pages out of the page cache."""
        self.gf.drop_after_read = drop

    def _raw(self, name: str) -> tuple[GGUFTensor, np.ndarray]:
        """The tensor's bytes as rows [out, row bytes], with llama's q/k row permutation undone."""
        t = self.by_name[name]
        raw = self.gf.read(t).reshape(t.shape[0], -1)
        if self.unpermute and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name):
            heads = self.spec.n_heads if ".q_proj." in name else self.spec.n_kv_heads
            raw = raw[_unpermute_rows(t.shape[0], heads)]
        return t, raw

    def dense(self, name: str) -> torch.Tensor:
        """The tensor as a dense tensor in the compute dtype (quantized ones dequantized)."""
        return self.values(name).to(self.dtype)

    def values(self, name: str) -> torch.Tensor:
        """The tensor's values as stored (float types) or dequantized to fp32, in memory of their own."""
        t, raw = self._raw(name)
        return _float_tensor(raw, t) if t.fmt in FLOAT_FORMATS else _dequantized(raw, t)

    def linear(self, name: str):
        """A linear weight [out, in] as the kernels take it: as stored, or quantized to the asked format."""
        from offload.kernels import TILED, PackedWeight, pack

        t, raw = self._raw(name)
        want = self.quantization
        if want == "none" and t.fmt == KEPT_FLOAT:  # kept as stored (TensorSpec.held_format)
            return _float_tensor(raw, t)
        if want == "none" and t.fmt in FLOAT_FORMATS:
            return _float_tensor(raw, t).to(self.dtype)
        if t.fmt is not None and is_quantized(t.fmt) and want in ("none", t.fmt):
            w = PackedWeight.from_gguf(raw, t.fmt, t.shape)
            return w.to_tiled() if TILED else w
        dense = _float_tensor(raw, t) if t.fmt in FLOAT_FORMATS else _dequantized(raw, t)
        if t.shape[-1] % QK:  # cannot be quantized: kept in the compute dtype
            return dense.to(self.dtype)
        return pack(dense.float(), want)


def stack(parts: list):
    """Linears fused along the output dimension: one weight when the parts share a format, else a
    StackedWeight (a GGUF layer whose q, k and v are stored in different types)."""
    from offload.kernels import TILED, PackedWeight

    if all(isinstance(p, torch.Tensor) for p in parts) and len({p.dtype for p in parts}) == 1:
        return torch.cat(parts)
    if all(isinstance(p, PackedWeight) for p in parts) and len({p.fmt for p in parts}) == 1:
        rows = [p.to_rows() for p in parts]  # rows of blocks concatenate in row order (GGUF formats: always)
        d = None if rows[0].d is None else torch.cat([p.d for p in rows])
        fused = PackedWeight(rows[0].fmt, (sum(p.shape[0] for p in rows), rows[0].shape[1]),
                             torch.cat([p.qs for p in rows]), d)
        return fused.to_tiled() if TILED else fused  # to_tiled: itself for formats without a tiled order
    return StackedWeight(tuple(parts))


def _unpermute_rows(n_rows: int, n_heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's permutation of a q or k weight (as transformers' GGUF loader does)."""
    half = n_rows // n_heads // 2
    return np.arange(n_rows).reshape(n_heads, half, 2).swapaxes(1, 2).reshape(-1)


def _float_tensor(raw: np.ndarray, t: GGUFTensor) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(raw)).view(_FLOAT_DTYPES[t.fmt]).reshape(t.shape)


def _dequantized(raw: np.ndarray, t: GGUFTensor) -> torch.Tensor:
    """fp32 values of a quantized tensor: offload's own dequantization, gguf-py's for types offload does not
    compute with."""
    if t.fmt is not None:
        from offload.kernels import PackedWeight

        return PackedWeight.from_gguf(raw, t.fmt, t.shape).dequantize()
    from gguf import GGMLQuantizationType, quants

    values = quants.dequantize(np.ascontiguousarray(raw), GGMLQuantizationType[t.ggml_type])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(t.shape)

"""UnitLayout: the weights of one unit laid out in a single flat byte buffer.

One buffer per unit is what makes streaming cheap: one pinned host region, one host-to-device copy into a
staging slot, one disk read. `materialize` turns any buffer with the layout (host, staging slot, read-ahead
buffer) back into the weights the block math takes, without copying.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from offload.formats import ALIGN_BYTES, GGUF_BLOCKS
from offload.kernels.ops import StackedWeight
from offload.model.llama import LayerWeights, MLPWeights
from offload.model.moe import ExpertWeights
from offload.runtime.device_quant import DeviceQuantWeight

# a unit's weights: one of these dataclasses, or a single weight
HOLDERS = {"layer": LayerWeights, "experts": ExpertWeights, "mlp": MLPWeights}


@dataclass(frozen=True)
class Entry:
    """One tensor inside the buffer: which field (and plane of a quantized weight), where, and what."""

    field: str  # LayerWeights / ExpertWeights field name (an expert's: gate_up#e), or "weight" for single tensors
    part: str  # dense | qs | d
    offset: int
    n_bytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    fmt: str | None = None  # q8_0 / q4_0 / a GGUF block format (formats.GGUF_BLOCKS) for quantized planes
    tiled: bool = False  # quantized planes in tiled block order (offload.kernels.packed)


@dataclass(frozen=True)
class UnitLayout:
    """Where each tensor of a unit sits in its flat buffer; holder: the HOLDERS key of its weights' class, or
    "weight" for a single tensor."""

    holder: str
    entries: tuple[Entry, ...]
    n_bytes: int


def _holder(weights) -> str:
    return next((k for k, cls in HOLDERS.items() if isinstance(weights, cls)), "weight")


def _leaves(weights) -> list[tuple[str, object]]:
    """(name, tensor or packed weight) of a unit; the parts of a StackedWeight field are named field/0, field/1,
    the experts of a tuple field field#0, field#1."""
    if _holder(weights) == "weight":
        return [("weight", weights)]
    leaves = []
    for f in dataclasses.fields(weights):
        value = getattr(weights, f.name)
        named = [(f"{f.name}#{e}", v) for e, v in enumerate(value)] if isinstance(value, tuple) else [(f.name, value)]
        for name, leaf in named:
            if isinstance(leaf, StackedWeight):
                leaves += [(f"{name}/{i}", part) for i, part in enumerate(leaf.parts)]
            else:
                leaves.append((name, leaf))
    return leaves


def layout_of(weights) -> UnitLayout:
    """The layout for a LayerWeights, an ExpertWeights or a single weight (tensor or PackedWeight)."""
    entries, offset = [], 0
    for name, leaf in _leaves(weights):
        if leaf is None:
            continue
        if isinstance(leaf, torch.Tensor):
            parts = [("dense", leaf, None)]
        elif leaf.fmt in GGUF_BLOCKS:  # GGUF block bytes: one plane, no scales
            parts = [("qs", leaf.qs, leaf.fmt)]
        else:  # PackedWeight or DeviceQuantWeight: quants and scales planes
            parts = [("qs", leaf.qs, leaf.fmt), ("d", leaf.d, leaf.fmt)]
            if leaf.d is None:  # a half-precision PackedWeight has no scale plane
                parts = [("dense", leaf.qs, None)]
        tiled = bool(getattr(leaf, "tiled", False))
        for part, t, fmt in parts:
            entries.append(Entry(name, part, offset, t.nbytes, t.dtype, tuple(t.shape), fmt, tiled))
            offset += -(-t.nbytes // ALIGN_BYTES) * ALIGN_BYTES
    return UnitLayout(_holder(weights), tuple(entries), offset)


def in_row_order(weights):
    """The unit's weights with tiled q8_0/q4_0 matrices put back in GGUF's row block order.

    Tiled order is for the CPU kernels; a unit that only ever computes on the GPU is dequantized there, which
    is simplest (and needs no reordering scratch) in row order.
    """
    def rows(leaf):
        if isinstance(leaf, StackedWeight):
            return StackedWeight(tuple(rows(p) for p in leaf.parts))
        return leaf.to_rows() if getattr(leaf, "tiled", False) else leaf

    def field(value):
        return tuple(rows(v) for v in value) if isinstance(value, tuple) else rows(value)

    if _holder(weights) != "weight":
        return dataclasses.replace(weights, **{f.name: field(getattr(weights, f.name))
                                               for f in dataclasses.fields(weights)})
    return rows(weights)


def _in_features(fmt: str, qs_width: int) -> int:
    """K of a quantized weight whose quants plane is qs_width wide (bytes, or int8 values for q8_0)."""
    if fmt in GGUF_BLOCKS:
        per_block, block_bytes = GGUF_BLOCKS[fmt]
        return qs_width // block_bytes * per_block
    return qs_width * (1 if fmt == "q8_0" else 2)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def write_into(layout: UnitLayout, weights, buffer: torch.Tensor) -> None:
    """Copy the unit's tensors into buffer (uint8, at least layout.n_bytes, any device)."""
    leaves = dict(_leaves(weights))
    for e in layout.entries:
        leaf = leaves[e.field]
        if e.part == "dense":
            t = leaf if isinstance(leaf, torch.Tensor) else leaf.qs
        else:
            t = getattr(leaf, e.part)
        buffer[e.offset: e.offset + e.n_bytes].copy_(_as_bytes(t))


def materialize(layout: UnitLayout, buffer: torch.Tensor | None, on_device: bool, view=None):
    """Weights viewing buffer: quantized planes become DeviceQuantWeight (on_device) or PackedWeight (CPU kernels).

    view(entry), when given, supplies each entry's tensor instead of the buffer: a tensor shaped as the entry, or
    for a dense linear a tuple of row blocks that together make it (they become a StackedWeight)."""
    if view is None:
        def view(e: Entry) -> torch.Tensor:
            return buffer[e.offset: e.offset + e.n_bytes].view(e.dtype).view(e.shape)
    views: dict[str, dict[str, torch.Tensor]] = {}
    fmts, shapes, tiled = {}, {}, {}
    for e in layout.entries:
        views.setdefault(e.field, {})[e.part] = view(e)
        if e.fmt:
            fmts[e.field], tiled[e.field] = e.fmt, e.tiled
            if e.part == "qs":
                shapes[e.field] = (e.shape[0], _in_features(e.fmt, e.shape[1]))
    built = {}
    for name, parts in views.items():
        if "dense" in parts:
            dense = parts["dense"]
            built[name] = StackedWeight(dense) if isinstance(dense, tuple) else dense
        elif on_device:
            built[name] = DeviceQuantWeight(fmts[name], shapes[name], parts["qs"], parts.get("d"), tiled[name])
        else:
            from offload.kernels import PackedWeight

            built[name] = PackedWeight(fmts[name], shapes[name], parts["qs"], parts.get("d"), tiled[name])
    if layout.holder == "weight":
        return built["weight"]
    stacked: dict[str, list] = {}
    for name in sorted((n for n in built if "/" in n), key=lambda n: int(n.rsplit("/", 1)[1])):
        stacked.setdefault(name.split("/")[0], []).append(built[name])
    built.update({name: StackedWeight(tuple(parts)) for name, parts in stacked.items()})
    experts: dict[str, list] = {}
    for name in sorted((n for n in built if "#" in n and "/" not in n), key=lambda n: int(n.rsplit("#", 1)[1])):
        experts.setdefault(name.split("#")[0], []).append(built[name])
    built.update({name: tuple(parts) for name, parts in experts.items()})
    cls = HOLDERS[layout.holder]
    return cls(**{f.name: built.get(f.name) for f in dataclasses.fields(cls)})

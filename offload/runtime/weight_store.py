"""WeightStore: every unit's weights where a Placement says (resident on the device, in host RAM, pinned where
they are copied to the device, mapped from the page cache, or on disk, read from the file that holds their bytes
or from a spill copy), the fused C++ handles of the layers the CPU computes from host memory (built once), and the
buffers the plan sized for streaming: the staging ring and the disk read-ahead arena."""

from __future__ import annotations

from pathlib import Path

import torch

from offload.errors import PlanError
from offload.kernels import layer as fused
from offload.planner.costs import read_ahead_bytes
from offload.planner.placement import Placement
from offload.runtime.backends.base import Backend
from offload.runtime.disk import DiskStore, ReadAhead, mapped_pieces
from offload.runtime.host_memory import keep_heap_small
from offload.runtime.staging import StagingRing
from offload.runtime.unit_store import UnitLayout, in_row_order, layout_of, materialize, write_into
from offload.spec import ModelSpec


class WeightStore:
    """The placed weights of one model and the buffers they stream through; built once, when the model is loaded."""

    def __init__(self, spec: ModelSpec, source, placement: Placement, backend: Backend, fuse: bool,
                 disk_dir: str | Path | None = None, shared: dict | None = None):
        """shared: units resident on the device that another model holds, name -> (layout, weights), taken as
        they are (a substitute draft runs its model's resident units): neither loaded nor allocated again."""
        self.spec, self.placement, self.backend, self.fuse = spec, placement, backend, fuse
        self.units = spec.units()
        self.order = [u.name for u in self.units]
        self.kind_index = {u.name: (u.kind, u.index) for u in self.units}  # name -> (kind, layer index)
        # host-resident units' C++ views, built once here (the final norm's too, with fp32 weights)
        self.fused_layers: dict[str, fused.FusedLayer | fused.FusedExperts | fused.FusedNorm] = {}
        self.layouts: dict[str, UnitLayout] = {}
        self.resident, self.host_buffers, self.host_weights = {}, {}, {}
        self.disk = DiskStore(disk_dir)
        keep_heap_small()
        # where the page cache has no room for some disk unit, the load leaves it only the units it keeps
        short = any(p.weights == "disk" and not placement.page_cache_keeps(n) for n, p in placement.units.items())
        for unit in self.units:
            if unit.name in (shared or {}):
                self.layouts[unit.name], self.resident[unit.name] = shared[unit.name]
                continue
            if hasattr(source, "drop_after_read"):
                source.drop_after_read(short and not placement.page_cache_keeps(unit.name))
            self._place(unit, source.load(unit), source)
        self.disk.drop = {n for n in self.disk.sizes if not placement.page_cache_keeps(n)}
        # an embedding computed on the CPU from disk reads only the rows a step looks up
        self.embed_rows = {u.name for u in self.units if u.kind == "embed" and placement[u.name].weights == "disk"
                           and placement[u.name].prefill == placement[u.name].decode == "cpu"
                           and len(self.disk.extents.get(u.name, ())) == 1}
        self.in_place = self._map_kept_units()
        self.ring = self._make_ring()
        self.reader = self._make_reader()

    def _place(self, unit, weights, source) -> None:
        p = self.placement[unit.name]
        if "cpu" not in (p.prefill, p.decode):  # GPU-only compute: GGUF row order (see in_row_order)
            weights = in_row_order(weights)
        layout = layout_of(weights)
        self.layouts[unit.name] = layout
        if p.weights == "gpu":
            buf = self.backend.alloc("gpu", layout.n_bytes)
            host = torch.empty(layout.n_bytes, dtype=torch.uint8, device=self.backend.meta_or("cpu"))
            write_into(layout, weights, host)
            buf.copy_(host)
            self.resident[unit.name] = materialize(layout, buf, on_device=True)
        elif p.weights == "cpu":
            streamed = "stream" in (p.prefill, p.decode)
            if streamed or not self.backend.computes:  # one flat (pinned) buffer: one copy per stream
                buf = self.backend.alloc("cpu", layout.n_bytes, pinned=streamed)
                write_into(layout, weights, buf)
                self.host_buffers[unit.name] = buf
                self.host_weights[unit.name] = materialize(layout, buf, on_device=False)
            else:  # computed where it was loaded: no second copy, not even for a moment
                self.backend.track("cpu", layout.n_bytes)
                self.host_weights[unit.name] = weights
            if "cpu" in (p.prefill, p.decode):
                self._fuse_host_layer(unit.name)
        else:  # read from the file that holds the unit's bytes as the layout has them, else from a spill copy
            extents = source.extents(unit, layout) if hasattr(source, "extents") else None
            in_place = self._kept_for_cpu(unit.name) and unit.kind != "embed"  # an embedding reads rows
            if extents is not None and in_place and mapped_pieces(extents, layout) is None:
                extents = None  # the plan computes it from mapped pages (no read-ahead): a copy laid out to be mapped
            if extents is not None:
                self.disk.add(unit.name, extents, layout.n_bytes)
            else:
                host = torch.empty(layout.n_bytes, dtype=torch.uint8, device=self.backend.meta_or("cpu"))
                write_into(layout, weights, host)
                self.disk.store(unit.name, host, layout)
            self.backend.track("disk", layout.n_bytes)

    def _kept_for_cpu(self, name: str) -> bool:
        """A disk unit the page cache keeps and only the CPU computes: the planner counts no read-ahead for it, so
        its weights are views of its file's mapped pages."""
        p = self.placement[name]
        return self.placement.page_cache_keeps(name) and p.prefill == p.decode == "cpu" and self.backend.computes

    def _map_kept_units(self) -> set[str]:
        """Disk units the page cache keeps and the CPU computes: their weights are views of their files' mapped
        pages, made once, so a step reads them where the page cache holds them, with no copy and no read-ahead."""
        mapped = set()
        for name in self.disk.extents:
            if name in self.embed_rows or not self._kept_for_cpu(name):
                continue
            weights = self.disk.map_unit(name, self.layouts[name])
            if weights is None:
                continue
            mapped.add(name)
            self.host_weights[name] = weights
            self._fuse_host_layer(name)
        return mapped

    def _fuse_host_layer(self, name: str) -> None:
        """The fused C++ handle of a layer (or experts unit) the CPU computes from host memory, made once, where it
        fits."""
        if not self.fuse or self.kind_index[name][0] not in ("layer", "experts", "mlp", "norm"):
            return
        handle = self.fused_handle(name, self.host_weights[name])
        if handle is not None:
            self.fused_layers[name] = handle

    def fused_handle(self, name: str, w):
        """The C++ view of a layer's (or a MoE layer's attention part's), an experts unit's or the final norm's
        weights; None where they do not suit it."""
        kind, index = self.kind_index[name]
        if kind == "norm":
            return fused.fuse_norm(w, self.spec.rms_norm_eps)
        if kind == "experts":
            return fused.fuse_experts(self.spec.moe, w)
        if kind == "mlp":
            return fused.fuse_mlp(w, self.spec.family.activation)
        return fused.fuse_layer(self.spec, w, self.spec.hands_over(index), index)

    def _make_ring(self) -> StagingRing | None:
        streamed = [n for n in self.order if "stream" in (self.placement[n].prefill, self.placement[n].decode)]
        if not streamed:
            return None
        slot_bytes = self._buffer_bytes(streamed, self.placement.staging_slot_bytes, "staging slot")
        return StagingRing(self.backend, self.placement.prefetch_depth, slot_bytes)

    def _make_reader(self) -> ReadAhead | None:
        on_disk = [n for n in self.order if self.placement[n].weights == "disk" and n not in self.embed_rows
                   and n not in self.in_place]
        if not on_disk:
            return None
        depth = self.placement.read_ahead
        need = read_ahead_bytes([self.layouts[n].n_bytes for n in on_disk], depth)
        planned = self.placement.read_buffer_bytes
        if planned is not None and planned < read_ahead_bytes([max(self.layouts[n].n_bytes for n in on_disk)], 1):
            raise PlanError(f"the plan sized the disk read-ahead at {planned} bytes, less than its largest disk unit "
                            f"takes; the plan was made for another model or format: plan again for this one")
        # the arena is pinned only for units copied to a GPU from it; CPU-computed ones are read in place
        streamed = any("stream" in (self.placement[n].prefill, self.placement[n].decode) for n in on_disk)
        return ReadAhead(self.backend, self.disk, depth, need if planned is None else planned, pinned=streamed)

    def _buffer_bytes(self, units: list[str], planned: int | None, what: str) -> int:
        """The planned size of a buffer that must hold any of units (their largest, for a hand-made placement)."""
        need = max(units, key=lambda n: self.layouts[n].n_bytes)
        if planned is None:
            return self.layouts[need].n_bytes
        if self.layouts[need].n_bytes > planned:
            raise PlanError(f"{need} takes {self.layouts[need].n_bytes} bytes but the plan sized each {what} at "
                            f"{planned}; the plan was made for another model or format: plan again for this one")
        return planned

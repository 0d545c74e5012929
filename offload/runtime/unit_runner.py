"""UnitRunner: one unit's block math where it computes, with the kernels the executor chooses: layers computed from
host RAM with packed weights, in fp32 or bf16, run the fused C++ layer (offload.kernels.layer; its handles are the
WeightStore's), runs of them back to back in one call; everything else runs the reference block math of
offload.model.llama, a layer chunk by chunk over a long prefill. It keeps the fused layer's views of the KV caches
and its table of each step. The PlacedModel decides what runs where and when; the runner only computes."""

from __future__ import annotations

import torch

from offload.formats import F32_KERNEL_ROWS
from offload.kernels import layer as fused
from offload.model.llama import layer_forward
from offload.model.step import LayerKV, Step
from offload.model.units import unit_forward
from offload.profile.timeline import Timeline
from offload.runtime.backends.base import Backend
from offload.runtime.host_kv import HostKVAttention
from offload.runtime.weight_store import WeightStore
from offload.spec import ModelSpec


class UnitRunner:
    """Computes units for a PlacedModel: on the device (launched by the backend) or on the host (on its CPU
    worker)."""

    def __init__(self, spec: ModelSpec, store: WeightStore, backend: Backend, dtype: torch.dtype, fuse: bool,
                 prefill_chunk_tokens: int):
        self.spec, self.store, self.backend, self.dtype, self.fuse = spec, store, backend, dtype, fuse
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self._kv_views: dict[int, fused.KVView | None] = {}  # id(LayerKV) -> the fused layer's view of it
        self._runs: dict[tuple, fused.FusedRun] = {}  # units computed back to back -> their run (this cache's)

    def attach_cache(self, cache: list[LayerKV]) -> None:
        """A new KV cache: the fused layer's view of each of its layers, made once per cache."""
        self._kv_views = {id(kv): fused.kv_view(kv) for kv in cache} if self.fuse else {}
        self._runs.clear()  # they hold the caches' views

    def host_layers(self, x, names, step: Step, kvs: list[LayerKV], steps: dict, ends: list[float]):
        """Layers in host RAM back to back: through the fused C++ layer when all of them can, else one by one (a
        MoE model's layers and experts units alternate: one by one, each through its own C++ call where it can)."""
        run = self._runs.get(names)
        if run is not None and self._runs_again(run, x, step, kvs):  # the steps after the first: nothing to look up
            return fused.run_fused(run, x, {k: self._step_table(step, v, steps) for k, v in
                                            zip(run.keys, run.key_views)}, ends)
        layers = [self._fused(self.store.fused_layers.get(n), x) for n in names]
        views = self._fused_views(kvs, x, step) if self.fuse and all(layers) and any(kv is not None for kv in kvs) \
            else None
        if views is not None and len(self._chunks(x, step)) == 1:  # every unit in one C++ call
            if run is None or not run.holds(layers, views):
                run = self._runs[names] = fused.fused_run(layers, views)
            tables = [None if v is None else self._step_table(step, v, steps) for v in views]
            return fused.run_fused(run, x, tables, ends)
        for name, kv in zip(names, kvs):
            w = self.store.host_weights[name]
            x = self._layer(x, name, w, step, kv, steps, False) if kv is not None else \
                self.compute(x, name, w, step, None, steps, False)
            ends.append(Timeline.now())
        return x

    def _runs_again(self, run, x, step: Step, kvs: list) -> bool:
        """Whether run takes this pass as host_layers' checks would find: fused, its handles and caches as they were
        (rings that fit the step, dense fp32 linears over few enough tokens), one chunk."""
        return self.fuse and run.of_caches(kvs) and x.dtype in fused.ACTIVATIONS and \
            all(self._fused(u, x) is not None for u in run.layers if getattr(u, "dense", False)) and \
            (all(v is None or v.ring is None for v in run.views) or fused.ring_fits(step)) and \
            len(self._chunks(x, step)) == 1

    @staticmethod
    def _fused(handle, x):
        """handle where it runs this pass: one with dense fp32 linears only up to F32_KERNEL_ROWS tokens (torch's
        matmul is the faster one for more)."""
        if handle is None or not getattr(handle, "dense", False):
            return handle
        return handle if x.numel() <= F32_KERNEL_ROWS * x.shape[-1] else None

    def _fused_views(self, kvs: list[LayerKV | None], x, step: Step) -> list | None:
        """The fused layer's views of these caches (None for a unit without one: experts, a split-off MLP), or None
        where the activations or a cache do not suit it (a ring's, a step with too many new tokens a sequence)."""
        if x.dtype not in fused.ACTIVATIONS or \
                (any(getattr(kv, "ring", None) is not None for kv in kvs) and not fused.ring_fits(step)):
            return None
        views = [self._kv_views.get(id(kv)) for kv in kvs]
        views = [v if v is not None and v.kv is kv else fused.kv_view(kv) if kv is not None else None
                 for v, kv in zip(views, kvs)]
        return views if all(v is not None for v, kv in zip(views, kvs) if kv is not None) else None

    def _step_table(self, step: Step, view, steps: dict):
        """The fused layer's table of this step for caches like view (made once per step, chunk and cache shape,
        shared by every fused layer of that shape)."""
        key = ("fused_table", id(step), view.key)
        if key not in steps:
            steps[key] = fused.step_table(self.spec, step, view)
        return steps[key]

    def compute_cpu(self, x, name: str, w, step: Step, cache, steps: dict, ends: list[float]):
        y = self.compute(x, name, w, step, cache, steps, False)
        ends.append(Timeline.now())
        return y

    def compute(self, x, name: str, w, step: Step, cache, steps: dict, on_device: bool):
        """One unit's block math; a layer goes through _layer."""
        kind, index = self.store.kind_index[name]
        if kind in ("experts", "mlp") and not on_device and self.fuse and x.dtype in fused.ACTIVATIONS:
            handle = self._fused(self.store.fused_layers.get(name) or self.store.fused_handle(name, w), x)  # read from disk: made for this use
            if handle is not None:
                return fused.fused_experts_forward(handle, x)
        if kind != "layer":
            return unit_forward(self.spec, kind, w, x, None, None, self.dtype)
        return self._layer(x, name, w, step, cache[index], steps, on_device)

    def _chunks(self, x, step: Step, cap: int | None = None) -> list[tuple[int, int]]:
        """Token ranges a layer computes at once: at most the planned chunk of tokens (a ragged step's flat
        tokens; a plain step's prefill in columns of chunk / rows), and at most cap (a fused ring layer's)."""
        b, s = x.shape[0], x.shape[1]
        if step.groups is not None:
            width = max(1, min(self.prefill_chunk_tokens, cap or self.prefill_chunk_tokens))
        else:
            width = max(1, min(self.prefill_chunk_tokens // max(b, 1), cap or self.prefill_chunk_tokens))
            if step.phase != "prefill":
                return [(0, s)]
        if s <= width:
            return [(0, s)]
        return [(a, min(a + width, s)) for a in range(0, s, width)]

    def _layer(self, x, name: str, w, step: Step, kv: LayerKV, steps: dict, on_device: bool):
        """One layer over a pass, chunk by chunk (each chunk's keys include the chunks before it; a CPU layer whose
        cache is a ring, in chunks the fused layer takes)."""
        ring = kv is not None and kv.ring is not None and self.fuse and not on_device
        chunks = self._chunks(x, step, fused.ring_chunk() if ring else None)
        if len(chunks) == 1:
            return self._layer_chunk(x, name, w, self._step_on(step, on_device, steps), kv, steps, on_device)
        parts = []
        for a, b in chunks:
            key = ("slice", a, b, on_device)
            if key not in steps:
                steps[key] = self._step_on(step, on_device, steps).slice(a, b)
            parts.append(self._layer_chunk(x[:, a:b], name, w, steps[key], kv, steps, on_device))
        return torch.cat(parts, dim=1)

    def _step_on(self, step: Step, on_device: bool, steps: dict) -> Step:
        key = ("step", on_device)
        if key not in steps:
            steps[key] = step.to(self.backend.device, self.backend.upload) if on_device else step
        return steps[key]

    def _layer_chunk(self, x, name: str, w, step: Step, kv: LayerKV, steps: dict, on_device: bool):
        """The fused C++ layer for a CPU layer where it can run; else the reference block math, with the fused
        layer's attention where the cache is in host RAM: a CPU layer's (weights the fused layer cannot take: float
        ones through torch), and a device layer's (runtime/host_kv.py: decode-like groups attend on the host, prompt
        chunks on the device)."""
        index = self.store.kind_index[name][1]
        attention, moe = None, self.spec.hands_over(index)
        if not on_device and self.fuse:  # a layer read from disk has its fused view made for this use
            handle = self._fused(self.store.fused_layers.get(name) or self.store.fused_handle(name, w), x)
            views = self._fused_views([kv], x, step)
            if handle is not None and views is not None:
                return fused.fused_layers_forward([handle], x, self._step_table(step, views[0], steps), views)
            if views is not None and fused.HAS_CACHED_ATTENTION:
                attention = self._attention(self._step_table(step, views[0], steps), views[0], index, w.sinks)
        elif on_device and self.fuse and fused.HAS_CACHED_ATTENTION and step._host is not None and \
                kv.k.device.type == "cpu" and not self.spec.variant.layer_windows and w.sinks is None:
            # host_kv.py knows neither a layer's window nor sinks
            views = self._fused_views([kv], x, step)
            if views is not None:
                attention = HostKVAttention(self.spec, self.backend, step, kv, views[0],
                                            lambda s, view: self._step_table(s, view, steps))
        return layer_forward(self.spec, w, x, step, kv, attention, moe, index)

    def _attention(self, table, view, index: int, sinks):
        """The fused layer's attention over a host cache for layer index's qkv [N, q | k | v] in whatever float
        format (sinks: the layer's, gpt-oss's, or None): computed in fp32, the output as qkv was."""
        def attention(qkv: torch.Tensor) -> torch.Tensor:
            return fused.cached_attention(self.spec, qkv.to(torch.float32).contiguous(), table, view,
                                          index=index, sinks=sinks).to(qkv.dtype)
        return attention

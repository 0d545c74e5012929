"""Executor: runs the block loop by a Placement across device-resident, streamed, CPU and disk units.

The loop is written once against Backend. For each unit in order (embed, layers, norm, lm_head):
acquire its weights (resident / staging slot / host buffer / read-ahead buffer), move the hidden state to
where it computes, compute, release. The Streamer (runtime/streamer.py) issues the copies into the staging slots
and the disk reads by the plan's schedule, so copies run under compute, the CPU blocks' included.
Consecutive layers held and computed in host RAM have nothing to acquire or release: they run as one group,
back to back, each still timed as a unit. Every device interaction goes through the backend (launch, run_cpu,
to_device / to_host, copies and events), so the simulated device runs this same loop.

Three parts do the work: the WeightStore (runtime/weight_store.py) places the weights and allocates the buffers
the Placement sized (a unit that would not fit them is an error, not a larger buffer), the Streamer replays the
schedule's copies, and the UnitRunner (runtime/unit_runner.py) computes each unit with the kernels the executor
chooses (the fused C++ layer for host-RAM layers where it can run, else the reference block math). PlacedModel
wires them and runs the loop.
"""

from __future__ import annotations

import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from offload.errors import PlanError
from offload.kernels import layer as fused
from offload.model.step import LayerKV, Step, layer_cache, make_step
from offload.planner.placement import Placement
from offload.planner.types import PHASES
from offload.profile.timeline import Span, Timeline
from offload.runtime.backends.base import Backend, Work
from offload.runtime.streamer import Streamer
from offload.runtime.unit_runner import UnitRunner
from offload.runtime.threads import ThreadGovernor
from offload.runtime.unit_store import materialize
from offload.runtime.weight_store import WeightStore
from offload.spec import ModelSpec


class PlacedModel:
    """A model whose units sit where a Placement says; same interface as the resident Model."""

    def __init__(self, spec: ModelSpec, source, placement: Placement, backend: Backend,
                 dtype: torch.dtype = torch.float32, disk_dir: str | Path | None = None, fuse: bool | None = None,
                 kv_dtype: torch.dtype | None = None, shared: dict | None = None):
        """fuse: run host-RAM layers through the fused C++ layer (None: wherever the kernels and dtype allow);
        kv_dtype: the KV cache's (None: dtype's); shared: device-resident units another model holds (WeightStore)."""
        self.spec, self.placement, self.backend, self.dtype = spec, placement, backend, dtype
        self.kv_dtype = kv_dtype or dtype
        fuse = backend.computes and fused.FUSABLE and dtype in fused.ACTIVATIONS if fuse is None else fuse
        fuse = fuse and fused.runs_math_of(spec)  # a family whose math the C++ layer lacks: the reference math
        self.units = spec.units()
        self.order = [u.name for u in self.units]
        if set(self.order) != set(placement.units):
            raise PlanError(f"the placement places units {sorted(set(placement.units) - set(self.order))[:3]} this "
                            f"model does not have, or misses {sorted(set(self.order) - set(placement.units))[:3]}; "
                            f"run a plan with the spec it placed (offload.planner.plan_spec)")
        self._cpu = torch.device("cpu")
        self.store = WeightStore(spec, source, placement, backend, fuse, disk_dir, shared)
        store = self.store
        self.runner = UnitRunner(spec, store, backend, dtype, fuse, placement.prefill_chunk_tokens)
        self.layouts, self.resident, self.host_buffers = store.layouts, store.resident, store.host_buffers
        self.host_weights, self.disk, self.fused_layers = store.host_weights, store.disk, store.fused_layers
        self._embed_rows, self._in_place, self.ring, self.reader = store.embed_rows, store.in_place, store.ring, \
            store.reader
        self._cpu_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="offload-cpu")
        self._overlap = self.ring is not None or self.reader is not None
        on_disk = [n for n in self.order if placement[n].weights == "disk" and n not in self._embed_rows
                   and n not in self._in_place]
        self.streamer = Streamer(backend, placement, self.order, self.layouts, self.host_buffers, self.ring,
                                 self.reader, on_disk)
        self._schedule = {phase: self._group_host_layers(phase) for phase in PHASES}
        # each unit's kind, index and whether its KV cache is in host RAM, looked up once (a step's Work of each)
        self._unit_facts = {n: (*store.kind_index[n], placement[n].kv == "cpu") for n in self.order}
        self._kv_bytes: dict[str, int] = {}
        self.threads = ThreadGovernor(torch.get_num_threads(), enabled=None if backend.computes else False)
        self._step_began = 0.0
        self._held = None  # the lm_head's weights kept for more rows of the step (logits(more=True))
        self._logit_rows = 0  # rows of the step's logits so far
        self._samples = True  # whether the step computes logits (runs the lm_head)
        self._embed_name = next(u.name for u in self.units if u.kind == "embed")
        self._embed_from: PlacedModel | None = None  # whose embedding looks tokens up (share_embedding)
        self.backend.order_after_allocations()
        self._closer = weakref.finalize(self, backend.close)  # pinned registrations end before buffers are freed

    @property
    def fuse(self) -> bool:
        """Whether host-RAM layers run through the fused C++ layer (fp32 or bf16 compute; False: the reference
        block math for every layer, as tests compare)."""
        return self.runner.fuse

    @fuse.setter
    def fuse(self, value: bool) -> None:
        self.runner.fuse = value and fused.runs_math_of(self.spec)

    @property
    def timeline(self) -> Timeline:
        return self.backend.timeline

    def now(self) -> float:
        """The backend's clock (simulated time on a simulated device)."""
        return self.backend.now()

    def close(self) -> None:
        """Release what the backend holds for this model (pinned registrations); the model is unusable after."""
        self._closer()

    def flush(self) -> None:
        """Wait for the device's queued work and resolve its timings (end of a run, not per step)."""
        self.backend.synchronize()

    def _group_host_layers(self, phase: str) -> list[str | tuple[str, ...]]:
        """The units before the lm_head in order, runs of consecutive layers (and MoE experts units) whose weights
        live in host RAM and compute there grouped in tuples: they have nothing to acquire or release, so they run
        back to back. The final norm ends the run before it where the store has its C++ view (fp32 weights). A run
        starts at a layer: experts (or a split-off MLP) whose attention part computes elsewhere run alone."""
        schedule: list = []
        for name in self.order[:-1]:
            p, kind = self.placement[name], self.store.kind_index[name][0]
            held = p.weights == "cpu" or name in self._in_place
            ends_run = kind == "norm" and name in self.fused_layers and self.dtype is torch.float32 and schedule \
                and isinstance(schedule[-1], tuple)
            starts = not schedule or not isinstance(schedule[-1], tuple)
            if starts and kind in ("experts", "mlp"):  # its attention part computed elsewhere: a unit of its own
                schedule.append(name)
            elif (kind in ("layer", "experts", "mlp") or ends_run) and held and p.mode(phase) == "cpu":
                if starts:
                    schedule.append(())
                schedule[-1] += (name,)
            else:
                schedule.append(name)
        return schedule

    # the interface the Generator uses -----------------------------------------------------------------
    def new_cache(self, batch: int, max_len: int, n_rings: int | None = None) -> list[LayerKV]:
        """A KV cache per layer, each where its layer decodes; replaces (and un-counts) the previous one. n_rings:
        the sequences a pooled row holds at once (a ring layer keeps a ring for each; None: a row is one)."""
        for tier, n in self._kv_bytes.items():
            self.backend.free(tier, n)
        self._kv_bytes = {}
        s, cache = self.spec, []
        for i in range(s.n_layers):
            tier = self.placement[f"layer.{i}"].kv or "cpu"
            device = self.backend.meta_or(self.backend.device if tier == "gpu" else "cpu")
            kv = layer_cache(s, i, batch, max_len, self.kv_dtype, device, n_rings)
            self.backend.track(tier, kv.nbytes)
            self._kv_bytes[tier] = self._kv_bytes.get(tier, 0) + kv.nbytes
            cache.append(kv)
        self.runner.attach_cache(cache)
        self.backend.order_after_allocations()
        return cache

    def make_step(self, positions, valid, trash_slot: int, rows=None, phase: str = "prefill") -> Step:
        return make_step(self.spec, self.dtype, positions, valid, trash_slot, rows, phase)

    def forward(self, tokens: torch.Tensor, step: Step, cache: list[LayerKV], logits: bool = True) -> torch.Tensor:
        """Hidden states [B, S, D] after the final norm (on the host). logits: whether logits() follows for this step
        (False: a prefill pass that ends no prompt; the lm_head is then neither copied nor read)."""
        n_threads = self.threads.threads_for(step.phase)
        if n_threads != torch.get_num_threads():
            torch.set_num_threads(n_threads)
        self._step_began = time.perf_counter()
        self._begin_step(step.phase, logits)
        steps: dict = {}  # the step on each device, and the fused layer's table of it
        x = tokens
        with self.backend.compute_context():
            for unit in self._schedule[step.phase]:
                if isinstance(unit, tuple):
                    x = self._run_host_layers(unit, x, step, cache, steps)
                else:
                    x = self._run(unit, x, step.phase, step, cache, steps)
            return self.backend.to_host(x)

    def logits(self, hidden: torch.Tensor, more: bool = False) -> torch.Tensor:
        """fp32 logits [..., V] on the host; ends the step begun by forward(), unless more rows of the step
        follow (more=True: the lm_head, read or copied once per step, is kept for them)."""
        if not self._samples:
            raise RuntimeError("logits() after forward(..., logits=False): that step's lm_head is neither copied nor "
                               "read; pass logits=True to forward() for a step whose logits are wanted")
        with self.backend.compute_context():
            out = self.backend.to_host(self._run("lm_head", hidden, self._phase, None, None, {}, keep=more)).float()
        self._logit_rows += hidden.numel() // hidden.shape[-1]
        if not more:  # the step's time over all the rows it sampled
            self.threads.observe(self._phase, time.perf_counter() - self._step_began, self._logit_rows)
            self._logit_rows = 0
        return out

    # the schedule -------------------------------------------------------------------------------------
    def prepare_step(self, phase: str, samples: bool = True) -> None:
        """Issue the next step's first copies and disk reads before it begins (Streamer.prepare): the caller has
        work of its own first, a draft's steps, which they run under."""
        self.streamer.prepare(phase, samples)

    def host_worked(self, seconds: float) -> None:
        """The host worked seconds on its own between steps (a draft's steps, on the draft's clock): a simulated
        device's clock moves on by that (a real one did), so the copies and reads issued before run under it."""
        self.backend.host_wait_until(self.backend.now() + seconds)

    def _begin_step(self, phase: str, samples: bool) -> None:
        self._phase, self._samples = phase, samples
        self.backend.collect()  # the finished work's timings: a job's events do not pile up until its end
        self.streamer.begin_step(phase, samples)

    def _acquire(self, name: str, phase: str):
        """(weights, on_device) for unit name in this phase."""
        p = self.placement[name]
        mode = p.mode(phase)
        if mode == "gpu":
            return self.resident[name], True
        if mode == "stream":
            return self.streamer.acquire(name, phase), True
        if p.weights == "cpu" or name in self._in_place:
            return self.host_weights[name], False
        return materialize(self.layouts[name], self.streamer.read(name), on_device=False), False

    def _release(self, name: str, phase: str) -> None:
        p = self.placement[name]
        mode = p.mode(phase)
        if mode == "stream":
            self.streamer.release(name, phase)
        elif mode == "cpu" and p.weights == "disk" and name not in self._in_place:
            self.reader.release(name)

    def share_embedding(self, other: "PlacedModel") -> None:
        """Look tokens up in other's embedding from now on, and let this model's own copy go: a substitute draft's
        embedding is its model's (the planner left it out of the draft's bytes)."""
        name, self._embed_from = self._embed_name, other
        if self.host_weights.pop(name, None) is not None:
            self.backend.free("cpu", self.layouts[name].n_bytes)
        self.host_buffers.pop(name, None)

    def look_up(self, tokens: torch.Tensor, phase: str, step: Step) -> torch.Tensor:
        """The embedding of tokens, as this model's step computes it (for a model that shares it)."""
        return self._run(self._embed_name, tokens, phase, step, None, {})

    def _run(self, name: str, x, phase: str, step: Step | None, cache, steps: dict, keep: bool = False):
        """Acquire, compute and release one unit; step and cache are None for the lm_head. keep: hold the unit
        for another call of this step (the lm_head over more rows), released by the last one."""
        if name == self._embed_name and self._embed_from is not None:
            return self._embed_from.look_up(x, phase, step)
        work = self._works((name,), phase, step, x)[0]
        if name in self._embed_rows:
            rows, ids = self._embedding_rows(name, x, phase)
            return self._on_cpu([work], self.runner.compute_cpu, ids, name, rows, step, cache, steps)
        held, self._held = self._held, None
        weights, on_device = held if held is not None else self._acquire(name, phase)
        if on_device:
            y = self.backend.launch(work, self.runner.compute, self.backend.to_device(x), name, weights, step, cache,
                                    steps, True)
        else:
            y = self._on_cpu([work], self.runner.compute_cpu, self.backend.to_host(x), name, weights, step, cache, steps)
        if keep:
            self._held = (weights, on_device)
        else:
            self._release(name, phase)
        return y

    def _embedding_rows(self, name: str, tokens: torch.Tensor, phase: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of a disk embedding these tokens look up, read from its file, and the tokens as indices into
        them."""
        entry = self.layouts[name].entries[0]
        ids, inverse = torch.unique(tokens.reshape(-1), return_inverse=True)
        row_bytes = entry.n_bytes // entry.shape[0]
        start = self.backend.now()
        raw = self.disk.read_rows(name, ids, row_bytes)
        self.timeline.add(Span("disk_read", phase, name, start, self.backend.now(), n_bytes=raw.numel()))
        return raw.view(entry.dtype).view(len(ids), entry.shape[1]), inverse.view(tokens.shape)

    def _works(self, names, phase: str, step: Step | None, x) -> list[Work]:
        if step is None:  # the lm_head over hidden rows [..., D]
            n_tokens = x.numel() // x.shape[-1]
            return [Work(name, self._unit_facts[name][0], phase, n_tokens, n_tokens) for name in names]
        n_tokens, n_seqs, n_keys, facts = step.n_tokens, step.n_seqs, step.n_keys, self._unit_facts
        return [Work(name, kind, phase, n_tokens, n_seqs, n_keys, kind == "layer" and kv_on_host)
                for name, (kind, _, kv_on_host) in zip(names, map(facts.__getitem__, names))]

    def _on_cpu(self, works: list[Work], fn, x, *args):
        """CPU blocks through the backend; on a worker thread when copies or reads run alongside. They wait for the
        device's output, so the streamer's launched disk units give their read buffers back first (at no cost)."""
        self.streamer.settle()
        if self._overlap:
            return self._cpu_pool.submit(self.backend.run_cpu, works, fn, x, *args).result()
        return self.backend.run_cpu(works, fn, x, *args)

    def _run_host_layers(self, names: tuple[str, ...], x, step: Step, cache, steps: dict):
        """Compute consecutive layers held and computed in host RAM, timing each one as a unit of its own."""
        kvs = [cache[i] if kind == "layer" else None for kind, i, _ in map(self._unit_facts.__getitem__, names)]
        works = self._works(names, step.phase, step, x)
        return self._on_cpu(works, self.runner.host_layers, self.backend.to_host(x), names, step, kvs, steps)

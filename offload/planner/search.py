"""The planner's search: candidate placements, per-phase stream-or-CPU choices, disk spill.

plan(spec, hardware, budget, workload) searches the number of GPU-resident units (in order of time saved
per byte: planner/residents.py says which counts it weighs); for each, it decides per phase which offloaded units
stream to the GPU and which compute on the CPU (planner/streams.py), with the KV caches on the GPU or in host RAM,
spills host weights to disk when RAM is short (planner/spill.py), and keeps the candidate with the shortest job
time; then the staging depth about it. Pure arithmetic: no torch. planner/shortfall.py says what to change when
nothing fits.
"""

from __future__ import annotations

import copy
import functools
import math
from bisect import bisect_right
from dataclasses import dataclass, replace
from pathlib import Path

from offload.errors import ConfigError, PlanError
from offload.formats import AS_STORED, QUANT_BLOCK_BYTES, WEIGHT_FORMATS, is_quantized
from offload.hardware import HardwareProfile
from offload.planner.costs import (ACT_BYTES_CPU, ACT_BYTES_GPU, PhaseCost, cost_kin, cpu_path, hop_s, main_format,
                                   phases_for, price_step, unit_cost, workspace_bytes)
from offload.planner.residents import weigh_again, weigh_counts
from offload.planner.shortfall import Shortfall
from offload.planner.spill import HostMemory
from offload.planner.streams import STREAMABLE, StreamChoice
from offload.planner.types import DEFAULT_PREFETCH_DEPTH, PHASES, Budget, Plan, TierUsage, UnitPlan, Workload
from offload.spec import ModelSpec, UnitSpec

HOST_KV_SHARE = 0.1  # the KV cache's share of the GPU budget from which plans with it in host RAM are weighed


@functools.lru_cache(maxsize=4)
def _units(spec: ModelSpec) -> tuple[tuple[UnitSpec, ...], list[int], list[UnitSpec]]:
    """spec's units; for each, the number it shares with the units alike (costs.cost_kin: the layers of one window,
    the experts units: sized and priced once); one unit of each such number. Kept for the several plans of one
    model (plan_best_batch, the staging depths, what-ifs)."""
    units, ids, kin, alike = spec.units(), {}, [], []
    for u in units:
        key = cost_kin(spec, u)
        if key not in ids:
            ids[key] = len(alike)
            alike.append(u)
        kin.append(ids[key])
    return units, kin, alike


@dataclass
class _Candidate:
    """A placement under construction (mutable; frozen into a Plan at the end)."""

    weight: list[str]
    compute: dict[str, list[str]]
    use_gpu: bool
    staging_slot: int = 0
    gpu_fixed: int = 0  # margin + workspace + resident weights + GPU KV
    cached: frozenset[int] = frozenset()  # disk units the page cache keeps between reads
    short: tuple[str, int, int] | None = None  # (tier, needed, allowed) when it does not fit
    residents: int = 0  # how many units of the residency order are on the GPU
    host_kv: bool = False  # every layer's KV cache in host RAM; GPU layers' decode attention on the CPU
    decode_kinds: tuple[str, ...] = STREAMABLE  # the kinds that may stream in decode


class Search(StreamChoice, HostMemory):
    """Holds the per-unit costs of one planning problem and evaluates candidate placements."""

    def __init__(self, spec: ModelSpec, hw: HardwareProfile, budget: Budget, workload: Workload,
                 fmt: str, depth: int):
        self.spec, self.hw, self.budget, self.wl, self.fmt, self.depth = spec, hw, budget, workload, fmt, depth
        self.units, self.kin, self.alike = _units(spec)  # alike units share a small number (kin)
        self.n = len(self.units)
        kinds = self.kinds = [u.kind for u in self.units]
        self.path = cpu_path(main_format(spec, fmt), workload.compute_format)
        self.i_embed, self.i_norm, self.i_head = kinds.index("embed"), kinds.index("norm"), kinds.index("lm_head")
        self.streamable = [i for i, k in enumerate(kinds) if k in STREAMABLE]
        compute = workload.compute_format
        self.w = self._per_unit(lambda u: u.nbytes(fmt, compute))
        self.stored = self._per_unit(lambda u: "+".join(u.held_formats(fmt, compute)))
        self.buf = self._per_unit(lambda u: u.buffer_bytes(fmt, compute))  # what a slot or read buffer holds
        self.kv = self._per_unit(lambda u: spec.pool_kv_bytes(workload.batch_size, workload.seq_len,
                                                               workload.kv_elem_bytes, u.index)
                                 if u.kind == "layer" else 0)  # a ring layer's by its ring, any other's in blocks
        self.phase = dict(zip(PHASES, phases_for(workload.batch_size, workload.prompt_len, workload.gen_len,
                                                 workload.prefill_pass_tokens)))
        kv = workload.kv_format
        self.cost = {p: self._per_unit(lambda u, ph=ph: unit_cost(spec, u, fmt, hw, ph, compute, kv))
                     for p, ph in self.phase.items()}
        # Plain float lists per phase: the search reads them many times.
        self.gpu_s = {p: [c.gpu_s for c in cs] for p, cs in self.cost.items()}
        self.cpu_s = {p: [c.cpu_s for c in cs] for p, cs in self.cost.items()}
        self.gain_order = {p: self._gain_order(p) for p in PHASES}
        self.hop = {p: hop_s(spec, hw, ph) for p, ph in self.phase.items()}
        self.gpu_possible = hw.has_gpu and budget.gpu_bytes > 0
        self.ws_gpu = workspace_bytes(spec, workload, ACT_BYTES_GPU, is_quantized(main_format(spec, fmt)))
        self.ws_cpu = workspace_bytes(spec, workload, ACT_BYTES_CPU, False)
        chunk = min(workload.batch_size * workload.prompt_len, workload.prefill_chunk_tokens)
        width = 2 if spec.moe or spec.split_mlp else 1  # an attention part hands on [residual | normed hidden]
        self.hop_buffers = 2 * chunk * width * spec.hidden_size * ACT_BYTES_CPU
        self.order = self._residency_order()
        self.resident_bytes = {host_kv: self._resident_bytes(host_kv) for host_kv in (False, True)}
        self.slot_after = (self._slot_after(min), self._slot_after(max))
        # KV in host RAM frees VRAM for weights but moves decode attention to the CPU: weighed where the KV cache
        # takes a real share of the GPU budget
        self.host_kv_may_pay = self.gpu_possible and sum(self.kv) > HOST_KV_SHARE * budget.gpu_bytes

    def _per_unit(self, value) -> list:
        """value(unit) for each unit, computed once for units alike."""
        table = [value(u) for u in self.alike]
        return [table[k] for k in self.kin]

    def _gain_order(self, phase: str) -> list[int]:
        """Streamable units where the GPU beats the CPU, by compute saved per PCIe second (best first)."""
        cs = self.cost[phase]
        gain = [i for i in self.streamable if cs[i].cpu_s > cs[i].gpu_s and cs[i].pcie_s < math.inf]
        return sorted(gain, key=lambda i: (cs[i].cpu_s - cs[i].gpu_s) / cs[i].pcie_s, reverse=True)

    def _residency_order(self) -> list[int]:
        """Units by time saved per byte when made GPU-resident (norm follows lm_head, embed comes last)."""
        def saving(i: int) -> float:
            total = 0.0
            for p, weight in (("prefill", 1), ("decode", self.wl.gen_len)):
                c = self.cost[p][i]
                offloaded = min(c.cpu_s, max(c.gpu_s, c.pcie_s))
                total += weight * (offloaded - c.gpu_s)
            return total / max(self.w[i] + self.kv[i], 1)

        first = {}  # one unit of each kin: alike units save alike
        for i in self.streamable:
            first.setdefault(self.kin[i], i)
        by_kin = {k: saving(i) for k, i in first.items()}
        # stable: the layers keep their index order
        ranked = sorted(self.streamable, key=lambda i: by_kin[self.kin[i]], reverse=True)
        return ranked + [self.i_embed]

    def run(self) -> Plan:
        """The best candidate's Plan; PlanError (a Shortfall, with what to change) if none fits."""
        tally = weigh_counts(self)
        if tally.best is None:
            raise Shortfall(self, tally.shorts)
        return self.plan_of(tally.best)

    def plan_of(self, best: _Candidate) -> Plan:
        """The Plan of a candidate, priced with its copies' overlap."""
        self.chosen = best
        return self._freeze(best, self._phase_cost("prefill", best), self._phase_cost("decode", best))

    def at_depth(self, depth: int) -> Search:
        """This search with `depth` staging slots and read-ahead buffers (nothing else it holds depends on them)."""
        other = copy.copy(self)
        other.depth = depth
        return other

    def _build(self, k: int, use_gpu: bool, decode_kinds: tuple[str, ...] = STREAMABLE,
               host_kv: bool = False) -> _Candidate:
        """The candidate with the first k units of the residency order on the GPU, streaming in decode only
        units of decode_kinds; host_kv: with every layer's KV cache in host RAM."""
        weight = ["cpu"] * self.n
        for i in self.order[:k]:
            weight[i] = "gpu"
        weight[self.i_norm] = weight[self.i_head]
        cand = _Candidate(weight, {p: list(weight) for p in PHASES}, use_gpu, residents=k, host_kv=host_kv,
                          decode_kinds=decode_kinds)
        if use_gpu:
            cand.gpu_fixed = self._gpu_fixed(k, host_kv)
            if cand.gpu_fixed > self.budget.gpu_bytes:
                cand.short = ("gpu", cand.gpu_fixed, self.budget.gpu_bytes)
                return cand
            self._choose_streams(cand, decode_kinds)
        self._place_host_weights(cand)
        return cand

    def _gpu_fixed(self, k: int, host_kv: bool) -> int:
        """GPU bytes of the first k units of the residency order (their KV caches too, unless host_kv) beside the
        margin, the workspace and what the device reserves."""
        return (self.budget.margin_bytes("gpu") + self.ws_gpu + self.hw.gpu_reserved_bytes
                + self.resident_bytes[host_kv][k])

    def _resident_bytes(self, host_kv: bool) -> list[int]:
        """Bytes of the first k units of the residency order, for each k (the norm with the lm_head)."""
        kv = [0] * self.n if host_kv else self.kv
        total, out = 0, [0]
        for i in self.order:
            total += self.w[i] + kv[i] + (self.w[self.i_norm] + kv[self.i_norm] if i == self.i_head else 0)
            out.append(total)
        return out

    def most_residents(self, host_kv: bool) -> int:
        """The largest count of residents whose GPU bytes fit (-1: not even none's)."""
        room = self.budget.gpu_bytes - self._gpu_fixed(0, host_kv)
        return bisect_right(self.resident_bytes[host_kv], room) - 1 if room >= 0 else -1

    def staging_bounds(self, top: int, host_kv: bool) -> list[int]:
        """The largest counts (at most top) that leave room for `depth` staging slots of the smallest and of the
        largest offloaded unit: past the first nothing streams, past the second not every unit may."""
        out, room = [], self.budget.gpu_bytes - self._gpu_fixed(0, host_kv)
        for slot in self.slot_after:
            fits = [k for k, (resident, size) in enumerate(zip(self.resident_bytes[host_kv][:top + 1], slot))
                    if size and resident + self.depth * size <= room]
            out += fits[-1:]
        return out

    def _slot_after(self, pick) -> list[int]:
        """pick (min or max) of the staging slots of the streamable units left offloaded by each count (0: none)."""
        out, slot = [0], 0
        for i in reversed(self.order):
            if self.kinds[i] in STREAMABLE:
                slot = pick(slot, self.buf[i]) if slot else self.buf[i]
            out.append(slot)
        return out[::-1]

    def _phase_cost(self, phase: str, cand: _Candidate, overlap: bool = True) -> PhaseCost:
        """Busy seconds per resource in one step of phase, overlapped into the step time."""
        return price_step(self.spec, self.hw, self.phase[phase], self.cost[phase], self.kinds, cand.compute[phase],
                          cand.compute["decode"], cand.weight, self.depth, self.path, steady=phase == "decode",
                          cached=cand.cached, host_kv=self._host_kv(cand), overlap=overlap)

    def _host_kv(self, cand: _Candidate) -> frozenset[int]:
        """The GPU-computed layers whose KV cache is in host RAM."""
        if not cand.host_kv:
            return frozenset()
        return frozenset(i for i in range(self.n) if self.kinds[i] == "layer" and cand.compute["decode"][i] != "cpu")

    def _freeze(self, cand: _Candidate, pre, dec) -> Plan:
        units, mode = [], cand.compute
        for i, u in enumerate(self.units):
            kv_tier = ("cpu" if mode["decode"][i] == "cpu" or cand.host_kv else "gpu") if u.kind == "layer" else None
            units.append(UnitPlan(u.name, u.kind, u.index, cand.weight[i], mode["prefill"][i], mode["decode"][i],
                                  kv_tier, self.w[i], self.kv[i], i in cand.cached, self.stored[i]))
        n_streamed = sum("stream" in (u.prefill, u.decode) for u in units)
        depth = min(self.depth, n_streamed)  # copies run this many streamed units ahead
        in_place = self._in_place(cand)
        read_ahead = self.depth if self._disk_reads(cand.weight, in_place) else 0  # units read ahead at most
        tiers = (self._gpu_tier(cand, units, depth), self._cpu_tier(cand, units), self._disk_tier(units))
        return Plan(self._model_name(), self.hw.name, self.fmt, self.wl, self.budget, tuple(units),
                    tiers, pre, dec, depth, cand.staging_slot if depth else 0, read_ahead,
                    self._read_ahead(cand.weight, in_place), self._notes(cand), self.spec.split_mlp)

    def _gpu_tier(self, cand: _Candidate, units: list[UnitPlan], depth: int) -> TierUsage:
        if not cand.use_gpu:
            return TierUsage("gpu", self.budget.gpu_bytes)
        return TierUsage("gpu", self.budget.gpu_bytes,
                         weights_bytes=sum(u.weight_bytes for u in units if u.weight_tier == "gpu"),
                         kv_bytes=sum(u.kv_bytes for u in units if u.kv_tier == "gpu"),
                         workspace_bytes=self.ws_gpu, staging_bytes=depth * cand.staging_slot,
                         margin_bytes=self.budget.margin_bytes("gpu"), reserved_bytes=self.hw.gpu_reserved_bytes)

    def _cpu_tier(self, cand: _Candidate, units: list[UnitPlan]) -> TierUsage:
        any_cpu = any("cpu" in (u.prefill, u.decode) for u in units if u.kind != "norm")
        return TierUsage("cpu", self.budget.cpu_bytes,
                         weights_bytes=sum(u.weight_bytes for u in units if u.weight_tier == "cpu"),
                         kv_bytes=sum(u.kv_bytes for u in units if u.kv_tier == "cpu"),
                         workspace_bytes=self.ws_cpu if any_cpu else 0, pinned_bytes=self._pinned(cand),
                         margin_bytes=self.budget.margin_bytes("cpu"))

    def _disk_tier(self, units: list[UnitPlan]) -> TierUsage:
        return TierUsage("disk", self.budget.disk_bytes,
                         weights_bytes=sum(u.weight_bytes for u in units if u.weight_tier == "disk"))

    def _notes(self, cand: _Candidate) -> tuple[str, ...]:
        notes = []
        if self.hw.has_gpu and not self.gpu_possible:
            notes.append("the GPU budget is 0: everything runs on the CPU")
        if not self.hw.has_gpu:
            notes.append(f"{self.hw.name} has no GPU: every unit computes on the CPU")
        if self.fmt == AS_STORED:
            notes.append(f"weights as the GGUF file stores them (mostly {self.spec.stored_format}); embeddings are "
                         f"dequantized to {self.wl.compute_format} for lookup")
        elif self.fmt in QUANT_BLOCK_BYTES:
            notes.append(f"{self.fmt}: embeddings stay fp16, norms fp32; the GPU workspace holds bf16 "
                         "scratch for the largest layer tensor (lm_head is dequantized in slices of that size)")
        return tuple(notes)

    def _model_name(self) -> str:
        path = Path(self.spec.source) if self.spec.source else None
        if path is None:
            return "model"
        return path.parent.name if path.name == "config.json" and path.parent.name else path.name

    def _all_in_ram(self) -> _Candidate:
        """Every unit's weights in RAM, computed on the CPU (the shortfall advice sizes budgets for it)."""
        return _Candidate(["cpu"] * self.n, {p: ["cpu"] * self.n for p in PHASES}, False)


DEPTHS = (1, 2, 3, 4)  # staging slots the planner weighs: each more holds a larger unit's copy ahead, and costs
# a unit's room in VRAM (70B q4_0 on 22 GiB, batch 32: 29.4, 35.0, 36.6, 36.1 decode tokens/s at depths 1-4)
DEPTH_WINDOW = (-3, 1)  # GPU residents weighed at the other depths, about the best number at the default depth


def plan(spec: ModelSpec, hardware: HardwareProfile, budget: Budget, workload: Workload,
         weight_format: str | None = None, prefetch_depth: int | None = DEFAULT_PREFETCH_DEPTH) -> Plan:
    """The fastest placement of spec's units within budget for workload on hardware; PlanError if none fits.

    weight_format defaults to the workload's compute format (no quantization); prefetch_depth None searches the
    staging slots (DEPTHS) along with the placement."""
    fmt = weight_format or workload.compute_format
    if fmt == AS_STORED and not spec.from_gguf:
        raise ConfigError(f"weight format {AS_STORED!r} (as stored) needs a GGUF model; {spec.source} is not one")
    if fmt not in WEIGHT_FORMATS and fmt != AS_STORED:
        raise ConfigError(f"weight format {fmt!r} is not supported; use one of {', '.join(WEIGHT_FORMATS)}")
    if prefetch_depth is not None and (isinstance(prefetch_depth, bool) or prefetch_depth < 1):
        raise ConfigError(f"prefetch depth must be 1 or more, found {prefetch_depth}")
    if prefetch_depth is not None:
        return Search(spec, hardware, budget, workload, fmt, prefetch_depth).run()
    first = Search(spec, hardware, budget, workload, fmt, DEFAULT_PREFETCH_DEPTH)
    best = first.run()
    if not (best.prefetch_depth or best.read_ahead_depth):
        return best  # nothing streams or is read ahead: the depth changes nothing
    k = first.chosen.residents
    window = range(max(0, k + DEPTH_WINDOW[0]), k + DEPTH_WINDOW[1] + 1)
    for depth in DEPTHS:
        if depth == DEFAULT_PREFETCH_DEPTH:
            continue
        other = first.at_depth(depth)
        tally = weigh_again(other, first.chosen, window)  # a Plan is made of the fastest only
        if tally.best is not None and tally.best_s < best.job_s * (1 - 1e-9):
            best = other.plan_of(tally.best)
    return best


def plan_best_batch(spec: ModelSpec, hardware: HardwareProfile, budget: Budget, workload: Workload,
                    weight_format: str | None = None, prefetch_depth: int | None = DEFAULT_PREFETCH_DEPTH,
                    max_batch: int = 256) -> Plan:
    """plan() at the batch size (powers of two up to max_batch) with the highest predicted job throughput.

    workload.batch_size is ignored; PlanError if not even one sequence fits.
    """
    best, best_rate, batch = None, 0.0, 1
    while batch <= max_batch:
        try:
            candidate = plan(spec, hardware, budget, replace(workload, batch_size=batch), weight_format,
                             prefetch_depth)
        except PlanError:
            if best is None:
                raise
            break  # a larger batch needs more KV and workspace still
        rate = batch * workload.gen_len / candidate.job_s
        if rate > best_rate:
            best, best_rate = candidate, rate
        batch *= 2
    return best

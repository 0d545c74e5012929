"""The planner's search: candidate placements, per-phase stream-or-CPU choices, disk spill.

plan(spec, hardware, budget, workload) searches the number of GPU-resident units (in order of time saved
per byte); for each, it decides per phase which offloaded units stream to the GPU and which compute on
the CPU (greedily, best gain per PCIe second first, keeping the prefix with the shortest step, the streamed
units spread between the CPU ones), with the KV caches on the GPU or in host RAM, spills host weights to disk
when RAM is short, and keeps the candidate with the shortest job time; then the staging depth about it. Pure
arithmetic: no torch. planner/shortfall.py says what to change when nothing fits.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from pathlib import Path

from offload.errors import ConfigError, PlanError
from offload.formats import AS_STORED, QUANT_BLOCK_BYTES, WEIGHT_FORMATS, is_quantized
from offload.hardware import HardwareProfile
from offload.planner.costs import (ACT_BYTES_CPU, ACT_BYTES_GPU, READ_PAGE_CACHE_BYTES, PhaseCost, cpu_path, hop_s,
                                   main_format, phases_for, price_step, read_ahead_bytes, unit_cost, workspace_bytes)
from offload.planner.shortfall import Shortfall
from offload.planner.types import DEFAULT_PREFETCH_DEPTH, PHASES, Budget, Plan, TierUsage, UnitPlan, Workload
from offload.spec import ModelSpec, UnitSpec

STREAMABLE = ("layer", "experts", "mlp", "lm_head")  # kinds that may stream to the GPU (or compute on the CPU)
HOST_KV_SHARE = 0.1  # the KV cache's share of the GPU budget from which plans with it in host RAM are weighed


@functools.lru_cache(maxsize=4)
def _units(spec: ModelSpec) -> tuple[tuple[UnitSpec, ...], list[tuple]]:
    """spec's units, and for each a key that units alike in kind, shapes and stored formats share (the layers, the
    experts units: sized and priced once); kept for the several plans of one model (plan_best_batch, what-ifs)."""
    units = spec.units()
    return units, [(u.kind, tuple((t.shape, t.stored) for t in u.tensors)) for u in units]


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


class Search:
    """Holds the per-unit costs of one planning problem and evaluates candidate placements."""

    def __init__(self, spec: ModelSpec, hw: HardwareProfile, budget: Budget, workload: Workload,
                 fmt: str, depth: int):
        self.spec, self.hw, self.budget, self.wl, self.fmt, self.depth = spec, hw, budget, workload, fmt, depth
        self.units, self.alike = _units(spec)
        ids: dict = {}
        self.kin = [ids.setdefault(key, len(ids)) for key in self.alike]  # alike units share a small number
        self.n = len(self.units)
        kinds = self.kinds = [u.kind for u in self.units]
        self.path = cpu_path(main_format(spec, fmt), workload.compute_format)
        self.i_embed, self.i_norm, self.i_head = kinds.index("embed"), kinds.index("norm"), kinds.index("lm_head")
        self.streamable = [i for i, k in enumerate(kinds) if k in STREAMABLE]
        compute = workload.compute_format
        self.w = self._per_unit(lambda u: u.nbytes(fmt, compute))
        self.stored = self._per_unit(lambda u: "+".join(u.held_formats(fmt, compute)))
        self.buf = self._per_unit(lambda u: u.buffer_bytes(fmt, compute))  # what a slot or read buffer holds
        layer_kv = spec.layer_kv_bytes(workload.batch_size, workload.seq_len, workload.kv_elem_bytes)
        self.kv = [layer_kv if k == "layer" else 0 for k in kinds]
        self.phase = dict(zip(PHASES, phases_for(workload.batch_size, workload.prompt_len, workload.gen_len,
                                                 workload.prefill_pass_tokens)))
        self.cost = {p: self._per_unit(lambda u, ph=ph: unit_cost(spec, u, fmt, hw, ph, compute))
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
        # KV in host RAM frees VRAM for weights but moves decode attention to the CPU: weighed where the KV cache
        # takes a real share of the GPU budget
        self.host_kv_may_pay = self.gpu_possible and sum(self.kv) > HOST_KV_SHARE * budget.gpu_bytes

    def _per_unit(self, value) -> list:
        """value(unit) for each unit, computed once for units alike."""
        memo: dict = {}
        out = []
        for u, key in zip(self.units, self.alike):
            if key not in memo:
                memo[key] = value(u)
            out.append(memo[key])
        return out

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

        ranked = sorted(self.streamable, key=saving, reverse=True)  # stable: layers keep index order
        return ranked + [self.i_embed]

    def run(self, window: range | None = None) -> Plan:
        """The best candidate (of those with a number of GPU residents in window, where given)."""
        best, best_s, shorts = None, math.inf, []
        for cand in self._candidates(window):
            if cand.short:
                shorts.append(cand.short)
                continue
            dec = self._phase_cost("decode", cand, overlap=False)
            if self.wl.gen_len * dec.step_s >= best_s:
                continue  # slower than the best already, whatever its prefill
            pre = self._phase_cost("prefill", cand, overlap=False)
            job_s = pre.step_s + self.wl.gen_len * dec.step_s
            if job_s < best_s * (1 - 1e-9):
                best, best_s = cand, job_s
        if best is None:
            raise Shortfall(self, shorts)
        self.best_residents = best.residents
        return self._freeze(best, self._phase_cost("prefill", best), self._phase_cost("decode", best))

    def _candidates(self, window: range | None = None):
        if window is None or 0 in window:
            yield self._build(0, use_gpu=False)
        if not self.gpu_possible:
            return
        kv_choices = [False, True] if self.host_kv_may_pay else [False]
        for k in window or range(len(self.order) + 1):
            if k > len(self.order) or not kv_choices:
                return
            for host_kv in list(kv_choices):
                cand = self._build(k, use_gpu=True, host_kv=host_kv)
                if cand.short and cand.short[0] == "gpu" and k > 0:
                    kv_choices.remove(host_kv)  # more residents cannot fit either
                    continue
                yield cand
                if not host_kv:
                    yield from self._variants(k, cand)

    def _variants(self, k: int, cand: _Candidate):
        """The same residents streaming less in decode, where the scan's estimate may mislead."""
        streamed = [self.kinds[i] for i, m in enumerate(cand.compute["decode"]) if m == "stream"]
        if "experts" in streamed or "mlp" in streamed:
            # A streamed experts unit copies every expert for the few a decode step reads (a split-off MLP
            # crosses PCIe where the CPU could compute it in place); where the scan's overlap estimate favours
            # it the step's pipeline may not: weigh the same residents streaming whole layers only.
            yield self._build(k, use_gpu=True, decode_kinds=("layer", "lm_head"))
        if streamed:
            # Streaming in decode is chosen for the decode step alone; it also moves the prompt's KV cache
            # in prefill, which a short generation may not repay: weigh the same residents without it.
            yield self._build(k, use_gpu=True, decode_kinds=())

    def _build(self, k: int, use_gpu: bool, decode_kinds: tuple[str, ...] = STREAMABLE,
               host_kv: bool = False) -> _Candidate:
        """The candidate with the first k units of the residency order on the GPU, streaming in decode only
        units of decode_kinds; host_kv: with every layer's KV cache in host RAM."""
        weight = ["cpu"] * self.n
        for i in self.order[:k]:
            weight[i] = "gpu"
        weight[self.i_norm] = weight[self.i_head]
        compute = {p: ["gpu" if t == "gpu" else "cpu" for t in weight] for p in PHASES}
        cand = _Candidate(weight, compute, use_gpu, residents=k, host_kv=host_kv)
        if use_gpu:
            kv = [0] * self.n if host_kv else self.kv
            cand.gpu_fixed = (self.budget.margin_bytes("gpu") + self.ws_gpu + self.hw.gpu_reserved_bytes
                              + sum(self.w[i] + kv[i] for i in range(self.n) if weight[i] == "gpu"))
            if cand.gpu_fixed > self.budget.gpu_bytes:
                cand.short = ("gpu", cand.gpu_fixed, self.budget.gpu_bytes)
                return cand
            self._choose_streams(cand, decode_kinds)
        self._place_host_weights(cand)
        return cand

    def _choose_streams(self, cand: _Candidate, decode_kinds: tuple[str, ...] = STREAMABLE) -> None:
        """Decide per phase which offloaded units stream to the GPU (in decode, only units of decode_kinds); the
        rest compute on the CPU."""
        offloaded = [i for i in self.streamable if cand.weight[i] != "gpu"]
        stageable, room = self._stageable(cand, offloaded)
        if not stageable:
            return  # no room for staging slots: offloaded units compute on the CPU
        if decode_kinds:
            in_decode = [i for i in stageable if self.kinds[i] in decode_kinds]
            self._scan("decode", cand, offloaded, in_decode, math.inf if cand.host_kv else room)
        self._scan("prefill", cand, offloaded, stageable, math.inf)
        head = cand.compute
        for p in PHASES:
            head[p][self.i_norm] = "gpu" if cand.weight[self.i_norm] == "gpu" else (
                "stream" if head[p][self.i_head] == "stream" else "cpu")
        streamed = [i for i in offloaded if "stream" in (head["prefill"][i], head["decode"][i])]
        cand.staging_slot = max((self.buf[i] for i in streamed), default=0)

    def _stageable(self, cand: _Candidate, offloaded: list[int]) -> tuple[list[int], int]:
        """The offloaded units that may stream and the GPU bytes left beside their staging slots: every one where
        `depth` slots of the largest fit, else those no larger than the largest slot that does fit (an experts
        unit can be many times an attention part)."""
        for slot in sorted({self.buf[i] for i in offloaded}, reverse=True):
            room = self.budget.gpu_bytes - cand.gpu_fixed - self.depth * slot
            if room >= 0:
                return [i for i in offloaded if self.buf[i] <= slot], room
        return [], 0

    def _scan(self, phase: str, cand: _Candidate, offloaded: list[int], stageable: list[int],
              kv_room: float) -> None:
        """Stream stageable units in order of compute saved per PCIe second; keep the prefix with the shortest step.

        Along that order compute time only falls and PCIe time only rises, so the step time
        max(compute, pcie, host memory) falls then rises: the scan stops once PCIe alone is longer. A streamed
        experts unit costs host memory all its experts, where the CPU would read only those routed to.
        """
        costs, gpu_s, cpu_s = self.cost[phase], self.gpu_s[phase], self.cpu_s[phase]
        compute, decode = cand.compute[phase], cand.compute["decode"]
        weight = cand.weight
        busy = sum(gpu_s[i] if weight[i] == "gpu" else cpu_s[i] for i in range(self.n))
        host = sum(costs[i].host_cpu_s for i in offloaded)
        link = 0.0
        if phase == "prefill":
            link = sum(costs[i].kv_move_s for i in offloaded if decode[i] != "cpu")
        best_s, best_m, best_link, kv_used = max(busy, link, host), 0, link, 0
        allowed = set(stageable)
        gain = [i for i in self.gain_order[phase] if i in allowed]
        for m, i in enumerate(gain, 1):
            if phase == "decode":
                kv_used += self.kv[i]
                if kv_used > kv_room:
                    break
            busy += gpu_s[i] - cpu_s[i]
            link += costs[i].pcie_s
            host += costs[i].host_mem_s - costs[i].host_cpu_s
            if phase == "prefill":
                link += costs[i].kv_move_s if decode[i] == "cpu" else -costs[i].kv_move_s
            step_s = max(busy, link, host)
            if step_s < best_s * (1 - 1e-9):
                best_s, best_m, best_link = step_s, m, link
            elif link > best_s:
                break
        chosen = gain[:best_m]
        if chosen and self._spread_pays(phase, chosen, gain[best_m:], best_link):
            kin = self.kin
            chosen = spread(chosen, gain, (lambda i: (kin[i], decode[i])) if phase == "prefill" else kin.__getitem__)
        for i in chosen:
            compute[i] = "stream"

    def _spread_pays(self, phase: str, streamed: list[int], on_cpu: list[int], link_s: float) -> bool:
        """Whether streamed units set between the CPU ones gain more (copies under CPU compute: at most the shorter
        of the two) than the hand-overs of the hidden state between the devices cost."""
        under = min(link_s, sum(self.cpu_s[phase][i] for i in on_cpu))
        return under > 2 * min(len(streamed), len(on_cpu)) * self.hop[phase]

    def _host_usage(self, cand: _Candidate) -> int:
        any_cpu = any("cpu" in (cand.compute[p][i] for p in PHASES) for i in range(self.n) if i != self.i_norm)
        kv_cpu = sum(self.kv[i] for i in range(self.n) if cand.compute["decode"][i] == "cpu" or cand.host_kv)
        weights = sum(self.w[i] for i in range(self.n) if cand.weight[i] == "cpu")
        return (self.budget.margin_bytes("cpu") + (self.ws_cpu if any_cpu else 0) + kv_cpu + weights
                + self._pinned(cand))

    def _pinned(self, cand: _Candidate, weight: list[str] | None = None) -> int:
        """Host memory besides weights: the hidden-state hand-over (with a GPU), the disk read-ahead arena and the
        page cache the disk reads hold while they are dropped behind them (the piece being read and what the OS
        reads ahead of it: READ_PAGE_CACHE_BYTES, or a unit where that is less)."""
        skip = self._in_place(cand, None if weight is None else self._kept(weight))
        read = [self.buf[i] for i in self._disk_reads(weight or cand.weight, skip)]
        in_flight = min(max(read, default=0), READ_PAGE_CACHE_BYTES)
        return (self.hop_buffers if cand.use_gpu else 0) + read_ahead_bytes(read, self.depth) + in_flight

    def _in_place(self, cand: _Candidate, cached: frozenset[int] | None = None) -> frozenset[int]:
        """Disk units the page cache keeps (cand's, or those given) and only the CPU computes: the executor maps
        them, reads none ahead."""
        return frozenset(i for i in (cand.cached if cached is None else cached)
                         if all(cand.compute[p][i] == "cpu" for p in PHASES))

    def _kept(self, weight: list[str]) -> frozenset[int]:
        """The disk units the page cache has room for beside the budget, in order; the others are dropped from it
        once read."""
        room, kept = self.budget.page_cache_bytes, []
        for i in self._disk_reads(weight):
            if self.buf[i] > room:
                break
            room -= self.buf[i]
            kept.append(i)
        return frozenset(kept)

    def _disk_reads(self, weight: list[str], skip: frozenset[int] = frozenset()) -> list[int]:
        """Disk units read whole at every step, in order (an embedding on disk reads only the rows looked up)."""
        return [i for i in range(self.n) if weight[i] == "disk" and i != self.i_embed and i not in skip]

    def _read_ahead(self, weight: list[str], skip: frozenset[int] = frozenset()) -> int:
        """The read-ahead arena the executor allocates."""
        return read_ahead_bytes([self.buf[i] for i in self._disk_reads(weight, skip)], self.depth)

    def _spill(self, cand: _Candidate, order: list[int]) -> tuple[list[str], int]:
        """Weights after moving units to disk in order until the host budget holds (or nothing is left to move),
        and the host bytes they use."""
        weight = list(cand.weight)
        other = self._host_usage(cand) - self._pinned(cand)
        floor = self.hop_buffers if cand.use_gpu else 0  # pinned bytes are never fewer: count them once it may fit
        for i in order:
            if other + floor <= self.budget.cpu_bytes >= other + self._pinned(cand, weight):
                break
            weight[i] = "disk"
            other -= self.w[i]
        return weight, other + self._pinned(cand, weight)

    def _place_host_weights(self, cand: _Candidate) -> None:
        """Keep offloaded weights in RAM while it lasts, then move units to disk: the embedding first (a step reads
        only the rows it looks up), then layers and experts units from the last, or the lm_head before them,
        whichever keeps more in RAM once the read-ahead arena they need is counted. The disk units the page cache
        has room for beside the budget are left to it; the others are dropped from it once read."""
        movable = [i for i in reversed(range(self.n)) if cand.weight[i] == "cpu" and i != self.i_norm]
        first = [i for i in movable if i == self.i_embed]
        layers = [i for i in movable if self.kinds[i] in ("layer", "experts", "mlp")]
        rest = [i for i in movable if i != self.i_embed and self.kinds[i] not in ("layer", "experts", "mlp")]
        orders = (first + layers + rest, first + rest + layers)
        tried = [self._spill(cand, orders[0])]
        if any(w == "disk" for w in tried[0][0]) or tried[0][1] > self.budget.cpu_bytes:  # the order mattered
            tried.append(self._spill(cand, orders[1]))
        fits = [t for t in tried if t[1] <= self.budget.cpu_bytes]
        cand.weight, used = (min(fits, key=lambda t: sum(self.w[i] for i in self._disk_reads(t[0]))) if fits
                             else min(tried, key=lambda t: t[1]))
        cand.cached = self._kept(cand.weight)
        on_disk = sum(self.w[i] for i in range(self.n) if cand.weight[i] == "disk")
        if used > self.budget.cpu_bytes:
            cand.short = ("cpu", used, self.budget.cpu_bytes)
        elif on_disk > self.budget.disk_bytes:
            cand.short = ("disk", on_disk, self.budget.disk_bytes)

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


def spread(chosen: list[int], candidates: list[int], group) -> list[int]:
    """The chosen units with each group's share moved to evenly spaced members of that group: units alike cost the
    same, so the scan's estimate does not change, but the streamed ones now sit between the CPU ones and their
    copies run under CPU compute (taken in index order they end up together, and the link idles through the CPU
    units' long run)."""
    if not chosen:
        return chosen
    taken: dict = {}
    for i in chosen:
        key = group(i)
        taken[key] = taken.get(key, 0) + 1
    pools: dict = {key: [] for key in taken}
    for i in candidates:
        pool = pools.get(group(i))
        if pool is not None:
            pool.append(i)
    out = []
    for key, n in taken.items():
        pool = sorted(pools[key])
        out += [pool[int((j + 0.5) * len(pool) / n)] for j in range(n)]
    return out


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
    k = first.best_residents
    window = range(max(0, k + DEPTH_WINDOW[0]), k + DEPTH_WINDOW[1] + 1)
    for depth in DEPTHS:
        if depth == DEFAULT_PREFETCH_DEPTH:
            continue
        try:
            other = Search(spec, hardware, budget, workload, fmt, depth).run(window)
        except PlanError:
            continue
        if other.job_s < best.job_s * (1 - 1e-9):
            best = other
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

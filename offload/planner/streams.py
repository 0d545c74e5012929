"""Which offloaded units stream to the GPU in each phase, and which compute on the CPU: the search's choice for one
candidate placement (planner/search.py), greedily by compute saved per PCIe second, keeping the prefix with the
shortest step, the streamed units spread between the CPU ones where that pays. Pure arithmetic."""

from __future__ import annotations

import math
from collections import Counter

from offload.planner.types import PHASES

STREAMABLE = ("layer", "experts", "mlp", "lm_head")  # kinds that may stream to the GPU (or compute on the CPU)


class StreamChoice:
    """The Search's stream choice (a mixin: it reads the per-unit costs, sizes and orders Search.__init__ holds)."""

    def _choose_streams(self, cand, decode_kinds: tuple[str, ...] = STREAMABLE) -> None:
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

    def _stageable(self, cand, offloaded: list[int]) -> tuple[list[int], int]:
        """The offloaded units that may stream and the GPU bytes left beside their staging slots: every one where
        `depth` slots of the largest fit, else those no larger than the largest slot that does fit (an experts
        unit can be many times an attention part)."""
        for slot in sorted({self.buf[i] for i in offloaded}, reverse=True):
            room = self.budget.gpu_bytes - cand.gpu_fixed - self.depth * slot
            if room >= 0:
                return [i for i in offloaded if self.buf[i] <= slot], room
        return [], 0

    def _scan(self, phase: str, cand, offloaded: list[int], stageable: list[int], kv_room: float) -> None:
        """Stream stageable units in order of compute saved per PCIe second; keep the prefix with the shortest step.

        Along that order compute time only falls and PCIe time only rises, so the step time
        max(compute, pcie, host memory) falls then rises: the scan stops once PCIe alone is longer. A streamed
        experts unit costs host memory all its experts, where the CPU would read only those routed to.
        """
        costs, gpu_s, cpu_s = self.cost[phase], self.gpu_s[phase], self.cpu_s[phase]
        compute, decode = cand.compute[phase], cand.compute["decode"]
        busy = sum(g if t == "gpu" else c for g, c, t in zip(gpu_s, cpu_s, cand.weight))
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
            # a unit's group: units alike (in prefill, alike where decode runs them too)
            group = list(zip(self.kin, decode)) if phase == "prefill" else self.kin
            chosen = spread(chosen, gain, group.__getitem__)
        for i in chosen:
            compute[i] = "stream"

    def _spread_pays(self, phase: str, streamed: list[int], on_cpu: list[int], link_s: float) -> bool:
        """Whether streamed units set between the CPU ones gain more (copies under CPU compute: at most the shorter
        of the two) than the hand-overs of the hidden state between the devices cost."""
        under = min(link_s, sum(self.cpu_s[phase][i] for i in on_cpu))
        return under > 2 * min(len(streamed), len(on_cpu)) * self.hop[phase]


def spread(chosen: list[int], candidates: list[int], group) -> list[int]:
    """The chosen units with each group's share (group(i): unit i's) moved to evenly spaced members of that group:
    units alike cost the same, so the scan's estimate does not change, but the streamed ones now sit between the
    CPU ones and their copies run under CPU compute (taken in index order they end up together, and the link idles
    through the CPU units' long run)."""
    if not chosen:
        return chosen
    taken = Counter(map(group, chosen))
    pools: dict = {key: [] for key in taken}
    for i, key in zip(candidates, map(group, candidates)):
        pool = pools.get(key)
        if pool is not None:
            pool.append(i)
    out = []
    for key, n in taken.items():
        pool = sorted(pools[key])
        out += [pool[int((j + 0.5) * len(pool) / n)] for j in range(n)]
    return out

"""How many units of the residency order the search makes GPU-resident: the counts it weighs and, for each, the
candidates it builds (the count's placement; the same streaming less in decode; with every KV cache in host RAM).

Pricing a count walks every unit (planner/costs.price_step), so weighing every count is quadratic in the units:
a fraction of a second for a real model (83 units for Llama 3.1 70B, 191 for Qwen3 235B), minutes for 1,000
layers. So every count is weighed where counts x units is at most COUNT_UNITS (every shipped model: the plan is the
best of all counts), and beyond, about SAMPLE_UNITS / units counts per KV placement: the counts the memory bounds
mark (the most whose weights fit, the most that leave room for `depth` staging slots of the smallest and of the
largest offloaded unit, the counts below them), then grids over the counts that fit, each narrowing about its best
count; the variants streaming less in decode are weighed at the best count found. A large model's search then
prices a bounded number of counts, each in one pass over the units: linear in the layers. On nine 1,000-layer
models its plan was at most 7.5% slower (predicted job time) than the best of every count, which took 8-20 s."""

from __future__ import annotations

import math

# counts x units weighed one by one: every shipped model's (at most 53,138: Llama 3.1 70B with its MLPs split off,
# on an H200 at batch 128: 2 KV placements x 163 counts x 163 units) and Llama 3.1 405B's (255 units split)
COUNT_UNITS = 1 << 17
SAMPLE_UNITS = 1 << 12  # beyond, counts x units sampled per KV placement (4 counts of 1,000 units), half of them
# memory marks, half on grids
MIN_COUNTS = 2  # counts sampled per KV placement however many units: the most that fit, the most that stream
GRID = 5  # counts a grid prices across its span; the next spans the two steps about the best: a quarter as wide


class Tally:
    """The fastest candidate weighed so far (by predicted job seconds) and the shortfalls of those that do not fit."""

    def __init__(self, search):
        self.search, self.best, self.best_s, self.shorts = search, None, math.inf, []

    def weigh(self, cand) -> float:
        """cand's job seconds, or a bound below them where its decode steps alone are slower than the best (its
        prefill is then not priced), or inf where it does not fit."""
        if cand.short:
            self.shorts.append(cand.short)
            return math.inf
        search = self.search
        decode_s = search.wl.gen_len * search._phase_cost("decode", cand, overlap=False).step_s
        if decode_s >= self.best_s:
            return decode_s  # slower than the best already, whatever its prefill
        job_s = search._phase_cost("prefill", cand, overlap=False).step_s + decode_s
        if job_s < self.best_s * (1 - 1e-9):
            self.best, self.best_s = cand, job_s
        return job_s


def weigh_counts(search, window: range | None = None) -> Tally:
    """Weigh the candidates of every count (of those in window, where given), or a sample of the counts where
    weighing every one would price more than COUNT_UNITS counts x units."""
    tally = Tally(search)
    if window is not None or weighs_every_count(search):
        for cand in every_count(search, window):
            tally.weigh(cand)
        return tally
    for host_kv in _families(search):
        _sample(search, tally, host_kv, max(MIN_COUNTS, SAMPLE_UNITS // search.n))
    tally.weigh(search._build(0, use_gpu=False))  # last: where the GPU's counts are faster, its prefill is not priced
    return tally


def weigh_again(search, best, window: range) -> Tally:
    """Weigh the placements about best (found at another staging depth) at this search's depth: the candidates of
    every count in window where every count is weighed, else best's own placement (a window of a sampled search's
    counts would price as much again as the search)."""
    if weighs_every_count(search):
        return weigh_counts(search, window)
    tally = Tally(search)
    tally.weigh(search._build(best.residents, best.use_gpu, best.decode_kinds, best.host_kv))
    return tally


def weighs_every_count(search) -> bool:
    """Whether weighing every count whose weights fit prices at most COUNT_UNITS counts x units."""
    if not search.gpu_possible:
        return True
    return sum(search.most_residents(host_kv) + 1 for host_kv in _families(search)) * search.n <= COUNT_UNITS


def every_count(search, window: range | None = None):
    """Every count's candidates (those in window, where given), in order; a family (KV on the GPU, or in host RAM)
    stops at the first count whose GPU bytes do not fit."""
    if window is None or 0 in window:
        yield search._build(0, use_gpu=False)
    if not search.gpu_possible:
        return
    kv_choices = [False, True] if search.host_kv_may_pay else [False]
    for k in window or range(len(search.order) + 1):
        if k > len(search.order) or not kv_choices:
            return
        for host_kv in list(kv_choices):
            cand = search._build(k, use_gpu=True, host_kv=host_kv)
            if cand.short and cand.short[0] == "gpu" and k > 0:
                kv_choices.remove(host_kv)  # more residents cannot fit either
                continue
            yield cand
            if not host_kv:
                yield from variants(search, k, cand)


def fits_somewhere(search) -> bool:
    """Whether some candidate fits the budget (memory only: nothing is priced): of every count where they are few,
    else none on the GPU and the most residents that fit (they hold the least in host RAM)."""
    if weighs_every_count(search):
        return any(not cand.short for cand in every_count(search))
    if not search._build(0, use_gpu=False).short:
        return True
    return any(not search._build(search.most_residents(host_kv), use_gpu=True, host_kv=host_kv).short
               for host_kv in _families(search) if search.most_residents(host_kv) >= 0)


def _families(search) -> tuple[bool, ...]:
    """The KV placements weighed: on the GPU, and in host RAM where that may pay."""
    return (False, True) if search.host_kv_may_pay else (False,)


def variants(search, k: int, cand):
    """The same residents streaming less in decode, where the scan's estimate may mislead."""
    streamed = [search.kinds[i] for i, m in enumerate(cand.compute["decode"]) if m == "stream"]
    if "experts" in streamed or "mlp" in streamed:
        # A streamed experts unit copies every expert for the few a decode step reads (a split-off MLP
        # crosses PCIe where the CPU could compute it in place); where the scan's overlap estimate favours
        # it the step's pipeline may not: weigh the same residents streaming whole layers only.
        yield search._build(k, use_gpu=True, decode_kinds=("layer", "lm_head"))
    if streamed:
        # Streaming in decode is chosen for the decode step alone; it also moves the prompt's KV cache
        # in prefill, which a short generation may not repay: weigh the same residents without it.
        yield search._build(k, use_gpu=True, decode_kinds=())


def _sample(search, tally: Tally, host_kv: bool, budget: int) -> None:
    """Weigh about `budget` counts of one KV placement: the memory marks first, then grids narrowing about the best
    count; the variants at the best count."""
    top = search.most_residents(host_kv)
    if top < 0:  # not even the workspace fits: say by how much
        tally.weigh(search._build(0, use_gpu=True, host_kv=host_kv))
        return
    priced: dict[int, tuple] = {}

    def price(k: int) -> None:
        if k not in priced:
            cand = search._build(k, use_gpu=True, host_kv=host_kv)
            priced[k] = (tally.weigh(cand), cand)

    for k in memory_marks(search, top, host_kv)[:max(MIN_COUNTS, budget // 2)]:  # the rest for the grids
        price(k)
    lo, hi = 0, top
    while len(priced) < budget and hi > lo:
        step = -(-(hi - lo) // (GRID - 1))
        for k in [*range(lo, hi, step), hi]:
            price(k)
        best = min((k for k in priced if lo <= k <= hi), key=lambda k: priced[k][0])
        lo, hi = max(lo, best - step + 1), min(hi, best + step - 1)
        if step == 1:
            break
    best = min(priced, key=lambda k: priced[k][0])
    if not host_kv:
        for cand in variants(search, best, priced[best][1]):
            tally.weigh(cand)


def memory_marks(search, top: int, host_kv: bool) -> list[int]:
    """Counts where the placement changes kind, most telling first: the most whose weights fit (top), the most that
    leave room for `depth` staging slots of the smallest and of the largest offloaded unit (past the first nothing
    streams, past the second not every unit may), the counts just below them, and none and one resident."""
    stages = search.staging_bounds(top, host_kv)
    marks = [top, *stages, top - 1, *(k - 1 for k in stages), 0, 1]
    return [k for i, k in enumerate(marks) if 0 <= k <= top and k not in marks[:i]]

"""What the planner says when nothing fits: the tier short and by how much, and what would make it fit (a smaller
batch, a quantization and what it saves, the budget to raise and by how much). Pure arithmetic over a Search."""

from __future__ import annotations

import math
from dataclasses import replace

from offload.errors import PlanError
from offload.formats import QUANT_BLOCK_BYTES
from offload.hardware import format_bytes
from offload.planner.residents import fits_somewhere


class Shortfall(PlanError):
    """No placement fits: the message (with its advice, which takes planning smaller batches and contexts) is
    written when it is read, so a search that expects a failure (the largest batch that fits) pays nothing."""

    def __init__(self, search, shorts: list[tuple[str, int, int]]):
        super().__init__()
        self._search, self._shorts, self._message = search, shorts, None

    def __str__(self) -> str:
        if self._message is None:
            self._message = shortfall_message(self._search, self._shorts)
        return self._message

    def __reduce__(self):  # sent across processes (Ray) as the plain error it reads as
        return PlanError, (str(self),)


def shortfall_message(search, shorts: list[tuple[str, int, int]]) -> str:
    """Why the closest placement did not fit, and what to change: a sentence with its hints."""
    tier, need, have = min(shorts, key=lambda s: s[1] - s[2])
    what = (f"{search._model_name()} in {search.fmt} does not fit: the closest placement needs "
            f"{format_bytes(need)} of {tier} memory but the budget allows {format_bytes(have)} "
            f"(short by {format_bytes(need - have)})")
    return what + "; " + "; ".join(_hints(search, tier, need - have)) + "."


def _hints(search, tier: str, short: int) -> list[str]:
    """The KV cache and weights beside the shortfall, then what would fit: a smaller batch or context where the KV
    cache is what does not fit, a quantization that saves enough, and the budget to raise."""
    weights, kv = sum(search.w), sum(search.kv)
    hints = [f"weights take {format_bytes(weights)}, the KV cache {format_bytes(kv)} for batch "
             f"{search.wl.batch_size} x {search.wl.seq_len} tokens"]
    smaller = _what_fits(search) if kv + search.ws_cpu >= short else []  # the KV cache could make room
    hints += smaller
    compute = search.wl.compute_format
    sizes = {fmt: sum(u.nbytes(fmt, compute) for u in search.units) for fmt in QUANT_BLOCK_BYTES}
    # a quantization is offered where its saving alone covers the shortfall, not a few MiB against TiB
    savings = [f"{fmt} would save {format_bytes(weights - n)}" for fmt, n in sizes.items() if weights - n >= short]
    if savings:
        hints.append("--quantization " + ", ".join(savings))
    if tier == "gpu":
        hints.append("raise --gpu-memory, or set it to 0 to run on the CPU")
    else:  # where the KV cache is what does not fit, spilling weights to disk is not offered for it
        hints.append(_host_hint(search, spill=not smaller))
    return hints


def _what_fits(search) -> list[str]:
    """Where a smaller batch or context fits (the KV cache grows with batch x max_model_len): the largest batch
    that fits, with the weights spilled to disk if it takes that; else the longest context that fits one
    sequence in this budget. Each found by placing it (memory only)."""
    wl, one = search.wl, replace(search.wl, batch_size=1)
    spill = replace(search.budget, disk_bytes=max(search.budget.disk_bytes, sum(search.w)))
    for budget, also in ((search.budget, ""), (spill, f" with --disk-memory {_up(spill.disk_bytes)}")):
        if wl.batch_size > 1 and _fits(search, one, budget):
            batch = _largest(lambda n: _fits(search, replace(wl, batch_size=n), budget), 1, wl.batch_size - 1)
            return [f"--batch-size {batch}{also} is the largest batch that fits (schedule.batch_size)"]
    if wl.seq_len > 2 and _fits(search, _context(one, 2), search.budget):
        tokens = _largest(lambda n: _fits(search, _context(one, n), search.budget), 2, wl.seq_len - 1)
        where = "" if wl.batch_size == 1 else " at batch 1"
        return [f"--max-model-len {tokens} is the longest context that fits{where} (model.max_model_len)"]
    return []


def _context(wl, tokens: int):
    gen = min(wl.gen_len, tokens - 1)
    return replace(wl, prompt_len=tokens - gen, gen_len=gen)


def _fits(search, workload, budget) -> bool:
    """Whether some placement of search's units fits budget for workload (its memory only: nothing is priced)."""
    return fits_somewhere(type(search)(search.spec, search.hw, budget, workload, search.fmt, search.depth))


def _largest(fits, low: int, high: int) -> int:
    """The largest n in [low, high] with fits(n), given fits(low) and that fitting is monotone in n."""
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def _host_hint(search, spill: bool = True) -> str:
    """What to raise so that the CPU-only placement fits: RAM for every weight, or RAM and disk with the
    weights that do not fit spilled. Budgets are sized for the margin taken from them."""
    ram_only = search._all_in_ram()
    held = "every weight" if sum(search.kv) < sum(search.w) else "this KV cache and every weight"  # the larger first
    hint = f"raise --cpu-memory by {_up(_budget_for(search, ram_only) - search.budget.cpu_bytes)} to hold {held} in RAM"
    if not spill:
        return hint
    spilled = search._build(0, use_gpu=False)
    on_disk = sum(search.w[i] for i in range(search.n) if spilled.weight[i] == "disk")
    disk = f"--disk-memory by {_up(on_disk - search.budget.disk_bytes)} (it is " \
           f"{format_bytes(search.budget.disk_bytes)})"
    if spilled.short and spilled.short[0] == "disk":
        hint += f", or {disk} to spill the weights that do not fit to disk"
    elif spilled.short and on_disk:
        more = _up(_budget_for(search, spilled) - search.budget.cpu_bytes)
        hint += (f", or by {more} with {disk} to spill weights to disk" if on_disk > search.budget.disk_bytes
                 else f", or by {more} with the weights that do not fit spilled to disk")
    return hint


def _budget_for(search, cand) -> int:
    """The CPU budget at which cand's host memory, margin included, just fits."""
    used = search._host_usage(cand) - search.budget.margin_bytes("cpu")
    return math.ceil(used / (1 - search.budget.margin_frac))


def _up(n_bytes: int) -> str:
    """A size rounded up in its unit (0.01 MiB, 0.01 GiB), so that raising a budget by it is always enough."""
    n_bytes = max(int(n_bytes), 0)
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n_bytes >= scale:
            return f"{math.ceil(n_bytes / scale * 100) / 100:.2f} {unit}"
    return f"{n_bytes} B"

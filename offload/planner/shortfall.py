"""What the planner says when nothing fits: the tier short and by how much, and what would make it fit (a smaller
batch, a quantization and what it saves, the budget to raise and by how much). Pure arithmetic over a Search."""

from __future__ import annotations

import math

from offload.formats import QUANT_BLOCK_BYTES
from offload.hardware import format_bytes


def shortfall_message(search, shorts: list[tuple[str, int, int]]) -> str:
    """Why the closest placement did not fit, and what to change: a sentence with its hints."""
    tier, need, have = min(shorts, key=lambda s: s[1] - s[2])
    what = (f"{search._model_name()} in {search.fmt} does not fit: the closest placement needs "
            f"{format_bytes(need)} of {tier} memory but the budget allows {format_bytes(have)} "
            f"(short by {format_bytes(need - have)})")
    return what + "; " + "; ".join(_hints(search, tier, need - have)) + "."


def _hints(search, tier: str, short: int) -> list[str]:
    """The KV cache and weights beside the shortfall, a quantization's saving, and the budget to raise."""
    weights, kv = sum(search.w), sum(search.kv)
    hints = [f"weights take {format_bytes(weights)}, the KV cache {format_bytes(kv)} for batch "
             f"{search.wl.batch_size} x {search.wl.seq_len} tokens"]
    if kv + search.ws_cpu > short or search.wl.batch_size > 1:
        hints.append("a smaller --batch-size or --max-tokens would shrink the KV cache and activations")
    compute = search.wl.compute_format
    sizes = {fmt: sum(u.nbytes(fmt, compute) for u in search.units) for fmt in QUANT_BLOCK_BYTES}
    savings = [f"{fmt} would save {format_bytes(weights - n)}" for fmt, n in sizes.items() if n < weights]
    if savings:
        hints.append("--quantization " + ", ".join(savings))
    if tier == "gpu":
        hints.append("raise --gpu-memory, or set it to 0 to run on the CPU")
    else:
        hints.append(_host_hint(search))
    return hints


def _host_hint(search) -> str:
    """What to raise so that the CPU-only placement fits: RAM for every weight, or RAM and disk with the
    weights that do not fit spilled. Budgets are sized for the margin taken from them."""
    ram_only = search._all_in_ram()
    hint = (f"raise --cpu-memory by {_up(_budget_for(search, ram_only) - search.budget.cpu_bytes)} to hold "
            f"every weight in RAM")
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

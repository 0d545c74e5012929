"""Text views of a Plan: the table `offload plan` prints, and the explanation of its choices."""

from __future__ import annotations

from offload.hardware import format_bytes
from offload.planner.bottleneck import bottleneck_name, predicted_bottleneck


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds < 10 else f"{seconds:.1f} s"


def _unit_rows(plan) -> list[tuple]:
    """Units with consecutive layers of identical placement merged into one row (layer.0-39); a MoE model's
    experts units likewise (experts.0-11), each row where its first unit comes. A row's layers whose KV caches
    differ (sliding layers' rings beside full layers) show each size."""
    rows: list[list] = []
    open_rows: dict[str, list] = {}  # kind -> its last row, which the next unit of that kind may extend
    for u in plan.units:
        key = (u.kind, u.weight_tier, u.prefill, u.decode, u.kv_tier, u.weight_bytes, u.stored)
        row = open_rows.get(u.kind)
        if row is not None and row[0] == key and row[2] + 1 == u.index:
            row[2] = u.index
            row[3] += 1
            row[5].add(u.kv_bytes)
            continue
        rows.append([key, u.name, u.index, 1, u, {u.kv_bytes}])
        if u.kind in ("layer", "experts", "mlp"):
            open_rows[u.kind] = rows[-1]
    out = []
    for key, name, last, count, u, kvs in rows:
        label = f"{u.kind}.{u.index}-{last}" if count > 1 else name
        kv = " / ".join(format_bytes(b) for b in sorted(kvs)) if u.kind == "layer" else "-"  # ring layers' apart
        out.append((label, str(count), u.stored or "-", format_bytes(u.weight_bytes), u.weight_tier, u.prefill,
                    u.decode, kv, u.kv_tier or "-"))
    return out


def _grid(header: tuple, rows: list[tuple]) -> list[str]:
    widths = [max(len(str(r[c])) for r in [header, *rows]) for c in range(len(header))]
    return ["  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip() for r in [header, *rows]]


def plan_table(plan) -> str:
    """The plan as text: units, tiers, predicted phases and the greppable summary line."""
    wl = plan.workload
    lines = [f"plan: {plan.model} ({plan.weight_format}) on {plan.hardware}: batch {wl.batch_size}, "
             f"prompt {wl.prompt_len}, generate {wl.gen_len}, KV cache {wl.cache_format}", ""]
    lines += _grid(("unit", "n", "stored", "weights/unit", "tier", "prefill", "decode", "kv/unit", "kv tier"),
                   _unit_rows(plan))
    lines.append("")
    tier_rows = [(t.tier, format_bytes(t.budget_bytes), format_bytes(t.weights_bytes), format_bytes(t.kv_bytes),
                  format_bytes(t.workspace_bytes), format_bytes(t.staging_bytes), format_bytes(t.pinned_bytes),
                  format_bytes(t.reserved_bytes), format_bytes(t.margin_bytes), format_bytes(t.total_bytes))
                 for t in plan.tiers]
    lines += _grid(("tier", "budget", "weights", "kv", "workspace", "staging", "pinned", "reserved", "margin",
                    "total"), tier_rows)
    lines.append("")
    phase_rows = [(p.phase, f"{p.tokens_per_s:.2f}", _ms(p.step_s), _ms(p.gpu_s), _ms(p.cpu_s), _ms(p.pcie_s),
                   _ms(p.disk_s), p.bound, f"{p.cpu_share:.0%} CPU / {p.gpu_share:.0%} GPU")
                  for p in (plan.prefill, plan.decode)]
    lines += _grid(("phase", "tokens/s", "step", "gpu", "cpu", "pcie", "disk", "bound", "compute split"),
                   phase_rows)
    lines.append("")
    lines.append(f"prefetch depth {plan.prefetch_depth}, staging slot {format_bytes(plan.staging_slot_bytes)}")
    lines.append(plan.summary_line)
    if plan.moe_summary:
        lines.append(plan.moe_summary)
    return "\n".join(lines)


def moe_split(plan) -> str | None:
    """Where a MoE model's attention parts and experts (or a dense model's split-off MLPs) are: "attention 32/32
    on GPU, experts 12/32 layers on GPU, 20 on CPU (decode), 20 streamed (prefill)"; None for whole layers."""
    experts = [u for u in plan.units if u.kind == "experts"]
    mlps = [u for u in plan.units if u.kind == "mlp"]
    if not experts and not mlps:
        return None
    layers = [u for u in plan.units if u.kind == "layer"]
    parts = [f"attention {sum(u.weight_tier == 'gpu' for u in layers)}/{len(layers)} on GPU"]
    if experts:
        parts.append(f"experts {sum(u.weight_tier == 'gpu' for u in experts)}/{len(experts)} layers on GPU")
    if mlps:
        parts.append(f"MLP {sum(u.weight_tier == 'gpu' for u in mlps)}/{len(mlps)} layers on GPU")
    experts = experts + mlps
    for phase in ("decode", "prefill"):
        modes = [getattr(u, phase) for u in experts if u.weight_tier != "gpu"]
        where = [f"{modes.count(m)} {label}" for m, label in (("cpu", "on CPU"), ("stream", "streamed")) if m in modes]
        if where:
            parts.append(f"{' + '.join(where)} ({phase})")
    return ", ".join(parts)


def _decision(plan, phase: str) -> str:
    modes = [getattr(u, phase) for u in plan.units if u.weight_tier != "gpu"]  # the units the table counts
    if not modes:
        return f"{phase}: every unit is resident on the GPU."
    n_stream, n_cpu = modes.count("stream"), modes.count("cpu")
    cost = getattr(plan, phase)
    why = {"compute": "the compute chain", "pcie": "the PCIe link", "disk": "disk reads",
           "host_memory": "host-memory bandwidth"}[cost.bound]
    return (f"{phase}: of {len(modes)} units not resident on the GPU, {n_stream} stream to it and {n_cpu} compute on "
            f"the CPU; one step takes {_ms(cost.step_s)}, set by {why} (GPU {_ms(cost.gpu_s)}, "
            f"CPU {_ms(cost.cpu_s)}, PCIe {_ms(cost.pcie_s)}, disk {_ms(cost.disk_s)}, "
            f"host memory {_ms(cost.host_mem_s)}).")


def overlap_line(plan) -> str:
    """How much of each phase's copy time runs under compute (the schedule the pricer ran)."""
    parts = []
    for phase in ("prefill", "decode"):
        cost = getattr(plan, phase)
        if cost.pcie_s <= 0:
            parts.append(f"{phase}: no copies")
            continue
        share = min(cost.copy_under_compute_s / cost.pcie_s, 1.0)
        parts.append(f"{phase}: {_ms(cost.pcie_s)} of copies per step, {share:.0%} under compute "
                     f"({min(cost.copy_under_cpu_s / cost.pcie_s, 1.0):.0%} under CPU blocks)")
    return "Copies under compute: " + "; ".join(parts) + "."


def bottleneck_line(plan) -> str:
    """Which resource each phase waits on, by the rule of planner/bottleneck.py."""
    names = ", ".join(f"{p} {bottleneck_name(predicted_bottleneck(getattr(plan, p)))}" for p in ("prefill", "decode"))
    return f"Bottleneck: {names} (the resource with the most seconds per step; make it faster first)."


def plan_explanation(plan) -> str:
    """Sentences saying what was placed where and why the step time is what it is."""
    gpu, cpu, disk = plan.tier("gpu"), plan.tier("cpu"), plan.tier("disk")
    lines = [f"Weights: {format_bytes(gpu.weights_bytes)} resident on the GPU, {format_bytes(cpu.weights_bytes)} "
             f"in RAM, {format_bytes(disk.weights_bytes)} on disk.",
             *([f"{plan.moe_summary}."] if plan.moe_summary else []),
             f"Each placement counts weights, the KV cache for batch {plan.workload.batch_size} x "
             f"{plan.workload.seq_len} tokens, activations at the largest shape, staging slots, pinned "
             f"buffers and a {plan.budget.margin_frac:.0%} margin; no tier exceeds its budget."]
    lines += [_decision(plan, "prefill"), _decision(plan, "decode"), overlap_line(plan), bottleneck_line(plan)]
    lines.append("Streaming wins when the CPU would take longer on a unit than copying its weights over "
                 "PCIe; copies overlap compute, so the step takes the longest of compute, PCIe, disk and "
                 "host-memory time, not their sum.")
    lines += list(plan.notes)
    return "\n".join(lines)

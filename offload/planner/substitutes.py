"""Where a substitute draft's weights go on a plan with GPU layers (SubSpec's layout): the model's units resident
on the GPU are the draft's as they are, and every other layer (and a far lm_head) gets a copy in the draft's format,
in VRAM where the room set aside for copies holds it, else in host RAM.

- A copy computes where its layer's KV cache is read from: a layer the model streams keeps its KV on the GPU, so
  its copy must be in VRAM; a layer the model computes on the CPU keeps its KV in host RAM, and its copy in VRAM
  attends to a mirror of that KV in VRAM (the positions the model cached since, copied before each drafting round:
  not a hop across the link per layer and token), or its copy in RAM is computed by the CPU.
- VRAM set aside for copies is VRAM the model's resident layers do not have: the planner tries several amounts
  (planner.speculation.plan_substitutes) and keeps the one with the most predicted tokens per second.
- The draft step is priced by the cost model the plan uses (planner.costs.price_step), each unit in its own format.
Pure arithmetic: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from offload.formats import FLOAT_FORMATS, GGUF_TYPE, QUANT_BLOCK_BYTES
from offload.planner.costs import Phase, cost_kin, cpu_path, launch_s, main_format, price_step, unit_cost
from offload.planner.placement import Placement, UnitPlacement

COPIED_KINDS = ("layer", "experts", "mlp", "lm_head")  # units a draft holds a copy of where the model's are far
ROOM_STEPS = 8  # amounts of VRAM tried for copies, from none to every far unit's


@dataclass(frozen=True)
class SubstituteLayout:
    """A substitute draft's units on a plan with GPU layers: shared (the model's resident units, run as they are),
    on_gpu and on_cpu (copies in fmt held in VRAM or host RAM), and the copies' bytes on each."""

    fmt: str
    shared: tuple[str, ...]
    on_gpu: tuple[str, ...]
    on_cpu: tuple[str, ...]
    gpu_bytes: int
    cpu_bytes: int
    plan_held: tuple[int, int] = (0, 0)  # (VRAM, RAM) set aside for the copies: the model was planned without them
    label: str = ""  # the copies' format as said (a GGUF file's main format where they are read as stored)
    mirrored: tuple[str, ...] = ()  # layers in on_gpu whose KV the model keeps in host RAM: mirrored in VRAM
    mirror_bytes: int = 0  # their mirrors' bytes (in gpu_bytes), brought up to date before each drafting round
    mirror: bool = True  # whether a VRAM copy of a CPU layer has a mirror (else it attends to the host KV)

    def describe(self) -> str:
        copies = len(self.on_gpu) + len(self.on_cpu)
        return (f"{copies} {self.label or self.fmt} cop{'y' if copies == 1 else 'ies'} of the far units "
                f"({len(self.on_gpu)} in VRAM, {len(self.on_cpu)} in RAM) beside the model's {len(self.shared)} "
                f"resident units")


def gpu_fused(spec, fmt: str, compute: str) -> frozenset[str]:
    """The units whose copies in fmt (AS_STORED: each tensor as spec's file stores it) a fused GPU kernel computes:
    every linear weight in a float format, q4_0, q8_0, or a GGUF type with a Triton kernel. A copy in VRAM must be
    one of them: a dequantized copy per use would take the VRAM and time the copy saves."""
    def fused(f: str) -> bool:
        return f in FLOAT_FORMATS or f in QUANT_BLOCK_BYTES or (f in GGUF_TYPE and GGUF_TYPE[f].triton is not None)

    return frozenset(u.name for u in spec.units() if all(fused(f) for f in u.held_formats(fmt, compute)))


def copy_sizes(spec, fmt: str, compute: str) -> dict[str, int]:
    """Each unit's bytes in the draft's format fmt (its float tensors, norms and biases, in compute)."""
    return {u.name: u.nbytes(fmt, compute) for u in spec.units()}


def layout_on(target, sizes: dict[str, int], fmt: str, room: int, label: str = "",
              fused: frozenset[str] | None = None, mirror: bool = True) -> SubstituteLayout | None:
    """The copies for target's far units with room bytes of VRAM for them: the units it streams first (their KV is
    on the GPU: their copies must be there), then the ones it computes on the CPU, in order, as they fit, each with
    a mirror of its layer's KV (the model keeps that in host RAM; the draft attends to the mirror, copied before each
    drafting round, not across the link layer by layer; mirror False: it attends there, as a GPU layer with host KV
    does); the rest in RAM. Only the units in fused (None: all) may have a copy in VRAM: those a fused GPU kernel
    computes (gpu_fused). None where a streamed unit's copy cannot be in VRAM."""
    shared = tuple(u.name for u in target.units if u.weight_tier == "gpu")
    far = [u for u in target.units if u.kind in COPIED_KINDS and u.weight_tier != "gpu"]
    streamed = [u for u in far if u.decode != "cpu"]
    on_gpu, mirrored, used, mirror_bytes = [], [], 0, 0
    for u in streamed + [u for u in far if u.decode == "cpu"]:
        kv = u.kv_bytes if mirror and u.decode == "cpu" and u.kind == "layer" else 0  # its KV mirrored beside it
        if used + sizes[u.name] + kv <= room and (fused is None or u.name in fused):
            on_gpu.append(u.name)
            used, mirror_bytes = used + sizes[u.name] + kv, mirror_bytes + kv
            if kv:
                mirrored.append(u.name)
        elif u.decode != "cpu":
            return None
    held = set(on_gpu)
    on_cpu = tuple(u.name for u in far if u.name not in held)
    return SubstituteLayout(fmt, shared, tuple(u.name for u in far if u.name in held), on_cpu, used,
                            sum(sizes[n] for n in on_cpu), label=label, mirrored=tuple(mirrored),
                            mirror_bytes=mirror_bytes, mirror=mirror)


def draft_step_s(spec, hw, target, layout: SubstituteLayout, context: int, copy_spec=None) -> float:
    """Seconds of one draft step (one token after context cached ones) with target's resident units and
    layout's copies (units of copy_spec, default spec: a GGUF file's copies carry their own stored formats), each
    unit priced in its own format where it computes."""
    phase = Phase("decode", 1, 1, context + 1, context, 1, 1)  # recost.step_phase's for one token
    compute, kv = target.workload.compute_format, target.workload.kv_format
    by_name = {u.name: u for u in target.units}
    on_gpu, on_cpu = set(layout.on_gpu), set(layout.on_cpu)
    copies = {u.name: u for u in (copy_spec or spec).units()}
    costs, kinds, modes, decode, weight, host_kv, memo = [], [], [], [], [], set(), {}
    for i, unit in enumerate(spec.units()):
        plan_unit = by_name[unit.name]
        copied = unit.name in on_gpu or unit.name in on_cpu
        of, unit, fmt = (copy_spec or spec, copies[unit.name], layout.fmt) if copied else (spec, unit,
                                                                                           target.weight_format)
        key = (cost_kin(of, unit), fmt)
        if key not in memo:
            memo[key] = unit_cost(of, unit, fmt, hw, phase, compute, kv)
        costs.append(memo[key])
        kinds.append(unit.kind)
        if unit.name in on_gpu:  # a copy in VRAM, attending to its layer's KV (or its mirror) there, or in host RAM
            where = ("gpu", "gpu", "gpu")
            if plan_unit.decode == "cpu" and unit.kind == "layer" and unit.name not in layout.mirrored:
                host_kv.add(i)
        elif unit.name in on_cpu:
            where = ("cpu", "cpu", "cpu")
        else:  # the model's own unit, as the model runs it
            where = (plan_unit.decode, plan_unit.decode, plan_unit.weight_tier)
        modes.append(where[0]), decode.append(where[1]), weight.append(where[2])
    path = cpu_path(main_format(copy_spec or spec, layout.fmt), compute)
    return price_step(spec, hw, phase, costs, kinds, modes, decode, weight, target.prefetch_depth, path, steady=True,
                      host_kv=frozenset(host_kv), overlap=False).step_s


SYNC_TOKENS = 8  # positions a drafting round copies into the mirrors: about those a verify pass kept


def mirror_sync_s(hw, layout: SubstituteLayout, target) -> float:
    """Seconds of a drafting round's copy into the mirrors: for each mirrored layer, a K and a V copy of the
    positions the model cached since the last round (SYNC_TOKENS of its plan's KV per position, pageable)."""
    if not layout.mirror_bytes or not hw.h2d_pageable_bps:
        return 0.0
    per_token = layout.mirror_bytes / max(target.workload.batch_size * target.workload.seq_len, 1)
    return 2 * len(layout.mirrored) * launch_s(hw) + SYNC_TOKENS * per_token / hw.h2d_pageable_bps


def room_candidates(plain, sizes: dict[str, int], budget_gpu: int) -> list[int]:
    """VRAM amounts to try for copies: ROOM_STEPS + 1 from none to every unit's copy and every layer's KV mirror,
    within the GPU budget less what the plain plan keeps there besides weights, KV and staging (the CUDA context,
    the margin, the activations: the GPU needs them whoever holds the weights)."""
    gpu = plain.tier("gpu")
    usable = max(budget_gpu - gpu.reserved_bytes - gpu.margin_bytes - gpu.workspace_bytes, 0)
    most = min(sum(sizes[u.name] + (u.kv_bytes if u.kind == "layer" else 0) for u in plain.units
                   if u.kind in COPIED_KINDS), usable)
    return sorted({most * i // ROOM_STEPS for i in range(ROOM_STEPS + 1)})


def draft_placement(target: Placement, layout: SubstituteLayout) -> Placement:
    """The substitute draft's Placement beside target's (the model's, as planned): its shared units resident as
    the model's, its copies in VRAM (a layer's KV where the model keeps it, or its mirror in VRAM) or computed by
    the CPU from host RAM, the rest (the embedding, which the draft looks up in the model's, and the final norm)
    computed where the lm_head it feeds runs."""
    on_gpu, on_cpu, shared, mirrored = set(layout.on_gpu), set(layout.on_cpu), set(layout.shared), set(layout.mirrored)
    head_tier = "gpu" if "lm_head" in shared or "lm_head" in on_gpu else "cpu"
    units = {}
    for name, p in target.units.items():
        if name in shared or name in on_gpu:  # a mirrored layer attends to its KV's copy in VRAM
            units[name] = UnitPlacement("gpu", "gpu", "gpu", "gpu" if name in mirrored else p.kv)
        elif name in on_cpu:
            units[name] = UnitPlacement("cpu", "cpu", "cpu", "cpu" if p.kv else None)
        elif name == "norm":
            units[name] = UnitPlacement(head_tier, head_tier, head_tier)
        else:
            units[name] = UnitPlacement("cpu", "cpu", "cpu", "cpu" if p.kv else None)
    return Placement(units, prefill_chunk_tokens=target.prefill_chunk_tokens,
                     prefill_pass_tokens=target.prefill_pass_tokens)

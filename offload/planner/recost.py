"""The plan re-costed for the steps a run actually took: the report's predicted time, set against the measured.

A plan predicts one step of its own workload (its batch, prompt and output lengths); a run takes other steps
(mixed steps, batches that shrink as sequences finish, prompts of every length). Each step the generator ran
is priced again by the same cost model and placement (planner.costs.price_step), so predicted ÷ measured time
checks the cost model itself, not the guess of the workload. Pure arithmetic: no torch.
"""

from __future__ import annotations

from offload.hardware import HardwareProfile
from offload.planner.costs import Phase, cost_kin, cpu_path, main_format, price_step, unit_cost
from offload.planner.types import PHASES, Plan
from offload.spec import ModelSpec


def step_phase(shape) -> Phase:
    """The cost model's Phase for one step's shape (a profile.timeline.StepShape)."""
    n_tokens, n_seqs = max(shape.n_tokens, 1), max(shape.n_seqs, 1)
    return Phase(shape.phase, n_seqs, n_tokens, max(round(shape.attended_keys / n_tokens), 1),
                 round(shape.kv_read_tokens / n_seqs), 1, shape.n_logits, shape.threads)


def recost_steps(spec: ModelSpec, hw: HardwareProfile, plan: Plan, shapes, gap_s: float = 0.0) -> dict[str, float]:
    """Predicted seconds of the steps run, per phase, for plan's placement on hw (gap_s: the host's own work before
    each decode step, counted in, with the step's first copies and reads under it: price_step's)."""
    units = spec.units()
    kinds = [u.kind for u in units]
    by_name = {u.name: u for u in plan.units}
    weight = [by_name[u.name].weight_tier for u in units]
    modes = {p: [getattr(by_name[u.name], p) for u in units] for p in PHASES}
    cached = frozenset(i for i, u in enumerate(units) if by_name[u.name].page_cached)
    host_kv = frozenset(i for i, u in enumerate(units)  # GPU layers whose KV cache is in host RAM
                        if u.kind == "layer" and by_name[u.name].kv_tier == "cpu" and by_name[u.name].decode != "cpu")
    path = cpu_path(main_format(spec, plan.weight_format), plan.workload.compute_format)
    unit_memo: dict = {}
    step_memo: dict[Phase, float] = {}
    out = dict.fromkeys(PHASES, 0.0)
    for shape in shapes:
        phase = step_phase(shape)
        if phase not in step_memo:
            costs = []
            for u in units:
                key = (cost_kin(spec, u), phase)
                if key not in unit_memo:
                    unit_memo[key] = unit_cost(spec, u, plan.weight_format, hw, phase, plan.workload.compute_format,
                                               plan.workload.kv_format)
                costs.append(unit_memo[key])
            step_memo[phase] = price_step(spec, hw, phase, costs, kinds, modes[phase.name], modes["decode"], weight,
                                          plan.prefetch_depth, path, steady=phase.name == "decode",
                                          cached=cached, host_kv=host_kv, overlap=False,
                                          gap_s=gap_s if phase.name == "decode" else 0.0).step_s
        out[phase.name] += step_memo[phase]
    return out


def recost_steps_at(spec: ModelSpec, hw: HardwareProfile, plan: Plan, shapes, speeds) -> dict[str, float]:
    """recost_steps with each step priced on hw moved to the CPU's speed while it ran ((memory, compute, attention)
    per shape, as HardwareProfile.at_speed takes them), rounded to 1% so that the steps at one speed are priced
    together."""
    groups: dict[tuple, list] = {}
    for shape, speed in zip(shapes, speeds, strict=True):
        groups.setdefault(tuple(None if r is None else round(r, 2) for r in speed), []).append(shape)
    out = dict.fromkeys(PHASES, 0.0)
    for speed, group in groups.items():
        for phase, seconds in recost_steps(spec, hw.at_speed(*speed), plan, group).items():
            out[phase] += seconds
    return out

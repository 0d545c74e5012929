"""What-ifs: the same job re-planned through plan_for with one thing changed, each prediction set against the
current plan's. Pure arithmetic (a plan takes milliseconds to a few tens of them); no torch.

The changes, each alone (the batch stays the current plan's unless the batch is what changes):
- quantization: each of none, q8_0, q4_0 other than the current one;
- GPU memory: 8 GiB more VRAM and GPU budget (only where the hardware has a GPU);
- batch size: half and double the plan's batch (where the half is 1 or more);
- hardware: the next preset up (see next_preset), with its own default memory budgets (the request's
  budgets describe the current machine); skipped at the top.
A change whose plan fails (it does not fit, or the request is refused) is kept with the planner's reason.

For a run's report the what-ifs are priced for the steps the run took (planner.recost), as its prediction is, and
set against the current plan priced for the same steps; the batch what-ifs would have taken other steps, so they
keep the plans' own workload (predicted_for says which).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from offload.errors import ConfigError, PlanError
from offload.formats import QUANTIZATIONS
from offload.hardware import HardwareProfile, load_hardware, preset_names
from offload.planner.recost import recost_steps
from offload.planner.request import PlanRequest, plan_for, plan_spec
from offload.planner.types import PHASES, Plan
from offload.spec import ModelSpec

MORE_VRAM_BYTES = 8 * 2**30  # a step up a GPU line (16 -> 24 GiB, 24 -> 32 GiB)
WHAT_IFS_HEADER = "what-ifs (the same job re-planned with one change; Nx: predicted speed against this plan):"
STEPS_RUN, PLAN_WORKLOAD = "the steps run", "the plan's workload"  # what a what-if's figures are predicted for


@dataclass(frozen=True)
class WhatIf:
    """One change to the request and its predicted speed; the s/token figures are None when it does not fit."""

    label: str  # as printed: "q4_0", "+8 GiB VRAM", "batch 32", "hardware h200-server"
    change: str  # the PlanRequest field changed: quantization | gpu_memory | batch_size | hardware
    value: str | int  # its new value (gpu_memory in bytes, hardware by preset name)
    prefill_s_per_token: float | None = None
    decode_s_per_token: float | None = None
    prefill_speedup: float | None = None  # the current plan's s/token over this one's: 2.0 is twice as fast
    decode_speedup: float | None = None
    reason: str | None = None  # why it does not fit: the first clause of the planner's error
    # in a run's report, what its figures are predicted for: STEPS_RUN (the steps it took, priced again) or
    # PLAN_WORKLOAD (a batch what-if); None in a plan's (everything is for its workload)
    predicted_for: str | None = None

    @property
    def fits(self) -> bool:
        return self.reason is None

    def to_dict(self) -> dict:
        d = {k: _finite(v) for k, v in asdict(self).items()}
        d.update(fits=self.fits, prefill_tokens_per_s=_per_s(self.prefill_s_per_token),
                 decode_tokens_per_s=_per_s(self.decode_s_per_token))
        return d

    def line(self) -> str:
        return what_if_line(self.to_dict())


def what_ifs(spec: ModelSpec, hw: HardwareProfile, request: PlanRequest, current: Plan,
             steps=None) -> list[WhatIf]:
    """current's job (spec on hw, as request asked) re-planned with one change each, in the order above; priced for
    steps (profile.timeline.StepShape, a run's) where given, except the batch what-ifs."""
    base = request.with_options(hardware=hw, batch_size=current.workload.batch_size)
    run = _StepsRun(spec, hw, current, steps) if steps else None
    out = [_replan(spec, current, label, change, value, req, None if change == "batch_size" else run)
           for label, change, value, req in _changes(base, hw, current)]
    return [replace(w, predicted_for=PLAN_WORKLOAD) if run and w.predicted_for is None else w for w in out]


class _StepsRun:
    """A run's steps, their tokens per phase, and the current plan's seconds for them."""

    def __init__(self, spec: ModelSpec, hw: HardwareProfile, current: Plan, steps):
        self.steps = steps
        self.tokens = dict.fromkeys(PHASES, 0)
        for shape in steps:
            self.tokens[shape.phase] += shape.n_tokens
        self.current = self.s_per_token(spec, hw, current)

    def s_per_token(self, spec: ModelSpec, hw: HardwareProfile, plan: Plan) -> dict[str, float]:
        seconds = recost_steps(plan_spec(spec, plan), hw, plan, self.steps)
        return {p: seconds[p] / n if n else math.inf for p, n in self.tokens.items()}


def _changes(base: PlanRequest, hw: HardwareProfile, current: Plan) -> list[tuple[str, str, object, PlanRequest]]:
    out = [(q, "quantization", q, base.with_options(quantization=q)) for q in QUANTIZATIONS
           if q != base.model.quantization]
    if hw.has_gpu:
        gpu_bytes = current.budget.gpu_bytes + MORE_VRAM_BYTES
        bigger = hw.with_changes(vram_bytes=hw.vram_bytes + MORE_VRAM_BYTES)
        out.append((f"+{MORE_VRAM_BYTES // 2**30} GiB VRAM", "gpu_memory", gpu_bytes,
                    base.with_options(hardware=bigger, gpu_memory=gpu_bytes)))
    batch = current.workload.batch_size
    for n in (batch // 2, 2 * batch):
        if n >= 1:
            out.append((f"batch {n}", "batch_size", n, base.with_options(batch_size=n)))
    up = next_preset(hw)
    if up is not None:
        out.append((f"hardware {up.name}", "hardware", up.name,
                    base.with_options(hardware=up, gpu_memory=None, cpu_memory=None)))
    return out


def _replan(spec: ModelSpec, current: Plan, label: str, change: str, value, request: PlanRequest,
            run: _StepsRun | None) -> WhatIf:
    try:
        hw = request.profile()
        plan = plan_for(spec, hw, request)
    except (ConfigError, PlanError) as e:
        return WhatIf(label, change, value, reason=first_clause(str(e)))
    if run is not None:
        new = run.s_per_token(spec, hw, plan)
        return WhatIf(label, change, value, _finite(new["prefill"]), _finite(new["decode"]),
                      _speedup(run.current["prefill"], new["prefill"]), _speedup(run.current["decode"], new["decode"]),
                      predicted_for=STEPS_RUN)
    pre, dec = plan.prefill.s_per_token, plan.decode.s_per_token
    return WhatIf(label, change, value, pre, dec, _speedup(current.prefill.s_per_token, pre),
                  _speedup(current.decode.s_per_token, dec))


def next_preset(hw: HardwareProfile) -> HardwareProfile | None:
    """The GPU preset one step up from hw: presets ranked by (VRAM, GPU FLOP/s), the lowest ranked above hw (for a
    CPU-only profile, the smallest GPU preset); None when none is above."""
    above = [p for p in map(load_hardware, preset_names()) if p.has_gpu and _rank(p) > _rank(hw)]
    return min(above, key=_rank, default=None)


def _rank(hw: HardwareProfile) -> tuple[int, float]:
    return (hw.vram_bytes, hw.gpu_flops) if hw.has_gpu else (0, 0.0)


def first_clause(message: str) -> str:
    """What is wrong, from an error message: up to its first '; ' (the advice follows), after 'does not fit: '."""
    return message.split("; ")[0].rstrip(".").split(" does not fit: ")[-1]


def what_if_line(d: dict) -> str:
    """One what-if (as to_dict gives it) as text: 'q4_0: predicted 2.10x decode, 1.30x prefill (...)'."""
    if not d["fits"]:
        return f"{d['label']}: does not fit: {d['reason']}"
    workload = f", for {PLAN_WORKLOAD}" if d.get("predicted_for") == PLAN_WORKLOAD else ""
    return (f"{d['label']}: predicted {_times(d['decode_speedup'])} decode, {_times(d['prefill_speedup'])} prefill "
            f"({_rate(d['decode_tokens_per_s'])} decode, {_rate(d['prefill_tokens_per_s'])} prefill tokens/s"
            f"{workload})")


def format_what_ifs(dicts: list[dict]) -> list[str]:
    """The header and one indented line per what-if (none: no lines)."""
    return [WHAT_IFS_HEADER, *(f"  {what_if_line(d)}" for d in dicts)] if dicts else []


def _speedup(current_s: float, new_s: float) -> float | None:
    ratio = current_s / new_s if new_s > 0 else math.inf
    return ratio if math.isfinite(ratio) and ratio > 0 else None


def _per_s(s_per_token: float | None) -> float | None:
    return 1 / s_per_token if s_per_token and math.isfinite(s_per_token) else None


def _finite(value):
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _times(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}x" if x >= 0.1 else f"{x:.2g}x"


def _rate(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3g}" if x < 1000 else f"{x:.0f}"

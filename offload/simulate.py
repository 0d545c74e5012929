"""`offload simulate`: the executor's real schedule on a timed simulated device, beside the planner's prediction.

What would Llama-3.1-70B in q4_0 do on a 24 GB card with DDR5, before buying either? The plan is made as for a
real run; weights are meta tensors (no memory, no files); the simulated GPU's copies, disk reads and blocks take
the times the hardware profile and the cost model give; the real executor and generator drive it, so the
prefetch ring, the read-ahead, the hand-overs and the prefill passes are the ones a real run would make.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

from offload.engine import run_to_end
from offload.errors import ConfigError
from offload.formats import torch_dtype
from offload.generate import Generator
from offload.hardware import format_bytes
from offload.planner import Placement, Plan, PlanRequest, plan_for, plan_spec
from offload.planner.bottleneck import bottleneck_name, predicted_bottleneck
from offload.planner.types import PHASES, TIERS
from offload.profile.report import write_trace
from offload.profile.timeline import RESOURCES, Timeline
from offload.runtime.backends.sim import SimBackend, TimedCosts
from offload.runtime.executor import PlacedModel
from offload.sampling import SamplingParams
from offload.sequence import Sequence
from offload.weights.model_files import model_spec
from offload.weights.default_model import resolve_model
from offload.weights.sources import MetaSource

DEFAULT_DECODE_STEPS = 8  # simulated decode steps: enough for a steady state, few enough to stay quick


@dataclass
class PhaseResult:
    """One phase as simulated, beside the plan's prediction of it."""

    phase: str
    steps: int
    tokens: int
    simulated_s: float  # simulated time of the whole phase
    predicted_step_s: float
    busy_share: dict[str, float]

    step_s: float = 0.0  # prefill: the whole batch's passes; decode: the median step once the pipeline is full

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.simulated_s if self.simulated_s > 0 else 0.0

    @property
    def predicted_over_simulated(self) -> float:
        return self.predicted_step_s / self.step_s if self.step_s > 0 else 0.0


@dataclass
class Simulation:
    """The plan, what the simulated device did in each phase, and peak memory per tier against the plan."""

    plan: Plan
    phases: dict[str, PhaseResult]
    peak_bytes: dict[str, int]
    timeline: Timeline = field(repr=False)
    log: list = field(default_factory=list, repr=False)  # the staging ring's (event, unit, slot) in issue order
    requests: int | None = None  # a job of this many requests (of the simulated prompt length) to estimate

    @property
    def job(self) -> dict | None:
        """A job of `requests` prompts as simulated, each generating the plan's max_tokens, run at the plan's batch:
        its prompt tokens at the simulated prefill speed plus its generated tokens at the simulated decode speed."""
        if not self.requests:
            return None
        pre, dec = self.phases["prefill"], self.phases["decode"]
        prompt_len, gen_len = pre.tokens // max(self.plan.workload.batch_size, 1), self.plan.workload.gen_len
        prefill_s = self.requests * prompt_len / pre.tokens_per_s if pre.tokens_per_s else 0.0
        decode_s = self.requests * gen_len / dec.tokens_per_s if dec.tokens_per_s else 0.0
        total = prefill_s + decode_s
        return {"requests": self.requests, "prompt_len": prompt_len, "gen_len": gen_len,
                "batch_size": self.plan.workload.batch_size, "prefill_s": prefill_s, "decode_s": decode_s,
                "generated_tokens_per_s": self.requests * gen_len / total if total else 0.0,
                "decode_bound": predicted_bottleneck(self.plan.decode)}

    def to_dict(self) -> dict:
        return {"plan": self.plan.to_dict(), "peak_bytes": self.peak_bytes,
                "phases": {p: {"steps": r.steps, "tokens": r.tokens, "simulated_s": r.simulated_s,
                               "step_s": r.step_s, "tokens_per_s": r.tokens_per_s,
                               "predicted_step_s": r.predicted_step_s,
                               "predicted_over_simulated": r.predicted_over_simulated, "busy_share": r.busy_share}
                           for p, r in self.phases.items()},
                **({"job": self.job} if self.job else {})}

    def table(self) -> str:
        wl = self.plan.workload
        lines = [f"simulated: {self.plan.model} ({self.plan.weight_format}) on {self.plan.hardware}: batch "
                 f"{wl.batch_size}, prompt {wl.prompt_len}, {self.phases['decode'].steps} decode steps", "",
                 "phase    tokens/s   step        predicted   pred/sim  busy: gpu   pcie  cpu   disk"]
        for r in self.phases.values():
            busy = "  ".join(f"{r.busy_share[k]:4.0%}" for k in ("gpu", "pcie", "cpu", "disk"))
            lines.append(f"{r.phase:8s} {r.tokens_per_s:9.2f}  {_s(r.step_s):10s}  {_s(r.predicted_step_s):10s}  "
                         f"{r.predicted_over_simulated:6.2f}    {busy}")
        lines.append("")
        if self.job:
            j = self.job
            lines += [f"job: {j['requests']} requests of {j['prompt_len']} prompt + {j['gen_len']} generated tokens at "
                      f"batch {j['batch_size']}: {j['generated_tokens_per_s']:.1f} generated tokens/s (prefill "
                      f"{j['prefill_s']:.0f} s + decode {j['decode_s']:.0f} s; decode bound by "
                      f"{bottleneck_name(j['decode_bound'])})", ""]
        for tier in ("gpu", "cpu"):
            planned = self.plan.tier(tier)
            lines.append(f"peak {tier}: {format_bytes(self.peak_bytes[tier])} of {format_bytes(planned.total_bytes)} "
                         f"planned (budget {format_bytes(planned.budget_bytes)}; activations not counted)")
        return "\n".join(lines)


def _s(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds < 10 else f"{seconds:.1f} s"


def simulate(request: PlanRequest, decode_steps: int = DEFAULT_DECODE_STEPS, trace: str | Path | None = None,
             plan: Plan | None = None, prompt_len: int | None = None, requests: int | None = None) -> Simulation:
    """Plan request (or take plan), then run one prefill of the plan's batch (prompts of prompt_len tokens, else
    the plan's) and decode_steps decode steps on a timed simulated device of the planned GPU budget; write a Chrome
    trace to trace if given; requests: estimate a job of that many such prompts (Simulation.job)."""
    spec = model_spec(resolve_model(request.model.path))
    hw = request.profile()
    plan = plan or plan_for(spec, hw, request)
    spec = plan_spec(spec, plan)
    wl = plan.workload
    dtype = torch_dtype(wl.compute_format)
    backend = SimBackend(hw, capacity_bytes=max(plan.budget.gpu_bytes, 0),
                         timed=TimedCosts(spec, hw, plan.weight_format, wl.compute_format, wl.kv_format))
    placement = Placement.from_plan(plan)
    model = PlacedModel(spec, MetaSource(spec, dtype, request.model.quantization), placement, backend, dtype,
                        kv_dtype=torch_dtype(wl.cache_format))
    params = SamplingParams(max_tokens=decode_steps + 1, temperature=0, ignore_eos=True)
    prompt_len = prompt_len or wl.prompt_len
    if prompt_len > wl.seq_len:
        raise ConfigError(f"a prompt of {prompt_len} tokens does not fit the plan's {wl.seq_len}-token sequences "
                          f"(max_model_len); give a shorter --prompt-len or a larger --max-model-len")
    seqs = [Sequence(i, [1] * prompt_len, params) for i in range(wl.batch_size)]
    generator = Generator(model, max_batch_size=wl.batch_size, step_tokens=placement.prefill_pass_tokens,
                          max_model_len=max(prompt_len, wl.prompt_len) + decode_steps + 1, mixed=False)
    generator.prefix_caching = False  # the plan's prefill computes every prompt (--prefix-hit-rate prices hits)
    run_to_end(generator, seqs)  # the plan's shape: prompts, then decode steps of the whole batch (mixed steps
    # would start some sequences' decode inside the prefill)
    model.flush()
    timeline = backend.timeline
    if trace is not None:
        write_trace(timeline, Path(trace))
    phases = {p: _phase(timeline, p, plan) for p in PHASES}
    return Simulation(plan, phases, {t: backend.memory.peak_bytes[t] for t in TIERS}, timeline, backend.log,
                      requests)


def _phase(timeline: Timeline, phase: str, plan: Plan) -> PhaseResult:
    time_s, steps = timeline.phase_time_s[phase], timeline.step_s[phase]
    busy = {r: (timeline.busy_s(r, phase) / time_s if time_s > 0 else 0.0) for r in RESOURCES}
    # a decode step after prefill starts with an empty prefetch ring: the steady state is the median step
    step_s = time_s if phase == "prefill" else statistics.median(steps) if steps else 0.0
    return PhaseResult(phase, len(steps), timeline.phase_tokens[phase], time_s, getattr(plan, phase).step_s, busy,
                       step_s)

"""The planner: place every unit on gpu/cpu/disk and pick where it computes per phase, within a budget.

plan(spec, hardware, budget, workload) searches the number of GPU-resident units (in order of time saved
per byte); for each, it decides per phase which offloaded units stream to the GPU and which compute on
the CPU (greedily, best gain per PCIe second first, keeping the prefix with the shortest step), spills
host weights to disk when RAM is short, and keeps the candidate with the shortest job time. Pure
arithmetic: no torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

from offload.costs import LOGIT_BYTES, PhaseCost
from offload.errors import ConfigError, PlanError
from offload.hardware import HardwareProfile
from offload.spec import FLOAT_FORMATS, FORMATS, ModelSpec

TIERS = ("gpu", "cpu", "disk")
COMPUTE_MODES = ("gpu", "stream", "cpu")
DEFAULT_PREFETCH_DEPTH = 2


@dataclass(frozen=True)
class Budget:
    """Bytes each tier may use; margin_frac of the gpu and cpu budgets is held back for fragmentation."""

    gpu_bytes: int
    cpu_bytes: int
    disk_bytes: int = 0
    margin_frac: float = 0.05

    def __post_init__(self):
        for name in ("gpu_bytes", "cpu_bytes", "disk_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"budget {name} must be 0 or more, found {getattr(self, name)}")
        if not 0 <= self.margin_frac < 1:
            raise ConfigError(f"budget margin_frac must be in [0, 1), found {self.margin_frac}")

    @classmethod
    def for_hardware(cls, hw: HardwareProfile, gpu_bytes: int | None = None, cpu_bytes: int | None = None,
                     disk_bytes: int = 0, margin_frac: float = 0.05) -> Budget:
        """Defaults: 90% of VRAM (the CUDA context takes the rest), 80% of RAM (the OS keeps the rest)."""
        gpu = (int(0.9 * hw.vram_bytes) if hw.has_gpu else 0) if gpu_bytes is None else gpu_bytes
        cpu = int(0.8 * hw.ram_bytes) if cpu_bytes is None else cpu_bytes
        return cls(gpu, cpu, disk_bytes, margin_frac)

    def limit(self, tier: str) -> int:
        return {"gpu": self.gpu_bytes, "cpu": self.cpu_bytes, "disk": self.disk_bytes}[tier]

    def margin_bytes(self, tier: str) -> int:
        return int(self.limit(tier) * self.margin_frac) if tier != "disk" else 0


@dataclass(frozen=True)
class Workload:
    """What one run asks for: batch_size sequences of prompt_len tokens, each generating gen_len tokens."""

    batch_size: int = 1
    prompt_len: int = 512
    gen_len: int = 128
    prefill_chunk_tokens: int = 512  # prefill runs layer by layer over chunks of this many tokens
    kv_dtype: str = "fp16"

    def __post_init__(self):
        for name in ("batch_size", "prompt_len", "gen_len", "prefill_chunk_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"workload {name} must be a whole number of 1 or more, "
                                  f"found {getattr(self, name)!r}")
        if self.kv_dtype not in FLOAT_FORMATS:
            raise ConfigError(f"workload kv_dtype {self.kv_dtype!r} is not supported; use fp16, bf16 or fp32")

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.gen_len

    @property
    def kv_elem_bytes(self) -> int:
        return FLOAT_FORMATS[self.kv_dtype]


@dataclass(frozen=True)
class UnitPlan:
    """Where one unit's weights live, where it computes per phase, and where its KV cache lives."""

    name: str
    kind: str
    index: int | None
    weight_tier: str  # gpu | cpu | disk
    prefill: str  # gpu | stream | cpu
    decode: str
    kv_tier: str | None  # layers only: where the decode computes
    weight_bytes: int
    kv_bytes: int


@dataclass(frozen=True)
class TierUsage:
    """Bytes planned on one tier, by what they hold."""

    tier: str
    budget_bytes: int
    weights_bytes: int = 0
    kv_bytes: int = 0
    workspace_bytes: int = 0  # activations and scratch at the largest shape
    staging_bytes: int = 0  # ring of slots that streamed weights are copied into
    pinned_bytes: int = 0  # page-locked buffers: disk read-ahead and hidden-state hand-over
    margin_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return (self.weights_bytes + self.kv_bytes + self.workspace_bytes + self.staging_bytes
                + self.pinned_bytes + self.margin_bytes)

    @property
    def free_bytes(self) -> int:
        return self.budget_bytes - self.total_bytes


@dataclass(frozen=True)
class Plan:
    """A frozen placement with its predicted cost; prints as a table, serialises to JSON, explains itself."""

    model: str
    hardware: str
    weight_format: str
    workload: Workload
    budget: Budget
    units: tuple[UnitPlan, ...]
    tiers: tuple[TierUsage, ...]
    prefill: PhaseCost
    decode: PhaseCost
    prefetch_depth: int
    staging_slot_bytes: int
    notes: tuple[str, ...] = field(default=())

    def unit(self, name: str) -> UnitPlan:
        return next(u for u in self.units if u.name == name)

    def tier(self, name: str) -> TierUsage:
        return next(t for t in self.tiers if t.tier == name)

    @property
    def n_gpu_units(self) -> int:
        return sum(u.weight_tier == "gpu" for u in self.units)

    @property
    def summary_line(self) -> str:
        """The stable, greppable line: how many units have their weights resident on the GPU."""
        return f"offloaded {self.n_gpu_units}/{len(self.units)} blocks to GPU"

    @property
    def job_s(self) -> float:
        """Predicted time of the whole workload: one prefill plus gen_len decode steps."""
        return self.prefill.step_s + self.workload.gen_len * self.decode.step_s

    def to_dict(self) -> dict:
        return {
            "model": self.model, "hardware": self.hardware, "weight_format": self.weight_format,
            "workload": asdict(self.workload), "budget": asdict(self.budget),
            "summary": self.summary_line, "n_gpu_units": self.n_gpu_units, "n_units": len(self.units),
            "prefetch_depth": self.prefetch_depth, "staging_slot_bytes": self.staging_slot_bytes,
            "tiers": {t.tier: {**asdict(t), "total_bytes": t.total_bytes} for t in self.tiers},
            "phases": {"prefill": self.prefill.to_dict(), "decode": self.decode.to_dict()},
            "predicted_job_s": self.job_s,
            "units": [asdict(u) for u in self.units],
            "notes": list(self.notes),
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=_json_default)

    def table(self) -> str:
        from offload.plan_text import plan_table

        return plan_table(self)

    def explain(self) -> str:
        from offload.plan_text import plan_explanation

        return plan_explanation(self)

    def __str__(self) -> str:
        return self.table()


def _json_default(value):
    if isinstance(value, float) and math.isinf(value):
        return None
    raise TypeError(f"cannot serialise {value!r}")


def plan(spec: ModelSpec, hardware: HardwareProfile, budget: Budget, workload: Workload,
         weight_format: str | None = None, prefetch_depth: int = DEFAULT_PREFETCH_DEPTH) -> Plan:
    """The fastest placement of spec's units within budget for workload on hardware; PlanError if none fits."""
    from offload.placement import Search

    fmt = weight_format or spec.dtype
    if fmt not in FORMATS:
        raise ConfigError(f"weight format {fmt!r} is not supported; use one of {', '.join(FORMATS)}")
    if prefetch_depth < 1:
        raise ConfigError(f"prefetch depth must be 1 or more, found {prefetch_depth}")
    return Search(spec, hardware, budget, workload, fmt, prefetch_depth).run()


def plan_batch(spec: ModelSpec, hardware: HardwareProfile, budget: Budget, workload: Workload,
               weight_format: str | None = None, prefetch_depth: int = DEFAULT_PREFETCH_DEPTH,
               max_batch: int = 256) -> Plan:
    """The plan whose batch size (powers of two up to max_batch) gives the highest predicted job throughput.

    workload.batch_size is ignored; PlanError if not even one sequence fits.
    """
    best, best_rate, batch = None, 0.0, 1
    while batch <= max_batch:
        try:
            candidate = plan(spec, hardware, budget, _with_batch(workload, batch), weight_format, prefetch_depth)
        except PlanError:
            if best is None:
                raise
            break  # a larger batch needs more KV and workspace still
        rate = batch * workload.gen_len / candidate.job_s
        if rate > best_rate:
            best, best_rate = candidate, rate
        batch *= 2
    return best


def _with_batch(workload: Workload, batch: int) -> Workload:
    from dataclasses import replace

    return replace(workload, batch_size=batch)


def workspace_bytes(spec: ModelSpec, workload: Workload, act_bytes: int, dequant_scratch: bool) -> int:
    """Activations at the largest shape on one device, plus bf16 scratch to dequantize the largest tensor."""
    b, p = workload.batch_size, workload.prompt_len
    chunk = min(b * p, workload.prefill_chunk_tokens)
    hidden = b * p * spec.hidden_size * act_bytes  # residual stream of the whole prompt batch, kept between layers
    working = max(spec.activation_bytes(chunk, p, act_bytes),
                  spec.activation_bytes(b, workload.seq_len, act_bytes))
    logits = b * spec.vocab_size * LOGIT_BYTES
    scratch = max(t.numel for t in spec.layer_tensors(0) if t.role == "linear") * 2 if dequant_scratch else 0
    return hidden + working + logits + scratch


__all__ = ["Budget", "Workload", "UnitPlan", "TierUsage", "Plan", "PhaseCost", "PlanError", "plan",
           "workspace_bytes", "TIERS", "COMPUTE_MODES"]

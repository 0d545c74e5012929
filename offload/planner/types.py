"""The planner's values: Budget, Workload, and the Plan it makes (units, tier usage, predicted phases). No torch."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

from offload.errors import ConfigError
from offload.formats import FLOAT_FORMATS
from offload.hardware import HardwareProfile
from offload.options import DEFAULT_PREFILL_CHUNK_TOKENS  # tokens a layer computes at once in prefill
from offload.planner.costs import PhaseCost
from offload.planner.schedule import PhaseSchedule, phase_schedule
from offload.planner.text import moe_split, plan_explanation, plan_table

TIERS = ("gpu", "cpu", "disk")  # where weights (and KV caches) live
PHASES = ("prefill", "decode")
COMPUTE_MODES = ("gpu", "stream", "cpu")  # resident on the GPU, streamed to it ahead of use, or on the CPU
DEFAULT_PREFETCH_DEPTH = 2
DEFAULT_PREFILL_PASS_TOKENS = 4096  # padded prompt tokens per pass over the weights: bounds the residual stream


@dataclass(frozen=True)
class Budget:
    """Bytes each tier may use; margin_frac of the gpu and cpu budgets is held back for fragmentation."""

    gpu_bytes: int
    cpu_bytes: int
    disk_bytes: int = 0
    margin_frac: float = 0.05
    page_cache_bytes: int = 0  # page cache the OS can keep for disk units besides cpu_bytes (measured when planning)
    host_baseline_bytes: int = 0  # what the process holds besides the plan; cpu_bytes is the budget less it

    @property
    def process_cpu_bytes(self) -> int:
        """The CPU budget as the user gave it: the whole process (what the memory watch holds it to)."""
        return self.cpu_bytes + self.host_baseline_bytes

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
    prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS  # tokens one layer computes at once in prefill
    prefill_pass_tokens: int = DEFAULT_PREFILL_PASS_TOKENS  # padded tokens per prefill pass over the weights
    compute_format: str = "fp16"  # activations, the KV cache, and the weights a quantization leaves unquantized
    kv_format: str = ""  # the KV cache's, where it differs from compute_format (kv_cache_dtype); "": the same

    def __post_init__(self):
        for name in ("batch_size", "prompt_len", "gen_len", "prefill_chunk_tokens", "prefill_pass_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"workload {name} must be a whole number of 1 or more, "
                                  f"found {getattr(self, name)!r}")
        for name in ("compute_format", "kv_format"):
            if getattr(self, name) not in FLOAT_FORMATS and (name == "compute_format" or self.kv_format):
                raise ConfigError(f"workload {name} {getattr(self, name)!r} is not supported; use fp16, bf16 or fp32")

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.gen_len

    @property
    def kv_elem_bytes(self) -> int:
        return FLOAT_FORMATS[self.cache_format]

    @property
    def cache_format(self) -> str:
        """The KV cache's format."""
        return self.kv_format or self.compute_format


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
    page_cached: bool = False  # a disk unit the page cache is left to keep between reads (its reads are cheap)
    stored: str = ""  # the formats its weights are held in, most weights first, joined by "+" (q5_0+q8_0)


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
    reserved_bytes: int = 0  # GPU: what the process holds outside offload's buffers (CUDA context, cuBLAS)

    @property
    def total_bytes(self) -> int:
        return (self.weights_bytes + self.kv_bytes + self.workspace_bytes + self.staging_bytes
                + self.pinned_bytes + self.margin_bytes + self.reserved_bytes)

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
    prefetch_depth: int  # staging slots on the GPU (copies run this many streamed units ahead)
    staging_slot_bytes: int
    read_ahead_depth: int  # disk units read ahead of use at most
    read_buffer_bytes: int  # the arena they are read into (pinned where they are copied to a GPU)
    notes: tuple[str, ...] = field(default=())
    split_mlp: bool = False  # dense layers' MLPs are units of their own (mlp.i): the spec this plan places

    def unit(self, name: str) -> UnitPlan:
        return next(u for u in self.units if u.name == name)

    def tier(self, name: str) -> TierUsage:
        return next(t for t in self.tiers if t.tier == name)

    @property
    def n_gpu_units(self) -> int:
        return sum(u.weight_tier == "gpu" for u in self.units)

    @property
    def summary_line(self) -> str:
        """The stable, greppable line, in words read one way: blocks resident on the GPU; of the others, how many
        each phase streams to it and computes on the CPU; and how many are read from disk."""
        away = [u for u in self.units if u.weight_tier != "gpu"]
        phases = "; ".join(f"{p} streams {n} and computes {len(away) - n} on the CPU"
                           for p, n in ((p, sum(getattr(u, p) == "stream" for u in away)) for p in ("decode", "prefill")))
        on_disk = sum(u.weight_tier == "disk" for u in away)
        return (f"blocks: {self.n_gpu_units} of {len(self.units)} resident on the GPU" + (f"; {phases}" if away else "")
                + f"; {on_disk} read from disk")

    @property
    def moe_summary(self) -> str | None:
        """Of a MoE model, where its attention parts and experts are (see text.moe_split); None for a dense one."""
        return moe_split(self)

    @property
    def job_s(self) -> float:
        """Predicted time of the whole workload: one prefill plus gen_len decode steps."""
        return self.prefill.step_s + self.workload.gen_len * self.decode.step_s

    def to_dict(self) -> dict:
        return {
            "model": self.model, "hardware": self.hardware, "weight_format": self.weight_format,
            "workload": asdict(self.workload), "budget": asdict(self.budget),
            "summary": self.summary_line, "n_gpu_units": self.n_gpu_units, "n_units": len(self.units),
            **({"moe_summary": self.moe_summary} if self.moe_summary else {}), "split_mlp": self.split_mlp,
            "prefetch_depth": self.prefetch_depth, "staging_slot_bytes": self.staging_slot_bytes,
            "read_ahead_depth": self.read_ahead_depth, "read_buffer_bytes": self.read_buffer_bytes,
            "tiers": {t.tier: {**asdict(t), "total_bytes": t.total_bytes} for t in self.tiers},
            "phases": {"prefill": self.prefill.to_dict(), "decode": self.decode.to_dict()},
            "predicted_job_s": self.job_s,
            "units": [asdict(u) for u in self.units],
            "schedule": {p: self.schedule(p).to_list() for p in PHASES},
            "notes": list(self.notes),
        }

    def schedule(self, phase: str) -> PhaseSchedule:
        """One step of phase as the executor runs it: copies into staging slots, runs, releases, hand-overs."""
        units = [(u.name, getattr(u, phase), u.weight_tier) for u in self.units]
        return phase_schedule(phase, units, self.prefetch_depth, steady=phase == "decode")

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=_json_default)

    def table(self) -> str:
        return plan_table(self)

    def explain(self) -> str:
        return plan_explanation(self)

    def __str__(self) -> str:
        return self.table()


def _json_default(value):
    if isinstance(value, float) and math.isinf(value):
        return None
    raise TypeError(f"cannot serialise {value!r}")


__all__ = ["Budget", "Workload", "UnitPlan", "TierUsage", "Plan", "TIERS", "PHASES", "COMPUTE_MODES"]

"""The one way a Plan is made from user options: LLM, `offload plan`, `offload run` and the benchmarks all
build a PlanRequest and call plan_for, so the plan a user reads is the plan that runs."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from offload.baseline import recorded_baseline_bytes
from offload.errors import ConfigError, PlanError
from offload.formats import AS_STORED, QUANTIZATIONS, compute_format, weight_format
from offload.options import (BACKENDS, HardwareOptions, MemoryOptions, ModelOptions, ScheduleOptions,
                             default_of)
from offload.hardware import (HardwareProfile, as_pageable, default_hardware, format_bytes, load_hardware,
                             pageable_copies, parse_size)
from offload.planner.search import plan, plan_best_batch
from offload.planner.types import Budget, Plan, Workload
from offload.spec import ModelSpec
from offload.system import page_cache_room_bytes

DEFAULT_MAX_MODEL_LEN = 2048  # context the KV cache is budgeted for unless max_model_len says otherwise


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """Everything a user says that decides the plan, by the options' outside names (offload/options.py holds
    each one's type, default and help; PlanRequest.of makes one from the option sections)."""

    model: str = default_of("model.path")
    quantization: str = default_of("model.quantization")
    dtype: str = default_of("model.dtype")
    hardware: str | HardwareProfile | None = field(default=default_of("hardware.profile"), compare=False)
    backend: str = default_of("hardware.backend")
    gpu_memory: int | str | None = default_of("memory.gpu")
    cpu_memory: int | str | None = default_of("memory.cpu")  # the whole process, host_baseline included
    disk_memory: int | str | None = default_of("memory.disk")
    host_baseline: int | str | None = default_of("memory.baseline")  # auto: recorded or DEFAULT_BASELINE_BYTES
    batch_size: int | None = default_of("schedule.batch_size")
    max_model_len: int | None = default_of("model.max_model_len")
    max_tokens: int = default_of("sampling.max_tokens")
    prefetch_depth: int | None = default_of("schedule.prefetch_depth")
    prefill_chunk_tokens: int = default_of("schedule.prefill_chunk_tokens")

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend {self.backend!r} is not supported; use one of {', '.join(BACKENDS)}")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization {self.quantization!r} is not supported; "
                              f"use one of {', '.join(QUANTIZATIONS)}")
        for name in ("batch_size", "max_model_len", "max_tokens", "prefetch_depth", "prefill_chunk_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name} must be a whole number of 1 or more, found {value!r}")

    @classmethod
    def of(cls, model: ModelOptions, hardware: HardwareOptions, memory: MemoryOptions, schedule: ScheduleOptions,
           max_tokens: int) -> "PlanRequest":
        """The request the option sections make: what a job, `offload plan` and LLM(...) all plan from."""
        return cls(model=model.path, quantization=model.quantization, dtype=model.dtype,
                   max_model_len=model.max_model_len, hardware=hardware.profile, backend=hardware.backend,
                   gpu_memory=memory.gpu, cpu_memory=memory.cpu, disk_memory=memory.disk,
                   host_baseline=memory.baseline, batch_size=schedule.batch_size,
                   prefetch_depth=schedule.prefetch_depth, prefill_chunk_tokens=schedule.prefill_chunk_tokens,
                   max_tokens=max_tokens)

    def baseline_bytes(self) -> int:
        """What the process holds besides the plan: the recorded figure (or the default) for 'auto'."""
        return recorded_baseline_bytes() if self.host_baseline == "auto" else int(self.host_baseline or 0)

    def profile(self) -> HardwareProfile:
        """The hardware profile: a preset name, a YAML path, a profile, or the calibrated/estimated default; its
        copies priced pageable where OFFLOAD_PAGEABLE=1 (the CUDA backend then pins nothing)."""
        if self.hardware is None:
            hw = default_hardware()
        elif isinstance(self.hardware, HardwareProfile):
            hw = self.hardware
        else:
            hw = load_hardware(self.hardware)
        return as_pageable(hw) if pageable_copies() else hw

    def budget(self, hw: HardwareProfile) -> Budget:
        """The tiers' budgets on hw: the CPU budget covers the whole process, so the plan places weights and KV in
        what is left of it after the process's own baseline (Budget.host_baseline_bytes)."""
        gpu_bytes = _size(self.gpu_memory, "gpu_memory")
        if gpu_bytes and not hw.has_gpu:
            raise ConfigError(f"a GPU budget of {format_bytes(gpu_bytes)} was given (memory.gpu, --gpu-memory) but the "
                              f"hardware profile {hw.name!r} has no GPU; leave the GPU budget unset or 0, or name "
                              f"a hardware profile with a GPU")
        budget = Budget.for_hardware(hw, gpu_bytes=gpu_bytes, cpu_bytes=_size(self.cpu_memory, "cpu_memory"),
                                     disk_bytes=_size(self.disk_memory, "disk_memory") or 0)
        check_within(budget.cpu_bytes, hw.ram_bytes, "CPU", "memory.cpu, --cpu-memory",
                     f"{format_bytes(hw.ram_bytes)} of RAM that the hardware profile {hw.name!r} has")
        if hw.has_gpu:
            check_within(budget.gpu_bytes, hw.vram_bytes, "GPU", "memory.gpu, --gpu-memory",
                         f"{format_bytes(hw.vram_bytes)} of VRAM that the hardware profile {hw.name!r} has")
        baseline = self.baseline_bytes()
        if baseline and budget.cpu_bytes <= baseline:
            raise ConfigError(f"the CPU budget of {format_bytes(budget.cpu_bytes)} (memory.cpu, --cpu-memory) is not "
                              f"more than this process's own {format_bytes(baseline)} (Python, torch, the "
                              f"tokenizer: memory.baseline); raise the budget above that")
        budget = replace(budget, cpu_bytes=budget.cpu_bytes - baseline, host_baseline_bytes=baseline)
        if self.hardware is None and budget.disk_bytes:  # this machine: how much of the disk units its page
            room = page_cache_room_bytes(budget.process_cpu_bytes)  # cache can keep (rounded: plan = run)
            budget = replace(budget, page_cache_bytes=room // PAGE_CACHE_ROUNDING * PAGE_CACHE_ROUNDING)
        return budget

    def compute_format(self, hw: HardwareProfile) -> str:
        """The compute format this request runs in on hw (resolving dtype 'auto')."""
        on_gpu = self.backend != "cpu" and hw.has_gpu and self.budget(hw).gpu_bytes > 0
        return compute_format(self.dtype, on_gpu)

    def context_len(self, spec: ModelSpec) -> int:
        """Tokens per sequence the KV cache holds: max_model_len (default DEFAULT_MAX_MODEL_LEN), at most the
        model's context."""
        return min(self.max_model_len or DEFAULT_MAX_MODEL_LEN, spec.max_position_embeddings)

    def workload(self, spec: ModelSpec, hw: HardwareProfile) -> Workload:
        """The workload the plan is sized for: max_model_len tokens per sequence, max_tokens of them generated."""
        total = self.context_len(spec)
        if total < 2:
            raise ConfigError(f"max_model_len must be at least 2, found {self.max_model_len}")
        gen = min(self.max_tokens, total - 1)
        return Workload(batch_size=self.batch_size or 1, prompt_len=total - gen, gen_len=gen,
                        prefill_chunk_tokens=self.prefill_chunk_tokens, compute_format=self.compute_format(hw))


PAGE_CACHE_ROUNDING = 256 << 20


SPLIT_GAIN = 1.03  # a plan with the MLPs split off must predict the job this much faster to be chosen


def plan_for(spec: ModelSpec, hw: HardwareProfile, request: PlanRequest) -> Plan:
    """The Plan for request on hw; the batch size is searched when the request leaves it open. Where a GPU is
    planned, dense layers are also planned with their MLPs split off (attention on the GPU, the MLP computed on
    the CPU where its weights live, as llama.cpp's `-ot ffn=CPU` does by hand); that plan is taken if it predicts
    the job SPLIT_GAIN faster. Run a plan with plan_spec(spec, plan)."""
    spec = replace(spec, split_mlp=False)  # a spec a plan split (plan_spec) is planned afresh, both ways
    workload = request.workload(spec, hw)
    fmt = plan_weight_format(spec, request.quantization, workload.compute_format)
    search = plan_best_batch if request.batch_size is None else plan
    budget = request.budget(hw)
    whole = search(spec, hw, budget, workload, weight_format=fmt, prefetch_depth=request.prefetch_depth)
    if not may_split(spec, hw, request, budget):
        return whole
    try:
        split = search(replace(spec, split_mlp=True), hw, budget, workload, weight_format=fmt,
                       prefetch_depth=request.prefetch_depth)
    except PlanError:
        return whole
    rate = lambda p: p.workload.batch_size / p.job_s  # noqa: E731 - sequences per second of the whole job
    return split if rate(split) > SPLIT_GAIN * rate(whole) else whole


def may_split(spec: ModelSpec, hw: HardwareProfile, request: PlanRequest, budget: Budget) -> bool:
    """Whether splitting the dense MLPs off can pay: a GPU is planned, and some layer has a dense MLP (a GGUF
    model's units stay whole: its tensors are read as stored, layer by layer)."""
    dense = spec.moe is None or bool(spec.moe.dense_layers)
    return hw.has_gpu and budget.gpu_bytes > 0 and request.backend != "cpu" and dense and not spec.from_gguf


def plan_spec(spec: ModelSpec, plan: Plan) -> ModelSpec:
    """The spec whose units plan places: spec, with the dense MLPs split off where the plan chose it."""
    return replace(spec, split_mlp=plan.split_mlp) if spec.split_mlp != plan.split_mlp else spec


def plan_weight_format(spec: ModelSpec, quantization: str, compute: str) -> str:
    """The plan's weight format: a GGUF model with quantization 'none' keeps each tensor as its file stores it
    (AS_STORED); otherwise the quantization, or the compute format for 'none'."""
    if spec.from_gguf and quantization == "none":
        return AS_STORED
    return weight_format(quantization, compute)


def check_within(budget_bytes: int, has_bytes: int, tier: str, keys: str, what: str) -> None:
    """A budget above what the machine (or the profile planned for) has is refused, not planned into."""
    if budget_bytes > has_bytes:
        raise ConfigError(f"the {tier} budget of {format_bytes(budget_bytes)} ({keys}) is more than the "
                          f"{what}; set it to at most {format_bytes(has_bytes)}, or leave it unset for the default")


def _size(value, what: str) -> int | None:
    return None if value is None else parse_size(value, what)

"""The one way a Plan is made from user options: LLM, `offload plan`, `offload run` and the benchmarks all
build a PlanRequest and call plan_for, so the plan a user reads is the plan that runs."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from offload.baseline import recorded_baseline_bytes
from offload.errors import ConfigError, PlanError
from offload.formats import AS_STORED, compute_format, kv_format, weight_format
from offload.options import (PLAN_SECTIONS, HardwareOptions, MemoryOptions, ModelOptions, ScheduleOptions, default_of,
                             request_sections)
from offload.hardware import (HardwareProfile, as_pageable, default_hardware, format_bytes, load_hardware,
                             pageable_copies)
from offload.planner.search import plan, plan_best_batch
from offload.planner.types import Budget, Plan, Workload
from offload.spec import ModelSpec
from offload.system import page_cache_room_bytes

DEFAULT_MAX_MODEL_LEN = 2048  # context the KV cache is budgeted for unless max_model_len says otherwise


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """Everything a user says that decides the plan: the option sections (offload/options.py holds each option's
    type, default, bounds and help; sizes are bytes once the section is made) and the tokens generated per request.
    PlanRequest.of(model=..., cpu_memory="48GiB") makes one from the options' outside names (LLM's keywords);
    request.with_options(batch_size=1) is one with some of them changed."""

    model: ModelOptions = field(default_factory=ModelOptions)
    hardware: HardwareOptions = field(default_factory=HardwareOptions)
    memory: MemoryOptions = field(default_factory=MemoryOptions)  # memory.cpu: the whole process, baseline included
    schedule: ScheduleOptions = field(default_factory=ScheduleOptions)
    max_tokens: int = default_of("sampling.max_tokens")
    # bytes the process holds beside this plan (a draft planned first, out of memory.cpu): not this plan's budget, and
    # not room for the page cache to keep disk units in either
    beside_bytes: int = 0

    def __post_init__(self):
        for name, section in PLAN_SECTIONS.items():
            if not isinstance(getattr(self, name), section):
                raise TypeError(f"PlanRequest({name}=...) takes a {section.__name__}, found "
                                f"{getattr(self, name)!r}; PlanRequest.of(...) takes the options by name")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be a whole number of 1 or more, found {self.max_tokens!r}")

    @classmethod
    def of(cls, **options) -> "PlanRequest":
        """The request of options by their outside names (model, quantization, hardware, gpu_memory, cpu_memory,
        batch_size, max_tokens, ...: LLM's keywords), each checked as the job YAML's is; None is its default."""
        return cls(**request_sections(options))

    def with_options(self, **options) -> "PlanRequest":
        """This request with some options changed, by their outside names (None: the option's default)."""
        base = {name: getattr(self, name) for name in PLAN_SECTIONS}
        return PlanRequest(**request_sections(options, base | {"max_tokens": self.max_tokens}),
                           beside_bytes=self.beside_bytes)

    def baseline_bytes(self) -> int:
        """What the process holds besides the plan: the recorded figure (or the default) for 'auto'."""
        baseline = self.memory.baseline
        return recorded_baseline_bytes() if baseline == "auto" else baseline

    def profile(self) -> HardwareProfile:
        """The hardware profile: a preset name, a YAML path, a profile, or the calibrated/estimated default; its
        copies priced pageable where OFFLOAD_PAGEABLE=1 (the CUDA backend then pins nothing)."""
        given = self.hardware.profile
        if given is None:
            hw = default_hardware()
        elif isinstance(given, HardwareProfile):
            hw = given
        else:
            hw = load_hardware(given)
        return as_pageable(hw) if pageable_copies() else hw

    def budget(self, hw: HardwareProfile) -> Budget:
        """The tiers' budgets on hw: the CPU budget covers the whole process, so the plan places weights and KV in
        what is left of it after the process's own baseline (Budget.host_baseline_bytes)."""
        gpu_bytes = self.memory.gpu
        if gpu_bytes and not hw.has_gpu:
            raise ConfigError(f"a GPU budget of {format_bytes(gpu_bytes)} was given (memory.gpu, --gpu-memory) but the "
                              f"hardware profile {hw.name!r} has no GPU; leave the GPU budget unset or 0, or name "
                              f"a hardware profile with a GPU")
        budget = Budget.for_hardware(hw, gpu_bytes=gpu_bytes, cpu_bytes=self.memory.cpu,
                                     disk_bytes=self.memory.disk or 0)
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
        if self.hardware.profile is None and budget.disk_bytes:  # this machine: how much of the disk units its page
            # cache can keep, beside all the process holds (rounded: plan = run)
            room = page_cache_room_bytes(budget.process_cpu_bytes + self.beside_bytes)
            budget = replace(budget, page_cache_bytes=room // PAGE_CACHE_ROUNDING * PAGE_CACHE_ROUNDING)
        return budget

    def compute_format(self, hw: HardwareProfile) -> str:
        """The compute format this request runs in on hw (resolving dtype 'auto')."""
        on_gpu = self.hardware.backend != "cpu" and hw.has_gpu and self.budget(hw).gpu_bytes > 0
        return compute_format(self.model.dtype, on_gpu)

    def context_len(self, spec: ModelSpec) -> int:
        """Tokens per sequence the KV cache holds: max_model_len (default DEFAULT_MAX_MODEL_LEN), at most the
        model's context."""
        return min(self.model.max_model_len or DEFAULT_MAX_MODEL_LEN, spec.max_position_embeddings)

    def workload(self, spec: ModelSpec, hw: HardwareProfile) -> Workload:
        """The workload the plan is sized for: max_model_len tokens per sequence, max_tokens of them generated."""
        total = self.context_len(spec)
        if total < 2:
            raise ConfigError(f"max_model_len must be at least 2, found {self.model.max_model_len}")
        gen = min(self.max_tokens, total - 1)
        compute = self.compute_format(hw)
        kv = kv_format(self.model.kv_cache_dtype, compute)
        return Workload(batch_size=self.schedule.batch_size or 1, prompt_len=total - gen, gen_len=gen,
                        prefill_chunk_tokens=self.schedule.prefill_chunk_tokens, compute_format=compute,
                        kv_format="" if kv == compute else kv)


PAGE_CACHE_ROUNDING = 256 << 20


SPLIT_GAIN = 1.03  # a plan with the MLPs split off must predict the job this much faster to be chosen


def plan_for(spec: ModelSpec, hw: HardwareProfile, request: PlanRequest) -> Plan:
    """The Plan for request on hw; the batch size is searched when the request leaves it open. Where a GPU is
    planned, dense layers are also planned with their MLPs split off (attention on the GPU, the MLP computed on
    the CPU where its weights live, as llama.cpp's `-ot ffn=CPU` does by hand); that plan is taken if it predicts
    the job SPLIT_GAIN faster. Run a plan with plan_spec(spec, plan)."""
    spec = replace(spec, split_mlp=False)  # a spec a plan split (plan_spec) is planned afresh, both ways
    workload = request.workload(spec, hw)
    fmt = plan_weight_format(spec, request.model.quantization, workload.compute_format)
    search = plan_best_batch if request.schedule.batch_size is None else plan
    budget = request.budget(hw)
    depth = request.schedule.prefetch_depth
    whole = search(spec, hw, budget, workload, weight_format=fmt, prefetch_depth=depth)
    if not may_split(spec, hw, request, budget):
        return whole
    try:
        split = search(replace(spec, split_mlp=True), hw, budget, workload, weight_format=fmt, prefetch_depth=depth)
    except PlanError:
        return whole
    rate = lambda p: p.workload.batch_size / p.job_s  # noqa: E731 - sequences per second of the whole job
    return split if rate(split) > SPLIT_GAIN * rate(whole) else whole


SPLIT_MAX_LAYERS = 1_000  # the largest released dense model has 126 layers (Llama 3.1 405B)


def may_split(spec: ModelSpec, hw: HardwareProfile, request: PlanRequest, budget: Budget) -> bool:
    """Whether splitting the dense MLPs off can pay: a GPU is planned, and some layer has a dense MLP (a GGUF
    model's units stay whole: its tensors are read as stored, layer by layer), in a model of at most
    SPLIT_MAX_LAYERS layers (past them the split's twice as many units would double the search of a model no
    release comes near)."""
    dense = spec.moe is None or bool(spec.moe.dense_layers)
    return (hw.has_gpu and budget.gpu_bytes > 0 and request.hardware.backend != "cpu" and dense
            and not spec.from_gguf and spec.n_layers <= SPLIT_MAX_LAYERS)


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


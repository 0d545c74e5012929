"""The one way a Plan is made from user options: LLM, `offload plan`, `offload run` and the benchmarks all
build a PlanRequest and call plan_for, so the plan a user reads is the plan that runs."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from offload.errors import ConfigError, PlanError
from offload.formats import AS_STORED, QUANTIZATIONS, compute_format, weight_format
from offload.hardware import HardwareProfile, default_hardware, format_bytes, load_hardware, parse_size
from offload.planner.search import plan, plan_best_batch
from offload.planner.types import DEFAULT_PREFILL_CHUNK_TOKENS, Budget, Plan, Workload
from offload.spec import ModelSpec
from offload.system import page_cache_room_bytes

DEFAULT_MAX_MODEL_LEN = 2048  # context the KV cache is budgeted for unless max_model_len says otherwise
DEFAULT_MAX_TOKENS = 128  # generated tokens per sequence the prediction assumes unless max_tokens says otherwise
BACKENDS = ("auto", "cpu", "cuda")  # auto: CUDA where a GPU is visible, else the CPU


@dataclass(frozen=True)
class PlanRequest:
    """Everything a user says that decides the plan; None means the default named beside each field."""

    model: str = "default"  # a model folder, a name in configs/models, or 'default'
    quantization: str = "none"  # none | q8_0 | q4_0 (linear weights)
    dtype: str = "auto"  # compute format; auto: bf16 where the plan uses a GPU, fp32 on the CPU
    hardware: str | HardwareProfile | None = field(default=None, compare=False)  # None: calibrated or estimated
    gpu_memory: int | str | None = None  # None: 90% of VRAM
    cpu_memory: int | str | None = None  # None: 80% of RAM
    disk_memory: int | str | None = None  # None: 0 (no spilling)
    batch_size: int | None = None  # None: the batch with the best predicted throughput
    max_model_len: int | None = None  # None: DEFAULT_MAX_MODEL_LEN, at most the model's context
    max_tokens: int | None = None  # None: DEFAULT_MAX_TOKENS, at most a quarter of max_model_len
    prefetch_depth: int | None = None  # staging slots; None: searched with the placement
    prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS
    backend: str = "auto"  # auto | cpu | cuda: with cpu, dtype 'auto' computes in fp32 even where a GPU is planned
    host_baseline: int | None = None  # RAM the process holds besides the plan (Python, torch, tokenizer),
    # counted against cpu_memory; measured by jobs (memory.baseline); None: not counted

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend {self.backend!r} is not supported; use one of {', '.join(BACKENDS)}")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization {self.quantization!r} is not supported; "
                              f"use one of {', '.join(QUANTIZATIONS)}")
        for name in ("batch_size", "max_model_len", "max_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name} must be a whole number of 1 or more, found {value!r}")

    def profile(self) -> HardwareProfile:
        """The hardware profile: a preset name, a YAML path, a profile, or the calibrated/estimated default."""
        if self.hardware is None:
            return default_hardware()
        if isinstance(self.hardware, HardwareProfile):
            return self.hardware
        return load_hardware(self.hardware)

    def budget(self, hw: HardwareProfile) -> Budget:
        gpu_bytes = _size(self.gpu_memory, "gpu_memory")
        if gpu_bytes and not hw.has_gpu:
            raise ConfigError(f"a GPU budget of {format_bytes(gpu_bytes)} was given (memory.gpu, --gpu-memory) but the "
                              f"hardware profile {hw.name!r} has no GPU; leave the GPU budget unset or 0, or name "
                              f"a hardware profile with a GPU")
        budget = Budget.for_hardware(hw, gpu_bytes=gpu_bytes, cpu_bytes=_size(self.cpu_memory, "cpu_memory"),
                                     disk_bytes=_size(self.disk_memory, "disk_memory") or 0)
        baseline = self.host_baseline or 0
        if baseline and budget.cpu_bytes <= baseline:
            raise ConfigError(f"the CPU budget of {format_bytes(budget.cpu_bytes)} (memory.cpu, --cpu-memory) is not "
                              f"more than this process's own {format_bytes(baseline)} (Python, torch, the "
                              f"tokenizer: memory.baseline); raise the budget above that")
        budget = replace(budget, cpu_bytes=budget.cpu_bytes - baseline)
        if self.hardware is None and budget.disk_bytes:  # this machine: how much of the disk units its page
            room = page_cache_room_bytes(budget.cpu_bytes)   # cache can keep (rounded: a plan and its run agree)
            budget = replace(budget, page_cache_bytes=room // PAGE_CACHE_ROUNDING * PAGE_CACHE_ROUNDING)
        return budget

    def compute_format(self, hw: HardwareProfile) -> str:
        """The compute format this request runs in on hw (resolving dtype 'auto')."""
        on_gpu = self.backend != "cpu" and hw.has_gpu and self.budget(hw).gpu_bytes > 0
        return compute_format(self.dtype, on_gpu)

    def workload(self, spec: ModelSpec, hw: HardwareProfile) -> Workload:
        """The workload the plan is sized for: max_model_len tokens per sequence, max_tokens of them generated."""
        total = min(self.max_model_len or DEFAULT_MAX_MODEL_LEN, spec.max_position_embeddings)
        if total < 2:
            raise ConfigError(f"max_model_len must be at least 2, found {self.max_model_len}")
        gen = min(self.max_tokens or DEFAULT_MAX_TOKENS, total - 1)
        if self.max_tokens is None:
            gen = min(gen, total // 4) or 1
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


def _size(value, what: str) -> int | None:
    return None if value is None else parse_size(value, what)

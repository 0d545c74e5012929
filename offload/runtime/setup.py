"""Choosing a backend and making the plan an LLM runs by: the glue between user options and the executor."""

from __future__ import annotations

import torch

from offload.errors import ConfigError
from offload.hardware import default_hardware, load_hardware, parse_size
from offload.planner import Budget, Plan, Workload, plan, plan_batch
from offload.runtime.backend import Backend
from offload.runtime.cpu_backend import CPUBackend

_FORMAT_OF_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def make_backend(name: str = "auto") -> Backend:
    """'cuda' (a GPU is required), 'cpu', or 'auto' (CUDA when a GPU is present)."""
    if name not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"backend {name!r} is not supported; use auto, cpu or cuda")
    if name == "cpu":
        return CPUBackend()
    from offload.runtime.cuda_backend import CUDABackend, cuda_available

    if cuda_available():
        return CUDABackend()
    if name == "cuda":
        raise ConfigError("backend 'cuda' was asked for but no CUDA GPU is visible; use backend 'cpu' or 'auto'")
    return CPUBackend()


def make_plan(spec, quantization: str, dtype: torch.dtype, workload: Workload, hardware=None, gpu_memory=None,
              cpu_memory=None, disk_memory=None, prefetch_depth: int = 2, choose_batch: bool = False) -> Plan:
    """Plan spec's units for the hardware profile (a preset name, a YAML path, a profile, or the default)."""
    if hardware is None:
        profile = default_hardware()
    elif isinstance(hardware, str):
        profile = load_hardware(hardware)
    else:
        profile = hardware
    budget = Budget.for_hardware(profile, gpu_bytes=_size(gpu_memory, "gpu_memory"),
                                 cpu_bytes=_size(cpu_memory, "cpu_memory"),
                                 disk_bytes=_size(disk_memory, "disk_memory") or 0)
    fmt = quantization if quantization != "none" else _FORMAT_OF_DTYPE[dtype]
    if choose_batch:
        return plan_batch(spec, profile, budget, workload, weight_format=fmt, prefetch_depth=prefetch_depth)
    return plan(spec, profile, budget, workload, weight_format=fmt, prefetch_depth=prefetch_depth)


def _size(value, what: str) -> int | None:
    return None if value is None else parse_size(value, what)

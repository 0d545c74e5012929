"""The only doors to devices: CPUBackend everywhere, CUDABackend where a GPU is visible."""

from __future__ import annotations

from offload.errors import ConfigError
from offload.options import BACKENDS
from offload.runtime.backends.base import Backend
from offload.runtime.backends.cpu import CPUBackend


def make_backend(name: str = "auto", hardware=None) -> Backend:
    """'cuda' (a GPU is required), 'cpu', 'auto' (CUDA when a GPU is present) or 'sim' (the simulated GPU of
    hardware's VRAM and link: offload.runtime.backends.sim)."""
    if name not in BACKENDS:
        raise ConfigError(f"backend {name!r} is not supported; use one of {', '.join(BACKENDS)}")
    if name == "cpu":
        return CPUBackend()
    if name == "sim":
        from offload.runtime.backends.sim import SimBackend

        if hardware is None:
            raise ConfigError("backend 'sim' simulates a GPU of a hardware profile; give one (hardware: NAME)")
        return SimBackend(hardware)
    from offload.runtime.backends.cuda import CUDABackend, cuda_available

    if cuda_available():
        return CUDABackend()
    if name == "cuda":
        raise ConfigError("backend 'cuda' was asked for but no CUDA GPU is visible; use backend 'cpu' or 'auto'")
    return CPUBackend()


def missing_gpu(hardware, backend: str, gpu_memory) -> str | None:
    """Why a plan for hardware (a profile with a GPU, such as a preset) cannot run here, or None: on backend 'auto'
    or 'cuda' with no CUDA GPU visible its GPU units would run on the CPU while the report showed a GPU's busy time
    and VRAM. Backends 'cpu' and 'sim', and a GPU budget of 0, run it (simulated_gpu_warning says so)."""
    if not hardware.has_gpu or backend in ("cpu", "sim") or gpu_memory == 0:
        return None
    from offload.runtime.backends.cuda import cuda_available

    if cuda_available():
        return None
    from offload.units import format_bytes

    return (f"the hardware profile {hardware.name!r} plans on a GPU ({format_bytes(hardware.vram_bytes)} of VRAM) "
            f"but no CUDA GPU is visible on this machine, so backend {backend!r} cannot run that plan here; run it on "
            f"this CPU with backend cpu (--backend cpu; its GPU figures are then simulated), see the plan with "
            f"`offload plan --hardware {hardware.name}`, or leave hardware unset to plan for this machine")


def simulated_gpu_warning(hardware) -> str | None:
    """The warning for a profile with a GPU run where none is visible (backend cpu or sim), or None."""
    from offload.runtime.backends.cuda import cuda_available

    if not hardware.has_gpu or cuda_available():
        return None
    return (f"the hardware profile {hardware.name!r} is not this machine (it has a GPU, this machine shows none): "
            f"its budgets and predictions are that machine's, and the units it plans on the GPU run on this CPU, so "
            f"its GPU figures are simulated")


__all__ = ["BACKENDS", "Backend", "CPUBackend", "make_backend", "missing_gpu", "simulated_gpu_warning"]

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


__all__ = ["BACKENDS", "Backend", "CPUBackend", "make_backend"]

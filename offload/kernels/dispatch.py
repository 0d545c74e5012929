"""Which kernel path serves this process: chosen once at import from the CPU's features."""

from __future__ import annotations

import os
import warnings

PATHS = ("avx512", "avx2", "scalar", "numba")
PATH_IDS = {"scalar": 0, "avx2": 1, "avx512": 2}  # csrc/kernels.h enum Path
AVX2_FEATURES = frozenset({"avx2", "fma", "f16c"})
AVX512_FEATURES = AVX2_FEATURES | {"avx512f", "avx512bw", "avx512vl", "avx512vnni"}
ENV_VAR = "OFFLOAD_KERNELS"  # auto (default), avx512, avx2, scalar or numba


def best_path(cpu_features: set[str] | frozenset[str], ext_built: bool = True) -> str:
    """The fastest path these CPU features and this build can run."""
    if not ext_built:
        return "numba"
    if AVX512_FEATURES <= cpu_features:
        return "avx512"
    if AVX2_FEATURES <= cpu_features:
        return "avx2"
    return "scalar"


def choose_path(cpu_features: set[str] | frozenset[str], ext_built: bool = True, forced: str | None = None) -> str:
    """The path to use: `forced` (from OFFLOAD_KERNELS) when this CPU can run it, else the best one."""
    best = best_path(cpu_features, ext_built)
    if forced in (None, "", "auto"):
        return best
    if forced not in PATHS:
        warnings.warn(f"{ENV_VAR}={forced!r} is not one of auto, {', '.join(PATHS)}; using {best!r}", stacklevel=2)
        return best
    if forced == "numba":
        return "numba"
    if not ext_built:
        warnings.warn(f"{ENV_VAR}={forced!r} needs the C++ extension, which is not built; using numba", stacklevel=2)
        return "numba"
    if PATHS.index(forced) < PATHS.index(best):  # asks for an ISA this CPU lacks
        warnings.warn(f"{ENV_VAR}={forced!r} is not supported by this CPU; using {best!r}", stacklevel=2)
        return best
    return forced


def load_extension():
    """The compiled module offload.kernels._C, or None when it is missing or disabled."""
    if os.environ.get(ENV_VAR) == "numba":
        return None
    try:
        import torch  # noqa: F401 - load torch's libgomp first so the extension shares its OpenMP pool
        from offload.kernels import _C
    except ImportError:
        return None
    return _C

"""`python -m offload.kernels.check`: the CPU kernel path this process runs, and a non-zero exit where an x86-64
machine runs the numba fallback, so that CI and the GPU check fail when the C++ extension did not build (setup.py
installs without it, for users) rather than measure the slow kernels."""

from __future__ import annotations

import importlib
import os
import platform
import sys

from offload.errors import ConfigError
from offload.kernels import ACTIVE_PATH
from offload.kernels.dispatch import ENV_VAR

X86_64 = ("x86_64", "amd64")
FALLBACK = "numba"  # the one path that is not csrc/'s C++
REBUILD = "rebuild it with `pip install -v -e .` and read why it failed (a compiler error, or pybind11 missing)"


def path_problem(active: str, machine: str, forced: str | None, load_error: str | None) -> str | None:
    """Why the active path is not the C++ one an x86-64 machine should run, as one sentence; None where it is."""
    if active != FALLBACK or machine.lower() not in X86_64:
        return None
    if forced == FALLBACK:
        return f"the numba kernels run because {ENV_VAR}={FALLBACK} is set; unset it to run the C++ kernels"
    return (f"the C++ kernel extension offload.kernels._C is not built or does not load ({load_error or 'not found'}), "
            f"so this x86-64 CPU runs the slower numba kernels; {REBUILD}")


def extension_load_error() -> str | None:
    """What importing the C++ extension raises, as one line; None where it loads."""
    try:
        importlib.import_module("offload.kernels._C")
    except ImportError as e:
        return " ".join(f"{type(e).__name__}: {e}".split())
    return None


def active_problem() -> str | None:
    """path_problem of this process."""
    if ACTIVE_PATH != FALLBACK:
        return None
    return path_problem(ACTIVE_PATH, platform.machine(), os.environ.get(ENV_VAR), extension_load_error())


def require_cpp_kernels(what: str) -> None:
    """ConfigError where `what` would measure the numba fallback on x86-64 by accident (OFFLOAD_KERNELS=numba set
    on purpose allows it)."""
    problem = active_problem()
    if problem is not None and os.environ.get(ENV_VAR) != FALLBACK:
        raise ConfigError(f"{what} refuses: {problem}; or set {ENV_VAR}={FALLBACK} to measure the numba kernels "
                          f"on purpose")


def main() -> int:
    """Print the active path; exit 1 with one line where path_problem finds one."""
    problem = active_problem()
    if problem is not None:
        print(f"offload CPU kernels: {ACTIVE_PATH}: {problem}", file=sys.stderr)
        return 1
    kind = "numba fallback" if ACTIVE_PATH == FALLBACK else "C++ extension"
    print(f"offload CPU kernels: {ACTIVE_PATH} ({kind}, {platform.machine()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

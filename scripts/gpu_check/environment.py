"""The environment the figures were measured in, written to $OUT/env.txt and put in the step's line."""

from __future__ import annotations

import os
import platform
import resource
import subprocess
import sys
from pathlib import Path

NVIDIA_SMI_QUERY = ("name,driver_version,memory.total,memory.used,clocks.sm,clocks.max.sm,power.draw,"
                    "pcie.link.gen.current,pcie.link.width.current")


def _command(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return f"({argv[0]}: {e})"


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return "(not readable)"


def environment(ctx) -> None:
    """Software and hardware: torch, Triton, CUDA, the GPU as nvidia-smi sees it, the CPU kernel path, cores,
    RAM, the locked-memory limit (pinning) and transparent huge pages."""
    import torch

    from offload.kernels import ACTIVE_PATH

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    memlock = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    facts = {
        "python": sys.version.split()[0], "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "triton": triton_version, "cuda_available": torch.cuda.is_available(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "(none: simulated device)",
        "cpu_kernels": ACTIVE_PATH, "machine": platform.machine(), "cores": os.cpu_count(),
        "ram_gib": os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30,
        "memlock": "unlimited" if memlock == resource.RLIM_INFINITY else memlock,
        "thp": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
        "commit": _command(["git", "rev-parse", "--short", "HEAD"]) or "(no git)",
    }
    for key, value in facts.items():
        ctx.put(key, value)
    text = "\n".join(f"{k}: {v}" for k, v in facts.items())
    if not ctx.smoke:
        text += "\n\n" + _command(["nvidia-smi", f"--query-gpu={NVIDIA_SMI_QUERY}", "--format=csv"])
        text += "\n\n" + _command(["nvidia-smi"])
    cpu = [line for line in _read("/proc/cpuinfo").splitlines() if line.startswith("model name")][:1]
    (ctx.out / "env.txt").write_text(text + "\n" + "\n".join(cpu) + "\n")
    ctx.summary(gpu=facts["gpu"], torch=facts["torch"], triton=triton_version, cpu_kernels=ACTIVE_PATH)
    ctx.log(text)

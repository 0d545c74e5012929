"""Whether a job's GPU is there: a hardware profile with a GPU (a preset such as rtx4090-ddr5) planned for a
machine without one. Planning for it stays allowed (`offload plan`); running its plan here on `--backend auto` or
`cuda` is refused, since its GPU units would run on the CPU while the report showed a GPU's busy time and VRAM. On
`--backend cpu` it runs, with a warning, and the report says its GPU figures are simulated; on `--backend sim` it
runs on the simulated GPU (which computes on the CPU and says so)."""

from __future__ import annotations

import logging

from offload.errors import ConfigError
from offload.jobs.config import JobConfig, plan_request
from offload.units import format_bytes

logger = logging.getLogger("offload")


def check_gpu_is_here(config: JobConfig) -> None:
    """ConfigError where the job's hardware profile plans a GPU that this machine lacks and the backend would be
    CUDA's; a warning where it runs anyway (backend cpu, or no GPU budget). A Ray job plans on each node instead."""
    if config.engine != "local" or config.hardware.profile is None:
        return
    request = plan_request(config)
    hw = request.profile()
    if not hw.has_gpu or _cuda_visible():
        return
    if request.backend not in ("cpu", "sim") and config.memory.gpu != 0:
        raise ConfigError(f"the hardware profile {hw.name!r} plans on a GPU ({format_bytes(hw.vram_bytes)} of VRAM) "
                          f"but no CUDA GPU is visible on this machine, so backend {request.backend!r} cannot run "
                          f"that plan here; run it on this CPU with --backend cpu (its GPU figures are then "
                          f"simulated), see the plan with `offload plan --hardware {hw.name}`, or leave hardware "
                          f"unset to plan for this machine")
    logger.warning(f"the hardware profile {hw.name!r} is not this machine (it has a GPU, this machine shows none): "
                   f"its budgets and predictions are that machine's, and the units it plans on the GPU run on this "
                   f"CPU, so its GPU figures are simulated")


def simulated_gpu_note(llm) -> str | None:
    """The report's note where the plan placed units on a GPU that the backend does not have (backend cpu): its GPU
    busy times are this CPU's work on those units, and no device memory was used."""
    plan, backend = getattr(llm, "plan", None), getattr(llm, "backend", None)
    if plan is None or getattr(backend, "name", None) not in ("cpu", "sim"):
        return None
    if not any(u.weight_tier == "gpu" or "cpu" != u.prefill or "cpu" != u.decode for u in plan.units):
        return None
    where = "on the simulated GPU (computing on this CPU)" if backend.name == "sim" else "on this CPU"
    return (f"simulated: no GPU ran this job; the plan's GPU units (for {plan.hardware}) ran {where}, so the GPU "
            f"busy times are that CPU work, and no device memory was used (the VRAM budget is the profile's)")


def _cuda_visible() -> bool:
    from offload.runtime.backends.cuda import cuda_available

    return cuda_available()

"""Whether a job's GPU is there: a hardware profile with a GPU (a preset such as rtx4090-ddr5) planned for a
machine without one. Planning for it stays allowed (`offload plan`); running its plan here on `--backend auto` or
`cuda` is refused, since its GPU units would run on the CPU while the report showed a GPU's busy time and VRAM. On
`--backend cpu` it runs, with a warning, and the report says its GPU figures are simulated; on `--backend sim` it
runs on the simulated GPU (which computes on the CPU and says so)."""

from __future__ import annotations

from offload.errors import ConfigError
from offload.jobs.config import JobConfig, plan_request
from offload.runtime.backends import missing_gpu


def check_gpu_is_here(config: JobConfig) -> None:
    """ConfigError where the job's hardware profile plans a GPU that this machine lacks and the backend would be
    CUDA's, before the job touches its outputs (LLM(...) checks again, and warns where it runs anyway). A Ray job
    plans on each node instead."""
    if config.engine != "local" or config.hardware.profile is None:
        return
    request = plan_request(config)
    problem = missing_gpu(request.profile(), request.hardware.backend, config.memory.gpu)
    if problem:
        raise ConfigError(problem)


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

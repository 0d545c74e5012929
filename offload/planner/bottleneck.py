"""The bottleneck of a phase: the one resource that sets its time, predicted (from a PhaseCost) or measured (from a
timeline's busy seconds). No torch.

Both rules pick the resource with the most seconds, so that "what to do" is "make that one faster":

- predicted: the cost model's `bound` (the busiest of the compute chain, PCIe, disk and host memory); a compute
  bound is split into GPU compute, CPU compute or overhead (the CPU/GPU hand-overs) by whichever of gpu_s, cpu_s
  and hop_s is largest.
- measured: the largest of each resource's busy seconds in the phase (CPU, GPU, PCIe, disk) and the idle seconds
  when none of them was busy (overhead: Python, launches, synchronisation). Host-memory bandwidth is not timed
  on its own, so a measured bottleneck is never host memory.
"""

from __future__ import annotations

BOTTLENECKS = {"pcie": "PCIe", "gpu": "GPU compute", "cpu": "CPU compute", "disk": "disk",
               "host_memory": "host memory", "overhead": "overhead"}  # key in JSON -> name in text


def predicted_bottleneck(cost) -> str:
    """The BOTTLENECKS key of a PhaseCost: its bound, with compute split into gpu, cpu or overhead."""
    if cost.bound != "compute":
        return cost.bound
    parts = {"gpu": cost.gpu_s, "cpu": cost.cpu_s, "overhead": cost.hop_s}
    return max(parts, key=parts.get)


def measured_bottleneck(busy_s: dict[str, float], idle_s: float) -> str | None:
    """The BOTTLENECKS key with the most seconds among busy_s (cpu, gpu, pcie, disk) and idle_s (overhead);
    None when the phase took no time."""
    seconds = {**busy_s, "overhead": idle_s}
    key = max(seconds, key=seconds.get)
    return key if seconds[key] > 0 else None


def bottleneck_name(key: str | None) -> str:
    """The name printed for a BOTTLENECKS key ("n/a" for None)."""
    return "n/a" if key is None else BOTTLENECKS.get(key, key)

"""Rate curves of matmul kernels by rows of activations, as a HardwareProfile holds them: which GPU kernel wins at a
row count (the measured crossover), and how a CPU curve scales with the machine's memory and compute speed."""

from __future__ import annotations

import math

GPU_KERNELS = ("fused", "dequant", "cublas")  # Triton fused dequant-matmul; dequantize + cuBLAS; cuBLAS on float


def crossover_rows(curves: dict[str, tuple[tuple[int, float], ...]]) -> int | None:
    """The fewest rows at which the dequant curve's rate beat the fused curve's, over the rows both measured;
    None where it never did (or one is missing)."""
    fused, dequant = dict(curves.get("fused", ())), dict(curves.get("dequant", ()))
    return next((rows for rows in sorted(fused.keys() & dequant.keys()) if dequant[rows] > fused[rows]), None)


def gpu_kernel(crossover: dict[str, int], fmt: str, rows: int) -> str:
    """Which GPU kernel multiplies `rows` activation rows by a quantized weight in fmt: dequantize + cuBLAS
    ("dequant") from the format's measured crossover on, else the fused Triton kernel ("fused", also wherever
    the table has no figure for fmt)."""
    at = crossover.get(fmt)
    return "dequant" if at is not None and rows >= at else "fused"


COMPUTE_BOUND_ROWS = 64  # activation rows from which a CPU matmul is bound by compute, not by reading its weights


def speed_factor(rows: int, memory: float, compute: float) -> float:
    """How much a CPU matmul at `rows` activation rows speeds up when memory-bound work runs `memory` x as fast
    and compute-bound work `compute` x: memory at 1 row, compute from COMPUTE_BOUND_ROWS, linear in log(rows)."""
    t = min(math.log(max(rows, 1)) / math.log(COMPUTE_BOUND_ROWS), 1.0)
    return memory + t * (compute - memory)


def scale_curve(curve: tuple[tuple[int, float], ...], memory: float,
                compute: float) -> tuple[tuple[int, float], ...]:
    """A ((rows, FLOP/s), ...) curve with each rate times speed_factor of its rows."""
    return tuple((rows, rate * speed_factor(rows, memory, compute)) for rows, rate in curve)

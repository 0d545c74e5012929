"""Rate curves of matmul kernels by rows of activations, as a HardwareProfile holds them: which GPU kernel wins at a
row count (the measured crossover), how a CPU curve scales with the machine's memory and compute speed, and whether
a set of CPU curves agrees with itself."""

from __future__ import annotations

import math
import statistics

from offload.formats import is_quantized

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


# Checks of measured CPU curves. A quantized matmul reads each weight once per product, whatever its rows, so its
# FLOP rate rises with rows until compute bounds it, and the quantized formats run kernels of one design, whose rates
# sit near each other at equal rows. Measured on this project's 2-core VM (weights out of cache, rows 1 and 64):
# from 1 to 64 rows q2_k and iq4_xs rise 1.8x, q5_1 2.0x, q6_k 2.3x, q3_k 2.4x, q8_0 2.9x, q4_0 3.4x; at 1 row they
# run at 30-45 GFLOP/s, at 64 rows at 61-154 (within 2.2x of their median). A curve far outside these bounds (q4_0
# flat at 2 GFLOP/s beside q5_0 at 362) was measured while the machine's speed moved.
MIN_RISE = 1.2  # a quantized curve's rate at its most rows over its rate at 1 row is at least this
CURVE_SPREAD = 8.0  # a quantized format's rate stays within this factor of the quantized formats' median


def curve_problems(curves: dict[str, tuple[tuple[int, float], ...]]) -> list[tuple[str, str]]:
    """(format, what is wrong) for each CPU curve that contradicts the bounds above: a rate not positive, a quantized
    curve that does not rise with rows, or a quantized rate far from the quantized formats' median at 1 row or at the
    most rows every curve has. Empty where the curves agree."""
    problems = [(fmt, f"{fmt} has a rate of {rate:.3g} FLOP/s at {rows} row{'s' * (rows > 1)}")
                for fmt, curve in curves.items() for rows, rate in curve if not (math.isfinite(rate) and rate > 0)]
    if problems:
        return problems
    quantized = {fmt: dict(curve) for fmt, curve in curves.items() if is_quantized(fmt) and curve}
    for fmt, curve in quantized.items():
        most = max(curve)
        if 1 in curve and most >= COMPUTE_BOUND_ROWS and curve[most] < MIN_RISE * curve[1]:
            problems.append((fmt, f"{fmt}'s rate does not rise with rows ({_gflops(curve[1])} at 1 row, "
                                  f"{_gflops(curve[most])} at {most})"))
    shared = set.intersection(*(set(c) for c in quantized.values())) if len(quantized) >= 3 else set()
    for rows in sorted(shared & {1, max(shared, default=1)}):  # a median of two says nothing of which one strays
        median = statistics.median(c[rows] for c in quantized.values())
        problems += [(fmt, f"{fmt} runs at {_gflops(c[rows])} at {rows} row{'s' * (rows > 1)} where the quantized "
                           f"formats' median is {_gflops(median)}") for fmt, c in quantized.items()
                     if not median / CURVE_SPREAD <= c[rows] <= median * CURVE_SPREAD]
    return problems


def _gflops(rate: float) -> str:
    return f"{rate / 1e9:{'.3g' if rate < 1e12 else '.0f'}} GFLOP/s"

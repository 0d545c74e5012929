"""`offload calibrate --quick`: a short matmul curve per format the fused layer runs, in seconds, checked for
contradictions (rate_curves.curve_problems) and measured again where they show, or refused (CalibrationError)."""

from __future__ import annotations

from dataclasses import replace

from offload.costfit import (CURVE_FORMATS, GGUF_CURVE_FORMATS, curve_text, monotone_curve, reference_probes,
                             refuse_contradictions, steadiest_curve)
from offload.hardware import HardwareProfile
from offload.rate_curves import curve_problems, scale_curve

QUICK_ROWS = (1, 4, 16, 64)  # calibrate --quick: decode-sized products (bound by the weights' read) up to compute-bound
QUICK_UNSTEADY = 2.0  # a quick curve whose machine's speed moved by more than this in its steadiest try is not kept


def quick_cpu_curves(hw: HardwareProfile, log=print) -> HardwareProfile:
    """hw with a short matmul curve for each format the fused layer runs (CURVE_FORMATS and the default model's
    GGUF formats), on weights cycled past the last-level cache at QUICK_ROWS rows, each moved to the speed of the
    reference probes taken as it starts: what `offload calibrate --quick` adds, in seconds, so that CPU units are
    priced from products shaped like the ones that run (not from a cache-resident weight). The overhead terms stay
    unmeasured (zero): the full calibration fits them. Curves that contradict each other (rate_curves.curve_problems)
    or were measured while the machine's speed moved are measured again once, with fresh reference probes; if they
    still do, CalibrationError says why and nothing is saved."""
    formats = CURVE_FORMATS + GGUF_CURVE_FORMATS
    references = reference_probes(formats, rounds=1)
    curves, unsteady = {}, {}
    for fmt in formats:
        curves[fmt], unsteady[fmt] = _quick_curve(fmt, references[fmt], log)
    problems = _quick_problems(curves, unsteady)
    if problems:  # a reference or a curve taken in a moment of another speed: both again, for those formats
        again = tuple(fmt for fmt in formats if fmt in dict(problems))
        log(f"cpu matmul curves of {', '.join(again)} disagree ({problems[0][1]}); measuring them again")
        references.update(reference_probes(again))
        for fmt in again:
            curves[fmt], unsteady[fmt] = _quick_curve(fmt, references[fmt], log)
        refuse_contradictions(_quick_problems(curves, unsteady), again=True)
    return replace(hw, cpu_flops_by_rows={**hw.cpu_flops_by_rows, **curves}, cpu_probe=references)


def _quick_curve(fmt: str, reference, log) -> tuple[tuple, float]:
    """fmt's quick curve at the reference speed (made monotone), and how far the machine's speed moved under it."""
    unsteady, curve, speed, _ = steadiest_curve(fmt, QUICK_ROWS, reference, repeats=2)
    kept = monotone_curve(scale_curve(curve, 1 / speed.memory, 1 / speed.compute))
    log(f"cpu matmul curve {fmt:5s} (quick): " + curve_text(curve, kept) + " GFLOP/s")
    return kept, unsteady


def _quick_problems(curves: dict, unsteady: dict[str, float]) -> list[tuple[str, str]]:
    moved = [(fmt, f"the machine's speed moved by {u:.2f}x while {fmt}'s curve was measured") for fmt, u in
             unsteady.items() if u > QUICK_UNSTEADY]
    return moved + curve_problems(curves)

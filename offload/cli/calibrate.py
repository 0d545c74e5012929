"""`offload calibrate`: measure this machine and cache the hardware profile the planner then uses."""

from __future__ import annotations

import logging
from pathlib import Path

from offload.errors import ConfigError
from offload.hardware import cache_path, format_bytes, save_hardware

log = logging.getLogger("offload")


def add_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="measure this machine and cache its hardware profile")
    p.add_argument("--output", default=None, help="where to write the profile (default: hardware.yaml in offload's "
                                                  "cache folder, see OFFLOAD_CACHE)")
    p.add_argument("--quick", action="store_true",
                   help="short CPU matmul curves (rows 1-64, weights out of cache) and no overhead fit: under a "
                        "minute; predictions are rougher for small models, whose steps the overheads weigh on")
    p.set_defaults(func=run)


def run(args) -> int:
    """Measure, log and cache the profile; print the path of the written profile."""
    from offload.costfit import calibrate_cpu_costs
    from offload.kernels.check import require_cpp_kernels
    from offload.quick_calibration import quick_cpu_curves
    from offload.runtime.calibrate import calibrate

    target = Path(args.output) if args.output else cache_path()
    check_writable(target)  # before minutes of measuring
    require_cpp_kernels("offload calibrate")  # the figures of the numba fallback would price every CPU block
    record_baseline()  # first: nothing else held yet
    profile = calibrate(log.info)
    if args.quick:
        profile = quick_cpu_curves(profile, log.info)
    else:
        log.info("cpu cost curves and overhead terms for the report's predictions (about two minutes)...")
        profile = calibrate_cpu_costs(profile, log.info)
    try:
        path = save_hardware(profile, target)
    except OSError as e:
        raise ConfigError(f"cannot write the hardware profile to {target} ({e.strerror or e}); "
                          f"pass --output with a writable path") from None
    log.info(f"ram {format_bytes(profile.ram_bytes)}, {profile.n_cores} cores, vram {format_bytes(profile.vram_bytes)}")
    print(f"wrote {path}")
    return 0


def record_baseline() -> None:
    """Measure the process baseline (offline) and record it for memory.baseline: auto; where it cannot be measured,
    plans keep the figure recorded before, else the documented default, and the log says so."""
    from offload.baseline import recorded_baseline_bytes, record_baseline_bytes
    from offload.runtime.host_memory import calibration_baseline_bytes

    try:
        baseline = calibration_baseline_bytes(log.info)
    except ImportError as e:  # no tokenizer can be made: measuring the rest is still worth it
        log.warning(f"process baseline not measured ({e}); plans keep {format_bytes(recorded_baseline_bytes())} "
                    f"(memory.baseline)")
        return
    record_baseline_bytes(baseline)  # what plans count for the process itself (memory.baseline: auto)
    log.info(f"process baseline {format_bytes(baseline)} (torch and a tokenizer), recorded for memory.baseline")


def check_writable(path: Path) -> None:
    """ConfigError unless a file can be written at path (tried: its folder is made, a new file is removed)."""
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a"):
            pass
    except OSError as e:
        raise ConfigError(f"cannot write the hardware profile to {path} ({e.strerror or e}); "
                          f"pass --output with a writable path") from None
    if not existed:
        path.unlink()

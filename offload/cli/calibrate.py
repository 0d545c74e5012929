"""`offload calibrate`: measure this machine and cache the hardware profile the planner then uses."""

from __future__ import annotations

import logging
from pathlib import Path

from offload.errors import ConfigError
from offload.hardware import cache_path, format_bytes, save_hardware

log = logging.getLogger("offload")


def add_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="measure this machine and cache its hardware profile")
    p.add_argument("--output", default=None, help=f"where to write the profile (default {cache_path()})")
    p.add_argument("--quick", action="store_true",
                   help="short CPU matmul curves (rows 1-64, weights out of cache) and no overhead fit: under a "
                        "minute; predictions are rougher for small models, whose steps the overheads weigh on")
    p.set_defaults(func=run)


def run(args) -> int:
    """Measure, log and cache the profile; print the path of the written profile."""
    from offload.costfit import calibrate_cpu_costs, quick_cpu_curves
    from offload.runtime.calibrate import calibrate

    from offload.baseline import record_baseline_bytes
    from offload.runtime.host_memory import process_baseline_bytes
    from offload.weights.default_model import resolve_model

    target = Path(args.output) if args.output else cache_path()
    check_writable(target)  # before minutes of measuring
    baseline = process_baseline_bytes(str(resolve_model("default")))  # first: nothing else held yet
    record_baseline_bytes(baseline)  # what plans count for the process itself (memory.baseline: auto)
    log.info(f"process baseline {format_bytes(baseline)} (torch and a tokenizer), recorded for memory.baseline")
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

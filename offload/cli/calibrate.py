"""`offload calibrate`: measure this machine and cache the hardware profile the planner then uses."""

from __future__ import annotations

import logging

from offload.hardware import cache_path, format_bytes, save_hardware

log = logging.getLogger("offload")


def add_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="measure this machine and cache its hardware profile")
    p.add_argument("--output", default=None, help=f"where to write the profile (default {cache_path()})")
    p.set_defaults(func=run)


def run(args) -> int:
    """Measure, log and cache the profile; print the path of the written profile."""
    from offload.runtime.calibrate import calibrate

    profile = calibrate(log.info)
    path = save_hardware(profile, args.output or cache_path())
    log.info(f"ram {format_bytes(profile.ram_bytes)}, {profile.n_cores} cores, vram {format_bytes(profile.vram_bytes)}")
    print(f"wrote {path}")
    return 0

"""The hardware profile items 8 and 9 plan on: `offload calibrate --quick`'s CPU figures (run with CUDA hidden, so
it measures the CPU alone), overlaid with what items 3-7 of this run measured on the GPU. Item 8 builds it and
keeps it in the state folder (profile.yaml); item 9 reads it there (or builds it, where item 8 did not)."""

from __future__ import annotations

import os
import sys
from dataclasses import fields

from gpu_check.runner import run_limited

# calibrate --quick: its CPU curves ~60 s (the figure: rows 1-64 of each format, weights out of cache), the
# bandwidth, matmul and disk probes ~10 s, on the H100 machine's 16 cores: 100 s lets it end on a busier machine
CALIBRATE_TIMEOUT_S = 100
PROFILE_FILE = "profile.yaml"


def _curves(table: dict) -> dict:
    """JSON's lists back into gpu_flops_by_rows' tuples."""
    return {fmt: {kernel: tuple((int(r), float(rate)) for r, rate in curve) for kernel, curve in kernels.items()}
            for fmt, kernels in table.items()}


# profile field: (the step that measured it, how its figures hold it)
FIGURES = {
    "vram_bytes": ("memory", lambda f: f["free_bytes"]),
    "gpu_reserved_bytes": ("memory", lambda f: f["context_reserve_bytes"]),
    "h2d_pinned_bps": ("h2d", lambda f: f["pinned"]["wall_bps"]),
    "h2d_pageable_bps": ("h2d", lambda f: f["pageable"]["wall_bps"]),
    "host_read_bps": ("h2d", lambda f: f["combined_read_bps"]),
    "handover_s": ("handover", lambda f: f["calibrate"]["idle_s"]),
    "handover_busy_s": ("handover", lambda f: f["calibrate"]["under_copy_s"]),
    "gpu_flops": ("fused_matmul", lambda f: f["rooflines"]["gpu_flops"]),
    "gpu_mem_bps": ("fused_matmul", lambda f: f["rooflines"]["gpu_mem_bps"]),
    "gpu_flops_by_rows": ("fused_matmul", lambda f: _curves(f["profile_curves"])),
    "gpu_launch_s": ("host_cost", lambda f: f["gpu_launch_s"]),
    "gpu_layer_host_s": ("host_cost", lambda f: f["profile"]["layer"]),
    "gpu_experts_host_s": ("host_cost", lambda f: f["profile"]["experts"]),
}


# under --smoke only these are taken: the simulated device's rates and times are the host's (its blocks compute on
# the CPU), and a profile of them would plan every unit onto the CPU, leaving the simulated device idle
SMOKE_TAKES = ("vram_bytes", "gpu_reserved_bytes")


def gpu_figures(ctx) -> tuple[dict, dict]:
    """(profile changes measured by items 3-7, {field: why it kept the base profile's value})."""
    known = {f.name for f in fields(_profile_class())}
    changes, kept = {}, {}
    for name, (step, read) in FIGURES.items():
        if name not in known:
            kept[name] = "not a HardwareProfile field in this version"
            continue
        if ctx.smoke and name not in SMOKE_TAKES:
            kept[name] = "a rate of the simulated device (the host's): the preset's kept"
            continue
        try:
            value = read(ctx.earlier(step))
        except (KeyError, TypeError) as e:  # the step failed, or did not measure this figure
            kept[name] = f"{step} has no {e}"
            continue
        if isinstance(value, dict) and "skipped" in value:
            kept[name] = f"{step} skipped it: {value['skipped']}"
            continue
        changes[name] = value
    return changes, kept


def _profile_class():
    from offload.hardware import HardwareProfile

    return HardwareProfile


def cpu_profile(ctx):
    """The CPU's figures: `offload calibrate --quick` with CUDA hidden; the simulated device's preset under
    --smoke; estimated where calibrate fails."""
    from offload.hardware import estimate_hardware, load_hardware

    if ctx.smoke:
        ctx.skip("cpu_calibration", "calibrate --quick takes a minute of CPU: the smoke run plans on the "
                                    "rtx4090-ddr5 preset's CPU figures")
        return ctx.device.sim_hardware
    path, log = ctx.state / "cpu_profile.yaml", ctx.state / "calibrate.log"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    rc, seconds = run_limited([sys.executable, "-m", "offload", "calibrate", "--quick", "--output", str(path)],
                              CALIBRATE_TIMEOUT_S, log, env)
    tail = log.read_text(errors="replace").splitlines()[-3:] if log.exists() else []
    ctx.put("cpu_calibration", {"rc": rc, "seconds": seconds, "log_tail": tail})
    if rc == 0:
        return load_hardware(path)
    return estimate_hardware()


def build_profile(ctx):
    base = cpu_profile(ctx)
    changes, kept = gpu_figures(ctx)
    ctx.put("profile_from_this_run", sorted(changes))
    ctx.put("profile_kept_from_base", kept)
    return base.with_changes(name="gpu_check", source="gpu_check: calibrate --quick (CPU) + items 3-7 (GPU)",
                             **changes)


def check_profile(ctx):
    """The run's profile: built by item 8 (saved for item 9), read back by item 9."""
    from offload.hardware import load_hardware, save_hardware

    path = ctx.state / PROFILE_FILE
    if ctx.name != "offload_70b_batch1" and path.exists():
        ctx.put("profile", f"item 8's ({path.name})")
        return load_hardware(path)
    profile = build_profile(ctx)
    save_hardware(profile, path)
    ctx.put("profile", f"built here ({path.name})")
    return profile

"""What an item works with: its figures (saved as they are measured, so a kill at the limit keeps them), the figures
of the items before it, and the device: CUDA, or under --smoke the strict simulated device (SimBackend's compute
mode: tensors on `simgpu`, which refuses host/device mixing and counts host syncs)."""

from __future__ import annotations

import importlib
import statistics
import time
import traceback
from functools import cached_property
from pathlib import Path

from gpu_check.runner import read_json, result_path, write_json

SIM_PROFILE = "rtx4090-ddr5"  # the simulated device's bandwidths (its CUDA-context reserve left out: no context)


class Context:
    """One item's run: put() records a figure (and saves every figure so far), skip() says why one was not
    measured, summary() gives the headline summary.json shows."""

    def __init__(self, name: str, smoke: bool, state: Path, out: Path):
        self.name, self.smoke, self.state, self.out = name, smoke, state, out
        self.figures: dict = {"simulated": smoke}

    def put(self, key: str, value) -> None:
        self.figures[key] = value
        write_json(result_path(self.state, self.name, "partial"), {"ok": False, "figures": self.figures})

    def skip(self, key: str, reason: str) -> None:
        self.put(key, {"skipped": reason})

    def summary(self, **headline) -> None:
        self.put("summary", {**self.figures.get("summary", {}), **headline})

    def earlier(self, step: str) -> dict:
        """The figures of an earlier step of this run, {} where it did not finish."""
        line = read_json(result_path(self.state, step, "line"))
        return line.get("figures", {}) if line.get("ok") else {}

    def log(self, text: str) -> None:
        print(text, flush=True)

    @cached_property
    def device(self) -> "Device":
        return Device(self.smoke)


class Device:
    """The GPU the check measures: CUDA, or the strict simulated device under --smoke, whose ops run as they are
    called (its times are the host's clock; its figures say so)."""

    def __init__(self, smoke: bool):
        import torch

        self.smoke = smoke
        if smoke:
            from offload.runtime.backends.sim_device import sim_device

            self.torch_device = sim_device()
        else:
            if not torch.cuda.is_available():
                raise RuntimeError("no CUDA GPU is visible to torch; run with --smoke on a machine without one")
            self.torch_device = torch.device("cuda")
        self._backend = None

    @cached_property
    def sim_hardware(self):
        from offload.hardware import load_hardware

        return load_hardware(SIM_PROFILE).with_changes(gpu_reserved_bytes=0)

    def backend(self, hardware=None, capacity_bytes: int | None = None, wrap=None):
        """A fresh backend: CUDABackend, or SimBackend in compute mode (hardware's bandwidths, capacity_bytes);
        wrap(cls) -> a subclass of cls to make instead."""
        if self.smoke:
            from offload.runtime.backends.sim import SimBackend

            cls = wrap(SimBackend) if wrap else SimBackend
            self._backend = cls(hardware or self.sim_hardware, capacity_bytes=capacity_bytes)
        else:
            from offload.runtime.backends.cuda import CUDABackend

            self._backend = (wrap(CUDABackend) if wrap else CUDABackend)()
        return self._backend

    def synchronize(self) -> None:
        if not self.smoke:
            import torch

            torch.cuda.synchronize()

    def seconds_per_call(self, fn, calls: int = 10, repeats: int = 5) -> float:
        """Median seconds of one fn(): repeats runs of `calls` calls after a warm one, timed with CUDA events (on the
        simulated device the host's clock, two runs of two calls)."""
        import torch

        if self.smoke:  # the code path, not a figure: two runs of two calls
            calls, repeats = min(calls, 2), min(repeats, 2)
        fn()
        self.synchronize()
        times = []
        for _ in range(repeats):
            if self.smoke:
                start = time.perf_counter()
                for _ in range(calls):
                    fn()
                times.append(time.perf_counter() - start)
                continue
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1e3)
        return statistics.median(times) / calls

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) device bytes as the driver sees them; simulated: the latest SimBackend's capacity less
        what its tracker counts."""
        if not self.smoke:
            import torch

            return torch.cuda.mem_get_info()
        b = self._backend
        total = b.capacity_bytes if b is not None else self.sim_hardware.vram_bytes
        return total - (b.memory.now_bytes["gpu"] if b is not None else 0), total

    def allocator(self) -> dict:
        """The caching allocator's figures (CUDA); {} on the simulated device, which has none."""
        if self.smoke:
            return {}
        import torch

        return {"allocated_bytes": torch.cuda.memory_allocated(), "reserved_bytes": torch.cuda.memory_reserved(),
                "max_allocated_bytes": torch.cuda.max_memory_allocated()}

    def reset_peak(self) -> None:
        if not self.smoke:
            import torch

            torch.cuda.reset_peak_memory_stats()


def one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"[:2000]


def run_item(name: str, target: str, smoke: bool, state: Path, out: Path) -> int:
    """Run the item `name` (target: "module:function") in this process; its result (ok, error, figures) goes to
    state/NAME.result.json."""
    module, function = target.split(":")
    ctx = Context(name, smoke, state, out)
    start = time.perf_counter()
    try:
        getattr(importlib.import_module(module), function)(ctx)
        ok, error = True, None
    except Exception as e:  # noqa: BLE001 - recorded in the item's line; the next item runs
        traceback.print_exc()
        ok, error = False, one_line(e)
    write_json(result_path(state, name, "result"), {"ok": ok, "error": error, "figures": ctx.figures})
    print(f"{name}: {'ok' if ok else 'FAILED ' + error} in {time.perf_counter() - start:.1f} s", flush=True)
    return 0 if ok else 1

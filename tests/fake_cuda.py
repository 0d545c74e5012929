"""A stand-in for the few torch.cuda calls CUDABackend makes, so that its bookkeeping (event pool, timings, memory
peaks, pinning) runs on the CPU. Strict where the real thing is: an event's time can be read only if it was made
with timing and recorded, and each record moves a clock, so an event recorded again before its time was read
gives a wrong span."""

from __future__ import annotations

import contextlib

import torch


class FakeEvent:
    """An event: record() stamps the fake device's clock (1 ms a record)."""

    def __init__(self, cuda: "FakeCuda", enable_timing: bool = False):
        self.cuda, self.timing = cuda, enable_timing
        self.t_ms: float | None = None
        self.n_records = 0
        cuda.events.append(self)

    def record(self, stream=None) -> None:
        self.cuda.clock_ms += 1.0
        self.t_ms, self.n_records = self.cuda.clock_ms, self.n_records + 1

    def query(self) -> bool:
        return self.t_ms is not None

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "FakeEvent") -> float:
        if not (self.timing and end.timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'")
        if self.t_ms is None or end.t_ms is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time")
        return end.t_ms - self.t_ms


class FakeStream:
    def __init__(self, device=None):
        self.waited: list = []

    def wait_event(self, event) -> None:
        self.waited.append(event)

    def wait_stream(self, stream) -> None:
        pass


class FakeCuda:
    """The device's state: events made, a clock, memory as mem_get_info and the allocator report it."""

    def __init__(self, total_bytes: int = 80 << 30):
        self.events: list[FakeEvent] = []
        self.clock_ms = 0.0
        self.total_bytes, self.used_bytes = total_bytes, 1 << 30  # the context, before offload allocates
        self.reserved_bytes = self.max_reserved_bytes = self.max_allocated_bytes = 0

    def install(self, monkeypatch) -> "FakeCuda":
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "Event", lambda enable_timing=False, **kw: FakeEvent(self, enable_timing))
        monkeypatch.setattr(cuda, "Stream", FakeStream)
        monkeypatch.setattr(cuda, "stream", lambda s: contextlib.nullcontext())
        monkeypatch.setattr(cuda, "current_stream", lambda device=None: FakeStream())
        monkeypatch.setattr(cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(cuda, "cudart", lambda: object())
        monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda device=None: None)
        monkeypatch.setattr(cuda, "mem_get_info", lambda device=None: (self.total_bytes - self.used_bytes,
                                                                        self.total_bytes))
        monkeypatch.setattr(cuda, "memory_reserved", lambda device=None: self.reserved_bytes)
        monkeypatch.setattr(cuda, "max_memory_reserved", lambda device=None: self.max_reserved_bytes)
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: self.max_allocated_bytes)
        return self

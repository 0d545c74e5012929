"""Pinned host memory has a full lifecycle: registered once, kept alive while registered, unregistered before it
can be freed, every failure's error cleared; tested against a fake CUDA runtime, on the CPU."""

from __future__ import annotations

import resource

import torch

from offload.runtime.backends.cuda import CUDA_ERROR_MEMORY_ALLOCATION, PinnedRegistry

ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered


class FakeRuntime:
    """Registrations by address, like the driver: registering a registered address fails; errors are sticky in
    `last` until cleared, as cudaGetLastError would report them to the next kernel launch."""

    def __init__(self, fail_with: int = 0):
        self.registered: dict[int, int] = {}
        self.last, self.fail_with, self.calls = 0, fail_with, []

    def register(self, ptr: int, n_bytes: int) -> int:
        self.calls.append(("register", ptr))
        err = self.fail_with or (ALREADY_REGISTERED if ptr in self.registered else 0)
        if err:
            self.last = err
            return err
        self.registered[ptr] = n_bytes
        return 0

    def unregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr))
        return 0 if self.registered.pop(ptr, None) is not None else 713

    def error_string(self, code: int) -> str:
        return {ALREADY_REGISTERED: "part or all of the requested memory range is already mapped",
                CUDA_ERROR_MEMORY_ALLOCATION: "out of memory"}.get(code, "unknown")

    def clear_error(self) -> None:
        self.last = 0

    def is_pinned(self, buf: torch.Tensor) -> bool:
        return False


def test_register_once_and_unregister_before_free():
    rt = FakeRuntime()
    reg = PinnedRegistry(rt)
    buf = torch.empty(4096, dtype=torch.uint8)
    assert reg.pin(buf) and reg.pin(buf)  # the second pin of the same buffer is skipped
    assert [c for c in rt.calls if c[0] == "register"] == [("register", buf.data_ptr())]
    assert len(reg) == 1
    reg.close()
    assert rt.registered == {} and len(reg) == 0 and rt.last == 0


def test_a_new_model_can_pin_memory_the_last_one_freed():
    """The defect: buffers freed without unregistering come back from the allocator registered, and the next
    model's registration fails. With close() before the free, the address registers again cleanly."""
    rt = FakeRuntime()
    first = PinnedRegistry(rt)
    buf = torch.empty(8192, dtype=torch.uint8)
    assert first.pin(buf)
    first.close()
    second = PinnedRegistry(rt)
    assert second.pin(buf) and rt.last == 0


def test_a_refused_registration_is_cleared_and_named():
    rt = FakeRuntime(fail_with=ALREADY_REGISTERED)
    reg = PinnedRegistry(rt)
    assert not reg.pin(torch.empty(64, dtype=torch.uint8))
    assert rt.last == 0  # cleared: it cannot surface later as an unrelated CUDA error
    why = reg.why_failed()
    assert "already mapped" in why and "ulimit" not in why  # the memlock hint only where it can be the cause


def test_the_memlock_hint_appears_only_when_the_limit_can_be_the_cause(monkeypatch):
    reg = PinnedRegistry(FakeRuntime(fail_with=CUDA_ERROR_MEMORY_ALLOCATION))
    assert not reg.pin(torch.empty(64, dtype=torch.uint8))
    monkeypatch.setattr(resource, "getrlimit", lambda what: (64 * 2**20, 64 * 2**20))
    assert "ulimit -l" in reg.why_failed() and "64 MiB" in reg.why_failed()
    monkeypatch.setattr(resource, "getrlimit", lambda what: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert "ulimit" not in reg.why_failed()


def test_registered_buffers_stay_alive_until_closed():
    import gc
    import weakref

    reg = PinnedRegistry(FakeRuntime())
    buf = torch.empty(1024, dtype=torch.uint8)
    ref = weakref.ref(buf)
    reg.pin(buf)
    del buf
    gc.collect()
    assert ref() is not None  # its memory cannot go back to the allocator while registered
    reg.close()
    gc.collect()
    assert ref() is None


def test_a_refused_pin_is_an_error_that_names_the_limit_and_the_pageable_switch(monkeypatch):
    """The defect: a refused cudaHostRegister only warned while the plan priced pinned copies. Now the load stops
    with one line naming the memlock limit (where it can be the cause) and OFFLOAD_PAGEABLE=1; what was registered
    before is let go."""
    import pytest

    from fake_cuda import FakeCuda
    from offload.errors import ConfigError
    from offload.runtime.backends.cuda import CUDABackend

    FakeCuda().install(monkeypatch)
    monkeypatch.delenv("OFFLOAD_PAGEABLE", raising=False)
    monkeypatch.setattr(resource, "getrlimit", lambda what: (64 * 2**20, 64 * 2**20))
    backend = CUDABackend()
    rt = FakeRuntime()
    backend.pinned = PinnedRegistry(rt)
    backend.pin(torch.empty(64, dtype=torch.uint8))
    rt.fail_with = CUDA_ERROR_MEMORY_ALLOCATION
    with pytest.raises(ConfigError) as caught:
        backend.alloc("cpu", 4 << 20, pinned=True)
    message = str(caught.value)
    assert "\n" not in message and "4.00 MiB" in message and "ulimit -l unlimited" in message
    assert "OFFLOAD_PAGEABLE=1" in message and rt.registered == {}


def test_with_offload_pageable_nothing_is_pinned_and_plans_price_pageable_copies(monkeypatch):
    from fake_cuda import FakeCuda
    from offload.hardware import load_hardware
    from offload.planner.request import PlanRequest
    from offload.runtime.backends.cuda import CUDABackend

    FakeCuda().install(monkeypatch)
    monkeypatch.setenv("OFFLOAD_PAGEABLE", "1")
    backend = CUDABackend()
    rt = FakeRuntime(fail_with=CUDA_ERROR_MEMORY_ALLOCATION)
    backend.pinned = PinnedRegistry(rt)
    backend.alloc("cpu", 4 << 20, pinned=True)
    assert rt.calls == []  # not even tried
    preset = load_hardware("rtx4090-ddr5")
    hw = PlanRequest.of(hardware="rtx4090-ddr5").profile()
    assert hw.h2d_pinned_bps == preset.h2d_pageable_bps < preset.h2d_pinned_bps
    monkeypatch.delenv("OFFLOAD_PAGEABLE")
    assert PlanRequest.of(hardware="rtx4090-ddr5").profile().h2d_pinned_bps == preset.h2d_pinned_bps

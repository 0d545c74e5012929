"""CUDABackend's bookkeeping on the CPU (tests/fake_cuda.py stands in for torch.cuda): timing events come from a
pool and go back once read, so a long run makes a bounded number; the spans the report needs are all there and
right; device memory is sampled as the device sees it and budgets are held to that peak; the calibrated context
reserve is measured after the libraries a step uses have loaded."""

from __future__ import annotations

import time

import pytest
import torch

from fake_cuda import FakeCuda
from offload.profile.report import JobCounts, build_report, format_report
from offload.profile.timeline import Timeline
from offload.runtime.backends.cuda import CUBLAS_WORKSPACE_BYTES, CUDABackend, context_reserve_bytes
from offload.runtime.backends.event_pool import EventPool
from offload.runtime.backends.memory_sampler import DeviceMemorySampler, device_peak_bytes

N_STEPS, N_UNITS = 50, 4  # streamed units per step


@pytest.fixture
def cuda(monkeypatch) -> FakeCuda:
    return FakeCuda().install(monkeypatch)


def run_steps(backend: CUDABackend, n_steps: int = N_STEPS) -> list:
    """What the streamer and the unit runner do per streamed unit: copy, wait for it, compute, release; the
    timings collected at each step's start, as the generator does. Returns the copy handles."""
    src, dst, handles = torch.ones(64, dtype=torch.uint8), torch.empty(64, dtype=torch.uint8), []
    for _ in range(n_steps):
        backend.collect()
        for j in range(N_UNITS):
            handles.append(backend.copy_h2d(dst, src, f"layer.{j}", "decode"))
            backend.wait_copy(handles[-1], f"layer.{j}", "decode")
            with backend.gpu_block(f"layer.{j}", "decode", 1):
                pass
            backend.mark_done()
    backend.synchronize()
    return handles


def test_timing_events_are_pooled_and_spans_kept(cuda):
    """The defect: two new timing events per copy, wait and block (7 events per streamed unit with the release:
    1400 here). Now the pool's events are bounded by a step's, and only the handles the streams wait on are new:
    a copy's end (timed) and a release (untimed)."""
    backend = CUDABackend(Timeline())
    handles = run_steps(backend)
    backend.close()
    n_copies = N_STEPS * N_UNITS
    timed = [e for e in cuda.events if e.timing]
    assert backend._events.n_made <= 5 * N_UNITS  # a copy's start, a wait's two, a block's two: one step in flight
    assert len(timed) <= n_copies + 5 * N_UNITS + 1  # + the origin
    assert len(cuda.events) - len(timed) == n_copies  # the releases' events: handles only, never timed
    assert all(h.n_records == 1 and h.timing for h in handles)  # a handle is never recorded again
    spans = backend.timeline.spans
    assert [sum(s.kind == k for s in spans) for k in ("h2d_copy", "wait", "gpu_block")] == [n_copies] * 3
    # each span's two events were recorded one after the other: 1 ms apart on the fake clock, unless a pooled
    # event was recorded again before its time was read
    assert all(s.duration_s == pytest.approx(1e-3) for s in spans)
    assert sum(s.n_bytes for s in spans) == 64 * n_copies and sum(s.n_tokens for s in spans) == n_copies


def test_the_pool_hands_back_given_events_before_making_new_ones():
    made = []
    pool = EventPool(lambda: made.append(object()) or made[-1])
    a, b = pool.take(), pool.take()
    pool.give_back([a])
    assert pool.take() is a and pool.n_made == 2 and len(pool) == 0
    pool.give_back([a, b])
    assert {pool.take(), pool.take()} == {a, b} and pool.take() not in (a, b) and pool.n_made == 3


def test_the_sampler_keeps_the_peak_it_saw():
    """In use (of 100): 30 at the start, 60 for a while, then 40: the thread saw 60, and a reset starts from 40."""
    used, reads = [30], []

    def mem_get_info():
        reads.append(used[0])
        return 100 - used[0], 100

    def wait_for(n_reads: int) -> None:
        deadline = time.monotonic() + 5
        while len(reads) < n_reads and time.monotonic() < deadline:
            time.sleep(0.001)

    sampler = DeviceMemorySampler(mem_get_info, interval_s=0.001)
    sampler.start()
    used[0] = 60
    wait_for(len(reads) + 3)
    used[0] = 40
    wait_for(len(reads) + 3)
    thread = sampler._thread
    sampler.stop()
    assert sampler.peak_used_bytes == 60 and reads[0] == 30 and reads[-1] == 40
    assert thread.daemon and not thread.is_alive()
    sampler.reset()
    assert sampler.peak_used_bytes == 40


def test_the_device_peak_is_held_to_the_budget_not_the_allocated_peak(cuda):
    """The defect: 'within budget' compared max_memory_allocated only, blind to the context, the libraries'
    modules and the allocator's cache. The device's peak counts them; a spike between samples still shows
    through the reserved peak on top of what was in use outside the allocator at the start."""
    backend = CUDABackend()
    try:
        cuda.used_bytes, cuda.max_allocated_bytes, cuda.max_reserved_bytes = (9 << 30), 7 << 30, 7 << 30
        backend.device_memory.sample()
        cuda.used_bytes = 2 << 30  # freed again before the report
        assert backend.peak_device_bytes() == 9 << 30 > cuda.max_allocated_bytes
        cuda.max_reserved_bytes = 12 << 30  # a spike no sample saw: 12 GiB reserved + the 1 GiB context
        assert backend.peak_device_bytes() == 13 << 30
        peaks = backend.memory_peaks()
        assert peaks == {"gpu": 13 << 30, "gpu_allocated": 7 << 30, "gpu_reserved": 12 << 30}
        backend.reset_peak()
        cuda.max_reserved_bytes = 0
        assert backend.peak_device_bytes() == 2 << 30
    finally:
        backend.close()
    assert device_peak_bytes(5, 3, 1) == 5 and device_peak_bytes(3, 3, 1) == 4


def test_the_report_shows_the_device_peak_beside_the_allocator_peaks():
    peaks = {"cpu": 1 << 30, "gpu": 13 << 30, "gpu_allocated": 7 << 30, "gpu_reserved": 12 << 30}
    report = build_report(JobCounts(), peaks=peaks, budget={"gpu": 12 << 30})
    gpu = report["memory"]["gpu"]
    assert gpu["peak_bytes"] == 13 << 30 and gpu["peak_over_budget"] == pytest.approx(13 / 12)
    assert gpu["allocated_peak_bytes"] == 7 << 30 and gpu["reserved_peak_bytes"] == 12 << 30
    assert ("   vram: peak 13.00 GiB of budget 12.00 GiB (the device's; allocated 7.00 GiB, reserved 12.00 GiB "
            "at peak)") in format_report(report)
    cpu_only = build_report(JobCounts(), peaks={"cpu": 1 << 30, "gpu": 0})
    assert "allocated_peak_bytes" not in cpu_only["memory"]["gpu"] and "the device's" not in format_report(cpu_only)


def test_the_report_names_the_cpu_kernel_path(monkeypatch):
    import offload.kernels as kernels

    report = build_report(JobCounts())
    assert report["cpu_kernels"] == kernels.ACTIVE_PATH
    assert f"kernels: CPU {kernels.ACTIVE_PATH} (C++)" in format_report(report).splitlines()
    monkeypatch.setattr(kernels, "ACTIVE_PATH", "numba")
    assert "kernels: CPU numba (numba: the C++ extension is not built)" in format_report(build_report(JobCounts()))


def test_the_context_reserve_is_measured_after_the_libraries_load(cuda):
    """cuBLAS, attention and Triton load their modules at first use, outside the allocator: measured before, the
    reserve missed them (~0.5 GiB on an H100)."""
    def load(dev):
        cuda.used_bytes += 512 << 20  # modules loaded
        cuda.reserved_bytes = CUBLAS_WORKSPACE_BYTES  # the workspace the matmul made, counted by the allocator
        cuda.used_bytes += CUBLAS_WORKSPACE_BYTES

    context = cuda.used_bytes
    reserve = context_reserve_bytes(torch.device("cuda"), load=load)
    assert reserve == context + (512 << 20) + 2 * CUBLAS_WORKSPACE_BYTES

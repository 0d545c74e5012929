"""Backend: what the executor asks of a device — memory by tier, async copies, completion markers, timing.

The schedule in executor.py is written once against this interface. CPUBackend runs it on a machine without
a GPU (the "gpu" tier is then ordinary memory, tracked separately), CUDABackend on a real one.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import sys
from dataclasses import dataclass, field

import torch

from offload.planner.types import TIERS
from offload.profile.timeline import Span, Timeline



HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14  # Linux


def _libc_madvise():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


_madvise = _libc_madvise() if sys.platform.startswith("linux") else None


def host_empty(n_bytes: int) -> torch.Tensor:
    """Uninitialized host bytes; from 2 MiB up, fresh anonymous memory, 2 MiB-aligned and advised for
    transparent huge pages.

    Weights are streamed through the CPU kernels and PCIe copies; on 4 KiB pages the hardware prefetcher
    stops at every page boundary and each page costs a TLB walk (matrix-vector products over huge pages ran
    about 10-25% faster on this project's 2-core Zen3 machine). The memory is mapped afresh (not reused from
    the heap, whose pages may already be faulted in small) so the advice takes effect at first touch. Where
    the kernel refuses (THP set to never, not Linux), the buffer is simply made of ordinary pages.
    """
    if n_bytes < HUGE_PAGE_BYTES or _madvise is None:
        return torch.empty(n_bytes, dtype=torch.uint8)
    region = mmap.mmap(-1, n_bytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping alive
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    buf = raw[offset: offset + n_bytes]
    _madvise(buf.data_ptr(), n_bytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES, _MADV_HUGEPAGE)
    return buf


@dataclass
class MemoryTracker:
    """Bytes allocated per tier now and at peak, as the backend hands buffers out and takes them back."""

    now_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    peak_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))

    def add(self, tier: str, n_bytes: int) -> None:
        self.now_bytes[tier] += n_bytes
        self.peak_bytes[tier] = max(self.peak_bytes[tier], self.now_bytes[tier])

    def remove(self, tier: str, n_bytes: int) -> None:
        self.now_bytes[tier] -= n_bytes


class Backend:
    """Base: allocation with accounting and the event log; subclasses supply the device and the copies."""

    name = "base"
    device: torch.device

    def __init__(self, timeline: Timeline | None = None):
        self.timeline = timeline or Timeline()
        self.memory = MemoryTracker()
        self.log: list[tuple[str, str, int]] = []  # (event, unit, slot): copy / compute / release

    # memory -------------------------------------------------------------------------------------------
    def alloc(self, tier: str, n_bytes: int, pinned: bool = False) -> torch.Tensor:
        """A uint8 buffer of n_bytes in tier (gpu: the device; cpu: host RAM, page-locked if pinned)."""
        on_host = tier == "cpu" or self.device.type == "cpu"
        buf = host_empty(n_bytes) if on_host else torch.empty(n_bytes, dtype=torch.uint8, device=self.device)
        if pinned and tier == "cpu":
            buf = self.pin(buf)
        self.memory.add(tier, n_bytes)
        return buf

    def track(self, tier: str, n_bytes: int) -> None:
        """Count memory allocated elsewhere (a KV cache, disk files) against a tier."""
        self.memory.add(tier, n_bytes)

    def free(self, tier: str, n_bytes: int) -> None:
        self.memory.remove(tier, n_bytes)

    def pin(self, buf: torch.Tensor) -> torch.Tensor:
        """Page-lock a host buffer in place if the backend can; the CPU backend has nothing to pin."""
        return buf

    # copies and ordering -------------------------------------------------------------------------------
    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, unit: str, phase: str):
        """Start copying host src into device dst; returns a handle that compute can wait on."""
        raise NotImplementedError

    def wait_copy(self, handle) -> None:
        """Make the compute stream wait for a copy (no host synchronisation)."""

    def mark_done(self):
        """A handle that completes when all compute enqueued so far has finished."""
        return None

    def wait_done_before_copy(self, handle) -> None:
        """Make the copy stream wait until compute recorded by handle has finished (slot reuse)."""

    def host_wait(self, handle) -> None:
        """Block the host until the copy or compute behind handle has finished (before reusing a host buffer)."""

    def compute_context(self):
        """A context in which the executor's work is ordered on the compute stream (nothing to do on the CPU)."""
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def gpu_block(self, unit: str, phase: str, n_tokens: int):
        """Time a block computed on the device."""
        start = Timeline.now()
        yield
        self.timeline.add(Span("gpu_block", phase, unit, start, Timeline.now(), n_tokens=n_tokens))

    def synchronize(self) -> None:
        """Wait for all device work and resolve pending timings."""

    def reset_peak(self) -> None:
        """Start peak tracking afresh."""
        self.memory.peak_bytes = dict(self.memory.now_bytes)

    def peak_device_bytes(self) -> int:
        """Peak device memory as the device itself reports it (the tracker's figure on the CPU backend)."""
        return self.memory.peak_bytes["gpu"]

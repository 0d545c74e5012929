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


@dataclass(frozen=True)
class Work:
    """One block of work as a backend sees it: which unit, in which phase, over how many tokens and keys."""

    unit: str
    kind: str  # embed | layer | norm | lm_head
    phase: str
    n_tokens: int  # new tokens this pass computes (all sequences)
    n_seqs: int = 1
    n_keys: int = 0  # keys each query may see at most (layers)
    kv_on_host: bool = False  # a layer whose KV cache is in host RAM (computed on the GPU: decode attends on the CPU)


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
    computes = True  # False: a timed simulation, where weights are never read and blocks take modelled time

    def __init__(self, timeline: Timeline | None = None):
        self.timeline = timeline or Timeline()
        self.memory = MemoryTracker()
        self.log: list[tuple[str, str, int]] = []  # (event, unit, slot): copy / compute / release

    # memory -------------------------------------------------------------------------------------------
    def alloc(self, tier: str, n_bytes: int, pinned: bool = False) -> torch.Tensor:
        """A uint8 buffer of n_bytes in tier (gpu: the device; cpu: host RAM, page-locked if pinned)."""
        self.check_capacity(tier, n_bytes)
        on_host = tier == "cpu" or self.device.type == "cpu"
        buf = host_empty(n_bytes) if on_host else torch.empty(n_bytes, dtype=torch.uint8, device=self.device)
        if pinned and tier == "cpu":
            buf = self.pin(buf)
        self.memory.add(tier, n_bytes)
        return buf

    def track(self, tier: str, n_bytes: int) -> None:
        """Count memory allocated elsewhere (a KV cache, disk files) against a tier."""
        self.check_capacity(tier, n_bytes)
        self.memory.add(tier, n_bytes)

    def check_capacity(self, tier: str, n_bytes: int) -> None:
        """Raise DeviceMemoryError if n_bytes more would not fit the tier (only a simulated device has a limit)."""

    def free(self, tier: str, n_bytes: int) -> None:
        self.memory.remove(tier, n_bytes)

    def pin(self, buf: torch.Tensor) -> torch.Tensor:
        """Page-lock a host buffer in place if the backend can; the CPU backend has nothing to pin."""
        return buf

    def close(self) -> None:
        """Give back what the backend holds for the device (pinned registrations) before buffers are freed."""

    def order_after_allocations(self) -> None:
        """Order buffers just allocated before the streams that will use them (CUDA's default stream)."""

    # copies and ordering -------------------------------------------------------------------------------
    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, unit: str, phase: str, not_before: float = 0.0):
        """Start copying host src into device dst (not before time not_before, when src is ready); returns a
        handle that compute can wait on."""
        raise NotImplementedError

    def wait_copy(self, handle, unit: str = "", phase: str = "") -> None:
        """Make the compute stream wait for a copy (no host synchronisation); a stall is a wait span."""

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

    # compute -------------------------------------------------------------------------------------------
    def now(self) -> float:
        """The clock the timeline and phase times use (a simulated device keeps its own)."""
        return Timeline.now()

    def launch(self, work: Work, fn, x, *args):
        """Run fn(x, *args) as a block on the device (enqueued on the compute stream); the result may be pending."""
        with self.gpu_block(work.unit, work.phase, work.n_tokens):
            return fn(x, *args)

    def run_cpu(self, works: list[Work], fn, x, *args):
        """Run consecutive CPU blocks as fn(x, *args, ends), which appends each block's end (Timeline.now())."""
        ends: list[float] = []
        start = Timeline.now()
        y = fn(x, *args, ends)
        self.timeline.add_blocks("cpu_block", works, [start] + ends)
        return y

    def to_device(self, x: torch.Tensor):
        """Hidden states handed to the device (ordered on the compute stream)."""
        return x.to(self.device)

    def upload(self, t: torch.Tensor) -> torch.Tensor:
        """A small host tensor (a step's positions, rope tables, mask) on the device, for the device's blocks."""
        return t.to(self.device)

    def to_host(self, x) -> torch.Tensor:
        """A device result on the host, once the device has computed it."""
        return x.to("cpu")

    def download(self, t: torch.Tensor) -> torch.Tensor:
        """A device tensor copied to the host within a step (through page-locked memory where the device has it):
        the host waits for the device once."""
        return t.to("cpu")

    def read_disk(self, store, unit: str, buffer: torch.Tensor, phase: str, not_before: float = 0.0) -> float:
        """Read unit's bytes from store into buffer (a read-ahead thread calls this); returns when they are there."""
        start = self.now()
        n = store.read_into(unit, buffer)
        end = self.now()
        self.timeline.add(Span("disk_read", phase, unit, start, end, n_bytes=n))
        return end

    def host_wait_until(self, t: float) -> None:
        """The host has waited for something ready at time t (a simulated clock moves on; real ones did wait)."""

    def meta_or(self, device) -> torch.device:
        """Where buffers and caches live: device, or nowhere (meta) on a timed simulation."""
        return torch.device(device)

    def synchronize(self) -> None:
        """Wait for all device work and resolve pending timings."""

    def collect(self) -> None:
        """Resolve the timings of the device work already done, without waiting for the rest (at each step's
        start: a long job holds no more than a step or two of them)."""

    def reset_peak(self) -> None:
        """Start peak tracking afresh."""
        self.memory.peak_bytes = dict(self.memory.now_bytes)

    def device_memory_bytes(self) -> int | None:
        """The device's total memory, or None where there is no device to hold a GPU budget to (the CPU)."""
        return None

    def peak_device_bytes(self) -> int:
        """Peak device memory as the device itself reports it (the tracker's figure on the CPU backend)."""
        return self.memory.peak_bytes["gpu"]

    def memory_peaks(self) -> dict[str, int]:
        """Peak device bytes for the report: "gpu" (peak_device_bytes, which budgets are held to), and where the
        device has an allocator, "gpu_allocated" and "gpu_reserved" (its peaks) beside it."""
        return {"gpu": self.peak_device_bytes()}

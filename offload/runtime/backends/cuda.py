"""CUDABackend: the only place offload touches torch.cuda — streams, events, pinned memory, VRAM statistics."""

from __future__ import annotations

import contextlib
import ctypes
import resource
import statistics
import threading
import time
import weakref
from typing import NamedTuple

import torch

from offload.errors import ConfigError
from offload.hardware import PAGEABLE_ENV, format_bytes, pageable_copies
from offload.runtime.backends.base import Backend
from offload.runtime.backends.event_pool import EventPool
from offload.runtime.backends.memory_sampler import DeviceMemorySampler, device_peak_bytes
from offload.profile.timeline import Span, Timeline

PAGEABLE_SLOWDOWN = 3  # pageable H2D copies reach about a third of pinned bandwidth
CUDA_ERROR_MEMORY_ALLOCATION = 2
CUDA_HOST_REGISTER_PORTABLE = 1
CUBLAS_WORKSPACE_BYTES = 32 << 20  # one cuBLAS handle's workspace per stream on sm_90 (counted by the allocator)


class CudaRuntime:
    """The few CUDA runtime calls pinning needs (torch's libcudart bindings; cudaGetLastError through ctypes)."""

    def __init__(self):
        self._cudart = torch.cuda.cudart()

    def register(self, ptr: int, n_bytes: int) -> int:
        return int(self._cudart.cudaHostRegister(ptr, n_bytes, CUDA_HOST_REGISTER_PORTABLE))

    def unregister(self, ptr: int) -> int:
        return int(self._cudart.cudaHostUnregister(ptr))

    def error_string(self, code: int) -> str:
        try:
            return str(self._cudart.cudaGetErrorString(self._cudart.cudaError(code)))
        except (TypeError, ValueError, AttributeError):
            return f"CUDA error {code}"

    def clear_error(self) -> None:
        """Reset the runtime's last error, which a later kernel-launch check would otherwise report."""
        for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12"):
            try:
                ctypes.CDLL(name).cudaGetLastError()
                return
            except (OSError, AttributeError):
                continue

    def is_pinned(self, buf: torch.Tensor) -> bool:
        return buf.is_pinned()


class PinnedRegistry:
    """Host buffers page-locked with cudaHostRegister. A buffer is registered once (one torch already pinned is
    left alone), kept alive while registered so its memory cannot be reused under the registration, and
    unregistered by close() before it can be freed; a failed call's error is cleared so that it cannot surface
    later as an unrelated CUDA error."""

    def __init__(self, runtime):
        self.runtime = runtime
        self._buffers: dict[int, torch.Tensor] = {}
        self.last_error: int = 0

    def pin(self, buf: torch.Tensor) -> bool:
        """Page-lock buf in place; False if the runtime refused (copies from it are then pageable)."""
        ptr = buf.data_ptr()
        if ptr in self._buffers or self.runtime.is_pinned(buf):
            return True
        err = self.runtime.register(ptr, buf.numel() * buf.element_size())
        if err:
            self.runtime.clear_error()
            self.last_error = err
            return False
        self._buffers[ptr] = buf
        return True

    def close(self) -> None:
        """Unregister every buffer (before its memory goes back to the allocator) and let it go."""
        for ptr in list(self._buffers):
            if self.runtime.unregister(ptr):
                self.runtime.clear_error()
            del self._buffers[ptr]

    def __len__(self) -> int:
        return len(self._buffers)

    def why_failed(self) -> str:
        """What the runtime said, and the memlock limit only where it can be the cause."""
        text = f"cudaHostRegister failed: {self.runtime.error_string(self.last_error)}"
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        if self.last_error == CUDA_ERROR_MEMORY_ALLOCATION and soft != resource.RLIM_INFINITY:
            text += (f"; the locked-memory limit is {soft // 2**20} MiB: raise it (ulimit -l unlimited, or "
                     f"--ulimit memlock=-1 for a container)")
        return text


def cuda_available() -> bool:
    return torch.cuda.is_available()


class Timing(NamedTuple):
    """A span awaiting its events' times; `pooled` are the events to give back to the pool once it is read (not a
    copy's end: that is also the handle the compute stream waits on)."""

    kind: str
    phase: str
    unit: str
    n_bytes: int
    start: object
    end: object
    n_tokens: int
    pooled: tuple


class CUDABackend(Backend):
    """A compute stream and a copy stream; copies are ordered against compute with events, never host syncs."""

    name = "cuda"

    def __init__(self, timeline: Timeline | None = None, device_index: int = 0):
        super().__init__(timeline)
        self.device = torch.device("cuda", device_index)
        self.compute_stream = torch.cuda.Stream(self.device)
        self.copy_stream = torch.cuda.Stream(self.device)
        self._pending: list[Timing] = []  # spans awaiting their events' times, oldest first
        self._events = EventPool(lambda: torch.cuda.Event(enable_timing=True))
        self._origin = None  # (event, host time) that maps event times onto the timeline's clock
        self.pinned = PinnedRegistry(CudaRuntime())
        torch.cuda.reset_peak_memory_stats(self.device)
        device = self.device  # the sampler's thread holds the device, not the backend
        self.device_memory = DeviceMemorySampler(lambda: torch.cuda.mem_get_info(device))
        # in use outside the allocator now (the context, other processes): with the reserved peak, a floor of the
        # device's peak that a spike between two samples cannot pass under
        self._outside_allocator_bytes = self.device_memory.sample() - torch.cuda.memory_reserved(device)
        self.device_memory.start()
        weakref.finalize(self, self.device_memory.stop)  # a backend dropped without close() stops sampling too

    def pin(self, buf: torch.Tensor) -> torch.Tensor:
        """Page-lock buf in place with cudaHostRegister (exact size, no power-of-two rounding); left pageable where
        OFFLOAD_PAGEABLE=1 made the plan price pageable copies. ConfigError where the runtime refuses."""
        if pageable_copies() or self.pinned.pin(buf):
            return buf
        self.close()  # the load stops here: what was registered is let go
        raise ConfigError(f"could not pin {format_bytes(buf.numel() * buf.element_size())} of host memory for "
                          f"offloaded weights ({self.pinned.why_failed()}), and the plan priced pinned copies; set "
                          f"{PAGEABLE_ENV}=1 to plan and run with pageable copies (about {PAGEABLE_SLOWDOWN}x slower)")

    def close(self) -> None:
        """Unregister the pinned host buffers before their memory can be freed or reused; stop sampling."""
        self.device_memory.stop()
        try:
            torch.cuda.synchronize(self.device)  # no copy may still read them
        except RuntimeError:  # the CUDA runtime is already shutting down (interpreter exit)
            pass
        self.pinned.close()

    def order_after_allocations(self) -> None:
        """Buffers and caches allocated (and zeroed) on the default stream are ready before the side streams use
        them."""
        default = torch.cuda.current_stream(self.device)
        self.compute_stream.wait_stream(default)
        self.copy_stream.wait_stream(default)

    def compute_context(self):
        """Make the compute stream current: every kernel, allocation and device<->host move is ordered on it."""
        return torch.cuda.stream(self.compute_stream)

    def _event(self, stream, timing: bool = True, pooled: bool = True) -> torch.cuda.Event:
        """An event recorded on stream: from the pool where only its time is read (pooled), else a new one (a
        handle some stream or the host will wait on), with timing only where its time is read."""
        if timing and self._origin is None:
            origin = torch.cuda.Event(enable_timing=True)  # never pooled: every time is read against it
            origin.record(stream)
            self._origin = (origin, Timeline.now())
        ev = self._events.take() if pooled else torch.cuda.Event(enable_timing=timing)
        ev.record(stream)
        return ev

    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, unit: str, phase: str, not_before: float = 0.0):
        with torch.cuda.stream(self.copy_stream):
            start = self._event(self.copy_stream)
            dst[: src.numel()].copy_(src, non_blocking=True)
            end = self._event(self.copy_stream, pooled=False)  # the handle: the compute stream waits on it
        self._pending.append(Timing("h2d_copy", phase, unit, src.numel(), start, end, 0, (start,)))
        return end

    def to_device(self, x: torch.Tensor):
        """Hidden states cross from page-locked memory without blocking the host (ordered on the compute stream)."""
        if x.device.type == "cpu":
            x = x.pin_memory()
        return x.to(self.device, non_blocking=True)

    def download(self, t: torch.Tensor) -> torch.Tensor:
        """Into page-locked memory on the compute stream (a pageable copy is slower), then one wait for it."""
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        return host

    def upload(self, t: torch.Tensor) -> torch.Tensor:
        """From page-locked memory on the compute stream: the host does not wait for the blocks queued before
        (a pageable copy would: one host stall per step)."""
        return self.to_device(t)

    def wait_copy(self, handle, unit: str = "", phase: str = "") -> None:
        """The compute stream waits for the copy; the stall is timed as a wait span."""
        if handle is not None:
            start = self._event(self.compute_stream)
            self.compute_stream.wait_event(handle)
            end = self._event(self.compute_stream)
            self._pending.append(Timing("wait", phase, unit, 0, start, end, 0, (start, end)))

    def mark_done(self):
        return self._event(self.compute_stream, timing=False, pooled=False)  # a handle only: never timed

    def wait_done_before_copy(self, handle) -> None:
        if handle is not None:
            self.copy_stream.wait_event(handle)

    def host_wait(self, handle) -> None:
        if handle is not None:
            handle.synchronize()

    @contextlib.contextmanager
    def gpu_block(self, unit: str, phase: str, n_tokens: int):
        with torch.cuda.stream(self.compute_stream):
            start = self._event(self.compute_stream)
            yield
            end = self._event(self.compute_stream)
        self._pending.append(Timing("gpu_block", phase, unit, 0, start, end, n_tokens, (start, end)))

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)
        self._resolve(len(self._pending))

    def collect(self) -> None:
        """The timings whose events have completed, oldest first, up to the first still pending: their events
        are released (no host wait)."""
        done = 0
        while done < len(self._pending) and self._pending[done].end.query():
            done += 1
        self._resolve(done)

    def _resolve(self, n: int) -> None:
        """The first n pending timings (their events completed) as spans on the timeline; their pooled events go
        back to the pool."""
        if n == 0:
            return
        origin_ev, origin_s = self._origin
        for t in self._pending[:n]:
            s = origin_s + origin_ev.elapsed_time(t.start) / 1e3
            e = origin_s + origin_ev.elapsed_time(t.end) / 1e3
            self.timeline.add(Span(t.kind, t.phase, t.unit, s, e, n_bytes=t.n_bytes, n_tokens=t.n_tokens))
            self._events.give_back(t.pooled)
        del self._pending[:n]

    def measure_h2d_bps(self, n_bytes: int = 1 << 30, repeats: int = 5) -> tuple[float, float]:
        """(pinned, pageable) host-to-device bandwidth in bytes/s, the median of repeats copies of n_bytes."""
        dst = torch.empty(n_bytes, dtype=torch.uint8, device=self.device)
        rates = []
        for pinned in (True, False):
            src = torch.empty(n_bytes, dtype=torch.uint8, pin_memory=pinned)
            times = []
            for _ in range(repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                dst.copy_(src, non_blocking=pinned)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            rates.append(n_bytes / sorted(times)[len(times) // 2])
            del src
        del dst
        return rates[0], rates[1]

    def reset_peak(self) -> None:
        super().reset_peak()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.device_memory.reset()

    def device_memory_bytes(self) -> int:
        return int(torch.cuda.get_device_properties(self.device).total_memory)

    def peak_device_bytes(self) -> int:
        """The device's peak in use as it saw it (sampled, not the allocator's figure), which budgets are held to."""
        self.device_memory.sample()
        return device_peak_bytes(self.device_memory.peak_used_bytes, int(torch.cuda.max_memory_reserved(self.device)),
                                 self._outside_allocator_bytes)

    def memory_peaks(self) -> dict[str, int]:
        """The device's peak beside its allocator's allocated and reserved peaks (the report shows the three)."""
        return {"gpu": self.peak_device_bytes(), "gpu_allocated": int(torch.cuda.max_memory_allocated(self.device)),
                "gpu_reserved": int(torch.cuda.max_memory_reserved(self.device))}


# calibration: the GPU half of `offload calibrate` ------------------------------------------------------
def _timed(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def measure_cuda(log=print, copy_bytes: int = 512 * 2**20, repeats: int = 5) -> dict | None:
    """H2D bandwidth (pinned, pageable), bf16 matmul rate, memory bandwidth and free VRAM; None without CUDA."""
    if not torch.cuda.is_available():
        log("no CUDA GPU: GPU figures left at 0")
        return None
    dev = torch.device("cuda")
    reserve = context_reserve_bytes(dev)  # first: offload has allocated nothing yet
    pageable = torch.ones(copy_bytes // 4)
    pinned = pageable.pin_memory()
    target = torch.empty(copy_bytes // 4, device=dev)
    out = {"gpu_name": torch.cuda.get_device_name(dev), "gpu_reserved_bytes": reserve}
    out["h2d_pinned_bps"] = copy_bytes / _timed(lambda: target.copy_(pinned, non_blocking=True), repeats)
    out["h2d_pageable_bps"] = copy_bytes / _timed(lambda: target.copy_(pageable), repeats)
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    out["gpu_mem_bps"] = 2 * copy_bytes / _timed(lambda: dst.copy_(src), repeats)  # read + write
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    out["gpu_flops"] = 2 * n**3 / _timed(lambda: a @ b, repeats)
    out["host_read_bps"] = combined_read_bps(pinned, target)
    del pinned, target, src, dst, a, b
    out["gpu_launch_s"] = measure_launch_s()
    out["handover_s"], out["handover_busy_s"] = measure_handover_s()
    from offload.runtime.host_cost import measure_host_s

    host = measure_host_s(CUDABackend, log)
    out["gpu_layer_host_s"], out["gpu_experts_host_s"] = host["layer"], host["experts"]
    torch.cuda.empty_cache()
    out["vram_bytes"] = torch.cuda.mem_get_info(dev)[0]
    log(f"gpu {out['gpu_name']}: H2D pinned {out['h2d_pinned_bps'] / 1e9:.1f} GB/s, "
        f"pageable {out['h2d_pageable_bps'] / 1e9:.1f} GB/s, memory {out['gpu_mem_bps'] / 1e9:.0f} GB/s, "
        f"bf16 matmul {out['gpu_flops'] / 1e12:.0f} TFLOP/s, free {out['vram_bytes'] / 2**30:.1f} GiB, host RAM "
        f"to the CPU and the copies together {out['host_read_bps'] / 1e9:.1f} GB/s; a launch "
        f"{out['gpu_launch_s'] * 1e6:.1f} us, a hand-over round trip {out['handover_s'] * 1e6:.0f} us idle, "
        f"{out['handover_busy_s'] * 1e6:.0f} us under a weight copy")
    return out


def context_reserve_bytes(dev: torch.device, load=None) -> int:
    """Device bytes the process holds outside offload's buffers once what a step runs has loaded (load: by default
    load_step_libraries): the CUDA context, the modules of cuBLAS, attention and Triton kernels, and a cuBLAS
    workspace for each of the backend's two streams."""
    (load or load_step_libraries)(dev)
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()  # what the loading allocated and freed is not the context's
    free, total = torch.cuda.mem_get_info(dev)
    return max(total - free - torch.cuda.memory_reserved(dev) + 2 * CUBLAS_WORKSPACE_BYTES, 0)


def load_step_libraries(dev: torch.device) -> None:
    """Run once what a step loads lazily (CUDA loads each kernel's module at its first launch): a bf16 matmul
    (cuBLAS), attention with a mask and causal, grouped-query (the kernels SDPA picks for each), and a fused
    Triton kernel (Triton's runtime and a module)."""
    x = torch.ones(16, 256, device=dev, dtype=torch.bfloat16)
    _ = x @ x.T
    q = torch.ones(1, 8, 16, 64, device=dev, dtype=torch.bfloat16)
    kv = torch.ones(1, 2, 16, 64, device=dev, dtype=torch.bfloat16)
    mask = torch.ones(16, 16, device=dev, dtype=torch.bool).tril()
    torch.nn.functional.scaled_dot_product_attention(q, kv, kv, attn_mask=mask, enable_gqa=True)
    torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    _random_device_weight("q4_0", (64, 256)).apply(x, None)  # Triton's kernel, or the torch fallback without it


def measure_launch_s(n_launches: int = 200, repeats: int = 5) -> float:
    """Seconds per kernel launch: a sequence of n_launches tiny kernels (an in-place add on one element)."""
    x = torch.zeros(1, device="cuda")
    return _timed(lambda: [x.add_(1) for _ in range(n_launches)], repeats) / n_launches


def measure_handover_s(n_bytes: int = 16 << 10, copy_bytes: int = 256 << 20, repeats: int = 20) -> tuple[float, float]:
    """(idle, under copy) median seconds of a hand-over's round trip: n_bytes device -> pinned host -> device, each
    way waited for; idle, then while a copy_bytes host-to-device copy runs on another stream (a streamed weight)."""
    small = torch.ones(n_bytes // 2, dtype=torch.bfloat16, device="cuda")
    host = torch.empty(small.shape, dtype=small.dtype).pin_memory()
    big = torch.ones(copy_bytes, dtype=torch.uint8).pin_memory()
    target, side = torch.empty(copy_bytes, dtype=torch.uint8, device="cuda"), torch.cuda.Stream()
    stream = torch.cuda.current_stream()

    def round_trip(under_copy: bool) -> float:
        torch.cuda.synchronize()
        if under_copy:
            with torch.cuda.stream(side):
                target.copy_(big, non_blocking=True)
        start = time.perf_counter()
        host.copy_(small, non_blocking=True)
        stream.synchronize()
        small.copy_(host, non_blocking=True)
        stream.synchronize()
        return time.perf_counter() - start

    round_trip(True)
    idle = statistics.median(round_trip(False) for _ in range(repeats))
    busy = statistics.median(round_trip(True) for _ in range(repeats))
    torch.cuda.synchronize()
    return idle, busy


def matmul_timer(shape: tuple[int, int], repeats: int = 5, calls: int = 10):
    """time_s(fmt, kernel, rows): best seconds of one x [rows, K] bf16 @ W.T on the GPU for W [N, K] random in
    fmt, by kernel (rate_curves.GPU_KERNELS: fused Triton, dequantize + cuBLAS, cuBLAS on a float W), each timed over
    `calls` calls; None where the kernel does not run here (no Triton, or no fused kernel for fmt). One format's
    weight is held at a time."""
    from offload.formats import GGUF_TYPE
    from offload.runtime.device_quant import _fused_kernels

    held: dict = {}

    def time_s(fmt: str, kernel: str, rows: int) -> float | None:
        if fmt not in held:
            held.clear()
            torch.cuda.empty_cache()
            held[fmt] = _random_device_weight(fmt, shape)
        w, fused = held[fmt], _fused_kernels()
        x = torch.randn(rows, shape[1], device="cuda", dtype=torch.bfloat16)
        if kernel == "cublas":
            fn = lambda: x @ w.T  # noqa: E731
        elif kernel == "dequant":
            fn = lambda: w.apply_torch(x, None)  # noqa: E731
        elif fused is None or (w.d is None and GGUF_TYPE[fmt].triton is None):  # no fused kernel takes fmt
            return None
        elif w.d is None:
            fn = lambda: fused.gguf.linear(x, w.qs, fmt, w.shape)  # noqa: E731
        else:
            fn = lambda: fused.quant.linear(x, w.qs, w.d, fmt, w.shape, w.tiled)  # noqa: E731
        return _timed(lambda: [fn() for _ in range(calls)], repeats) / calls

    return time_s


def _random_device_weight(fmt: str, shape: tuple[int, int]):
    """A random weight [N, K] in fmt on the GPU: a bf16 tensor for a float format, else a DeviceQuantWeight (row
    block order; small positive scales)."""
    from offload.formats import FLOAT_FORMATS, GGUF_BLOCKS, QK
    from offload.kernels.quant import random_gguf_blocks
    from offload.runtime.device_quant import DeviceQuantWeight

    n, k = shape
    if fmt in FLOAT_FORMATS:
        return torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    if fmt in GGUF_BLOCKS:
        return DeviceQuantWeight(fmt, shape, torch.from_numpy(random_gguf_blocks(fmt, n, k)).cuda(), None)
    d = (torch.rand(n, k // QK, device="cuda") * 0.01).half()
    if fmt == "q8_0":
        return DeviceQuantWeight(fmt, shape, torch.randint(-128, 128, (n, k), dtype=torch.int8, device="cuda"), d)
    return DeviceQuantWeight(fmt, shape, torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda"), d)


def combined_read_bps(pinned: torch.Tensor, target: torch.Tensor, seconds: float = 1.0) -> float:
    """Bytes/s host RAM serves the cores (a multi-threaded sum over a buffer past the caches, on a thread) and
    pinned copies to the GPU running at the same time: the planner's combined host read rate."""
    host = torch.ones(pinned.numel(), dtype=pinned.dtype)
    stop, read = threading.Event(), [0]

    def cores():
        while not stop.is_set():
            host.sum()
            read[0] += host.nbytes

    torch.cuda.synchronize()
    reader = threading.Thread(target=cores, name="offload-calibrate-read")
    start, copied = time.perf_counter(), 0
    reader.start()
    while time.perf_counter() - start < seconds:
        target.copy_(pinned, non_blocking=True)
        torch.cuda.synchronize()
        copied += pinned.nbytes
    stop.set()
    reader.join()
    return (read[0] + copied) / (time.perf_counter() - start)

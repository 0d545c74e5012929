"""SimBackend: a simulated GPU that behaves asynchronously like CUDA, to prove the schedule without one.

Streams are worker threads that run their queues in order; events are real; a host-to-device copy lands in
its slot only after bytes / bandwidth (scaled by time_scale in real time, so a compute that does not wait
for it reads stale bytes); device memory is a counted allocator with a hard capacity. Every span is stamped
with simulated time: each stream, the CPU, the disk and the host keep a clock, and an operation starts when
its resource is free and what it waits for is done.

Three modes. compute: the device's blocks really compute (on the CPU, on the compute stream's thread), so a
missing wait shows up as a wrong answer. timed: nothing is computed and no weight exists (buffers are
`meta` tensors); blocks take the seconds the planner's cost model gives for the hardware profile, so a
70B-shaped model runs through the executor's real schedule in seconds. wall: the CPU blocks really compute on
this machine's cores from real host weights, while the device's blocks and copies take the cost model's seconds
in real time (their streams sleep, and pass the hidden state through): whether real CPU work overlaps the
simulated link shows in wall time.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time

import torch

from offload.errors import DeviceMemoryError
from offload.hardware import HardwareProfile, format_bytes
from offload.planner.costs import Phase, cost_kin, unit_cost
from offload.profile.timeline import Span, Timeline
from offload.runtime.backends import sim_device
from offload.runtime.backends.base import Backend, Work, host_empty
from offload.runtime.backends.sim_device import DeviceState, DeviceTensor, host_view
from offload.spec import ModelSpec


class SimEvent:
    """A marker on a stream: done once the stream reaches it, at simulated time t."""

    def __init__(self, failed: threading.Event | None = None):
        self._done, self._failed = threading.Event(), failed  # failed: set when a stream's op raised
        self.t = 0.0
        self.seq = -1  # the compute stream's op count when it reached the marker (mark_done)

    def set(self, t: float, seq: int = -1) -> None:
        self.t, self.seq = t, seq
        self._done.set()

    def wait(self) -> float:
        """The marker's time, once reached; raises StreamFailed if a stream's op raised (the marker never comes)."""
        while not self._done.wait(0.05):
            if self._failed is not None and self._failed.is_set():
                raise StreamFailed("an operation on the simulated device raised; the host sees its error next")
        return self.t


class StreamFailed(RuntimeError):
    """What a wait on the simulated device raises once one of its streams' operations has raised."""


class Pending:
    """A block's result on the simulated device: there once the compute stream has run it."""

    def __init__(self, failed: threading.Event | None = None):
        self.event, self.value = SimEvent(failed), None
        self.unit, self.phase = "", None  # the block that computes it

    def resolve(self) -> torch.Tensor:
        self.event.wait()
        return self.value


_STREAMS: list[_Stream] = []  # every live stream, stopped before the interpreter exits


@atexit.register
def _stop_streams() -> None:
    """A daemon thread left inside a torch op while the interpreter tears down aborts the process (C++'s
    terminate): each stream drops what is queued, and the exit waits for the op in hand."""
    for stream in list(_STREAMS):
        stream.stop()


class _Stream:
    """A worker thread running its queue in order, with its own simulated clock t."""

    def __init__(self, name: str, backend: SimBackend):
        self.name, self.backend, self.t = name, backend, 0.0
        self._queue: queue.Queue = queue.Queue()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name=f"offload-sim-{name}", daemon=True)
        self._thread.start()
        _STREAMS.append(self)

    def enqueue(self, op) -> None:
        self._queue.put(op)

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping = True
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _loop(self) -> None:
        if self.name == "compute":
            self.backend.strict.mark_compute_thread()
        while True:
            op = self._queue.get()
            if op is None:
                return
            if self._stopping:
                continue
            try:
                op()
            except BaseException as e:  # noqa: BLE001 - surfaced at the host's next sync point
                if not isinstance(e, StreamFailed):
                    self.backend.errors.append(e)
                self.backend.failed.set()


class TimedCosts:
    """Seconds each block takes in a timed simulation, and the shapes it returns, from the cost model."""

    def __init__(self, spec: ModelSpec, hw: HardwareProfile, weight_format: str, compute_format: str,
                 kv_format: str = ""):
        self.spec, self.hw, self.fmt, self.compute, self.kv = spec, hw, weight_format, compute_format, kv_format
        self.units = {u.name: u for u in spec.units()}
        self._memo: dict = {}

    def seconds(self, work: Work, on_device: bool) -> float:
        return self._seconds(self._cost(work), work, on_device)

    def host_attention_parts(self, work: Work) -> tuple[float, float, float]:
        """(GPU matmul, CPU attention, hand-over) seconds of a GPU layer's decode over a host KV cache."""
        cost = self._cost(work)
        return cost.gpu_matmul_s, cost.attn_host_s, cost.kv_hop_s

    def _cost(self, work: Work):
        """The unit's cost model figures for this work's shape, priced once per shape."""
        unit = self.units[work.unit]
        key = (cost_kin(self.spec, unit), work.phase, work.n_tokens, work.n_seqs, work.n_keys)
        if key not in self._memo:
            self._memo[key] = unit_cost(self.spec, unit, self.fmt, self.hw, self._phase(work), self.compute,
                                          self.kv)
        return self._memo[key]

    @staticmethod
    def _seconds(cost, work: Work, on_device: bool) -> float:
        """A GPU layer with its KV cache in host RAM: in decode its matmuls, the CPU's attention and the hand-overs
        of q, k, v and the output one after another; in prefill the new K/V's copy down follows its block."""
        if not on_device:
            return cost.cpu_s
        if work.kv_on_host and work.phase == "decode":
            return cost.gpu_matmul_s + cost.attn_host_s + cost.kv_hop_s
        return cost.gpu_s + (cost.kv_move_s if work.kv_on_host else 0.0)

    @staticmethod
    def _phase(work: Work) -> Phase:
        per_seq = max(work.n_tokens // max(work.n_seqs, 1), 1)
        if work.phase == "decode":
            return Phase("decode", work.n_seqs, work.n_tokens, work.n_keys, work.n_keys)
        return Phase("prefill", work.n_seqs, work.n_tokens, max(work.n_keys - per_seq // 2, 1), 0)

    def output(self, work: Work, x: torch.Tensor, real: bool = False) -> torch.Tensor:
        """What the block returns: hidden states (meta; real: zeros, or x passed through) for embed/layer/norm,
        zero logits for the lm_head."""
        device = "cpu" if real else "meta"
        if work.kind == "embed":
            return torch.zeros(*x.shape, self.spec.hidden_size, device=device)
        if work.kind == "lm_head":
            return torch.zeros(*x.shape[:-1], self.spec.vocab_size)
        d, index = self.spec.hidden_size, self.units[work.unit].index
        if work.kind == "layer" and self.spec.hands_over(index):  # [.., 2D] to its experts or MLP, back to [.., D]
            return torch.zeros(*x.shape[:-1], 2 * d, device=device, dtype=x.dtype)
        if work.kind in ("experts", "mlp"):
            return torch.zeros(*x.shape[:-1], d, device=device, dtype=x.dtype)
        return x



class SimBackend(Backend):
    """An asynchronous simulated GPU (compute stream + copy stream) of capacity_bytes, with hw's bandwidths."""

    name = "sim"

    def __init__(self, hardware: HardwareProfile, capacity_bytes: int | None = None, timed: TimedCosts | None = None,
                 time_scale: float = 0.0, kernel_delay_s: float = 0.0, timeline: Timeline | None = None,
                 wall: bool = False):
        """timed: run in timed mode with these costs (else compute mode); wall (with timed): CPU blocks compute for
        real, device blocks and copies take the costs' seconds in real time. time_scale: real seconds slept per
        simulated second of a copy or disk read (compute mode; 0: none). kernel_delay_s: real seconds each
        device block sleeps before it runs (compute mode), so a compute stream lags behind the host."""
        super().__init__(timeline)
        if wall and timed is None:
            raise ValueError("the wall mode takes the device's seconds from timed costs")
        self.hw, self.timed, self.wall = hardware, timed, wall
        self.computes = timed is None or wall  # the CPU blocks compute (and the device's too, in compute mode)
        self.capacity_bytes = hardware.vram_bytes if capacity_bytes is None else capacity_bytes
        self.time_scale, self.kernel_delay_s = (1.0 if wall else time_scale), kernel_delay_s
        self.device = sim_device.sim_device() if timed is None else torch.device("meta")
        self.strict = DeviceState(on_sync=self._record_sync)  # what the device refuses and counts (compute mode)
        sim_device.activate(self.strict)
        self.errors: list[BaseException] = []
        self.failed = threading.Event()  # a stream's op raised: waits on the device give up
        self._lock = threading.Lock()
        self.host_t = self.cpu_t = self.disk_t = 0.0
        self.compute_stream, self.copy_stream = _Stream("compute", self), _Stream("copy", self)
        self.track("gpu", hardware.gpu_reserved_bytes)  # the CUDA context and cuBLAS workspaces a real GPU holds

    def _record_sync(self, unit: str, phase: str, what: str) -> None:
        """A host sync on the timeline: an instant at the host's clock, named by its unit and op."""
        self.timeline.add(Span("host_sync", phase, f"{unit} ({what})", self.host_t, self.host_t))

    # clocks ---------------------------------------------------------------------------------------------
    def now(self) -> float:
        return self.host_t

    def _advance_host(self, t: float) -> None:
        with self._lock:
            self.host_t = max(self.host_t, t)

    def _raise_errors(self) -> None:
        if self.errors:
            raise self.errors[0]

    def _host_waits(self, wait):
        """wait() on the host; a stream's failure surfaces as the error it raised."""
        try:
            return wait()
        except StreamFailed:
            self._raise_errors()
            raise

    def host_wait_until(self, t: float) -> None:
        self._advance_host(t)

    # memory ---------------------------------------------------------------------------------------------
    def check_capacity(self, tier: str, n_bytes: int) -> None:
        if tier == "gpu" and self.memory.now_bytes["gpu"] + n_bytes > self.capacity_bytes:
            raise DeviceMemoryError(
                f"the simulated device has {format_bytes(self.capacity_bytes - self.memory.now_bytes['gpu'])} free "
                f"but {format_bytes(n_bytes)} more was asked for; the plan exceeds the device: plan with a smaller "
                f"--gpu-memory")

    def alloc(self, tier: str, n_bytes: int, pinned: bool = False) -> torch.Tensor:
        self.check_capacity(tier, n_bytes)
        real = tier != "gpu" if self.wall else self.computes
        buf = host_empty(n_bytes) if real else torch.empty(n_bytes, dtype=torch.uint8, device="meta")
        if real and tier == "gpu":
            buf = DeviceTensor(buf)
        elif real and pinned:
            buf = self.pin(buf)
        self.memory.add(tier, n_bytes)
        return buf

    def pin(self, buf: torch.Tensor) -> torch.Tensor:
        """Page-lock a host buffer (the device remembers it: copies from it may be asynchronous)."""
        self.strict.pin(buf)
        return buf

    def _pinned_copy(self, t: torch.Tensor) -> torch.Tensor:
        """t in a fresh page-locked host buffer (CUDA's t.pin_memory())."""
        pinned = t.clone()
        self.strict.pin(pinned)
        return pinned

    def meta_or(self, device) -> torch.device:
        return torch.device(device) if self.computes else torch.device("meta")

    # copies and ordering --------------------------------------------------------------------------------
    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, unit: str, phase: str, not_before: float = 0.0):
        """The copy runs on the copy stream; its bytes land in dst only when it ends."""
        done, issued, n = SimEvent(self.failed), max(self.host_t, not_before), src.numel()
        done.unit = unit
        stream, strict = self.copy_stream, self.strict
        if self.computes and not self.wall:
            strict.set_unit(unit, phase)
            if isinstance(dst, DeviceTensor) and strict.slot_of(dst) is None:
                strict.add_slot(dst, unit)
            if not strict.is_pinned(src):  # CUDA runs a copy from pageable memory synchronously
                strict.count_pageable()
            strict.copy_issued(dst, done)

        def op():
            if self.computes and not self.wall:
                strict.copy_starts(dst, done)
            start = max(stream.t, issued)
            seconds = n / self.hw.h2d_pinned_bps
            if self.time_scale:
                time.sleep(seconds * self.time_scale)
            if self.computes and not self.wall:
                host_view(dst)[:n].copy_(src)
            stream.t = start + seconds
            self.timeline.add(Span("h2d_copy", phase, unit, start, stream.t, n_bytes=n))
            done.set(stream.t)

        stream.enqueue(op)
        return done

    def _wait_on(self, stream: _Stream, handle, unit: str = "", phase: str = "") -> None:
        if handle is None:
            return

        def op():
            ready = handle.wait()
            if stream is self.compute_stream:
                self.strict.copy_waited(handle)
            else:  # the copy stream may refill what the compute stream read before the marker
                self.strict.copy_stream_waited(handle, handle.seq)
            if unit and ready > stream.t:  # the compute stream stalled for weights
                self.timeline.add(Span("wait", phase, unit, stream.t, ready))
            stream.t = max(stream.t, ready)

        stream.enqueue(op)

    def wait_copy(self, handle, unit: str = "", phase: str = "") -> None:
        self._wait_on(self.compute_stream, handle, unit, phase)

    def wait_done_before_copy(self, handle) -> None:
        self._wait_on(self.copy_stream, handle)

    def mark_done(self):
        done, stream = SimEvent(self.failed), self.compute_stream
        stream.enqueue(lambda: done.set(stream.t, self.strict.compute_seq))
        return done

    def host_wait(self, handle) -> None:
        if handle is not None:
            self._advance_host(self._host_waits(handle.wait))
            self.strict.copy_waited(handle)
            self.strict.copy_stream_waited(handle, handle.seq)  # later copies are issued after it
        self._raise_errors()

    def synchronize(self) -> None:
        for stream in (self.compute_stream, self.copy_stream):
            done = SimEvent(self.failed)
            stream.enqueue(lambda s=stream, d=done: d.set(s.t))
            self._advance_host(self._host_waits(done.wait))
        self.strict.all_waited()
        self._raise_errors()

    # compute --------------------------------------------------------------------------------------------
    def launch(self, work: Work, fn, x, *args):
        """Enqueue a device block fn(x, *args); x, if Pending, is resolved on the compute stream."""
        self._raise_errors()
        result, issued, stream = Pending(self.failed), self.host_t, self.compute_stream
        result.unit, result.phase = work.unit, work.phase
        expected = self.strict.expected() if self.computes and not self.wall else None

        def op():
            start = max(stream.t, issued)
            value = x.resolve() if isinstance(x, Pending) else x
            self.strict.set_unit(work.unit, work.phase)
            self.strict.expect(expected)
            if self.wall:  # the device's time, slept; the hidden state passes through
                seconds = self.timed.seconds(work, True)
                time.sleep(seconds)
                value = self.timed.output(work, value, real=True)
            elif self.computes:
                if self.kernel_delay_s:
                    time.sleep(self.kernel_delay_s)
                began = time.perf_counter()
                value = fn(value, *args)
                seconds = time.perf_counter() - began
            else:
                value, seconds = self.timed.output(work, value), self.timed.seconds(work, True)
            stream.t = start + seconds
            if self.timed is not None and work.kv_on_host and work.phase == "decode":
                self._host_attention_spans(work, start)
            else:
                self.timeline.add(Span("gpu_block", work.phase, work.unit, start, stream.t, n_tokens=work.n_tokens))
            result.value = value
            result.event.set(stream.t)

        stream.enqueue(op)
        return result

    def _host_attention_spans(self, work: Work, start: float) -> None:
        """A GPU layer's decode whose attention the CPU runs over a host KV cache: the GPU's matmuls, then (after q,
        k, v cross to the host) the CPU's attention, as spans of each device."""
        gpu_s, cpu_s, hop_s = self.timed.host_attention_parts(work)
        self.timeline.add(Span("gpu_block", work.phase, work.unit, start, start + gpu_s, n_tokens=work.n_tokens))
        begin = start + gpu_s + hop_s / 2
        self.timeline.add(Span("cpu_block", work.phase, work.unit, begin, begin + cpu_s, n_tokens=work.n_tokens))

    def to_device(self, x):
        """Hidden states from the host cross PCIe on the compute stream (a hand-over, not a weight copy)."""
        if isinstance(x, Pending):
            return x
        moved, issued, stream = Pending(self.failed), self.host_t, self.compute_stream
        seconds = self._hop_s(x)

        def op():
            if self.wall:
                time.sleep(seconds)
            stream.t = max(stream.t, issued) + seconds
            moved.value = self._on_device(x)
            moved.event.set(stream.t)

        stream.enqueue(op)
        return moved

    def _on_device(self, x):
        """Host hidden states as the device receives them from a page-locked copy (compute mode)."""
        if not self.computes or self.wall or not isinstance(x, torch.Tensor) or isinstance(x, DeviceTensor):
            return x
        return DeviceTensor(x.clone())

    def upload(self, t: torch.Tensor) -> torch.Tensor:
        """As CUDA's: from a page-locked copy, without waiting for the device."""
        if not self.computes or self.wall:
            return t
        return self._pinned_copy(t).to(self.device, non_blocking=True)

    def to_host(self, x) -> torch.Tensor:
        """A device result on the host: the host waits for the device (a sync, counted)."""
        if not isinstance(x, Pending):
            return x
        value = self._host_waits(x.resolve)
        self._raise_errors()
        self._advance_host(x.event.t + self._hop_s(value))
        if isinstance(value, DeviceTensor):
            self.strict.set_unit(f"{getattr(x, 'unit', '')} output", getattr(x, "phase", None))
            return value.to("cpu")
        return value

    def _hop_s(self, x) -> float:
        n_bytes = x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0
        return n_bytes / self.hw.h2d_pinned_bps if self.hw.h2d_pinned_bps else 0.0

    def run_cpu(self, works: list[Work], fn, x, *args):
        """CPU blocks start when the CPU and the host are free; timed mode takes the cost model's seconds."""
        with self._lock:
            start = max(self.cpu_t, self.host_t)
        self.strict.set_unit(works[0].unit, works[0].phase)
        if self.computes:
            ends: list[float] = []
            began = time.perf_counter()
            value = fn(x, *args, ends)
            seconds = [end - prev for prev, end in zip([began] + ends, ends)]
        else:
            value = self.timed.output(works[-1], x)
            seconds = [self.timed.seconds(w, False) for w in works]
        t = start
        for work, s in zip(works, seconds):
            self.timeline.add(Span("cpu_block", work.phase, work.unit, t, t + s, n_tokens=work.n_tokens))
            t += s
        with self._lock:
            self.cpu_t = t
            self.host_t = max(self.host_t, t)
        return value

    def read_disk(self, store, unit: str, buffer: torch.Tensor, phase: str, not_before: float = 0.0) -> float:
        """A read takes bytes / disk bandwidth of simulated time, after the disk and the buffer are free."""
        n = store.sizes[unit]
        seconds = n / self.hw.disk_read_bps if self.hw.disk_read_bps else 0.0
        if self.time_scale:
            time.sleep(seconds * self.time_scale)
        if self.computes:
            store.read_into(unit, buffer)
        with self._lock:
            start = max(self.disk_t, not_before)
            self.disk_t = start + seconds
            end = self.disk_t
        self.timeline.add(Span("disk_read", phase, unit, start, end, n_bytes=n))
        return end

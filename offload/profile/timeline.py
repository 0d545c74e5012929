"""Timeline: every disk read, host-to-device copy, GPU block and CPU block, with start and end times."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

# Resources a span occupies; the report computes each one's busy share per phase.
RESOURCES = ("cpu", "gpu", "pcie", "disk")
KINDS = {"cpu_block": "cpu", "gpu_block": "gpu", "h2d_copy": "pcie", "disk_read": "disk", "wait": None,
         "host_sync": None}  # host_sync: the host waited for the device (an instant; unit names the op and where)


@dataclass(frozen=True)
class Span:
    """One timed piece of work: kind (cpu_block, gpu_block, h2d_copy, disk_read, wait, host_sync), in seconds."""

    kind: str
    phase: str  # prefill | decode
    unit: str  # e.g. "layer.3", "lm_head"
    start_s: float
    end_s: float
    n_bytes: int = 0
    n_tokens: int = 0

    @property
    def resource(self) -> str | None:
        return KINDS[self.kind]

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class StepShape:
    """What one step computed, enough for the cost model to price it again: the report re-costs the plan for
    the steps actually run."""

    phase: str  # prefill: the step carried prompt tokens (decode tokens may ride along); decode: it did not
    seconds: float
    n_prompt_tokens: int
    n_decode_tokens: int
    n_seqs: int  # sequences with a token in the step
    n_logits: int  # rows of logits computed (sequences sampled)
    attended_keys: int  # keys seen, summed over the step's tokens
    kv_read_tokens: int  # cached positions read, summed over the step's sequences
    threads: int = 0  # CPU threads the step ran on (0: not known)
    start_s: float = 0.0  # when the step began, on the generator's clock

    @property
    def mid_s(self) -> float:
        return self.start_s + self.seconds / 2

    @property
    def n_tokens(self) -> int:
        return self.n_prompt_tokens + self.n_decode_tokens


def device_read_bytes() -> int:
    """Bytes this process (all its threads) has had read from a storage device, page faults included: what the
    page cache did not serve (/proc/self/io read_bytes; 0 where it is not available)."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def disk_reads(timeline) -> dict:
    """Bytes the disk tier asked for since the timeline began, and how many of them the device had to read."""
    requested = sum(s.n_bytes for s in timeline.spans if s.kind == "disk_read")
    device = max(0, device_read_bytes() - timeline.device_read_at_start)
    return {"requested_bytes": requested, "device_bytes": device,
            "page_cache_share": max(0.0, 1 - device / requested) if requested else None}


@dataclass
class Timeline:
    """A thread-safe list of spans plus the wall-clock extent of each phase."""

    _spans: list[Span] = field(default_factory=list)  # read through spans
    phase_time_s: dict[str, float] = field(default_factory=lambda: {"prefill": 0.0, "decode": 0.0})
    phase_tokens: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    step_s: dict[str, list[float]] = field(default_factory=lambda: {"prefill": [], "decode": []})  # each pass
    steps: list[StepShape] = field(default_factory=list)  # each step's shape, where the generator gave it
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    device_read_at_start: int = field(default_factory=lambda: device_read_bytes())  # /proc/self/io read_bytes
    # runs of blocks add_blocks took, made Spans when the spans are read: a decode step times a span per unit
    _runs: list[tuple] = field(default_factory=list, repr=False)

    @property
    def spans(self) -> list[Span]:
        """Every span so far, in the order they were added."""
        with self._lock:
            self._settle()
            return self._spans

    @staticmethod
    def now() -> float:
        return time.perf_counter()

    def add(self, span: Span) -> None:
        if span.kind not in KINDS:
            raise ValueError(f"unknown span kind {span.kind!r}; use one of {', '.join(KINDS)}")
        with self._lock:
            self._settle()
            self._spans.append(span)

    def add_blocks(self, kind: str, works: list, bounds: list[float]) -> None:
        """Spans of kind for consecutive blocks: works[i] (with the unit, phase and n_tokens of a backend's Work)
        from bounds[i] to bounds[i + 1]. They are kept as one run and made Spans when the spans are read: a decode
        step of a 48-unit model made 48 Spans, about 2% of its time."""
        if kind not in KINDS:
            raise ValueError(f"unknown span kind {kind!r}; use one of {', '.join(KINDS)}")
        with self._lock:
            self._runs.append((kind, works, bounds))

    def _settle(self) -> None:
        """The runs add_blocks took, as Spans after the ones before them (under the lock)."""
        if self._runs:
            self._spans += [Span(kind, w.phase, w.unit, begin, end, n_tokens=w.n_tokens)
                            for kind, works, bounds in self._runs for w, begin, end in zip(works, bounds, bounds[1:])]
            self._runs.clear()

    def add_phase(self, phase: str, elapsed_s: float, n_tokens: int, shape: StepShape | None = None) -> None:
        """Count one forward pass of a phase: its wall time and the tokens it processed (and its shape)."""
        with self._lock:
            self.phase_time_s[phase] += elapsed_s
            self.phase_tokens[phase] += n_tokens
            self.step_s[phase].append(elapsed_s)
            if shape is not None:
                self.steps.append(shape)

    def intervals(self, resource: str, phase: str) -> list[tuple[float, float]]:
        """The resource's busy intervals in the phase, overlapping spans merged, in time order."""
        merged: list[tuple[float, float]] = []
        for start, end in sorted((s.start_s, s.end_s) for s in self.spans
                                 if s.phase == phase and s.resource == resource):
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], end))
            else:
                merged.append((start, end))
        return merged

    def busy_s(self, resource: str, phase: str) -> float:
        """Seconds the resource was busy in the phase (overlapping spans on one resource merged)."""
        return sum(end - start for start, end in self.intervals(resource, phase))

    def overlap_s(self, a: str, b: str, phase: str) -> float:
        """Seconds in the phase when resources a and b were both busy (e.g. copies hidden under GPU compute)."""
        total, other = 0.0, self.intervals(b, phase)
        for start, end in self.intervals(a, phase):
            for o_start, o_end in other:
                total += max(0.0, min(end, o_end) - max(start, o_start))
        return total

    def bytes_moved(self, kind: str, phase: str) -> int:
        return sum(s.n_bytes for s in self.spans if s.kind == kind and s.phase == phase)

    def clear(self) -> None:
        self.drain()

    def drain(self) -> Timeline:
        """What this timeline holds, as a Timeline of its own, and this one cleared at once: a server's metrics
        read it so, step by step, and it does not grow for the server's life."""
        with self._lock:
            self._settle()
            taken = Timeline(_spans=list(self._spans), phase_time_s=self.phase_time_s, phase_tokens=self.phase_tokens,
                             step_s=self.step_s, steps=self.steps, device_read_at_start=self.device_read_at_start)
            self._spans.clear()
            self.phase_time_s = {"prefill": 0.0, "decode": 0.0}
            self.phase_tokens = {"prefill": 0, "decode": 0}
            self.step_s = {"prefill": [], "decode": []}
            self.steps = []
            self.device_read_at_start = device_read_bytes()
        return taken

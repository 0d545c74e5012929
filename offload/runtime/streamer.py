"""Streamer: drives the staging ring and the disk read-ahead through each step, by the rules of the plan's schedule
(planner/schedule.py): streamed units take the slots in turn, the copy of streamed unit j + depth is issued as unit
j is released, into the slot it leaves, and past the step's last streamed unit the next step's first host-RAM units
are copied ahead (decode steps and prefill passes repeat), so the link works while the step's CPU blocks run. Disk
units are read ahead in order; a copy waits for its read only when its unit is needed."""

from __future__ import annotations

import torch

from offload.planner.placement import Placement
from offload.planner.schedule import copied_ahead
from offload.planner.types import PHASES
from offload.runtime.backends.base import Backend
from offload.runtime.disk import ReadAhead
from offload.runtime.staging import StagingRing


class Streamer:
    """Copies of streamed units into the staging ring, and reads of disk units, for one model's placement."""

    def __init__(self, backend: Backend, placement: Placement, order: list[str], layouts: dict, host_buffers: dict,
                 ring: StagingRing | None, reader: ReadAhead | None, on_disk: list[str]):
        self.backend, self.placement, self.layouts, self.host_buffers = backend, placement, layouts, host_buffers
        self.ring, self.reader, self.on_disk = ring, reader, on_disk
        # the schedule's unit lists, fixed by the placement: made once, not at every step
        self.streamed = {phase: [n for n in order if placement[n].mode(phase) == "stream"] for phase in PHASES}
        slots = ring.n_slots if ring is not None else 0
        self.ahead = {phase: copied_ahead([placement[n].weights == "disk" for n in units], slots)
                      for phase, units in self.streamed.items()}  # the next step's units copied ahead at most
        self._queue: list[str] = []
        self._n_ahead = 0
        self._next_copy = 0  # past the end of the queue: copies for the next step of the same phase
        self._ahead: list[str] = []  # units copied ahead for the next step

    def begin_step(self, phase: str) -> None:
        """A step of phase begins: keep what was copied ahead for it (else free those slots), schedule the disk
        reads, and issue the first copies."""
        self._queue, self._n_ahead = self.streamed[phase], self.ahead[phase]
        ahead, self._ahead = self._ahead, []
        if ahead and ahead != self._queue[:len(ahead)]:
            self.ring.discard(ahead)  # copied ahead for a step that streams other units: not used
            ahead = []
        self._next_copy = len(ahead)
        if self.reader is not None:
            self.reader.schedule(self.on_disk, phase)
        self.issue_copies(phase)

    def issue_copies(self, phase: str, need: str | None = None) -> None:
        """Copy upcoming streamed units into free slots, in order; block on a disk read only for `need`."""
        while self.ring is not None and self.ring.free_slot() is not None:
            name = self._next_streamed()
            if name is None:
                return
            src = self._host_source(name, block=name == need)
            if src is None:
                return
            ready_t = self.reader.ready_t(name) if self.placement[name].weights == "disk" else 0.0
            self.ring.load(name, src[: self.layouts[name].n_bytes], phase, ready_t)
            if self._next_copy >= len(self._queue):
                self._ahead.append(name)
            self._next_copy += 1

    def _next_streamed(self) -> str | None:
        """The next unit to copy: this step's, or the next step's while it is in host RAM and not in a slot."""
        queue = self._queue
        if self._next_copy < len(queue):
            return queue[self._next_copy]
        j = self._next_copy - len(queue)
        if j >= self._n_ahead or self.ring.holds(queue[j]):
            return None
        return queue[j]

    def _host_source(self, name: str, block: bool) -> torch.Tensor | None:
        if self.placement[name].weights == "cpu":
            return self.host_buffers[name]
        return self.reader.acquire(name) if block else self.reader.try_acquire(name)

    def acquire(self, name: str, phase: str) -> torch.Tensor:
        """The staging slot holding a streamed unit's weights, once its copy is ordered before the compute (a disk
        unit's read buffer is free again once its copy has landed)."""
        if not self.ring.holds(name):
            self.issue_copies(phase, need=name)
        buf = self.ring.acquire(name, phase)
        if self.placement[name].weights == "disk":
            self.backend.host_wait(next(s.copy_handle for s in self.ring.slots if s.unit == name and s.in_use))
            self.reader.release(name)
        return buf

    def release(self, name: str, phase: str) -> None:
        """A streamed unit's compute is enqueued: its slot takes the next copy (block j+k's goes where j's was)."""
        self.ring.release(name)
        self.issue_copies(phase)

"""Streamer: drives the staging ring and the disk read-ahead through each step by replaying the plan's schedule of
copies (planner/schedule.copy_plan, the one place its rule is written) over the units the step runs (step_units: a
step that samples no row, a prefill pass that ends no prompt, runs no lm_head): at a step's start it issues the
copies the schedule issues then (and those it copied ahead in the step before, where that step streamed other
units), at each streamed unit's release the copies that release issues, this step's or the next step's, so the link
works while the step's CPU blocks run. Disk units are read ahead in order; a copy whose read has not landed waits,
in turn, and is issued at the next release, or when its unit is needed. Where the host has work of its own
between two steps (a draft's steps before a verify pass), prepare() issues the next step's first copies and reads
before that work, so they run under it.

A disk unit's read buffer is reused by the reader, so it is given back only once its copy has landed; the host
does not wait for that copy before launching the unit's compute (the device orders the two). It waits where it
costs nothing: at the next streamed unit's release (after that unit's launch: its own copy lands after this one),
before it would block on the reader anyway, before the CPU computes (it needs the device's output then), and as
the next step begins."""

from __future__ import annotations

import torch

from offload.planner.placement import Placement
from offload.planner.schedule import AHEAD, copy_plan, step_units
from offload.planner.types import PHASES
from offload.runtime.backends.base import Backend
from offload.runtime.disk import ReadAhead
from offload.runtime.staging import StagingRing
from offload.runtime.unit_store import UnitLayout, materialize


class Streamer:
    """Copies of streamed units into the staging ring, and reads of disk units, for one model's placement."""

    def __init__(self, backend: Backend, placement: Placement, order: list[str], layouts: dict, host_buffers: dict,
                 ring: StagingRing | None, reader: ReadAhead | None, on_disk: list[str]):
        self.backend, self.placement, self.layouts, self.host_buffers = backend, placement, layouts, host_buffers
        self.ring, self.reader = ring, reader
        slots = ring.n_slots if ring is not None else 0
        # each kind of step's schedule of copies, made once from the placement, by (phase, whether it samples: a
        # prefill pass that ends no prompt runs no lm_head): (unit, issued) at the step's start, the copies each
        # streamed unit's release issues as (unit, for the next step), and the disk units it reads, in order
        self.at_start: dict[tuple[str, bool], list[tuple[str, str]]] = {}
        self.on_release: dict[tuple[str, bool], dict[str, list[tuple[str, bool]]]] = {}
        self.reads: dict[bool, list[str]] = {}
        for samples in (True, False):
            units = step_units(order, samples)
            self.reads[samples] = [n for n in on_disk if n in units]
            for phase in PHASES:
                self._plan((phase, samples), [n for n in units if placement[n].mode(phase) == "stream"], slots)
        self._pending: list[tuple[str, bool]] = []  # copies the schedule has issued, waiting for a read (in turn)
        self._landing: list[tuple[str, object]] = []  # disk units launched, their read buffer kept for their copy
        # a streamed unit's weights are views of its slot, made once per slot and layout (units of one shape share
        # them); layouts are numbered once here, as hashing a MoE layer's costs more than the views
        numbers: dict[UnitLayout, int] = {}
        self._layout_no = {name: numbers.setdefault(layout, len(numbers)) for name, layout in layouts.items()}
        self._views: dict[tuple[int, int], object] = {}
        self._ahead: list[str] = []  # units copied ahead for the next step
        self._phase, self._step = "", ("", True)
        self._prepared: tuple[str, bool] | None = None  # the kind of step prepare() issued the first copies of
        self._early: list[str] = []  # the disk units prepare() queued for reading

    def _plan(self, step: tuple[str, bool], streamed: list[str], slots: int) -> None:
        """The copies of a step that streams these units, from the schedule's rule (copy_plan)."""
        copies = copy_plan(tuple(self.placement[n].weights == "disk" for n in streamed), slots, steady=True)
        self.at_start[step] = [(streamed[c.turn], c.issued) for c in copies if c.issued != "release"]
        after = self.on_release[step] = {}
        for c in copies:
            if c.by is not None:
                after.setdefault(streamed[c.by], []).append((streamed[c.turn], c.issued == AHEAD))

    def prepare(self, phase: str, samples: bool = True) -> None:
        """Issue the next step's first copies and queue its disk reads now, before it begins: the host has other
        work first (a draft's steps), which they run under. That step's begin_step keeps the copies where it is a
        step of this kind, and frees their slots otherwise; the reads queued are those every kind of step makes
        first (all but a disk lm_head's), so they are never wrong."""
        if self._prepared is not None:
            return
        self._prepared = step = (phase, samples)
        self.settle()
        if self.ring is not None:  # the step's first copies, those not copied ahead already, as copied ahead
            self._pending = [(name, True) for name, _ in self.at_start[step] if name not in self._ahead]
            self.issue_copies()
        if self.reader is not None:  # a step that samples nothing reads all but the last unit: the same first
            self._early = list(self.reads[False])
            self.reader.schedule(self._early, phase)

    def begin_step(self, phase: str, samples: bool = True) -> None:
        """A step of phase begins, sampling a row of logits or not (then it runs no lm_head): keep what was copied
        ahead for it (else free those slots), schedule the disk reads (those prepare() has not), and issue the
        step's first copies."""
        self._phase, self._step = phase, (phase, samples)
        self.settle()
        prepared, self._prepared = self._prepared, None
        ahead, self._ahead = self._ahead, []
        expected = [name for name, issued in self.at_start[self._step] if issued == AHEAD or prepared == self._step]
        if ahead and ahead != expected[:len(ahead)]:
            self.ring.discard(ahead)  # copied ahead for a step that streams other units: not used
            ahead = []
        self._pending = [(name, False) for name, _ in self.at_start[self._step]
                         if name not in ahead]  # the first step has nothing copied ahead
        if self.reader is not None:
            early, self._early = self._early, []
            self.reader.schedule(self.reads[samples][len(early):], phase)
        self.issue_copies()

    def issue_copies(self, need: str | None = None) -> None:
        """Issue the copies the schedule has issued so far, in turn, into the ring's next slot; a disk unit's copy
        waits for its read, which blocks only for `need`."""
        while self._pending and self.ring.free_slot() is not None:
            name, next_step = self._pending[0]
            src = self._host_source(name, block=name == need)
            if src is None:
                return
            ready_t = self.reader.ready_t(name) if self.placement[name].weights == "disk" else 0.0
            self.ring.load(name, src[: self.layouts[name].n_bytes], self._phase, ready_t)
            if next_step:
                self._ahead.append(name)
            self._pending.pop(0)

    def _host_source(self, name: str, block: bool) -> torch.Tensor | None:
        if self.placement[name].weights == "cpu":
            return self.host_buffers[name]
        return self.read(name) if block else self.reader.try_acquire(name)

    def read(self, name: str) -> torch.Tensor:
        """A disk unit's read buffer, waiting for its read; the buffers of launched units go back to the reader
        first, which may need their room."""
        buf = self.reader.try_acquire(name)
        if buf is None:
            self.settle()
            buf = self.reader.acquire(name)
        return buf

    def acquire(self, name: str, phase: str):
        """A streamed unit's weights, views of the staging slot holding them, once its copy is ordered before the
        compute."""
        if not self.ring.holds(name):
            self.issue_copies(need=name)
        buf = self.ring.acquire(name, phase)
        if self.placement[name].weights == "disk":
            self._landing.append((name, next(s.copy_handle for s in self.ring.slots if s.unit == name and s.in_use)))
        key = (id(buf), self._layout_no[name])
        if key not in self._views:
            self._views[key] = materialize(self.layouts[name], buf, on_device=True)
        return self._views[key]

    def release(self, name: str, phase: str) -> None:
        """A streamed unit's compute is enqueued: its slot takes the copies the schedule issues at its release, and
        the disk units launched before it give their read buffers back."""
        self.ring.release(name)
        self._pending += self.on_release[self._step].get(name, [])
        self.issue_copies()
        self.settle(but=name)

    def settle(self, but: str | None = None) -> None:
        """Give the read buffers of the launched disk units (but one) back to the reader once their copies have
        landed: the host waits for those copies here."""
        keep = [(name, copy) for name, copy in self._landing if name == but]
        for name, copy in self._landing:
            if name != but:
                self.backend.host_wait(copy)
                self.reader.release(name)
        self._landing = keep

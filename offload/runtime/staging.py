"""StagingRing: k device slots that streamed blocks' weights are copied into, in execution order.

Prefetch depth k: while block j computes from its slot, the copies of the next k-1 streamed blocks are in
flight in the other slots, and the copy of block j+k is issued into block j's slot as soon as block j's
compute has been enqueued, ordered after it by a completion event — so a slot is only overwritten once the
block using it has finished, and no more than k slots are ever in use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from offload.runtime.backends.base import Backend


@dataclass
class Slot:
    buffer: torch.Tensor
    unit: str | None = None  # whose weights it holds (or is receiving)
    copy_handle: object = None
    done_handle: object = None
    in_use: bool = False  # between the copy's issue and the release after compute


class StagingRing:
    """Slots of slot_bytes each on the device; load() issues copies, acquire()/release() bracket compute."""

    def __init__(self, backend: Backend, n_slots: int, slot_bytes: int):
        if n_slots < 1:
            raise ValueError(f"a staging ring needs at least one slot, got {n_slots}")
        self.backend = backend
        self.slots = [Slot(backend.alloc("gpu", slot_bytes)) for _ in range(n_slots)] if slot_bytes else []
        self.slot_bytes = slot_bytes
        self._next = 0
        self.max_in_use = 0

    @property
    def n_slots(self) -> int:
        return len(self.slots)

    def free_slot(self) -> int | None:
        """The next slot in ring order if it is free, else None."""
        slot = self.slots[self._next]
        return None if slot.in_use else self._next

    def load(self, unit: str, src: torch.Tensor, phase: str, not_before: float = 0.0) -> int:
        """Issue the copy of unit's host buffer src (ready at time not_before) into the next slot, which must be
        free."""
        i = self.free_slot()
        if i is None:
            raise RuntimeError(f"staging slot {self._next} is still in use by {self.slots[self._next].unit}; "
                               f"cannot copy {unit} into it")
        if src.numel() > self.slot_bytes:
            raise RuntimeError(f"{unit} needs {src.numel()} bytes but staging slots hold {self.slot_bytes}")
        slot = self.slots[i]
        self.backend.wait_done_before_copy(slot.done_handle)
        slot.unit, slot.in_use = unit, True
        slot.copy_handle = self.backend.copy_h2d(slot.buffer, src, unit, phase, not_before)
        self.backend.log.append(("copy", unit, i))
        self._next = (self._next + 1) % len(self.slots)
        self.max_in_use = max(self.max_in_use, sum(s.in_use for s in self.slots))
        return i

    def holds(self, unit: str) -> bool:
        """Whether a slot holds (or is receiving) unit's weights."""
        return any(s.unit == unit and s.in_use for s in self.slots)

    def discard(self, units: list[str]) -> None:
        """Free the slots copied ahead for units that will not run; a slot is reused once its copy has landed."""
        for i, slot in enumerate(self.slots):
            if slot.in_use and slot.unit in units:
                slot.done_handle, slot.in_use = slot.copy_handle, False
                self.backend.log.append(("discard", slot.unit, i))

    def acquire(self, unit: str, phase: str = "") -> torch.Tensor:
        """The slot buffer holding unit, once its copy is complete (on the compute stream)."""
        for i, slot in enumerate(self.slots):
            if slot.unit == unit and slot.in_use:
                self.backend.wait_copy(slot.copy_handle, unit, phase)
                self.backend.log.append(("compute", unit, i))
                return slot.buffer
        raise RuntimeError(f"{unit} was not prefetched into a staging slot")

    def release(self, unit: str) -> None:
        """Mark unit's slot reusable once the compute enqueued so far has finished."""
        for i, slot in enumerate(self.slots):
            if slot.unit == unit and slot.in_use:
                slot.done_handle, slot.in_use = self.backend.mark_done(), False
                self.backend.log.append(("release", unit, i))
                return
        raise RuntimeError(f"{unit} holds no staging slot to release")

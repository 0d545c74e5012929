"""EventPool: timing events reused once their timings were read, so that a step records into the same few events
rather than creating two per copy, wait and block (a 70B batch-1 step times ~250 of them). It knows no device:
the CUDA backend hands it the event constructor, a test a fake."""

from __future__ import annotations

from collections.abc import Callable, Iterable


class EventPool:
    """Events made by make() on demand, and given back once nothing reads them any more."""

    def __init__(self, make: Callable[[], object]):
        self._make = make
        self._free: list = []
        self.n_made = 0  # events ever made: bounded by how many are in flight at once, not by how many were timed

    def take(self):
        """A free event (one given back, else a new one), to be recorded."""
        if self._free:
            return self._free.pop()
        self.n_made += 1
        return self._make()

    def give_back(self, events: Iterable) -> None:
        """Events whose timings were read and that no stream will wait on."""
        self._free.extend(events)

    def __len__(self) -> int:
        return len(self._free)

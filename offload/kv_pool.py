"""The KV pool: one cache row's token slots, handed out as contiguous extents (a sequence's own positions; its block
table maps the prefix cache's shared blocks in front of them: offload.sequence.Sequence.table). The engine holds one
for the model, a draft model's drafter one for the draft."""

from __future__ import annotations


class KVPool:
    """Contiguous extents of one cache row of `capacity` slots, handed out first fit and merged when returned."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.free = [(0, capacity)]  # (start, length), by start

    def alloc(self, n: int) -> int | None:
        """The first slot of n free slots in a row, or None when no free extent is that long."""
        for i, (start, length) in enumerate(self.free):
            if length >= n:
                self.free[i] = (start + n, length - n)
                if self.free[i][1] == 0:
                    del self.free[i]
                return start
        return None

    def release(self, start: int, n: int) -> None:
        self.free.append((start, n))
        self.free.sort()
        merged = [self.free[0]]
        for s, n_ in self.free[1:]:
            last_s, last_n = merged[-1]
            if last_s + last_n == s:
                merged[-1] = (last_s, last_n + n_)
            else:
                merged.append((s, n_))
        self.free = merged

    @property
    def n_free(self) -> int:
        return sum(n for _, n in self.free)

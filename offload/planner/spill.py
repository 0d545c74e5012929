"""Host memory of a candidate placement and the spill of its weights to disk: what RAM holds (weights, KV caches, the
CPU workspace, pinned hand-over and read-ahead buffers, the page cache reads hold), which units move to disk when
that is over the budget, and which disk units the page cache keeps. Pure arithmetic."""

from __future__ import annotations

from itertools import compress

from offload.planner.costs import READ_PAGE_CACHE_BYTES, read_ahead_bytes
from offload.planner.types import PHASES

SPILLED_FIRST = ("layer", "experts", "mlp")  # kinds moved to disk from the last (or after the other kinds)


class HostMemory:
    """The Search's host-memory accounting (a mixin: it reads the per-unit sizes Search.__init__ holds)."""

    def _host_usage(self, cand) -> int:
        norm = self.i_norm
        any_cpu = any(modes.count("cpu") > (modes[norm] == "cpu") for modes in cand.compute.values())
        decode = cand.compute["decode"]
        kv_cpu = sum(self.kv) if cand.host_kv else sum(kv for kv, m in zip(self.kv, decode) if m == "cpu")
        weights = sum(w for w, t in zip(self.w, cand.weight) if t == "cpu")
        return (self.budget.margin_bytes("cpu") + (self.ws_cpu if any_cpu else 0) + kv_cpu + weights
                + self._pinned(cand))

    def _pinned(self, cand, weight: list[str] | None = None) -> int:
        """Host memory besides weights: the hidden-state hand-over (with a GPU), the disk read-ahead arena and the
        page cache the disk reads hold while they are dropped behind them (the piece being read and what the OS
        reads ahead of it: READ_PAGE_CACHE_BYTES, or a unit where that is less); cand's, or with weight's disk
        units (the page cache keeping those it has room for)."""
        reads = self._disk_reads(weight or cand.weight)
        return self._pinned_of(cand, reads, None if weight is None else self._kept_of(reads))

    def _pinned_of(self, cand, reads: list[int], cached: frozenset[int] | None) -> int:
        """_pinned with these disk reads (in order), cached those the page cache keeps (None: cand's)."""
        skip = self._in_place(cand, cached)
        read = list(map(self.buf.__getitem__, [i for i in reads if i not in skip] if skip else reads))
        in_flight = min(max(read, default=0), READ_PAGE_CACHE_BYTES)
        return (self.hop_buffers if cand.use_gpu else 0) + read_ahead_bytes(read, self.depth) + in_flight

    def _in_place(self, cand, cached: frozenset[int] | None = None) -> frozenset[int]:
        """Disk units the page cache keeps (cand's, or those given) and only the CPU computes: the executor maps
        them, reads none ahead."""
        return frozenset(i for i in (cand.cached if cached is None else cached)
                         if all(cand.compute[p][i] == "cpu" for p in PHASES))

    def _kept(self, weight: list[str]) -> frozenset[int]:
        """The disk units the page cache has room for beside the budget, in order; the others are dropped from it
        once read."""
        return self._kept_of(self._disk_reads(weight))

    def _kept_of(self, reads: list[int]) -> frozenset[int]:
        """_kept of these disk reads, in order."""
        room, kept = self.budget.page_cache_bytes, []
        for i in reads:
            if self.buf[i] > room:
                break
            room -= self.buf[i]
            kept.append(i)
        return frozenset(kept)

    def _disk_reads(self, weight: list[str], skip: frozenset[int] = frozenset()) -> list[int]:
        """Disk units read whole at every step, in order (an embedding on disk reads only the rows looked up)."""
        if "disk" not in weight:
            return []
        reads = list(compress(range(len(weight)), map("disk".__eq__, weight)))
        if weight[self.i_embed] == "disk":
            reads.remove(self.i_embed)
        return [i for i in reads if i not in skip] if skip else reads

    def _read_ahead(self, weight: list[str], skip: frozenset[int] = frozenset()) -> int:
        """The read-ahead arena the executor allocates."""
        return read_ahead_bytes(list(map(self.buf.__getitem__, self._disk_reads(weight, skip))), self.depth)

    def _spill(self, cand, order: list[int]) -> tuple[list[str], int]:
        """Weights after moving units to disk in order until the host budget holds (or nothing is left to move),
        and the host bytes they use."""
        weight, moved = list(cand.weight), []
        other = self._host_usage(cand) - self._pinned(cand)
        floor = self.hop_buffers if cand.use_gpu else 0  # pinned bytes are never fewer: count them once it may fit
        for i in order:
            if other + floor <= self.budget.cpu_bytes >= other + self._pinned_moved(cand, moved):
                break
            weight[i] = "disk"
            other -= self.w[i]
            moved.append(i)
        return weight, other + self._pinned_moved(cand, moved)

    def _pinned_moved(self, cand, moved: list[int]) -> int:
        """_pinned with the units moved to disk besides cand's (a spill walks every unit: its disk reads are not
        looked for again at each)."""
        reads = sorted(self._disk_reads(cand.weight) + [i for i in moved if i != self.i_embed])
        return self._pinned_of(cand, reads, self._kept_of(reads))

    def _place_host_weights(self, cand) -> None:
        """Keep offloaded weights in RAM while it lasts, then move units to disk: the embedding first (a step reads
        only the rows it looks up), then layers and experts units from the last, or the lm_head before them,
        whichever keeps more in RAM once the read-ahead arena they need is counted. The disk units the page cache
        has room for beside the budget are left to it; the others are dropped from it once read."""
        movable = [i for i in reversed(range(self.n)) if cand.weight[i] == "cpu" and i != self.i_norm]
        first = [i for i in movable if i == self.i_embed]
        layers = [i for i in movable if self.kinds[i] in SPILLED_FIRST]
        rest = [i for i in movable if i != self.i_embed and self.kinds[i] not in SPILLED_FIRST]
        orders = (first + layers + rest, first + rest + layers)
        tried = [self._spill(cand, orders[0])]
        if "disk" in tried[0][0] or tried[0][1] > self.budget.cpu_bytes:  # the order mattered
            tried.append(self._spill(cand, orders[1]))
        fits = [t for t in tried if t[1] <= self.budget.cpu_bytes]
        cand.weight, used = (min(fits, key=lambda t: sum(map(self.w.__getitem__, self._disk_reads(t[0])))) if fits
                             else min(tried, key=lambda t: t[1]))
        cand.cached = self._kept(cand.weight)
        on_disk = sum(w for w, t in zip(self.w, cand.weight) if t == "disk")
        if used > self.budget.cpu_bytes:
            cand.short = ("cpu", used, self.budget.cpu_bytes)
        elif on_disk > self.budget.disk_bytes:
            cand.short = ("disk", on_disk, self.budget.disk_bytes)

"""One phase step's timeline as the executor runs it: each unit's disk read, copy and block on the clocks of the
link, the GPU, the CPU, the disk and the host, the hidden state handed between devices, copies issued when the
schedule (planner/schedule.copy_plan) issues them into the staging slot whose turn it is. Pure arithmetic."""

from __future__ import annotations

from collections import deque
from itertools import chain, groupby, repeat

from offload.planner.schedule import AHEAD, copy_plan

STEADY_STEPS = 2  # steps priced for a steady one: the first's copies start at once, as the step before's would


class Pipeline:
    """One phase step's clocks as the executor runs it: link, GPU, CPU, disk, host, the hidden state, read buffers,
    and each streamed unit's block end and release (a staging slot is free again once its unit's block has run);
    the copies' and blocks' intervals of the step being priced. When each copy is issued, and into whose slot, is
    the schedule's (planner/schedule.copy_plan), as the executor's streamer replays it.

    Each streamed unit's copy starts once the link is free, a staging slot is (the streamed unit `depth` before
    it has computed) and its bytes are (read from disk, for a disk unit); each disk read once the disk and one
    of `depth` read-ahead buffers are; GPU and CPU blocks follow the hidden state, with its hand-over where
    it changes device, and the host waits for a CPU block's input. Copies of host-RAM units run ahead
    into the next pass or step while slots are free (the executor prefetches across steps), disk reads do not.
    A step of several passes (a long prefill) runs the chain once per pass, each with its share of the compute
    and the whole weights' copies; steady gives one step after the pipeline has filled (a decode step)."""

    def __init__(self, depth: int, on_gpu: bool, record: bool = True):
        self.on_gpu, self.depth, self.record = on_gpu, max(depth, 1), record  # record: keep the intervals (overlap)
        self.t_gpu = self.t_copy = self.t_cpu = self.t_disk = self.t_host = self.t_x = 0.0
        self.buffers = deque([0.0] * self.depth)  # when each read-ahead buffer is free again
        self.slots = deque([0.0] * self.depth)  # when each staging slot's last block ends, in the ring's turn
        self.copies: list[tuple[float, float]] = []
        self.n_passes = 1
        self.blocks: list[tuple[float, float, str]] = []  # (start, end, cpu | gpu)
        self.plan: tuple = ()
        self.released: list[float] = []  # when the host released the previous step's streamed units
        self.gap_s = 0.0  # the host's own work before each step (run's gap_s)

    def run(self, units, n_passes: int, steady: bool, gap_s: float = 0.0) -> float:
        """Seconds of one step of units in order, as runs of alike units: (mode, weight tier, seconds of a unit's
        block, of its copy and of its disk read, of the hand-over of its input where that changes device, how many
        units; a span of units on one device that wait for nothing but the block before it is one unit). gap_s:
        the host's own work before each step (a draft's steps), which holds the GPU and the CPU while the step's
        first copies and disk reads, issued before it (runtime/streamer.Streamer.prepare), run; counted in."""
        ends, self.n_passes, self.gap_s = [], n_passes, gap_s
        on_disk = tuple(tier == "disk" for mode, tier, *_ in _each(units) if mode == "stream")
        self.plan = copy_plan(on_disk, self.depth, steady=True)  # the first step copies at its start what a
        self.released = [0.0] * len(on_disk)  # steady one had copied ahead
        for _ in range(min(n_passes, 3) if not steady else STEADY_STEPS):
            self.copies, self.blocks = [], []
            self.step(units, n_passes)
            ends.append(self.t_x)
        if steady:
            return ends[-1] - ends[-2]
        return ends[0] + (n_passes - 1) * (ends[-1] - ends[-2]) if n_passes > 1 else ends[0]

    def overlap(self) -> tuple[float, float]:
        """(copy seconds under any block, under CPU blocks) of the last step (or pass, times the passes) priced."""
        n = self.n_passes
        return (n * _overlap(self.copies, [(a, b) for a, b, _ in self.blocks]),
                n * _overlap(self.copies, [(a, b) for a, b, d in self.blocks if d == "cpu"]))

    def step(self, units, n_passes: int) -> None:
        """One step: each unit's read, copy and block in order (clocks kept in locals: the search prices
        thousands of steps). A copy starts once the schedule has issued it (at a release, or as the step begins),
        the link is free, its staging slot's previous unit has run (the ring's slots are taken in turn) and, for a
        disk unit, its read has landed."""
        t_gpu, t_copy, t_cpu, t_disk, t_host, t_x = self.t_gpu, self.t_copy, self.t_cpu, self.t_disk, self.t_host, \
            self.t_x
        buffers, slots, on_gpu, plan = self.buffers, self.slots, self.on_gpu, self.plan
        copies, blocks, record = self.copies, self.blocks, self.record
        before, now = self.released, [0.0] * len(plan)
        begin, j = t_x, 0  # the step starts when the host has the previous step's answer
        if self.gap_s:  # its first copies and reads issued, the host works on its own first
            t_x = t_gpu = t_cpu = t_host = max(t_gpu, t_cpu, t_host, t_x) + self.gap_s
        for mode, tier, block_s, copy_s, read_s, hop_s in _each(units):
            ready = 0.0
            if tier == "disk":
                t_disk = max(t_disk, buffers.popleft(), begin) + read_s / n_passes
                ready = t_disk
            on_cpu = mode == "cpu"
            if mode == "stream":
                copy = plan[j]
                if copy.issued == "release":  # at the release of this step's unit `by`
                    issued = now[copy.by]
                elif copy.issued == AHEAD:  # at the release of the step before's unit `by`
                    issued = before[copy.by]
                else:  # as the step begins
                    issued = begin
                start = max(t_copy, slots.popleft(), issued, ready)
                t_copy = start + copy_s / n_passes
                if record:
                    copies.append((start, t_copy))
                ready = t_copy
                if tier == "disk":
                    buffers.append(t_copy)
            if on_cpu == on_gpu:  # the hidden state changes device
                t_x += hop_s
            if on_cpu:
                start = max(t_cpu, t_x, t_host, ready)
                t_x = t_host = t_cpu = start + block_s / n_passes
                if record:
                    blocks.append((start, t_cpu, "cpu"))
                if tier == "disk":
                    buffers.append(t_cpu)
            else:
                start = max(t_gpu, t_x, ready)
                t_x = t_gpu = start + block_s / n_passes
                if record:
                    blocks.append((start, t_gpu, "gpu"))
                if mode == "stream":
                    slots.append(t_gpu)
                    now[j] = t_host
                    j += 1
            on_gpu = not on_cpu
        self.t_gpu, self.t_copy, self.t_cpu, self.t_disk, self.t_host, self.t_x = t_gpu, t_copy, t_cpu, t_disk, \
            t_host, t_x
        self.on_gpu, self.released = on_gpu, now


def entries(units: list[int], entry: list[tuple], device: list[str | None]) -> list[tuple]:
    """Pipeline.run's entries for units in order, each unit the number of its kind, with the kind's entry and, for a
    kind that waits for nothing but the block before it (no copy, no disk read), its device: each span of such
    units on one device as one entry of their blocks' seconds, each run of units of another kind as one entry."""
    out, block_s = [], [e[2] for e in entry]
    for where, span in groupby(units, key=device.__getitem__):
        if where:  # units that follow one another on one device: their blocks back to back
            span = list(span)
            out.append((where, where, sum(map(block_s.__getitem__, span)), 0.0, 0.0, entry[span[0]][5], 1))
            continue
        for u, run in groupby(span):
            out.append((*entry[u], len(list(run))))
    return out


def _each(units):
    """Each unit of runs of alike units (an entry, then how many)."""
    return chain.from_iterable(repeat(run[:-1], run[-1]) for run in units)


def _overlap(copies: list[tuple[float, float]], blocks: list[tuple[float, float]]) -> float:
    """Seconds of the copies' intervals that fall within some block's (each list in start order, blocks disjoint
    as they follow the hidden state)."""
    total, j = 0.0, 0
    for start, end in copies:
        while j < len(blocks) and blocks[j][1] <= start:
            j += 1
        k = j
        while k < len(blocks) and blocks[k][0] < end:
            total += max(0.0, min(end, blocks[k][1]) - max(start, blocks[k][0]))
            k += 1
    return total

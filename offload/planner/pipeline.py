"""One phase step's timeline as the executor runs it: each unit's disk read, copy and block on the clocks of the
link, the GPU, the CPU, the disk and the host, the hidden state handed between devices, copies issued when the
schedule (planner/schedule.copy_plan) issues them into the staging slot whose turn it is. Pure arithmetic."""

from __future__ import annotations

from collections import deque

from offload.planner.schedule import AHEAD, copy_plan

STEADY_STEPS = 2  # steps priced for a steady one: the first's copies start at once, as the step before's would


def pipeline_s(units: list[tuple], depth: int, n_passes: int = 1, steady: bool = False) -> float:
    """Seconds of one phase step as the executor schedules it, for units in order as (mode, weight tier, cost (a
    costs.UnitCost), extra seconds on its block, seconds of the hand-over of its input where that changes device).

    Each streamed unit's copy starts once the link is free, a staging slot is (the streamed unit `depth` before
    it has computed) and its bytes are (read from disk, for a disk unit); each disk read once the disk and one
    of `depth` read-ahead buffers are; GPU and CPU blocks follow the hidden state, with its hand-over where
    it changes device, and the host waits for a CPU block's input. Copies of host-RAM units run ahead
    into the next pass or step while slots are free (the executor prefetches across steps), disk reads do not.
    A step of several passes (a long prefill) runs the chain once per pass, each with its share of the compute
    and the whole weights' copies; steady gives one step after the pipeline has filled (a decode step).
    """
    return Pipeline(depth, units[0][0] != "cpu" if units else False).run(units, n_passes, steady)


class Pipeline:
    """The clocks of pipeline_s: link, GPU, CPU, disk, host, the hidden state, read buffers, and each streamed
    unit's block end and release (a staging slot is free again once its unit's block has run); the copies' and
    blocks' intervals of the step being priced. When each copy is issued, and into whose slot, is the schedule's
    (planner/schedule.copy_plan), as the executor's streamer replays it."""

    def __init__(self, depth: int, on_gpu: bool):
        self.on_gpu, self.depth = on_gpu, max(depth, 1)
        self.t_gpu = self.t_copy = self.t_cpu = self.t_disk = self.t_host = self.t_x = 0.0
        self.buffers = deque([0.0] * self.depth)  # when each read-ahead buffer is free again
        self.slots = deque([0.0] * self.depth)  # when each staging slot's last block ends, in the ring's turn
        self.copies: list[tuple[float, float]] = []
        self.n_passes = 1
        self.blocks: list[tuple[float, float, str]] = []  # (start, end, cpu | gpu)
        self.plan: tuple = ()
        self.released: list[float] = []  # when the host released the previous step's streamed units

    def run(self, units, n_passes: int, steady: bool) -> float:
        ends, self.n_passes = [], n_passes
        on_disk = tuple(tier == "disk" for mode, tier, *_ in units if mode == "stream")
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
        buffers, slots, copies, blocks, on_gpu, plan = self.buffers, self.slots, self.copies, self.blocks, \
            self.on_gpu, self.plan
        before, now = self.released, [0.0] * len(plan)
        begin, j = t_x, 0  # the step starts when the host has the previous step's answer
        for mode, tier, c, extra_s, hop_s in units:
            ready = 0.0
            if tier == "disk":
                t_disk = max(t_disk, buffers.popleft(), begin) + c.disk_s / n_passes
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
                t_copy = start + c.pcie_s / n_passes
                copies.append((start, t_copy))
                ready = t_copy
                if tier == "disk":
                    buffers.append(t_copy)
            if on_cpu == on_gpu:  # the hidden state changes device
                t_x += hop_s
            if on_cpu:
                start = max(t_cpu, t_x, t_host, ready)
                t_x = t_host = t_cpu = start + (c.cpu_s + extra_s) / n_passes
                blocks.append((start, t_cpu, "cpu"))
                if tier == "disk":
                    buffers.append(t_cpu)
            else:
                start = max(t_gpu, t_x, ready)
                t_x = t_gpu = start + (c.gpu_s + extra_s) / n_passes
                blocks.append((start, t_gpu, "gpu"))
                if mode == "stream":
                    slots.append(t_gpu)
                    now[j] = t_host
                    j += 1
            on_gpu = not on_cpu
        self.t_gpu, self.t_copy, self.t_cpu, self.t_disk, self.t_host, self.t_x = t_gpu, t_copy, t_cpu, t_disk, \
            t_host, t_x
        self.on_gpu, self.released = on_gpu, now


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

"""ThreadGovernor: how many threads the CPU blocks use, chosen by measuring decode steps.

On a machine that is not idle, a core can be taken away from one of the kernels' threads; every parallel region
then waits at its barrier until that thread runs again, and a 2-thread decode on a 2-core machine with one busy
process ran at 28% of its idle speed, against 75% with one thread (the demo job, this project's Zen 4 machine).
So the governor keeps the thread count that gives the shortest decode steps: now and then it tries the other
count for PROBE_STEPS steps and keeps whichever is faster, which follows a machine whose load comes and goes.
A probe that confirms the choice doubles the wait before the next one (a probe of the worse count costs time). offload's CPU kernels split rows, not sums, across threads: the count changes their speed, not results.

Costs per token are compared only between steps of like sizes (LIKE_TOKENS): a step of 2 tokens is bound by the
weights' read, where one thread does as well as two, and a step of 64 by arithmetic, where two do twice as well. A
job's warm-up of 2-token steps once left two threads' cost at 30 ms a token; a probe of one thread at 64 tokens
(12 ms a token) then won, and 25 steps of the job ran 1.9x slower on one thread.
"""

from __future__ import annotations

import os

PROBE_EVERY = 32  # decode steps between two probes after a probe changed the count
MAX_PROBE_EVERY = 256  # ... growing to this while probes confirm it (then under 1% of steps run on the other)
FIRST_PROBE = 8  # the first probe comes early: a short job would otherwise run on the worse count throughout
PROBE_STEPS = 2  # steps each probe runs: one to settle, one to measure
SMOOTHING = 0.3  # weight of the newest step in each count's running mean
LIKE_TOKENS = 1.25  # steps whose token counts are within this ratio are compared; a step beyond it starts afresh
THREADS_ENV_VAR = "OFFLOAD_ADAPTIVE_THREADS"  # 0: keep the thread count fixed


class ThreadGovernor:
    """Chooses between max_threads and half of them for the next step from measured seconds per token."""

    def __init__(self, max_threads: int, enabled: bool | None = None):
        if enabled is None:
            enabled = os.environ.get(THREADS_ENV_VAR, "1") != "0"
        self.counts = sorted({max(1, max_threads), max(1, max_threads // 2)}, reverse=True)
        self.enabled = enabled and len(self.counts) > 1
        self.chosen = self.current = self.counts[0]
        self.cost: dict[int, float | None] = dict.fromkeys(self.counts)  # seconds per token, running mean
        self.sized: dict[int, int] = dict.fromkeys(self.counts, 0)  # the token count of each mean's latest step
        self._steps = self._probing = 0
        self._next_probe, self._interval = FIRST_PROBE, PROBE_EVERY

    def threads_for(self, phase: str) -> int:
        """The thread count for the next step of phase (prefill keeps the chosen count)."""
        if not self.enabled or phase != "decode":
            return self.chosen
        self._steps += 1
        if self._probing == 0 and self._steps >= self._next_probe:
            self._probing = PROBE_STEPS
            self.current = next(n for n in self.counts if n != self.chosen)
            self.cost[self.current] = None  # measured afresh: the machine may have changed since the last probe
        elif self._probing == 0:
            self.current = self.chosen
        return self.current

    def observe(self, phase: str, seconds: float, n_tokens: int) -> None:
        """Record a finished step that ran with the count threads_for returned."""
        if not self.enabled or phase != "decode" or n_tokens < 1:
            return
        per_token, old = seconds / n_tokens, self.cost[self.current]
        if old is not None and _alike(self.sized[self.current], n_tokens):
            per_token = (1 - SMOOTHING) * old + SMOOTHING * per_token
        self.cost[self.current], self.sized[self.current] = per_token, n_tokens
        if self._probing:
            self._probing -= 1
            if self._probing == 0:  # compared with the counts last measured at steps of this size only
                known = {n: c for n, c in self.cost.items() if c is not None and _alike(self.sized[n], n_tokens)}
                before = self.chosen
                if before in known:  # else the choice and the wait stand: nothing at this size to weigh it by
                    self.chosen = min(known, key=known.get)
                    self._interval = PROBE_EVERY if self.chosen != before else min(2 * self._interval,
                                                                                    MAX_PROBE_EVERY)
                self._next_probe = self._steps + self._interval


def _alike(a: int, b: int) -> bool:
    """Whether steps of a and b tokens cost alike per token (within LIKE_TOKENS of each other)."""
    return max(a, b) <= LIKE_TOKENS * min(a, b)

"""ThreadGovernor: keeps the thread count whose decode steps are faster, probing the other one now and then."""

from __future__ import annotations

from offload.runtime.threads import FIRST_PROBE, MAX_PROBE_EVERY, PROBE_EVERY, PROBE_STEPS, ThreadGovernor


def _run(gov: ThreadGovernor, seconds_per_token, steps: int) -> list[int]:
    """Drive the governor with a machine whose speed per thread count is seconds_per_token(n)."""
    used = []
    for _ in range(steps):
        n = gov.threads_for("decode")
        used.append(n)
        gov.observe("decode", seconds_per_token(n) * 4, 4)
    return used


def test_a_busy_core_moves_the_kernels_to_fewer_threads_and_back():
    gov = ThreadGovernor(2, enabled=True)
    idle = {2: 0.010, 1: 0.016}
    busy = {2: 0.040, 1: 0.018}  # one core taken: two threads wait at every barrier
    used = _run(gov, idle.get, 3 * PROBE_EVERY)
    assert gov.chosen == 2 and 2 * PROBE_STEPS <= used.count(1) <= 3 * PROBE_STEPS  # only probes ran on one
    used = _run(gov, busy.get, MAX_PROBE_EVERY + PROBE_EVERY)  # probes back off while they confirm the choice
    assert gov.chosen == 1 and used[-PROBE_EVERY:].count(1) >= PROBE_EVERY - PROBE_STEPS
    _run(gov, idle.get, 2 * MAX_PROBE_EVERY)
    assert gov.chosen == 2


def test_probes_back_off_while_they_confirm_the_choice():
    gov = ThreadGovernor(2, enabled=True)
    used = _run(gov, {2: 0.010, 1: 0.016}.get, 2000)
    assert used.count(1) <= 2 * PROBE_STEPS + 2000 // MAX_PROBE_EVERY * PROBE_STEPS  # under 1% past the start


def test_prefill_and_a_disabled_governor_keep_the_count():
    gov = ThreadGovernor(4, enabled=True)
    assert all(gov.threads_for("prefill") == 4 for _ in range(3 * PROBE_EVERY))
    off = ThreadGovernor(4, enabled=False)
    assert set(_run(off, {4: 0.05, 2: 0.01}.get, 3 * PROBE_EVERY)) == {4}
    assert not ThreadGovernor(1).enabled  # one thread: nothing to choose


def test_the_environment_can_switch_it_off(monkeypatch):
    monkeypatch.setenv("OFFLOAD_ADAPTIVE_THREADS", "0")
    assert not ThreadGovernor(2).enabled


def test_costs_are_compared_at_like_step_sizes_only():
    """A warm-up of 2-token steps (bound by the weights' read: 30 ms a token on two threads) must not make a probe
    of one thread at 64 tokens (12 ms a token, where two threads take 6) look faster."""
    gov = ThreadGovernor(2, enabled=True)
    for _ in range(FIRST_PROBE - 1):
        gov.observe("decode", 0.060, 2) if gov.threads_for("decode") == 2 else None
    used = []
    for _ in range(3 * PROBE_EVERY):
        n = gov.threads_for("decode")
        used.append(n)
        gov.observe("decode", 64 * {2: 0.006, 1: 0.012}[n], 64)
    assert gov.chosen == 2 and used.count(1) <= 2 * PROBE_STEPS

"""The verify pass's first copies and disk reads under the drafting (issue 46, item 4): the runtime issues them
before the draft's steps (Generator._drafts calls the model's prepare_step; tests/test_streamer.py checks what the
streamer does with them), the simulated device's clock runs on through the drafting, and the cost model prices a
pass with the drafting before it (planner/pipeline.py's gap)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from offload.planner.pipeline import Pipeline
from offload.planner.speculation import SpeculationPlans

STREAMED = [("stream", "cpu", 0.001, 0.010, 0.0, 0.0, 4)]  # 4 units: a 1 ms block after a 10 ms copy each
ON_DISK = [("cpu", "disk", 0.004, 0.0, 0.010, 0.0, 4)]  # 4 units computed on the CPU: 4 ms after a 10 ms read


def _after(units, depth: int, on_gpu: bool, gap_s: float) -> float:
    """A steady step's seconds past gap_s of the host's own work before it."""
    return Pipeline(depth, on_gpu).run(units, 1, True, gap_s) - gap_s


def test_a_link_bound_pass_has_its_first_copies_under_the_drafting():
    """Two staging slots: 30 ms of drafting take the first two copies (20 ms); the third waits for the first slot
    (free once its unit has run, at 31 ms) and the link (at 20 ms), lands at 41 ms, the fourth at 51 ms, its block
    at 52 ms: 22 ms past the drafting, against 40 without it. 5 ms of drafting hide 5 ms."""
    assert _after(STREAMED, 2, True, 0.0) == pytest.approx(0.040)
    assert _after(STREAMED, 2, True, 0.030) == pytest.approx(0.022)
    assert _after(STREAMED, 2, True, 0.005) == pytest.approx(0.035)
    assert _after(STREAMED, 1, True, 0.030) == pytest.approx(_after(STREAMED, 1, True, 0.0) - 0.010)  # one slot


def test_a_disk_bound_pass_has_its_first_reads_under_the_drafting():
    """Two read buffers: the first two reads land under 30 ms of drafting; 28 ms past it against 44."""
    assert _after(ON_DISK, 2, False, 0.0) == pytest.approx(0.044)
    assert _after(ON_DISK, 2, False, 0.030) == pytest.approx(0.028)


def test_a_draft_that_copies_or_reads_gets_no_pass_under_its_drafting():
    """SpeculationPlans prices the pass after the drafting only where the draft neither streams nor reads (under):
    else the two would share the link and the disk, and the pass is priced as if alone."""

    class Counted(SpeculationPlans):
        def pass_s(self, k, after_s=0.0):
            return (k, after_s if self.under else 0.0)

    plans = Counted(None, 0, 0.01, None, None, draft_step_s=0.002, sync_s=0.001)
    assert plans.verify_s(3) == (3, 0.0) and plans.verify_s(3, 5) == (5, 0.0)
    assert replace(plans, under=True).verify_s(3, 5) == (5, pytest.approx(0.007))  # 3 steps and the mirrors' copy


SLOW_DISK = 5e6  # bytes a second: a disk read takes longer than the host's own work in a step


class _Slow:
    """A drafter taking DRAFT_S of the host's time per round (its own clock), proposing the same tokens."""

    DRAFT_S = 0.25

    def __init__(self):
        self.seconds = 0.0

    def propose(self, tokens: list[int], k: int, seq=None) -> list[int]:
        self.seconds += self.DRAFT_S
        return [7, 8, 9][:k]


@pytest.mark.parametrize("weights", ["cpu", "disk"])
def test_the_simulated_device_s_clock_runs_on_through_the_drafting(tmp_path, weights):
    """On the simulated device the drafting is on the model's clock too (PlacedModel.host_worked): the run's time
    is its steps' and the drafting's. With the weights on disk, the reads the verify pass's first units were queued
    for before the drafting have landed when it begins, and its steps take less time than where they are queued as
    it begins (prepare_step a no-op); the answers are plain decoding's."""
    from conftest import gpu_profile, make_hf_model, save_hf_model
    from offload.engine import run_to_end
    from offload.generate import Generator
    from offload.planner import Placement
    from offload.runtime.backends.sim import SimBackend
    from offload.runtime.executor import PlacedModel
    from offload.sampling import SamplingParams
    from offload.sequence import Sequence
    from offload.speculative import Speculator
    from offload.weights.loader import Checkpoint
    from offload.weights.model_files import model_spec
    from offload.weights.sources import CheckpointSource

    path = save_hf_model(make_hf_model("llama"), tmp_path / "tiny")
    spec = model_spec(path)

    def run(drafter, prepare: bool = True):
        placement = Placement.uniform(spec, weights, "stream", prefetch_depth=2, read_ahead=2,
                                      page_cache=frozenset())
        model = PlacedModel(spec, CheckpointSource(Checkpoint(path), spec, torch.float32, "none"), placement,
                            SimBackend(gpu_profile().with_changes(disk_read_bps=SLOW_DISK)))
        if not prepare:
            model.prepare_step = lambda phase, samples=True: None
        gen = Generator(model, max_batch_size=1, max_model_len=64)
        gen.speculator = Speculator(drafter, num_tokens=3) if drafter else None
        seq = Sequence(0, [5, 6, 7, 8], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        run_to_end(gen, [seq])
        return seq.output_ids, model

    plain, _ = run(None)
    drafter = _Slow()
    ours, model = run(drafter)
    assert ours == plain and drafter.seconds >= 2 * _Slow.DRAFT_S
    steps = model.timeline.phase_time_s["decode"]
    assert model.now() >= drafter.seconds + steps  # the drafting on the model's clock
    late, unprepared = run(_Slow(), prepare=False)
    assert late == plain
    if weights == "disk":
        assert steps < 0.8 * unprepared.timeline.phase_time_s["decode"], (steps, unprepared.timeline.phase_time_s)

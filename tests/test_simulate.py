"""`offload simulate`: the executor's schedule on the timed simulated GPU agrees with the planner's prediction,
stays within the planned memory, and its trace shows copies under compute and CPU blocks beside copies."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import pytest

from offload.cli.main import main
from offload.planner import PlanRequest
from offload.simulate import simulate

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from sim_vs_plan import cases  # noqa: E402  (the same matrix the script prints)

TOLERANCE = 0.10  # predicted / simulated step time, per phase


def _check(request: PlanRequest) -> None:
    sim = simulate(request, decode_steps=4)
    for phase, result in sim.phases.items():
        assert abs(result.predicted_over_simulated - 1) <= TOLERANCE, (request, phase, result)
    for tier in ("gpu", "cpu"):
        assert sim.peak_bytes[tier] <= sim.plan.tier(tier).total_bytes, (request, tier)


@pytest.mark.parametrize("request_", list(itertools.islice(cases(), 0, None, 6)), ids=lambda r: f"{r.model.path}-"
                         f"{r.hardware.profile}-{r.memory.gpu // 2**30}GiB-b{r.schedule.batch_size}")
def test_prediction_holds_on_the_simulated_device(request_):
    _check(request_)


@pytest.mark.slow
def test_prediction_holds_over_the_whole_matrix():
    for request in cases():
        _check(request)


def test_the_70b_trace_shows_copies_under_compute_and_cpu_blocks_beside_copies(tmp_path, capsys):
    trace = tmp_path / "trace.json"
    argv = ["simulate", "--model", "llama-3.1-70b", "--hardware", "rtx4090-ddr5", "--gpu-memory", "22GiB",
            "--quantization", "q4_0", "--trace", str(trace), "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert 0.9 <= result["phases"]["decode"]["predicted_over_simulated"] <= 1.1
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    by_track = {}
    for e in events:
        by_track.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))

    def overlap(a: int, b: int) -> float:
        return sum(max(0, min(e1, e2) - max(s1, s2)) for s1, e1 in by_track[a] for s2, e2 in by_track[b])

    cpu, gpu, pcie = 1, 2, 3  # profile.report.TRACK_IDS
    assert overlap(pcie, gpu) > 0 and overlap(pcie, cpu) > 0


def test_simulate_refuses_zero_decode_steps(capsys):
    assert main(["simulate", "--model", "llama-3.1-8b", "--decode-steps", "0"]) == 2
    assert "--decode-steps must be 1 or more" in capsys.readouterr().err

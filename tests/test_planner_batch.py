"""plan_best_batch: the planner picks the batch size when the user does not."""

from __future__ import annotations

import pytest

from offload.errors import PlanError
from offload.hardware import load_hardware
from offload.planner import Budget, Workload, plan, plan_best_batch
from offload.spec import load_spec

SMOL = "configs/models/smollm2-135m"


def test_batch_grows_with_the_budget_and_fits():
    spec, hw = load_spec(SMOL), load_hardware("cpu-desktop")
    workload = Workload(prompt_len=1920, gen_len=128, compute_format="fp32")
    small = plan_best_batch(spec, hw, Budget(gpu_bytes=0, cpu_bytes=2 << 30), workload)
    large = plan_best_batch(spec, hw, Budget(gpu_bytes=0, cpu_bytes=16 << 30), workload)
    assert 1 <= small.workload.batch_size < large.workload.batch_size
    for chosen, cpu_bytes in ((small, 2 << 30), (large, 16 << 30)):
        assert chosen.tier("cpu").total_bytes <= cpu_bytes
        doubled = chosen.workload.batch_size * 2
        if doubled <= 256:  # the next size up either does not fit or is predicted no faster
            try:
                bigger = plan(spec, hw, Budget(gpu_bytes=0, cpu_bytes=cpu_bytes),
                              Workload(doubled, 1920, 128, compute_format="fp32"))
            except PlanError:
                continue
            assert doubled * 128 / bigger.job_s <= chosen.workload.batch_size * 128 / chosen.job_s


def test_nothing_fits_raises():
    spec, hw = load_spec(SMOL), load_hardware("cpu-desktop")
    with pytest.raises(PlanError):
        plan_best_batch(spec, hw, Budget(gpu_bytes=0, cpu_bytes=1 << 20), Workload(compute_format="fp32"))

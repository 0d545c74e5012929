"""Property tests over random specs, budgets, workloads and machines: fit or say so, never over-commit."""

import pytest

from offload.planner.costs import read_ahead_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offload.errors import PlanError
from offload.hardware import load_hardware
from offload.planner import COMPUTE_MODES, TIERS, Budget, Workload, plan
from offload.formats import WEIGHT_FORMATS as FORMATS
from offload.spec import spec_from_config

MACHINES = {name: load_hardware(name) for name in ("rtx3090-ddr4", "rtx4090-ddr5", "t4-server", "cpu-desktop")}


@st.composite
def specs(draw):
    head_dim = draw(st.sampled_from([8, 16, 32]))
    n_kv_heads = draw(st.integers(1, 4))
    n_heads = n_kv_heads * draw(st.integers(1, 3))
    config = {"model_type": draw(st.sampled_from(["llama", "qwen2", "mistral"])),
              "hidden_size": n_heads * head_dim * draw(st.sampled_from([1, 2])),
              "head_dim": head_dim, "num_attention_heads": n_heads, "num_key_value_heads": n_kv_heads,
              "intermediate_size": 32 * draw(st.integers(1, 8)), "num_hidden_layers": draw(st.integers(1, 6)),
              "vocab_size": 32 * draw(st.integers(1, 16)), "tie_word_embeddings": draw(st.booleans())}
    return spec_from_config(config)


budgets = st.builds(Budget, gpu_bytes=st.integers(0, 3 * 10**6), cpu_bytes=st.integers(0, 3 * 10**6),
                    disk_bytes=st.sampled_from([0, 10**5, 10**7]), margin_frac=st.sampled_from([0.0, 0.05, 0.2]))
workloads = st.builds(Workload, batch_size=st.integers(1, 16), prompt_len=st.integers(1, 64),
                      gen_len=st.integers(1, 32), prefill_chunk_tokens=st.sampled_from([16, 512]))
FAST = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(specs(), budgets, workloads, st.sampled_from(sorted(MACHINES)), st.sampled_from(FORMATS))
def test_no_plan_exceeds_a_budget_and_every_unit_is_placed_once(spec, budget, workload, machine, fmt):
    try:
        p = plan(spec, MACHINES[machine], budget, workload, fmt)
    except PlanError as e:
        assert "short by" in str(e)
        return
    for tier in p.tiers:
        assert tier.total_bytes <= tier.budget_bytes, (tier, budget)
    assert [u.name for u in p.units] == [u.name for u in spec.units()]
    for u in p.units:
        assert u.weight_tier in TIERS and u.prefill in COMPUTE_MODES and u.decode in COMPUTE_MODES
        assert (u.weight_tier == "gpu") == (u.prefill == "gpu") == (u.decode == "gpu")
        if u.kind == "layer":
            assert u.kv_tier == ("cpu" if u.decode == "cpu" else "gpu")
    by_tier = {t: sum(u.weight_bytes for u in p.units if u.weight_tier == t) for t in TIERS}
    assert by_tier == {t.tier: t.weights_bytes for t in p.tiers}
    assert sum(by_tier.values()) == sum(u.nbytes(fmt, workload.compute_format) for u in spec.units())
    if not MACHINES[machine].has_gpu or budget.gpu_bytes == 0:
        assert p.tier("gpu").total_bytes == 0 and {u.decode for u in p.units} == {"cpu"}
    buffers = {u.name: u.buffer_bytes(fmt, workload.compute_format) for u in spec.units()}
    streamed = [buffers[u.name] for u in p.units if "stream" in (u.prefill, u.decode) and u.kind != "norm"]
    assert p.staging_slot_bytes == max(streamed, default=0)  # a slot holds the largest streamed unit's buffer
    read = [buffers[u.name] for u in p.units if u.weight_tier == "disk" and u.kind != "embed"]  # embed: by rows
    assert p.read_buffer_bytes == read_ahead_bytes(read, 2) and p.read_ahead_depth == (2 if read else 0)
    assert p.prefill.step_s > 0 and p.decode.step_s > 0


@FAST
@given(specs(), workloads, st.sampled_from(sorted(MACHINES)), st.sampled_from(FORMATS))
def test_a_failing_plan_fits_once_the_budget_is_ample(spec, workload, machine, fmt):
    """PlanError comes from the budget, never from the search: ample memory always gives a plan."""
    tight = Budget(gpu_bytes=0, cpu_bytes=1000, disk_bytes=0)
    with pytest.raises(PlanError, match="short by"):
        plan(spec, MACHINES[machine], tight, workload, fmt)
    ample = Budget(gpu_bytes=10**9, cpu_bytes=10**9, disk_bytes=10**9)
    p = plan(spec, MACHINES[machine], ample, workload, fmt)
    assert all(t.total_bytes <= t.budget_bytes for t in p.tiers)


@FAST
@given(specs(), workloads, st.sampled_from(FORMATS), st.integers(0, 2 * 10**6))
def test_more_gpu_memory_never_predicts_a_slower_job(spec, workload, fmt, gpu_bytes):
    """Within 3%: stream choices are greedy per phase, and a decode choice can cost prefill a KV copy."""
    hw = MACHINES["rtx4090-ddr5"]
    try:
        small = plan(spec, hw, Budget(gpu_bytes, 10**8), workload, fmt)
    except PlanError:
        return
    large = plan(spec, hw, Budget(gpu_bytes * 2 + 10**5, 10**8), workload, fmt)
    assert large.job_s <= small.job_s * 1.03

"""The cost model prices each layer's attention by the keys that layer reads: a sliding layer's window (capped by
the context), a full layer's whole context; a model without windows is priced as before."""

from dataclasses import replace
from pathlib import Path

import pytest

from conftest import gpu_profile
from offload.planner import Budget, Workload, plan
from offload.planner.costs import phases_for, unit_cost
from offload.spec import load_spec

MODELS = Path(__file__).resolve().parent.parent / "configs" / "models"
CONTEXT, GEN = 32768, 256
WORKLOAD = Workload(batch_size=1, prompt_len=CONTEXT - GEN, gen_len=GEN, compute_format="bf16")


def _gemma3():
    """Gemma 3 27B: five sliding layers of window 1024 to each full one."""
    return load_spec(MODELS / "gemma-3-27b")


def _windows_removed(spec, window=None):
    """spec with every sliding layer's window set to window (None: every layer attends to the whole context)."""
    layer_windows = tuple(w and window for w in spec.variant.layer_windows) if window else ()
    return replace(spec, sliding_window=None, variant=replace(spec.variant, layer_windows=layer_windows,
                                                              sliding_window=None))


def _layer(spec, i):
    return next(u for u in spec.units() if u.kind == "layer" and u.index == i)


def _one_sliding_one_full(spec):
    sliding = next(i for i in range(spec.n_layers) if spec.window(i) is not None)
    full = next(i for i in range(spec.n_layers) if spec.window(i) is None)
    return sliding, full


@pytest.mark.parametrize("phase", phases_for(1, CONTEXT - GEN, GEN, WORKLOAD.prefill_pass_tokens),
                         ids=lambda p: p.name)
def test_a_sliding_layer_is_priced_as_a_full_layer_over_its_window(phase):
    spec, hw = _gemma3(), gpu_profile()
    sliding, full = _one_sliding_one_full(spec)
    window = spec.window(sliding)

    def cost(s, i, ph=phase):
        return unit_cost(s, _layer(s, i), "q4_0", hw, ph, "bf16")

    assert phase.ctx_len > window  # the window binds: prefill attends 16k keys on average, decode 32k
    slide, whole = cost(spec, sliding), cost(spec, full)
    assert slide.gpu_s < whole.gpu_s and slide.cpu_s < whole.cpu_s
    if phase.name == "decode":  # the CPU attends over a host KV cache by the window too
        assert slide.attn_host_s < whole.attn_host_s
    plain = _windows_removed(spec)
    assert whole == cost(plain, full)  # a full layer is priced as every layer of the model without windows
    # a sliding layer: as a layer without a window whose queries see only the window's keys
    capped = replace(phase, ctx_len=window, kv_read_len=min(phase.kv_read_len, window))
    assert slide == cost(plain, sliding, capped)


def test_windows_lower_the_predicted_steps_of_a_long_context():
    """All resident on an H200 (nothing else changes between the two plans): Gemma 3 at 32k predicts shorter
    prefill and decode steps than the same model with every window removed."""
    hw = gpu_profile("h200-server")
    budget = Budget(gpu_bytes=100 << 30, cpu_bytes=64 << 30)
    spec = _gemma3()
    windowed, plain = (plan(s, hw, budget, WORKLOAD, weight_format="q4_0") for s in (spec, _windows_removed(spec)))
    assert windowed.n_gpu_units == plain.n_gpu_units == len(spec.units())
    assert windowed.decode.step_s < plain.decode.step_s
    assert windowed.prefill.step_s < plain.prefill.step_s


def test_windows_lower_the_predicted_decode_step_on_a_small_gpu():
    """Gemma 3 27B q4_0 at 32k on 8 GiB beside a desktop's RAM: the windows' smaller caches and reads make its
    decode step shorter than without windows."""
    hw = gpu_profile("rtx4090-ddr5")
    budget = Budget(gpu_bytes=8 << 30, cpu_bytes=48 << 30)
    spec = _gemma3()
    windowed, plain = (plan(s, hw, budget, WORKLOAD, weight_format="q4_0") for s in (spec, _windows_removed(spec)))
    assert windowed.decode.step_s < plain.decode.step_s
    assert windowed.job_s < plain.job_s


def test_windows_wider_than_the_context_change_no_price():
    """Sliding layers whose window holds the whole context cost and hold what full ones do, layer by layer and
    phase by phase, and an all-resident plan predicts the same steps: per-window pricing changes nothing where no
    window binds."""
    hw = gpu_profile("h200-server")
    wide, plain = _windows_removed(_gemma3(), 2 * CONTEXT), _windows_removed(_gemma3())
    for phase in phases_for(1, CONTEXT - GEN, GEN, WORKLOAD.prefill_pass_tokens):
        for i in range(plain.n_layers):
            ours, theirs = (unit_cost(s, _layer(s, i), "q4_0", hw, phase, "bf16") for s in (wide, plain))
            assert ours == theirs
    assert [wide.layer_kv_bytes(1, CONTEXT, 2, i) for i in range(wide.n_layers)] == [
        plain.layer_kv_bytes(1, CONTEXT, 2, i) for i in range(plain.n_layers)]
    budget = Budget(gpu_bytes=100 << 30, cpu_bytes=64 << 30)
    ours, theirs = (plan(s, hw, budget, WORKLOAD, weight_format="q4_0") for s in (wide, plain))
    assert (ours.units, ours.tiers) == (theirs.units, theirs.tiers)
    for a, b in ((ours.prefill, theirs.prefill), (ours.decode, theirs.decode)):  # summed by kin: rounding apart
        assert a.bound == b.bound and a.step_s == pytest.approx(b.step_s, rel=1e-12)
        assert a.gpu_s == pytest.approx(b.gpu_s, rel=1e-12) and a.pcie_s == pytest.approx(b.pcie_s, rel=1e-12)


def test_a_model_without_windows_prices_every_layer_over_the_context():
    """Llama 3.1 8B: every layer costs the same, its attention over the whole context (by hand: QK^T and PV
    FLOPs 4 x tokens x keys x q_size; K and V read 2 x keys x kv_size x 2 bytes in bf16; the preset has no matmul
    curves, so a GPU layer is one roofline)."""
    spec, hw = load_spec(MODELS / "llama-3.1-8b"), gpu_profile("rtx4090-ddr5")
    prefill, decode = phases_for(1, CONTEXT - GEN, GEN)
    layers = [u for u in spec.units() if u.kind == "layer"]
    costs = {unit_cost(spec, u, "q4_0", hw, decode, "bf16") for u in layers}
    assert len(costs) == 1
    (cost,) = costs
    layer = layers[0]
    flops = layer.matmul_flops(1) + 4 * decode.ctx_len * spec.q_size
    read = layer.nbytes("q4_0", "bf16") + 2 * decode.kv_read_len * spec.kv_size * 2
    assert cost.gpu_s == pytest.approx(max(flops / hw.gpu_flops, read / hw.gpu_mem_bps), rel=1e-12)
    assert len({unit_cost(spec, u, "q4_0", hw, prefill, "bf16") for u in layers}) == 1


def test_a_uniform_window_caps_reads_not_the_cache_of_each_layer():
    """Mistral 7B v0.1 (one window of 4096 for every layer) keeps every position of each layer, as the runtime
    does, and its queries read the window's keys."""
    spec = load_spec(MODELS / "mistral-7b")
    assert spec.kv_ring(0) is None
    assert spec.layer_kv_bytes(1, CONTEXT, 2, 0) == spec.layer_kv_bytes(1, CONTEXT, 2) == 2 * CONTEXT * spec.kv_size * 2
    assert spec.kv_read_bytes(1, CONTEXT, 2, 0) == 2 * 4096 * spec.kv_size * 2


def test_the_timed_simulation_prices_each_layer_by_its_window():
    """The simulated backend's memo of unit costs keeps a sliding layer's price apart from a full one's: each
    layer costs what it costs priced alone."""
    from offload.runtime.backends.base import Work
    from offload.runtime.backends.sim import TimedCosts

    spec, hw = _gemma3(), gpu_profile()
    sliding, full = _one_sliding_one_full(spec)
    work = {i: Work(f"layer.{i}", "layer", "decode", 1, 1, CONTEXT) for i in (sliding, full)}
    timed = TimedCosts(spec, hw, "q4_0", "bf16")
    seconds = {i: timed.seconds(w, True) for i, w in work.items()}
    assert seconds[sliding] < seconds[full]
    assert all(s == TimedCosts(spec, hw, "q4_0", "bf16").seconds(work[i], True) for i, s in seconds.items())

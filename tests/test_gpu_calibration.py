"""The GPU half of calibration without a GPU: the kernel linear() picks by rows from a measured table, the profile's
GPU section through YAML, GPU units priced from a measured curve (else a roofline), the measured launch and
hand-over seconds in the cost model, and the curve tables built from a stand-in timer (the CUDA kernels are
covered by tests/test_triton_dequant.py and tests/test_cuda.py)."""


import pytest

import offload.runtime.backends.cuda as cuda_backend
import offload.runtime.calibrate as calibrate_module
import offload.runtime.device_quant as device_quant
from offload.api import LLM
from offload.errors import ConfigError
from offload.rate_curves import crossover_rows, gpu_kernel
from offload.hardware import (gpu_calibration_summary, load_hardware, profile_from_dict,
                              profile_to_dict)
from offload.planner.costs import (DENSE_LAYER_LAUNCHES, GPU_LAUNCH_S, HOP_LATENCY_S, MLP_LAUNCHES,
                                   MOE_GROUPED_LAUNCHES, Phase, hop_s, moe_launch_s, unit_cost)
from offload.runtime.calibrate import GPU_CURVE_SMALL_SHAPE, gpu_formats, gpu_matmul_curves, measure_gpu_curves
from offload.spec import spec_from_config

# rates in FLOP/s: the fused kernel ahead below 64 rows, dequantize + cuBLAS from there on
Q4_CURVES = {"fused": ((1, 1e12), (16, 1e13), (64, 3e13), (1024, 1e14)),
             "dequant": ((1, 1e11), (16, 5e12), (64, 4e13), (1024, 4e14))}
BF16_CURVES = {"cublas": ((1, 2e12), (1024, 5e14))}
TINY = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 256, "torch_dtype": "bfloat16"}


def measured(**changes):
    """The H200 preset with measured GPU figures."""
    return load_hardware("h200-server").with_changes(
        **{"gpu_flops_by_rows": {"q4_0": Q4_CURVES, "bf16": BF16_CURVES}, **changes})


def test_the_kernel_by_rows_follows_the_table():
    table = {"q4_0": 64, "q4_k": 1}
    assert [gpu_kernel(table, "q4_0", r) for r in (1, 16, 63, 64, 1024)] == ["fused"] * 3 + ["dequant"] * 2
    assert gpu_kernel(table, "q4_k", 1) == "dequant"
    assert gpu_kernel(table, "q8_0", 4096) == "fused"  # not in the table: today's rule
    assert gpu_kernel({}, "q4_0", 4096) == "fused"


def test_the_crossover_is_the_fewest_rows_where_dequant_won():
    assert crossover_rows(Q4_CURVES) == 64
    assert crossover_rows({"fused": Q4_CURVES["fused"], "dequant": ((1, 1e10), (1024, 1e13))}) is None
    assert crossover_rows({"dequant": Q4_CURVES["dequant"]}) is None
    assert measured().gpu_crossover() == {"q4_0": 64}


def test_the_gpu_section_round_trips_through_yaml():
    hw = measured(gpu_launch_s=4.5e-6, handover_s=31e-6, handover_busy_s=95e-6)
    data = profile_to_dict(hw)
    assert data["gpu"]["flops_by_rows"]["q4_0"]["dequant"] == {1: 1e11, 16: 5e12, 64: 4e13, 1024: 4e14}
    assert (data["gpu"]["launch"], data["gpu"]["handover"], data["gpu"]["handover_under_copy"]) == (4.5e-6, 31e-6, 95e-6)
    again = profile_from_dict(data)
    assert again == hw and again.gpu_flops_by_rows == hw.gpu_flops_by_rows
    assert "flops_by_rows" not in profile_to_dict(load_hardware("h200-server"))["gpu"]  # not measured: left out


def test_the_check_summary_holds_the_gpu_figures():
    hw = measured(gpu_launch_s=4.5e-6, handover_s=31e-6, handover_busy_s=95e-6, gpu_flops_by_rows={
        "q4_0": Q4_CURVES, "q8_0": {"fused": ((1, 2e12),), "dequant": ((1, 1e12),)}, "bf16": BF16_CURVES})
    summary = gpu_calibration_summary(hw)
    assert summary["launch_us"] == pytest.approx(4.5) and summary["handover_under_copy_us"] == pytest.approx(95)
    assert summary["crossover_rows"] == {"q4_0": 64, "q8_0": None}
    assert summary["tflops_by_rows"]["q4_0"]["dequant"] == {1: 0.1, 16: 5.0, 64: 40.0, 1024: 400.0}
    assert summary["tflops_by_rows"]["bf16"] == {"cublas": {1: 2.0, 1024: 500.0}}


@pytest.mark.parametrize("body, wrong", [({"q4_0": {"cuda": {1: 1e12}}}, "unknown GPU kernel 'cuda'"),
                                         ({"q9": {"fused": {1: 1e12}}}, "unknown weight format 'q9'"),
                                         ({"q4_0": {"fused": {0: 1e12}}}, "rows must be whole numbers")])
def test_a_bad_gpu_curve_names_its_key(body, wrong):
    data = profile_to_dict(load_hardware("h200-server"))
    data["gpu"]["flops_by_rows"] = body
    with pytest.raises(ConfigError, match=wrong):
        profile_from_dict(data, "hw.yaml")


def test_launch_seconds_must_be_seconds():
    data = profile_to_dict(load_hardware("h200-server"))
    data["gpu"]["launch"] = "fast"
    with pytest.raises(ConfigError, match="gpu.launch: expected seconds"):
        profile_from_dict(data, "hw.yaml")


def test_a_gpu_unit_is_priced_from_the_measured_curve_else_as_a_roofline():
    """A decode step of 1 row and a prefill of 64 rows through a q4_0 layer: the layer's matmul FLOPs over the
    curve of the kernel linear() runs there (fused at 1 row, dequant at 64), attention as a roofline beside;
    bf16 weights on the cuBLAS curve, fp16 on bf16's; without curves, the preset's roofline."""
    spec = spec_from_config(TINY)
    layer = next(u for u in spec.units() if u.kind == "layer")
    hw, roof = measured(), load_hardware("h200-server")
    for phase, rate in ((Phase("decode", 1, 1, 16, 16), 1e12), (Phase("prefill", 1, 64, 32, 0), 4e13)):
        attention = max(spec.attention_flops(phase.n_tokens, phase.ctx_len) / hw.gpu_flops,
                        spec.layer_kv_bytes(1, phase.kv_read_len, 2) / hw.gpu_mem_bps)
        cost = unit_cost(spec, layer, "q4_0", hw, phase, "bf16")
        assert cost.gpu_s == pytest.approx(layer.matmul_flops(phase.n_tokens) / rate + attention)
        assert unit_cost(spec, layer, "q4_0", roof, phase, "bf16").gpu_s < cost.gpu_s  # the roofline is optimistic
    decode = Phase("decode", 1, 1, 16, 16)
    attention = max(spec.attention_flops(1, 16) / hw.gpu_flops, spec.layer_kv_bytes(1, 16, 2) / hw.gpu_mem_bps)
    for fmt in ("bf16", "fp16"):
        assert unit_cost(spec, layer, fmt, hw, decode, fmt).gpu_s == pytest.approx(
            layer.matmul_flops(1) / 2e12 + attention)
    # q8_0 has no curve: the whole unit is a roofline, as the preset prices it
    assert unit_cost(spec, layer, "q8_0", hw, decode, "bf16") == unit_cost(spec, layer, "q8_0", roof, decode, "bf16")


def test_measured_launch_and_hand_over_seconds_price_the_step():
    spec = spec_from_config(TINY)
    phase, roof = Phase("decode", 1, 1, 16, 16), load_hardware("h200-server")
    moved = 64 * 2 / roof.h2d_pinned_bps  # one row of hidden 64 in bf16
    assert hop_s(spec, roof, phase) == hop_s(spec, roof, phase, busy=True) == pytest.approx(HOP_LATENCY_S + moved)
    hw = measured(handover_s=30e-6, handover_busy_s=90e-6, gpu_launch_s=3e-6)
    assert hop_s(spec, hw, phase) == pytest.approx(15e-6 + moved)  # half a round trip
    assert hop_s(spec, hw, phase, busy=True) == pytest.approx(45e-6 + moved)
    moe = spec_from_config({**TINY, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2})
    experts = next(u for u in moe.units() if u.kind == "experts")
    assert moe_launch_s(experts, "q4_0", "bf16", 1) == MOE_GROUPED_LAUNCHES * GPU_LAUNCH_S
    assert moe_launch_s(experts, "q4_0", "bf16", 1, hw) == pytest.approx(MOE_GROUPED_LAUNCHES * 3e-6)


def test_a_short_unit_takes_at_least_its_launches():
    """With a measured launch of 1 ms, a tiny layer's decode step is its launches: a dense layer's, and of a MoE
    model the attention part's (its MLP is the experts unit); without a measured launch, no such floor."""
    spec, phase = spec_from_config(TINY), Phase("decode", 1, 1, 16, 16)
    layer = next(u for u in spec.units() if u.kind == "layer")
    assert unit_cost(spec, layer, "q4_0", measured(gpu_launch_s=1e-3), phase, "bf16").gpu_s == \
        pytest.approx(DENSE_LAYER_LAUNCHES * 1e-3)
    assert unit_cost(spec, layer, "q4_0", measured(), phase, "bf16").gpu_s < 1e-4
    moe = spec_from_config({**TINY, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2})
    attention = next(u for u in moe.units() if u.kind == "layer")
    assert unit_cost(moe, attention, "q4_0", measured(gpu_launch_s=1e-3), phase, "bf16").gpu_s == \
        pytest.approx((DENSE_LAYER_LAUNCHES - MLP_LAUNCHES) * 1e-3)


def fake_timer(shape, calls=None):
    """Seconds as a kernel's would go: fused grows 4x as fast with rows as dequant, which starts 10x higher;
    bf16 cuBLAS flat to 64 rows; no fused kernel for q6_k (as where Triton does not take a format)."""
    def time_s(fmt, kernel, rows):
        if calls is not None:
            calls.append((fmt, kernel, rows))
        if kernel == "fused":
            return None if fmt == "q6_k" else 1e-5 + 4e-7 * rows
        if kernel == "dequant":
            return 1e-4 + 1e-7 * rows
        return 2e-5 * max(rows, 64) / 64
    return time_s


def test_the_curves_are_built_from_the_timings():
    logs, calls = [], []
    shape = (4096, 8192)
    curves = gpu_matmul_curves(fake_timer(shape, calls), gpu_formats(), shape, rows=(1, 64, 256, 1024),
                               log=logs.append)
    assert set(curves) == set(gpu_formats())
    flops = 2 * 4096 * 8192
    assert curves["q4_0"]["fused"][0] == (1, flops / (1e-5 + 4e-7))
    assert curves["q4_0"]["dequant"][-1] == (1024, 1024 * flops / (1e-4 + 1e-7 * 1024))
    # fused: 10 + 0.4 r us against dequant's 100 + 0.1 r: dequant is faster from r = 300, first measured at 1024
    assert crossover_rows(curves["q8_0"]) == 1024
    assert set(curves["q6_k"]) == {"dequant"} and set(curves["bf16"]) == {"cublas"}
    assert ("bf16", "fused", 1) not in calls and ("q4_0", "cublas", 1) not in calls
    assert any("q4_0" in line and "dequantize + cuBLAS from 1024 rows" in line for line in logs)


def test_formats_past_the_budget_are_left_out_and_named():
    ticks, logs = iter(range(100)), []  # the clock ticks a second at each look: two formats start within 2.5 s
    curves = gpu_matmul_curves(fake_timer(None), gpu_formats(), rows=(1, 16), budget_s=2.5, log=logs.append,
                               clock=lambda: next(ticks))
    assert list(curves) == list(gpu_formats()[:2])
    assert any("not measured" in line and gpu_formats()[-1] in line for line in logs)


def test_a_gpu_short_of_memory_is_timed_on_a_smaller_weight():
    shapes = []

    def timer(shape):
        shapes.append(shape)
        return fake_timer(shape)

    curves = measure_gpu_curves(1 << 30, log=lambda line: None, timer=timer)
    assert shapes == [GPU_CURVE_SMALL_SHAPE] and curves["q4_0"]["fused"][0][0] == 1


def test_calibrate_puts_the_gpu_figures_in_the_profile(monkeypatch, tmp_path):
    """calibrate() with the CUDA measurements stood in for (and the CPU and disk ones, which take minutes): the
    launch, hand-over and curve figures land in the profile, and it round-trips through YAML."""
    monkeypatch.setenv("OFFLOAD_CACHE", str(tmp_path))
    monkeypatch.setattr(calibrate_module, "measure_cpu_mem_bps", lambda: 5e10)
    monkeypatch.setattr(calibrate_module, "measure_cpu_flops", lambda fmt: (1e11, "torch"))
    monkeypatch.setattr(calibrate_module, "measure_disk", lambda folder, log: (2e9, 1e10))
    gpu = {"gpu_name": "stand-in", "vram_bytes": 100 << 30, "h2d_pinned_bps": 5e10, "h2d_pageable_bps": 1.6e10,
           "gpu_flops": 7e14, "gpu_mem_bps": 4e12, "gpu_launch_s": 4e-6, "handover_s": 3e-5, "handover_busy_s": 9e-5}
    monkeypatch.setattr(cuda_backend, "measure_cuda", lambda log: dict(gpu))
    monkeypatch.setattr(cuda_backend, "matmul_timer", fake_timer)
    hw = calibrate_module.calibrate(log=lambda line: None)
    assert (hw.gpu_launch_s, hw.handover_s, hw.handover_busy_s) == (4e-6, 3e-5, 9e-5)
    assert set(hw.gpu_flops_by_rows) == set(gpu_formats()) and hw.gpu_crossover()["q4_0"] == 1024
    assert profile_from_dict(profile_to_dict(hw)) == hw


def test_an_llm_planned_with_a_measured_profile_sets_linears_table(tiny_llama, monkeypatch):
    monkeypatch.setattr(device_quant, "_CROSSOVER", {"q8_0": 4})
    _, folder = tiny_llama
    LLM(str(folder), quantization="q4_0", hardware=measured(), backend="cpu", gpu_memory=0, cpu_memory="1GiB")
    assert device_quant._CROSSOVER == {"q4_0": 64}
    LLM(str(folder), quantization="q4_0", hardware="cpu-desktop", backend="cpu", cpu_memory="1GiB")
    assert device_quant._CROSSOVER == {}


def strict_timer(shape, calls=None, broken=()):
    """fake_timer, but as the real kernels refuse: the fused kernel of a GGUF type without one raises KernelError
    (triton_gguf._check), and so does a fused kernel named in broken (a Triton that fails on this GPU)."""
    from offload.errors import KernelError
    from offload.formats import GGUF_TYPE

    timed = fake_timer(shape, calls)

    def time_s(fmt, kernel, rows):
        if kernel == "fused" and (fmt in broken or (fmt in GGUF_TYPE and GGUF_TYPE[fmt].layout == "blocks"
                                                    and GGUF_TYPE[fmt].triton is None)):
            raise KernelError(f"GGUF fused dequant takes q4_1/q4_k/q5_k/q6_k weights, got {fmt}")
        return timed(fmt, kernel, rows)

    return time_s


def test_formats_are_timed_in_the_order_plans_need_them():
    """bf16, q4_0 and q8_0 first (what plans use most), then the GGUF formats with a fused kernel, then the rest,
    which are timed on their dequantize path only."""
    from offload.formats import GGUF_BLOCKS, GGUF_TYPE, QUANT_BLOCK_BYTES
    from offload.runtime.calibrate import gpu_kernels

    formats = gpu_formats()
    assert formats[:3] == ("bf16", "q4_0", "q8_0")
    assert sorted(formats) == sorted(["bf16", *QUANT_BLOCK_BYTES, *GGUF_BLOCKS]) and len(set(formats)) == len(formats)
    has_fused = [fmt in QUANT_BLOCK_BYTES or GGUF_TYPE[fmt].triton is not None for fmt in formats[1:]]
    fused = 1 + sum(has_fused)  # bf16, then the formats with a fused kernel
    assert has_fused == sorted(has_fused, reverse=True) and "q4_k" in formats[:fused] and formats[fused] == "q5_0"
    assert "q2_k" in formats[:fused]
    assert gpu_kernels("q5_0") == ("dequant",) and gpu_kernels("q4_k") == ("fused", "dequant")
    assert gpu_kernels("bf16") == ("cublas",) and gpu_kernels("q8_0") == ("fused", "dequant")


def test_a_format_without_a_fused_kernel_is_priced_by_its_dequantize_path():
    """The defect: calibrate timed the fused kernel of every GGUF format, and q5_0's KernelError ended it with no
    profile. Now q5_0 is timed on dequantize + cuBLAS only, and a fused kernel that fails anyway (q4_k here) is
    logged and left out: every format still gets a curve."""
    calls, logs = [], []
    curves = gpu_matmul_curves(strict_timer(None, calls, broken=("q4_k",)), gpu_formats(), (4096, 8192),
                               rows=(1, 64), log=logs.append)
    assert set(curves) == set(gpu_formats())
    assert set(curves["q5_0"]) == {"dequant"} and ("q5_0", "fused", 1) not in calls
    assert set(curves["q4_k"]) == {"dequant"} and set(curves["q4_1"]) == {"fused", "dequant"}
    assert [line for line in logs if "not measured" in line] == [
        "gpu matmul q4_k fused: not measured (KernelError: GGUF fused dequant takes q4_1/q4_k/q5_k/q6_k weights, "
        "got q4_k)"]
    hw = measured(gpu_flops_by_rows=curves)
    assert hw.gpu_matmul_rate("q5_0", 1) == pytest.approx(2 * 4096 * 8192 / (1e-4 + 1e-7))  # its dequantize curve


def test_calibrate_writes_a_profile_past_formats_without_a_fused_kernel(monkeypatch, tmp_path):
    monkeypatch.setenv("OFFLOAD_CACHE", str(tmp_path))
    monkeypatch.setattr(calibrate_module, "measure_cpu_mem_bps", lambda: 5e10)
    monkeypatch.setattr(calibrate_module, "measure_cpu_flops", lambda fmt: (1e11, "torch"))
    monkeypatch.setattr(calibrate_module, "measure_disk", lambda folder, log: (2e9, 1e10))
    gpu = {"gpu_name": "stand-in", "vram_bytes": 100 << 30, "h2d_pinned_bps": 5e10, "h2d_pageable_bps": 1.6e10,
           "gpu_flops": 7e14, "gpu_mem_bps": 4e12}
    monkeypatch.setattr(cuda_backend, "measure_cuda", lambda log: dict(gpu))
    monkeypatch.setattr(cuda_backend, "matmul_timer", strict_timer)
    hw = calibrate_module.calibrate(log=lambda line: None)
    assert set(hw.gpu_flops_by_rows) == set(gpu_formats()) and set(hw.gpu_flops_by_rows["q5_0"]) == {"dequant"}

"""The planner on mixtures of experts: experts units priced by the experts a step touches, placed apart from
attention by the cost model and the budget, byte-exact on a tiny MoE, and the split it prints for real models."""

import json
import re
from pathlib import Path

import pytest

from offload.cli.main import main
from offload.errors import PlanError
from offload.formats import WEIGHT_FORMATS as FORMATS
from offload.hardware import HardwareProfile, load_hardware
from offload.planner import Budget, PlanRequest, Workload, plan, plan_for
from offload.planner.costs import (GPU_LAUNCH_S, HOP_LATENCY_S, MOE_GROUPED_LAUNCHES, MOE_LOOP_LAUNCHES, Phase, hop_s,
                                   price_step, unit_cost)
from offload.spec import load_spec, spec_from_config

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "configs" / "models"

TINY_MOE = {"model_type": "mixtral", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2,
            "vocab_size": 256, "torch_dtype": "bfloat16"}
WORKLOAD = Workload(batch_size=1, prompt_len=8, gen_len=8)  # compute fp16: weights and KV 2 bytes an element

# Hand-computed bytes of TINY_MOE in fp16 (head_dim 16, kv_size 32):
EMBED = LM_HEAD = 256 * 64 * 2  # 32768
# layer.i, the attention part: q and o 64x64, k and v 32x64 -> 12288 weights; two norms of 64.
LAYER = 2 * (12288 + 128)  # 24832
# experts.i: the router 4x64 = 256 (kept in the compute format) and 4 experts of gate, up, down 64x64 = 49152.
EXPERTS = 2 * (256 + 4 * 3 * 64 * 64)  # 98816 (every plane a multiple of 64 bytes: its buffer is as large)
NORM = 64 * 2  # 128
WEIGHTS = EMBED + 2 * LAYER + 2 * EXPERTS + NORM + LM_HEAD  # 312960
# K and V x (1 seq x one block of 16 slots + the pool's trash slot) x kv_size 32 x fp16 = 2176 per layer; experts
# hold none
KV = 2 * (1 * 16 + 1) * 32 * 2
# Workspace: the prompt's residual [8, 64], one layer's working set for an 8-token chunk over 8 keys, fp32 logits.
# Per token: 3*64 + 64 (q) + 2*32 (k, v) + 2*128 (gate and up of the top 2 experts of width 64) + 2*64 (the
# [residual | normed] hand-over to the experts) = 704 elements; attention: the decode kernel's partials for 8 tokens
# read in place, 2 KV heads x (2 query heads x 8 queries) x (16 + 2) x 4 bytes = 2304.
WS_GPU = 8 * 64 * 2 + (8 * 704 * 2 + 2304) + 256 * 4  # 1024 + 13568 + 1024 = 15616
WS_CPU = 8 * 64 * 4 + (8 * 704 * 4 + 2304) + 256 * 4  # 2048 + 24832 + 1024 = 27904
HOP_BUFFERS = 2 * 8 * (2 * 64) * 4  # two pinned fp32 hand-over buffers of [8, 2 x 64]: the experts' input = 8192


def tiny_hw(vram_bytes: int = 10**6, **changes) -> HardwareProfile:
    hw = HardwareProfile(name="tiny", vram_bytes=vram_bytes, ram_bytes=10**7, disk_bytes=10**8, n_cores=2,
                         h2d_pinned_bps=1e9, h2d_pageable_bps=3e8, gpu_flops=1e12, gpu_mem_bps=1e11,
                         cpu_mem_bps=1e10, cpu_flops={f: 1e10 for f in FORMATS}, disk_read_bps=1e9)
    return hw.with_changes(**changes)


SLOW_CPU = tiny_hw(cpu_flops={f: 1e8 for f in FORMATS})  # the GPU wins wherever it may run a unit


def test_tiny_moe_units_by_hand():
    units = {u.name: u for u in spec_from_config(TINY_MOE).units()}
    assert list(units) == ["embed", "layer.0", "experts.0", "layer.1", "experts.1", "norm", "lm_head"]
    assert units["layer.0"].nbytes("fp16", "fp16") == LAYER and units["experts.0"].nbytes("fp16", "fp16") == EXPERTS
    assert units["experts.0"].buffer_bytes("fp16", "fp16") == EXPERTS


def test_cpu_only_moe_fits_to_the_byte_and_fails_one_byte_below():
    spec = spec_from_config(TINY_MOE)
    need = WEIGHTS + 2 * KV + WS_CPU  # 312960 + 4352 + 27904 = 345216; no GPU, so no pinned buffers
    p = plan(spec, tiny_hw(vram_bytes=0), Budget(0, need, margin_frac=0), WORKLOAD)
    cpu = p.tier("cpu")
    assert (cpu.weights_bytes, cpu.kv_bytes, cpu.workspace_bytes, cpu.pinned_bytes) == (WEIGHTS, 2 * KV, WS_CPU, 0)
    assert cpu.total_bytes == need == 345_216 and p.tier("gpu").total_bytes == 0
    assert all(u.weight_tier == "cpu" and u.prefill == u.decode == "cpu" for u in p.units)
    assert [u.kv_bytes for u in p.units if u.kind == "experts"] == [0, 0]
    with pytest.raises(PlanError, match=r"raise --cpu-memory by 1 B to hold every weight in RAM"):
        plan(spec, tiny_hw(vram_bytes=0), Budget(0, need - 1, margin_frac=0), WORKLOAD)


def test_all_resident_moe_fits_to_the_byte_and_leaves_the_embedding_one_byte_below():
    spec = spec_from_config(TINY_MOE)
    need = WEIGHTS + 2 * KV + WS_GPU  # 312960 + 4352 + 15616 = 332928
    p = plan(spec, SLOW_CPU, Budget(need, 10**6, margin_frac=0), WORKLOAD)
    gpu = p.tier("gpu")
    assert (gpu.weights_bytes, gpu.kv_bytes, gpu.workspace_bytes, gpu.staging_bytes) == (WEIGHTS, 2 * KV, WS_GPU, 0)
    assert gpu.total_bytes == need == 332_928 and p.tier("cpu").pinned_bytes == HOP_BUFFERS
    assert p.moe_summary == "attention 2/2 on GPU, experts 2/2 layers on GPU"
    below = plan(spec, SLOW_CPU, Budget(need - 1, 10**6, margin_frac=0), WORKLOAD)
    assert [u.name for u in below.units if u.weight_tier != "gpu"] == ["embed"]  # last in the residency order
    assert below.tier("gpu").total_bytes == need - EMBED


def test_staging_slots_sized_for_attention_parts_when_experts_slots_do_not_fit():
    """Two slots of an experts unit (2 x 98816) do not fit, two of an attention part do: attention parts stream
    and the experts compute on the CPU. Workspace, two layer slots and both layers' KV (the KV of a layer that
    streams in decode lives on the GPU): 15616 + 2 * 24832 + 2 * 2176 = 69632. One byte less leaves room for
    one layer's KV only, so layer.1 decodes on the CPU."""
    spec = spec_from_config(TINY_MOE)
    p = plan(spec, SLOW_CPU, Budget(69_632, 10**6, margin_frac=0), WORKLOAD)
    assert [(u.name, u.decode) for u in p.units if u.decode != "cpu"] == [("layer.0", "stream"), ("layer.1", "stream")]
    assert all(u.prefill == u.decode == "cpu" for u in p.units if u.kind == "experts")
    assert p.staging_slot_bytes == LAYER and p.prefetch_depth == 2
    assert p.tier("gpu").total_bytes == 69_632
    below = plan(spec, SLOW_CPU, Budget(69_631, 10**6, margin_frac=0), WORKLOAD)
    assert [(u.name, u.decode) for u in below.units if u.decode != "cpu"] == [("layer.0", "stream")]
    assert below.unit("layer.1").kv_tier == "cpu" and below.tier("gpu").total_bytes == 69_632 - KV


def test_the_hand_over_to_the_experts_moves_twice_the_hidden_state():
    """Attention parts on the GPU, experts on the CPU: each layer hands [1, 2 x 64] fp16 to its experts (256 bytes
    over 1e9 B/s) and gets [1, 64] back (128 bytes), each hand-over 20 us of latency besides."""
    spec = spec_from_config(TINY_MOE)
    hw, phase = tiny_hw(), Phase("decode", 1, 1, 12, 12)
    units = spec.units()
    costs = [unit_cost(spec, u, "fp16", hw, phase) for u in units]
    modes = ["gpu" if u.kind != "experts" else "cpu" for u in units]
    step = price_step(spec, hw, phase, costs, [u.kind for u in units], modes, modes, modes, 2, "torch", steady=True)
    assert hop_s(spec, hw, phase, 2) == pytest.approx(20e-6 + 256 / 1e9)
    assert step.hop_s == pytest.approx(2 * (20e-6 + 256 / 1e9) + 2 * (20e-6 + 128 / 1e9))


@pytest.fixture(scope="module")
def mixtral():
    return load_spec(MODELS / "mixtral-8x7b")


def _experts(spec):
    return next(u for u in spec.units() if u.kind == "experts")


def test_decode_reads_the_experts_a_token_routes_to_and_a_copy_moves_all(mixtral):
    """Mixtral routes each token to 2 of 8 experts: at batch 1 a CPU or resident-GPU step reads a quarter of the
    experts' bytes (and the router); a copy to the GPU moves all of them, as a disk read does."""
    hw, unit = load_hardware("rtx4090-ddr5"), _experts(mixtral)
    w_bytes = unit.nbytes("q4_0", "fp16")
    router = 8 * 4096 * 2  # [8, 4096] in fp16
    cost = unit_cost(mixtral, unit, "q4_0", hw, Phase("decode", 1, 1, 512, 512))
    touched = router + (w_bytes - router) * 2 / 8
    assert cost.cpu_s == pytest.approx(touched / hw.cpu_mem_bps)  # bandwidth-bound at one row per expert
    assert cost.cpu_s / (w_bytes / hw.cpu_mem_bps) == pytest.approx(2 / 8, rel=1e-3)
    assert cost.host_cpu_s == pytest.approx(touched / hw.cpu_mem_bps)
    assert cost.gpu_s == pytest.approx(touched / hw.gpu_mem_bps + MOE_GROUPED_LAUNCHES * GPU_LAUNCH_S)
    assert cost.pcie_s == pytest.approx(w_bytes / hw.h2d_pinned_bps)
    assert cost.disk_s == pytest.approx(w_bytes / hw.disk_read_bps)
    assert cost.host_mem_s == pytest.approx(w_bytes / hw.cpu_mem_bps)


def test_gpu_experts_pay_the_grouped_kernels_launches_once_or_the_loops_per_picked_expert(mixtral):
    """On the GPU an experts unit costs the bytes of the experts picked plus its launches: q4_0 (and float) experts
    run grouped, 20 launches whichever experts 1 or 8 tokens pick; q4_k experts loop, 12 launches, a host sync
    and 8 per expected picked expert (2 for a token, 8 x (1 - 0.75^8) = 7.20 for 8)."""
    hw, unit = load_hardware("rtx4090-ddr5"), _experts(mixtral)
    router = 8 * 4096 * 2
    for fmt, n_tokens in [("q4_0", 1), ("q4_0", 8), ("bf16", 8), ("q4_k", 1), ("q4_k", 8)]:
        w_bytes = unit.nbytes(fmt, "fp16")
        picked = 8 * (1 - 0.75**n_tokens)
        bytes_s = (router + (w_bytes - router) * picked / 8) / hw.gpu_mem_bps
        flops_s = 2 * unit.linear_numel * n_tokens * 2 // 8 / hw.gpu_flops
        launches_s = MOE_GROUPED_LAUNCHES * GPU_LAUNCH_S
        if fmt == "q4_k":
            launches_s = (MOE_LOOP_LAUNCHES[0] + MOE_LOOP_LAUNCHES[1] * picked) * GPU_LAUNCH_S + HOP_LATENCY_S
        cost = unit_cost(mixtral, unit, fmt, hw, Phase("decode", n_tokens, n_tokens, 512, 512))
        assert cost.gpu_s == pytest.approx(max(bytes_s, flops_s) + launches_s), (fmt, n_tokens)


def test_a_prefill_touches_nearly_every_expert(mixtral):
    """512 tokens routed 2 of 8: 8 x (1 - 0.75^512) experts, all of them to float precision; the step is bound by
    the active FLOPs (2 of 8 experts per token)."""
    hw, unit = load_hardware("rtx4090-ddr5"), _experts(mixtral)
    w_bytes = unit.nbytes("q4_0", "fp16")
    cost = unit_cost(mixtral, unit, "q4_0", hw, Phase("prefill", 1, 512, 256, 0))
    assert cost.host_cpu_s == pytest.approx(w_bytes / hw.cpu_mem_bps)
    flops = 2 * unit.linear_numel * 512 * 2 // 8
    assert cost.cpu_s == pytest.approx(flops / hw.cpu_flops["q4_0"]) and cost.cpu_s > w_bytes / hw.cpu_mem_bps


def test_calibrated_cpu_rate_is_taken_at_the_rows_each_expert_gets(mixtral):
    """8 tokens routed 2 of 8 run 8 x (1 - 0.75^8) = 7.20 experts of 16 / 7.20 = 2.22 rows each: the calibrated
    matmul rate is the curve's at 2.22 rows, not at 8."""
    curve = {"q4_0": ((1, 5e10), (16, 8e11))}
    hw = load_hardware("rtx4090-ddr5").with_changes(cpu_flops_by_rows=curve)
    unit = _experts(mixtral)
    cost = unit_cost(mixtral, unit, "q4_0", hw, Phase("decode", 8, 8, 512, 512))
    rows = 16 / (8 * (1 - 0.75**8))
    flops = 2 * unit.linear_numel * 8 * 2 // 8
    assert cost.cpu_s == pytest.approx(flops / hw.cpu_matmul_rate("q4_0", rows))
    assert cost.cpu_s > 1.5 * flops / hw.cpu_matmul_rate("q4_0", 8)


def test_a_layer_reads_all_its_weights():
    spec = spec_from_config({**TINY_MOE, "model_type": "llama", "intermediate_size": 128})
    layer = spec.units()[1]
    cost = unit_cost(spec, layer, "fp16", tiny_hw(), Phase("decode", 1, 1, 12, 12))
    assert cost.host_cpu_s == cost.host_mem_s == layer.nbytes("fp16", "fp16") / 1e10


@pytest.mark.parametrize("workload, phase", [
    (Workload(1, 16, 2048), "decode"), (Workload(1, 2048, 1), "prefill"), (Workload(4, 1024, 1), "prefill"),
    (Workload(16, 256, 64), None)])  # the last one at 22.5 -> 23 GiB once streamed an experts unit in decode
def test_more_gpu_memory_never_predicts_a_slower_moe_job(mixtral, workload, phase):
    """Mixtral q4_0 on the RTX 3090 preset, GPU budgets from 0 to 30 GiB by 0.5 GiB: the job never gets slower, nor
    the phase that makes up the job (decode over 2048 tokens, or a prefill with one token to generate)."""
    hw = load_hardware("rtx3090-ddr4")
    last = None
    for gib in [g / 2 for g in range(61)]:
        p = plan(mixtral, hw, Budget(int(gib * 2**30), 48 * 2**30), workload, "q4_0")
        times = (p.job_s, getattr(p, phase).step_s if phase else 0.0)
        if last is not None:
            assert times[0] <= last[0] * (1 + 1e-9) and times[1] <= last[1] * (1 + 1e-9), (gib, times, last)
        last = times
    assert p.n_gpu_units == len(p.units)  # 30 GiB holds all of it


def test_mixtral_on_a_24gb_gpu_keeps_attention_there_and_splits_the_experts(mixtral):
    """Mixtral-8x7B q4_0 (24.6 GiB) at batch 1 on the rtx4090-ddr5 preset with 22 GiB of it: every attention part
    and its KV cache on the GPU, as many experts layers as fit beside them and two staging slots, the others
    computed on the CPU in decode (a token reads 2 of their 8 experts) and streamed in prefill."""
    request = PlanRequest.of(quantization="q4_0", hardware="rtx4090-ddr5", gpu_memory="22GiB", batch_size=1)
    p = plan_for(mixtral, request.profile(), request)
    print("\n" + p.table())
    assert all(u.weight_tier == "gpu" and u.kv_tier == "gpu" for u in p.units if u.kind == "layer")
    m = re.fullmatch(r"attention 32/32 on GPU, experts (\d+)/32 layers on GPU, (\d+) on CPU \(decode\), "
                     r"(\d+) streamed \(prefill\)", p.moe_summary)
    assert m, p.moe_summary
    on_gpu, on_cpu, streamed = map(int, m.groups())
    assert 0 < on_gpu < 32 and on_gpu + on_cpu == 32 and streamed == on_cpu
    assert p.moe_summary in p.table() and p.moe_summary in p.explain()
    assert re.search(rf"^experts\.0-{on_gpu - 1} +{on_gpu} ", p.table(), re.M)  # experts units merged in one row
    assert json.loads(p.to_json())["moe_summary"] == p.moe_summary
    assert all(t.total_bytes <= t.budget_bytes for t in p.tiers)
    assert p.staging_slot_bytes == _experts(mixtral).buffer_bytes("q4_0", "bf16")


def test_a_dense_plan_has_no_moe_summary():
    p = plan(spec_from_config({**TINY_MOE, "model_type": "llama"}), tiny_hw(), Budget(10**6, 10**6), WORKLOAD)
    assert p.moe_summary is None and "moe_summary" not in json.loads(p.to_json())


@pytest.mark.parametrize("name, active_b, n_experts, top_k", [
    ("mixtral-8x7b", 12.9, 8, 2), ("qwen3-30b-a3b", 3.3, 128, 8), ("qwen3-235b-a22b", 22.0, 128, 8)])
def test_shipped_moe_configs_match_published_active_sizes(name, active_b, n_experts, top_k):
    """Parameters a token runs (published: 12.9B, 3.3B, 22B); totals are checked in tests/test_spec_planner.py."""
    spec = load_spec(MODELS / name)
    assert (spec.moe.n_experts, spec.moe.top_k, spec.moe.dense_layers) == (n_experts, top_k, ())
    idle = sum(u.linear_numel for u in spec.units() if u.kind == "experts") * (1 - top_k / n_experts)
    assert (spec.n_params - idle) / 1e9 == pytest.approx(active_b, rel=2e-2)


def test_the_qwen3_30b_job_plans_for_an_8gb_gpu(capsys):
    config = ROOT / "configs" / "qwen3-30b-a3b-8gb.yaml"
    assert main(["plan", str(config), "--model", "qwen3-30b-a3b", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["weight_format"] == "q4_0" and data["budget"]["gpu_bytes"] == 7 * 2**30
    assert data["tiers"]["gpu"]["total_bytes"] <= 7 * 2**30 and data["tiers"]["cpu"]["total_bytes"] <= 24 * 2**30
    assert data["moe_summary"].startswith("attention 48/48 on GPU, experts ")

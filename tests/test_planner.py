"""The planner: byte-exact budgets on tiny specs, CPU-only and disk plans, errors, the Plan's views."""

import json

import pytest

from offload.planner.costs import PAGE_BYTES, READ_PAGE_CACHE_BYTES

from offload.errors import PlanError
from offload.hardware import HardwareProfile
from offload.planner import Budget, Workload, plan
from offload.formats import WEIGHT_FORMATS as FORMATS
from offload.spec import spec_from_config

TINY = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 256, "torch_dtype": "bfloat16"}
WORKLOAD = Workload(batch_size=1, prompt_len=8, gen_len=8)

# Hand-computed bytes of TINY in bf16 (see tests/test_spec_planner.py for the per-tensor sums):
EMBED = LM_HEAD = 256 * 64 * 2  # 32768
LAYER = 2 * (36864 + 128)  # 73984
NORM = 64 * 2  # 128
WEIGHTS = EMBED + 2 * LAYER + NORM + LM_HEAD  # 213632
# K and V x (1 seq x one block of 16 slots (8 + 8 positions write 15) + the pool's trash slot) x kv_size 32 x fp16
KV = 2 * (1 * 16 + 1) * 32 * 2  # 2176 per layer
# Workspace: residual of the prompt [8, 64] + one layer's working set for an 8-token chunk over 8 keys
# (8 tokens x 576 elements + attention: 8 tokens read the cache in place, the decode kernel's fp32 partials of one
# split per KV head, 2 x (2 query heads x 8 queries) x (head_dim 16 + max and sum) x 4 = 2304) + fp32 logits [1, 256].
ATTENTION = 2 * (2 * 8) * (16 + 2) * 4  # 2304
WS_GPU = 8 * 64 * 2 + (8 * 576 * 2 + ATTENTION) + 256 * 4  # 1024 + 11520 + 1024 = 13568
WS_CPU = 8 * 64 * 4 + (8 * 576 * 4 + ATTENTION) + 256 * 4  # 2048 + 20736 + 1024 = 23808
HOP_BUFFERS = 2 * 8 * 64 * 4  # two fp32 [8, 64] hand-over buffers in pinned memory = 4096


def tiny_hw(vram_bytes: int = 10**6, **changes) -> HardwareProfile:
    hw = HardwareProfile(name="tiny", vram_bytes=vram_bytes, ram_bytes=10**7, disk_bytes=10**8, n_cores=2,
                         h2d_pinned_bps=1e9, h2d_pageable_bps=3e8, gpu_flops=1e12, gpu_mem_bps=1e11,
                         cpu_mem_bps=1e10, cpu_flops={f: 1e10 for f in FORMATS}, disk_read_bps=1e9)
    return hw.with_changes(**changes)


def test_everything_resident_when_the_gpu_holds_it_byte_exact():
    spec = spec_from_config(TINY)
    p = plan(spec, tiny_hw(), Budget(gpu_bytes=10**6, cpu_bytes=10**6, margin_frac=0.05), WORKLOAD)
    assert p.summary_line == "blocks: 5 of 5 resident on the GPU; 0 read from disk"
    gpu, cpu = p.tier("gpu"), p.tier("cpu")
    assert (gpu.weights_bytes, gpu.kv_bytes, gpu.workspace_bytes, gpu.staging_bytes) == (WEIGHTS, 2 * KV, WS_GPU, 0)
    assert gpu.margin_bytes == 50_000  # 5% of 10**6
    assert gpu.total_bytes == 213632 + 4352 + 13568 + 50_000 == 281_552
    assert (cpu.weights_bytes, cpu.kv_bytes, cpu.workspace_bytes, cpu.pinned_bytes) == (0, 0, 0, HOP_BUFFERS)
    assert all(u.prefill == u.decode == "gpu" for u in p.units)
    assert p.prefetch_depth == 0 and p.staging_slot_bytes == 0


def test_cpu_only_fits_to_the_byte_and_fails_one_byte_below():
    spec = spec_from_config(TINY)
    need = WEIGHTS + 2 * KV + WS_CPU  # 213632 + 4352 + 23808 = 241792; no GPU, so no pinned buffers
    p = plan(spec, tiny_hw(vram_bytes=0), Budget(0, need, margin_frac=0), WORKLOAD)
    assert p.tier("cpu").total_bytes == need == 241_792
    assert p.tier("gpu").total_bytes == 0 and p.summary_line == ("blocks: 0 of 5 resident on the GPU; decode streams 0 and computes 5 on the CPU; "
                                                            "prefill streams 0 and computes 5 on the CPU; 0 read from disk")
    assert all(u.weight_tier == "cpu" and u.prefill == u.decode == "cpu" for u in p.units)
    assert all(u.kv_tier == "cpu" for u in p.units if u.kind == "layer")
    with pytest.raises(PlanError, match=r"raise --cpu-memory by 1 B to hold every weight in RAM"):
        plan(spec, tiny_hw(vram_bytes=0), Budget(0, need - 1, margin_frac=0), WORKLOAD)


def _pages(n: int) -> int:
    return -(-n // PAGE_BYTES) * PAGE_BYTES


def test_disk_spill_moves_the_embedding_first_byte_exact():
    """An embedding on disk is read a row at a time: moving it first frees 32768 bytes and needs no read-ahead."""
    spec = spec_from_config(TINY)
    p = plan(spec, tiny_hw(vram_bytes=0), Budget(0, 240_511, disk_bytes=10**6, margin_frac=0), WORKLOAD)
    assert [u.name for u in p.units if u.weight_tier == "disk"] == ["embed"]
    assert p.tier("cpu").total_bytes == 241_792 - EMBED and p.tier("cpu").pinned_bytes == 0
    assert p.read_ahead_depth == 0 and p.read_buffer_bytes == 0


def test_disk_spill_counts_the_read_ahead_arena_and_the_page_cache_in_flight():
    """With layers of ~13 MiB, layers go to disk from the last; the host budget counts the arena the executor
    allocates (the two largest consecutive disk units, page-rounded) and the page cache the dropped reads hold
    beside it (a unit's worth, at most READ_PAGE_CACHE_BYTES). With TINY's 74 KB layers, moving one to disk never
    pays: it needs more than it frees."""
    spec = spec_from_config({**TINY, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 6})
    weights = sum(u.nbytes("bf16", "bf16") for u in spec.units())
    budget = Budget(0, int(0.6 * weights), disk_bytes=10**9, margin_frac=0)
    p = plan(spec, tiny_hw(vram_bytes=0), budget, WORKLOAD)
    read = [u for u in p.units if u.weight_tier == "disk" and u.kind != "embed"]
    assert [u.name for u in read] == [f"layer.{i}" for i in range(6 - len(read), 6)] and len(read) >= 2
    sizes = [u.weight_bytes for u in read]  # bf16 layers: the buffer is the weights
    arena = 2 * max(_pages(n) for n in sizes)
    assert p.read_buffer_bytes == arena and p.read_ahead_depth == 2
    cpu = p.tier("cpu")
    assert cpu.pinned_bytes == arena + min(max(sizes), READ_PAGE_CACHE_BYTES)
    assert cpu.total_bytes == cpu.weights_bytes + cpu.kv_bytes + cpu.workspace_bytes + cpu.pinned_bytes
    assert cpu.total_bytes <= budget.cpu_bytes and p.decode.disk_s > 0


def test_streaming_reserves_staging_slots_byte_exact():
    spec = spec_from_config(TINY)
    # Workspace, two staging slots of a layer (the largest streamed unit) and both layers' KV on the GPU:
    # 13568 + 2 * 73984 + 2 * 2176 = 165888. Making lm_head resident instead would need
    # 13568 + 32768 + 128 + 2 * 73984 = 194432 before any KV, so the plan streams everything.
    budget = Budget(gpu_bytes=165_888, cpu_bytes=10**6, margin_frac=0)
    hw = tiny_hw(cpu_flops={f: 1e8 for f in FORMATS})  # a slow CPU: streaming wins
    p = plan(spec, hw, budget, WORKLOAD)
    assert [u.decode for u in p.units] == ["cpu", "stream", "stream", "stream", "stream"]
    assert [u.weight_tier for u in p.units] == ["cpu"] * 5
    assert p.staging_slot_bytes == LAYER and p.prefetch_depth == 2
    gpu = p.tier("gpu")
    assert (gpu.weights_bytes, gpu.kv_bytes, gpu.workspace_bytes, gpu.staging_bytes) == (0, 2 * KV, WS_GPU, 2 * LAYER)
    assert gpu.total_bytes == budget.gpu_bytes == 165_888
    assert p.decode.pcie_s > 0 and p.decode.cpu_s < 1e-4  # only the embedding gather runs on the CPU


def test_no_gpu_means_no_gpu_use_even_with_a_gpu_budget():
    spec = spec_from_config(TINY)
    p = plan(spec, tiny_hw(vram_bytes=0), Budget(10**6, 10**6), WORKLOAD)
    assert p.tier("gpu").total_bytes == 0
    assert {u.decode for u in p.units} == {"cpu"}


def test_plan_error_says_what_is_short_and_what_helps():
    spec = spec_from_config(TINY)
    with pytest.raises(PlanError) as e:
        plan(spec, tiny_hw(vram_bytes=0), Budget(0, 100_000), Workload(batch_size=64, prompt_len=8, gen_len=8))
    msg = str(e.value)
    assert "cpu memory" in msg and "short by" in msg and "raise --cpu-memory by" in msg
    # one sequence does not fit either, and no quantization saves the 1.75 MiB short: neither is offered
    assert "--batch-size" not in msg and "--quantization" not in msg and "--disk-memory by" in msg


def test_plan_json_and_table():
    spec = spec_from_config(TINY)
    p = plan(spec, tiny_hw(), Budget(10**6, 10**6), WORKLOAD, weight_format="q8_0")
    data = json.loads(p.to_json())
    assert data["summary"] == p.summary_line and data["weight_format"] == "q8_0"
    assert [u["name"] for u in data["units"]] == ["embed", "layer.0", "layer.1", "norm", "lm_head"]
    assert data["tiers"]["gpu"]["total_bytes"] == p.tier("gpu").total_bytes
    assert data["phases"]["decode"]["tokens_per_s"] == pytest.approx(p.decode.tokens_per_s)
    text = p.table()
    assert p.summary_line in text and "tokens/s" in text and "compute split" in text
    assert "resident on the GPU" in p.explain() and str(p) == text


def test_plan_is_frozen():
    p = plan(spec_from_config(TINY), tiny_hw(), Budget(10**6, 10**6), WORKLOAD)
    with pytest.raises(AttributeError):
        p.prefetch_depth = 3


def test_the_cuda_context_reserve_counts_against_the_gpu_budget_byte_exact():
    """The profile's gpu_reserved_bytes (CUDA context, cuBLAS workspaces) is inside an explicit GPU budget."""
    spec = spec_from_config(TINY)
    hw = tiny_hw(gpu_reserved_bytes=20_000)
    need = WEIGHTS + 2 * KV + WS_GPU + 20_000  # 213632 + 4352 + 13568 + 20000 = 251552, no margin
    p = plan(spec, hw, Budget(gpu_bytes=need, cpu_bytes=10**6, margin_frac=0), WORKLOAD)
    assert p.tier("gpu").reserved_bytes == 20_000 and p.tier("gpu").total_bytes == need == 251_552
    assert p.n_gpu_units == 5
    assert plan(spec, hw, Budget(gpu_bytes=need - 1, cpu_bytes=10**6, margin_frac=0), WORKLOAD).n_gpu_units < 5


def test_disk_units_the_page_cache_keeps_are_computed_in_place():
    """With page cache room beside the budget for every disk unit, the plan leaves them to it: computed from mapped
    pages, with no read-ahead arena, no page cache in flight and no disk time; with no room, none of them."""
    spec = spec_from_config({**TINY, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 6})
    weights = sum(u.nbytes("bf16", "bf16") for u in spec.units())
    hw = tiny_hw(vram_bytes=0)
    for room, kept in ((10**12, "all"), (1, "none")):
        budget = Budget(0, int(0.6 * weights), disk_bytes=10**9, margin_frac=0, page_cache_bytes=room)
        p = plan(spec, hw, budget, WORKLOAD)
        read = [u for u in p.units if u.weight_tier == "disk" and u.kind != "embed"]
        assert read and all(u.page_cached == (kept == "all") for u in read)
        if kept == "all":
            assert p.read_buffer_bytes == 0 and p.tier("cpu").pinned_bytes == 0 and p.decode.disk_s < 1e-3
        else:
            assert p.read_buffer_bytes > 0 and p.decode.disk_s > 0


def test_spilling_counts_no_read_ahead_for_the_units_the_page_cache_keeps():
    """Units go to disk only until the budget holds: where the page cache keeps them, no read-ahead arena is
    counted for them while the planner spills, so a budget short of the weights by about one layer spills about
    one layer (with the arena counted, every layer had gone, or the plan had not fit)."""
    spec = spec_from_config({**TINY, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 6})
    layer = next(u for u in spec.units() if u.kind == "layer").nbytes("bf16", "bf16")
    hw = tiny_hw(vram_bytes=0)
    full = plan(spec, hw, Budget(0, 10**10, margin_frac=0), WORKLOAD).tier("cpu").total_bytes
    budget = Budget(0, full - layer // 2, disk_bytes=10**9, margin_frac=0, page_cache_bytes=10**12)
    p = plan(spec, hw, budget, WORKLOAD)
    on_disk = [u.name for u in p.units if u.weight_tier == "disk"]
    assert p.tier("cpu").total_bytes <= budget.cpu_bytes and p.read_buffer_bytes == 0
    assert sum(n.startswith("layer.") for n in on_disk) <= 1 and len(on_disk) <= 2, on_disk

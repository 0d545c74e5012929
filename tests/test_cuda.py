"""GPU backend tests. Those of placements run on the simulated GPU everywhere (as strict as CUDA about where
tensors live: offload.runtime.backends.sim_device) and on CUDA where there is a GPU; those of CUDA itself (events,
the allocator, calibration) are skipped without one and run by scripts/gpu_check.sh on one."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_logits_close, gpu_profile, make_hf_model, offload_logits, save_hf_model
from offload.weights.sources import load_model
from offload.weights.sources import CheckpointSource
from offload.runtime.executor import PlacedModel
from offload.planner.placement import Placement
from offload.spec import load_spec
from offload.weights.loader import Checkpoint

CUDA_ONLY = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEVICES = [pytest.param("sim"), pytest.param("cuda", marks=CUDA_ONLY)]
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def gpu_backend(device: str):
    """The simulated GPU or CUDA's backend."""
    if device == "sim":
        from offload.runtime.backends.sim import SimBackend

        return SimBackend(gpu_profile())
    from offload.runtime.backends.cuda import CUDABackend

    return CUDABackend()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = save_hf_model(make_hf_model("llama", num_hidden_layers=4), tmp_path_factory.mktemp("m") / "tiny")
    return folder, load_spec(folder)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mix", [("gpu", "gpu"), ("cpu", "stream"), ("disk", "stream"), 0, 1, 2])
@pytest.mark.parametrize("quantization", ["none", "q8_0", "q4_0"])
def test_cuda_placements_match_cpu(tiny, mix, quantization, device):
    """fp32 on the GPU against the CPU: the float model for none (1e-4 of the logit range); for q8_0/q4_0 the
    model with the same quantized weights dequantized (1e-4 where every block computes on the GPU, 3e-2 where
    CPU blocks quantize their activations), as tests/test_executor.py checks on the CPU backend."""
    from test_executor import dequantized

    folder, spec = tiny
    placement = Placement.random(spec, mix) if isinstance(mix, int) else Placement.uniform(spec, *mix)
    source = CheckpointSource(Checkpoint(folder), spec, torch.float32, quantization)
    model = PlacedModel(spec, source, placement, gpu_backend(device), torch.float32)
    reference = load_model(Checkpoint(folder), spec, quantization=quantization)
    if quantization != "none":
        reference = dequantized(reference)
    ids = [5, 17, 33, 2, 90, 11, 4]
    device_only = all(p.prefill in ("gpu", "stream") for p in placement.units.values())
    rel = 1e-4 if quantization == "none" or device_only else 3e-2
    assert_logits_close(offload_logits(model, ids), offload_logits(reference, ids), rel=rel)
    model.flush()
    assert "gpu_block" in {s.kind for s in model.timeline.spans}


def bf16_placement_logits(tiny, mix, quantization, backends) -> list[torch.Tensor]:
    """The logits of one prompt through the same placement in bf16 on each backend."""
    folder, spec = tiny
    placement = Placement.random(spec, mix) if isinstance(mix, int) else Placement.uniform(spec, *mix)
    out = []
    for backend in backends:
        source = CheckpointSource(Checkpoint(folder), spec, torch.bfloat16, quantization)
        model = PlacedModel(spec, source, placement, backend, torch.bfloat16)
        out.append(offload_logits(model, [5, 17, 33, 2, 90, 11, 4]).float())
        model.flush()
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mix", [("cpu", "stream"), ("disk", "stream"), ("cpu", "cpu"), 0, 1, 2])
@pytest.mark.parametrize("quantization", ["none", "q4_0"])
def test_cuda_bf16_placements_match_the_cpu_backend(tiny, mix, quantization, device):
    """bf16, the compute format GPU plans run in: device blocks, copies from pinned host buffers and CPU blocks
    through the fused C++ layer with bf16 hand-overs and caches, against the same placement on the CPU backend in
    bf16, within 3e-2 of the logit range (bf16 sums in another order on each device)."""
    from offload.runtime.backends.cpu import CPUBackend

    ours, ref = bf16_placement_logits(tiny, mix, quantization, [gpu_backend(device), CPUBackend()])
    assert_logits_close(ours, ref, rel=3e-2)


@pytest.mark.cuda
@cuda_only
def test_cuda_timings_are_resolved_as_steps_go_not_held_to_the_end(tiny):
    """Each step's start turns the device work already done into timeline spans and lets its events go: after a
    generate call of many decode steps, no more than about a step's events are still pending."""
    from offload.engine import run_to_end
    from offload.generate import Generator
    from offload.sequence import Sequence
    from offload import SamplingParams
    from offload.runtime.backends.cuda import CUDABackend

    folder, spec = tiny
    model = PlacedModel(spec, CheckpointSource(Checkpoint(folder), spec, torch.bfloat16), Placement.uniform(spec, "cpu",
                        "stream"), CUDABackend(), torch.bfloat16)
    seqs = [Sequence(0, [5, 17, 33], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))]
    run_to_end(Generator(model, max_batch_size=1), seqs)
    per_step = 3 * len(model.order)  # a copy, a wait and a block per streamed unit
    assert 0 < len(model.backend._pending) <= 2 * per_step and len(model.timeline.spans) > 8 * per_step
    model.flush()
    assert not model.backend._pending


@pytest.mark.cuda
@cuda_only
def test_cuda_peak_memory_within_plan(tiny):
    """What offload allocates on the device stays within the planned GPU tier. The backend's compute stream gets a
    cuBLAS workspace of its own (32 MiB on sm_90, through torch's allocator: seen on an H200, where this test
    once warmed other streams only and found 34 MB over a 3 MiB tier); it is part of the CUDA reserve a
    calibrated profile counts in the GPU budget, so the plan here reserves it, and what the tier says it uses
    (weights, KV, workspace, staging, margin and that reserve) is checked.
    What earlier tests left on the device is outside it: it exists before the baseline is taken."""
    from offload import LLM, SamplingParams
    from offload.runtime.backends.cuda import CUBLAS_WORKSPACE_BYTES

    folder, _ = tiny
    torch.ones(64, 64, device="cuda") @ torch.ones(64, 64, device="cuda")  # the default stream's workspace
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    hardware = gpu_profile().with_changes(gpu_reserved_bytes=CUBLAS_WORKSPACE_BYTES)
    llm = LLM(str(folder), hardware=hardware, gpu_memory=8 * 2**20 + CUBLAS_WORKSPACE_BYTES, cpu_memory="1GiB",
              backend="cuda", host_baseline=0, batch_size=4, max_model_len=64, dtype="fp32")
    llm.generate([[1, 2, 3, 4, 5]] * 4, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    tier = llm.plan.tier("gpu")
    assert tier.reserved_bytes == CUBLAS_WORKSPACE_BYTES and tier.weights_bytes > 0
    assert torch.cuda.max_memory_allocated() - baseline <= tier.total_bytes


@pytest.mark.parametrize("device", DEVICES)
def test_cuda_blocks_with_kv_cache_in_cpu_ram(tiny, device):
    import dataclasses

    folder, spec = tiny
    units = {n: dataclasses.replace(p, kv="cpu") for n, p in Placement.uniform(spec, "cpu", "stream").units.items()}
    source = CheckpointSource(Checkpoint(folder), spec, torch.float32)
    model = PlacedModel(spec, source, Placement(units), gpu_backend(device), torch.float32)
    ids = [5, 17, 33, 2, 90, 11, 4]
    assert_logits_close(offload_logits(model, ids), offload_logits(load_model(Checkpoint(folder), spec), ids))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize("mix", ["all-gpu-side", "experts-cpu-rest-gpu", "experts-streamed-rest-cpu", "random"])
@pytest.mark.parametrize("quantization", ["none", "q4_0"])
def test_cuda_moe_placements_match_the_cpu_backend(tmp_path, arch, mix, quantization, device):
    """A MoE model on the CUDA backend computes what the CPU backend computes for the same placement: attention
    parts, shared and routed experts on the GPU (resident or streamed) or the CPU, the hand-over between them
    crossing PCIe (1e-4 of the logit range: fp32 on both; the CPU units are the same kernels on both)."""
    from test_moe import MIXES

    from offload.runtime.backends.cpu import CPUBackend

    folder = save_hf_model(make_hf_model(arch), tmp_path / arch)
    spec = load_spec(folder)
    placement = MIXES[mix](spec)

    def logits(backend):
        source = CheckpointSource(Checkpoint(folder), spec, torch.float32, quantization)
        return offload_logits(PlacedModel(spec, source, placement, backend, torch.float32), [5, 17, 33, 2, 90, 11, 4])

    assert_logits_close(logits(gpu_backend(device)), logits(CPUBackend()), rel=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_layers_attending_over_a_host_kv_cache_match_the_device_cache(tiny, dtype, device):
    """GPU-computed layers whose KV cache is in host RAM (decode attention on the CPU, prefill attention on the GPU
    with the new K/V sent down) give the logits and greedy tokens of the same layers with the cache on the GPU:
    fp32 to 1e-4 of the logit range, bf16 to 2e-2."""
    from dataclasses import replace

    from test_sim import _greedy

    folder, spec = tiny
    device_kv = Placement.uniform(spec, "cpu", "stream")
    host_kv = Placement({n: replace(p, kv="cpu") if n.startswith("layer.") else p
                         for n, p in device_kv.units.items()})
    models = [PlacedModel(spec, CheckpointSource(Checkpoint(folder), spec, dtype, "none"), p, gpu_backend(device),
                          dtype) for p in (host_kv, device_kv)]
    ids = [5, 17, 33, 2, 90, 11, 4]
    rel = 1e-4 if dtype == torch.float32 else 2e-2
    assert_logits_close(offload_logits(models[0], ids), offload_logits(models[1], ids), rel=rel)
    if dtype == torch.float32:  # bf16 sums in another order on the CPU: a near-tie may turn
        assert _greedy(models[0]) == _greedy(models[1])


@pytest.mark.cuda
@cuda_only
def test_the_gpu_calibration_times_each_kernel_and_the_hand_over():
    """The GPU half of calibrate on a small weight: a time for every format's kernels, launches and hand-overs in
    microseconds, not seconds; and linear() run by each kernel as the table picks it gives the same product."""
    from offload.runtime import device_quant
    from offload.runtime.backends.cuda import _random_device_weight, matmul_timer, measure_handover_s, measure_launch_s
    from offload.runtime.calibrate import gpu_formats, gpu_kernels, gpu_matmul_curves

    shape = (256, 512)
    logs = []
    curves = gpu_matmul_curves(matmul_timer(shape, repeats=1, calls=1), gpu_formats(), shape, rows=(1, 64),
                               log=logs.append)
    assert not [line for line in logs if "not measured" in line]  # a kernel that raised is logged, not raised
    assert {fmt: set(c) for fmt, c in curves.items()} == {fmt: set(gpu_kernels(fmt)) for fmt in gpu_formats()}
    assert all(rate > 0 for c in curves.values() for k in c.values() for _, rate in k)
    assert 0 < measure_launch_s(n_launches=20, repeats=1) < 1e-3
    idle, busy = measure_handover_s(copy_bytes=64 << 20, repeats=3)
    assert 0 < idle < 0.1 and 0 < busy < 0.1
    w = _random_device_weight("q4_0", shape)
    x = torch.randn(64, shape[1], device="cuda", dtype=torch.bfloat16)
    try:
        fused = w.apply(x, None)
        device_quant.set_gpu_crossover({"q4_0": 64})
        dequant = w.apply(x, None)
    finally:
        device_quant.set_gpu_crossover({})
    torch.testing.assert_close(fused.float(), dequant.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.cuda
@cuda_only
def test_the_device_peak_sees_memory_the_allocator_gave_back():
    """The sampler reads the device as it is: 256 MiB held for a few samples and freed (empty_cache: gone from the
    allocator's reserve too) still shows in the device's peak, and the peak counts the context the allocator's
    figures miss."""
    import time

    from offload.runtime.backends.cuda import CUDABackend

    backend = CUDABackend()
    try:
        free, total = torch.cuda.mem_get_info()
        before = total - free
        held = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        time.sleep(4 * backend.device_memory.interval_s)
        del held
        torch.cuda.empty_cache()
        peaks = backend.memory_peaks()
        assert peaks["gpu"] >= before + (256 << 20) and peaks["gpu"] > peaks["gpu_reserved"] >= peaks["gpu_allocated"]
    finally:
        backend.close()


@pytest.mark.cuda
@cuda_only
def test_the_context_reserve_counts_the_libraries_a_step_loads():
    """Measured after cuBLAS, attention and a Triton kernel have run: at least the two workspaces and a context,
    less than a few GiB."""
    from offload.runtime.backends.cuda import CUBLAS_WORKSPACE_BYTES, context_reserve_bytes

    reserve = context_reserve_bytes(torch.device("cuda"))
    assert 2 * CUBLAS_WORKSPACE_BYTES + (100 << 20) < reserve < 4 << 30

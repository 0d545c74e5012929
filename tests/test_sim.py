"""The simulated asynchronous device: the executor's schedule on streams that really run apart.

Compute mode computes for real, so what the CPU backend gives is the reference: any placement mix and
quantization must give the same logits and greedy tokens. Copies land late and the compute stream can lag
behind the host, so removing any single wait or slot-release event from the schedule gives a wrong answer.
"""

from __future__ import annotations

import threading

import pytest
import torch

from offload.kernels import layer as fused

from conftest import assert_logits_close, gpu_profile, make_hf_model, offload_logits, save_hf_model
from offload.engine import run_to_end
from offload.errors import DeviceMemoryError
from offload.generate import Generator
from offload.hardware import load_hardware
from offload.planner import Placement
from offload.runtime.backends.base import Work
from offload.runtime.backends.cpu import CPUBackend
from offload.runtime.backends.sim import SimBackend
from offload.runtime.backends.sim_device import SlotOrderError
from offload.runtime.executor import PlacedModel
from offload.sampling import SamplingParams
from offload.sequence import Sequence
from offload.spec import load_spec
from offload.weights.loader import Checkpoint
from offload.weights.sources import CheckpointSource

HW = gpu_profile()  # the rtx4090-ddr5 preset without its CUDA-context reserve: these devices are KiB-sized
UNIFORM = {"all-gpu": ("gpu", "gpu"), "all-streamed": ("cpu", "stream"), "all-cpu": ("cpu", "cpu"),
           "all-disk-streamed": ("disk", "stream"), "all-disk-cpu": ("disk", "cpu")}
MIXES = list(UNIFORM) + ["random-0", "random-1", "random-2"]
PROMPT = [5, 17, 33, 2, 90, 11, 4]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = save_hf_model(make_hf_model("llama", num_hidden_layers=3), tmp_path_factory.mktemp("sim") / "tiny")
    return folder, load_spec(folder)


def _placement(spec, mix: str, **kwargs) -> Placement:
    if mix.startswith("random-"):
        return Placement.random(spec, int(mix.split("-")[1]), **kwargs)
    return Placement.uniform(spec, *UNIFORM[mix], **kwargs)


def _model(tiny, placement, backend, quantization="none") -> PlacedModel:
    folder, spec = tiny
    return PlacedModel(spec, CheckpointSource(Checkpoint(folder), spec, torch.float32, quantization), placement,
                       backend)


def _greedy(model, n=5) -> list[list[int]]:
    seqs = [Sequence(i, p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
            for i, p in enumerate([PROMPT, [7, 1, 150]])]
    run_to_end(Generator(model, max_batch_size=2), seqs)
    return [s.output_ids for s in seqs]


@pytest.mark.parametrize("quantization", ["none", "q8_0", "q4_0"])
@pytest.mark.parametrize("mix", MIXES)
def test_compute_mode_equals_the_cpu_backend(tiny, mix, quantization):
    placement = _placement(tiny[1], mix)
    sim = _model(tiny, placement, SimBackend(HW, time_scale=0.05), quantization)
    ref = _model(tiny, placement, CPUBackend(), quantization)
    # equal to 1e-6 of the logit range: the simulated device's blocks run torch ops on its own thread, where a
    # busy machine can give BLAS another thread split (and so other last bits) than on the main thread. Quantized:
    # 1e-4, since a CPU layer whose KV cache is on the device (random mixes) cannot run the fused C++ layer over
    # it (device memory) and runs the reference block math, which rounds its q8 activations at other points
    rel = 1e-6 if quantization == "none" else 1e-4
    assert_logits_close(offload_logits(sim, PROMPT), offload_logits(ref, PROMPT), rel=rel)
    assert _greedy(sim) == _greedy(ref)


def _logits_with(tiny, placement, backend, monkeypatch=None, patch=None) -> torch.Tensor:
    if patch is not None:
        monkeypatch.setattr(*patch)
    return offload_logits(_model(tiny, placement, backend), PROMPT)


# Each case: the placement, a simulated device where that wait matters, and the wait removed.
SLOW_COPIES = dict(hardware=HW.with_changes(h2d_pinned_bps=2e6), time_scale=1.0)  # ~50 ms per layer copy
LAGGING_COMPUTE = dict(hardware=HW, kernel_delay_s=0.05)  # the compute stream runs 50 ms behind the host
FAST_DISK_SLOW_COPIES = dict(hardware=HW.with_changes(h2d_pinned_bps=2e6, disk_read_bps=1e12), time_scale=1.0)
WAITS = {
    "compute waits for the copy": ("all-streamed", SLOW_COPIES, (SimBackend, "wait_copy", lambda self, h, *a: None)),
    "copy waits for the slot's last compute": (
        "all-streamed", LAGGING_COMPUTE, (SimBackend, "wait_done_before_copy", lambda self, h: None)),
    "release records the compute done": ("all-streamed", LAGGING_COMPUTE, (SimBackend, "mark_done", lambda self: None)),
    "read buffer kept until its copy lands": (
        "all-disk-streamed", FAST_DISK_SLOW_COPIES, (SimBackend, "host_wait", lambda self, h: None)),
}


@pytest.mark.parametrize("case", sorted(WAITS))
def test_removing_any_wait_gives_a_wrong_answer(tiny, monkeypatch, case):
    mix, device, patch = WAITS[case]
    placement = _placement(tiny[1], mix, prefetch_depth=1, read_ahead=1)
    device = dict(device)
    hw = device.pop("hardware")
    good = _logits_with(tiny, placement, SimBackend(hw, **device))
    reference = offload_logits(_model(tiny, placement, CPUBackend()), PROMPT)
    assert_logits_close(good, reference, rel=1e-6)  # with every wait in place the answer is right
    try:  # the strict device names the slot used out of order, else the answer is wrong
        broken = _logits_with(tiny, placement, SimBackend(hw, **device), monkeypatch, patch)
    except SlotOrderError:
        return
    assert not torch.allclose(broken, reference, rtol=1e-3, atol=1e-3)


STRICT_WAITS = {"compute waits for the copy": "before its copy's event was waited on",
                "copy waits for the slot's last compute": "refilled while a compute that read it may still run"}


@pytest.mark.parametrize("case", sorted(STRICT_WAITS))
def test_the_strict_device_refuses_a_slot_used_out_of_order(tiny, monkeypatch, case):
    """Without the wait, the slot's ordering is an error on the simulated device whatever the timing (no slow
    copy or lagging compute is needed to see it)."""
    mix, _, patch = WAITS[case]
    placement = _placement(tiny[1], mix, prefetch_depth=1, read_ahead=1)
    with pytest.raises(SlotOrderError, match=STRICT_WAITS[case]):
        _logits_with(tiny, placement, SimBackend(HW), monkeypatch, patch)


def test_a_compute_that_runs_ahead_of_a_late_copy_is_refused_at_its_read():
    """The copy stream is still busy, so the compute stream reaches the slot before its copy has even begun: the
    read is refused by the host's order of issue (the copy was issued before the op), not by the streams' timing."""
    backend = SimBackend(HW)
    busy = threading.Event()
    backend.copy_stream.enqueue(busy.wait)  # an earlier transfer the new copy queues behind
    slot = backend.alloc("gpu", 16)
    backend.copy_h2d(slot, backend.pin(torch.arange(16, dtype=torch.uint8)), "layers.0", "decode")
    out = backend.launch(Work("layers.0", "layer", "decode", 1), lambda x: x + slot.float().sum(),
                         backend.to_device(torch.zeros(1)))
    try:
        with pytest.raises(SlotOrderError, match=STRICT_WAITS["compute waits for the copy"]):
            backend.to_host(out)
    finally:
        busy.set()


def test_device_memory_is_a_hard_capacity(tiny):
    placement = _placement(tiny[1], "all-gpu")
    with pytest.raises(DeviceMemoryError, match="smaller --gpu-memory"):
        _model(tiny, placement, SimBackend(HW, capacity_bytes=100_000))


def test_a_planned_run_stays_within_the_simulated_device(tmp_path):
    """The executor allocates what the plan budgeted: a device of exactly the GPU budget never overflows, and
    resident, streamed and CPU blocks together give the CPU backend's tokens."""
    from offload.planner import PlanRequest, plan_for, plan_spec

    folder = save_hf_model(make_hf_model("llama", num_hidden_layers=8, hidden_size=128, intermediate_size=256),
                           tmp_path / "tiny8")
    spec = load_spec(folder)
    request = PlanRequest.of(model=str(folder), dtype="fp32", hardware=HW, gpu_memory="7000KiB", cpu_memory="1GiB", batch_size=8,
                             max_model_len=64)
    plan = plan_for(spec, HW, request)
    spec = plan_spec(spec, plan)
    modes = {(u.weight_tier, u.prefill, u.decode) for u in plan.units}
    assert ("gpu", "gpu", "gpu") in modes and any("stream" in m for m in modes) and ("cpu", "cpu", "cpu") in modes
    backend = SimBackend(HW, capacity_bytes=plan.budget.gpu_bytes, time_scale=0.02)
    model = _model((folder, spec), Placement.from_plan(plan), backend)
    tokens = _greedy(model)
    gpu = plan.tier("gpu")
    assert backend.memory.peak_bytes["gpu"] <= gpu.total_bytes - gpu.workspace_bytes - gpu.margin_bytes
    assert tokens == _greedy(_model((folder, spec), Placement.from_plan(plan), CPUBackend()))


def test_a_compute_stalled_on_a_copy_is_a_wait_span(tiny):
    """Copies slower than compute: the GPU waits for weights, and the timeline says for how long."""
    backend = SimBackend(HW.with_changes(h2d_pinned_bps=2e6), time_scale=0.0)
    offload_logits(_model(tiny, _placement(tiny[1], "all-streamed", prefetch_depth=1), backend), PROMPT)
    backend.synchronize()
    waits = [s for s in backend.timeline.spans if s.kind == "wait"]
    assert waits and sum(s.duration_s for s in waits) > 0.5 * backend.timeline.busy_s("pcie", "prefill")


def _host_kv(spec, **kwargs) -> Placement:
    """Layers computed on the GPU (resident, streamed, from disk) with their KV caches in host RAM, beside a CPU layer
    and the default: FlexGen's placement for batches whose cache VRAM cannot hold."""
    from offload.planner.placement import UnitPlacement

    units = dict(Placement.uniform(spec, "cpu", "stream").units)
    units["layer.0"] = UnitPlacement("gpu", "gpu", "gpu", "cpu")
    units["layer.1"] = UnitPlacement("cpu", "stream", "stream", "cpu")
    units["layer.2"] = UnitPlacement("disk", "stream", "cpu", "cpu")
    return Placement(units, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_layers_with_host_kv_equal_the_cpu_backend(tiny, dtype):
    """The executor allocates each layer's cache on the tier its placement names (host RAM here, counted there) and
    a GPU layer over a host cache gives what the CPU backend gives, in fp32 and in the bf16 GPU plans compute in."""
    folder, spec = tiny
    placement = _host_kv(spec)
    models = [PlacedModel(spec, CheckpointSource(Checkpoint(folder), spec, dtype, "none"), placement, backend, dtype)
              for backend in (SimBackend(HW, time_scale=0.05), CPUBackend())]
    cache = models[0].new_cache(2, 16)
    assert all(kv.k.device.type == "cpu" for kv in cache) and models[0]._kv_bytes == {"cpu": sum(kv.nbytes
                                                                                               for kv in cache)}
    rel = 1e-6 if dtype == torch.float32 else 1e-2
    assert_logits_close(offload_logits(models[0], PROMPT), offload_logits(models[1], PROMPT), rel=rel)
    assert _greedy(models[0]) == _greedy(models[1])
    # decode attention over the host caches runs in the fused layer's kernels (q, k, v down, the output up); the
    # reference block math (torch's attention where the cache is) gives the same tokens
    reference = PlacedModel(spec, CheckpointSource(Checkpoint(folder), spec, dtype, "none"), placement, CPUBackend(),
                            dtype)
    reference.fuse = False
    calls = []
    real = fused.cached_attention
    with pytest.MonkeyPatch.context() as m:
        m.setattr(fused, "cached_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
        ours = _greedy(models[0])
    n = 5 if dtype == torch.float32 else 3  # bf16: torch attends in bf16, the kernels in fp32; a near tie may part
    assert len(calls) >= 3 * 3 and [t[:n] for t in ours] == [t[:n] for t in _greedy(reference)]

"""The simulated GPU as strict as CUDA: host and device tensors told apart, host syncs counted per step and named,
long prompts mixed with decoding through GPU-resident, streamed and host-KV layers equal to the CPU backend."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from conftest import gpu_profile, make_hf_model, save_hf_model
from offload.engine import run_to_end
from offload.generate import Generator
from offload.planner import Placement
from offload.planner.placement import UnitPlacement
from offload.profile.report import format_report, phase_report
from offload.runtime.backends import sim_device
from offload.runtime.backends.cpu import CPUBackend
from offload.runtime.backends.sim import SimBackend
from offload.runtime.executor import PlacedModel
from offload.sampling import SamplingParams
from offload.sequence import Sequence
from offload.spec import load_spec
from offload.weights.loader import Checkpoint
from offload.weights.sources import CheckpointSource

HW = gpu_profile()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model = make_hf_model("llama", num_hidden_layers=4, max_position_embeddings=4096)
    folder = save_hf_model(model, tmp_path_factory.mktemp("strict") / "tiny")
    return folder, load_spec(folder)


def test_an_op_mixing_host_and_device_tensors_is_refused():
    device = sim_device.sim_device()
    x = torch.ones(4, 3).to(device)
    with pytest.raises(RuntimeError, match="same device"):
        x + torch.ones(3)
    assert torch.equal((x + torch.tensor(2.0)).cpu(), torch.full((4, 3), 3.0))  # a 0-d host tensor is a scalar
    assert torch.arange(3, device=device).device == device  # made on the device, as CUDA's factories do
    for made, want in ((torch.arange(3, device=device), [0, 1, 2]), (torch.arange(1, 3, device=device), [1, 2]),
                       (torch.arange(0, 7, 3, device=device), [0, 3, 6])):  # their shapes too, not only their values
        assert made.shape == (len(want),) and made.cpu().tolist() == want


def test_what_cuda_makes_wait_is_counted():
    state = sim_device.DeviceState()
    sim_device.activate(state)
    device = sim_device.sim_device()
    x = torch.ones(8, device=device)
    x.sum().item()
    x.tolist()
    x.cpu()
    _ = x[x > 0]  # boolean indexing: the output's size is known only on the device
    pageable = torch.ones(8)
    x.copy_(pageable, non_blocking=True)
    state.pin(pageable)
    x.copy_(pageable, non_blocking=True)  # from page-locked memory: no wait
    whats = Counter(what for (_, what), n in state.syncs.items() for _ in range(n))
    assert whats == {"item": 1, "tolist": 1, "copy to host": 1, "nonzero": 1, "pageable copy": 1}
    assert sum(state.pageable_async_copies.values()) == 1


def _placement(spec, kind: str, **kwargs) -> Placement:
    """all-gpu: resident layers, KV on the device; mixed: resident, streamed and host-KV GPU layers beside a CPU
    layer (the host hands over to it and back)."""
    units = dict(Placement.uniform(spec, "gpu", "gpu").units)
    if kind == "mixed":
        units["layer.1"] = UnitPlacement("cpu", "stream", "stream", "gpu")
        units["layer.2"] = UnitPlacement("gpu", "gpu", "gpu", "cpu")
        units["layer.3"] = UnitPlacement("cpu", "cpu", "cpu", "cpu")
    return Placement(units, **kwargs)


def _model(tiny, placement, backend, dtype=torch.float32) -> PlacedModel:
    folder, spec = tiny
    return PlacedModel(spec, CheckpointSource(Checkpoint(folder), spec, dtype, "none"), placement, backend, dtype)


def _generate(model, prompts, max_tokens) -> list[list[int]]:
    seqs = [Sequence(i, p, SamplingParams(max_tokens=m, temperature=0, ignore_eos=True))
            for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    run_to_end(Generator(model, max_batch_size=len(prompts), max_model_len=2100, step_tokens=768), seqs)
    return [s.output_ids for s in seqs]


def _prompts(lengths, vocab=160) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_prompts_mixed_with_decoding_equal_the_cpu_backend(tiny, dtype):
    """Prompts of 600-2000 tokens (past the 512-token prefill chunk) arrive while short ones decode: mixed steps of
    768 tokens, each layer in chunks of 512, through resident, streamed and host-KV GPU layers and a CPU layer."""
    placement = _placement(tiny[1], "mixed", prefetch_depth=1)
    prompts, max_tokens = _prompts([5, 600, 7, 2000]), [12, 4, 10, 3]
    model = _model(tiny, placement, SimBackend(HW), dtype)
    model.timeline.clear()
    ours = _generate(model, prompts, max_tokens)
    ref = _generate(_model(tiny, placement, CPUBackend(), dtype), prompts, max_tokens)
    # bf16: the device runs other kernels, and bf16 logits tie: the CPU backend's top two logits at the 2000-token
    # prompt's second token are equal in bf16 (the first index wins), where the device and fp32 pick the other
    n = None if dtype == torch.float32 else 1
    assert [t[:n] for t in ours] == [t[:n] for t in ref]
    # the host-KV GPU layer's crossings in mixed steps are page-locked downloads only: no blocking copy of rows,
    # indices or keys to the device, no pageable copy
    host_kv = Counter(s.unit for s in model.timeline.spans if s.kind == "host_sync" and s.unit.startswith("layer.2"))
    assert set(host_kv) == {"layer.2 (copy to host)", "layer.2 output (copy to host)"}, host_kv


def _decode_syncs(model) -> tuple[float, Counter, dict]:
    model.timeline.clear()
    _generate(model, _prompts([6, 9, 4]), [6, 6, 6])
    timeline = model.timeline
    syncs = Counter(s.unit for s in timeline.spans if s.kind == "host_sync" and s.phase == "decode")
    return sum(syncs.values()) / len(timeline.step_s["decode"]), syncs, phase_report(timeline, "decode")


def test_a_gpu_plan_syncs_the_host_at_most_twice_a_decode_step(tiny):
    per_step, syncs, report = _decode_syncs(_model(tiny, _placement(tiny[1], "all-gpu"), SimBackend(HW)))
    assert per_step <= 2, syncs
    assert report["host_syncs_per_step"] == per_step and report["host_syncs_by_unit"] == dict(syncs.most_common())


def test_host_kv_and_cpu_layers_sync_once_per_hand_over(tiny):
    """A host-KV GPU layer waits once (its q, k, v come down to the host's attention); the hand-over to the CPU
    layer once; the hidden state and the logits coming up once each."""
    per_step, syncs, report = _decode_syncs(_model(tiny, _placement(tiny[1], "mixed", prefetch_depth=1),
                                                   SimBackend(HW)))
    assert per_step <= 2 + 1 + 1, syncs
    assert all(any(name in unit for name in ("layer.2", "layer.3", "norm", "lm_head")) for unit in syncs), syncs
    text = format_report({"requests": {"done": 1, "failed": 0, "skipped_already_done": 0, "interrupted": False,
                                       "total": 1}, "tokens": {"prompt": 1, "generated": 1}, "generate_s": 1.0,
                          "generated_tokens_per_s": 1.0, "phases": {"decode": report}, "memory": {}})
    assert "host syncs" in text and "per step" in text


def test_decode_reads_the_cache_in_place_without_repeating_keys(tiny):
    """Decode attention reads each sequence's keys through the step's block table (the paged path); no op on the
    device makes a tensor the size of a K history repeated for the query heads of a group; prefill chunks take a
    fused SDPA form."""
    from offload.kernels.attention import attention_paths, reset_attention_paths

    spec = tiny[1]
    backend = SimBackend(HW)
    model = _model(tiny, _placement(spec, "all-gpu"), backend)
    reset_attention_paths()
    n = 600
    seqs = [Sequence(0, _prompts([n])[0], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))]
    run_to_end(Generator(model, max_batch_size=1, max_model_len=n + 8), seqs)
    paths = attention_paths()
    assert paths.pop("torch_grouped") == 3 * spec.n_layers  # the paged path on a device without Triton
    assert set(paths) <= {"sdpa_causal_lower_right", "sdpa_folded_mask"} and paths
    made = {op: n for (phase, op), n in backend.strict.largest.items() if phase == "decode"}
    repeated = (spec.n_heads // spec.n_kv_heads) * n * spec.n_kv_heads * spec.head_dim
    assert made and max(made.values()) < repeated, sorted(made.items(), key=lambda kv: -kv[1])[:3]


def _launches_per_unit(model, prompts) -> dict[str, int]:
    """Launches each unit made in the run's last decode step, as the simulated GPU counts them."""
    backend, snaps = model.backend, []
    collect = backend.collect
    backend.collect = lambda: snaps.append(Counter(backend.strict.launches)) or collect()
    run_to_end(Generator(model, max_batch_size=len(prompts), max_model_len=64),
               [Sequence(i, p, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)) for i, p in enumerate(prompts)])
    backend.synchronize()
    return dict(Counter(backend.strict.launches) - snaps[-1])


def test_a_gpu_decode_layer_launches_what_the_planner_prices(tiny):
    """The cost model's launches per dense layer (the host's floor on a GPU unit) are what the layer dispatches:
    the simulated GPU's count at batch 2, with the paged attention's torch ops (this device has no Triton)
    replaced by the Triton decode kernel's launches."""
    from offload.kernels.attention import KVTable, paged_attention
    from offload.planner.costs import ATTENTION_DECODE_LAUNCHES, DENSE_LAYER_LAUNCHES, unit_launches

    spec = tiny[1]
    backend = SimBackend(HW)
    counted = _launches_per_unit(_model(tiny, _placement(spec, "all-gpu"), backend), _prompts([5, 9]))
    device = sim_device.sim_device()
    q = torch.zeros(2, 1, spec.n_heads, spec.head_dim, device=device)
    pool = torch.zeros(32, spec.n_kv_heads, spec.head_dim, device=device)
    table = KVTable(torch.zeros(2, 1, dtype=torch.int32, device=device), torch.ones(2, dtype=torch.int32,
                                                                                    device=device), 16, (1, 1))
    before = sum(backend.strict.launches.values())
    paged_attention(q, pool, pool, table, scale=1.0)
    attention = sum(backend.strict.launches.values()) - before
    layer = counted["layer.2"] - attention + ATTENTION_DECODE_LAUNCHES  # layer.0 also makes the step's table
    assert layer == DENSE_LAYER_LAUNCHES == unit_launches(spec, spec.units()[3]), counted


def test_measured_host_seconds_price_gpu_units(tiny):
    """offload calibrate's host seconds of a decode layer bound a GPU layer's price; without them, its launches at
    the measured launch seconds do; a preset prices the roofline alone."""
    from offload.planner.costs import DENSE_LAYER_LAUNCHES, unit_host_s
    from offload.runtime.host_cost import measure_host_s

    spec = tiny[1]
    layer = spec.units()[1]
    assert unit_host_s(spec, layer, HW) == 0.0
    assert unit_host_s(spec, layer, HW.with_changes(gpu_launch_s=1e-5)) == pytest.approx(DENSE_LAYER_LAUNCHES * 1e-5)
    assert unit_host_s(spec, layer, HW.with_changes(gpu_launch_s=1e-5, gpu_layer_host_s=3e-3)) == 3e-3
    measured = measure_host_s(CPUBackend, log=lambda line: None)
    assert measured["layer"] > 0 and measured["experts"] > 0 and measured["layer_device_s"] > 0

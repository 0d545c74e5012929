"""The executor on the CPU backend: every placement mix and quantization gives the resident model's results.

Tolerances (max |diff| relative to the reference's logit range): unquantized placements 1e-5 against the
resident model; quantized device-side blocks (resident or streamed, dequantized with torch ops) 1e-4 against
the dequantized fp32 model; quantized CPU blocks (int8-quantized activations in the kernels) 3e-2.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import assert_logits_close, make_hf_model, offload_logits, save_hf_model
from offload.engine import run_to_end
from offload.generate import Generator
from offload.sequence import Sequence
from offload.model.llama import LayerWeights
from offload.weights.sources import load_model
from offload.weights.sources import CheckpointSource
from offload.runtime.backends.cpu import CPUBackend
from offload.runtime.executor import PlacedModel
from offload.planner.placement import Placement
from offload.sampling import SamplingParams
from offload.spec import load_spec
from offload.weights.loader import Checkpoint

UNIFORM = {"all-resident": ("gpu", "gpu"), "all-cpu": ("cpu", "cpu"), "all-streamed": ("cpu", "stream"),
           "all-disk-streamed": ("disk", "stream"), "all-disk-cpu": ("disk", "cpu")}
MIXES = list(UNIFORM) + ["random-0", "random-1", "random-2", "random-3"]


def placement_for(spec, mix: str, **kwargs) -> Placement:
    if mix.startswith("random-"):
        return Placement.random(spec, int(mix.split("-")[1]), **kwargs)
    return Placement.uniform(spec, *UNIFORM[mix], **kwargs)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = save_hf_model(make_hf_model("llama", num_hidden_layers=4), tmp_path_factory.mktemp("m") / "tiny")
    return folder, load_spec(folder)


def placed(folder, spec, placement, quantization="none", backend=None) -> PlacedModel:
    source = CheckpointSource(Checkpoint(folder), spec, torch.float32, quantization)
    return PlacedModel(spec, source, placement, backend or CPUBackend())


def dequantized(model):
    """The resident model with every packed weight replaced by its fp32 dequantization."""
    deq = lambda w: w if isinstance(w, torch.Tensor) or w is None else w.dequantize()  # noqa: E731
    model.layers = [LayerWeights(**{f.name: deq(getattr(lw, f.name)) for f in dataclasses.fields(lw)})
                    for lw in model.layers]
    model.lm_head = deq(model.lm_head)
    return model


def greedy(model, prompts, n=8) -> list[list[int]]:
    seqs = [Sequence(i, p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)) for i, p in enumerate(prompts)]
    run_to_end(Generator(model, max_batch_size=2), seqs)
    return [s.output_ids for s in seqs]


PROMPTS = [[5, 17, 33, 2, 90, 11, 4], [7, 1, 150], [60, 61, 62, 63, 64]]


@pytest.mark.parametrize("mix", MIXES)
def test_unquantized_placements_equal_resident(tiny, mix):
    folder, spec = tiny
    resident = load_model(Checkpoint(folder), spec)
    model = placed(folder, spec, placement_for(spec, mix))
    assert_logits_close(offload_logits(model, PROMPTS[0]), offload_logits(resident, PROMPTS[0]), rel=1e-5)
    assert greedy(model, PROMPTS) == greedy(resident, PROMPTS)


@pytest.mark.parametrize("quantization", ["q8_0", "q4_0"])
@pytest.mark.parametrize("mix", MIXES)
def test_quantized_placements_match(tiny, mix, quantization):
    folder, spec = tiny
    placement = placement_for(spec, mix)
    model = placed(folder, spec, placement, quantization)
    ours = offload_logits(model, PROMPTS[0])
    device_only = all(p.prefill in ("gpu", "stream") for p in placement.units.values())
    cpu_only = all(p.prefill == "cpu" for p in placement.units.values())
    if device_only:
        reference = dequantized(load_model(Checkpoint(folder), spec, quantization=quantization))
        assert_logits_close(ours, offload_logits(reference, PROMPTS[0]), rel=1e-4)
    elif cpu_only:  # the fused C++ layer against the reference block math over the same packed weights;
        # q8_0's int16 activation quanta move with 1-ulp input differences (tests/test_fused_layer.py's RTOL)
        reference = load_model(Checkpoint(folder), spec, quantization=quantization)
        assert_logits_close(ours, offload_logits(reference, PROMPTS[0]), rel=1e-4)
    reference = dequantized(load_model(Checkpoint(folder), spec, quantization=quantization))
    assert_logits_close(ours, offload_logits(reference, PROMPTS[0]), rel=3e-2)


@pytest.mark.parametrize("mix", ["all-streamed", "all-disk-streamed", "random-0"])
@pytest.mark.parametrize("quantization", ["none", "q8_0"])
def test_default_model_greedy_tokens_equal_across_placements(default_model_dir, default_llm, mix, quantization):
    spec = default_llm.spec
    prompt = default_llm.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    model = placed(default_model_dir, spec, placement_for(spec, mix), quantization)
    reference = default_llm.model if quantization == "none" else placed(
        default_model_dir, spec, placement_for(spec, "all-cpu"), quantization)
    assert greedy(model, [prompt], n=16) == greedy(reference, [prompt], n=16)


def test_same_block_streamed_in_prefill_and_cpu_in_decode(tiny):
    folder, spec = tiny
    placement = Placement({u.name: dataclasses.replace(Placement.uniform(spec, "cpu", "stream")[u.name],
                                                       decode="cpu", kv="cpu") for u in spec.units()})
    model = placed(folder, spec, placement)
    resident = load_model(Checkpoint(folder), spec)
    assert greedy(model, PROMPTS) == greedy(resident, PROMPTS)
    kinds = {(s.kind, s.phase) for s in model.timeline.spans}
    assert {("h2d_copy", "prefill"), ("gpu_block", "prefill"), ("cpu_block", "decode")} <= kinds
    assert ("h2d_copy", "decode") not in kinds


def test_kv_cache_in_cpu_ram_for_device_blocks(tiny):
    """Blocks computed on the (simulated) GPU with their KV cache in CPU RAM: attention runs where the cache is."""
    folder, spec = tiny
    units = {name: dataclasses.replace(p, kv="cpu") for name, p in Placement.uniform(spec, "cpu", "stream").units.items()}
    model = placed(folder, spec, Placement(units))
    cache = model.new_cache(2, 16)
    assert all(kv.k.device.type == "cpu" for kv in cache)
    assert model.backend.memory.now_bytes["gpu"] == model.ring.n_slots * model.ring.slot_bytes  # no KV on the GPU
    resident = load_model(Checkpoint(folder), spec)
    assert greedy(model, PROMPTS) == greedy(resident, PROMPTS)


def test_host_layers_run_back_to_back_each_timed(tiny):
    """Layers 0-1 and 3 (held and computed in host RAM) run as groups around the streamed layer 2, and still get a
    cpu_block span each: within a group one layer's span ends where the next one's starts."""
    folder, spec = tiny
    units = dict(Placement.uniform(spec, "cpu", "cpu").units)
    units["layer.2"] = Placement.uniform(spec, "cpu", "stream")["layer.2"]
    model = placed(folder, spec, Placement(units), "q4_0")
    reference = placed(folder, spec, Placement.uniform(spec, "cpu", "cpu"), "q4_0")
    assert greedy(model, PROMPTS, n=4) == greedy(reference, PROMPTS, n=4)
    blocks = [s for s in model.timeline.spans if s.phase == "decode" and s.kind in ("cpu_block", "gpu_block")]
    one_step = [(s.kind, s.unit) for s in blocks[:7]]
    assert one_step == [("cpu_block", "embed"), ("cpu_block", "layer.0"), ("cpu_block", "layer.1"),
                        ("gpu_block", "layer.2"), ("cpu_block", "layer.3"), ("cpu_block", "norm"),
                        ("cpu_block", "lm_head")]
    assert blocks[1].end_s == blocks[2].start_s and blocks[1].n_tokens == blocks[2].n_tokens > 0

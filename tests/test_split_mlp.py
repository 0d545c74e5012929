"""Dense layers with the MLP split off (what llama.cpp users do by hand with `-ot ffn=CPU`): layer.i holds
attention and the norms, mlp.i the MLP; any placement of the two computes what the whole layer computes.

Tolerances as tests/test_executor.py's: unquantized 1e-5 of the logit range against the resident model; quantized
device-side units against the dequantized resident model 1e-4; quantized CPU units (the C++ kernels round the
activations) against the resident model on the same packed weights 1e-4 where every unit is on the CPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import assert_logits_close, make_hf_model, offload_logits, save_hf_model
from offload.engine import run_to_end
from offload.generate import Generator
from offload.model.llama import LayerWeights
from offload.planner.placement import Placement, UnitPlacement
from offload.runtime.backends.cpu import CPUBackend
from offload.runtime.executor import PlacedModel
from offload.sampling import SamplingParams
from offload.sequence import Sequence
from offload.spec import load_spec
from offload.weights.loader import Checkpoint
from offload.weights.sources import CheckpointSource, load_model

PROMPT = [5, 17, 33, 2, 90, 11, 4, 150, 61]
PROMPTS = [PROMPT, [7, 1, 150]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = save_hf_model(make_hf_model("qwen2", num_hidden_layers=3), tmp_path_factory.mktemp("split") / "tiny")
    spec = load_spec(folder)
    return folder, spec, dataclasses.replace(spec, split_mlp=True)


def greedy(model, n=6):
    seqs = [Sequence(i, p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)) for i, p in enumerate(PROMPTS)]
    run_to_end(Generator(model, max_batch_size=2), seqs)
    return [s.output_ids for s in seqs]


def mlp_apart(spec, mlp: tuple[str, str], rest: tuple[str, str]) -> Placement:
    def unit(tier, mode):
        return UnitPlacement(tier, mode, mode, "cpu" if mode == "cpu" else "gpu")

    return Placement({u.name: unit(*(mlp if u.kind == "mlp" else rest)) for u in spec.units()})


MIXES = {"mlp-cpu-rest-gpu": (("cpu", "cpu"), ("gpu", "gpu")), "all-cpu": (("cpu", "cpu"), ("cpu", "cpu")),
         "mlp-streamed-rest-cpu": (("cpu", "stream"), ("cpu", "cpu")),
         "mlp-disk-cpu-rest-gpu": (("disk", "cpu"), ("gpu", "gpu"))}


def test_units(tiny):
    _, spec, split = tiny
    assert [u.name for u in split.units()][:4] == ["embed", "layer.0", "mlp.0", "layer.1"]
    assert sum(u.nbytes("q4_0") for u in split.units()) == sum(u.nbytes("q4_0") for u in spec.units())
    assert {t.name for u in split.units() for t in u.tensors} == {t.name for u in spec.units() for t in u.tensors}


@pytest.mark.parametrize("quantization", ["none", "q8_0", "q4_0"])
@pytest.mark.parametrize("mix", list(MIXES))
def test_split_placements_equal_the_whole_layer(tiny, mix, quantization):
    folder, spec, split = tiny
    source = CheckpointSource(Checkpoint(folder), split, torch.float32, quantization)
    model = PlacedModel(split, source, mlp_apart(split, *MIXES[mix]), CPUBackend())
    resident = load_model(Checkpoint(folder), spec, quantization=quantization)
    mlp_tier, rest_tier = (mode for _, mode in MIXES[mix])
    if quantization != "none":  # units computed on the GPU side run dequantized weights; CPU units the kernels
        deq = lambda w: w if isinstance(w, torch.Tensor) or w is None else w.dequantize()  # noqa: E731
        on_gpu = lambda f: (mlp_tier if f in ("gate_up", "down") else rest_tier) != "cpu"  # noqa: E731
        resident.layers = [LayerWeights(**{f.name: deq(getattr(lw, f.name)) if on_gpu(f.name) else getattr(lw, f.name)
                                           for f in dataclasses.fields(lw)}) for lw in resident.layers]
        if rest_tier != "cpu":
            resident.lm_head = deq(resident.lm_head)
    rel = 1e-5 if quantization == "none" else 1e-4
    assert_logits_close(offload_logits(model, PROMPT), offload_logits(resident, PROMPT), rel=rel)
    assert greedy(model) == greedy(resident)


def test_the_planner_splits_only_where_it_predicts_a_gain():
    """Llama-3.1-8B q4_0 at batch 64 on an 8 GiB budget: the plan with the MLPs split off predicts the job 1.2x
    faster, so plan_for takes it; Llama-3.1-70B at batch 1 on 22 GiB does not pay (1.03x, under SPLIT_GAIN; nor
    at batch 16, where whole layers streamed between CPU layers keep both engines busy), and a machine without a
    GPU never splits. The chosen split plan's units are the split spec's."""
    from offload.planner import PlanRequest, plan_for, plan_spec
    from offload.planner.request import SPLIT_GAIN
    from offload.planner.search import plan
    from offload.weights.model_files import model_spec
    from offload.weights.default_model import resolve_model

    for model, gpu, batch, split in (("llama-3.1-70b", "22GiB", 1, False), ("llama-3.1-70b", "22GiB", 16, False),
                                     ("llama-3.1-8b", "8GiB", 64, True)):
        spec = model_spec(resolve_model(model))
        request = PlanRequest.of(model=model, quantization="q4_0", hardware="rtx4090-ddr5", gpu_memory=gpu,
                                 cpu_memory="64GiB", batch_size=batch, max_tokens=128)
        hw = request.profile()
        chosen = plan_for(spec, hw, request)
        assert chosen.split_mlp is split
        budget, workload = request.budget(hw), request.workload(spec, hw)
        apart = plan(dataclasses.replace(spec, split_mlp=True), hw, budget, workload, "q4_0", None)
        whole = plan(spec, hw, budget, workload, "q4_0", None)
        assert (whole.job_s > SPLIT_GAIN * apart.job_s) is split  # the choice is the planner's own prediction
        assert [u.name for u in chosen.units] == [u.name for u in plan_spec(spec, chosen).units()]
        if split:
            assert "MLP" in chosen.moe_summary and chosen.to_dict()["split_mlp"]
    cpu_only = PlanRequest.of(model="llama-3.1-70b", quantization="q4_0", hardware="cpu-desktop", cpu_memory="30GiB", batch_size=16,
                              disk_memory="100GiB")
    assert not plan_for(spec, cpu_only.profile(), cpu_only).split_mlp


def test_an_llm_runs_the_split_plan(tiny, monkeypatch):
    """With the split forced (any gain taken), LLM plans, loads and runs the split units, and answers as the
    whole layers do."""
    from conftest import gpu_profile
    from offload import LLM
    from offload.planner import request as planner_request

    folder, _, _ = tiny
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    whole = LLM(folder, hardware=gpu_profile(), gpu_memory="300KiB", cpu_memory="2GiB", host_baseline=0,
                batch_size=2, backend="sim")
    monkeypatch.setattr(planner_request, "SPLIT_GAIN", 0.0)
    split = LLM(folder, hardware=gpu_profile(), gpu_memory="300KiB", cpu_memory="2GiB", host_baseline=0,
                batch_size=2, backend="sim")
    assert split.plan.split_mlp and not whole.plan.split_mlp and "mlp.0" in split.model.order
    outs = [llm.generate(PROMPTS, params) for llm in (whole, split)]
    assert [o.outputs[0].token_ids for o in outs[0]] == [o.outputs[0].token_ids for o in outs[1]]


@pytest.mark.parametrize("layers,weighed", [(80, True), (1_000, True), (1_001, False)])
def test_the_split_is_weighed_up_to_a_thousand_layers(layers, weighed):
    """Splitting the MLPs off doubles the units the search walks; past SPLIT_MAX_LAYERS (no released model comes
    near: Llama 3.1 405B has 126 layers) only the whole layers are planned, so a plan of 10^4 layers answers in
    seconds."""
    from offload.planner.request import PlanRequest, SPLIT_MAX_LAYERS, may_split
    from offload.spec import spec_from_config

    spec = spec_from_config({"model_type": "llama", "hidden_size": 512, "intermediate_size": 1536,
                             "num_hidden_layers": layers, "num_attention_heads": 8, "vocab_size": 1000})
    request = PlanRequest.of(model="x", hardware="rtx4090-ddr5", gpu_memory="22GiB")
    hw = request.profile()
    assert SPLIT_MAX_LAYERS == 1_000 and may_split(spec, hw, request, request.budget(hw)) == weighed

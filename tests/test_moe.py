"""Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE) against transformers in fp32, and placed by unit.

Tolerances (max |diff| over the reference's logit range), as tests/test_executor.py's: unquantized 1e-4 against
transformers, greedy tokens equal. Quantized weights: device-side units (dequantized with torch ops, here on the
CPU backend) 1e-4 against transformers running the same weights dequantized, greedy tokens equal. Units computed by
offload's CPU kernels, which round the activations too (int8 for q4_0, int16 for q8_0): 1e-4 against the resident
model on the same packed weights and kernels (the placement changes nothing), and for q8_0 3e-2 against the
dequantized transformers. q4_0's int8 activations move near-tied router choices (a top-2/top-3 gap of 2e-4 flips
in these tiny random models, as it would in llama.cpp), so its kernels are held to their scalar reference instead
(tests/test_kernels.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import assert_logits_close, hf_logits, make_hf_model, offload_logits, save_hf_model
from test_executor import dequantized
from offload.engine import run_to_end
from offload.generate import Generator
from offload.kernels import pack
from offload.planner.placement import Placement, UnitPlacement
from offload.runtime.backends.cpu import CPUBackend
from offload.runtime.executor import PlacedModel
from offload.sampling import SamplingParams
from offload.sequence import Sequence
from offload.spec import load_spec, spec_from_config
from offload.weights.loader import Checkpoint
from offload.weights.sources import CheckpointSource, load_model

ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe"]
PROMPT = [5, 17, 33, 2, 90, 11, 4, 150, 61, 62, 63, 64, 7, 1, 99, 100, 12]
PROMPTS = [PROMPT[:7], [7, 1, 150], PROMPT[5:]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """arch -> (transformers model, its folder, spec)."""
    out = {}
    for arch in ARCHS:
        hf = make_hf_model(arch)
        folder = save_hf_model(hf, tmp_path_factory.mktemp("moe") / arch)
        out[arch] = (hf, folder, load_spec(folder))
    return out


def hf_greedy(hf, prompt: list[int], n: int = 8) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def greedy(model, prompts, n: int = 8) -> list[list[int]]:
    seqs = [Sequence(i, p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)) for i, p in enumerate(prompts)]
    run_to_end(Generator(model, max_batch_size=2), seqs)
    return [s.output_ids for s in seqs]


def dequantized_hf(hf, quantization: str):
    """A copy of the transformers model whose quantizable linears (attention, shared and routed experts, lm_head;
    not the routers) hold their quantize-dequantize round trip: what offload's packed weights compute."""
    ref = copy.deepcopy(hf)
    with torch.no_grad():
        for name, p in ref.named_parameters():  # transformers 5 holds each layer's experts as one [E, out, in]
            linear = p.dim() >= 2 and "embed" not in name and not name.endswith(("gate.weight", "expert_gate.weight"))
            if linear and p.shape[-1] % 32 == 0:
                for m in p.view(-1, *p.shape[-2:]):
                    m.copy_(pack(m.detach().clone(), quantization).dequantize())
    return ref


def placed(folder, spec, placement, quantization="none") -> PlacedModel:
    source = CheckpointSource(Checkpoint(folder), spec, torch.float32, quantization)
    return PlacedModel(spec, source, placement, CPUBackend())


def split_placement(spec, experts: tuple[str, str], others: tuple[str, str]) -> Placement:
    """Experts units one way, every other unit another: (weights tier, compute mode)."""
    def unit(tier, mode):
        return UnitPlacement(tier, mode, mode, "cpu" if mode == "cpu" else "gpu")

    return Placement({u.name: unit(*(experts if u.kind == "experts" else others)) for u in spec.units()})


MIXES = {"all-gpu-side": lambda s: Placement.uniform(s, "gpu", "gpu"),
         "all-cpu": lambda s: Placement.uniform(s, "cpu", "cpu"),
         "experts-cpu-rest-gpu": lambda s: split_placement(s, ("cpu", "cpu"), ("gpu", "gpu")),
         "experts-streamed-rest-cpu": lambda s: split_placement(s, ("cpu", "stream"), ("cpu", "cpu")),
         "experts-disk-cpu-rest-gpu": lambda s: split_placement(s, ("disk", "cpu"), ("gpu", "gpu")),
         "random": lambda s: Placement.random(s, 3)}


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_and_greedy_tokens_match_transformers(models, arch):
    hf, folder, spec = models[arch]
    ours = load_model(Checkpoint(folder), spec)
    assert_logits_close(offload_logits(ours, PROMPT), hf_logits(hf, PROMPT))
    assert greedy(ours, [PROMPT])[0] == hf_greedy(hf, PROMPT)


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("arch", ARCHS)
def test_placements_match_transformers(models, arch, mix):
    hf, folder, spec = models[arch]
    model = placed(folder, spec, MIXES[mix](spec))
    assert_logits_close(offload_logits(model, PROMPT), hf_logits(hf, PROMPT))
    assert greedy(model, PROMPTS) == [hf_greedy(hf, p) for p in PROMPTS]


@pytest.mark.parametrize("quantization", ["q8_0", "q4_0"])
@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_device_side_equals_dequantized_transformers(models, arch, quantization):
    hf, folder, spec = models[arch]
    reference = dequantized_hf(hf, quantization)
    model = placed(folder, spec, MIXES["all-gpu-side"](spec), quantization)
    assert_logits_close(offload_logits(model, PROMPT), hf_logits(reference, PROMPT))
    assert greedy(model, [PROMPT])[0] == hf_greedy(reference, PROMPT)


@pytest.mark.parametrize("quantization", ["q8_0", "q4_0"])
@pytest.mark.parametrize("mix", ["all-cpu", "experts-cpu-rest-gpu", "experts-disk-cpu-rest-gpu", "random"])
@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_cpu_kernels_placed_equal_resident(models, arch, mix, quantization):
    hf, folder, spec = models[arch]
    model = placed(folder, spec, MIXES[mix](spec), quantization)
    resident = load_model(Checkpoint(folder), spec, quantization=quantization)
    if mix != "all-cpu":  # the units on the GPU side compute dequantized weights
        resident = dequantized(resident)  # the layers and lm_head; the routed experts (Model.experts) stay packed
    ours = offload_logits(model, PROMPT)
    if mix != "random":
        assert_logits_close(ours, offload_logits(resident, PROMPT))
        assert greedy(model, PROMPTS) == greedy(resident, PROMPTS)
    if quantization == "q8_0":
        assert_logits_close(ours, hf_logits(dequantized_hf(hf, quantization), PROMPT), rel=3e-2)


def test_units_split_attention_and_experts(models):
    _, _, spec = models["qwen2_moe"]  # layer 1 is dense (mlp_only_layers)
    assert [u.name for u in spec.units()] == ["embed", "layer.0", "experts.0", "layer.1", "norm", "lm_head"]
    experts = spec.units()[2]
    assert experts.tensors[0].role == "router" and experts.tensors[0].nbytes("q4_0") == 6 * 64 * 4
    assert {t.name.rsplit(".", 2)[-2] for t in spec.units()[1].tensors if t.role == "linear"} == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}  # the shared expert's MLP
    assert sum(t.numel for u in spec.units() for t in u.tensors) - 160 * 64 == spec.n_params - 160 * 64


def test_expected_experts_per_step():
    spec = spec_from_config({"model_type": "mixtral", "hidden_size": 64, "num_attention_heads": 4,
                             "num_hidden_layers": 1, "vocab_size": 10, "intermediate_size": 32,
                             "num_local_experts": 8, "num_experts_per_tok": 2})
    moe = spec.moe
    assert moe.expected_experts(1) == pytest.approx(2.0)
    assert moe.expected_experts(2) == pytest.approx(8 * (1 - 0.75 ** 2))  # 3.5
    assert moe.expected_experts(512) == pytest.approx(8.0)
    experts = next(u for u in spec.units() if u.kind == "experts")
    assert experts.matmul_flops(3) == 2 * 3 * 2 * (3 * 32 * 64)  # 3 tokens, 2 experts each, 3 matrices of 32x64


@pytest.mark.parametrize("changes, needle", [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
    ({"num_local_experts": 0}, "'num_local_experts'"),
])
def test_bad_moe_config_is_named(changes, needle):
    from offload.errors import ConfigError

    config = {"model_type": "mixtral", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1,
              "vocab_size": 10, "intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2, **changes}
    with pytest.raises(ConfigError, match=needle):
        spec_from_config(config)


def test_packed_cache_holds_experts_units(models, tmp_path, monkeypatch):
    """A second q4_0 load reads each experts unit from the packed-weight cache, not the checkpoint's floats, and
    a disk placement reads them from the cache's files in place."""
    from offload.weights import cache

    monkeypatch.setenv("OFFLOAD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(cache.PACKED_CACHE_ENV, "1")
    hf, folder, spec = models["mixtral"]

    def load():
        ckpt = Checkpoint(folder)
        read, get = [], ckpt.get
        ckpt.get = lambda name, dtype=None: read.append(name) or get(name, dtype)
        source = CheckpointSource(ckpt, spec, torch.float32, "q4_0")
        return source, {u.name: source.load(u) for u in spec.units()}, read

    _, first, read_first = load()
    source, second, read_second = load()
    assert any(".experts." in n for n in read_first) and not any(".experts." in n for n in read_second)
    for a, b in zip(first["experts.1"].gate_up + first["experts.1"].down, second["experts.1"].gate_up +
                    second["experts.1"].down):
        assert torch.equal(a.qs, b.qs) and torch.equal(a.d, b.d)
    model = PlacedModel(spec, source, split_placement(spec, ("disk", "cpu"), ("cpu", "cpu")), CPUBackend())
    assert not model.disk.spilled and "experts.0" in model.disk.extents
    resident = load_model(Checkpoint(folder), spec, quantization="q4_0")
    assert greedy(model, PROMPTS) == greedy(resident, PROMPTS)


@pytest.mark.parametrize("quantization", ["none", "q4_0"])
@pytest.mark.parametrize("mix", ["experts-streamed-rest-gpu", "experts-cpu-rest-gpu", "random"])
def test_simulated_device_equals_the_cpu_backend(models, mix, quantization):
    """On the simulated asynchronous device (copies land late, streams run apart) a MoE placement computes what
    the CPU backend computes: the hand-over between attention parts and experts waits where it must."""
    from conftest import gpu_profile
    from offload.runtime.backends.sim import SimBackend

    hf, folder, spec = models["qwen2_moe"]
    placement = (split_placement(spec, ("cpu", "stream"), ("gpu", "gpu")) if mix == "experts-streamed-rest-gpu"
                 else MIXES[mix](spec))

    def run(backend):
        source = CheckpointSource(Checkpoint(folder), spec, torch.float32, quantization)
        return PlacedModel(spec, source, placement, backend)

    sim, ref = run(SimBackend(gpu_profile(), time_scale=0.05)), run(CPUBackend())
    assert_logits_close(offload_logits(sim, PROMPT), offload_logits(ref, PROMPT), rel=1e-6)
    assert greedy(sim, PROMPTS) == greedy(ref, PROMPTS)

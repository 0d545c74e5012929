"""The families of offload/families.py against transformers in fp32 (issue 45): logits within 1e-4 of the logit
range and the same greedy tokens, at GQA ratios 1, 4 and 8, with prompts longer than the sliding window, on the
resident reference and on the placed executor (CPU, streamed from RAM and from disk)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import assert_logits_close, hf_logits, make_hf_model, offload_logits, save_hf_model
from offload.spec import load_spec
from offload.weights.loader import Checkpoint
from offload.weights.sources import load_model

# name -> (model_type, overrides): heads 8 with kv heads 8, 2, 1 are GQA ratios 1, 4 and 8
CASES = {
    "qwen3-gqa4": ("qwen3", dict(num_attention_heads=8, num_key_value_heads=2)),
    "qwen3-gqa1-tied": ("qwen3", dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)),
    "gemma2-gqa8": ("gemma2", dict(num_attention_heads=8, num_key_value_heads=1)),
    "gemma2-gqa1": ("gemma2", dict(num_attention_heads=4, num_key_value_heads=4)),
    "gemma3-gqa4": ("gemma3_text", dict(num_attention_heads=8, num_key_value_heads=2)),
    # transformers 4's keys, which 5 reads into rope_parameters' sections (one per attention kind)
    "gemma3-rope-linear": ("gemma3_text", dict(rope_theta=100000.0, rope_local_base_freq=1000.0,
                                               rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "phi3-gqa4": ("phi3", dict(num_attention_heads=8, num_key_value_heads=2)),
    "phi3-partial-rotary": ("phi3", dict(partial_rotary_factor=0.75, num_attention_heads=4, num_key_value_heads=1)),
    "phi3-longrope": ("phi3", dict(max_position_embeddings=64, original_max_position_embeddings=16,
                                   rope_scaling={"type": "longrope", "short_factor": [1.0 + i / 8 for i in range(8)],
                                                 "long_factor": [2.0 + i / 4 for i in range(8)]})),
    "olmo2-gqa4": ("olmo2", dict(num_attention_heads=8, num_key_value_heads=2)),
    # the sixth family, which the table already covered: Llama with q/k/v biases and o_proj's own (attention_out_bias)
    "seed-oss-gqa4": ("seed_oss", dict(num_attention_heads=8, num_key_value_heads=2)),
    "seed-oss-out-bias-gqa8": ("seed_oss", dict(num_attention_heads=8, num_key_value_heads=1, attention_out_bias=True,
                                                attention_bias=False, mlp_bias=True)),
    "gpt-oss-gqa4": ("gpt_oss", dict(num_attention_heads=8, num_key_value_heads=2)),
    "gpt-oss-yarn-gqa8": ("gpt_oss", dict(num_attention_heads=8, num_key_value_heads=1, rope_theta=150000.0,
                                          max_position_embeddings=64, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 16})),
}


def _prompt(n: int, vocab: int = 160, seed: int = 1) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=list(CASES))
def family(request, tmp_path_factory):
    arch, overrides = CASES[request.param]
    hf = make_hf_model(arch, **overrides)
    return hf, save_hf_model(hf, tmp_path_factory.mktemp(request.param))


def test_logits_match_transformers(family):
    hf, folder = family
    ids = _prompt(24)  # past the windows (6) and LongRoPE's original length (16)
    ours = load_model(Checkpoint(folder), load_spec(folder))
    assert_logits_close(offload_logits(ours, ids), hf_logits(hf, ids))


def test_greedy_tokens_match_transformers_on_the_placed_executor(family):
    """Prefill then decode token by token through LLM (the plan's placement on this CPU), against
    transformers' greedy generate. The prompt is past LongRoPE's original length: there transformers' generate
    runs the prompt again with the long factors where a sequence crosses it, which offload (as vLLM) does not."""
    from offload import LLM, SamplingParams

    hf, folder = family
    ids = _prompt(20)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, min_new_tokens=12)[0, 20:]
    llm = LLM(str(folder), max_model_len=64)
    out = llm.generate([ids], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == ref.tolist()


PLACED = ["qwen3-gqa4", "gemma2-gqa8", "gemma3-gqa4", "phi3-partial-rotary", "gpt-oss-gqa4", "olmo2-gqa4",
          "seed-oss-gqa4"]
MIXES = {"streamed-on-the-simulated-gpu": ("cpu", "stream", "sim"), "resident-on-the-simulated-gpu":
         ("gpu", "gpu", "sim"), "from-disk-on-the-cpu": ("disk", "cpu", "cpu"), "random": (None, None, "sim"),
         "mlps-split-off": ("split", "stream", "sim")}


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("case", PLACED)
def test_every_placement_gives_the_resident_models_tokens(case, mix, tmp_path):
    """The family's math on the placed executor: streamed to and resident on the strict simulated GPU (which
    refuses host tensors in device ops), read from disk, and a random mix; greedy tokens as the resident model's,
    logits within 1e-5 of its range."""
    from conftest import gpu_profile
    from offload.engine import run_to_end
    from offload.generate import Generator
    from offload.planner.placement import Placement
    from offload.runtime.backends.cpu import CPUBackend
    from offload.runtime.backends.sim import SimBackend
    from offload.runtime.executor import PlacedModel
    from offload.sampling import SamplingParams
    from offload.sequence import Sequence
    from offload.weights.sources import CheckpointSource

    arch, overrides = CASES[case]
    folder = save_hf_model(make_hf_model(arch, **overrides), tmp_path / case)
    spec = load_spec(folder)
    weights, compute, backend = MIXES[mix]
    if weights == "split":  # each dense MLP a unit of its own (with Gemma's norm after it)
        spec, weights = dataclasses.replace(spec, split_mlp=True), "cpu"
    placement = Placement.random(spec, 1) if weights is None else Placement.uniform(spec, weights, compute)
    model = PlacedModel(spec, CheckpointSource(Checkpoint(folder), spec, torch.float32), placement,
                        SimBackend(gpu_profile()) if backend == "sim" else CPUBackend())
    resident = load_model(Checkpoint(folder), spec)
    ids = _prompt(20)
    assert_logits_close(offload_logits(model, ids), offload_logits(resident, ids), rel=1e-5)

    def greedy(m):
        seqs = [Sequence(i, p, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
                for i, p in enumerate([ids, _prompt(9, seed=2)])]
        run_to_end(Generator(m, max_batch_size=2), seqs)
        return [s.output_ids for s in seqs]

    assert greedy(model) == greedy(resident)


@pytest.mark.parametrize("prefix", ["model.language_model.", "language_model.model."])
def test_a_multimodal_gemma3_folder_loads_its_text_model(tmp_path, prefix):
    """Gemma3ForConditionalGeneration's folder: the text config under text_config, the text model's tensors under
    language_model (transformers 5's and 4's layouts), a vision tower beside them that is never read."""
    import json

    from safetensors.torch import load_file, save_file

    hf = make_hf_model("gemma3_text", **CASES["gemma3-gqa4"][1])
    folder = save_hf_model(hf, tmp_path / "text")
    tensors = load_file(folder / "model.safetensors")
    renamed = {(prefix + k[len("model."):] if k.startswith("model.") else "language_model." + k
                if prefix.startswith("language") else k): v for k, v in tensors.items()}
    renamed["model.vision_tower.patch_embedding.weight"] = torch.zeros(4, 3)
    save_file(renamed, folder / "model.safetensors")
    text = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": text,
                                                    "architectures": ["Gemma3ForConditionalGeneration"],
                                                    "vision_config": {"model_type": "siglip_vision_model"}}))
    ids = _prompt(20)
    ours = load_model(Checkpoint(folder), load_spec(folder))
    assert_logits_close(offload_logits(ours, ids), hf_logits(hf, ids))

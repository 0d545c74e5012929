"""The fused C++ CPU layer computes the families whose rope or norms differ from Llama's (issue 45): partial rotary
(Phi-4-mini's partial_rotary_factor 0.75: rope turns the first 12 of each head's 16 dimensions), a rope's
attention_factor (LongRoPE's, here sqrt(1 + ln 4 / ln 16) ~ 1.22 as max_position_embeddings is 4x the original 16,
and YaRN's 0.1 ln 4 + 1 ~ 1.14: it is in the step's cos and sin) and OLMo 2's blocks (no norms before attention and
the MLP; q and k each RMS-normed whole, all heads together, before rope). Prompts of 20 tokens pass LongRoPE's
original length.

Tolerances: fp32 logits within conftest's 1e-4 x the logit range of transformers'; a layer on each kernel path
within 1e-4 x max |ref| of the reference block math on the same q8_0 weights (test_fused_layer.py's q8_0 bound),
and the same layer without the family's feature more than 100x that bound away (the check tells them apart)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import offload.kernels.layer as fused
from conftest import make_hf_model, save_hf_model
from fused_support import PATHS, PROMPT_LEN, check_fp32_fused, check_q8_0_fused
from offload.kernels import ACTIVE_PATH
from offload.model.llama import layer_forward
from offload.model.step import layer_cache, make_step
from offload.spec import load_spec
from offload.weights.loader import Checkpoint
from offload.weights.sources import load_model

pytestmark = pytest.mark.skipif(not fused.FUSABLE, reason=f"fused layer needs the C++ extension ({ACTIVE_PATH})")

# name -> (model_type, config overrides, the feature the fused layer computes for it)
FAMILIES = {
    "phi3-partial-rotary": ("phi3", dict(partial_rotary_factor=0.75, num_attention_heads=4, num_key_value_heads=1),
                            "rotary_dim"),
    "phi3-longrope": ("phi3", dict(num_attention_heads=4, num_key_value_heads=2, original_max_position_embeddings=16,
                                   rope_scaling={"type": "longrope", "short_factor": [1.0 + i / 8 for i in range(8)],
                                                 "long_factor": [2.0 + i / 4 for i in range(8)]}), "attention_factor"),
    "qwen2-yarn": ("qwen2", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 16}), "attention_factor"),
    "olmo2": ("olmo2", dict(num_attention_heads=8, num_key_value_heads=2), "qk_norm_all"),
}


def _has(feature: str, spec) -> bool:
    return {"rotary_dim": spec.rotary_dim < spec.head_dim, "attention_factor": spec.rope.attention_factor > 1.1,
            "qk_norm_all": spec.family.qk_norm_over == "all"}[feature]


def _without(feature: str, spec, w):
    """spec and a layer's weights w with the feature taken out: rope over whole heads, no attention_factor, no q/k
    norms."""
    if feature == "rotary_dim":
        return dataclasses.replace(spec, variant=dataclasses.replace(spec.variant, rotary_dim=None)), w
    if feature == "attention_factor":
        return dataclasses.replace(spec, rope=dataclasses.replace(spec.rope, attention_factor=1.0)), w
    return spec, dataclasses.replace(w, q_norm=None, k_norm=None)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    arch, overrides, feature = FAMILIES[request.param]
    hf = make_hf_model(arch, max_position_embeddings=64, **overrides)
    return feature, hf, save_hf_model(hf, tmp_path_factory.mktemp(request.param))


def test_the_fused_layer_takes_their_math(family):
    feature, _, folder = family
    spec = load_spec(folder)
    assert fused.runs_math_of(spec) and _has(feature, spec)


def test_fp32_layers_attend_fused_and_match_transformers(family, monkeypatch):
    """fp32 weights (torch's linears) with the fused layer's attention: logits and greedy tokens of transformers."""
    _, hf, folder = family
    check_fp32_fused(hf, folder, monkeypatch)


def test_q8_0_layers_run_fused_and_match_the_reference_math(family, monkeypatch):
    """q8_0 weights: every layer of every step one fused C++ call; tokens and logits those of the reference block
    math on the same weights."""
    _, _, folder = family
    check_q8_0_fused(folder, monkeypatch)


def _layer_runs(spec, w, i: int, path: str | None, wrong=None):
    """Layer i over a prompt past LongRoPE's original length, then one decode token: [(fused, reference, and the
    reference of wrong = (spec, w) without the feature)] per step, from the same random hidden states."""
    g = torch.Generator().manual_seed(i)
    specs = [spec, spec] + ([wrong[0]] if wrong else [])
    weights = [w, w] + ([wrong[1]] if wrong else [])
    kvs = [layer_cache(s, i, 1, 32, torch.float32) for s in specs]
    out = []
    for start, n in ((0, PROMPT_LEN), (PROMPT_LEN, 1)):
        positions = torch.arange(start, start + n)[None]
        x = torch.randn(1, n, spec.hidden_size, generator=g)
        steps = [make_step(s, torch.float32, positions, torch.ones_like(positions, dtype=torch.bool), 32)
                 for s in specs]
        row = [fused.fused_layer_forward(spec, w, x, steps[0], kvs[0], path, index=i)]
        row += [layer_forward(s, lw, x, st, kv, index=i) for s, lw, st, kv in zip(specs[1:], weights[1:], steps[1:],
                                                                                 kvs[1:])]
        out.append(row)
    return out


@pytest.mark.parametrize("path", PATHS)
def test_each_layer_on_each_kernel_path_matches_the_reference(family, path):
    _, _, folder = family
    spec = load_spec(folder)
    model = load_model(Checkpoint(folder), spec, quantization="q8_0")
    for i, w in enumerate(model.layers):
        for ours, ref in _layer_runs(spec, w, i, path):
            assert float((ours - ref).abs().max()) <= 1e-4 * float(ref.abs().max()), i


def test_the_check_tells_each_feature_from_its_absence(family):
    """The same layers without the family's feature land far outside the bound the fused layer meets."""
    feature, _, folder = family
    spec = load_spec(folder)
    model = load_model(Checkpoint(folder), spec, quantization="q8_0")
    for i, w in enumerate(model.layers):
        for ours, ref, wrong in _layer_runs(spec, w, i, None, _without(feature, spec, w)):
            bound = 1e-4 * float(ref.abs().max())
            assert float((ours - ref).abs().max()) <= bound < float((ours - wrong).abs().max()) / 100, i

"""The fused C++ CPU layer computes gpt-oss's blocks (issue 45): its attention sinks (one more logit per head in the
softmax's denominator, with no value: e^(sink - max) joins the running sum after all keys, on the scalar path and in
the SIMD tiles) and its routed experts (biased router, gate_up and down; the clamped SwiGLU
gate * sigmoid(1.702 gate) * (up + 1), gate clamped above and up on both sides at 7). The tiny model's sinks run
from -3 to 8, so some heads' sink is above all their scores (the softmax is then taken relative to the sink) and
every head's output moves with its sink.

Tolerances: fp32 logits within conftest's 1e-4 x the logit range of transformers'; on q8_0 weights, the attention
part and the experts on each kernel path within 1e-4 x max |ref| of the reference block math (test_fused_layer.py's
q8_0 bound), and the reference without the sinks, with SiLU experts or without the experts' biases more than 100x
that bound away (the check tells them apart)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import offload.kernels.layer as fused
import offload.runtime.unit_runner as unit_runner
from conftest import assert_logits_close, hf_logits, make_hf_model, offload_logits, save_hf_model
from fused_support import NEW, PATHS, PROMPT_LEN, Counting, check_fp32_fused, greedy, prompt
from offload import LLM, attention_sizes
from offload.kernels import ACTIVE_PATH
from offload.model.llama import layer_forward
from offload.model.moe import experts_forward
from offload.model.step import layer_cache, make_step
from offload.spec import load_spec
from offload.weights.loader import Checkpoint
from offload.weights.sources import load_model

pytestmark = pytest.mark.skipif(not fused.HAS_MOE, reason=f"fused layer needs the C++ extension ({ACTIVE_PATH})")
BOUND = 1e-4  # x max |ref|: q8_0's, as tests/test_fused_layer.py states


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """A tiny gpt-oss (sliding window 6 on alternate layers) whose sinks spread from -3 to 8, and its folder."""
    hf = make_hf_model("gpt_oss", num_attention_heads=8, num_key_value_heads=2)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.sinks.copy_(torch.linspace(-3.0, 8.0, hf.config.num_attention_heads))
    return hf, save_hf_model(hf, tmp_path_factory.mktemp("gpt_oss"))


@pytest.fixture(scope="module")
def q8_model(gpt_oss):
    folder = gpt_oss[1]
    spec = load_spec(folder)
    return spec, load_model(Checkpoint(folder), spec, quantization="q8_0")


def test_the_fused_layer_takes_its_math(gpt_oss):
    spec = load_spec(gpt_oss[1])
    assert fused.runs_math_of(spec) and spec.family.sinks and spec.moe.biases and spec.moe.activation == "swiglu_oai"


def test_fp32_layers_attend_fused_and_match_transformers(gpt_oss, monkeypatch):
    """fp32 weights (torch's linears) with the fused layer's attention, sinks included: transformers' logits and
    greedy tokens."""
    hf, folder = gpt_oss
    check_fp32_fused(hf, folder, monkeypatch)


def test_q8_0_layers_and_experts_run_fused_and_match_the_reference_math(gpt_oss, monkeypatch):
    """q8_0 weights: every layer's attention part and experts of every step one C++ call each; tokens and logits
    those of the reference block math on the same weights."""
    folder = gpt_oss[1]
    llm, reference = (LLM(str(folder), quantization="q8_0", backend="cpu") for _ in range(2))
    reference.model.fuse = False
    counting = Counting(fused._C, ("layer_forward", "experts_forward"))
    monkeypatch.setattr(fused, "_C", counting)
    ids = prompt(PROMPT_LEN)
    ours = greedy(llm, ids)
    n_layers = llm.model.spec.n_layers
    assert counting.calls["layer_forward"] >= n_layers * NEW and counting.calls["experts_forward"] >= n_layers * NEW
    counting.calls.clear()
    assert ours == greedy(reference, ids) and not counting.calls
    assert_logits_close(offload_logits(llm.model, ids), offload_logits(reference.model, ids))


def test_ring_layers_run_fused_in_chunks_their_ring_takes(gpt_oss, monkeypatch):
    """With rings smaller than the cache (slack cut to 2: a ring of 16 slots for a window of 6), a prompt of 80 is
    more than a ring takes in one fused call: the sliding layer attends fused in chunks of slack + 1 = 3 tokens
    through tables that wrap around its ring, the full-attention layer in one call: transformers' logits."""
    hf, folder = gpt_oss
    monkeypatch.setattr(attention_sizes, "RING_SLACK", 2)
    monkeypatch.setattr(unit_runner, "F32_KERNEL_ROWS", 0)  # fp32 weights through torch's linears: attention alone
    llm = LLM(str(folder), backend="cpu")
    counting = Counting(fused._C)
    monkeypatch.setattr(fused, "_C", counting)
    ids = prompt(2 * PROMPT_LEN)
    assert_logits_close(offload_logits(llm.model, ids), hf_logits(hf, ids))
    spec = llm.model.spec
    full = sum(spec.window(i) is None for i in range(spec.n_layers))
    assert 0 < full < spec.n_layers
    assert counting.calls["cached_attention"] == full + (spec.n_layers - full) * -(-len(ids) // 3)


def _attention_runs(spec, i: int, layers: list, path: str | None):
    """Layer i's attention part over a prompt, then one decode token, from the same random hidden states: per
    step [fused (layers[0]), reference of each of layers[1:]]."""
    g = torch.Generator().manual_seed(i)
    handle = fused.fuse_layer(spec, layers[0], moe=True, index=i)
    assert handle is not None
    kvs = [layer_cache(spec, i, 1, 32, torch.float32) for _ in layers]
    out = []
    for start, n in ((0, PROMPT_LEN), (PROMPT_LEN, 1)):
        positions = torch.arange(start, start + n)[None]
        x = torch.randn(1, n, spec.hidden_size, generator=g)
        step = make_step(spec, torch.float32, positions, torch.ones_like(positions, dtype=torch.bool), 32)
        view = fused.kv_view(kvs[0])
        row = [fused.fused_layers_forward([handle], x, fused.step_table(spec, step, view), [view], path=path)]
        row += [layer_forward(spec, w, x, step, kv, moe=True, index=i) for w, kv in zip(layers[1:], kvs[1:])]
        out.append(row)
    return out


def _handover(spec, n_tokens: int, seed: int) -> torch.Tensor:
    """[n_tokens, 2D] = residual | h, h 4x a unit normal's scale so that gates and ups pass the clamp at 7."""
    x = torch.randn(n_tokens, 2 * spec.hidden_size, generator=torch.Generator().manual_seed(seed))
    x[:, spec.hidden_size:] *= 4
    return x


@pytest.mark.parametrize("path", PATHS)
def test_each_layer_on_each_kernel_path_matches_the_reference(q8_model, path):
    spec, model = q8_model
    for i, w in enumerate(model.layers):
        for ours, ref in _attention_runs(spec, i, [w, w], path):
            assert float((ours - ref).abs().max()) <= BOUND * float(ref.abs().max()), i
        experts = fused.fuse_experts(spec.moe, model.experts[i])
        for n_tokens in (1, 3, 37):
            x = _handover(spec, n_tokens, i)
            ours, ref = fused.fused_experts_forward(experts, x, path), experts_forward(spec.moe, model.experts[i], x)
            assert float((ours - ref).abs().max()) <= BOUND * float(ref.abs().max()), (i, n_tokens)


def test_the_check_tells_sinks_from_their_absence(q8_model):
    spec, model = q8_model
    for i, w in enumerate(model.layers):
        for ours, ref, unsunk in _attention_runs(spec, i, [w, w, dataclasses.replace(w, sinks=None)], None):
            bound = BOUND * float(ref.abs().max())
            assert float((ours - ref).abs().max()) <= bound < float((ours - unsunk).abs().max()) / 100, i


def test_the_check_tells_the_experts_activation_and_biases_from_their_absence(q8_model):
    spec, model = q8_model
    silu = dataclasses.replace(spec.moe, activation="silu")
    for i, ew in model.experts.items():
        unbiased = dataclasses.replace(ew, router_bias=None, gate_up_bias=None, down_bias=None)
        x = _handover(spec, 37, i)
        ours, ref = fused.fused_experts_forward(fused.fuse_experts(spec.moe, ew), x), experts_forward(spec.moe, ew, x)
        bound = BOUND * float(ref.abs().max())
        assert float((ours - ref).abs().max()) <= bound
        for wrong in (experts_forward(silu, ew, x), experts_forward(spec.moe, unbiased, x)):
            assert bound < float((ours - wrong).abs().max()) / 100, i

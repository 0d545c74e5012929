"""The fused C++ CPU layer computes Gemma 2 and Gemma 3 blocks (issue 45): norms after attention and the MLP, GELU-
tanh, the query_pre_attn_scalar scale, Gemma 2's soft-capped scores (a cap of 2 here, so that it bites), per-layer
sliding windows (6) under prompts of 20 tokens, Gemma 3's local rope and q/k norms. Caches keep every position
(a ring, spec.kv_ring, is larger than these contexts); layers whose cache is a ring run the reference math.

Tolerances: fp32 logits within conftest's 1e-4 x the logit range of transformers'; a layer on each kernel path
within 1e-4 x max |ref| of the reference block math on the same q8_0 weights (test_fused_layer.py's q8_0 bound)."""

from __future__ import annotations

import pytest
import torch

import offload.kernels.layer as fused
from conftest import make_hf_model, save_hf_model
from fused_support import NEW, PATHS, PROMPT_LEN, Counting, check_fp32_fused, check_q8_0_fused, greedy, prompt
from offload import LLM, attention_sizes
from offload.kernels import ACTIVE_PATH
from offload.model.llama import layer_forward
from offload.model.step import layer_cache, make_step
from offload.spec import load_spec
from offload.weights.loader import Checkpoint
from offload.weights.sources import load_model

pytestmark = pytest.mark.skipif(not fused.FUSABLE, reason=f"fused layer needs the C++ extension ({ACTIVE_PATH})")

FAMILIES = {"gemma2": ("gemma2", dict(num_attention_heads=8, num_key_value_heads=2, attn_logit_softcapping=2.0)),
            "gemma3": ("gemma3_text", dict(num_attention_heads=8, num_key_value_heads=1))}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    arch, overrides = FAMILIES[request.param]
    hf = make_hf_model(arch, max_position_embeddings=128, **overrides)
    return hf, save_hf_model(hf, tmp_path_factory.mktemp(request.param))


def test_the_fused_layer_takes_gemmas_math(family):
    assert fused.runs_math_of(load_spec(family[1]))


def test_fp32_layers_attend_fused_and_match_transformers(family, monkeypatch):
    """fp32 weights (torch's linears) with the fused layer's attention: logits and greedy tokens of transformers."""
    hf, folder = family
    check_fp32_fused(hf, folder, monkeypatch)


def test_q8_0_layers_run_fused_and_match_the_reference_math(family, monkeypatch):
    """q8_0 weights: every layer of every step one fused C++ call; tokens and logits those of the reference block
    math on the same weights."""
    _, folder = family
    check_q8_0_fused(folder, monkeypatch)


def test_ring_layers_run_fused_through_wrapping_tables(family, monkeypatch):
    """Rings smaller than the context (slack 2): the sliding layers' caches wrap. The 40-token prompt is more than
    a ring takes in one call (slack + 1 = 3), so its sliding layers run fused in chunks of 3 and the full ones in one
    call; each decode step runs every layer fused, the sliding ones through tables that wrap around their rings.
    The tokens stay the reference math's."""
    monkeypatch.setattr(attention_sizes, "RING_SLACK", 2)
    _, folder = family
    llm, reference = (LLM(str(folder), quantization="q8_0", backend="cpu", max_model_len=64, batch_size=2)
                      for _ in range(2))
    reference.model.fuse = False
    counting = Counting(fused._C)
    monkeypatch.setattr(fused, "_C", counting)
    spec = llm.model.spec
    ids = prompt(40)  # the engine's cache holds 45 positions, past two rings of 16 (a pooled row of two)
    ours = greedy(llm, ids)
    full = sum(spec.kv_ring(i) is None for i in range(spec.n_layers))
    assert 0 < full < spec.n_layers
    assert counting.calls["layer_forward"] == full + (spec.n_layers - full) * -(-len(ids) // 3) + \
        spec.n_layers * (NEW - 1)
    assert ours == greedy(reference, ids)


@pytest.mark.parametrize("path", PATHS)
def test_each_layer_on_each_kernel_path_matches_the_reference(family, path):
    """Every layer (sliding and full) over a prompt past its window, then one decode token, on each kernel path."""
    _, folder = family
    spec = load_spec(folder)
    model = load_model(Checkpoint(folder), spec, quantization="q8_0")
    g = torch.Generator().manual_seed(0)
    for i, w in enumerate(model.layers):
        kvs = [layer_cache(spec, i, 1, 32, torch.float32) for _ in range(2)]
        for start, n in ((0, PROMPT_LEN), (PROMPT_LEN, 1)):
            positions = torch.arange(start, start + n)[None]
            step = make_step(spec, torch.float32, positions, torch.ones_like(positions, dtype=torch.bool), 32)
            x = torch.randn(1, n, spec.hidden_size, generator=g)
            out = fused.fused_layer_forward(spec, w, x, step, kvs[0], path, index=i)
            ref = layer_forward(spec, w, x, step, kvs[1], index=i)
            assert float((out - ref).abs().max()) <= 1e-4 * float(ref.abs().max()), (i, start)


def test_a_run_kept_from_decode_steps_is_not_taken_by_a_later_prompt_it_does_not_fit(family, monkeypatch):
    """The runner keeps each run of fused units for the steps after; a later step it does not fit goes the way
    host_layers would send it. One request at a time, so the second prompt's prefill follows the first's decode
    steps over the same caches: its 30 tokens are more than a ring layer takes in one call (tokens: the reference
    math's), and with fp32 weights past F32_KERNEL_ROWS (torch's linears, the fused attention: no fused run)."""
    import offload.runtime.unit_runner as unit_runner
    from offload import SamplingParams

    _, folder = family
    prompts = [{"prompt_token_ids": prompt(12, seed=2)}, {"prompt_token_ids": prompt(30, seed=3)}]
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    with monkeypatch.context() as m:
        m.setattr(unit_runner, "F32_KERNEL_ROWS", 1)  # dense fp32 linears fused at one token a step only
        fp32 = LLM(str(folder), backend="cpu", max_model_len=64, batch_size=1)
        counting = Counting(fused._C)
        m.setattr(fused, "_C", counting)
        fp32.generate(prompts, params)
    n_layers = fp32.model.spec.n_layers
    assert counting.calls["layer_forward"] == n_layers * 2 * (NEW - 1)  # the decode steps of both requests
    assert counting.calls["cached_attention"] >= n_layers * 2  # each prompt's prefill: its attention alone
    monkeypatch.setattr(attention_sizes, "RING_SLACK", 2)
    llm, reference = (LLM(str(folder), quantization="q8_0", backend="cpu", max_model_len=64, batch_size=1)
                      for _ in range(2))
    reference.model.fuse = False
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in reference.generate(prompts,
                                                                                                         params)]

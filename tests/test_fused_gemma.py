"""The fused C++ CPU layer computes Gemma 2 and Gemma 3 blocks (issue 45): norms after attention and the MLP, GELU-
tanh, the query_pre_attn_scalar scale, Gemma 2's soft-capped scores (a cap of 2 here, so that it bites), per-layer
sliding windows (6) under prompts of 20 tokens, Gemma 3's local rope and q/k norms. Caches keep every position
(a ring, spec.kv_ring, is larger than these contexts); layers whose cache is a ring run the reference math.

Tolerances: fp32 logits within conftest's 1e-4 x the logit range of transformers'; a layer on each kernel path
within 1e-4 x max |ref| of the reference block math on the same q8_0 weights (test_fused_layer.py's q8_0 bound)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import offload.kernels.layer as fused
from conftest import assert_logits_close, hf_logits, make_hf_model, offload_logits, save_hf_model
from offload import LLM, SamplingParams, attention_sizes
from offload.kernels import ACTIVE_PATH
from offload.model.llama import layer_forward
from offload.model.step import layer_cache, make_step
from offload.spec import load_spec
from offload.weights.loader import Checkpoint
from offload.weights.sources import load_model

pytestmark = pytest.mark.skipif(not fused.FUSABLE, reason=f"fused layer needs the C++ extension ({ACTIVE_PATH})")

FAMILIES = {"gemma2": ("gemma2", dict(num_attention_heads=8, num_key_value_heads=2, attn_logit_softcapping=2.0)),
            "gemma3": ("gemma3_text", dict(num_attention_heads=8, num_key_value_heads=1))}
PROMPT_LEN, NEW = 20, 6
PATHS = ["scalar"] + [p for p in ("avx2", "avx512") if ACTIVE_PATH in ("avx2", "avx512") and
                      (p == "avx2" or ACTIVE_PATH == "avx512")]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    arch, overrides = FAMILIES[request.param]
    hf = make_hf_model(arch, max_position_embeddings=128, **overrides)
    return hf, save_hf_model(hf, tmp_path_factory.mktemp(request.param))


class _Counting:
    """The extension, with its calls of the fused layer and of its attention alone counted."""

    def __init__(self, ext):
        self.ext, self.calls = ext, Counter()

    def __getattr__(self, name):
        real = getattr(self.ext, name)
        if name not in ("layer_forward", "cached_attention"):
            return real
        return lambda *args: self.calls.update([name]) or real(*args)


def _prompt(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, 160, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy(llm, ids: list[int]) -> list[int]:
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    return list(llm.generate([{"prompt_token_ids": ids}], params)[0].outputs[0].token_ids)


def _hf_greedy(hf, ids: list[int]) -> list[int]:
    out = list(ids)
    for _ in range(NEW):
        out.append(int(hf_logits(hf, out)[-1].argmax()))
    return out[len(ids):]


def test_the_fused_layer_takes_gemmas_math(family):
    assert fused.runs_math_of(load_spec(family[1]))


def test_fp32_layers_attend_fused_and_match_transformers(family, monkeypatch):
    """fp32 weights (torch's linears) with the fused layer's attention: logits and greedy tokens of transformers."""
    hf, folder = family
    llm = LLM(str(folder), backend="cpu")
    counting = _Counting(fused._C)
    monkeypatch.setattr(fused, "_C", counting)
    ids = _prompt(PROMPT_LEN)
    assert_logits_close(offload_logits(llm.model, ids), hf_logits(hf, ids))
    assert _greedy(llm, ids) == _hf_greedy(hf, ids)
    assert counting.calls["cached_attention"] >= llm.model.spec.n_layers * (NEW + 1)


def test_q8_0_layers_run_fused_and_match_the_reference_math(family, monkeypatch):
    """q8_0 weights: every layer of every step one fused C++ call; tokens and logits those of the reference block
    math on the same weights."""
    _, folder = family
    llm, reference = (LLM(str(folder), quantization="q8_0", backend="cpu") for _ in range(2))
    reference.model.fuse = False
    counting = _Counting(fused._C)
    monkeypatch.setattr(fused, "_C", counting)
    ids = _prompt(PROMPT_LEN)
    ours = _greedy(llm, ids)
    assert counting.calls["layer_forward"] >= llm.model.spec.n_layers * NEW
    counting.calls.clear()
    assert ours == _greedy(reference, ids) and not counting.calls
    assert_logits_close(offload_logits(llm.model, ids), offload_logits(reference.model, ids))


def test_ring_layers_run_the_reference_math_beside_fused_ones(family, monkeypatch):
    """Rings smaller than the context (slack 2): the sliding layers' caches wrap, those layers run the reference
    math and the full ones the fused layer; the tokens stay the reference's."""
    monkeypatch.setattr(attention_sizes, "RING_SLACK", 2)
    _, folder = family
    llm, reference = (LLM(str(folder), quantization="q8_0", backend="cpu", max_model_len=64, batch_size=2)
                          for _ in range(2))
    reference.model.fuse = False
    counting = _Counting(fused._C)
    monkeypatch.setattr(fused, "_C", counting)
    spec = llm.model.spec
    ids = _prompt(40)  # the engine's cache holds 45 positions, past two rings of 16 (a pooled row of two)
    ours = _greedy(llm, ids)
    full = sum(spec.kv_ring(i) is None for i in range(spec.n_layers))
    assert 0 < full < spec.n_layers and counting.calls["layer_forward"] == full * NEW
    assert ours == _greedy(reference, ids)


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

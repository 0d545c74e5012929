"""The fused C++ decoder layer (offload/kernels/layer.py) against the unfused reference layer_forward.

The matmuls are the same kernels, and only elementwise rounding and summation order differ, so outputs
agree to max |diff| <= 1e-5 x max |ref| (measured <= 8e-7 over 20 seeds), except against q8_0 weights:
their int16 activation quanta (amax / 32767) move with 1-ulp input differences, so 1e-4 there (measured
<= 5e-5; the kernels' own error against fp32 is 1e-4). The KV cache after the call equals the reference's
to the same tolerance (trash slot excepted: the fused layer writes nothing for padding).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import offload.kernels.layer as fused
from conftest import make_hf_model, save_hf_model
from offload import LLM, SamplingParams
from offload.kernels import ACTIVE_PATH, pack
from offload.kernels.step_tokens import token_table
from offload.model.llama import LayerWeights, layer_forward
from offload.model.step import LayerKV, make_step
from offload.rope_spec import RopeSpec
from offload.spec import ModelSpec

pytestmark = pytest.mark.skipif(not fused.FUSABLE, reason=f"fused layer needs the C++ extension ({ACTIVE_PATH})")

# dense: fp32 tensors, read in place; dense-bf16 / dense-fp16: bf16 / fp16 tensors, widened against fp32 activations
RTOL = {"q8_0": 1e-4, "q4_0": 1e-5, "bf16": 1e-5, "dense": 1e-5, "dense-bf16": 1e-5, "dense-fp16": 1e-5}
MAX_LEN = 64  # KV slots per row; slot MAX_LEN is the trash slot


def _spec(n_heads=4, n_kv_heads=2, window=None, bias=False) -> ModelSpec:
    return ModelSpec(architecture="llama", vocab_size=64, hidden_size=64, intermediate_size=96, n_layers=1,
                     n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=16, rms_norm_eps=1e-5, rope=RopeSpec(),
                     max_position_embeddings=64, qkv_bias=bias, sliding_window=window)


def _weights(spec: ModelSpec, fmt: str, bias: bool, seed: int = 0) -> LayerWeights:
    g = torch.Generator().manual_seed(seed)
    d, f, qkv_rows = spec.hidden_size, spec.intermediate_size, spec.q_size + 2 * spec.kv_size
    rand = lambda *shape: torch.randn(*shape, generator=g) * 0.2  # noqa: E731
    norm = lambda: torch.rand(d, generator=g) + 0.5  # noqa: E731
    maybe = lambda n: rand(n) if bias else None  # noqa: E731
    as_fmt = {"dense": lambda t: t, "dense-bf16": lambda t: t.bfloat16(), "dense-fp16": lambda t: t.half()}.get(
        fmt, lambda t: pack(t, fmt))
    return LayerWeights(attn_norm=norm(), qkv=as_fmt(rand(qkv_rows, d)), qkv_bias=maybe(qkv_rows),
                        o=as_fmt(rand(d, spec.q_size)), o_bias=maybe(d), mlp_norm=norm(),
                        gate_up=as_fmt(rand(2 * f, d)), gate_up_bias=maybe(2 * f),
                        down=as_fmt(rand(d, f)), down_bias=maybe(d))


def _step(spec, starts, lengths, width, rows=None, phase="prefill"):
    """Row b holds lengths[b] new tokens at positions starts[b]..., padded to width."""
    positions = torch.zeros(len(starts), width, dtype=torch.long)
    valid = torch.zeros_like(positions, dtype=torch.bool)
    for b, (start, n) in enumerate(zip(starts, lengths)):
        positions[b, :n] = torch.arange(start, start + n)
        valid[b, :n] = True
    return make_step(spec, torch.float32, positions, valid, trash_slot=MAX_LEN, rows=rows, phase=phase)


def _unfused(monkeypatch, *args):
    """The reference: llama.layer_forward is the plain block math, whatever kernels exist."""
    return layer_forward(*args)


def _run_both(monkeypatch, spec, w, x, step, kv):
    """(fused out, reference out, fused cache, reference cache) from the same starting cache."""
    kv_ref = LayerKV(kv.k.shape[0], spec.n_kv_heads, MAX_LEN, spec.head_dim, torch.float32)
    kv_ref.k.copy_(kv.k), kv_ref.v.copy_(kv.v)
    assert fused.can_fuse(w, x, kv)
    ref = _unfused(monkeypatch, spec, w, x, step, kv_ref)
    return fused.fused_layer_forward(spec, w, x, step, kv), ref, kv, kv_ref


def _assert_close(out, ref, fmt):
    err = (out - ref).abs().max().item()
    assert torch.isfinite(out).all() and err <= RTOL[fmt] * ref.abs().max().item(), err


def _assert_same_cache(kv, kv_ref, fmt):
    for a, b in ((kv.k, kv_ref.k), (kv.v, kv_ref.v)):
        _assert_close(a[:, :MAX_LEN], b[:, :MAX_LEN], fmt)


def _randn(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _prefilled(monkeypatch, spec, w, lengths, n_rows=None):
    """A cache whose rows hold lengths[b] tokens, filled by the reference path."""
    kv = LayerKV(n_rows or len(lengths), spec.n_kv_heads, MAX_LEN, spec.head_dim, torch.float32)
    x = _randn(len(lengths), max(lengths), spec.hidden_size, seed=2)
    rows = None if n_rows is None else torch.arange(len(lengths))
    _unfused(monkeypatch, spec, w, x, _step(spec, [0] * len(lengths), lengths, max(lengths), rows), kv)
    return kv


CASES = {  # name: (n_heads, n_kv_heads, sliding window, biases, format)
    "gqa-q8_0": (4, 2, None, False, "q8_0"),
    "gqa-q4_0": (4, 2, None, False, "q4_0"),
    "mha-q4_0": (2, 2, None, False, "q4_0"),
    "window-q8_0": (4, 1, 5, False, "q8_0"),
    "qwen2-bias-q8_0": (4, 2, None, True, "q8_0"),
    "bf16": (4, 2, None, True, "bf16"),
    "dense-fp32": (4, 2, None, True, "dense"),
    "dense-bf16": (4, 2, None, False, "dense-bf16"),
    "dense-fp16": (2, 2, None, True, "dense-fp16"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_with_padding_matches(case, monkeypatch):
    n_heads, n_kv, window, bias, fmt = CASES[case]
    spec = _spec(n_heads, n_kv, window, bias)
    w, lengths = _weights(spec, fmt, bias), [9, 4, 1]
    kv = LayerKV(3, spec.n_kv_heads, MAX_LEN, spec.head_dim, torch.float32)
    x = _randn(3, 9, spec.hidden_size)
    out, ref, kv, kv_ref = _run_both(monkeypatch, spec, w, x, _step(spec, [0, 0, 0], lengths, 9), kv)
    _assert_close(out, ref, fmt)  # padding tokens too: both see key 0 of their row only
    _assert_same_cache(kv, kv_ref, fmt)


@pytest.mark.parametrize("case", list(CASES))
def test_decode_matches(case, monkeypatch):
    n_heads, n_kv, window, bias, fmt = CASES[case]
    spec = _spec(n_heads, n_kv, window, bias)
    w, lengths = _weights(spec, fmt, bias), [11, 3]
    kv = _prefilled(monkeypatch, spec, w, lengths)
    x = _randn(2, 1, spec.hidden_size)
    out, ref, kv, kv_ref = _run_both(monkeypatch, spec, w, x, _step(spec, lengths, [1, 1], 1, phase="decode"), kv)
    _assert_close(out, ref, fmt)
    _assert_same_cache(kv, kv_ref, fmt)


def test_long_prefill_matches(monkeypatch):
    """Enough keys x heads that attention runs on all threads (csrc/layer.cpp's parallel threshold)."""
    spec = _spec(4, 2, None, False)
    w, lengths = _weights(spec, "q4_0", False), [62, 60, 40]  # 4603 keys x 4 heads x 16 >= 2^18
    kv = LayerKV(3, spec.n_kv_heads, MAX_LEN, spec.head_dim, torch.float32)
    x = _randn(3, 62, spec.hidden_size)
    out, ref, kv, kv_ref = _run_both(monkeypatch, spec, w, x, _step(spec, [0, 0, 0], lengths, 62), kv)
    _assert_close(out, ref, "q4_0")
    _assert_same_cache(kv, kv_ref, "q4_0")


def test_chunked_prefill_continues_rows_subset(monkeypatch):
    """New tokens appended after cached ones, in cache rows 3 and 1 of 4 (step.rows), one row padded."""
    spec = _spec(4, 2, None, False)
    w = _weights(spec, "q4_0", False)
    kv = _prefilled(monkeypatch, spec, w, [5, 6, 2, 7], n_rows=4)
    x = _randn(2, 4, spec.hidden_size)
    step = _step(spec, [7, 6], [4, 2], 4, rows=torch.tensor([3, 1]))
    out, ref, kv, kv_ref = _run_both(monkeypatch, spec, w, x, step, kv)
    _assert_close(out, ref, "q4_0")
    _assert_same_cache(kv, kv_ref, "q4_0")
    assert torch.equal(kv.k[[0, 2]], kv_ref.k[[0, 2]])  # rows not in the step stay untouched


def test_token_table_matches_attention_mask():
    """lo/hi per token select exactly the keys of step.attention_mask (causal, window, padding -> key 0)."""
    spec = _spec(window=3)
    step = _step(spec, [0, 4], [6, 2], 6)
    table, blocks = token_table(step, n_rows=2, n_slots=MAX_LEN + 1, sliding_window=3)
    assert blocks is None  # a step over whole rows: each sequence's keys are one run
    keys = torch.arange(step.mask.shape[-1])
    lo, hi = table[:, 2, None], table[:, 3, None]
    assert torch.equal((keys >= lo) & (keys <= hi), step.mask[:, 0].reshape(-1, keys.numel()))
    assert table[:, 0].tolist() == [0, 1, 2, 3, 4, 5, 69, 70, -1, -1, -1, -1]


def test_unsupported_inputs_fall_back():
    spec = _spec()
    w = _weights(spec, "q8_0", False)
    kv = LayerKV(1, spec.n_kv_heads, MAX_LEN, spec.head_dim, torch.float32)
    x = _randn(1, 2, spec.hidden_size)
    assert fused.can_fuse(w, x, kv) and fused.can_fuse(w, x.bfloat16(), kv)  # bf16: a GPU plan's format
    assert not fused.can_fuse(w, x.half(), kv)
    assert not fused.can_fuse(LayerWeights(**{**w.__dict__, "qkv": w.qkv.dequantize().double()}), x, kv)
    dense = LayerWeights(**{**w.__dict__, "qkv": w.qkv.dequantize()})  # fp32: offload's fp32 kernels read it
    assert fused.can_fuse(dense, x, kv) and fused.fuse_layer(spec, dense).dense and not fused.fuse_layer(spec, w).dense
    # bf16 rows of whole 32-element blocks: the bf16 tiles (or fp32-widening kernel) at any token count; fp16 and
    # bf16 rows the tiles do not take: steps of few tokens only
    for half, few_only in ((w.qkv.dequantize().bfloat16(), False), (w.qkv.dequantize().half(), True),
                           (torch.zeros(spec.q_size + 2 * spec.kv_size, 72, dtype=torch.bfloat16), True)):
        layer = LayerWeights(**{**w.__dict__, "qkv": half})
        assert fused.can_fuse(layer, x, kv) and fused.has_dense(layer) is few_only
    assert not fused.can_fuse(w, x, LayerKV(1, spec.n_kv_heads, MAX_LEN, spec.head_dim, torch.float16))
    mixed = LayerKV(1, spec.n_kv_heads, MAX_LEN, spec.head_dim, torch.float32)
    mixed.v = mixed.v.bfloat16()
    assert not fused.can_fuse(w, x, mixed)


@pytest.mark.parametrize("quantization", ["q8_0", "q4_0"])
def test_greedy_generation_unchanged(quantization, tmp_path, monkeypatch):
    folder = save_hf_model(make_hf_model("llama", num_hidden_layers=2), tmp_path / "tiny")
    llm = LLM(str(folder), quantization=quantization, backend="cpu")
    prompts = [{"prompt_token_ids": ids} for ids in ([5, 9, 31, 2, 77, 100, 3], [42, 8])]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    calls, runs, ext = [], [], fused._C
    counting = SimpleNamespace(fused_weights=ext.fused_weights, layer_forward=ext.layer_forward,
                               unit_run=lambda units: runs.append(len(units)) or ext.unit_run(units),
                               run_units=lambda *a: calls.append(1) or ext.run_units(*a))
    with monkeypatch.context() as m:
        m.setattr(fused, "_C", counting)
        ours = [o.token_ids for o in llm.generate(prompts, params)]
    assert len(calls) >= 12 and runs and set(runs) == {3}  # every step: both layers and the final norm, in C++
    reference = LLM(str(folder), quantization=quantization, backend="cpu")
    reference.model.fuse = False  # the executor's kernel choice: the reference block math for every layer
    calls.clear()
    with monkeypatch.context() as m:
        m.setattr(fused, "_C", counting)
        ref = [o.token_ids for o in reference.generate(prompts, params)]
    assert not calls and ours == ref and all(len(t) == 12 for t in ours)


def _layers_with_caches(monkeypatch, n: int):
    """(spec, n layers' q4_0 weights, two sequences' lengths, their prefilled caches, a copy of each cache)."""
    spec = _spec(4, 2, None, False)
    ws, lengths = [_weights(spec, "q4_0", False, seed=s) for s in range(n)], [6, 3]
    kvs = [_prefilled(monkeypatch, spec, w, lengths) for w in ws]
    copies = [LayerKV(2, spec.n_kv_heads, MAX_LEN, spec.head_dim, torch.float32) for _ in ws]
    for kv, copy in zip(kvs, copies):
        copy.k.copy_(kv.k), copy.v.copy_(kv.v)
    return spec, ws, lengths, kvs, copies


def test_layers_back_to_back_match_one_by_one(monkeypatch):
    """Three fused layers in one call (outputs alternate between two buffers) equal the reference layer by layer,
    caches included, and each layer's end time is recorded."""
    spec, ws, lengths, kvs, kvs_ref = _layers_with_caches(monkeypatch, 3)
    x, step, ends = _randn(2, 1, spec.hidden_size), _step(spec, lengths, [1, 1], 1, phase="decode"), []
    views = [fused.kv_view(kv) for kv in kvs]
    layers = [fused.fuse_layer(spec, w) for w in ws]
    out = fused.fused_layers_forward(layers, x, fused.step_table(spec, step, views[0]), views, ends)
    ref = x
    for w, kv_ref in zip(ws, kvs_ref):
        ref = _unfused(monkeypatch, spec, w, ref, step, kv_ref)
    _assert_close(out, ref, "q4_0")
    for kv, kv_ref in zip(kvs, kvs_ref):
        _assert_same_cache(kv, kv_ref, "q4_0")
    assert len(ends) == 3 and ends == sorted(ends)


def test_a_run_built_once_takes_each_step_and_refuses_tables_that_do_not_fit(monkeypatch):
    """A FusedRun made once runs later steps as a run made for each (the same C++ calls: equal bit for bit), its
    units' end times fall within the call, and step tables that do not fit its caches or tokens are refused."""
    import time

    from offload.errors import KernelError

    spec, ws, lengths, kvs, twins = _layers_with_caches(monkeypatch, 2)
    layers = [fused.fuse_layer(spec, w) for w in ws]
    views, twin_views = [fused.kv_view(kv) for kv in kvs], [fused.kv_view(kv) for kv in twins]
    run = fused.fused_run(layers, views)
    assert run.holds(layers, views) and not run.holds(layers, twin_views)
    for i in range(2):
        x, step, ends = _randn(2, 1, spec.hidden_size, seed=i), _step(spec, [n + i for n in lengths], [1, 1], 1,
                                                                        phase="decode"), []
        began = time.perf_counter()
        out = fused.run_fused(run, x, fused.step_table(spec, step, views[0]), ends)
        assert began <= ends[0] <= ends[1] <= time.perf_counter()
        twin = fused.fused_layers_forward(layers, x, fused.step_table(spec, step, twin_views[0]), twin_views)
        assert torch.equal(out, twin) and all(torch.equal(a.k, b.k) for a, b in zip(kvs, twins))
    tables = [fused.step_table(spec, step, v) for v in views]  # two tables for caches of one shape
    with pytest.raises(KernelError, match="different ones"):
        fused.run_fused(run, x, tables, [])
    with pytest.raises(KernelError, match="do not match the step's token table"):
        fused.run_fused(run, _randn(1, 1, spec.hidden_size), tables[0])


def test_the_model_math_never_calls_the_fused_layer(monkeypatch):
    """layer_forward is the reference: even with packed weights, fp32 CPU activations and an fp32 cache it
    runs torch ops, and nothing is stored on the weights, the cache or the step."""
    spec = _spec()
    w = _weights(spec, "q8_0", False)
    kv = LayerKV(1, spec.n_kv_heads, MAX_LEN, spec.head_dim, torch.float32)
    x, step = _randn(1, 3, spec.hidden_size), _step(spec, [0], [3], 3)
    before = (set(vars(w)), set(vars(kv)), set(vars(step)))
    monkeypatch.setattr(fused, "_C", None)  # any call into the extension would fail
    out = layer_forward(spec, w, x, step, kv)
    assert torch.isfinite(out).all()
    assert (set(vars(w)), set(vars(kv)), set(vars(step))) == before


def test_executor_builds_fused_handles_once_at_placement(tmp_path):
    """Host-resident CPU layers (and the fp32 final norm, which ends their run) get their fused handle when the
    weights are placed; steps reuse it."""
    folder = save_hf_model(make_hf_model("llama", num_hidden_layers=2), tmp_path / "tiny")
    llm = LLM(str(folder), quantization="q8_0", backend="cpu")
    handles = dict(llm.model.fused_layers)
    assert set(handles) == {"layer.0", "layer.1", "norm"} and isinstance(handles["norm"], fused.FusedNorm)
    assert llm.model._schedule["decode"][1] == ("layer.0", "layer.1", "norm")
    llm.generate([{"prompt_token_ids": [5, 9, 31]}], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert all(llm.model.fused_layers[n] is h for n, h in handles.items())
    assert all(set(vars(llm.model.host_weights[n])) == set(LayerWeights.__dataclass_fields__)
               for n in handles if n != "norm")
    bf16 = LLM(str(folder), quantization="q8_0", dtype="bf16", backend="cpu")  # bf16 norm weights: a unit apart
    assert "norm" not in bf16.model.fused_layers and bf16.model._schedule["decode"][1:] == [("layer.0", "layer.1"),
                                                                                             "norm"]


@pytest.mark.parametrize("quantization", ["q8_0", "q4_0", "none"])
def test_a_bf16_plans_cpu_layers_run_fused_and_keep_bf16_caches(quantization, tmp_path, monkeypatch):
    """dtype bf16 (a GPU plan's compute format) on the CPU: every layer of every step goes through the fused C++
    layer with bf16 hidden states and bf16 KV caches (nothing widened to fp32 between the calls), and greedy tokens
    follow those of the reference block math in bf16."""
    folder = save_hf_model(make_hf_model("llama", num_hidden_layers=2), tmp_path / "tiny")
    prompts = [{"prompt_token_ids": ids} for ids in ([5, 9, 31, 2, 77, 100, 3], [42, 8])]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    llm = LLM(str(folder), quantization=quantization, dtype="bf16", backend="cpu")
    seen, caches, ext = [], [], fused._C

    def unit_run(units):
        caches.extend(u[6] for u in units)  # kv_bf16 of each layer
        return ext.unit_run(units)

    def run_units(*args):
        seen.append(args[9])  # act_bf16
        return ext.run_units(*args)

    with monkeypatch.context() as m:
        m.setattr(fused, "_C", SimpleNamespace(fused_weights=ext.fused_weights, layer_forward=ext.layer_forward,
                                               unit_run=unit_run, run_units=run_units))
        ours = [o.token_ids for o in llm.generate(prompts, params)]
    assert len(seen) >= 8 and set(seen) == {1} and caches and set(caches) == {1}
    cache = llm.model.runner._kv_views
    assert cache and all(v.kv.k.dtype is torch.bfloat16 and v.bf16 for v in cache.values())
    reference = LLM(str(folder), quantization=quantization, dtype="bf16", backend="cpu")
    reference.model.fuse = False  # the reference block math in torch bf16 (a bf16 model's embeddings, norms, head)
    ref = [o.token_ids for o in reference.generate(prompts, params)]
    assert [t[:3] for t in ours] == [t[:3] for t in ref]  # later ones may part at a near tie: torch rounds each op


ATTENTION_PATHS = ["scalar"] + [p for p in ("avx2", "avx512") if ACTIVE_PATH in ("avx2", "avx512") and
                                  (p == "avx2" or ACTIVE_PATH == "avx512")]


@pytest.mark.parametrize("path", ATTENTION_PATHS)
@pytest.mark.parametrize("n_heads,n_kv,head_dim,window,lengths", [
    (9, 3, 64, None, [1500, 700]),  # SmolLM2's heads, a long prompt and a shorter one in one step
    (8, 1, 128, None, [301]),  # a whole group of 8 query heads on one KV head, 128-wide heads
    (4, 4, 32, 100, [450, 9]),  # sliding window: keys [pos - 99, pos]; a head size without its own tiles
    (6, 2, 24, None, [77]),  # head size not a multiple of 8: the per-query loop on every path
])
def test_long_prompt_attention_matches_exact_softmax(path, n_heads, n_kv, head_dim, window, lengths):
    """Attention on each kernel path (blocked online softmax on AVX2 and AVX-512, one query at a time on the
    scalar path) against softmax(q k^T) v in float64 over prompts of up to 1500 tokens: max |diff| <= 1e-5 x
    max |ref| (fp32 scores, a polynomial exp)."""
    _attention_matches_exact_softmax(path, n_heads, n_kv, head_dim, window, lengths, torch.float32)


def _attention_matches_exact_softmax(path, n_heads, n_kv, head_dim, window, lengths, kv_dtype) -> None:
    """cached_attention over a prompt per row into a cache of kv_dtype, against softmax(q k^T) v in float64 over
    the values the cache holds (within 1e-5 x max |ref|); a bf16 cache holds K as torch rounds it."""
    max_len = max(lengths) + 1
    spec = ModelSpec(architecture="llama", vocab_size=64, hidden_size=n_heads * head_dim, intermediate_size=96,
                     n_layers=1, n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, rms_norm_eps=1e-5,
                     rope=RopeSpec(), max_position_embeddings=max_len, sliding_window=window)
    width = max(lengths)
    positions = torch.zeros(len(lengths), width, dtype=torch.long)
    valid = torch.zeros_like(positions, dtype=torch.bool)
    for b, n in enumerate(lengths):
        positions[b, :n] = torch.arange(n)
        valid[b, :n] = True
    step = make_step(spec, torch.float32, positions, valid, trash_slot=max_len, phase="prefill")
    kv = LayerKV(len(lengths), n_kv, max_len, head_dim, kv_dtype)
    view = fused.kv_view(kv)
    assert view is not None and view.bf16 == (kv_dtype is torch.bfloat16)
    qkv = _randn(len(lengths) * width, spec.q_size + 2 * spec.kv_size) * 2
    att = fused.cached_attention(spec, qkv, fused.step_table(spec, step, view), view, path)  # ropes qkv in place
    rows = qkv.view(len(lengths), width, -1)
    q = rows[..., :spec.q_size].double().view(len(lengths), width, n_heads, head_dim)
    group = n_heads // n_kv
    for b, n in enumerate(lengths):
        new_k = rows[b, :n, spec.q_size:spec.q_size + spec.kv_size].reshape(n, n_kv, head_dim)
        assert torch.equal(kv.k[b, :n], new_k.to(kv_dtype))  # stored as torch rounds
        k = kv.k[b, :n].double().repeat_interleave(group, dim=1)  # [n, heads, dh]
        v = kv.v[b, :n].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[b, :n], k) / head_dim ** 0.5
        pos = torch.arange(n)
        seen = pos[None, :] <= pos[:, None]
        if window is not None:
            seen &= pos[None, :] > pos[:, None] - window
        ref = torch.einsum("hqk,khd->qhd", scores.masked_fill(~seen, float("-inf")).softmax(-1), v).reshape(n, -1)
        got = att.view(len(lengths), width, -1)[b, :n].double()
        assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("path", ATTENTION_PATHS)
@pytest.mark.parametrize("n_heads,n_kv,head_dim,lengths", [
    (9, 3, 64, [300, 40]),  # SmolLM2's heads: the 64-wide tiles
    (8, 1, 128, [130]),  # the 128-wide tiles
    (4, 4, 32, [90, 9]),  # a head size without its own tiles: widened into buffers
    (6, 2, 24, [77]),  # not a multiple of 8: the per-query loop
    (2, 1, 264, [40]),  # wider than the bf16 tiles' buffers: the per-query loop
])
def test_attention_over_a_bf16_cache_matches_exact_softmax(path, n_heads, n_kv, head_dim, lengths):
    """A bf16 KV cache (a GPU plan's compute format): K and V are stored rounded to nearest even, exactly as torch
    rounds them, and attention over the stored values matches softmax(q k^T) v in float64 within 1e-5 x max |ref|
    on each kernel path."""
    _attention_matches_exact_softmax(path, n_heads, n_kv, head_dim, None, lengths, torch.bfloat16)


@pytest.mark.parametrize("path", ATTENTION_PATHS)
@pytest.mark.parametrize("fmt", ["q4_0", "q8_0", "bf16", "dense-bf16"])
def test_a_bf16_layer_matches_the_fp32_reference(path, fmt, monkeypatch):
    """bf16 hidden states and a bf16 cache through the fused layer (prefill with padding, then decode) against the
    reference block math in fp32 on the same values (the bf16 input widened, a bf16 cache, which it also writes
    rounded and reads widened; the inputs of bf16 weights' linears rounded to bf16, as the fused layer and torch's
    bf16 path take them): the output within 4e-3 of max |ref| (one bf16 rounding, 2^-9 relative, with the kernels'
    own differences), the cache within one bf16 step. The hidden states stay bf16 in and out."""
    spec = _spec(4, 2, None, "bf16" in fmt)
    w = _weights(spec, fmt, "bf16" in fmt)
    import offload.model.llama as llama

    def rounding_linear(x, weight, bias, linear=llama.linear):
        bf16 = getattr(weight, "dtype", None) is torch.bfloat16 or getattr(weight, "fmt", None) == "bf16"
        return linear(x.bfloat16().float() if bf16 else x, weight, bias)

    monkeypatch.setattr(llama, "linear", rounding_linear)
    kv, kv_ref = (LayerKV(3, spec.n_kv_heads, MAX_LEN, spec.head_dim, torch.bfloat16) for _ in range(2))
    lengths = [9, 4, 1]
    x = _randn(3, 9, spec.hidden_size).to(torch.bfloat16)
    steps = [(x, _step(spec, [0, 0, 0], lengths, 9)),
             (_randn(3, 1, spec.hidden_size, seed=5).to(torch.bfloat16), _step(spec, lengths, [1, 1, 1], 1,
                                                                                 phase="decode"))]
    for x, step in steps:
        out = fused.fused_layer_forward(spec, w, x, step, kv, path)
        ref = layer_forward(spec, w, x.float(), step, kv_ref)
        assert out.dtype is torch.bfloat16 and torch.isfinite(out.float()).all()
        assert (out.float() - ref).abs().max() <= 4e-3 * ref.abs().max()
        for got, want in ((kv.k, kv_ref.k), (kv.v, kv_ref.v)):  # the trash slot (padding's writes) aside
            got, want = got[:, :MAX_LEN].float(), want[:, :MAX_LEN].float()
            assert ((got - want).abs() <= 2 ** -7 * want.abs() + 1e-6).all()


def test_bench_bf16_cpu_smoke():
    """scripts/bench_bf16_cpu.py runs end to end (a tiny model, one repeat) and prints each variant's ratio."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "scripts" / "bench_bf16_cpu.py"
    proc = subprocess.run([sys.executable, str(script), "--smoke"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("tiny")]
    assert [r.split()[2] for r in rows] == ["fp32", "bf16", "bf16"] and rows[1].count("x") == 2

"""The C++ MoE code (csrc/layer.cpp: a MoE layer's attention part in the fused layer, and the routed experts)
against the reference block math (offload.model.llama.layer_forward(moe=True), offload.model.moe.experts_forward).

The matmuls are the same kernels; only elementwise rounding and summation order differ: max |diff| <= 1e-5 x
max |ref| for q4_0 weights, 1e-4 for q8_0 (its int16 activation quanta move with 1-ulp input differences), as
tests/test_fused_layer.py states. The routed experts run on every kernel path the machine has."""

from __future__ import annotations

import pytest
import torch

import offload.kernels.layer as fused
from offload.kernels import ACTIVE_PATH, pack
from offload.model.llama import LayerWeights, layer_forward
from offload.model.step import LayerKV, make_step
from offload.model.moe import ExpertWeights, experts_forward
from offload.spec import spec_from_config

pytestmark = pytest.mark.skipif(not fused.HAS_MOE, reason=f"fused MoE needs the C++ extension ({ACTIVE_PATH})")

RTOL = {"q8_0": 1e-4, "q4_0": 1e-5, "bf16-handover": 4e-3}  # bf16: one rounding of the output (2^-9)
PATHS = ["scalar"] + [p for p in ("avx2", "avx512") if ACTIVE_PATH in ("avx2", "avx512") and
                      (p == "avx2" or ACTIVE_PATH == "avx512")]
MAX_LEN = 64


def _spec(arch: str, shared: int = 0):
    config = {"model_type": arch, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 1, "vocab_size": 64, "intermediate_size": 96, "max_position_embeddings": 64,
              "rms_norm_eps": 1e-5, "num_experts_per_tok": 3, "moe_intermediate_size": 64, "head_dim": 32}
    config["num_local_experts" if arch == "mixtral" else "num_experts"] = 7
    if arch == "qwen2_moe":
        config["shared_expert_intermediate_size"] = shared
    return spec_from_config(config)


def _attention_part(spec, fmt: str, seed: int = 0) -> LayerWeights:
    g = torch.Generator().manual_seed(seed)
    d, f = spec.hidden_size, spec.moe.shared_size
    rand = lambda *shape: torch.randn(*shape, generator=g) * 0.2  # noqa: E731
    norm = lambda n: torch.rand(n, generator=g) + 0.5  # noqa: E731
    qkv_rows = spec.q_size + 2 * spec.kv_size
    return LayerWeights(attn_norm=norm(d), qkv=pack(rand(qkv_rows, d), fmt),
                        qkv_bias=rand(qkv_rows) if spec.qkv_bias else None, o=pack(rand(d, spec.q_size), fmt),
                        o_bias=None, mlp_norm=norm(d), gate_up=pack(rand(2 * f, d), fmt) if f else None,
                        gate_up_bias=None, down=pack(rand(d, f), fmt) if f else None, down_bias=None,
                        q_norm=norm(spec.head_dim) if spec.qk_norm else None,
                        k_norm=norm(spec.head_dim) if spec.qk_norm else None,
                        shared_gate=rand(1, d) if f else None)


def _experts(spec, fmt: str, seed: int = 1) -> ExpertWeights:
    g = torch.Generator().manual_seed(seed)
    d, f, n = spec.hidden_size, spec.moe.expert_size, spec.moe.n_experts
    rand = lambda *shape: torch.randn(*shape, generator=g) * 0.2  # noqa: E731
    return ExpertWeights(rand(n, d) * 5, tuple(pack(rand(2 * f, d), fmt) for _ in range(n)),
                         tuple(pack(rand(d, f), fmt) for _ in range(n)))


def _close(ours, ref, fmt):
    assert (ours - ref).abs().max() <= RTOL[fmt] * ref.abs().max()


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
@pytest.mark.parametrize("arch, shared", [("mixtral", 0), ("qwen2_moe", 96), ("qwen3_moe", 0)])
def test_attention_part_matches_reference(arch, shared, fmt):
    spec = _spec(arch, shared)
    w = _attention_part(spec, fmt)
    handle = fused.fuse_layer(spec, w, moe=True)
    assert handle is not None and handle.moe
    assert fused.fuse_layer(spec, w, moe=False) is None  # never run as a dense layer
    g = torch.Generator().manual_seed(3)
    for lengths, start in (([9, 4], 0), ([1, 1], 9)):  # a padded prefill, then one decode token per row
        positions = torch.tensor([[start + i for i in range(max(lengths))]] * 2)
        valid = torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]
        step = make_step(spec, torch.float32, positions, valid, trash_slot=MAX_LEN)
        x = torch.randn(2, max(lengths), spec.hidden_size, generator=g)
        if start == 0:
            kv_ref, kv_ours = (LayerKV(2, spec.n_kv_heads, MAX_LEN, spec.head_dim, torch.float32) for _ in range(2))
        ref = layer_forward(spec, w, x, step, kv_ref, moe=True)
        view = fused.kv_view(kv_ours)
        ours = fused.fused_layers_forward([handle], x, fused.step_table(spec, step, view), [view])
        assert ours.shape == (2, max(lengths), 2 * spec.hidden_size)
        _close(ours[valid], ref[valid], fmt)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
@pytest.mark.parametrize("n_tokens", [1, 2, 5, 37, 300])
def test_experts_match_reference(n_tokens, fmt, path):
    for arch in ("mixtral", "qwen2_moe"):  # renormalised top-k weights, and not
        spec = _spec(arch, 32)
        w = _experts(spec, fmt)
        handle = fused.fuse_experts(spec.moe, w)
        x = torch.randn(n_tokens, 2 * spec.hidden_size, generator=torch.Generator().manual_seed(n_tokens))
        ours = fused.fused_experts_forward(handle, x, path)
        _close(ours, experts_forward(spec.moe, w, x), fmt)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("arch, shared", [("mixtral", 0), ("qwen2_moe", 96)])
def test_a_bf16_moe_layer_matches_the_fp32_reference(arch, shared, path):
    """A GPU plan's bf16 hand-over through the fused attention part (bf16 cache) and the routed experts: each
    against the reference math in fp32 on the same values (bf16 input widened; the attention part's reference
    writing and reading a bf16 cache too) within 4e-3 of max |ref| (one bf16 rounding of the output); the
    outputs stay bf16."""
    spec = _spec(arch, shared)
    w, ew = _attention_part(spec, "q4_0"), _experts(spec, "q4_0")
    layer, experts = fused.fuse_layer(spec, w, moe=True), fused.fuse_experts(spec.moe, ew)
    g = torch.Generator().manual_seed(4)
    kv_ref, kv_ours = (LayerKV(2, spec.n_kv_heads, MAX_LEN, spec.head_dim, torch.bfloat16) for _ in range(2))
    for lengths, start in (([9, 4], 0), ([1, 1], 9)):
        positions = torch.tensor([[start + i for i in range(max(lengths))]] * 2)
        valid = torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]
        step = make_step(spec, torch.float32, positions, valid, trash_slot=MAX_LEN)
        x = torch.randn(2, max(lengths), spec.hidden_size, generator=g).bfloat16()
        ref = layer_forward(spec, w, x.float(), step, kv_ref, moe=True)
        view = fused.kv_view(kv_ours)
        ours = fused.fused_layers_forward([layer], x, fused.step_table(spec, step, view), [view], path=path)
        assert ours.dtype is torch.bfloat16
        _close(ours[valid].float(), ref[valid], "bf16-handover")
        out = fused.fused_experts_forward(experts, ours[valid], path)
        assert out.dtype is torch.bfloat16
        _close(out.float(), experts_forward(spec.moe, ew, ours[valid].float()), "bf16-handover")


def test_experts_reject_bad_ids_and_float_weights():
    spec = _spec("mixtral")
    w = _experts(spec, "q4_0")
    dense = ExpertWeights(w.router, tuple(p.dequantize() for p in w.gate_up), w.down)
    assert fused.fuse_experts(spec.moe, dense) is None  # float experts run the reference math
    handle = fused.fuse_experts(spec.moe, w)
    x = torch.randn(2, 2 * spec.hidden_size)
    ids = torch.tensor([[0, 1, 9], [2, 3, 4]])  # expert 9 of 7
    out = torch.empty(2, spec.hidden_size)
    with pytest.raises(ValueError, match="expert id out of range"):
        fused._C.experts_forward(handle.view, 0, 1, 2, x.data_ptr(), ids.data_ptr(),
                                 torch.ones(2, 3).data_ptr(), out.data_ptr(), 0)


def test_units_out_of_model_order_are_refused():
    """Experts take the hand-over of the attention part just before them: a chain that feeds them plain hidden
    states (or feeds a layer the hand-over) is refused, not computed on garbage. A final norm ends a run (its
    output: the run's without it, normed), and only with fp32 activations."""
    from offload.errors import KernelError
    from offload.kernels.ops import norm_rows

    spec = _spec("mixtral")
    layer = fused.fuse_layer(spec, _attention_part(spec, "q4_0"), moe=True)
    experts = fused.fuse_experts(spec.moe, _experts(spec, "q4_0"))
    step = make_step(spec, torch.float32, torch.arange(3)[None], torch.ones(1, 3, dtype=torch.bool), MAX_LEN)
    kv = LayerKV(1, spec.n_kv_heads, MAX_LEN, spec.head_dim, torch.float32)
    view = fused.kv_view(kv)
    table = fused.step_table(spec, step, view)
    x = torch.randn(1, 3, spec.hidden_size)
    assert fused.fused_layers_forward([layer, experts], x, table, [view, None]).shape == x.shape
    norm = fused.fuse_norm(torch.rand(spec.hidden_size) + 0.5, spec.rms_norm_eps)
    normed = fused.fused_layers_forward([layer, experts, norm], x, table, [view, None, None])
    torch.testing.assert_close(normed, norm_rows(fused.fused_layers_forward([layer, experts], x, table, [view, None]),
                                                 norm.weight, norm.eps), rtol=1e-6, atol=1e-6)  # its K, V again
    for units, views in (([experts], [None]), ([layer, layer], [view, view]), ([experts, layer], [None, view]),
                         ([layer, norm], [view, None]), ([layer, experts, norm, layer], [view, None, None, view]),
                         ([norm], [None])):
        with pytest.raises(KernelError, match="hand-over"):
            fused.fused_layers_forward(units, x, table, views)
    with pytest.raises(KernelError, match="takes fp32 activations"):
        fused.fused_layers_forward([layer, experts, norm], x.bfloat16(), table, [view, None, None])

"""What a decode step does outside the layers, done with fewer operations: rope rows looked up, ragged groups
described without masks, the final norm in C++, block spans kept as runs. Each must equal what it replaced."""

from __future__ import annotations

import pytest
import torch

from offload.kernels import ACTIVE_PATH
from offload.kernels.ops import norm_rows, rms_norm
from offload.model import rope
from offload.model.step import make_step, ragged_step
from offload.profile.timeline import Span, Timeline
from offload.rope_spec import RopeSpec
from offload.sampling import all_finite
from offload.runtime.backends.base import Work
from offload.spec import ModelSpec

ROPES = [RopeSpec(), RopeSpec(theta=500000.0, type="llama3", factor=8.0, original_max_position_embeddings=64,
                              low_freq_factor=1.0, high_freq_factor=4.0),
         RopeSpec(type="dynamic", factor=2.0), RopeSpec(type="linear", factor=4.0, attention_factor=1.5)]
MAX_POSITIONS = 2048


@pytest.mark.parametrize("spec_rope", ROPES, ids=lambda r: r.type)
@pytest.mark.parametrize("positions", [[[5], [17], [rope.ROPE_ROWS - 1]], [list(range(300))], [[rope.ROPE_ROWS]],
                                       [list(range(rope.ROPE_ROWS - 50, rope.ROPE_ROWS + 50))], [[3000]]],
                         ids=["decode", "prefill", "past-the-rows", "across-the-rows", "past-dynamic-length"])
def test_rope_rows_looked_up_equal_the_ones_computed(spec_rope, positions):
    positions = torch.tensor(positions)
    for dim in (16, 64, 128):
        cos, sin = rope._cos_sin(spec_rope, dim, positions, MAX_POSITIONS, int(positions.max()))
        inv_freq = rope._shared_inv_freq(spec_rope, dim, int(positions.max()) + 1, MAX_POSITIONS)
        ref_cos, ref_sin = rope._cos_sin_of(spec_rope, inv_freq, positions)
        assert cos.shape == ref_cos.shape == (positions.shape[0], 1, positions.shape[1], dim)
        assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)


def _spec() -> ModelSpec:
    return ModelSpec(architecture="llama", vocab_size=64, hidden_size=64, intermediate_size=96, n_layers=1,
                     n_heads=4, n_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope=RopeSpec(),
                     max_position_embeddings=MAX_POSITIONS)


@pytest.mark.parametrize("positions", [[[40], [7], [19]], [[33, 34, 35, 36, 37]]], ids=["decode", "chunk"])
def test_a_group_of_real_tokens_is_described_as_with_its_valid_mask(positions):
    spec, positions = _spec(), torch.tensor(positions)
    tables = torch.tensor([[9, 2, 5], [0, 1, 3], [4, 6, 8]])[: positions.shape[0]]
    valid = torch.ones_like(positions, dtype=torch.bool)
    lean = make_step(spec, torch.float32, positions, None, 999, phase="decode", tables=tables)
    full = make_step(spec, torch.float32, positions, valid, 999, phase="decode", tables=tables)
    for name in ("positions", "write_index", "valid", "cos", "sin"):
        assert torch.equal(getattr(lean, name), getattr(full, name)), name
    assert lean.n_keys == full.n_keys == int(positions.max()) + 1
    one = ragged_step(spec, torch.float32, [(positions, tables)], 999, "decode")
    assert torch.equal(one.write_index, full.write_index.reshape(1, -1)) and one.n_keys == full.n_keys


@pytest.mark.skipif(ACTIVE_PATH == "numba", reason="the C++ norm needs the C++ extension")
@pytest.mark.parametrize("shape", [(1, 1, 1024), (3, 5, 576), (2, 7), (20, 64)])
def test_the_cpp_norm_equals_torchs(shape):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(*shape, generator=g) * 3, torch.randn(shape[-1], generator=g)
    torch.testing.assert_close(norm_rows(x, w, 1e-5), rms_norm(x, w, 1e-5), rtol=1e-6, atol=2e-6)
    strided = torch.randn(8, 2 * shape[-1], generator=g)[:, ::2]  # not contiguous: copied first
    torch.testing.assert_close(norm_rows(strided, w, 1e-6), rms_norm(strided, w, 1e-6), rtol=1e-6, atol=2e-6)
    half = x.bfloat16()  # bf16 rows: torch's math, as before
    assert torch.equal(norm_rows(half, w.bfloat16(), 1e-5), rms_norm(half, w.bfloat16(), 1e-5))


def test_block_runs_read_as_spans_in_the_order_added():
    tl = Timeline()
    tl.add(Span("disk_read", "decode", "layer.0", 0.0, 1.0, n_bytes=8))
    tl.add_blocks("cpu_block", [Work("layer.0", "layer", "decode", 3), Work("layer.1", "layer", "decode", 3)],
                  [1.0, 1.5, 2.5])
    tl.add(Span("wait", "decode", "layer.2", 2.5, 3.0))
    tl.add_blocks("cpu_block", [Work("lm_head", "lm_head", "decode", 1)], [3.0, 3.25])
    expect = [("disk_read", "layer.0", 0.0, 1.0, 0), ("cpu_block", "layer.0", 1.0, 1.5, 3),
              ("cpu_block", "layer.1", 1.5, 2.5, 3), ("wait", "layer.2", 2.5, 3.0, 0),
              ("cpu_block", "lm_head", 3.0, 3.25, 1)]
    assert [(s.kind, s.unit, s.start_s, s.end_s, s.n_tokens) for s in tl.spans] == expect
    assert tl.busy_s("cpu", "decode") == pytest.approx(1.75)
    tl.add_blocks("cpu_block", [Work("layer.0", "layer", "decode", 2)], [4.0, 4.5])
    taken = tl.drain()
    assert [s.unit for s in taken.spans][-1] == "layer.0" and len(taken.spans) == 6 and tl.spans == []
    with pytest.raises(ValueError, match="unknown span kind"):
        tl.add_blocks("gpu_sleep", [Work("layer.0", "layer", "decode", 1)], [0.0, 1.0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_are_finite_unless_one_is_nan_or_infinite(dtype):
    logits = torch.randn(3000, generator=torch.Generator().manual_seed(0)).to(dtype)
    assert all_finite(logits) and all_finite(logits[::3])
    for bad in (float("nan"), float("inf"), float("-inf")):
        broken = logits.clone()
        broken[1234] = bad
        assert not all_finite(broken), bad
    huge = torch.full((100_000,), 3e38, dtype=dtype)  # their sum overflows
    assert all_finite(huge) and not all_finite(torch.cat([huge, torch.tensor([float("nan")], dtype=dtype)]))

"""GGUF block formats read as stored with fused CPU kernels (q4_1, q5_0, q5_1, iq4_nl, q2_k, q3_k, q4_k, q5_k, q6_k,
iq4_xs, mxfp4): dequantize against gguf-py bit for bit, every
kernel path against the scalar reference and the dequantized fp32 matmul, the fused layer, the numba fallback,
bad inputs; mxfp4's every e8m0 scale byte on every path.

Tolerances, as normalized error ||y - y_ref|| / ||y_ref||:
  SIMD paths vs the scalar reference (same integer dot products, other fp32 summation order): 1e-5
  (measured <= 2.7e-7 over these shapes);
  scalar reference vs x @ dequantize(w).T in fp32: q4_1 (int16 activations, as q8_0's 1e-4): 1e-4 (measured
  <= 5.3e-5 over these shapes, ~2e-5 typical, fp32 and bf16 inputs); the others (int8 activations, as q4_0's
  2e-2): 3e-2 (measured <= 2.3e-2, mxfp4's, ~5e-3 typical; one output alone, M = N = 1, swings most).
The default model's Q4_1 file read as stored, against transformers' dequantized fp32 model: see
test_default_q4_1_model_answers_paris_and_matches_transformers.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import assert_thread_count_invariant

import offload.kernels as K
from offload.errors import KernelError
from offload.formats import CPU_KERNELS, GGUF_BLOCKS, GGUF_TYPE

gguf = pytest.importorskip("gguf")

TOL_REF = 1e-5
TOL_FLOAT = {"q4_1": 1e-4}  # the others (int8 activations): 3e-2
FORMATS = [f for f in GGUF_BLOCKS if f in CPU_KERNELS]  # the GGUF types with fused CPU kernels (the others: test_formats.py)
SIMD = [p for p, need in (("avx2", {"avx2", "fma", "f16c"}),
                          ("avx512", {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512vnni"}))
        if K._C is not None and need <= K.CPU_FEATURES]
# (M, blocks per row, N): M = 1, 3, 5, 67; one block, several, an odd count (K not a multiple of 64 / 512) and
# for q4_1 counts past whole groups of 8 blocks (9, 17); N = 1 (matrix-vector), 2, 3, 7, 33. The AVX-512 16-row
# tiles (from 8 tokens): rows past the last whole 16, 8 tokens, 16 + 16 + 1 (q4_1: 4 x 8 + 1), 150.
SHAPES = [(1, 1, 1), (3, 1, 2), (5, 3, 1), (67, 2, 3), (5, 9, 7), (3, 17, 33), (67, 5, 1), (1, 4, 33), (4, 3, 2),
          (67, 2, 33), (40, 9, 8), (16, 3, 150)]


def nerr(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y - ref).norm() / ref.norm().clamp_min(1e-30))


def gguf_blocks(fmt: str, m: int, k: int, seed: int = 0) -> np.ndarray:
    """Realistic GGUF bytes uint8 [m, row_bytes]: gguf-py's quantizer where it has one (q4_1, mxfp4), else random
    bytes with small finite fp16 fields (the scale d, and a minimum m / dmin where the format has one)."""
    rng = np.random.default_rng(seed)
    per_block, block_bytes = GGUF_BLOCKS[fmt]
    if fmt in ("q4_1", "mxfp4"):
        w = rng.standard_normal((m, k)).astype(np.float32) * rng.uniform(0.1, 1.0, (m, 1)).astype(np.float32)
        return gguf.quants.quantize(w, getattr(gguf.GGMLQuantizationType, fmt.upper())).reshape(m, -1)
    blocks = rng.integers(0, 256, (m * k // per_block, block_bytes), dtype=np.uint8)

    def fp16(lo, hi):
        return rng.uniform(lo, hi, blocks.shape[0]).astype(np.float16).view(np.uint8).reshape(-1, 2)

    d, *minimum = GGUF_TYPE[fmt].f16_offsets
    blocks[:, d:d + 2] = fp16(1e-4, 2e-3) if fmt in ("q6_k", "q3_k") else fp16(1e-3, 2e-2)
    for at in minimum:  # q2_k's minimums per 16 weights: kept below its scales, as in real files
        blocks[:, at:at + 2] = fp16(0.0, 4e-3 if fmt == "q2_k" else 2e-2)
    return blocks.reshape(m, -1)


def case(fmt: str, m: int, n_blocks: int, n: int, seed: int = 0):
    k = n_blocks * GGUF_BLOCKS[fmt][0]
    w = K.PackedWeight.from_gguf(gguf_blocks(fmt, m, k, seed), fmt, (m, k))
    g = torch.Generator().manual_seed(seed)
    return w, torch.randn(n, k, generator=g) * 3, torch.randn(m, generator=g)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,n_blocks", [(1, 1), (67, 3), (5, 9)])
def test_dequantize_is_bit_identical_with_gguf_py(fmt, m, n_blocks):
    k = n_blocks * GGUF_BLOCKS[fmt][0]
    raw = gguf_blocks(fmt, m, k, seed=m)
    want = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, fmt.upper()))
    got = K.PackedWeight.from_gguf(raw, fmt, (m, k)).dequantize()
    assert got.dtype == torch.float32 and tuple(got.shape) == (m, k)
    assert np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("fmt", FORMATS)
def test_gguf_bytes_are_wrapped_as_they_are(fmt):
    k = 2 * GGUF_BLOCKS[fmt][0]
    raw = gguf_blocks(fmt, 3, k)
    w = K.PackedWeight.from_gguf(raw, fmt, (3, k))
    assert w.qs.data_ptr() == raw.ctypes.data  # no copy of writable contiguous bytes
    assert w.d is None and not w.tiled and w.nbytes == raw.nbytes
    assert w.to_rows() is w and w.to_tiled() is w
    assert np.array_equal(w.to_gguf(), raw)
    from_bytes = K.PackedWeight.from_gguf(raw.tobytes(), fmt, (3, k))  # read-only bytes: copied once
    assert torch.equal(from_bytes.qs, w.qs)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,n_blocks,n", SHAPES)
def test_scalar_ref_matches_float_reference(fmt, m, n_blocks, n):
    w, x, bias = case(fmt, m, n_blocks, n, seed=m + n)
    want = x @ w.dequantize().T + bias
    assert nerr(K.linear_ref(x, w, bias), want) < TOL_FLOAT.get(fmt, 3e-2)


@pytest.mark.parametrize("path", SIMD or ["none"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,n_blocks,n", SHAPES)
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_simd_matches_scalar_ref(path, fmt, m, n_blocks, n, xdtype, with_bias):
    if path == "none":
        pytest.skip(f"no SIMD path on this machine (active: {K.ACTIVE_PATH})")
    w, x, bias = case(fmt, m, n_blocks, n, seed=m * 7 + n)
    x, bias = x.to(xdtype), bias if with_bias else None
    got, ref = K.linear_path(x, w, bias, path), K.linear_ref(x, w, bias)
    assert got.dtype == torch.float32 and got.shape == (n, m)
    assert nerr(got, ref) < TOL_REF
    assert nerr(got, x.float() @ w.dequantize().T + (0 if bias is None else bias)) < TOL_FLOAT.get(fmt, 3e-2)


@pytest.mark.parametrize("fmt", FORMATS)
def test_linear_dispatch_and_thread_count(fmt):
    w, x, bias = case(fmt, 203, 3, 5)
    one = assert_thread_count_invariant(K.linear, x, w, bias)
    assert nerr(one, K.linear_ref(x, w, bias)) < TOL_REF
    assert torch.equal(K.linear(x.bfloat16(), w), K.linear(x.bfloat16().float(), w))


@pytest.mark.parametrize("fmt", FORMATS)
def test_numba_fallback_dequantizes_and_multiplies(fmt):
    w, x, bias = case(fmt, 13, 3, 3)
    got = K._linear_numba(x, w, bias, torch.empty(3, 13))
    assert torch.allclose(got, x @ w.dequantize().T + bias, rtol=1e-5, atol=1e-5)
    assert nerr(got, K.linear_ref(x, w, bias)) < TOL_FLOAT.get(fmt, 3e-2)


@pytest.mark.parametrize("path", SIMD or ["none"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_simd_sums_the_largest_products_without_overflow(path, fmt):
    """Every quant byte 0xFF (each format's largest quant) against activations all +127 (x constant and positive):
    the largest int16 partial sums the tiles take, at 1 token and at the 8- and 16-row tiles' token counts. Random
    bytes never reach them: summing q6_k's products 8 at a time in int16 passed the random shapes."""
    if path == "none":
        pytest.skip(f"no SIMD path on this machine (active: {K.ACTIVE_PATH})")
    per_block, _ = GGUF_BLOCKS[fmt]
    raw = gguf_blocks(fmt, 16, 2 * per_block)
    blocks = raw.reshape(-1, GGUF_BLOCKS[fmt][1])
    keep = blocks.copy()
    blocks[:] = 0xFF
    for at in GGUF_TYPE[fmt].f16_offsets:  # the fp16 scales stay finite and small
        blocks[:, at:at + 2] = keep[:, at:at + 2]
    if fmt == "mxfp4":
        blocks[:, 0] = 120  # e8m0 scale byte 2^-8
    w = K.PackedWeight.from_gguf(blocks.reshape(16, -1), fmt, (16, 2 * per_block))
    for n in (1, 9, 17):
        x = torch.full((n, w.shape[1]), 0.5)
        assert nerr(K.linear_path(x, w, None, path), K.linear_ref(x, w, None)) < TOL_REF


@pytest.mark.parametrize("path", ["scalar"] + SIMD)
def test_mxfp4_every_scale_byte_on_every_path(path):
    """Row e holds one block whose only nonzero weight is level 1 times e8m0 byte e's scale, 2^(e - 128), from the
    subnormal 2^-128 to 2^127: with activations all ones, y[e] is that weight. Within 1e-4 (the subnormal scales'
    products keep 14 bits; a wrong exponent is off by 2x)."""
    raw = np.zeros((256, 17), dtype=np.uint8)
    raw[:, 0], raw[:, 1] = np.arange(256), 0x01  # weight 0 = level 1 (low nibble 1), the other 31 level 0
    w = K.PackedWeight.from_gguf(raw, "mxfp4", (256, 32))
    want = w.dequantize()[:, 0]
    assert want[0] == 2.0 ** -128 and want[255] == 2.0 ** 127
    for n in (1, 9):  # one token; the 16-row tiles from 8 tokens
        got = K.linear_path(torch.ones(n, 32), w, None, path)
        assert torch.allclose(got, want.expand(n, -1), rtol=1e-4, atol=0)


@pytest.mark.slow
def test_forcing_numba_in_a_fresh_process():
    code = ("import numpy as np, torch\n"
            "import offload.kernels as K\n"
            "assert K.ACTIVE_PATH == 'numba', K.ACTIVE_PATH\n"
            "raw = np.random.default_rng(0).integers(0, 256, (9, 210), dtype=np.uint8)\n"
            "raw[:, 208:210] = np.array([1e-3], dtype=np.float16).view(np.uint8)\n"
            "w = K.PackedWeight.from_gguf(raw, 'q6_k', (9, 256)); x = torch.randn(2, 256)\n"
            "assert torch.allclose(K.linear(x, w), x @ w.dequantize().T, rtol=1e-5, atol=1e-5)\n"
            "print('ok')\n")
    env = dict(os.environ, OFFLOAD_KERNELS="numba")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


@pytest.mark.parametrize("make, match", [
    (lambda: K.PackedWeight.from_gguf(b"\0" * 143, "q4_k", (1, 256)), "needs 144 bytes, got 143"),
    (lambda: K.PackedWeight.from_gguf(b"\0" * 210 * 3, "q6_k", (2, 256)), "needs 420 bytes"),
    (lambda: K.PackedWeight.from_gguf(b"\0" * 40, "q4_1", (1, 48)), "blocks of 32 weights"),
    (lambda: K.PackedWeight.from_gguf(b"\0" * 176, "q5_k", (2, 128)), "blocks of 256 weights"),
    (lambda: K.PackedWeight("q4_k", (2, 256), torch.zeros(2, 143, dtype=torch.uint8), None), "quants must be"),
    (lambda: K.PackedWeight("q6_k", (1, 256), torch.zeros(1, 210, dtype=torch.int8), None), "quants must be"),
    (lambda: K.PackedWeight("q4_1", (1, 32), torch.zeros(1, 20, dtype=torch.uint8),
                            torch.zeros(1, 1, dtype=torch.float16)), "scales must be"),
    (lambda: K.pack(torch.randn(4, 256), "q4_k"), "does not quantize to q4_k"),
])
def test_bad_inputs_raise_kernel_error(make, match):
    with pytest.raises(KernelError, match=match):
        make()


def _spec():
    from offload.rope_spec import RopeSpec
    from offload.spec import ModelSpec

    return ModelSpec(architecture="llama", vocab_size=64, hidden_size=256, intermediate_size=512, n_layers=1,
                     n_heads=4, n_kv_heads=2, head_dim=64, rms_norm_eps=1e-5, rope=RopeSpec(),
                     max_position_embeddings=64, qkv_bias=True, sliding_window=None)


def _layer_weights(spec):
    """A layer with q4_k (qkv, gate_up) and q6_k (o, down) linears; K = 256 or 512 (whole super-blocks)."""
    from offload.model.llama import LayerWeights

    def lin(fmt, rows, cols, seed):
        return K.PackedWeight.from_gguf(gguf_blocks(fmt, rows, cols, seed), fmt, (rows, cols))

    d, f, qkv_rows = spec.hidden_size, spec.intermediate_size, spec.q_size + 2 * spec.kv_size
    g = torch.Generator().manual_seed(0)
    return LayerWeights(attn_norm=torch.rand(d, generator=g) + 0.5, qkv=lin("q4_k", qkv_rows, d, 1),
                        qkv_bias=torch.randn(qkv_rows, generator=g) * 0.1, o=lin("q6_k", d, spec.q_size, 2),
                        o_bias=None, mlp_norm=torch.rand(d, generator=g) + 0.5, gate_up=lin("q4_k", 2 * f, d, 3),
                        gate_up_bias=None, down=lin("q6_k", d, f, 4), down_bias=None)


def test_fused_layer_with_k_quant_linears_matches_the_python_layer():
    import offload.kernels.layer as fused
    from offload.model.llama import layer_forward
    from offload.model.step import LayerKV, make_step

    if not fused.FUSABLE:
        pytest.skip(f"fused layer needs the C++ extension ({K.ACTIVE_PATH})")
    spec = _spec()
    w, g = _layer_weights(spec), torch.Generator().manual_seed(1)
    for n_new, phase in ((5, "prefill"), (1, "decode")):
        kv, kv_ref = (LayerKV(2, spec.n_kv_heads, 16, spec.head_dim, torch.float32) for _ in range(2))
        x = torch.randn(2, n_new, spec.hidden_size, generator=g)
        positions = torch.arange(n_new).repeat(2, 1)
        step = make_step(spec, torch.float32, positions, torch.ones_like(positions, dtype=torch.bool), trash_slot=16,
                         phase=phase)
        assert fused.can_fuse(w, x, kv)
        ref = layer_forward(spec, w, x, step, kv_ref)
        out = fused.fused_layer_forward(spec, w, x, step, kv)
        assert (out - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
        assert torch.allclose(kv.k[:, :16], kv_ref.k[:, :16], rtol=0, atol=1e-5 * kv_ref.k.abs().max().item())


def test_unit_store_round_trip_keeps_the_gguf_blocks():
    from offload.runtime import unit_store

    w = _layer_weights(_spec())
    for unit in (w, w.down):  # a layer, and a single weight
        layout = unit_store.layout_of(unit)
        assert [e.part for e in layout.entries if e.fmt] == ["qs"] * (4 if unit is w else 1)  # no scale planes
        buf = torch.empty(layout.n_bytes, dtype=torch.uint8)
        unit_store.write_into(layout, unit, buf)
        back = unit_store.materialize(layout, buf, on_device=False)
        pairs = [(back.down, unit.down), (back.qkv, unit.qkv)] if unit is w else [(back, unit)]
        for got, want in pairs:
            assert (got.fmt, got.shape, got.d) == (want.fmt, want.shape, None)
            assert torch.equal(got.qs, want.qs) and got.qs.data_ptr() >= buf.data_ptr()  # a view of the buffer


@pytest.mark.parametrize("fmt", FORMATS)
def test_calibration_times_the_kernels_on_gguf_blocks(fmt):
    from offload.runtime import calibrate

    flops, path = calibrate.measure_cpu_flops(fmt, m=2, k=256, n=64, repeats=1)
    assert path == "offload.kernels" and flops > 0
    fallback = calibrate._torch_matmul(fmt, 2, 256, 64)()  # the estimate without kernels: dequantized per call
    assert fallback.shape == (2, 64) and torch.isfinite(fallback).all()


TOL_DEFAULT_LOGITS = 1e-3  # of the logit range (measured 1.1e-4 on AVX-512; int8 activations: 2.7e-2)


@pytest.mark.slow
def test_default_q4_1_model_answers_paris_and_matches_transformers(default_gguf_llm, default_hf):
    """The default model's Q4_1 file as stored, int16 activations: int8 ones (llama.cpp's q8_1) answered
    "L'Étoile, la Marseillaise", like llama.cpp on this file; transformers dequantizes the same file to fp32."""
    from conftest import assert_logits_close, hf_logits, offload_logits
    from offload.sampling import SamplingParams

    llm = default_gguf_llm
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=12, temperature=0))[0]
    assert "Paris" in out.text, out.text
    ids = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    assert_logits_close(offload_logits(llm.model, ids), hf_logits(default_hf, ids), rel=TOL_DEFAULT_LOGITS)

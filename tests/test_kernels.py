"""linear() on every path against its scalar reference and a float reference; bad inputs; dispatch."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import assert_thread_count_invariant

import offload.kernels as K
from offload.errors import KernelError
from offload.kernels.dispatch import AVX2_FEATURES, AVX512_FEATURES, best_path, choose_path

# Tolerances, as normalized error ||y - y_ref|| / ||y_ref||:
#   optimized vs scalar reference (same integer math, other float summation order): 1e-5
#   vs fp32 matmul with the dequantized weights: q4_0 (int8 activation rounding) 2e-2,
#   q8_0 (int16 activations) 1e-4, bf16 / fp16 weights (exactly converted) and fp32 weights 1e-5
TOL_REF = 1e-5
TOL_FLOAT = {"q4_0": 2e-2, "q8_0": 1e-4, "bf16": 1e-5, "fp16": 1e-5, "fp32": 1e-5}

# (M, K, N): M=1, M not a multiple of 4/8, K=32 (1 block), odd block counts, 8-block groups plus
# leftovers (K=288: 9 blocks, K=576: 18), N=1 (matrix-vector), odd N, N large; N of each remainder mod the
# GEMM tiles' 2 and 4 tokens (5, 6, 7, 11), up to 600 rows.
SHAPES = [(1, 32, 1), (5, 32, 2), (13, 96, 1), (8, 288, 3), (33, 576, 1), (31, 576, 7), (9, 128, 130),
          (64, 1024, 1), (3, 64, 17), (7, 96, 5), (6, 352, 6), (37, 160, 600), (4, 64, 11),
          # AVX-512 q4_0's 16-row tiles: rows past the last whole 16, odd block counts, 16 + 8 + 4 + 2 + 1 tokens
          (203, 96, 31), (50, 288, 4), (16, 32, 600), (70, 576, 21),
          # AVX2 bf16/fp16 packed panels: 16 + 16 + 13 rows, K = 3 chunks of 256 + 32, 13 = 4 + 4 + 5 tokens
          (45, 800, 13)]
FORMATS = ["q8_0", "q4_0", "bf16", "fp16", "fp32"]
NATIVE = [p for p in ("avx2", "avx512") if K.ACTIVE_PATH in ("avx2", "avx512") and
          (p == "avx2" or K.ACTIVE_PATH == "avx512")]


def nerr(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y - ref).norm() / ref.norm().clamp_min(1e-30))


def case(m: int, k: int, n: int, fmt: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g)
    x = torch.randn(n, k, generator=g) * 3
    bias = torch.randn(m, generator=g)
    return K.pack(w, fmt), x, bias


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_scalar_ref_matches_float_reference(fmt, m, k, n):
    if fmt not in ("q8_0", "q4_0") and k % 32:
        pytest.skip("shape only for quantized formats")
    w, x, bias = case(m, k, n, fmt)
    want = x @ w.dequantize().T + bias
    assert nerr(K.linear_ref(x, w, bias), want) < TOL_FLOAT[fmt]


@pytest.mark.parametrize("path", NATIVE or ["none"])
@pytest.mark.parametrize("fmt,order", [("q8_0", "tiled"), ("q8_0", "rows"), ("q4_0", "tiled"), ("q4_0", "rows"),
                                       ("bf16", "-"), ("fp16", "-"), ("fp32", "-")])
@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_simd_matches_scalar_ref(path, fmt, order, m, k, n, xdtype, with_bias):
    if path == "none":
        pytest.skip(f"no SIMD path on this machine (active: {K.ACTIVE_PATH})")
    w, x, bias = case(m, k, n, fmt, seed=m * 7 + n)
    w = w.to_tiled() if order == "tiled" else w.to_rows()
    x, bias = x.to(xdtype), bias if with_bias else None
    got, ref = K.linear_path(x, w, bias, path), K.linear_ref(x, w, bias)
    assert got.dtype == torch.float32 and got.shape == (n, m)
    assert nerr(got, ref) < TOL_REF
    want = x.float() @ w.dequantize().T + (bias if with_bias else 0)
    assert nerr(got, want) < TOL_FLOAT[fmt]


@pytest.mark.parametrize("fmt", FORMATS)
def test_thread_count_does_not_change_results(fmt):
    w, x, bias = case(203, 576, 5, fmt)
    assert_thread_count_invariant(K.linear, x, w, bias)


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("m,k,n", [(45, 523, 13), (5, 523, 3), (10, 523, 8), (9, 40, 9)])
def test_float_weights_take_any_k(fmt, m, k, n):
    # K % 8 = 3 (K % 16 = 11, 8): the SIMD kernels' scalar or masked leftovers, packed (13 tokens) or not; the
    # AVX-512 fp32 tiles' 4 + 4 and 5 + 4 tokens
    w, x, bias = case(m, k, n, fmt)
    got = assert_thread_count_invariant(K.linear, x, w, bias)
    assert nerr(got, K.linear_ref(x, w, bias)) < TOL_REF


@pytest.mark.parametrize("native_bf16", [False, True])
def test_dense_bf16_weights_take_offloads_kernels_unless_the_cpu_multiplies_bf16(monkeypatch, native_bf16):
    """Many rows of bf16 against bf16 weights: offload's kernels on a CPU without native bf16 (torch widens slowly
    there), torch's matmul where the CPU has it and offload's bf16 tiles do not take the shape (K % 32 != 0)."""
    from offload.kernels import ops

    taken = []
    real = ops._half_kernel()
    if real is None:
        pytest.skip("no C++ kernels")
    monkeypatch.setattr(ops, "_bf16_available", lambda: native_bf16)
    monkeypatch.setattr(ops, "_half_kernel", lambda: lambda w: taken.append(w) or real(w))
    g = torch.Generator().manual_seed(0)
    x, w = (torch.randn(n, 40, generator=g).bfloat16() for n in (16, 24))
    y = ops.linear(x, w, None)
    assert bool(taken) != native_bf16 and y.dtype is torch.bfloat16
    assert nerr(y.float(), x.float() @ w.float().T) < 1e-2  # the output rounded to bf16


@pytest.mark.parametrize("rows,taken", [(1, True), (9, True), (64, True), (65, False)])
def test_dense_fp32_weights_take_offloads_kernels_at_few_rows(monkeypatch, rows, taken):
    """fp32 weights against fp32 activations: offload's kernels up to ops.F32_KERNEL_ROWS rows (a decode step, a
    verify pass), bit for bit the PackedWeight view's result; torch's matmul beyond."""
    from offload.kernels import ops

    if ops._half_kernel() is None:
        pytest.skip("no C++ kernels")
    seen = []
    real = ops._f32_view
    monkeypatch.setattr(ops, "_f32_view", lambda w: seen.append(w) or real(w))
    g = torch.Generator().manual_seed(rows)
    x, w, bias = torch.randn(rows, 72, generator=g), torch.randn(40, 72, generator=g), torch.randn(40, generator=g)
    y = ops.linear(x.view(1, rows, 72), w, bias)
    assert bool(seen) == taken and y.shape == (1, rows, 40) and y.dtype is torch.float32
    if taken:
        assert torch.equal(y[0], K.linear(x, K.pack(w, "fp32"), bias))
    assert nerr(y[0], x @ w.T + bias) < 1e-5


@pytest.mark.skipif(not K.BF16_TILES, reason="the AVX-512 BF16 tiles need a CPU with AVX-512 BF16")
def test_bf16_tiles_give_each_token_what_it_gets_alone():
    """bf16 x bf16 through the tiles, 9 tokens (tiles of 6 and 3) against one at a time, a long K in blocks of 64
    rows and a tail: each token's outputs equal its own matrix-vector product to the bit (the same sums, lane by
    lane, in the same order), as a speculative verify pass's rows must equal decoding's."""
    w, x, bias = case(70, 3104, 9, "bf16")
    x = x.bfloat16()
    got = K.linear(x, w, bias)
    assert all(torch.equal(got[i], K.linear(x[i:i + 1], w, bias)[0]) for i in range(9))


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_bf16_activations_equal_their_fp32_values(fmt):
    w, x, _ = case(17, 256, 3, fmt)
    xb = x.bfloat16()
    assert torch.equal(K.linear(xb, w), K.linear(xb.float(), w))


def test_empty_batch_gives_empty_output():
    w, _, _ = case(4, 64, 1, "q8_0")
    assert K.linear(torch.empty(0, 64), w).shape == (0, 4)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "bf16"])
def test_numba_fallback_matches_scalar_ref(fmt):
    w, x, bias = case(13, 96, 3, fmt)
    assert nerr(K.linear_path(x, w, bias, "numba"), K.linear_ref(x, w, bias)) < TOL_REF


@pytest.mark.slow
def test_forcing_numba_in_a_fresh_process():
    code = ("import warnings, torch\n"
            "with warnings.catch_warnings(record=True) as ws:\n"
            "    warnings.simplefilter('always')\n"
            "    import offload.kernels as K\n"
            "assert K.ACTIVE_PATH == 'numba', K.ACTIVE_PATH\n"
            "assert any('numba' in str(w.message) for w in ws)\n"
            "w = K.pack(torch.randn(9, 64), 'q4_0'); x = torch.randn(2, 64)\n"
            "err = (K.linear(x, w) - x @ w.dequantize().T).norm() / (x @ w.dequantize().T).norm()\n"
            "assert err < 2e-2, err\n"
            "print('ok')\n")
    env = dict(os.environ, OFFLOAD_KERNELS="numba")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


def x_w(**kw):
    w, x, bias = case(8, 64, 2, "q8_0")
    return kw.get("x", x), w, kw.get("bias", None)


@pytest.mark.parametrize("args, match", [
    (x_w(x=torch.randn(2, 64).half()), "float32 or bfloat16"),
    (x_w(x=torch.randn(2, 64).double()), "float32 or bfloat16"),
    (x_w(x=torch.randn(64, 2).T), "contiguous"),
    (x_w(x=torch.randn(2, 96)), r"\[N, 64\]"),
    (x_w(x=torch.randn(1, 2, 64)), "2-D"),
    (x_w(bias=torch.randn(7)), "bias"),
    (x_w(bias=torch.randn(8).bfloat16()), "bias"),
    (x_w(bias=torch.randn(8, 2)), "bias"),
    (x_w(bias=torch.randn(16)[::2]), "bias"),
    ((torch.randn(2, 64), torch.randn(8, 64), None), "PackedWeight"),
])
def test_bad_inputs_raise_kernel_error(args, match):
    with pytest.raises(KernelError, match=match):
        K.linear(*args)


def test_unknown_path_is_a_kernel_error():
    x, w, _ = x_w()
    with pytest.raises(KernelError, match="not available"):
        K.linear_path(x, w, None, "neon")


@pytest.mark.parametrize("features, built, want", [
    (AVX512_FEATURES, True, "avx512"),
    (AVX512_FEATURES - {"avx512vnni"}, True, "avx2"),   # Skylake-X: AVX-512 without VNNI
    (AVX2_FEATURES | {"avx512f"}, True, "avx2"),
    (AVX2_FEATURES, True, "avx2"),
    (AVX2_FEATURES - {"f16c"}, True, "scalar"),
    (frozenset(), True, "scalar"),
    (AVX512_FEATURES, False, "numba"),
])
def test_best_path(features, built, want):
    assert best_path(set(features), built) == want


@pytest.mark.parametrize("features, built, forced, want, warns", [
    (AVX512_FEATURES, True, None, "avx512", False),
    (AVX512_FEATURES, True, "avx2", "avx2", False),
    (AVX512_FEATURES, True, "scalar", "scalar", False),
    (AVX2_FEATURES, True, "avx512", "avx2", True),       # never runs an ISA the CPU lacks
    (AVX2_FEATURES, True, "numba", "numba", False),
    (AVX2_FEATURES, False, "avx2", "numba", True),
    (AVX2_FEATURES, True, "bogus", "avx2", True),
    (AVX2_FEATURES, True, "auto", "avx2", False),
])
def test_choose_path(features, built, forced, want, warns, recwarn):
    assert choose_path(set(features), built, forced) == want
    assert (len(recwarn) > 0) == warns


def test_active_path_is_consistent_with_this_cpu():
    assert K.ACTIVE_PATH in ("avx512", "avx2", "scalar", "numba")
    if K._C is not None and not os.environ.get("OFFLOAD_KERNELS"):
        assert K.ACTIVE_PATH == best_path(K.CPU_FEATURES, True)


@pytest.mark.skipif(K.ACTIVE_PATH not in ("avx2", "avx512"), reason="the peak probe runs AVX2/AVX-512 code")
def test_peak_probe_measures_the_kernels_instructions():
    """The kernel benchmark's peak: FLOP/s of one multiply-add instruction, more for wider integer dot products."""
    kinds = ["fma32", "avx2_s16", "avx2_u8"] + (["vnni_s16", "vnni_u8"] if K.ACTIVE_PATH == "avx512" else []) + \
        (["bf16"] if K.BF16_TILES else [])
    rates = {k: K._C.peak_flops(k, 200_000, 1) for k in kinds}
    assert all(1e8 < r < 1e13 for r in rates.values()), rates
    with pytest.raises(ValueError, match="kind must be"):
        K._C.peak_flops("fma64", 10, 1)

"""Device dequantization of GGUF's block types: the torch ops against gguf-py, the Triton kernels (q4_1, q2_k, q4_k, q5_k,
q6_k: offload.kernels.triton_gguf) against the torch ops, and DeviceQuantWeight's linear over block bytes.

Weights are raw GGUF block bytes uint8 [M, K/per_block*block_bytes] (formats.GGUF_BLOCKS), as a GGUF file
stores them: q4_1 quantized from random data by gguf-py; the others random bytes with their scale fields (fp16
d/dmin, IQ1_M's packed d, MXFP4's and NVFP4's scale bytes: kernels.quant.put_scales) set to small finite values.

Tolerances. The torch dequantization in fp32 is gguf-py's result bit for bit (same operations in the same
order); in bf16/fp16 it is that result rounded once, so within u * |w| (u the unit roundoff: 2^-8 bf16,
2^-11 fp16). A matmul over the weights, per element: |y - ref| <= 2 * ((u + sqrt(K) * 2^-24) * (|x| @ |W|.T
+ |bias|) + u * |ref|), as tests/test_triton_dequant.py argues (weights rounded once to x's dtype, fp32
accumulation, output rounded once, the factor 2 for the reference's own rounding), u = 2^-24 for fp32 x.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
import torch
from conftest import run_interpreted
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from offload.errors import KernelError
from offload.formats import GGUF_BLOCKS, GGUF_TYPE, GGUF_TYPES
from offload.kernels.quant import put_scales
from offload.runtime import device_quant
from offload.runtime.device_quant import DeviceQuantWeight, dequantize_gguf
from triton_support import INTERPRETER_PRELUDE

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (pip install triton)")
FORMATS = tuple(GGUF_BLOCKS)
TRITON_FORMATS = tuple(t.name for t in GGUF_TYPES if t.triton)  # the others run the torch fallback on a GPU too
QTYPES = {t.name: GGMLQuantizationType[t.ggml_name] for t in GGUF_TYPES}
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def gguf_blocks(fmt: str, m: int, n_blocks: int, seed: int) -> torch.Tensor:
    """Block bytes uint8 [M, n_blocks*block_bytes] of a [M, n_blocks*per_block] matrix in fmt."""
    per_block, block_bytes = GGUF_BLOCKS[fmt]
    rng = np.random.default_rng(seed)
    if fmt == "q4_1":  # gguf-py quantizes q4_1: realistic d, m and nibbles
        raw = gguf_quants.quantize(rng.standard_normal((m, n_blocks * per_block), dtype=np.float32), QTYPES[fmt])
        return torch.from_numpy(np.ascontiguousarray(raw))
    raw = rng.integers(0, 256, (m, n_blocks, block_bytes), dtype=np.uint8)
    # random bytes in the scales could be inf/nan; real files hold small scales
    put_scales(raw.reshape(-1, block_bytes), fmt, lambda n: rng.uniform(1e-4, 0.02, n))
    return torch.from_numpy(raw.reshape(m, -1))


def gguf_py(raw: torch.Tensor, fmt: str) -> torch.Tensor:
    """gguf-py's fp32 dequantization of block bytes [M, row_bytes] -> [M, K]."""
    return torch.from_numpy(gguf_quants.dequantize(raw.numpy(), QTYPES[fmt]).copy())


def shape_of(raw: torch.Tensor, fmt: str) -> tuple[int, int]:
    per_block, block_bytes = GGUF_BLOCKS[fmt]
    return raw.shape[0], raw.shape[1] // block_bytes * per_block


# ----------------------------------------------------------------------------------------- torch ops
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 5, 64])
@pytest.mark.parametrize("n_blocks", [1, 3, 8])
def test_torch_dequant_is_gguf_py_bit_for_bit(fmt, m, n_blocks):
    raw = gguf_blocks(fmt, m, n_blocks, seed=m * 10 + n_blocks)
    got = dequantize_gguf(raw, fmt, shape_of(raw, fmt), torch.float32)
    want = gguf_py(raw, fmt)
    assert got.shape == want.shape == shape_of(raw, fmt) and got.dtype == torch.float32
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_output_is_the_fp32_result_rounded_once(fmt, dtype):
    raw = gguf_blocks(fmt, 5, 3, seed=1)
    got, want = dequantize_gguf(raw, fmt, shape_of(raw, fmt), dtype), gguf_py(raw, fmt)
    assert got.dtype == dtype and torch.equal(got, want.to(dtype))
    assert bool(((got.float() - want).abs() <= UNIT_ROUNDOFF[dtype] * want.abs()).all())


def test_wrong_byte_count_names_the_shape():
    raw = gguf_blocks("q4_k", 4, 2, seed=3)
    with pytest.raises(KernelError, match=r"q4_k weight \[4, 768\] needs block bytes \[4, 432\]"):
        dequantize_gguf(raw, "q4_k", (4, 768), torch.float32)


# ------------------------------------------------------------------------------- DeviceQuantWeight
def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 x @ W.T + bias, the per-element tolerance of the module docstring) for fp32 weights w [M, K]."""
    bf = torch.zeros(w.shape[0]) if bias is None else bias.float()
    ref = x.float() @ w.T + bf
    u = UNIT_ROUNDOFF[x.dtype]
    tol = 2 * ((u + x.shape[-1] ** 0.5 * 2.0**-24) * (x.float().abs() @ w.abs().T + bf.abs()) + u * ref.abs())
    return ref, tol


def assert_within(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    ref, tol = reference(x, w, bias)
    assert y.dtype == x.dtype and y.shape == ref.shape
    err = (y.float() - ref).abs()
    worst = int((err - tol).argmax())
    assert bool((err <= tol).all()), (f"error {float(err.flatten()[worst]):.3g} > tolerance "
                                      f"{float(tol.flatten()[worst]):.3g}")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_device_quant_linear_on_the_cpu(fmt, dtype, monkeypatch):
    raw = gguf_blocks(fmt, 13, 2, seed=4)
    m, k = shape_of(raw, fmt)
    w, x, bias = gguf_py(raw, fmt), torch.randn(3, 2, k).to(dtype), torch.randn(m).to(dtype)
    dq = DeviceQuantWeight(fmt, (m, k), raw, None)
    assert dq.nbytes == raw.nbytes
    y = dq.apply(x, bias)  # CPU tensors: the torch fallback
    assert y.shape == (3, 2, m)
    if dtype == torch.float32:
        torch.testing.assert_close(y, x @ w.T + bias, rtol=1e-5, atol=1e-5)
    assert_within(y.reshape(6, m), x.reshape(6, k), w, bias)
    monkeypatch.setattr(device_quant, "DEQUANT_CHUNK_ELEMENTS", 5 * k)  # row slices of 4 rows, then the tail
    sliced = dq.apply(x, bias)
    assert sliced.shape == (3, 2, m)
    assert_within(sliced.reshape(6, m), x.reshape(6, k), w, bias)


# ----------------------------------------------------------------------------- Triton, interpreted
# (kernel, rows of x, M, blocks per row): M not a multiple of the tiles (16 rows of W in gemv, 64 in gemm);
# gemv at 1 row takes 512 weights of a row per step (q4_1: 16 blocks, partly filled at 3, two steps at 17;
# K-quants: 2 super-blocks), at 4 rows 128 (half a super-block), at 16 rows 32 (one sub-block, q6_k two);
# gemm 64 weights per step, 70 rows of x make two tiles.
SHAPES = [("gemv", 1, 37, 3), ("gemv", 1, 21, 17), ("gemv", 3, 37, 2), ("gemv", 16, 21, 1),
          ("gemm", 5, 70, 2), ("gemm", 40, 131, 1), ("gemm", 70, 37, 3)]
CASES = [(kernel, fmt, i % 2 == 0, n, m, n_blocks, DTYPES[i % 3])
         for i, (kernel, n, m, n_blocks) in enumerate(SHAPES) for fmt in TRITON_FORMATS]

# The worker starts with triton_support's prelude (bf16 dot operands as values, as a GPU multiplies them).
WORKER = INTERPRETER_PRELUDE + """
from offload.kernels import triton_gguf
cases = torch.load(sys.argv[1], weights_only=False)
out = {}
for name, c in cases.items():
    x, raw, fmt = c["x"], c["raw"], c["fmt"]
    if c["kernel"] == "linear":  # the entry point DeviceQuantWeight calls, x of any leading shape
        out[name] = triton_gguf.linear(x, raw, fmt, c["shape"], c["bias"])
    else:
        y = torch.empty((x.shape[0], raw.shape[0]), dtype=x.dtype)
        out[name] = getattr(triton_gguf, c["kernel"])(x, raw, fmt, c["bias"], y)
torch.save(out, sys.argv[2])
"""


def case_id(case) -> str:
    kernel, fmt, with_bias, n, m, n_blocks, dtype = case
    return f"{kernel}-{fmt}-{'bias' if with_bias else 'nobias'}-{n}x{m}x{n_blocks}blocks-{str(dtype)[6:]}"


def make_inputs(case, seed: int) -> dict:
    kernel, fmt, with_bias, n, m, n_blocks, dtype = case
    raw = gguf_blocks(fmt, m, n_blocks, seed)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, shape_of(raw, fmt)[1], generator=gen).to(dtype)
    bias = torch.randn(m, generator=gen).to(dtype) if with_bias else None
    return {"kernel": kernel, "fmt": fmt, "raw": raw, "shape": shape_of(raw, fmt), "x": x, "bias": bias}


def linear_inputs() -> dict:
    """Cases for triton_gguf.linear(): 3-D x on both sides of GEMV_MAX_ROWS, and a non-contiguous x."""
    cases = {}
    for i, (lead, fmt) in enumerate([((2, 3), "q4_k"), ((3, 11), "q6_k"), ((1, 1), "q5_k")]):
        c = make_inputs(("linear", fmt, True, 1, 37, 2, torch.bfloat16), seed=1000 + i)
        c["x"] = torch.randn(*lead, c["shape"][1]).to(torch.bfloat16)
        cases[f"linear-{i}"] = c
    c = make_inputs(("linear", "q4_1", False, 1, 37, 3, torch.float32), seed=1003)
    c["x"] = torch.randn(c["shape"][1], 6).T  # [6, 96] with a column stride of 6
    cases["linear-strided"] = c
    return cases


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> tuple[dict, dict]:
    """(inputs, outputs) of every case, the kernels run under TRITON_INTERPRET=1 in a subprocess (setting it
    here would make every later test's kernels interpreted)."""
    inputs = {case_id(c): make_inputs(c, seed=i) for i, c in enumerate(CASES)}
    inputs.update(linear_inputs())
    return inputs, run_interpreted(WORKER, inputs, tmp_path_factory.mktemp("triton_gguf"))


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_triton_kernel_equals_the_torch_dequant(interpreted, case):
    inputs, outputs = interpreted
    c = inputs[case_id(case)]
    w = dequantize_gguf(c["raw"], c["fmt"], c["shape"], torch.float32)
    assert_within(outputs[case_id(case)], c["x"], w, c["bias"])


@needs_triton
@pytest.mark.parametrize("name", ["linear-0", "linear-1", "linear-2", "linear-strided"])
def test_triton_linear_takes_any_leading_shape_and_strides(interpreted, name):
    inputs, outputs = interpreted
    c, y = inputs[name], outputs[name]
    w = dequantize_gguf(c["raw"], c["fmt"], c["shape"], torch.float32)
    assert y.shape == (*c["x"].shape[:-1], c["shape"][0])
    assert_within(y.reshape(-1, y.shape[-1]), c["x"].reshape(-1, c["x"].shape[-1]), w, c["bias"])


@needs_triton
def test_triton_linear_refuses_wrong_block_bytes():
    from offload.kernels import triton_gguf

    raw = gguf_blocks("q4_k", 4, 1, seed=5)
    with pytest.raises(KernelError, match=r"block bytes must be a contiguous uint8 tensor \[4, 288\]"):
        triton_gguf.linear(torch.randn(1, 512), raw, "q4_k", (4, 512))


@needs_triton
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1: kernels are interpreted")
@pytest.mark.parametrize("fmt", TRITON_FORMATS)
@pytest.mark.parametrize("kernel,n", [("gemv", 1), ("gemv", 16), ("gemm", 64)])
def test_kernels_compile_for_an_h200(fmt, kernel, n):
    """The interpreter accepts code the compiler rejects: compile each kernel to sm_90 with Triton's ptxas."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from offload.kernels import triton_gguf as G

    cfg = G.gemv_config(n, fmt) if kernel == "gemv" else G.gemm_config(n, fmt, torch.bfloat16)
    names = ["x_ptr", "qs_ptr", "bias_ptr", "y_ptr", "N", "M", "n_sub", "row_bytes", "stride_x", "stride_y"]
    options = {k: cfg[k] for k in ("num_warps", "enable_fp_fusion")}
    consts = {**G._layout(fmt), "HAS_BIAS": True, **{k: v for k, v in cfg.items() if k not in options}}
    signature = {**dict(zip(names, ["*bf16", "*u8", "*bf16", "*bf16"] + ["i32"] * 6)),
                 **{k: "constexpr" for k in consts}}
    try:
        source = ASTSource(getattr(G, f"_{kernel}_kernel"), signature, consts, {})
    except TypeError as e:  # the compile API is internal and changes between Triton releases
        pytest.skip(f"Triton {triton.__version__} builds an ASTSource differently ({e})")
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    assert len(compiled.asm["cubin"]) > 0


# --------------------------------------------------------------------------------------------- on a GPU
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_torch_dequant_is_gguf_py_bit_for_bit(fmt):
    raw = gguf_blocks(fmt, 64, 4096 // GGUF_BLOCKS[fmt][0], seed=6)
    got = dequantize_gguf(raw.cuda(), fmt, shape_of(raw, fmt), torch.float32).cpu()
    assert torch.equal(got.view(torch.int32), gguf_py(raw, fmt).view(torch.int32))


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_cuda_fp4_scales_over_every_byte(fmt):
    """Every scale byte on the GPU too: MXFP4's subnormal 2^-128 and overflowing 2^127 must not be flushed."""
    raw = gguf_blocks(fmt, 256, 4, seed=8)
    n_scales = GGUF_TYPE[fmt].fields[0][1]  # the scale bytes lead the block
    raw.view(256, 4, GGUF_BLOCKS[fmt][1])[..., :n_scales] = torch.arange(256, dtype=torch.uint8)[:, None, None]
    got = dequantize_gguf(raw.cuda(), fmt, shape_of(raw, fmt), torch.float32).cpu()
    with np.errstate(over="ignore"):
        want = gguf_py(raw, fmt)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.cuda
@needs_gpu
@needs_triton
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n", [1, 5, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_triton_path_equals_the_torch_dequant(fmt, n, dtype):
    raw = gguf_blocks(fmt, 300, 4096 // GGUF_BLOCKS[fmt][0], seed=n)
    m, k = shape_of(raw, fmt)
    x, bias = torch.randn(n, k).to(dtype), torch.randn(m).to(dtype)
    w = gguf_py(raw, fmt)
    dq = DeviceQuantWeight(fmt, (m, k), raw.cuda(), None)
    assert_within(dq.apply(x.cuda(), bias.cuda()).cpu(), x, w, bias)  # CUDA tensors: the fused Triton kernels
    assert_within(dq.apply_torch(x.cuda(), bias.cuda()).cpu(), x, w, bias)  # the torch ops on the GPU


@pytest.mark.parametrize("fmt", FORMATS)
def test_unit_store_streams_block_bytes_to_a_device_weight(fmt):
    """A unit's flat buffer holds the block bytes as one plane; materialized on the device, the same matrix."""
    from offload.runtime import unit_store

    raw = gguf_blocks(fmt, 6, 2, seed=7)
    w = DeviceQuantWeight(fmt, shape_of(raw, fmt), raw, None)
    layout = unit_store.layout_of(w)
    assert [(e.part, e.n_bytes, e.fmt) for e in layout.entries] == [("qs", raw.nbytes, fmt)]
    buf = torch.empty(layout.n_bytes, dtype=torch.uint8)
    unit_store.write_into(layout, w, buf)
    back = unit_store.materialize(layout, buf, on_device=True)
    assert isinstance(back, DeviceQuantWeight) and back.d is None
    assert (back.fmt, back.shape) == (fmt, w.shape) and torch.equal(back.qs, raw)

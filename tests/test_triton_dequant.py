"""Fused dequant kernels (offload.kernels.triton_dequant) against the scalar reference.

Without a GPU the kernels run under TRITON_INTERPRET=1 in one subprocess for all cases: the variable decides,
when triton.jit decorates a kernel, whether it is compiled or interpreted, so setting it in this process
would leak into every later test (and on a GPU machine make the CUDA tests interpret too). Inputs are made
here, outputs come back through a file, and each case is compared here with the reference: the weights
dequantized by the numpy reference (PackedWeight.dequantize) and an fp32 matmul.

Tolerance, per element: |y - ref| <= 2 * ((u + sqrt(K) * 2^-24) * (|x| @ |W|.T + |bias|) + u * |ref|), u the
unit roundoff of x's dtype (2^-9 bf16, 2^-11 fp16, 2^-24 fp32): each dequantized weight is rounded once to x's
dtype (exact in fp32), K products accumulate in fp32 (sqrt(K) roundings' worth, the random-walk size; the
worst case K would let an fp16 or tf32 rounding of the weights pass in the fp32 cases), the output is rounded
once to x's dtype; the factor 2 covers the reference's own fp32 rounding. Measured: fp32 cases reach about
1.5 * 2^-24 * (|x| @ |W|.T) under the interpreter, a 30th of their tolerance at K = 544.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from conftest import child_env, run_interpreted

from offload.kernels.packed import pack
from offload.runtime.device_quant import DeviceQuantWeight
from triton_support import INTERPRETER_PRELUDE

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (pip install triton)")
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-9, torch.float16: 2.0**-11}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# (kernel, n rows of x, M, K): M and N not multiples of the kernels' tiles (gemv 16 rows of W; gemm 64 rows of
# W, 16-64 rows of x; 70 rows of x make two tiles) nor M of the 4-row tiles; K = 96 is 3 blocks (odd: tiled
# order's lone last block), 544 is 17 (a second, partial step of the widest gemv step, 16 q4_0 blocks); gemv
# takes up to 16 rows. Each kernel meets each dtype of x (DTYPES in turn).
SHAPES = [("gemv", 1, 37, 544), ("gemv", 3, 37, 96), ("gemv", 8, 70, 160), ("gemv", 16, 21, 96),
          ("gemm", 1, 70, 96), ("gemm", 5, 37, 160), ("gemm", 17, 70, 544), ("gemm", 40, 131, 96),
          ("gemm", 70, 37, 96)]
CASES = [(kernel, fmt, tiled, with_bias, n, m, k, DTYPES[i % 3])
         for i, (kernel, n, m, k) in enumerate(SHAPES)
         for fmt in ("q8_0", "q4_0") for tiled in (False, True) for with_bias in (False, True)]


def case_id(case) -> str:
    kernel, fmt, tiled, with_bias, n, m, k, dtype = case
    order = "tiled" if tiled else "rows"
    return f"{kernel}-{fmt}-{order}-{'bias' if with_bias else 'nobias'}-{n}x{k}@{m}x{k}-{str(dtype)[6:]}"


def make_inputs(case, seed: int) -> dict:
    """Weights packed in the case's block order, x, and bias (in x's dtype, as the model holds it)."""
    kernel, fmt, tiled, with_bias, n, m, k, dtype = case
    gen = torch.Generator().manual_seed(seed)
    w = pack(torch.randn(m, k, generator=gen), fmt)
    w = w.to_tiled() if tiled else w.to_rows()
    x = torch.randn(n, k, generator=gen).to(dtype)
    bias = torch.randn(m, generator=gen).to(dtype) if with_bias else None
    return {"kernel": kernel, "fmt": fmt, "tiled": tiled, "w": w, "x": x, "bias": bias}


def reference(x: torch.Tensor, w, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 x @ W.T + bias with W from the numpy dequantizer, the per-element tolerance stated above)."""
    wf = w.dequantize()  # [M, K] fp32
    bf = torch.zeros(w.shape[0]) if bias is None else bias.float()
    ref = x.float() @ wf.T + bf
    u = UNIT_ROUNDOFF[x.dtype]
    tol = 2 * ((u + x.shape[-1] ** 0.5 * 2.0**-24) * (x.float().abs() @ wf.abs().T + bf.abs()) + u * ref.abs())
    return ref, tol


def assert_within(y: torch.Tensor, x: torch.Tensor, w, bias: torch.Tensor | None) -> None:
    ref, tol = reference(x, w, bias)
    assert y.dtype == x.dtype and y.shape == ref.shape
    err = (y.float() - ref).abs()
    worst = int((err - tol).argmax())
    assert bool((err <= tol).all()), f"error {float(err.flatten()[worst]):.3g} > tolerance {float(tol.flatten()[worst]):.3g}"


# ---------------------------------------------------------------------------------------- interpreted runs
# The worker starts with triton_support's prelude (bf16 dot operands as values, as a GPU multiplies them).
WORKER = INTERPRETER_PRELUDE + """
from offload.kernels import triton_dequant as T
cases = torch.load(sys.argv[1], weights_only=False)
out = {}
for name, c in cases.items():
    w, x = c["w"], c["x"]
    if c["kernel"] == "linear":  # the dispatching entry point, x of any leading shape
        out[name] = T.linear(x, w.qs, w.d, w.fmt, w.shape, w.tiled, c["bias"])
    else:
        y = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype)
        out[name] = getattr(T, c["kernel"])(x, w.qs, w.d, w.fmt, w.tiled, c["bias"], y)
torch.save(out, sys.argv[2])
"""


def linear_inputs() -> dict:
    """Cases for linear(): 3-D x, a non-contiguous x, and row counts on both sides of GEMV_MAX_ROWS."""
    cases = {}
    for i, (lead, fmt, tiled) in enumerate([((1, 1), "q4_0", True), ((5, 4), "q8_0", False), ((33,), "q4_0", False)]):
        c = make_inputs(("linear", fmt, tiled, True, 1, 37, 96, torch.bfloat16), seed=1000 + i)
        c["x"] = torch.randn(*lead, 96).to(torch.bfloat16)
        cases[f"linear-{i}"] = c
    c = make_inputs(("linear", "q8_0", True, False, 1, 37, 96, torch.float32), seed=1003)
    c["x"] = torch.randn(96, 6).T  # [6, 96] with a column stride of 6
    cases["linear-strided"] = c
    return cases


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> tuple[dict, dict]:
    """(inputs, outputs) of every case, the kernels run under TRITON_INTERPRET=1 in a subprocess."""
    inputs = {case_id(c): make_inputs(c, seed=i) for i, c in enumerate(CASES)}
    inputs.update(linear_inputs())
    return inputs, run_interpreted(WORKER, inputs, tmp_path_factory.mktemp("triton_interpret"))


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_kernel_equals_the_scalar_reference(interpreted, case):
    inputs, outputs = interpreted
    c = inputs[case_id(case)]
    assert_within(outputs[case_id(case)], c["x"], c["w"], c["bias"])


@needs_triton
@pytest.mark.parametrize("name", ["linear-0", "linear-1", "linear-2", "linear-strided"])
def test_linear_takes_any_leading_shape_and_strides(interpreted, name):
    inputs, outputs = interpreted
    c = inputs[name]
    y = outputs[name]
    assert y.shape == (*c["x"].shape[:-1], c["w"].shape[0])
    assert_within(y.reshape(-1, y.shape[-1]), c["x"].reshape(-1, c["x"].shape[-1]), c["w"], c["bias"])


def test_the_torch_fallback_meets_the_same_tolerance():
    for i, case in enumerate(CASES[::5]):
        c = make_inputs(case, seed=i)
        w = c["w"]
        y = DeviceQuantWeight(w.fmt, w.shape, w.qs, w.d, w.tiled).apply(c["x"], c["bias"])  # CPU: torch ops
        assert_within(y, c["x"], w, None if c["bias"] is None else c["bias"].to(c["x"].dtype))


NO_TRITON = """
import sys
sys.modules["triton"] = None  # import triton now raises ImportError, as where it is not installed
import torch
from offload.errors import KernelError
from offload.kernels import triton_dequant as T
from offload.kernels.packed import pack
from offload.runtime.device_quant import DeviceQuantWeight
w, x = pack(torch.randn(8, 64), "q4_0"), torch.randn(2, 64)
y = DeviceQuantWeight(w.fmt, w.shape, w.qs, w.d).apply(x, None)
assert torch.allclose(y, x @ w.dequantize().T, atol=1e-4), "torch fallback"
try:
    T.linear(x, w.qs, w.d, w.fmt, w.shape)
except KernelError as e:
    print("available:", T.TRITON_AVAILABLE, "refused:", e)
"""


def test_module_imports_without_triton_and_the_fallback_still_computes():
    proc = subprocess.run([sys.executable, "-c", NO_TRITON], env=child_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "available: False refused: the fused dequant kernels need Triton" in proc.stdout


# ------------------------------------------------------------------------- compiled for a GPU, without one
def compile_for_h200(kernel, fmt: str, x_type: str, cfg: dict, tiled: bool):
    """The kernel compiled to a cubin for sm_90 (an H200) by Triton's own ptxas: no GPU or driver needed."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = ["x_ptr", "qs_ptr", "d_ptr", "bias_ptr", "y_ptr", "N", "M", "nb", "stride_x", "stride_y"]
    types = [f"*{x_type}", "*u8" if fmt == "q4_0" else "*i8", "*fp16", f"*{x_type}", f"*{x_type}"] + ["i32"] * 5
    options = {k: cfg[k] for k in ("num_warps", "enable_fp_fusion")}
    consts = {"Q4": fmt == "q4_0", "TILED": tiled, "HAS_BIAS": True, **{k: v for k, v in cfg.items() if k not in options}}
    signature = {**dict(zip(names, types)), **{k: "constexpr" for k in consts}}
    # launches specialize 16-byte-aligned pointers and sizes divisible by 16 (nb, strides at K = M = 4096)
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 7, 8, 9)}
    try:
        source = ASTSource(kernel, signature, consts, attrs)
    except TypeError as e:  # the compile API is internal and changes between Triton releases
        pytest.skip(f"Triton {triton.__version__} builds an ASTSource differently ({e})")
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


@needs_triton
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1: kernels are interpreted")
@pytest.mark.parametrize("kernel,fmt,tiled,n", [("gemv", "q4_0", True, 1), ("gemv", "q8_0", False, 8),
                                                ("gemm", "q4_0", True, 64), ("gemm", "q8_0", False, 16)])
def test_kernels_compile_for_an_h200_with_vector_loads(kernel, fmt, tiled, n):
    from offload.kernels import triton_dequant as T

    cfg = T.gemv_config(n, fmt) if kernel == "gemv" else T.gemm_config(n, fmt, torch.bfloat16)
    compiled = compile_for_h200(getattr(T, f"_{kernel}_kernel"), fmt, "bf16", cfg, tiled)
    assert len(compiled.asm["cubin"]) > 0
    ptx = compiled.asm["ptx"]  # vector loads, or 16-byte asynchronous copies where Triton pipelines the loop
    assert "ld.global.v" in ptx or "cp.async.cg" in ptx, "no vectorized global load: Triton lost the 16-byte runs"


# --------------------------------------------------------------------------------------------- on a GPU
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.cuda
@needs_gpu
@needs_triton
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_cuda_kernel_equals_the_scalar_reference(case):
    from offload.kernels import triton_dequant as T

    c = make_inputs(case, seed=7)
    w, x, bias = c["w"], c["x"].cuda(), None if c["bias"] is None else c["bias"].cuda()
    y = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device="cuda")
    getattr(T, c["kernel"])(x, w.qs.cuda(), w.d.cuda(), w.fmt, w.tiled, bias, y)
    assert_within(y.cpu(), c["x"], w, c["bias"])


@pytest.mark.cuda
@needs_gpu
@needs_triton
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
@pytest.mark.parametrize("n", [1, 64])
def test_cuda_resident_weight_is_never_dequantized_into_a_copy(fmt, n):
    m, k = 4096, 4096  # a bf16 copy would be 32 MiB
    w = pack(torch.randn(m, k), fmt).to_tiled()
    dq = DeviceQuantWeight(fmt, (m, k), w.qs.cuda(), w.d.cuda(), tiled=True)
    x = torch.randn(n, k).to(torch.bfloat16)
    xc = x.cuda()
    dq.apply(xc, None)  # compile outside the measurement
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y = dq.apply(xc, None)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before <= 2 * n * m * 2, "apply() allocated more than its output"
    assert_within(y.cpu(), x, w, None)

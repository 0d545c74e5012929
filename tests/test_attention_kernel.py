"""Attention over the KV pool through a block table (offload.kernels.attention, offload.kernels.triton_attention)
against the float64 reference, and proof that it reads the pool in place.

The Triton kernel runs under TRITON_INTERPRET=1 in one subprocess for all cases (as in tests/test_triton_dequant.py:
setting the variable here would make every later test's kernels interpreted); the torch path runs here.

Tolerances: fp32 outputs, and the fp32 accumulator of 16-bit caches (out_fp32=True), within 1e-4 * max|ref| of a
float64 softmax over the same (rounded) values; the 16-bit output within one ulp of that reference rounded to its
dtype (ulps counted no finer than at 2^-10 * max|ref|: see assert_within_one_ulp).

In place: a TorchDispatchMode records every tensor an aten op creates during a call; the Triton path makes none as
large as one sequence's K history (L * n_kv_heads * Dh), only its output and the partials partials_bytes prices;
the torch path none larger (it gathers a sequence's keys once); one that repeats K/V per query head (as SDPA's
math path does) is caught.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import run_interpreted
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from offload.errors import KernelError
from offload.kernels import attention as A
from offload.kernels.triton_attention import partials_bytes, split_count, unsupported
from triton_support import INTERPRETER_PRELUDE

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (pip install triton)")
MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}
BLOCK = 16


class CreatedTensors(TorchDispatchMode):
    """Records the numel of every tensor an aten op creates: each output sharing no input's storage."""

    def __init__(self):
        super().__init__()
        self.numels: list[int] = [0]
        self.total_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = pytree.tree_leaves((args, kwargs))
        given = {t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else t.data_ptr()
                 for t in leaves if isinstance(t, (torch.Tensor, torch.UntypedStorage))}
        made = [t for t in pytree.tree_leaves(out)
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given]
        self.numels += [t.numel() for t in made]
        self.total_bytes += sum(t.numel() * t.element_size() for t in made)
        return out


def largest_created(fn) -> tuple[object, int]:
    """(fn(), the numel of the largest tensor it created)."""
    out, seen = created(fn)
    return out, max(seen.numels)


def created(fn) -> tuple[object, CreatedTensors]:
    """(fn(), what it created)."""
    with CreatedTensors() as seen:
        out = fn()
    return out, seen


def make_table(lengths: list[int], kind: str, gen: torch.Generator) -> tuple[A.KVTable, int]:
    """(a table, the pool's slot count): "paged" shuffled blocks of BLOCK with spare blocks between, "contiguous"
    extents with gaps cut in blocks of BLOCK, "one_run" the same extents as one block each."""
    n_blocks = [-(-n // BLOCK) for n in lengths]
    if kind == "paged":
        order = torch.randperm(sum(n_blocks) + 5, generator=gen)
        slots = torch.zeros(len(lengths), max(n_blocks), dtype=torch.int32)
        for b, first in enumerate([sum(n_blocks[:b]) for b in range(len(lengths))]):
            slots[b, : n_blocks[b]] = order[first: first + n_blocks[b]] * BLOCK
        return A.KVTable(slots=slots, lengths=torch.tensor(lengths, dtype=torch.int32), block_size=BLOCK), \
            (sum(n_blocks) + 5) * BLOCK
    bases = [sum(lengths[:b]) + 7 * (b + 1) for b in range(len(lengths))]  # 7 foreign slots before each extent
    size = BLOCK if kind == "contiguous" else 512
    return A.contiguous_table(bases, lengths, size), bases[-1] + lengths[-1] + 7


def make_case(heads: tuple[int, int, int], lengths: list[int], *, table: str = "paged", S: int = 1,
              dtype: torch.dtype = torch.float32, seed: int = 0, **kw) -> dict:
    """q [B, S, H, Dh], pools, table and keyword arguments of one call (16-bit values rounded once, here)."""
    H, n_kv_heads, D = heads
    gen = torch.Generator().manual_seed(seed)
    tab, n_slots = make_table(lengths, table, gen)
    k, v = (torch.randn(n_slots, n_kv_heads, D, generator=gen).to(dtype) for _ in range(2))
    q = (torch.randn(len(lengths), S, H, D, generator=gen) * kw.pop("q_gain", 1.0)).to(dtype)
    if kw.pop("sinks", False):
        kw["sinks"] = torch.randn(H, generator=gen) * 2
    if kw.pop("tree", False):  # a random tree: each query sees itself and some of the other new keys
        tree = torch.rand(len(lengths), S, S, generator=gen) < 0.5
        kw["tree_mask"] = tree | torch.eye(S, dtype=torch.bool)
    return {"q": q, "k": k, "v": v, "table": tab, "kw": {"scale": D**-0.5, **kw}}


def history_numel(c: dict) -> int:
    """One sequence's K history (the longest): L * n_kv_heads * Dh."""
    return int(c["table"].lengths.max()) * c["k"].shape[1] * c["k"].shape[2]


LLAMA_70B, LLAMA_8B, SMALL = (64, 8, 128), (32, 8, 128), (8, 2, 32)
FP32_CASES = {"70b-paged": make_case(LLAMA_70B, [1, 17, 300]),
              "8b-contiguous": make_case(LLAMA_8B, [300, 1, 17], table="contiguous", seed=1),
              "8b-one-run": make_case(LLAMA_8B, [40, 300], table="one_run", seed=2)}
LOW_CASES = {f"8b-{str(dt)[6:]}-{out}": make_case(LLAMA_8B, [17, 300], dtype=dt, seed=3, out_fp32=out == "acc")
             for dt in MANTISSA_BITS for out in ("acc", "cast")}
FEATURE_CASES = {"window": make_case(SMALL, [9, 40, 75], window=16, seed=4),
                 "window-s3": make_case(SMALL, [9, 40, 75], S=3, window=8, seed=5),
                 "softcap": make_case(SMALL, [9, 40, 75], softcap=2.0, q_gain=4.0, seed=6),
                 "sinks-s2": make_case(SMALL, [9, 40, 75], S=2, sinks=True, seed=7),
                 "tree-s4": make_case(SMALL, [9, 40, 75], S=4, tree=True, seed=8),
                 "all-s4-bf16": make_case(SMALL, [9, 40, 75], S=4, window=20, softcap=3.0, sinks=True, tree=True,
                                          q_gain=3.0, dtype=torch.bfloat16, out_fp32=True, seed=9)}
CASES = {**FP32_CASES, **LOW_CASES, **FEATURE_CASES}


def reference(c: dict) -> torch.Tensor:
    kw = {k: v for k, v in c["kw"].items() if k != "out_fp32"}
    return A.attention_ref(c["q"], c["k"], c["v"], c["table"], **kw)


def assert_close(y: torch.Tensor, c: dict) -> None:
    """y (fp32) within 1e-4 * max|ref| of the float64 reference, element by element."""
    ref = reference(c)
    assert y.shape == ref.shape and y.dtype == torch.float32
    err, bound = float((y.double() - ref).abs().max()), 1e-4 * float(ref.abs().max())
    assert err <= bound, f"max error {err:.3g} > {bound:.3g}"


def assert_within_one_ulp(y: torch.Tensor, c: dict) -> None:
    """y (16-bit) within one ulp of the float64 reference rounded to y's dtype, ulps counted at |ref| or, for the
    elements under 2^-10 * max|ref|, at that floor: fp32 sums of q . k leave errors of ~3e-7 * max|ref| on both
    paths (fp16 case: 4.4e-7 for max|ref| 1.3), more than an fp16 ulp of an output cancelling to 1.9e-4, so
    fp32 accumulation cannot decide such an element's rounding; the floor holds it to 2^-20 * max|ref| (fp16)."""
    ref = reference(c)
    want = ref.to(y.dtype).double()
    assert y.dtype == c["q"].dtype and y.shape == want.shape
    magnitude = want.abs().clamp_min(2.0**-10 * float(ref.abs().max()))
    ulp = torch.pow(2.0, (torch.frexp(magnitude).exponent - 1 - MANTISSA_BITS[y.dtype]).double())
    steps = float(((y.double() - want).abs() / ulp).max())
    assert steps <= 1, f"{steps} ulp from the rounded reference"


def call(c: dict, impl: str):
    return A.paged_attention(c["q"], c["k"], c["v"], c["table"], impl=impl, **c["kw"])


# ---------------------------------------------------------------------------------------- interpreted runs
# The worker starts with triton_support's prelude (bf16 dot operands as values, as a GPU multiplies them), rounds
# fp32 -> bf16 casts to nearest even as a GPU does (cvt.rn.bf16.f32; the interpreter truncates them), and records
# what each call creates with this module's CreatedTensors.
BF16_ROUNDING = """
import numpy as np
cast = interpreter.InterpreterBuilder.cast_impl
def cast_bf16_to_nearest(self, src, dst_type):
    if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
        values = torch.from_numpy(np.array(src.data, dtype=np.float32))
        return interpreter.TensorHandle(values.to(torch.bfloat16).view(torch.uint16).numpy(), tl.bfloat16)
    return cast(self, src, dst_type)
interpreter.InterpreterBuilder.cast_impl = cast_bf16_to_nearest
"""
WORKER = INTERPRETER_PRELUDE + BF16_ROUNDING + f"""
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_attention_kernel import created
from offload.kernels import attention as A
cases = torch.load(sys.argv[1], weights_only=False)
out = {{}}
for name, c in cases.items():
    A.reset_attention_paths()
    y, seen = created(lambda: A.paged_attention(c["q"], c["k"], c["v"], c["table"], impl="triton", **c["kw"]))
    out[name] = {{"y": y, "largest": max(seen.numels), "bytes": seen.total_bytes, "paths": A.attention_paths()}}
torch.save(out, sys.argv[2])
"""


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    """Each case's Triton output, largest created tensor and recorded paths, under TRITON_INTERPRET=1."""
    return run_interpreted(WORKER, CASES, tmp_path_factory.mktemp("attention_interpret"))


@needs_triton
@pytest.mark.parametrize("name", FP32_CASES)
def test_triton_fp32_matches_float64(interpreted, name):
    assert_close(interpreted[name]["y"], CASES[name])
    assert interpreted[name]["paths"] == {"triton_decode": 1}


@pytest.mark.parametrize("name", FP32_CASES)
def test_torch_fp32_matches_float64(name):
    assert_close(call(CASES[name], "torch"), CASES[name])


@needs_triton
@pytest.mark.parametrize("name", LOW_CASES)
def test_triton_16bit_accumulator_and_cast(interpreted, name):
    y, c = interpreted[name]["y"], CASES[name]
    if c["kw"]["out_fp32"]:
        assert_close(y, c)
    else:  # the accumulator rounded once, and so within one ulp
        assert torch.equal(y, interpreted[name.replace("cast", "acc")]["y"].to(y.dtype))
        assert_within_one_ulp(y, c)


@pytest.mark.parametrize("name", LOW_CASES)
def test_torch_16bit_accumulator_and_cast(name):
    c = CASES[name]
    assert_close(call(c, "torch"), c) if c["kw"]["out_fp32"] else assert_within_one_ulp(call(c, "torch"), c)


@needs_triton
@pytest.mark.parametrize("name", FEATURE_CASES)
def test_triton_window_softcap_sinks_tree(interpreted, name):
    assert_close(interpreted[name]["y"], CASES[name])


@pytest.mark.parametrize("name", FEATURE_CASES)
def test_torch_window_softcap_sinks_tree(name):
    assert_close(call(CASES[name], "torch"), CASES[name])


def test_each_feature_changes_the_answer():
    """The feature cases are not vacuous: without its option each one's reference moves by far more than the
    tolerance."""
    for name, c in FEATURE_CASES.items():
        plain = {**c, "kw": {"scale": c["kw"]["scale"]}}
        assert float((reference(c) - reference(plain)).abs().max()) > 1e-2, name


@needs_triton
def test_triton_path_creates_nothing_of_history_size(interpreted):
    for name, c in CASES.items():
        assert interpreted[name]["largest"] < history_numel(c), name


@needs_triton
@pytest.mark.parametrize("name", FP32_CASES)
def test_triton_path_allocates_what_partials_bytes_says(interpreted, name):
    """All the Triton path allocates: its output, the partials partials_bytes prices, and the 4-byte int32 read
    of the longest length (max_length not given)."""
    c = CASES[name]
    B, S, H, D = c["q"].shape
    partials = partials_bytes(B, S, H, c["k"].shape[1], D, int(c["table"].lengths.max()))
    assert interpreted[name]["bytes"] == c["q"].numel() * 4 + partials + 4


def test_partials_bytes():
    # Llama-70B, batch 1, 4096 keys, 132 SMs: 16 splits x 8 KV heads x 8 query rows x (max, sum, 128 values) fp32
    assert partials_bytes(1, 1, 64, 8, 128, 4096) == 4 * 16 * 8 * 8 * 130 == 532_480
    # batch 32: two splits each
    assert partials_bytes(32, 1, 64, 8, 128, 4096) == 4 * 32 * 8 * 2 * 8 * 130


def test_torch_path_gathers_keys_once_and_never_repeats_them():
    c = FP32_CASES["70b-paged"]
    _, largest = largest_created(lambda: call(c, "torch"))
    assert largest <= history_numel(c) < 8 * history_numel(c)  # 307200: one sequence's keys, gathered once


def repeated_kv_attention(q, k_pool, v_pool, table, *, scale):
    """Attention as SDPA's math path runs it: each sequence's K/V repeated to every query head."""
    B, S, H, D = q.shape
    G = H // k_pool.shape[1]
    out = torch.empty(q.shape)
    for b, n in enumerate(table.lengths.tolist()):
        slots = A.key_slots(table, b, n)
        k, v = (pool[slots].repeat_interleave(G, dim=1).transpose(0, 1) for pool in (k_pool, v_pool))
        s = (q[b].transpose(0, 1) @ k.transpose(1, 2)) * scale  # [H, S, L]
        s = s.masked_fill(torch.arange(n) > torch.arange(n - S, n)[:, None], float("-inf"))
        out[b] = (torch.softmax(s, -1) @ v).transpose(0, 1)
    return out


def test_repeated_kv_is_caught():
    """The in-place check is real: an implementation repeating K/V per query head (right, but G times the
    history) creates a tensor of G * history."""
    c = FP32_CASES["70b-paged"]
    y, largest = largest_created(lambda: repeated_kv_attention(c["q"], c["k"], c["v"], c["table"], **c["kw"]))
    assert_close(y, c)
    assert largest >= 8 * history_numel(c)


def test_path_counter_records_each_call():
    c = FEATURE_CASES["window"]
    A.reset_attention_paths()
    call(c, "auto")
    call(c, "torch")
    assert A.attention_paths() == {"torch_grouped": 2}  # CPU tensors take the torch path
    A.reset_attention_paths()
    assert A.attention_paths() == {}


@needs_triton
def test_path_counter_records_the_triton_path(interpreted):
    assert all(interpreted[name]["paths"] == {"triton_decode": 1} for name in CASES)


def test_triton_refuses_what_it_cannot_take():
    c = FEATURE_CASES["window"]
    with pytest.raises(KernelError, match="TRITON_INTERPRET"):
        call(c, "triton")  # CPU tensors, no interpreter in this process
    assert unsupported(96, 8) == "head_dim 96" and unsupported(128, 64) is None and unsupported(256, 32) is None
    assert unsupported(128, 65) and unsupported(256, 33)  # accumulators past 8192 fp32 values


def test_split_count():
    """About two programs per SM (132), each split at least 256 keys."""
    assert split_count(1 * 8, 4096, 132) == 16  # Llama-70B batch 1 at 4k keys: 16 splits of 256
    assert split_count(1 * 8, 100_000, 132) == 33  # ceil(264 / 8)
    assert split_count(32 * 8, 100_000, 132) == 2
    assert split_count(1 * 8, 1, 132) == 1


def test_bad_inputs_name_what_to_change():
    c = FEATURE_CASES["tree-s4"]
    with pytest.raises(KernelError, match=r"tree_mask must be bool \[3, 4, 4\]"):
        A.paged_attention(c["q"], c["k"], c["v"], c["table"], scale=1.0, tree_mask=c["kw"]["tree_mask"][:, :2])
    with pytest.raises(KernelError, match="sinks must be"):
        A.paged_attention(c["q"], c["k"], c["v"], c["table"], scale=1.0, sinks=torch.zeros(3))
    short = A.KVTable(c["table"].slots, torch.tensor([3, 40, 75], dtype=torch.int32), BLOCK)
    with pytest.raises(KernelError, match="fewer than its 4 new queries"):
        A.paged_attention(c["q"], c["k"], c["v"], short, scale=1.0)


def compile_for_h100(fn, types: dict[str, str], constants: dict[str, object], launch: dict):
    """fn compiled for sm_90 as a launch on these shapes specialises it (pointers and multiple-of-16 integers
    marked 16-divisible), with Triton's own ptxas: no GPU needed."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    aligned = {"sq_b", "sq_s", "sq_h", "sk_n", "sk_h", "sv_n", "sv_h", "block_size", "so_b", "so_s", "so_h"}
    default = {True: "*fp32", False: "i32"}  # by whether the name ends in _ptr
    signature = {name: "constexpr" if name in constants else types.get(name, default[name.endswith("_ptr")])
                 for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if signature[name][0] == "*" or name in aligned}
    return compile(ASTSource(fn, signature, constants, attrs), target=GPUTarget("cuda", 90, 32), options=launch)


def local_bytes(kernel) -> int:
    """Bytes of stack (register spills) a thread of a compiled kernel uses, from cuobjdump."""
    import triton

    path = Path(tempfile.mkdtemp()) / "kernel.cubin"
    path.write_bytes(kernel.asm["cubin"])
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    usage = subprocess.run([str(tool), "--dump-resource-usage", str(path)], capture_output=True, text=True).stdout
    return int(re.search(r"STACK:(\d+)", usage).group(1))


@needs_triton
def test_kernels_compile_for_h100_without_spills():
    """The interpreter runs what a GPU compiler may refuse (a non-constexpr global, a type mismatch across loop
    iterations): both kernels compile for sm_90, and the split kernel at its most loaded (bf16, S = 3, window,
    softcap and tree; 8 warps) keeps everything in registers."""
    from offload.kernels import triton_attention as TA

    types = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "slots_ptr": "*i32", "lengths_ptr": "*i32",
             "tree_ptr": "*u8", "scale": "fp32", "softcap": "fp32", "out_ptr": "*bf16"}
    split = compile_for_h100(TA._decode_split, types, dict(D=128, BR=32, BN=64, WINDOW=True, SOFTCAP=True,
                                                           TREE=True, QK_NATIVE=True, PIECES=3), TA._SPLIT_LAUNCH)
    assert local_bytes(split) == 0
    compile_for_h100(TA._decode_combine, types, dict(D=128, BR=32, SINKS=True), TA._LAUNCH)


@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs a CUDA GPU and Triton")
@pytest.mark.parametrize("name", ["70b-paged", "8b-bfloat16-acc", "8b-bfloat16-cast", "all-s4-bf16"])
def test_cuda_kernel(name):
    """The compiled kernel on a GPU, through the door: the Triton path, same bounds, nothing of history size."""
    c = CASES[name]
    on_gpu = pytree.tree_map(lambda t: t.cuda() if isinstance(t, torch.Tensor) else t, c)
    on_gpu["table"] = A.KVTable(c["table"].slots.cuda(), c["table"].lengths.cuda(), c["table"].block_size)
    A.reset_attention_paths()
    y, largest = largest_created(lambda: call(on_gpu, "auto"))
    assert A.attention_paths() == {"triton_decode": 1} and largest < history_numel(c)
    y = y.cpu()
    assert_close(y, c) if y.dtype == torch.float32 else assert_within_one_ulp(y, c)

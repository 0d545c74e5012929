"""Grouped expert kernels (offload.kernels.triton_moe, offload.model.moe.experts_forward_grouped) against the
per-expert loop (experts_forward_loop), and proof that the grouped path never waits for the device.

Without a GPU the kernels run under TRITON_INTERPRET=1 in one subprocess for all cases, as in
tests/test_triton_dequant.py (setting the variable here would make every later test's kernels interpreted).

Tolerance, per element of the output: |grouped - loop| <= (8 + 2k) * u * size, u the unit roundoff of the
activations' dtype (2^-24 fp32, 2^-9 bf16, 2^-11 fp16), k the experts per token, and size what the roundings
scale with: |residual| + sum over the token's experts of scale * walk(W_down, 2.2 |up| walk(W_gate, h) +
2 |silu(gate)| walk(W_up, h) + |act|), walk(A, b) = sqrt(A^2 @ b^2) the size of a sum of products of random
signs (the sqrt(K) of tests/test_triton_dequant.py), in fp32 from the weights as the loop multiplies them. The
loop rounds gate and up (and quantized weights, to the dtype: the factors 2; silu's slope is under 1.1),
silu(gate) * up, the down product, its scaling and each of the k sums; the kernels round act, the scaled
product and the sum once each; the factor 2 on k is margin. Measured under the interpreter: at most a third of
it (bf16), a seventh (fp32); an act 1% off fails every fp32 case by 4000x.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F
from conftest import run_interpreted

from offload.kernels.packed import pack
from offload.kernels.ops import StackedWeight, linear
from offload.model.moe import ExpertWeights, experts_forward_loop, route
from offload.runtime.device_quant import DeviceQuantWeight
from offload.moe_spec import MoESpec
from triton_support import INTERPRETER_PRELUDE

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (pip install triton)")
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-9, torch.float16: 2.0**-11}
D, F_ = 96, 64  # hidden (3 blocks of 32: tiled order's lone last block), expert width (2 blocks)

# (n_experts, top_k, n_tokens, weights, tiled, dtype, skewed): one token (each expert one row: the CUDA-core
# kernel), a few tokens with experts no token picked, 24 tokens skewed to expert 0 (its rows span several tiles),
# no tokens at all; every weight format the kernels take, in both block orders, against each activation dtype.
CASES = [(4, 2, 1, "dense", False, torch.float32, False), (8, 2, 3, "dense", False, torch.bfloat16, False),
         (5, 1, 6, "dense", False, torch.float16, False), (4, 2, 1, "q8_0", False, torch.bfloat16, False),
         (8, 2, 5, "q8_0", True, torch.float32, False), (3, 2, 1, "q4_0", False, torch.float32, False),
         (6, 3, 24, "q4_0", True, torch.bfloat16, True), (6, 2, 9, "q4_0", False, torch.float16, False),
         (4, 2, 0, "dense", False, torch.bfloat16, False)]


def case_id(case) -> str:
    e, k, t, fmt, tiled, dtype, skewed = case
    return f"{e}e-top{k}-{t}tok-{fmt}{'-tiled' if tiled else ''}-{str(dtype)[6:]}{'-skewed' if skewed else ''}"


def make_inputs(case, seed: int) -> dict:
    """A MoESpec, its ExpertWeights (dense in the activations' dtype, or q8_0/q4_0 DeviceQuantWeights) and x."""
    n_experts, top_k, n_tokens, fmt, tiled, dtype, skewed = case
    gen = torch.Generator().manual_seed(seed)

    def weight(m: int, k: int):
        w = torch.randn(m, k, generator=gen) / k**0.5
        if fmt == "dense":
            return w.to(dtype)
        p = pack(w, fmt)
        p = p.to_tiled() if tiled else p.to_rows()
        return DeviceQuantWeight(p.fmt, p.shape, p.qs, p.d, p.tiled)

    router = torch.randn(n_experts, D, generator=gen)
    h = torch.randn(n_tokens, D, generator=gen)
    if skewed:  # every token leans towards expert 0
        h += 3 * router[0] / router[0].norm()
        router[0] *= 3
    x = torch.cat((torch.randn(n_tokens, D, generator=gen), h), dim=1).to(dtype)
    w = ExpertWeights(router.to(dtype), tuple(weight(2 * F_, D) for _ in range(n_experts)),
                      tuple(weight(D, F_) for _ in range(n_experts)))
    return {"moe": MoESpec(n_experts, top_k, F_), "w": w, "x": x}


def tolerance(moe: MoESpec, w: ExpertWeights, x: torch.Tensor) -> torch.Tensor:
    """The per-element bound of the module docstring, [T, D]."""
    def dense(v):
        return v.dequantize_rows(0, v.shape[0], x.dtype).float() if hasattr(v, "dequantize_rows") else v.float()

    def walk(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # the size of a sum of products of random signs
        return (a.square() @ b.square()).sqrt()

    residual, h = x[:, :D].float(), x[:, D:]
    weights, ids = route(moe, linear(h, w.router, None))
    gate_ups, downs = [dense(v) for v in w.gate_up], [dense(v) for v in w.down]
    mag = residual.abs()
    for j in range(moe.top_k):
        for t in range(x.shape[0]):
            gu, down = gate_ups[int(ids[t, j])], downs[int(ids[t, j])]
            hf = h[t].float()
            gate, up = (gu @ hf).chunk(2)
            gate_size, up_size = walk(gu, hf).chunk(2)
            act_size = 2.2 * up.abs() * gate_size + 2 * F.silu(gate).abs() * up_size + (F.silu(gate) * up).abs()
            mag[t] += weights[t, j] * walk(down, act_size)
    return (8 + 2 * moe.top_k) * UNIT_ROUNDOFF[x.dtype] * mag


# ---------------------------------------------------------------------------------------- interpreted runs
# The worker starts with triton_support's prelude (bf16 dot operands as values). SyncGuard records every torch
# call that makes the host wait for the device (a value read back, a data-dependent size, a copy to the host)
# while the grouped path runs.
WORKER = INTERPRETER_PRELUDE + """
from torch.overrides import TorchFunctionMode
from offload.kernels import triton_moe
from offload.kernels import ops
from offload.model.moe import experts_forward_loop, route
SYNCING = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero",
           "argwhere", "bincount", "unique", "unique_consecutive", "masked_select", "repeat_interleave", "equal",
           "allclose", "is_nonzero"}
class SyncGuard(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls, self.ops = [], []
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        to_host = name in ("to", "copy_") and any(str(a) == "cpu" for a in (*args[1:], *kwargs.values()))
        bool_index = name in ("__getitem__", "__setitem__", "index_put_") and any(
            isinstance(a, torch.Tensor) and a.dtype == torch.bool for a in args[1:])
        if name != "__get__":  # a property (shape, device, dtype): never a launch
            self.ops.append(name)
        if name in SYNCING or to_host or bool_index:
            self.calls.append(name)
        return func(*args, **kwargs)
from offload.model import moe
# the router's linear() as it runs on the GPU: F.linear at any rows. On the CPU tensors the interpreter runs on,
# linear() checks a bf16 weight for offload's C++ kernels, which take one or two rows (more only where the CPU has
# AVX-512 BF16), so the calls of 1 token and of 24 would differ by the host's kernel choice, not the grouped path's
host_linear = moe.linear
def device_linear(x, w, bias):
    if isinstance(w, torch.Tensor) and w.dtype == x.dtype:
        return torch.nn.functional.linear(x, w, bias)
    return host_linear(x, w, bias)
moe.linear = device_linear
def experts_forward_grouped(m, w, x):
    d = x.shape[-1] // 2
    residual, h = x[..., :d], x[..., d:].reshape(-1, d)
    weights, ids = route(m, moe.linear(h, w.router, None))
    out = ops.run_grouped(m, w, h, weights, ids)
    return None if out is None else residual + out.to(x.dtype).view(residual.shape)
group_weights, builds = triton_moe.group_weights, []
triton_moe.group_weights = lambda leaves, x: builds.append(len(leaves)) or group_weights(leaves, x)
cases = torch.load(sys.argv[1], weights_only=False)
out = {}
for name, c in cases.items():
    run = experts_forward_loop if name.startswith("loop") else experts_forward_grouped
    triton_moe._offset_table.cache_clear()  # each case builds its weights' offset table, as a first call does
    ops._GROUPED.clear()  # and its grouped operands
    if "refill" in c:  # a staging slot: grouped once, then refilled in place with another layer's weights
        run(c["moe"], c["w"], c["x"])
        for slot, new in c["refill"]:
            slot.copy_(new)
    builds.clear()
    with SyncGuard() as guard:
        y = run(c["moe"], c["w"], c["x"])
    out[name] = (y, guard.calls, guard.ops, len(builds))
torch.save(out, sys.argv[2])
"""


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> tuple[dict, dict]:
    """(inputs, outputs) of every case, the grouped path interpreted in a subprocess; "loop" runs the reference
    there under the same guard (and for its first token only), "one-token" the skewed case's first token only,
    "batched" a case's tokens as [B, S, 2D], as a unit gets them."""
    inputs = {case_id(c): make_inputs(c, seed=i) for i, c in enumerate(CASES)}
    inputs["loop"] = inputs[case_id(CASES[1])]
    inputs["loop-one-token"] = {**inputs["loop"], "x": inputs["loop"]["x"][:1].clone()}
    inputs["one-token"] = {**inputs[case_id(CASES[6])], "x": inputs[case_id(CASES[6])]["x"][:1].clone()}
    inputs["batched"] = {**inputs[case_id(CASES[7])], "x": inputs[case_id(CASES[7])]["x"].reshape(3, 3, 2 * D)}
    inputs["refilled"] = slot_inputs(CASES[4], seed=4)
    return inputs, run_interpreted(WORKER, inputs, tmp_path_factory.mktemp("triton_moe"))


def slot_inputs(case, seed: int) -> dict:
    """make_inputs(case) with each projection's experts as views of one buffer per plane (a staging slot's), and
    "refill": (buffer, what to copy into it) pairs holding another draw's experts."""
    first, second = make_inputs(case, seed), make_inputs(case, seed + 100)
    refill, leaves = [], {}
    for field in ("gate_up", "down"):
        planes = [torch.stack([v.qs for v in getattr(first["w"], field)]),
                  torch.stack([v.d for v in getattr(first["w"], field)])]
        refill += zip(planes, [torch.stack([v.qs for v in getattr(second["w"], field)]),
                               torch.stack([v.d for v in getattr(second["w"], field)])])
        v = getattr(first["w"], field)[0]
        leaves[field] = tuple(DeviceQuantWeight(v.fmt, v.shape, qs, d, v.tiled) for qs, d in zip(*planes))
    w = ExpertWeights(first["w"].router, leaves["gate_up"], leaves["down"])
    return {**first, "w": w, "refill": refill, "refilled_w": second["w"]}


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_grouped_experts_equal_the_loop(interpreted, case):
    inputs, outputs = interpreted
    c = inputs[case_id(case)]
    y = outputs[case_id(case)][0]
    ref = experts_forward_loop(c["moe"], c["w"], c["x"])
    assert y is not None and y.dtype == ref.dtype and y.shape == ref.shape
    err, tol = (y.float() - ref.float()).abs(), tolerance(c["moe"], c["w"], c["x"])
    if err.numel():
        worst = int((err - tol).argmax())
        assert bool((err <= tol).all()), f"error {float(err.flatten()[worst]):.3g} > {float(tol.flatten()[worst]):.3g}"


@needs_triton
def test_grouped_experts_take_batched_sequences(interpreted):
    inputs, outputs = interpreted
    c, y = inputs["batched"], outputs["batched"][0]
    assert y.shape == (3, 3, D)
    ref = experts_forward_loop(c["moe"], c["w"], c["x"])
    assert bool(((y - ref).float().abs() <= tolerance(c["moe"], c["w"], c["x"].reshape(9, 2 * D)).view(3, 3, D)).all())


@needs_triton
def test_a_slot_s_grouped_operands_are_built_once_and_follow_its_contents(interpreted):
    """The experts' grouped operands are built on the first call with their weights and reused (a rebuild walks
    every expert: 0.4 ms for 128); they hold views, so after the slot is refilled with another layer's experts the
    second call computes with those."""
    inputs, outputs = interpreted
    c = inputs["refilled"]
    y, _, _, builds = outputs["refilled"]
    assert builds == 0 and outputs[case_id(CASES[4])][3] == 2  # a first call builds both projections
    refilled = {**c, "w": ExpertWeights(c["w"].router, c["refilled_w"].gate_up, c["refilled_w"].down)}
    ref = experts_forward_loop(c["moe"], refilled["w"], c["x"])
    assert not torch.allclose(ref, experts_forward_loop(c["moe"], c["w"], c["x"]))  # the refill changes the answer
    assert bool(((y.float() - ref.float()).abs() <= tolerance(c["moe"], refilled["w"], c["x"])).all())


@needs_triton
def test_grouped_operands_are_rebuilt_for_other_weights_or_activations(monkeypatch):
    from offload.kernels import ops, triton_moe

    builds = []
    group_weights = triton_moe.group_weights
    monkeypatch.setattr(triton_moe, "group_weights", lambda leaves, x: builds.append(1) or group_weights(leaves, x))
    c = make_inputs(CASES[4], seed=4)
    h = c["x"][:, D:]
    first = ops.grouped_weights(c["w"], h)
    assert first[0] is not None and len(builds) == 2
    assert ops.grouped_weights(c["w"], h) is first and len(builds) == 2  # the same weights: nothing rebuilt
    ops.grouped_weights(c["w"], h.bfloat16())  # other activations: the dense/quant checks differ
    copy = ExpertWeights(c["w"].router, c["w"].gate_up, c["w"].down)
    ops.grouped_weights(copy, h)
    assert len(builds) == 6


def test_the_cases_leave_experts_unpicked_and_spread_an_expert_over_tiles():
    """What the cases claim to cover: experts no token picked (3 tokens of 8 experts), and an expert with more rows
    than a tile (the skewed case)."""
    from offload.kernels.triton_moe import tile_rows

    c = make_inputs(CASES[1], seed=1)
    _, ids = route(c["moe"], linear(c["x"][:, D:], c["w"].router, None))
    assert len(set(ids.flatten().tolist())) < c["moe"].n_experts
    c = make_inputs(CASES[6], seed=6)
    _, ids = route(c["moe"], linear(c["x"][:, D:], c["w"].router, None))
    assert int((ids == 0).sum()) > tile_rows(24, 3, 6) == 16


@needs_triton
def test_the_grouped_path_makes_the_host_wait_for_nothing(interpreted):
    """No torch call the grouped path makes reads a value back or sizes a tensor by the data; the same guard
    catches the loop's read of the per-expert counts, so it can fail. And the torch calls (each a launch or
    less) are the same whether 1 token picks 3 experts or 24 tokens pick 6, where the loop's grow with them."""
    _, outputs = interpreted
    for case in CASES:
        assert outputs[case_id(case)][1] == [], (case_id(case), outputs[case_id(case)][1])
    assert "tolist" in outputs["loop"][1]
    assert outputs["one-token"][2] == outputs[case_id(CASES[6])][2]
    assert len(outputs["loop-one-token"][2]) < len(outputs["loop"][2])


@pytest.mark.parametrize("n_tokens, top_k, n_experts, block_rows", [(1, 2, 4, 1), (3, 2, 8, 16), (40, 3, 6, 16),
                                                                     (7, 1, 3, 2), (0, 2, 4, 16)])
def test_tiles_cover_each_pair_once_within_one_expert(n_tokens, top_k, n_experts, block_rows):
    from offload.kernels.triton_moe import expert_tiles

    gen = torch.Generator().manual_seed(n_tokens)
    picks = [torch.randperm(n_experts, generator=gen)[:top_k] for _ in range(n_tokens)]
    ids = torch.stack(picks) if picks else torch.zeros(0, top_k, dtype=torch.int64)  # [T, k]
    t = expert_tiles(ids, n_experts, block_rows)
    flat, seen = ids.reshape(-1), []
    for j, e in enumerate(t.expert.tolist()):  # each tile's rows as the kernel finds them
        if e >= n_experts:
            continue
        lo, hi = int(t.bounds[e]), int(t.bounds[e + 1])
        start = lo + (j - (int(t.tile_end[e]) - -(-(hi - lo) // block_rows))) * block_rows
        rows = list(range(start, min(start + block_rows, hi)))
        assert rows and all(int(flat[t.order[r]]) == e for r in rows)
        seen += rows
    assert sorted(seen) == list(range(flat.numel()))
    assert sorted(t.order.tolist()) == list(range(flat.numel()))


@needs_triton
def test_weights_the_kernels_do_not_take_stay_on_the_loop():
    """GGUF block formats, a StackedWeight, formats mixed across experts and dense weights in another dtype than
    the activations: group_weights says None (experts_forward then loops)."""
    from offload.kernels.triton_moe import group_weights

    x = torch.randn(2, 64)
    q8, q4 = (pack(torch.randn(32, 64), f).to_rows() for f in ("q8_0", "q4_0"))
    quant = [DeviceQuantWeight(p.fmt, p.shape, p.qs, p.d) for p in (q8, q8)]
    assert group_weights(quant, x) is not None and group_weights([torch.randn(32, 64)] * 2, x) is not None
    gguf = DeviceQuantWeight("q4_1", (32, 64), torch.zeros(32, 40, dtype=torch.uint8), None)
    mixed = [quant[0], DeviceQuantWeight(q4.fmt, q4.shape, q4.qs, q4.d)]
    for leaves in ([gguf, gguf], [StackedWeight((gguf, gguf))] * 2, mixed, [torch.randn(32, 64).bfloat16()] * 2,
                   [quant[0], torch.randn(32, 64)]):
        assert group_weights(leaves, x) is None


# ------------------------------------------------------------------------- compiled for a GPU, without one
@needs_triton
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1: kernels are interpreted")
@pytest.mark.parametrize("gated, kind, bn", [(True, 2, 16), (False, 0, 1)])
def test_the_grouped_kernel_compiles_for_an_h200(gated, kind, bn):
    """The kernel compiled to a cubin for sm_90 by Triton's own ptxas (no GPU needed): gate_up over tiled q4_0
    with tl.dot, and down over dense bf16 on the CUDA cores."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from offload.kernels import triton_moe as T

    cfg = T._config("dense" if kind == 0 else "q4_0", bn, torch.bfloat16)
    names = ["x_ptr", "w_ptr", "d_ptr", "offsets_ptr", "order_ptr", "bounds_ptr", "tile_end_ptr", "expert_ptr",
             "scale_ptr", "y_ptr", "N", "M", "K", "top_k", "n_experts", "stride_x", "stride_y"]
    w_types = ["*bf16", "*bf16"] if kind == 0 else ["*u8", "*fp16"]
    types = ["*bf16", *w_types, *["*i64"] * 5, "*bf16" if gated else "*fp32", "*bf16"] + ["i32"] * 7
    options = {k: cfg[k] for k in ("num_warps", "enable_fp_fusion")}
    consts = {"GATED": gated, "KIND": kind, "TILED": kind != 0,
              **{k: v for k, v in cfg.items() if k not in options}}
    try:
        source = ASTSource(T._grouped_kernel, {**dict(zip(names, types)), **{k: "constexpr" for k in consts}},
                           consts, {})
    except TypeError as e:  # the compile API is internal and changes between Triton releases
        pytest.skip(f"Triton {triton.__version__} builds an ASTSource differently ({e})")
    assert len(triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["cubin"]) > 0


# --------------------------------------------------------------------------------------------- on a GPU
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@needs_triton
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_cuda_experts_forward_takes_the_grouped_kernels(case):
    from offload.model import moe

    c = make_inputs(case, seed=7)

    def to_cuda(v):
        return v.cuda() if isinstance(v, torch.Tensor) else DeviceQuantWeight(v.fmt, v.shape, v.qs.cuda(),
                                                                               v.d.cuda(), v.tiled)
    w = c["w"]
    wc = ExpertWeights(w.router.cuda(), tuple(map(to_cuda, w.gate_up)), tuple(map(to_cuda, w.down)))
    from offload.kernels import ops

    assert ops._triton_moe() is not None
    y = moe.experts_forward(c["moe"], wc, c["x"].cuda()).cpu()
    ref = experts_forward_loop(c["moe"], w, c["x"])
    assert bool(((y.float() - ref.float()).abs() <= tolerance(c["moe"], w, c["x"])).all())

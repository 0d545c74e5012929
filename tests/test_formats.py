"""The table of GGUF types (offload.formats.GGUF_TYPES) against gguf-py and csrc/, each type's numpy and torch
dequantizers bit for bit against gguf-py, the dequantizing CPU matmul of the types without fused kernels, and GGUF
files in those types loaded, run and compared with transformers on the dequantized weights."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

import offload.kernels as K
from conftest import assert_logits_close, hf_logits, make_hf_model, offload_logits
from gguf_support import GGPY_QUANTIZES, K_TINY, hf_from_gguf, write_gguf
from offload.errors import WeightsError
from offload.formats import CPU_KERNELS, GGUF_BLOCKS, GGUF_NAMES, GGUF_TYPE, GGUF_TYPES
from offload.kernels.quant import put_scales, random_gguf_blocks

BLOCK_TYPES = tuple(GGUF_BLOCKS)
DEQUANTIZED = tuple(f for f in GGUF_BLOCKS if f not in CPU_KERNELS)  # computed by dequantizing, no fused kernel
IDS = [5, 17, 42, 99, 3, 200, 7]
CSRC = Path(__file__).resolve().parent.parent / "csrc"


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_CACHE", str(tmp_path / "cache"))


def gguf_py(raw: np.ndarray, fmt: str) -> np.ndarray:
    return quants.dequantize(raw, GGMLQuantizationType[GGUF_TYPE[fmt].ggml_name])


def signed_blocks(fmt: str, m: int, n_blocks: int, seed: int) -> np.ndarray:
    """Random blocks [m, n_blocks * block_bytes] whose scales are finite, the fp16 ones of either sign."""
    raw = random_gguf_blocks(fmt, m, n_blocks * GGUF_TYPE[fmt].block_weights, seed)
    rng = np.random.default_rng(seed + 1)
    put_scales(raw.reshape(-1, GGUF_TYPE[fmt].block_bytes), fmt, lambda n: rng.uniform(-2e-2, 2e-2, n))
    return raw


# ----------------------------------------------------------------------------------------------- the table
def test_the_table_agrees_with_gguf_py():
    for t in GGUF_TYPES:
        qtype = GGMLQuantizationType[t.ggml_name]
        assert qtype.value == t.ggml_type and GGML_QUANT_SIZES[qtype] == (t.block_weights, t.block_bytes), t.name
        assert not t.fields or sum(n for _, n, _ in t.fields) == t.block_bytes, t.name
        assert t.layout in ("float", "split", "blocks") and set(t.kin) <= set(GGUF_TYPE), t.name
        assert {kind for _, _, kind in t.fields} <= {"f16", "e8m0", "ue4m3", "bits+f16", "bits"}, t.name


def test_the_tables_kernel_codes_are_csrcs():
    """formats.CPU_KERNELS is csrc/kernels.h's formats, name for name: the enum's fixed ids and the GGUF block
    formats' lines (OFFLOAD_GGUF_FORMATS), whose block sizes are the table's."""
    header = (CSRC / "kernels.h").read_text()
    enum = re.search(r"enum WFmt : int \{([^}]*)\}", header)[1]
    codes = {m[1].lower(): int(m[2]) for m in re.finditer(r"W_(\w+) = (\d+)", enum)}
    lines = re.findall(r"X\((\w+), (\w+), (\d+), (\d+), (\d+), ", header)
    codes.update({name: int(code) for name, _, code, _, _ in lines})
    assert codes == {f.replace("fp16", "f16").replace("fp32", "f32"): c for f, c in CPU_KERNELS.items()}
    for name, upper, _, weights, block_bytes in lines:
        assert upper.lower() == name and (int(weights), int(block_bytes)) == GGUF_BLOCKS[name], name


# -------------------------------------------------------------------------------- dequantizers, bit for bit
@pytest.mark.parametrize("fmt", BLOCK_TYPES)
@pytest.mark.parametrize("m,n_blocks", [(1, 1), (7, 3), (3, 1)])
def test_numpy_and_torch_dequantizers_are_gguf_py_bit_for_bit(fmt, m, n_blocks):
    from offload.runtime.device_quant import dequantize_gguf

    raw = signed_blocks(fmt, m, n_blocks, seed=m * 10 + n_blocks)
    shape = (m, n_blocks * GGUF_TYPE[fmt].block_weights)
    want = gguf_py(raw, fmt).reshape(shape)
    numpy_ref = K.PackedWeight.from_gguf(raw, fmt, shape).dequantize().numpy()
    torch_path = dequantize_gguf(torch.from_numpy(raw), fmt, shape, torch.float32).numpy()
    for got in (numpy_ref, torch_path):
        assert got.shape == shape and np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_torch_dequantizers_make_their_constants_once_per_device(monkeypatch):
    """A tensor made from Python data on a GPU is a host-to-device copy the host waits for: the torch dequantizers
    (run per call on the GPU) make theirs once per device, and none in later calls."""
    made = []
    real = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **kw: made.append(a) or real(*a, **kw))
    for fmt in BLOCK_TYPES:
        blocks = torch.from_numpy(signed_blocks(fmt, 2, 1, seed=3)).reshape(2, 1, -1)
        first = GGUF_TYPE[fmt].dequantize_torch(blocks)
        made.clear()
        assert torch.equal(GGUF_TYPE[fmt].dequantize_torch(blocks), first) and made == [], fmt


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_fp4_scales_over_every_byte_are_gguf_pys(fmt):
    """Each of the 256 scale bytes beside each of the 16 levels: MXFP4's e8m0 from 2^-128 (subnormal) to 2^127
    (its larger levels overflow to inf), NVFP4's ue4m3 with its 0x7F (zero) and the unused top bit. The numpy
    and torch dequantizers are gguf-py's, bit for bit."""
    kind = GGUF_TYPE[fmt]
    n_scales = kind.fields[0][1]
    blocks = np.random.default_rng(5).integers(0, 256, (256, kind.block_bytes), dtype=np.uint8)
    blocks[:, :n_scales] = np.arange(256, dtype=np.uint8)[:, None]
    blocks[:, n_scales: n_scales + 8] = np.arange(0, 16, 2, dtype=np.uint8) | np.arange(16, 256, 32, dtype=np.uint8)
    with np.errstate(over="ignore"):
        want, got = gguf_py(blocks, fmt), kind.dequantize_np(blocks)
    on_torch = kind.dequantize_torch(torch.from_numpy(blocks)[None])[0].numpy()
    if fmt == "mxfp4":  # both ends of the range were reached
        assert np.isinf(want).any() and (np.abs(want[want != 0]) < np.finfo(np.float32).tiny).any()
    for out in (got, on_torch):
        assert np.array_equal(out.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("fmt", [f for f in BLOCK_TYPES if GGUF_TYPE[f].ggml_name in GGPY_QUANTIZES])
def test_gguf_py_quantized_blocks_dequantize_bit_for_bit(fmt):
    """Blocks as gguf-py quantizes them (realistic scales: MXFP4's exponents, TQ1_0's base-3 bytes below 243)."""
    qtype = GGMLQuantizationType[GGUF_TYPE[fmt].ggml_name]
    rows = np.logspace(-3, 1, 9, dtype=np.float32)[:, None]  # 4 decades of scale
    w = np.random.default_rng(6).standard_normal((9, 512)).astype(np.float32) * rows
    raw = quants.quantize(w, qtype).reshape(-1, GGUF_TYPE[fmt].block_bytes)
    want = gguf_py(raw, fmt).reshape(raw.shape[0], -1)
    assert np.array_equal(GGUF_TYPE[fmt].dequantize_np(raw).view(np.uint32), want.view(np.uint32))
    on_torch = GGUF_TYPE[fmt].dequantize_torch(torch.from_numpy(raw)[None])[0].numpy()
    assert np.array_equal(on_torch.view(np.uint32), want.view(np.uint32))


# ---------------------------------------------------------------------------- the dequantizing CPU matmul
@pytest.mark.parametrize("fmt", DEQUANTIZED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_types_without_kernels_multiply_dequantized(fmt, dtype, monkeypatch):
    """kernels.linear on a type without fused kernels: x @ (gguf-py's values).T + bias in fp32, whole or in slices of
    rows, on every path. Its matmuls sum the k products in another order than torch's one: the results are apart by
    about sqrt(k) roundings of the products' sizes (the bound tests/test_device_dequant_gguf.py argues; a fixed 1e-5
    failed now and then, x being drawn unseeded)."""
    m, k = 13, 2 * GGUF_TYPE[fmt].block_weights
    raw = signed_blocks(fmt, m, 2, seed=3)
    w = K.PackedWeight.from_gguf(raw, fmt, (m, k))
    assert w.fmt_id < 0
    x, bias = torch.randn(5, k).to(dtype).float(), torch.randn(m)
    values = torch.from_numpy(gguf_py(raw, fmt).reshape(m, k))
    want = x @ values.T + bias
    tol = 2 * ((1 + k ** 0.5) * (x.abs() @ values.abs().T + bias.abs()) + want.abs()) * 2.0**-24
    got = [K.linear(x.to(dtype), w, bias), K.linear_ref(x.to(dtype), w, bias)]
    monkeypatch.setattr(K, "DEQUANT_SLICE_BYTES", 4 * 4 * k)  # slices of 4 rows, then the tail of 1
    got.append(K.linear(x.to(dtype), w, None) + bias)
    for y in got:
        assert y.dtype == torch.float32 and y.shape == want.shape and bool(((y - want).abs() <= tol).all())


def test_the_fused_layer_leaves_types_without_kernels_to_the_unfused_path():
    from offload.kernels.layer import _packed
    from offload.kernels.ops import StackedWeight

    kernel, none = (K.PackedWeight.from_gguf(random_gguf_blocks(f, 4, 256), f, (4, 256)) for f in ("q3_k", "iq3_xxs"))
    assert _packed(kernel) and not _packed(none) and not _packed(StackedWeight((kernel, none)))


# --------------------------------------------------------------------------------------- GGUF files as stored
# On the dequantizing path the weights are gguf-py's values multiplied in fp32, as transformers multiplies them:
# logits agree as an F32 file's do (1e-4 of their range). The fused kernels take int8 activations (as llama.cpp's
# q8_0 / q8_K): 5e-2, as the K-quants' in test_gguf.py (measured here <= 1.3e-2).
TOLERANCE = 1e-4
KERNEL_TOLERANCE = 5e-2


@pytest.mark.parametrize("fmt", BLOCK_TYPES)
def test_gguf_file_in_every_block_type_loads_and_runs(tmp_path, fmt):
    """Every linear (and the embedding) of a 256-wide model stored in fmt: it loads as stored, generates, and its
    logits are transformers' on gguf-py's dequantization of the same file (through the fused kernels where the type
    has them, else dequantized and multiplied in fp32)."""
    from offload import LLM, SamplingParams

    qtype = GGUF_TYPE[fmt].ggml_name
    model = make_hf_model("llama", **{**K_TINY, "vocab_size": 300})
    path = write_gguf(model, tmp_path / f"tiny-{qtype}.gguf", qtype, random_quants=True)
    llm = LLM(str(path))
    assert llm.spec.stored_format == fmt and llm.plan.weight_format == "gguf"
    rel = KERNEL_TOLERANCE if fmt in CPU_KERNELS else TOLERANCE
    assert_logits_close(offload_logits(llm.model, IDS), hf_logits(hf_from_gguf(model, path), IDS), rel=rel)
    out = llm.generate([IDS], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def test_mixed_new_types_in_one_layer(tmp_path):
    """Q5_0 rows beside Q8_0 and Q3_K ones in one layer (as llama.cpp's Q4_K_M fallback writes them): the fused
    q|k|v is a stack of the three types, and logits match transformers'."""
    from offload import LLM
    from offload.kernels.ops import StackedWeight
    from offload.weights.gguf import GGUFFile
    from offload.weights.gguf_source import GGUFSource

    types = {"blk.0.attn_q.weight": "Q5_0", "blk.0.attn_k.weight": "Q8_0", "blk.0.attn_v.weight": "Q3_K",
             "blk.1.ffn_down.weight": "IQ4_NL"}
    model = make_hf_model("llama", **{**K_TINY, "vocab_size": 300})
    path = write_gguf(model, tmp_path / "mixed.gguf", "Q5_1", types=types, random_quants=True)
    llm = LLM(str(path))
    layer = GGUFSource(GGUFFile(path), llm.spec, torch.float32).load(llm.spec.units()[1])
    assert isinstance(layer.qkv, StackedWeight) and [p.fmt for p in layer.qkv.parts] == ["q5_0", "q8_0", "q3_k"]
    assert_logits_close(offload_logits(llm.model, IDS), hf_logits(hf_from_gguf(model, path), IDS),
                        rel=KERNEL_TOLERANCE)
    # the plan sizes each tensor by its own type: q 256x256 in q5_0 (22 bytes per 32), k and v 128x256 in q8_0 (34
    # per 32) and q3_k (110 per 256), o 256x256, gate and up 512x256 in q5_1 (24 per 32); down 256x512 in q5_1
    # too in layer 0; two norms of 256 fp32
    unit = llm.plan.unit("layer.0")
    q5_1 = (256 * 256 + 2 * 512 * 256 + 256 * 512) // 32 * 24
    assert unit.weight_bytes == 256 * 256 // 32 * 22 + 128 * 256 // 32 * 34 + 128 * 256 // 256 * 110 + q5_1 + 2048
    assert unit.stored == "q5_1+q5_0+q8_0+q3_k" and llm.plan.unit("layer.1").stored == "q5_1+iq4_nl"
    assert "q5_1+q5_0+q8_0+q3_k" in llm.plan.table()


def test_a_unit_of_mixed_types_is_priced_by_each_types_own_rate(tmp_path):
    """A layer holding q5_1, q5_0, q8_0 and q3_k linears: its CPU matmul time is each format's share of the
    weights at that format's rate (curves of one format no longer price the others)."""
    from dataclasses import replace

    from offload import LLM
    from offload.hardware import load_hardware
    from offload.planner.costs import _cpu_matmul_s

    types = {"blk.0.attn_q.weight": "Q5_0", "blk.0.attn_k.weight": "Q8_0", "blk.0.attn_v.weight": "Q3_K"}
    path = write_gguf(make_hf_model("llama", **{**K_TINY, "vocab_size": 300}), tmp_path / "mixed.gguf", "Q5_1",
                      types=types, random_quants=True)
    unit = LLM(str(path)).spec.units()[1]
    rates = {"q5_1": 1e9, "q5_0": 2e9, "q8_0": 4e9, "q3_k": 8e9, "fp32": 1e9}
    hw = replace(load_hardware("cpu-desktop"), cpu_flops=rates, cpu_flops_by_rows={}, cpu_k_factor={},
                 cpu_n_factor={})
    numel = {}
    for t in (t for t in unit.tensors if t.role == "linear"):
        numel[t.held_format("gguf", "fp32")] = numel.get(t.held_format("gguf", "fp32"), 0) + t.numel
    flops = 1e9
    want = sum(flops * n / sum(numel.values()) / rates[f] for f, n in numel.items())
    assert set(numel) == {"q5_1", "q5_0", "q8_0", "q3_k"}
    assert _cpu_matmul_s(unit, "gguf", "fp32", hw, flops, 1, 0) == pytest.approx(want, rel=1e-9)
    assert want > flops / rates["q5_0"]  # slower than pricing the whole layer at any one faster format's rate


def test_a_type_offload_does_not_read_is_refused_by_name(tmp_path):
    model = make_hf_model("llama", **{**K_TINY, "vocab_size": 300})
    path = write_gguf(model, tmp_path / "q1_0.gguf", "Q8_0", types={"blk.0.ffn_up.weight": "Q1_0"},
                      random_quants=True)
    from offload import LLM

    with pytest.raises(WeightsError, match=r"blk\.0\.ffn_up\.weight .* is stored as Q1_0, which offload does not"):
        LLM(str(path))


def test_bf16_gguf_linears_stay_bf16(tmp_path):
    """A BF16 file under fp32 compute: linears stay bf16 (offload's bf16 kernels take fp32 activations), the plan
    sizes them at 2 bytes a weight, and logits are transformers' on the same weights."""
    from offload import LLM
    from offload.weights.gguf import GGUFFile
    from offload.weights.gguf_source import GGUFSource

    model = make_hf_model("llama", vocab_size=300)
    path = write_gguf(model, tmp_path / "bf16.gguf", "BF16")
    llm = LLM(str(path))
    layer = GGUFSource(GGUFFile(path), llm.spec, torch.float32).load(llm.spec.units()[1])
    assert layer.qkv.dtype == torch.bfloat16 and layer.down.dtype == torch.bfloat16
    # q 64x64, k and v 32x64, o 64x64, gate and up 128x64, down 64x128 at 2 bytes; two norms of 64 fp32
    assert llm.plan.unit("layer.0").weight_bytes == (2 * 64 * 64 + 2 * 32 * 64 + 3 * 128 * 64) * 2 + 2 * 64 * 4
    assert llm.plan.unit("layer.0").stored == "bf16"
    assert_logits_close(offload_logits(llm.model, IDS), hf_logits(hf_from_gguf(model, path), IDS), rel=1e-4)


needs_llama_cpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                     reason="llama-cpp-python is not installed")


@pytest.mark.slow  # ~25 s: llama.cpp quantizes a 49k-token vocabulary
@needs_llama_cpp
def test_llama_cpp_q4_k_m_of_smollm2_widths_loads(tmp_path):
    """llama.cpp's Q4_K_M of a 576-wide model falls back to Q5_0 (and Q8_0) for rows that are not whole 256-weight
    super-blocks, which offload refused before; it now loads as stored and generates."""
    import gguf

    from offload import LLM, SamplingParams

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    import make_gguf

    f16, q4km = tmp_path / "smol.f16.gguf", tmp_path / "smol.Q4_K_M.gguf"
    make_gguf.write_f16(f16, "smol-2l")
    make_gguf.quantize(f16, q4km, "Q4_K_M", threads=2)
    types = {t.tensor_type.name for t in gguf.GGUFReader(q4km).tensors if t.name.startswith("blk.")}
    assert "Q5_0" in types and types <= set(GGUF_NAMES)
    llm = LLM(str(q4km))
    assert "q5_0" in llm.plan.unit("layer.0").stored
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 3

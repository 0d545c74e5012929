"""Quantizers and GGUF block layouts: bit-exact against gguf-py, round trips, sizes."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import quants as gq

import offload.kernels as K
from offload.errors import KernelError
from offload.formats import QUANT_BLOCK_BYTES
from offload.kernels.packed import pack as pack_impl

GGUF_TYPES = {"q8_0": QT.Q8_0, "q4_0": QT.Q4_0}


def hard_weights(m: int = 48, k: int = 320, seed: int = 0) -> np.ndarray:
    """Random rows over 6 decades of scale, plus blocks that stress rounding: zeros, ties, negative maxima."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((m, k)) * 10.0 ** rng.uniform(-4, 2, (m, 1))).astype(np.float32)
    w[0, :32] = 0.0                                       # all-zero block: d = 0
    w[1, :32] = 1.0                                       # every element ties for the max
    w[2, :32] = rng.integers(-127, 128, 32) / 127 * 3     # exact .5 cases after scaling
    w[3, :32] = -np.abs(w[3, :32])                        # negative maximum (q4_0 sign of d)
    w[4, 32:64] = np.linspace(-1, 1, 32)
    w[5, :32] = 1e-30                                     # scale underflows fp16
    w[6, :32] = np.r_[127.0, np.arange(-15, 16) + 0.5]    # q8_0: d = 1, exact .5 ties (away from zero)
    w[7, :32] = np.r_[-8.0, np.arange(-7.5, 8.0, 0.5)]    # q4_0: d = 1, x + 8.5 lands on integers
    return w


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_pack_is_bit_exact_with_gguf(fmt):
    w = hard_weights()
    want = gq.quantize(w, GGUF_TYPES[fmt])
    assert np.array_equal(K.pack(torch.from_numpy(w), fmt).to_gguf(), want)         # active path
    assert np.array_equal(pack_impl(torch.from_numpy(w), fmt, ext=None).to_gguf(), want)  # numpy fallback


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_pack_multithreaded_equals_single_threaded(fmt):
    w = torch.from_numpy(hard_weights(m=67, k=96, seed=1))
    one, many = pack_impl(w, fmt, ext=K._C, n_threads=1), pack_impl(w, fmt, ext=K._C, n_threads=4)
    assert torch.equal(one.qs, many.qs) and torch.equal(one.d.view(torch.int16), many.d.view(torch.int16))


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_from_gguf_wraps_without_requantizing(fmt):
    w = hard_weights(m=8, k=64, seed=2)
    raw = gq.quantize(w, GGUF_TYPES[fmt])
    p = K.PackedWeight.from_gguf(raw.tobytes(), fmt, (8, 64))
    assert p.nbytes == raw.nbytes == 8 * 2 * QUANT_BLOCK_BYTES[fmt]
    assert np.array_equal(p.to_gguf(), raw)
    assert np.array_equal(p.dequantize().numpy(), gq.dequantize(raw, GGUF_TYPES[fmt]))


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_half_formats_round_trip(fmt):
    w = torch.randn(6, 40)
    p = K.pack(w, fmt)
    dt = torch.bfloat16 if fmt == "bf16" else torch.float16
    assert p.nbytes == 6 * 40 * 2 and torch.equal(p.dequantize(), w.to(dt).float())
    q = K.PackedWeight.from_gguf(p.to_gguf(), fmt, (6, 40))
    assert torch.equal(q.dequantize(), p.dequantize())


def test_pack_accepts_bf16_and_fp16_input_like_fp32():
    w = torch.randn(8, 64).bfloat16()
    assert torch.equal(K.pack(w, "q4_0").qs, K.pack(w.float(), "q4_0").qs)


@pytest.mark.parametrize("bad, match", [
    (lambda: K.pack(torch.randn(4, 48), "q8_0"), "divisible by 32"),
    (lambda: K.pack(torch.randn(4, 64), "q3_0"), "not supported"),
    (lambda: K.pack(torch.randn(4, 256), "q5_k"), "does not quantize to q5_k"),
    (lambda: K.pack(torch.randn(4, 64).double(), "q8_0"), "float32/bfloat16/float16"),
    (lambda: K.pack(torch.randn(64), "q8_0"), "2-D"),
    (lambda: K.PackedWeight.from_gguf(b"\0" * 33, "q8_0", (1, 32)), "needs 34 bytes"),
    (lambda: K.PackedWeight("q8_0", (2, 32), torch.zeros(2, 32, dtype=torch.uint8),
                            torch.zeros(2, 1, dtype=torch.float16)), "quants must be"),
    (lambda: K.PackedWeight("q4_0", (2, 64), torch.zeros(2, 32, dtype=torch.uint8),
                            torch.zeros(2, 2, dtype=torch.float32)), "scales must be"),
    (lambda: K.PackedWeight("q4_0", (2, 64), torch.zeros(2, 64, dtype=torch.uint8),
                            torch.zeros(2, 2, dtype=torch.float16)), "quants must be"),
    (lambda: K.PackedWeight("bf16", (2, 8), torch.zeros(2, 8), None), "quants must be"),
])
def test_bad_pack_inputs_raise_kernel_error(bad, match):
    with pytest.raises(KernelError, match=match):
        bad()


def test_fp16_conversions_match_numpy():
    vals = np.array([0, 1e-8, 6e-8, 1e-5, 0.1, 1 / 3, 65504, 65520, 1e6, -2.5e-3, 1e-30], dtype=np.float32)
    got = [K._C.f32_to_fp16(float(v)) for v in vals]
    with np.errstate(over="ignore"):
        assert got == list(vals.astype(np.float16).view(np.uint16))
    halves = np.arange(0, 65536, 7, dtype=np.uint16)
    finite = halves[np.isfinite(halves.view(np.float16))]
    back = np.array([K._C.fp16_to_f32(int(h)) for h in finite], dtype=np.float32)
    assert np.array_equal(back, finite.view(np.float16).astype(np.float32))

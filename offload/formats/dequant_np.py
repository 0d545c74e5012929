"""Numpy reference dequantizers of the GGUF block types kept as blocks, one function per type, named as in the table.

Each takes uint8 blocks [n, block_bytes] and returns fp32 [n, block_weights], bit for bit gguf-py's
gguf.quants.dequantize: the same fp32 operations in the same order (a product rounds once; d * q + m twice).
The lattice types' codebooks (grids) and sign table, and the fp4 types' levels and scale decoders, are read from
gguf-py, a dependency, not copied.
"""

from __future__ import annotations

import functools

import numpy as np

_NIBBLE_SHIFTS = np.array([0, 4], dtype=np.uint8)


def _fp16(b: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte `at` of each block [n, bytes], as fp32 [n, 1]."""
    return np.ascontiguousarray(b[:, at: at + 2]).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, groups: int) -> np.ndarray:
    """uint8 [n, groups * m] -> [n, 2 * groups, m]: each m bytes' low nibbles, then their high nibbles."""
    q = qs.reshape(qs.shape[0], groups, 1, -1) >> _NIBBLE_SHIFTS.reshape(1, 1, 2, 1)
    return (q & np.uint8(15)).reshape(qs.shape[0], 2 * groups, -1)


def _bits(b: np.ndarray, n_bits: int) -> np.ndarray:
    """uint8 [n, m] -> [n, m * 8 / n_bits]: each byte's fields of n_bits, lowest first."""
    shifts = np.arange(0, 8, n_bits, dtype=np.uint8)
    return ((b[:, :, None] >> shifts) & np.uint8((1 << n_bits) - 1)).reshape(b.shape[0], -1)


def _fifth_bits(b: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1: the 32 high bits of a block's 4 bytes qh (a little-endian uint32), [n, 32] uint8."""
    qh = np.ascontiguousarray(b).view(np.uint32).reshape(-1, 1) >> np.arange(32, dtype=np.uint32)
    return (qh & np.uint32(1)).astype(np.uint8)


def q4_1(b: np.ndarray) -> np.ndarray:
    """{fp16 d, fp16 m, qs[16]}: d * q + m, low nibbles are weights 0..15."""
    return _fp16(b, 0) * _nibbles(b[:, 4:20], 1).reshape(-1, 32).astype(np.float32) + _fp16(b, 2)


def q5_0(b: np.ndarray) -> np.ndarray:
    """{fp16 d, qh[4], qs[16]}: d * (q - 16), bit i of qh the fifth bit of weight i."""
    q = _nibbles(b[:, 6:22], 1).reshape(-1, 32) | (_fifth_bits(b[:, 2:6]) << np.uint8(4))
    return _fp16(b, 0) * (q.astype(np.int8) - np.int8(16)).astype(np.float32)


def q5_1(b: np.ndarray) -> np.ndarray:
    """{fp16 d, fp16 m, qh[4], qs[16]}: d * q + m."""
    q = _nibbles(b[:, 8:24], 1).reshape(-1, 32) | (_fifth_bits(b[:, 4:8]) << np.uint8(4))
    return _fp16(b, 0) * q.astype(np.float32) + _fp16(b, 2)


def _k4_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 6-bit scales and minimums [n, 8] of q4_k / q5_k blocks (12 packed bytes at offset 4; csrc/kquant.h)."""
    w = np.ascontiguousarray(b[:, 4:16]).view(np.uint32)
    out = np.empty((b.shape[0], 4), dtype=np.uint32)
    out[:, 0] = w[:, 0] & 0x3F3F3F3F
    out[:, 1] = (w[:, 2] & 0x0F0F0F0F) | ((w[:, 0] >> 2) & 0x30303030)
    out[:, 2] = w[:, 1] & 0x3F3F3F3F
    out[:, 3] = ((w[:, 2] >> 4) & 0x0F0F0F0F) | ((w[:, 1] >> 2) & 0x30303030)
    sm = out.view(np.uint8).astype(np.float32)
    return sm[:, :8], sm[:, 8:]


def q2_k(b: np.ndarray) -> np.ndarray:
    """{scales[16], qs[64], fp16 d, fp16 dmin}: sub-block s of 16 is (d * sc) * q - dmin * m, sc and m the low and
    high nibble of scales[s], q 2 bits (each 32 bytes give 4 runs of 32 weights, lowest bits first)."""
    n = b.shape[0]
    dl = (_fp16(b, 80) * (b[:, :16] & np.uint8(15)).astype(np.float32))[:, :, None]
    ml = (_fp16(b, 82) * (b[:, :16] >> np.uint8(4)).astype(np.float32))[:, :, None]
    q = b[:, 16:80].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    q = (q & np.uint8(3)).reshape(n, 16, 16).astype(np.float32)
    return (dl * q - ml).reshape(n, 256)


def q3_k(b: np.ndarray) -> np.ndarray:
    """{hmask[32], qs[64], scales[12], fp16 d}: sub-block s of 16 is (d * (sc - 32)) * (q - 4 * (1 - h)), q 2 bits
    as in q2_k, h its bit of hmask, sc 6 bits (low 4 from bytes 0-7, high 2 from bytes 8-11)."""
    n = b.shape[0]
    low = _nibbles(b[:, 96:104], 1).reshape(n, 16)
    high = (b[:, 104:108].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)).reshape(n, 16)
    sc = (low | ((high & np.uint8(3)) << np.uint8(4))).astype(np.int8) - np.int8(32)
    dl = (_fp16(b, 108) * sc.astype(np.float32))[:, :, None]
    ql = b[:, 32:96].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    qh = b[:, :32].reshape(n, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    ql = (ql & np.uint8(3)).reshape(n, 16, 16)
    qh = (qh.reshape(n, 16, 16) & np.uint8(1)) ^ np.uint8(1)
    q = (ql.astype(np.int8) - (qh << np.uint8(2)).astype(np.int8)).astype(np.float32)
    return (dl * q).reshape(n, 256)


def q4_k(b: np.ndarray) -> np.ndarray:
    """{fp16 d, fp16 dmin, scales[12], qs[128]}: sub-block s of 32 is (d * sc[s]) * q - dmin * m[s]."""
    sc, m = _k4_scales(b)
    d, dm = (_fp16(b, 0) * sc)[:, :, None], (_fp16(b, 2) * m)[:, :, None]
    return (d * _nibbles(b[:, 16:], 4).astype(np.float32) - dm).reshape(-1, 256)


def q5_k(b: np.ndarray) -> np.ndarray:
    """{fp16 d, fp16 dmin, scales[12], qh[32], qs[128]}: as q4_k, bit s of qh[i] the fifth bit of weight i of
    sub-block s."""
    sc, m = _k4_scales(b)
    d, dm = (_fp16(b, 0) * sc)[:, :, None], (_fp16(b, 2) * m)[:, :, None]
    high = (b[:, None, 16:48] >> np.arange(8, dtype=np.uint8)[None, :, None]) & np.uint8(1)  # [n, 8, 32]
    q = _nibbles(b[:, 48:], 4) | (high << np.uint8(4))
    return (d * q.astype(np.float32) - dm).reshape(-1, 256)


def q6_k(b: np.ndarray) -> np.ndarray:
    """{ql[128], qh[64], int8 scales[16], fp16 d}: sub-block s of 16 is (d * scales[s]) * (q - 32)."""
    n = b.shape[0]
    d = (_fp16(b, 208) * b[:, 192:208].view(np.int8).astype(np.float32))[:, :, None]  # [n, 16, 1]
    ql = b[:, :128].reshape(n, 2, 1, 64) >> _NIBBLE_SHIFTS.reshape(1, 1, 2, 1)
    ql = (ql & np.uint8(15)).reshape(n, 8, 32)
    qh = b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    qh = (qh & np.uint8(3)).reshape(n, 8, 32)
    q = ((ql | (qh << np.uint8(4))).view(np.int8) - np.int8(32)).reshape(n, 16, 16).astype(np.float32)
    return (d * q).reshape(n, 256)


@functools.cache
def iq4_values() -> np.ndarray:
    """IQ4_NL's 16 non-linear levels (int8), from gguf-py."""
    from gguf.quants import IQ4_NL

    return np.array(IQ4_NL.kvalues, dtype=np.int8)


def iq4_nl(b: np.ndarray) -> np.ndarray:
    """{fp16 d, qs[16]}: d * values[q], q the nibbles (low ones are weights 0..15)."""
    q = _nibbles(b[:, 2:18], 1).reshape(-1, 32)
    return _fp16(b, 0) * iq4_values()[q].astype(np.float32)


def iq4_xs(b: np.ndarray) -> np.ndarray:
    """{fp16 d, scales_h[2], scales_l[4], qs[128]}: sub-block s of 32 is (d * (sc - 32)) * values[q], sc 6 bits
    (low 4 the nibbles of scales_l, high 2 bits 2s of the uint16 scales_h)."""
    n = b.shape[0]
    high = np.ascontiguousarray(b[:, 2:4]).view(np.uint16).reshape(n, 1) >> np.arange(0, 16, 2, dtype=np.uint16)
    low = _bits(b[:, 4:8], 4)
    sc = (low | ((high.astype(np.uint8) & np.uint8(3)) << np.uint8(4))).astype(np.int8) - np.int8(32)
    dl = (_fp16(b, 0) * sc.astype(np.float32))[:, :, None]
    q = _nibbles(b[:, 8:136], 8)  # [n, 16, 16]: sub-block s is runs 2s (low nibbles) and 2s+1 (high)
    return (dl * iq4_values()[q].astype(np.float32).reshape(n, 8, 32)).reshape(n, 256)


@functools.cache
def lattice(ggml_name: str) -> tuple[np.ndarray, np.ndarray]:
    """(grid fp32 [entries, 4 or 8], sign masks uint8 [128]) of a lattice type, from gguf-py's codebooks."""
    from gguf import quants

    cls = getattr(quants, ggml_name)
    cls.init_grid()
    grid = cls.grid.reshape(cls.grid_shape)
    return grid, np.frombuffer(quants.IQ2_XXS.ksigns, dtype=np.uint8)


def _signs(bits: np.ndarray) -> np.ndarray:
    """Sign bytes [...] -> +1 / -1 fp32 [..., 8], bit i the sign of weight i."""
    return np.where((bits[..., None] >> np.arange(8, dtype=np.uint8)) & np.uint8(1), np.float32(-1), np.float32(1))


def _packed_signs(words: np.ndarray) -> np.ndarray:
    """IQ2_XXS / IQ3_XXS: a uint32 [..] holds 4 sign indices of 7 bits (into gguf-py's ksigns) -> fp32 [.., 4, 8]."""
    ksigns = lattice("IQ2_XXS")[1]
    idx = (words[..., None] >> np.array([0, 7, 14, 21], dtype=np.uint32)) & np.uint32(0x7F)
    return _signs(ksigns[idx])


def iq2_xxs(b: np.ndarray) -> np.ndarray:
    """{fp16 d, qs[64]}: 8 groups of 32 weights, each two uint32: 4 grid indices (bytes), then 4 sign indices and
    a 4-bit scale (top bits); a group is (d * (0.5 + scale) * 0.25) * grid[index] * signs."""
    n = b.shape[0]
    qs = np.ascontiguousarray(b[:, 2:66]).view(np.uint32).reshape(n, 8, 2)
    db = (_fp16(b, 0) * (np.float32(0.5) + (qs[..., 1] >> 28).astype(np.float32)) * np.float32(0.25))
    grid = lattice("IQ2_XXS")[0][qs[..., 0].copy().view(np.uint8).reshape(n, 8, 4)]  # [n, 8, 4, 8]
    return (db[:, :, None, None] * grid * _packed_signs(qs[..., 1])).reshape(n, 256)


def iq2_xs(b: np.ndarray) -> np.ndarray:
    """{fp16 d, qs[32] uint16, scales[8]}: each uint16 is a 9-bit grid index and a 7-bit sign index; a run of 16
    weights has a 4-bit scale (nibbles of scales, low first): (d * (0.5 + scale) * 0.25) * grid * signs."""
    n = b.shape[0]
    qs = np.ascontiguousarray(b[:, 2:66]).view(np.uint16).reshape(n, 32)
    sc = _bits(b[:, 66:74], 4).astype(np.float32)
    db = _fp16(b, 0) * (np.float32(0.5) + sc) * np.float32(0.25)  # [n, 16]
    grid, ksigns = lattice("IQ2_XS")
    w = grid[qs & np.uint16(511)] * _signs(ksigns[qs >> 9])  # [n, 32, 8]
    return (db[:, :, None, None] * w.reshape(n, 16, 2, 8)).reshape(n, 256)


def iq2_s(b: np.ndarray) -> np.ndarray:
    """{fp16 d, qs[32], signs[32], qh[8], scales[8]}: a 10-bit grid index per 8 weights (a byte of qs, 2 bits of qh),
    a sign bit per weight, and a 4-bit scale per 16 weights: (d * (0.5 + scale) * 0.25) * grid * signs."""
    n = b.shape[0]
    idx = b[:, 2:34].astype(np.uint16) | (_bits(b[:, 66:74], 2).astype(np.uint16) << np.uint16(8))
    db = _fp16(b, 0) * (np.float32(0.5) + _bits(b[:, 74:82], 4).astype(np.float32)) * np.float32(0.25)
    grid = lattice("IQ2_S")[0][idx].reshape(n, 16, 2, 8)
    return (db[:, :, None, None] * grid * _signs(b[:, 34:66]).reshape(n, 16, 2, 8)).reshape(n, 256)


def iq3_xxs(b: np.ndarray) -> np.ndarray:
    """{fp16 d, qs[64], signs_scales[32]}: a grid index (byte) per 4 weights; 8 groups of 32 each with a uint32 of 4
    sign indices and a 4-bit scale (top bits): (d * (0.5 + scale) * 0.5) * grid * signs."""
    n = b.shape[0]
    words = np.ascontiguousarray(b[:, 66:98]).view(np.uint32).reshape(n, 8)
    db = _fp16(b, 0) * (np.float32(0.5) + (words >> 28).astype(np.float32)) * np.float32(0.5)
    grid = lattice("IQ3_XXS")[0][b[:, 2:66]].reshape(n, 8, 4, 8)
    return (db[:, :, None, None] * grid * _packed_signs(words)).reshape(n, 256)


def iq3_s(b: np.ndarray) -> np.ndarray:
    """{fp16 d, qs[64], qh[8], signs[32], scales[4]}: a 9-bit grid index per 4 weights (a byte of qs, a bit of qh),
    a sign bit per weight, a 4-bit scale per 32 weights: (d * (1 + 2 * scale)) * grid * signs."""
    n = b.shape[0]
    idx = b[:, 2:66].astype(np.uint16) | (_bits(b[:, 66:74], 1).astype(np.uint16) << np.uint16(8))
    db = _fp16(b, 0) * (1 + 2 * _bits(b[:, 106:110], 4))  # uint8 times fp32, as gguf-py
    grid = lattice("IQ3_S")[0][idx].reshape(n, 8, 4, 8)
    return (db[:, :, None, None] * grid * _signs(b[:, 74:106]).reshape(n, 8, 4, 8)).reshape(n, 256)


def tq2_0(b: np.ndarray) -> np.ndarray:
    """{qs[64], fp16 d}: ternary weights d * (q - 1), q 2 bits (each 32 bytes hold 4 runs of 32, lowest bits first)."""
    n = b.shape[0]
    q = (b[:, :64].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
    return _fp16(b, 64) * (q.reshape(n, 256).astype(np.int8) - np.int8(1)).astype(np.float32)


_POW3 = np.array([1, 3, 9, 27, 81], dtype=np.uint8)


def _trits(b: np.ndarray, k: int) -> np.ndarray:
    """TQ1_0: bytes [n, m] -> [n, k * m] trits 0..2, run j holding trit j of each byte ((x * 3^j mod 256) * 3 >> 8)."""
    q = b[:, None, :] * _POW3[:k, None]  # uint8: mod 256
    return ((q.astype(np.uint16) * np.uint16(3)) >> np.uint16(8)).astype(np.uint8).reshape(b.shape[0], -1)


def tq1_0(b: np.ndarray) -> np.ndarray:
    """{qs[48], qh[4], fp16 d}: ternary weights d * (t - 1), 5 trits a byte of qs (4 of qh) in base-3 fixed point:
    qs's bytes 0-31 give 5 runs of 32 weights, bytes 32-47 5 runs of 16, qh 4 runs of 4."""
    q = np.concatenate((_trits(b[:, :32], 5), _trits(b[:, 32:48], 5), _trits(b[:, 48:52], 4)), axis=1)
    return _fp16(b, 52) * (q.astype(np.int8) - np.int8(1)).astype(np.float32)


def _iq1(dl: np.ndarray, idx: np.ndarray, shift: np.ndarray) -> np.ndarray:
    """IQ1_S / IQ1_M: dl * (grid[idx] + delta), delta -0.125 where the shift bit is set, else 0.125; dl [n, s],
    idx and shift [n, 32] (8 weights each), s scales over the 32 grid rows in order -> fp32 [n, 256]."""
    n, s = dl.shape
    delta = np.where(shift == 0, np.float32(0.125), np.float32(-0.125))
    grid = lattice("IQ1_S")[0][idx] + delta[:, :, None]
    return (dl[:, :, None, None] * grid.reshape(n, s, -1, 8)).reshape(n, 256)


def iq1_s(b: np.ndarray) -> np.ndarray:
    """{fp16 d, qs[32], qh[8] uint16}: an 11-bit grid index per 8 weights into iq1s's grid of -1/0/1 (a byte of qs,
    3 bits of qh); per 32 weights a uint16 of qh holds the 4 indices' high bits (from bit 0 up), a 3-bit scale (bits
    12-14) and a shift's sign (bit 15): (d * (2 * scale + 1)) * (grid + delta), delta +-0.125."""
    qh = np.ascontiguousarray(b[:, 34:50]).view(np.uint16)  # [n, 8]
    dl = _fp16(b, 0) * (2 * ((qh >> np.uint16(12)) & np.uint16(7)) + 1)  # uint16 times fp32, as gguf-py
    high = (qh[:, :, None] >> np.array([0, 3, 6, 9], dtype=np.uint16)) & np.uint16(7)
    idx = b[:, 2:34].astype(np.uint16) | (high.reshape(-1, 32) << np.uint16(8))
    return _iq1(dl, idx, np.repeat(qh >> np.uint16(15), 4, axis=1))


def iq1_m(b: np.ndarray) -> np.ndarray:
    """{qs[32], qh[16], scales[8]}: as iq1_s, a nibble of qh per 8 weights (the index's high 3 bits, the shift's sign
    bit 3), a 3-bit scale per 16 weights (fields of the 4 uint16 scales from bit 0 up), and fp16 d the top nibbles of
    those uint16s (lowest bits first)."""
    top = b[:, 49:56:2]  # the uint16 scales' high bytes
    d = ((top[:, 0::2] >> np.uint8(4)) | (top[:, 1::2] & np.uint8(0xF0))).copy().view(np.float16).astype(np.float32)
    sc = np.ascontiguousarray(b[:, 48:56]).view(np.uint16)[:, :, None] >> np.array([0, 3, 6, 9], dtype=np.uint16)
    dl = d * (2 * (sc.reshape(-1, 16) & np.uint16(7)) + 1)  # uint16 times fp32, as gguf-py
    qh = _bits(b[:, 32:48], 4)
    idx = b[:, :32].astype(np.uint16) | ((qh & np.uint8(7)).astype(np.uint16) << np.uint16(8))
    return _iq1(dl, idx, qh & np.uint8(8))


@functools.cache
def fp4_tables() -> dict[str, np.ndarray]:
    """MXFP4's and NVFP4's lookup tables, fp32 from gguf-py: "e2m1" the 16 levels (doubled, ggml's kvalues_mxfp4),
    "e8m0" and "ue4m3" the scale of each of the 256 bytes (halved, for the doubled levels)."""
    from gguf.quants import MXFP4, NVFP4

    every = np.arange(256, dtype=np.uint8)
    return {"e2m1": np.array(MXFP4.kvalues, dtype=np.float32), "e8m0": MXFP4.e8m0_to_fp32_half(every),
            "ue4m3": NVFP4.ue4m3_to_fp32(every).astype(np.float32)}


def mxfp4(b: np.ndarray) -> np.ndarray:
    """{e8m0 e, qs[16]}: 2^(e - 128) * levels[q], q the nibbles (low ones are weights 0..15)."""
    t = fp4_tables()
    return t["e8m0"][b[:, :1]] * t["e2m1"][_nibbles(b[:, 1:17], 1).reshape(-1, 32)]


def nvfp4(b: np.ndarray) -> np.ndarray:
    """{ue4m3 d[4], qs[32]}: sub-block s of 16 is d[s] * levels[q], q the nibbles of its 8 bytes (low ones first)."""
    t, n = fp4_tables(), b.shape[0]
    return (t["ue4m3"][b[:, :4]][:, :, None] * t["e2m1"][_nibbles(b[:, 4:36], 4)].reshape(n, 4, 16)).reshape(n, 64)

"""Torch dequantizers of the GGUF block types kept as blocks, one function per type, named as in the table.

Each takes uint8 blocks [M, nb, block_bytes] on any device and returns fp32 [M, nb, block_weights] there,
computed in gguf-py's order of fp32 operations (gguf.quants), so the result is bit for bit gguf-py's and
offload.formats.dequant_np's. Used on the GPU (runtime/device_quant.py) and, on the CPU, by the dequantizing
matmul of the types without a fused CPU kernel (kernels.linear). Integers are widened to int32/int64 before
shifts (torch's uint16/uint32 lack them).
"""

from __future__ import annotations

import functools

import torch


def _half(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 field at byte `at` of each block [M, nb, bytes], as fp32 [M, nb, 1]."""
    return blocks[..., at: at + 2].contiguous().view(torch.float16).float()


def _unpack(b: torch.Tensor, groups: int, bits: int) -> torch.Tensor:
    """Bit fields of bytes [M, nb, groups * n] -> uint8 [M, nb, groups * (8 // bits) * n]: within each group
    of n bytes, the n lowest fields first, then the next bits up (ggml's order for nibbles and high bits)."""
    m, nb, _ = b.shape
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=b.device)[:, None]  # [8 / bits, 1]
    fields = (b.reshape(m, nb, groups, 1, -1) >> shifts) & ((1 << bits) - 1)  # [M, nb, groups, 8 / bits, n]
    return fields.reshape(m, nb, -1)


def _bits(b: torch.Tensor, bits: int) -> torch.Tensor:
    """Bytes [M, nb, n] -> uint8 [M, nb, n * 8 // bits]: each byte's fields of `bits`, lowest first."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=b.device)
    return ((b[..., None] >> shifts) & ((1 << bits) - 1)).reshape(*b.shape[:-1], -1)


def _words(b: torch.Tensor, n_bytes: int) -> torch.Tensor:
    """Little-endian unsigned words of n_bytes from bytes [M, nb, n * n_bytes] -> int64 [M, nb, n]."""
    parts = b.reshape(*b.shape[:-1], -1, n_bytes).long()
    return sum(parts[..., i] << (8 * i) for i in range(n_bytes))


def q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """{fp16 d, fp16 m, qs[16]} [M, nb, 20] -> fp32 [M, nb, 32]: d * q + m."""
    q = _unpack(blocks[..., 4:], 1, 4).float()
    return q.mul_(_half(blocks, 0)).add_(_half(blocks, 2))


def _with_fifth_bit(nibble_bytes: torch.Tensor, qh: torch.Tensor) -> torch.Tensor:
    """Q5_0 / Q5_1: the 32 5-bit quants of 16 nibble bytes and 4 bytes qh (bit i the fifth bit of weight i)."""
    return (_unpack(nibble_bytes, 1, 4) | (_bits(qh, 1) << 4)).float()


def q5_0(blocks: torch.Tensor) -> torch.Tensor:
    """{fp16 d, qh[4], qs[16]} [M, nb, 22] -> fp32 [M, nb, 32]: d * (q - 16)."""
    return _with_fifth_bit(blocks[..., 6:22], blocks[..., 2:6]).sub_(16).mul_(_half(blocks, 0))


def q5_1(blocks: torch.Tensor) -> torch.Tensor:
    """{fp16 d, fp16 m, qh[4], qs[16]} [M, nb, 24] -> fp32 [M, nb, 32]: d * q + m."""
    return _with_fifth_bit(blocks[..., 8:24], blocks[..., 4:8]).mul_(_half(blocks, 0)).add_(_half(blocks, 2))


def _k_scales(blocks: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: the 8 sub-block scales d*sc and offsets dmin*m, fp32 [M, nb, 8, 1], from 12 bytes of 6-bit
    fields (gguf.quants.Q4_K.get_scale_min): bytes 0-3 and 4-7 hold sc and m of sub-blocks 0-3 in their low 6
    bits, bytes 8-11 the low 4 bits of sub-blocks 4-7, whose top 2 bits are the top bits of bytes 0-7."""
    m, nb, _ = blocks.shape
    s = blocks[..., 4:16].reshape(m, nb, 3, 4)
    lo, mins, hi = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = torch.cat((lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)), dim=-1).float()  # [M, nb, 8]
    mn = torch.cat((mins & 0x3F, (hi >> 4) | ((mins >> 2) & 0x30)), dim=-1).float()
    return (d * sc)[..., None], (dmin * mn)[..., None]


def q2_k(blocks: torch.Tensor) -> torch.Tensor:
    """{scales[16], qs[64], fp16 d, fp16 dmin} [M, nb, 84] -> fp32 [M, nb, 256]: sub-block s of 16 is
    (d * sc) * q - dmin * m, sc and m the nibbles of scales[s], q 2 bits (each 32 bytes hold 4 runs of 32)."""
    m, nb, _ = blocks.shape
    scale = (_half(blocks, 80) * (blocks[..., :16] & 15).float())[..., None]  # [M, nb, 16, 1]
    offset = (_half(blocks, 82) * (blocks[..., :16] >> 4).float())[..., None]
    q = _unpack(blocks[..., 16:80], 2, 2).float().reshape(m, nb, 16, 16)
    return q.mul_(scale).sub_(offset).reshape(m, nb, 256)


def q3_k(blocks: torch.Tensor) -> torch.Tensor:
    """{hmask[32], qs[64], scales[12], fp16 d} [M, nb, 110] -> fp32 [M, nb, 256]: sub-block s of 16 is
    (d * (sc - 32)) * (q - 4 * (1 - h)), q 2 bits as in q2_k, h its bit of hmask, sc 6 bits."""
    m, nb, _ = blocks.shape
    low = _unpack(blocks[..., 96:104], 1, 4)  # [M, nb, 16]
    high = _unpack(blocks[..., 104:108], 1, 2)
    sc = (low | (high << 4)).float().sub_(32)
    scale = (_half(blocks, 108) * sc)[..., None]  # [M, nb, 16, 1]
    ql = _unpack(blocks[..., 32:96], 2, 2)
    h = _unpack(blocks[..., :32], 1, 1)  # [M, nb, 256]: bit j of the 32 bytes is run j
    q = ql.float() - ((h ^ 1) << 2).float()
    return q.reshape(m, nb, 16, 16).mul_(scale).reshape(m, nb, 256)


def q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """{fp16 d, fp16 dmin, scales[12], qs[128]} [M, nb, 144] -> fp32 [M, nb, 256]: sub-block s of 32 is
    (d*sc[s]) * q - dmin*m[s]."""
    m, nb, _ = blocks.shape
    scale, offset = _k_scales(blocks, _half(blocks, 0), _half(blocks, 2))
    q = _unpack(blocks[..., 16:], 4, 4).float().reshape(m, nb, 8, 32)
    return q.mul_(scale).sub_(offset).reshape(m, nb, 256)


def q5_k(blocks: torch.Tensor) -> torch.Tensor:
    """{fp16 d, fp16 dmin, scales[12], qh[32], qs[128]} [M, nb, 176] -> fp32 [M, nb, 256]: as Q4_K, with bit s
    of qh[i] the fifth bit of element i of sub-block s."""
    m, nb, _ = blocks.shape
    scale, offset = _k_scales(blocks, _half(blocks, 0), _half(blocks, 2))
    q = _unpack(blocks[..., 48:], 4, 4) | (_unpack(blocks[..., 16:48], 1, 1) << 4)
    return q.float().reshape(m, nb, 8, 32).mul_(scale).sub_(offset).reshape(m, nb, 256)


def q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """{ql[128], qh[64], int8 scales[16], fp16 d} [M, nb, 210] -> fp32 [M, nb, 256]: sub-block s of 16 is
    (d*scales[s]) * (q - 32), q's low 4 bits from ql and top 2 from qh, each in two halves of 128."""
    m, nb, _ = blocks.shape
    scale = (_half(blocks, 208) * blocks[..., 192:208].view(torch.int8).float())[..., None]  # [M, nb, 16, 1]
    q = (_unpack(blocks[..., :128], 2, 4) | (_unpack(blocks[..., 128:192], 2, 2) << 4)).to(torch.int8) - 32
    return q.float().reshape(m, nb, 16, 16).mul_(scale).reshape(m, nb, 256)


@functools.cache
def _constant(values: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """values as a tensor on device, made once per device: a tensor made from Python data on a GPU is a
    host-to-device copy the host waits for, which per call would stall every dequantization. Read only."""
    return torch.tensor(values, dtype=dtype, device=device)


@functools.cache
def _table(kind: str, name: str, device: torch.device) -> torch.Tensor:
    """A lookup table from offload.formats.dequant_np (gguf-py's values) on device: IQ4 levels as fp32, a
    lattice's grid fp32 [entries, width], the sign masks uint8 [128], or an fp4 table (e2m1, e8m0, ue4m3) fp32."""
    from offload.formats import dequant_np

    if kind == "values":
        table = dequant_np.iq4_values().astype("float32")
    elif kind in ("grid", "signs"):
        grid, signs = dequant_np.lattice(name)
        table = grid if kind == "grid" else signs
    else:
        table = dequant_np.fp4_tables()[kind]
    return torch.from_numpy(table.copy()).to(device)


def iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    """{fp16 d, qs[16]} [M, nb, 18] -> fp32 [M, nb, 32]: d * values[q]."""
    values = _table("values", "", blocks.device)
    return values[_unpack(blocks[..., 2:18], 1, 4).long()].mul_(_half(blocks, 0))


def iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    """{fp16 d, scales_h[2], scales_l[4], qs[128]} [M, nb, 136] -> fp32 [M, nb, 256]: sub-block s of 32 is
    (d * (sc - 32)) * values[q], sc's low 4 bits a nibble of scales_l, its high 2 bits 2s of scales_h."""
    m, nb, _ = blocks.shape
    high = _bits(blocks[..., 2:4], 2)  # [M, nb, 8]: the uint16's 2-bit fields, lowest first
    sc = (_bits(blocks[..., 4:8], 4) | (high << 4)).float().sub_(32)
    scale = (_half(blocks, 0) * sc)[..., None]  # [M, nb, 8, 1]
    q = _unpack(blocks[..., 8:136], 8, 4).long()  # runs of 16: sub-block s is runs 2s (low nibbles), 2s + 1
    values = _table("values", "", blocks.device)
    return values[q].reshape(m, nb, 8, 32).mul_(scale).reshape(m, nb, 256)


def _signs(bits: torch.Tensor) -> torch.Tensor:
    """Sign bytes [...] -> +1 / -1 fp32 [..., 8], bit i the sign of weight i."""
    return 1.0 - 2.0 * _bits(bits[..., None], 1).float()


def _packed_signs(words: torch.Tensor, device: torch.device) -> torch.Tensor:
    """IQ2_XXS / IQ3_XXS: words int64 [...] of 4 sign indices of 7 bits (into gguf-py's ksigns) -> [..., 4, 8]."""
    idx = (words[..., None] >> _constant((0, 7, 14, 21), torch.int64, device)) & 0x7F
    return _signs(_table("signs", "IQ2_XXS", device)[idx])


def _scaled(db: torch.Tensor, grid: torch.Tensor, signs: torch.Tensor, m: int, nb: int) -> torch.Tensor:
    """(db * grid) * signs over groups: db [M, nb, g], grid and signs [M, nb, g, ...] -> fp32 [M, nb, 256]."""
    db = db.reshape(*db.shape, *([1] * (grid.dim() - db.dim())))
    return (db * grid).mul_(signs).reshape(m, nb, 256)


def iq2_xxs(blocks: torch.Tensor) -> torch.Tensor:
    """{fp16 d, qs[64]} [M, nb, 66] -> fp32 [M, nb, 256]: 8 groups of 32, each two uint32: 4 grid indices
    (bytes), then 4 sign indices and a 4-bit scale (top bits): (d * (0.5 + scale) * 0.25) * grid * signs."""
    m, nb, _ = blocks.shape
    qs = blocks[..., 2:66].reshape(m, nb, 8, 8)
    words = _words(qs[..., 4:], 4)[..., 0]  # [M, nb, 8]
    db = _half(blocks, 0) * (0.5 + (words >> 28).float()) * 0.25
    grid = _table("grid", "IQ2_XXS", blocks.device)[qs[..., :4].long()]  # [M, nb, 8, 4, 8]
    return _scaled(db, grid, _packed_signs(words, blocks.device), m, nb)


def iq2_xs(blocks: torch.Tensor) -> torch.Tensor:
    """{fp16 d, qs[32] uint16, scales[8]} [M, nb, 74] -> fp32 [M, nb, 256]: each uint16 a 9-bit grid index and a
    7-bit sign index, a 4-bit scale per 16 weights: (d * (0.5 + scale) * 0.25) * grid * signs."""
    m, nb, _ = blocks.shape
    qs = _words(blocks[..., 2:66], 2)  # [M, nb, 32]
    db = _half(blocks, 0) * (0.5 + _bits(blocks[..., 66:74], 4).float()) * 0.25  # [M, nb, 16]
    grid = _table("grid", "IQ2_XS", blocks.device)[qs & 511]
    signs = _signs(_table("signs", "IQ2_XS", blocks.device)[qs >> 9])
    return _scaled(db, grid.reshape(m, nb, 16, 2, 8), signs.reshape(m, nb, 16, 2, 8), m, nb)


def iq2_s(blocks: torch.Tensor) -> torch.Tensor:
    """{fp16 d, qs[32], signs[32], qh[8], scales[8]} [M, nb, 82] -> fp32 [M, nb, 256]: a 10-bit grid index per 8
    weights (a byte of qs, 2 bits of qh), a sign bit per weight, a 4-bit scale per 16 weights."""
    m, nb, _ = blocks.shape
    idx = blocks[..., 2:34].long() | (_bits(blocks[..., 66:74], 2).long() << 8)
    db = _half(blocks, 0) * (0.5 + _bits(blocks[..., 74:82], 4).float()) * 0.25
    grid = _table("grid", "IQ2_S", blocks.device)[idx].reshape(m, nb, 16, 2, 8)
    return _scaled(db, grid, _signs(blocks[..., 34:66]).reshape(m, nb, 16, 2, 8), m, nb)


def iq3_xxs(blocks: torch.Tensor) -> torch.Tensor:
    """{fp16 d, qs[64], signs_scales[32]} [M, nb, 98] -> fp32 [M, nb, 256]: a grid index per 4 weights, 8 groups
    of 32 each with a uint32 of 4 sign indices and a 4-bit scale: (d * (0.5 + scale) * 0.5) * grid * signs."""
    m, nb, _ = blocks.shape
    words = _words(blocks[..., 66:98], 4)  # [M, nb, 8]
    db = _half(blocks, 0) * (0.5 + (words >> 28).float()) * 0.5
    grid = _table("grid", "IQ3_XXS", blocks.device)[blocks[..., 2:66].long()].reshape(m, nb, 8, 4, 8)
    return _scaled(db, grid, _packed_signs(words, blocks.device), m, nb)


def iq3_s(blocks: torch.Tensor) -> torch.Tensor:
    """{fp16 d, qs[64], qh[8], signs[32], scales[4]} [M, nb, 110] -> fp32 [M, nb, 256]: a 9-bit grid index per 4
    weights, a sign bit per weight, a 4-bit scale per 32 weights: (d * (1 + 2 * scale)) * grid * signs."""
    m, nb, _ = blocks.shape
    idx = blocks[..., 2:66].long() | (_bits(blocks[..., 66:74], 1).long() << 8)
    db = _half(blocks, 0) * (1 + 2 * _bits(blocks[..., 106:110], 4).float())
    grid = _table("grid", "IQ3_S", blocks.device)[idx].reshape(m, nb, 8, 4, 8)
    return _scaled(db, grid, _signs(blocks[..., 74:106]).reshape(m, nb, 8, 4, 8), m, nb)


def tq2_0(blocks: torch.Tensor) -> torch.Tensor:
    """{qs[64], fp16 d} [M, nb, 66] -> fp32 [M, nb, 256]: ternary weights d * (q - 1), q 2 bits as in q2_k."""
    return _unpack(blocks[..., :64], 2, 2).float().sub_(1).mul_(_half(blocks, 64))


def _trits(b: torch.Tensor, k: int) -> torch.Tensor:
    """TQ1_0: bytes [M, nb, n] -> [M, nb, k * n] trits 0..2, run j holding trit j of each byte
    ((x * 3^j mod 256) * 3 >> 8)."""
    pow3 = _constant((1, 3, 9, 27, 81)[:k], torch.int32, b.device)[:, None]
    return ((((b[..., None, :].int() * pow3) & 255) * 3) >> 8).flatten(-2)


def tq1_0(blocks: torch.Tensor) -> torch.Tensor:
    """{qs[48], qh[4], fp16 d} [M, nb, 54] -> fp32 [M, nb, 256]: ternary weights d * (t - 1), 5 trits a byte of qs
    (runs of 32, then of 16), 4 a byte of qh (runs of 4)."""
    t = (_trits(blocks[..., :32], 5), _trits(blocks[..., 32:48], 5), _trits(blocks[..., 48:52], 4))
    return torch.cat(t, dim=-1).float().sub_(1).mul_(_half(blocks, 52))


def _iq1(dl: torch.Tensor, idx: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """IQ1_S / IQ1_M: dl * (grid[idx] + delta), delta -0.125 where shift is 1, else 0.125; dl [M, nb, s], idx and
    shift [M, nb, 32] (8 weights each), s scales over the 32 grid rows in order -> fp32 [M, nb, 256]."""
    m, nb, s = dl.shape
    grid = _table("grid", "IQ1_S", dl.device)[idx] + (0.125 - 0.25 * shift.float())[..., None]
    return (dl[..., None, None] * grid.reshape(m, nb, s, -1, 8)).reshape(m, nb, 256)


def iq1_s(blocks: torch.Tensor) -> torch.Tensor:
    """{fp16 d, qs[32], qh[8] uint16} [M, nb, 50] -> fp32 [M, nb, 256]: an 11-bit index per 8 weights into iq1s's
    grid (a byte of qs, 3 bits of qh), per 32 weights a uint16 of qh with the indices' high bits, a 3-bit scale (bits
    12-14) and a shift's sign (bit 15): (d * (2 * scale + 1)) * (grid + delta), delta +-0.125."""
    m, nb, _ = blocks.shape
    qh = _words(blocks[..., 34:50], 2)  # [M, nb, 8]
    dl = _half(blocks, 0) * (2 * ((qh >> 12) & 7) + 1).float()
    high = (qh[..., None] >> _constant((0, 3, 6, 9), torch.int64, blocks.device)) & 7
    idx = blocks[..., 2:34].long() | (high.reshape(m, nb, 32) << 8)
    return _iq1(dl, idx, (qh >> 15).repeat_interleave(4, dim=-1))


def iq1_m(blocks: torch.Tensor) -> torch.Tensor:
    """{qs[32], qh[16], scales[8]} [M, nb, 56] -> fp32 [M, nb, 256]: as iq1_s, a nibble of qh per 8 weights (high
    index bits, shift sign bit 3), a 3-bit scale per 16 weights, fp16 d the top nibbles of the 4 uint16 scales."""
    m, nb, _ = blocks.shape
    top = blocks[..., 49:56:2]  # the uint16 scales' high bytes
    d = ((top[..., 0::2] >> 4) | (top[..., 1::2] & 0xF0)).contiguous().view(torch.float16).float()
    sc = _words(blocks[..., 48:56], 2)[..., None] >> _constant((0, 3, 6, 9), torch.int64, blocks.device)
    dl = d * (2 * (sc.reshape(m, nb, 16) & 7) + 1).float()
    qh = _bits(blocks[..., 32:48], 4).long()
    return _iq1(dl, blocks[..., :32].long() | ((qh & 7) << 8), qh >> 3)


def mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    """{e8m0 e, qs[16]} [M, nb, 17] -> fp32 [M, nb, 32]: 2^(e - 128) * levels[q] (e2m1's, doubled)."""
    levels = _table("e2m1", "", blocks.device)[_unpack(blocks[..., 1:17], 1, 4).long()]
    return levels.mul_(_table("e8m0", "", blocks.device)[blocks[..., :1].long()])


def nvfp4(blocks: torch.Tensor) -> torch.Tensor:
    """{ue4m3 d[4], qs[32]} [M, nb, 36] -> fp32 [M, nb, 64]: sub-block s of 16 is d[s] * levels[q], q the nibbles of
    its 8 bytes (low ones first)."""
    m, nb, _ = blocks.shape
    levels = _table("e2m1", "", blocks.device)[_unpack(blocks[..., 4:36], 4, 4).long()].reshape(m, nb, 4, 16)
    return levels.mul_(_table("ue4m3", "", blocks.device)[blocks[..., :4].long()][..., None]).reshape(m, nb, 64)

"""Decode attention over the KV pool in place, in Triton: split-K (flash-decoding) through a block table.

Two launches per call (semantics: offload.kernels.attention):

- split: grid (sequence, KV head, key split). A program loads the G query heads x S queries that share its KV
  head as one [G*S, Dh] tile, walks its share of the sequence's keys in tiles of BLOCK_N, each key's pool slot
  computed from the table (slots[b, j // block_size] + j % block_size: no gather, no repeated K/V), and keeps
  an online softmax in fp32; it writes its partial (max, sum, p.V) to small fp32 buffers.
- combine: grid (sequence, KV head). Merges the splits' partials, adds the sink logit to the denominator, divides
  and stores in the output's dtype.

Scores are q . k in fp32: 16-bit q and K multiply exactly on the tensor cores and sum in fp32; other operands in
IEEE fp32 (not tf32). p . V takes fp32 p against 16-bit V as 2-3 16-bit pieces of p on the tensor cores (_add_pv:
p to 2^-22 or better, where p rounded to bf16 once was 15x over the tests' bound), fp32 V in IEEE fp32; so the
accumulator before the final cast is within fp32 rounding of a float64 softmax whatever the cache's dtype.
Nothing of the history's size is allocated: the partials hold [B, Hkv, splits, G*S, Dh + 2] fp32
(partials_bytes). The module imports without Triton (TRITON_AVAILABLE False).
"""

from __future__ import annotations

import functools

import torch

from offload.attention_sizes import DECODE_SPLIT_MIN_KEYS as MIN_SPLIT_KEYS
from offload.attention_sizes import SIZING_SMS as DEFAULT_SM_COUNT
from offload.attention_sizes import decode_partials_bytes as partials_bytes
from offload.attention_sizes import decode_splits as split_count
from offload.kernels.triton_dequant import _LAUNCH, TRITON_AVAILABLE, _jit, tl, triton

HEAD_DIMS = (16, 32, 64, 128, 256)  # powers of two a [rows, Dh] tile and tl.dot take
# A program's fp32 accumulator [rows, head_dim] at most 8192 values; rows are the query heads sharing a KV head x
# the queries of a sequence, padded to a power of two from 16. Compiled for sm_90 at 8 warps with window, softcap
# and tree (bf16): [32, 256] and [128, 64] stayed in registers, [64, 128] spilled 240 bytes a thread, [128, 128] 488
MAX_ACC_VALUES = 8192
LOG2E = 1.4426950408889634
# The split kernel at 8 warps: compiled for sm_90 (cuobjdump), its bf16/fp16 variants with window, softcap and tree
# spilled 48-152 bytes a thread at 4 warps and nothing at 8 (107-228 registers); speed not yet measured on a GPU
_SPLIT_LAUNCH = {**_LAUNCH, "num_warps": 8}
LOG2E_C = tl.constexpr(LOG2E) if TRITON_AVAILABLE else LOG2E  # a global a Triton kernel may read
P_SCALE = 2.0**15  # p <= 1 scaled for 16-bit pieces: fp16's largest power of two below its 65504
P_SCALE_C = tl.constexpr(P_SCALE) if TRITON_AVAILABLE else P_SCALE
P_PIECES = {torch.float32: 0, torch.float16: 2, torch.bfloat16: 3}  # 16-bit pieces of p per cache dtype


def unsupported(head_dim: int, rows: int) -> str | None:
    """Why the kernel cannot take head_dim and rows (query heads per KV head x queries), a few words, or None."""
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim}"
    if padded_rows(rows) * head_dim > MAX_ACC_VALUES:
        return f"{rows} query rows per KV head at head_dim {head_dim}"
    return None


def padded_rows(rows: int) -> int:
    """A program's query rows: a power of two, at least the 16 tl.dot takes."""
    return max(16, 1 << (rows - 1).bit_length())


@functools.lru_cache(maxsize=8)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device, DEFAULT_SM_COUNT for any other."""
    if device.type == "cuda":  # Triton's driver knows the device (the CUDA backend is torch's only door to it)
        props = triton.runtime.driver.active.utils.get_device_properties(device.index or 0)
        return int(props["multiprocessor_count"])
    return DEFAULT_SM_COUNT


@_jit
def _tanh(x):
    """tanh in fp32 from exp2 (1 at +inf, -1 at -inf)."""
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * LOG2E_C)) + 1.0)


@_jit
def _visible(j, t, i, row_ok, in_split, L, S, window, tree_ptr,
             WINDOW: tl.constexpr, TREE: tl.constexpr):
    """bool [BR, BN]: which keys j [BN] the queries i [BR] at positions t [BR] see (module attention's rules)."""
    vis = row_ok[:, None] & in_split[None, :]
    if TREE:  # the S newest keys through the query's row of the mask, older keys all
        newest = j >= L - S
        allowed = tl.load(tree_ptr + i[:, None] * S + (j - (L - S))[None, :], mask=vis & newest[None, :], other=0)
        vis = vis & ((j < L - S)[None, :] | (allowed != 0))
    else:
        vis = vis & (j[None, :] <= t[:, None])
    if WINDOW:
        vis = vis & ((t[:, None] - j[None, :]) < window)
    return vis


@_jit
def _add_pv(acc, p, v, PIECES: tl.constexpr):
    """acc + p @ v: fp32 p [BR, BN] against V [BN, Dh]. 16-bit V multiplies PIECES 16-bit pieces of P_SCALE * p
    on the tensor cores (each piece the rounding residue of the ones before: p to 2^-26 in bf16 x 3, 2^-22 in
    fp16 x 2; the scale keeps fp16 pieces of small p out of subnormals), accumulating P_SCALE * p . V; fp32 V
    multiplies in IEEE fp32 (PIECES 0)."""
    if PIECES == 0:
        return acc + tl.dot(p, v, input_precision="ieee")
    rest = p * P_SCALE_C
    for _ in tl.static_range(PIECES):
        piece = rest.to(v.dtype)
        acc = tl.dot(piece, v, acc)
        rest = rest - piece.to(tl.float32)
    return acc


@_jit
def _decode_split(q_ptr, k_ptr, v_ptr, slots_ptr, lengths_ptr, tree_ptr, m_ptr, l_ptr, acc_ptr,
                  sq_b, sq_s, sq_h, sk_n, sk_h, sv_n, sv_h, ss_b, ss_m,
                  scale, softcap, window, S, G, block_size,
                  D: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr, WINDOW: tl.constexpr,
                  SOFTCAP: tl.constexpr, TREE: tl.constexpr, QK_NATIVE: tl.constexpr, PIECES: tl.constexpr):
    """One (sequence b, KV head, split): online softmax of its G*S query rows over its keys; partials out."""
    b, kvh, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n_splits = tl.num_programs(2)
    L = tl.load(lengths_ptr + b).to(tl.int32)
    r = tl.arange(0, BR)  # row r: query r // G of head kvh * G + r % G
    i, row_ok, d = r // G, r < G * S, tl.arange(0, D)
    t = L - S + i  # each query's position
    q = tl.load(q_ptr + b * sq_b + i[:, None] * sq_s + (kvh * G + r % G)[:, None] * sq_h + d[None, :],
                mask=row_ok[:, None], other=0.0)
    lo = 0
    if WINDOW:  # keys before the earliest query's window are seen by none
        lo = tl.maximum(L - S + 1 - window, 0)
    per = tl.cdiv(tl.cdiv(L - lo, n_splits), BN) * BN
    start = lo + sp * per
    end = tl.minimum(start + per, L)
    m_i = tl.full([BR], float("-inf"), tl.float32)
    l_i = tl.zeros([BR], tl.float32)
    acc = tl.zeros([BR, D], tl.float32)
    slots_b = slots_ptr + b.to(tl.int64) * ss_b
    for n0 in range(start, end, BN):
        j = n0 + tl.arange(0, BN)
        in_split = j < end
        slot = tl.load(slots_b + (j // block_size) * ss_m, mask=in_split, other=0).to(tl.int64) + j % block_size
        k = tl.load(k_ptr + slot[:, None] * sk_n + kvh * sk_h + d[None, :], mask=in_split[:, None], other=0.0)
        if QK_NATIVE:  # 16-bit q and K: exact products, fp32 sums
            s = tl.dot(q, tl.trans(k)) * scale
        else:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
        if SOFTCAP:
            s = softcap * _tanh(s / softcap)
        vis = _visible(j, t, i, row_ok, in_split, L, S, window, tree_ptr + b * S * S, WINDOW, TREE)
        s = tl.where(vis, s * LOG2E_C, float("-inf"))  # log2 units: exp2 below
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw no key yet: exp2(-inf) = 0
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        v = tl.load(v_ptr + slot[:, None] * sv_n + kvh * sv_h + d[None, :], mask=in_split[:, None], other=0.0)
        acc = _add_pv(acc * alpha[:, None], p, v, PIECES)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    row = ((b * tl.num_programs(1) + kvh) * n_splits + sp) * (G * S) + r
    tl.store(m_ptr + row, m_i, mask=row_ok)
    tl.store(l_ptr + row, l_i, mask=row_ok)
    if PIECES:
        acc = acc * (1.0 / P_SCALE_C)
    tl.store(acc_ptr + row[:, None] * D + d[None, :], acc, mask=row_ok[:, None])


@_jit
def _decode_combine(m_ptr, l_ptr, acc_ptr, sinks_ptr, out_ptr, so_b, so_s, so_h, S, G, n_splits,
                    D: tl.constexpr, BR: tl.constexpr, SINKS: tl.constexpr):
    """One (sequence b, KV head): the splits' partials merged, the sink added to the denominator, output stored."""
    b, kvh = tl.program_id(0), tl.program_id(1)
    r = tl.arange(0, BR)
    i, row_ok, d = r // G, r < G * S, tl.arange(0, D)
    m = tl.full([BR], float("-inf"), tl.float32)
    total = tl.zeros([BR], tl.float32)
    acc = tl.zeros([BR, D], tl.float32)
    first = (b * tl.num_programs(1) + kvh) * n_splits
    for sp in range(0, n_splits):
        row = (first + sp) * (G * S) + r
        m_s = tl.load(m_ptr + row, mask=row_ok, other=float("-inf"))
        m_new = tl.maximum(m, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha, beta = tl.exp2(m - m_safe), tl.exp2(m_s - m_safe)
        total = total * alpha + tl.load(l_ptr + row, mask=row_ok, other=0.0) * beta
        acc_s = tl.load(acc_ptr + row[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + acc_s * beta[:, None]
        m = m_new
    h = kvh * G + r % G
    if SINKS:  # one more logit in the denominator, none in the values
        sink = tl.load(sinks_ptr + h, mask=row_ok, other=float("-inf")).to(tl.float32) * LOG2E_C
        m_new = tl.maximum(m, sink)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        total = total * alpha + tl.exp2(sink - m_safe)
        acc = acc * alpha[:, None]
    out = acc / tl.where(row_ok, total, 1.0)[:, None]
    tl.store(out_ptr + b * so_b + i[:, None] * so_s + h[:, None] * so_h + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def paged_attention_triton(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table, *, scale: float,
                           window: int | None, softcap: float | None, sinks: torch.Tensor | None,
                           tree_mask: torch.Tensor | None, out_fp32: bool, max_length: int) -> torch.Tensor:
    """[B, S, H, Dh] attention of q over the pool through table (checked by the caller); max_length bounds the
    splits. Allocates the output and the partials only."""
    B, S, H, D = q.shape
    n_kv_heads = k_pool.shape[1]
    G = H // n_kv_heads
    rows = G * S
    keys = max_length if window is None else min(max_length, window + S - 1)
    n_splits = split_count(B * n_kv_heads, keys, sm_count(q.device))
    f32 = torch.float32
    m = torch.empty((2, B, n_kv_heads, n_splits, rows), dtype=f32, device=q.device)  # max and sum
    acc = torch.empty((B, n_kv_heads, n_splits, rows, D), dtype=f32, device=q.device)
    out = torch.empty(q.shape, dtype=f32 if out_fp32 else q.dtype, device=q.device)
    block_rows = padded_rows(rows)
    block_keys = 32 if D > 128 else 64
    tree = q if tree_mask is None else tree_mask.contiguous().view(torch.uint8)  # a pointer never read if None
    slots, lengths = table.slots, table.lengths.contiguous()
    _decode_split[(B, n_kv_heads, n_splits)](
        q, k_pool, v_pool, slots, lengths, tree, m[0], m[1], acc,
        q.stride(0), q.stride(1), q.stride(2), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0),
        v_pool.stride(1), slots.stride(0), slots.stride(1),
        float(scale), float(softcap or 0.0), int(window or 0), S, G, int(table.block_size),
        D=D, BR=block_rows, BN=block_keys, WINDOW=window is not None, SOFTCAP=softcap is not None,
        TREE=tree_mask is not None, QK_NATIVE=q.dtype == k_pool.dtype and q.dtype != f32,
        PIECES=P_PIECES[v_pool.dtype], **_SPLIT_LAUNCH)
    _decode_combine[(B, n_kv_heads)](
        m[0], m[1], acc, q if sinks is None else sinks, out, out.stride(0), out.stride(1), out.stride(2),
        S, G, n_splits, D=D, BR=block_rows, SINKS=sinks is not None, **_LAUNCH)
    return out


__all__ = ["DEFAULT_SM_COUNT", "HEAD_DIMS", "MAX_ACC_VALUES", "MIN_SPLIT_KEYS", "TRITON_AVAILABLE", "padded_rows",
           "paged_attention_triton", "partials_bytes", "sm_count", "split_count", "unsupported"]

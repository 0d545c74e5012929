"""Attention of a step's new queries over a layer's KV pool in place, each sequence's keys found through a block table.

The KV layout (one layer): k_pool, v_pool [N_slots, n_kv_heads, head_dim] (fp32, bf16 or fp16). Key j of sequence b
lies at slot slots[b, j // block_size] + j % block_size (a KVTable). A contiguous extent is a table of one run; a
vLLM-style paged pool has slots[b, j] = block_id * block_size.

Semantics shared by every implementation here (attention_ref, paged_attention_torch, the Triton kernel):

- q [B, S, H, Dh]: S new queries per sequence (S = 1 decode; S > 1 a speculative verify group or a short chunk).
  Query i of sequence b sits at position t = lengths[b] - S + i; its own key and all earlier ones are in the pool
  (bottom-right aligned causal).
- GQA: H = G * n_kv_heads; query head h reads KV head h // G.
- scale multiplies q . k; softcap (Gemma 2) maps scores to softcap * tanh(scores / softcap) after scale.
- window (Mistral / Gemma 2 sliding window): the key at position p is visible to the query at t iff p <= t and
  t - p < window.
- sinks [H] (gpt-oss): one more logit per head in the softmax's denominator, with no value.
- tree_mask [B, S, S] bool (speculative tree verify): which of the S newest keys each query sees, in place of
  causality among them; older keys are always visible. The window applies to every key.
- Output [B, S, H, Dh] in q's dtype (fp32 with out_fp32=True: the accumulator before the final cast); softmax and
  p . V accumulate in fp32.

paged_attention is the door: the Triton split-K kernel (offload.kernels.triton_attention) on CUDA tensors,
paged_attention_torch elsewhere; PATH_COUNTS records which ran.
"""

from __future__ import annotations

import collections
import functools
import importlib.util
import os
from dataclasses import dataclass

import torch

from offload.errors import KernelError

CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # of q and of the K/V pools
IMPLS = ("auto", "triton", "torch")
# calls per path since the last reset: "triton_decode", "torch_grouped", "torch_grouped (<why not Triton>)" where a
# CUDA call could not take the kernel
PATH_COUNTS: collections.Counter = collections.Counter()


@dataclass(frozen=True)
class KVTable:
    """Where each sequence's keys lie in a layer's pool: key j of sequence b is at pool slot
    slots[b, j // block_size] + j % block_size (keys within a block are consecutive slots)."""

    slots: torch.Tensor  # [B, M] int32 (int64 accepted), first pool slot of each block of keys
    lengths: torch.Tensor  # [B] int32, keys of each sequence (its new queries' keys included)
    block_size: int
    host_lengths: tuple[int, ...] | None = None  # lengths as the host knows them: no device read to loop or size


def contiguous_table(bases, lengths, block_size: int) -> KVTable:
    """The table of contiguous extents: sequence b's keys from slot bases[b] on, in blocks of block_size (reads
    max(lengths) on the host)."""
    lengths = torch.as_tensor(lengths, dtype=torch.int32)
    bases = torch.as_tensor(bases, dtype=torch.int32, device=lengths.device)
    n_blocks = max(1, -(-int(lengths.max()) // block_size))
    slots = bases[:, None] + block_size * torch.arange(n_blocks, dtype=torch.int32, device=lengths.device)
    return KVTable(slots=slots, lengths=lengths, block_size=block_size)


def key_slots(table: KVTable, b: int, n_keys: int) -> torch.Tensor:
    """int64 [n_keys]: the pool slots of sequence b's first n_keys keys."""
    j = torch.arange(n_keys, device=table.slots.device)
    return table.slots[b, j // table.block_size].long() + j % table.block_size


def attention_paths() -> dict[str, int]:
    """Calls per attention path since the last reset_attention_paths()."""
    return dict(PATH_COUNTS)


def reset_attention_paths() -> None:
    PATH_COUNTS.clear()


def attention_ref(q, k_pool, v_pool, table: KVTable, *, scale: float, window: int | None = None,
                  softcap: float | None = None, sinks: torch.Tensor | None = None,
                  tree_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Float64 [B, S, H, Dh]: the module's semantics one sequence, query and head at a time."""
    B, S, H, D = q.shape
    G = H // k_pool.shape[1]
    out = torch.zeros((B, S, H, D), dtype=torch.float64)
    for b in range(B):
        n_keys = int(table.lengths[b])
        slots = key_slots(table, b, n_keys).cpu()
        k, v = k_pool.cpu()[slots].double(), v_pool.cpu()[slots].double()  # [L, Hkv, Dh]
        p = torch.arange(n_keys)
        for i in range(S):
            t = n_keys - S + i
            seen = p <= t
            if tree_mask is not None:
                seen[n_keys - S:] = tree_mask[b, i].cpu()
            if window is not None:
                seen &= t - p < window
            for h in range(H):
                s = (k[:, h // G] @ q[b, i, h].cpu().double()) * scale
                if softcap is not None:
                    s = softcap * torch.tanh(s / softcap)
                logits = s[seen] if sinks is None else torch.cat((s[seen], sinks[h].cpu().double().view(1)))
                w = torch.softmax(logits, 0)[: int(seen.sum())]
                out[b, i, h] = w @ v[seen, h // G]
    return out


def paged_attention_torch(q, k_pool, v_pool, table: KVTable, *, scale: float, window: int | None = None,
                          softcap: float | None = None, sinks: torch.Tensor | None = None,
                          tree_mask: torch.Tensor | None = None, out_fp32: bool = False) -> torch.Tensor:
    """[B, S, H, Dh] in torch, a sequence at a time: its keys gathered once (never repeated per query head), the G
    query heads of a KV head folded into the query rows ([Hkv, G*S, Dh] against [Hkv, L, Dh]), fp32 throughout.
    Reads lengths on the host."""
    B, S, H, D = q.shape
    n_kv_heads = k_pool.shape[1]
    G = H // n_kv_heads
    out = torch.empty(q.shape, dtype=torch.float32 if out_fp32 else q.dtype, device=q.device)
    sink = None if sinks is None else sinks.float().view(n_kv_heads, G, 1, 1)
    for b, n_keys in enumerate(table.host_lengths or table.lengths.tolist()):
        if n_keys < S:
            raise KernelError(f"sequence {b} has {n_keys} keys in its KVTable, fewer than its {S} new queries; "
                              f"write each query's key into the pool before attention")
        lo = 0 if window is None else max(0, n_keys - S + 1 - window)  # keys before every query's window: unread
        slots = key_slots(table, b, n_keys)[lo:]
        k = k_pool.index_select(0, slots).float().transpose(0, 1)  # [Hkv, L, Dh]
        v = v_pool.index_select(0, slots).float().transpose(0, 1)
        qg = q[b].float().view(S, n_kv_heads, G, D).permute(1, 2, 0, 3).reshape(n_kv_heads, G * S, D)
        s = torch.bmm(qg, k.transpose(1, 2)).mul_(scale)  # [Hkv, G*S, L]
        if softcap is not None:
            s = s.div_(softcap).tanh_().mul_(softcap)
        seen = _visible(n_keys, S, window, None if tree_mask is None else tree_mask[b], q.device)[:, lo:]  # [S, L]
        s = s.view(n_kv_heads, G, S, n_keys - lo).masked_fill_(~seen, float("-inf"))
        o = torch.bmm(_softmax_with_sinks(s, sink).view(n_kv_heads, G * S, n_keys - lo), v)  # [Hkv, G*S, Dh]
        out[b] = o.view(n_kv_heads, G, S, D).permute(2, 0, 1, 3).reshape(S, H, D)
    return out


def _visible(n_keys: int, S: int, window: int | None, tree: torch.Tensor | None, device) -> torch.Tensor:
    """bool [S, n_keys]: which keys each of the S newest queries sees."""
    t = torch.arange(n_keys - S, n_keys, device=device)[:, None]
    p = torch.arange(n_keys, device=device)[None, :]
    seen = p <= t
    if tree is not None:
        seen[:, n_keys - S:] = tree
    if window is not None:
        seen &= t - p < window
    return seen


def _softmax_with_sinks(s: torch.Tensor, sink: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last axis of fp32 scores s, with sink (broadcast to s's rows) one more denominator term."""
    m = s.amax(-1, keepdim=True)
    if sink is not None:
        m = torch.maximum(m, sink)
    m = m.masked_fill(m == float("-inf"), 0.0)  # a row that sees nothing: all weights 0
    e = (s - m).exp_()
    total = e.sum(-1, keepdim=True)
    if sink is not None:
        total += (sink - m).exp()
    return e.div_(total)


def paged_attention(q, k_pool, v_pool, table: KVTable, *, scale: float, window: int | None = None,
                    softcap: float | None = None, sinks: torch.Tensor | None = None,
                    tree_mask: torch.Tensor | None = None, out_fp32: bool = False, impl: str = "auto",
                    max_length: int | None = None) -> torch.Tensor:
    """[B, S, H, Dh] attention of q over the pool through table (module docstring), on the path impl allows:
    "auto" (Triton on CUDA tensors, else torch), "triton" (CUDA, or CPU under TRITON_INTERPRET=1) or "torch".
    max_length, the longest of table.lengths, saves the Triton path a host read."""
    _check(q, k_pool, v_pool, table, sinks, tree_mask, window, softcap)
    path = _choose_path(q, k_pool, v_pool, impl)
    PATH_COUNTS[path] += 1
    kw = dict(scale=scale, window=window, softcap=softcap, sinks=sinks, tree_mask=tree_mask, out_fp32=out_fp32)
    if path != "triton_decode":
        return paged_attention_torch(q, k_pool, v_pool, table, **kw)
    from offload.kernels.triton_attention import paged_attention_triton

    if max_length is None:
        max_length = max(table.host_lengths) if table.host_lengths else int(table.lengths.max())
    q = q if q.stride(-1) == 1 else q.contiguous()
    return paged_attention_triton(q, k_pool, v_pool, table, max_length=max_length, **kw)


def _choose_path(q, k_pool, v_pool, impl: str) -> str:
    """The PATH_COUNTS key of the path this call takes; KernelError where impl="triton" cannot be honoured."""
    if impl not in IMPLS:
        raise KernelError(f"paged_attention impl must be one of {IMPLS}, got {impl!r}")
    interpreted = impl == "triton" and os.environ.get("TRITON_INTERPRET") == "1"
    if impl == "torch" or not (q.is_cuda or interpreted):
        if impl == "triton":
            raise KernelError(f"paged_attention impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1), got "
                              f"{q.device}; use impl='auto'")
        return "torch_grouped"
    why = _triton_refusal(q, k_pool, v_pool)
    if why is None:
        return "triton_decode"
    if impl == "triton":
        raise KernelError(f"the Triton attention kernel cannot take {why}; use impl='auto' for the torch path")
    return f"torch_grouped ({why})"


def _triton_refusal(q, k_pool, v_pool) -> str | None:
    """Why the Triton kernel cannot run this call (a few words), or None."""
    if not _triton_installed():
        return "no Triton"
    from offload.kernels.triton_attention import unsupported

    if k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1:
        return "a pool with strided head_dim"
    return unsupported(q.shape[3], q.shape[1] * q.shape[2] // k_pool.shape[1])


@functools.lru_cache(maxsize=1)
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _check(q, k_pool, v_pool, table: KVTable, sinks, tree_mask, window, softcap) -> None:
    """Raise KernelError naming the first input paged_attention cannot take."""
    if q.dim() != 4 or k_pool.dim() != 3 or v_pool.shape != k_pool.shape:
        raise KernelError(f"paged_attention needs q [B, S, H, Dh] and k_pool, v_pool [N_slots, n_kv_heads, Dh] of "
                          f"one shape, got {list(q.shape)}, {list(k_pool.shape)}, {list(v_pool.shape)}")
    B, S, H, D = q.shape
    if q.dtype not in CACHE_DTYPES or k_pool.dtype not in CACHE_DTYPES or v_pool.dtype != k_pool.dtype:
        raise KernelError(f"paged_attention takes fp32, bf16 or fp16 q and K/V pools of one dtype, got {q.dtype}, "
                          f"{k_pool.dtype}, {v_pool.dtype}")
    if k_pool.shape[2] != D or H % k_pool.shape[1]:
        raise KernelError(f"paged_attention needs q's head_dim {D} to match the pool's {k_pool.shape[2]} and its "
                          f"{H} heads to be a multiple of the pool's {k_pool.shape[1]} KV heads")
    slots, lengths = table.slots, table.lengths
    if (slots.dim() != 2 or slots.shape[0] != B or lengths.shape != (B,) or table.block_size < 1
            or slots.dtype not in (torch.int32, torch.int64) or lengths.dtype not in (torch.int32, torch.int64)):
        raise KernelError(f"KVTable needs int slots [{B}, M], int lengths [{B}] and block_size >= 1, got "
                          f"{slots.dtype} {list(slots.shape)}, {lengths.dtype} {list(lengths.shape)}, "
                          f"{table.block_size}")
    if sinks is not None and tuple(sinks.shape) != (H,):
        raise KernelError(f"paged_attention sinks must be [{H}] (one per query head), got {list(sinks.shape)}")
    if tree_mask is not None and (tree_mask.dtype != torch.bool or tuple(tree_mask.shape) != (B, S, S)):
        raise KernelError(f"paged_attention tree_mask must be bool [{B}, {S}, {S}], got {tree_mask.dtype} "
                          f"{list(tree_mask.shape)}")
    if (window is not None and window < 1) or (softcap is not None and softcap <= 0):
        raise KernelError(f"paged_attention needs window >= 1 and softcap > 0 where given, got {window}, {softcap}")
    others = [k_pool, v_pool, slots, lengths] + [t for t in (sinks, tree_mask) if t is not None]
    if any(t.device != q.device for t in others):
        raise KernelError(f"paged_attention needs every tensor on q's device {q.device}, got "
                          f"{[str(t.device) for t in others]}; move the KVTable with the pool")


__all__ = ["CACHE_DTYPES", "KVTable", "PATH_COUNTS", "attention_paths", "attention_ref", "contiguous_table", "key_slots",
           "paged_attention", "paged_attention_torch", "reset_attention_paths"]

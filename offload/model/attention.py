"""A layer's attention over its KV cache, in the forms a device's fused kernels take (no math fallback, no copy
of the history to decode).

- Decode and short groups (a verify group): the new queries read each sequence's keys where they lie in the
  cache, through the step's block table (offload.kernels.attention.paged_attention: the Triton split-K kernel on
  CUDA, GQA native, fp32 accumulation).
- Prefill chunks: scaled_dot_product_attention over the sequence's cached keys (a view where the cache allows),
  bottom-right causal (`causal_lower_right`, which flash attention takes with GQA) where causality is all the mask
  says; else with the query-head group folded into the query length and the bool mask repeated per head of the
  group (no GQA, so the memory-efficient kernel takes the mask; K/V are never repeated).
- A cache in host RAM for a block computed elsewhere (FlexGen's choice for a batch whose cache VRAM cannot hold):
  one new token per sequence attends where the cache is (q, k, v move, not the cache); several take the cache's
  prefix up to the block.

Each call records its path in offload.kernels.attention.PATH_COUNTS.
"""

from __future__ import annotations

import math
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from offload.kernels.attention import PATH_COUNTS, KVTable, paged_attention
from offload.model.step import LayerKV, Step
from offload.attention_sizes import IN_PLACE_MAX_QUERIES
from offload.spec import ModelSpec


def attend(spec: ModelSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step, kv: LayerKV):
    """Append k, v [B, Hkv, S, Dh] to the cache and attend with q [B, H, S, Dh]; [B, H, S, Dh] where q is. A
    ragged step attends group by group."""
    if step.groups is not None:
        outs = []
        for g, t0 in zip(step.groups, step.offsets):
            b, s = g.positions.shape
            grid = [t[0, :, t0:t0 + b * s].unflatten(1, (b, s)).transpose(0, 1) for t in (q, k, v)]  # [b, H, s, Dh]
            outs.append(attend(spec, *grid, g, kv).transpose(0, 1).flatten(1, 2))  # [H, b * s, Dh]
        return torch.cat(outs, dim=1)[None]
    if kv.k.device != q.device:
        return _attend_host_cache(spec, q, k, v, step, kv)
    kv.write(step, k, v)
    if _reads_in_place(step, q):
        return _paged(spec, q, step, kv)
    return _prefill(spec, q, step, kv)


def _reads_in_place(step: Step, q: torch.Tensor) -> bool:
    """Whether the step's queries are each sequence's newest few tokens, all real (host tensors only; worked out
    once per step, not per layer)."""
    if q.shape[-2] > IN_PLACE_MAX_QUERIES:
        return False
    if "in_place" not in step._derived:
        positions, valid = step.positions, step.valid
        step._derived["in_place"] = bool(valid.all()) and bool(
            (positions[:, -1] - positions[:, 0] == positions.shape[1] - 1).all())
    return step._derived["in_place"]


def _paged(spec: ModelSpec, q: torch.Tensor, step: Step, kv: LayerKV) -> torch.Tensor:
    """q [B, H, S, Dh] over the pool in place through the step's table of contiguous extents."""
    n_slots, heads, dh = kv.k.shape[0] * kv.k.shape[1], kv.k.shape[2], kv.k.shape[3]
    o = paged_attention(q.transpose(1, 2), kv.k.view(n_slots, heads, dh), kv.v.view(n_slots, heads, dh),
                        kv_table(step, kv), scale=1 / math.sqrt(spec.head_dim), window=spec.sliding_window)
    return o.transpose(1, 2)


def kv_table(step: Step, kv: LayerKV) -> KVTable:
    """Each sequence's keys as one run of its cache row (made once per step and cache shape, on the device from
    the step's uploaded tensors: no host sync)."""
    stride = kv.k.shape[1]
    table = step._derived.get(("table", stride))
    if table is None:
        n, dev = step.positions.shape[0], step.write_index.device
        rows = step.rows if step.rows is not None else torch.arange(n, device=dev)
        first, newest = rows.to(dev) * stride, step.write_index[:, -1]  # newest: the last key's slot in its row
        if step.bases is not None:
            first, newest = first + step.bases, newest - step.bases
        lengths = newest + 1
        host = tuple(int(p) + 1 for p in step.positions[:, -1])
        table = step._derived[("table", stride)] = KVTable(first[:, None].int(), lengths.int(), stride, host)
    return table


def _prefill(spec: ModelSpec, q: torch.Tensor, step: Step, kv: LayerKV) -> torch.Tensor:
    """A prefill chunk: q [B, H, S, Dh] over its sequences' cached keys."""
    return sdpa_over_keys(q, *cached_keys(step, kv), step)


def sdpa_over_keys(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, step: Step) -> torch.Tensor:
    """q [B, H, S, Dh] over K, V [B, Hkv, T, Dh] as the step's mask allows, in a form a fused SDPA kernel takes:
    bottom-right causal where that is the whole mask, else the query-head group folded into the query length
    with the bool mask repeated (no GQA: the memory-efficient kernel takes a mask; K/V never repeated)."""
    keys, values = keys.to(q.dtype), values.to(q.dtype)
    b, heads, s, dh = q.shape
    group = heads // keys.shape[1]
    if _causal_only(step):
        PATH_COUNTS["sdpa_causal_lower_right"] += 1
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=causal_lower_right(s, keys.shape[2]),
                                              enable_gqa=group > 1)
    PATH_COUNTS["sdpa_folded_mask"] += 1
    mask = step.mask  # [B, 1, S, T]
    folded = q.reshape(b, keys.shape[1], group * s, dh)  # head h = kv_head * group + g: the group's rows in a run
    mask = mask[:, :, None].expand(b, 1, group, s, mask.shape[-1]).reshape(b, 1, group * s, mask.shape[-1])
    o = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask)
    return o.view(b, heads, s, dh)


def _causal_only(step: Step) -> bool:
    """One sequence whose new tokens are all real and consecutive, with no window cutting its keys: the mask is
    bottom-right causal (host tensors only; worked out once per step)."""
    if "causal_only" not in step._derived:
        positions, valid, window = step.positions, step.valid, step.sliding_window
        step._derived["causal_only"] = (
            positions.shape[0] == 1 and bool(valid.all())
            and int(positions[0, -1]) - int(positions[0, 0]) == positions.shape[1] - 1
            and int(positions[0, -1]) + 1 == step.n_keys and (window is None or step.n_keys <= window))
    return step._derived["causal_only"]


def cached_keys(step: Step, kv: LayerKV) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [B, Hkv, n_keys, Dh] of the step's sequences from the cache: views of the cache where each sequence's
    keys are one run of its row that the host can name (one sequence, or every row in order), else gathered."""
    n_keys, host = step.n_keys, step._host if step._host is not None else step
    if step.bases is None and step.rows is None:
        return kv.k[:, :n_keys].transpose(1, 2), kv.v[:, :n_keys].transpose(1, 2)
    if step.positions.shape[0] == 1 and (host.rows is None or host.rows.device.type == "cpu"):
        row = 0 if host.rows is None else int(host.rows[0])
        base = 0 if host.bases is None else int(host.bases[0])
        return (kv.k[row, base:base + n_keys].transpose(0, 1)[None],
                kv.v[row, base:base + n_keys].transpose(0, 1)[None])
    return gathered_keys(step, kv)


def gathered_keys(step: Step, kv: LayerKV) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [B, Hkv, n_keys, Dh] gathered from each sequence's rows and base slot (a copy of the history)."""
    n_keys, dev, (batch, slots, heads, dh) = step.n_keys, kv.k.device, kv.k.shape
    rows = torch.arange(step.positions.shape[0], device=dev) if step.rows is None else step.rows.to(dev)
    first = rows * slots + (0 if step.bases is None else step.bases.to(dev))
    index = (first[:, None] + torch.arange(n_keys, device=dev)[None]).clamp_(max=batch * slots - 1)
    keys = kv.k.view(batch * slots, heads, dh)[index].transpose(1, 2)
    return keys, kv.v.view(batch * slots, heads, dh)[index].transpose(1, 2)


def _attend_host_cache(spec: ModelSpec, q, k, v, step: Step, kv: LayerKV) -> torch.Tensor:
    """The cache in host RAM, the block elsewhere: one new token per sequence attends on the host (q, k, v move
    down, the output up); several bring the cache's prefix up to the block."""
    device = q.device
    if q.shape[-2] == 1 or device.type == "cpu":
        host = step._host if step._host is not None else step
        q, k, v = (t.to(kv.k.device) for t in (q, k, v))
        kv.write(host, k, v)
        keys, values = gathered_keys(host, kv)
        o = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype),
                                           attn_mask=host.mask.to(kv.k.device),
                                           enable_gqa=spec.n_kv_heads != spec.n_heads)
        PATH_COUNTS["host_cache_sdpa"] += 1
        return o.to(device)
    kv.write(step, k, v)
    keys, values = gathered_keys(step, kv)
    PATH_COUNTS["host_cache_prefix_up"] += 1
    group = spec.n_heads // spec.n_kv_heads
    keys, values = keys.to(device, q.dtype), values.to(device, q.dtype)
    b, heads, s, dh = q.shape
    mask = step.mask[:, :, None].expand(b, 1, group, s, step.n_keys).reshape(b, 1, group * s, step.n_keys)
    o = F.scaled_dot_product_attention(q.reshape(b, keys.shape[1], group * s, dh), keys, values, attn_mask=mask)
    return o.view(b, heads, s, dh)

"""A layer's attention over its KV cache, in the forms a device's fused kernels take (no math fallback, no copy
of the history to decode).

- Decode and short groups (a verify group): the new queries read each sequence's keys where they lie in the
  cache, through the step's block table (offload.kernels.attention.paged_attention: the Triton split-K kernel on
  CUDA, GQA native, fp32 accumulation); a verified tree's tokens with its mask over the tree's own keys.
- Prefill chunks: scaled_dot_product_attention over the sequence's cached keys (a view where the cache allows),
  bottom-right causal (`causal_lower_right`, which flash attention takes with GQA) where causality is all the mask
  says; else with the query-head group folded into the query length and the bool mask repeated per head of the
  group (no GQA, so the memory-efficient kernel takes the mask; K/V are never repeated).
- A cache in host RAM for a block computed elsewhere (FlexGen's choice for a batch whose cache VRAM cannot hold):
  one new token per sequence attends where the cache is (q, k, v move, not the cache); several take the cache's
  prefix up to the block.

A layer attends with the model's scale (Gemma's query_pre_attn_scalar), its own sliding window (Gemma 2/3 mix
sliding and full layers: the step holds a mask per window) and the model's soft-cap of the scores (Gemma 2:
scaled dot products then go through the math below, as no fused SDPA kernel caps them).

Each call records its path in offload.kernels.attention.PATH_COUNTS.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from offload.kernels.attention import PATH_COUNTS, KVTable, paged_attention
from offload.model.step import LayerKV, Step, table_slots
from offload.attention_sizes import IN_PLACE_MAX_QUERIES, KV_BLOCK, RING_BLOCK
from offload.spec import ModelSpec


def attend(spec: ModelSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step, kv: LayerKV,
           window: int | None = None, sinks: torch.Tensor | None = None):
    """Append k, v [B, Hkv, S, Dh] to the cache and attend with q [B, H, S, Dh] over the keys a layer of this
    sliding window sees (with gpt-oss's sinks [H], a logit per head with no value); [B, H, S, Dh] where q is. A
    ragged step attends group by group."""
    if step.groups is not None:
        outs = []
        for g, t0 in zip(step.groups, step.offsets):
            b, s = g.positions.shape
            grid = [t[0, :, t0:t0 + b * s].unflatten(1, (b, s)).transpose(0, 1) for t in (q, k, v)]  # [b, H, s, Dh]
            outs.append(attend(spec, *grid, g, kv, window, sinks).transpose(0, 1).flatten(1, 2))  # [H, b * s, Dh]
        return torch.cat(outs, dim=1)[None]
    if kv.ring is not None:
        return _attend_ring(spec, q, k, v, step, kv, window, sinks)
    if kv.k.device != q.device:
        return _attend_host_cache(spec, q, k, v, step, kv, window, sinks)
    kv.write(step, k, v)
    if _reads_in_place(step, q) and (step.key_maps is None or window is None):  # a tree: its mask's newest keys
        return _paged(spec, q, step, kv, window, sinks)
    return sdpa_over_keys(q, *cached_keys(step, kv), step, window, spec, sinks)


def _reads_in_place(step: Step, q: torch.Tensor) -> bool:
    """Whether the step's queries are each sequence's newest few tokens, all real (host tensors only; worked out
    once per step, not per layer)."""
    if q.shape[-2] > IN_PLACE_MAX_QUERIES:
        return False
    if "in_place" not in step._derived:
        positions, valid = step.positions, step.valid
        if step.key_maps is not None:  # a verified tree: in place where its tokens see every key before theirs
            host = step._host if step._host is not None else step  # (not a part of one cut after its root)
            step._derived["in_place"] = bool(host.mask[..., : host.n_keys - positions.shape[1]].all())
        else:
            step._derived["in_place"] = bool(valid.all()) and bool(
                (positions[:, -1] - positions[:, 0] == positions.shape[1] - 1).all())
    return step._derived["in_place"]


def _paged(spec: ModelSpec, q: torch.Tensor, step: Step, kv: LayerKV, window: int | None,
           sinks: torch.Tensor | None) -> torch.Tensor:
    """q [B, H, S, Dh] over the pool in place through the step's table of contiguous extents (a ring's blocks)."""
    n_slots, heads, dh = kv.k.shape[0] * kv.k.shape[1], kv.k.shape[2], kv.k.shape[3]
    table = kv_table(step, kv) if kv.ring is None else ring_table(step, kv)
    s = q.shape[2]  # a tree's: which of the S newest keys (its own) each of its tokens sees
    tree = None if step.key_maps is None else step.mask[:, 0, :, step.n_keys - s:]
    o = paged_attention(q.transpose(1, 2), kv.k.view(n_slots, heads, dh), kv.v.view(n_slots, heads, dh),
                        table, scale=spec.attn_scale, window=window, softcap=spec.variant.attn_softcap,
                        sinks=sinks, tree_mask=tree)
    return o.transpose(1, 2)


def kv_table(step: Step, kv: LayerKV) -> KVTable:
    """Where each sequence's keys lie in the flat pool: its block table in its row (a pooled cache), else one run of
    its row (made once per step and cache shape, on the device from the step's uploaded tensors: no host sync)."""
    stride = kv.k.shape[1]
    table = step._derived.get(("table", stride))
    if table is None:
        n, dev = step.positions.shape[0], step.write_index.device
        rows = step.rows if step.rows is not None else torch.arange(n, device=dev)
        first = rows.to(dev)[:, None] * stride
        host = tuple(int(p) + 1 for p in step.positions[:, -1]) if step.key_maps is None else (step.n_keys,)
        if step.tables is None:
            lengths = step.write_index[:, -1] + 1  # the last key's slot in its row, plus one
            table = KVTable(first.int(), lengths.int(), stride, host)
        else:  # the newest key's block: the first of the table holding its slot (a sequence's blocks are disjoint)
            newest, tables = step.write_index[:, -1:], step.tables
            j = ((tables <= newest) & (newest < tables + KV_BLOCK)).int().argmax(dim=1, keepdim=True)
            lengths = (j * KV_BLOCK + newest - tables.gather(1, j) + 1)[:, 0]
            table = KVTable((first + tables).int(), lengths.int(), KV_BLOCK, host)
        step._derived[("table", stride)] = table
    return table


def sdpa_over_keys(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, step: Step,
                   window: int | None = None, spec: ModelSpec | None = None,
                   sinks: torch.Tensor | None = None, first_key: int = 0) -> torch.Tensor:
    """q [B, H, S, Dh] over K, V [B, Hkv, T, Dh] (the keys of positions first_key.. of each sequence) as the
    step's mask for this window allows, in a form a fused SDPA kernel takes: bottom-right causal where that is the
    whole mask, else the query-head group folded into the query length with the bool mask repeated (no GQA: the
    memory-efficient kernel takes a mask; K/V never repeated). Soft-capped scores (spec's attn_softcap) and sinks
    take the math of math_attention."""
    keys, values = keys.to(q.dtype), values.to(q.dtype)
    b, heads, s, dh = q.shape
    group = heads // keys.shape[1]
    scale = None if spec is None else spec.attn_scale
    mask = step.mask_for(window)[..., first_key:]  # [B, 1, S, T]
    if spec is not None and (spec.variant.attn_softcap is not None or sinks is not None):
        PATH_COUNTS["attention_math"] += 1
        return math_attention(q, keys, values, mask, scale, spec.variant.attn_softcap, sinks)
    if first_key == 0 and _causal_only(step, window):
        PATH_COUNTS["sdpa_causal_lower_right"] += 1
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=causal_lower_right(s, keys.shape[2]),
                                              enable_gqa=group > 1, scale=scale)
    PATH_COUNTS["sdpa_folded_mask"] += 1
    folded = q.reshape(b, keys.shape[1], group * s, dh)  # head h = kv_head * group + g: the group's rows in a run
    mask = mask[:, :, None].expand(b, 1, group, s, mask.shape[-1]).reshape(b, 1, group * s, mask.shape[-1])
    o = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask, scale=scale)
    return o.view(b, heads, s, dh)


def math_attention(q, keys, values, mask, scale: float, softcap: float | None = None,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(softcap * tanh(q k^T * scale / softcap), masked) v, in fp32, for q [B, H, S, Dh] over K, V
    [B, Hkv, T, Dh] (query-head groups folded, K/V never repeated); mask [B, 1, S, T]; sinks [H]: one more logit
    per head in the softmax's denominator (gpt-oss), with no value."""
    b, heads, s, dh = q.shape
    n_kv, t = keys.shape[1], keys.shape[2]
    group = heads // n_kv
    scores = q.float().reshape(b, n_kv, group * s, dh) @ keys.float().transpose(-1, -2) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    seen = mask[:, :, None].expand(b, 1, group, s, t).reshape(b, 1, group * s, t)
    scores = scores.masked_fill(~seen, float("-inf"))
    if sinks is not None:  # head h = kv_head * group + g: each row's own head's sink
        sink = sinks.float().view(1, n_kv, group, 1, 1).expand(b, n_kv, group, s, 1).reshape(b, n_kv, group * s, 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return (probs @ values.float()).to(q.dtype).view(b, heads, s, dh)


def _causal_only(step: Step, window: int | None) -> bool:
    """One sequence whose new tokens are all real and consecutive, with no window cutting its keys: the mask is
    bottom-right causal (host tensors only; worked out once per step and window)."""
    key = ("causal_only", window)
    if step.key_maps is not None:
        return False
    if key not in step._derived:
        positions, valid = step.positions, step.valid
        step._derived[key] = (
            positions.shape[0] == 1 and bool(valid.all())
            and int(positions[0, -1]) - int(positions[0, 0]) == positions.shape[1] - 1
            and int(positions[0, -1]) + 1 == step.n_keys and (window is None or step.n_keys <= window))
    return step._derived[key]


def cached_keys(step: Step, kv: LayerKV) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [B, Hkv, n_keys, Dh] of the step's sequences from the cache: views of the cache where each sequence's
    keys are one run of its row that the host can name (one sequence whose table is one run, or every row in
    order), else gathered."""
    n_keys, host = step.n_keys, step._host if step._host is not None else step
    if step.tables is None and step.rows is None:
        return kv.k[:, :n_keys].transpose(1, 2), kv.v[:, :n_keys].transpose(1, 2)
    if step.positions.shape[0] == 1 and (host.rows is None or host.rows.device.type == "cpu"):
        base = _one_run(host, n_keys)
        if base is not None:
            row = 0 if host.rows is None else int(host.rows[0])
            return (kv.k[row, base:base + n_keys].transpose(0, 1)[None],
                    kv.v[row, base:base + n_keys].transpose(0, 1)[None])
    return gathered_keys(step, kv)


def _one_run(host: Step, n_keys: int) -> int | None:
    """The first slot of a one-sequence host step's first n_keys keys where they are one run of its row, else
    None (a table that maps blocks from elsewhere)."""
    if host.tables is None:
        return 0
    key = ("one_run", n_keys)
    if key not in host._derived:
        blocks = host.tables[0, : -(-n_keys // KV_BLOCK)]
        steps = blocks - blocks[0] == KV_BLOCK * torch.arange(len(blocks))
        host._derived[key] = int(blocks[0]) if bool(steps.all()) else None
    return host._derived[key]


def gathered_keys(step: Step, kv: LayerKV) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [B, Hkv, n_keys, Dh] gathered from each sequence's row through its block table (a copy of the
    history)."""
    n_keys, dev, (batch, slots, heads, dh) = step.n_keys, kv.k.device, kv.k.shape
    rows = torch.arange(step.positions.shape[0], device=dev) if step.rows is None else step.rows.to(dev)
    keys = torch.arange(n_keys, device=dev)[None].expand(rows.shape[0], n_keys)
    at = keys if step.tables is None else table_slots(step.tables.to(dev), keys)
    index = (rows[:, None] * slots + at).clamp_(max=batch * slots - 1)
    keys = kv.k.view(batch * slots, heads, dh)[index].transpose(1, 2)
    return keys, kv.v.view(batch * slots, heads, dh)[index].transpose(1, 2)


def _attend_ring(spec: ModelSpec, q, k, v, step: Step, kv: LayerKV, window: int | None,
                 sinks: torch.Tensor | None) -> torch.Tensor:
    """A sliding layer whose cache is a ring of kv.ring slots per sequence (its window and RING_SLACK more): a few
    new tokens per sequence are written, then read in place through the ring's blocks; a longer chunk attends in
    slices of at most kv.ring - window + 1 tokens, each written before it attends, so no key a slice's queries see
    is overwritten. A ring in host RAM for a block elsewhere: q, k, v move to the ring and the output back."""
    if kv.k.device != q.device:  # a ring in host RAM for a device block, or on the device for a CPU block
        there = _step_on(step, kv.k.device)
        moved = _attend_ring(spec, *(t.to(kv.k.device) for t in (q, k, v)), there, kv, window,
                             None if sinks is None else sinks.to(kv.k.device))
        PATH_COUNTS["ring_elsewhere"] += 1
        return moved.to(q.device)
    if _reads_in_place(step, q):
        kv.write(step, k, v)
        return _paged(spec, q, step, kv, window, sinks)
    s, width = q.shape[2], kv.ring - window + 1
    outs = []
    for a in range(0, s, width):
        part = step if width >= s else step.slice(a, a + width)
        pk, pv = (t[:, :, a:a + width] for t in (k, v))
        kv.write(part, pk, pv)
        first_key = max(0, part.n_keys - kv.ring)
        outs.append(sdpa_over_keys(q[:, :, a:a + width], *ring_keys(part, kv, first_key), part, window, spec, sinks,
                                   first_key))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def _step_on(step: Step, device: torch.device) -> Step:
    """The step where a cache is: its host step for the host, else moved there once per step."""
    if device.type == "cpu":
        return step._host if step._host is not None else step
    key = ("on", str(device))
    if key not in step._derived:
        step._derived[key] = step.to(device)
    return step._derived[key]


def ring_table(step: Step, kv: LayerKV) -> KVTable:
    """Each sequence's keys in its ring as a block table: key j in ring block (j // RING_BLOCK) % blocks, so the
    newest kv.ring keys lie where they were written (older ones, outside every window, read what overwrote them)."""
    stride = kv.k.shape[1]
    key = ("ring table", kv.ring, stride)
    table = step._derived.get(key)
    if table is None:
        ring, n = step.rings[kv.ring], step.positions.shape[0]
        dev = ring.first.device
        rows = step.rows if step.rows is not None else torch.arange(n, device=dev)
        host = tuple(int(p) + 1 for p in step.positions[:, -1])
        blocks = torch.arange(-(-max(host) // RING_BLOCK), device=dev) % (kv.ring // RING_BLOCK)
        slots = (rows.to(dev) * stride + ring.first)[:, None] + blocks[None] * RING_BLOCK
        table = step._derived[key] = KVTable(slots.int(), (ring.positions[:, -1] + 1).int(), RING_BLOCK, host)
    return table


def ring_keys(step: Step, kv: LayerKV, first_key: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [B, Hkv, n_keys - first_key, Dh] of positions first_key.. of the step's sequences, gathered from their
    rings (a position a later one overwrote, outside every query's window, reads that one)."""
    n_keys, dev, (batch, slots, heads, dh) = step.n_keys, kv.k.device, kv.k.shape
    ring = step.rings[kv.ring]
    rows = torch.arange(step.positions.shape[0], device=dev) if step.rows is None else step.rows.to(dev)
    positions = torch.arange(first_key, n_keys, device=dev)
    index = (rows * slots + ring.first.to(dev))[:, None] + positions[None] % kv.ring
    return (kv.k.view(batch * slots, heads, dh)[index].transpose(1, 2),
            kv.v.view(batch * slots, heads, dh)[index].transpose(1, 2))


def _attend_host_cache(spec: ModelSpec, q, k, v, step: Step, kv: LayerKV, window: int | None,
                       sinks: torch.Tensor | None) -> torch.Tensor:
    """The cache in host RAM, the block elsewhere: one new token per sequence attends on the host (q, k, v move
    down, the output up); several bring the cache's prefix up to the block."""
    device = q.device
    if q.shape[-2] == 1 or device.type == "cpu":
        host = step._host if step._host is not None else step
        q, k, v = (t.to(kv.k.device) for t in (q, k, v))
        kv.write(host, k, v)
        keys, values = gathered_keys(host, kv)
        mask = host.mask_for(window).to(kv.k.device)
        if spec.variant.attn_softcap is not None or sinks is not None:
            o = math_attention(q, keys, values, mask, spec.attn_scale, spec.variant.attn_softcap,
                               None if sinks is None else sinks.to(kv.k.device))
        else:
            o = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask,
                                               enable_gqa=spec.n_kv_heads != spec.n_heads, scale=spec.attn_scale)
        PATH_COUNTS["host_cache_sdpa"] += 1
        return o.to(device)
    kv.write(step, k, v)
    keys, values = gathered_keys(step, kv)
    PATH_COUNTS["host_cache_prefix_up"] += 1
    group = spec.n_heads // spec.n_kv_heads
    keys, values = keys.to(device, q.dtype), values.to(device, q.dtype)
    if spec.variant.attn_softcap is not None or sinks is not None:
        return math_attention(q, keys, values, step.mask_for(window), spec.attn_scale, spec.variant.attn_softcap,
                              sinks)
    b, heads, s, dh = q.shape
    mask = step.mask_for(window)[:, :, None].expand(b, 1, group, s, step.n_keys).reshape(b, 1, group * s,
                                                                                           step.n_keys)
    o = F.scaled_dot_product_attention(q.reshape(b, keys.shape[1], group * s, dh), keys, values, attn_mask=mask,
                                       scale=spec.attn_scale)
    return o.view(b, heads, s, dh)

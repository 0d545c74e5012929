"""What one forward pass needs besides weights (Step: where each new token sits and what it may see) and the KV
cache it appends to (LayerKV), made on the host and moved to a device once per step."""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass, field

import torch

from offload.attention_sizes import KV_BLOCK, ring_slots
from offload.model.rope import rope_cos_sin
from offload.spec import ModelSpec


@dataclass
class Step:
    """What one forward pass needs besides weights: where each new token sits and what it may see.

    A plain step is a grid of B sequences by S new tokens (padding marked invalid). A ragged step (groups set)
    holds the tokens of several grids back to back as one row of T tokens: a mixed step's decode tokens (one
    grid [b, 1]) and prompt chunks (a grid [1, c] each). The linears run once over all T tokens; attention runs
    per group. Its top-level tensors are the flat [1, T] ones; each group is a plain step of its own.
    """

    positions: torch.Tensor  # [B, S] long, position of each new token (pads: 0)
    write_index: torch.Tensor  # [B, S] long, KV slot to write within the row (through tables; pads: the trash slot)
    valid: torch.Tensor  # [B, S] bool, real tokens (not padding)
    n_keys: int  # keys the step's queries see: positions 0 .. n_keys - 1 of each sequence
    cos: torch.Tensor  # [B, 1, S, head_dim]
    sin: torch.Tensor  # [B, 1, S, head_dim], first half negated (see apply_rope)
    rows: torch.Tensor | None = None  # [B] cache rows these sequences use; None: all rows, in order
    phase: str = "prefill"  # prefill | decode: the plan may compute a block differently in each
    sliding_window: int | None | tuple = None  # of every layer, or (a model whose layers differ) each distinct one
    tables: torch.Tensor | None = None  # [B, M] long: slot in its row of each KV_BLOCK keys of a sequence (a pooled
    # cache: key p at tables[b, p // KV_BLOCK] + p % KV_BLOCK); None: key p at slot p
    rings: dict = field(default_factory=dict)  # ring slots R -> RingIndex, of each ring layer size (spec.kv_ring)
    groups: tuple["Step", ...] | None = None  # a ragged step's grids, each b == 1 or s == 1
    offsets: tuple[int, ...] = ()  # where each group's tokens begin in the flat row
    key_maps: tuple | None = None  # a tree of proposals' group (tree_step): per token, None or the keys its
    # positions after the sequence's last token's are at (its ancestors' and its own, where the tree wrote them);
    # None: a chain, every token's keys where their positions say
    _mask: torch.Tensor | None = field(default=None, repr=False)
    _host: "Step | None" = field(default=None, repr=False)  # this step on the host (of a step moved to a device)
    _derived: dict = field(default_factory=dict, repr=False)  # what attention derives from it, made once per step

    @property
    def n_seqs(self) -> int:
        """Sequences in this step (a ragged step's groups together)."""
        if self.groups is not None:
            return sum(g.n_seqs for g in self.groups)
        return self.positions.shape[0]

    @property
    def n_tokens(self) -> int:
        return self.positions.numel()

    @property
    def mask(self) -> torch.Tensor:
        """[B, 1, S, n_keys] bool, keys each query may attend to; made on first use (the fused CPU layer
        reads positions instead, so a decode step on the CPU never builds it)."""
        if self.groups is not None:
            raise ValueError("a ragged step has one mask per group: use step.groups[i].mask")
        if self._mask is None:
            self._mask = attention_mask(self.positions, self.valid, self.n_keys, self.sliding_window)
        return self._mask

    def mask_for(self, window: int | None) -> torch.Tensor:
        """[B, 1, S, n_keys] bool, the mask of layers with this sliding window (None: full attention)."""
        if not isinstance(self.sliding_window, tuple):
            return self.mask
        i = self.sliding_window.index(window)
        return self.mask[:, i:i + 1]

    def slice(self, start: int, stop: int) -> "Step":
        """The part of this step for new tokens start..stop-1 of every row (one chunk of a long prefill); of a
        ragged step, flat tokens start..stop-1."""
        if self.groups is not None:
            return self._slice_ragged(start, stop)
        positions, valid = self.positions[:, start:stop], self.valid[:, start:stop]
        n_keys = int(torch.where(valid, positions, 0).max()) + 1 if positions.numel() else 1
        maps = None if self.key_maps is None else self.key_maps[start:stop]
        if maps is not None:  # a tree's keys lie past its positions
            n_keys = tree_n_keys(positions[0].tolist(), maps)
        mask = None if self._mask is None else self._mask[:, :, start:stop, :n_keys]  # where the step's mask is
        host = None if self._host is None else self._host.slice(start, stop)
        rings = {r: ring.slice(start, stop) for r, ring in self.rings.items()}
        return Step(positions, self.write_index[:, start:stop], valid, n_keys, self.cos[:, :, start:stop],
                    self.sin[:, :, start:stop], self.rows, self.phase, self.sliding_window, self.tables, rings,
                    key_maps=maps, _mask=mask, _host=host)

    def _rows_slice(self, start: int, stop: int) -> "Step":
        """Rows start..stop-1 of a plain step."""
        positions, valid = self.positions[start:stop], self.valid[start:stop]
        n_keys = int(torch.where(valid, positions, 0).max()) + 1 if positions.numel() else 1
        rows = self.rows[start:stop] if self.rows is not None else torch.arange(start, stop,
                                                                                  device=self.write_index.device)
        tables = None if self.tables is None else self.tables[start:stop]
        mask = None if self._mask is None else self._mask[start:stop, :, :, :n_keys]
        host = None if self._host is None else self._host._rows_slice(start, stop)
        rings = {r: ring.rows(start, stop) for r, ring in self.rings.items()}
        return Step(positions, self.write_index[start:stop], valid, n_keys, self.cos[start:stop],
                    self.sin[start:stop], rows, self.phase, self.sliding_window, tables, rings, _mask=mask, _host=host)

    def _slice_ragged(self, start: int, stop: int) -> "Step":
        groups, offsets, at = [], [], 0
        for g, t0 in zip(self.groups, self.offsets):
            b, s = g.positions.shape
            a, z = max(start, t0) - t0, min(stop, t0 + b * s) - t0
            if z <= a:
                continue
            part = g if (a, z) == (0, b * s) else (g._rows_slice(a, z) if s == 1 else g.slice(a, z))
            groups.append(part)
            offsets.append(at)
            at += z - a
        part = _ragged(groups, offsets, self.positions[:, start:stop], self.write_index[:, start:stop],
                       self.valid[:, start:stop], self.cos[:, :, start:stop], self.sin[:, :, start:stop], self.phase,
                       self.sliding_window)
        part._host = None if self._host is None else self._host._slice_ragged(start, stop)
        return part

    def to(self, device, move=None) -> "Step":
        """This step with its tensors on device (positions stay where they are), moved once for every layer; move
        (tensor -> tensor on device), where given, moves them (the executor's backend: from page-locked memory,
        without waiting for the device)."""
        move = move or (lambda t: t.to(device, non_blocking=True))
        if self.groups is not None:
            moved = _ragged([g.to(device, move) for g in self.groups], list(self.offsets), self.positions,
                            move(self.write_index), self.valid, move(self.cos), move(self.sin), self.phase,
                            self.sliding_window)
            moved._host = self
            return moved
        rows = None if self.rows is None else move(self.rows)
        tables = None if self.tables is None else move(self.tables)
        rings = {r: ring.to(move) for r, ring in self.rings.items()}
        return Step(self.positions, move(self.write_index), self.valid, self.n_keys, move(self.cos), move(self.sin),
                    rows, self.phase, self.sliding_window, tables, rings, key_maps=self.key_maps,
                    _mask=move(self.mask), _host=self)


def _ragged(groups, offsets, positions, write_index, valid, cos, sin, phase, sliding_window) -> Step:
    n_keys = max((g.n_keys for g in groups), default=1)
    return Step(positions, write_index, valid, n_keys, cos, sin, None, phase, sliding_window, None, {},
                tuple(groups), tuple(offsets))


@dataclass
class RingIndex:
    """Where a step's sequences keep their keys in the layers whose cache is a ring of `size` slots per sequence
    (spec.kv_ring): position p of sequence b at slot first[b] + p % size of its cache row."""

    size: int
    writes: torch.Tensor  # [B, S] long, the slot each new token's K and V go to (padding: -1, the trash slot)
    first: torch.Tensor  # [B] long, each sequence's first ring slot in its row
    positions: torch.Tensor  # [B, S] long, the new tokens' positions where the cache is (a moved step's on its device)

    @staticmethod
    def of(size: int, positions: torch.Tensor, valid: torch.Tensor, rings: torch.Tensor | None) -> "RingIndex":
        """rings [B]: each sequence's ring in a pooled row (None: each row holds one sequence's ring)."""
        first = torch.zeros(positions.shape[0], dtype=torch.long) if rings is None else rings.long() * size
        writes = torch.where(valid, first[:, None] + positions % size, -1)
        return RingIndex(size, writes, first, positions)

    def slice(self, start: int, stop: int) -> "RingIndex":
        return RingIndex(self.size, self.writes[:, start:stop], self.first, self.positions[:, start:stop])

    def rows(self, start: int, stop: int) -> "RingIndex":
        return RingIndex(self.size, self.writes[start:stop], self.first[start:stop], self.positions[start:stop])

    def to(self, move) -> "RingIndex":
        return RingIndex(self.size, move(self.writes), move(self.first), move(self.positions))


class LayerKV:
    """KV cache of one layer, token-major: [B, T + 1, n_kv_heads, head_dim]; slot T takes writes of padding. A
    ring layer's (ring: its slots per sequence) holds n_rings rings of a sequence's newest keys per row instead."""

    def __init__(self, batch: int, n_kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", ring: int | None = None, n_rings: int = 1):
        self.ring = ring
        shape = (batch, (max_len if ring is None else ring * n_rings) + 1, n_kv_heads, head_dim)
        self.k, self.v = (_zeros(shape, dtype, device) for _ in range(2))

    def write(self, step: "Step", k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [b, H, S, Dh] at step.write_index (a ring's: step.rings) in rows step.rows (None: every cache
        row, in order); the cache may live on another device than k, v (KV lives where a block decodes)."""
        dev, (batch, slots, heads, dh) = self.k.device, self.k.shape
        rows = torch.arange(k.shape[0], device=dev) if step.rows is None else step.rows.to(dev)
        if self.ring is None:
            index = step.write_index.to(dev)
        else:
            index = step.rings[self.ring].writes.to(dev)
            index = torch.where(index < 0, slots - 1, index)
        flat = (rows[:, None] * slots + index).reshape(-1)
        for cache, new in ((self.k, k), (self.v, v)):
            new = new.transpose(1, 2).reshape(-1, heads, dh)
            cache.view(batch * slots, heads, dh).index_copy_(0, flat, _to(new, dev, cache.dtype))

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def layer_cache(spec: ModelSpec, i: int, batch: int, max_len: int, dtype: torch.dtype, device="cpu",
                n_rings: int | None = None) -> LayerKV:
    """Layer i's cache of batch rows of max_len slots; a ring layer's (spec.kv_ring) holds n_rings rings per row
    (a pooled row: one per sequence it may hold at once; None: a row is one sequence), where that is smaller."""
    ring = spec.kv_ring(i)
    if ring is not None and ring * (n_rings or 1) >= max_len:
        ring = None
    return LayerKV(batch, spec.n_kv_heads, max_len, spec.head_dim, dtype, device, ring, n_rings or 1)


LAZY_ZEROS_BYTES = 1 << 20  # host caches from this size on are zero pages until written (see _zeros)


def _zeros(shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """A zeroed cache tensor. On the host, a large one is an anonymous mapping: its pages are the kernel's zero
    page until a sequence writes them, so a pool sized for the plan's whole batch holds memory as it fills (a
    server's idle pool costs nothing), not all at once as torch.zeros's memset makes it."""
    n_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or n_bytes < LAZY_ZEROS_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    private = mmap.mmap(-1, n_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # reads map the zero page
    return torch.frombuffer(private, dtype=dtype).view(shape)  # the tensor keeps the mapping


def _to(t: torch.Tensor, device, dtype) -> torch.Tensor:
    return t if t.device == device and t.dtype == dtype else t.to(device, dtype)


def attention_mask(positions: torch.Tensor, valid: torch.Tensor, n_keys: int,
                   sliding_window: int | None | tuple) -> torch.Tensor:
    """[B, 1, S, n_keys] bool: causal over each row's own cache; padding queries see key 0 only. A tuple of
    windows gives [B, n_windows, S, n_keys], one mask per window (Step.mask_for picks one)."""
    if isinstance(sliding_window, tuple):
        return torch.cat([attention_mask(positions, valid, n_keys, w) for w in sliding_window], dim=1)
    keys = torch.arange(n_keys, device=positions.device)[None, None, :]  # [1, 1, T]
    q = positions[:, :, None]  # [B, S, 1]
    mask = keys <= q
    if sliding_window is not None:
        mask &= (q - keys) < sliding_window
    mask &= valid[:, :, None]
    mask |= (~valid[:, :, None]) & (keys == 0)
    return mask[:, None]


def make_step(spec: ModelSpec, dtype: torch.dtype, positions: torch.Tensor, valid: torch.Tensor, trash_slot: int,
              rows: torch.Tensor | None = None, phase: str = "prefill", tables: torch.Tensor | None = None,
              rings: torch.Tensor | None = None) -> Step:
    """Describe one forward pass: new tokens at positions [B, S]; valid [B, S] marks real tokens (None: all are);
    tables [B, M]: the slot in its cache row of each KV_BLOCK keys of a sequence (a pooled cache; M covers its
    positions); rings [B]: each sequence's ring in a pooled row of the ring layers (spec.kv_ring; None: a row's one
    ring)."""
    last = None
    if valid is None and tables is not None:  # every token real (a ragged step's group)
        last, valid = int(positions.max()), torch.ones_like(positions, dtype=torch.bool)
        n_keys, write_index = last + 1, table_slots(tables, positions)
    else:
        valid = torch.ones_like(positions, dtype=torch.bool) if valid is None else valid
        n_keys = int(torch.where(valid, positions, 0).max()) + 1 if positions.numel() else 1  # no valid token: 1
        slots = positions if tables is None else table_slots(tables, torch.where(valid, positions, 0))
        write_index = torch.where(valid, slots, trash_slot)
    cos, sin = rope_cos_sin(spec, positions, dtype, last)
    sizes = ring_sizes(spec)
    if tables is not None and rings is None and sizes:
        raise ValueError("a pooled step of a model with ring layers needs each sequence's ring (rings)")
    return Step(positions=positions, write_index=write_index, valid=valid, n_keys=n_keys, cos=cos, sin=sin, rows=rows,
                phase=phase, sliding_window=step_windows(spec), tables=tables,
                rings={r: RingIndex.of(r, positions, valid, rings) for r in sizes})


def table_slots(tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[B, S] slots in their rows of positions [B, S] through the sequences' block tables [B, M]."""
    return tables.gather(1, positions // KV_BLOCK) + positions % KV_BLOCK


def extent_tables(bases, n_keys: int) -> torch.Tensor:
    """[B, M] long: the block tables of contiguous extents from slots bases [B], covering n_keys positions."""
    n_blocks = max(1, -(-n_keys // KV_BLOCK))
    return torch.as_tensor(bases, dtype=torch.long)[:, None] + KV_BLOCK * torch.arange(n_blocks)[None]


def ring_sizes(spec: ModelSpec) -> tuple[int, ...]:
    """The distinct ring sizes of the model's ring layers (none: every layer keeps every position)."""
    return tuple(sorted({ring_slots(w) for w in set(spec.variant.layer_windows) if w is not None}))


def step_windows(spec: ModelSpec) -> int | None | tuple:
    """A step's sliding_window: the model's, or each distinct window where its layers differ (Gemma 2/3)."""
    return spec.windows if spec.variant.layer_windows else spec.sliding_window


def ragged_step(spec: ModelSpec, dtype: torch.dtype, groups: list[tuple[torch.Tensor, ...]],
                trash_slot: int, phase: str) -> Step:
    """A ragged step over one pooled cache row: groups of (positions [b, s], tables [b, m], rings [b] (where the model
    has ring layers), and a verified tree's parents (else None)), each b == 1 or s == 1 and every token real; the
    tokens of the groups follow one another in the flat row."""
    parts, offsets, at = [], [], 0
    for positions, tables, *rest in groups:
        b, s = positions.shape
        if b != 1 and s != 1:
            raise ValueError(f"a ragged step's groups are [b, 1] or [1, s] grids, found [{b}, {s}]")
        part = make_step(spec, dtype, positions, None, trash_slot, torch.zeros(b, dtype=torch.long), phase, tables,
                         rest[0] if rest else None)
        parts.append(part if len(rest) < 2 or rest[1] is None else tree_step(spec, part, rest[1]))
        offsets.append(at)
        at += b * s
    flat = lambda name: _cat([getattr(g, name).reshape(1, -1) for g in parts], 1)  # noqa: E731
    cos = _cat([g.cos.permute(1, 0, 2, 3).reshape(1, 1, -1, g.cos.shape[-1]) for g in parts], 2)
    sin = _cat([g.sin.permute(1, 0, 2, 3).reshape(1, 1, -1, g.sin.shape[-1]) for g in parts], 2)
    return _ragged(parts, offsets, flat("positions"), flat("write_index"), flat("valid"), cos, sin, phase,
                   step_windows(spec))


def _cat(tensors: list[torch.Tensor], dim: int) -> torch.Tensor:
    """torch.cat, but one tensor as it is (a decode step's one group: no copies)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=dim)


def tree_step(spec: ModelSpec, group: Step, parents: tuple[int, ...]) -> Step:
    """A verified tree's group ([1, 1 + n]: the sequence's last token, then n proposals, parents[i] the proposal
    that proposal i follows, -1 the last token; positions by depth): proposal i writes its K and V at the key one
    past the last token's plus i, and each token sees the sequence's keys up to the last token and then its
    ancestors' and its own (its key map, where those are not at their positions)."""
    if ring_sizes(spec):
        raise ValueError("a tree of proposals needs every layer to keep every position (this model has ring "
                         "layers); propose chains")
    positions = group.positions[0].tolist()
    maps = tree_key_maps(positions[0], parents)
    keys = [p if m is None else m[-1] for p, m in zip(positions, maps)]
    group.write_index = table_slots(group.tables, torch.tensor([keys]))
    group.n_keys, group.key_maps = max(keys) + 1, maps
    group._mask = tree_mask(positions, maps, group.n_keys, group.sliding_window)
    return group


def tree_key_maps(base: int, parents: tuple[int, ...]) -> tuple:
    """Each token's key map of a tree after the token at position base (its own: None): a proposal's keys from
    base + 1 on, its ancestors' and its own (proposal i at key base + 1 + i), or None where they are at their
    positions (its path is proposals 0, 1, .. in order)."""
    paths, maps = [], [None]
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"proposal {i} follows {parent}: a tree's proposals follow one before them")
        paths.append((() if parent < 0 else paths[parent]) + (base + 1 + i,))
        path = paths[-1]
        maps.append(None if path == tuple(range(base + 1, base + 1 + len(path))) else path)
    return tuple(maps)


def tree_n_keys(positions: list[int], maps: tuple) -> int:
    """Keys a tree's tokens see: up to the last key any of them writes."""
    return max(p if m is None else m[-1] for p, m in zip(positions, maps)) + 1


def tree_mask(positions: list[int], maps: tuple, n_keys: int, window) -> torch.Tensor:
    """[1, n_windows, S, n_keys] bool: each tree token sees the keys before its map and its map's (within a
    window, by position), one mask per window where the model's layers differ (step_windows)."""
    if isinstance(window, tuple):
        return torch.cat([tree_mask(positions, maps, n_keys, w) for w in window], dim=1)
    keys = torch.arange(n_keys)
    rows = []
    for pos, path in zip(positions, maps):
        start = pos + 1 - (0 if path is None else len(path))  # keys from here on are the map's
        row = keys < start
        if path is not None:
            row[list(path)] = True
        if window is not None:  # by position: key j's is j before the map, the map's in order after
            seen = keys <= pos - window
            if path is not None:
                seen[list(path)] = torch.arange(start, pos + 1) <= pos - window
            row &= ~seen
        rows.append(row)
    return torch.stack(rows)[None, None]

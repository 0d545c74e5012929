"""The fused layer's token tables: for each new token of a step, where its K and V go in the cache and which keys
it sees, and the sequences' block tables as flat slots (offload/kernels/layer.py's StepTable holds them)."""

from __future__ import annotations

import torch

from offload.attention_sizes import KV_BLOCK
from offload.errors import KernelError


def token_table(step, n_rows: int, n_slots: int,
                sliding_window: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B * S, 5] int64 per new token: flat KV slot (-1: padding), flat slot of its sequence's key 0 (its row,
    plus its base in a pooled cache; with block tables: where its sequence's table begins in blocks), first and
    last key it sees, and -1 or where its key map begins in blocks (a tree's token: [t, its last t keys' places]);
    the same keys as step.attention_mask (padding tokens see key 0 only). And blocks: a pooled step's block tables
    as flat slots (row * n_slots + each block's slot), one sequence's after another, else None; then the key maps.
    A ragged step's tables are its groups' one after another.

    Built from Python lists: a decode step has a few tokens, where a dozen tiny tensor ops would cost more
    than the table is worth."""
    groups = step.groups if step.groups is not None else (step,)
    parts, blocks = [], [] if any(g.tables is not None for g in groups) else None
    for g in groups:
        parts += _group_tokens(g, n_rows, n_slots, sliding_window, blocks)
    tokens = torch.tensor(parts, dtype=torch.long) if parts else torch.empty(0, 5, dtype=torch.long)
    return tokens, (torch.tensor(blocks, dtype=torch.long) if blocks else None)


def _group_tokens(step, n_rows: int, n_slots: int, sliding_window: int | None, blocks: list[int] | None) -> list[tuple]:
    """token_table's rows of a plain step, its block tables appended to blocks (where given: a group without tables
    adds contiguous ones)."""
    positions, write_index = step.positions.tolist(), step.write_index.tolist()
    b = len(positions)
    rows = list(range(b)) if step.rows is None else step.rows.tolist()
    if len(rows) != b or any(not 0 <= r < n_rows for r in rows):
        raise KernelError(f"fused layer: step rows {rows} do not fit a KV cache of {n_rows} rows for "
                          f"a batch of {b}; allocate the cache with more rows")
    tables = None if step.tables is None else step.tables.tolist()
    if tables is None and blocks is not None:
        tables = [list(range(0, step.n_keys, KV_BLOCK))] * b
    # the last key each row's table must hold: its last position's (a tree's keys lie past its positions)
    last = [step.n_keys - 1] * b if step.key_maps is not None else [max(p) for p in positions]
    if tables is not None and any(not 0 <= t < n_slots - 1 for table, reach in zip(tables, last)
                                  for t in table[: reach // KV_BLOCK + 1]):
        raise KernelError(f"fused layer: a block table names slots outside the KV cache's {n_slots - 1}; "
                          f"build the step from the pool's extents")
    maps = step.key_maps or (None,) * len(positions[0])
    if step.key_maps is not None and (blocks is None or b != 1):
        raise KernelError("fused layer: a tree's tokens need their sequence's block table (one sequence a group)")
    out = []
    for i, (row, row_positions, row_slots) in enumerate(zip(rows, positions, write_index)):
        if blocks is None:
            first = row * n_slots
        else:
            first = len(blocks)
            blocks += [row * n_slots + t for t in tables[i]]
        for pos, slot, path in zip(row_positions, row_slots, maps):
            if slot == n_slots - 1:  # padding writes to the trash slot T
                out.append((-1, first, 0, 0, -1))
                continue
            if not 0 <= slot < n_slots - 1 or (blocks is None and pos >= n_slots - 1):
                raise KernelError(f"fused layer: positions reach past the KV cache's {n_slots - 1} slots; "
                                  f"allocate the cache with a larger max_len")
            at = -1
            if path is not None:
                at = len(blocks)
                blocks += [len(path), *path]
            out.append((row * n_slots + slot, first, 0 if sliding_window is None else max(pos - sliding_window + 1, 0),
                        pos, at))
    return out


def ring_token_table(step, n_rows: int, n_slots: int, ring: int) -> tuple[torch.Tensor, torch.Tensor]:
    """token_table's rows and block tables for a ring layer's cache of ring slots a sequence: a token writes at its
    ring slot and sees keys 0.. its position (the layer's window cuts them in C++), found through a table whose
    blocks wrap around the sequence's ring (key j at first + j % ring, as offload.model.attention.ring_table)."""
    groups = step.groups if step.groups is not None else (step,)
    tokens, blocks = [], []
    for g in groups:
        rings = g.rings[ring]
        positions, writes, first = g.positions.tolist(), rings.writes.tolist(), rings.first.tolist()
        rows = list(range(len(positions))) if g.rows is None else g.rows.tolist()
        for row, start, row_positions, row_writes in zip(rows, first, positions, writes):
            at, base = len(blocks), row * n_slots + start
            blocks += [base + (KV_BLOCK * j) % ring for j in range(max(row_positions) // KV_BLOCK + 1)]
            for pos, slot in zip(row_positions, row_writes):
                tokens.append((-1, at, 0, 0, -1) if slot < 0 else (row * n_slots + slot, at, 0, pos, -1))
    return torch.tensor(tokens, dtype=torch.long).view(-1, 5), torch.tensor(blocks, dtype=torch.long)

"""The KV pool: one cache row's token slots, handed out in blocks of KV_BLOCK slots (vLLM's paged KV). A sequence's
block table lists the blocks the prefix cache maps at its front, then its own (offload.sequence.Sequence.table); its
blocks lie anywhere in the row, so a pool with n free blocks admits any sequence that needs n, however the frees fell.
The engine holds one for the model, a draft model's drafter one for the draft."""

from __future__ import annotations

import torch

from offload.attention_sizes import KV_BLOCK, kv_blocks


def block_slots(blocks: list[int]) -> torch.Tensor:
    """The slots of blocks' keys, block after block (long, on the host)."""
    return (torch.tensor(blocks, dtype=torch.long)[:, None] + torch.arange(KV_BLOCK)[None]).reshape(-1)


def pool_capacity(kv_tokens: int, context_len: int) -> int:
    """The slots of a pool within kv_tokens (less the trash slot), in whole blocks, and never fewer than one sequence
    of the whole context needs."""
    return KV_BLOCK * max((kv_tokens - 1) // KV_BLOCK, kv_blocks(context_len - 1))


class KVPool:
    """The blocks of one cache row of `capacity` slots (a multiple of KV_BLOCK), lowest free slots first."""

    def __init__(self, capacity: int):
        if capacity % KV_BLOCK:
            raise ValueError(f"a KV pool's capacity is whole blocks of {KV_BLOCK} slots, got {capacity}")
        self.capacity = capacity
        self.free = list(range(0, capacity, KV_BLOCK))  # first slot of each free block, ascending

    def alloc(self, n: int) -> list[int] | None:
        """The first slots of the blocks that hold n slots (the lowest free ones, ascending), or None when fewer are
        free."""
        k = kv_blocks(n)
        if k > len(self.free):
            return None
        taken, self.free = self.free[:k], self.free[k:]
        return taken

    def release(self, blocks: list[int]) -> None:
        """Give blocks back (each once: a block given back twice is a bug in whoever held it)."""
        if not blocks:
            return
        free = set(self.free)
        if len(free.union(blocks)) != len(free) + len(set(blocks)) or len(set(blocks)) != len(blocks):
            raise ValueError(f"KV blocks given back twice: {sorted(free.intersection(blocks))[:4]}")
        self.free = sorted(self.free + list(blocks))

    @property
    def n_free(self) -> int:
        """Free slots (whole blocks)."""
        return len(self.free) * KV_BLOCK

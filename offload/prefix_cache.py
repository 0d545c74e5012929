"""The prefix cache: prompts that begin as earlier ones did take those tokens' K and V instead of computing them
(vLLM's automatic prefix caching, llama.cpp's prompt cache).

A sequence's tokens are cut into blocks of BLOCK_TOKENS, each named by a hash of every token up to its end (a
chain: a block's name says its whole prefix, as vLLM's block hashes do). The index maps a name to where that
block's K and V lie:
- in a running sequence's own blocks, from the step its prompt chunk was cached (a request whose next block is still
  being prefilled by another waits for that prefill instead of computing the block again);
- in a kept run of a finished sequence's blocks: when a sequence ends, its full blocks not already indexed stay in
  the pool (the rest of its blocks are freed), until the pool needs the room;
- in the host tier: runs the pool evicts move to host RAM while the tier's bytes allow (a CPU budget the plan
  leaves free), and come back by copy on a hit.
A hit maps the leading blocks that kept runs hold in the pool or running sequences hold as their own into the
new sequence's block table (vLLM's shared blocks: no copy) and copies the rest (the host tier's) into its own
blocks. Mapped blocks are lent: a kept run is pinned while a table maps it, and a running sequence that lent blocks
keeps them as a pinned kept run when it leaves, however it ended (they were computed before they were lent). The
new sequence's prefill starts after its hit, and its last prompt token is always computed, for its logits.
Eviction from the pool goes by block: the least recently used kept run first (a run is a request's
blocks), its deepest block first, never a pinned run (one a table maps or a hit copies from); the host tier drops
whole runs, least recently used first.

Models whose sliding layers keep a ring of their window (offload.spec.ModelSpec.kv_ring: Gemma 2/3, gpt-oss) cache
too: a hit of P tokens needs, of each ring layer, the keys of the window before P, which the ring of the hit's last
holder still has while that holder has written fewer than P + ring - window keys (a chat's next turn, which takes
all of the last one; a prompt's waiters, while its prefill has not gone further than that). The hit is cut to the
blocks whose holder's ring still has them, and those ring slots are copied into the new sequence's ring. A kept run
holds its sequence's ring (the engine takes one back, least recently used run first, when a new request needs it);
their runs stay in the pool, with no host tier; their hits are copied, not mapped.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import torch

from offload.attention_sizes import KV_BLOCK
from offload.kv_pool import KVPool, block_slots
from offload.sequence import Sequence

BLOCK_TOKENS = KV_BLOCK  # tokens per cached block: the pool's blocks (vLLM's default block_size)


def block_names(tokens: list[int], n_blocks: int) -> Iterator[bytes]:
    """The chained names of tokens' first n_blocks blocks, one by one: each a digest of the one before it and its
    own tokens."""
    prev, ids = b"", np.asarray(tokens[: n_blocks * BLOCK_TOKENS], dtype=np.int64)
    for i in range(n_blocks):
        prev = _chained(prev, ids[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS])
        yield prev


def _chained(prev: bytes, ids: np.ndarray) -> bytes:
    """A block's name: a digest of the name before it and its own token ids (int64)."""
    return hashlib.blake2b(prev + ids.tobytes(), digest_size=16).digest()


def prompt_block_name(seq: Sequence, i: int) -> bytes:
    """The name of block i of seq's prompt, computed once per request (a request waiting behind another's prefill
    is looked up again every step): seq.prefix_names holds those named so far."""
    names = seq.prefix_names
    while len(names) <= i:
        at = len(names) * BLOCK_TOKENS
        names.append(_chained(names[-1] if names else b"", np.asarray(seq.prompt_ids[at: at + BLOCK_TOKENS],
                                                                      dtype=np.int64)))
    return names[i]


@dataclass(eq=False)
class Kept:
    """Blocks first.. first + len(names) - 1 of a finished sequence: in the pool's blocks at slots (one per name),
    or in host RAM (slots None; host: per layer, K and V of the run's tokens)."""

    names: list[bytes]
    first: int
    slots: list[int] | None
    last_used: float
    host: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    pins: int = 0
    ring: int | None = None  # a ring model's: the ring it holds in the ring layers' pooled rows
    written: int = 0  # ... and the keys its sequence wrote there

    @property
    def n_slots(self) -> int:
        return len(self.names) * BLOCK_TOKENS


@dataclass
class Hit:
    """What a lookup found: the blocks from the first on, each (holder, its block index); waits: the next block is
    being prefilled by a running sequence."""

    blocks: list[tuple[object, int]] = field(default_factory=list)
    waits: bool = False

    @property
    def n_tokens(self) -> int:
        return len(self.blocks) * BLOCK_TOKENS


class PrefixCache:
    """The index of cached blocks over one engine's pool and cache, with its host tier of host_bytes."""

    def __init__(self, cache: list, pool: KVPool, host_bytes: int = 0, clock=time.monotonic,
                 carried: list[Kept] = (), windows: list[int | None] = (), free_rings: list[int] | None = None):
        """carried: host-tier runs an earlier engine's cache left (to_host), indexed again here; windows: each
        layer's window, where its cache is a ring; free_rings: the engine's rings no sequence holds, where a kept
        run's ring goes back when it is dropped."""
        self.rings = [(layer, window) for layer, window in zip(cache, windows) if layer.ring is not None]
        if self.rings:  # a ring model keeps runs in the pool only (its rings are not carried or copied out)
            host_bytes, carried = 0, ()
        self.cache, self.pool, self.host_bytes, self.clock = cache, pool, host_bytes, clock
        self.free_rings = free_rings if free_rings is not None else []
        self.index: dict[bytes, tuple[object, int]] = {}  # name -> (a running Sequence or a Kept, block index)
        self._running: dict[int, list[bytes]] = {}  # id(sequence) -> the names it holds in the index
        self._mapped: dict[int, list] = {}  # id(sequence) -> the holders (Kept, Sequence) its table maps blocks of
        self._lent: dict[int, list[int]] = {}  # id(running sequence) -> [tables mapping its blocks, blocks lent]
        self.kept: list[Kept] = []  # in the pool or the host tier
        for kept in carried:
            self.kept.append(kept)
            for i, name in enumerate(kept.names):
                self.index.setdefault(name, (kept, kept.first + i))
        self.queries = self.hits = 0  # prompt tokens looked up, and found
        self.token_bytes = sum(t.shape[2] * t.shape[3] * t.element_size() for layer in cache for t in (layer.k, layer.v))

    @property
    def pool_slots(self) -> int:
        """Pool slots that kept runs no request maps hold (free to any request that needs them)."""
        return sum(k.n_slots for k in self.kept if k.slots is not None and not k.pins)

    @property
    def host_used(self) -> int:
        return sum(k.n_slots for k in self.kept if k.slots is None) * self.token_bytes

    def lookup(self, seq: Sequence) -> Hit:
        """The longest run of seq's prompt blocks in the index, all but its last token (seq without prompt
        logprobs: those need every prompt token's logits)."""
        hit = Hit()
        if seq.params.prompt_logprobs is not None:
            return hit
        for i in range((len(seq.prompt_ids) - 1) // BLOCK_TOKENS):
            holder, block = self.index.get(prompt_block_name(seq, i), (None, -1))
            if holder is None:
                break
            if isinstance(holder, Sequence) and holder.n_cached < (block + 1) * BLOCK_TOKENS:
                hit.waits = True
                break
            hit.blocks.append((holder, block))
        self._fit_rings(hit)
        return hit

    def refit(self, hit: Hit) -> Hit:
        """hit cut before its first block of a run dropped since the lookup (a ring the engine took back: only a
        ring model's runs go while a hit pins them)."""
        if not self.rings:
            return hit
        alive = {id(k) for k in self.kept}
        gone = next((i for i, (h, _) in enumerate(hit.blocks) if isinstance(h, Kept) and id(h) not in alive),
                    len(hit.blocks))
        del hit.blocks[gone:]
        self._fit_rings(hit)
        return hit

    def _fit_rings(self, hit: Hit) -> None:
        """A ring model's hit cut to the blocks whose last holder's ring still has the window before them."""
        while self.rings and hit.blocks and not self._ring_holds(hit.blocks[-1][0], hit.n_tokens):
            hit.blocks.pop()

    def _ring_holds(self, holder, n: int) -> bool:
        """Whether holder's ring has, in every ring layer, the keys of the window before position n."""
        if holder.ring is None:
            return False
        written = _written(holder)
        return all(max(0, written - layer.ring) <= max(0, n - window + 1) for layer, window in self.rings)

    def reclaim_ring(self) -> bool:
        """Drop the least recently used kept run that holds a ring (one no hit copies from first), its ring back to
        the engine; False where none holds one."""
        holders = [k for k in self.kept if k.ring is not None]
        if not holders:
            return False
        self._drop(min(holders, key=lambda k: (k.pins > 0, k.last_used)))
        return True

    def pin(self, hit: Hit, by: int) -> None:
        """Keep (by=1) or release (by=-1) the kept runs a hit takes blocks from from eviction (while the request is
        admitted)."""
        for holder in _holders(hit.blocks):
            if isinstance(holder, Kept):
                holder.pins += by

    def mappable(self, hit: Hit) -> int:
        """How many of a hit's leading blocks a table can map where they are: those of kept runs in the pool and of
        running sequences (a ring model's hits are copied: a ring the engine takes back may cut them)."""
        if self.rings:
            return 0
        return next((i for i, (h, _) in enumerate(hit.blocks) if isinstance(h, Kept) and h.slots is None),
                    len(hit.blocks))

    def alloc(self, n: int) -> list[int] | None:
        """The pool's blocks for n slots, evicting kept blocks while too few are free: least recently used first,
        and of a run the deepest block first (vLLM's order: the head a system prompt or a few-shot prefix shares
        with many prompts stays longest); a pinned run (mapped by a table, or a hit's) is never touched."""
        while (blocks := self.pool.alloc(n)) is None:
            victims = [k for k in self.kept if k.slots is not None and not k.pins]
            if not victims:
                return None
            self._evict(self._tail(min(victims, key=lambda k: k.last_used)))
        return blocks

    def _tail(self, kept: Kept) -> Kept:
        """A pool run's last block as a run of its own (the run itself where it has one block), indexed in its
        place."""
        if len(kept.names) == 1:
            return kept
        name, at = kept.names.pop(), kept.first + len(kept.names)
        tail = Kept([name], at, [kept.slots.pop()], kept.last_used)
        if self.index.get(name, (None,))[0] is kept:
            self.index[name] = (tail, at)
        self.kept.append(tail)
        return tail

    def take(self, seq: Sequence, hit: Hit, mapped: int = 0) -> None:
        """A hit's first mapped blocks into the tables of seq's samples (admitted, each one's own blocks after them)
        and the rest copied into seq's own blocks: its prompt is cached up to them."""
        now = self.clock()
        self.queries += len(seq.prompt_ids)
        shared = [_slot_of(h, block) for h, block in hit.blocks[:mapped]]
        runs: list[list] = []  # [holder, first block, n blocks]
        for holder, block in hit.blocks:
            if isinstance(holder, Kept):
                holder.last_used = now
            if runs and runs[-1][0] is holder and runs[-1][1] + runs[-1][2] == block:
                runs[-1][2] += 1
            elif block >= mapped:
                runs.append([holder, block, 1])
        for holder, block, n in runs:
            self._copy(holder, block, n, seq.blocks[block - mapped: block - mapped + n])
        for sample in seq.group:
            sample.shared = list(shared)
            self._mapped[id(sample)] = _holders(hit.blocks[:mapped])
            for holder in self._mapped[id(sample)]:
                self._lend(holder, 1, max(b + 1 for h, b in hit.blocks[:mapped] if h is holder))
        if self.rings and hit.blocks:
            self._copy_ring(hit.blocks[-1][0], hit.n_tokens, seq.ring)
        seq.n_cached = seq.n_prefix_hit = hit.n_tokens
        self.hits += hit.n_tokens

    def _lend(self, holder, by: int, n_blocks: int = 0) -> None:
        """One more (by=1) or one fewer (by=-1) table maps holder's blocks (a running sequence's: its first
        n_blocks)."""
        if isinstance(holder, Kept):
            holder.pins += by
            return
        lent = self._lent.setdefault(id(holder), [0, 0])
        lent[0], lent[1] = lent[0] + by, max(lent[1], n_blocks)

    def _copy(self, holder, block: int, n: int, dst: list[int]) -> None:
        """holder's n blocks from block on into the pool's blocks dst (one per block)."""
        to = block_slots(dst)
        if isinstance(holder, Kept) and holder.slots is None:
            at = (block - holder.first) * BLOCK_TOKENS
            for layer, saved in zip(self.cache, holder.host):
                to_ = to.to(layer.k.device)
                for t, h in zip((layer.k, layer.v), saved):
                    t[0, to_] = h[at: at + len(to)].to(t.device)
            return
        src = block_slots([_slot_of(holder, b) for b in range(block, block + n)])
        for layer in (layer for layer in self.cache if layer.ring is None):
            to_, src_ = to.to(layer.k.device), src.to(layer.k.device)
            for t in (layer.k, layer.v):
                t[:, to_] = t[:, src_]

    def _copy_ring(self, holder, n: int, ring: int) -> None:
        """The keys before position n that holder's ring has into ring, in each ring layer (position p at slot
        p % size of a ring)."""
        written = _written(holder)
        for layer, _ in self.rings:
            size = layer.ring
            at = torch.arange(max(0, n - size, written - size), n, device=layer.k.device) % size
            for t in (layer.k, layer.v):
                t[0, ring * size + at] = t[0, holder.ring * size + at]

    def add_running(self, seq: Sequence) -> None:
        """Index seq's prompt blocks that are not yet (they are hits from the step their chunk is cached)."""
        names = [prompt_block_name(seq, i) for i in range(len(seq.prompt_ids) // BLOCK_TOKENS)]
        mine = [name for i, name in enumerate(names) if self.index.setdefault(name, (seq, i))[0] is seq]
        self._running[id(seq)] = mine

    def release(self, seq: Sequence, keep: bool) -> bool:
        """seq left: give back the blocks its table maps; keep its own full blocks that no one else holds in the
        pool (keep: it ended as it should; its tokens' K and V are all written; and those it lent, however it
        ended) and free the rest of its own blocks; else free them all. Whether the kept run holds seq's ring (a ring
        model's: else the engine takes it back)."""
        for holder in self._mapped.pop(id(seq), []):
            self._lend(holder, -1)
        n_maps, n_lent = self._lent.pop(id(seq), (0, 0))
        for name in self._running.pop(id(seq), []):
            if self.index.get(name, (None,))[0] is seq:
                del self.index[name]
        tokens, n_shared = seq.prompt_ids + seq.output_ids, len(seq.shared)
        n_full = (seq.n_tokens - 1) // BLOCK_TOKENS if keep and seq.prefilled else 0
        if n_maps:  # the blocks it lent stay, pinned, whatever else does
            n_full = max(n_full, n_lent)
        names = list(block_names(tokens, n_full))
        first = next((i for i, name in enumerate(names) if name not in self.index), n_full)
        if first >= n_full or n_full <= n_shared:
            self.pool.release(seq.blocks)
            return False
        first = max(first, n_shared)
        own = seq.blocks  # its blocks from block n_shared on
        kept = Kept(names[first:], first, own[first - n_shared: n_full - n_shared], self.clock())
        if self.rings:
            kept.ring, kept.written = seq.ring, seq.n_tokens - 1  # its last token was sampled, never written
        for i, name in enumerate(kept.names):
            self.index.setdefault(name, (kept, first + i))
        self.kept.append(kept)
        if n_maps:  # the tables that map its blocks now map the kept run's
            kept.pins += n_maps
            for holders in self._mapped.values():
                holders[:] = [kept if h is seq else h for h in holders]
        self.pool.release(own[: first - n_shared] + own[n_full - n_shared:])
        return bool(self.rings)

    def to_host(self) -> list[Kept]:
        """Move the pool's kept runs to the host tier, most recently used first, while it has room (the rest are
        dropped): what a later engine over another pool takes as carried. A cache with layers on a device keeps
        none (copying them back would stall the device's stream at the end of every call)."""
        on_host = all(t.device.type == "cpu" for layer in self.cache for t in (layer.k, layer.v))
        for kept in sorted((k for k in self.kept if k.slots is not None), key=lambda k: -k.last_used):
            if on_host and self.host_used + kept.n_slots * self.token_bytes <= self.host_bytes:
                self._evict(kept)
            else:
                self._drop(kept)
        return list(self.kept)

    def _evict(self, kept: Kept) -> None:
        """Move a kept run from the pool to the host tier where the tier has room (evicting its least recently
        used runs), else drop it."""
        need = kept.n_slots * self.token_bytes
        while self.host_used + need > self.host_bytes:
            victims = [k for k in self.kept if k.slots is None and not k.pins]
            if not victims or need > self.host_bytes:
                break
            self._drop(min(victims, key=lambda k: k.last_used))
        if self.host_used + need <= self.host_bytes:
            at = block_slots(kept.slots)
            kept.host = [tuple(t[0, at.to(t.device)].to("cpu") for t in (layer.k, layer.v)) for layer in self.cache]
            self.pool.release(kept.slots)
            kept.slots = None
        else:
            self._drop(kept)

    def _drop(self, kept: Kept) -> None:
        for name in kept.names:
            if self.index.get(name, (None,))[0] is kept:
                del self.index[name]
        self.kept.remove(kept)
        if kept.slots is not None:
            self.pool.release(kept.slots)
        if kept.ring is not None:
            self.free_rings.append(kept.ring)
            kept.ring = None



def _written(holder) -> int:
    """Keys a holder's sequence has written (at most: a running one's last sampled token counts)."""
    if isinstance(holder, Kept):
        return holder.written
    return holder.n_tokens if holder.prefilled else holder.n_cached


def _slot_of(holder, block: int) -> int:
    """The pool slot of block's first key where a kept run in the pool or a running sequence holds it (a running
    one's prompt blocks past those its table maps are its own)."""
    if isinstance(holder, Kept):
        return holder.slots[block - holder.first]
    return holder.blocks[block - len(holder.shared)]



def _holders(blocks: list[tuple[object, int]]) -> list:
    """blocks' holders (kept runs and running sequences), each once."""
    return list({id(h): h for h, _ in blocks}.values())

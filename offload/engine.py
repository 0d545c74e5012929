"""The engine loop: requests join and leave one continuous batch while it steps.

An Engine holds a KV pool for its life and two queues of requests waiting for slots: interactive ones, and
background ones (a server's batches) admitted only while no interactive one waits. Each `step()` drops the
requests aborted since the last one, admits waiting ones first come first served while their KV blocks fit, and
runs one mixed step of the generator (offload/generate.py) over every request in flight: one pass over the
weights serves them all. `add` and `abort` may be called from other threads while a step runs (a server's
event loop); the steps themselves run in one thread at a time. `run_to_end` is this loop over a fixed list.
The engine calls the generator; the generator knows nothing of engines.

A request with n > 1 samples is a group of n sequences admitted together: the first prefills the prompt, the
others wait, and in the step where the prompt is in the cache they copy its K and V into their own blocks and
sample their first token from the same logits (the prompt's prefill is computed once). The group leaves the
engine when its last sample ends; each sample's blocks are freed as it ends.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator

from offload.attention_sizes import KV_BLOCK, kv_blocks
from offload.errors import ConfigError, QueueFull, SamplingError
from offload.generate import Generator
from offload.kv_pool import KVPool, pool_capacity
from offload.prefix_cache import Hit, PrefixCache
from offload.sampling import SamplingParams
from offload.sequence import Sequence

ABORT = "abort"  # the finish_reason of a request aborted before it finished (vLLM's)


def kv_extent(seq: Sequence, context_len: int) -> int:
    """KV slots a sequence needs at most: every token but the last one sampled is written to the cache."""
    return min(len(seq.prompt_ids) + seq.params.max_tokens, context_len) - 1


@dataclass
class StepOutput:
    """What one step did: the token ids each sample sampled in it, and the requests that left the batch (finished,
    or aborted with finish_reason 'abort'; for n > 1, the first sample, once every one has ended)."""

    tokens: list[tuple[Sequence, list[int]]] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)


def run_to_end(generator: Generator, seqs: list[Sequence],
               on_finish: Callable[[Sequence], None] | None = None) -> None:
    """Generate until every sequence has finished, in an engine whose pool is what they need at most (within the
    generator's kv_tokens), prompts that begin alike side by side where the prefix cache is on; on_finish is called
    as each one does."""
    for seq in seqs:
        _check_named(generator, seq)
    if not seqs:
        return
    # the pool's blocks, with its trash slot within kv_tokens; the longest request always fits
    extents = [(kv_blocks(kv_extent(s, generator.context_len)), s.params.n) for s in seqs]  # n samples: n each
    largest = sorted((e for e, n in extents for _ in range(n)), reverse=True)
    whole = max(e * n for e, n in extents)  # one request's samples are admitted together
    n_blocks = max(min((generator.kv_tokens - 1) // KV_BLOCK, sum(largest[: generator.max_batch_size])), whole)
    engine = Engine(generator, kv_slots=KV_BLOCK * n_blocks)
    # with the prefix cache, prompts that begin alike run close together (sorted by their tokens), so their shared
    # blocks are still cached when the next one starts
    for seq in sorted(seqs, key=lambda s: s.prompt_ids) if engine.prefix is not None else seqs:
        engine.submit(seq)
    try:
        engine.run_until_done(on_finish)
    finally:  # the next call's engine has a pool of its own: the kept runs it may take are in the host tier
        if engine.prefix is not None:
            generator.prefix_carried = engine.prefix.to_host()


def _check_named(generator: Generator, seq: Sequence) -> None:
    """The generator's check of seq's prompt, its error naming the prompt by its request id."""
    try:
        generator.check_prompt(seq.prompt_ids, seq.params)
    except ConfigError as e:
        raise ConfigError(f"prompts[{seq.request_id}]: {e}") from None
    except SamplingError as e:
        raise SamplingError(f"prompts[{seq.request_id}]: {e}", e.param) from None


def prefix_cache_of(generator: Generator, cache: list, pool: KVPool, free_rings: list[int]) -> PrefixCache | None:
    """The generator's prefix cache over an engine's pool and its rings no sequence holds (None: turned off)."""
    if not generator.prefix_caching:
        return None
    spec = generator.model.spec
    return PrefixCache(cache, pool, generator.prefix_host_bytes, carried=generator.prefix_carried,
                       windows=[spec.window(i) for i in range(len(cache))], free_rings=free_rings)


class Engine:
    """Steps a Generator over the requests in flight, admitting new ones as slots free (continuous batching)."""

    def __init__(self, generator: Generator, *, max_waiting: int | None = None, kv_slots: int | None = None):
        """max_waiting: requests that may wait for a slot at once (None:
        no bound); kv_slots: the pool's slots, rounded up to whole blocks (None: the generator's kv_tokens, its
        plan's batch at the whole context, less the trash slot, in whole blocks; never fewer than one sequence of
        the whole context needs)."""
        if max_waiting is not None and max_waiting < 1:
            raise ConfigError(f"max_waiting must be 1 or more (None for no bound), got {max_waiting}")
        self.generator = generator
        self.max_waiting = max_waiting
        self.capacity = KV_BLOCK * kv_blocks(kv_slots) if kv_slots else \
            pool_capacity(generator.kv_tokens, generator.context_len)
        self.pool = KVPool(self.capacity)
        # slot `capacity` takes the writes of padding; a ring layer holds a ring per sequence that may run at once
        self.cache = generator.model.new_cache(1, self.capacity, generator.max_batch_size)
        self._rings = list(range(generator.max_batch_size))  # the rings no running sequence holds
        self.prefix = prefix_cache_of(generator, self.cache, self.pool, self._rings)
        self._waiting: deque[Sequence] = deque()
        self._background: deque[Sequence] = deque()  # admitted only while _waiting is empty; not bounded here
        self._running: list[Sequence] = []  # changed by the stepping thread only, under the lock
        self._in_flight: dict[int | str, Sequence] = {}  # waiting or running, by request id
        self._aborting: dict[int, Sequence] = {}  # running requests to drop at the next step, by id(first sample)
        self._left: list[Sequence] = []  # aborted while waiting: reported by the next step
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # notified when a request arrives
        self._stepping = threading.Lock()

    def add(self, request_id: int | str, prompt_ids: list[int], params: SamplingParams | None = None) -> Sequence:
        """Queue a request; its Sequence fills in as steps run. ConfigError if it cannot run (the prompt, or an id
        in flight); QueueFull if max_waiting requests wait already."""
        seq = Sequence(request_id, [int(t) for t in prompt_ids], params or SamplingParams())
        self.generator.check_prompt(seq.prompt_ids, seq.params)
        self.submit(seq)
        return seq

    def submit(self, seq: Sequence, background: bool = False) -> None:
        """Queue a Sequence whose prompt was checked (run_to_end checks a list first, naming each prompt).
        background: it waits behind every interactive request, and max_waiting does not count it (its feeder
        bounds how many it queues); a running sequence is never preempted either way."""
        seq.fork()
        for sample in seq.group:
            sample.extent = kv_extent(sample, self.generator.context_len)
        n = len(seq.group)
        if n > self.generator.max_batch_size:
            raise ConfigError(f"request {seq.request_id!r} asks for n={n} samples and the engine runs "
                              f"{self.generator.max_batch_size} sequences at once; lower n or raise the batch size")
        if n * KV_BLOCK * kv_blocks(seq.extent) > self.capacity:
            what = f"{n} samples of {seq.extent}" if n > 1 else f"{seq.extent}"
            raise ConfigError(f"request {seq.request_id!r} needs {what} KV slots (prompt + max_tokens) and the "
                              f"engine's pool has {self.capacity}; lower max_tokens{' or n' if n > 1 else ''} or "
                              f"give the engine more kv_slots")
        with self._lock:
            if seq.request_id in self._in_flight:
                raise ConfigError(f"request id {seq.request_id!r} is already in flight; give each request its own id")
            if not background and self.max_waiting is not None and len(self._waiting) >= self.max_waiting:
                raise QueueFull(f"{len(self._waiting)} requests are waiting, the engine's max_waiting; send request "
                                f"{seq.request_id!r} again once some have started, or raise max_waiting")
            (self._background if background else self._waiting).append(seq)
            self._in_flight[seq.request_id] = seq
            self._work.notify_all()

    def abort(self, request_id: int | str) -> None:
        """Stop a request: a waiting one leaves the queue now, a running one frees its slots at the next step; an
        id not in flight (unknown, or finished) is ignored."""
        with self._lock:
            seq = self._in_flight.get(request_id)
            if seq is None:
                return
            queue = next((q for q in (self._waiting, self._background) if any(s is seq for s in q)), None)
            if queue is not None:
                queue.remove(seq)
                del self._in_flight[request_id]
                for sample in seq.group:
                    sample.finish_reason = ABORT
                self._left.append(seq)
            else:
                self._aborting[id(seq)] = seq
            self._work.notify_all()

    def step(self) -> StepOutput:
        """One pass over the weights for every request in flight, after dropping the aborted ones and admitting
        waiting ones while their blocks fit; what was sampled and who left (nothing runs when nothing waits)."""
        with self._stepping:
            with self._lock:
                out = StepOutput(finished=self._drop_aborted())
                self._admit()
            if self._running:
                before = [len(s.output_ids) for s in self._running]
                self.generator.step(self._running, self.cache, self.capacity)
                out.tokens = [(s, s.output_ids[n:]) for s, n in zip(self._running, before) if len(s.output_ids) > n]
                with self._lock:
                    out.finished += self._release([s for s in self._running if s.finish_reason])
                if self.generator.between_steps is not None:
                    self.generator.between_steps()
            return out

    def steps(self) -> Iterator[StepOutput]:
        """Step while any request is in flight (the iterator form of run_until_done)."""
        while self.has_work():
            yield self.step()

    def run_until_done(self, on_finish: Callable[[Sequence], None] | None = None) -> None:
        """Step until no request is in flight; on_finish is called as each one leaves."""
        for out in self.steps():
            for seq in out.finished:
                if on_finish is not None:
                    on_finish(seq)

    def has_work(self) -> bool:
        with self._lock:
            return self._has_work()

    def wait_for_work(self, timeout_s: float | None = None) -> bool:
        """Block until a request is in flight or timeout_s passes; whether one is."""
        with self._work:
            return self._work.wait_for(self._has_work, timeout_s)

    @property
    def n_waiting(self) -> int:
        return len(self._waiting) + len(self._background)

    @property
    def n_running(self) -> int:
        return len(self._running)

    @property
    def kv_slots_used(self) -> int:
        """Slots running requests hold (and the kept blocks their tables map; not the prefix cache's other kept runs,
        which any request may take)."""
        return self.capacity - self.pool.n_free - (self.prefix.pool_slots if self.prefix is not None else 0)

    def _has_work(self) -> bool:
        return bool(self._waiting or self._background or self._running or self._left)

    def _admit(self) -> None:
        """Waiting requests in arrival order, interactive ones first, while the batch has room for all their samples
        and their blocks fit in the pool (an interactive head that does not fit holds the background ones back
        too); one whose prompt's next block another request is prefilling waits for it (those behind may pass)."""
        while (queue := self._waiting or self._background) and \
                len(self._running) + len(queue[0].group) <= self.generator.max_batch_size:
            seq, hit = self._next_of(queue)
            if seq is None or len(self._running) + len(seq.group) > self.generator.max_batch_size:
                break
            mapped = 0 if self.prefix is None else self.prefix.mappable(hit)  # blocks its table maps, not copies
            blocks = self._alloc(seq.group, hit, mapped)
            if blocks is None and hit.blocks and not self._running:  # the run its hit pins holds the blocks it
                hit, mapped = Hit(), 0  # needs, and nothing running will free others: it goes without the hit
                blocks = self._alloc(seq.group, hit, mapped)
            if blocks is None:
                break
            if self.prefix is not None:  # a ring the prefix cache gave back may have held the hit's blocks
                hit = self.prefix.refit(hit)
            queue.remove(seq)
            for sample, own in zip(seq.group, blocks):
                sample.blocks, sample.shared, sample.n_cached = own, [], 0
                sample.generator = sample.params.make_generator(sample.index)
                sample.ring = self._rings.pop()
                if sample.params.logprobs is not None:
                    sample.logprobs = []
                self._running.append(sample)
            if self.prefix is not None:
                self.prefix.take(seq, hit, mapped)
                self.prefix.add_running(seq)

    def _next_of(self, queue: deque[Sequence]) -> tuple[Sequence | None, Hit]:
        """The first request of queue not waiting for another's prefill of its prefix, and what the cache has of
        its prompt."""
        if self.prefix is None:
            return queue[0], Hit()
        for seq in queue:
            hit = self.prefix.lookup(seq)
            if not hit.waits:
                return seq, hit
        return None, Hit()

    def _alloc(self, group: list[Sequence], hit: Hit, mapped: int) -> list[list[int]] | None:
        """Each sample's own blocks (for its positions after the hit's first mapped blocks, which its table maps)
        and a free ring for each (the prefix cache gives up kept runs for them, not those the hit holds while
        others can), or None with nothing taken."""
        taken = []
        if self.prefix is not None:
            self.prefix.pin(hit, 1)
        for sample in group:
            n = max(0, sample.extent - KV_BLOCK * mapped)
            blocks = self.pool.alloc(n) if self.prefix is None else self.prefix.alloc(n)
            if blocks is None:
                break
            taken.append(blocks)
        rings = len(taken) == len(group) and self._free_rings(len(group))
        if self.prefix is not None:
            self.prefix.pin(hit, -1)
        if not rings:
            for blocks in taken:
                self.pool.release(blocks)
            return None
        return taken

    def _free_rings(self, n: int) -> bool:
        """Whether n rings are free, the prefix cache's kept runs giving theirs back as needed."""
        while len(self._rings) < n:
            if self.prefix is None or not self.prefix.reclaim_ring():
                return False
        return True

    def _drop_aborted(self) -> list[Sequence]:
        left, self._left = self._left, []
        # a step that raised may leave a sequence finished but not released: aborting it releases it
        aborted = [s for s in self._running if id(s.parent or s) in self._aborting]
        self._aborting.clear()
        for seq in aborted:
            seq.finish_reason = seq.finish_reason or ABORT
        return left + self._release(aborted)

    def _release(self, seqs: list[Sequence]) -> list[Sequence]:
        """Free the blocks of samples that ended; the requests whose every sample has now ended leave."""
        left, speculator = [], getattr(self.generator, "speculator", None)
        for seq in seqs:
            self._running.remove(seq)
            if self.prefix is None:
                self.pool.release(seq.blocks)
                self._rings.append(seq.ring)
            elif not self.prefix.release(seq, keep=seq.finish_reason in ("stop", "length")):
                self._rings.append(seq.ring)
            if speculator is not None:
                speculator.forget(seq)
            first = seq.parent or seq
            if first.done and first.request_id in self._in_flight:
                del self._in_flight[first.request_id]
                left.append(first)
        return left

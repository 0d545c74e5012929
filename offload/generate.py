"""The generator: continuous batching with chunked prefill and mixed steps over a pooled KV cache.

Each step carries one decode token of every running sequence that has its prompt in the cache, plus chunks of
the prompts of sequences still being prefilled, up to a token budget (the plan's tokens per pass over the
weights): one pass over the weights serves both, as vLLM's chunked-prefill scheduler does. A step is three
parts: the scheduler writes down what it holds (offload/schedule_step.py: a ScheduledStep), the runner computes
it (one ragged forward pass, then the rows of logits it names, in one pass over the lm_head), and the update
takes the logits (sampling, verifying proposals, prompt logprobs, the prompt chunks now cached). The KV cache is
one pool of token slots (offload/kv_pool.py); the loop that admits sequences into it and releases them is the
engine's (offload/engine.py), which steps a Generator; this module builds no engine.

`mixed=False` keeps the schedule offload had before (a step is all prompt chunks or all decode tokens, and
prompts go first): `scripts/bench_batch.py` runs both side by side.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable

import torch

from offload.attention_sizes import KV_BLOCK, pool_tokens
from offload.grammar import Constraints
from offload.kv_pool import block_slots
from offload.model.model import Model  # or a PlacedModel: same interface
from offload.model.step import ragged_step, ring_sizes
from offload.planner.types import DEFAULT_PREFILL_PASS_TOKENS
from offload.profile.timeline import StepShape
from offload.proposal_tree import kept_moves, move_kept
from offload.sampling import SamplingParams, runner_up, sample, token_logprobs
from offload.schedule_step import Proposal, ScheduledStep, decoding, prefills, schedule_step
from offload.sequence import Sequence
from offload.speculative import Speculator
from offload.weights.prompts import check_prompt_ids


@dataclass(frozen=True)
class StepLogits:
    """What the runner gives back: the logits of each row the step named, when it began and on how many threads
    it ran (as the executor set them for it)."""

    by_row: dict[int, torch.Tensor]  # row of the flat tokens -> [vocab] logits
    start_s: float
    threads: int


class Generator:
    """Runs sequences through a Model, at most max_batch_size at once, in steps of at most step_tokens tokens."""

    def __init__(self, model: Model, tokenizer=None, eos_ids: tuple[int, ...] = (), max_batch_size: int = 32,
                 max_model_len: int | None = None, step_tokens: int = DEFAULT_PREFILL_PASS_TOKENS,
                 kv_tokens: int | None = None, logits_rows: int | None = None, mixed: bool = True):
        """step_tokens: tokens one step (one pass over the weights) carries; kv_tokens: slots of the KV pool
        (None: max_batch_size sequences of the whole context); logits_rows: rows of logits computed at once
        (None: max_batch_size); mixed: decode tokens ride along with prompt chunks."""
        self.model = model
        self.step_tokens = max(step_tokens, max_batch_size)  # every running sequence's decode token fits a step
        self.now = getattr(model, "now", time.perf_counter)  # a simulated device keeps its own clock
        self.tokenizer = tokenizer
        self.eos_ids = set(eos_ids)
        self.max_batch_size = max_batch_size
        self.context_len = min(max_model_len or model.spec.max_position_embeddings,
                               model.spec.max_position_embeddings)
        self.kv_tokens = kv_tokens or pool_tokens(max_batch_size, self.context_len)
        self.logits_rows = logits_rows or max_batch_size
        self.mixed = mixed
        self.between_steps: Callable[[], None] | None = None  # called after each step, outside its timing
        self.speculator: Speculator | None = None  # speculative decoding (offload/speculative.py), when asked for
        self.trees_fit = not ring_sizes(model.spec)  # a tree's siblings would share a ring layer's slot
        # the engines' prefix cache (offload/prefix_cache.py): on, with a host tier of this many bytes, and the
        # host-tier runs the last run_to_end left for the next one
        self.prefix_caching, self.prefix_host_bytes, self.prefix_carried = True, 0, []
        self.constraints = Constraints(tokenizer, model.spec.vocab_size, tuple(sorted(self.eos_ids)), self.context_len)

    def step(self, running: list[Sequence], cache, trash_slot: int) -> None:
        """One forward pass over the weights: schedule the running sequences, run the step (structured outputs'
        masks filled beside it), take its logits."""
        if self.speculator is not None:
            self.speculator.attach(cache, trash_slot)
        scheduled = self.schedule(running)
        self.constraints.start(scheduled)
        try:
            ran = self.run_step(scheduled, cache, trash_slot)
        finally:
            allowed = self.constraints.join()
        self.update(scheduled, ran, cache, allowed)

    def schedule(self, running: list[Sequence]) -> ScheduledStep:
        """The next step: the decode tokens, the drafter's proposals for some of them, the prompt chunks."""
        # the step's phase as schedule_step will set it (but where the proposals leave a waiting prompt no room)
        phase = "prefill" if any(prefills(s) for s in running) else "decode"
        proposals = self._drafts(decoding(running, self.mixed), phase)
        return schedule_step(running, self.step_tokens, self.mixed, proposals)

    def _drafts(self, decode: list[Sequence], phase: str = "decode") -> dict[int, Proposal]:
        """Proposals for decode sequences (speculative decoding, by id(sequence)), each within its KV extent, all
        within the step's tokens; sequences the drafter has nothing for are left out. The model's step of phase
        that verifies them has its first copies and disk reads issued before the drafting, to run under it."""
        if self.speculator is None or not decode:
            return {}
        k, room, asks = self.speculator.choose_k(len(decode)), self.step_tokens - len(decode), []
        for seq in decode:
            n = min(k, seq.extent - seq.n_tokens, room)  # positions up to n_tokens - 1 + n are in its extent
            if n > 0:
                asks.append((seq.prompt_ids + seq.output_ids, n, seq))
                room -= n
        branching = self.speculator.max_branches > 0 and self.trees_fit  # trees: offload/proposal_tree.py
        if asks:  # the verify pass's first copies and disk reads run under the drafting
            self.model.prepare_step(phase)
        drafted = self.speculator.draft_seconds
        proposals = self.speculator.propose_many(asks, branching)
        self.model.host_worked(self.speculator.draft_seconds - drafted)
        proposals = [self.constraints.cut(seq, draft) if seq.params.structured_outputs is not None else draft
                     for (_, _, seq), draft in zip(asks, proposals)]
        if branching:  # a structured output's proposals stay a chain (no room), as a sequence's at its extent's end
            rooms = [0 if seq.params.structured_outputs is not None else seq.extent - seq.n_tokens - len(d)
                     for (_, _, seq), d in zip(asks, proposals)]
            trees = self.speculator.branch(proposals, rooms, len(decode), room)
        else:
            trees = [Proposal.chain(draft) for draft in proposals]
        return {id(seq): tree for (_, _, seq), tree in zip(asks, trees) if len(tree)}

    def run_step(self, scheduled: ScheduledStep, cache, trash_slot: int) -> StepLogits:
        """The runner: one pass over the weights for the step's tokens, then the logits of the rows it names (a
        step that names none, prompt chunks that end no prompt, skips the lm_head)."""
        start = self.now()
        step = ragged_step(self.model.spec, self.model.dtype, list(scheduled.groups), trash_slot, scheduled.phase)
        with torch.inference_mode():
            hidden = self.model.forward(torch.tensor([scheduled.tokens]), step, cache,
                                        logits=scheduled.n_logits > 0)[0]
        threads = torch.get_num_threads()  # as the executor set it for this step
        rows = list(scheduled.logit_rows)
        return StepLogits(dict(zip(rows, self._logits(hidden, rows))), start, threads)

    def update(self, scheduled: ScheduledStep, ran: StepLogits, cache,
               allowed: dict[int, torch.Tensor] | None = None) -> None:
        """Take a step's logits: the prompt chunks are cached, prompt tokens scored, the other samples of an n > 1
        request take the prompt's K and V, the step is counted, then every sampling sequence gains its token and
        every verified one the proposals it keeps. allowed: the structured outputs' masks by id(sequence), as
        Constraints.join gives them (None: filled now)."""
        if allowed is None:
            allowed = self.constraints.fill_now(scheduled)
        for seq, n in scheduled.chunks:
            seq.n_cached += n
        for seq, rows, ids in scheduled.scored:
            scores = [ran.by_row[r] for r in rows]
            seq.prompt_logprobs = (seq.prompt_logprobs or [None]) + (
                token_logprobs(torch.stack(scores), list(ids), seq.params.prompt_logprobs) if scores else [])
        for seq, other in scheduled.shared:
            share_prefill(cache, seq, other)
        shape = replace(scheduled.shape, threads=ran.threads)
        elapsed = self._count(scheduled.phase, ran.start_s, len(scheduled.tokens), shape)
        self._sample_next([seq for seq, _ in scheduled.samples], [ran.by_row[r] for _, r in scheduled.samples],
                          allowed)
        gained = self._verify(scheduled.verified, [[ran.by_row[r] for r in rows] for rows in scheduled.verify_rows],
                              allowed, cache)
        if self.speculator is not None and scheduled.phase == "decode":
            self.speculator.observe_step(shape, elapsed, len(scheduled.decode) + gained)

    def _verify(self, verified: tuple[tuple[Sequence, Proposal], ...], checked: list[list[torch.Tensor]],
                allowed: dict[int, torch.Tensor], cache) -> int:
        """Each verified sequence takes the proposals the model agrees with and one token of its own (checked: its
        rows of logits; allowed: structured outputs' masks), a tree's kept ones' K and V moved to their positions;
        the tokens they gained."""
        if not verified:
            return 0
        before = self.speculator.stats.verified_tokens
        for (seq, proposal), rows in zip(verified, checked):
            base = seq.n_tokens - 1  # the last token's position: a tree's proposal i wrote at base + 1 + i
            path = self.speculator.verify(rows, proposal, seq.params, seq.generator, seq.prompt_ids, seq.output_ids,
                                          lambda token, row, seq=seq: self._take(seq, token, row),
                                          allowed.get(id(seq)))
            move_kept(cache, seq, kept_moves(base, path))
        return self.speculator.stats.verified_tokens - before

    def _logits(self, hidden: torch.Tensor, rows: list[int]) -> list[torch.Tensor]:
        """Logits of hidden[rows], at most logits_rows at a time (the plan budgets that many)."""
        out = []
        for i in range(0, len(rows), self.logits_rows):  # the lm_head read once for all of them
            more = i + self.logits_rows < len(rows)
            out += list(self.model.logits(hidden[rows[i: i + self.logits_rows]], more=more))
        return out

    def _count(self, phase: str, start_s: float, n_tokens: int, shape: StepShape) -> float:
        """The step's seconds since start_s, added to the timeline."""
        elapsed = self.now() - start_s
        timeline = getattr(self.model, "timeline", None)
        if timeline is not None:
            timeline.add_phase(phase, elapsed, n_tokens, replace(shape, seconds=elapsed, start_s=start_s))
        return elapsed

    def check_prompt(self, ids: list[int], params: SamplingParams | None = None) -> None:
        """ConfigError if token ids cannot run: empty, not shorter than this run's context, or outside the vocab;
        SamplingError if params name a token outside it (stop_token_ids, logit_bias)."""
        check_prompt_ids(ids, self.context_len, self.model.spec, params)
        if params is not None and params.structured_outputs is not None:
            self.constraints.compile(params.structured_outputs)  # SamplingError here, not in a step

    def _sample_next(self, seqs: list[Sequence], logits: list[torch.Tensor], allowed: dict[int, torch.Tensor]) -> None:
        for seq, row in zip(seqs, logits):
            mask = allowed.get(id(seq))
            if mask is not None and not len(mask):  # its grammar allows no token of the vocabulary: it ends here
                seq.finish_reason = "stop"
                continue
            self._take(seq, sample(row, seq.params, seq.generator, seq.prompt_ids, seq.output_ids,
                                   None if mask is None else mask[0]), row)

    def _take(self, seq: Sequence, token: int, row: torch.Tensor) -> bool:
        """Append a token sampled (or kept) from a row of logits (raw: logprobs are the model's own); whether the
        sequence goes on. A structured output's grammar advances, and ends the sequence where it took a stop token."""
        if seq.logprobs is not None:
            seq.logprobs += token_logprobs(row[None], [token], seq.params.logprobs)
        if seq.alternatives is not None:  # a draft's run: its next likeliest token too
            seq.alternatives.append(runner_up(row, token))
        seq.output_ids.append(token)
        if seq.grammar is not None and not self.constraints.accept(seq, token):
            seq.finish_reason = "stop"
        else:
            self._check_stop(seq, token)
        return not seq.finish_reason

    def _check_stop(self, seq: Sequence, token: int) -> None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_ids):
            seq.finish_reason = "stop"
        elif p.stop and self.tokenizer is not None and self._hit_stop_string(seq):
            seq.finish_reason = "stop"
        elif len(seq.output_ids) >= p.max_tokens or seq.n_tokens >= self.context_len:
            seq.finish_reason = "length"

    def _hit_stop_string(self, seq: Sequence) -> bool:
        """Whether the text now ends past a stop string: only the newest token's text is decoded (vLLM's
        incremental detokenizing), and only the tail a new stop string could touch is searched."""
        before = len(seq._text)
        seq._text += self._new_text(seq)
        longest = max(len(s) for s in seq.params.stop)
        tail_from = max(0, before - longest + 1)
        if not any(s in seq._text[tail_from:] for s in seq.params.stop):
            return False
        text = self._full_text(seq)  # once per sequence: where the stop string cuts the final text
        hits = [(text.find(s), s) for s in seq.params.stop if s in text]
        if not hits:
            return False
        at, stop = min(hits)
        seq.stop_text_end = at + len(stop) if seq.params.include_stop_str_in_output else at
        return True

    def _new_text(self, seq: Sequence) -> str:
        text, seq._offsets = next_text(self.tokenizer, seq.output_ids, seq._offsets, seq.params.skip_special_tokens)
        return text

    def _full_text(self, seq: Sequence) -> str:
        return self.tokenizer.decode(seq.output_ids, skip_special_tokens=seq.params.skip_special_tokens)

    def text_of(self, seq: Sequence) -> str:
        """The decoded completion, cut at the stop string if one ended it."""
        if self.tokenizer is None:
            return ""
        text = self._full_text(seq)
        return text if seq.stop_text_end is None else text[: seq.stop_text_end]


def share_prefill(cache, seq: Sequence, other: Sequence) -> None:
    """Copy the K and V of seq's prompt (now in the cache) into other's blocks (a ring layer's: other's ring):
    other's prompt is in the cache. The blocks their tables both map (the prefix cache's) are not copied."""
    n = len(seq.prompt_ids)
    skip = KV_BLOCK * len(seq.shared)
    if other.shared != seq.shared:
        raise ValueError("a request's samples map the same prefix blocks; admit them together")
    src, dst = (block_slots(s.blocks)[: n - skip] for s in (seq, other))  # their own blocks start at skip
    for layer in cache:
        ring = layer.ring
        if ring is not None:
            src_, dst_ = seq.ring * ring, other.ring * ring
            for t in (layer.k, layer.v):
                t[:, dst_: dst_ + ring].copy_(t[:, src_: src_ + ring])
            continue
        at_src, at_dst = src.to(layer.k.device), dst.to(layer.k.device)
        for t in (layer.k, layer.v):
            t[:, at_dst] = t[:, at_src]
    other.n_cached = n


def next_text(tokenizer, ids: list[int], offsets: tuple[int, int],
              skip_special_tokens: bool) -> tuple[str, tuple[int, int]]:
    """The text the tokens after offsets' read end add, decoded with a few tokens of context before them, and the
    offsets to pass next time (vLLM's incremental detokenizing); empty while the text ends inside a multi-byte
    character (a later token completes it)."""
    prefix_start, read_end = offsets
    prefix = tokenizer.decode(ids[prefix_start:read_end], skip_special_tokens=skip_special_tokens)
    full = tokenizer.decode(ids[prefix_start:], skip_special_tokens=skip_special_tokens)
    if full.endswith("\ufffd") or len(full) <= len(prefix):
        return "", offsets
    return full[len(prefix):], (read_end, len(ids))

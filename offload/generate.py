"""Prefill and decode over a fixed set of cache slots, refilled as sequences finish (continuous batching)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from offload.errors import ConfigError
from offload.model.model import Model  # or a PlacedModel: same interface
from offload.planner.types import DEFAULT_PREFILL_PASS_TOKENS
from offload.sampling import SamplingParams, sample



@dataclass
class Sequence:
    """One request in flight: its prompt, what it has generated and why it stopped."""

    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_text_end: int | None = None  # where a stop string cut the text
    slot: int = -1
    generator: torch.Generator | None = None

    @property
    def n_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


class Generator:
    """Runs sequences through a Model in batches of at most max_batch_size cache slots."""

    def __init__(self, model: Model, tokenizer=None, eos_ids: tuple[int, ...] = (), max_batch_size: int = 32,
                 max_model_len: int | None = None, prefill_pass_tokens: int = DEFAULT_PREFILL_PASS_TOKENS):
        """prefill_pass_tokens: padded prompt tokens in one prefill pass over the weights (the residual stream the
        plan budgets); a longer prompt is prefilled in several passes."""
        self.model = model
        self.prefill_pass_tokens = prefill_pass_tokens
        self._now = getattr(model, "now", time.perf_counter)  # a simulated device keeps its own clock
        self.tokenizer = tokenizer
        self.eos_ids = set(eos_ids)
        self.max_batch_size = max_batch_size
        self.context_len = min(max_model_len or model.spec.max_position_embeddings,
                               model.spec.max_position_embeddings)

    def run(self, seqs: list[Sequence], on_finish: Callable[[Sequence], None] | None = None) -> None:
        """Generate until every sequence has finished; on_finish is called as each one does."""
        for seq in seqs:
            self._check(seq)
        if not seqs:
            return
        n_slots = min(self.max_batch_size, len(seqs))
        max_len = min(self.context_len, max(len(s.prompt_ids) + s.params.max_tokens for s in seqs))
        cache = self.model.new_cache(n_slots, max_len)
        pending, active = deque(seqs), {}
        free = list(range(n_slots))[::-1]
        while pending or active:
            admitted = []
            while pending and free:
                seq = pending.popleft()
                seq.slot, seq.generator = free.pop(), seq.params.make_generator()
                active[seq.slot] = seq
                admitted.append(seq)
            if admitted:
                for group in _prefill_groups(admitted, self.prefill_pass_tokens):
                    start = self._now()
                    logits = self._prefill(group, cache, max_len)
                    self._count("prefill", start, sum(len(s.prompt_ids) for s in group))
                    self._sample_next(group, logits)
            else:
                batch = list(active.values())
                start = self._now()
                logits = self._decode(batch, cache, max_len)
                self._count("decode", start, len(batch))
                self._sample_next(batch, logits)
            for seq in [s for s in active.values() if s.finish_reason]:
                del active[seq.slot]
                free.append(seq.slot)
                if on_finish:
                    on_finish(seq)

    def _count(self, phase: str, start_s: float, n_tokens: int) -> None:
        timeline = getattr(self.model, "timeline", None)
        if timeline is not None:
            timeline.add_phase(phase, self._now() - start_s, n_tokens)

    def _check(self, seq: Sequence) -> None:
        try:
            self.check_prompt(seq.prompt_ids)
        except ConfigError as e:
            raise ConfigError(f"prompts[{seq.request_id}]: {e}") from None

    def check_prompt(self, ids: list[int]) -> None:
        """ConfigError if token ids cannot run: empty, not shorter than this run's context, or outside the vocab."""
        if not ids:
            raise ConfigError("the prompt is empty after tokenization; give at least one token")
        model_len = self.model.spec.max_position_embeddings
        if len(ids) >= self.context_len:
            more = (f"raise max_model_len (model.max_model_len in a job, --max-model-len) to more than {len(ids)}, "
                    f"at most the model's {model_len}, or shorten the prompt" if len(ids) < model_len
                    else f"the model's own context is {model_len}: shorten the prompt")
            raise ConfigError(f"the prompt has {len(ids)} tokens but this run's context (max_model_len) is "
                              f"{self.context_len} tokens; {more}")
        vocab = self.model.spec.vocab_size
        if max(ids) >= vocab or min(ids) < 0:
            raise ConfigError(f"prompt token ids must lie in [0, {vocab}); use the model's own tokenizer")

    def _prefill(self, group: list[Sequence], cache, max_len: int) -> torch.Tensor:
        """Run the prompts of newly admitted sequences, in passes of at most prefill_pass_tokens padded tokens;
        return last-token logits [b, V]."""
        lengths = [len(s.prompt_ids) for s in group]
        s_max, n = max(lengths), len(group)
        tokens = torch.zeros(n, s_max, dtype=torch.long)
        for i, seq in enumerate(group):
            tokens[i, : lengths[i]] = torch.tensor(seq.prompt_ids)
        limit = torch.tensor(lengths)[:, None]
        span = max(1, self.prefill_pass_tokens // n)
        last: list[torch.Tensor | None] = [None] * n
        for start in range(0, s_max, span):
            stop = min(start + span, s_max)
            positions = torch.arange(start, stop)[None].expand(n, stop - start)
            valid = positions < limit
            positions = torch.where(valid, positions, torch.zeros_like(positions))
            hidden = self._forward(group, tokens[:, start:stop], positions, valid, cache, max_len, "prefill")
            for i, length in enumerate(lengths):
                if start < length <= stop:
                    last[i] = hidden[i, length - 1 - start]
        return self.model.logits(torch.stack(last))

    def _decode(self, batch: list[Sequence], cache, max_len: int) -> torch.Tensor:
        """One token for each active sequence; return logits [b, V]."""
        tokens = torch.tensor([[s.output_ids[-1]] for s in batch])
        positions = torch.tensor([[s.n_tokens - 1] for s in batch])
        valid = torch.ones(positions.shape, dtype=torch.bool)
        hidden = self._forward(batch, tokens, positions, valid, cache, max_len, "decode")
        return self.model.logits(hidden[:, 0])

    def _forward(self, seqs, tokens, positions, valid, cache, max_len: int, phase: str) -> torch.Tensor:
        slots = [s.slot for s in seqs]
        all_rows = len(seqs) == cache[0].k.shape[0] and slots == list(range(len(seqs)))
        step = self.model.make_step(positions, valid, trash_slot=max_len,
                                    rows=None if all_rows else torch.tensor(slots), phase=phase)
        with torch.inference_mode():
            return self.model.forward(tokens, step, cache)

    def _sample_next(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        for seq, row in zip(seqs, logits):
            token = sample(row, seq.params, seq.generator)
            seq.output_ids.append(token)
            self._check_stop(seq, token)

    def _check_stop(self, seq: Sequence, token: int) -> None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_ids):
            seq.finish_reason = "stop"
        elif p.stop and self.tokenizer is not None and self._hit_stop_string(seq):
            seq.finish_reason = "stop"
        elif len(seq.output_ids) >= p.max_tokens or seq.n_tokens >= self.context_len:
            seq.finish_reason = "length"

    def _hit_stop_string(self, seq: Sequence) -> bool:
        text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=seq.params.skip_special_tokens)
        hits = [(text.find(s), s) for s in seq.params.stop if s in text]
        if not hits:
            return False
        at, stop = min(hits)
        seq.stop_text_end = at + len(stop) if seq.params.include_stop_str_in_output else at
        return True

    def text_of(self, seq: Sequence) -> str:
        """The decoded completion, cut at the stop string if one ended it."""
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=seq.params.skip_special_tokens)
        return text if seq.stop_text_end is None else text[: seq.stop_text_end]


def _prefill_groups(seqs: list[Sequence], tokens_per_pass: int) -> list[list[Sequence]]:
    """Split sequences so that each group's padded prompts fit one pass of tokens_per_pass (a longer prompt is
    a group of its own, prefilled in several passes)."""
    groups, current, longest = [], [], 0
    for seq in sorted(seqs, key=lambda s: len(s.prompt_ids)):
        longest_if_added = max(longest, len(seq.prompt_ids))
        if current and longest_if_added * (len(current) + 1) > tokens_per_pass:
            groups.append(current)
            current, longest_if_added = [], len(seq.prompt_ids)
        current.append(seq)
        longest = longest_if_added
    return groups + [current] if current else groups

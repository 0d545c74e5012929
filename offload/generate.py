"""The scheduler: continuous batching with chunked prefill and mixed steps over a pooled KV cache.

Each step carries one decode token of every running sequence that has its prompt in the cache, plus chunks of
the prompts of sequences still being prefilled, up to a token budget (the plan's tokens per pass over the
weights): one pass over the weights serves both, as vLLM's chunked-prefill scheduler does. The KV cache is one
pool of token slots; a sequence gets a contiguous extent of prompt + max_tokens slots (at most the context)
when it is admitted and gives it back when it finishes, so short requests leave room for more of them. The loop
that admits and releases them is the engine's (offload/engine.py): `run` is that loop over a fixed list.

`mixed=False` keeps the schedule offload had before (a step is all prompt chunks or all decode tokens, and
prompts go first): `scripts/bench_batch.py` runs both side by side.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable

import torch

from offload.engine import Engine, KVPool, Sequence, kv_extent  # noqa: F401 (KVPool: offload.generate's name too)
from offload.errors import ConfigError, SamplingError
from offload.model.step import ragged_step
from offload.model.model import Model  # or a PlacedModel: same interface
from offload.planner.types import DEFAULT_PREFILL_PASS_TOKENS
from offload.profile.timeline import StepShape
from offload.sampling import SamplingParams, sample, token_logprobs
from offload.speculative import Speculator
from offload.weights.prompts import check_prompt_ids


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
        self.kv_tokens = kv_tokens or max_batch_size * self.context_len
        self.logits_rows = logits_rows or max_batch_size
        self.mixed = mixed
        self.between_steps: Callable[[], None] | None = None  # called after each step, outside its timing
        self.speculator: Speculator | None = None  # speculative decoding (offload/speculative.py), when asked for

    def run(self, seqs: list[Sequence], on_finish: Callable[[Sequence], None] | None = None) -> None:
        """Generate until every sequence has finished; on_finish is called as each one does."""
        for seq in seqs:
            self._check(seq)
        if not seqs:
            return
        # the pool: what these sequences need at most, within kv_tokens with its trash slot (the longest always fits)
        extents = [(kv_extent(s, self.context_len), s.params.n) for s in seqs]  # n samples: n extents
        largest = sorted((e for e, n in extents for _ in range(n)), reverse=True)
        whole = max(e * n for e, n in extents)  # one request's samples are admitted together
        engine = Engine(self, kv_slots=max(min(self.kv_tokens - 1, sum(largest[: self.max_batch_size])), whole))
        for seq in seqs:
            engine.submit(seq)
        engine.run_until_done(on_finish)

    def _plan_step(self, running: list[Sequence]) -> tuple[list[Sequence], dict[int, list[int]],
                                                           list[tuple[Sequence, int]]]:
        """The decode sequences, the drafter's proposals for some of them (by id), and the (sequence, chunk length)
        prompt chunks of the next step."""
        decode = [s for s in running if s.prefilled]
        prefilling = [s for s in running if not s.prefilled and s.parent is None]  # samples 1.. wait for sample 0
        if not self.mixed and prefilling:
            decode = []  # the old schedule: prompts first, decode waits
        drafts = self._drafts(decode)
        room, chunks = self.step_tokens - len(decode) - sum(map(len, drafts.values())), []
        for seq in prefilling:
            if room <= 0:
                break
            n = min(room, len(seq.prompt_ids) - seq.n_cached)
            chunks.append((seq, n))
            room -= n
        return decode, drafts, chunks

    def _drafts(self, decode: list[Sequence]) -> dict[int, list[int]]:
        """Proposals for decode sequences (speculative decoding), each within its KV extent, all within the step's
        tokens; sequences the drafter has nothing for are left out."""
        if self.speculator is None or not decode:
            return {}
        k, room, asks = self.speculator.choose_k(len(decode)), self.step_tokens - len(decode), []
        for seq in decode:
            n = min(k, seq.extent - seq.n_tokens, room)  # positions up to n_tokens - 1 + n are in its extent
            if n > 0:
                asks.append((seq.prompt_ids + seq.output_ids, n, seq))
                room -= n
        proposals = self.speculator.propose_many(asks)
        return {id(seq): draft for (_, _, seq), draft in zip(asks, proposals) if draft}

    def step(self, running: list[Sequence], cache, trash_slot: int) -> None:
        """One forward pass over the weights: the decode tokens and prompt chunks, then sampling."""
        decode, drafts, chunks = self._plan_step(running)
        plain = [s for s in decode if id(s) not in drafts]
        verified = [(s, drafts[id(s)]) for s in decode if id(s) in drafts]
        groups, tokens = self._inputs(plain, verified, chunks)
        rows, sampled, verify_rows, scored = self._rows(plain, verified, chunks)
        n_logits = len(rows) + sum(map(len, verify_rows)) + sum(len(m) for _, m, _ in scored)
        phase = "prefill" if chunks else "decode"
        start = self.now()
        step = ragged_step(self.model.spec, self.model.dtype, groups, trash_slot, phase)
        with torch.inference_mode():  # a step that samples no row (prompt chunks that end no prompt): no lm_head
            hidden = self.model.forward(torch.tensor([tokens]), step, cache, logits=n_logits > 0)[0]
        threads = torch.get_num_threads()  # as the executor set it for this step
        for seq, n in chunks:
            seq.n_cached += n
        flat_verify = [r for more in verify_rows for r in more]
        logits = self._logits(hidden, rows + flat_verify + [r for _, more, _ in scored for r in more])  # one pass
        logits, checked, extra = (logits[: len(rows)], logits[len(rows): len(rows) + len(flat_verify)],
                                  logits[len(rows) + len(flat_verify):])
        for seq, more, ids in scored:
            scores, extra = extra[: len(more)], extra[len(more):]
            seq.prompt_logprobs = (seq.prompt_logprobs or [None]) + (
                token_logprobs(torch.stack(scores), ids, seq.params.prompt_logprobs) if scores else [])
        for seq, row in list(zip(sampled[len(plain):], logits[len(plain):])):
            for other in seq.samples[1:]:  # n > 1: the other samples take the prompt's K and V, and its logits
                share_prefill(cache, seq, other)
                sampled.append(other)
                logits.append(row)
        shape = self._shape(phase, len(tokens), plain, verified, chunks, n_logits, threads)
        elapsed = self._count(phase, start, len(tokens), shape)
        self._sample_next(sampled, logits)
        gained = self._verify(verified, verify_rows, checked)
        if self.speculator is not None and phase == "decode":
            self.speculator.observe_step(shape, elapsed, len(plain) + gained)

    @staticmethod
    def _rows(plain: list[Sequence], verified: list[tuple[Sequence, list[int]]],
              chunks: list[tuple[Sequence, int]]) -> tuple[list[int], list[Sequence], list[list[int]], list]:
        """The step's rows of logits, before it runs: (rows sampled: every plain decode token and the last token of
        each prompt this step ends, the sequences they sample, each verified sequence's rows, and (sequence, rows,
        prompt token ids they predict) where prompt logprobs are asked for (echo))."""
        rows, sampled, at = list(range(len(plain))), list(plain), len(plain)
        verify_rows = []
        for seq, draft in verified:
            verify_rows.append(list(range(at, at + len(draft) + 1)))
            at += len(draft) + 1
        scored = []
        for seq, n in chunks:
            if seq.params.prompt_logprobs is not None:  # row i predicts the prompt's token after it
                first, last = seq.n_cached, min(seq.n_cached + n, len(seq.prompt_ids) - 1)
                scored.append((seq, list(range(at, at + max(last - first, 0))), seq.prompt_ids[first + 1: last + 1]))
            at += n
            if seq.n_cached + n >= len(seq.prompt_ids):
                rows.append(at - 1)
                sampled.append(seq)
        return rows, sampled, verify_rows, scored

    def _verify(self, verified: list[tuple[Sequence, list[int]]], verify_rows: list[list[int]],
                checked: list[torch.Tensor]) -> int:
        """Each verified sequence takes the proposals the model agrees with and one token of its own (checked: the
        rows of logits of verify_rows); the tokens they gained."""
        if not verified:
            return 0
        before = self.speculator.stats.verified_tokens
        for (seq, draft), more in zip(verified, verify_rows):
            mine, checked = checked[: len(more)], checked[len(more):]
            self.speculator.verify(mine, draft, seq.params, seq.generator, seq.prompt_ids, seq.output_ids,
                                   lambda token, row, seq=seq: self._take(seq, token, row))
        return self.speculator.stats.verified_tokens - before

    @staticmethod
    def _inputs(plain: list[Sequence], verified: list[tuple[Sequence, list[int]]],
                chunks: list[tuple[Sequence, int]]) -> tuple[list, list[int]]:
        """The step's ragged groups (positions, base slots) and its tokens: the plain decode tokens in one group,
        each verified sequence's last token and proposals, each prompt chunk."""
        groups, tokens = [], []
        if plain:
            positions = torch.tensor([[s.n_tokens - 1] for s in plain])
            groups.append((positions, torch.tensor([s.base for s in plain])))
            tokens += [s.output_ids[-1] for s in plain]
        for seq, draft in verified:  # its last token and its proposals: the model's next token after each
            groups.append((torch.arange(seq.n_tokens - 1, seq.n_tokens + len(draft))[None], torch.tensor([seq.base])))
            tokens += [seq.output_ids[-1], *draft]
        for seq, n in chunks:
            groups.append((torch.arange(seq.n_cached, seq.n_cached + n)[None], torch.tensor([seq.base])))
            tokens += seq.prompt_ids[seq.n_cached: seq.n_cached + n]
        return groups, tokens

    @staticmethod
    def _shape(phase: str, n_tokens: int, plain: list[Sequence], verified: list[tuple[Sequence, list[int]]],
               chunks: list[tuple[Sequence, int]], n_logits: int, threads: int) -> StepShape:
        """What the step computed, for the cost model (the chunks' n_cached already counts them)."""
        n_prompt = sum(n for _, n in chunks)
        return StepShape(
            phase, 0.0, n_prompt, n_tokens - n_prompt, len(plain) + len(verified) + len(chunks), n_logits,
            attended_keys=sum(s.n_tokens for s in plain) + sum(n * (s.n_cached - n) + n * (n + 1) // 2
                                                               for s, n in chunks)
            + sum((len(d) + 1) * s.n_tokens + len(d) * (len(d) + 1) // 2 for s, d in verified),
            kv_read_tokens=sum(s.n_tokens for s in plain) + sum(s.n_tokens + len(d) for s, d in verified)
            + sum(s.n_cached for s, _ in chunks), threads=threads)

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

    def _check(self, seq: Sequence) -> None:
        try:
            self.check_prompt(seq.prompt_ids, seq.params)
        except ConfigError as e:
            raise ConfigError(f"prompts[{seq.request_id}]: {e}") from None
        except SamplingError as e:
            raise SamplingError(f"prompts[{seq.request_id}]: {e}", e.param) from None

    def check_prompt(self, ids: list[int], params: SamplingParams | None = None) -> None:
        """ConfigError if token ids cannot run: empty, not shorter than this run's context, or outside the vocab;
        SamplingError if params name a token outside it (stop_token_ids, logit_bias)."""
        check_prompt_ids(ids, self.context_len, self.model.spec, params)

    def _sample_next(self, seqs: list[Sequence], logits: list[torch.Tensor]) -> None:
        for seq, row in zip(seqs, logits):
            self._take(seq, sample(row, seq.params, seq.generator, seq.prompt_ids, seq.output_ids), row)

    def _take(self, seq: Sequence, token: int, row: torch.Tensor) -> bool:
        """Append a token sampled (or kept) from a row of logits; whether the sequence goes on."""
        if seq.logprobs is not None:
            seq.logprobs += token_logprobs(row[None], [token], seq.params.logprobs)
        seq.output_ids.append(token)
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
    """Copy the K and V of seq's prompt (now in the cache) into other's extent: other's prompt is in the cache."""
    n = len(seq.prompt_ids)
    for layer in cache:
        for t in (layer.k, layer.v):
            t[:, other.base: other.base + n].copy_(t[:, seq.base: seq.base + n])
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

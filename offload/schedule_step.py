"""The step object: what one step holds, decided before it runs (vLLM v1's SchedulerOutput).

A step is one pass over the weights. The scheduler chooses what it carries from the running sequences: one
decode token of each sequence whose prompt is in the cache, the drafter's proposals for some of them (verified
in the same pass), and chunks of the prompts still being prefilled, up to the step's tokens. `schedule_step`
writes that choice down as a ScheduledStep, everything the runner and the update need, so that neither decides
anything of its own:

- the model's inputs: ragged groups (positions [b, s], each sequence's block table in the pool: the first KV
  slot of each of its blocks, and its ring in the ring layers) and the flat tokens, group after group;
- the rows of logits to compute and what each is for: sampling a sequence's next token (the other samples of an
  n > 1 request take their first one from their prompt's row, after copying its K and V), verifying a
  sequence's proposals, scoring the prompt tokens a chunk predicts (prompt logprobs);
- the step's shape for the cost model (its seconds and threads are the run's).

It is a pure function of the sequences and the proposals: its rows are tested without a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from offload.attention_sizes import KV_BLOCK
from offload.profile.timeline import StepShape
from offload.sequence import Sequence


@dataclass(frozen=True)
class Proposal:
    """Tokens a drafter proposes after a sequence's last token, each with the index of the token it follows (-1:
    the sequence's last token): a chain (parents -1, 0, 1, ...) or a tree (several candidates after one token),
    each proposal after the one it follows."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    odds: tuple[float, ...] = ()  # a tree's: per proposal, 0 for the chain's, else the draft's probability for a
    # second candidate (offload/proposal_tree.py)

    @classmethod
    def chain(cls, tokens: Iterable[int]) -> Proposal:
        tokens = tuple(tokens)
        return cls(tokens, tuple(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return self.parents == tuple(range(-1, len(self.tokens) - 1))

    @property
    def depths(self) -> tuple[int, ...]:
        """Each token's distance from the sequence's last token (its position is that much further on)."""
        out: list[int] = []
        for parent in self.parents:
            out.append(1 if parent < 0 else out[parent] + 1)
        return tuple(out)


@dataclass(frozen=True, eq=False)
class ScheduledStep:
    """One step, decided before it runs: what it carries, the model's inputs, the rows of logits and their uses."""

    phase: str  # prefill: it carries prompt tokens (decode tokens may ride along); decode: it does not
    decode: tuple[Sequence, ...]  # a decode token each, no proposals
    verified: tuple[tuple[Sequence, Proposal], ...]  # a decode token and the drafter's proposals each
    chunks: tuple[tuple[Sequence, int], ...]  # (sequence, its next n prompt tokens, from its n_cached on)
    groups: tuple[tuple, ...]  # (positions [b, s], tables [b, m], rings [b], a tree's parents or None): ragged_step's
    tokens: tuple[int, ...]  # the flat tokens, group after group
    samples: tuple[tuple[Sequence, int], ...]  # (sequence, row) of each sequence that samples its next token
    shared: tuple[tuple[Sequence, Sequence], ...]  # (first sample, other): other copies the prompt's K and V
    verify_rows: tuple[tuple[int, ...], ...]  # each verified sequence's rows: after its last token, each proposal
    scored: tuple[tuple[Sequence, tuple[int, ...], tuple[int, ...]], ...]  # (sequence, rows, prompt ids they predict)
    logit_rows: tuple[int, ...]  # the rows of logits to compute, in one pass: sampled, verified, scored
    shape: StepShape  # for the cost model; seconds, start and threads are the run's

    @property
    def n_logits(self) -> int:
        return len(self.logit_rows)


def prefills(seq: Sequence) -> bool:
    """Whether seq's prompt is still being prefilled (samples 1.. of a request wait for sample 0's prefill)."""
    return not seq.prefilled and seq.parent is None


def decoding(running: list[Sequence], mixed: bool = True) -> list[Sequence]:
    """The sequences that decode a token in the next step: those with their prompt in the cache; none while a
    prompt is prefilled when mixed is False (the older schedule: prompts first)."""
    if not mixed and any(prefills(s) for s in running):
        return []
    return [s for s in running if s.prefilled]


def schedule_step(running: list[Sequence], step_tokens: int, mixed: bool = True,
                  proposals: dict[int, Proposal] | None = None) -> ScheduledStep:
    """The next step over the running sequences: their decode tokens (with the proposals, by id(sequence), the
    drafter made for some), then prompt chunks while the step has room for step_tokens tokens."""
    proposals = proposals or {}
    decode = decoding(running, mixed)
    plain = tuple(s for s in decode if not proposals.get(id(s)))
    verified = tuple((s, proposals[id(s)]) for s in decode if proposals.get(id(s)))
    room = step_tokens - len(decode) - sum(len(p) for _, p in verified)
    chunks = []
    for seq in (s for s in running if prefills(s)):
        if room <= 0:
            break
        n = min(room, len(seq.prompt_ids) - seq.n_cached)
        chunks.append((seq, n))
        room -= n
    groups, tokens = _inputs(plain, verified, chunks)
    samples, shared, verify_rows, scored = _rows(plain, verified, chunks)
    logit_rows = (*dict.fromkeys(row for _, row in samples), *(r for rows in verify_rows for r in rows),
                  *(r for _, rows, _ in scored for r in rows))
    phase = "prefill" if chunks else "decode"
    return ScheduledStep(phase=phase, decode=plain, verified=verified, chunks=tuple(chunks), groups=groups,
                         tokens=tokens, samples=samples, shared=shared, verify_rows=verify_rows, scored=scored,
                         logit_rows=logit_rows, shape=_shape(phase, len(tokens), plain, verified, chunks,
                                                             len(logit_rows)))


def _inputs(plain, verified, chunks) -> tuple[tuple, tuple[int, ...]]:
    """The ragged groups (positions, block tables, rings) and the flat tokens: the plain decode tokens in one group,
    each verified sequence's last token and proposals, each prompt chunk."""
    groups, tokens = [], []
    if plain:
        last = [s.n_tokens - 1 for s in plain]
        groups.append((torch.tensor([[p] for p in last]), *_where(plain, last), None))
        tokens += [s.output_ids[-1] for s in plain]
    for seq, proposal in verified:  # its last token and its proposals: the model's next token after each (a tree's
        # proposal i writes at the key one past the last token's plus i: model/step.py's tree_step)
        positions = [seq.n_tokens - 1 + d for d in (0, *proposal.depths)]
        tree = None if proposal.is_chain else proposal.parents
        groups.append((torch.tensor([positions]), *_where([seq], [seq.n_tokens - 1 + len(proposal)]), tree))
        tokens += [seq.output_ids[-1], *proposal.tokens]
    for seq, n in chunks:
        positions = torch.arange(seq.n_cached, seq.n_cached + n)[None]
        groups.append((positions, *_where([seq], [seq.n_cached + n - 1]), None))
        tokens += seq.prompt_ids[seq.n_cached: seq.n_cached + n]
    return tuple(groups), tuple(tokens)


def _where(seqs, lasts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequences' block tables in the pool (as far as their last positions reach) and their rings in the ring
    layers."""
    n_blocks = max(lasts) // KV_BLOCK + 1
    for seq, last in zip(seqs, lasts):
        if last >= KV_BLOCK * seq.n_blocks:  # its writes would land in another sequence's block
            raise RuntimeError(f"request {seq.request_id!r} reaches position {last} past its {seq.n_blocks} KV blocks")
    return torch.tensor([s.table(n_blocks) for s in seqs]), torch.tensor([s.ring for s in seqs])


def _rows(plain, verified, chunks) -> tuple[tuple, tuple, tuple, tuple]:
    """The rows of the flat tokens whose logits are used: (sequence, row) sampled (every plain decode token, the
    last token of each prompt this step ends, and from that row the request's other samples), the (first sample,
    other) prefills shared, each verified sequence's rows, and (sequence, rows, prompt ids they predict) where
    prompt logprobs are asked for (row i predicts the prompt's token after it)."""
    samples, at = [(s, i) for i, s in enumerate(plain)], len(plain)
    verify_rows = []
    for _, proposal in verified:
        verify_rows.append(tuple(range(at, at + len(proposal) + 1)))
        at += len(proposal) + 1
    scored = []
    for seq, n in chunks:
        if seq.params.prompt_logprobs is not None:
            first, last = seq.n_cached, min(seq.n_cached + n, len(seq.prompt_ids) - 1)
            scored.append((seq, tuple(range(at, at + max(last - first, 0))),
                           tuple(seq.prompt_ids[first + 1: last + 1])))
        at += n
        if seq.n_cached + n >= len(seq.prompt_ids):
            samples.append((seq, at - 1))
    shared = []
    for seq, row in samples[len(plain):]:  # n > 1: the other samples take the prompt's K and V, and its logits
        for other in seq.samples[1:]:
            shared.append((seq, other))
            samples.append((other, row))
    return tuple(samples), tuple(shared), tuple(verify_rows), tuple(scored)


def _shape(phase: str, n_tokens: int, plain, verified, chunks, n_logits: int) -> StepShape:
    """What the step computes, for the cost model: keys attended and cached positions read, before it runs."""
    n_prompt = sum(n for _, n in chunks)
    attended = (sum(s.n_tokens for s in plain) + sum(n * s.n_cached + n * (n + 1) // 2 for s, n in chunks)
                + sum((len(p) + 1) * s.n_tokens + len(p) * (len(p) + 1) // 2 for s, p in verified))
    read = (sum(s.n_tokens for s in plain) + sum(s.n_tokens + len(p) for s, p in verified)
            + sum(s.n_cached + n for s, n in chunks))
    return StepShape(phase=phase, seconds=0.0, n_prompt_tokens=n_prompt, n_decode_tokens=n_tokens - n_prompt,
                     n_seqs=len(plain) + len(verified) + len(chunks), n_logits=n_logits, attended_keys=attended,
                     kv_read_tokens=read)

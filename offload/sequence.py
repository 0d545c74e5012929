"""A Sequence: one request in flight, as the scheduler, the generator and the engine all see it.

It lives apart from the engine and the generator so that both can name it while the imports run one way: the
engine steps a generator, the generator schedules and runs sequences, and neither builds the other's objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from offload.sampling import SamplingParams, TokenLogprob


@dataclass
class Sequence:
    """One request in flight: its prompt, what it has generated and why it stopped."""

    request_id: int | str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_text_end: int | None = None  # where a stop string cut the text
    blocks: list[int] | None = None  # first slot of each of its own KV blocks in the pool, in position order (its
    # positions after the shared blocks); None until it is admitted
    extent: int = 0  # KV positions it may write: within the shared blocks' and its own blocks'
    shared: list[int] = field(default_factory=list)  # first slot of each block another request wrote that its
    # table maps at its front (the prefix cache's kept blocks: its positions 0 .. KV_BLOCK * len(shared) - 1)
    ring: int = 0  # its ring in the ring layers' pooled rows (offload.spec.ModelSpec.kv_ring)
    n_cached: int = 0  # prompt tokens whose K and V are in the cache
    n_prefix_hit: int = 0  # of them, those the prefix cache gave (offload/prefix_cache.py)
    prefix_names: list = field(default_factory=list, repr=False)  # its prompt blocks' names, as far as looked up
    generator: torch.Generator | None = None
    index: int = 0  # which of the request's n samples
    parent: Sequence | None = None  # the sample whose prefill this one shares (None: it prefills itself)
    samples: list[Sequence] = field(default_factory=list)  # the request's samples, on its first one ([] for n=1)
    logprobs: list[TokenLogprob] | None = None  # per output token, when params.logprobs is set
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token (None for the first one)
    grammar: object | None = None  # its structured output's matcher (offload/grammar.py), made at its first sample
    alternatives: list | None = None  # a draft's run, where asked for: per token, (its next likeliest token, the
    # token's probability, that one's) for a tree's second candidates (offload/proposal_tree.py)
    _text: str = ""  # decoded so far (stop strings only): extended token by token
    _offsets: tuple[int, int] = (0, 0)  # incremental detokenizing: (prefix start, read end) in output_ids

    @property
    def admitted(self) -> bool:
        """Whether the engine gave it blocks of the pool (it runs, or ran)."""
        return self.blocks is not None

    @property
    def n_blocks(self) -> int:
        """Blocks its table holds: the shared ones and its own."""
        return len(self.shared) + len(self.blocks or [])

    def table(self, n_blocks: int) -> list[int]:
        """The slot of each of its first n_blocks blocks of KV_BLOCK positions: the shared ones, then its own; padded
        with block 0 past them (a batch's tables are as long as its longest; nothing reads a sequence's past its
        length)."""
        table = (self.shared + (self.blocks or []))[:n_blocks]
        return table + [0] * (n_blocks - len(table))

    @property
    def n_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prefilled(self) -> bool:
        return self.n_cached >= len(self.prompt_ids)

    @property
    def group(self) -> list[Sequence]:
        """The request's samples: this one alone unless n > 1."""
        return self.samples or [self]

    @property
    def done(self) -> bool:
        return all(s.finish_reason for s in self.group)

    def fork(self) -> None:
        """Make the n - 1 further samples of this request (n > 1); they share its prompt and its prefill."""
        if self.params.n > 1 and not self.samples:
            self.samples = [self] + [Sequence(self.request_id, self.prompt_ids, self.params, index=i, parent=self)
                                     for i in range(1, self.params.n)]

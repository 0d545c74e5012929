"""Structured outputs at run time: each request's constraint (offload/structured.py) compiled for the model's
vocabulary, a matcher per constrained sequence, and each step's masks of the tokens its grammar allows.

The library is xgrammar, chosen by measuring both kept candidates on a 2-core x86 CPU with the default model's
tokenizer (49,152 tokens) and a nested JSON schema (objects three deep, arrays of objects, an enum, bounded
numbers): xgrammar's mask fill took 6-12 us a token along a 115-token document and 15 us on average (p99 34 us) on
random walks under the mask, llguidance's 75-100 us and 20 us (p99 326 us); compiling the schema took xgrammar
14-27 ms and llguidance 2 ms (lazy: its work moves into the fills), the vocabulary's tables 160 and 500 ms once.
Masking a row of logits with the unpacked mask (torch.where) takes ~55 us either way, so a token's fill and masking
cost ~65 us with xgrammar and ~155 us with llguidance.

A step's masks are filled beside its forward pass: `start` hands the matchers to a worker thread as the step's
forward begins (the model's kernels let the GIL go), `join` collects them when the logits are ready. A sequence
that samples needs one mask (its grammar's state now); one that verifies k proposals needs k + 1 (after its last
token and after each proposal): the worker advances its matcher through the proposals and rolls it back. The
sampler masks the rows (offload/sampling.py's `allowed`), and the token taken advances the matcher; the model's
stop tokens are allowed only where the grammar may end, and taking one ends the grammar and the sequence.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from offload.errors import SamplingError
from offload.schedule_step import ScheduledStep
from offload.sequence import Sequence
from offload.structured import FIELD, StructuredOutputsParams, to_grammar

# compiled constraints kept, least recently used dropped (a server's repeated schemas compile once): 9 KB (a regex) to
# 220 KB (a nested schema) each with the default model's vocabulary
COMPILED_KEPT = 64
COMPILE_THREADS = 1  # the compile runs beside the engine's steps (a server prepares requests while it steps)


class Constraints:
    """The structured outputs of one generator: compiled constraints, the matchers of its sequences (seq.grammar)
    and each step's masks. Nothing is imported or built until a constraint is first compiled."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: tuple[int, ...]):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, eos_ids
        self._compiler = None
        self._compiled: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()  # a server compiles requests in its preparing thread while the engine steps
        self._worker: ThreadPoolExecutor | None = None
        self._pending: Future | None = None

    def compile(self, params: StructuredOutputsParams):
        """The constraint compiled for this model's vocabulary (cached); SamplingError where there is no tokenizer."""
        with self._lock:
            key = params.key
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
            compiled = self._compiler_now().compile_grammar(to_grammar(params))
            self._compiled[key] = compiled
            if len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)
            return compiled

    def _compiler_now(self):
        if self._compiler is None:
            import xgrammar

            if self.tokenizer is None:
                raise SamplingError(f"{FIELD} needs the model's tokenizer to build its masks, and this model has none; "
                                    f"add the tokenizer files to the model's folder, or drop the constraint", FIELD)
            if not self.eos_ids:
                raise SamplingError(f"{FIELD} needs the model's end-of-sequence token to end a finished grammar, and "
                                    f"this model names none; set eos_token_id in its config.json or "
                                    f"generation_config.json, or drop the constraint", FIELD)
            try:
                info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                               stop_token_ids=list(self.eos_ids))
            except Exception as e:  # a tokenizer xgrammar cannot read (its vocabulary past the model's, its kind)
                raise SamplingError(f"{FIELD} cannot be used with this model: xgrammar cannot read its tokenizer "
                                    f"({type(e).__name__}: {' '.join(str(e).split())[:200]}); drop the constraint",
                                    FIELD) from None
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=COMPILE_THREADS, cache_enabled=False)
        return self._compiler

    def matcher(self, seq: Sequence):
        """seq's matcher, made at its first use (each of a request's n samples has its own)."""
        if seq.grammar is None:
            import xgrammar

            seq.grammar = xgrammar.GrammarMatcher(self.compile(seq.params.structured_outputs))
        return seq.grammar

    def cut(self, seq: Sequence, draft: list[int]) -> list[int]:
        """A drafter's proposal for seq up to its first token the grammar rejects (a stop token that would end the
        grammar is left to the model's own row); the matcher is left as it was."""
        matcher, n = self.matcher(seq), 0
        for token in draft:
            if not matcher.accept_token(token):
                break
            n += 1
            if matcher.is_terminated():
                matcher.rollback(1)
                n -= 1
                break
        if n:
            matcher.rollback(n)
        return draft[:n]

    def accept(self, seq: Sequence, token: int) -> bool:
        """Advance seq's matcher by the token it took; whether the grammar goes on (False: it took a stop token)."""
        if not seq.grammar.accept_token(token):
            raise RuntimeError(f"request {seq.request_id!r} took token {token}, which its grammar's mask did not "
                               f"allow; this is a bug in offload's structured outputs: please report it")
        return not seq.grammar.is_terminated()

    # a step's masks -----------------------------------------------------------------------------------------------
    def start(self, scheduled: ScheduledStep) -> None:
        """Begin filling the masks of the step's constrained rows in the worker thread (none: nothing starts)."""
        jobs = _jobs(scheduled)
        if not jobs:
            return
        for seq, _ in jobs:
            self.matcher(seq)
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="offload-grammar")
        self._pending = self._worker.submit(self._fill, jobs)

    def join(self) -> dict[int, torch.Tensor]:
        """The masks start began, by id(sequence): allowed tokens [rows, vocab] bool, no rows where the grammar
        allows no token now (what it needs next is no token of this vocabulary); {} where none began."""
        pending, self._pending = self._pending, None
        return {} if pending is None else pending.result()

    def fill_now(self, scheduled: ScheduledStep) -> dict[int, torch.Tensor]:
        """The step's masks filled here (a step whose parts are run one by one, as tests do)."""
        self.start(scheduled)
        return self.join()

    def _fill(self, jobs: list[tuple[Sequence, tuple[int, ...]]]) -> dict[int, torch.Tensor]:
        out = {}
        words = (self.vocab_size + 31) // 32
        for seq, proposal in jobs:
            bits = np.empty((len(proposal) + 1, words), dtype=np.int32)
            seq.grammar.fill_next_token_bitmask(bits, 0)
            for i, token in enumerate(proposal, 1):  # cut made sure the grammar accepts each
                seq.grammar.accept_token(token)
                seq.grammar.fill_next_token_bitmask(bits, i)
            if proposal:
                seq.grammar.rollback(len(proposal))
            out[id(seq)] = unpack_mask(bits if bits[0].any() else bits[:0], self.vocab_size)
        return out


def unpack_mask(bits: np.ndarray, vocab_size: int) -> torch.Tensor:
    """A bitmask [rows, words] int32 (token t allowed where bit t % 32 of word t // 32 is set) as bool [rows, vocab]."""
    allowed = np.unpackbits(bits.view(np.uint8), axis=-1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(allowed.astype(bool))


def _jobs(scheduled: ScheduledStep) -> list[tuple[Sequence, tuple[int, ...]]]:
    """The step's constrained sequences and the proposals each verifies (none where it samples)."""
    jobs = [(seq, ()) for seq, _ in scheduled.samples if seq.params.structured_outputs is not None]
    jobs += [(seq, p.tokens) for seq, p in scheduled.verified if seq.params.structured_outputs is not None]
    return jobs

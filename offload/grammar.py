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

An answer running out of room is closed, not cut: from CLOSE_WITHIN tokens before its max_tokens (or the context's
end), each step plans the shortest way the grammar allows to finish from where the answer is (its forced text, and
of a JSON document the closing quotes and brackets, empty values and the required keys left), and once that plan
needs all but CLOSE_MARGIN of the tokens left, the step's mask allows only the plan's next token. A JSON answer that
a small model keeps extending (a string it repeats) so ends as a valid document with finish_reason "stop" instead of
"length". Where no plan fits (a grammar whose shortest end is further than the room left), nothing is forced.
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
CLOSE_WITHIN = 64  # tokens left from which each step plans an answer's closing
CLOSE_MARGIN = 2  # the plan is followed once it needs all but this many of the tokens left
# a plan's token choices where the grammar leaves a choice: in a JSON string, close it (and what holds it); outside
# one, close what is open, else the shortest value (an empty string, a zero, false, null), else the separators a
# required key needs; where none of these is allowed, the longest token the grammar allows (forced names, patterns)
CLOSERS_IN_STRING = (b'"}', b'"]', b'"')
CLOSERS = (b"}", b"]", b'""', b'"', b"0", b"false", b"null", b",", b":")


class Constraints:
    """The structured outputs of one generator: compiled constraints, the matchers of its sequences (seq.grammar)
    and each step's masks. Nothing is imported or built until a constraint is first compiled."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: tuple[int, ...], context_len: int | None = None):
        self.tokenizer, self.vocab_size, self.eos_ids, self.context_len = tokenizer, vocab_size, eos_ids, context_len
        self._compiler = None
        self._closing: _Closing | None = None
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
            self._closing = _Closing(info.decoded_vocab, self.vocab_size, self.eos_ids[0])
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
            forced = self._closing.token(seq, self._room(seq))
            if forced is not None:  # the answer must close now to fit: only the plan's next token
                bits[0] = 0
                bits[0, forced // 32] = np.int32(np.uint32(1 << (forced % 32)).view(np.int32))
            for i, token in enumerate(proposal, 1):  # cut made sure the grammar accepts each
                seq.grammar.accept_token(token)
                seq.grammar.fill_next_token_bitmask(bits, i)
            if proposal:
                seq.grammar.rollback(len(proposal))
            out[id(seq)] = unpack_mask(bits if bits[0].any() else bits[:0], self.vocab_size)
        return out


    def _room(self, seq: Sequence) -> int:
        """Tokens seq may still generate, this step's included."""
        left = seq.params.max_tokens - len(seq.output_ids)
        return left if self.context_len is None else min(left, self.context_len - seq.n_tokens)


class _Closing:
    """The shortest way a matcher's grammar allows an answer to finish, as CLOSERS choose it, over a vocabulary's
    decoded tokens (bytes)."""

    def __init__(self, decoded_vocab: list[bytes], vocab_size: int, eos: int):
        vocab = list(decoded_vocab)[:vocab_size]
        self.vocab, self.vocab_size, self.eos = vocab + [b""] * (vocab_size - len(vocab)), vocab_size, eos
        ids = {text: i for i, text in reversed(list(enumerate(self.vocab)))}  # a text's first id
        self.in_string = [ids[t] for t in CLOSERS_IN_STRING if t in ids]
        self.outside = [ids[t] for t in CLOSERS if t in ids]
        self.lengths = np.array([len(t) for t in self.vocab], dtype=np.int64)
        self.lengths[eos] = -1  # the stop token ends a plan only where the grammar is complete

    def token(self, seq: Sequence, room: int) -> int | None:
        """The next token of seq's closing plan where the plan needs (nearly) all of room, else None."""
        if room > CLOSE_WITHIN or room < 1:
            return None
        plan = self.plan(seq.grammar, b"".join(self.vocab[t] for t in seq.output_ids), room)
        return plan[0] if plan is not None and len(plan) + CLOSE_MARGIN >= room else None

    def plan(self, matcher, text: bytes, limit: int) -> list[int] | None:
        """Tokens from matcher's state (after text) to the grammar's end, its stop token last; None beyond limit."""
        m, plan, state = matcher.fork(), [], _string_state(text)
        bits = np.empty((1, (self.vocab_size + 31) // 32), dtype=np.int32)
        while len(plan) < limit:
            if m.is_completed():
                return plan + [self.eos]
            for t in m.find_jump_forward_tokens() or [self._choose(m, bits, state[0])]:
                if t is None or not m.accept_token(t):
                    return None
                plan.append(t)
                state = _string_state(self.vocab[t], state)
        return None

    def _choose(self, m, bits: np.ndarray, inside: bool) -> int | None:
        m.fill_next_token_bitmask(bits, 0)
        allowed = unpack_mask(bits, self.vocab_size)[0].numpy()
        for t in self.in_string if inside else self.outside:
            if allowed[t]:
                return t
        ids = np.flatnonzero(allowed)
        return int(ids[np.argmax(self.lengths[ids])]) if len(ids) else None


def _string_state(text: bytes, state: tuple[bool, bool] = (False, False)) -> tuple[bool, bool]:
    """(inside a JSON string, just after a backslash in it) once text follows state (inside: an odd count of
    unescaped quotes)."""
    inside, escaped = state
    for c in text:
        if escaped:
            escaped = False
        elif inside and c == 0x5C:  # a backslash
            escaped = True
        elif c == 0x22:  # a quote
            inside = not inside
    return inside, escaped


def unpack_mask(bits: np.ndarray, vocab_size: int) -> torch.Tensor:
    """A bitmask [rows, words] int32 (token t allowed where bit t % 32 of word t // 32 is set) as bool [rows, vocab]."""
    allowed = np.unpackbits(bits.view(np.uint8), axis=-1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(allowed.astype(bool))


def _jobs(scheduled: ScheduledStep) -> list[tuple[Sequence, tuple[int, ...]]]:
    """The step's constrained sequences and the proposals each verifies (none where it samples)."""
    jobs = [(seq, ()) for seq, _ in scheduled.samples if seq.params.structured_outputs is not None]
    jobs += [(seq, p.tokens) for seq, p in scheduled.verified if seq.params.structured_outputs is not None]
    return jobs

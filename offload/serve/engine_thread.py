"""The server's engine thread: it holds the model while the server runs, steps the Engine whenever a request is in
flight, and hands each request what it gained in a step (new text, its end) to the asyncio queue its HTTP handler
awaits. A step that raises fails the requests in it; the loop goes on."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from offload.engine import ABORT, Engine, StepOutput
from offload.generate import next_text
from offload.sequence import Sequence
from offload.serve.metrics import ServeMetrics

logger = logging.getLogger("offload")

IDLE_WAIT_S = 0.1  # how long the idle thread waits for a request before it looks at its stop flag again
ERROR = "error"  # the finish reason counted for a request whose step raised


@dataclass(frozen=True)
class Update:
    """What a request gained in one step. Streaming: a choice's new text and its tokens (with their logprobs where
    asked), and at that choice's end why it ended. The last update of a request says it is done (every sample
    ended) with its token counts, or carries the error that ended it."""

    index: int = 0  # the choice: the request's first index + the sample's
    text: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: list | None = None
    finish_reason: str | None = None
    done: bool = False
    error: str | None = None
    n_prompt: int = 0
    n_completion: int = 0
    n_cached: int = 0  # of the prompt tokens, those the prefix cache gave

    @property
    def last(self) -> bool:
        return self.done or self.error is not None


@dataclass
class SampleText:
    """What one sample of a streamed request has decoded and handed on."""

    decoded: str = ""  # text decoded so far
    offsets: tuple[int, int] = (0, 0)  # next_text's
    sent: str = ""  # text handed on so far
    n_logprobs: int = 0  # logprobs handed on so far


@dataclass
class Stream:
    """A request in flight as the engine thread sees it: its sequence, where its updates go (an event loop's
    queue, or for a batch's request a sink called in the engine thread), what was sent."""

    seq: Sequence
    loop: asyncio.AbstractEventLoop | None
    queue: asyncio.Queue | None
    streaming: bool  # its text goes out as it is generated (else all at once at its end)
    first_index: int = 0  # its first choice's index in the answer (a request of several prompts)
    sink: Callable[[Update], None] | None = None
    arrived_s: float = field(default_factory=time.perf_counter)
    last_token_s: float | None = None
    samples: dict[int, SampleText] = field(default_factory=dict)

    def post(self, update: Update) -> None:
        if self.sink is not None:
            self.sink(update)
            return
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, update)
        except RuntimeError:  # its event loop has closed: the server is shutting down
            pass


class EngineThread:
    """Owns an LLM's generation loop for the server's life: submit and abort from the event loop, steps here."""

    def __init__(self, llm, *, max_waiting: int, model_name: str):
        self.llm = llm
        self.engine = Engine(llm.generator, max_waiting=max_waiting)
        self.metrics = ServeMetrics(self.engine, model_name, llm.generator.context_len)
        self._streams: dict[str, Stream] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Take the model (ConfigError if a generate call holds it) and start stepping."""
        self.llm.acquire("offload serve's engine thread")
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="offload-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 60.0) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout_s)
        self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def died(self) -> bool:
        """Started, and ended without stop(): nothing would answer a request now."""
        return self._thread is not None and not self._thread.is_alive()

    def submit(self, seq: Sequence, streaming: bool, queue: asyncio.Queue | None = None,
               first_index: int = 0) -> asyncio.Queue:
        """Queue a checked sequence (from the event loop); its updates arrive on the queue returned (queue: one
        the request's other prompts share), its choices numbered from first_index. QueueFull or ConfigError as
        Engine.submit raises them."""
        stream = Stream(seq, asyncio.get_running_loop(), queue or asyncio.Queue(),
                        streaming and self.llm.generator.tokenizer is not None, first_index)
        self._submit(stream, background=False)
        return stream.queue

    def submit_background(self, seq: Sequence, sink: Callable[[Update], None]) -> None:
        """Queue a batch's checked sequence behind every interactive one (Engine.submit's background); its last
        update goes to sink, called in the engine thread. ConfigError as Engine.submit raises it."""
        self._submit(Stream(seq, None, None, False, sink=sink), background=True)

    def _submit(self, stream: Stream, background: bool) -> None:
        with self._lock:  # before the engine sees it: its first step may come at once
            self._streams[stream.seq.request_id] = stream
        try:
            self.engine.submit(stream.seq, background)
        except BaseException:
            with self._lock:
                del self._streams[stream.seq.request_id]
            raise

    def abort(self, request_id: str) -> None:
        """The client left (or its batch was cancelled): the request frees its slots at the next step (a waiting one
        leaves the queue now); nothing more is posted for it."""
        with self._lock:
            stream = self._streams.pop(request_id, None)
        if stream is not None:
            self.engine.abort(request_id)
            self._count_finish(stream, ABORT)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.engine.wait_for_work(IDLE_WAIT_S):
                    continue
                try:
                    out = self.engine.step()
                    self._deliver(out)
                    self.metrics.on_step(getattr(self.llm.model, "timeline", None))
                except Exception as e:  # noqa: BLE001 (nothing a step raises may end the server)
                    logger.error(f"a step failed ({type(e).__name__}: {e}); its requests get an error, the server "
                                 f"goes on")
                    self._fail(e, admitted_only=True)
        except BaseException as e:  # the thread ends: no request in flight would ever be answered
            logger.error(f"the engine thread stopped ({type(e).__name__}: {e}); restart offload serve")
            self._fail(e, admitted_only=False)
        finally:
            self.llm.release()

    def _deliver(self, out: StepOutput) -> None:
        now = time.perf_counter()
        new: dict[int, tuple[Stream, int, int]] = {}  # by id(stream): its new tokens, and the most of one sample
        for seq, tokens in out.tokens:
            stream = self._streams.get((seq.parent or seq).request_id)
            if stream is None:
                continue
            _, total, most = new.get(id(stream), (stream, 0, 0))
            new[id(stream)] = (stream, total + len(tokens), max(most, len(tokens)))
            if stream.streaming:
                self._stream_tokens(stream, seq, tokens)
        for stream, n_tokens, per_sample in new.values():
            first = stream.last_token_s is None
            self.metrics.on_tokens(n_tokens, now - (stream.arrived_s if first else stream.last_token_s), first,
                                   per_sample)
            stream.last_token_s = now
        for seq in out.finished:
            with self._lock:
                stream = self._streams.pop(seq.request_id, None)
            if stream is None or seq.finish_reason == ABORT:  # aborted: its client is gone
                continue
            self._count_finish(stream, seq.finish_reason)  # before its answer: a scrape after the answer counts it
            stream.post(Update(done=True, n_prompt=len(seq.prompt_ids),
                               n_completion=sum(len(s.output_ids) for s in seq.group), n_cached=seq.n_prefix_hit))

    def _stream_tokens(self, stream: Stream, seq: Sequence, tokens: list[int]) -> None:
        """Hand on a sample's new text (less the tail a stop string may still claim; at its end, the rest of its
        text, cut where a stop string ended it) and its new tokens' logprobs."""
        state = stream.samples.setdefault(seq.index, SampleText())
        if seq.finish_reason:
            text = self.llm.generator.text_of(seq)[len(state.sent):]
        else:
            params = seq.params
            piece, state.offsets = next_text(self.llm.generator.tokenizer, seq.output_ids, state.offsets,
                                             params.skip_special_tokens)
            state.decoded += piece
            held = max(map(len, params.stop)) - 1 if params.stop and not params.include_stop_str_in_output else 0
            ready = state.decoded[: max(len(state.sent), len(state.decoded) - held)]
            text, state.sent = ready[len(state.sent):], ready
        logprobs = None
        if seq.logprobs is not None:
            logprobs, state.n_logprobs = seq.logprobs[state.n_logprobs:], len(seq.logprobs)
        if text or logprobs or seq.finish_reason:
            ids = tuple(seq.output_ids[len(seq.output_ids) - len(logprobs):]) if logprobs else tuple(tokens)
            stream.post(Update(stream.first_index + seq.index, text, ids, logprobs, seq.finish_reason))

    def _fail(self, error: BaseException, admitted_only: bool) -> None:
        """End requests with an error: those of a step that raised (admitted_only: they leave the engine at the
        next step), or every one in flight."""
        with self._lock:
            failed = [s for s in self._streams.values() if s.seq.admitted or not admitted_only]
            for stream in failed:
                del self._streams[stream.seq.request_id]
        for stream in failed:
            self.engine.abort(stream.seq.request_id)
            self._count_finish(stream, ERROR)
            stream.post(Update(error=f"generation failed ({type(error).__name__}: {error}); the request was "
                                     f"dropped: send it again, or report the error"))

    def _count_finish(self, stream: Stream, finish_reason: str) -> None:
        seq = stream.seq
        self.metrics.on_finish(finish_reason, len(seq.prompt_ids), sum(len(s.output_ids) for s in seq.group),
                               time.perf_counter() - stream.arrived_s, seq.n_prefix_hit)

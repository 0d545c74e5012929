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

from offload.engine import ABORT, Engine, Sequence, StepOutput
from offload.generate import next_text
from offload.serve.metrics import ServeMetrics

logger = logging.getLogger("offload")

IDLE_WAIT_S = 0.1  # how long the idle thread waits for a request before it looks at its stop flag again
ERROR = "error"  # the finish reason counted for a request whose step raised


@dataclass(frozen=True)
class Update:
    """What a request gained in one step: new text (streaming), and on its last update why it ended (or the
    error that ended it) with its token counts."""

    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    n_prompt: int = 0
    n_completion: int = 0

    @property
    def last(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass
class Stream:
    """A request in flight as the engine thread sees it: its sequence, where its updates go (an event loop's
    queue, or for a batch's request a sink called in the engine thread), what was sent."""

    seq: Sequence
    loop: asyncio.AbstractEventLoop | None
    queue: asyncio.Queue | None
    streaming: bool  # its text goes out as it is generated (else all at once at its end)
    sink: Callable[[Update], None] | None = None
    arrived_s: float = field(default_factory=time.perf_counter)
    last_token_s: float | None = None
    decoded: str = ""  # text decoded so far (streaming)
    offsets: tuple[int, int] = (0, 0)  # next_text's
    sent: str = ""  # text handed on so far

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

    def __init__(self, llm, *, max_waiting: int):
        self.llm = llm
        self.engine = Engine(llm.generator, max_waiting=max_waiting)
        self.metrics = ServeMetrics(self.engine)
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

    def submit(self, seq: Sequence, streaming: bool) -> asyncio.Queue:
        """Queue a checked sequence (from the event loop); its updates arrive on the queue returned. QueueFull
        or ConfigError as Engine.submit raises them."""
        stream = Stream(seq, asyncio.get_running_loop(), asyncio.Queue(),
                        streaming and self.llm.generator.tokenizer is not None)
        self._submit(stream, background=False)
        return stream.queue

    def submit_background(self, seq: Sequence, sink: Callable[[Update], None]) -> None:
        """Queue a batch's checked sequence behind every interactive one (Engine.submit's background); its last
        update goes to sink, called in the engine thread. ConfigError as Engine.submit raises it."""
        self._submit(Stream(seq, None, None, False, sink), background=True)

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
            self.metrics.on_finish(ABORT, len(stream.seq.prompt_ids))

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
        for request_id, tokens in out.tokens.items():
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            first = stream.last_token_s is None
            self.metrics.on_tokens(len(tokens), now - (stream.arrived_s if first else stream.last_token_s), first)
            stream.last_token_s = now
            if stream.streaming and not stream.seq.finish_reason:
                text = self._new_text(stream)
                if text:
                    stream.post(Update(text=text))
        for seq in out.finished:
            with self._lock:
                stream = self._streams.pop(seq.request_id, None)
            if stream is None or seq.finish_reason == ABORT:  # aborted: its client is gone
                continue
            text = self.llm.generator.text_of(seq)
            stream.post(Update(text=text[len(stream.sent):], finish_reason=seq.finish_reason,
                               n_prompt=len(seq.prompt_ids), n_completion=len(seq.output_ids)))
            self.metrics.on_finish(seq.finish_reason, len(seq.prompt_ids))

    def _new_text(self, stream: Stream) -> str:
        """Text to send now: what the new tokens decode to, less the tail a stop string may still claim."""
        seq, params = stream.seq, stream.seq.params
        piece, stream.offsets = next_text(self.llm.generator.tokenizer, seq.output_ids, stream.offsets,
                                          params.skip_special_tokens)
        stream.decoded += piece
        held = max(map(len, params.stop)) - 1 if params.stop and not params.include_stop_str_in_output else 0
        ready = stream.decoded[: max(len(stream.sent), len(stream.decoded) - held)]
        text, stream.sent = ready[len(stream.sent):], ready
        return text

    def _fail(self, error: BaseException, admitted_only: bool) -> None:
        """End requests with an error: those of a step that raised (admitted_only: they leave the engine at the
        next step), or every one in flight."""
        with self._lock:
            failed = [s for s in self._streams.values() if s.seq.base >= 0 or not admitted_only]
            for stream in failed:
                del self._streams[stream.seq.request_id]
        for stream in failed:
            self.engine.abort(stream.seq.request_id)
            stream.post(Update(error=f"generation failed ({type(error).__name__}: {error}); the request was "
                                     f"dropped: send it again, or report the error"))
            self.metrics.on_finish(ERROR, len(stream.seq.prompt_ids))

"""One batch running on the served model: a thread reads its input (the job engine's read_requests), resumes its
output log (the job engine's OutputLog: a record flushed per answer, so a killed server loses only what was in
flight, and a resume skips every custom_id already answered), and feeds its requests to the engine thread as
background sequences, a bounded number at a time, behind every interactive request, until each is answered or
the batch's completion window ends (then what is in flight is aborted and the batch expires). Each answer or
failure is written once, by this thread, in the job engine's record shapes."""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from pathlib import Path

from offload.sequence import Sequence
from offload.errors import ConfigError, OffloadError, OutputError
from offload.jobs import responses
from offload.jobs.batch import BadLine, Request, error_record, read_requests, success_record
from offload.jobs.output import OutputLog
from offload.jobs.worker import chat_split, prompt_ids, request_problem
from offload.reasoning import AnswerSplit
from offload.serve.engine_thread import Update
from offload.serve.protocol import ApiError

logger = logging.getLogger("offload")

# Sequences one batch keeps queued or running per slot of the engine's batch: two refill every slot that frees at
# the next step, and a 50,000-line batch never waits in the engine at once.
QUEUED_PER_SLOT = 2
LOG_NAME = "log.jsonl"  # the batch's output log, in its folder
POLL_S = 0.2  # how often a runner waiting for answers looks at its cancel and stop flags and the clock


def prefix_order(requests: list[Request], prefix_caching: bool) -> list[Request]:
    """The order a batch's requests are fed in: with the prefix cache, those that begin alike (the same messages or
    prompt up to some point) side by side, sorted by their text, so a shared few-shot prefix or system prompt is still
    cached when the next request that needs it starts; without it, the file's order."""
    if not prefix_caching:
        return requests

    def text(req: Request) -> str:
        if req.messages is not None:  # the chat template is the batch's own: messages that begin alike render alike
            return "\x00".join(f"{m.get('role')}\x01{m.get('content')}" for m in req.messages)
        return req.prompt if isinstance(req.prompt, str) else "\x00".join(map(str, req.prompt or ()))

    return sorted(requests, key=text)


class BatchRunner:
    """Runs one batch in its own thread; cancel() and stop() may come from any thread."""

    def __init__(self, batch: dict, folder: Path, server, batches):
        """batch: its object (id, endpoint); server: what the routes share (llm, engine_thread, model_name,
        defaults); batches: the registry this runner reports to (update, finalize)."""
        self.batch_id, self.endpoint, self.folder = batch["id"], batch["endpoint"], folder
        self.input_file_id = batch["input_file_id"]
        self.server, self.batches = server, batches
        self.n_total = self.n_completed = self.n_failed = 0
        self._started = False  # counts are the job's once its log is read
        self._expired = False  # its window ended with requests unanswered
        self._answers: queue.Queue[tuple[str, Update]] = queue.Queue()
        self._in_flight: dict[str, tuple[Request, Sequence, AnswerSplit | None]] = {}  # with its answer's split
        self._cancel, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"offload-{self.batch_id}", daemon=True)

    @property
    def input_path(self) -> Path:
        return self.folder / "input.jsonl"

    @property
    def log_path(self) -> Path:
        return self.folder / LOG_NAME

    def start(self) -> None:
        self._thread.start()

    def cancel(self) -> None:
        """Feed no more; what is in flight is aborted, and the batch ends as cancelled with the answers written."""
        self._cancel.set()

    def stop(self, timeout_s: float = 10.0) -> None:
        """The server is stopping: leave the batch as it stands (a restart resumes it)."""
        self._stop.set()
        self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def counts(self) -> dict | None:
        """The request counts so far (None until the batch's input and log are read)."""
        if not self._started:
            return None
        return {"total": self.n_total, "completed": self.n_completed, "failed": self.n_failed}

    def _run(self) -> None:
        try:
            requests, bad = self._read()
            log = OutputLog(self.log_path, self._fingerprint(), retry_failed=True)
            done = log.open()
        except ConfigError as e:
            self.batches.fail(self.batch_id, str(e))
            return
        try:
            self._answer(log, done, requests, bad)
        except Exception as e:  # noqa: BLE001 (a runner that fails must say so, not leave the batch in progress)
            # as OpenAI ends a batch that cannot finish (expired): what was answered in the output file, each
            # request not run an error line; not `failed` with the answers out of reach
            why = (f"the server could not write its log: {e.reason}" if isinstance(e, OutputError) and e.reason
                   else f"{type(e).__name__}: {e}")
            logger.error(f"batch {self.batch_id} stopped partway ({why})")
            self._abort_in_flight()
            log.close()
            self.batches.finalize(self.batch_id, "failed", failure=why, items=[*bad, *requests])
            return
        log.close()
        if not self._stop.is_set():
            status = "cancelled" if self._cancel.is_set() else "expired" if self._expired else "completed"
            self.batches.finalize(self.batch_id, status, items=[*bad, *requests] if self._expired else ())

    def _read(self) -> tuple[list[Request], list[BadLine]]:
        """The batch's requests; a line for another endpoint than the batch's is a failed line."""
        requests, bad = read_requests(self.input_path, "openai", self.server.defaults, name=self._input_name())
        wrong = [r for r in requests if r.url != self.endpoint]
        bad += [BadLine(r.line_no, f"line {r.line_no} (custom_id {r.custom_id!r}): expected 'url' to be the "
                                   f"batch's endpoint {self.endpoint}, found {r.url}", r.custom_id) for r in wrong]
        return [r for r in requests if r.url == self.endpoint], sorted(bad, key=lambda b: b.line_no)

    def _input_name(self) -> str:
        """What the batch's messages call its input: the name it was uploaded under (the client's, not the server's
        copy in the state folder), else its file id."""
        try:
            return self.batches.files.info(self.input_file_id)["filename"]
        except (ApiError, KeyError):
            return self.input_file_id

    def _fingerprint(self) -> dict:
        """What decides the answers: a restart under another model or other defaults refuses to resume."""
        return {"batch.id": self.batch_id, "batch.endpoint": self.endpoint, "model": self.server.model_name,
                **{f"sampling.{k}": v for k, v in sorted(self.server.defaults.items())}}

    def _answer(self, log: OutputLog, done: set[str], requests: list[Request], bad: list[BadLine]) -> None:
        """Write the bad lines, then feed the requests not yet answered and write each answer as it comes, until
        none is left, the batch is cancelled or the server stops, or the batch's window ends."""
        self.n_total, self.n_completed, self._started = len(requests) + len(bad), len(done), True
        self.batches.started(self.batch_id, self.counts())
        for item in bad:
            if item.key not in done:
                self._write(log, error_record(item, item.message))
        todo = deque(prefix_order([r for r in requests if r.key not in done], self.server.llm.generator.prefix_caching))
        window = QUEUED_PER_SLOT * self.server.llm.generator.max_batch_size
        while not self._stop.is_set():
            if self._cancel.is_set():
                self._abort_in_flight()
                break
            if (todo or self._in_flight) and self.batches.past_window(self.batch_id):
                self._expired = True
                self._abort_in_flight()
                break
            while todo and len(self._in_flight) < window and not self._cancel.is_set():
                self._feed(log, todo.popleft())
            if not self._in_flight:
                break
            try:
                request_id, update = self._answers.get(timeout=POLL_S)
            except queue.Empty:
                continue
            self._write_answer(log, *self._in_flight.pop(request_id), update)
        self._drain(log)

    def _feed(self, log: OutputLog, req: Request) -> None:
        """Hand one request to the engine thread (or write why it cannot run)."""
        llm, request_id = self.server.llm, f"{self.batch_id}:{req.custom_id}"  # never an interactive id (cmpl-)
        try:
            ids, _ = prompt_ids(req, llm.tokenizer, llm.path)
            llm.generator.check_prompt(ids, req.params)
            split = chat_split(req, llm, ids, self.server.reasoning_parser)
            seq = Sequence(request_id, ids, req.params if split is None else split.sampling(req.params))
            self._in_flight[request_id] = (req, seq, split)
            self.server.engine_thread.submit_background(seq, lambda update: self._answers.put((request_id, update)))
        except OffloadError as e:
            self._in_flight.pop(request_id, None)
            self._write(log, error_record(req, request_problem(req, e)))

    def _write_answer(self, log: OutputLog, req: Request, seq: Sequence, split: AnswerSplit | None,
                      update: Update) -> None:
        if update.error:
            self._write(log, error_record(req, request_problem(req, update.error), "server_error"))
            return
        llm = self.server.llm
        output = llm.output_of(seq, req.prompt if isinstance(req.prompt, str) else None)
        choices = responses.choices(req.url, output, llm.tokenizer, echo=req.echo, split=split, tools=req.tools,
                                    tool_call_parser=self.server.tool_call_parser)
        self._write(log, success_record(req, choices, update.n_prompt, update.n_completion, self.server.model_name,
                                          update.n_cached))

    def _write(self, log: OutputLog, record: dict) -> None:
        log.append(record)
        if record["error"] is None:
            self.n_completed += 1
        else:
            self.n_failed += 1

    def _abort_in_flight(self) -> None:
        for request_id in list(self._in_flight):
            self.server.engine_thread.abort(request_id)

    def _drain(self, log: OutputLog) -> None:
        """Answers that arrived as the batch was cancelled or stopped are written too: each was generated once."""
        while True:
            try:
                request_id, update = self._answers.get_nowait()
            except queue.Empty:
                return
            pending = self._in_flight.pop(request_id, None)
            if pending is not None:
                self._write_answer(log, *pending, update)

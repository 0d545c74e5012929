"""The OpenAI-compatible HTTP app of `offload serve` (FastAPI): models, completions and chat completions, plain and
streamed, health and Prometheus metrics, the Batch API's routes (batches.py) and vLLM's tokenize and detokenize
(tokens.py). Requests go to the engine thread, which owns the model."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from offload.errors import ConfigError, QueueFull
from offload.jobs.batch import CHAT, COMPLETIONS
from offload.options import ServeOptions
from offload.serve import protocol
from offload.serve.batches import Batches, add_batch_routes
from offload.serve.engine_thread import EngineThread
from offload.serve.protocol import ApiError, Job, sse
from offload.serve.tokens import add_token_routes

RETRY_AFTER_S = 1  # what a 503 for a full queue asks the client to wait: slots free as requests finish


class Server:
    """What the routes share: the model and its name, the request defaults, the key, how chat answers split off
    their reasoning and how their tool calls are read, the engine thread, and the batches of the state folder (None
    without one)."""

    def __init__(self, llm, model_name: str, *, defaults: dict | None = None, api_key: str | None = None,
                 max_waiting: int = ServeOptions.model_fields["max_waiting"].default, state_dir: Path | None = None,
                 max_upload_bytes: int = ServeOptions.model_fields["max_upload_bytes"].default,
                 reasoning_parser: str = ServeOptions.model_fields["reasoning_parser"].default,
                 tool_call_parser: str = ServeOptions.model_fields["tool_call_parser"].default):
        self.llm, self.model_name, self.defaults, self.api_key = llm, model_name, defaults or {}, api_key
        self.reasoning_parser, self.tool_call_parser = reasoning_parser, tool_call_parser
        self.created = int(time.time())
        self.engine_thread = EngineThread(llm, max_waiting=max_waiting, model_name=model_name)
        # requests are tokenized here, one at a time, off the event loop: a long prompt (seconds) must not stop the
        # server answering the others and /health
        self.preparer = ThreadPoolExecutor(1, thread_name_prefix="offload-prepare")
        self.metrics = self.engine_thread.metrics
        self.max_upload_bytes = max_upload_bytes
        self.batches = Batches(Path(state_dir), self) if state_dir is not None else None

    def check_model(self, body) -> None:
        """A body naming another model is refused; the name given, or its last path part, is this one."""
        name = body.get("model") if isinstance(body, dict) else None
        if name is not None and name not in (self.model_name, Path(self.model_name).name):
            raise ApiError(404, f"the model {name!r} is not served here; this server serves {self.model_name!r} "
                                f"(GET /v1/models)", "model", "model_not_found")


def make_app(server: Server) -> FastAPI:
    """The app; its lifespan starts the engine thread and resumes the unfinished batches, and stops both
    (app.state.server reaches them)."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.engine_thread.start()
        if server.batches is not None:
            server.batches.resume()
        try:
            yield
        finally:
            if server.batches is not None:
                server.batches.stop()
            server.engine_thread.stop()
            server.preparer.shutdown(cancel_futures=True)

    app = FastAPI(title="offload", lifespan=lifespan)
    app.state.server = server
    _add_error_handlers(app)
    auth = [Depends(_key_check(server))]

    @app.get("/health")
    async def health():
        if not server.engine_thread.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models", dependencies=auth)
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.created,
                                            "owned_by": "offload", "max_model_len": server.llm.generator.context_len}]}

    @app.get("/metrics", dependencies=auth)
    async def metrics():
        text, content_type = server.metrics.exposition()
        return Response(text, media_type=content_type)

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request):
        return await _answer(server, request, COMPLETIONS)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request):
        return await _answer(server, request, CHAT)

    add_batch_routes(app, server, auth)
    add_token_routes(app, server, auth)
    return app


def _key_check(server: Server):
    async def check(request: Request) -> None:
        if server.api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
        # the scheme is case-insensitive (RFC 9110: `bearer` is `Bearer`); the key is compared as sent
        if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), server.api_key.encode()):
            raise ApiError(401, "missing or wrong API key; send the header `Authorization: Bearer <key>` with the "
                                "key the server was started with (--api-key)", code="invalid_api_key")
    return check


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_parameter(request, e: RequestValidationError):
        return JSONResponse(_validation_error(e).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        return JSONResponse(protocol.error_body(str(e.detail), "invalid_request_error"), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def server_error(request, e: Exception):
        return JSONResponse(protocol.error_body(f"the server failed ({type(e).__name__}: {e})", "server_error"),
                            status_code=500)


def _validation_error(e: RequestValidationError) -> ApiError:
    """FastAPI's check of a route's parameters (a query's limit=abc) in OpenAI's shape, naming the parameter."""
    first = (e.errors() or [{}])[0]
    loc = [str(part) for part in first.get("loc", ())]  # ("query", "limit")
    where, name = (loc[0], loc[-1]) if len(loc) > 1 else ("request", loc[0] if loc else "body")
    found = f", found {str(first['input'])[:80]!r}" if "input" in first else ""
    return ApiError(400, f"the {where} parameter {name!r} is not valid ({first.get('msg', 'invalid')}{found}); "
                         f"fix it and send the request again", str(name))


async def _answer(server: Server, request: Request, url: str):
    body = await protocol.read_json(request)
    server.check_model(body)
    job = await asyncio.get_running_loop().run_in_executor(server.preparer, functools.partial(
        protocol.prepare, url, body, server.llm, server.model_name, server.defaults, server.reasoning_parser,
        server.tool_call_parser))
    if server.engine_thread.died:
        raise ApiError(503, "the server's engine thread has stopped (its log says why); restart offload serve",
                       kind="server_error")
    _check_queue_bound(server, job)
    queue, first = asyncio.Queue(), 0
    try:
        for seq in job.seqs:  # a request of several prompts: one sequence each, one queue
            server.engine_thread.submit(seq, job.stream, queue, first)
            first += seq.params.n
    except QueueFull as e:
        _abort(server, job)
        raise ApiError(503, f"the server is busy: {e}", kind="server_error",
                       headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    except ConfigError as e:
        _abort(server, job)
        raise ApiError(400, str(e), "n" if "asks for n=" in str(e) else "max_tokens") from None
    if job.stream:
        return StreamingResponse(_events(server, job, queue), media_type="text/event-stream")
    return await _whole(server, request, job, queue)


def _check_queue_bound(server: Server, job: Job) -> None:
    """A request of more prompts than may ever wait at once could only get 503s: 400, before any is queued."""
    bound = server.engine_thread.engine.max_waiting
    if bound is not None and len(job.seqs) > bound:
        raise ApiError(400, f"the request has {len(job.seqs)} prompts but at most {bound} requests may wait at once "
                            f"on this server (serve.max_waiting); send at most {bound} prompts per request, or start "
                            f"the server with --max-waiting {len(job.seqs)} or more", "prompt")


def _abort(server: Server, job: Job) -> None:
    for seq in job.seqs:
        server.engine_thread.abort(str(seq.request_id))


async def _whole(server: Server, request: Request, job: Job, queue: asyncio.Queue):
    """The answer of a request that does not stream; a client that leaves before it is done aborts it."""
    done = asyncio.ensure_future(_all_done(queue, len(job.seqs)))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not done.done():
            return Response(status_code=499)  # nobody reads it
        error = done.result()
    finally:
        for task in (done, gone):
            task.cancel()
        if not done.done() or done.cancelled() or done.result() is not None:
            _abort(server, job)
    if error:
        raise ApiError(500, error, kind="server_error")
    outputs = [server.llm.output_of(seq, text) for seq, text in zip(job.seqs, job.prompt_texts)]
    return protocol.completion(job, outputs)


async def _all_done(queue: asyncio.Queue, n_seqs: int) -> str | None:
    """Wait until each of the request's sequences is done; the error that ended one, if any."""
    while n_seqs:
        update = await queue.get()
        if update.error:
            return update.error
        n_seqs -= update.done
    return None


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _events(server: Server, job: Job, queue: asyncio.Queue):
    """Server-sent events: chunks as text arrives, each choice's end, usage if asked, [DONE]; a client that
    leaves (the stream is cancelled or closed) aborts its request."""
    finished, left, n_prompt, n_completion, n_cached = False, len(job.seqs), 0, 0, 0
    try:
        for index in range(job.n_choices):
            if job.url == CHAT:
                yield sse(protocol.chunk(job, index, role=True))
            elif job.echo:  # the prompt's text first
                seq = _seq_of(job, index)
                yield sse(protocol.chunk(job, index, _prompt_text(server, job, seq)))
        while left:
            update = await queue.get()
            if update.error:
                yield sse(protocol.error_body(update.error, "server_error"))
                break
            if update.done:
                left -= 1
                n_prompt, n_completion = n_prompt + update.n_prompt, n_completion + update.n_completion
                n_cached += update.n_cached
                continue
            piece = protocol.text_chunk(job, update.index, update.text, update.logprobs, list(update.token_ids),
                                        final=update.finish_reason is not None)
            if piece is not None:
                yield sse(piece)
            if update.finish_reason:
                yield sse(protocol.finish_chunk(job, update.index, update.finish_reason))
        finished = not left
        if finished and job.include_usage:
            yield sse(protocol.usage_chunk(job, n_prompt, n_completion, n_cached))
        yield sse("[DONE]")
    finally:
        if not finished:
            _abort(server, job)


def _seq_of(job: Job, index: int):
    for seq in job.seqs:
        if index < seq.params.n:
            return seq
        index -= seq.params.n
    raise IndexError(index)


def _prompt_text(server: Server, job: Job, seq) -> str:
    text = job.prompt_texts[job.seqs.index(seq)]
    tokenizer = server.llm.tokenizer
    return text if text is not None else "" if tokenizer is None else tokenizer.decode(seq.prompt_ids)

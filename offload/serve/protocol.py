"""OpenAI's HTTP shapes: a request body checked into a prompt and SamplingParams (by the batch job's own checks,
so a body means the same in a job and here), the error object, and the streamed chunks."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from offload.engine import Sequence
from offload.errors import OffloadError
from offload.jobs.batch import CHAT, BodyError, Request, check_body
from offload.jobs.worker import prompt_ids

SERVE_KEYS = ("stream_options",)  # body keys only a server reads (a batch job ignores 'stream')


class ApiError(Exception):
    """An answer other than 200, in OpenAI's error shape; param names the body field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass
class Job:
    """One checked request: its sequence for the engine and how to answer it."""

    url: str
    seq: Sequence
    model: str
    stream: bool = False
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def id(self) -> str:
        return str(self.seq.request_id)


def prepare(url: str, body, llm, model: str, defaults: dict) -> Job:
    """The Job of a request body to url, answered as model; ApiError (400) names the field that cannot run."""
    if not isinstance(body, dict):
        raise ApiError(400, f"expected the request body to be a JSON object, found {type(body).__name__}")
    stream = False if body.get("stream") is None else body["stream"]
    if not isinstance(stream, bool):
        raise ApiError(400, f"expected 'stream' to be true or false, found {stream!r}", "stream")
    include_usage = _include_usage(body.get("stream_options"), stream)
    try:
        params, content = check_body(url, {k: v for k, v in body.items() if k not in SERVE_KEYS}, defaults)
    except BodyError as e:
        raise ApiError(400, str(e), e.param) from None
    request_id = f"{'chatcmpl' if url == CHAT else 'cmpl'}-{uuid.uuid4().hex}"
    req = Request(request_id, 0, url, params, **({"messages": content} if url == CHAT else {"prompt": content}))
    try:
        ids, _ = prompt_ids(req, llm.tokenizer, llm.path)
        llm.generator.check_prompt(ids)  # the one check, against the context the server's cache holds
    except OffloadError as e:
        raise ApiError(400, str(e), "messages" if url == CHAT else "prompt") from None
    return Job(url, Sequence(request_id, ids, params), model, stream, include_usage)


def _include_usage(options, stream: bool) -> bool:
    if options is None:
        return False
    if not stream:
        raise ApiError(400, "'stream_options' is only allowed when 'stream' is true; drop it or set stream",
                       "stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"} or \
            not isinstance(options.get("include_usage", False), bool):
        raise ApiError(400, f"expected 'stream_options' to be {{'include_usage': true or false}}, found {options!r}",
                       "stream_options")
    return options.get("include_usage", False)


def usage(n_prompt: int, n_completion: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}


def completion(job: Job, text: str, finish_reason: str, n_prompt: int, n_completion: int) -> dict:
    """The whole answer of a request that did not stream."""
    if job.url == CHAT:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {"id": job.id, "object": "chat.completion" if job.url == CHAT else "text_completion",
            "created": job.created, "model": job.model, "choices": [choice], "usage": usage(n_prompt, n_completion)}


def chunk(job: Job, text: str | None = None, finish_reason: str | None = None, role: bool = False) -> dict:
    """One streamed piece: new text, or the end (finish_reason); for chat, the first one carries the role."""
    if job.url == CHAT:
        delta = {"role": "assistant", "content": ""} if role else {} if text is None else {"content": text}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    out = {"id": job.id, "object": "chat.completion.chunk" if job.url == CHAT else "text_completion",
           "created": job.created, "model": job.model, "choices": [choice]}
    return {**out, "usage": None} if job.include_usage else out


def usage_chunk(job: Job, n_prompt: int, n_completion: int) -> dict:
    """The last chunk when stream_options.include_usage is set: no choices, the request's usage."""
    return {"id": job.id, "object": "chat.completion.chunk" if job.url == CHAT else "text_completion",
            "created": job.created, "model": job.model, "choices": [], "usage": usage(n_prompt, n_completion)}


def sse(obj: dict | str) -> str:
    """One server-sent event: `data: <json>` (or `data: [DONE]`) and a blank line."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


"""OpenAI's HTTP shapes: a request body checked into a prompt and SamplingParams (by the batch job's own checks,
so a body means the same in a job and here), the error object, and the streamed chunks."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from offload.sequence import Sequence
from offload.errors import OffloadError
from offload.jobs import responses
from offload.jobs.batch import CHAT, BodyError, Request, check_body, template_kwargs
from offload.jobs.worker import chat_split, prompt_ids
from offload.options import DEFAULT_REASONING_PARSER, DEFAULT_TOOL_CALL_PARSER
from offload.reasoning import AnswerSplit
from offload import tool_parsers
from offload.tool_parsers import AnswerParser, tool_parser
from offload.tools import ToolChoice, from_body as tools_of

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


async def read_json(request):
    """A request's body as JSON; ApiError 400 if it is not JSON, or nests deeper than Python's parser follows (its
    RecursionError is not the server's failure)."""
    try:
        return await request.json()
    except ValueError as e:
        raise ApiError(400, f"the request body is not valid JSON ({e}); send one JSON object") from None
    except RecursionError:
        raise ApiError(400, "the request body is not valid JSON as this server reads it: its arrays and objects "
                            "nest too deep to parse; send one JSON object nested a few levels deep") from None


@dataclass
class Job:
    """One checked request: a sequence per prompt for the engine (n samples each), and how to answer it."""

    url: str
    id: str
    seqs: list[Sequence]
    model: str
    prompt_texts: list[str | None]  # each prompt's text where it was given as text (echo)
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    tokenizer: object = field(default=None, repr=False)  # the model's: logprobs name their tokens by it
    split: AnswerSplit | None = None  # chat: how the answer splits into reasoning and content; None: not split
    tools: ToolChoice | None = None  # chat: the tools offered (their calls are parsed out of the answer)
    tool_call_parser: str = DEFAULT_TOOL_CALL_PARSER  # serve.tool_call_parser: how an auto answer's calls are read
    created: int = field(default_factory=lambda: int(time.time()))
    parsers: dict[int, AnswerParser] = field(default_factory=dict, repr=False)  # by choice: a stream's readers

    def parser(self, index: int) -> AnswerParser:
        """Choice index's reader of its streamed answer (reasoning, content and tool calls)."""
        if index not in self.parsers:
            parser = tool_parser(self.tokenizer, self.tools, self.split, self.tool_call_parser)
            self.parsers[index] = AnswerParser(self.split, parser, self.tools.names if self.tools else ())
        return self.parsers[index]

    @property
    def n_choices(self) -> int:
        return sum(s.params.n for s in self.seqs)


def prepare(url: str, body, llm, model: str, defaults: dict, reasoning_parser: str = DEFAULT_REASONING_PARSER,
            tool_call_parser: str = DEFAULT_TOOL_CALL_PARSER) -> Job:
    """The Job of a request body to url, answered as model, a chat answer split by reasoning_parser
    (serve.reasoning_parser) and its tool calls read by tool_call_parser (serve.tool_call_parser); ApiError (400)
    names the field that cannot run."""
    if not isinstance(body, dict):
        raise ApiError(400, f"expected the request body to be a JSON object, found {type(body).__name__}")
    stream = False if body.get("stream") is None else body["stream"]
    if not isinstance(stream, bool):
        raise ApiError(400, f"expected 'stream' to be true or false, found {stream!r}", "stream")
    include_usage = _include_usage(body.get("stream_options"), stream)
    try:
        params, content = check_body(url, {k: v for k, v in body.items() if k not in SERVE_KEYS}, defaults,
                                     many=True)
    except BodyError as e:
        raise ApiError(400, str(e), e.param) from None
    echo = url != CHAT and body.get("echo") is True
    if echo and stream and params.prompt_logprobs is not None:
        raise ApiError(400, "'echo' with 'logprobs' is answered whole, not streamed; set 'stream' to false, or drop "
                            "one of them", "echo")
    job_id = f"{'chatcmpl' if url == CHAT else 'cmpl'}-{uuid.uuid4().hex}"
    prompts = [content] if url == CHAT else content
    seqs, texts, split, tools = [], [], None, tools_of(body) if url == CHAT else None
    for i, prompt in enumerate(prompts):
        given = {"messages": prompt, "chat_template_kwargs": template_kwargs(body), "tools": tools} \
            if url == CHAT else {"prompt": prompt}
        req = Request(job_id, 0, url, params, **given)
        where = "messages" if url == CHAT else "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        try:
            ids, text = prompt_ids(req, llm.tokenizer, llm.path, llm.generator.context_len)
            llm.generator.check_prompt(ids, params)  # the one check, against the context the server's cache holds
        except OffloadError as e:
            field = getattr(e, "param", None) or where  # a sampling field, else the prompt
            raise ApiError(400, str(e) if len(prompts) == 1 else f"{where}: {e}", field) from None
        split = chat_split(req, llm, ids, reasoning_parser)  # chat: one prompt
        seqs.append(Sequence(job_id if len(prompts) == 1 else f"{job_id}-{i}", ids,
                             params if split is None else split.sampling(params)))
        texts.append(text)
    return Job(url, job_id, seqs, model, texts, stream=stream, include_usage=include_usage, echo=echo,
               tokenizer=llm.tokenizer, split=split, tools=tools, tool_call_parser=tool_call_parser)


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


def completion(job: Job, outputs: list) -> dict:
    """The whole answer of a request that did not stream, from each prompt's RequestOutput."""
    out_choices, first = [], 0
    for output, text in zip(outputs, job.prompt_texts):
        out_choices += responses.choices(job.url, output, job.tokenizer, echo=job.echo, prompt_text=text,
                                         first_index=first, split=job.split, tools=job.tools,
                                         tool_call_parser=job.tool_call_parser)
        first += len(output.outputs)
    return responses.response_body(job.url, job.id, job.created, job.model, out_choices, responses.usage_of(outputs))


def text_chunk(job: Job, index: int, text: str, logprobs: list | None, token_ids: list[int],
               final: bool) -> dict | None:
    """The chunk of choice `index`'s new text, for chat split into delta.reasoning_content and delta.content where
    the job splits its answer (a tail that may begin a tag waits for the next piece) and its complete tool calls in
    delta.tool_calls where it offers tools; None where nothing is to be sent yet. final: the choice ends with this
    piece."""
    reasoning, calls = None, []
    if job.url == CHAT and (job.split is not None or job.tools is not None):
        parser = job.parser(index)
        first = parser.n_calls
        reasoning, text, calls = parser.feed(text, final)
        calls = [{"index": first + k, **call} for k, call in enumerate(calls)]
    if not (text or reasoning or logprobs or calls):
        return None
    return chunk(job, index, text if text or not (reasoning or calls) else None, logprobs=logprobs,
                 token_ids=token_ids, reasoning=reasoning or None, tool_calls=calls or None)


def finish_chunk(job: Job, index: int, reason: str) -> dict:
    """The chunk that ends choice `index`: finish_reason tool_calls where its answer made tool calls."""
    called = index in job.parsers and job.parsers[index].n_calls > 0
    return chunk(job, index, finish_reason=tool_parsers.finish_reason(reason, called))


def chunk(job: Job, index: int = 0, text: str | None = None, finish_reason: str | None = None,
          role: bool = False, logprobs: list | None = None, token_ids: list[int] | None = None,
          reasoning: str | None = None, tool_calls: list[dict] | None = None) -> dict:
    """One streamed piece of choice `index`: new text (and its tokens' logprobs; for chat, reasoning_content
    beside or instead of content, and tool_calls: OpenAI's deltas, each call whole), or its end (finish_reason); for
    chat, the first one carries the role."""
    if job.url == CHAT:
        delta = {"role": "assistant", "content": ""} if role else {} if text is None else {"content": text}
        if reasoning is not None:
            delta = {"reasoning_content": reasoning, **delta}
        if tool_calls is not None:
            delta = {**delta, "tool_calls": tool_calls}
        lp = None if logprobs is None else responses.chat_logprobs(job.tokenizer, logprobs)
        choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
    else:
        lp = None if logprobs is None else responses.completion_logprobs(job.tokenizer, token_ids, logprobs)
        choice = {"index": index, "text": text or "", "logprobs": lp, "finish_reason": finish_reason}
    out = {"id": job.id, "object": "chat.completion.chunk" if job.url == CHAT else "text_completion",
           "created": job.created, "model": job.model, "choices": [choice]}
    return {**out, "usage": None} if job.include_usage else out


def usage_chunk(job: Job, n_prompt: int, n_completion: int, n_cached: int = 0) -> dict:
    """The last chunk when stream_options.include_usage is set: no choices, the request's usage."""
    return {"id": job.id, "object": "chat.completion.chunk" if job.url == CHAT else "text_completion",
            "created": job.created, "model": job.model, "choices": [],
            "usage": responses.usage(n_prompt, n_completion, n_cached)}


def sse(obj: dict | str) -> str:
    """One server-sent event: `data: <json>` (or `data: [DONE]`) and a blank line."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"

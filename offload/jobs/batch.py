"""OpenAI Batch JSONL (and plain prompt files) in; OpenAI Batch JSONL records out (written by output.OutputLog)."""

from __future__ import annotations

import difflib
import hashlib
import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from offload.errors import ConfigError, OffloadError, SamplingError, ToolError
from offload.sampling import MAX_LOGPROBS, SamplingParams
from offload import structured, tools
from offload.weights.prompts import (check_reasoning_effort, check_template_kwargs, check_text, role_problem,
                                     with_reasoning_effort)

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
URLS = (COMPLETIONS, CHAT)
CONTENT_KEYS = {COMPLETIONS: "prompt", CHAT: "messages"}  # what each endpoint's body asks
# Request body keys mapped onto SamplingParams (OpenAI names first, then vLLM's extras).
PARAM_KEYS = {"max_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "temperature": "temperature",
              "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed", "stop": "stop",
              "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos", "n": "n",
              "skip_special_tokens": "skip_special_tokens",
              "include_stop_str_in_output": "include_stop_str_in_output", "presence_penalty": "presence_penalty",
              "frequency_penalty": "frequency_penalty", "repetition_penalty": "repetition_penalty",
              "logit_bias": "logit_bias"}
LOGPROB_KEYS = ("logprobs", "top_logprobs", "echo")  # read by endpoint: see logprob_params
IGNORED_KEYS = ("model", "user", "stream", "metadata")
TEMPLATE_KWARGS = "chat_template_kwargs"  # chat: the chat template's variables (vLLM's), such as enable_thinking
EFFORT = "reasoning_effort"  # chat: low, medium or high, passed to the chat template as that variable (gpt-oss's)


@dataclass
class Request:
    """One valid request: its custom_id, endpoint, prompt (text or ids) or messages, and sampling params."""

    custom_id: str
    line_no: int
    url: str
    params: SamplingParams
    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    echo: bool = False  # completions: the answer's text (and logprobs) begin with the prompt's
    chat_template_kwargs: dict | None = None  # chat: passed to the chat template (enable_thinking, reasoning_effort)
    tools: tools.ToolChoice | None = None  # chat: the tools offered, and whether a call is enforced

    @property
    def key(self) -> str:
        return self.custom_id


class BodyError(ConfigError):
    """A request body that cannot run: the message, and the body field it names (OpenAI's error 'param')."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class BadLine:
    """An input line that cannot run; it becomes an error line in the output."""

    line_no: int
    message: str
    custom_id: str | None = None

    @property
    def key(self) -> str:
        return self.custom_id if self.custom_id is not None else f"line:{self.line_no}"


def read_requests(path: Path, fmt: str = "openai", defaults: dict | None = None, chat: bool = True,
                  name: str | None = None) -> tuple[list[Request], list[BadLine]]:
    """Parse a batch file; ConfigError if it holds no requests or custom_ids repeat (the job must not start then).
    name: what the messages call the file (a server's upload by its own name; default: the path)."""
    defaults, shown = defaults or {}, name or str(path)
    try:
        # bytes decoded, not read_text: its universal newlines would turn a lone "\r" into a line break
        lines = jsonl_lines(Path(path).read_bytes().decode("utf-8-sig"))  # -sig: a byte-order mark is not data
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read the input file {shown} ({e}); give a UTF-8 text file") from None
    if fmt == "text":
        url = CHAT if chat else COMPLETIONS
        items = [_text_request(line, n, url, defaults) for n, line in enumerate(lines, 1) if line.strip()]
    else:
        items = [_openai_request(line, n, defaults, name or Path(path).name) for n, line in enumerate(lines, 1)
                 if line.strip()]
    if not items:
        what = "one JSON request object per line" if fmt != "text" else "one prompt per line"
        raise ConfigError(f"the input file {shown} has no requests ({'only blank lines' if lines else 'it is empty'}); "
                          f"expected {what}: add requests, or give another input file")
    _refuse_duplicates(shown, items)
    return [i for i in items if isinstance(i, Request)], [i for i in items if isinstance(i, BadLine)]


def jsonl_lines(text: str) -> list[str]:
    """The lines of a JSON Lines (or prompt) file, split at "\\n" only, each without one trailing "\\r": str.splitlines
    also breaks at U+2028, U+2029, U+0085 and other characters that a JSON string may hold raw, which would cut a
    request in two and shift every line number after it."""
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()  # the newline that ends the last line starts no line
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def _text_request(line: str, n: int, url: str, defaults: dict) -> Request | BadLine:
    try:
        params = sampling_params(defaults, {})
    except BodyError as e:
        return BadLine(n, str(e))
    if url == CHAT:
        return Request(f"line-{n}", n, url, params, messages=[{"role": "user", "content": line.strip()}])
    return Request(f"line-{n}", n, url, params, prompt=line)


def _openai_request(line: str, n: int, defaults: dict, name: str) -> Request | BadLine:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        return BadLine(n, f"line {n} of {name} is not valid JSON ({e.msg} at column {e.colno}); "
                          f"expected one JSON object per line")
    except RecursionError:  # Python's parser follows a few hundred levels of nesting
        return BadLine(n, f"line {n} of {name} is not valid JSON as offload reads it (its arrays and objects nest "
                          f"too deep to parse); expected one JSON object per line, nested a few levels deep")
    if not isinstance(obj, dict):
        return BadLine(n, f"line {n} of {name}: expected a JSON object, found {type(obj).__name__}")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return BadLine(n, f"line {n} of {name}: expected a non-empty string 'custom_id', found {custom_id!r}")
    try:
        check_text(custom_id, "'custom_id'")  # the output repeats it, and no UTF-8 file holds half a character
    except ConfigError as e:
        return BadLine(n, f"line {n} of {name}: {e}")
    problem = _check_envelope(obj)
    if problem:
        return BadLine(n, f"line {n} of {name} (custom_id {custom_id!r}): {problem}", custom_id)
    try:
        params, content = check_body(obj["url"], obj["body"], defaults)
    except BodyError as e:
        return BadLine(n, f"line {n} of {name} (custom_id {custom_id!r}): {e}", custom_id)
    if obj["url"] == CHAT:
        return Request(custom_id, n, CHAT, params, messages=content, chat_template_kwargs=template_kwargs(obj["body"]),
                       tools=tools.from_body(obj["body"]))
    return Request(custom_id, n, COMPLETIONS, params, prompt=content, echo=obj["body"].get("echo") is True)


def _check_envelope(obj: dict) -> str | None:
    method, url = obj.get("method", "POST"), obj.get("url")
    if url not in URLS:
        close = difflib.get_close_matches(str(url), URLS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return f"expected 'url' to be one of {', '.join(URLS)}, found {url!r}{hint}"
    if method != "POST":
        return f"expected 'method' POST, found {method!r}"
    if not isinstance(obj.get("body"), dict):
        return f"expected 'body' to be a JSON object, found {obj.get('body')!r}"
    return None


def _unsupported(key: str, url: str) -> str:
    known = sorted([*PARAM_KEYS, *_logprob_keys(url), *IGNORED_KEYS, *_content_keys(url), *structured.BODY_KEYS])
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"supported: {', '.join(known)}"
    return f"body parameter {key!r} is not supported; {hint}"


def _is_whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_body(url: str, body: dict, defaults: dict, many: bool = False) -> tuple[SamplingParams, Any]:
    """The SamplingParams and the prompt (text or token ids; for chat, the messages) of an OpenAI request body to
    url, its unset parameters taken from defaults; BodyError names the first field that cannot run. many: a
    completions prompt may be a list of prompts (a server's request), and the prompt returned is always a list."""
    # both endpoints' content keys: the other one's is refused naming its endpoint (_refuse_other_endpoints)
    known = (*PARAM_KEYS, *IGNORED_KEYS, *_logprob_keys(url), *CONTENT_KEYS.values(), *_content_keys(url),
             *structured.BODY_KEYS)
    unknown = [k for k in body if k not in known]
    if unknown:
        raise BodyError(_unsupported(unknown[0], url), unknown[0])
    if url != CHAT:
        return sampling_params(defaults, body, url), _content(url, body, many)
    for key, check in ((TEMPLATE_KWARGS, check_template_kwargs), (EFFORT, check_reasoning_effort)):
        try:
            check(body.get(key))
        except ConfigError as e:
            raise BodyError(str(e), key) from None
    try:
        choice = tools.from_body(body)
        params = sampling_params(defaults, body, url)
        return (params if choice is None else choice.sampling(params)), _content(url, body, many)
    except ToolError as e:
        raise BodyError(str(e), e.param) from None


def template_kwargs(body: dict) -> dict | None:
    """The chat template's variables of a checked chat body: its chat_template_kwargs, with its reasoning_effort."""
    return with_reasoning_effort(body.get(TEMPLATE_KWARGS), body.get(EFFORT))


def _content_keys(url: str) -> tuple[str, ...]:
    return ("messages", TEMPLATE_KWARGS, EFFORT, *tools.TOOL_KEYS) if url == CHAT else ("prompt",)


def _logprob_keys(url: str) -> tuple[str, ...]:
    return ("logprobs", "top_logprobs") if url == CHAT else ("logprobs", "echo")


def logprob_params(url: str, body: dict) -> dict:
    """The SamplingParams fields of a body's logprob keys. Chat: logprobs true/false and top_logprobs (0-20);
    completions: logprobs (top ones per token, 0-20) and echo (with logprobs, the prompt's tokens are scored)."""
    want = body.get("logprobs")
    if url == CHAT:
        top = body.get("top_logprobs")
        if want is not None and not isinstance(want, bool):
            raise BodyError(f"expected 'logprobs' to be true or false, found {want!r}; the number of top tokens is "
                            f"'top_logprobs'", "logprobs")
        if top is not None and not (_is_whole(top) and 0 <= top <= MAX_LOGPROBS):
            raise BodyError(f"expected 'top_logprobs' to be an integer from 0 to {MAX_LOGPROBS}, found {top!r}",
                            "top_logprobs")
        if top is not None and not want:
            raise BodyError("'top_logprobs' needs 'logprobs': true; set it, or drop top_logprobs", "top_logprobs")
        return {"logprobs": top or 0} if want else {}
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise BodyError(f"expected 'echo' to be true or false, found {echo!r}", "echo")
    if want is None:
        return {}
    if not _is_whole(want) or not 0 <= want <= MAX_LOGPROBS:
        raise BodyError(f"expected 'logprobs' to be an integer from 0 to {MAX_LOGPROBS} (the top tokens given per "
                        f"token), found {want!r}", "logprobs")
    return {"logprobs": want, **({"prompt_logprobs": want} if echo else {})}


def sampling_params(defaults: dict, body: dict, url: str = COMPLETIONS) -> SamplingParams:
    """defaults (a job's sampling section) overridden by the body's parameters; BodyError names a bad one."""
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise BodyError("give one of 'max_tokens' and 'max_completion_tokens' (the same limit under two names), not "
                        "both", "max_completion_tokens")
    values = dict(defaults)
    cap = values.pop("max_tokens_cap", None)  # sampling.max_tokens_cap: no body passes it
    values.update({PARAM_KEYS[k]: v for k, v in body.items() if k in PARAM_KEYS and v is not None})
    values.update(logprob_params(url, body))
    if cap is not None and _is_whole(values.get("max_tokens")) and values["max_tokens"] > cap:
        values["max_tokens"] = cap
    try:
        return SamplingParams(**values, structured_outputs=structured.from_body(body))
    except SamplingError as e:  # named by its SamplingParams field: the body's key if the body set it
        key = next((k for k, field in PARAM_KEYS.items() if field == e.param and k in body), e.param)
        raise BodyError(str(e) if key == e.param else f"{e} (the body's {key!r})", key) from None
    except (OffloadError, TypeError, ValueError) as e:
        raise BodyError(str(e), None) from None


def _content(url: str, body: dict, many: bool = False) -> Any:
    """The prompt as text or token ids (many: a list of them), or the messages; BodyError says what is wrong."""
    _refuse_other_endpoints(url, body)
    if url == COMPLETIONS:
        prompt = body.get("prompt")
        if _one_prompt(prompt):
            return [prompt] if many else prompt
        if many and isinstance(prompt, list) and prompt and all(_one_prompt(p) for p in prompt):
            return prompt
        if isinstance(prompt, list) and prompt and all(_one_prompt(p) for p in prompt):
            raise BodyError("a batch line takes one prompt (a string or a list of token ids); put each prompt on a "
                            "line of its own", "prompt")
        what = "a list of them" if many else "one of them"
        raise BodyError(f"expected 'prompt' to be a non-empty string or a list of token ids (or {what}), found "
                        f"{_short(prompt)}", "prompt")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BodyError(f"expected 'messages' to be a non-empty list of {{'role', 'content'}} objects, found "
                        f"{messages!r}", "messages")
    out = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):  # OpenAI content parts: text only
            content = _text_of_parts(i, content)
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not (
                isinstance(content, str) or (content is None and calls)):
            raise BodyError(f"expected messages[{i}] to have a string 'role' and text 'content' (null only beside an "
                            f"assistant's 'tool_calls'), found {_short(m)}", f"messages[{i}]")
        problem = role_problem(i, m["role"])
        if problem:
            raise BodyError(problem, f"messages[{i}].role")
        tools.check_tool_fields(i, m)
        out.append({"role": m["role"], "content": content,
                    **{k: m[k] for k in ("tool_calls", "tool_call_id", "name") if m.get(k) is not None}})
    return out


def _refuse_other_endpoints(url: str, body: dict) -> None:
    """BodyError naming the endpoint a body is for where it holds the other endpoint's content only (messages sent
    to /v1/completions): its own content key is not what is wrong."""
    other = CHAT if url == COMPLETIONS else COMPLETIONS
    key, theirs = CONTENT_KEYS[url], CONTENT_KEYS[other]
    if theirs in body and key not in body:
        raise BodyError(f"'{theirs}' is for {other}, but this request went to {url}, which takes '{key}'; send it "
                        f"to {other}, or give '{key}'", theirs)


def _text_of_parts(i: int, parts: list) -> str:
    """The text of a message's OpenAI content parts; BodyError for a part that is not text (an image, audio): the
    model reads text only, and dropping the part would answer another question."""
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            found = f"a part of type {kind!r}" if isinstance(kind, str) else _short(part)
            raise BodyError(f"expected messages[{i}].content[{j}] to be a text part {{'type': 'text', 'text': ...}}, "
                            f"found {found}; offload's models read text only: send the content as text",
                            f"messages[{i}].content")
    return "".join(part["text"] for part in parts)


def _one_prompt(prompt) -> bool:
    return (isinstance(prompt, str) and bool(prompt)) or (
        isinstance(prompt, list) and bool(prompt) and all(_is_whole(t) for t in prompt))


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _refuse_duplicates(shown: str, items: list) -> None:
    first: dict[str, int] = {}
    repeats = []
    for item in items:
        cid = item.custom_id
        if cid is None:
            continue
        if cid in first:
            repeats.append(f"{cid!r} on lines {first[cid]} and {item.line_no}")
        else:
            first[cid] = item.line_no
    if repeats:
        more = f" (and {len(repeats) - 3} more)" if len(repeats) > 3 else ""
        raise ConfigError(f"{shown}: custom_id must be unique, found {'; '.join(repeats[:3])}{more}; "
                          f"give each request its own custom_id")


def success_record(req: Request, choices: list[dict], n_prompt: int, n_generated: int, model: str,
                   n_cached: int = 0) -> dict:
    """An OpenAI Batch output line for a finished request: its choices (offload.jobs.responses.choices)."""
    request_id = uuid.uuid4().hex
    prefix = "chatcmpl" if req.url == CHAT else "cmpl"
    answer = response_body(req.url, f"{prefix}-{request_id}", int(time.time()), model, choices,
                           usage(n_prompt, n_generated, n_cached))
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": req.custom_id,
            "response": {"status_code": 200, "request_id": request_id, "body": answer}, "error": None}


def usage(n_prompt: int, n_completion: int, n_cached: int = 0) -> dict:
    """OpenAI's usage: n_cached of the prompt tokens came from the prefix cache (prompt_tokens_details)."""
    return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion,
            "prompt_tokens_details": {"cached_tokens": n_cached}}


def response_body(url: str, request_id: str, created: int, model: str, choices: list[dict], usage_: dict) -> dict:
    """The whole answer of a request, as OpenAI's API returns it (and a batch output line's response body)."""
    return {"id": request_id, "object": "chat.completion" if url == CHAT else "text_completion", "created": created,
            "model": model, "choices": choices, "usage": usage_}


def error_record(item: BadLine | Request, message: str, code: str = "invalid_request") -> dict:
    """An OpenAI Batch output line for a request that could not run."""
    error = {"code": code, "message": message, "line": item.line_no}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": item.custom_id, "response": None, "error": error}


def file_digest(path: Path) -> str:
    """sha256 of a small file (a model's config.json), to notice a changed model."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]

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

from offload.errors import ConfigError, OffloadError, SamplingError
from offload.sampling import SamplingParams

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
URLS = (COMPLETIONS, CHAT)
# Request body keys mapped onto SamplingParams (OpenAI names first, then vLLM's extras).
PARAM_KEYS = {"max_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "temperature": "temperature",
              "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed", "stop": "stop",
              "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos", "n": "n",
              "skip_special_tokens": "skip_special_tokens",
              "include_stop_str_in_output": "include_stop_str_in_output", "presence_penalty": "presence_penalty",
              "frequency_penalty": "frequency_penalty", "repetition_penalty": "repetition_penalty",
              "logit_bias": "logit_bias"}
IGNORED_KEYS = ("model", "user", "stream", "metadata")
ROLES = ("system", "user", "assistant")  # what chat templates render; OpenAI's tool roles need tool calls


@dataclass
class Request:
    """One valid request: its custom_id, endpoint, prompt (text or ids) or messages, and sampling params."""

    custom_id: str
    line_no: int
    url: str
    params: SamplingParams
    prompt: str | list[int] | None = None
    messages: list[dict] | None = None

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


def read_requests(path: Path, fmt: str = "openai", defaults: dict | None = None,
                  chat: bool = True) -> tuple[list[Request], list[BadLine]]:
    """Parse a batch file; ConfigError if it holds no requests or custom_ids repeat (the job must not start then)."""
    defaults = defaults or {}
    try:
        lines = Path(path).read_text(encoding="utf-8-sig").splitlines()  # -sig: a byte-order mark is not data
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read the input file {path} ({e}); give a UTF-8 text file") from None
    if fmt == "text":
        url = CHAT if chat else COMPLETIONS
        items = [_text_request(line, n, url, defaults) for n, line in enumerate(lines, 1) if line.strip()]
    else:
        items = [_openai_request(line, n, defaults, path.name) for n, line in enumerate(lines, 1) if line.strip()]
    if not items:
        what = "one JSON request object per line" if fmt != "text" else "one prompt per line"
        raise ConfigError(f"the input file {path} has no requests ({'only blank lines' if lines else 'it is empty'}); "
                          f"expected {what}: add requests, or give another input.path")
    _refuse_duplicates(path, items)
    return [i for i in items if isinstance(i, Request)], [i for i in items if isinstance(i, BadLine)]


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
    if not isinstance(obj, dict):
        return BadLine(n, f"line {n} of {name}: expected a JSON object, found {type(obj).__name__}")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return BadLine(n, f"line {n} of {name}: expected a non-empty string 'custom_id', found {custom_id!r}")
    problem = _check_envelope(obj)
    if problem:
        return BadLine(n, f"line {n} of {name} (custom_id {custom_id!r}): {problem}", custom_id)
    try:
        params, content = check_body(obj["url"], obj["body"], defaults)
    except BodyError as e:
        return BadLine(n, f"line {n} of {name} (custom_id {custom_id!r}): {e}", custom_id)
    if obj["url"] == CHAT:
        return Request(custom_id, n, CHAT, params, messages=content)
    return Request(custom_id, n, COMPLETIONS, params, prompt=content)


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
    known = sorted([*PARAM_KEYS, *IGNORED_KEYS, "messages" if url == CHAT else "prompt"])
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"supported: {', '.join(known)}"
    return f"body parameter {key!r} is not supported; {hint}"


def _is_whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_body(url: str, body: dict, defaults: dict) -> tuple[SamplingParams, Any]:
    """The SamplingParams and the prompt (text or token ids; for chat, the messages) of an OpenAI request body to
    url, its unset parameters taken from defaults; BodyError names the first field that cannot run."""
    unknown = [k for k in body if k not in PARAM_KEYS and k not in IGNORED_KEYS and k not in ("prompt", "messages")]
    if unknown:
        raise BodyError(_unsupported(unknown[0], url), unknown[0])
    return sampling_params(defaults, body), _content(url, body)


def sampling_params(defaults: dict, body: dict) -> SamplingParams:
    """defaults (a job's sampling section) overridden by the body's parameters; BodyError names a bad one."""
    values = dict(defaults)
    cap = values.pop("max_tokens_cap", None)  # sampling.max_tokens_cap: no body passes it
    values.update({PARAM_KEYS[k]: v for k, v in body.items() if k in PARAM_KEYS and v is not None})
    if cap is not None and _is_whole(values.get("max_tokens")) and values["max_tokens"] > cap:
        values["max_tokens"] = cap
    try:
        return SamplingParams(**values)
    except SamplingError as e:  # named by its SamplingParams field: the body's key if the body set it
        key = next((k for k, field in PARAM_KEYS.items() if field == e.param and k in body), e.param)
        raise BodyError(str(e) if key == e.param else f"{e} (the body's {key!r})", key) from None
    except (OffloadError, TypeError, ValueError) as e:
        raise BodyError(str(e), None) from None


def _content(url: str, body: dict) -> Any:
    """The prompt as text or token ids, or the messages; BodyError says what is wrong."""
    if url == COMPLETIONS:
        prompt = body.get("prompt")
        if isinstance(prompt, str) and prompt:
            return prompt
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        raise BodyError(f"expected 'prompt' to be a non-empty string or a list of token ids, found {prompt!r}",
                        "prompt")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BodyError(f"expected 'messages' to be a non-empty list of {{'role', 'content'}} objects, found "
                        f"{messages!r}", "messages")
    out = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(content, str):
            raise BodyError(f"expected messages[{i}] to have a string 'role' and text 'content', found {m!r}",
                            f"messages[{i}]")
        if m["role"] not in ROLES:
            close = difflib.get_close_matches(m["role"], ROLES, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise BodyError(f"expected messages[{i}].role to be one of {', '.join(ROLES)}, found {m['role']!r}{hint}",
                            f"messages[{i}].role")
        out.append({"role": m["role"], "content": content})
    return out


def _refuse_duplicates(path: Path, items: list) -> None:
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
        raise ConfigError(f"{path}: custom_id must be unique, found {'; '.join(repeats[:3])}{more}; "
                          f"give each request its own custom_id")


def success_record(req: Request, text: str, finish_reason: str, n_prompt: int, n_generated: int,
                   model: str) -> dict:
    """An OpenAI Batch output line for a finished request."""
    usage = {"prompt_tokens": n_prompt, "completion_tokens": n_generated, "total_tokens": n_prompt + n_generated}
    if req.url == CHAT:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}
        obj, prefix = "chat.completion", "chatcmpl"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
        obj, prefix = "text_completion", "cmpl"
    request_id = uuid.uuid4().hex
    body = {"id": f"{prefix}-{request_id}", "object": obj, "created": int(time.time()), "model": model,
            "choices": [choice], "usage": usage}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": req.custom_id,
            "response": {"status_code": 200, "request_id": request_id, "body": body}, "error": None}


def error_record(item: BadLine | Request, message: str, code: str = "invalid_request") -> dict:
    """An OpenAI Batch output line for a request that could not run."""
    error = {"code": code, "message": message, "line": item.line_no}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": item.custom_id, "response": None, "error": error}


def file_digest(path: Path) -> str:
    """sha256 of a small file (a model's config.json), to notice a changed model."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]

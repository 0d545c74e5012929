"""A chat answer's tool calls parsed out of its text, whole or fed in pieces (a stream's), after its reasoning is split
off (offload/reasoning.py), as vLLM's tool parsers find them. Which parser reads an answer follows from the request,
serve.tool_call_parser (vLLM's --tool-call-parser; auto elsewhere) and, where that is auto, the chat template
(tool_parser):

- `json`, for an enforced tool_choice (required or named, offload/tools.py): the whole answer is one call
  `{"name", "arguments"}` or a JSON array of them;
- `openai`, where the answer is gpt-oss's harmony: a commentary message addressed to `functions.NAME` is a call to
  NAME, its text the arguments (the harmony splitter hands the calls over);
- `hermes`, where the template mentions `<tool_call>` (Qwen2.5's, Qwen3's, Hermes'): each `<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>` is a call, the text around them content;
- `llama3_json` otherwise (Llama 3.1's and 3.2's, and the JSON a generic prompt asks for): an answer that is, whole,
  a JSON call `{"name": ..., "parameters": {...}}` (or "arguments"), optionally after `<|python_tag|>`, several
  joined by `;`.

A call to a name not in the request's tools, or one whose JSON does not parse, stays text (content; harmony's stays
reasoning). A call is handed on when it is complete, whole: its name and arguments in one piece of the stream.
"""

from __future__ import annotations

import json
import uuid

from offload.reasoning import AnswerSplit, partial_tail
from offload.tools import ToolChoice

CALL_START, CALL_END = "<tool_call>", "</tool_call>"  # hermes' tags
PYTHON_TAG = "<|python_tag|>"  # Llama 3's: what follows is a call
AUTO_PARSERS = ("hermes", "llama3_json", "openai")  # vLLM's --tool-call-parser names of the styles auto reads
PARSERS = ("json", *AUTO_PARSERS)


def tool_parser(tokenizer, tools: ToolChoice | None, split: AnswerSplit | None, configured: str) -> str | None:
    """The parser for a chat answer (None: no tools, or tool_choice none: nothing is parsed). configured:
    serve.tool_call_parser's value, which reads an auto answer: auto (chosen from the model), one of AUTO_PARSERS,
    or none (an auto answer stays content; an enforced one is still read as its call)."""
    if tools is None or tools.choice == "none":
        return None
    if tools.enforced:
        return "json"
    if configured != "auto":
        return None if configured == "none" else configured
    if split is not None and split.harmony:
        return "openai"
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return "hermes" if isinstance(template, str) and CALL_START in template else "llama3_json"


def tool_call(name: str, arguments: str) -> dict:
    """One call in OpenAI's shape, with an id of its own."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def finish_reason(reason: str, called: bool) -> str:
    """A chat choice's finish_reason: tool_calls for an answer that ended (stop) with tool calls."""
    return "tool_calls" if called and reason == "stop" else reason


def call_of(obj, names: tuple[str, ...], key: str = "arguments") -> dict | None:
    """The call a parsed JSON value states ({"name", key: {...}} naming one of names), or None."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    arguments = obj.get(key, obj.get("arguments", {}))
    if not isinstance(arguments, dict):
        return None
    return tool_call(obj["name"], json.dumps(arguments, ensure_ascii=False))


class AnswerParser:
    """One chat answer's text, fed in pieces: its reasoning, content and tool calls. split: how reasoning splits off
    (None: not split); parser: tool_parser's choice (None: no calls are parsed)."""

    def __init__(self, split: AnswerSplit | None, parser: str | None, names: tuple[str, ...] = ()):
        self.splitter = None if split is None else split.splitter(names if parser == "openai" else ())
        self.calls = None if parser in (None, "openai") else TextCalls(parser, names)
        self.n_calls = 0  # calls handed on so far: the next one's index

    @property
    def thought(self) -> bool:
        return self.splitter is not None and self.splitter.thought

    def feed(self, text: str, final: bool = False) -> tuple[str, str, list[dict]]:
        """(reasoning, content, calls) that the text so far adds; final: the answer ends with this piece."""
        reasoning, content = ("", text) if self.splitter is None else self.splitter.feed(text, final)
        calls = []
        if self.calls is not None:
            content, calls = self.calls.feed(content, final)
        for name, arguments in getattr(self.splitter, "take_calls", list)():
            calls.append(tool_call(name, arguments))
        self.n_calls += len(calls)
        return reasoning, content, calls


def parse_answer(text: str, split: AnswerSplit | None, parser: str | None,
                 names: tuple[str, ...] = ()) -> tuple[str | None, str | None, list[dict]]:
    """(reasoning_content, content, tool_calls) of a whole answer: reasoning None where it did not reason, content
    None where it said nothing else."""
    answer = AnswerParser(split, parser, names)
    reasoning, content, calls = answer.feed(text, final=True)
    return (reasoning if answer.thought else None), (content or None), calls


class TextCalls:
    """Calls found in an answer's content, fed in pieces, by the json, hermes or llama3_json parser; the content left
    is handed on as it comes, but what may yet turn out to be a call is held until it is complete (json and
    llama3_json hold a whole answer that opens as a call; hermes a <tool_call> block)."""

    def __init__(self, parser: str, names: tuple[str, ...]):
        self.parser, self.names = parser, names
        self._held = ""
        self._whole = parser == "json"  # the answer is held to its end
        self._leading = parser == "llama3_json"  # nothing handed on yet: an answer that opens as a call is held

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        """(content, calls) that the text so far adds."""
        text, self._held = self._held + text, ""
        if self._leading:
            start = text.lstrip()
            if start.startswith(("{", PYTHON_TAG)):
                self._whole = True
            elif not final and (not start or PYTHON_TAG.startswith(start)):
                self._held = text
                return "", []
            self._leading = False
        if self._whole:
            if not final:
                self._held = text
                return "", []
            calls = self._whole_calls(text)
            return ("", calls) if calls else (text, [])
        return self._hermes(text, final) if self.parser == "hermes" else (text, [])

    def _whole_calls(self, text: str) -> list[dict]:
        """The calls a whole answer states (json: one or an array; llama3_json: one or several joined by ';'), or
        none where any part of it is not a call."""
        body = text.strip().removeprefix(PYTHON_TAG).strip()
        key = "parameters" if self.parser == "llama3_json" else "arguments"
        decoder, values, at = json.JSONDecoder(), [], 0
        try:
            while at < len(body):
                value, at = decoder.raw_decode(body, at)
                values += value if isinstance(value, list) and self.parser == "json" else [value]
                at = len(body) - len(body[at:].lstrip().removeprefix(";").lstrip())
        except ValueError:
            return []
        calls = [call_of(v, self.names, key) for v in values]
        return calls if calls and all(calls) else []

    def _hermes(self, text: str, final: bool) -> tuple[str, list[dict]]:
        content, calls = [], []
        while text:
            start = text.find(CALL_START)
            if start < 0:
                keep = 0 if final else partial_tail(text, (CALL_START,))
                content.append(text[:len(text) - keep])
                self._held = text[len(text) - keep:]
                break
            content.append(text[:start])
            end = text.find(CALL_END, start)
            if end < 0 and not final:  # the block goes on in the next piece
                self._held = text[start:]
                break
            body = text[start + len(CALL_START):end if end >= 0 else len(text)]
            call = self._hermes_call(body)
            if call is None:
                content.append(text[start:end + len(CALL_END)] if end >= 0 else text[start:])
            else:
                calls.append(call)
            text = text[end + len(CALL_END):] if end >= 0 else ""
        return "".join(content), calls

    def _hermes_call(self, body: str) -> dict | None:
        try:
            return call_of(json.loads(body), self.names)
        except ValueError:
            return None

"""Tool calls in chat, as OpenAI's API states them and vLLM's and llama.cpp's servers take them: a request's `tools`,
`tool_choice` and `parallel_tool_calls` checked into a ToolChoice; the JSON schema that enforces a `required` or named
choice (a structured output: offload/structured.py); and the conversation as the chat template takes it.

A template takes tools where a conversation rendered with a tool gives other text than without (the default model's,
SmolLM2's, does not). There the tools go in as the template's `tools` variable and the messages as they are (an
assistant's tool calls with their JSON arguments as objects, as Hugging Face templates read them and vLLM passes them;
its null content as ""). Elsewhere (llama.cpp's generic way) a `required` or named choice adds a paragraph to the
system message listing the functions as JSON and asking for a JSON call, `auto` is refused (nothing tells such a model
how to call), an assistant's tool calls become its text (one JSON call a line) and a tool message a user turn
`Tool result (<tool_call_id>): <content>`.

An enforced answer is one call `{"name": NAME, "arguments": {...}}` valid against the function's parameters: the named
function's, or for `required` any tool's; with parallel_tool_calls (OpenAI's default: true) a `required` answer is a
JSON array of one or more calls. Output parsing is offload/tool_parsers.py's.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, replace

from offload.errors import SamplingError, ToolError
from offload.structured import StructuredOutputsParams

TOOL_KEYS = ("tools", "tool_choice", "parallel_tool_calls")
CHOICES = ("none", "auto", "required")  # tool_choice's strings; else {"type": "function", "function": {"name"}}
NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's function names (dots too: vLLM and llama.cpp take them)
DEFINITIONS = ("$defs", "definitions")  # where a JSON schema keeps the subschemas its "$ref"s name
NO_PARAMETERS = {"type": "object", "properties": {}}  # a function that gives none takes none
_PROBE = [{"type": "function", "function": {"name": "offload_probe", "description": "p", "parameters": NO_PARAMETERS}}]


@dataclass(frozen=True)
class ToolChoice:
    """A chat request's tools (each function's {"name", "description", "parameters"}), its tool_choice (none, auto,
    required, or the name of the function to call) and parallel_tool_calls."""

    functions: tuple[dict, ...]
    choice: str = "auto"
    parallel: bool = True

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f["name"] for f in self.functions)

    @property
    def enforced(self) -> bool:
        """Whether the answer must be a call (required, or a named function), held to it by a JSON schema."""
        return self.choice not in ("none", "auto")

    def template_tools(self) -> list[dict]:
        """The chat template's `tools` variable: OpenAI's tool objects."""
        return [{"type": "function", "function": f} for f in self.functions]

    def schema(self) -> dict:
        """The JSON schema an enforced answer is held to; the parameters' own definitions ($defs, definitions) are
        lifted to its root, where their references ("#/$defs/...") point."""
        chosen = [f for f in self.functions if self.choice in ("required", f["name"])]
        calls = [call_schema(f) for f in chosen]
        out = calls[0] if len(calls) == 1 else {"anyOf": calls}
        if self.choice == "required" and self.parallel:
            out = {"type": "array", "minItems": 1, "items": out}
        for key in DEFINITIONS:
            defs = {k: v for f in chosen for k, v in (f.get("parameters") or {}).get(key, {}).items()}
            out = {**out, key: defs} if defs else out
        return out

    def sampling(self, params):
        """params (SamplingParams) held to the enforced call's schema (as they are where nothing is enforced);
        ToolError where they hold another constraint already."""
        if not self.enforced:
            return params
        if params.structured_outputs is not None:
            raise ToolError(f"tool_choice {self.choice!r} holds the answer to a tool call, and the request states "
                            f"another output constraint (response_format or structured_outputs) too; drop one of "
                            f"them", "tool_choice")
        return replace(params, structured_outputs=StructuredOutputsParams(json=self.schema()))


def call_schema(function: dict) -> dict:
    """The JSON schema of one call to a function: its name, and arguments valid against its parameters."""
    return {"type": "object", "properties": {"name": {"const": function["name"]},
                                             "arguments": function.get("parameters") or NO_PARAMETERS},
            "required": ["name", "arguments"]}


def from_body(body: dict) -> ToolChoice | None:
    """The ToolChoice of a chat body (None where it gives no tools); ToolError names the first field that is wrong."""
    tools, choice, parallel = (body.get(key) for key in TOOL_KEYS)
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError(f"expected 'parallel_tool_calls' to be true or false, found {_short(parallel)}",
                        "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise ToolError(f"'tool_choice' {_short(choice)} needs 'tools', and the request gives none; add the "
                            f"functions as 'tools', or drop tool_choice", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise ToolError(f"expected 'tools' to be a list of {{'type': 'function', 'function': {{'name', "
                        f"'description', 'parameters'}}}} objects, found {_short(tools)}", "tools")
    functions = tuple(_function(i, tool) for i, tool in enumerate(tools))
    names = [f["name"] for f in functions]
    repeated = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if repeated is not None:
        raise ToolError(f"'tools' names the function {repeated!r} twice; give each function once under its own name",
                        "tools")
    return ToolChoice(functions, _choice(choice, names), True if parallel is None else parallel)


def _function(i: int, tool) -> dict:
    """tools[i]'s function, checked: a name, an optional description, and parameters that are a JSON schema."""
    where = f"tools[{i}]"
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
        raise ToolError(f"expected {where} to be {{'type': 'function', 'function': {{'name', 'description', "
                        f"'parameters'}}}}, found {_short(tool)}", where)
    name = function.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise ToolError(f"expected {where}.function.name to be 1 to 64 letters, digits, '_', '.' or '-', found "
                        f"{_short(name)}", f"{where}.function.name")
    if function.get("description") is not None and not isinstance(function["description"], str):
        raise ToolError(f"expected {where}.function.description to be text, found {_short(function['description'])}",
                        f"{where}.function.description")
    parameters = function.get("parameters")
    if parameters is not None:
        try:
            StructuredOutputsParams(json=parameters)  # the schema an enforced call is held to must compile
        except SamplingError as e:
            problem = str(e).split(": ", 1)[-1]
            raise ToolError(f"{where}.function.parameters: {problem}",
                            f"{where}.function.parameters") from None
    return {k: function[k] for k in ("name", "description", "parameters") if function.get(k) is not None}


def _choice(choice, names: list[str]) -> str:
    """tool_choice as a string: none, auto (the default), required, or the function's name."""
    if choice is None or choice in CHOICES:
        return choice or "auto"
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise ToolError(f"expected 'tool_choice' to be one of {', '.join(map(repr, CHOICES))} or {{'type': "
                        f"'function', 'function': {{'name': ...}}}}, found {_short(choice)}", "tool_choice")
    if name not in names:
        raise ToolError(f"'tool_choice' names the function {name!r}, which is not in 'tools' (they are "
                        f"{', '.join(map(repr, names))}); name one of them, or add it to tools", "tool_choice")
    return name


def check_tool_fields(i: int, message: dict) -> None:
    """ToolError for messages[i]'s tool fields where they are malformed: a tool message's tool_call_id and text, an
    assistant message's tool_calls (OpenAI's [{"id", "type": "function", "function": {"name", "arguments"}}])."""
    where, role, calls = f"messages[{i}]", message.get("role"), message.get("tool_calls")
    if role == "tool" and (not isinstance(message.get("tool_call_id"), str) or not message["tool_call_id"]):
        raise ToolError(f"expected {where} (a tool message) to have the 'tool_call_id' of the call it answers, found "
                        f"{_short(message.get('tool_call_id'))}", f"{where}.tool_call_id")
    if calls is None:
        return
    if role != "assistant":
        raise ToolError(f"{where} has 'tool_calls' but its role is {role!r}; only an assistant message makes tool "
                        f"calls", f"{where}.tool_calls")
    if not isinstance(calls, list) or not calls:
        raise ToolError(f"expected {where}.tool_calls to be a non-empty list of calls, found {_short(calls)}",
                        f"{where}.tool_calls")
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or not isinstance(function.get("arguments"), (str, dict)):
            raise ToolError(f"expected {where}.tool_calls[{j}] to be {{'id', 'type': 'function', 'function': "
                            f"{{'name', 'arguments'}}}} with the arguments as JSON text, found {_short(call)}",
                            f"{where}.tool_calls[{j}]")


@functools.lru_cache(maxsize=8)
def template_takes_tools(tokenizer, template: str) -> bool:
    """Whether the tokenizer's chat template (its text: the cache's key) renders a tools variable: a conversation
    rendered with one tool differs from the same without (a template that raises on tools takes none)."""
    user = [{"role": "user", "content": "x"}]
    try:
        with_tools = tokenizer.apply_chat_template(user, tools=_PROBE, tokenize=False, add_generation_prompt=True)
        plain = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 (the template's raise_exception() and jinja2's errors: many kinds)
        return False
    return with_tools != plain


def for_template(conversation: list[dict], tools: ToolChoice | None,
                 native: bool) -> tuple[list[dict], list[dict] | None]:
    """The conversation and the template's tools variable (None: not passed) as a template takes them, natively or
    not (see the module's docstring); ToolError for tool_choice auto where the template takes no tools."""
    if native:
        offered = tools.template_tools() if tools is not None else None
        return [_native(m) for m in conversation], offered
    if tools is not None and tools.choice == "auto":
        raise ToolError("tool_choice 'auto' needs a chat template that takes tools, and this model's has none, so "
                        "nothing would tell the model how to call; use tool_choice 'required' or a named function "
                        "(offload then prompts for a JSON call and enforces it), or a model whose template takes "
                        "tools", "tool_choice")
    messages = [_generic(m) for m in conversation]
    if tools is not None and tools.enforced:
        messages = with_system_text(messages, generic_prompt(tools))
    return messages, None


def generic_prompt(tools: ToolChoice) -> str:
    """The system paragraph that asks a model whose template takes no tools for a JSON call (llama.cpp's way)."""
    offered = [f for f in tools.functions if tools.choice in ("required", f["name"])]
    listing = "\n".join(json.dumps(f, ensure_ascii=False) for f in offered)
    if tools.choice != "required":
        ask = f'Call the function {tools.choice}: answer with only a JSON object {{"name": "{tools.choice}", ' \
              f'"arguments": {{...}}}} whose arguments follow its parameters.'
    else:
        ask = 'Call one of them: answer with only a JSON object {"name": ..., "arguments": {...}} whose arguments ' \
              'follow its parameters' + (", or a JSON array of such objects to call several." if tools.parallel
                                         else ".")
    return f"You can call these functions, described in JSON:\n{listing}\n{ask}"


def with_system_text(messages: list[dict], text: str) -> list[dict]:
    """The messages with text added to the leading system message as a paragraph of its own (one is made first)."""
    if messages and messages[0].get("role") == "system" and isinstance(messages[0].get("content"), str):
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _native(message: dict) -> dict:
    if not message.get("tool_calls"):
        return message
    calls = [{**c, "function": {**c["function"], "arguments": _arguments(c["function"]["arguments"])}}
             for c in message["tool_calls"]]
    return {**message, "content": message.get("content") or "", "tool_calls": calls}


def _generic(message: dict) -> dict:
    if message.get("role") == "tool":
        return {"role": "user", "content": f"Tool result ({message['tool_call_id']}): {message.get('content')}"}
    if not message.get("tool_calls"):
        return message
    calls = [json.dumps({"name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])},
                        ensure_ascii=False) for c in message["tool_calls"]]
    text = "\n".join(([message["content"]] if message.get("content") else []) + calls)
    return {"role": "assistant", "content": text}


def _arguments(arguments):
    """A call's arguments as an object where they are JSON text of one (as templates read them), else as given."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return arguments
        return parsed if isinstance(parsed, dict) else arguments
    return arguments


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."

"""Structured outputs: what a request's text must match, and the request-body forms that say so.

A constraint is one of vLLM's StructuredOutputsParams: a JSON schema (`json`), any JSON object (`json_object`), a
regular expression (`regex`), one of a few strings (`choice`) or a grammar in GBNF, llama.cpp's and xgrammar's
syntax (`grammar`). A request body states it as OpenAI's `response_format` (`json_object`, or `json_schema` with
its `schema`), as vLLM's `structured_outputs` object, or as one of vLLM's older top-level `guided_json`,
`guided_regex`, `guided_choice` and `guided_grammar`. Its syntax is checked where it is given (xgrammar parses it
without the tokenizer), so a bad schema is refused before any request runs; offload/grammar.py compiles it for the
model's vocabulary and masks the logits with it each step.

JSON is generated without free whitespace (xgrammar's any_whitespace=False: `", "` and `": "` between items, one
line), and a schema allows no property it does not name unless it says `additionalProperties` (xgrammar's strict
mode; `json_object` allows any).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields
from typing import Any

from offload.errors import SamplingError

FIELD = "structured_outputs"  # SamplingParams' field and vLLM's body key
GUIDED_KEYS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
               "guided_grammar": "grammar"}  # vLLM's top-level fields before structured_outputs
BODY_KEYS = ("response_format", FIELD, *GUIDED_KEYS)  # the request-body keys that state a constraint
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
ANY_OBJECT = '{"type": "object"}'
_LIBRARY_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")  # xgrammar's "[time] file:line: "


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output, by keyword (vLLM's): json (a JSON schema, as a dict or as JSON text),
    regex, choice (a list of strings), grammar (GBNF), or json_object=True; SamplingError says what is wrong."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self):
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            found = f"found {', '.join(given)}" if given else "found none"
            raise SamplingError(f"invalid {FIELD}: expected exactly one of json, regex, choice, grammar and "
                                f"json_object, {found}; give one constraint", FIELD)
        problem = _shape_problem(given[0], getattr(self, given[0]))
        if problem is None:
            problem = _syntax_problem(self)
        if problem is not None:
            raise SamplingError(f"invalid {FIELD}: {problem}", FIELD)

    @property
    def kind(self) -> str:
        return next(f.name for f in fields(self) if getattr(self, f.name) not in (None, False))

    @property
    def key(self) -> str:
        """The constraint as one string (kind and canonical text): equal constraints compile once."""
        value = getattr(self, self.kind)
        if self.kind == "json":
            value = json.dumps(json.loads(value) if isinstance(value, str) else value, sort_keys=True)
        elif self.kind == "choice":
            value = json.dumps(value)
        return f"{self.kind}:{value}"


def structured_params(value) -> StructuredOutputsParams | None:
    """SamplingParams' structured_outputs as given (None, a StructuredOutputsParams, or a dict of its keywords)
    made a StructuredOutputsParams; SamplingError names what is wrong."""
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if not isinstance(value, dict):
        raise SamplingError(f"invalid {FIELD}: expected a StructuredOutputsParams or a dict such as "
                            f"{{'json': schema}}, found {_short(value)}", FIELD)
    names = [f.name for f in fields(StructuredOutputsParams)]
    unknown = [k for k in value if k not in names]
    if unknown:
        raise SamplingError(f"invalid {FIELD}: {unknown[0]!r} is not supported; supported: {', '.join(names)}",
                            FIELD)
    return StructuredOutputsParams(**{k: v for k, v in value.items() if v is not None})


def from_body(body: dict) -> StructuredOutputsParams | None:
    """The constraint a request body states (response_format, structured_outputs or a guided_* field), None where
    it states none; SamplingError names the body key at fault (its param)."""
    stated = []
    for key in BODY_KEYS:
        if body.get(key) is not None:
            try:
                made = _from_key(key, body[key])
            except SamplingError as e:
                raise SamplingError(str(e).replace(f"invalid {FIELD}:", f"invalid {key}:", 1), key) from None
            if made is not None:
                stated.append((key, made))
    if len(stated) > 1:
        raise SamplingError(f"the body states two output constraints, {stated[0][0]!r} and {stated[1][0]!r}; give "
                            f"one of {', '.join(BODY_KEYS)}", stated[1][0])
    return stated[0][1] if stated else None


def _from_key(key: str, value) -> StructuredOutputsParams | None:
    if key == "response_format":
        return _response_format(value)
    if key == FIELD:
        return structured_params(value)
    return StructuredOutputsParams(**{GUIDED_KEYS[key]: value})


def _response_format(value) -> StructuredOutputsParams | None:
    """OpenAI's response_format: {'type': 'text'} (no constraint), {'type': 'json_object'}, or {'type':
    'json_schema', 'json_schema': {'name', 'schema', 'strict'}}."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in RESPONSE_FORMATS:
        found = f"type {kind!r}" if isinstance(value, dict) else _short(value)
        raise SamplingError(f"invalid {FIELD}: expected an object whose 'type' is one of {', '.join(RESPONSE_FORMATS)}"
                            f", found {found}; for a schema send {{'type': 'json_schema', 'json_schema': {{'name': "
                            f"..., 'schema': {{...}}}}}}", FIELD)
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        found = _short(spec.get("schema") if isinstance(spec, dict) else spec)
        raise SamplingError(f"invalid {FIELD}: expected 'json_schema' to be {{'name': ..., 'schema': {{...}}}} with "
                            f"the schema as a JSON object, found {found}", FIELD)
    for name, kinds, what in (("name", str, "a string"), ("strict", bool, "true or false")):
        if spec.get(name) is not None and not isinstance(spec[name], kinds):
            raise SamplingError(f"invalid {FIELD}: expected json_schema.{name} to be {what}, found "
                                f"{_short(spec[name])}", FIELD)
    return StructuredOutputsParams(json=spec["schema"])


def _shape_problem(kind: str, value) -> str | None:
    """What is wrong with the type of a constraint's value, or None."""
    if kind == "json_object":
        return None if value is True else f"expected json_object to be true, found {_short(value)}"
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                return f"the JSON schema given as text is not valid JSON ({e}); send the schema as a JSON object"
        if not isinstance(value, dict):
            return f"expected a JSON schema object, found {_short(value)}"
        try:
            json.dumps(value)
        except (TypeError, ValueError) as e:
            return f"the JSON schema is not JSON ({e}); give it as JSON values (dicts, lists, strings, numbers)"
        return None
    if kind == "choice":
        if isinstance(value, (list, tuple)) and value and all(isinstance(c, str) and c for c in value):
            return None
        return f"expected choice to be a non-empty list of non-empty strings, found {_short(value)}"
    if not isinstance(value, str) or not value.strip():
        return f"expected {kind} to be a non-empty string, found {_short(value)}"
    return None


def _syntax_problem(params: StructuredOutputsParams) -> str | None:
    """What the grammar library says is wrong with the constraint (a schema it cannot use, a regex or grammar that
    does not parse), or None."""
    try:
        to_grammar(params)
    except RuntimeError as e:  # xgrammar's parsers raise RuntimeError with the position and the reason
        detail = " ".join(_LIBRARY_PREFIX.sub("", str(e)).split())
        what = {"json": "JSON schema", "grammar": "GBNF grammar"}.get(params.kind, params.kind)
        return f"the {what} cannot be used ({detail}); fix it and send the request again"
    return None


def to_grammar(params: StructuredOutputsParams):
    """The constraint as an xgrammar Grammar (parsed, not yet compiled for a vocabulary); RuntimeError from xgrammar
    where it does not parse."""
    import xgrammar

    kind, value = params.kind, getattr(params, params.kind)
    if kind == "json_object":
        return xgrammar.Grammar.from_json_schema(ANY_OBJECT, any_whitespace=False, strict_mode=False)
    if kind == "json":
        text = value if isinstance(value, str) else json.dumps(value)
        return xgrammar.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True)
    if kind == "regex":
        return xgrammar.Grammar.from_regex(value)
    if kind == "choice":
        return xgrammar.Grammar.from_ebnf("root ::= " + " | ".join(_ebnf_literal(c) for c in value))
    return xgrammar.Grammar.from_ebnf(value)


def _ebnf_literal(text: str) -> str:
    """A GBNF string literal matching text exactly: printable ASCII as it is, anything else as a \\U escape."""
    return '"' + "".join(c if " " <= c <= "~" and c not in '"\\' else f"\\U{ord(c):08x}" for c in text) + '"'


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."

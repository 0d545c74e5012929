"""A value checked against an option's field (offload/options.py) as given, without pydantic's coercion, and the
field's type and bounds in words ("an integer from 1 to 64", "in (0, 1]"): SamplingParams' checks, whose fields and
bounds are the options'. Fields are a type, or a type or None; lists and mappings of those."""

from __future__ import annotations

import math
import types
import typing
from typing import Any

import annotated_types as at
from pydantic.fields import FieldInfo

BOUNDS = {at.Ge: "ge", at.Gt: "gt", at.Le: "le", at.Lt: "lt", at.MinLen: "min_length"}


def value_problem(name: str, info: FieldInfo, value: Any) -> str | None:
    """None where value fits the field, else '<name> must be <what the field takes>, got <value>'."""
    if fits(info.annotation, value, info.metadata):
        return None
    return f"{name} must be {expected(info.annotation, info.metadata)}, got {value!r}"


def fits(annotation, value: Any, metadata=()) -> bool:
    """Whether value is of the annotation's type (an int is a float; a bool is neither) and within its bounds."""
    kind, bounds, optional = parts(annotation, metadata)
    if value is None:
        return optional
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is list:
        return isinstance(value, list) and all(fits(args[0], v) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(fits(args[0], k) and fits(args[1], v) for k, v in value.items())
    if kind is bool:
        return isinstance(value, bool)
    if kind is str:
        return isinstance(value, str) and len(value) >= bounds.get("min_length", 0)
    if kind in (int, float):
        number = isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool)
        return number and math.isfinite(value) and _within(value, bounds)
    return True  # a kind no sampling field has: pydantic's to check


def expected(annotation, metadata=(), plural: bool = False) -> str:
    """What the field takes, in words: 'an integer >= 1', 'in (0, 1]', 'non-negative integers' (plural)."""
    kind, bounds, _ = parts(annotation, metadata)
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is list:
        return expected(args[0], plural=True)
    if origin is dict:
        return f"a mapping of {expected(args[0], plural=True)} to {expected(args[1], plural=True)}"
    if kind is bool:
        return "true or false"
    if kind is str:
        noun = "strings" if plural else "a string"
        return noun.replace("string", "non-empty string") if bounds.get("min_length") else noun
    if kind is int:
        if set(bounds) == {"ge"} and bounds["ge"] == 0:
            return "non-negative integers" if plural else "a non-negative integer"
        return _bounded("integers" if plural else "an integer", bounds, interval=False)
    return _bounded("numbers" if plural else "a finite number", bounds, interval=True)


def parts(annotation, metadata=()) -> tuple[Any, dict, bool]:
    """(the bare type, its bounds by pydantic's names, whether None is allowed)."""
    bounds, optional = _bounds(metadata), False
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            annotation, *meta = typing.get_args(annotation)
            bounds |= _bounds(meta)
        elif origin in (typing.Union, types.UnionType):
            members = typing.get_args(annotation)
            optional = type(None) in members
            annotation = next(m for m in members if m is not type(None))
        else:
            return annotation, bounds, optional


def bare_type(annotation):
    """The annotation without its Annotated metadata: Whole | None -> int | None, list[TokenId] -> list[int]."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return bare_type(args[0])
    if origin in (typing.Union, types.UnionType):
        return typing.Union[tuple(bare_type(a) for a in args)]
    if origin in (list, dict):
        return origin[tuple(bare_type(a) for a in args)]
    return annotation


def _bounds(metadata) -> dict:
    found = {}
    for m in metadata:
        if isinstance(m, FieldInfo):  # Annotated[int, Field(ge=0)]
            found |= _bounds(m.metadata)
        found |= {key: getattr(m, key) for cls, key in BOUNDS.items() if isinstance(m, cls)}
    return found


def _within(value, bounds: dict) -> bool:
    return (value >= bounds.get("ge", -math.inf) and value > bounds.get("gt", -math.inf)
            and value <= bounds.get("le", math.inf) and value < bounds.get("lt", math.inf))


def _bounded(noun: str, bounds: dict, interval: bool) -> str:
    """'an integer from 1 to 64', 'in (0, 1]' (interval: numbers bounded on both sides), 'a finite number >= 0'."""
    signs = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    given = [(key, bounds[key]) for key in signs if key in bounds]  # the low bound first
    if interval and len(given) == 2:
        (low, a), (high, b) = given
        where = f"in {'[' if low == 'ge' else '('}{_number(a)}, {_number(b)}{']' if high == 'le' else ')'}"
        return where if noun.startswith("a ") else f"{noun} {where}"
    if [key for key, _ in given] == ["ge", "le"]:
        return f"{noun} from {_number(given[0][1])} to {_number(given[1][1])}"
    return " ".join([noun, " and ".join(f"{signs[key]} {_number(v)}" for key, v in given)]).strip()


def _number(value) -> str:
    """A bound as a user reads it: 64-bit limits as powers of two (2**64-1, not 18446744073709551615)."""
    if isinstance(value, int) and abs(value) >= 2**32:
        for p in range(32, 129):
            if abs(value) in (2**p, 2**p - 1):
                return f"{'-' if value < 0 else ''}2**{p}{'-1' if abs(value) == 2**p - 1 else ''}"
    return str(value)

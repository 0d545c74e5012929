"""docs/options.md, made from the options (offload/options.py) and the command line that takes them:
`python -m offload.cli.options_doc > docs/options.md` writes it; a test checks it is current."""

from __future__ import annotations

import argparse
import types
import typing

from offload.option_values import bare_type, expected, parts
from offload.options import PLAN_SECTIONS, RequestOptions, Section, extra, named_options

GLOBAL_FLAGS = ("help", "debug", "quiet", "log_level")  # every command's, listed once


def yaml_sections() -> dict[str, type[Section]]:
    """The job YAML's sections by their keys, in its order."""
    from offload.jobs.config import JobConfig

    return {key: section for key, info in JobConfig.model_fields.items() if (section := _section(info.annotation))}


def documented_sections() -> dict[str, type[Section]]:
    """Every section this page lists: the YAML's, then what a request sets beside them."""
    return yaml_sections() | {"request": RequestOptions}


def command_parsers() -> dict[str, object]:
    """Each command's parser by its name ('cache clear' for a command's own subcommand)."""
    from offload.cli.main import build_parser

    def walk(parser, prefix: str) -> dict:
        found = {}
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    found |= {f"{prefix}{name}": sub} | walk(sub, f"{prefix}{name} ")
        return found

    return walk(build_parser(), "")


def option_flags() -> dict[str, dict[str, list[str]]]:
    """Dotted key -> its flag -> the commands that take it."""
    out: dict[str, dict[str, list[str]]] = {}
    for command, parser in command_parsers().items():
        for action in parser._actions:
            if key := option_of(action):
                out.setdefault(key, {}).setdefault(", ".join(action.option_strings), []).append(command)
    return out


def option_of(action) -> str | None:
    """The dotted key of the option a flag sets, or None: a flag made from an option (cli/job_flags.py) has its
    name as dest and names its key in its help."""
    key = named_options(yaml_sections()).get(action.dest, (None,))[0]
    return key if key and f"({key}" in (action.help or "") else None


def type_name(info) -> str:
    """The option's type in short: int, float, bool, str, size (bytes), list[int], ...; '| none' where it may be
    unset."""
    size = extra(info).get("unit") == "bytes"

    def name(ann) -> str:
        origin, args = typing.get_origin(ann), typing.get_args(ann)
        if origin in (typing.Union, types.UnionType):
            return " \\| ".join(name(a) for a in args)
        if origin is typing.Literal:
            return repr(args[0]) if len(args) == 1 else "str"
        if origin in (list, dict):
            return f"{origin.__name__}[{', '.join(name(a) for a in args)}]"
        if ann is type(None):
            return "none"
        return "size" if size and ann is int else getattr(ann, "__name__", str(ann))

    return name(bare_type(info.annotation))


def allowed(info) -> str:
    """Its choices, or its bounds in words ('an integer >= 1', 'in (0, 1]'); blank where any value of its type is."""
    kind, bounds, _ = parts(info.annotation, info.metadata)
    choices = [c for a in _members(info.annotation) if typing.get_origin(a) is typing.Literal
               for c in typing.get_args(a)]
    if len(choices) > 1:
        return ", ".join(f"`{c}`" for c in choices)
    if bounds or typing.get_origin(kind) in (list, dict):
        return expected(info.annotation, info.metadata)
    return ""


def default_text(info) -> str:
    if info.is_required():
        return "required"
    default = info.get_default(call_default_factory=True)
    return "unset" if default is None else f"`{default!r}`" if isinstance(default, str) else f"`{default}`"


def option_rows(section_key: str, section: type[Section], flags: dict) -> list[str]:
    rows = []
    for field, info in section.model_fields.items():
        key = f"{section_key}.{field}"
        taken = "<br>".join(f"`{flag}`: {', '.join(commands)}" for flag, commands in flags.get(key, {}).items())
        keyword = extra(info).get("name", "") if section_key in PLAN_SECTIONS or key == "sampling.max_tokens" else ""
        cells = [f"`{field}`", type_name(info), default_text(info), allowed(info), taken,
                 f"`{keyword}`" if keyword else "", _cell(info.description)]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def command_only_flags() -> list[str]:
    """The flags that set no option: each command's own (its prompts, its output form), with their help."""
    rows = []
    for command, parser in command_parsers().items():
        for action in parser._actions:
            if action.option_strings and action.dest not in GLOBAL_FLAGS and not option_of(action):
                rows.append(f"| {command} | `{', '.join(action.option_strings)}` | {_cell(action.help)} |")
    return rows


def options_markdown() -> str:
    """docs/options.md."""
    from offload.jobs.config import JobConfig

    flags = option_flags()
    lines = ["# Options", "",
             "Every option offload takes, made from `offload/options.py` by `python -m offload.cli.options_doc > "
             "docs/options.md` (a test checks that this page is current). A job YAML sets them by section "
             "(`memory: {cpu: 48GiB}`); `--set KEY=VALUE` sets any of them by its dotted key "
             "(`--set memory.cpu=48GiB`); the flags below set one each. `LLM(...)` takes the plan's options "
             "(sections " + ", ".join(PLAN_SECTIONS) + ", and sampling.max_tokens) as keywords. Sizes are bytes "
             "or a number with a unit: 22GiB, 64GB, 512MiB.", ""]
    for section_key, section in documented_sections().items():
        where = "" if section_key in yaml_sections() else " (not in the YAML)"
        lines += [f"## `{section_key}`{where}", "", " ".join((section.__doc__ or "").split()), "",
                  "| key | type | default | allowed | flag: commands | `LLM(...)` | meaning |",
                  "|---|---|---|---|---|---|---|", *option_rows(section_key, section, flags), ""]
    lines += ["## Top-level keys", "", "| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    lines += [f"| `{key}` | {type_name(info)} | {default_text(info)} | {allowed(info)} | {_cell(info.description)} |"
              for key, info in JobConfig.model_fields.items() if key not in yaml_sections()]
    lines += ["", "## Flags of one command", "", "Flags that set no option above. Every command also takes "
              "`--debug`, `--quiet` and `--log-level`.", "", "| command | flag | meaning |", "|---|---|---|",
              *command_only_flags()]
    return "\n".join(lines) + "\n"


def _section(annotation) -> type[Section] | None:
    return next((a for a in _members(annotation) if isinstance(a, type) and issubclass(a, Section)), None)


def _members(annotation) -> list:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _members(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [m for a in typing.get_args(annotation) for m in _members(a)]
    return [annotation]


def _cell(text: str | None) -> str:
    """Text as one table cell: on one line, its bars escaped and <placeholders> shown, not read as HTML."""
    return " ".join((text or "").replace("|", "\\|").replace("<", "&lt;").replace("%%", "%").split())


if __name__ == "__main__":
    print(options_markdown(), end="")

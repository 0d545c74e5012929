"""Every option is defined once (offload/options.py): LLM(...), the job YAML and the CLI list the same options under
the same names, types and defaults; what one of them lacks is on an allow-list below, with the reason."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
import types
import typing
from pathlib import Path

import pytest

from offload.api import LLM, PREFIX_CACHE_NAMES
from offload.cli.main import build_parser
from offload.errors import ConfigError
from offload.jobs.config import JobConfig, load_config
from offload.options import PLAN_SECTIONS, MemoryOptions, SamplingOptions, Section, named_options
from offload.planner.request import PlanRequest

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = ("plan", "validate", "run", "serve", "generate")

# What one or two of LLM / YAML / CLI lack, and why. Keys: an outside name (LLM keyword, flag dest), or the dotted
# YAML key of a field without one.
NOT_EVERYWHERE = {
    # LLM only
    "placement": "a Placement given by hand replaces the plan; a job always plans",
    "disk_dir": "the folder LLM's disk tier writes to; a job uses the default",
    "max_batch_size": "LLM's deprecated old name of batch_size",
    # CLI only
    "config": "the job YAML file itself",
    "set": "--set KEY=VALUE sets any YAML key by its dotted name",
    "ray": "--ray [ADDRESS] sets engine: ray and distributed.address",
    "restart": "--restart is output.overwrite for one run",
    "print_config": "prints the effective config instead of running",
    "json": "the form `offload plan` prints the plan in",
    "explain": "what `offload plan` prints besides the plan",
    "speculative_acceptance": "the acceptance `offload plan` prices speculation at; a run measures its own",
    "help": "argparse's own", "debug": "logging, not the job", "quiet": "logging, not the job",
    "log_level": "logging, not the job",
    "prompt": "offload generate's prompts (a job reads them from its input file)",
    "raw": "offload generate's prompts without the chat template (a job: input.chat)",
    # YAML (and --set) only: no outside name
    "memory.on_exceed": "what the job's memory watch does; LLM has no watch",
    "sampling.ignore_eos": "a job's sampling defaults: set per request in the body, or by --set",
    "sampling.presence_penalty": "a job's sampling defaults: set per request in the body, or by --set",
    "sampling.frequency_penalty": "a job's sampling defaults: set per request in the body, or by --set",
    "sampling.repetition_penalty": "a job's sampling defaults: set per request in the body, or by --set",
    "sampling.logit_bias": "a job's sampling defaults: set per request in the body, or by --set",
    "input.chat": "how text prompts are read: set with --set input.chat=false",
    "output.overwrite": "its flag is --restart",
    "output.retry_failed": "how a rerun treats error lines: set with --set",
    "report.print": "whether the report prints: set with --set",
    "engine": "its flag is --ray",
    "distributed.address": "its flag is --ray ADDRESS",
    "distributed.replicas": "Ray only: set with --set",
    "distributed.cpus_per_replica": "Ray only: set with --set",
    "distributed.gpus_per_replica": "Ray only: set with --set",
    "distributed.shard_size": "Ray only: set with --set",
    "distributed.max_restarts": "Ray only: set with --set",
    # the speculative section: LLM takes it whole as speculative_config (vLLM's name), the YAML as `speculative:`,
    # the CLI by --set speculative.KEY=VALUE; one class (SpeculativeOptions) checks all three
    "speculative_config": "LLM's dict of the YAML's speculative section",
    "prefix_cache": "LLM's dict of the YAML's prefix_cache section (its fields are keywords of their own too)",
    "speculative.method": "LLM: speculative_config; CLI: --set", "speculative.num_speculative_tokens": "ditto",
    "speculative.max_speculative_tokens": "ditto", "speculative.prompt_lookup_max": "ditto",
    "speculative.prompt_lookup_min": "ditto", "speculative.model": "ditto", "speculative.quantization": "ditto",
    "speculative.max_branches": "ditto",
    # YAML and LLM, no flag
    "host_baseline": "memory.baseline is auto (recorded by offload calibrate) unless measured otherwise: --set",
    # YAML and CLI, not LLM: LLM.generate takes sampling per call (SamplingParams) and writes no files
    "max_tokens_cap": "a job's cap on request bodies; LLM's caller sets SamplingParams.max_tokens itself",
    "temperature": "a job's sampling default; LLM.generate takes SamplingParams",
    "seed": "a job's sampling default; LLM.generate takes SamplingParams",
    "top_p": "a job's sampling default; LLM.generate takes SamplingParams",
    "top_k": "a job's sampling default; LLM.generate takes SamplingParams",
    "min_p": "a job's sampling default; LLM.generate takes SamplingParams",
    "stop": "a job's sampling default; LLM.generate takes SamplingParams",
    "input": "a job's input file", "input_format": "a job's input file",
    "output": "a job's output file", "report": "a job's report file", "trace": "a job's trace file",
    "plot": "a job's plot file", "progress": "a job's progress bar", "echo": "a job's console output",
    # YAML and CLI (offload serve), not LLM: a server's own options
    "host": "where offload serve listens", "port": "where offload serve listens",
    "api_key": "who may call offload serve", "state_dir": "offload serve's state folder",
    "max_waiting": "offload serve's bound on waiting requests (the Engine's max_waiting)",
    "max_upload": "offload serve's largest upload (POST /v1/files)",
    "reasoning_parser": "offload serve's split of a chat answer's <think> block (LLM.chat splits as its default, "
                        "auto, does)",
    "tool_call_parser": "how offload serve reads an auto answer's tool calls (LLM.chat reads them as its default, "
                        "auto, does)",
    "enable_auto_tool_choice": "vLLM's serve flag, taken and ignored (auto tool choice is always served)",
}
NO_DEFAULT_IN_HELP = {  # flags whose option is unset by default and whose help need not say so
    "input.path": "required: a job has no default input",
    "report.trace": "unset: no trace is written",
    "report.plot": "unset: no plot is written",
    "sampling.seed": "unset: each request draws its own seed",
    "sampling.stop": "none: a completion ends at its end-of-sequence token or max_tokens",
}
UNITS = {"bytes", "tokens"}  # a new unit needs its check in test_flag_help_names_the_unit


# --- the three surfaces ----------------------------------------------------------------------------------------

def yaml_options(model=JobConfig, prefix: str = "") -> dict[str, object]:
    """Dotted YAML key -> pydantic FieldInfo, for every leaf of the job schema (sections walked recursively)."""
    out = {}
    for key, info in model.model_fields.items():
        section = [a for a in (info.annotation, *typing.get_args(info.annotation))
                   if isinstance(a, type) and issubclass(a, Section)]
        if section:
            out |= yaml_options(section[0], f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = info
    return out


def default_of(info):
    """The option's one default (None for a required one)."""
    return None if info.is_required() else info.get_default(call_default_factory=True)


def outside_name(key: str, info) -> str:
    return (info.json_schema_extra or {}).get("name", key)


def yaml_by_name() -> dict[str, tuple[str, object]]:
    """Outside name (or the dotted key where there is none) -> (dotted key, FieldInfo)."""
    return {outside_name(key, info): (key, info) for key, info in yaml_options().items()}


def cli_actions() -> dict[str, dict[str, object]]:
    """command -> dest -> its argparse action, for each command of COMMANDS."""
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return {cmd: {a.dest: a for a in sub.choices[cmd]._actions} for cmd in COMMANDS}


def cli_dests() -> set[str]:
    return {dest for actions in cli_actions().values() for dest in actions}


def llm_requests(monkeypatch) -> list:
    """LLM's planning request, caught where LLM would load the model (nothing is loaded)."""
    caught = []
    monkeypatch.setattr(LLM, "_load", lambda self, request, *rest: caught.append(request))
    return caught


def request_options(request: PlanRequest) -> dict[str, object]:
    """A PlanRequest's options by their outside names (LLM's keywords)."""
    out = {"max_tokens": request.max_tokens}
    for name, (key, _) in named_options(PLAN_SECTIONS).items():
        section, field = key.split(".")
        out[name] = getattr(getattr(request, section), field)
    return out


def llm_names(monkeypatch) -> set[str]:
    """LLM's options: its signature's keywords and every outside name it accepts as **options."""
    llm_requests(monkeypatch)
    params = inspect.signature(LLM.__init__).parameters
    names = {n for n, p in params.items() if n != "self" and p.kind is not p.VAR_KEYWORD}
    for name in yaml_by_name():
        try:
            LLM(**{name: None})
        except ConfigError as e:
            assert "unknown option" in str(e), e
            continue
        names.add(name)
    return names


# --- types and sample values ---------------------------------------------------------------------------------

def kind_of(info) -> object:
    """'bytes', int, float, bool, list, a tuple of Literal choices, or str."""
    if (info.json_schema_extra or {}).get("unit") == "bytes":
        return "bytes"
    found = []

    def walk(ann):
        origin = typing.get_origin(ann)
        if origin is typing.Annotated:
            walk(typing.get_args(ann)[0])
        elif origin in (typing.Union, types.UnionType):
            for a in typing.get_args(ann):
                walk(a)
        elif origin is typing.Literal:
            found.append(typing.get_args(ann))
        elif ann is not type(None):
            found.append(origin or ann)

    walk(info.annotation)
    for kind in (int, float, bool, list):
        if kind in found:
            return kind
    return next((k for k in found if isinstance(k, tuple)), str)


SAMPLE_STR = {"model.path": "llama-3.1-8b", "hardware.profile": "rtx4090-ddr5", "distributed.address": "10.0.0.5:6379"}


def sample(key: str, info, tmp: Path):
    """A valid value for the option other than its default, as YAML gives it."""
    kind, default = kind_of(info), default_of(info)
    if kind == "bytes":
        return "3GiB"
    if isinstance(kind, tuple):
        return next(c for c in kind if c != default)
    if kind is bool:
        return not default
    return {int: 3, float: 0.5, list: ["</s>"]}.get(kind) or SAMPLE_STR.get(key) or str(tmp / key)


def section_value(key: str, value):
    """What the job schema makes of value at key."""
    section, field = key.split(".") if "." in key else (None, key)
    raw = {"model": {"path": "default"}, "input": {"path": "in.jsonl"}}
    if section:
        raw[section] = {**raw.get(section, {}), field: value}
    else:
        raw[field] = value
    config = JobConfig.model_validate(raw)
    return getattr(getattr(config, section), field) if section else getattr(config, field)


# --- the tests -----------------------------------------------------------------------------------------------

def test_every_option_is_on_all_three_surfaces_or_allowed(monkeypatch):
    yaml, llm, cli = set(yaml_by_name()), llm_names(monkeypatch), cli_dests()
    everywhere = yaml & llm & cli
    missing = {name: [s for s, names in (("YAML", yaml), ("LLM", llm), ("CLI", cli)) if name not in names]
               for name in (yaml | llm | cli) - everywhere}
    unexplained = {n: lacks for n, lacks in missing.items() if n not in NOT_EVERYWHERE}
    assert not unexplained, f"options missing from a surface without a reason in NOT_EVERYWHERE: {unexplained}"
    stale = set(NOT_EVERYWHERE) - set(missing)
    assert not stale, f"NOT_EVERYWHERE lists options that are everywhere or nowhere: {sorted(stale)}"
    assert {"model", "cpu_memory", "gpu_memory", "max_tokens", "batch_size"} <= everywhere


def test_llm_keywords_set_the_yaml_key_of_their_name_with_its_default(monkeypatch):
    by_name = yaml_by_name()
    # the prefix cache's keywords set the LLM's cache, not its plan (tests/test_prefix_cache.py)
    shared = llm_names(monkeypatch) & set(by_name) - set(PREFIX_CACHE_NAMES)
    caught = llm_requests(monkeypatch)
    LLM()
    defaults = request_options(caught.pop())
    assert inspect.signature(LLM.__init__).parameters["model"].default == section_value("model.path", "default")
    assert shared >= {"model", "cpu_memory", "max_tokens", "batch_size", "host_baseline"}
    for name in sorted(shared):
        key, info = by_name[name]
        assert defaults[name] == default_of(info), name
        value = sample(key, info, Path("/tmp"))
        LLM(**{name: value})
        request = request_options(caught.pop())
        assert request[name] == section_value(key, value), name
        assert [n for n, v in request.items() if v != defaults[n]] == [name], f"{name} set more than its own field"
    undocumented = [n for n in shared - {"model"} if not re.search(rf"\b{n}\b", LLM.__init__.__doc__ or "")]
    assert not undocumented, f"LLM.__init__'s docstring lists its options; it lacks {undocumented}"


def test_llm_deprecated_max_batch_size_is_batch_size(monkeypatch):
    caught = llm_requests(monkeypatch)
    with pytest.warns(DeprecationWarning, match="batch_size"):
        LLM(max_batch_size=3)
    assert caught.pop().schedule.batch_size == 3
    with pytest.raises(ConfigError, match="batch_size"):
        LLM(max_batch_size=3, batch_size=4)


def test_llm_refuses_an_unknown_keyword_naming_the_close_one(monkeypatch):
    llm_requests(monkeypatch)
    with pytest.raises(ConfigError, match="unknown option 'cpu_memroy'; did you mean 'cpu_memory'"):
        LLM(cpu_memroy="4GiB")


def test_plan_request_holds_the_plan_sections_and_max_tokens(monkeypatch):
    """PlanRequest's fields are the job YAML's plan sections (the same classes) and max_tokens, each at its one
    default, and beside_bytes (not an option: what a draft planned first holds beside the plan, 0 unless one is);
    PlanRequest.of takes the options of those sections by their outside names, as LLM does."""
    assert [f.name for f in dataclasses.fields(PlanRequest)] == [*PLAN_SECTIONS, "max_tokens", "beside_bytes"]
    assert PlanRequest().beside_bytes == 0
    request = PlanRequest()
    for name, section in PLAN_SECTIONS.items():
        assert JobConfig.model_fields[name].annotation is section, name
        assert getattr(request, name) == section(), name
    assert request.max_tokens == SamplingOptions().max_tokens
    assert set(request_options(request)) == llm_names(monkeypatch) & set(yaml_by_name()) - set(PREFIX_CACHE_NAMES)


def test_plan_request_sizes_are_bytes_once_made():
    request = PlanRequest.of(gpu_memory="22GiB", cpu_memory="64GB", disk_memory=0, host_baseline="512MiB")
    assert (request.memory.gpu, request.memory.cpu, request.memory.disk, request.memory.baseline) == (
        22 * 2**30, 64 * 10**9, 0, 512 * 2**20)
    assert request.baseline_bytes() == 512 * 2**20
    with pytest.raises(ConfigError, match="option cpu_memory: expected a size such as 22GiB, 64GB or 512MiB, "
                                          "found '64 gigs'"):
        PlanRequest.of(cpu_memory="64 gigs")
    with pytest.raises(ConfigError, match="unknown option 'cpu_memroy'; did you mean 'cpu_memory'"):
        PlanRequest.of(cpu_memroy="4GiB")


def test_plan_request_with_options_changes_those_and_keeps_the_rest():
    on_exceed = MemoryOptions(cpu="8GiB", on_exceed="stop")  # a section field with no outside name is kept too
    request = PlanRequest(memory=on_exceed, max_tokens=7).with_options(batch_size=4, quantization="q4_0")
    assert (request.schedule.batch_size, request.model.quantization) == (4, "q4_0")
    assert (request.memory.cpu, request.memory.on_exceed, request.max_tokens) == (8 * 2**30, "stop", 7)
    assert request.with_options(cpu_memory=None).memory.cpu is None, "None is the option's default"
    with pytest.raises(ConfigError, match="option batch_size: input should be greater than or equal to 1"):
        request.with_options(batch_size=0)


def test_plan_request_refuses_an_option_where_a_section_goes():
    with pytest.raises(TypeError, match=r"PlanRequest\(model=...\) takes a ModelOptions.*PlanRequest.of"):
        PlanRequest(model="llama-3.1-8b")
    with pytest.raises(ConfigError, match="max_tokens must be a whole number of 1 or more, found 0"):
        PlanRequest(max_tokens=0)


def test_cli_flags_have_the_options_type_default_and_help():
    by_name = yaml_by_name()
    checked = set()
    for cmd, actions in cli_actions().items():
        for dest, action in actions.items():
            if dest not in by_name:
                continue
            key, info = by_name[dest]
            kind, default = kind_of(info), default_of(info)
            text = (action.help or "").replace("%%", "%")
            assert action.default is None, f"{cmd} --{dest}: None means the option's default"
            if kind is bool:
                assert action.const == (not default) and action.nargs == 0, f"{cmd} {dest}: a switch to not default"
            elif kind is list:
                assert isinstance(action, argparse._AppendAction) and action.type is None, f"{cmd} {dest}: repeatable"
            else:
                assert action.type is {int: int, float: float}.get(kind), f"{cmd} {dest}: type {action.type}"
            if isinstance(kind, tuple):
                assert text.startswith(f"one of {', '.join(map(str, kind))}"), f"{cmd} {dest}: {text}"
            assert f"({key}" in text, f"{cmd} {dest}: help names the YAML key {key}: {text}"
            if default not in (None, []) and not isinstance(default, bool):
                assert re.search(rf"default '?{re.escape(str(default))}'?\)", text), f"{cmd} {dest}: {text}"
            elif default in (None, []) and key not in NO_DEFAULT_IN_HELP:
                assert "default" in text, f"{cmd} {dest}: help says what unset means: {text}"
            checked.add(dest)
    assert {"cpu_memory", "max_tokens", "temperature", "seed", "batch_size", "progress"} <= checked


def test_each_command_takes_the_flags_of_its_options():
    """plan takes the plan's options; validate and run also the sampling defaults and the job's; serve the plan's,
    the sampling defaults and its own; generate the plan's and the sampling's."""
    actions = cli_actions()
    for key, info in yaml_options().items():
        cli = (info.json_schema_extra or {}).get("cli")
        name = outside_name(key, info)
        assert (name in actions["plan"]) == (cli == "plan"), name
        assert (name in actions["run"]) == (name in actions["validate"]) == (cli in ("plan", "sampling", "job")), name
        assert (name in actions["serve"]) == (cli in ("plan", "sampling", "serve")), name
        assert (name in actions["generate"]) == (cli in ("plan", "sampling")), name


def test_flags_set_the_yaml_key_their_help_names(tmp_path):
    """All of run's option flags at once, each with a value other than its default: each lands on its own key."""
    (tmp_path / "in.jsonl").write_text("")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    given = {"model.path": str(model), "input.path": str(tmp_path / "in.jsonl")}
    argv, expected = ["run"], {}
    for dest, action in cli_actions()["run"].items():
        if dest not in yaml_by_name() or dest == "plot":  # a plot needs matplotlib, an extra
            continue
        key, info = yaml_by_name()[dest]
        value = given.get(key) or sample(key, info, tmp_path)
        values = [] if kind_of(info) is bool else value if kind_of(info) is list else [value]
        argv += [word for v in values for word in (action.option_strings[0], str(v))] or action.option_strings[:1]
        expected[key] = section_value(key, value)
    args = build_parser().parse_args(argv)
    from offload.cli.job_flags import effective_config

    config = effective_config(args)
    for key, value in expected.items():
        section, field = key.split(".")
        assert getattr(getattr(config, section), field) == value, key
    assert len(expected) >= 20


def test_no_flags_leave_every_option_at_its_default():
    args = build_parser().parse_args(["plan"])
    from offload.cli.job_flags import effective_config

    config, defaults = effective_config(args, need_input=False), load_config(None, {"model.path": "default"},
                                                                             need_input=False)
    assert config == defaults
    for key, info in yaml_options().items():
        if key.split(".")[0] in ("model", "hardware", "memory", "schedule", "sampling"):
            section, field = key.split(".")
            assert getattr(getattr(config, section), field) == default_of(info), key


def test_flag_help_names_the_unit():
    for cmd, actions in cli_actions().items():
        for dest, action in actions.items():
            if dest not in yaml_by_name():
                continue
            unit = (yaml_by_name()[dest][1].json_schema_extra or {}).get("unit")
            assert unit in UNITS | {None}, f"{dest}: unit {unit!r} has no check here"
            if unit == "bytes":
                assert re.search(r"such as \d+[KMGT]i?B", action.help), f"{cmd} {dest}: {action.help}"
            elif unit == "tokens":
                assert "tokens" in action.help, f"{cmd} {dest}: {action.help}"


def test_every_unit_is_one_this_test_knows():
    units = {(info.json_schema_extra or {}).get("unit") for info in yaml_options().values()}
    assert units - {None} <= UNITS and {"bytes", "tokens"} <= units


def test_no_plan_request_is_built_by_position():
    """Keyword-only: a field added to PlanRequest cannot shift the others' values."""
    found = []
    for folder in ("offload", "scripts", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Call) and node.args and (
                        getattr(node.func, "id", None) == "PlanRequest"
                        or getattr(node.func, "attr", None) == "PlanRequest"):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, f"PlanRequest built by position at {found}"
    make = PlanRequest  # (by another name, so that the walk above does not find this one)
    with pytest.raises(TypeError):
        make("llama-3.1-8b")


GENERATORS = ("Generator", "Recording", "_generator", "_run")  # max_batch_size is the Generator's own parameter


def test_the_projects_code_uses_batch_size_not_its_deprecated_name():
    """LLM(max_batch_size=...) warns (18 DeprecationWarnings per test run); only its own test above may pass it."""
    found = []
    for folder in ("offload", "scripts", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name == "test_options.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                name = getattr(getattr(node, "func", None), "id", None) or getattr(getattr(node, "func", None),
                                                                                  "attr", None)
                passed = isinstance(node, ast.Call) and any(k.arg == "max_batch_size" for k in node.keywords)
                in_text = isinstance(node, ast.Constant) and "LLM(" in str(node.value) and \
                    re.search(r"max_batch_size=\w", str(node.value))  # a script run in a child process
                if passed and name not in GENERATORS or in_text:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, f"max_batch_size= passed at {found}; pass batch_size"


def test_the_options_reference_is_current():
    """docs/options.md is made from the options and the command line; it must be what the code makes now."""
    from offload.cli.options_doc import options_markdown

    assert (ROOT / "docs" / "options.md").read_text() == options_markdown(), \
        "docs/options.md is not current; run `python -m offload.cli.options_doc > docs/options.md`"


def test_the_options_reference_lists_every_section_and_key():
    """Each section of the job YAML (and every other section of offload/options.py) has its heading in
    docs/options.md, and under it a row per key; a top-level key has its row too."""
    from offload import options
    from offload.cli.options_doc import documented_sections

    text = (ROOT / "docs" / "options.md").read_text()
    headed = dict(re.findall(r"^## `(\w+)`[^\n]*\n(.*?)(?=^## |\Z)", text, re.M | re.S))
    for key in yaml_options():
        section, field = key.split(".") if "." in key else ("", key)
        body = headed.get(section) if section else text[text.index("## Top-level keys"):]
        assert body is not None, f"docs/options.md has no heading for the section {section}"
        assert f"| `{field}` |" in body, f"docs/options.md lacks a row for {key}"
    sections = {c for c in vars(options).values()
                if isinstance(c, type) and issubclass(c, Section) and c is not Section}
    assert sections == set(documented_sections().values()), "a section of offload/options.py is not documented"
    for name, section in documented_sections().items():
        assert all(f"| `{field}` |" in headed[name] for field in section.model_fields), name


HAND_WRITTEN = {  # flags whose dest is an option's outside name but that set no option, and why
    ("eval-kl", "--model"): "the model measured, beside --reference: required, no default model",
    ("cache clear", "--model"): "which model's cache entries to remove",
    ("calibrate", "--output"): "where the measured hardware profile goes, not a job's output",
}


def test_no_command_writes_an_options_flag_by_hand():
    """A flag that sets an option is made from its field (cli/job_flags.py): its key in its help, its type, default
    and choices the option's; every other flag of every command says what it does."""
    from offload.options import named_options
    from offload.cli.options_doc import command_parsers, option_of, yaml_sections

    names = named_options(yaml_sections())
    flags = {"--" + name.replace("_", "-") for name in names}
    by_hand = {}
    for command, parser in command_parsers().items():
        for action in parser._actions:
            if not isinstance(action, argparse._SubParsersAction):  # a command's own commands have theirs
                assert action.help, f"{command} {action.option_strings or action.dest} has no help"
            if option_of(action) is None and (action.dest in names or flags & set(action.option_strings)):
                by_hand[(command, action.option_strings[0])] = action.help
    assert set(by_hand) == set(HAND_WRITTEN), f"flags of an option written by hand: {set(by_hand) - set(HAND_WRITTEN)}"


def test_eval_kl_takes_the_options_flags():
    args = build_parser().parse_args(["eval-kl", "--model", "m.gguf", "--reference", "r.gguf", "--text", "t.txt",
                                      "--dtype", "fp32", "--backend", "cpu", "--batch", "64"])
    assert (args.dtype, args.backend, args.prefill_chunk_tokens) == ("fp32", "cpu", 64)
    assert build_parser().parse_args(["eval-kl", "--model", "m", "--reference", "r", "--text", "t"]).dtype is None

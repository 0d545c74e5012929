"""Job configs: YAML validated by pydantic, every mistake reported in one pass; flags > file > defaults."""

from __future__ import annotations

import copy
import difflib
import importlib.util
import os
import reprlib
import sys
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError

from offload.errors import ConfigError, WeightsError
from offload.options import (ENGINES, DistributedOptions, HardwareOptions, InputOptions, MemoryOptions, ModelOptions,
                             OutputOptions, PrefixCacheOptions, ReportOptions, SamplingOptions, ScheduleOptions,
                             Section, ServeOptions, SpeculativeOptions)
from offload.planner.request import PlanRequest
from offload.profile.report import PLOT_EXTRA_HINT, plotting_available
from offload.weights.default_model import resolve_model
from offload.weights.model_files import has_model

RAY_EXTRA_HINT = "install it with `pip install 'offload[ray]'` on the driver and every node, or set engine: local"
# how a wrong value is quoted back: a few items and characters of it (YAML aliases make a list of 9^8 items from a
# few lines, and its whole repr is hundreds of megabytes)
_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxdict, _SHOWN.maxstring, _SHOWN.maxother = 3, 4, 4, 80, 80


class JobConfig(Section):
    """One offline batch job: the option sections of offload/options.py."""

    model: ModelOptions = Field(description="a section with at least 'path'")
    hardware: HardwareOptions = Field(default_factory=HardwareOptions)
    memory: MemoryOptions = Field(default_factory=MemoryOptions)
    input: InputOptions | None = None  # required to run a job (see validate_config), not to plan one
    output: OutputOptions = Field(default_factory=OutputOptions)
    sampling: SamplingOptions = Field(default_factory=SamplingOptions)
    schedule: ScheduleOptions = Field(default_factory=ScheduleOptions)
    report: ReportOptions = Field(default_factory=ReportOptions)
    engine: Literal[ENGINES] = Field("local", description="local: one process on this machine; ray: replicas on a "
                                     "Ray cluster (see distributed; --ray sets it)")
    distributed: DistributedOptions = Field(default_factory=DistributedOptions)
    serve: ServeOptions = Field(default_factory=ServeOptions)  # offload serve only
    speculative: SpeculativeOptions = Field(default_factory=SpeculativeOptions)  # LLM's speculative_config
    prefix_cache: PrefixCacheOptions = Field(default_factory=PrefixCacheOptions)  # LLM's prefix_cache

    @property
    def output_path(self) -> Path:
        if self.output.path:
            return Path(self.output.path)
        src = Path(self.input.path)
        return src.with_name(src.stem + ".outputs.jsonl")

    @property
    def report_path(self) -> Path:
        if self.report.path:
            return Path(self.report.path)
        out = self.output_path
        return out.with_name(out.stem + ".report.json")

    def to_yaml(self) -> str:
        """The effective configuration as YAML, defaults filled in."""
        data = self.model_dump(mode="json")
        if self.input is not None or self.output.path:  # a server's config has no input to name its outputs after
            data["output"]["path"] = str(self.output_path)
            data["report"]["path"] = str(self.report_path)
        return yaml.safe_dump(data, sort_keys=False)


# Keys holding file paths; relative ones resolve against the config file's folder.
PATH_KEYS = ("model.path", "input.path", "output.path", "report.path", "report.trace", "report.plot",
             "hardware.profile", "serve.state_dir")


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None,
                need_input: bool = True) -> JobConfig:
    """The effective config: defaults, then the YAML file (if any), then overrides (dotted key -> value).

    need_input False accepts a config without an input section (to plan a job, not to run it)."""
    source = str(path) if path is not None else "command line"
    raw = _shorthands(read_yaml(Path(path))) if path is not None else {}
    base = Path(path).resolve().parent if path is not None else Path.cwd()
    raw = _resolve_paths(raw, base)
    for key, value in (overrides or {}).items():
        if value is not None:
            _set_dotted(raw, key, _resolve_one(key, value, Path.cwd()))
    return validate_config(raw, source, need_input)


def _shorthands(raw: dict) -> dict:
    """Accept `model: default`, `input: prompts.jsonl` and `hardware: rtx4090-ddr5` for their one main key."""
    main = {"model": "path", "input": "path", "hardware": "profile"}
    return {k: {main[k]: v} if k in main and (isinstance(v, str) or k == "hardware" and v is None) else v
            for k, v in raw.items()}


def read_yaml(path: Path) -> dict:
    """Parse a YAML config file into a mapping, with a clear error if that fails."""
    if not path.is_file():
        raise ConfigError(f"config file {path} {_what_is(path)}; expected a YAML file such as configs/demo.yaml: "
                          f"give its path")
    try:
        data = yaml.load(path.read_text(encoding="utf-8-sig"), Loader=_UniqueKeyLoader)
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not UTF-8 text (byte {e.start} is {e.object[e.start:e.start + 1]!r}); "
                          f"save the config as UTF-8") from None
    except _DuplicateKey as e:
        raise ConfigError(f"{path}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML ({' '.join(str(e).split())}); fix the syntax") from None
    except RecursionError:  # PyYAML's parser recurses once per level of nesting
        raise ConfigError(f"{path} is not a config offload can read: its lists and mappings nest too deep to parse; "
                          f"a config nests a few levels (see configs/demo.yaml)") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections (model, input, ...), "
                          f"found {type(data).__name__}; see configs/demo.yaml")
    return data


class _DuplicateKey(Exception):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (PyYAML would keep the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise _DuplicateKey(f"key {key!r} is given twice (lines {seen[key]} and "
                                    f"{key_node.start_mark.line + 1}), and YAML would silently keep only the last; "
                                    f"merge them into one")
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def validate_config(raw: dict, source: str = "config", need_input: bool = True) -> JobConfig:
    """A JobConfig from a mapping, or one ConfigError listing every problem found."""
    raw, problems = _shorthands(raw), []
    if need_input and raw.get("input") is None:
        problems.append("key 'input' is missing; expected a section with at least 'path'")
    config = None
    try:
        config = JobConfig.model_validate(raw)
    except ValidationError as e:
        problems += [describe_error(err) for err in e.errors()]
    problems += check_files(raw)
    if config is not None and config.input is not None:
        problems += check_paths(config)
    if problems:
        raise ConfigError(_join_problems(source, problems))
    return config


def _join_problems(source: str, problems: list[str]) -> str:
    if len(problems) == 1:
        return f"{source}: {problems[0]}"
    lines = "\n".join(f"  - {p}" for p in problems)
    return f"{source} has {len(problems)} problems; fix them and run `offload validate` again:\n{lines}"


def describe_error(err: dict) -> str:
    """One pydantic error as: key, what was expected, what was found, and a suggestion."""
    loc = [str(p) for p in err["loc"] if not str(p).startswith("function-")]
    key = ".".join(loc)
    kind, found = err["type"], err.get("input")
    if kind == "extra_forbidden":
        known = _known_keys(loc[:-1])
        close = difflib.get_close_matches(loc[-1], known, n=1, cutoff=0.6)
        hint = f"did you mean {'.'.join(loc[:-1] + close)!r}?" if close else f"known keys: {', '.join(known)}"
        return f"unknown key {key!r}; {hint}"
    if kind == "missing":
        expected = _description(loc) or "a value"
        return f"key {key!r} is missing; expected {expected}"
    if kind == "literal_error":
        options = err["ctx"]["expected"]
        close = difflib.get_close_matches(_SHOWN.repr(found).strip("'"), [o.strip("'") for o in options.split(", ")],
                                          n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return f"key {key!r}: expected one of {options}, found {_SHOWN.repr(found)}{hint}"
    if kind == "value_error":
        return f"key {key!r}: {err['msg'].removeprefix('Value error, ')}"
    if kind == "model_type" or kind == "dict_type":
        return f"key {key!r}: expected a section (a mapping of keys), found {_SHOWN.repr(found)}"
    return f"key {key!r}: expected {_expected(err)}, found {_SHOWN.repr(found)}"


def _expected(err: dict) -> str:
    kind, ctx = err["type"], err.get("ctx", {})
    bounds = {"greater_than_equal": ">= {ge}", "greater_than": "> {gt}", "less_than_equal": "<= {le}",
              "less_than": "< {lt}"}
    if kind in bounds:
        return "a value " + bounds[kind].format(**ctx)
    if kind == "string_too_short":
        return "a non-empty string" if ctx["min_length"] == 1 else f"a string of {ctx['min_length']} characters or more"
    names = {"int": "a whole number", "float": "a number", "bool": "true or false", "string": "a string",
             "list": "a list"}
    for prefix, name in names.items():
        if kind.startswith(prefix):
            return name
    return err["msg"].lower()


def _section_model(loc: list[str]):
    model = JobConfig
    for part in loc:
        field = model.model_fields.get(part)
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return model


def _known_keys(loc: list[str]) -> list[str]:
    model = _section_model(loc)
    return list(model.model_fields) if model else []


def _description(loc: list[str]) -> str | None:
    model = _section_model(loc[:-1])
    field = model.model_fields.get(loc[-1]) if model else None
    return field.description if field else None


def check_files(raw: dict) -> list[str]:
    """Problems with the files a config names: missing model or input, unwritable outputs, bad hardware."""
    problems = [p for key in ("model.path", "speculative.model") if (p := _model_problem(key, _get_dotted(raw, key)))]
    input_path = _get_dotted(raw, "input.path")
    if isinstance(input_path, str) and not Path(input_path).is_file():
        what = _what_is(Path(input_path))
        why = ": a job reads its input again to resume, so save the requests to a file" if "FIFO" in what else ""
        problems.append(f"key 'input.path': expected a file of requests (batch JSONL, or prompts with input.format: "
                        f"text), found {input_path!r}, which {what}{why}")
    for key in ("output.path", "report.path", "report.trace", "report.plot"):
        value = _get_dotted(raw, key)
        if isinstance(value, str) and (reason := unwritable_reason(Path(value))):
            problems.append(f"key {key!r}: {value!r} cannot be written ({reason}); choose a writable location")
    if isinstance(_get_dotted(raw, "report.plot"), str) and not plotting_available():
        problems.append(f"key 'report.plot': writing a plot needs matplotlib, which is not installed; {PLOT_EXTRA_HINT}")
    if raw.get("engine") == "ray" and not ray_available():
        problems.append(f"key 'engine': running on Ray needs the ray package, which is not installed; "
                        f"{RAY_EXTRA_HINT}")
    hardware = _get_dotted(raw, "hardware.profile")
    if isinstance(hardware, str):
        from offload.hardware import load_hardware

        try:
            load_hardware(hardware)
        except ConfigError as e:
            problems.append(f"key 'hardware': {e}")
    return problems


def _model_problem(key: str, given) -> str | None:
    """What is wrong with a model path (the model's, or a speculative draft's), or None."""
    if not isinstance(given, str) or given == "default":
        return None
    try:
        folder = resolve_model(given)
    except WeightsError as e:  # a Hub id that is not in the local Hugging Face cache
        return f"key {key!r}: {e}"
    return None if has_model(folder) else f"key {key!r}: {_not_a_model(given, folder)}"


def ray_available() -> bool:
    """Whether ray (the `ray` extra) can be imported."""
    if "ray" in sys.modules:  # imported already, or None: an import of it is blocked and fails
        return sys.modules["ray"] is not None
    return importlib.util.find_spec("ray") is not None


def check_paths(config: JobConfig) -> list[str]:
    """Problems where two files of a job are one: the input and what the job writes, or two things it writes."""
    from offload.jobs.output import side_files

    if not Path(config.input.path).name or not config.output_path.name:
        return []  # a folder such as / (check_files says so): no file names can be made from it
    files = {"input.path": Path(config.input.path), "output.path": config.output_path,
             "report.path": config.report_path}
    files |= {f"the output's {name}": path for name, path in side_files(config.output_path).items()}
    files |= {key: Path(getattr(config.report, key.split(".")[1])) for key in ("report.trace", "report.plot")
              if getattr(config.report, key.split(".")[1])}
    problems, seen = [], {}
    for key, path in files.items():
        real = os.path.realpath(path)
        if real in seen:
            what = "would write over its input" if seen[real] == "input.path" else "would write one over the other"
            problems.append(f"{_key_name(seen[real])} and {_key_name(key)} are the same file {path}, so the job "
                            f"{what}; give them different paths")
        else:
            seen[real] = key
    return problems


def _key_name(key: str) -> str:
    return f"key {key!r}" if "." in key and " " not in key else key


def _what_is(path: Path) -> str:
    from offload.paths import describe_path

    return describe_path(path)


def _not_a_model(given: str, path: Path) -> str:
    expected = "a folder with config.json, a .gguf file, a Hub id or 'default'"
    what = _what_is(path)
    if what == "does not exist":
        return f"expected {expected}, found {given!r}, which does not exist"
    what += " without config.json" if what == "is a folder" else ""
    return f"{given!r} {what}, not a model: expected {expected}"


def unwritable_reason(path: Path) -> str | None:
    """Why a file could not be created or appended to at path, or None if it can."""
    what = _what_is(path)
    if what not in ("is a file", "does not exist") and not what.startswith("is a broken symlink"):
        return f"it {what}"  # a folder, a symlink loop, a FIFO, a device
    if path.exists():
        return None if os.access(path, os.W_OK) else "the file is read-only"
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is a file, not a folder"
    return None if os.access(parent, os.W_OK | os.X_OK) else f"the folder {parent} is not writable"


def _resolve_paths(raw: dict, base: Path) -> dict:
    raw = copy.deepcopy(raw)
    for key in PATH_KEYS:
        value = _get_dotted(raw, key)
        if isinstance(value, str):
            _set_dotted(raw, key, _resolve_one(key, value, base))
    return raw


def _resolve_one(key: str, value: Any, base: Path) -> Any:
    """Make a relative path absolute against base; 'default' and hardware preset names stay as they are."""
    if key not in PATH_KEYS or not isinstance(value, str) or Path(value).is_absolute():
        return value
    if (key == "model.path" and value == "default") or (key in ("hardware.profile", "model.path")
                                                          and not (base / Path(value).expanduser()).exists()):
        return value  # a preset or shipped model name, or a path that does not exist (reported as given)
    return str((base / Path(value).expanduser()).resolve())


def _get_dotted(raw: dict, key: str) -> Any:
    node = raw
    for part in key.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


def _set_dotted(raw: dict, key: str, value: Any) -> None:
    *parents, last = key.split(".")
    node = raw
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[last] = value


def parse_set_option(text: str) -> tuple[str, Any]:
    """'sampling.temperature=0.7' -> ('sampling.temperature', 0.7), the value read as YAML."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set expects KEY=VALUE such as sampling.temperature=0.7, found {text!r}")
    try:
        return key.strip(), yaml.safe_load(value)
    except yaml.YAMLError:
        return key.strip(), value


def sampling_defaults(config: JobConfig) -> dict:
    """The sampling section as each request's defaults (a request's body overrides them)."""
    return config.sampling.model_dump()


def plan_request(config: JobConfig) -> PlanRequest:
    """What a job asks of the planner: the one request both `offload plan JOB` and `offload run JOB` plan from."""
    return PlanRequest(model=config.model, hardware=config.hardware, memory=config.memory, schedule=config.schedule,
                       max_tokens=config.sampling.max_tokens)

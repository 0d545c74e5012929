"""The flags of `offload run`, `offload validate`, `offload plan`, `offload serve`, `offload generate` and
`offload simulate`, and the option flags of `offload eval-kl`, made from the options' fields (offload/options.py):
each overrides one job config key."""

from __future__ import annotations

from pathlib import Path

RAY_CONFIG_ADDRESS = "from-config"  # --ray given without an address


def job_sections() -> dict:
    """The job's option sections, in the order their flags are listed."""
    from offload import options as o

    return {**o.PLAN_SECTIONS, "sampling": o.SamplingOptions, "input": o.InputOptions, "output": o.OutputOptions,
            "report": o.ReportOptions, "serve": o.ServeOptions,
            "prefix_cache": o.PrefixCacheOptions}


def flag_options(commands: tuple[str, ...]) -> dict[str, tuple[str, object]]:
    """argparse dest -> (the config key it overrides, its field) for the flags of these groups of commands ("plan",
    "sampling", "job", "serve": an option's `cli`)."""
    from offload.options import extra, named_options

    return {name: (key, info) for name, (key, info) in named_options(job_sections()).items()
            if extra(info).get("cli") in commands}


def _add_flags(p, commands: tuple[str, ...]) -> None:
    """One flag per option the commands take, with its type, choices and help from the option's field."""
    for dest, (key, info) in flag_options(commands).items():
        _add_flag(p, dest, key, info)


def add_option_flags(p, keys: dict[str, tuple[str, ...]]) -> None:
    """A flag for each of these options (dotted key -> other names of its flag), made as _add_flags makes them: for
    a command that takes a few options of a section, such as eval-kl's dtype and backend."""
    from offload.options import named_options

    by_key = {key: (dest, info) for dest, (key, info) in named_options(job_sections()).items()}
    for key, aliases in keys.items():
        dest, info = by_key[key]
        _add_flag(p, dest, key, info, aliases)


def _add_flag(p, dest: str, key: str, info, aliases: tuple[str, ...] = ()) -> None:
    """The flag of one option: its type, choices and help from the option's field; unset, it leaves the option to
    the config file or its default (None)."""
    import typing

    from offload.options import extra

    flags = (extra(info).get("flag") or "--" + dest.replace("_", "-"), *aliases)
    default = None if info.is_required() else info.get_default(call_default_factory=True)
    shown = "" if default in (None, "", []) else f"; default {default!r}" if isinstance(default, str) \
        else f"; default {default}"
    help_text = f"{info.description} ({key}{shown})"
    if info.annotation is bool:  # a switch to the other value
        p.add_argument(*flags, dest=dest, action="store_const", const=not default, default=None,
                       help=help_text.replace("%", "%%"))
        return
    if typing.get_origin(info.annotation) is list:  # one value per use of the flag
        p.add_argument(*flags, dest=dest, action="append", help=help_text.replace("%", "%%"))
        return
    kind = _arg_type(info)
    if isinstance(kind, tuple):  # checked by the option itself, which names the field and suggests a value
        help_text = f"one of {', '.join(map(str, kind))}: {help_text}"
    kwargs = {"type": kind} if kind in (int, float) else {}
    p.add_argument(*flags, dest=dest, help=help_text.replace("%", "%%"), **kwargs)


def _arg_type(info):
    """int, float, a tuple of choices, or None (a string: sizes and paths are parsed by the option's check)."""
    import typing

    from offload.options import extra

    if extra(info).get("unit") == "bytes":  # 22GiB: read by the option's own check
        return None

    metadata_base = [a for a in typing.get_args(info.annotation)] or [info.annotation]
    for ann in (info.annotation, *metadata_base):
        if typing.get_origin(ann) is typing.Annotated:  # Whole | None: the int inside
            ann = typing.get_args(ann)[0]
        if typing.get_origin(ann) is typing.Literal:
            return typing.get_args(ann)
        if ann in (int, float):
            return ann
    return None


def add_plan_flags(p) -> None:
    """What decides the plan: model, hardware, budgets, workload."""
    p.add_argument("config", nargs="?", help="a job YAML file such as configs/demo.yaml (flags override it)")
    _add_flags(p, ("plan",))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config key, e.g. --set sampling.top_p=0.9 (repeatable)")


def add_generate_flags(p) -> None:
    """add_plan_flags plus the sampling of the prompts."""
    add_plan_flags(p)
    _add_flags(p, ("sampling",))


def add_job_flags(p) -> None:
    """add_plan_flags plus the requests' sampling defaults and what a job reads and writes."""
    add_plan_flags(p)
    _add_flags(p, ("sampling", "job"))
    p.add_argument("--ray", nargs="?", const=RAY_CONFIG_ADDRESS, metavar="ADDRESS",
                   help="run on a Ray cluster (engine: ray): at ADDRESS (auto, local or HOST:PORT), or at "
                        "distributed.address when none is given; put it after the config file")


def add_serve_flags(p) -> None:
    """add_plan_flags plus the requests' sampling defaults, where the server listens, who may call it and how many
    requests may wait."""
    add_plan_flags(p)
    _add_flags(p, ("sampling", "serve"))


def effective_config(args, need_input: bool = True):
    """The config from args.config plus every flag that was given."""
    from offload.jobs.config import load_config, parse_set_option

    flags = flag_options(("plan", "sampling", "job", "serve"))
    overrides = {key: getattr(args, dest) for dest, (key, _) in flags.items() if getattr(args, dest, None) is not None}
    if getattr(args, "ray", None) is not None:
        overrides |= ray_overrides(args)
    overrides.update(dict(parse_set_option(s) for s in args.set))
    if args.config is None and "model.path" not in overrides:
        overrides["model.path"] = "default"
    return load_config(args.config, overrides, need_input)


def ray_overrides(args) -> dict:
    """--ray [ADDRESS]: engine ray, and the address when one is given (a config file there is a misplaced flag)."""
    from offload.errors import ConfigError

    if args.ray == RAY_CONFIG_ADDRESS:
        return {"engine": "ray"}
    if args.config is None and Path(args.ray).is_file():
        raise ConfigError(f"--ray took {args.ray!r}, a file, as the Ray address; put the config file first "
                          f"(`offload run {args.ray} --ray`) or give an address (`--ray auto`)")
    return {"engine": "ray", "distributed.address": args.ray}

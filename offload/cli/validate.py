"""`offload validate`: check a job config and its input file without running anything."""

from __future__ import annotations

from pathlib import Path

from offload.cli.job_flags import add_job_flags, effective_config
from offload.errors import ConfigError


def add_parser(sub) -> None:
    p = sub.add_parser("validate", help="check a job config and its input file without running it")
    add_job_flags(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from offload.jobs.batch import read_requests
    from offload.jobs.run import sampling_defaults

    config = effective_config(args)
    requests, bad = read_requests(Path(config.input.path), config.input.format, sampling_defaults(config),
                                  config.input.chat)
    name = args.config or "the command line"
    if bad:
        lines = "\n".join(f"  - {b.message}" for b in bad)
        raise ConfigError(f"{config.input.path} has {len(bad)} bad line(s) that would become error lines in "
                          f"the output; fix them:\n{lines}")
    print(f"{name}: ok; {len(requests)} requests from {config.input.path}; outputs to {config.output_path}")
    return 0

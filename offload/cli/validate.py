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
    if config.engine == "local":  # on Ray each replica plans for the node it lands on, when the job starts
        check_plan(config)
    if bad:
        lines = "\n".join(f"  - {b.message}" for b in bad)
        raise ConfigError(f"{config.input.path} has {len(bad)} bad line(s) that would become error lines in "
                          f"the output; fix them:\n{lines}")
    print(f"{name}: ok; {len(requests)} requests from {config.input.path}; outputs to {config.output_path}")
    return 0


def check_plan(config) -> None:
    """Plan the job (arithmetic over config.json and the hardware profile, no weights): budgets that cannot
    work, such as a GPU budget without a GPU or one too small for the model, are refused here."""
    from offload.jobs.config import plan_request
    from offload.planner import plan_for
    from offload.weights.model_files import model_spec
    from offload.weights.default_model import resolve_model

    request = plan_request(config)
    plan_for(model_spec(resolve_model(request.model)), request.profile(), request)

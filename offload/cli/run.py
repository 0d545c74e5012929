"""`offload run`: a batch job from a YAML config, flags overriding the file; resumable."""

from __future__ import annotations

import logging

from offload.cli.exits import EXIT_FAILED_REQUESTS, EXIT_OK
from offload.cli.job_flags import add_job_flags, effective_config

logger = logging.getLogger("offload")


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="run a batch job from a YAML config (resumable)")
    add_job_flags(p)
    p.add_argument("--restart", action="store_true",
                   help="start over; the old outputs are moved to <output>.bak (then .bak.1, .bak.2, ...: "
                        "none is overwritten) once the new run is ready")
    p.add_argument("--print-config", action="store_true", help="print the effective config and exit")
    p.set_defaults(func=run, resumes=True)  # an interrupted run keeps what it finished (main says so)


def run(args) -> int:
    from offload.jobs.run import run_batch

    config = effective_config(args)
    if args.print_config:
        print(config.to_yaml(), end="")
        return 0
    report = run_batch(config, restart=args.restart)
    if report["outputs"]["failed"]:
        logger.warning(f"{report['outputs']['failed']} request(s) are error lines in {report['outputs']['path']}; "
                       f"fix them and rerun to retry them (exit code {EXIT_FAILED_REQUESTS})")
        return EXIT_FAILED_REQUESTS
    return EXIT_OK

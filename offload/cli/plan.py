"""`offload plan`: the plan a job (or the same flags) would run, printed without loading any weight."""

from __future__ import annotations

import logging

from offload.cli.job_flags import add_plan_flags, effective_config

log = logging.getLogger("offload")


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="place a model's blocks on GPU, CPU and disk and predict its speed")
    add_plan_flags(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--explain", action="store_true", help="also print why the plan is what it is")
    p.set_defaults(func=run)


def run(args) -> int:
    from offload.jobs.config import plan_request
    from offload.planner import plan_for
    from offload.spec import load_spec
    from offload.weights.default_model import resolve_model

    request = plan_request(effective_config(args, need_input=False))
    if request.hardware is None:
        log.info("planning for the calibrated profile (or an estimate; run `offload calibrate`)")
    plan = plan_for(load_spec(resolve_model(request.model)), request.profile(), request)
    if args.json:
        print(plan.to_json())
        return 0
    print(plan.table())
    if args.explain:
        print()
        print(plan.explain())
    return 0

"""`offload plan`: the plan a job (or the same flags) would run, printed without loading any weight."""

from __future__ import annotations

import json
import logging

from offload.cli.job_flags import add_plan_flags, effective_config
from offload.cli.speculation_price import add_acceptance_flag, speculation_json, speculation_price

log = logging.getLogger("offload")


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="place a model's blocks on GPU, CPU and disk and predict its speed")
    add_plan_flags(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--explain", action="store_true",
                   help="also print why the plan is what it is, its bottleneck per phase and what-ifs (the same job "
                        "re-planned with another quantization, more VRAM, half or double the batch, the next "
                        "hardware preset); with --json, adds the keys bottleneck and what_ifs")
    add_acceptance_flag(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from offload.jobs.config import plan_request
    from offload.planner import plan_for
    from offload.planner.whatif import format_what_ifs, what_ifs
    from offload.weights.model_files import model_spec
    from offload.weights.default_model import resolve_model

    config = effective_config(args, need_input=False)
    request = plan_request(config)
    if request.hardware.profile is None:
        log.info("planning for the calibrated profile (or an estimate; run `offload calibrate`)")
    spec, hw = model_spec(resolve_model(request.model.path)), request.profile()
    plan = plan_for(spec, hw, request)
    speculation = speculation_price(request, config.speculative, args.speculative_acceptance)
    changes = [w.to_dict() for w in what_ifs(spec, hw, request, plan)] if args.explain else []
    if args.json:
        out = json.loads(plan.to_json()) if not args.explain else explained_dict(plan, changes)
        if speculation is not None:
            out["speculative"] = speculation_json(speculation)
        print(json.dumps(out, indent=2, default=lambda v: None))
        return 0
    print(plan.table())
    print(prefix_cache_line(plan, config.prefix_cache))
    if speculation is not None:
        print(speculation.line())
    if args.explain:
        print()
        print(plan.explain())
        print("\n".join(["", *format_what_ifs(changes)]))
    return 0


def prefix_cache_line(plan, options) -> str:
    """What the prefix cache holds under this plan: the KV pool's room, and the host tier's."""
    from offload.hardware import format_bytes
    from offload.planner.prefix_price import host_tier_bytes

    if not options.enabled:
        return "prefix cache: off (prefix_cache.enabled false, --no-enable-prefix-caching)"
    shown = "half the CPU budget the plan leaves free" if options.host_memory is None else "prefix_cache.host_memory"
    return (f"prefix cache: on, in the KV pool's free slots, and a host tier of "
            f"{format_bytes(host_tier_bytes(plan, options.host_memory))} ({shown})")


def explained_dict(plan, changes: list[dict]) -> dict:
    """The plan's JSON with the bottleneck of each phase and the what-ifs (--json --explain)."""
    from offload.planner.bottleneck import predicted_bottleneck

    bottleneck = {p: predicted_bottleneck(getattr(plan, p)) for p in ("prefill", "decode")}
    return {**json.loads(plan.to_json()), "bottleneck": bottleneck, "what_ifs": changes}

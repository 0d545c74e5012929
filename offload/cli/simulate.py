"""`offload simulate`: run the plan's real schedule on a timed simulated GPU and print it beside the prediction."""

from __future__ import annotations

import dataclasses
import json
import logging

from offload.cli.job_flags import add_option_flags, add_plan_flags, effective_config
from offload.cli.speculation_price import add_acceptance_flag, speculation_json, speculation_price

log = logging.getLogger("offload")


def add_parser(sub) -> None:
    p = sub.add_parser("simulate", help="run the plan's schedule on a simulated GPU: tokens/s, busy shares, memory")
    add_plan_flags(p)
    p.add_argument("--decode-steps", type=int, default=8, help="decode steps to simulate (default 8)")
    p.add_argument("--requests", type=int, help="estimate a job of this many requests: prompt tokens at the "
                   "simulated prefill speed plus max_tokens each at the simulated decode speed")
    p.add_argument("--prompt-len", type=int, help="tokens per simulated prompt (default: max_model_len - max_tokens)")
    add_option_flags(p, {"report.trace": ()})  # the simulated run's trace
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    add_acceptance_flag(p)
    p.add_argument("--prefix-hit-rate", type=float, metavar="RATE",
                   help="price the prefix cache: a prompt's prefill with this share of its tokens cached (0 to 1)")
    p.set_defaults(func=run)


def prefix_hit(request, rate: float):
    """The plan's prefill of one prompt priced with rate of its tokens from the prefix cache."""
    from offload.planner import plan_for
    from offload.planner.prefix_price import price_prefix_hit
    from offload.weights.default_model import resolve_model
    from offload.weights.model_files import model_spec

    spec, hw = model_spec(resolve_model(request.model.path)), request.profile()
    return price_prefix_hit(plan_for(spec, hw, request), spec, hw, rate)


def run(args) -> int:
    from offload.errors import ConfigError
    from offload.jobs.config import plan_request
    from offload.simulate import simulate

    for flag in ("decode_steps", "requests", "prompt_len"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be 1 or more, found {value}")
    config = effective_config(args, need_input=False)
    request = plan_request(config)
    speculation = speculation_price(request, config.speculative, args.speculative_acceptance)
    trace = config.report.trace
    result = simulate(request, args.decode_steps, trace, prompt_len=args.prompt_len, requests=args.requests)
    hit = None if args.prefix_hit_rate is None else prefix_hit(request, args.prefix_hit_rate)
    if args.json:
        out = result.to_dict()
        if speculation is not None:
            out["speculative"] = speculation_json(speculation)
        if hit is not None:
            out["prefix_cache"] = {**dataclasses.asdict(hit), "hit_prefill_s": hit.hit_prefill_s,
                                   "speedup": hit.speedup}
        print(json.dumps(out, indent=2, default=lambda v: None))
    else:
        print(result.table())
        if speculation is not None:
            print(speculation.line())
        if hit is not None:
            print(hit.line())
    if trace:
        log.info(f"trace written to {trace} (open it in ui.perfetto.dev or chrome://tracing)")
    return 0

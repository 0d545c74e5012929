"""`offload simulate`: run the plan's real schedule on a timed simulated GPU and print it beside the prediction."""

from __future__ import annotations

import json
import logging

from offload.cli.job_flags import add_plan_flags, effective_config

log = logging.getLogger("offload")


def add_parser(sub) -> None:
    p = sub.add_parser("simulate", help="run the plan's schedule on a simulated GPU: tokens/s, busy shares, memory")
    add_plan_flags(p)
    p.add_argument("--decode-steps", type=int, default=8, help="decode steps to simulate (default 8)")
    p.add_argument("--requests", type=int, help="estimate a job of this many requests: prompt tokens at the "
                   "simulated prefill speed plus max_tokens each at the simulated decode speed")
    p.add_argument("--prompt-len", type=int, help="tokens per simulated prompt (default: max_model_len - max_tokens)")
    p.add_argument("--trace", help="write a Chrome/Perfetto trace JSON of the simulated run here")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from offload.errors import ConfigError
    from offload.jobs.config import plan_request
    from offload.simulate import simulate

    for flag in ("decode_steps", "requests", "prompt_len"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be 1 or more, found {value}")
    request = plan_request(effective_config(args, need_input=False))
    result = simulate(request, args.decode_steps, args.trace, prompt_len=args.prompt_len, requests=args.requests)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, default=lambda v: None))
    else:
        print(result.table())
    if args.trace:
        log.info(f"trace written to {args.trace} (open it in ui.perfetto.dev or chrome://tracing)")
    return 0

"""The `offload` command line: generate, plan, calibrate, ... Errors print one line unless --debug."""

from __future__ import annotations

import argparse
import sys

from offload.errors import OffloadError


def add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate a completion for one or more prompts")
    p.add_argument("--model", default="default", help="model folder, config.json folder, or 'default'")
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--quantization", default="none", help="none, q8_0 or q4_0")
    p.add_argument("--dtype", default="auto", help="compute dtype for unquantized weights: auto, fp32, bf16")
    p.set_defaults(func=run_generate)


def run_generate(args) -> int:
    from offload.api import LLM
    from offload.sampling import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop)
    llm = LLM(args.model, quantization=args.quantization, dtype=args.dtype)
    if args.raw:
        outputs = llm.generate(args.prompt, params)
    else:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
    for out in outputs:
        print(out.text)
    return 0


def add_plan_parser(sub) -> None:
    from offload.plan_cli import add_plan_arguments, run_plan

    p = sub.add_parser("plan", help="place a model's blocks on GPU, CPU and disk and predict its speed")
    add_plan_arguments(p)
    p.set_defaults(func=run_plan)


def add_calibrate_parser(sub) -> None:
    from offload.calibrate import add_calibrate_arguments, run_calibrate

    p = sub.add_parser("calibrate", help="measure this machine and cache its hardware profile")
    add_calibrate_arguments(p)
    p.set_defaults(func=run_calibrate)


from offload.job_cli import add_run_parser, add_validate_parser  # noqa: E402  (batch jobs)

# Each subcommand registers itself here: add_<name>_parser(subparsers).
PARSERS = [add_generate_parser, add_plan_parser, add_calibrate_parser, add_run_parser, add_validate_parser]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="offload", description=__doc__)
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in PARSERS:
        add(sub)
    for subparser in sub.choices.values():  # --debug also after the subcommand
        subparser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except OffloadError as e:
        if args.debug:
            raise
        print(f"offload: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("offload: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

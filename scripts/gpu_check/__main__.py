"""`python -m gpu_check run|item ...` (scripts/ on PYTHONPATH): the whole check, or one item in this process."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from gpu_check.steps import BY_NAME


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_check", description=__doc__)
    ap.add_argument("what", choices=["run", "item"])
    ap.add_argument("name", nargs="?", help="the item to run (with `item`)")
    ap.add_argument("--target", help="the item's module:function (default: the step of that name's)")
    ap.add_argument("--smoke", action="store_true", help="the strict simulated device in place of CUDA, tiny sizes")
    ap.add_argument("--out", required=True, type=Path, help="items.jsonl, summary.json and env.txt go here")
    ap.add_argument("--state", required=True, type=Path, help="logs and results; what a rerun skips")
    ap.add_argument("--budget-s", type=float, default=330.0, help="the whole check's deadline (GPU_CHECK_BUDGET_S)")
    ap.add_argument("--started", type=float, default=None, help="when the check began (seconds since the epoch)")
    args = ap.parse_args(argv)
    if args.what == "item":
        target = args.target or (BY_NAME[args.name].target if args.name in BY_NAME else "")
        if not args.name or not target:
            ap.error(f"no item {args.name!r}; items: {', '.join(n for n, s in BY_NAME.items() if s.target)}")
        from gpu_check.context import run_item

        return run_item(args.name, target, args.smoke, args.state, args.out)
    from gpu_check.runner import Run, run_all

    run = Run("smoke" if args.smoke else "cuda", args.out, args.state, args.budget_s, args.started or time.time())
    return run_all(run, sys.executable)


if __name__ == "__main__":
    sys.exit(main())

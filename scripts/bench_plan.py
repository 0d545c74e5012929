"""How long the planner takes for an 80-layer model (Llama-3.1-70B q4_0 on a 24 GB card), against the 50 ms a
plan should stay well under: `offload plan`, `LLM(...)` and every what-if plan this way. Each batch is planned
with the staging depth searched (what `offload plan` does unless --prefetch-depth is given) and at a fixed
depth of 2; batch 128 is where plans with the KV caches in host RAM are weighed too.

  python scripts/bench_plan.py [--model configs/models/llama-3.1-70b] [--repeats 9]
  python scripts/bench_plan.py --smoke     # one timed plan each: about a second
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from offload.hardware import load_hardware
from offload.planner import Budget, Workload, plan
from offload.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent
TARGET_S = 0.050
GiB = 2**30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "configs" / "models" / "llama-3.1-70b"))
    ap.add_argument("--hardware", default="rtx4090-ddr5")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--smoke", action="store_true", help="one timed plan per row (--repeats 1): about a second")
    args = ap.parse_args()
    if args.smoke:
        args.repeats = 1
    spec, hw = load_spec(args.model), load_hardware(args.hardware)
    budget = Budget.for_hardware(hw, gpu_bytes=22 * GiB)
    print(f"{spec.n_layers} layers ({len(spec.units())} units), {args.hardware}, q4_0, 22 GiB of GPU memory")
    for batch_size in (1, 32, 128):
        workload = Workload(batch_size=batch_size, prompt_len=512, gen_len=128)
        for depth, label in ((None, "depth searched"), (2, "depth 2")):
            plan(spec, hw, budget, workload, "q4_0", depth)  # imports and caches warm
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                plan(spec, hw, budget, workload, "q4_0", depth)
                times.append(time.perf_counter() - start)
            median = statistics.median(times)
            print(f"batch {batch_size:3d}, {label:14s}: median {median * 1e3:.1f} ms, best {min(times) * 1e3:.1f} ms "
                  f"({median / TARGET_S:.2f}x of {TARGET_S * 1e3:.0f} ms)")


if __name__ == "__main__":
    main()

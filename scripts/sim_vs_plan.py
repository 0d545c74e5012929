"""Predicted against simulated step times: the planner's cost model against the executor's real schedule on the
timed simulated device, over a matrix of models, GPU budgets, batch sizes and hardware presets.

  python scripts/sim_vs_plan.py            # the 24-case matrix; prints one row per case and the worst ratio
  python scripts/sim_vs_plan.py --smoke    # two cases (8B and 70B at batch 1), one decode step each: seconds
"""

from __future__ import annotations

import argparse
import itertools
import time

from offload.planner import PlanRequest
from offload.simulate import simulate

MODELS = {"llama-3.1-8b": ("4GiB", "8GiB", "16GiB"), "llama-3.1-70b": ("12GiB", "22GiB", "24GiB")}  # at most the cards' VRAM
HARDWARE = ("rtx4090-ddr5", "rtx3090-ddr4")
BATCHES = (1, 32)


def cases():
    for (model, budgets), hw, batch in itertools.product(MODELS.items(), HARDWARE, BATCHES):
        for gpu in budgets:
            yield PlanRequest.of(model=model, quantization="q4_0", dtype="auto", hardware=hw, gpu_memory=gpu,
                                 batch_size=batch, max_model_len=1024, max_tokens=128)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decode-steps", type=int, default=4)
    ap.add_argument("--smoke", action="store_true", help="the first case of each model, one decode step: seconds")
    args = ap.parse_args()
    requests = list(cases())
    if args.smoke:
        requests = [next(r for r in requests if r.model.path == m) for m in MODELS]
        args.decode_steps = 1
    print(f"{'model':14s} {'hardware':13s} {'gpu':>6s} {'batch':>5s}  {'prefill pred/sim':>16s}  "
          f"{'decode pred/sim':>15s}  {'peak gpu / plan':>15s}  wall")
    worst = 0.0
    for request in requests:
        start = time.perf_counter()
        sim = simulate(request, args.decode_steps)
        ratios = [sim.phases[p].predicted_over_simulated for p in ("prefill", "decode")]
        worst = max(worst, *(abs(r - 1) for r in ratios))
        gpu_share = sim.peak_bytes["gpu"] / max(sim.plan.tier("gpu").total_bytes, 1)
        gpu = f"{request.memory.gpu // 2**30}GiB"
        print(f"{request.model.path:14s} {request.hardware.profile:13s} {gpu:>6s} {request.schedule.batch_size:5d}  "
              f"{ratios[0]:16.3f}  {ratios[1]:15.3f}  {gpu_share:15.2f}  {time.perf_counter() - start:.1f} s")
    print(f"largest |predicted / simulated - 1|: {worst:.3f}")


if __name__ == "__main__":
    main()

"""Offloaded inference of a model built from a config.json with random weights in memory (no files).

Plans the model for a GPU budget, each batch with its own plan ('auto': the batch the planner picks for an
offline job of --offline-len tokens per sequence), runs it through the executor, and prints per batch and phase: tokens/s, the
share of wall time the PCIe link was busy, achieved copy bandwidth against the measured pinned bandwidth, the
share of copy time hidden under GPU compute, time the GPU waited for weights, and peak device memory against
the budget, and the plan's prediction for the steps run over the measured time of each phase (on cuda and cpu;
the plan is made for --hardware, so on a GPU unlike that profile the ratio shows the profile's error too).
--backend sim runs the same schedule on the simulated asynchronous GPU (compute mode, on the CPU),
which is how machines without a GPU exercise it. --json writes every figure to a file.

  python scripts/bench_offload.py --model configs/models/llama-3.1-70b --quantization q4_0 --gpu-memory 22GiB
  python scripts/bench_offload.py --smoke     # a tiny model on the simulated GPU (rtx4090-ddr5 without its CUDA
                                              # context reserve, 1 MiB of it), batches 1 and 2: seconds
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from offload.formats import torch_dtype
from offload.engine import run_to_end
from offload.generate import Generator
from offload.hardware import format_bytes
from offload.planner import Placement, PlanRequest, plan_for, plan_spec
from offload.planner.recost import recost_steps
from offload.runtime.backends import make_backend
from offload.runtime.backends.sim import SimBackend
from offload.runtime.executor import PlacedModel
from offload.sampling import SamplingParams
from offload.sequence import Sequence
from offload.weights.model_files import model_spec
from offload.weights.sources import RandomSource

GOAL = 0.8  # streamed decode keeps the link busy this share of wall time, or hides this share of copy time


def run_phase(model, batch: int, prompt_len: int, new_tokens: int, vocab: int, pinned_bps: float, predict) -> dict:
    """Generate new_tokens for batch random prompts, after an untimed run of 2 tokens; return the timeline figures
    of both phases of the timed run, with the plan's prediction for the steps run (predict(steps): seconds per
    phase) over the measured wall time."""
    gen = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, vocab, (prompt_len,), generator=gen).tolist() for _ in range(batch)]
    # an untimed run of the same shapes first: the GPU kernels (Triton's among them) compile at their first call
    warm = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    run_to_end(Generator(model, max_batch_size=batch), [Sequence(i, p, warm) for i, p in enumerate(prompts)])
    model.flush()
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    seqs = [Sequence(i, p, params) for i, p in enumerate(prompts)]
    tl = model.timeline
    tl.clear()
    model.backend.reset_peak()
    run_to_end(Generator(model, max_batch_size=batch), seqs)
    model.flush()
    out = {"peak_device_bytes": model.backend.peak_device_bytes()}
    predicted = predict(tl.steps) if predict else {}
    for phase in ("prefill", "decode"):
        wall, copy_s = tl.phase_time_s[phase], tl.busy_s("pcie", phase)
        achieved = tl.bytes_moved("h2d_copy", phase) / copy_s if copy_s else 0.0
        out[phase] = {
            "tokens_per_s": tl.phase_tokens[phase] / wall if wall else 0.0,
            "pcie_busy_share": copy_s / wall if wall else 0.0,
            "pcie_bps": achieved, "pcie_over_pinned": achieved / pinned_bps if pinned_bps else None,
            "copy_hidden_share": tl.overlap_s("pcie", "gpu", phase) / copy_s if copy_s else None,
            "copy_under_cpu_share": tl.overlap_s("pcie", "cpu", phase) / copy_s if copy_s else None,
            "gpu_wait_s": sum(s.duration_s for s in tl.spans if s.kind == "wait" and s.phase == phase),
            "cpu_share": tl.busy_s("cpu", phase) / wall if wall else 0.0,
            "gpu_share": tl.busy_s("gpu", phase) / wall if wall else 0.0,
            "predicted_over_measured": predicted[phase] / wall if wall and phase in predicted else None,
        }
    return out


def _backend(name: str, request: PlanRequest, gpu_bytes: int):
    if name == "sim":
        return SimBackend(request.profile(), capacity_bytes=gpu_bytes, time_scale=0.0)
    return make_backend(name)


def _line(batch: int, phase: str, f: dict) -> str:
    vs = f" ({f['pcie_over_pinned']:.2f}x of pinned)" if f["pcie_over_pinned"] else ""
    hidden = "-" if f["copy_hidden_share"] is None else f"{f['copy_hidden_share']:.0%}"
    under_cpu = "-" if f["copy_under_cpu_share"] is None else f"{f['copy_under_cpu_share']:.0%}"
    return (f"batch {batch:3d} {phase:7s}: {f['tokens_per_s']:9.2f} tok/s  PCIe busy {f['pcie_busy_share']:4.0%} at "
            f"{f['pcie_bps'] / 1e9:6.2f} GB/s{vs}  copy hidden {hidden} (under CPU {under_cpu})  GPU waited {f['gpu_wait_s'] * 1e3:.1f} ms  "
            f"busy CPU {f['cpu_share']:.0%} / GPU {f['gpu_share']:.0%}  predicted/measured "
            f"{'-' if f['predicted_over_measured'] is None else format(f['predicted_over_measured'], '.2f')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="configs/models/llama-3.1-70b")
    ap.add_argument("--quantization", default="q4_0", choices=["none", "q8_0", "q4_0"])
    ap.add_argument("--gpu-memory", default="22GiB")
    ap.add_argument("--cpu-memory", default=None)
    ap.add_argument("--hardware", default=None, help="profile to plan with (default: calibrated or estimated)")
    ap.add_argument("--backend", default="auto", choices=["auto", "cuda", "cpu", "sim"])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=8)
    ap.add_argument("--batches", default="1,32", help="batch sizes, each run with its own plan; 'auto': the batch "
                    "the planner chooses for --offline-len (prompts of --prompt-len)")
    ap.add_argument("--offline-len", type=int, default=640, help="max_model_len of the 'auto' batch's plan (an "
                    "offline job's prompts plus its new tokens)")
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the simulated GPU, batches 1 and 2: seconds")
    args = ap.parse_args()
    if not args.smoke:
        return bench(args)
    from offload.hardware import load_hardware

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from make_llama import tiny

    with tempfile.TemporaryDirectory(prefix="bench-offload-") as tmp:
        args.model, args.backend, args.gpu_memory = str(tiny(Path(tmp) / "tiny")), "sim", "1MiB"
        args.hardware = load_hardware("rtx4090-ddr5").with_changes(gpu_reserved_bytes=0)  # a GPU budget of a MiB
        args.batches, args.prompt_len, args.decode_tokens, args.offline_len = "1,2", 8, 2, 32
        bench(args)


def bench(args) -> None:
    """Each batch of --batches planned, built and run; --json gets every figure."""
    results = {"model": args.model, "batches": {}}
    for batch in args.batches.split(","):
        auto = batch.strip() == "auto"
        max_len = args.offline_len if auto else args.prompt_len + args.decode_tokens + 1
        request = PlanRequest.of(model=str(args.model), quantization=args.quantization, dtype="auto",
                                 hardware=args.hardware, gpu_memory=args.gpu_memory, cpu_memory=args.cpu_memory,
                                 batch_size=None if auto else int(batch), max_model_len=max_len,
                                 max_tokens=max_len - args.prompt_len if auto else args.decode_tokens + 1,
                                 backend="cuda" if args.backend == "cuda" else "auto")
        r, plan = run_batch(request, args)
        results["batches"][str(plan.workload.batch_size) + (" (auto)" if auto else "")] = r
        results.setdefault("backend", r["backend"])
        results.setdefault("measured_pinned_bps", r["measured_pinned_bps"])
        results["build_s"] = results.get("build_s", 0.0) + r["build_s"]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def run_batch(request: PlanRequest, args) -> tuple[dict, object]:
    """Plan request, build its model with random weights, run its batch; every figure of the run."""
    spec = model_spec(Path(args.model))
    hardware = request.profile()
    plan = plan_for(spec, hardware, request)
    spec = plan_spec(spec, plan)
    batch = plan.workload.batch_size
    backend = _backend(args.backend, request, plan.budget.gpu_bytes)
    pinned_bps = hardware.h2d_pinned_bps
    if backend.name == "cuda":
        pinned_bps, pageable_bps = backend.measure_h2d_bps()
        print(f"measured H2D: pinned {pinned_bps / 1e9:.1f} GB/s, pageable {pageable_bps / 1e9:.1f} GB/s")
    dtype = torch_dtype(plan.workload.compute_format)
    print(f"batch {batch}: {plan.summary_line}, depth {plan.prefetch_depth}, "
          f"{sum(u.kv_tier == 'cpu' and u.decode != 'cpu' for u in plan.units)} GPU layers with KV in host RAM")
    start = time.perf_counter()
    model = PlacedModel(spec, RandomSource(spec, dtype, args.quantization), Placement.from_plan(plan), backend, dtype)
    build_s = time.perf_counter() - start
    print(f"built and placed random {args.quantization} weights in {build_s:.1f} s; backend {backend.name}")
    budget = plan.tier("gpu").budget_bytes
    prompt_len = args.prompt_len if batch == 1 or request.schedule.batch_size is None else 16
    r = run_phase(model, batch, prompt_len, args.decode_tokens, spec.vocab_size, pinned_bps,
                  None if backend.name == "sim" else lambda shapes: recost_steps(spec, hardware, plan, shapes))
    r.update(backend=backend.name, plan=plan.summary_line, build_s=build_s, measured_pinned_bps=pinned_bps,
             gpu_budget_bytes=budget, prefetch_depth=plan.prefetch_depth)
    for phase in ("prefill", "decode"):
        print(_line(batch, phase, r[phase]))
    peak = r["peak_device_bytes"]
    r["peak_within_budget"] = peak <= budget
    dec = r["decode"]
    r["decode_link_goal_met"] = dec["pcie_busy_share"] >= GOAL or (dec["copy_hidden_share"] or 0) >= GOAL
    print(f"batch {batch:3d} peak device memory {format_bytes(peak)} of budget {format_bytes(budget)} "
          f"({'within' if peak <= budget else 'OVER'})")
    model.close()
    return r, plan


if __name__ == "__main__":
    main()

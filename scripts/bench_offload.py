"""Offloaded inference of a model built from a config.json with random weights in memory (no files).

Plans the model for a GPU budget, runs it through the executor, and prints prefill and decode tokens/s,
achieved PCIe bandwidth against the measured pinned bandwidth, the share of copy time hidden under GPU
compute, and peak device memory against the budget. With --backend cpu it runs the same schedule on the
CPU (the "GPU" then being simulated), which is how CI-sized machines exercise it.

  python scripts/bench_offload.py --model configs/models/llama-3.1-70b --quantization q4_0 --gpu-memory 22GiB
"""

from __future__ import annotations

import argparse
import time

import torch

from offload.generate import Generator, Sequence
from offload.hardware import format_bytes
from offload.weights.sources import RandomSource
from offload.formats import torch_dtype
from offload.planner import PlanRequest, plan_for
from offload.runtime.executor import PlacedModel
from offload.planner.placement import Placement
from offload.runtime.backends import make_backend
from offload.sampling import SamplingParams
from offload.spec import load_spec


def run_phase(model, batch: int, prompt_len: int, new_tokens: int, vocab: int) -> dict:
    """Generate new_tokens for batch random prompts; return the timeline figures of both phases."""
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    seqs = [Sequence(i, torch.randint(0, vocab, (prompt_len,), generator=gen).tolist(), params) for i in range(batch)]
    tl = model.timeline
    tl.clear()
    model.backend.reset_peak()
    Generator(model, max_batch_size=batch).run(seqs)
    out = {"peak_device_bytes": model.backend.peak_device_bytes()}
    for phase in ("prefill", "decode"):
        wall = tl.phase_time_s[phase]
        copy_s = tl.busy_s("pcie", phase)
        out[phase] = {
            "tokens_per_s": tl.phase_tokens[phase] / wall if wall else 0.0,
            "pcie_bps": tl.bytes_moved("h2d_copy", phase) / copy_s if copy_s else 0.0,
            "hidden_share": tl.overlap_s("pcie", "gpu", phase) / copy_s if copy_s else 1.0,
            "cpu_share": tl.busy_s("cpu", phase) / wall if wall else 0.0,
            "gpu_share": tl.busy_s("gpu", phase) / wall if wall else 0.0,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="configs/models/llama-3.1-70b")
    ap.add_argument("--quantization", default="q4_0", choices=["none", "q8_0", "q4_0"])
    ap.add_argument("--gpu-memory", default="22GiB")
    ap.add_argument("--cpu-memory", default=None)
    ap.add_argument("--hardware", default=None, help="profile to plan with (default: calibrated or estimated)")
    ap.add_argument("--backend", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=8)
    ap.add_argument("--batches", default="1,32")
    args = ap.parse_args()

    spec = load_spec(args.model)
    backend = make_backend(args.backend)
    if backend.name == "cuda":
        pinned_bps, pageable_bps = backend.measure_h2d_bps()
        print(f"measured H2D: pinned {pinned_bps / 1e9:.1f} GB/s, pageable {pageable_bps / 1e9:.1f} GB/s")
    else:
        pinned_bps = 0.0
    batches = [int(b) for b in args.batches.split(",")]
    request = PlanRequest(str(args.model), args.quantization, "bf16" if backend.name == "cuda" else "fp32",
                          args.hardware, args.gpu_memory, args.cpu_memory, batch_size=max(batches),
                          max_model_len=args.prompt_len + args.decode_tokens + 1, max_tokens=args.decode_tokens + 1)
    hardware = request.profile()
    plan = plan_for(spec, hardware, request)
    dtype = torch_dtype(plan.workload.compute_format)
    print(plan.summary_line)
    start = time.perf_counter()
    model = PlacedModel(spec, RandomSource(spec, dtype, args.quantization), Placement.from_plan(plan), backend, dtype)
    print(f"built and placed random {args.quantization} weights in {time.perf_counter() - start:.1f} s; "
          f"backend {backend.name}")
    budget = plan.tier("gpu").budget_bytes
    for batch in batches:
        r = run_phase(model, batch, args.prompt_len if batch == 1 else 16, args.decode_tokens, spec.vocab_size)
        for phase in ("prefill", "decode"):
            f = r[phase]
            vs = f" ({f['pcie_bps'] / pinned_bps:.2f}x of pinned)" if pinned_bps and f["pcie_bps"] else ""
            print(f"batch {batch:3d} {phase:7s}: {f['tokens_per_s']:9.2f} tok/s  PCIe {f['pcie_bps'] / 1e9:6.2f} GB/s{vs}"
                  f"  copy hidden under compute {f['hidden_share']:.0%}  busy CPU {f['cpu_share']:.0%} / "
                  f"GPU {f['gpu_share']:.0%}")
        peak = r["peak_device_bytes"]
        print(f"batch {batch:3d} peak device memory {format_bytes(peak)} of budget {format_bytes(budget)} "
              f"({'within' if peak <= budget else 'OVER'})")


if __name__ == "__main__":
    main()

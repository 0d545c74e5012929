"""Items 8 and 9: Llama-3.1-70B in q4_0 (random weights in memory) planned for a 22 GiB GPU budget on the profile
this run measured, and run: batch 1, then batch 32 with 512-token prompts. Per step its time and the plan's
prediction for it; per phase predicted / measured; the device's peak (the backend's sampled mem_get_info, a sampler
of the check's own, the allocator's peaks) against the budget, which item 10 reads.

The profile (gpu_check.profile) is built by item 8 and kept in the state folder for item 9. Generation runs the
plan's shape, as `offload simulate` does: the prompts in passes of prefill_pass_tokens, then decode steps of the
whole batch."""

from __future__ import annotations

import json
import tempfile
import time
from collections import Counter
from pathlib import Path

from gpu_check.profile import check_profile
from gpu_check.steps import ROOT

MODEL = ROOT / "configs/models/llama-3.1-70b"
GPU_MEMORY, CPU_MEMORY = "22GiB", "100GiB"  # the H100 machine has 128 GiB of RAM
SMOKE_SHAPE = {"num_hidden_layers": 4, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
               "num_key_value_heads": 2, "vocab_size": 512}
SMOKE_GPU_MEMORY = "1MiB"  # the tiny model's 0.3 MiB resident (the planner puts tinier budgets on the CPU)
RUNS = {1: (512, 8), 32: (512, 8)}  # batch: (prompt tokens, decode tokens)
SMOKE_RUNS = {1: (16, 2), 32: (8, 2)}
SMOKE_BATCH = {1: 1, 32: 4}
WARM_TOKENS = 512  # the warm-up's prompt tokens in all: one 512-row pass compiles the prefill shapes


def batch1(ctx) -> None:
    run_70b(ctx, 1)


def batch32(ctx) -> None:
    run_70b(ctx, 32)


def generate(model, batch: int, prompt_len: int, new_tokens: int, vocab: int, pass_tokens: int) -> None:
    """Random prompts (seeded by batch), the plan's shape: prompts first, then decode steps of the whole batch."""
    import torch

    from offload.engine import run_to_end
    from offload.generate import Generator
    from offload.sampling import SamplingParams
    from offload.sequence import Sequence

    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    seqs = [Sequence(i, torch.randint(0, vocab, (prompt_len,), generator=gen).tolist(), params)
            for i in range(batch)]
    generator = Generator(model, max_batch_size=batch, max_model_len=prompt_len + new_tokens + 1,
                          step_tokens=pass_tokens, mixed=False)
    run_to_end(generator, seqs)


def phase_figures(tl, phase: str, pinned_bps: float, predicted_s: float) -> dict:
    """One phase as measured: tokens/s, the link's use, copies hidden under GPU blocks, the GPU's waits, busy
    shares, and the plan's prediction over the measured time."""
    wall, copy_s = tl.phase_time_s[phase], tl.busy_s("pcie", phase)
    achieved = tl.bytes_moved("h2d_copy", phase) / copy_s if copy_s else 0.0
    return {"measured_s": wall, "predicted_s": predicted_s,
            "predicted_over_measured": predicted_s / wall if wall else None,
            "tokens_per_s": tl.phase_tokens[phase] / wall if wall else 0.0,
            "pcie_busy_share": copy_s / wall if wall else 0.0, "pcie_bps": achieved,
            "pcie_over_pinned": achieved / pinned_bps if pinned_bps else None,
            "copy_hidden_share": tl.overlap_s("pcie", "gpu", phase) / copy_s if copy_s else None,
            "gpu_wait_s": sum(s.duration_s for s in tl.spans if s.kind == "wait" and s.phase == phase),
            "cpu_share": tl.busy_s("cpu", phase) / wall if wall else 0.0,
            "gpu_share": tl.busy_s("gpu", phase) / wall if wall else 0.0}


def model_folder(tmp: Path, smoke: bool) -> Path:
    """The 70B preset's folder, or under --smoke a copy of its config.json at tiny widths."""
    if not smoke:
        return MODEL
    config = {**json.loads((MODEL / "config.json").read_text()), **SMOKE_SHAPE}
    (tmp / "config.json").write_text(json.dumps(config))
    return tmp


def plan_figures(plan) -> dict:
    placed = Counter(f"{u.weight_tier}/{u.decode}" for u in plan.units)
    return {"summary": plan.summary_line, "prefetch_depth": plan.prefetch_depth, "units": dict(placed),
            "gpu_budget_bytes": plan.tier("gpu").budget_bytes, "gpu_planned_bytes": plan.tier("gpu").total_bytes,
            "host_kv_gpu_layers": sum(u.kv_tier == "cpu" and u.decode != "cpu" for u in plan.units)}


def memory_figures(dev, backend, sampler, plan) -> dict:
    peaks = backend.memory_peaks()
    return {"peak_device_bytes": peaks["gpu"], "allocated_peak_bytes": peaks.get("gpu_allocated"),
            "reserved_peak_bytes": peaks.get("gpu_reserved"), "sampled_peak_bytes": sampler.peak_used_bytes,
            "budget_bytes": plan.tier("gpu").budget_bytes, "planned_bytes": plan.tier("gpu").total_bytes,
            "device_total_bytes": dev.mem_get_info()[1]}


def run_70b(ctx, batch: int) -> None:
    prompt_len, decode = (SMOKE_RUNS if ctx.smoke else RUNS)[batch]
    batch = SMOKE_BATCH[batch] if ctx.smoke else batch
    ctx.put("run", {"batch": batch, "prompt_len": prompt_len, "decode_tokens": decode})
    hw = check_profile(ctx)
    with tempfile.TemporaryDirectory(prefix="gpu-check-70b-") as tmp:
        spec, plan = make_plan(ctx, model_folder(Path(tmp), ctx.smoke), hw, batch, prompt_len, decode)
        timed_run(ctx, spec, plan, hw, batch, prompt_len, decode)
    phases = ctx.figures["phases"]
    ctx.summary(**{p: {"tok_s": round(f["tokens_per_s"], 2), "pred/meas": f["predicted_over_measured"] and
                       round(f["predicted_over_measured"], 2)} for p, f in phases.items()},
                peak_gib=round(ctx.figures["memory"]["peak_device_bytes"] / 2**30, 2),
                plan=ctx.figures["plan"]["summary"])


def make_plan(ctx, folder: Path, hw, batch: int, prompt_len: int, decode: int):
    """(spec as the plan splits it, plan) for the run's batch and lengths; no `auto` batch."""
    from offload.planner import PlanRequest, plan_for, plan_spec
    from offload.weights.model_files import model_spec

    request = PlanRequest.of(model=str(folder), quantization="q4_0", dtype="auto", hardware=hw,
                             gpu_memory=SMOKE_GPU_MEMORY if ctx.smoke else GPU_MEMORY,
                             cpu_memory=None if ctx.smoke else CPU_MEMORY, batch_size=batch,
                             max_model_len=prompt_len + decode + 1, max_tokens=decode + 1,
                             backend="auto" if ctx.smoke else "cuda")
    spec = model_spec(folder)
    plan = plan_for(spec, hw, request)
    ctx.put("plan", plan_figures(plan))
    return plan_spec(spec, plan), plan


def timed_run(ctx, spec, plan, hw, batch: int, prompt_len: int, decode: int) -> None:
    """Build the plan's model with random weights, warm it up, then time one run of the batch."""
    from offload.formats import torch_dtype
    from offload.planner import Placement
    from offload.planner.recost import recost_steps
    from offload.runtime.backends.memory_sampler import DeviceMemorySampler
    from offload.runtime.executor import PlacedModel
    from offload.weights.sources import RandomSource

    dev = ctx.device
    backend = dev.backend(hw, capacity_bytes=plan.budget.gpu_bytes)
    sampler = DeviceMemorySampler(dev.mem_get_info)  # the check's own, beside the backend's
    sampler.start()
    dtype, placement = torch_dtype(plan.workload.compute_format), Placement.from_plan(plan)
    start = time.perf_counter()
    model = PlacedModel(spec, RandomSource(spec, dtype, "q4_0"), placement, backend, dtype)
    ctx.put("build_s", time.perf_counter() - start)
    try:
        def run(n_prompt: int, n_new: int) -> None:
            generate(model, batch, n_prompt, n_new, spec.vocab_size, placement.prefill_pass_tokens)
            model.flush()

        run(max(min(prompt_len, WARM_TOKENS // batch), 1), 2)  # Triton compiles at first calls: untimed
        model.timeline.clear()
        backend.reset_peak()
        sampler.reset()
        syncs = Counter(backend.strict.syncs) if ctx.smoke else None
        start = time.perf_counter()
        run(prompt_len, decode + 1)
        ctx.put("run_s", time.perf_counter() - start)
        sampler.stop()
        ctx.put("memory", memory_figures(dev, backend, sampler, plan))
        record_steps(ctx, model.timeline, spec, hw, plan, recost_steps)
        if ctx.smoke:  # the strict device's host syncs in the timed run, by unit and kind
            ctx.put("host_syncs", {f"{u} {w}": n for (u, w), n in (Counter(backend.strict.syncs) - syncs).items()})
    finally:
        sampler.stop()
        model.close()


def record_steps(ctx, tl, spec, hw, plan, recost_steps) -> None:
    """Per step: phase, tokens, measured and predicted seconds; per phase: the figures of phase_figures."""
    steps = []
    for shape in tl.steps:
        predicted = recost_steps(spec, hw, plan, [shape])
        steps.append({"phase": shape.phase, "tokens": shape.n_tokens, "seqs": shape.n_seqs,
                      "seconds": shape.seconds, "predicted_s": sum(predicted.values())})
    ctx.put("steps", steps)
    predicted = recost_steps(spec, hw, plan, tl.steps)
    ctx.put("phases", {p: phase_figures(tl, p, hw.h2d_pinned_bps, predicted.get(p, 0.0))
                       for p in ("prefill", "decode")})

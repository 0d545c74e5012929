"""Item 7: the host's cost of a GPU decode layer and of a MoE layer.

Two views. The profile's figures: offload.runtime.host_cost.measure_host_s, as `offload calibrate` measures them
(gpu_layer_host_s, gpu_experts_host_s), and calibrate's launch time. And at the shapes the check's model runs (one
layer of Llama-3.1-70B and of Qwen3-30B-A3B, q4_0, every unit resident): the wall time of the Python inside each
unit's launch() against the unit's device time (its gpu_block span, from CUDA events) at batch 1 and 32, and the
kernels one launch makes (the profiler's launch calls inside the unit's range on CUDA; the strict device's count of
kernel-launching ops here)."""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

from gpu_check.context import one_line
from gpu_check.steps import ROOT

MODELS = {"dense": ("configs/models/llama-3.1-70b", {"num_hidden_layers": 1, "vocab_size": 32000}),
          "moe": ("configs/models/qwen3-30b-a3b", {"num_hidden_layers": 1, "vocab_size": 32000})}
SMOKE_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
               "vocab_size": 512}
SMOKE_MOE = {"head_dim": 16, "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2}
BATCHES, SMOKE_BATCHES = (1, 32), (1, 4)
PROMPT_LEN = 16
DECODE_STEPS, SMOKE_DECODE_STEPS = 16, 4


def host_timed(cls):
    """A subclass of backend class cls that keeps the host's seconds in each launch() (the Python that dispatches
    a unit's kernels), or, while profiling, marks each launch as a profiler range."""

    class HostTimed(cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.host_s: list[tuple[str, str, float]] = []  # (unit, phase, seconds)
            self.profiling = False

        def launch(self, work, fn, x, *args):
            if self.profiling:
                import torch

                with torch.profiler.record_function(f"unit {work.unit} {work.phase}"):
                    return super().launch(work, fn, x, *args)
            start = time.perf_counter()
            out = super().launch(work, fn, x, *args)
            self.host_s.append((work.unit, work.phase, time.perf_counter() - start))
            return out

    return HostTimed


def model_folder(tmp: Path, name: str, smoke: bool) -> Path:
    """A copy of the preset's config.json with one layer (and, under --smoke, tiny widths)."""
    source, changes = MODELS[name]
    config = json.loads((ROOT / source / "config.json").read_text())
    config.update(changes)
    if smoke:
        config.update(SMOKE_SHAPE, **(SMOKE_MOE if name == "moe" else {}))
    folder = tmp / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def generate(model, batch: int, new_tokens: int) -> None:
    from offload.engine import run_to_end
    from offload.generate import Generator
    from offload.sampling import SamplingParams
    from offload.sequence import Sequence

    vocab = model.spec.vocab_size
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    seqs = [Sequence(i, [(7 * i + j) % (vocab - 1) + 1 for j in range(PROMPT_LEN)], params) for i in range(batch)]
    run_to_end(Generator(model, max_batch_size=batch), seqs)


def unit_times(backend, timeline) -> dict:
    """Per unit, decode launches only: median host seconds in launch(), median device seconds of its block."""
    host, device = defaultdict(list), defaultdict(list)
    for unit, phase, seconds in backend.host_s:
        if phase == "decode":
            host[unit].append(seconds)
    for span in timeline.spans:
        if span.kind == "gpu_block" and span.phase == "decode":
            device[span.unit].append(span.duration_s)
    return {u: {"host_s": statistics.median(host[u]),
                "device_s": statistics.median(device[u]) if device[u] else None,
                "launches": len(host[u])} for u in host}


def profiled_launches(model, backend) -> dict:
    """CUDA kernels launched per decode launch of each unit: the profiler's kernel-launch calls (runtime or
    driver API) inside the unit's range, over a 3-token generation at batch 1."""
    from torch.profiler import ProfilerActivity, profile

    backend.profiling = True
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            generate(model, 1, 3)
            model.flush()
    finally:
        backend.profiling = False

    def launches(evt) -> int:
        return sum(("LaunchKernel" in child.name) + launches(child) for child in evt.cpu_children)

    counts = defaultdict(list)
    for evt in prof.events():
        if evt.name.startswith("unit ") and evt.name.endswith(" decode"):
            counts[evt.name.split()[1]].append(launches(evt))
    return {u: statistics.median(c) for u, c in counts.items()}


def measure_model(ctx, folder: Path, batches: tuple[int, ...]) -> dict:
    """One preset's single-layer model, resident, q4_0, bf16: unit times at each batch, and kernels per launch."""
    import torch

    from offload.planner import Placement
    from offload.runtime.executor import PlacedModel
    from offload.weights.model_files import model_spec
    from offload.weights.sources import RandomSource

    spec = model_spec(folder)
    backend = ctx.device.backend(wrap=host_timed)
    model = PlacedModel(spec, RandomSource(spec, torch.bfloat16, "q4_0"), Placement.uniform(spec, "gpu", "gpu"),
                        backend, torch.bfloat16)
    out = {}
    try:
        for batch in batches:
            generate(model, batch, 2)  # Triton's kernels compile at their first call
            model.flush()
            backend.host_s.clear()
            model.timeline.clear()
            before = Counter(backend.strict.launches) if ctx.smoke else None
            generate(model, batch, (SMOKE_DECODE_STEPS if ctx.smoke else DECODE_STEPS) + 1)
            model.flush()
            out[f"batch_{batch}"] = unit_times(backend, model.timeline)
            if ctx.smoke:  # kernel-launching ops per launch, prefill and decode together
                counts = Counter(backend.strict.launches) - before
                n = Counter(u for u, _, _ in backend.host_s)
                out[f"batch_{batch}_kernels_per_launch"] = {u: counts[u] / n[u] for u in n}
        if not ctx.smoke:
            try:
                out["kernels_per_decode_launch"] = profiled_launches(model, backend)
            except Exception as e:  # noqa: BLE001 - the profiler is a view, not the measurement
                out["kernels_per_decode_launch"] = {"skipped": one_line(e)}
    finally:
        model.close()
    return out


def host_cost(ctx) -> None:
    dev = ctx.device
    if ctx.smoke:
        ctx.skip("gpu_launch_s", "measure_launch_s times CUDA launches")
    else:
        from offload.runtime.backends.cuda import measure_launch_s

        ctx.put("gpu_launch_s", measure_launch_s())
    try:
        from offload.runtime.host_cost import measure_host_s
    except ImportError as e:
        ctx.skip("profile", f"offload.runtime.host_cost does not import ({e})")
    else:
        ctx.put("profile", measure_host_s(dev.backend, ctx.log))  # gpu_layer_host_s, gpu_experts_host_s
    with tempfile.TemporaryDirectory(prefix="gpu-check-host-") as tmp:
        for name in MODELS:
            ctx.put(name, measure_model(ctx, model_folder(Path(tmp), name, ctx.smoke),
                                        SMOKE_BATCHES if ctx.smoke else BATCHES))
    us = lambda s: None if s is None else round(s * 1e6)  # noqa: E731
    ctx.summary(**{f"{name} {batch}": {u: [us(t["host_s"]), us(t["device_s"])] for u, t in times.items()
                                       if u.startswith(("layer", "experts"))}
                   for name in MODELS for batch, times in ctx.figures[name].items() if batch.startswith("batch")
                   and not batch.endswith("launch")},
                profile_us={k: us(v) for k, v in ctx.figures["profile"].items()}
                if "skipped" not in ctx.figures["profile"] else None)

"""Do real CPU layers overlap the (simulated) PCIe link? Wall time per decode step, streamed layers set between the
CPU layers (the planner's schedule) against the streamed layers first and the CPU layers after (the old order).

The simulated device's wall mode: the CPU layers compute for real on this machine's cores from real weights
(offload's kernels, the fused C++ layer), while the device's blocks and copies take the cost model's seconds in
real time. The link's bandwidth is set so that one layer's copy takes about what one CPU layer took when measured
alone first; half the layers stream, half compute on the CPU, two staging slots. Both orders run in this process,
alternating (--repeats), and each prints the wall time of a decode step against max(CPU, link) and against their
sum, from the same run's timeline.

  python scripts/make_llama.py --out /tmp/llama-0.8b           # ~0.82 B parameters, 16 layers
  python scripts/bench_overlap.py --model /tmp/llama-0.8b      # q4_0, batch 4, 16 decode steps
  python scripts/bench_overlap.py --smoke                      # a tiny model made here, a few seconds
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from offload.engine import run_to_end  # noqa: E402
from offload.generate import Generator  # noqa: E402
from offload.hardware import load_hardware  # noqa: E402
from offload.planner.placement import Placement, UnitPlacement  # noqa: E402
from offload.runtime.backends.cpu import CPUBackend  # noqa: E402
from offload.runtime.backends.sim import SimBackend, TimedCosts  # noqa: E402
from offload.runtime.executor import PlacedModel  # noqa: E402
from offload.sampling import SamplingParams  # noqa: E402
from offload.sequence import Sequence  # noqa: E402
from offload.spec import load_spec  # noqa: E402
from offload.weights.loader import Checkpoint  # noqa: E402
from offload.weights.sources import CheckpointSource  # noqa: E402

ORDERS = ("interleaved", "in-order")


def placement(spec, order: str) -> Placement:
    """Half the layers streamed, half on the CPU: alternating (interleaved) or streamed first (in-order)."""
    n = spec.n_layers
    streamed = set(range(0, n, 2)) if order == "interleaved" else set(range(n // 2))
    units = {u.name: UnitPlacement("cpu", "cpu", "cpu") for u in spec.units()}
    for i in streamed:
        units[f"layer.{i}"] = UnitPlacement("cpu", "stream", "stream", "gpu")
    return Placement(units, prefetch_depth=2)


def decode(model, prompt_len: int, steps: int, batch: int) -> float:
    """Wall seconds of `steps` decode steps of `batch` sequences (two runs of different length, subtracted, so the
    prefill and the pipeline's start are not counted)."""
    def run(n: int) -> float:
        seqs = [Sequence(i, [1 + i] * prompt_len, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
                for i in range(batch)]
        start = time.perf_counter()
        run_to_end(Generator(model, max_batch_size=batch, max_model_len=prompt_len + n + 1, mixed=False), seqs)
        return time.perf_counter() - start

    short = run(2)
    return (run(2 + steps) - short) / steps


def busy_per_step(timeline, kind: str, steps: int) -> float:
    return sum(s.end_s - s.start_s for s in timeline.spans if s.kind == kind and s.phase == "decode") / steps


def cpu_layer_s(spec, source, prompt_len: int, batch: int) -> float:
    """Median seconds of one CPU layer in a decode step, every unit on the CPU backend."""
    model = PlacedModel(spec, source, Placement.uniform(spec, "cpu", "cpu"), CPUBackend())
    decode(model, prompt_len, 4, batch)
    spans = [s.end_s - s.start_s for s in model.timeline.spans
             if s.kind == "cpu_block" and s.phase == "decode" and s.unit.startswith("layer.")]
    return statistics.median(spans)


def bench(folder: Path, quantization: str, steps: int, batch: int, repeats: int, prompt_len: int) -> dict:
    spec = load_spec(folder)
    source = CheckpointSource(Checkpoint(folder), spec, torch.float32, quantization)
    layer_s = cpu_layer_s(spec, source, prompt_len, batch)
    probe = PlacedModel(spec, source, placement(spec, "interleaved"), CPUBackend())
    layer_bytes = probe.layouts["layer.0"].n_bytes
    hw = load_hardware("rtx4090-ddr5")
    hw = hw.with_changes(h2d_pinned_bps=layer_bytes / layer_s, gpu_reserved_bytes=0)
    print(f"{folder.name}: {spec.n_layers} layers, {quantization}, batch {batch}; a CPU layer takes "
          f"{layer_s * 1e3:.2f} ms, so the link is set to {hw.h2d_pinned_bps / 1e9:.2f} GB/s "
          f"({layer_bytes / 2**20:.1f} MiB a layer)")
    results: dict[str, list[tuple[float, float, float]]] = {o: [] for o in ORDERS}
    for _ in range(repeats):
        for order in ORDERS:
            backend = SimBackend(hw, capacity_bytes=1 << 40, timed=TimedCosts(spec, hw, quantization, "fp32"),
                                 wall=True)
            model = PlacedModel(spec, source, placement(spec, order), backend)
            wall = decode(model, prompt_len, steps, batch)
            n_steps = len(model.timeline.step_s["decode"])  # both runs' decode steps
            cpu, link = (busy_per_step(model.timeline, k, n_steps) for k in ("cpu_block", "h2d_copy"))
            results[order].append((wall, cpu, link))
            model.close()
    return results


def report(results: dict) -> None:
    print(f"{'order':12s} {'step':>9s} {'CPU':>9s} {'link':>9s}  step/max  step/sum")
    ratio = {}
    for order, runs in results.items():
        wall, cpu, link = (statistics.median(r[k] for r in runs) for k in range(3))
        ratio[order] = wall
        print(f"{order:12s} {wall * 1e3:7.2f}ms {cpu * 1e3:7.2f}ms {link * 1e3:7.2f}ms  "
              f"{wall / max(cpu, link):8.2f}  {wall / (cpu + link):8.2f}")
    print(f"interleaved is {ratio['in-order'] / ratio['interleaved']:.2f}x the in-order schedule's decode speed "
          f"(medians of {len(next(iter(results.values())))} runs each, alternating)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a Hugging Face Llama folder (scripts/make_llama.py writes one)")
    ap.add_argument("--quantization", default="q4_0")
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per run")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="a tiny model made here, a few steps: seconds")
    args = ap.parse_args(argv)
    if args.smoke:
        sys.path.insert(0, str(ROOT / "tests"))
        from conftest import make_hf_model, save_hf_model

        tmp = Path(tempfile.mkdtemp(prefix="offload-bench-overlap-"))
        folder = save_hf_model(make_hf_model("llama", num_hidden_layers=4, hidden_size=128, intermediate_size=256),
                               tmp / "tiny")
        report(bench(folder, args.quantization, 3, 1, 1, 8))
        return 0
    if not args.model:
        ap.error("--model is required (or --smoke)")
    report(bench(Path(args.model), args.quantization, args.steps, args.batch, args.repeats, args.prompt_len))
    return 0


if __name__ == "__main__":
    sys.exit(main())

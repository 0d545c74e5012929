"""The CPU cost curves and overhead terms the report's predictions rest on, measured by `offload calibrate`.

The planner prices a CPU layer by its matmuls (a FLOP rate that depends on how many activation rows share each
read of the weights), its attention (FLOPs and KV bytes read) and the time a step spends elsewhere (Python, the
executor, sampling). This module measures the matmul curve of offload's own CPU kernels (torch's for float
weights), then runs the real scheduler and executor on random calibration models and fits the rest by
non-negative least squares on relative error. It sits above the generator it drives. Speed probes
(runtime.speedprobe) taken beside each measurement tie it to the machine's speed of that moment: the profile
keeps each format's reference probe, curves and steps measured in a slow or fast moment are scaled to it, and a
job's report scales the whole to the speed it probes.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

from offload.formats import GGUF_BLOCKS, GGUF_TYPES, QUANTIZATIONS, compute_format, format_nbytes, weight_format
from offload.errors import CalibrationError
from offload.hardware import OVERHEAD_TERMS, HardwareProfile
from offload.rate_curves import COMPUTE_BOUND_ROWS, curve_problems, scale_curve
from offload.runtime.speedprobe import (attention_cache, attention_prefill, attention_run, linear_for, machine_speed,
                                        median_time, probe, random_weight, reference_probe)
from offload.runtime.speedprobe import calibration_spec as _calibration_spec

CURVE_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # activation rows the matmul curve is measured at
CPU_COMPUTE = compute_format("auto", False)  # what CPU layers compute in
CURVE_FORMATS = tuple(weight_format(q, CPU_COMPUTE) for q in QUANTIZATIONS)  # each quantization's weights
# GGUF formats read as stored get matmul curves too (the default model is Q4_1; Q4_K_M files are Q4_K and Q6_K);
# their overhead terms are the fused layer's, fitted on CURVE_FORMATS. The others are priced by their kin's curves
# (formats.GGUFType.kin: Q5_K by Q4_K's).
GGUF_CURVE_FORMATS = tuple(t.name for t in GGUF_TYPES if t.calibrated)
# Float weights other than fp32 run where a float compute format is asked for (dtype bf16 on the CPU): torch's
# matmul with activations in that format, measured as such.
FLOAT_CURVE_FORMATS = ("bf16",)
CURVE_BYTES = 96 * 2**20  # weights cycled through per measurement: past the last-level cache, as a model is


def measure_cpu_curve(fmt: str, rows: tuple[int, ...] = CURVE_ROWS, repeats: int = 3,
                      threads: int = 0) -> tuple[tuple[int, float], ...]:
    """FLOP/s of offload's CPU matmul for weights in fmt at each number of activation rows, on `threads` threads
    (0: torch's count): the linears of the calibration model's layer, copied until they hold CURVE_BYTES, run one
    after another as a model's layers do."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        return _measure_curve(fmt, rows, repeats)
    finally:
        torch.set_num_threads(before)


def _measure_curve(fmt: str, rows: tuple[int, ...], repeats: int) -> tuple[tuple[int, float], ...]:
    import torch


    spec = _calibration_spec(1)
    shapes = [t.shape for t in spec.layer_tensors(0) if t.role == "linear"]
    per_layer = format_nbytes(sum(n * k for n, k in shapes), fmt)
    gen = torch.Generator().manual_seed(0)
    mats = []
    for _ in range(max(1, int(CURVE_BYTES // per_layer))):
        for n, k in shapes:
            mats.append(random_weight(fmt, n, k, gen))
    linear, x_dtype = linear_for(fmt)
    curve = []
    n_layers = len(mats) // len(shapes)
    for m in rows:
        xs = {k: torch.randn(m, k, generator=gen).to(x_dtype) for _, k in shapes}
        # past COMPUTE_BOUND_ROWS the weights' read no longer counts: as many layers as make the work of that
        # many rows over all of them (bf16 through torch on a CPU without AVX-512 BF16 took minutes here)
        used = mats[: len(shapes) * max(1, -(-n_layers * COMPUTE_BOUND_ROWS // max(m, COMPUTE_BOUND_ROWS)))]
        flops = sum(2 * m * n * k for n, k in shapes) * (len(used) // len(shapes))

        def run():
            for w, (_, k) in zip(used, shapes * (len(used) // len(shapes))):
                linear(xs[k], w)

        curve.append((m, flops / median_time(run, repeats)))
    return tuple(curve)


def monotone_curve(curve: tuple[tuple[int, float], ...]) -> tuple[tuple[int, float], ...]:
    """The closest curve (least squares in log rate) whose rate never falls as rows grow: pool-adjacent-violators.

    More activation rows per read of the weights never make a matmul kernel slower per FLOP, so a point below one
    at fewer rows is the machine's noise during its measurement (this one's speed swings by tens of percent within
    a minute); pooling it with its neighbours keeps a single slow moment from bending the planner's prices."""
    import math

    blocks: list[list[float]] = []  # [sum of log rates, count]
    for _, rate in curve:
        blocks.append([math.log(rate), 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    rates = [math.exp(total / count) for total, count in blocks for _ in range(int(count))]
    return tuple((rows, rate) for (rows, _), rate in zip(curve, rates))


K_CLASSES = (256, 512, 576, 640, 768, 1024, 1536, 2048, 3072, 4096)  # inner dimensions the K factor is measured at
N_CLASSES = (64, 128, 192, 256, 384, 512, 576, 768, 1024, 2048, 4096)  # outputs the N factor is measured at
SHAPE_ROWS = 128  # activation rows of the shape factors' products: where compute, not the weights' read, bounds
SHAPE_FLOPS = 4e9  # work of one timing of a shape (20-80 ms of the quantized kernels on 2 cores): the copies of
# CURVE_BYTES took 0.2-1 s each, ten minutes of the calibration on an AVX2 machine
K_REFERENCE = 768  # the calibration model's hidden size: the curves' K
N_REFERENCE = 2048  # the outputs the K factor is measured at


def measure_shape_factors(fmt: str, rounds: int = 3) -> tuple[tuple, tuple]:
    """The matmul rate of weights in fmt by inner dimension K (at N_REFERENCE outputs) and by outputs N (at
    K_REFERENCE), each against its reference's rate, on SHAPE_ROWS rows; then both moved so that the calibration
    model's own linears (which the curves are measured on) come out at 1: ((K, factor), ...), ((N, factor), ...).

    A kernel's blocking fits some shapes better than others (a q4_0 linear with 192 outputs ran at 0.75x of one
    with 2048); measured where compute bounds the time, as the factors' errors there are the costly ones. Each
    shape is timed right after its reference, in rounds, and the median ratio kept: this machine's speed drifts
    (timed one after another, three K classes once came out at 0.56 in a slow minute, 1.0-1.1 timed again)."""
    from offload.hardware import shape_efficiency

    block = GGUF_BLOCKS.get(fmt, (1, 0))[0]
    ks = [k for k in K_CLASSES if k % block == 0]
    products = {shape: _shape_product(fmt, *shape) for shape in
                {(N_REFERENCE, k) for k in ks + [K_REFERENCE]} | {(n, K_REFERENCE) for n in N_CLASSES}}
    ratios: dict[tuple[int, int], list[float]] = {shape: [] for shape in products}
    ref = products[(N_REFERENCE, K_REFERENCE)]
    for i in range(rounds + 1):  # the first round warms every product up (page faults, the thread pool)
        for shape, product in products.items():
            ratio = _rate(product) / _rate(ref)
            if i:
                ratios[shape].append(ratio)
    factor = {shape: statistics.median(r) for shape, r in ratios.items()}
    k_factor = tuple((k, factor[(N_REFERENCE, k)]) for k in ks)
    n_factor = tuple((n, factor[(n, K_REFERENCE)]) for n in N_CLASSES)
    shapes = [t.shape for t in _calibration_spec(1).layer_tensors(0) if t.role == "linear"]
    mix = shape_efficiency(k_factor, n_factor, shapes)
    return k_factor, tuple((n, f / mix) for n, f in n_factor)


def _shape_product(fmt: str, n: int, k: int):
    """(run, FLOPs of a run): [SHAPE_ROWS, k] x [n, k]^T with weights in fmt, distinct copies cycled past the
    caches."""
    import torch

    gen = torch.Generator().manual_seed(2)
    copies = max(1, min(int(CURVE_BYTES // format_nbytes(n * k, fmt)), int(SHAPE_FLOPS // (2 * SHAPE_ROWS * n * k))))
    mats = [random_weight(fmt, n, k, gen) for _ in range(min(copies, 8))] * max(1, copies // 8)
    linear, x_dtype = linear_for(fmt)
    x = torch.randn(SHAPE_ROWS, k, generator=gen).to(x_dtype)

    def run():
        for w in mats:
            linear(x, w)

    return run, 2 * SHAPE_ROWS * n * k * len(mats)


def _rate(product) -> float:
    """FLOP/s of one run of a _shape_product."""
    run, flops = product
    t0 = time.perf_counter()
    run()
    return flops / (time.perf_counter() - t0)


class _DistinctRandomSource:
    """RandomSource with its own weights in every layer (shared ones would stay in the caches)."""

    def __new__(cls, spec, dtype, quantization: str):
        from offload.weights.sources import RandomSource

        source = RandomSource(spec, dtype, quantization)
        source._linear = source._random_linear
        return source


ATTENTION_TOKENS = 2048  # a causal prefill of this many tokens measures the fused attention's FLOP rate
KV_READ = (8, 2048)  # decode tokens and each one's context: the rate K and V are read at
KV_READ_BYTES = 160 * 2**20  # the caches the decode measurement cycles through: past the last-level cache


def measure_attention(repeats: int = 5) -> dict[str, float] | None:
    """The fused C++ layer's attention timed alone (kernels.layer.cached_attention) on the calibration model's
    heads: FLOP/s of a causal prefill of ATTENTION_TOKENS (FLOPs as the cost model counts them), and bytes/s of
    K and V read by decode tokens over long contexts (their FLOPs at the prefill rate taken out), the caches of
    several layers cycled as a model's are. None without the C++ layer.

    Measured, not fitted with the overheads: a fitted rate takes up whatever the matmul curves get wrong on the
    fit's small model (one fit put prefill attention at 56 GFLOP/s where it ran at 88)."""
    import torch

    spec = _calibration_spec(1)
    prefill = attention_prefill(spec, ATTENTION_TOKENS)
    if prefill is None:
        return None
    run, flops = prefill
    rate = flops / median_time(run, repeats)
    gen = torch.Generator().manual_seed(4)
    seqs, ctx = KV_READ
    kv_bytes = spec.layer_kv_bytes(seqs, ctx + 1, 4)  # as the cost model counts a decode token's read
    caches = [attention_cache(spec, seqs, ctx + 1, gen) for _ in range(max(2, KV_READ_BYTES // kv_bytes))]
    decode_s = median_time(attention_run(spec, torch.full((seqs, 1), ctx), "decode", caches, gen), repeats) / len(caches)
    reading_s = decode_s - spec.attention_flops(seqs, ctx + 1) / rate
    return {"fused": rate, "kv_read": kv_bytes / max(reading_s, decode_s / 2)}


FIT_MODELS = ((4, 8192), (12, 32768))  # (layers, vocabulary): two of each, so the per-step, per-layer and
# per-logit terms come apart
# (sequences, prompt tokens, new tokens): decode at several batches and contexts, prefill short and long
FIT_RUNS = ((1, 8, 12), (4, 8, 12), (16, 8, 10), (48, 8, 8), (4, 900, 8), (1, 64, 2), (1, 1500, 2), (8, 200, 2))


def measure_steps(spec, fmt: str) -> list:
    """Run FIT_RUNS through the real executor and scheduler on random weights: the steps' shapes and times."""
    import torch

    from offload.engine import run_to_end
    from offload.generate import Generator
    from offload.planner.placement import Placement
    from offload.runtime.backends.cpu import CPUBackend
    from offload.runtime.executor import PlacedModel
    from offload.runtime.threads import ThreadGovernor
    from offload.sampling import SamplingParams
    from offload.sequence import Sequence

    quant = QUANTIZATIONS[CURVE_FORMATS.index(fmt)]
    model = PlacedModel(spec, _DistinctRandomSource(spec, torch.float32, quant), Placement.uniform(spec, "cpu", "cpu"),
                        CPUBackend(), torch.float32)
    model.threads = ThreadGovernor(torch.get_num_threads(), enabled=False)  # no probes: each step as it runs
    gen = torch.Generator().manual_seed(1)
    steps = []
    for n_seqs, prompt_len, new in FIT_RUNS:
        prompts = [torch.randint(0, spec.vocab_size, (prompt_len,), generator=gen).tolist() for _ in range(n_seqs)]
        for warm_up in (True, False):  # the first run pays for allocations and page faults
            seqs = [Sequence(i, p, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
                    for i, p in enumerate(prompts)]
            model.timeline.clear()
            run_to_end(Generator(model, max_batch_size=n_seqs, max_model_len=prompt_len + new + 1), seqs)
        steps += model.timeline.steps
    model.close()
    return steps


def fit_overheads(hw: HardwareProfile, runs: list[tuple[object, str, list, object]], log=print,
                  attention: dict[str, float] | None = None) -> HardwareProfile:
    """hw with the overhead terms and attention rates fitted to measured steps: runs of (spec, fmt, steps, speed),
    speed the machine's speed while they ran against hw's (a speedprobe.MachineSpeed; None: hw's own).

    Each step's measured time less its calibrated matmul time (the plan re-costed with attention and overheads
    left out) is fitted, in relative terms (non-negative least squares), by a step term, a per-layer term per
    path, a per-sequence and a per-logit term, attention FLOPs over a rate per path and KV bytes over a read
    rate; rates given in attention (measure_attention: fused, kv_read) are priced as given, not fitted. Each
    run is priced on hw at its speed (HardwareProfile.at_speed), so the terms come out at hw's.
    (The matmul curves are not rescaled by the fit: the small calibration model's weights fit in the last-level
    cache, a real model's do not.)"""
    import numpy as np

    from offload.planner.costs import cpu_path, path_at, step_phase_attention_flops
    from offload.planner.recost import recost_steps
    from offload.planner.search import plan
    from offload.planner.types import Budget, Workload

    given = attention or {}
    bare = replace(hw, cpu_attention={"fused": given.get("fused", 1e30), "torch": 1e30,
                                      "kv_read": given.get("kv_read", 1e30)}, overhead_s={})
    names = ["step", "layer", "layer_unfused", "sequence", "logit", "token", "attention_fused", "attention_torch",
             "kv_read"]
    fit = [not (name == "attention_fused" and "fused" in given or name == "kv_read" and "kv_read" in given)
           for name in names]  # the columns fitted
    rows, measured, bases = [], [], []
    for spec, fmt, steps, speed in runs:
        memory, compute, attention = speed.ratios if speed is not None else (1.0, 1.0, None)
        attention = attention or compute
        run_hw = bare.at_speed(memory, compute, attention)
        wl = Workload(batch_size=1, prompt_len=64, gen_len=16, compute_format=CPU_COMPUTE)
        p = plan(spec, bare, Budget(0, 64 * 2**30), wl, weight_format=fmt)
        path = cpu_path(fmt, CPU_COMPUTE)
        for shape in steps:
            base = sum(recost_steps(spec, run_hw, p, [shape]).values())
            attn = step_phase_attention_flops(spec, shape)
            kv_bytes = spec.n_layers * 2 * shape.kv_read_tokens * spec.kv_size * 4  # fp32 K and V read once
            runs = path_at(path, shape.n_tokens)  # dense fp32 layers: fused for steps of few tokens
            terms = [1.0, spec.n_layers * (runs == "fused"), spec.n_layers * (runs == "torch"), shape.n_seqs,
                     shape.n_logits * spec.vocab_size, shape.n_tokens * spec.n_layers, attn * (runs == "fused"),
                     attn * (runs == "torch")]
            # as at_speed moves each term: attention's by its speed, the rest by compute's
            rows.append([t / compute for t in terms[:6]] + [t / attention for t in terms[6:]] + [kv_bytes / memory])
            measured.append(shape.seconds)
            bases.append(base)
    a, measured, bases = np.array(rows, dtype=np.float64)[:, fit], np.array(measured), np.array(bases)
    weights = 1.0 / measured  # relative error
    coef = _nnls(a * weights[:, None], (measured - bases) * weights)
    fitted = dict(zip([n for n, f in zip(names, fit) if f], coef))
    err = (bases + a @ coef) / measured
    log(f"overhead fit over {len(measured)} steps: predicted / measured {np.median(err):.2f} median, "
        f"{err.min():.2f}-{err.max():.2f}")
    rates = {p: given[p] if p in given else float(1.0 / fitted[k]) if fitted[k] > 0 else 1e30
             for p, k in (("fused", "attention_fused"), ("torch", "attention_torch"), ("kv_read", "kv_read"))}
    overhead = {k: float(fitted[k]) for k in OVERHEAD_TERMS}
    return replace(hw, cpu_attention=rates, overhead_s=overhead)


def _nnls(a, b, iterations: int = 50):
    """Least squares with every coefficient >= 0: solve, drop the negative ones, solve again."""
    import numpy as np

    active = np.ones(a.shape[1], dtype=bool)
    coef = np.zeros(a.shape[1])
    for _ in range(iterations):
        coef[:] = 0
        if not active.any():
            break
        coef[active] = np.linalg.lstsq(a[:, active], b, rcond=None)[0]
        if (coef >= 0).all():
            break
        active &= coef > 0
    return np.clip(coef, 0, None)


def curve_text(measured, kept) -> str:
    """rows: GFLOP/s of each point, with the measured figure beside a point the monotone fit moved by over 2%."""
    return ", ".join(f"{m}: {k / 1e9:.0f}" + (f" (measured {r / 1e9:.0f})" if abs(k / r - 1) > 0.02 else "")
                     for (m, r), (_, k) in zip(measured, kept))


REFERENCE_ROUNDS = 3  # probes of every format, in turn, that make its reference speed as calibration starts
ATTENTION_ROUNDS = 3  # attention measurements, each moved to the reference speed by the probes around it
ATTENTION_PROBE = "q4_0"  # the format whose probes move attention to the reference speed (compute probes of
# every format track attention's speed alike: correlations 0.82 over four minutes of this project's VM)


def calibrate_cpu_costs(hw: HardwareProfile, log=print) -> HardwareProfile:
    """hw with the CPU matmul curves, attention rates and overhead terms measured on this machine, and the speed
    probes (speedprobe) that tie them to the machine's speed of the moment.

    Every format's reference probe is taken as calibration starts, in rounds over the formats; each measurement
    after it (curves, attention, the fitted steps) is moved to that moment's speed by the probes beside it, so the
    whole profile speaks for one moment, the one a job's probes are set against."""
    formats = CURVE_FORMATS + GGUF_CURVE_FORMATS + FLOAT_CURVE_FORMATS
    references = reference_probes(formats)
    curves, one_thread = {}, {}
    for fmt in formats:
        measured = measure_format_curves(fmt, references[fmt], log)
        curves[fmt] = measured[0]
        if len(measured) > 1:
            one_thread[fmt] = measured[1]
    refuse_contradictions(curve_problems(curves))  # before minutes more of measuring on them
    k_factor, n_factor = {}, {}
    for fmt in formats:
        k_factor[fmt], n_factor[fmt] = measure_shape_factors(fmt)
        log(f"cpu matmul {fmt:5s} by K, against K={K_REFERENCE}: " + ", ".join(f"{k}: {f:.2f}" for k, f in k_factor[fmt]))
        log(f"cpu matmul {fmt:5s} by outputs N, against the calibration layer's: "
            + ", ".join(f"{n}: {f:.2f}" for n, f in n_factor[fmt]))
    hw = replace(hw, cpu_flops_by_rows=curves, cpu_flops_one_thread=one_thread, cpu_k_factor=k_factor,
                 cpu_n_factor=n_factor,
                 cpu_probe=references)
    attention = measure_attention_at_reference(references[ATTENTION_PROBE])
    if attention is not None:
        log(f"cpu attention (fused layer): {attention['fused'] / 1e9:.1f} GFLOP/s on a {ATTENTION_TOKENS}-token "
            f"prompt, K and V read at {attention['kv_read'] / 1e9:.1f} GB/s in decode (at the reference speed)")
    runs = []
    for n_layers, vocab in FIT_MODELS:
        spec = _calibration_spec(n_layers, vocab)
        for fmt in CURVE_FORMATS:
            before = probe(fmt)
            steps = measure_steps(spec, fmt)
            runs.append((spec, fmt, steps, machine_speed([before, probe(fmt)], references[fmt])))
    return fit_overheads(hw, runs, log, attention)


def refuse_contradictions(problems: list[tuple[str, str]], again: bool = False) -> None:
    """CalibrationError naming what contradicts what, where anything does: no profile is saved from such curves."""
    if problems:
        more = f" (and {len(problems) - 2} more)" if len(problems) > 2 else ""
        raise CalibrationError(f"the CPU matmul curves contradict each other{' after measuring again' * again}: "
                               f"{'; '.join(p for _, p in problems[:2])}{more}; the machine's speed moved while they "
                               f"were measured, so no profile was saved: run offload calibrate again when it is idle")


def reference_probes(formats: tuple[str, ...], rounds: int = REFERENCE_ROUNDS) -> dict[str, tuple]:
    """Each format's reference rates (speedprobe): the median of its probes in rounds over all the formats, so that
    every reference speaks for the same moment."""
    probes: dict[str, list] = {fmt: [] for fmt in formats}
    for _ in range(rounds):
        for fmt in formats:
            probes[fmt].append(probe(fmt))
    return {fmt: reference_probe(p) for fmt, p in probes.items()}


def measure_attention_at_reference(reference, rounds: int = ATTENTION_ROUNDS) -> dict[str, float] | None:
    """measure_attention in rounds, each round's rates moved to the reference speed by ATTENTION_PROBE's probes
    before and after it (FLOP/s by their attention speed, or compute where not probed; K/V reads by memory), the
    median of each kept."""
    rates: dict[str, list[float]] = {"fused": [], "kv_read": []}
    for _ in range(rounds):
        before = probe(ATTENTION_PROBE)
        measured = measure_attention(repeats=3)
        if measured is None:
            return None
        speed = machine_speed([before, probe(ATTENTION_PROBE)], reference)
        rates["fused"].append(measured["fused"] / (speed.attention or speed.compute))
        rates["kv_read"].append(measured["kv_read"] / speed.memory)
    return {k: statistics.median(v) for k, v in rates.items()}


CURVE_TRIES = 3  # measurements of a curve at most, where the machine's speed moved under the earlier ones
STEADY = 1.2  # a curve is steady where its probes before and after agree within this, and no rate falls by more
# than this as rows grow (the kernels never slow down per FLOP with more rows: such a fall is the machine's)


def measure_format_curves(fmt: str, reference, log=print) -> list:
    """fmt's matmul curve on torch's threads (and on one thread, where torch runs more), each moved to the
    reference speed (reference_probes) by the probes taken before and after it, so that a curve measured in a
    slow moment is not taken for the machine's speed; each the steadiest of up to CURVE_TRIES (steadiest_curve)."""
    import torch

    curves = []
    for threads in (0, 1) if torch.get_num_threads() > 1 else (0,):  # the thread governor may run steps on one
        unsteady, curve, speed, n_tries = steadiest_curve(fmt, CURVE_ROWS, reference, threads=threads)
        curves.append(monotone_curve(scale_curve(curve, 1 / speed.memory, 1 / speed.compute)))
        log(("  on one thread: " if threads else f"cpu matmul curve {fmt:5s}: ") + curve_text(curve, curves[-1])
            + f" GFLOP/s (scaled {1 / speed.memory:.2f}x at 1 row, {1 / speed.compute:.2f}x from "
            f"{COMPUTE_BOUND_ROWS} rows to the reference speed"
            + (f"; measured {n_tries} times, the machine's speed moving by up to {unsteady:.2f}x" if n_tries > 1
               else "") + ")")
    return curves


def steadiest_curve(fmt: str, rows: tuple[int, ...], reference, threads: int = 0, repeats: int = 3):
    """fmt's curve at rows with the probes before and after it: (how far the machine's speed moved, the curve as
    measured, its MachineSpeed against reference, tries). A curve measured while the speed moved (its probes
    disagree, or its rate falls as rows grow: a slowdown of seconds, by 2-5x on shared VMs, that bent whole
    stretches of a curve beyond what monotone_curve mends) is measured again, up to CURVE_TRIES times, and the
    steadiest kept."""
    tries = []
    for _ in range(CURVE_TRIES):
        probes = [probe(fmt)]
        curve = measure_cpu_curve(fmt, rows, repeats=repeats, threads=threads)
        probes.append(probe(fmt))
        tries.append((unsteadiness(curve, probes), curve, machine_speed(probes, reference)))
        if tries[-1][0] <= STEADY:
            break
    unsteady, curve, speed = min(tries, key=lambda t: t[0])
    return unsteady, curve, speed, len(tries)


def unsteadiness(curve, probes) -> float:
    """How far the machine's speed moved while a curve was measured: the larger of its two probes' disagreement
    (memory or compute rate) and the deepest fall of its rate as rows grow past the first (1: steady). The first
    is left out: torch's fp32 and bf16 matmuls take a matrix-vector path at one row that can outrun the matrix
    product at two."""
    first, last = probes[0], probes[-1]
    moved = max(max(a, b) / min(a, b) for a, b in ((first.memory, last.memory), (first.compute, last.compute)))
    best, fall = 0.0, 1.0
    for _, rate in curve[1:]:
        best = max(best, rate)
        fall = max(fall, best / rate)
    return max(moved, fall)

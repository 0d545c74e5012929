"""A probe of the CPU's speed now, a fraction of a second long, that ties a calibration to the moment of a job.

A shared machine's speed drifts (this project's VMs by ±20% within minutes, by ±10% from one two-second stretch
to the next), so curves measured by `offload calibrate` at one moment are off at another. Calibrate probes each
format as it starts (the profile's cpu_probe, the reference) and next to each measurement, which it moves to the
reference speed; a job probes as it starts, every few seconds between its steps (PROBE_SHARE of its time) and as
it ends, and its report prices each step on the profile moved to the speed interpolated between the probes around
it (HardwareProfile.at_speed). A probe times offload's own CPU matmul for weights in one
format at two rates: bound by memory (one activation row over weights cycled past the last-level cache) and bound
by compute (COMPUTE_BOUND_ROWS rows over one weight held in the caches), and the fused C++ layer's attention over a
short causal prefill (whose speed strays from the matmuls' for seconds at a time: ±13% beside them, correlated over
ten seconds). The random weights, the matmul and the attention are the ones costfit times (random_weight,
linear_for, attention_run on the calibration model).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

from offload.formats import GGUF_BLOCKS, format_nbytes
from offload.hardware import HardwareProfile
from offload.rate_curves import COMPUTE_BOUND_ROWS

PROBE_BYTES = 48 * 2**20  # weights the memory-bound rate streams: past this machine's 32 MiB L3, and no more, as
# a job holds them while it probes (it probes only where its plan leaves room for them: probe_bytes)
PROBE_SHAPE = (2048, 768)  # [N, K] of each weight: the calibration model's MLP projection, at the curves' K
COMPUTE_PASSES = 8  # products per compute-bound timing (about 10 ms of work on this project's 2-core VM)
REPEATS = 5  # timings per rate, after a warm-up; the median counts (a probe takes 0.05-0.15 s here)
PROBE_ATTENTION_TOKENS = 512  # the attention probe's causal prefill (about 7 ms on this project's 2-core VM)
PROBE_SHARE = 0.02  # of a job's time its probes between steps may take
MIN_PROBE_INTERVAL_S = 2.0  # between two probes of a job (a short job is probed as it starts and ends only)
_TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # float weights: torch's matmul
_WEIGHTS: dict[str, object] = {}  # one random PROBE_SHAPE weight per format, packed once per process
_ATTENTION: dict[int, tuple] = {}  # the attention probe's (run, FLOPs) per prompt length, built once per process


@dataclass(frozen=True)
class SpeedProbe:
    """FLOP/s rates of offload's CPU matmul for weights in fmt, and of its attention, measured now."""

    fmt: str
    memory: float  # 1 activation row over PROBE_BYTES of weights read from DRAM
    compute: float  # COMPUTE_BOUND_ROWS rows over one PROBE_SHAPE weight in the caches
    attention: float = 0.0  # the fused layer's causal prefill of PROBE_ATTENTION_TOKENS (0: no C++ layer)
    at_s: float = 0.0  # when it ran (its middle, on time.perf_counter's clock)
    duration_s: float = 0.0


@dataclass(frozen=True)
class MachineSpeed:
    """The CPU's speed during a job against calibration's: the probes' geometric mean over the reference."""

    fmt: str
    memory: float
    compute: float
    n_probes: int
    compute_range: tuple[float, float] | None = None  # the lowest and highest compute speed a probe found
    attention: float | None = None  # None: not probed (the compute speed stands for it)

    def to_dict(self) -> dict:
        d = {"format": self.fmt, "memory": self.memory, "compute": self.compute, "probes": self.n_probes}
        if self.attention is not None:
            d["attention"] = self.attention
        return d if self.compute_range is None else {**d, "compute_range": list(self.compute_range)}

    @property
    def ratios(self) -> tuple[float, float, float | None]:
        """(memory, compute, attention), as HardwareProfile.at_speed takes them."""
        return self.memory, self.compute, self.attention


def probe(fmt: str, threads: int = 0) -> SpeedProbe:
    """Both rates for weights in fmt on `threads` threads (0: torch's count)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        return _probe(fmt)
    finally:
        torch.set_num_threads(before)


def _probe(fmt: str) -> SpeedProbe:
    import torch

    if fmt not in _WEIGHTS:
        _WEIGHTS[fmt] = random_weight(fmt, *PROBE_SHAPE, torch.Generator().manual_seed(0))
    hot = _WEIGHTS[fmt]
    mats = _copies(hot, _n_copies(fmt))
    linear, x_dtype = linear_for(fmt)
    n, k = PROBE_SHAPE
    gen = torch.Generator().manual_seed(0)
    one, many = (torch.randn(m, k, generator=gen).to(x_dtype) for m in (1, COMPUTE_BOUND_ROWS))

    def stream():
        for w in mats:
            linear(one, w)

    def compute():
        for _ in range(COMPUTE_PASSES):
            linear(many, hot)

    start = time.perf_counter()
    memory_rate = 2 * n * k * len(mats) / median_time(stream, REPEATS)
    compute_rate = 2 * COMPUTE_BOUND_ROWS * n * k * COMPUTE_PASSES / median_time(compute, REPEATS)
    attention_rate = _attention_rate()
    end = time.perf_counter()
    return SpeedProbe(fmt, memory_rate, compute_rate, attention_rate, (start + end) / 2, end - start)


def _attention_rate() -> float:
    """FLOP/s of the fused layer's attention over a causal prefill of PROBE_ATTENTION_TOKENS (0.0 without the layer)."""
    if PROBE_ATTENTION_TOKENS not in _ATTENTION:
        _ATTENTION[PROBE_ATTENTION_TOKENS] = attention_prefill(calibration_spec(1), PROBE_ATTENTION_TOKENS)
    built = _ATTENTION[PROBE_ATTENTION_TOKENS]
    if built is None:
        return 0.0
    run, flops = built
    return flops / median_time(run, REPEATS)


def calibration_spec(n_layers: int, vocab: int = 8192):
    """The calibration model: Llama-shaped, with layers large enough that a few of them outgrow the caches."""
    from offload.spec import spec_from_config

    return spec_from_config({"model_type": "llama", "hidden_size": 768, "num_attention_heads": 12,
                             "num_key_value_heads": 4, "intermediate_size": 2048, "num_hidden_layers": n_layers,
                             "vocab_size": vocab, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5},
                            "the calibration model")


def attention_cache(spec, batch: int, max_len: int, gen):
    """A layer's KV cache for spec, filled with random values (real pages, not the shared zero page)."""
    import torch

    from offload.model.step import LayerKV

    kv = LayerKV(batch, spec.n_kv_heads, max_len, spec.head_dim, torch.float32)
    kv.k.normal_(generator=gen), kv.v.normal_(generator=gen)
    return kv


def attention_run(spec, positions, phase: str, caches: list, gen):
    """A call running the fused C++ layer's attention (kernels.layer.cached_attention) of one step at positions
    [sequences, tokens] over each of caches in turn, as a model's layers do."""
    import torch

    from offload.kernels import layer as fused
    from offload.model.step import make_step

    max_len = caches[0].k.shape[1] - 1
    step = make_step(spec, torch.float32, positions, torch.ones_like(positions, dtype=torch.bool), max_len,
                     phase=phase)
    views = [fused.kv_view(kv) for kv in caches]
    tables = [fused.step_table(spec, step, view) for view in views]
    qkv = torch.randn(positions.numel(), spec.q_size + 2 * spec.kv_size, generator=gen)

    def once():
        for table, view in zip(tables, views):
            fused.cached_attention(spec, qkv, table, view)

    return once


def attention_prefill(spec, n_tokens: int):
    """(run, FLOPs as the cost model counts them) of a causal prefill of n_tokens through the fused layer's attention
    on spec's heads; None without the C++ layer."""
    import torch

    from offload.kernels import layer as fused

    if not fused.HAS_CACHED_ATTENTION:
        return None
    gen = torch.Generator().manual_seed(4)
    run = attention_run(spec, torch.arange(n_tokens)[None], "prefill", [attention_cache(spec, 1, n_tokens, gen)], gen)
    return run, spec.attention_flops(n_tokens, round((n_tokens + 1) / 2))


def _n_copies(fmt: str) -> int:
    n, k = PROBE_SHAPE
    return max(2, math.ceil(PROBE_BYTES / format_nbytes(n * k, fmt)))


def probe_bytes(fmt: str) -> int:
    """Bytes a probe of fmt holds while it runs: the cached weight and the copies it streams."""
    n, k = PROBE_SHAPE
    return format_nbytes(n * k, fmt) * (1 + _n_copies(fmt))


def _copies(w, count: int) -> list:
    """count copies of a weight (a tensor, or a kernels.PackedWeight) side by side in one new buffer per tensor:
    as slow to read from DRAM as new weights, far faster to make than packing them, and handed back to the OS in
    one piece when the probe drops them."""
    import torch

    if isinstance(w, torch.Tensor):
        return list(torch.stack([w] * count).unbind(0))
    from offload.kernels import PackedWeight

    qs = torch.stack([w.qs] * count)
    d = None if w.d is None else torch.stack([w.d] * count)
    return [PackedWeight(w.fmt, w.shape, qs[i], None if d is None else d[i], tiled=w.tiled) for i in range(count)]


def median_time(fn, repeats: int) -> float:
    """Median seconds of fn over repeats calls, after one more to warm up."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def linear_for(fmt: str):
    """(the matmul CPU layers run for weights in fmt, the activations' torch dtype): the block math's for float
    weights, with activations in their format; offload's kernels, with fp32 activations, for the others."""
    import torch

    from offload import kernels

    if fmt in _TORCH_DTYPES:  # the block math's own dispatch: torch's matmul, or offload's kernel for a row or two
        from offload.kernels.ops import linear

        return (lambda x, w: linear(x, w, None)), getattr(torch, _TORCH_DTYPES[fmt])
    return kernels.linear, torch.float32


def random_weight(fmt: str, n: int, k: int, gen):
    """A random [n, k] weight in fmt as the kernels take it (GGUF formats: random blocks with small scales)."""
    import torch

    from offload import kernels

    if fmt in GGUF_BLOCKS:
        from offload.kernels.quant import random_gguf_blocks

        return kernels.PackedWeight.from_gguf(random_gguf_blocks(fmt, n, k), fmt, (n, k))
    w = torch.randn(n, k, generator=gen) * k ** -0.5
    return w.to(getattr(torch, _TORCH_DTYPES[fmt])) if fmt in _TORCH_DTYPES else kernels.pack(w, fmt)


def reference_probe(probes: list[SpeedProbe]) -> tuple[float, float, float]:
    """(memory, compute, attention) rates that stand for several probes of one format: the median of each."""
    return (statistics.median(p.memory for p in probes), statistics.median(p.compute for p in probes),
            statistics.median(p.attention for p in probes))


def _ratios(p: SpeedProbe, reference) -> tuple[float, float, float | None]:
    """A probe's (memory, compute, attention) rates over the reference's; attention None where either lacks it."""
    ref_attention = reference[2] if len(reference) > 2 else 0.0
    attention = p.attention / ref_attention if p.attention > 0 and ref_attention > 0 else None
    return p.memory / reference[0], p.compute / reference[1], attention


def _geometric_mean(values, weights=None) -> float:
    weights = weights or [1.0] * len(values)
    return math.exp(sum(w * math.log(v) for w, v in zip(weights, values)) / sum(weights))


def machine_speed(probes: list[SpeedProbe], reference) -> MachineSpeed:
    """The speed probes of one format found against the reference rates calibrate recorded for it: geometric means
    (attention's where every probe and the reference have it)."""
    ratios = [_ratios(p, reference) for p in probes]
    attention = [a for _, _, a in ratios]
    computes = [c for _, c, _ in ratios]
    return MachineSpeed(probes[0].fmt, _geometric_mean([m for m, _, _ in ratios]), _geometric_mean(computes),
                        len(probes), (min(computes), max(computes)),
                        _geometric_mean(attention) if None not in attention else None)


SPEED_SMOOTHING_S = 10.0  # the time scale over which a step's speed is taken from the probes around it


def speed_at(probes: list[SpeedProbe], reference, t: float) -> tuple[float, float, float | None]:
    """(memory, compute, attention) speed at time t against the reference rates: the probes' geometric mean, each
    weighted by exp(-|t - its time| / SPEED_SMOOTHING_S). One probe is a tenth of a second of a speed that moves
    ±10% from one moment to the next: a job of a few seconds takes all its probes alike, a long one those of its
    last half-minute or so, so a drift over minutes is followed and no single probe prices a step alone."""
    nearest = min(abs(t - p.at_s) for p in probes)  # weights relative to the nearest probe's, which is 1
    weights = [math.exp(-(abs(t - p.at_s) - nearest) / SPEED_SMOOTHING_S) for p in probes]
    ratios = [_ratios(p, reference) for p in probes]
    attention = [a for _, _, a in ratios]
    return (_geometric_mean([m for m, _, _ in ratios], weights), _geometric_mean([c for _, c, _ in ratios], weights),
            _geometric_mean(attention, weights) if None not in attention else None)


def probe_due(probes: list[SpeedProbe], now: float) -> bool:
    """Whether a job probed so far by probes (none: a run that is not a job's, not probed) is due another probe
    now: every MIN_PROBE_INTERVAL_S at least, and so rarely that probes take PROBE_SHARE of the time."""
    if not probes:
        return False
    interval = max(MIN_PROBE_INTERVAL_S, statistics.median(p.duration_s for p in probes) / PROBE_SHARE)
    return now - probes[-1].at_s - probes[-1].duration_s / 2 >= interval


def probe_format(spec, plan, hw: HardwareProfile) -> str | None:
    """The format to probe for a plan: the one whose calibrated curves price its CPU layers; None where no unit
    computes on the CPU, hw has no reference probe of that format (a preset, an older calibration), or the plan
    leaves less of the CPU budget free than the probe holds while it runs."""
    from offload.planner.costs import main_format

    if plan is None or not any("cpu" in (u.prefill, u.decode) for u in plan.units):
        return None
    fmt = hw.rated_format(main_format(spec, plan.weight_format))
    if fmt not in hw.cpu_probe or plan.tier("cpu").free_bytes < probe_bytes(fmt):
        return None
    return fmt

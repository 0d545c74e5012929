"""Benchmark offload's CPU kernels against this machine's memory bandwidth and torch's own matmul.

For the linear-layer shapes of SmolLM2-135M, Llama-3.1-8B and Llama-3.1-70B, at each thread count,
prints per format and path: weight bytes per second, that rate over the memory read bandwidth measured
in the same run, and the speedup over torch F.linear on the same shape in fp32 and bf16. Weights are
rotated through copies larger than the last-level cache, as in real decoding, held (for both offload and
torch) as offload holds weights: 2 MiB-aligned buffers advised for transparent huge pages. The GGUF block
formats (q4_1, q4_k, q5_k, q6_k: random blocks with small scales, at shapes whose K is whole blocks) also show
their weight bytes per second against q4_0's at the same shape, threads and path. Then matrix-matrix
throughput at batch 1, 8, 32, 128 and 512 against torch, and as a fraction of the peak rate of the kernel's own
multiply-add instruction (vpdpbusd, vpdpwssd, vpmaddubsw or FMA), measured in the same run. With --vs-dequantized,
each GGUF format's fused kernel against what a type without one runs (slices dequantized to fp32 and multiplied by
torch), at gpt-oss-120b's expert shapes and GEMM_SHAPES, the two timed in turn in the same run. All times are
medians of several runs.

    python scripts/bench_kernels.py            # about 2-3 minutes on 2 cores
    python scripts/bench_kernels.py --models 8b --threads 2 --paths avx2 scalar
    python scripts/bench_kernels.py --formats q4_0 q4_0-rows --no-gemm   # tiled vs GGUF row order
    python scripts/bench_kernels.py --models 8b --formats q4_0 q4_k q6_k --no-gemm   # K-quants vs q4_0
    python scripts/bench_kernels.py --models 135m --formats mxfp4 --no-gemm --vs-dequantized --threads 1 2
    python scripts/bench_kernels.py --smoke    # SmolLM2's shapes, 1 thread, q8_0 q4_0 q4_k mxfp4, short timings: seconds
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import offload.kernels as K
from offload.formats import CPU_KERNELS, GGUF_BLOCKS
from offload.kernels.quant import random_gguf_blocks
from offload.runtime.backends.base import host_empty

SMALL_PAGES = False  # --small-pages: weights on ordinary 4 KiB pages instead of offload's 2 MiB-page buffers
TIME_BUDGET_S = 0.25  # how long median_time_s keeps repeating a call (--smoke: shorter)
PEAK_RUNS, PEAK_ITERS = 5, 2_000_000  # peak_flops: the best of 5 runs of about 0.1 s (--smoke: one of ~0.01 s)


def stored(t: torch.Tensor) -> torch.Tensor:
    """A copy of t in host memory as offload keeps weights (2 MiB-aligned, transparent huge pages)."""
    if SMALL_PAGES:
        return t.clone()
    buf = host_empty(t.nbytes)
    buf.copy_(t.contiguous().view(torch.uint8).reshape(-1))
    return buf.view(t.dtype).view(t.shape)

# (name, [M, K] per linear of one decoder block as (shape, count)); the 70B block is represented by
# its two largest matrices (gate/up and down) to keep the default run short.
MODELS = {
    "smollm2-135m": [((576, 576), 2), ((192, 576), 2), ((1536, 576), 2), ((576, 1536), 1)],
    "llama3.1-8b": [((4096, 4096), 2), ((1024, 4096), 2), ((14336, 4096), 2), ((4096, 14336), 1)],
    "llama3.1-70b": [((28672, 8192), 2), ((8192, 28672), 1)],
}
MODEL_KEYS = {"135m": "smollm2-135m", "8b": "llama3.1-8b", "70b": "llama3.1-70b"}
LM_HEAD = (49152, 576)  # SmolLM2's tied embedding as output layer
GEMM_SHAPES = [(1536, 576), (4096, 4096)]
EXPERT_SHAPES = [(5760, 2880), (2880, 2880)]  # gpt-oss-120b's expert gate_up and down (MXFP4 in its release)
DEQUANT_BATCHES = [1, 4, 32]  # rows an expert gets: a decode token or a few, a prefill chunk's share
OUT_OF_CACHE_BYTES = 160 * 2**20  # rotate copies until this much: well past a 32 MiB L3


def median_time_s(fn, min_reps: int = 5, budget_s: float | None = None) -> float:
    """Median wall time of fn() over at least min_reps calls (more while under budget_s, TIME_BUDGET_S if None)."""
    budget_s = TIME_BUDGET_S if budget_s is None else budget_s
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - start < budget_s and len(times) < 2000):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def read_bandwidth_bps(n_threads: int, nbytes: int = 1 << 30) -> float:
    """Memory read bandwidth: the best of the extension's AVX2 read loop and torch's sum, medians of 7."""
    buf = stored(torch.ones(nbytes, dtype=torch.uint8))  # on the same kind of pages as the weights
    rates = [nbytes / median_time_s(lambda: buf.view(torch.float32).sum(), 7, 0.0)]
    if K._C is not None:
        rates.append(nbytes / median_time_s(lambda: K._C.read_bytes(buf.data_ptr(), nbytes, n_threads), 7, 0.0))
    return max(rates)


class Rotation:
    """Copies of one operand, cycled through so each call reads its weights from DRAM."""

    def __init__(self, make, nbytes: int):
        self.items = [make() for _ in range(max(1, -(-OUT_OF_CACHE_BYTES // max(nbytes, 1))))]
        self.i = 0

    def next(self):
        self.i = (self.i + 1) % len(self.items)
        return self.items[self.i]


def kernel_time_s(w: torch.Tensor, fmt: str, path: str, n: int) -> tuple[float, int]:
    """(median seconds of one [n, K] x [M, K]^T product on path, weight bytes) for packed fmt.

    fmt "q8_0-rows" / "q4_0-rows" keeps GGUF's row block order instead of the tiled order pack() makes.
    """
    fmt, _, order = fmt.partition("-")
    if fmt in GGUF_BLOCKS:  # read from GGUF files, never packed: random blocks
        p = K.PackedWeight.from_gguf(random_gguf_blocks(fmt, *w.shape), fmt, tuple(w.shape))
    else:
        p = K.pack(w, fmt)
    if order == "rows":
        p = p.to_rows()
    rot = Rotation(lambda: K.PackedWeight(fmt, p.shape, stored(p.qs), None if p.d is None else stored(p.d),
                                          tiled=p.tiled), p.nbytes)
    x = torch.randn(n, w.shape[1])
    if fmt == "bf16" and K.BF16_TILES:  # as a bf16 model computes: the AVX-512 BF16 tiles (vdpbf16ps)
        x = x.bfloat16()
    if path == K.ACTIVE_PATH:
        t = median_time_s(lambda: K.linear(x, rot.next()))
    else:
        t = median_time_s(lambda: K.linear_path(x, rot.next(), None, path), 3, 0.1)
    return t, p.nbytes


def torch_time_s(w: torch.Tensor, dtype: torch.dtype, n: int) -> float:
    """Median seconds of torch F.linear on the same shape with weights and activations in dtype."""
    wd = w.to(dtype)
    rot = Rotation(lambda: stored(wd), wd.nbytes)
    x = torch.randn(n, w.shape[1], dtype=dtype)
    return median_time_s(lambda: F.linear(x, rot.next()))


def gemv_rows(shape, count: int, fmts, paths, n_threads: int, bw_bps: float) -> list[dict]:
    """One table row per (format, path) for matrix-vector products of this shape."""
    torch.set_num_threads(n_threads)
    w = torch.randn(shape) * 0.02
    t32, t16 = torch_time_s(w, torch.float32, 1), torch_time_s(w, torch.bfloat16, 1)
    rows = []
    for fmt in fmts:
        if fmt in GGUF_BLOCKS and shape[1] % GGUF_BLOCKS[fmt][0]:
            continue  # K is not whole blocks (GGUF files keep such tensors in another type)
        for path in paths:
            if path == "scalar" and (fmt in ("bf16", "fp16") or fmt in GGUF_BLOCKS) and shape[0] * shape[1] > 2**22:
                continue  # these scalar references are too slow to be worth the wait
            t, nbytes = kernel_time_s(w, fmt, path, 1)
            rows.append(dict(shape=shape, count=count, threads=n_threads, fmt=fmt, path=path, t=t, nbytes=nbytes,
                             gbps=nbytes / t / 1e9, x_bw=nbytes / t / bw_bps, vs_fp32=t32 / t, vs_bf16=t16 / t,
                             t32=t32, t16=t16))
    return rows


def print_gemv(rows: list[dict]) -> None:
    """The table; the GGUF formats add their GB/s over q4_0's at the same shape, threads and path (if measured)."""
    q4_0 = {(r["shape"], r["threads"], r["path"]): r["gbps"] for r in rows if r["fmt"] == "q4_0"}
    print(f"{'shape':>13} {'thr':>3} {'format':>9} {'path':>6} {'us':>9} {'GB/s':>6} {'xBW':>5} "
          f"{'vs fp32':>8} {'vs bf16':>8} {'GB/s vs q4_0':>12}")
    for r in rows:
        base = q4_0.get((r["shape"], r["threads"], r["path"])) if r["fmt"] in GGUF_BLOCKS else None
        print(f"{r['shape'][0]:>6}x{r['shape'][1]:<6} {r['threads']:>3} {r['fmt']:>9} {r['path']:>6} "
              f"{r['t'] * 1e6:9.1f} {r['gbps']:6.1f} {r['x_bw']:5.2f} {r['vs_fp32']:7.2f}x {r['vs_bf16']:7.2f}x"
              + (f" {r['gbps'] / base:11.2f}x" if base else ""))


def print_layer_summary(model: str, rows: list[dict], bw: dict[int, float]) -> None:
    """Whole decoder block (each linear weighted by its count): bytes/s and speedup over torch."""
    keys = sorted({(r["threads"], r["fmt"], r["path"]) for r in rows})
    shapes = {r["shape"] for r in rows}
    for n_threads, fmt, path in keys:
        sel = [r for r in rows if (r["threads"], r["fmt"], r["path"]) == (n_threads, fmt, path)]
        if {r["shape"] for r in sel} != shapes:
            continue  # a format that skipped some of the block's shapes (K not whole blocks)
        t = sum(r["t"] * r["count"] for r in sel)
        nbytes = sum(r["nbytes"] * r["count"] for r in sel)
        t32 = sum(r["t32"] * r["count"] for r in sel)
        t16 = sum(r["t16"] * r["count"] for r in sel)
        print(f"  {model} block, {n_threads} thr, {fmt:>9} {path:>6}: {nbytes / t / 1e9:6.1f} GB/s = "
              f"{nbytes / t / bw[n_threads]:.2f}x read BW; {t32 / t:5.2f}x torch fp32, {t16 / t:5.2f}x torch bf16")


# The multiply-add instruction each format's matrix-matrix kernel is built from, per path (csrc/peak.cpp).
PEAK_KIND = {("avx512", "q4_0"): "vnni_u8", ("avx512", "q8_0"): "vnni_s16", ("avx2", "q4_0"): "avx2_u8",
             ("avx2", "q8_0"): "avx2_s16", ("avx2", "bf16"): "fma32",
             ("avx512", "bf16"): "bf16" if K.BF16_TILES else "fma32",  # bf16 activations (kernel_time_s) take vdpbf16ps
             ("avx512", "fp16"): "fma32", ("avx2", "fp16"): "fma32"}
PEAK_KIND.update({(p, f): ("vnni_s16" if p == "avx512" else "avx2_s16") if f == "q4_1" else
                  ("vnni_u8" if p == "avx512" else "avx2_u8") for p in ("avx2", "avx512") for f in GGUF_BLOCKS if f in CPU_KERNELS})


def peak_flops(kind: str, n_threads: int) -> float:
    """FLOP/s of one multiply-add instruction kind on n_threads threads, best of PEAK_RUNS runs."""
    return max(K._C.peak_flops(kind, PEAK_ITERS, n_threads) for _ in range(PEAK_RUNS))


def gemm_report(shapes, batches, fmts, threads) -> None:
    """Matrix-matrix throughput (GFLOP/s) of the active path against torch fp32 and bf16, and as a fraction of the
    peak of the kernel's own multiply-add instruction, measured in this run."""
    peaks = {(kind, n): peak_flops(kind, n) for kind in {PEAK_KIND.get((K.ACTIVE_PATH, f.partition("-")[0])) for f in fmts} - {None}
             for n in threads} if K.ACTIVE_PATH in ("avx2", "avx512") else {}
    print(f"\n== matrix-matrix (path {K.ACTIVE_PATH}) ==")
    for (kind, n), rate in sorted(peaks.items()):
        print(f"peak of {kind} multiply-adds on {n} thread(s): {rate / 1e9:.0f} GFLOP/s")
    print(f"{'shape':>13} {'batch':>5} {'thr':>3} {'format':>6} {'GFLOP/s':>8} {'x peak':>7} {'vs fp32':>8} "
          f"{'vs bf16':>8}")
    for shape in shapes:
        w = torch.randn(shape) * 0.02
        for n in batches:
            for n_threads in threads:
                torch.set_num_threads(n_threads)
                t32, t16 = torch_time_s(w, torch.float32, n), torch_time_s(w, torch.bfloat16, n)
                flop = 2.0 * n * shape[0] * shape[1]
                print(f"{shape[0]:>6}x{shape[1]:<6} {n:>5} {n_threads:>3} {'torch':>6} {flop / t32 / 1e9:8.1f} "
                      f"{'':>7} {'(fp32)':>8} {flop / t16 / 1e9:7.1f}b")
                for fmt in fmts:
                    if fmt in GGUF_BLOCKS and shape[1] % GGUF_BLOCKS[fmt][0]:
                        continue
                    t, _ = kernel_time_s(w, fmt, K.ACTIVE_PATH, n)
                    peak = peaks.get((PEAK_KIND.get((K.ACTIVE_PATH, fmt.partition("-")[0])), n_threads))
                    frac = f"{flop / t / peak:7.2f}" if peak else f"{'-':>7}"
                    print(f"{shape[0]:>6}x{shape[1]:<6} {n:>5} {n_threads:>3} {fmt:>6} {flop / t / 1e9:8.1f} {frac} "
                          f"{t32 / t:7.2f}x {t16 / t:7.2f}x")


def side_by_side_s(fns, rounds: int = 3) -> list[float]:
    """Median seconds of each of fns, timed in turn for several rounds (so load from elsewhere falls on both)."""
    times = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            times[i].append(median_time_s(fn))
    return [statistics.median(t) for t in times]


def dequant_report(shapes, batches, fmts, threads) -> None:
    """The fused kernel of each GGUF format in fmts against the dequantized path (kernels._linear_dequantized: fp32
    slices of the same weights and torch's matmul), on the active path, out of cache: time ratio dequantized / fused."""
    fused_fmts = [f for f in fmts if f in GGUF_BLOCKS and f in CPU_KERNELS]
    print(f"\n== fused kernel vs dequantized to fp32 (path {K.ACTIVE_PATH}) ==")
    print(f"{'shape':>13} {'batch':>5} {'thr':>3} {'format':>7} {'fused us':>10} {'dequant us':>11} {'speedup':>8}")
    for shape in shapes:
        for fmt in fused_fmts:
            if shape[1] % GGUF_BLOCKS[fmt][0]:
                continue
            p = K.PackedWeight.from_gguf(random_gguf_blocks(fmt, *shape), fmt, shape)
            rot = Rotation(lambda: K.PackedWeight(fmt, p.shape, stored(p.qs), None), p.nbytes)
            for n in batches:
                x, y = torch.randn(n, shape[1]), torch.empty(n, shape[0])
                for n_threads in threads:
                    torch.set_num_threads(n_threads)
                    fused, dequant = side_by_side_s([lambda: K.linear(x, rot.next()),
                                                     lambda: K._linear_dequantized(x, rot.next(), None, y)])
                    print(f"{shape[0]:>6}x{shape[1]:<6} {n:>5} {n_threads:>3} {fmt:>7} {fused * 1e6:10.1f} "
                          f"{dequant * 1e6:11.1f} {dequant / fused:7.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["135m", "8b", "70b"], choices=sorted(MODEL_KEYS))
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--formats", nargs="+", default=list(CPU_KERNELS),
                    choices=list(K.PACKED_FORMATS) + ["q8_0-rows", "q4_0-rows"],
                    help="weight formats (default: those with fused CPU kernels); q8_0-rows / q4_0-rows: GGUF's row block order instead of the tiled one")
    ap.add_argument("--paths", nargs="+", default=[K.ACTIVE_PATH], help="kernel paths (e.g. avx2 scalar numba)")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 128, 512])
    ap.add_argument("--no-gemm", action="store_true", help="skip the matrix-matrix section")
    ap.add_argument("--vs-dequantized", action="store_true",
                    help="time each GGUF format's fused kernel against dequantizing to fp32 and multiplying (the path "
                         "of types without one) at gpt-oss's expert shapes and the matrix-matrix shapes")
    ap.add_argument("--small-pages", action="store_true",
                    help="keep weights (offload's and torch's) on 4 KiB pages instead of 2 MiB transparent huge pages")
    ap.add_argument("--smoke", action="store_true", help="SmolLM2's shapes, 1 thread, three formats, batches 1 and 8, "
                    "short timings in cache: seconds (the figures mean little)")
    args = ap.parse_args()
    global SMALL_PAGES, TIME_BUDGET_S, OUT_OF_CACHE_BYTES, GEMM_SHAPES, PEAK_RUNS, PEAK_ITERS, EXPERT_SHAPES
    global DEQUANT_BATCHES
    SMALL_PAGES = args.small_pages
    bw_bytes = 1 << 30
    if args.smoke:
        args.models, args.threads, args.formats, args.batches = ["135m"], [1], ["q8_0", "q4_0", "q4_k", "mxfp4"], [1, 8]
        TIME_BUDGET_S, OUT_OF_CACHE_BYTES, GEMM_SHAPES, bw_bytes = 0.005, 4 << 20, GEMM_SHAPES[:1], 64 << 20
        PEAK_RUNS, PEAK_ITERS = 1, 200_000
        args.vs_dequantized, EXPERT_SHAPES, DEQUANT_BATCHES = True, [], [1, 8]
    old_threads = torch.get_num_threads()
    print(f"offload kernels: active path {K.ACTIVE_PATH}; CPU features {' '.join(sorted(K.CPU_FEATURES))}")
    bw = {}
    for n_threads in args.threads:
        torch.set_num_threads(n_threads)
        bw[n_threads] = read_bandwidth_bps(n_threads, bw_bytes)
        print(f"memory read bandwidth, {n_threads} thread(s): {bw[n_threads] / 1e9:.1f} GB/s")
    for key in args.models:
        model = MODEL_KEYS[key]
        shapes = MODELS[model] + ([(LM_HEAD, 1)] if key == "135m" else [])
        print(f"\n== matrix-vector (decode), {model} ==")
        rows = [r for n_threads in args.threads for shape, count in shapes
                for r in gemv_rows(shape, count, args.formats, args.paths, n_threads, bw[n_threads])]
        print_gemv(rows)
        print_layer_summary(model, [r for r in rows if r["shape"] != LM_HEAD], bw)
    if not args.no_gemm:
        gemm_report(GEMM_SHAPES, args.batches, [f for f in args.formats if f.partition("-")[0] in ("q8_0", "q4_0", "bf16")],
                    args.threads)
    if args.vs_dequantized:
        dequant_report(EXPERT_SHAPES + GEMM_SHAPES, DEQUANT_BATCHES, args.formats, args.threads)
    torch.set_num_threads(old_threads)


if __name__ == "__main__":
    main()

"""Benchmark the fused Triton dequant kernels against the torch fallback they replace, on a CUDA GPU.

For the linear layers of Llama-3.1-8B and -70B (qkv, o, gate_up and down fused as offload holds them, and
70B's lm_head), in q4_0 and q8_0, row and tiled block order, at decode (1-32 rows of x) and prefill (512
rows) in bf16, prints the fallback's time (dequantize into bf16, then F.linear: what DeviceQuantWeight ran
before) over the fused kernel's time, and the fused kernel's weight bytes per second over the device's copy
bandwidth measured in the same run. Then gemv against gemm at 1..16 rows, to set GEMV_MAX_ROWS. Times are
medians from triton.testing.do_bench, which clears the L2 cache before each run (weights come from HBM, as
in a real step). On a machine without a CUDA GPU and Triton it says so and exits 0.

    python scripts/bench_triton_dequant.py                # about 2-4 minutes on an H200
    python scripts/bench_triton_dequant.py --models 8b --formats q4_0 --rows 1 32 --json out.json
    python scripts/bench_triton_dequant.py --smoke    # 8B's o matrix, q4_0, 1 and 32 rows, no split table: seconds
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from offload.formats import QK, QUANT_QS_BYTES
from offload.kernels import triton_dequant as T
from offload.runtime.device_quant import DeviceQuantWeight

# [M, K] of each linear as offload holds it (qkv and gate_up fused): hidden 4096 / 8192, 32 / 64 query heads
# and 8 kv heads of 128, intermediate 14336 / 28672, vocabulary 128256.
MODELS = {
    "8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
    "70b": {"qkv": (10240, 8192), "o": (8192, 8192), "gate_up": (57344, 8192), "down": (8192, 28672),
            "lm_head": (128256, 8192)},
}
ROWS = (1, 4, 8, 16, 32, 512)  # decode batch sizes, then one 512-token prefill chunk
SPLIT_ROWS = (1, 2, 4, 8, 12, 16)  # where gemv and gemm meet


def random_weight(fmt: str, shape: tuple[int, int], tiled: bool, device) -> DeviceQuantWeight:
    """Random quants and scales made on the device (packing a 70B matrix on the CPU would take minutes)."""
    m, k = shape
    qs = torch.randint(0, 256, (m, k * QUANT_QS_BYTES[fmt] // QK), dtype=torch.uint8, device=device)
    d = torch.empty((m, k // QK), dtype=torch.float16, device=device).uniform_(1e-3, 1e-2)
    return DeviceQuantWeight(fmt, shape, qs.view(torch.int8) if fmt == "q8_0" else qs, d, tiled)


def time_s(fn) -> float:
    """Median seconds of fn() on the GPU, L2 cleared before each run."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") / 1e3


def copy_bandwidth_bps(device, n_bytes: int = 1 << 30) -> float:
    """Device-to-device copy rate (bytes read + written per second): the ceiling a weight-reading kernel meets."""
    src = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * n_bytes / time_s(lambda: dst.copy_(src))


def compare(w: DeviceQuantWeight, n: int) -> dict:
    """Fallback and fused times for n rows of bf16 x, and the largest difference over the output's scale."""
    x = torch.randn(n, w.shape[1], dtype=torch.bfloat16, device=w.qs.device)
    fused, fallback = w.apply(x, None), w.apply_torch(x, None)
    diff = float((fused.float() - fallback.float()).abs().max() / fallback.float().abs().max())
    return {"fallback_s": time_s(lambda: w.apply_torch(x, None)), "fused_s": time_s(lambda: w.apply(x, None)),
            "max_rel_diff": diff}


def bench_linears(models, fmts, rows, device, bw_bps: float, matrices=None) -> list[dict]:
    """One row per (model, matrix, format, order, rows of x); matrices: the names to run (None: all)."""
    out = []
    for model in models:
        for name, shape in MODELS[model].items():
            if matrices is not None and name not in matrices:
                continue
            for fmt in fmts:
                for tiled in (False, True):
                    w = random_weight(fmt, shape, tiled, device)
                    for n in rows:
                        r = {"model": model, "matrix": name, "shape": list(shape), "fmt": fmt,
                             "order": "tiled" if tiled else "rows", "n": n, **compare(w, n)}
                        r["speedup"] = r["fallback_s"] / r["fused_s"]
                        r["fused_bw_share"] = w.nbytes / r["fused_s"] / bw_bps
                        out.append(r)
                        print_row(r)
                    del w
    return out


def print_row(r: dict) -> None:
    print(f"{r['model']:>4} {r['matrix']:>8} {str(r['shape']):>15} {r['fmt']} {r['order']:>5} n={r['n']:<4}"
          f" fallback {r['fallback_s'] * 1e6:9.1f} us  fused {r['fused_s'] * 1e6:8.1f} us"
          f"  speedup {r['speedup']:6.2f}x  weights at {r['fused_bw_share']:5.1%} of copy bandwidth"
          f"  max diff {r['max_rel_diff']:.1e}", flush=True)


def bench_split(fmts, device) -> list[dict]:
    """gemv over gemm time at 1..16 rows on 8B's o and gate_up matrices (ratio < 1: gemv is faster)."""
    out = []
    for fmt in fmts:
        for name in ("o", "gate_up"):
            w = random_weight(fmt, MODELS["8b"][name], True, device)
            for n in SPLIT_ROWS:
                x = torch.randn(n, w.shape[1], dtype=torch.bfloat16, device=device)
                y = torch.empty((n, w.shape[0]), dtype=torch.bfloat16, device=device)
                args = (x, w.qs, w.d, fmt, True, None, y)
                r = {"fmt": fmt, "matrix": name, "n": n, "gemv_s": time_s(lambda: T.gemv(*args)),
                     "gemm_s": time_s(lambda: T.gemm(*args))}
                r["gemv_over_gemm"] = r["gemv_s"] / r["gemm_s"]
                out.append(r)
                print(f"{fmt} {name:>8} n={n:<3} gemv {r['gemv_s'] * 1e6:8.1f} us  gemm {r['gemm_s'] * 1e6:8.1f} us"
                      f"  gemv/gemm {r['gemv_over_gemm']:.2f}", flush=True)
    every = [n for n in SPLIT_ROWS if all(r["gemv_over_gemm"] < 1 for r in out if r["n"] == n)]
    total = {n: sum(r["gemv_s"] for r in out if r["n"] == n) / sum(r["gemm_s"] for r in out if r["n"] == n)
             for n in SPLIT_ROWS}
    print("gemv over gemm, summed over the matrices: " + ", ".join(f"n={n} {t:.2f}" for n, t in total.items()))
    print(f"gemv is faster on every matrix at n = {', '.join(map(str, every)) or 'none'}; "
          f"GEMV_MAX_ROWS is {T.GEMV_MAX_ROWS}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--formats", nargs="+", default=["q4_0", "q8_0"], choices=["q4_0", "q8_0"])
    ap.add_argument("--rows", nargs="+", type=int, default=list(ROWS))
    ap.add_argument("--no-split", action="store_true", help="skip the gemv-against-gemm table")
    ap.add_argument("--json", help="also write every row to this file")
    ap.add_argument("--smoke", action="store_true", help="8B's o matrix in q4_0 at 1 and 32 rows, no split table")
    args = ap.parse_args(argv)
    matrices = None
    if args.smoke:
        args.models, args.formats, args.rows, args.no_split, matrices = ["8b"], ["q4_0"], [1, 32], True, ["o"]
    if not torch.cuda.is_available() or not T.TRITON_AVAILABLE:
        print("bench_triton_dequant needs a CUDA GPU and Triton (found: GPU "
              f"{torch.cuda.is_available()}, Triton {T.TRITON_AVAILABLE}); nothing to measure here")
        return 0
    device = torch.device("cuda")
    bw = copy_bandwidth_bps(device)
    print(f"{torch.cuda.get_device_name(device)}: device copy bandwidth {bw / 1e9:.0f} GB/s")
    result = {"device": torch.cuda.get_device_name(device), "copy_bps": bw,
              "linears": bench_linears(args.models, args.formats, args.rows, device, bw, matrices)}
    if not args.no_split:
        result["split"] = bench_split(args.formats, device)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

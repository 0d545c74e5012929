"""`offload calibrate`: measure this machine (CPU memory bandwidth and matmul rates, disk, and the GPU if any)."""

from __future__ import annotations

import mmap
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from offload.weights.loader import pread_into
from offload.hardware import HardwareProfile, cache_path
from offload.rate_curves import crossover_rows
from offload.system import system_cores, system_memory_bytes
from offload.formats import (FLOAT_FORMATS, GGUF_BLOCKS, GGUF_TYPE, GGUF_TYPES, QK, QUANT_BLOCK_BYTES,
                             WEIGHT_FORMATS)

GPU_CURVE_ROWS = (1, 4, 16, 64, 256, 1024)  # activation rows the GPU matmul curves are measured at
GPU_CURVE_SHAPE = (8192, 8192)  # a layer-sized weight [N, K] (a 70B model's attention projections)
GPU_CURVE_SMALL_SHAPE = (4096, 4096)  # ... where the GPU has under GPU_CURVE_MIN_FREE_BYTES free
GPU_CURVE_MIN_FREE_BYTES = 2 << 30
# The GPU curves stop after this long (the formats left are then priced as rooflines, and logged): Triton compiles
# each format's kernels once (about a second each), the timing itself takes a few seconds in all
GPU_CURVES_BUDGET_S = 40.0


def _best_time(fn, repeats: int) -> float:
    fn()  # warm-up: first-touch page faults, thread-pool start
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_cpu_mem_bps(n_bytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Read bandwidth of all cores: a multi-threaded sum over a buffer far larger than the caches."""
    import torch

    x = torch.ones(n_bytes // 4, dtype=torch.float32)
    return n_bytes / _best_time(lambda: x.sum(), repeats)


def _torch_matmul(fmt: str, m: int, k: int, n: int):
    """A callable computing x[m,k] @ W[n,k]^T with W held in fmt (quantized: dequantized per call)."""
    import torch

    x = torch.randn(m, k)
    if fmt in GGUF_BLOCKS:
        from offload.kernels.quant import dequantize_gguf_np, random_gguf_blocks

        raw = random_gguf_blocks(fmt, n, k)
        return lambda: x @ torch.from_numpy(dequantize_gguf_np(raw, fmt, (n, k))).T
    if fmt in FLOAT_FORMATS:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[fmt]
        w, xd = torch.randn(n, k).to(dtype), x.to(dtype)
        return lambda: xd @ w.T
    scales = torch.rand(n, k // QK, 1, dtype=torch.float16)
    if fmt == "q8_0":
        q = torch.randint(-128, 128, (n, k // QK, QK), dtype=torch.int8)
        return lambda: x @ (q.float() * scales.float()).view(n, k).T
    packed = torch.randint(0, 256, (n, k // QK, QK // 2), dtype=torch.uint8)

    def q4_0():
        nibbles = torch.cat([packed & 0xF, packed >> 4], dim=-1).float() - 8.0
        return x @ (nibbles * scales.float()).view(n, k).T

    return q4_0


def _kernel_matmul(fmt: str, m: int, k: int, n: int):
    """offload's own CPU kernel for fmt, if the kernels package is importable and takes this call; else None.
    GGUF_BLOCKS formats, which offload reads but does not quantize to, get random blocks with small scales."""
    try:
        from offload import kernels
        from offload.kernels.quant import random_gguf_blocks
        pack, linear = kernels.pack, kernels.linear
    except (ImportError, AttributeError):
        return None
    import torch

    x = torch.randn(m, k)
    try:
        if fmt in GGUF_BLOCKS:
            packed = kernels.PackedWeight.from_gguf(random_gguf_blocks(fmt, n, k), fmt, (n, k))
        else:
            packed = pack(torch.randn(n, k), fmt)
        linear(x, packed)
    except Exception:  # noqa: BLE001 - a kernel API that differs from this probe: use the torch estimate
        return None
    return lambda: linear(x, packed)


def measure_cpu_flops(fmt: str, m: int = 32, k: int = 2048, n: int = 2048, repeats: int = 5) -> tuple[float, str]:
    """FLOP/s of a [m,k] x [k,n] product with weights in fmt, and which path ran (kernels or torch)."""
    fn, path = _kernel_matmul(fmt, m, k, n), "offload.kernels"
    if fn is None:
        fn, path = _torch_matmul(fmt, m, k, n), "torch"
    return 2 * m * k * n / _best_time(fn, repeats), path


def gpu_formats() -> tuple[str, ...]:
    """The weight formats a GPU multiplies by, in the order they are timed (the curves stop at a time budget):
    bf16 (cuBLAS; it prices fp16 too), q4_0 and q8_0 (what plans use most), the GGUF block formats with a fused
    Triton kernel, then the other GGUF formats (their dequantize path only: gpu_kernels)."""
    split = tuple(sorted(QUANT_BLOCK_BYTES, key=QUANT_BLOCK_BYTES.get))  # the smaller first: q4_0, q8_0
    fused = tuple(t.name for t in GGUF_TYPES if t.layout == "blocks" and t.triton)
    return ("bf16",) + split + fused + tuple(f for f in GGUF_BLOCKS if f not in fused)


def gpu_kernels(fmt: str) -> tuple[str, ...]:
    """The GPU kernels fmt is timed on: cuBLAS for a float format; the fused Triton kernel and dequantize + cuBLAS
    where a fused kernel takes fmt (offload's q8_0/q4_0, GGUF types with one); else dequantize + cuBLAS."""
    if fmt in FLOAT_FORMATS:
        return ("cublas",)
    if fmt in QUANT_BLOCK_BYTES or GGUF_TYPE[fmt].triton:
        return ("fused", "dequant")
    return ("dequant",)


def gpu_matmul_curves(time_s, formats: tuple[str, ...], shape: tuple[int, int] = GPU_CURVE_SHAPE,
                      rows: tuple[int, ...] = GPU_CURVE_ROWS, budget_s: float = GPU_CURVES_BUDGET_S, log=print,
                      clock=time.perf_counter) -> dict[str, dict[str, tuple[tuple[int, float], ...]]]:
    """{fmt: {kernel: ((rows, FLOP/s), ...)}} (HardwareProfile.gpu_flops_by_rows) from time_s(fmt, kernel, rows):
    seconds of one x [rows, K] @ W.T with W [N, K] = shape in fmt, or None where that kernel does not run here
    (it is then left out). Each format is timed on gpu_kernels(fmt); a kernel that raises is logged and left out
    (the format is then priced by its other kernel, else as a roofline); the formats not started within budget_s
    are left out and named in the log."""
    n, k = shape
    start, out = clock(), {}
    for i, fmt in enumerate(formats):
        if clock() - start > budget_s:
            log(f"gpu matmul curves: {budget_s:.0f} s spent; {', '.join(formats[i:])} not measured (their GPU "
                "blocks are priced as rooflines)")
            break
        curves = {}
        for kernel in gpu_kernels(fmt):
            try:
                times = [(r, time_s(fmt, kernel, r)) for r in rows]
            except Exception as e:  # noqa: BLE001 - one kernel's failure (KernelError, a Triton compile) must not
                # lose the minutes measured so far: the profile is written without its curve
                log(f"gpu matmul {fmt} {kernel}: not measured ({type(e).__name__}: {' '.join(str(e).split())})")
                continue
            if all(t for _, t in times):
                curves[kernel] = tuple((r, 2 * r * n * k / t) for r, t in times)
        if curves:
            out[fmt] = curves
            log(_gpu_curve_text(fmt, curves, shape))
    return out


def _gpu_curve_text(fmt: str, curves: dict, shape: tuple[int, int]) -> str:
    parts = [f"{kernel} " + " ".join(f"{r}:{rate / 1e12:.1f}" for r, rate in curve) for kernel, curve in curves.items()]
    at = crossover_rows(curves)
    pick = "" if "cublas" in curves else (f"; dequantize + cuBLAS from {at} rows" if at else "; fused at every row count")
    return f"gpu matmul {fmt:5s} {shape[0]}x{shape[1]} (rows:TFLOP/s) {' | '.join(parts)}{pick}"


def measure_gpu_curves(free_bytes: int, log=print, timer=None) -> dict:
    """The GPU matmul curves of gpu_formats() on CUDA (timer: backends.cuda.matmul_timer, or a stand-in taking
    the shape), on a layer-sized weight, or a smaller one where little memory is free."""
    if timer is None:
        from offload.runtime.backends.cuda import matmul_timer as timer
    shape = GPU_CURVE_SHAPE if free_bytes >= GPU_CURVE_MIN_FREE_BYTES else GPU_CURVE_SMALL_SHAPE
    return gpu_matmul_curves(timer(shape), gpu_formats(), shape, log=log)


DISK_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # units read out of file order, as a model's layers are stored (safetensors
# sorts tensor names: layer 10 comes before layer 2), so each read starts without the OS's read-ahead


def measure_disk(folder: Path, n_bytes: int = 512 * 2**20, log=print, repeats: int = 3) -> tuple[float, float]:
    """(cold, page cache) read bytes/s of a fresh file in folder, median of repeats.

    Cold: the file's cached pages dropped first (POSIX_FADV_DONTNEED), then read as the disk tier reads units the
    page cache does not keep: 64 MiB units in DISK_ORDER, each in pieces dropped behind (weights.loader.pread_into)
    with what the OS read past it dropped too. Page cache: plain reads of the file once cached. O_DIRECT is timed
    too and logged for comparison. The file is larger than the 128 MiB a drive's own cache commonly holds."""
    folder.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=folder, prefix="offload-calibrate-")
    unit = n_bytes // len(DISK_ORDER)
    try:
        block = os.urandom(8 * 2**20)
        with os.fdopen(fd, "wb") as f:
            for _ in range(n_bytes // len(block)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        buffer = mmap.mmap(-1, unit)  # page-aligned, as O_DIRECT needs

        def read_all(flags: int = 0, cold: bool = True) -> float:
            rfd = os.open(name, os.O_RDONLY | flags)
            try:
                if cold:
                    os.posix_fadvise(rfd, 0, 0, os.POSIX_FADV_DONTNEED)
                t0 = time.perf_counter()
                for k in DISK_ORDER:
                    if flags:
                        os.preadv(rfd, [buffer], k * unit)
                    else:
                        pread_into(rfd, memoryview(buffer), k * unit, drop=cold)
                return n_bytes / (time.perf_counter() - t0)
            finally:
                os.close(rfd)

        direct = None
        if hasattr(os, "O_DIRECT"):
            try:
                direct = read_all(os.O_DIRECT)
            except OSError:
                pass  # a file system without O_DIRECT (tmpfs)
        cold = statistics.median(read_all() for _ in range(repeats))
        read_all(cold=False)
        cached = statistics.median(read_all(cold=False) for _ in range(repeats))
        if direct:
            log(f"disk cold read: {cold / 1e9:.2f} GB/s through the page cache, {direct / 1e9:.2f} GB/s with O_DIRECT "
                f"({'O_DIRECT' if direct > cold else 'the page cache'} is faster)")
        return cold, cached
    finally:
        os.unlink(name)


def calibrate(log=print) -> HardwareProfile:
    """Measure this machine and return its profile (GPU figures only where a CUDA GPU is present)."""
    from offload.runtime.backends.cuda import measure_cuda

    cpu_mem_bps = measure_cpu_mem_bps()
    log(f"cpu memory read bandwidth: {cpu_mem_bps / 1e9:.1f} GB/s")
    cpu_flops, paths = {}, set()
    for fmt in WEIGHT_FORMATS:
        cpu_flops[fmt], path = measure_cpu_flops(fmt)
        paths.add(path)
        log(f"cpu matmul {fmt:5s}: {cpu_flops[fmt] / 1e9:8.1f} GFLOP/s ({path})")
    folder = cache_path().parent
    disk_read_bps, page_cache_bps = measure_disk(folder, log=log)
    log(f"disk read: {disk_read_bps / 1e9:.2f} GB/s cold, {page_cache_bps / 1e9:.2f} GB/s from the page cache")
    gpu = measure_cuda(log) or {}
    if gpu:
        gpu["gpu_flops_by_rows"] = measure_gpu_curves(gpu["vram_bytes"], log)
    profile = HardwareProfile(
        name="calibrated", vram_bytes=gpu.get("vram_bytes", 0), ram_bytes=system_memory_bytes(),
        disk_bytes=shutil.disk_usage(folder).free, n_cores=system_cores(),
        h2d_pinned_bps=gpu.get("h2d_pinned_bps", 0.0), h2d_pageable_bps=gpu.get("h2d_pageable_bps", 0.0),
        gpu_flops=gpu.get("gpu_flops", 0.0), gpu_mem_bps=gpu.get("gpu_mem_bps", 0.0), cpu_mem_bps=cpu_mem_bps,
        gpu_reserved_bytes=gpu.get("gpu_reserved_bytes", 0), host_read_bps=gpu.get("host_read_bps", 0.0),
        cpu_flops=cpu_flops, disk_read_bps=disk_read_bps, page_cache_bps=page_cache_bps, gpu_name=gpu.get("gpu_name", ""),
        gpu_flops_by_rows=gpu.get("gpu_flops_by_rows", {}), gpu_launch_s=gpu.get("gpu_launch_s", 0.0),
        handover_s=gpu.get("handover_s", 0.0), handover_busy_s=gpu.get("handover_busy_s", 0.0),
        gpu_layer_host_s=gpu.get("gpu_layer_host_s", 0.0), gpu_experts_host_s=gpu.get("gpu_experts_host_s", 0.0),
        cpu_name=_cpu_name(), source=f"measured by offload calibrate ({', '.join(sorted(paths))} matmuls)")
    return profile


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""

"""GPU half of `offload calibrate`: the only calibration code that touches torch.cuda."""

from __future__ import annotations

import time


def _timed(fn, repeats: int) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def measure_cuda(log=print, copy_bytes: int = 512 * 2**20, repeats: int = 5) -> dict | None:
    """H2D bandwidth (pinned, pageable), bf16 matmul rate, memory bandwidth and free VRAM; None without CUDA."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        log("no CUDA GPU: GPU figures left at 0")
        return None
    dev = torch.device("cuda")
    pageable = torch.ones(copy_bytes // 4)
    pinned = pageable.pin_memory()
    target = torch.empty(copy_bytes // 4, device=dev)
    out = {"gpu_name": torch.cuda.get_device_name(dev)}
    out["h2d_pinned_bps"] = copy_bytes / _timed(lambda: target.copy_(pinned, non_blocking=True), repeats)
    out["h2d_pageable_bps"] = copy_bytes / _timed(lambda: target.copy_(pageable), repeats)
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    out["gpu_mem_bps"] = 2 * copy_bytes / _timed(lambda: dst.copy_(src), repeats)  # read + write
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    out["gpu_flops"] = 2 * n**3 / _timed(lambda: a @ b, repeats)
    del pinned, target, src, dst, a, b
    torch.cuda.empty_cache()
    out["vram_bytes"] = torch.cuda.mem_get_info(dev)[0]
    log(f"gpu {out['gpu_name']}: H2D pinned {out['h2d_pinned_bps'] / 1e9:.1f} GB/s, "
        f"pageable {out['h2d_pageable_bps'] / 1e9:.1f} GB/s, memory {out['gpu_mem_bps'] / 1e9:.0f} GB/s, "
        f"bf16 matmul {out['gpu_flops'] / 1e12:.0f} TFLOP/s, free {out['vram_bytes'] / 2**30:.1f} GiB")
    return out

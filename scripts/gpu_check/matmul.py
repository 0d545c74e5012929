"""Item 6: the fused Triton dequant-matmul kernels on Llama-3.1-70B's four weight shapes at 1, 8, 32 and 512 rows
of activations, against dequantize + cuBLAS, in q4_0 and q8_0; the bf16 cuBLAS curve and the card's two rooflines
(a bf16 matmul's rate, a device copy's bandwidth). The shapes are timed as `offload calibrate` times its curve
(offload.runtime.calibrate.gpu_matmul_curves over backends.cuda.matmul_timer), so the curves of the [8192, 8192]
shape go into item 8's profile as they are."""

from __future__ import annotations

import math

SHAPES = {"qkv": (10240, 8192), "o": (8192, 8192), "gate_up": (57344, 8192), "down": (8192, 28672)}  # [N, K]
SMOKE_SHAPES = {"qkv": (80, 64), "o": (64, 64), "gate_up": (448, 64), "down": (64, 224)}  # the 70B's / 128
ROWS = (1, 8, 32, 512)
SMOKE_ROWS = (1, 8)
FORMATS = ("q4_0", "q8_0")
CURVE_SHAPE = "o"  # a layer-sized weight, as calibrate's GPU_CURVE_SHAPE: the profile's curves
BYTES_PER_WEIGHT = {"q4_0": 18 / 32, "q8_0": 34 / 32, "bf16": 2.0}  # quants and fp16 scale of a 32-weight block
ROOFLINE_N, SMOKE_ROOFLINE_N = 8192, 64  # the bf16 matmul's side (calibrate's)
COPY_BYTES, SMOKE_COPY_BYTES = 512 << 20, 1 << 20  # the device copy (calibrate's)


def random_device_weight(fmt: str, shape: tuple[int, int], device):
    """A random weight [N, K] on device: a bf16 tensor, or a q8_0/q4_0 DeviceQuantWeight in row block order with
    small positive scales (backends.cuda._random_device_weight, for any device)."""
    import torch

    from offload.runtime.device_quant import DeviceQuantWeight

    n, k = shape
    if fmt == "bf16":
        return torch.randn(n, k, device=device, dtype=torch.bfloat16)
    d = (torch.rand(n, k // 32, device=device) * 0.01).half()
    if fmt == "q8_0":
        return DeviceQuantWeight(fmt, shape, torch.randint(-128, 128, (n, k), dtype=torch.int8, device=device), d)
    return DeviceQuantWeight(fmt, shape, torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device), d)


def sim_timer(dev, shape: tuple[int, int]):
    """matmul_timer's stand-in on the simulated device: "fused" is DeviceQuantWeight.apply, which takes the torch
    fallback there (no Triton without CUDA)."""
    import torch

    held: dict = {}

    def time_s(fmt: str, kernel: str, rows: int) -> float:
        if fmt not in held:
            held.clear()
            held[fmt] = random_device_weight(fmt, shape, dev.torch_device)
        w = held[fmt]
        x = torch.randn(rows, shape[1], device=dev.torch_device, dtype=torch.bfloat16)
        calls = {"cublas": lambda: x @ w.T, "dequant": lambda: w.apply_torch(x, None),
                 "fused": lambda: w.apply(x, None)}
        return dev.seconds_per_call(calls[kernel])

    return time_s


def shape_table(curves: dict, shape: tuple[int, int]) -> dict:
    """{fmt: {kernel: [{rows, seconds, tflops, weight_gbps}]}} from calibrate's curves of FLOP/s by rows."""
    n, k = shape
    table = {}
    for fmt, kernels in curves.items():
        table[fmt] = {kernel: [{"rows": r, "seconds": 2 * r * n * k / rate, "tflops": rate / 1e12,
                                "weight_gbps": n * k * BYTES_PER_WEIGHT[fmt] * rate / (2 * r * n * k) / 1e9}
                               for r, rate in curve] for kernel, curve in kernels.items()}
    return table


def rooflines(dev) -> dict:
    """The bf16 matmul rate (FLOP/s) and the device copy's bandwidth (bytes read + written per second)."""
    import torch

    n = SMOKE_ROOFLINE_N if dev.smoke else ROOFLINE_N
    a = torch.randn(n, n, device=dev.torch_device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev.torch_device, dtype=torch.bfloat16)
    flops = 2 * n**3 / dev.seconds_per_call(lambda: a @ b, calls=3)
    n_bytes = SMOKE_COPY_BYTES if dev.smoke else COPY_BYTES
    src = torch.empty(n_bytes, dtype=torch.uint8, device=dev.torch_device)
    dst = torch.empty_like(src)
    copy_bps = 2 * n_bytes / dev.seconds_per_call(lambda: dst.copy_(src), calls=3)
    return {"gpu_flops": flops, "gpu_mem_bps": copy_bps}


def fused_matmul(ctx) -> None:
    from offload.runtime.calibrate import gpu_matmul_curves

    shapes, rows = (SMOKE_SHAPES, SMOKE_ROWS) if ctx.smoke else (SHAPES, ROWS)
    if ctx.smoke:
        ctx.skip("fused_kernels", "no Triton kernel runs without CUDA: 'fused' is the torch fallback here")
        timer = lambda shape: sim_timer(ctx.device, shape)  # noqa: E731
    else:
        from offload.runtime.backends.cuda import matmul_timer as timer
    ctx.put("rooflines", rooflines(ctx.device))
    for name, shape in shapes.items():
        formats = ("bf16", *FORMATS) if name == CURVE_SHAPE else FORMATS
        logs: list[str] = []
        curves = gpu_matmul_curves(timer(shape), formats, shape, rows=rows, budget_s=math.inf, log=logs.append)
        ctx.put(name, {"shape": list(shape), "by_format": shape_table(curves, shape),
                       "not_measured": [line for line in logs if "not measured" in line]})
        if name == CURVE_SHAPE:
            ctx.put("profile_curves", curves)  # HardwareProfile.gpu_flops_by_rows, as calibrate writes it
    headline = {}
    for name in shapes:
        q4 = ctx.figures[name]["by_format"].get("q4_0", {})
        if "fused" in q4 and "dequant" in q4:  # fused over dequantize + cuBLAS time, by rows; fused GB/s at 1 row
            headline[name] = {"fused/dequant": [round(f["seconds"] / d["seconds"], 2)
                                                for f, d in zip(q4["fused"], q4["dequant"])],
                              "fused_gbps_1_row": round(q4["fused"][0]["weight_gbps"])}
    ctx.summary(q4_0=headline, bf16_tflops=round(ctx.figures["rooflines"]["gpu_flops"] / 1e12, 1),
                copy_gbps=round(ctx.figures["rooflines"]["gpu_mem_bps"] / 1e9))
    missing = [line for name in shapes for line in ctx.figures[name]["not_measured"]]
    if missing:
        raise RuntimeError(f"{len(missing)} kernel curves not measured: {missing[0]}")

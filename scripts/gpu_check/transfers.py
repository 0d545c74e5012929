"""Items 4 and 5: what crosses the host-device link. Item 4: host->device copies through offload's own path (a
buffer from host_empty page-locked by the backend's pin(), then the backend's copy_h2d on its copy stream), pinned
and pageable, alone and beside a CPU thread reading host memory; the combined host read rate calibrate measures.
Item 5: a hand-over's round trip (a token's hidden state to the device, a block, back), idle and while a weight
copy runs: calibrate's measure_handover_s, and the same through the backend as the executor makes it."""

from __future__ import annotations

import statistics
import threading
import time

COPY_BYTES, SMOKE_COPY_BYTES = 1 << 30, 4 << 20
PINNED_COPIES, PAGEABLE_COPIES = 8, 4
READER_S, SMOKE_READER_S = 2.0, 0.2  # seconds of the reader beside the copies (and of the reader alone)
HIDDEN = 8192  # Llama-70B's hidden size: a decode token's hand-over is 16 KiB in bf16
WEIGHT_COPY_BYTES, SMOKE_WEIGHT_COPY_BYTES = 256 << 20, 1 << 20  # the copy under which a hand-over is timed
ROUND_TRIPS = 20


def ring_copy(backend, dst, src, unit: str, wait: bool = True):
    """One copy into dst as the executor's staging ring makes it: the copy stream first waits for the compute
    stream's release of dst, and (wait) the compute stream waits for the copy (the strict device refuses less)."""
    backend.wait_done_before_copy(backend.mark_done())
    handle = backend.copy_h2d(dst, src, unit, "decode")
    if wait:
        backend.wait_copy(handle, unit, "decode")
    return handle


def copy_rate(backend, src, dst, n_copies: int) -> dict:
    """n_copies copies src -> dst through copy_h2d: bytes/s by the host's clock (waited for) and by the copy's own
    span on the timeline (CUDA events; simulated time on the simulated device)."""
    backend.synchronize()
    backend.timeline.clear()
    start = time.perf_counter()
    for _ in range(n_copies):
        handle = ring_copy(backend, dst, src, "h2d_probe")
    backend.host_wait(handle)
    wall = time.perf_counter() - start
    backend.synchronize()
    spans = [s.duration_s for s in backend.timeline.spans if s.kind == "h2d_copy"]
    n_bytes = src.numel() * src.element_size()
    return {"copies": n_copies, "bytes": n_bytes, "wall_bps": n_copies * n_bytes / wall,
            "span_bps": n_bytes / statistics.median(spans) if spans and statistics.median(spans) > 0 else None}


def beside_reader(backend, src, dst, seconds: float) -> dict:
    """Copies one after another while a thread sums a host buffer as large (all cores, past the caches); the
    reader alone first. Bytes/s of each, and of both together."""
    import torch

    host = torch.ones(max(src.numel() // 4, 1), dtype=torch.float32)

    def read_for(stop: threading.Event, out: list) -> None:
        while not stop.is_set():
            host.sum()
            out[0] += host.nbytes

    def with_reader(copies: bool) -> tuple[float, float]:
        stop, read = threading.Event(), [0]
        reader = threading.Thread(target=read_for, args=(stop, read))
        copied, start = 0, time.perf_counter()
        reader.start()
        while time.perf_counter() - start < seconds:
            if copies:
                backend.host_wait(ring_copy(backend, dst, src, "h2d_probe"))
                copied += src.numel() * src.element_size()
            else:
                time.sleep(0.01)
        stop.set()
        reader.join()
        elapsed = time.perf_counter() - start
        return read[0] / elapsed, copied / elapsed

    alone, _ = with_reader(False)
    reader_bps, copy_bps = with_reader(True)
    return {"reader_alone_bps": alone, "reader_bps": reader_bps, "copy_bps": copy_bps,
            "together_bps": reader_bps + copy_bps}


def h2d(ctx) -> None:
    import torch

    from offload.runtime.backends.base import host_empty

    dev = ctx.device
    backend = dev.backend()
    n_bytes = SMOKE_COPY_BYTES if ctx.smoke else COPY_BYTES
    host = host_empty(n_bytes).fill_(1)  # faulted in first: the pin times the registration alone
    start = time.perf_counter()
    src = backend.pin(host)
    ctx.put("pin", {"bytes": n_bytes, "seconds": time.perf_counter() - start})
    dst = torch.empty(n_bytes, dtype=torch.uint8, device=dev.torch_device)
    backend.order_after_allocations()
    try:
        ctx.put("pinned", copy_rate(backend, src, dst, PINNED_COPIES))
        ctx.put("pageable", copy_rate(backend, torch.ones(n_bytes, dtype=torch.uint8), dst, PAGEABLE_COPIES))
        ctx.put("beside_reader", beside_reader(backend, src, dst, SMOKE_READER_S if ctx.smoke else READER_S))
        if ctx.smoke:
            ctx.skip("combined_read_bps", "combined_read_bps times CUDA copies (beside_reader runs here)")
        else:
            from offload.runtime.backends.cuda import combined_read_bps

            ctx.put("combined_read_bps", combined_read_bps(src, dst))  # the profile's host_read_bps
    finally:
        backend.close()
    pinned, pageable, side = ctx.figures["pinned"], ctx.figures["pageable"], ctx.figures["beside_reader"]
    ctx.summary(pinned_gbps=round(pinned["wall_bps"] / 1e9, 1), pageable_gbps=round(pageable["wall_bps"] / 1e9, 1),
                beside_reader_gbps=[round(side["copy_bps"] / 1e9, 1), round(side["reader_bps"] / 1e9, 1)],
                reader_alone_gbps=round(side["reader_alone_bps"] / 1e9, 1))


def backend_handover(dev, backend, weight_bytes: int) -> dict:
    """Median seconds of a hand-over round trip through the backend (to_device, a block, to_host), idle and
    while a weight copy of weight_bytes runs on the copy stream."""
    import torch

    from offload.runtime.backends.base import Work, host_empty

    x = torch.randn(1, HIDDEN, dtype=torch.bfloat16)
    weights = backend.pin(host_empty(weight_bytes).fill_(1))
    slot = torch.empty(weight_bytes, dtype=torch.uint8, device=dev.torch_device)
    backend.order_after_allocations()
    work = Work("handover", "layer", "decode", 1)

    def round_trip(under_copy: bool) -> float:
        backend.synchronize()
        copy = ring_copy(backend, slot, weights, "weights", wait=False) if under_copy else None
        start = time.perf_counter()
        with backend.compute_context():
            backend.to_host(backend.launch(work, lambda v: v * 2, backend.to_device(x)))
        seconds = time.perf_counter() - start
        backend.wait_copy(copy)  # the weights are used after the hand-over, as a later unit's would be
        return seconds

    round_trip(True)
    idle = statistics.median(round_trip(False) for _ in range(ROUND_TRIPS))
    busy = statistics.median(round_trip(True) for _ in range(ROUND_TRIPS))
    backend.synchronize()
    return {"idle_s": idle, "under_copy_s": busy, "weight_copy_bytes": weight_bytes}


def handover(ctx) -> None:
    dev = ctx.device
    if ctx.smoke:
        ctx.skip("calibrate", "measure_handover_s times CUDA streams (the backend's hand-over below runs here)")
    else:
        from offload.runtime.backends.cuda import measure_handover_s

        idle, busy = measure_handover_s()  # what the profile's handover_s, handover_busy_s hold
        ctx.put("calibrate", {"idle_s": idle, "under_copy_s": busy})
    backend = dev.backend()
    try:
        ctx.put("backend", backend_handover(dev, backend, SMOKE_WEIGHT_COPY_BYTES if ctx.smoke else WEIGHT_COPY_BYTES))
    finally:
        backend.close()
    us = lambda s: round(s * 1e6, 1)  # noqa: E731
    ctx.summary(**{k: [us(v["idle_s"]), us(v["under_copy_s"])] for k, v in ctx.figures.items()
                   if isinstance(v, dict) and "idle_s" in v})

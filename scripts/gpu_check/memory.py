"""Item 3: device memory after each library a step loads (the CUDA context, cuBLAS, a Triton kernel, SDPA's kernels,
the decode attention kernel), as the driver sees it (mem_get_info) beside the caching allocator's figures; and
item 10: the device's peak during items 8 and 9 against their budget."""

from __future__ import annotations

from gpu_check.context import one_line


def _context(dev) -> None:
    import torch

    torch.ones(1, device=dev.torch_device)


def _cublas(dev) -> None:
    import torch

    x = torch.ones(16, 256, device=dev.torch_device, dtype=torch.bfloat16)
    _ = x @ x.T


def _triton(dev) -> None:
    import torch

    from gpu_check.matmul import random_device_weight

    x = torch.ones(16, 256, device=dev.torch_device, dtype=torch.bfloat16)
    random_device_weight("q4_0", (64, 256), dev.torch_device).apply(x, None)  # fused on CUDA, torch elsewhere


def _sdpa(dev) -> None:
    """The forms a step calls: grouped-query with a bool mask, the group folded into the queries, causal."""
    import torch
    import torch.nn.functional as F

    q = torch.ones(1, 8, 16, 64, device=dev.torch_device, dtype=torch.bfloat16)
    kv = torch.ones(1, 2, 16, 64, device=dev.torch_device, dtype=torch.bfloat16)
    mask = torch.ones(16, 16, dtype=torch.bool).tril().to(dev.torch_device)
    F.scaled_dot_product_attention(q, kv, kv, attn_mask=mask, enable_gqa=True)
    F.scaled_dot_product_attention(q.view(1, 2, 64, 64), kv, kv, attn_mask=mask.repeat(4, 1))
    F.scaled_dot_product_attention(q, q, q, is_causal=True)


def _paged_attention(dev) -> None:
    import torch

    from offload.kernels.attention import KVTable, paged_attention

    pool = torch.ones(64, 2, 64, device=dev.torch_device, dtype=torch.bfloat16)
    q = torch.ones(2, 1, 8, 64, device=dev.torch_device, dtype=torch.bfloat16)
    table = KVTable(torch.tensor([[0, 16], [32, 48]], dtype=torch.int32).to(dev.torch_device),
                    torch.tensor([20, 30], dtype=torch.int32).to(dev.torch_device), 16)
    paged_attention(q, pool, pool, table, scale=0.125, max_length=30)


STAGES = (("cuda_context", _context), ("cublas", _cublas), ("triton_q4_0", _triton), ("sdpa", _sdpa),
          ("paged_attention", _paged_attention))


def snapshot(dev) -> dict:
    """Device bytes in use (driver), the allocator's, and what lies outside the allocator (context, modules)."""
    free, total = dev.mem_get_info()
    alloc = dev.allocator()
    used = total - free
    return {"used_bytes": used, "total_bytes": total, **alloc,
            "outside_allocator_bytes": used - alloc.get("reserved_bytes", 0)}


def library_memory(ctx) -> None:
    dev = ctx.device
    if ctx.smoke:
        ctx.skip("driver", "the simulated device has no driver or context: its used bytes are its backend's tracker")
        dev.backend()  # the tracker mem_get_info reads
    rows, outside = [], 0
    for name, load in STAGES:
        try:
            load(dev)
            dev.synchronize()
        except Exception as e:  # noqa: BLE001 - a library that does not load here is a figure too
            rows.append({"stage": name, "error": one_line(e)})
        else:
            snap = snapshot(dev)
            rows.append({"stage": name, **snap, "outside_added_bytes": snap["outside_allocator_bytes"] - outside})
            outside = snap["outside_allocator_bytes"]
        ctx.put("stages", rows)
    if ctx.smoke:
        ctx.put("context_reserve_bytes", 0)
    else:
        import torch

        from offload.runtime.backends.cuda import context_reserve_bytes

        # the figure a calibrated profile reserves: after the same loads, plus a cuBLAS workspace per stream
        ctx.put("context_reserve_bytes", context_reserve_bytes(torch.device("cuda")))
        torch.cuda.empty_cache()
    free, total = dev.mem_get_info()
    ctx.put("free_bytes", free)
    ctx.put("total_bytes", total)
    ctx.summary(outside_allocator_mib={r["stage"]: round(r["outside_allocator_bytes"] / 2**20)
                                       for r in rows if "error" not in r},
                context_reserve_mib=round(ctx.figures["context_reserve_bytes"] / 2**20))
    failed = [r["stage"] for r in rows if "error" in r]
    if failed:
        raise RuntimeError(f"libraries that did not load: {', '.join(failed)} (see the stages' errors)")


def device_peak(ctx) -> None:
    """Item 10: items 8 and 9's device peaks (the backend's sampled mem_get_info, the check's own sampler, the
    allocator's peaks) against their plans' GPU budget."""
    runs = {}
    for step in ("offload_70b_batch1", "offload_70b_batch32"):
        memory = ctx.earlier(step).get("memory")
        if memory is None:
            ctx.skip(step, f"{step} did not finish: no peak to report")
            continue
        peak = max(memory["peak_device_bytes"], memory.get("sampled_peak_bytes") or 0)
        runs[step] = {**memory, "peak_bytes": peak, "within_budget": peak <= memory["budget_bytes"],
                      "headroom_bytes": memory["budget_bytes"] - peak}
        ctx.put(step, runs[step])
    ctx.summary(**{s: [round(r["peak_bytes"] / 2**30, 2), round(r["budget_bytes"] / 2**30, 2), r["within_budget"]]
                   for s, r in runs.items()})
    if not runs:
        raise RuntimeError("neither 70B run finished: no device peak to check")
    over = [s for s, r in runs.items() if not r["within_budget"]]
    if over:
        raise AssertionError(f"the device's peak passed the GPU budget in {', '.join(over)}")

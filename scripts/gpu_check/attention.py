"""Item 1: which attention path offload's decode and prefill shapes take, and what a call costs.

Decode runs paged_attention (offload.kernels.attention) over a bf16 KV pool through a block table, at
Llama-3.1-70B's heads. A prefill chunk is timed in the forms SDPA can be called with: grouped-query with a bool mask
(what offload called, which only the math path takes), the query-head group folded into the query length with the
mask repeated (what the memory-efficient kernel takes), and a bottom-right causal bias; each form is offered to
every SDPA backend alone (torch.nn.attention.sdpa_kernel) to see which accept it, and SDPA's own choice is read
(torch._fused_sdp_choice). Every output is checked against an fp32 math-path reference."""

from __future__ import annotations

import importlib
import warnings

from gpu_check.context import one_line

HEADS = (64, 8, 128)  # Llama-3.1-70B: query heads, KV heads, head_dim
SMOKE_HEADS = (8, 2, 16)
DECODE = ((1, 520), (32, 520), (32, 4096))  # (sequences, keys): batch 1 and 32 after 512-token prompts; 4k context
SMOKE_DECODE = ((1, 24), (4, 40))
PREFILL = ((512, 512), (512, 4096))  # (queries, keys): a prompt's first 512-token chunk; one after 3.5k cached keys
SMOKE_PREFILL = ((16, 16), (16, 48))
BLOCK_SIZE = 16  # keys per block of the table
BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")
MAX_ERROR = 1e-2  # |out - fp32 reference| / max |reference|: bf16 outputs are within 2^-8 (3.9e-3) of it


def attention(ctx) -> None:
    heads = SMOKE_HEADS if ctx.smoke else HEADS
    ctx.put("heads", {"query": heads[0], "kv": heads[1], "head_dim": heads[2], "dtype": "bf16"})
    try:
        importlib.import_module("offload.kernels.attention")  # the decode kernel's door, which may not be there yet
    except ImportError as e:
        ctx.skip("decode", f"offload.kernels.attention does not import ({e}); decode attention not measured")
    else:
        cases = SMOKE_DECODE if ctx.smoke else DECODE
        ctx.put("decode", [_case(decode_case, ctx.device, heads, b, n) for b, n in cases])
    cases = SMOKE_PREFILL if ctx.smoke else PREFILL
    ctx.put("prefill", [_case(prefill_case, ctx.device, heads, q, n) for q, n in cases])
    cases = (ctx.figures["decode"] if isinstance(ctx.figures["decode"], list) else []) + ctx.figures["prefill"]
    failed = [c["error"] for c in cases if "error" in c]
    decode = [d for d in cases if "batch" in d and "error" not in d]
    prefill = [p for p in cases if "queries" in p and "error" not in p]
    ctx.summary(decode={f"{d['batch']}x{d['keys']}": [d["paths"], round(d["seconds"] * 1e6, 1)] for d in decode},
                prefill={f"{p['queries']}x{p['keys']}": {f: [v["sdpa_choice"], round(v["seconds"] * 1e3, 3)]
                                                         for f, v in p["forms"].items() if "seconds" in v}
                         for p in prefill})
    bad = [f"decode {d['batch']}x{d['keys']}" for d in decode if d["max_error"] > MAX_ERROR] + [
        f"prefill {p['queries']}x{p['keys']} {f}" for p in prefill for f, v in p["forms"].items()
        if v.get("max_error", 0) > MAX_ERROR]
    if failed:
        raise RuntimeError(f"{len(failed)} attention cases raised, the first: {failed[0]}")
    if bad:
        raise AssertionError(f"attention outputs off their fp32 reference by more than {MAX_ERROR} x max|ref|: "
                             f"{', '.join(bad)}")


def _case(measure, dev, heads, *shape) -> dict:
    """measure(dev, heads, *shape), or the error it raised (the other cases still run)."""
    try:
        return measure(dev, heads, *shape)
    except Exception as e:  # noqa: BLE001
        return {"shape": list(shape), "error": one_line(e)}


def _randn(dev, *shape):
    import torch

    return torch.randn(*shape, dtype=torch.bfloat16, device=dev.torch_device)


def _transient_bytes(dev, fn) -> int | None:
    """Bytes one fn() allocates beyond what is held (the allocator's peak; None on the simulated device)."""
    if dev.smoke:
        return None
    import torch

    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - held


def decode_case(dev, heads, batch: int, n_keys: int) -> dict:
    """One decode step's attention: batch sequences of n_keys keys each, contiguous in the pool."""
    import torch

    from offload.kernels.attention import (KVTable, attention_paths, contiguous_table, paged_attention,
                                           paged_attention_torch, reset_attention_paths)

    n_heads, n_kv, head_dim = heads
    torch.manual_seed(batch * n_keys)
    k_pool, v_pool = _randn(dev, batch * n_keys, n_kv, head_dim), _randn(dev, batch * n_keys, n_kv, head_dim)
    q = _randn(dev, batch, 1, n_heads, head_dim)
    host = contiguous_table(torch.arange(batch) * n_keys, torch.full((batch,), n_keys), BLOCK_SIZE)
    table = KVTable(host.slots.to(dev.torch_device), host.lengths.to(dev.torch_device), BLOCK_SIZE)
    scale = head_dim ** -0.5

    def call(**kw):
        return paged_attention(q, k_pool, v_pool, table, scale=scale, max_length=n_keys, **kw)

    reset_attention_paths()
    out = call(out_fp32=True)
    paths = attention_paths()
    ref = paged_attention_torch(q, k_pool, v_pool, table, scale=scale, out_fp32=True)
    error = float((out - ref).abs().max()) / float(ref.abs().max())
    seconds = dev.seconds_per_call(call, calls=20)
    kv_bytes = 2 * batch * n_keys * n_kv * head_dim * 2  # K and V in bf16, each read once
    return {"batch": batch, "keys": n_keys, "paths": paths, "seconds": seconds,
            "kv_read_gbps": kv_bytes / seconds / 1e9, "max_error": error,
            "transient_bytes": _transient_bytes(dev, call)}


def prefill_forms(q, k, v, seen) -> dict:
    """name -> (q, k, v, SDPA keyword arguments, how to turn the output back into [1, H, S, D])."""
    from torch.nn.attention.bias import causal_lower_right

    _, n_heads, n_q, head_dim = q.shape
    n_kv, n_keys = k.shape[1], k.shape[2]
    group = n_heads // n_kv
    folded = q.view(1, n_kv, group * n_q, head_dim)  # heads kv*G .. kv*G+G-1 share KV head kv: [1, Hkv, G*S, D]
    same = lambda o: o  # noqa: E731
    return {
        "gqa_bool_mask": (q, k, v, dict(attn_mask=seen, enable_gqa=True), same),
        "folded_bool_mask": (folded, k, v, dict(attn_mask=seen.repeat(group, 1)),
                             lambda o: o.reshape(1, n_heads, n_q, head_dim)),
        "gqa_causal_lower_right": (q, k, v, dict(attn_mask=causal_lower_right(n_q, n_keys), enable_gqa=True), same),
    }


def prefill_case(dev, heads, n_q: int, n_keys: int) -> dict:
    """A prefill chunk of n_q queries at the end of n_keys keys, in each form."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    n_heads, n_kv, head_dim = heads
    torch.manual_seed(n_q * n_keys)
    q, k, v = _randn(dev, 1, n_heads, n_q, head_dim), _randn(dev, 1, n_kv, n_keys, head_dim), _randn(
        dev, 1, n_kv, n_keys, head_dim)
    # query i sits at position n_keys - n_q + i and sees every key up to its own
    seen = torch.ones(n_q, n_keys, dtype=torch.bool).tril(n_keys - n_q).to(dev.torch_device)
    with sdpa_kernel([SDPBackend.MATH]):
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=seen, enable_gqa=True)
    forms = {}
    for name, (fq, fk, fv, kw, back) in prefill_forms(q, k, v, seen).items():
        forms[name] = prefill_form(dev, fq, fk, fv, kw, back, ref)
    return {"queries": n_q, "keys": n_keys, "forms": forms,
            "flop": 4 * n_heads * n_q * n_keys * head_dim}


def prefill_form(dev, q, k, v, kw: dict, back, ref) -> dict:
    """Which backends take this call, which SDPA picks, its time, its error and what it allocates."""
    import torch.nn.functional as F

    def call():
        return F.scaled_dot_product_attention(q, k, v, **kw)

    out = {"accepted": {b: accepts(call, b) for b in BACKENDS}, "sdpa_choice": sdpa_choice(q, k, v, kw)}
    try:
        result = back(call())
    except Exception as e:  # noqa: BLE001 - a form SDPA refuses outright is a finding, not the item's failure
        out["error"] = f"{type(e).__name__}: {' '.join(str(e).split())}"[:300]
        return out
    out["max_error"] = float((result.float() - ref).abs().max()) / float(ref.abs().max())
    out["seconds"] = dev.seconds_per_call(call, calls=10, repeats=3)
    out["transient_bytes"] = _transient_bytes(dev, call)
    return out


def accepts(call, backend: str) -> str:
    """"ok" where the backend alone runs the call, else why not (SDPA's warning, or the error's first line)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with sdpa_kernel([SDPBackend.__members__[backend]]):
                call()
            return "ok"
        except Exception as e:  # noqa: BLE001 - "No available kernel" (RuntimeError), or a bias that refuses
            reasons = [" ".join(str(w.message).split()) for w in caught]
            return "; ".join(reasons)[:300] or f"{type(e).__name__}: {' '.join(str(e).split())}"[:300]


def sdpa_choice(q, k, v, kw: dict) -> str:
    """The backend SDPA picks for this call with every backend allowed (its private chooser), or why unknown."""
    import torch
    from torch.nn.attention import SDPBackend

    names = {int(value): name for name, value in SDPBackend.__members__.items()}
    try:
        return names.get(int(torch._fused_sdp_choice(q, k, v, **kw)), "unknown")
    except (RuntimeError, TypeError, AttributeError) as e:  # a bias object (causal_lower_right) dispatches itself
        return f"not read ({type(e).__name__})"

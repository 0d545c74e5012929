"""Mixture-of-experts block math (Mixtral, Qwen2-MoE, Qwen3-MoE): the router and the routed experts of one layer,
device-agnostic, weights passed in. The attention part of a MoE layer (with its shared expert) is
offload.model.llama's layer_forward(moe=True), which hands this unit [residual | normed hidden state].

On a CUDA device with Triton, the routed experts run as two grouped launches (offload.kernels.triton_moe) with
no host sync; elsewhere, and for weights those kernels do not take, one expert at a time (experts_forward_loop,
also their reference)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from offload.model.llama import Weight, linear
from offload.moe_spec import MoESpec


# Each ExpertWeights' grouped operands for the Triton kernels (experts_grouped), keyed by the object itself and
# dropped with it: a resident unit's weights live as long as the model, a streamed unit's are views of its staging
# slot made once per slot and layout (runtime/streamer.py).
_GROUPED = WeakIdKeyDictionary()


@dataclass
class ExpertWeights:
    """The routed experts of one MoE layer: the router [n_experts, D] and each expert's fused gate|up [2F, D] and
    down [D, F]; with biases where the family has them (gpt-oss: the router's [n_experts], each expert's gate|up
    [2F] and down [D])."""

    router: torch.Tensor
    gate_up: tuple[Weight, ...]
    down: tuple[Weight, ...]
    router_bias: torch.Tensor | None = None
    gate_up_bias: tuple[torch.Tensor, ...] | None = None
    down_bias: tuple[torch.Tensor, ...] | None = None


def route(moe: MoESpec, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, expert ids [T, k]) from router logits [T, n_experts]: softmax in fp32, the top k, and
    renormalised to sum to 1 where the family does (Mixtral always; Qwen when norm_topk_prob)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, moe.top_k, dim=-1)
    if moe.norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def expert_groups(ids: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, list[int]]:
    """(order, counts): the (token, slot) pairs of ids [T, k] flattened and sorted by expert, stable, and how many
    each expert has; expert e's pairs are order[sum(counts[:e]) : sum(counts[:e + 1])]."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=n_experts).tolist()
    return order, counts


def experts_forward(moe: MoESpec, w: ExpertWeights, x: torch.Tensor) -> torch.Tensor:
    """x [..., 2D] = [residual | normed h] -> residual + sum over each token's top-k experts of weight * expert(h):
    the grouped kernels where they run (_grouped_kernels), else the loop over the picked experts."""
    if _grouped_kernels(x) is not None and moe.activation == "silu" and not moe.biases:
        out = experts_forward_grouped(moe, w, x)
        if out is not None:
            return out
    return experts_forward_loop(moe, w, x)


def _grouped_kernels(x: torch.Tensor):
    """offload.kernels.triton_moe where x is on a CUDA device and Triton is installed, else None."""
    return _triton_moe() if x.device.type == "cuda" else None


@functools.cache
def _triton_moe():
    from offload.kernels import triton_moe

    return triton_moe if triton_moe.TRITON_AVAILABLE else None


def experts_forward_grouped(moe: MoESpec, w: ExpertWeights, x: torch.Tensor) -> torch.Tensor | None:
    """experts_forward in two grouped Triton launches (gate_up with SiLU, down with the routing weights) over the
    (token, slot) pairs sorted by expert on the device: nothing here waits for the device. None where the kernels
    do not take the experts' weights (offload.kernels.triton_moe says which)."""
    from offload.kernels import triton_moe

    d = x.shape[-1] // 2
    residual, h = x[..., :d], x[..., d:].reshape(-1, d)  # h [T, D]
    gate_up, down = experts_grouped(w, h)
    if gate_up is None or down is None:
        return None
    weights, ids = route(moe, linear(h, w.router, None))  # [T, k]
    tiles = triton_moe.expert_tiles(ids, moe.n_experts, triton_moe.tile_rows(h.shape[0], moe.top_k, moe.n_experts))
    act = triton_moe.grouped_gate_up(h, tiles, gate_up, moe.top_k)  # [T*k, F] by expert
    y = triton_moe.grouped_down(act, tiles, down, weights.reshape(-1))  # [T*k, D] by (token, slot)
    out = y.view(-1, moe.top_k, d).sum(dim=1, dtype=torch.float32).to(x.dtype)
    return residual + out.view(residual.shape)


def experts_grouped(w: ExpertWeights, h: torch.Tensor) -> tuple:
    """(gate_up, down) as triton_moe.GroupedWeights for activations like h (None where the kernels do not take
    them), built on w's first call and reused (a rebuild walks every expert: 0.4 ms for 128). They hold views of
    the weights and their addresses, never copies, so a staging slot's stay right while the slot is refilled."""
    from offload.kernels import triton_moe

    like = (h.device, h.dtype)
    held = _GROUPED.get(w)
    if held is not None and held[0] == like and held[1] is w.gate_up and held[2] is w.down:
        return held[3]
    grouped = triton_moe.group_weights(w.gate_up, h), triton_moe.group_weights(w.down, h)
    _GROUPED[w] = (like, w.gate_up, w.down, grouped)
    return grouped


def experts_forward_loop(moe: MoESpec, w: ExpertWeights, x: torch.Tensor) -> torch.Tensor:
    """experts_forward one picked expert at a time (the CPU path, and the grouped kernels' reference): learning
    which experts were picked waits for the device once, then each runs about 7 operations.

    Tokens are gathered per expert, so an expert several tokens picked runs once for all of them (a matrix-matrix
    product), and only the experts picked at all are read."""
    d = x.shape[-1] // 2
    residual, h = x[..., :d], x[..., d:].reshape(-1, d)
    weights, ids = route(moe, linear(h, w.router, w.router_bias))
    order, counts = expert_groups(ids, moe.n_experts)
    tokens = order // moe.top_k
    scale = weights.reshape(-1)[order]
    out = torch.zeros_like(h)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = tokens[start:start + n]
        bias = (None, None) if w.gate_up_bias is None else (w.gate_up_bias[e], w.down_bias[e])
        gate, up = linear(h.index_select(0, rows), w.gate_up[e], bias[0]).chunk(2, dim=-1)
        y = linear(gated(moe, gate, up), w.down[e], bias[1])
        out.index_add_(0, rows, (y * scale[start:start + n, None]).to(out.dtype))
        start += n
    return residual + out.view(residual.shape)


def gated(moe: MoESpec, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """An expert's activation of gate times up: SiLU's, or gpt-oss's clamped SwiGLU (gate clamped above and up on
    both sides at the limit, gate * sigmoid(alpha * gate) * (up + 1))."""
    if moe.activation == "silu":
        return F.silu(gate) * up
    gate = gate.clamp(max=moe.swiglu_limit)
    up = up.clamp(min=-moe.swiglu_limit, max=moe.swiglu_limit)
    return gate * torch.sigmoid(gate * moe.swiglu_alpha) * (up + 1)

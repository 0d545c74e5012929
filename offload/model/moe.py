"""Mixture-of-experts block math (Mixtral, Qwen2-MoE, Qwen3-MoE): the router and the routed experts of one layer,
device-agnostic, weights passed in. The attention part of a MoE layer (with its shared expert) is
offload.model.llama's layer_forward(moe=True), which hands this unit [residual | normed hidden state].

Where the kernels' door runs them grouped (offload.kernels.ops.grouped_experts: two Triton launches on a CUDA
device, no host sync), they run so; elsewhere, and for weights those kernels do not take, one expert at a time
(experts_forward_loop, also their reference)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from offload.kernels.ops import Weight, grouped_experts, linear
from offload.moe_spec import MoESpec


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
    the kernels' grouped experts where they run (offload.kernels.ops.grouped_experts), else the loop over the
    picked experts."""
    d = x.shape[-1] // 2
    residual, h = x[..., :d], x[..., d:].reshape(-1, d)  # h [T, D]
    weights, ids = route(moe, linear(h, w.router, w.router_bias))  # [T, k]
    out = grouped_experts(moe, w, h, weights, ids)
    if out is None:
        return experts_forward_loop(moe, w, x, (weights, ids))
    return residual + out.to(x.dtype).view(residual.shape)


def experts_forward_loop(moe: MoESpec, w: ExpertWeights, x: torch.Tensor, routed=None) -> torch.Tensor:
    """experts_forward one picked expert at a time (the CPU path, and the grouped kernels' reference): learning
    which experts were picked waits for the device once, then each runs about 7 operations.

    Tokens are gathered per expert, so an expert several tokens picked runs once for all of them (a matrix-matrix
    product), and only the experts picked at all are read. routed: (weights, ids) where the router ran already."""
    d = x.shape[-1] // 2
    residual, h = x[..., :d], x[..., d:].reshape(-1, d)
    weights, ids = routed if routed is not None else route(moe, linear(h, w.router, w.router_bias))
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

"""Mixture-of-experts block math (Mixtral, Qwen2-MoE, Qwen3-MoE): the router and the routed experts of one layer,
device-agnostic, weights passed in. The attention part of a MoE layer (with its shared expert) is
offload.model.llama's layer_forward(moe=True), which hands this unit [residual | normed hidden state]."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from offload.model.llama import Weight, linear
from offload.spec import MoESpec


@dataclass
class ExpertWeights:
    """The routed experts of one MoE layer: the router [n_experts, D] and each expert's fused gate|up [2F, D] and
    down [D, F]."""

    router: torch.Tensor
    gate_up: tuple[Weight, ...]
    down: tuple[Weight, ...]


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
    """x [..., 2D] = [residual | normed h] -> residual + sum over each token's top-k experts of weight * expert(h).

    Tokens are gathered per expert, so an expert several tokens picked runs once for all of them (a matrix-matrix
    product), and only the experts picked at all are read."""
    d = x.shape[-1] // 2
    residual, h = x[..., :d], x[..., d:].reshape(-1, d)
    weights, ids = route(moe, linear(h, w.router, None))
    order, counts = expert_groups(ids, moe.n_experts)
    tokens = order // moe.top_k
    scale = weights.reshape(-1)[order]
    out = torch.zeros_like(h)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = tokens[start:start + n]
        gate, up = linear(h.index_select(0, rows), w.gate_up[e], None).chunk(2, dim=-1)
        y = linear(F.silu(gate) * up, w.down[e], None)
        out.index_add_(0, rows, (y * scale[start:start + n, None]).to(out.dtype))
        start += n
    return residual + out.view(residual.shape)

"""One placement unit's forward: the dispatch from a unit's kind to its block math (dense layers and the attention
part of MoE layers in offload.model.llama, routed experts in offload.model.moe)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from offload.kernels.ops import linear, norm_rows
from offload.model.llama import layer_forward, mlp_forward
from offload.model.step import LayerKV, Step
from offload.model.moe import experts_forward
from offload.spec import ModelSpec


def unit_forward(spec: ModelSpec, kind: str, w, x: torch.Tensor, step: Step | None, kv: LayerKV | None,
                 dtype: torch.dtype, index: int | None = None) -> torch.Tensor:
    """One placement unit: embed (token ids [B, S] -> [B, S, D] in dtype), layer `index`, experts (a MoE layer's
    routed experts: [B, S, 2D] -> [B, S, D]), mlp (a split-off dense MLP, the same shapes), norm, or lm_head
    (-> logits)."""
    if kind == "experts":
        return experts_forward(spec.moe, w, x)
    if kind == "mlp":
        return mlp_forward(spec, w, x)
    if kind == "embed":
        return embed(spec, w, x, dtype)
    if kind == "norm":
        return norm_rows(x, w, spec.rms_norm_eps)
    if kind == "lm_head":
        return final_logits(spec, linear(x, w, None))
    return layer_forward(spec, w, x, step, kv, moe=index is not None and spec.hands_over(index), index=index)


def embed(spec: ModelSpec, w: torch.Tensor, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The embeddings of tokens [B, S] in dtype, times the family's scale (Gemma's sqrt(hidden), rounded to dtype
    first as transformers does)."""
    x = F.embedding(tokens, w).to(dtype)
    scale = spec.variant.embed_scale
    return x if scale is None else x * torch.tensor(scale, dtype=dtype)


def final_logits(spec: ModelSpec, logits: torch.Tensor) -> torch.Tensor:
    """The lm_head's output, soft-capped where the family caps it (Gemma 2: cap * tanh(logits / cap))."""
    cap = spec.variant.final_softcap
    return logits if cap is None else torch.tanh(logits / cap) * cap

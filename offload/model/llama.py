"""Decoder block math for every family (offload/families.py: Llama's, and where a family differs: Gemma's norms
after attention and the MLP, GELU-tanh, q/k norms, per-layer windows and ropes, soft-caps), and the attention
part of MoE layers: device-agnostic, weights passed in, gpt-fast style. The routed experts are
offload.model.moe's."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from offload.kernels.ops import Weight, linear, rms_norm
from offload.model.attention import attend
from offload.model.rope import apply_rope, rope_table
from offload.model.step import LayerKV, Step
from offload.spec import ModelSpec

@dataclass
class LayerWeights:
    """One decoder layer; q/k/v and gate/up are fused along the output dimension. Of a MoE layer, the attention
    part: gate_up and down are its shared expert's (None: it has none) and shared_gate that expert's gate."""

    attn_norm: torch.Tensor
    qkv: Weight
    qkv_bias: torch.Tensor | None
    o: Weight
    o_bias: torch.Tensor | None
    mlp_norm: torch.Tensor
    gate_up: Weight
    gate_up_bias: torch.Tensor | None
    down: Weight
    down_bias: torch.Tensor | None
    q_norm: torch.Tensor | None = None  # [head_dim], Qwen3's per-head RMSNorm of q and k
    k_norm: torch.Tensor | None = None
    shared_gate: torch.Tensor | None = None  # [1, hidden], a MoE layer's shared-expert gate
    post_attn_norm: torch.Tensor | None = None  # Gemma 2/3: the attention's output normed before the residual add
    sinks: torch.Tensor | None = None  # [n_heads] gpt-oss: one more logit in each head's softmax, with no value
    post_mlp_norm: torch.Tensor | None = None  # and the MLP's


@dataclass
class MLPWeights:
    """A dense layer's MLP as a unit of its own (its attention part hands it [residual | normed h])."""

    gate_up: Weight
    gate_up_bias: torch.Tensor | None
    down: Weight
    down_bias: torch.Tensor | None
    post_mlp_norm: torch.Tensor | None = None  # Gemma 2/3: the MLP's output normed before the residual add


def roped_heads(spec: ModelSpec, qkv: torch.Tensor, step: Step, window: int | None = None):
    """qkv [B, S, q | k | v] as q [B, H, S, Dh] and k, v [B, Hkv, S, Dh], rope applied to q and k (the rope of
    layers with this sliding window)."""
    b, s, _ = qkv.shape
    q, k, v = qkv.split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
    q = q.view(b, s, spec.n_heads, spec.head_dim).transpose(1, 2)
    k = k.view(b, s, spec.n_kv_heads, spec.head_dim).transpose(1, 2)
    v = v.view(b, s, spec.n_kv_heads, spec.head_dim).transpose(1, 2)
    cos, sin = rope_table(spec, step.cos, window), rope_table(spec, step.sin, window)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def qk_norm(spec: ModelSpec, w: LayerWeights, qkv: torch.Tensor) -> torch.Tensor:
    """qkv [..., q | k | v] with each head of q and k RMS-normed (Qwen3; OLMo 2: the whole of q and of k), v as
    it was."""
    q, k, v = qkv.split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
    if spec.family.qk_norm_over == "all":
        eps = spec.rms_norm_eps
        return torch.cat([rms_norm(q, w.q_norm, eps), rms_norm(k, w.k_norm, eps), v], dim=-1)
    q = rms_norm(q.unflatten(-1, (spec.n_heads, spec.head_dim)), w.q_norm, spec.rms_norm_eps).flatten(-2)
    k = rms_norm(k.unflatten(-1, (spec.n_kv_heads, spec.head_dim)), w.k_norm, spec.rms_norm_eps).flatten(-2)
    return torch.cat([q, k, v], dim=-1)


GATE_ACTIVATIONS = {"silu": F.silu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}


def mlp(width: int, w: LayerWeights | MLPWeights, h: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """down(act(gate(h)) * up(h)) with gate and up (each width rows) fused in w.gate_up."""
    gate, up = linear(h, w.gate_up, w.gate_up_bias).split(width, dim=-1)
    return linear(GATE_ACTIVATIONS[activation](gate) * up, w.down, w.down_bias)


def layer_forward(spec: ModelSpec, w: LayerWeights, x: torch.Tensor, step: Step, kv: LayerKV,
                  attention=None, moe: bool = False, index: int | None = None) -> torch.Tensor:
    """One decoder layer on hidden states x [B, S, D]; appends this step's K, V to kv. attention, if given,
    replaces rope, the KV append and attention: qkv [B * S, q | k | v] -> [B * S, n_heads * head_dim] (the
    executor passes the fused layer's attention for CPU layers whose linears run through torch).

    moe: a layer whose MLP is a unit of its own (a MoE layer's routed experts, offload.model.moe, or a dense MLP
    split off); it returns [B, S, 2D]: the residual stream (with a MoE layer's shared expert's output added) and
    the normed hidden state that unit takes. index: the layer's number (its sliding window and rope, where the
    model's layers differ)."""
    b, s, _ = x.shape
    eps = spec.rms_norm_eps
    h = x if w.attn_norm is None else rms_norm(x, w.attn_norm, eps)
    qkv = linear(h, w.qkv, w.qkv_bias)
    if w.q_norm is not None:
        qkv = qk_norm(spec, w, qkv)
    if attention is not None:
        o = attention(qkv.reshape(b * s, -1).contiguous()).view(b, s, spec.q_size)
    else:
        window = spec.window(index)
        q, k, v = roped_heads(spec, qkv.view(b, s, -1), step, window)
        o = attend(spec, q, k, v, step, kv, window, w.sinks).transpose(1, 2).reshape(b, s, spec.q_size)
    o = linear(o, w.o, w.o_bias)
    x = x + (o if w.post_attn_norm is None else rms_norm(o, w.post_attn_norm, eps))
    h = x if w.mlp_norm is None else rms_norm(x, w.mlp_norm, eps)
    if not moe:
        out = mlp(spec.intermediate_size, w, h, spec.family.activation)
        return x + (out if w.post_mlp_norm is None else rms_norm(out, w.post_mlp_norm, eps))
    if w.gate_up is not None:  # the shared expert, scaled by its sigmoid gate
        x = x + torch.sigmoid(linear(h, w.shared_gate, None)) * mlp(spec.moe.shared_size, w, h)
    return torch.cat([x, h], dim=-1)


def mlp_forward(spec: ModelSpec, w: MLPWeights, x: torch.Tensor) -> torch.Tensor:
    """A split-off dense MLP: x [..., 2D] = [residual | normed h] -> residual + mlp(h)."""
    d = x.shape[-1] // 2
    out = mlp(spec.intermediate_size, w, x[..., d:], spec.family.activation)
    return x[..., :d] + (out if w.post_mlp_norm is None else rms_norm(out, w.post_mlp_norm, spec.rms_norm_eps))

"""Model: the weights of a Llama-family model in memory, and the block loop over them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from offload.errors import ConfigError
from offload.model.llama import LayerKV, LayerWeights, Step, layer_forward, linear, make_step, rms_norm
from offload.spec import ModelSpec
from offload.weights.loader import Checkpoint

QUANTIZATIONS = ("none", "q8_0", "q4_0")


@dataclass
class Model:
    """Embedding, decoder layers, final norm and lm_head of one model, all resident in CPU memory."""

    spec: ModelSpec
    embed_tokens: torch.Tensor  # [V, D]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [D]
    lm_head: object  # [V, D] tensor or PackedWeight
    dtype: torch.dtype

    def new_cache(self, batch: int, max_len: int) -> list[LayerKV]:
        s = self.spec
        return [LayerKV(batch, s.n_kv_heads, max_len, s.head_dim, self.dtype) for _ in range(s.n_layers)]

    def make_step(self, positions: torch.Tensor, valid: torch.Tensor, trash_slot: int,
                  rows: torch.Tensor | None = None, phase: str = "prefill") -> Step:
        """Describe one forward pass: new tokens at positions [B, S]; valid [B, S] marks real tokens."""
        return make_step(self.spec, self.dtype, positions, valid, trash_slot, rows, phase)

    def forward(self, tokens: torch.Tensor, step: Step, cache: list[LayerKV]) -> torch.Tensor:
        """Hidden states [B, S, D] after the final norm, for tokens [B, S]."""
        x = F.embedding(tokens, self.embed_tokens).to(self.dtype)
        for w, kv in zip(self.layers, cache):
            x = layer_forward(self.spec, w, x, step, kv)
        return rms_norm(x, self.norm, self.spec.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [..., V] in fp32 from final hidden states [..., D]."""
        return linear(hidden, self.lm_head, None).float()


def load_model(ckpt: Checkpoint, spec: ModelSpec, dtype: torch.dtype = torch.float32,
               quantization: str = "none") -> Model:
    """Read every tensor once from the checkpoint; linear weights are packed if quantization is set."""
    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"quantization {quantization!r} is not supported; use one of {', '.join(QUANTIZATIONS)}")
    ckpt.check_against(spec)
    pack = packer(quantization, dtype)
    layers = [load_layer(ckpt, spec, i, dtype, pack) for i in range(spec.n_layers)]
    embed = ckpt.get("model.embed_tokens.weight", dtype)
    head = embed if spec.tie_word_embeddings else ckpt.get("lm_head.weight", dtype)
    return Model(spec=spec, embed_tokens=embed, layers=layers, norm=ckpt.get("model.norm.weight", dtype),
                 lm_head=pack(head), dtype=dtype)


def packer(quantization: str, dtype: torch.dtype):
    """A function that turns a dense [out, in] weight into the form the linear layers will use."""
    if quantization == "none":
        return lambda w: w.contiguous()
    from offload.kernels import pack

    def pack_or_keep(w: torch.Tensor):
        return pack(w, quantization) if w.shape[-1] % 32 == 0 else w.contiguous()

    return pack_or_keep


def load_layer(ckpt: Checkpoint, spec: ModelSpec, i: int, dtype: torch.dtype, pack) -> LayerWeights:
    """Read layer i's tensors, fusing q/k/v and gate/up."""
    p = f"model.layers.{i}."

    def get(name: str) -> torch.Tensor:
        return ckpt.get(p + name, dtype)

    def bias(names: list[str], present: bool) -> torch.Tensor | None:
        return torch.cat([get(n + ".bias") for n in names]) if present else None

    qkv = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
    gate_up = ["mlp.gate_proj", "mlp.up_proj"]
    return LayerWeights(
        attn_norm=get("input_layernorm.weight"),
        qkv=pack(torch.cat([get(n + ".weight") for n in qkv])),
        qkv_bias=bias(qkv, spec.qkv_bias),
        o=pack(get("self_attn.o_proj.weight")),
        o_bias=bias(["self_attn.o_proj"], spec.o_bias),
        mlp_norm=get("post_attention_layernorm.weight"),
        gate_up=pack(torch.cat([get(n + ".weight") for n in gate_up])),
        gate_up_bias=bias(gate_up, spec.mlp_bias),
        down=pack(get("mlp.down_proj.weight")),
        down_bias=bias(["mlp.down_proj"], spec.mlp_bias),
    )

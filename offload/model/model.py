"""Model: every weight of a Llama-family model resident in memory, and the plain block loop over them: the
reference the placed executor is tested against (it never chooses kernels)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from offload.model.llama import LayerWeights
from offload.model.step import LayerKV, Step, layer_cache, make_step
from offload.model.units import unit_forward
from offload.spec import ModelSpec


@dataclass
class Model:
    """Embedding, decoder layers, final norm and lm_head of one model, all resident in CPU memory."""

    spec: ModelSpec
    embed_tokens: torch.Tensor  # [V, D]
    layers: list[LayerWeights]  # of a MoE model, each MoE layer's attention part
    norm: torch.Tensor  # [D]
    lm_head: object  # [V, D] tensor or PackedWeight
    dtype: torch.dtype
    experts: dict[int, object] | None = None  # layer index -> ExpertWeights of its routed experts (MoE models)

    def new_cache(self, batch: int, max_len: int, n_rings: int | None = None) -> list[LayerKV]:
        """A cache per layer of batch rows of max_len slots (n_rings: sequences a pooled row holds at once)."""
        return [layer_cache(self.spec, i, batch, max_len, self.dtype, n_rings=n_rings)
                for i in range(self.spec.n_layers)]

    def make_step(self, positions: torch.Tensor, valid: torch.Tensor, trash_slot: int,
                  rows: torch.Tensor | None = None, phase: str = "prefill") -> Step:
        """Describe one forward pass: new tokens at positions [B, S]; valid [B, S] marks real tokens."""
        return make_step(self.spec, self.dtype, positions, valid, trash_slot, rows, phase)

    def prepare_step(self, phase: str, samples: bool = True) -> None:
        """As PlacedModel.prepare_step takes it: every weight is in memory here, so nothing is copied or read."""

    def host_worked(self, seconds: float) -> None:
        """As PlacedModel.host_worked takes it: the clock here is the host's own, which has moved on."""

    def forward(self, tokens: torch.Tensor, step: Step, cache: list[LayerKV], logits: bool = True) -> torch.Tensor:
        """Hidden states [B, S, D] after the final norm, for tokens [B, S] (logits: whether logits() follows, as
        PlacedModel.forward takes it; nothing to skip here)."""
        x = unit_forward(self.spec, "embed", self.embed_tokens, tokens, step, None, self.dtype)
        for i, (w, kv) in enumerate(zip(self.layers, cache)):
            x = unit_forward(self.spec, "layer", w, x, step, kv, self.dtype, i)
            if self.experts and i in self.experts:
                x = unit_forward(self.spec, "experts", self.experts[i], x, step, None, self.dtype, i)
        return unit_forward(self.spec, "norm", self.norm, x, step, None, self.dtype)

    def logits(self, hidden: torch.Tensor, more: bool = False) -> torch.Tensor:
        """Logits [..., V] in fp32 from final hidden states [..., D] (more: other rows of the step follow, as
        PlacedModel.logits takes it; nothing to keep here)."""
        return unit_forward(self.spec, "lm_head", self.lm_head, hidden, None, None, self.dtype).float()

"""The mixture-of-experts part of a model as data (MoESpec), read from its config.json: how many experts, how
many run per token, their width, a shared expert, the layers that keep a dense MLP, and how the family names,
stores and gates its experts (offload/families.py says which family does what)."""

from __future__ import annotations

from dataclasses import dataclass

from offload.config_values import MAX_EXPERTS_OVER_LAYERS, count, fix, layer_list, real
from offload.errors import ConfigError
from offload.families import Family


@dataclass(frozen=True)
class MoESpec:
    """The mixture-of-experts part of a model: each MoE layer's MLP is n_experts experts of width expert_size, of
    which top_k run per token (picked by a router, their weights renormalised when norm_topk), plus a shared expert
    of width shared_size (0: none) scaled by its own sigmoid gate; dense_layers keep an ordinary MLP."""

    n_experts: int
    top_k: int
    expert_size: int
    shared_size: int = 0
    norm_topk: bool = True
    dense_layers: tuple[int, ...] = ()
    naming: str = "qwen"  # checkpoint tensor names: mixtral (block_sparse_moe.experts.e.w1/w2/w3) | qwen (mlp.*) |
    # gpt_oss (mlp.experts.gate_up_proj [E, D, 2F] stacked, gate and up interleaved, with biases; mlp.router)
    activation: str = "silu"  # silu, or swiglu_oai: gpt-oss's clamped gate * sigmoid(alpha * gate) * (up + 1)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    biases: bool = False  # the router and each expert's linears have biases (gpt-oss)

    def expected_experts(self, n_tokens: int) -> float:
        """Distinct experts a layer runs for n_tokens tokens routed independently and uniformly: what a step reads
        of its expert weights (k for one token, nearly all of them in a long prefill)."""
        return self.n_experts * (1.0 - (1.0 - self.top_k / self.n_experts) ** max(n_tokens, 0))


def moe_from_config(config: dict, family: Family, source: str) -> MoESpec | None:
    """The MoESpec of a Mixtral, Qwen2-MoE, Qwen3-MoE or gpt-oss config (None for a dense family)."""
    if family.moe is None:
        return None
    arch, extra = family.name, {}
    if family.moe in ("mixtral", "gpt_oss"):  # every layer's MLP is experts of intermediate_size
        n_experts = count(config, "num_local_experts", source)
        expert_size, shared, norm, dense = count(config, "intermediate_size", source), 0, True, ()
        if family.moe == "gpt_oss":
            extra = {"activation": "swiglu_oai", "biases": True,
                     "swiglu_alpha": real(config.get("swiglu_alpha", 1.702), "swiglu_alpha", source),
                     "swiglu_limit": real(config.get("swiglu_limit", 7.0), "swiglu_limit", source)}
    else:
        # Qwen's key; transformers 5 writes num_local_experts (and reads either)
        key = "num_experts" if "num_experts" in config else "num_local_experts"
        n_experts = count(config, key, source)
        expert_size = count(config, "moe_intermediate_size", source)
        shared = count(config, "shared_expert_intermediate_size", source, default=0, least=0) \
            if arch == "qwen2_moe" else 0
        norm = bool(config.get("norm_topk_prob", False))
        step = count(config, "decoder_sparse_step", source, default=1)
        n_layers = count(config, "num_hidden_layers", source)
        only = layer_list(config, "mlp_only_layers", source, n_layers)
        dense = tuple(i for i in range(n_layers) if i in only or (i + 1) % step)
    top_k = count(config, "num_experts_per_tok", source)
    if top_k > n_experts:
        raise ConfigError(f"{source}: num_experts_per_tok={top_k} is more than the {n_experts} experts; fix the config")
    n_moe_layers = count(config, "num_hidden_layers", source) - len(dense)
    if n_moe_layers * n_experts > MAX_EXPERTS_OVER_LAYERS:
        raise ConfigError(f"{source}: {n_moe_layers:,} mixture-of-experts layers of {n_experts} experts are "
                          f"{n_moe_layers * n_experts:,} experts, above the {MAX_EXPERTS_OVER_LAYERS:,} offload plans "
                          f"for (no released model comes near it); {fix(source)}")
    return MoESpec(n_experts, top_k, expert_size, shared, norm, dense, family.moe, **extra)

"""ModelSpec: the architecture as data, built from a Hugging Face config.json (no torch, no weights)."""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from offload.config_values import count, fix, real
from offload.attention_sizes import attention_bytes, pool_tokens, ring_slots
from offload.errors import ConfigError
from offload.families import BY_MODEL_TYPE, Family, FamilyMath, family_math, family_of, text_config
from offload.paths import describe_path
from offload.moe_spec import MoESpec, moe_from_config
from offload.rope_spec import RopeSpec, check_rope_sections, rope_from_config
from offload.formats import (ALIGN_BYTES, AS_STORED, DTYPE_ALIASES, FLOAT_FORMATS, GGUF_BLOCKS, KEPT_FLOAT, QK,
                             QUANT_BLOCK_BYTES, QUANT_QS_BYTES, format_nbytes)



@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a unit; role is linear, embedding, norm, bias or router (a router's or shared-expert gate's
    small matrix, kept in the compute format as llama.cpp keeps it: top-k choices are sensitive to its rounding)."""

    name: str
    shape: tuple[int, ...]
    role: str
    stored: str | None = None  # the format a GGUF file holds it in (None: a float checkpoint)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def held_format(self, fmt: str, compute: str) -> str:
        """The format this tensor is held in when linear weights are in fmt. Under AS_STORED a linear keeps the
        quantized format its file stores it in, or bf16 (KEPT_FLOAT); other floats, embeddings (dequantized for
        lookup) and norms take the compute format."""
        if fmt == AS_STORED:
            kept = self.stored in QUANT_BLOCK_BYTES or self.stored in GGUF_BLOCKS or self.stored == KEPT_FLOAT
            return self.stored if kept and self.role == "linear" else compute
        if fmt in FLOAT_FORMATS:
            return fmt
        return fmt if self.quantizable else compute

    @property
    def quantizable(self) -> bool:
        return self.role == "linear" and self.shape[-1] % QK == 0

    def nbytes(self, fmt: str, compute: str = "fp32") -> int:
        """Bytes with linear weights in storage format fmt; under a quantized fmt, what cannot be quantized
        (embeddings, norms, biases, linears whose width is not a multiple of QK) stays in the compute format."""
        if fmt not in FLOAT_FORMATS and fmt not in QUANT_BLOCK_BYTES and fmt != AS_STORED:
            format_nbytes(0, fmt)  # raises the unknown-format error
        return format_nbytes(self.numel, self.held_format(fmt, compute))

    def buffer_bytes(self, fmt: str, compute: str = "fp32") -> int:
        """nbytes as laid out in a unit's flat buffer: each plane (quants, scales) starts ALIGN_BYTES-aligned."""
        held = self.held_format(fmt, compute)
        if held in QUANT_BLOCK_BYTES:
            blocks = self.numel // QK
            return _aligned(blocks * QUANT_QS_BYTES[held]) + _aligned(blocks * 2)
        return _aligned(self.nbytes(fmt, compute))


def _aligned(n_bytes: int) -> int:
    return -(-n_bytes // ALIGN_BYTES) * ALIGN_BYTES


@dataclass(frozen=True)
class UnitSpec:
    """A placeable unit: the embedding, one decoder layer, the final norm, or the lm_head. A MoE layer i is two
    units: layer.i (attention, the norms and the shared expert) and experts.i (the router and the routed experts);
    a dense layer whose MLP is split off is layer.i (attention, norms) and mlp.i."""

    name: str
    kind: str  # embed | layer | experts | mlp | norm | lm_head
    index: int | None
    tensors: tuple[TensorSpec, ...]
    moe: MoESpec | None = None  # set on an experts unit

    def nbytes(self, fmt: str, compute: str = "fp32") -> int:
        return sum(t.nbytes(fmt, compute) for t in self.tensors)

    def buffer_bytes(self, fmt: str, compute: str = "fp32") -> int:
        """Bytes of the unit's flat buffer (a staging slot or read-ahead buffer must hold this much)."""
        return sum(t.buffer_bytes(fmt, compute) for t in self.tensors)

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)

    def rate_format(self, fmt: str, compute: str = "fp32") -> str:
        """The format whose kernel rate prices this unit's matmuls: fmt, or under AS_STORED the format holding
        most of its linear weights."""
        if fmt != AS_STORED:
            return fmt
        return self.held_formats(fmt, compute)[0] if self.linear_numel else compute

    def linear_shares(self, fmt: str, compute: str = "fp32") -> dict[str, list]:
        """Shapes of the unit's linears by the format each is held in (none: its rate format, no shapes)."""
        out: dict[str, list] = {}
        for t in (t for t in self.tensors if t.role == "linear"):
            out.setdefault(t.held_format(fmt, compute), []).append(t.shape)
        return out or {self.rate_format(fmt, compute): []}

    def held_formats(self, fmt: str, compute: str = "fp32") -> tuple[str, ...]:
        """The formats the unit's linear weights are held in (all its tensors' where it has no linear), the one
        holding most weights first: a GGUF layer whose q is q5_0 and whose k and v are q8_0 holds (q5_0, q8_0)."""
        weight: dict[str, int] = {}
        for t in [t for t in self.tensors if t.role == "linear"] or self.tensors:
            held = t.held_format(fmt, compute)
            weight[held] = weight.get(held, 0) + t.numel
        return tuple(sorted(weight, key=lambda f: -weight[f]))

    @property
    def linear_numel(self) -> int:
        """Weights that take part in matmuls (the embedding is a lookup, norms and biases are elementwise)."""
        return sum(t.numel for t in self.tensors if t.role == "linear")

    def matmul_flops(self, n_tokens: int) -> int:
        """Multiply-add FLOPs of this unit's linear layers for n_tokens tokens (attention scores excluded); of an
        experts unit, the top_k experts each token runs."""
        if self.moe is not None:
            return 2 * self.linear_numel * n_tokens * self.moe.top_k // self.moe.n_experts
        return 2 * self.linear_numel * n_tokens

    def touched_fraction(self, n_tokens: int) -> float:
        """The share of this unit's weights a step of n_tokens tokens reads: all of them, but of an experts unit
        only the experts its tokens are routed to (expected)."""
        if self.moe is None:
            return 1.0
        return self.moe.expected_experts(n_tokens) / self.moe.n_experts


@dataclass(frozen=True)
class ModelSpec:
    """Everything about a Llama-family model that is not its weights."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSpec
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    stored_format: str = "fp32"  # the checkpoint's format (config.json torch_dtype; a GGUF's most used linear type)
    source: str = field(default="", compare=False)
    stored_formats: tuple[tuple[str, str], ...] = ()  # (tensor name, format) of a GGUF model's tensors
    qk_norm: bool = False  # RMSNorm over each head of q and k before rope (Qwen3)
    moe: MoESpec | None = None
    split_mlp: bool = False  # every dense layer's MLP a unit of its own (mlp.i after layer.i): a plan's choice
    family: Family = BY_MODEL_TYPE["llama"]  # how its math and tensor names differ from Llama's (families.py)
    variant: FamilyMath = FamilyMath()  # the numbers of that math its config sets

    def window(self, i: int | None) -> int | None:
        """The sliding window of layer i (None: it attends to the whole context)."""
        if self.variant.layer_windows and i is not None:
            return self.variant.layer_windows[i]
        return self.sliding_window

    def kv_ring(self, i: int) -> int | None:
        """Slots of layer i's ring per sequence where its cache is one (a sliding layer of a model whose layers
        differ in window: Gemma 2/3, gpt-oss), else None (every position of the context has its slot)."""
        window = self.window(i) if self.variant.layer_windows else None
        return None if window is None else ring_slots(window)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """The distinct windows of the layers (None: full attention)."""
        return tuple(sorted(set(self.variant.layer_windows), key=lambda w: w or 0)) or (self.sliding_window,)

    def rope_of(self, window: int | None) -> RopeSpec:
        """The rope of layers with this window (Gemma 3's sliding layers turn at a base of their own)."""
        local = self.variant.local_rope
        return local if local is not None and window is not None else self.rope

    @property
    def rotary_dim(self) -> int:
        return self.variant.rotary_dim or self.head_dim

    @property
    def attn_scale(self) -> float:
        return self.variant.attn_scale or self.head_dim ** -0.5

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i's MLP is a mixture of experts (a unit experts.i follows layer.i)."""
        return self.moe is not None and i not in self.moe.dense_layers

    def hands_over(self, i: int) -> bool:
        """Whether unit layer.i ends at the hand-over [residual | normed h] to a unit of its own for its MLP
        (experts.i of a MoE layer, or mlp.i of a dense layer when the MLPs are split off)."""
        return self.split_mlp or self.is_moe_layer(i)

    @property
    def from_gguf(self) -> bool:
        return bool(self.stored_formats)

    def with_stored_formats(self, formats: dict[str, str]) -> "ModelSpec":
        """This spec with the formats a GGUF file stores its tensors in; stored_format becomes the format that
        holds the most linear weights."""
        spec = replace(self, stored_formats=tuple(sorted(formats.items())))
        weight: dict[str, int] = {}
        for t in spec.tensors():
            if t.role == "linear" and t.stored:
                weight[t.stored] = weight.get(t.stored, 0) + t.numel
        return replace(spec, stored_format=max(weight, key=weight.get)) if weight else spec

    @functools.cached_property
    def _stored_by_name(self) -> dict[str, str]:
        return dict(self.stored_formats)

    def _stored(self, name: str) -> str | None:
        return self._stored_by_name.get(name)

    @property
    def q_size(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_kv_heads * self.head_dim

    def layer_tensors(self, i: int) -> tuple[TensorSpec, ...]:
        """The tensors of decoder layer i, with Hugging Face names (the family's) and [out, in] shapes."""
        p, d, fam = f"model.layers.{i}.", self.hidden_size, self.family
        ts = [self._tensor(f"{p}{fam.attn_norm}.weight", (d,), "norm")] if fam.attn_norm else []
        outs = (self.q_size, self.kv_size, self.kv_size)
        parts = zip(fam.qkv, outs) if len(fam.qkv) == 3 else ((fam.qkv[0], sum(outs)),)
        for module, out in parts:
            ts.append(self._tensor(f"{p}{module}.weight", (out, d), "linear"))
            if self.qkv_bias:
                ts.append(self._tensor(f"{p}{module}.bias", (out,), "bias"))
        if self.qk_norm:
            whole = fam.qk_norm_over == "all"
            ts += [self._tensor(f"{p}self_attn.{x}_norm.weight", (n if whole else self.head_dim,), "norm")
                   for x, n in (("q", self.q_size), ("k", self.kv_size))]
        if fam.sinks:
            ts.append(self._tensor(f"{p}self_attn.sinks", (self.n_heads,), "bias"))
        ts.append(self._tensor(f"{p}{fam.o}.weight", (d, self.q_size), "linear"))
        if self.o_bias:
            ts.append(self._tensor(f"{p}{fam.o}.bias", (d,), "bias"))
        ts += [self._tensor(f"{p}{n}.weight", (d,), "norm") for n in (fam.post_attn_norm, fam.mlp_norm) if n]
        if self.is_moe_layer(i):  # the shared expert stays with attention; the routed experts are a unit apart
            if self.moe.shared_size:
                ts += self._mlp_tensors(p + "mlp.shared_expert.", self.moe.shared_size, False)
                ts.append(self._tensor(p + "mlp.shared_expert_gate.weight", (1, d), "router"))
            return tuple(ts)
        return tuple(ts) if self.split_mlp else tuple(ts + self.mlp_tensors(i))

    def mlp_tensors(self, i: int) -> list[TensorSpec]:
        """The dense MLP of layer i: gate, up and down (with biases where the model has them), as the family
        names them (Phi-3's gate and up are one tensor), and the norm after it where the family has one."""
        fam, p = self.family, f"model.layers.{i}."
        ts = self._mlp_tensors(p, self.intermediate_size, self.mlp_bias, fam.gate_up, fam.down)
        return ts + ([self._tensor(f"{p}{fam.post_mlp_norm}.weight", (self.hidden_size,), "norm")]
                     if fam.post_mlp_norm else [])

    def _mlp_tensors(self, prefix: str, width: int, bias: bool, gate_up=("gate_proj", "up_proj"),
                     down="down_proj") -> list[TensorSpec]:
        """gate and up (or the two fused), then down, of an MLP of this width, named prefix + module."""
        d, ts = self.hidden_size, []
        parts = [(m, (width, d)) for m in gate_up] if len(gate_up) == 2 else [(gate_up[0], (2 * width, d))]
        for module, shape in parts + [(down, (d, width))]:
            ts.append(self._tensor(f"{prefix}{module}.weight", shape, "linear"))
            if bias:
                ts.append(self._tensor(f"{prefix}{module}.bias", (shape[0],), "bias"))
        return ts

    def expert_names(self, i: int, e: int) -> tuple[str, str, str]:
        """The checkpoint names of expert e of layer i: gate, up and down (gpt-oss's are views of its stacked
        tensors: name#e, with :gate or :up for a half of the interleaved gate_up; offload.weights.stacked)."""
        if self.moe.naming == "mixtral":
            p = f"model.layers.{i}.block_sparse_moe.experts.{e}."
            return p + "w1.weight", p + "w3.weight", p + "w2.weight"
        if self.moe.naming == "gpt_oss":
            p = f"model.layers.{i}.mlp.experts."
            return f"{p}gate_up_proj#{e}:gate", f"{p}gate_up_proj#{e}:up", f"{p}down_proj#{e}"
        p = f"model.layers.{i}.mlp.experts.{e}."
        return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"

    def expert_bias_names(self, i: int, e: int) -> tuple[str, str, str]:
        """The biases of expert e of layer i (gpt-oss): gate, up and down, views of the stacked bias tensors."""
        p = f"model.layers.{i}.mlp.experts."
        return f"{p}gate_up_proj_bias#{e}:gate", f"{p}gate_up_proj_bias#{e}:up", f"{p}down_proj_bias#{e}"

    def router_name(self, i: int, what: str = "weight") -> str:
        block = {"mixtral": "block_sparse_moe.gate", "gpt_oss": "mlp.router"}.get(self.moe.naming, "mlp.gate")
        return f"model.layers.{i}.{block}.{what}"

    def expert_tensors(self, i: int) -> tuple[TensorSpec, ...]:
        """The tensors of unit experts.i: the router [n_experts, hidden] (and its bias), then each expert's gate,
        up and down (and their biases)."""
        d, f, moe = self.hidden_size, self.moe.expert_size, self.moe
        ts = [self._tensor(self.router_name(i), (moe.n_experts, d), "router")]
        if moe.biases:
            ts.append(self._tensor(self.router_name(i, "bias"), (moe.n_experts,), "bias"))
        for e in range(moe.n_experts):
            gate, up, down = self.expert_names(i, e)
            ts += [self._tensor(gate, (f, d), "linear"), self._tensor(up, (f, d), "linear"),
                   self._tensor(down, (d, f), "linear")]
            if moe.biases:
                gate, up, down = self.expert_bias_names(i, e)
                ts += [self._tensor(gate, (f,), "bias"), self._tensor(up, (f,), "bias"),
                       self._tensor(down, (d,), "bias")]
        return tuple(ts)

    def _tensor(self, name: str, shape: tuple[int, ...], role: str) -> TensorSpec:
        return TensorSpec(name, shape, role, self._stored(name))

    def units(self) -> tuple[UnitSpec, ...]:
        """Embedding, layers 0..n-1, final norm, lm_head. A tied lm_head names the embedding tensor."""
        embed = self._tensor("model.embed_tokens.weight", (self.vocab_size, self.hidden_size), "embedding")
        head_name = "model.embed_tokens.weight" if self.tie_word_embeddings else "lm_head.weight"
        units = [UnitSpec("embed", "embed", None, (embed,))]
        for i in range(self.n_layers):
            units.append(UnitSpec(f"layer.{i}", "layer", i, self.layer_tensors(i)))
            if self.is_moe_layer(i):
                units.append(UnitSpec(f"experts.{i}", "experts", i, self.expert_tensors(i), self.moe))
            elif self.split_mlp:
                units.append(UnitSpec(f"mlp.{i}", "mlp", i, tuple(self.mlp_tensors(i))))
        units.append(UnitSpec("norm", "norm", None, (self._tensor("model.norm.weight", (self.hidden_size,), "norm"),)))
        units.append(UnitSpec("lm_head", "lm_head", None,
                              (self._tensor(head_name, (self.vocab_size, self.hidden_size), "linear"),)))
        return tuple(units)

    def tensors(self) -> tuple[TensorSpec, ...]:
        """Every tensor a checkpoint must hold (a tied lm_head adds none)."""
        seen: dict[str, TensorSpec] = {}
        for unit in self.units():
            for t in unit.tensors:
                seen.setdefault(t.name, t)
        return tuple(seen.values())

    def kv_bytes_per_token(self, elem_bytes: int = 2) -> int:
        """KV cache bytes per token over all layers (a sliding layer's too, before its window fills): K and V,
        n_kv_heads x head_dim each."""
        return 2 * self.n_layers * self.kv_size * elem_bytes

    @property
    def n_params(self) -> int:
        """Parameters in a checkpoint (a tied lm_head is counted once)."""
        return sum(t.numel for t in self.tensors())

    def kv_len(self, seq_len: int, i: int | None = None) -> int:
        """Slots layer i's KV cache holds for a sequence of seq_len tokens: each position's, or a ring's where the
        layer keeps one (kv_ring); without i, the layer that holds the most."""
        if i is not None:
            ring = self.kv_ring(i)
            return seq_len if ring is None else min(seq_len, ring)
        windows = self.variant.layer_windows or (None,)
        return seq_len if None in windows else min(seq_len, ring_slots(max(windows)))

    def keys_seen(self, ctx_len: int, i: int | None = None) -> int:
        """Keys a query at ctx_len attends to in layer i (its sliding window's; without i, the widest layer's)."""
        windows = (self.window(i),) if i is not None else self.windows
        return ctx_len if None in windows else min(ctx_len, max(windows))

    def layer_kv_bytes(self, n_seqs: int, seq_len: int, elem_bytes: int = 2, i: int | None = None) -> int:
        """KV cache bytes of layer i (without i: of the layer that holds the most) for n_seqs sequences of seq_len
        tokens: K and V, a ring layer's up to its ring."""
        return 2 * n_seqs * self.kv_len(seq_len, i) * self.kv_size * elem_bytes

    def pool_kv_bytes(self, n_seqs: int, seq_len: int, elem_bytes: int = 2, i: int | None = None) -> int:
        """Bytes of layer i's cache in an engine's pool for n_seqs sequences of seq_len tokens: a ring layer's rings
        (layer_kv_bytes), any other's blocks and trash slot (offload.attention_sizes.pool_tokens)."""
        ring = self.kv_ring(i) if i is not None else None
        if ring is not None and ring < seq_len:
            return self.layer_kv_bytes(n_seqs, seq_len, elem_bytes, i)
        return 2 * pool_tokens(n_seqs, seq_len) * self.kv_size * elem_bytes

    def kv_read_bytes(self, n_seqs: int, ctx_len: int, elem_bytes: int = 2, i: int | None = None) -> int:
        """K and V bytes layer i's attention reads of n_seqs caches at ctx_len positions: the keys its queries see
        (keys_seen: a sliding layer's window)."""
        return 2 * n_seqs * self.keys_seen(ctx_len, i) * self.kv_size * elem_bytes

    def attention_flops(self, n_tokens: int, ctx_len: int, i: int | None = None) -> int:
        """FLOPs of layer i's QK^T and PV for n_tokens queries over ctx_len keys each (a sliding layer's window)."""
        return 4 * n_tokens * self.keys_seen(ctx_len, i) * self.q_size

    @property
    def mlp_width(self) -> int:
        """The widest MLP activation per token: the dense MLP's, or in a MoE layer its top_k experts' and the
        shared expert's together (a token's gate and up rows are gathered for each of its experts)."""
        if self.moe is None:
            return self.intermediate_size
        moe = self.moe.top_k * self.moe.expert_size + self.moe.shared_size
        return max(moe, self.intermediate_size if self.moe.dense_layers else 0)

    def activation_bytes(self, n_tokens: int, ctx_len: int, elem_bytes: int = 2, n_seqs: int = 1) -> int:
        """Peak working set of one layer for n_tokens queries of n_seqs sequences over ctx_len keys (residual, qkv,
        attention's transients, MLP)."""
        d, f = self.hidden_size, self.mlp_width
        # x, normed x and attention output [T, d] (a MoE layer hands the experts unit [T, 2d]); q, k, v [T, q+2kv];
        # gate and up [T, f] (a MoE layer's grouped GPU path holds instead its picked pairs' activations [T, f]
        # and their down outputs [T, top_k, d] before they are summed); attention's transients (attention_bytes).
        mlp = 2 * f if self.moe is None else max(2 * f, f + self.moe.top_k * d)
        per_token = 3 * d + self.q_size + 2 * self.kv_size + mlp + (2 * d if self.moe else 0)
        attention = attention_bytes(n_tokens, self.kv_len(ctx_len), n_seqs, self.n_heads, self.n_kv_heads,
                                    self.head_dim, elem_bytes)
        return n_tokens * per_token * elem_bytes + attention


def load_spec(path: str | Path) -> ModelSpec:
    """Read a ModelSpec from a model folder or a config.json file."""
    path = Path(path)
    config_path = path / "config.json" if path.is_dir() else path
    what = describe_path(path)
    if what == "does not exist":
        raise ConfigError(f"model path {path} does not exist; pass a Hugging Face model folder, a config.json or 'default'")
    if not path.is_dir() and not (path.is_file() and path.suffix == ".json"):
        raise ConfigError(f"{path} {what}, not a model: expected a folder with config.json, a .gguf file, a Hub id "
                          f"or 'default'")
    if not config_path.is_file():
        raise ConfigError(f"{path} has no config.json; pass a Hugging Face model folder that contains one")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{config_path} is not valid JSON ({e}); restore the file from the model's source") from e
    except RecursionError:  # Python's parser follows a few hundred levels of nesting
        raise ConfigError(f"{config_path} is not a config.json offload can read: its objects and lists nest too deep "
                          f"to parse; restore the file from the model's source") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{config_path} must hold a JSON object, found {type(config).__name__}; restore the file "
                          f"from the model's source")
    return spec_from_config(config, source=str(config_path))


def spec_from_config(config: dict, source: str = "config.json") -> ModelSpec:
    """Build a ModelSpec from a parsed config.json dict (a multimodal folder's text model from its text_config)."""
    config = text_config(config)
    family = family_of(config, source)
    hidden = count(config, "hidden_size", source)
    n_heads = count(config, "num_attention_heads", source)
    n_kv_heads = count(config, "num_key_value_heads", source, default=n_heads)
    if not config.get("head_dim") and hidden % n_heads:  # the heads' width would be a fraction
        raise ConfigError(f"{source}: num_attention_heads={n_heads} does not divide hidden_size={hidden} and no "
                          f"head_dim is given; {fix(source)}")
    head_dim = count(config, "head_dim", source, default=max(1, hidden // n_heads))
    if head_dim % 2:
        raise ConfigError(f"{source}: the heads are {head_dim} wide (head_dim, or hidden_size / num_attention_heads), "
                          f"an odd number, but rotary embeddings turn pairs of dimensions; {fix(source)}")
    if n_heads % n_kv_heads:
        raise ConfigError(f"{source}: num_attention_heads={n_heads} is not a multiple of "
                          f"num_key_value_heads={n_kv_heads}; fix the config")
    eos = config.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    dtype = config.get("dtype", config.get("torch_dtype")) or "float32"
    n_layers = count(config, "num_hidden_layers", source)
    check_rope_sections(config, source)  # family_math reads them too
    variant = family_math(family, config, source, n_layers, head_dim)
    spec = ModelSpec(
        architecture=config["model_type"],
        vocab_size=count(config, "vocab_size", source),
        hidden_size=hidden,
        intermediate_size=count(config, "intermediate_size", source),
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=real(config.get("rms_norm_eps", 1e-6), "rms_norm_eps", source),
        rope=rope_from_config(config, source, variant.rotary_dim or head_dim),
        max_position_embeddings=count(config, "max_position_embeddings", source, default=2048),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", family.tied)),
        qkv_bias=family.qkv_bias(config),
        o_bias=family.o_bias(config),
        mlp_bias=family.mlp_bias(config),
        sliding_window=variant.sliding_window,
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=eos_ids,
        stored_format=DTYPE_ALIASES.get(str(dtype), "fp32"),
        source=source,
        qk_norm=family.qk_norm,
        moe=moe_from_config(config, family, source),
        family=family,
        variant=variant,
    )
    quantized = (config.get("quantization_config") or {}).get("quant_method")
    if quantized == "mxfp4" and spec.moe is not None and spec.moe.naming == "gpt_oss":  # its experts as released
        spec = spec.with_stored_formats({t.name: "mxfp4" for i in range(n_layers) if spec.is_moe_layer(i)
                                         for t in spec.expert_tensors(i) if t.role == "linear"})
    return spec

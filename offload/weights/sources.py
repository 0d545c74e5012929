"""Weights from a checkpoint, in the form the block math takes: the resident reference Model (load_model), and
unit sources for the executor, one unit at a time (CheckpointSource) or random (RandomSource, benchmarks)."""

from __future__ import annotations

import dataclasses

import torch

from offload.errors import ConfigError
from offload.formats import AS_STORED, FLOAT_FORMATS, GGUF_BLOCKS, KEPT_FLOAT, QK, QUANTIZATIONS, torch_dtype
from offload.kernels import TILED, PackedWeight
from offload.kernels.ops import StackedWeight
from offload.model.llama import LayerWeights, MLPWeights
from offload.model.model import Model
from offload.model.moe import ExpertWeights
from offload.spec import ModelSpec, TensorSpec, UnitSpec
from offload.weights.cache import CACHED_KINDS, open_packed_cache
from offload.weights.extents import Extent, unit_extents
from offload.weights import mxfp4
from offload.weights.loader import Checkpoint


def load_model(ckpt: Checkpoint, spec: ModelSpec, dtype: torch.dtype = torch.float32,
               quantization: str = "none") -> Model:
    """Read every tensor once from the checkpoint; linear weights are packed if quantization is set. Dense layers
    stay whole (the resident reference never splits an MLP off)."""
    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"quantization {quantization!r} is not supported; use one of {', '.join(QUANTIZATIONS)}")
    spec = dataclasses.replace(spec, split_mlp=False)
    ckpt.check_against(spec)
    pack = packer(quantization, dtype)
    layers = [load_layer(ckpt, spec, i, dtype, pack) for i in range(spec.n_layers)]
    experts = {i: load_experts(ckpt, spec, i, dtype, pack) for i in range(spec.n_layers) if spec.is_moe_layer(i)}
    embed = ckpt.get("model.embed_tokens.weight", dtype)
    head = embed if spec.tie_word_embeddings else ckpt.get("lm_head.weight", dtype)
    return Model(spec=spec, embed_tokens=embed, layers=layers, norm=read_norm(ckpt, spec, "model.norm.weight", dtype),
                 lm_head=pack(head), dtype=dtype, experts=experts or None)


def packer(quantization: str, dtype: torch.dtype):
    """A function that turns a dense [out, in] weight into the form the linear layers will use."""
    if quantization == "none":
        def keep(w):
            return w.contiguous()

        keep.as_stored = True  # linears a checkpoint stores quantized (gpt-oss's MXFP4 experts) stay so
        return keep
    from offload.kernels import pack

    def pack_or_keep(w: torch.Tensor):
        return pack(w, quantization) if w.shape[-1] % 32 == 0 else w.contiguous()

    return pack_or_keep


def layer_tensor_names(spec: ModelSpec, i: int) -> dict[str, tuple[str, ...] | None]:
    """Each LayerWeights field's checkpoint tensors, in the order they are fused (None: the model has none), as
    the model's family names them."""
    p, fam = f"model.layers.{i}.", spec.family
    moe = spec.is_moe_layer(i)
    # a MoE layer's only dense MLP is its shared expert; a split-off dense MLP is a unit of its own
    has_mlp = spec.moe.shared_size > 0 if moe else not spec.split_mlp
    if moe:
        gate_up, down = (f"{p}mlp.shared_expert.gate_proj", f"{p}mlp.shared_expert.up_proj"), \
            f"{p}mlp.shared_expert.down_proj"
    else:
        gate_up, down = tuple(p + m for m in fam.gate_up), p + fam.down
    qkv = [p + m for m in fam.qkv]

    def names(modules, suffix: str, present: bool = True) -> tuple[str, ...] | None:
        return tuple(m + suffix for m in modules) if present else None

    def norm(module: str | None) -> tuple[str, ...] | None:
        return None if module is None else (f"{p}{module}.weight",)

    return {"attn_norm": norm(fam.attn_norm), "qkv": names(qkv, ".weight"),
            "qkv_bias": names(qkv, ".bias", spec.qkv_bias), "o": (f"{p}{fam.o}.weight",),
            "o_bias": names([p + fam.o], ".bias", spec.o_bias),
            "mlp_norm": norm(fam.mlp_norm), "gate_up": names(gate_up, ".weight", has_mlp),
            "gate_up_bias": names(gate_up, ".bias", spec.mlp_bias and not moe and has_mlp),
            "down": names([down], ".weight", has_mlp),
            "down_bias": names([down], ".bias", spec.mlp_bias and not moe and has_mlp),
            "q_norm": names([p + "self_attn.q_norm"], ".weight", spec.qk_norm),
            "k_norm": names([p + "self_attn.k_norm"], ".weight", spec.qk_norm),
            "shared_gate": names([p + "mlp.shared_expert_gate"], ".weight", moe and has_mlp),
            "sinks": (f"{p}self_attn.sinks",) if fam.sinks else None, "post_attn_norm": norm(fam.post_attn_norm),
            "post_mlp_norm": norm(fam.post_mlp_norm) if has_mlp and not moe else None}


LINEAR_FIELDS = ("qkv", "o", "gate_up", "down")  # the LayerWeights fields that are matrices the linears multiply
NORM_FIELDS = ("attn_norm", "mlp_norm", "q_norm", "k_norm", "post_attn_norm", "post_mlp_norm")


def expert_tensor_names(spec: ModelSpec, i: int) -> dict[str, tuple[str, ...]]:
    """Each field of layer i's ExpertWeights as unit_store lays it out (router, gate_up#e, down#e, and where the
    family has them router_bias, gate_up_bias#e, down_bias#e) with its checkpoint tensors, in the order they are
    fused."""
    names = {"router": (spec.router_name(i),)}
    if spec.moe.biases:
        names["router_bias"] = (spec.router_name(i, "bias"),)
    for e in range(spec.moe.n_experts):
        gate, up, down = spec.expert_names(i, e)
        names[f"gate_up#{e}"], names[f"down#{e}"] = (gate, up), (down,)
        if spec.moe.biases:
            gate, up, down = spec.expert_bias_names(i, e)
            names[f"gate_up_bias#{e}"], names[f"down_bias#{e}"] = (gate, up), (down,)
    return names


def mlp_tensor_names(spec: ModelSpec, i: int) -> dict[str, tuple[str, ...] | None]:
    """Each MLPWeights field of layer i's split-off MLP with its checkpoint tensors."""
    names = layer_tensor_names(dataclasses.replace(spec, split_mlp=False), i)
    return {field: names[field] for field in ("gate_up", "gate_up_bias", "down", "down_bias", "post_mlp_norm")}


def unit_tensor_names(spec: ModelSpec, unit: UnitSpec) -> dict[str, tuple[str, ...] | None]:
    """layer_tensor_names for a layer, expert_tensor_names for experts, mlp_tensor_names for a split-off MLP;
    {"weight": (its tensor,)} for embed, norm and lm_head."""
    if unit.kind == "experts":
        return expert_tensor_names(spec, unit.index)
    if unit.kind == "mlp":
        return mlp_tensor_names(spec, unit.index)
    return layer_tensor_names(spec, unit.index) if unit.kind == "layer" else {"weight": (unit.tensors[0].name,)}


def _read_fused(ckpt: Checkpoint, names: tuple[str, ...] | None, dtype: torch.dtype, pack, linear: bool,
                offset: float = 0.0):
    """The checkpoint tensors names, concatenated along the output dimension (packed if linear); None for none.
    offset: added to a norm's weights (Gemma's 1 + weight), in fp32 before the cast to dtype."""
    if names is None:
        return None
    if linear and getattr(pack, "as_stored", False) and ckpt.is_mxfp4(names[0]):
        raw = torch.cat([ckpt.mxfp4_blocks(n) for n in names])  # GGUF's MXFP4 blocks, rows of the parts in turn
        return PackedWeight.from_gguf(raw, "mxfp4", (raw.shape[0], raw.shape[1] // mxfp4.BLOCK_BYTES * QK))
    if offset:
        return (ckpt.get(names[0], torch.float32) + offset).to(dtype)
    t = torch.cat([ckpt.get(n, dtype) for n in names]) if len(names) > 1 else ckpt.get(names[0], dtype)
    return pack(t) if linear else t


def read_norm(ckpt: Checkpoint, spec: ModelSpec, name: str, dtype: torch.dtype) -> torch.Tensor:
    """A norm's weights as the block math takes them: with the family's offset added (Gemma's checkpoints store
    weight where the norm multiplies by 1 + weight; llama.cpp's GGUF converter adds the 1 itself)."""
    return _read_fused(ckpt, (name,), dtype, None, False, spec.family.norm_offset)


def load_layer(ckpt: Checkpoint, spec: ModelSpec, i: int, dtype: torch.dtype, pack) -> LayerWeights:
    """Read layer i's tensors, fusing q/k/v and gate/up."""
    offset = spec.family.norm_offset
    return LayerWeights(**{field: _read_fused(ckpt, group, dtype, pack, field in LINEAR_FIELDS,
                                              offset if field in NORM_FIELDS else 0.0)
                           for field, group in layer_tensor_names(spec, i).items()})


def load_mlp(ckpt: Checkpoint, spec: ModelSpec, i: int, dtype: torch.dtype, pack) -> MLPWeights:
    """Read layer i's split-off MLP, fusing gate and up."""
    offset = spec.family.norm_offset
    return MLPWeights(**{field: _read_fused(ckpt, group, dtype, pack, field in LINEAR_FIELDS,
                                            offset if field in NORM_FIELDS else 0.0)
                         for field, group in mlp_tensor_names(spec, i).items()})


def load_experts(ckpt: Checkpoint, spec: ModelSpec, i: int, dtype: torch.dtype, pack) -> ExpertWeights:
    """Read layer i's router and experts, fusing each expert's gate and up; the router stays in dtype."""
    n, names = spec.moe.n_experts, expert_tensor_names(spec, i)
    fields = {"router": _read_fused(ckpt, names["router"], dtype, pack, False).contiguous(),
              "gate_up": tuple(_read_fused(ckpt, names[f"gate_up#{e}"], dtype, pack, True) for e in range(n)),
              "down": tuple(_read_fused(ckpt, names[f"down#{e}"], dtype, pack, True) for e in range(n))}
    if spec.moe.biases:  # in fp32, as the kernels add them
        fields["router_bias"] = _read_fused(ckpt, names["router_bias"], dtype, pack, False)
        for kind in ("gate_up_bias", "down_bias"):
            fields[kind] = tuple(_read_fused(ckpt, names[f"{kind}#{e}"], torch.float32, pack, False).contiguous()
                                 for e in range(n))
    return ExpertWeights(**fields)


def expert_biases(spec: ModelSpec, make) -> dict:
    """ExpertWeights' bias fields made by make(*shape, dtype=...) where the family has them (gpt-oss), else none:
    the router's in the compute format, the experts' in fp32."""
    if not spec.moe.biases:
        return {}
    f, d, n = spec.moe.expert_size, spec.hidden_size, spec.moe.n_experts
    return {"router_bias": make(n), "gate_up_bias": tuple(make(2 * f, dtype=torch.float32) for _ in range(n)),
            "down_bias": tuple(make(d, dtype=torch.float32) for _ in range(n))}


class CheckpointSource:
    """Reads one unit at a time from a safetensors checkpoint, packing linear weights if quantized; packed units
    come from the packed-weight cache when an earlier load wrote them (weights/cache.py)."""

    def __init__(self, ckpt: Checkpoint, spec: ModelSpec, dtype: torch.dtype, quantization: str = "none"):
        ckpt.check_against(spec)
        self.ckpt, self.spec, self.dtype = ckpt, spec, dtype
        self.pack = packer(quantization, dtype)
        self.cache = open_packed_cache(ckpt, spec, dtype, quantization)  # None: not quantized, or turned off

    def load(self, unit: UnitSpec):
        """LayerWeights for a layer; a tensor (or packed lm_head) for embed, norm and lm_head."""
        return self.read(unit) if self.cache is None else self.cache.load(unit, self.read)

    def extents(self, unit: UnitSpec, layout) -> tuple[Extent, ...] | None:
        """Where the unit's buffer (layout) sits in files as it is: the checkpoint when its tensors are stored in the
        compute dtype and not quantized, else the packed-weight cache once it is complete; None otherwise."""
        if self.cache is not None and unit.kind in CACHED_KINDS:
            return self.cache.extents(unit, layout)
        if self.spec.family.norm_offset and unit.kind in ("layer", "norm"):
            return None  # its norms are not as stored (read_norm adds the family's offset)
        if unit.kind == "experts" and self.spec.moe.naming == "gpt_oss":
            return None  # each expert is a transposed slice of a stacked tensor, not bytes as stored

        def locate(name: str, entry):
            path, offset, n_bytes, dtype = self.ckpt.where(name)
            return (path, offset, n_bytes, None) if entry.part == "dense" and dtype == entry.dtype else None

        return unit_extents(layout, unit_tensor_names(self.spec, unit), locate)

    def drop_after_read(self, drop: bool) -> None:
        """Whether reads of the checkpoint (and the packed cache) leave their pages out of the page cache."""
        self.ckpt.drop_after_read = drop
        if self.cache is not None and self.cache.reader is not None:
            self.cache.reader.drop_after_read = drop

    def read(self, unit: UnitSpec):
        """load() from the checkpoint itself, never the cache."""
        if unit.kind == "layer":
            return load_layer(self.ckpt, self.spec, unit.index, self.dtype, self.pack)
        if unit.kind == "experts":
            return load_experts(self.ckpt, self.spec, unit.index, self.dtype, self.pack)
        if unit.kind == "mlp":
            return load_mlp(self.ckpt, self.spec, unit.index, self.dtype, self.pack)
        if unit.kind == "norm":
            return read_norm(self.ckpt, self.spec, unit.tensors[0].name, self.dtype).contiguous()
        tensor = self.ckpt.get(unit.tensors[0].name, self.dtype)
        return self.pack(tensor) if unit.kind == "lm_head" else tensor.contiguous()


class RandomSource:
    """Random weights of the right shapes and format, made directly in memory (no files, no quantizing). One
    matrix per shape (and expert) is made and every layer shares it, its values included, which timing runs do not
    mind; its row block order too is made once (SharedRandomWeight)."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, quantization: str = "q4_0", seed: int = 0):
        self.spec, self.dtype, self.quantization = spec, dtype, quantization
        self.gen = torch.Generator().manual_seed(seed)
        self._made: dict[tuple[int, int], object] = {}  # one random matrix per shape, shared by every layer

    def _linear(self, out_features: int, in_features: int, expert: int = -1):
        """A random [out, in] weight; every layer gets the same one (a 70B model builds in seconds, not minutes)."""
        key = (out_features, in_features, expert)
        if key not in self._made:
            self._made[key] = self._random_linear(out_features, in_features)
        return self._made[key]

    def _random_linear(self, out_features: int, in_features: int):
        if self.quantization == "none":
            return torch.randn(out_features, in_features, generator=self.gen, dtype=self.dtype) * in_features ** -0.5
        nb = in_features // 32
        width = in_features if self.quantization == "q8_0" else in_features // 2
        qs = torch.randint(0, 256, (out_features, width), generator=self.gen, dtype=torch.uint8)
        if self.quantization == "q8_0":
            qs = qs.view(torch.int8)
        d = torch.full((out_features, nb), 0.02 / in_features ** 0.5, dtype=torch.float16)
        return SharedRandomWeight(self.quantization, (out_features, in_features), qs, d, tiled=TILED)

    def load(self, unit: UnitSpec):
        s = self.spec
        if unit.kind == "embed":
            return torch.randn(s.vocab_size, s.hidden_size, generator=self.gen, dtype=self.dtype)
        if unit.kind == "norm":
            return torch.ones(s.hidden_size, dtype=self.dtype)
        if unit.kind == "lm_head":
            return self._linear(s.vocab_size, s.hidden_size)
        if unit.kind == "experts":  # experts differ from one another (shared by every layer, as the layers are)
            f, n = s.moe.expert_size, s.moe.n_experts
            router = torch.randn(n, s.hidden_size, generator=self.gen, dtype=self.dtype)
            return ExpertWeights(router, tuple(self._linear(2 * f, s.hidden_size, e) for e in range(n)),
                                 tuple(self._linear(s.hidden_size, f, e) for e in range(n)),
                                 **expert_biases(s, lambda *shape, dtype=None: torch.zeros(*shape, dtype=dtype or self.dtype)))
        if unit.kind == "mlp":
            f = s.intermediate_size
            return MLPWeights(self._linear(2 * f, s.hidden_size), None, self._linear(s.hidden_size, f), None,
                              torch.ones(s.hidden_size, dtype=self.dtype) if s.family.post_mlp_norm else None)
        qkv_out = s.q_size + 2 * s.kv_size
        moe = s.is_moe_layer(unit.index)
        f = (s.moe.shared_size if moe else 0 if s.split_mlp else s.intermediate_size) or None
        whole = s.family.qk_norm_over == "all"

        def ones(n: int = s.hidden_size):
            return torch.ones(n, dtype=self.dtype)

        return LayerWeights(
            attn_norm=ones() if s.family.attn_norm else None, qkv=self._linear(qkv_out, s.hidden_size),
            qkv_bias=torch.zeros(qkv_out, dtype=self.dtype) if s.qkv_bias else None,
            o=self._linear(s.hidden_size, s.q_size), o_bias=None,
            mlp_norm=ones() if s.family.mlp_norm else None,
            gate_up=self._linear(2 * f, s.hidden_size) if f else None, gate_up_bias=None,
            down=self._linear(s.hidden_size, f) if f else None, down_bias=None,
            q_norm=ones(s.q_size if whole else s.head_dim) if s.qk_norm else None,
            k_norm=ones(s.kv_size if whole else s.head_dim) if s.qk_norm else None,
            shared_gate=torch.zeros(1, s.hidden_size, dtype=self.dtype) if moe and f else None,
            post_attn_norm=ones() if s.family.post_attn_norm else None,
            sinks=torch.zeros(s.n_heads, dtype=self.dtype) if s.family.sinks else None,
            post_mlp_norm=ones() if s.family.post_mlp_norm and f and not moe else None)


class SharedRandomWeight(PackedWeight):
    """A random quantized matrix every layer shares: its row block order, which GPU-only units are stored in
    (unit_store.in_row_order), is made once and kept, not once per layer (2-5 s a 70B q4_0 layer)."""

    __slots__ = ("_rows",)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._rows: PackedWeight | None = None

    def to_rows(self) -> PackedWeight:
        if self._rows is None:
            self._rows = super().to_rows()
        return self._rows


class MetaSource:
    """Weights of the right shapes, formats and byte sizes that exist nowhere (meta tensors), for a timed
    simulation: the executor places and schedules them like real ones, and nothing reads them. A GGUF model
    with quantization 'none' gets each linear in the format its file stores it in."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, quantization: str = "none"):
        if quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization {quantization!r} is not supported; use one of {', '.join(QUANTIZATIONS)}")
        self.spec, self.dtype, self.quantization = spec, dtype, quantization
        self.weight_format = AS_STORED if spec.from_gguf and quantization == "none" else quantization

    def _tensor(self, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype or self.dtype, device="meta")

    def _linear(self, t: TensorSpec):
        """A meta weight [out, in] in the format the plan holds tensor t in."""
        out_features, in_features = t.shape
        fmt = "none" if self.weight_format == "none" else t.held_format(self.weight_format, "fp32")
        if fmt in FLOAT_FORMATS or fmt == "none":
            dtype = torch_dtype(fmt) if fmt == KEPT_FLOAT and self.weight_format == AS_STORED else None
            return self._tensor(out_features, in_features, dtype=dtype)
        if fmt in GGUF_BLOCKS:
            per_block, block_bytes = GGUF_BLOCKS[fmt]
            qs = self._tensor(out_features, in_features // per_block * block_bytes, dtype=torch.uint8)
            return PackedWeight(fmt, (out_features, in_features), qs, None)
        q8 = fmt == "q8_0"
        qs = self._tensor(out_features, in_features if q8 else in_features // 2,
                          dtype=torch.int8 if q8 else torch.uint8)
        d = self._tensor(out_features, in_features // QK, dtype=torch.float16)
        return PackedWeight(fmt, (out_features, in_features), qs, d, tiled=TILED)

    def _fused(self, parts: list[TensorSpec]):
        """Linears fused along the output dimension, or stacked where their formats differ."""
        weights = [self._linear(t) for t in parts]
        kinds = {(getattr(w, "fmt", None), getattr(w, "dtype", None)) for w in weights}
        if len(kinds) > 1:
            return StackedWeight(tuple(weights))
        merged = TensorSpec(parts[0].name, (sum(t.shape[0] for t in parts), parts[0].shape[1]), "linear",
                            parts[0].stored)
        return self._linear(merged)

    def load(self, unit: UnitSpec):
        s = self.spec
        if unit.kind in ("embed", "norm"):
            return self._tensor(*unit.tensors[0].shape)
        if unit.kind == "lm_head":
            return self._linear(unit.tensors[0])
        if unit.kind == "experts":
            linears = [t for t in unit.tensors if t.role == "linear"]  # gate, up, down of each expert in turn
            return ExpertWeights(self._tensor(*unit.tensors[0].shape),
                                 tuple(self._fused(linears[j:j + 2]) for j in range(0, len(linears), 3)),
                                 tuple(self._linear(t) for t in linears[2::3]), **expert_biases(s, self._tensor))
        by_name = {t.name: t for t in unit.tensors}

        def field(names: tuple[str, ...] | None, linear: bool):
            if names is None:
                return None
            if linear:
                return self._fused([by_name[n] for n in names]) if len(names) > 1 else self._linear(by_name[names[0]])
            return self._tensor(sum(by_name[n].shape[0] for n in names), *by_name[names[0]].shape[1:])

        fields = unit_tensor_names(s, unit)
        weights = {name: field(names, name in LINEAR_FIELDS) for name, names in fields.items()}
        return (MLPWeights if unit.kind == "mlp" else LayerWeights)(**weights)

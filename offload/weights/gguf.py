"""GGUF model files: the architecture from the file's metadata, tensors used as they are stored, the tokenizer.

A GGUF file (or a split set `name-00001-of-0000N.gguf`) is parsed with gguf-py's reader for its metadata and
tensor table; tensor bytes are then read with pread into memory of their own (as the safetensors reader does:
the pages of a mapped file would stay in the resident set). Quantized tensors keep their bytes: q8_0 and q4_0
go into offload's split layout (the same blocks), q4_1 and the K-quants stay GGUF blocks; float tensors are
converted to the compute format. llama.cpp's converter permutes the rows of llama's q and k weights for its
rope; the rows are put back (a row permutation moves whole rows of blocks, so it is exact for every format).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from offload.errors import WeightsError
from offload.formats import GGUF_NAMES
from offload.paths import cache_dir
from offload.spec import ModelSpec, spec_from_config

SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")
# GGUF general.architecture -> ours (a llama file with experts is Mixtral, as llama.cpp's converter writes it)
ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen2moe": "qwen2_moe",
                 "qwen3moe": "qwen3_moe"}

# Hugging Face module of a layer -> its GGUF tensor (blk.N.<name>); a MoE layer's routed experts are not here: each
# expert is a slice of the layer's stacked ffn_{gate,up,down}_exps tensors (see tensor_map)
_LAYER_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
                "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
                "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
                "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
                "mlp.shared_expert_gate": "ffn_gate_inp_shexp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
                "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp"}
_TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_EXPERT_PROJS = ("gate", "up", "down")  # the order of ModelSpec.expert_names
TABLE_VERSION = 1  # of the cached metadata/tensor tables (cache_dir()/gguf)
_TABLES: dict[Path, dict] = {}  # tables read in this process, by their cache path (which names size and mtime)
LONG_ARRAY = 1024  # metadata arrays longer than this (vocabulary, merges, scores) keep only their length
_LLAMA3_FACTORS = (8.0, 16.0, 32.0)  # rope factors of the Llama 3.1 / 3.2 / 3.3 releases, tried against rope_freqs


def is_gguf(path: str | os.PathLike) -> bool:
    return str(path).lower().endswith(".gguf")


@dataclass(frozen=True)
class GGUFTensor:
    """Where one tensor's bytes are: file, offset and size; its GGUF type and its torch shape [out, in]."""

    name: str  # the GGUF name (an expert's slice of a stacked tensor: name[e])
    path: Path
    offset: int
    n_bytes: int
    ggml_type: str  # Q4_K, F32, ...
    shape: tuple[int, ...]

    @property
    def fmt(self) -> str | None:
        """offload's name of the tensor's type, None for a type offload does not compute with."""
        return GGUF_NAMES.get(self.ggml_type)


def shard_paths(path: Path) -> list[Path]:
    """Every file of a split GGUF model given any of its shards (or the one file of an unsplit one)."""
    m = SPLIT_NAME.match(path.name)
    if not m:
        return [path]
    count = int(m["count"])
    paths = [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    for p in paths:
        if not p.is_file():
            raise WeightsError(f"{p.name} is missing: {path.name} is one of {count} shards of a split GGUF model; "
                               f"download every shard into {path.parent}")
    return paths


class GGUFFile:
    """The metadata and tensor table of a GGUF model (one file or all shards of a split one)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise WeightsError(f"GGUF file {self.path} does not exist; check the path or download the model")
        self.fields: dict[str, object] = {}
        self.array_lengths: dict[str, int] = {}  # long arrays (the vocabulary, merges): only their lengths
        self.tensors: dict[str, GGUFTensor] = {}  # by GGUF name
        for shard in shard_paths(self.path):
            self._add(shard, _table(shard))
        self.architecture = str(self.fields.get("general.architecture", ""))

    def _add(self, path: Path, table: dict) -> None:
        size = path.stat().st_size
        for key, value in table["fields"].items():
            self.fields.setdefault(key, value)
        for key, n in table["array_lengths"].items():
            self.array_lengths.setdefault(key, n)
        for name, offset, n_bytes, ggml_type, shape in table["tensors"]:
            if offset + n_bytes > size:
                raise WeightsError(f"{path} is truncated: tensor {name} ends at byte {offset + n_bytes} but the file "
                                   f"has {size}; download it again")
            self.tensors[name] = GGUFTensor(name, path, offset, n_bytes, ggml_type, tuple(shape))

    def get(self, key: str, default=None):
        return self.fields.get(key, default)

    def has(self, key: str) -> bool:
        """Whether the metadata holds key (a long array counts though only its length is kept)."""
        return key in self.fields or key in self.array_lengths

    def arch_key(self, key: str, default=None):
        """A metadata value of the model's architecture namespace (llama.block_count, ...)."""
        return self.fields.get(f"{self.architecture}.{key}", default)

    drop_after_read = False  # leave the page cache none of the bytes read (a run whose plan keeps them elsewhere)

    def read(self, tensor: GGUFTensor) -> np.ndarray:
        """The tensor's bytes (uint8, its own memory)."""
        from offload.weights.loader import pread_into  # torch comes with it: a plan reads no tensor
        raw = np.empty(tensor.n_bytes, dtype=np.uint8)
        fd = os.open(tensor.path, os.O_RDONLY)
        try:
            got = pread_into(fd, memoryview(raw), tensor.offset, self.drop_after_read)
        finally:
            os.close(fd)
        if got != tensor.n_bytes:
            raise WeightsError(f"{tensor.path} ended while reading tensor {tensor.name} ({got} of {tensor.n_bytes} "
                               f"bytes); download it again")
        return raw


def _table(path: Path) -> dict:
    """The metadata and tensor table of one GGUF file: from the table cache when this file (path, size, mtime)
    was read before, else parsed with gguf-py's reader (seconds for a 50k-token vocabulary) and cached."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise WeightsError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF'); "
                           f"download it again or pass the model's folder instead")
    cached = table_cache_path(path)
    if cached in _TABLES:
        return _TABLES[cached]
    try:
        table = _TABLES[cached] = json.loads(cached.read_text())
        return table
    except (OSError, ValueError):
        pass
    table = _TABLES[cached] = _parse(path)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table))
        tmp.replace(cached)
    except OSError:  # a read-only cache: parse again next time
        pass
    return table


def table_cache_path(path: Path) -> Path:
    """Where the parsed table of a GGUF file is kept: keyed by its resolved path, size and modification time."""
    st = path.stat()
    key = hashlib.sha1(f"{TABLE_VERSION}|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:20]
    return cache_dir() / "gguf" / f"{path.stem[:60]}-{key}.json"


def _parse(path: Path) -> dict:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path, "r")
    except Exception as e:  # gguf-py raises ValueError/IndexError/struct errors on a cut or corrupt header
        raise WeightsError(f"{path} is truncated or corrupt ({type(e).__name__}: {e}); download it again") from e
    fields, lengths = {}, {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if len(field.data) > LONG_ARRAY:
            lengths[key] = len(field.data)
        else:
            fields[key] = _field_value(field)
    tensors = [[t.name, int(t.data_offset), int(t.n_bytes), t.tensor_type.name,
                [int(n) for n in reversed(t.shape.tolist())]] for t in reader.tensors]
    del reader  # drops the file's memory map
    return {"fields": fields, "array_lengths": lengths, "tensors": tensors}


def _field_value(field):
    """A metadata field as a JSON-safe Python value (str, number, bool or list of them); None where gguf-py
    cannot decode it."""
    try:
        value = field.contents()
    except Exception:  # a field gguf-py cannot decode: keep it out of the metadata rather than fail
        return None
    return json.loads(json.dumps(value, default=lambda o: o.item() if hasattr(o, "item") else str(o)))


def gguf_name(hf: str) -> str | None:
    """The GGUF name of a Hugging Face tensor name (model.layers.3.self_attn.q_proj.weight -> blk.3.attn_q.weight);
    None for a routed expert's (a slice of a stacked tensor: see tensor_map) or an unknown name."""
    module, _, suffix = hf.rpartition(".")
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", module)
    if m:
        short = _LAYER_NAMES.get(m[2])
        return f"blk.{m[1]}.{short}.{suffix}" if short else None
    return f"{_TOP_NAMES[module]}.{suffix}" if module in _TOP_NAMES else None


def gguf_locations(spec: ModelSpec) -> dict[str, tuple[str | None, int | None]]:
    """Each tensor of spec by Hugging Face name: the GGUF tensor that holds it, and for a routed expert its index in
    that layer's stacked [n_experts, out, in] tensor (None: the whole tensor)."""
    where: dict[str, tuple[str | None, int | None]] = {ts.name: (gguf_name(ts.name), None) for ts in spec.tensors()}
    for i in range(spec.n_layers):
        if spec.is_moe_layer(i):
            for e in range(spec.moe.n_experts):
                for proj, name in zip(_EXPERT_PROJS, spec.expert_names(i, e)):
                    where[name] = (f"blk.{i}.ffn_{proj}_exps.weight", e)
    return where


def tensor_map(gf: GGUFFile, spec: ModelSpec) -> dict[str, GGUFTensor]:
    """Where each tensor of spec is in the file, by Hugging Face name: a GGUF tensor, or for a routed expert its
    slice of the stacked tensor (contiguous: expert e's rows follow expert e-1's). Tensors the file lacks are left
    out (check_tensors names them)."""
    shapes = {ts.name: ts.shape for ts in spec.tensors()}
    found = {}
    for hf, (name, expert) in gguf_locations(spec).items():
        t = gf.tensors.get(name or "")
        if t is None:
            continue
        if expert is not None:
            t = _expert_slice(t, expert, spec.moe.n_experts)
        elif len(t.shape) == 1 and shapes[hf] == (1, t.shape[0]):
            t = replace(t, shape=shapes[hf])  # a [1, D] gate some converters store as [D]: the same bytes
        found[hf] = t
    return found


def _expert_slice(t: GGUFTensor, e: int, n_experts: int) -> GGUFTensor:
    """Expert e's [out, in] of a stacked experts tensor; a tensor not shaped [n_experts, out, in] is returned whole
    under the slice's name, so check_tensors reports its shape."""
    name = f"{t.name}[{e}]"
    if len(t.shape) != 3 or t.shape[0] != n_experts or t.n_bytes % n_experts:
        return replace(t, name=name)
    n_bytes = t.n_bytes // n_experts
    return replace(t, name=name, offset=t.offset + e * n_bytes, n_bytes=n_bytes, shape=t.shape[1:])


def gguf_config(gf: GGUFFile) -> dict:
    """A config.json-style dict for the model in gf (what spec_from_config reads)."""
    arch = gf.architecture
    if arch not in ARCHITECTURES:
        raise WeightsError(f"{gf.path}: GGUF architecture {arch or 'missing'!r} is not supported; offload runs "
                           f"{', '.join(ARCHITECTURES)} models")
    model_type = ARCHITECTURES[arch]
    if model_type == "llama" and gf.arch_key("expert_count"):
        model_type = "mixtral"  # llama.cpp stores Mixtral as llama with experts
    elif model_type == "llama" and "mistral" in str(gf.get("general.name", "")).lower():
        model_type = "mistral"  # llama.cpp stores mistral models as llama
    n_heads = gf.arch_key("attention.head_count")
    hidden = gf.arch_key("embedding_length")
    embed = gf.tensors.get("token_embd.weight")
    vocab = (gf.arch_key("vocab_size") or gf.array_lengths.get("tokenizer.ggml.tokens")
             or len(gf.get("tokenizer.ggml.tokens") or ()) or (embed.shape[0] if embed else None))
    config = {
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": gf.arch_key("feed_forward_length"),
        "num_hidden_layers": gf.arch_key("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": gf.arch_key("attention.head_count_kv") or n_heads,
        "rms_norm_eps": gf.arch_key("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": gf.arch_key("rope.freq_base", 10000.0),
        "max_position_embeddings": gf.arch_key("context_length"),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in gf.tensors,
        "bos_token_id": gf.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": gf.get("tokenizer.ggml.eos_token_id"),
        "attention_bias": model_type not in ("qwen2", "qwen2_moe") and "blk.0.attn_q.bias" in gf.tensors,
        "qkv_bias": "blk.0.attn_q.bias" in gf.tensors,  # read for qwen2_moe
        "mlp_bias": "blk.0.ffn_up.bias" in gf.tensors,
        "torch_dtype": "float32",
        **_moe_config(gf, model_type),
    }
    key_length = gf.arch_key("attention.key_length")
    if key_length:
        config["head_dim"] = key_length
    rope = _rope_scaling(gf, config)
    if rope:
        config["rope_scaling"] = rope
    window = gf.arch_key("attention.sliding_window")
    if window and model_type == "mistral":
        config["sliding_window"] = window
    return config


def _moe_config(gf: GGUFFile, model_type: str) -> dict:
    """The config.json keys of a Mixtral, Qwen2-MoE or Qwen3-MoE file's experts, as llama.cpp reads its metadata."""
    if model_type not in ("mixtral", "qwen2_moe", "qwen3_moe"):
        return {}
    n_experts, top_k = gf.arch_key("expert_count"), gf.arch_key("expert_used_count")
    for key, value in (("expert_count", n_experts), ("expert_used_count", top_k)):
        if not value:
            raise WeightsError(f"{gf.path}: metadata key {gf.architecture}.{key} is missing or 0, which a "
                               f"{gf.architecture} mixture of experts needs; convert the model again with llama.cpp")
    if model_type == "mixtral":  # its feed_forward_length is the expert width; every layer is MoE
        return {"num_local_experts": n_experts, "num_experts_per_tok": top_k}
    ff = gf.arch_key("feed_forward_length") or 0
    config = {"num_experts": n_experts, "num_experts_per_tok": top_k, "decoder_sparse_step": 1, "mlp_only_layers": [],
              # llama.cpp's defaults where a width is absent (src/models/qwen2moe.cpp, qwen3moe.cpp)
              "moe_intermediate_size": gf.arch_key("expert_feed_forward_length") or ff // top_k,
              # llama.cpp's qwen3moe graph always renormalises each token's top-k weights and its qwen2moe graph
              # never does; neither reads expert_weights_norm, so neither does offload
              "norm_topk_prob": model_type == "qwen3_moe"}
    if model_type == "qwen2_moe":
        config["shared_expert_intermediate_size"] = gf.arch_key("expert_shared_feed_forward_length") or ff
    config["intermediate_size"] = ff or config["moe_intermediate_size"]  # a dense MLP's width: no layer has one
    return config


def _rope_scaling(gf: GGUFFile, config: dict) -> dict | None:
    """rope_scaling from GGUF metadata: linear scaling by key; Llama 3's by matching the rope_freqs tensor."""
    kind = gf.arch_key("rope.scaling.type")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(gf.arch_key("rope.scaling.factor", 1.0))}
    if kind not in (None, "none"):
        raise WeightsError(f"{gf.path}: rope scaling {kind!r} is not supported; offload supports linear scaling "
                           f"and Llama 3's")
    freqs = gf.tensors.get("rope_freqs.weight")
    if freqs is None:
        return None
    factors = gf.read(freqs).view(np.float32) if freqs.ggml_type == "F32" else None
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    for factor in _LLAMA3_FACTORS:
        rope = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
        if factors is not None and np.allclose(factors, _llama3_factors(rope, config["rope_theta"], head_dim),
                                               rtol=1e-3):
            return rope
    raise WeightsError(f"{gf.path}: its rope_freqs tensor matches no Llama 3 rope scaling offload knows "
                       f"(factors {', '.join(str(f) for f in _LLAMA3_FACTORS)}); use the model's safetensors release")


def _llama3_factors(rope: dict, theta: float, head_dim: int) -> np.ndarray:
    """The per-frequency divisors llama.cpp stores as rope_freqs for Llama 3 rope scaling."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    old = rope["original_max_position_embeddings"]
    low, high = old / rope["low_freq_factor"], old / rope["high_freq_factor"]
    smooth = (old / wavelen - rope["low_freq_factor"]) / (rope["high_freq_factor"] - rope["low_freq_factor"])
    out = np.where(wavelen < high, 1.0, np.where(wavelen > low, rope["factor"],
                                                 1.0 / ((1 - smooth) / rope["factor"] + smooth)))
    return out.astype(np.float32)


def gguf_spec(gf: GGUFFile) -> ModelSpec:
    """The ModelSpec of a GGUF model, with each tensor's stored format."""
    spec = spec_from_config(gguf_config(gf), source=str(gf.path))
    return spec.with_stored_formats({hf: t.fmt or t.ggml_type for hf, t in tensor_map(gf, spec).items()})


def check_tensors(gf: GGUFFile, spec: ModelSpec, requantize: bool) -> None:
    """Every tensor the spec needs is in the file with the right shape and a type offload computes with (or the
    user asked for a quantization, and other types gguf-py dequantizes are quantized again, with a warning)."""
    found, where = tensor_map(gf, spec), gguf_locations(spec)
    odd: dict[str, GGUFTensor] = {}
    for ts in spec.tensors():
        t = found.get(ts.name)
        if t is None:
            name, expert = where[ts.name]
            what = f"GGUF name {name}" + (f", expert {expert}" if expert is not None else "")
            raise WeightsError(f"{gf.path} has no tensor for {ts.name} ({what}); the file is incomplete or not a "
                               f"{spec.architecture} model — download it again")
        if t.shape != ts.shape:
            raise WeightsError(f"tensor {t.name} in {gf.path} has shape {list(t.shape)} but the metadata implies "
                               f"{list(ts.shape)}; the file is corrupt — download it again")
        if t.fmt is None:
            odd.setdefault(t.name.split("[")[0], t)  # a stacked experts tensor counts once
    stuck = next((t for t in odd.values() if not _gguf_py_dequantizes(t.ggml_type)), None)
    if stuck or (odd and not requantize):
        t = stuck or next(iter(odd.values()))
        fix = ("gguf-py cannot dequantize it to convert it either; use" if stuck else
               "pass a quantization (q8_0 or q4_0) to convert it, or use")
        raise WeightsError(f"tensor {t.name} in {gf.path} is stored as {t.ggml_type}, which offload does not compute "
                           f"with (it reads {', '.join(GGUF_NAMES)}); {fix} a file of a supported type")
    if odd:
        warnings.warn(f"{len(odd)} tensors of {gf.path.name} are stored as "
                      f"{', '.join(sorted({t.ggml_type for t in odd.values()}))}, which offload does not compute "
                      f"with; they are dequantized and quantized again, which loses some accuracy", stacklevel=3)


def _gguf_py_dequantizes(ggml_type: str) -> bool:
    """Whether gguf-py's quants.dequantize has code for a type (it raises NotImplementedError where it has none):
    tried on one block of zeros."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[ggml_type]
    try:
        quants.dequantize(np.zeros(GGML_QUANT_SIZES[qtype][1], dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True

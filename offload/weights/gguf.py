"""GGUF model files: the metadata and tensor table, where each tensor of the spec is, tensors used as stored.

A GGUF file (or a split set `name-00001-of-0000N.gguf`) is parsed with gguf-py's reader for its metadata and
tensor table; tensor bytes are then read with pread into memory of their own (as the safetensors reader does:
the pages of a mapped file would stay in the resident set). gguf_config.py makes the ModelSpec of its metadata; a
tensor's GGUF name is its family's (offload/families.py). Quantized tensors keep their bytes: q8_0 and q4_0
go into offload's split layout (the same blocks), q4_1 and the K-quants stay GGUF blocks; float tensors are
converted to the compute format. llama.cpp's converter permutes the rows of llama-type q and k weights for its
rope (Family.gguf_permuted); the rows are put back (a row permutation moves whole rows of blocks, so it is exact
for every format). Gemma's norms are stored with the 1 its converter adds, so they are used as stored.
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
from offload.families import Family, gguf_layer_names
from offload.formats import GGUF_NAMES
from offload.paths import cache_dir
from offload.spec import ModelSpec

SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")
_TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_EXPERT_PROJS = ("gate", "up", "down")  # the order of ModelSpec.expert_names
TABLE_VERSION = 1  # of the cached metadata/tensor tables (cache_dir()/gguf)
_TABLES: dict[Path, dict] = {}  # tables read in this process, by their cache path (which names size and mtime)
LONG_ARRAY = 1024  # metadata arrays longer than this (vocabulary, merges, scores) keep only their length


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


def gguf_name(hf: str, family: Family) -> str | None:
    """The GGUF name of a Hugging Face tensor name in a file of this family (model.layers.3.self_attn.q_proj.weight
    -> blk.3.attn_q.weight); None for a routed expert's (a slice of a stacked tensor: see tensor_map) or an unknown
    name."""
    module, _, suffix = hf.rpartition(".")
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf)
    if m:
        names = gguf_layer_names(family)
        if m[2] in names:  # a tensor with no suffix (gpt-oss's self_attn.sinks): the converter names it .weight
            return f"blk.{m[1]}.{names[m[2]]}.weight"
        module, _, suffix = m[2].rpartition(".")
        short = names.get(module)
        return f"blk.{m[1]}.{short}.{suffix}" if short else None
    return f"{_TOP_NAMES[module]}.{suffix}" if module in _TOP_NAMES else None


def gguf_locations(spec: ModelSpec) -> dict[str, tuple[str | None, int | None]]:
    """Each tensor of spec by Hugging Face name: the GGUF tensor that holds it, and for a routed expert its index in
    that layer's stacked [n_experts, out, in] tensor (None: the whole tensor). gpt-oss's experts' biases are stacked
    the same way ([n_experts, out]); its interleaved gate|up is stored as separate gate and up stacks, as any
    family's."""
    where: dict[str, tuple[str | None, int | None]] = {ts.name: (gguf_name(ts.name, spec.family), None)
                                                       for ts in spec.tensors()}
    for i in range(spec.n_layers):
        if spec.is_moe_layer(i):
            for e in range(spec.moe.n_experts):
                for proj, name in zip(_EXPERT_PROJS, spec.expert_names(i, e)):
                    where[name] = (f"blk.{i}.ffn_{proj}_exps.weight", e)
                for proj, name in zip(_EXPERT_PROJS, spec.expert_bias_names(i, e) if spec.moe.biases else ()):
                    where[name] = (f"blk.{i}.ffn_{proj}_exps.bias", e)
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
    """Expert e's [out, in] of a stacked experts tensor (its [out] of stacked biases); a tensor not shaped
    [n_experts, out, in] or [n_experts, out] is returned whole under the slice's name, so check_tensors reports its
    shape."""
    name = f"{t.name}[{e}]"
    if len(t.shape) not in (2, 3) or t.shape[0] != n_experts or t.n_bytes % n_experts:
        return replace(t, name=name)
    n_bytes = t.n_bytes // n_experts
    return replace(t, name=name, offset=t.offset + e * n_bytes, n_bytes=n_bytes, shape=t.shape[1:])


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

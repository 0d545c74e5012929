"""The packed-weight cache: quantized weights written on the first load of a checkpoint, read on later loads.

Loading with quantization q8_0/q4_0 reads every bf16/fp32 weight and packs it (quantized, tiled for the CPU
kernels); for an 8B model that is most of the load. The first such load also writes each layer (and each MoE
layer's experts unit) and the lm_head,
as the packer gives them, to $OFFLOAD_CACHE/packed/<key>/ as safetensors files, one per unit: PackedWeight
quants and scales exactly as the kernels take them, plus the layer's norms and biases in the compute dtype.
Later loads read those instead. The embedding and final norm are not cached: nothing quantizes them, so they
are read from the checkpoint as before.

<key> hashes LAYOUT_VERSION, the quantization, the compute dtype, the tiling flag and a fingerprint of the
checkpoint that reads no weights: each file's name, size and mtime, each safetensors header, config.json. A
changed checkpoint gets a new key; the entry of its old state is removed once the new one is complete. An entry
is written in a temporary folder and renamed into place when complete, so a crash never leaves one that is
used. If the cache cannot be written (read-only, disk full) loading warns once and goes on without it.
OFFLOAD_PACKED_CACHE=0 turns the cache off. Tensors are read back with the loader's pread into memory of their
own, never through a memory map (see loader.py), one unit at a time: the model is never held twice.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import struct
import time
import uuid
import weakref
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable

import torch

from offload.errors import WeightsError
from offload.formats import format_of_dtype
from offload.model.llama import LayerWeights, MLPWeights
from offload.model.moe import ExpertWeights
from offload.paths import cache_dir
from offload.spec import ModelSpec, UnitSpec
from offload.weights.extents import unit_extents
from offload.weights.loader import _DTYPES, INDEX_NAME, Checkpoint

log = logging.getLogger(__name__)

LAYOUT_VERSION = 1  # bump when a unit file's tensors, names or PackedWeight's byte order change
PACKED_CACHE_ENV = "OFFLOAD_PACKED_CACHE"  # 0 turns the cache off
CACHED_KINDS = ("layer", "experts", "mlp", "lm_head")  # the units the packer touches
ENTRY_FILE = "entry.json"
TMP_PREFIX = ".tmp-"
MIN_FREE_BYTES = 1 << 30  # stop writing rather than leave less than this free on the cache's disk
_ST_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def packed_root() -> Path:
    """Where entries live: <cache_dir()>/packed."""
    return cache_dir() / "packed"


def cache_enabled() -> bool:
    return os.environ.get(PACKED_CACHE_ENV, "1") != "0"


def checkpoint_fingerprint(ckpt: Checkpoint) -> list:
    """[name, bytes, mtime_ns, sha256 of the safetensors header or of the (small) JSON file] per file; no weights read."""
    files = [*ckpt.files, ckpt.folder / "config.json", ckpt.folder / INDEX_NAME]
    out = []
    for path in (p for p in files if p.is_file()):
        st = path.stat()
        with path.open("rb") as f:
            if path.suffix == ".safetensors":
                (n,) = struct.unpack("<Q", f.read(8))
                head = f.read(n)
            else:
                head = f.read()
        out.append([path.name, st.st_size, st.st_mtime_ns, hashlib.sha256(head).hexdigest()])
    return out


def cache_key(ckpt: Checkpoint, quantization: str, dtype_name: str, tiled: bool, split_mlp: bool = False) -> str:
    """The entry's name; a plan that splits the dense MLPs off has units of other contents, so an entry of its own."""
    parts = [LAYOUT_VERSION, quantization, dtype_name, tiled, checkpoint_fingerprint(ckpt)]
    blob = json.dumps(parts + (["split_mlp"] if split_mlp else []))
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def open_packed_cache(ckpt: Checkpoint, spec: ModelSpec, dtype: torch.dtype, quantization: str) -> "PackedCache | None":
    """The cache entry for this checkpoint and format (read if complete, else written as units load), or None
    when nothing is quantized or OFFLOAD_PACKED_CACHE=0."""
    if quantization == "none" or not cache_enabled():
        return None
    from offload.kernels import TILED

    meta = {"layout_version": LAYOUT_VERSION, "model": str(ckpt.folder.resolve()), "quantization": quantization,
            "dtype": format_of_dtype(dtype), "tiled": TILED}
    key = cache_key(ckpt, quantization, meta["dtype"], TILED, spec.split_mlp)
    names = [u.name for u in spec.units() if u.kind in CACHED_KINDS]
    return PackedCache(packed_root(), key, meta, names)


class PackedCache:
    """One entry: load(unit, read) gives the cached unit, or read(unit) stored for the next load."""

    def __init__(self, root: Path, key: str, meta: dict, names: list[str]):
        self.root, self.key, self.meta, self.names = root, key, meta, names
        self.folder = root / key
        opened = _open_entry(self.folder, names)
        self.entry, self.reader = opened if opened else (None, None)
        self.tmp: Path | None = None
        self.stored: dict[str, dict] = {}
        self.writing = self.reader is None
        self._cleanup = None
        if self.reader is not None:
            log.info(f"reading packed {meta['quantization']} weights from {self.folder}")

    def load(self, unit: UnitSpec, read: Callable[[UnitSpec], object]):
        if unit.kind not in CACHED_KINDS:
            return read(unit)
        if self.reader is not None:
            try:
                return self._read_unit(unit)
            except (OSError, WeightsError, KeyError) as e:  # removed or damaged while loading: the checkpoint still works
                log.warning(f"the packed-weight cache {self.folder} could not be read ({e}); "
                            f"reading and quantizing the checkpoint instead")
                self.reader = None
                return read(unit)
        weights = read(unit)
        if self.writing:
            try:
                self._store(unit.name, weights)
            except OSError as e:
                self._give_up(f"{e.strerror or e}" + (f": {e.filename}" if e.filename else ""))
        return weights

    def extents(self, unit: UnitSpec, layout):
        """Where the unit's buffer (layout) sits in this complete entry's files, or None (not complete yet, or
        the unit's tensors are not there as the layout holds them)."""
        if self.reader is None:
            opened = _open_entry(self.folder, self.names)
            if opened is None:
                return None
            self.entry, self.reader = opened
        if unit.name not in self.entry["units"]:
            return None
        reader = self.reader

        def locate(name: str, entry):
            # a dense entry is a tensor, or the quants plane of a half-precision packed weight
            stored_names = (name, name + ".qs") if entry.part == "dense" else (f"{name}.{entry.part}",)
            for stored in stored_names:
                if stored in reader:
                    path, offset, n_bytes, dtype = reader.where(stored)
                    return (path, offset, n_bytes, None) if dtype == entry.dtype else None
            return None

        fields = self.entry["units"][unit.name]["fields"]
        return unit_extents(layout, {f: (f"{unit.name}.{f}",) for f in fields}, locate)

    def _read_unit(self, unit: UnitSpec):
        parts = {}
        for field, desc in self.entry["units"][unit.name]["fields"].items():
            name = f"{unit.name}.{field}"
            if desc is None or desc == "tensor":
                parts[field] = None if desc is None else self.reader.get(name)
            else:
                from offload.kernels.packed import PackedWeight

                d = self.reader.get(name + ".d") if name + ".d" in self.reader else None
                parts[field] = PackedWeight(desc["fmt"], tuple(desc["shape"]), self.reader.get(name + ".qs"), d,
                                            tiled=desc["tiled"])
        if unit.kind == "experts":  # each expert's fields (gate_up#e, down#e, their biases) as tuples
            grouped: dict[str, list] = {}
            for name in sorted((k for k in parts if "#" in k), key=lambda k: int(k.rsplit("#", 1)[1])):
                grouped.setdefault(name.split("#")[0], []).append(parts[name])
            return ExpertWeights(**{k: v for k, v in parts.items() if "#" not in k},
                                 **{k: tuple(v) for k, v in grouped.items()})
        if unit.kind == "mlp":
            return MLPWeights(**parts)
        return LayerWeights(**parts) if unit.kind == "layer" else parts["weight"]

    def _store(self, name: str, weights) -> None:
        if self.tmp is None:
            self._start()
        tensors, described = _flatten(name, weights)
        n_bytes = sum(t.nbytes for t in tensors.values())
        free = shutil.disk_usage(self.tmp).free
        if free - n_bytes < MIN_FREE_BYTES:
            raise OSError(f"only {free / 2**30:.1f} GiB free, and offload leaves {MIN_FREE_BYTES / 2**30:.0f} GiB")
        file = f"{name}.safetensors"
        self.stored[name] = {"file": file, "n_bytes": write_safetensors(self.tmp / file, tensors),
                             "fields": described}
        if len(self.stored) == len(self.names):
            self._finish()

    def _start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(f"{TMP_PREFIX}{self.key}-*"):
            if not _writer_alive(stale):
                shutil.rmtree(stale, ignore_errors=True)
        self.tmp = self.root / f"{TMP_PREFIX}{self.key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.tmp.mkdir()
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.tmp, True)  # a load that stops midway
        _write_json(self.tmp / ENTRY_FILE, {**self.meta, "created_s": time.time(), "units": {}})
        log.info(f"writing packed {self.meta['quantization']} weights to the cache {self.root} for later loads")

    def _finish(self) -> None:
        _write_json(self.tmp / ENTRY_FILE, {**self.meta, "created_s": time.time(), "units": self.stored})
        self.writing = False
        if _open_entry(self.folder, self.names) is not None:  # another process finished first
            self._cleanup()
            return
        shutil.rmtree(self.folder, ignore_errors=True)  # an invalid leftover, never a complete entry
        os.rename(self.tmp, self.folder)
        for entry in list_entries(self.root):
            if entry.path != self.folder and entry.complete and entry.same_model_and_format(self.meta):
                shutil.rmtree(entry.path, ignore_errors=True)  # the checkpoint's previous state

    def _give_up(self, reason: str) -> None:
        log.warning(f"could not write the packed-weight cache in {self.root} ({reason}); loading goes on without "
                    f"it (set {PACKED_CACHE_ENV}=0 to stop trying)")
        self.writing = False
        if self._cleanup is not None:
            self._cleanup()


def _flatten(name: str, weights) -> tuple[dict[str, torch.Tensor], dict]:
    """A unit's tensors by file name (<unit>.<field>[.qs|.d]) and each field's description (None, 'tensor',
    or a PackedWeight's fmt, shape and tiling)."""
    from offload.kernels.packed import PackedWeight

    if isinstance(weights, (LayerWeights, MLPWeights)):
        parts = {f.name: getattr(weights, f.name) for f in fields(weights)}
    elif isinstance(weights, ExpertWeights):  # each expert's by the names unit_store lays them out under
        parts = {}
        for f in fields(weights):
            value = getattr(weights, f.name)
            parts.update({f"{f.name}#{e}": w for e, w in enumerate(value)} if isinstance(value, tuple)
                         else {f.name: value})
    else:
        parts = {"weight": weights}
    tensors, described = {}, {}
    for field, value in parts.items():
        key = f"{name}.{field}"
        if isinstance(value, PackedWeight):
            described[field] = {"fmt": value.fmt, "shape": list(value.shape), "tiled": value.tiled}
            tensors[key + ".qs"] = value.qs
            if value.d is not None:
                tensors[key + ".d"] = value.d
        else:
            described[field] = None if value is None else "tensor"
            if value is not None:
                tensors[key] = value
    return tensors, described


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> int:
    """Write tensors as one safetensors file straight from their memory (fsynced); returns its size in bytes."""
    header, offset = {}, 0
    for name, t in tensors.items():
        header[name] = {"dtype": _ST_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data section starts 8-aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for t in tensors.values():
            f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(head) + offset


def _write_json(path: Path, data: dict) -> None:
    part = path.with_suffix(".part")
    part.write_text(json.dumps(data, indent=1))
    os.replace(part, path)


def _open_entry(folder: Path, names: list[str]) -> tuple[dict, Checkpoint] | None:
    """(entry.json, a reader of its files) if folder is a complete entry for these units, else None."""
    try:
        entry = json.loads((folder / ENTRY_FILE).read_text())
        units = entry["units"]
        if entry.get("layout_version") != LAYOUT_VERSION or set(units) != set(names):
            return None
        if any((folder / u["file"]).stat().st_size != u["n_bytes"] for u in units.values()):
            return None
        return entry, Checkpoint(folder)
    except (OSError, ValueError, KeyError, TypeError, WeightsError):
        return None


def _writer_alive(tmp: Path) -> bool:
    """Whether the process that writes a temporary entry (.tmp-<key>-<pid>-<id>) still runs."""
    try:
        os.kill(int(tmp.name.split("-")[-2]), 0)
    except (ValueError, IndexError, ProcessLookupError):
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


@dataclass(frozen=True)
class CacheEntry:
    """One folder under packed/: a complete entry, or one being written (or left by a crash)."""

    path: Path
    model: str
    quantization: str
    dtype: str
    tiled: bool
    n_bytes: int
    created_s: float
    complete: bool

    def same_model_and_format(self, meta: dict) -> bool:
        return (self.model, self.quantization, self.dtype, self.tiled) == (
            meta["model"], meta["quantization"], meta["dtype"], meta["tiled"])


def list_entries(root: Path | None = None) -> list[CacheEntry]:
    """Every folder under the packed cache, oldest first."""
    root = packed_root() if root is None else root
    entries = []
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        try:
            meta = json.loads((folder / ENTRY_FILE).read_text())
        except (OSError, ValueError):
            meta = {}
        try:
            n_bytes = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
            mtime_s = folder.stat().st_mtime
        except OSError:  # not a folder, or renamed or removed by a load that finished meanwhile
            continue
        complete = not folder.name.startswith(TMP_PREFIX) and bool(meta.get("units"))
        entries.append(CacheEntry(folder, meta.get("model", "?"), meta.get("quantization", "?"),
                                  meta.get("dtype", "?"), bool(meta.get("tiled")), n_bytes,
                                  meta.get("created_s", mtime_s), complete))
    return sorted(entries, key=lambda e: e.created_s)


def remove_entry(entry: CacheEntry) -> bool:
    """Delete an entry's folder; False (and kept) if it is being written by a running process."""
    if entry.path.name.startswith(TMP_PREFIX) and _writer_alive(entry.path):
        return False
    shutil.rmtree(entry.path)
    return True

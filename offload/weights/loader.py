"""Checkpoint: lazy access to the tensors of a safetensors model (single file or sharded), one read per tensor.

Tensors are read with pread into memory of their own, not through a memory map: the pages of a mapped
checkpoint stay in the process's resident set while it is open, which made loading a model peak at its size
twice over (weights in their buffers plus the file's pages) against a host budget that counts both.
"""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import torch

from offload.planner.costs import DROP_PIECE_BYTES, READ_AHEAD_TRAIL_BYTES
from offload.errors import WeightsError
from offload.spec import ModelSpec
from offload.weights import mxfp4

INDEX_NAME = "model.safetensors.index.json"
# a multimodal checkpoint's text model (Gemma 3's Gemma3ForConditionalGeneration): its tensors' prefixes as
# transformers 5 and 4 write them -> the text-only names; the vision tower's tensors are left unread
TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                 ("language_model.lm_head.", "lm_head."))
LFS_MAGIC = b"version https://git-lfs.github.com/spec"
_HEADER_LIMIT_BYTES = 100 * 1024 * 1024
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}  # safetensors dtype names
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # what a weight, norm or embedding may be stored as


def read_safetensors_header(path: Path) -> tuple[dict, int]:
    """(header, offset of the data section) of a safetensors file validated against its size; never reads data."""
    if not path.is_file():
        raise WeightsError(f"weights file {path} does not exist; download the checkpoint again")
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(64)
        if head.startswith(LFS_MAGIC):
            raise WeightsError(f"{path} is a git-lfs pointer file, not the weights; run `git lfs pull` "
                               f"in the model folder (or download the file itself)")
        if len(head) < 8:
            raise WeightsError(f"{path} is truncated ({size} bytes); download it again")
        (header_len,) = struct.unpack("<Q", head[:8])
        if header_len > min(size - 8, _HEADER_LIMIT_BYTES):
            raise WeightsError(f"{path} is not a valid safetensors file (header of {header_len} bytes in a "
                               f"{size}-byte file); it may be truncated or of another format — download it again")
        f.seek(8)
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise WeightsError(f"{path} has a corrupt safetensors header ({e}); download it again") from e
    data_end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + header_len + data_end > size:
        raise WeightsError(f"{path} is truncated: its header needs {8 + header_len + data_end} bytes but the "
                           f"file has {size}; download it again")
    return header, 8 + header_len




def pread_into(fd: int, view: memoryview, offset: int, drop: bool = False, trail: bool = True) -> int:
    """Read len(view) bytes at offset into view; returns the bytes read. With drop, the pages read are dropped
    from the page cache piece by piece, so the read never holds much more than a piece of it there; the OS's
    read-ahead, which keeps a cold read near the disk's speed, runs past it. With trail (a read on its own) fd
    is set to read nothing ahead and the range past the end is dropped too; a caller that reads on from there
    (the disk tier, unit by unit) passes trail=False and drops what was read past its last read itself."""
    n = len(view)
    if not drop:
        return os.preadv(fd, [view], offset) if n else 0
    if trail:  # a read on its own: without read-ahead, none of it lands in the page cache after the drop below
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    done = 0
    while done < n:
        got = os.preadv(fd, [view[done: done + DROP_PIECE_BYTES]], offset + done)
        os.posix_fadvise(fd, offset + done, got, os.POSIX_FADV_DONTNEED)
        if got <= 0:
            break
        done += got
    if trail:  # what the OS read ahead past the end
        os.posix_fadvise(fd, offset + done, READ_AHEAD_TRAIL_BYTES, os.POSIX_FADV_DONTNEED)
    return done


def _shard_names(index: Path, weight_map) -> list[str]:
    """The shard files a sharded index names, sorted; WeightsError unless each is a plain file name, so that an
    index can open nothing outside its model folder (`../../etc/passwd`, `/abs/path`, `sub/x.safetensors`)."""
    if not isinstance(weight_map, dict) or not all(isinstance(s, str) for s in weight_map.values()):
        raise WeightsError(f"{index} is not a valid sharded index ('weight_map' must map tensor names to shard "
                           f"file names); download it again")
    for shard in sorted(set(weight_map.values())):
        if shard in ("", ".", "..") or Path(shard).name != shard or "\\" in shard or "\0" in shard:
            raise WeightsError(f"{index} names shard {shard[:120]!r}, which is not a file name beside the index "
                               f"(it has path parts); a shard must sit in {index.parent}: fix the index's "
                               f"weight_map, or download the model again")
    return sorted(set(weight_map.values()))


_VIEW = re.compile(r"^(?P<stored>[^#]+)#(?P<e>\d+)(?::(?P<half>gate|up))?$")


def stacked_view(name: str) -> tuple[str, int, str | None] | None:
    """(stored tensor, e, half) of a view name stored#e[:gate|:up], or None for a plain name. gpt-oss's float
    checkpoints stack a layer's experts in one tensor, its matrices [n_experts, in, out] with gate and up
    interleaved along out: view e is expert e's [out, in] (its bias [out]), :gate its even rows, :up its odd."""
    m = _VIEW.match(name)
    return None if m is None else (m["stored"], int(m["e"]), m["half"])


class Checkpoint:
    """The tensors of one model folder, opened lazily; `get` reads one tensor through the file's mmap."""

    drop_after_read = False  # leave the page cache none of the bytes read (a run whose plan keeps them elsewhere)

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self._file_of: dict[str, Path] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._where: dict[str, tuple[int, int, str]] = {}  # name -> (file offset, bytes, safetensors dtype)
        self._stacked: tuple[str, torch.Tensor] | None = None  # the stacked tensor its views were last cut from
        self._stacked_parts: dict[str, torch.Tensor] = {}  # MXFP4 blocks and scales its views were last cut from
        self.files = self._weight_files()  # the safetensors files, in order
        for path in self.files:
            header, data_start = read_safetensors_header(path)
            for name, info in header.items():
                if name != "__metadata__":
                    self._file_of[name] = path
                    self._shapes[name] = tuple(info["shape"])
                    begin, end = info["data_offsets"]
                    self._where[name] = (data_start + begin, end - begin, info["dtype"])
        self._text_model_names()

    def _text_model_names(self) -> None:
        """A multimodal checkpoint's text model under the text-only names (TEXT_PREFIXES), where it has no
        text-only embedding of its own."""
        if "model.embed_tokens.weight" in self._file_of:
            return
        for name in list(self._file_of):
            for prefix, plain in TEXT_PREFIXES:
                if name.startswith(prefix):
                    text = plain + name[len(prefix):]
                    for table in (self._file_of, self._shapes, self._where):
                        table[text] = table[name]

    def _weight_files(self) -> list[Path]:
        index = self.folder / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise WeightsError(f"{index} is not a valid sharded index (needs a 'weight_map'); "
                                   f"download it again") from e
            shards = _shard_names(index, weight_map)
            for shard in shards:
                if not (self.folder / shard).is_file():
                    raise WeightsError(f"{index} names shard {shard}, which is missing from {self.folder}; "
                                       f"download that shard")
            return [self.folder / s for s in shards]
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            other = [p.name for p in self.folder.glob("*.bin")] + [p.name for p in self.folder.glob("*.gguf")]
            hint = f" (found {', '.join(other)}; convert it to safetensors)" if other else ""
            raise WeightsError(f"{self.folder} holds no .safetensors weights{hint}; "
                               f"offload reads Hugging Face safetensors checkpoints")
        return files

    def names(self) -> list[str]:
        return list(self._file_of)

    def _view(self, name: str) -> tuple[str, int, str | None] | None:
        """The stacked view a name is, unless a tensor of that name is stored (the packed cache's files name
        experts' fields gate_up#e)."""
        return None if name in self._file_of else stacked_view(name)

    def is_mxfp4(self, name: str) -> bool:
        """Whether a view's stacked tensor is stored as MXFP4 blocks and scales (gpt-oss's release)."""
        view = self._view(name)
        return view is not None and view[0] not in self._file_of and f"{view[0]}_blocks" in self._file_of

    def shape(self, name: str) -> tuple[int, ...]:
        view = self._view(name)
        if view is None:
            return self._shapes[name]
        stored, _, half = view
        if self.is_mxfp4(name):  # [E, out, G, 16]: the view is [out, G * 32]
            _, out, groups, _ = self._shapes[f"{stored}_blocks"]
            return (out // 2 if half else out, groups * 32)
        shape = self._shapes[stored][1:]
        shape = shape[::-1] if len(shape) == 2 else shape  # stored [in, out]: the view is [out, in]
        return (shape[0] // 2, *shape[1:]) if half else tuple(shape)

    def __contains__(self, name: str) -> bool:
        view = self._view(name)
        return (name if view is None else view[0]) in self._file_of or self.is_mxfp4(name)

    def mxfp4_blocks(self, name: str) -> torch.Tensor:
        """An MXFP4 view's GGUF block bytes [out, G * 17] (offload.weights.mxfp4), cut from the stacked blocks and
        scales (each read once for all its views in a row)."""
        stored, e, half = self._view(name)
        blocks, scales = (self._stacked_part(f"{stored}_{part}")[e] for part in ("blocks", "scales"))
        if half:  # gate and up interleaved along the rows
            blocks, scales = (t[0::2] if half == "gate" else t[1::2] for t in (blocks, scales))
        return mxfp4.gguf_blocks(blocks, scales)

    def _stacked_part(self, stored: str) -> torch.Tensor:
        cached = self._stacked_parts.get(stored)
        if cached is None:
            if len(self._stacked_parts) > 4:
                self._stacked_parts.clear()
            cached = self._stacked_parts[stored] = self.get(stored)
        return cached

    def where(self, name: str) -> tuple[Path, int, int, torch.dtype | None]:
        """(file, offset, bytes, torch dtype or None if offload does not read it) of a tensor in the checkpoint."""
        offset, n_bytes, st_dtype = self._where[name]
        return self._file_of[name], offset, n_bytes, _DTYPES.get(st_dtype)

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Read one tensor (optionally converted to dtype); a view of a stacked tensor (stacked_view) is cut from
        it, the stacked tensor read once for all its views in a row."""
        view = self._view(name)
        if view is not None and self.is_mxfp4(name):
            t = mxfp4.dequantize(self.mxfp4_blocks(name))
            return t.to(dtype) if dtype is not None else t
        if view is not None:
            stored, e, half = view
            if self._stacked is None or self._stacked[0] != stored:
                self._stacked = (stored, self.get(stored))
            t = self._stacked[1][e]
            t = t.T if t.dim() == 2 else t
            t = t[0::2] if half == "gate" else t[1::2] if half == "up" else t
            t = t.contiguous()
            return t.to(dtype) if dtype is not None and t.dtype != dtype else t
        path = self._file_of.get(name)
        if path is None:
            raise WeightsError(f"tensor {name} is missing from the checkpoint in {self.folder}; "
                               f"the weights do not match config.json — download the full checkpoint")
        offset, n_bytes, st_dtype = self._where[name]
        if st_dtype not in _DTYPES:
            raise WeightsError(f"tensor {name} in {path} is stored as {st_dtype}, which offload does not read; "
                               f"convert the checkpoint to bf16, fp16 or fp32")
        raw = torch.empty(n_bytes, dtype=torch.uint8)
        fd = os.open(path, os.O_RDONLY)
        try:
            got = pread_into(fd, memoryview(raw.numpy()), offset, self.drop_after_read)
        finally:
            os.close(fd)
        if got != n_bytes:
            raise WeightsError(f"{path} ended while reading tensor {name} ({got} of {n_bytes} bytes); "
                               f"download it again")
        t = raw.view(_DTYPES[st_dtype]).view(self._shapes[name])
        return t.to(dtype) if dtype is not None and t.dtype != dtype else t

    def check_against(self, spec: ModelSpec) -> None:
        """Every tensor the spec needs is present with the shape config.json implies."""
        for t in spec.tensors():
            if t.name not in self:
                raise WeightsError(f"tensor {t.name} is missing from the checkpoint in {self.folder}; "
                                   f"the weights do not match config.json — download the full checkpoint")
            found = self.shape(t.name)
            if found != t.shape:
                raise WeightsError(f"tensor {t.name} has shape {list(found)} in the checkpoint but config.json "
                                   f"implies {list(t.shape)}; use the config.json that came with these weights")
            stored = self._stored_dtype(t.name)
            if stored is not None and stored not in FLOAT_DTYPES:
                raise WeightsError(f"tensor {t.name} is stored as {stored} in {self._file_of[self._held_by(t.name)]}, "
                                   f"but offload reads float weights ({', '.join(FLOAT_DTYPES)}) from safetensors; "
                                   f"the checkpoint may be quantized by a tool offload does not read: use the "
                                   f"unquantized weights, or a GGUF file of them")

    def _held_by(self, name: str) -> str:
        """The stored tensor that holds name (itself, or the stacked tensor of a view)."""
        view = self._view(name)
        return name if view is None else view[0]

    def _stored_dtype(self, name: str) -> str | None:
        """The safetensors dtype of the tensor holding name; None for an MXFP4 view (blocks and scales)."""
        where = self._where.get(self._held_by(name))
        return None if where is None else where[2]

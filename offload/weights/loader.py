"""Checkpoint: lazy, memory-mapped access to the tensors of a safetensors model (single file or sharded)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from safetensors import safe_open

from offload.errors import WeightsError
from offload.spec import ModelSpec

INDEX_NAME = "model.safetensors.index.json"
LFS_MAGIC = b"version https://git-lfs.github.com/spec"
_HEADER_LIMIT_BYTES = 100 * 1024 * 1024


def check_safetensors_file(path: Path) -> dict:
    """Validate a safetensors file's header against its size; return the header. Never reads the data."""
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
    return header


class Checkpoint:
    """The tensors of one model folder, opened lazily; `get` reads one tensor through the file's mmap."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self._file_of: dict[str, Path] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._handles: dict[Path, object] = {}
        for path in self._weight_files():
            header = check_safetensors_file(path)
            for name, info in header.items():
                if name != "__metadata__":
                    self._file_of[name] = path
                    self._shapes[name] = tuple(info["shape"])

    def _weight_files(self) -> list[Path]:
        index = self.folder / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise WeightsError(f"{index} is not a valid sharded index (needs a 'weight_map'); "
                                   f"download it again") from e
            shards = sorted(set(weight_map.values()))
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

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Read one tensor (optionally converted to dtype)."""
        path = self._file_of.get(name)
        if path is None:
            raise WeightsError(f"tensor {name} is missing from the checkpoint in {self.folder}; "
                               f"the weights do not match config.json — download the full checkpoint")
        handle = self._handles.get(path)
        if handle is None:
            handle = self._handles[path] = safe_open(str(path), framework="pt")
        t = handle.get_tensor(name)
        return t.to(dtype) if dtype is not None and t.dtype != dtype else t

    def check_against(self, spec: ModelSpec) -> None:
        """Every tensor the spec needs is present with the shape config.json implies."""
        for t in spec.tensors():
            if t.name not in self._shapes:
                raise WeightsError(f"tensor {t.name} is missing from the checkpoint in {self.folder}; "
                                   f"the weights do not match config.json — download the full checkpoint")
            found = self._shapes[t.name]
            if found != t.shape:
                raise WeightsError(f"tensor {t.name} has shape {list(found)} in the checkpoint but config.json "
                                   f"implies {list(t.shape)}; use the config.json that came with these weights")

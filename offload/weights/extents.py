"""Extents: where the bytes of a unit's buffer already sit in files (a checkpoint, a GGUF file, the packed-weight
cache), so a unit kept on disk is read from there instead of from a copy written for the run.

A unit's buffer (runtime.unit_store.UnitLayout) holds each field's tensor, or each plane of a packed one; a fused
field (q/k/v, gate/up) is its tensors' bytes back to back. A source says where each of those tensors is; the
unit is readable from its files only if every entry is covered byte for byte, in the stored type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Extent:
    """n_bytes at offset in a file, read to `into` in the unit's buffer; rows, when given, reorders the piece's
    rows after the read as piece[rows] (llama.cpp's q/k row permutation undone)."""

    path: str
    offset: int
    n_bytes: int
    into: int
    rows: tuple[int, ...] | None = None


# where one tensor is: (path, offset, n_bytes, rows) if its stored bytes are what the entry holds, else None
Locate = Callable[[str, object], "tuple[str, int, int, tuple[int, ...] | None] | None"]


def unit_extents(layout, names: dict[str, tuple[str, ...] | None], locate: Locate) -> tuple[Extent, ...] | None:
    """The extents of every entry of layout, or None if any entry's bytes are not in the files as they are.

    names gives each field's tensors in the order they are fused; a stacked field's part field/k is its k-th."""
    extents = []
    for entry in layout.entries:
        field, _, part = entry.field.partition("/")
        group = names.get(field)
        if not group:
            return None
        if part:
            group = (group[int(part)],)
        into = entry.offset
        for name in group:
            where = locate(name, entry)
            if where is None:
                return None
            path, offset, n_bytes, rows = where
            extents.append(Extent(str(path), offset, n_bytes, into, rows))
            into += n_bytes
        if into - entry.offset != entry.n_bytes:
            return None
    return tuple(extents)

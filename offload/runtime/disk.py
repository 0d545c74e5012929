"""Disk tier: disk units are read from the files that already hold their bytes (or, for a format no file holds,
from a spill file), ahead of use by a thread, into one arena sized for the units it holds at once."""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import shutil
import tempfile
import threading
import weakref
from pathlib import Path

import torch

from offload.planner.costs import READ_AHEAD_TRAIL_BYTES, page_rounded
from offload.runtime.backends.base import Backend
from offload.weights.extents import Extent
from offload.weights.loader import pread_into


SPILL_PREFIX = "offload-disk-"  # spill folders in the temp folder; a run's own is locked while it lives
_NEW_PREFIX = ".offload-disk-new-"  # a folder not yet locked is made under this name, so no sweep takes it
LOCK_NAME = ".lock"
log = logging.getLogger("offload")


class SpillFolder:
    """A temporary folder for spilled weights, locked (flock) while this run uses it. It is removed by close(),
    when garbage-collected, at interpreter exit (also after an exception, Ctrl-C or a SIGTERM the CLI handles),
    and, if the run was killed outright, by the next run that makes a spill folder in the same place."""

    def __init__(self, parent: str | Path | None = None):
        parent = Path(parent or tempfile.gettempdir())
        sweep_stale(parent)
        new = Path(tempfile.mkdtemp(prefix=_NEW_PREFIX, dir=parent))
        fd = os.open(new / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        self.path = parent / (SPILL_PREFIX + new.name.removeprefix(_NEW_PREFIX))
        os.rename(new, self.path)
        self._finalizer = weakref.finalize(self, _remove, self.path, fd)

    @property
    def name(self) -> str:
        return str(self.path)

    def close(self) -> None:
        self._finalizer()


def _remove(path: Path, fd: int) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.close(fd)


def sweep_stale(parent: Path) -> list[Path]:
    """Remove the spill folders under parent whose run has died (their lock is free); return them."""
    removed = []
    for folder in sorted(Path(parent).glob(SPILL_PREFIX + "*")):
        try:
            fd = os.open(folder / LOCK_NAME, os.O_RDWR)
        except OSError:
            continue  # no lock file: not made by this version of offload, left alone
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
        except BlockingIOError:
            pass  # a live run's
        finally:
            os.close(fd)
    if removed:
        log.info(f"removed {len(removed)} spill folder(s) left by killed runs: {', '.join(map(str, removed))}")
    return removed


class DiskStore:
    """Where each disk unit's bytes are: extents of files that already hold them (the checkpoint, a GGUF file, the
    packed-weight cache), or a spill file written for this run (a format no file holds)."""

    def __init__(self, spill_dir: str | Path | None = None):
        self._spill_dir = spill_dir
        self._spill: SpillFolder | None = None
        self.extents: dict[str, tuple[Extent, ...]] = {}
        self.sizes: dict[str, int] = {}
        self.drop: set[str] = set()  # units whose pages are dropped from the page cache once read
        self.spilled: list[str] = []
        self._trail: tuple[str, int, int] | None = None  # past the last dropped read: dropped again at the next
        self._fds: dict[tuple[str, bool], int] = {}
        self._maps: dict[str, mmap.mmap] = {}  # files whose units are used in place (map_unit)
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _close_fds, self._fds)

    def add(self, unit: str, extents: tuple[Extent, ...] | list[Extent], n_bytes: int) -> None:
        """unit's bytes are read from these extents of existing files."""
        self.extents[unit], self.sizes[unit] = tuple(extents), n_bytes

    @property
    def spill_folder(self) -> Path | None:
        """The folder spill files go to: the one asked for, else this run's own once one is written."""
        if self._spill_dir is not None:
            return Path(self._spill_dir)
        return None if self._spill is None else self._spill.path

    def store(self, unit: str, buffer: torch.Tensor, layout) -> None:
        """Write a host uint8 buffer of this layout as unit's spill file, one extent per entry, so that the unit can
        be mapped in place (map_unit); a meta buffer, in a timed simulation, only its size."""
        if not buffer.is_meta:
            if self._spill_dir is None and self._spill is None:
                self._spill = SpillFolder()  # removed on every exit path; a killed run's by the next
            folder = self.spill_folder
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"{unit}.bin"
            with open(path, "wb") as f:
                f.write(buffer.numpy().tobytes())
            self.extents[unit] = tuple(Extent(str(path), e.offset, e.n_bytes, e.offset) for e in layout.entries)
            self.spilled.append(unit)
        self.sizes[unit] = buffer.numel()

    def _fd(self, path: str, rows: bool = False) -> int:
        """The file open for reading: one descriptor for whole units, another, set to read nothing ahead, for an
        embedding's rows (a read-ahead past a row would mostly bring pages no step asks for)."""
        with self._lock:
            return self._fd_locked(path, rows)

    def _fd_locked(self, path: str, rows: bool = False) -> int:
        fd = self._fds.get((path, rows))
        if fd is None:
            fd = self._fds[(path, rows)] = os.open(path, os.O_RDONLY)
            if rows:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return fd

    def read_into(self, unit: str, buffer: torch.Tensor) -> int:
        """Read unit's bytes into the start of buffer, extent by extent in file order; returns bytes read."""
        view = buffer.numpy()
        extents = sorted(self.extents[unit], key=lambda e: (e.path, e.offset))  # in file order: one sweep
        drop = unit in self.drop  # keep the page cache from holding what the plan does not keep
        if self._trail is not None:  # read ahead past the last unit, landed after it was dropped
            self.drop_pages([self._trail])
            self._trail = None
        for e in extents:
            got = pread_into(self._fd(e.path), memoryview(view[e.into: e.into + e.n_bytes]), e.offset, drop,
                             trail=False)  # the next extent may be read on from here: the trail goes at the end
            if got != e.n_bytes:
                raise OSError(f"short read of {e.path}: {got} of {e.n_bytes} bytes at {e.offset}; the file changed "
                              f"or is damaged: load the model again")
            if e.rows is not None:
                piece = buffer[e.into: e.into + e.n_bytes].view(len(e.rows), -1)
                piece.copy_(piece[torch.tensor(e.rows)])
        if drop:  # partial pages at the ends of extents, and what the OS read past the unit
            self.drop_pages((e.path, e.offset, e.n_bytes) for e in extents)
            last = extents[-1]
            self._trail = (last.path, last.offset + last.n_bytes, READ_AHEAD_TRAIL_BYTES)
            self.drop_pages([self._trail])
        return self.sizes[unit]

    def map_unit(self, unit: str, layout) -> object | None:
        """The unit's weights as views of its files mapped into memory (no copy: the page cache's pages are the
        weights), or None where its bytes are not laid out in the files as the kernels take them (rows reordered
        after the read, a quantized plane or a stacked part in pieces)."""
        pieces = mapped_pieces(self.extents.get(unit), layout)
        if pieces is None:
            return None

        def view(entry):
            tensors = [self._mapped(e).view(entry.dtype) for e in pieces[entry.offset]]
            if len(tensors) == 1:
                return tensors[0].view(entry.shape)
            if len(entry.shape) == 1:  # a fused bias: a few KiB, copied
                return torch.cat(tensors)
            return tuple(t.view(-1, entry.shape[1]) for t in tensors)

        from offload.runtime.unit_store import materialize

        return materialize(layout, None, on_device=False, view=view)

    def _mapped(self, e: Extent) -> torch.Tensor:
        """e's bytes as a uint8 tensor over the file's private read-only mapping (made once per file)."""
        with self._lock:
            mm = self._maps.get(e.path)
            if mm is None:
                mm = self._maps[e.path] = mmap.mmap(self._fd_locked(e.path), 0, flags=mmap.MAP_PRIVATE,
                                                    prot=mmap.PROT_READ | mmap.PROT_WRITE)
        return torch.frombuffer(mm, dtype=torch.uint8, count=e.n_bytes, offset=e.offset)

    def drop_pages(self, ranges) -> None:
        """Tell the OS the page cache need not keep these (path, offset, n_bytes) ranges of model files."""
        for path, offset, n_bytes in ranges:
            os.posix_fadvise(self._fd(str(path)), offset, n_bytes, os.POSIX_FADV_DONTNEED)

    def read_rows(self, unit: str, rows: torch.Tensor, row_bytes: int) -> torch.Tensor:
        """Rows of a dense single-tensor unit (an embedding): [len(rows), row_bytes] uint8, one pread per row."""
        (e,) = self.extents[unit]
        out = torch.empty(len(rows), row_bytes, dtype=torch.uint8)
        fd, view = self._fd(e.path, rows=True), out.numpy()
        for i, r in enumerate(rows.tolist()):
            if os.preadv(fd, [memoryview(view[i])], e.offset + r * row_bytes) != row_bytes:
                raise OSError(f"short read of {e.path} at row {r}; the file changed or is damaged: load the model again")
        return out


def mapped_pieces(extents, layout) -> dict[int, list[Extent]] | None:
    """Each layout entry's extents (by the entry's offset) where the files hold the entry's bytes as the kernels
    take them, so that a mapping of the files is the unit's weights; None where some entry's are not (its rows
    reordered after the read, a quantized plane or a stacked part in pieces, an extent over several entries)."""
    if extents is None:
        return None
    pieces: dict[int, list[Extent]] = {}
    for entry in layout.entries:
        mine = [e for e in extents if entry.offset <= e.into < entry.offset + entry.n_bytes]
        if not mine or any(e.rows is not None or e.into + e.n_bytes > entry.offset + entry.n_bytes for e in mine):
            return None
        if len(mine) > 1 and (entry.part != "dense" or "/" in entry.field):
            return None
        pieces[entry.offset] = sorted(mine, key=lambda e: e.into)
    return pieces


def _close_fds(fds: dict) -> None:
    for fd in fds.values():
        os.close(fd)
    fds.clear()


class ReadAhead:
    """A reader thread that reads disk units, in the order they will be used, into one arena of arena_bytes:
    each unit takes its own size (page-rounded), placed after the previous one and wrapping around, so at
    most depth units are ahead and the arena never holds more than it was sized for."""

    def __init__(self, backend: Backend, store: DiskStore, depth: int, arena_bytes: int, pinned: bool):
        self.backend, self.store, self.depth = backend, store, depth
        self.arena = backend.alloc("cpu", arena_bytes, pinned=pinned)
        self.arena_bytes = arena_bytes
        self._cond = threading.Condition()
        self._live: list[list] = []  # [unit, start, end, released] in read order
        self._ready: dict[str, tuple[int, int]] = {}
        self._ready_t: dict[str, float] = {}  # when each read unit's bytes were there (the backend's clock)
        self._free_t = 0.0  # when arena space was last given back
        self._queue: list[tuple[str, str]] = []
        self._error: BaseException | None = None
        self.max_in_use = 0
        self.max_bytes_in_use = 0
        self._thread = threading.Thread(target=self._run, name="offload-disk-reader", daemon=True)
        self._thread.start()

    def schedule(self, units: list[str], phase: str) -> None:
        """Queue units to be read, in use order."""
        with self._cond:
            self._queue.extend((u, phase) for u in units)
            self._cond.notify_all()

    def _where(self, n: int) -> int | None:
        """Start of a free range of n bytes after the newest unit (wrapping to 0), or None while there is none."""
        if len(self._live) >= self.depth:
            return None
        if not self._live:
            return 0 if n <= self.arena_bytes else None
        head, tail = self._live[-1][2], self._live[0][1]
        if self._live[-1][1] >= tail:  # not wrapped: free is [head, arena) and [0, tail)
            if head + n <= self.arena_bytes:
                return head
            return 0 if n <= tail else None
        return head if head + n <= tail else None  # wrapped: free is [head, tail)

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._queue:
                        unit, phase = self._queue[0]
                        n = page_rounded(self.store.sizes[unit])
                        start = self._where(n)
                        if start is not None:
                            break
                    self._cond.wait()
                self._queue.pop(0)
                self._live.append([unit, start, start + n, False])
                self.max_in_use = max(self.max_in_use, len(self._live))
                self.max_bytes_in_use = max(self.max_bytes_in_use, sum(e - s for _, s, e, _ in self._live))
                free_t = self._free_t
            buffer = self.arena[start: start + n]
            try:
                ready_t = self.backend.read_disk(self.store, unit, buffer, phase, free_t)
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                with self._cond:
                    self._error = e
                    self._cond.notify_all()
                return
            with self._cond:
                self._ready[unit], self._ready_t[unit] = (start, n), ready_t
                self._cond.notify_all()

    def _buffer(self, unit: str) -> torch.Tensor:
        start, n = self._ready[unit]
        return self.arena[start: start + n]

    def acquire(self, unit: str) -> torch.Tensor:
        """Block until unit has been read; return its bytes."""
        with self._cond:
            while unit not in self._ready:
                if self._error is not None:
                    raise self._error
                self._cond.wait()
            self.backend.host_wait_until(self._ready_t[unit])
            return self._buffer(unit)

    def ready_t(self, unit: str) -> float:
        """When unit's bytes were there (acquired units only): a copy of them starts no earlier."""
        with self._cond:
            return self._ready_t[unit]

    def try_acquire(self, unit: str) -> torch.Tensor | None:
        """unit's bytes if they have been read already, else None (never blocks)."""
        with self._cond:
            if self._error is not None:
                raise self._error
            return self._buffer(unit) if unit in self._ready else None

    def release(self, unit: str) -> None:
        """Give unit's space back to the reader (reclaimed once every unit read before it is released too)."""
        with self._cond:
            start, _ = self._ready.pop(unit)
            for entry in self._live:
                if entry[0] == unit and entry[1] == start and not entry[3]:
                    entry[3] = True
                    break
            while self._live and self._live[0][3]:
                self._live.pop(0)
            self._free_t = self.backend.now()
            self._cond.notify_all()

"""Disk tier: unit buffers stored in files, read ahead by a thread into a bounded set of (pinned) buffers."""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
import threading
import weakref
from pathlib import Path

import torch

from offload.runtime.backends.base import Backend


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
    """One file per unit under folder, holding the unit's flat buffer."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.sizes: dict[str, int] = {}

    def path(self, unit: str) -> Path:
        return self.folder / f"{unit}.bin"

    def store(self, unit: str, buffer: torch.Tensor) -> None:
        """Write a host uint8 buffer as unit's file (a meta buffer, in a timed simulation, only its size)."""
        if not buffer.is_meta:
            with open(self.path(unit), "wb") as f:
                f.write(buffer.numpy().tobytes())
        self.sizes[unit] = buffer.numel()

    def read_into(self, unit: str, buffer: torch.Tensor) -> int:
        """Read unit's file into the start of buffer with one pread; returns bytes read."""
        n = self.sizes[unit]
        fd = os.open(self.path(unit), os.O_RDONLY)
        try:
            view = memoryview(buffer.numpy())[:n]
            got = os.preadv(fd, [view], 0)
        finally:
            os.close(fd)
        if got != n:
            raise OSError(f"short read of {self.path(unit)}: {got} of {n} bytes; the offload disk cache is damaged")
        return n


class ReadAhead:
    """A reader thread that fills at most n_buffers buffers with disk units, in the order they will be used."""

    def __init__(self, backend: Backend, store: DiskStore, n_buffers: int, buffer_bytes: int):
        self.backend, self.store = backend, store
        self.buffers = [backend.alloc("cpu", buffer_bytes, pinned=True) for _ in range(n_buffers)]
        self.buffer_bytes = buffer_bytes
        self._cond = threading.Condition()
        self._free = list(range(n_buffers))
        self._ready: dict[str, int] = {}
        self._ready_t: dict[str, float] = {}  # when each read unit's bytes were there (the backend's clock)
        self._free_t = [0.0] * n_buffers  # when each buffer was last given back
        self._queue: list[tuple[str, str]] = []
        self._error: BaseException | None = None
        self.max_in_use = 0
        self._thread = threading.Thread(target=self._run, name="offload-disk-reader", daemon=True)
        self._thread.start()

    def schedule(self, units: list[str], phase: str) -> None:
        """Queue units to be read, in use order."""
        with self._cond:
            self._queue.extend((u, phase) for u in units)
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._queue and self._free):
                    self._cond.wait()
                unit, phase = self._queue.pop(0)
                i = self._free.pop(0)
                self.max_in_use = max(self.max_in_use, len(self.buffers) - len(self._free))
            try:
                ready_t = self.backend.read_disk(self.store, unit, self.buffers[i], phase, self._free_t[i])
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                with self._cond:
                    self._error = e
                    self._cond.notify_all()
                return
            with self._cond:
                self._ready[unit], self._ready_t[unit] = i, ready_t
                self._cond.notify_all()

    def acquire(self, unit: str) -> torch.Tensor:
        """Block until unit has been read; return its buffer."""
        with self._cond:
            while unit not in self._ready:
                if self._error is not None:
                    raise self._error
                self._cond.wait()
            self.backend.host_wait_until(self._ready_t[unit])
            return self.buffers[self._ready[unit]]

    def ready_t(self, unit: str) -> float:
        """When unit's bytes were there (acquired units only): a copy of them starts no earlier."""
        with self._cond:
            return self._ready_t[unit]

    def try_acquire(self, unit: str) -> torch.Tensor | None:
        """unit's buffer if it has been read already, else None (never blocks)."""
        with self._cond:
            if self._error is not None:
                raise self._error
            i = self._ready.get(unit)
            return None if i is None else self.buffers[i]

    def release(self, unit: str) -> None:
        """Give unit's buffer back to the reader."""
        with self._cond:
            i = self._ready.pop(unit)
            self._free_t[i] = self.backend.now()
            self._free.append(i)
            self._cond.notify_all()

"""The output JSONL of a job: one writer at a time (a lock), a manifest of the job that writes it, resume,
retry of failed requests, and a restart that keeps every earlier output (.bak, .bak.1, ...)."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from offload.errors import ConfigError, OutputError

logger = logging.getLogger("offload")

MANIFEST_VERSION = 1
AGAIN = "rerun with --restart (or output.overwrite: true) to start over, or choose another output path"


def side_files(output: Path) -> dict[str, Path]:
    """The files a job keeps beside its output: the manifest, the lock, the backup a restart makes."""
    return {"manifest": output.with_name(output.stem + ".job.json"),
            "lock": output.with_name(output.name + ".lock"), "backup": output.with_name(output.name + ".bak")}


def backup_path(output: Path) -> Path:
    """Where a restart keeps the outputs it replaces: <output>.bak, else the first free <output>.bak.N, so that
    no restart writes over an earlier one's (the highest number is the newest)."""
    first = side_files(output)["backup"]
    path, n = first, 0
    while path.exists() or path.is_symlink():
        n += 1
        path = first.with_name(f"{first.name}.{n}")
    return path


def record_key(record: dict) -> str | None:
    """The key a record answers: its custom_id, or line:N for a line that had none."""
    if record.get("custom_id") is not None:
        return record["custom_id"]
    line = (record.get("error") or {}).get("line")
    return f"line:{line}" if line is not None else None


class OutputLock:
    """An advisory lock (flock) on a file beside the output, naming the process that holds it."""

    def __init__(self, path: Path, what: Path):
        self.path, self.what = path, what
        self._fd: int | None = None

    def acquire(self) -> None:
        """Hold the lock, or ConfigError naming the process that holds it."""
        while self._fd is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "another process"
                os.close(fd)
                raise ConfigError(f"{self.what} is being written by {holder}; wait for that run to finish or stop "
                                  f"it, or choose another output path") from None
            if _same_file(fd, self.path):  # else the holder removed it as we opened it: take the new one
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"process {os.getpid()} (`{_command()}`, started {time.strftime('%H:%M:%S')})"
                          .encode(), 0)
                self._fd = fd
            else:
                os.close(fd)

    def release(self) -> None:
        if self._fd is not None:
            self.path.unlink(missing_ok=True)  # while still held, so nobody locks a file that is going away
            os.close(self._fd)
            self._fd = None


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def _command() -> str:
    name = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python"
    return " ".join(["offload" if name in ("main.py", "__main__.py", "-m") else name, *sys.argv[1:]])[:200]


@dataclass
class OutputLog:
    """The output JSONL plus a manifest beside it that fingerprints the job that writes it.

    Use: lock(), check(restart) -> keys not to redo, begin(restart) once the run is ready, append(), close()."""

    path: Path
    fingerprint: dict
    retry_failed: bool = True  # a rerun retries requests whose record is an error line
    done: set[str] = field(default_factory=set)  # keys answered (or failed, when not retried)
    failed: set[str] = field(default_factory=set)  # keys whose error line is in the file
    _file: Any = None
    _lock: OutputLock | None = None
    _drop: set[str] = field(default_factory=set)  # error lines begin() removes, as their requests run again

    @property
    def manifest_path(self) -> Path:
        return side_files(self.path)["manifest"]

    def open(self, restart: bool = False) -> set[str]:
        """lock, check and begin at once; return the keys not to redo."""
        self.lock()
        try:
            done = self.check(restart)
            self.begin(restart)
        except BaseException:
            self.close()
            raise
        return done

    def lock(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = OutputLock(side_files(self.path)["lock"], self.path)
        self._lock.acquire()

    def check(self, restart: bool = False) -> set[str]:
        """The keys an earlier run of this job finished; changes nothing. Refuses a resume under a changed job."""
        self.done, self.failed, self._drop = set(), set(), set()
        if restart or not self.path.exists() or self.path.stat().st_size == 0:
            return set()
        self._check_manifest()
        for key, ok in self._scan():
            if ok:
                self.done.add(key)
                self.failed.discard(key)
            elif key not in self.done:
                self.failed.add(key)
        if self.retry_failed:
            self._drop, self.failed = set(self.failed), set()
        else:
            self.done |= self.failed
        return set(self.done)

    def begin(self, restart: bool = False) -> None:
        """Start writing: a restart moves the old outputs to a backup of their own (backup_path); a resume drops
        the error lines it retries."""
        if restart and self.path.exists() and self.path.stat().st_size:
            n_records, backup = len(self._lines()), backup_path(self.path)
            os.replace(self.path, backup)
            logger.info(f"starting over: the {n_records} earlier records of {self.path} are kept in {backup}")
        elif self.path.exists() and not restart:
            self._rewrite()
        self.manifest_path.write_text(json.dumps({"version": MANIFEST_VERSION, "job": self.fingerprint}, indent=2))
        self._file = open(self.path, "a", encoding="utf-8")

    def _check_manifest(self) -> None:
        if not self.manifest_path.is_file():
            raise ConfigError(f"{self.path} exists but has no {self.manifest_path.name} saying which job wrote "
                              f"it, so it cannot be resumed safely; {AGAIN}")
        try:
            old = json.loads(self.manifest_path.read_text()).get("job", {})
        except (json.JSONDecodeError, AttributeError, UnicodeDecodeError):
            old = {}
        changed = [k for k in sorted(set(old) | set(self.fingerprint)) if old.get(k) != self.fingerprint.get(k)]
        if changed:
            k = changed[0]
            raise ConfigError(f"{self.path} was started with {k}={old.get(k)!r} but this run has "
                              f"{k}={self.fingerprint.get(k)!r}" + (f" (and {len(changed) - 1} more changes)"
                              if len(changed) > 1 else "") + f"; {AGAIN}")

    def _lines(self) -> list[bytes]:
        """The complete lines of the file, split at "\\n" only as records are written (a torn last line, from a killed
        write, is left out)."""
        data = self.path.read_bytes()
        return [line + b"\n" for line in data[: data.rfind(b"\n")].split(b"\n")] if b"\n" in data else []

    def _scan(self) -> list[tuple[str, bool]]:
        """(key, answered without error) for each complete record."""
        out = []
        for n, line in enumerate(self._lines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                key = record_key(record)
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
                raise ConfigError(f"{self.path} line {n} is not a JSON record; the file was edited or damaged: "
                                  f"repair it, or rerun with --restart to start over") from None
            if key is not None:
                out.append((key, record.get("error") is None))
        return out

    def _rewrite(self) -> None:
        """Cut a torn last line, and drop the error lines of requests that run again (atomically)."""
        lines = self._lines()
        keep = [line for line in lines if not self._drop or not _is_error_of(line, self._drop)]
        if len(keep) == len(lines) and sum(map(len, lines)) == self.path.stat().st_size:
            return
        if sum(map(len, lines)) < self.path.stat().st_size:
            logger.warning(f"the last line of {self.path} was cut short (a run was killed while writing it); it is "
                           f"removed and its request runs again")
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.writelines(keep)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def append(self, record: dict) -> None:
        """Write one record as a line and flush it, so a killed job keeps it."""
        key = record_key(record)
        try:
            self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
            self._file.flush()
        except OSError as e:
            raise OutputError(f"cannot write to {self.path} ({e.strerror}); the {len(self.done)} answers "
                              f"written before are kept: fix that (free space?) and rerun to resume",
                              e.strerror or str(e)) from None
        (self.done if record.get("error") is None else self.failed).add(key)

    def close(self) -> None:
        """Close the file (quietly if the disk refused the last bytes) and release the lock."""
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None
        if self._lock is not None:
            self._lock.release()
            self._lock = None


def _is_error_of(line: bytes, keys: set[str]) -> bool:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return False
    return record.get("error") is not None and record_key(record) in keys

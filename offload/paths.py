"""Where offload keeps what it makes (converted models, the calibrated hardware profile), and what a path a user
gave holds, in words."""

from __future__ import annotations

import errno
import os
import stat
import sys
from pathlib import Path


def cache_dir() -> Path:
    """$OFFLOAD_CACHE, else $XDG_CACHE_HOME/offload, else ~/.cache/offload."""
    if os.environ.get("OFFLOAD_CACHE"):
        return Path(os.environ["OFFLOAD_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "offload"


def configs_dir() -> Path:
    """The shipped configs/ (hardware presets, model configs, demo): the source tree's, else the installed copy."""
    source = Path(__file__).resolve().parent.parent / "configs"
    return source if source.is_dir() else Path(sys.prefix) / "share" / "offload" / "configs"


def describe_path(path: Path) -> str:
    """What is at path, for an error message: 'does not exist', 'is a folder', 'is a named pipe (FIFO)',
    'is a symlink loop (...)', 'is a file', ..."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "is a symlink loop (a link that leads back to itself)"
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            return "is a broken symlink (its target does not exist)" if os.path.islink(path) else "does not exist"
        return f"cannot be read ({e.strerror})"
    kinds = ((stat.S_ISDIR, "is a folder"), (stat.S_ISFIFO, "is a named pipe (FIFO)"), (stat.S_ISSOCK, "is a socket"),
             (stat.S_ISCHR, "is a device"), (stat.S_ISBLK, "is a device"))
    return next((words for test, words in kinds if test(mode)), "is a file")

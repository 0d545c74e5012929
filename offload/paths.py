"""Where offload keeps what it makes: converted models and the calibrated hardware profile."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$OFFLOAD_CACHE, else $XDG_CACHE_HOME/offload, else ~/.cache/offload."""
    if os.environ.get("OFFLOAD_CACHE"):
        return Path(os.environ["OFFLOAD_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "offload"

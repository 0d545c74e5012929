"""Where offload keeps what it makes: converted models and the calibrated hardware profile."""

from __future__ import annotations

import os
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

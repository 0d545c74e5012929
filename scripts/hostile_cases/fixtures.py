"""What the hostile cases break one thing of: a tiny Llama with a byte-level tokenizer and chat template (make_llama's
smoke model), tiny random models of the other families (the tests' make_hf_model) with the same tokenizer, a good
batch input and a good job config. Models are kept in the work folder and reused; each case gets a fresh folder."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

SCRIPTS = Path(__file__).resolve().parents[1]
TESTS = SCRIPTS.parent / "tests"
FAMILIES = ("qwen3", "gemma2", "gemma3_text", "phi3", "gpt_oss")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
VOCAB = 512  # the byte-level tokenizer's
MAX_MODEL_LEN = 64


def completion(custom_id, prompt="hi", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"prompt": prompt, "max_tokens": 2, **body}}


def chat(custom_id, content="hi", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": content}], "max_tokens": 2, **body}}


def write_lines(path: Path, items: list) -> Path:
    """Request lines: dicts as JSON, strings as they are."""
    path.write_text("".join((json.dumps(i) if isinstance(i, dict) else i) + "\n" for i in items))
    return path


@dataclass(frozen=True)
class Fixtures:
    work: Path
    model: Path  # the tiny Llama
    families: dict  # family name -> its tiny model's folder
    input: Path  # two good requests
    job: Path  # a good job of them (its output is o.jsonl beside the case's config)

    def case_folder(self, case) -> Path:
        folder = self.work / "cases" / f"{case.kind}-{re.sub(r'[^A-Za-z0-9]+', '-', case.name).strip('-')}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        return folder

    def job_data(self, **sections) -> dict:
        data = {"model": {"path": str(self.model), "max_model_len": MAX_MODEL_LEN}, "input": {"path": str(self.input)},
                "output": {"path": "o.jsonl"}, "sampling": {"max_tokens": 2, "temperature": 0},
                "report": {"print": False, "progress": False}}
        for key, value in sections.items():
            if value is None:
                data.pop(key, None)
            elif isinstance(value, dict) and isinstance(data.get(key), dict):
                data[key] = {**data[key], **value}
            else:
                data[key] = value
        return data

    def write_job(self, folder: Path, text: str | None = None, **sections) -> Path:
        """A job config in folder: the good one with sections changed, or text as written."""
        path = folder / "job.yaml"
        path.write_text(text if text is not None else yaml.safe_dump(self.job_data(**sections), sort_keys=False))
        return path

    def line_job(self, folder: Path, bad: list) -> tuple[Path, list[str]]:
        """A job of a good first request, the bad lines and a good last one; (its config, the bad custom_ids)."""
        write_lines(folder / "in.jsonl", [completion("first"), *bad, chat("last")])
        ids = [i["custom_id"] for i in bad if isinstance(i, dict) and isinstance(i.get("custom_id"), str)]
        return self.write_job(folder, input={"path": str(folder / "in.jsonl")}), ids

    def records(self, folder: Path) -> list[dict]:
        path = folder / "o.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().split("\n") if line.strip()]

    def model_copy(self, folder: Path, family: str = "llama", config=None, **changes) -> Path:
        """A copy of a tiny model (files linked, config.json copied) with config.json's keys changed (None removes
        one), or config(dict) -> dict applied to it."""
        source = self.model if family == "llama" else self.families[family]
        model = folder / f"model-{family}"
        model.mkdir()
        for path in source.iterdir():
            if path.name != "config.json":
                (model / path.name).symlink_to(path)
        data = json.loads((source / "config.json").read_text())
        data = config(data) if config else data
        for key, value in changes.items():
            if value is None:
                data.pop(key, None)
            else:
                data[key] = value
        (model / "config.json").write_text(json.dumps(data))
        return model

    def weights_copy(self, folder: Path, change) -> Path:
        """A copy of the tiny Llama whose tensors are change(dict of tensors) -> dict, saved again."""
        from safetensors.torch import load_file, save_file

        model = self.model_copy(folder)
        (model / "model.safetensors").unlink()
        tensors = change(load_file(str(self.model / "model.safetensors")))
        save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
        return model


def make_fixtures(work: Path) -> Fixtures:
    """The fixtures in work, made where absent (in a child process: the models' random init runs torch, which this
    process must not before it forks)."""
    work.mkdir(parents=True, exist_ok=True)
    model, families = work / "models" / "llama", {f: work / "models" / f for f in FAMILIES}
    if not all((p / "model.safetensors").exists() for p in (model, *families.values())):
        pid = os.fork()
        if pid == 0:
            try:
                _make_models(model, families)
                os._exit(0)
            except BaseException:
                import traceback

                traceback.print_exc()
                os._exit(1)
        if os.waitpid(pid, 0)[1] != 0:
            raise SystemExit("could not make the tiny models (see above)")
    write_lines(work / "in.jsonl", [completion("a"), chat("b")])
    fx = Fixtures(work, model, families, work / "in.jsonl", work / "job.yaml")
    fx.write_job(work)
    return fx


def _make_models(model: Path, families: dict) -> None:
    import contextlib
    import io

    sys.path.insert(0, str(TESTS))
    from conftest import make_hf_model, save_hf_model
    from make_llama import tiny

    with contextlib.redirect_stdout(io.StringIO()):
        tiny(model, vocab=VOCAB, tokenizer=True)
    for family, folder in families.items():
        save_hf_model(make_hf_model(family, vocab_size=VOCAB, eos_token_id=2, bos_token_id=1, pad_token_id=0),
                      folder)
        for name in TOKENIZER_FILES:
            shutil.copy(model / name, folder / name)

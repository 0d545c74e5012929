"""Helpers for the offload serve tests: a tiny model with a byte-level tokenizer, a server on a TestClient (its Batch
API on an injected clock where asked), OpenAI's error shape, and a gate that holds the engine's steps."""

from __future__ import annotations

import json
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from fastapi.testclient import TestClient

from offload import LLM
from offload.jobs.config import load_config, sampling_defaults
from offload.serve.app import Server, make_app
from offload.serve.batches import Batches

ROOT = Path(__file__).resolve().parent.parent
CONTEXT = 128
ERROR_KEYS = {"message", "type", "param", "code"}


def tiny_model(folder: Path) -> Path:
    """A 2-layer random Llama of 259 tokens, every id a byte or a special one, with a chat template."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_llama import tiny

    return tiny(folder, vocab=259, tokenizer=True)


def tiny_llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), backend="cpu", max_model_len=CONTEXT)


def server_defaults(model_dir: Path) -> dict:
    """The request defaults a server started on this model gets: the job's sampling section (greedy, 16 tokens)."""
    return sampling_defaults(load_config(None, {"model.path": str(model_dir)}, need_input=False))


@contextmanager
def serving(llm, defaults, state_dir: Path | None = None, clock=None, **kw):
    """A server named "tiny" and a TestClient on its app, the engine thread running inside the block; with
    state_dir, its Batch API, whose batches keep the time of clock (None: the real one)."""
    server = Server(llm, "tiny", defaults=defaults, **kw)
    if state_dir is not None:
        server.batches = Batches(state_dir, server) if clock is None else Batches(state_dir, server, clock=clock)
    with TestClient(make_app(server)) as client:
        yield server, client


def assert_error(response, status: int, param: str | None, kind: str = "invalid_request_error") -> str:
    """The message of an error answer in OpenAI's shape, checked to be one line."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS and error["type"] == kind and error["param"] == param, error
    assert "\n" not in error["message"], error["message"]
    return error["message"]


def records(text: str) -> list[dict]:
    return [json.loads(line) for line in text.split("\n") if line.strip()]


def upload(client, data: bytes, name: str = "batch.jsonl") -> dict:
    response = client.post("/v1/files", files={"file": (name, data)}, data={"purpose": "batch"})
    assert response.status_code == 200, response.text
    return response.json()


def wait_until(check, what: str, timeout_s: float = 60):
    """Poll check() until it gives something true, which is returned; fails naming what after timeout_s (a bound
    for a hung server, not a measurement)."""
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return found


class Clock:
    """A clock a test moves: seconds since the epoch, as time.time gives them."""

    def __init__(self, now_s: float = 1_700_000_000.0):
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


class StepGate:
    """Holds each engine step for which hold(running) is true until released (or the block ends), so what has run
    stays fixed while a test looks; counts the steps that ran."""

    def __init__(self, llm, monkeypatch, hold):
        self.released, self.n_steps, self.n_held = threading.Event(), 0, 0
        step = llm.generator.step

        def gated(running, *args):
            self.n_steps += 1
            if not self.released.is_set() and hold(running):
                self.n_held += 1
                self.released.wait(60)
            return step(running, *args)

        monkeypatch.setattr(llm.generator, "step", gated)

    def __enter__(self) -> StepGate:
        return self

    def __exit__(self, *exc) -> None:
        self.released.set()

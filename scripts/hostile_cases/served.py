"""One `offload serve` of the tiny model for every http and batch case (a real process on a free port, with an API
key and a state folder for the Batch API): a request sent as given, its health after, a restart where it went down,
and a file run through the Batch API."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

from bench_serve import free_port

KEY = "sk-hostile"
AUTH = {"Authorization": f"Bearer {KEY}"}
START_TIMEOUT_S = 180.0
BATCH_TIMEOUT_S = 30.0  # a batch of a few tiny requests, start to end


@dataclass(frozen=True)
class Http:
    """A request as sent: body a dict (sent as JSON), bytes or str (as they are, with content_type), or None."""

    method: str
    path: str
    body: object = None
    headers: dict = field(default_factory=lambda: dict(AUTH))
    content_type: str = "application/json"


@dataclass(frozen=True)
class BatchFile:
    """A file for the Batch API: its name and bytes, the endpoint the batch is created for."""

    name: str
    data: bytes
    endpoint: str = "/v1/completions"


class Served:
    def __init__(self, fx):
        self.fx, self.restarts, self.proc = fx, 0, None
        self.start()

    def start(self) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = open(self.fx.work / "serve.log", "a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "offload", "serve", "--model", str(self.fx.model), "--port", str(self.port),
             "--api-key", KEY, "--max-model-len", "64", "--max-tokens", "2", "--max-waiting", "8",
             "--state-dir", str(self.fx.work / "state"), "--quiet"], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.healthy(2.0):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"offload serve did not start; see {self.fx.work / 'serve.log'}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def restart(self) -> None:
        self.restarts += 1
        self.stop()
        self.start()

    def healthy(self, timeout_s: float) -> bool:
        if self.proc.poll() is not None:
            return False
        try:
            return httpx.get(f"{self.base}/health", timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def send(self, req: Http, timeout_s: float) -> tuple[int | None, bytes]:
        """(status, body) of req, the body read whole (a stream to its end); (None, b"") past timeout_s, 599 where
        the connection broke."""
        if isinstance(req.body, (bytes, str)):
            sent = {"content": req.body, "headers": {**req.headers, "content-type": req.content_type}}
        else:
            sent = {"json": req.body, "headers": req.headers} if req.body is not None else {"headers": req.headers}
        deadline = time.monotonic() + timeout_s
        try:
            with httpx.stream(req.method, self.base + req.path, timeout=timeout_s, **sent) as response:
                body = b""
                for piece in response.iter_bytes():
                    body += piece
                    if time.monotonic() > deadline:
                        return None, body
                return response.status_code, body
        except httpx.TimeoutException:
            return None, b""
        except httpx.TransportError as e:  # the server dropped the connection: its failure
            return 599, f"the connection failed ({type(e).__name__}: {e})".encode()

    def call(self, method: str, path: str, timeout_s: float, **kwargs) -> httpx.Response:
        return httpx.request(method, self.base + path, headers=AUTH, timeout=timeout_s, **kwargs)

    def batch(self, spec: BatchFile, expect: str, timeout_s: float) -> tuple[str, str]:
        """Upload spec, run a batch of it, read its outputs: each custom_id of the file answered once, the bad ones as
        error lines, or the file refused in one line (at upload, at create, or as the batch's failure)."""
        try:
            up = self.call("POST", "/v1/files", timeout_s, files={"file": (spec.name, spec.data)},
                           data={"purpose": "batch"})
            if up.status_code != 200:
                return _refused(up)
            made = self.call("POST", "/v1/batches", timeout_s, json={
                "input_file_id": up.json()["id"], "endpoint": spec.endpoint, "completion_window": "24h"})
            if made.status_code != 200:
                return _refused(made)
            batch = self._finished(made.json()["id"], timeout_s)
        except httpx.TimeoutException:
            return "hang", f"a Batch API call took over {timeout_s:.0f} s"
        if batch is None:
            return "hang", f"the batch did not end in {BATCH_TIMEOUT_S:.0f} s"
        if batch["status"] == "failed":
            message = ((batch.get("errors") or {}).get("data") or [{}])[0].get("message", "")
            return ("clean", message) if message and "\n" not in message else ("unclear", json.dumps(batch)[:300])
        return self._judge_outputs(spec, batch, expect, timeout_s)

    def _finished(self, batch_id: str, timeout_s: float) -> dict | None:
        deadline = time.monotonic() + BATCH_TIMEOUT_S
        while time.monotonic() < deadline:
            batch = self.call("GET", f"/v1/batches/{batch_id}", timeout_s).json()
            if batch["status"] in ("completed", "failed", "expired", "cancelled"):
                return batch
            time.sleep(0.1)
        return None

    def _judge_outputs(self, spec: BatchFile, batch: dict, expect: str, timeout_s: float) -> tuple[str, str]:
        records = []
        for key in ("output_file_id", "error_file_id"):
            if batch.get(key):
                text = self.call("GET", f"/v1/files/{batch[key]}/content", timeout_s).text
                records += [json.loads(line) for line in text.split("\n") if line.strip()]
        keys = [r.get("custom_id") for r in records]
        wanted = _custom_ids(spec.data)
        if sorted(k for k in keys if k is not None) != sorted(wanted):
            return "lost/duplicated", f"wanted {wanted}, got {keys}"
        errors = [r for r in records if r.get("error")]
        if expect == "ok":
            return ("clean", "") if not errors else ("unclear", json.dumps(errors[0])[:300])
        if not errors:
            return "wrong success", f"every line answered: {keys}"
        message = errors[0]["error"].get("message", "")
        return ("clean", message) if message and "\n" not in message else ("unclear", json.dumps(errors[0])[:300])


def _refused(response: httpx.Response) -> tuple[str, str]:
    if response.status_code >= 500:
        return "traceback", f"{response.status_code}: {response.text[:300]}"
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return "unclear", f"{response.status_code}: {response.text[:300]}"
    return ("clean", message) if "\n" not in message else ("unclear", message[:300])


def _custom_ids(data: bytes) -> list[str]:
    """The string custom_ids of a JSONL file's lines that parse."""
    out = []
    for line in data.decode(errors="replace").split("\n"):
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get("custom_id"), str) and obj["custom_id"]:
            out.append(obj["custom_id"])
    return out

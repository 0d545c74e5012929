"""offload serve's Batch API: a batch file uploaded through the official openai client completes with every
custom_id answered once (answers in the output file, failed lines in the error file) and the answers are
LLM.generate's; a server SIGKILLed mid-batch and restarted on its state folder finishes it, every custom_id still
once; an interactive request is answered while a batch runs; cancel keeps what was answered; ids cannot leave the state folder; uploads have a limit; every route but
/health needs the key; without a state folder the routes say how to get one."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="offload[serve] is not installed")
import httpx  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from offload import LLM, SamplingParams  # noqa: E402
from offload.jobs.config import load_config, sampling_defaults  # noqa: E402
from offload.serve.app import Server, make_app  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from make_llama import tiny  # noqa: E402

CONTEXT = 128
ERROR_KEYS = {"message", "type", "param", "code"}
PROMPTS = ["The quick brown fox", "Once upon a time", "Hello there", "A B C D", "1 2 3"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny(tmp_path_factory.mktemp("batches") / "tiny", vocab=259, tokenizer=True)


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(str(model_dir), backend="cpu", max_model_len=CONTEXT)


@pytest.fixture(scope="module")
def defaults(model_dir) -> dict:
    return sampling_defaults(load_config(None, {"model.path": str(model_dir)}, need_input=False))


def batch_lines(n: int, max_tokens: int = 16, bad: bool = True) -> tuple[bytes, int]:
    """n request lines to /v1/completions (greedy, ignore_eos: each runs its length on any machine), two of
    them failed lines when bad (one not JSON, one to another endpoint); the bytes and the number of failed lines."""
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": "tiny", "prompt": PROMPTS[i % len(PROMPTS)] + f" {i}",
                                  "max_tokens": max_tokens, "ignore_eos": True}}) for i in range(n)]
    if bad:
        lines[7] = '{"custom_id": "r7", "url": '
        lines[11] = json.dumps({"custom_id": "r11", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"messages": [{"role": "user", "content": "hi"}]}})
    return ("\n".join(lines) + "\n").encode(), 2 if bad else 0


def records(text: str) -> list[dict]:
    return [json.loads(line) for line in text.split("\n") if line.strip()]


def assert_error(response, status: int, param: str | None, kind: str = "invalid_request_error") -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS and error["type"] == kind and error["param"] == param, error
    return error["message"]


@contextmanager
def serving(llm, defaults, **kw):
    server = Server(llm, "tiny", defaults=defaults, **kw)
    with TestClient(make_app(server)) as client:
        yield server, client


def wait_for(client, batch_id: str, final=("completed", "failed", "cancelled"), timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while (batch := client.get(f"/v1/batches/{batch_id}").json())["status"] not in final:
        assert time.monotonic() < deadline, batch
        time.sleep(0.05)
    return batch


def test_ids_stay_in_the_state_folder_and_bad_requests_get_openai_errors(llm, defaults, tmp_path):
    state = tmp_path / "state"
    (tmp_path / "secret.json").write_text('{"id": "x"}')
    with serving(llm, defaults, state_dir=state, max_upload_bytes=1000) as (_, client):
        for bad_id in ("..%2F..%2Fsecret", "%2Fetc%2Fpasswd", "file-..%2F..%2Fsecret", "file-" + "0" * 23 + "G"):
            assert_error(client.get(f"/v1/files/{bad_id}/content"), 404, None)
            assert_error(client.get(f"/v1/files/{bad_id}"), 404, None)
        assert_error(client.get("/v1/files/" + "file-" + "0" * 24 + "/content"), 404, None)
        assert_error(client.get("/v1/batches/batch_" + "0" * 24), 404, None)
        assert_error(client.get("/v1/batches/..%2Fsecret"), 404, None)
        assert_error(client.post("/v1/batches/batch_" + "0" * 24 + "/cancel"), 404, None)
        small, _ = batch_lines(2, bad=False)
        assert_error(client.post("/v1/files", files={"file": ("b.jsonl", small)}, data={"purpose": "fine-tune"}),
                     400, "purpose")
        big = small * 5
        msg = assert_error(client.post("/v1/files", files={"file": ("b.jsonl", big)}, data={"purpose": "batch"}),
                           413, "file")
        assert "--max-upload" in msg and "1000 bytes" in msg
        # a body that says nothing of its length (chunked) is cut off as it passes the limit
        chunks = iter([b"x" * 40_000] * 4)
        assert_error(client.post("/v1/files", content=chunks, headers={"content-type": "multipart/form-data; "
                                                                                       "boundary=b"}), 413, "file")
        uploaded = client.post("/v1/files", files={"file": ("b.jsonl", small)}, data={"purpose": "batch"}).json()
        assert uploaded["bytes"] == len(small) and uploaded["purpose"] == "batch" and uploaded["object"] == "file"
        assert client.get(f"/v1/files/{uploaded['id']}/content").content == small
        create = {"input_file_id": uploaded["id"], "endpoint": "/v1/completions", "completion_window": "24h"}
        assert_error(client.post("/v1/batches", json={**create, "endpoint": "/v1/embeddings"}), 400, "endpoint")
        assert_error(client.post("/v1/batches", json={**create, "completion_window": "1w"}), 400,
                     "completion_window")
        assert_error(client.post("/v1/batches", json={**create, "input_file_id": "../secret"}), 404, None)
    assert sorted(p.name for p in (state / "files").iterdir()) == sorted([uploaded["id"], uploaded["id"] + ".json"])
    with serving(llm, defaults) as (_, client):
        for response in (client.post("/v1/files", files={"file": ("b.jsonl", small)}, data={"purpose": "batch"}),
                         client.get("/v1/batches"), client.post("/v1/batches", json=create)):
            assert "--state-dir" in assert_error(response, 400, None)


def test_every_batch_and_file_route_needs_the_key(llm, defaults, tmp_path):
    small, _ = batch_lines(2, bad=False)
    with serving(llm, defaults, state_dir=tmp_path, api_key="sesame") as (_, client):
        some = "file-" + "0" * 24
        for method, path in (("post", "/v1/files"), ("get", f"/v1/files/{some}"), ("get", f"/v1/files/{some}/content"),
                             ("post", "/v1/batches"), ("get", "/v1/batches"), ("get", "/v1/batches/batch_x"),
                             ("post", "/v1/batches/batch_x/cancel")):
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                assert_error(getattr(client, method)(path, headers=headers), 401, None)
        good = {"Authorization": "Bearer sesame"}
        assert client.post("/v1/files", files={"file": ("b.jsonl", small)}, data={"purpose": "batch"},
                           headers=good).status_code == 200
        assert client.get("/v1/batches", headers=good).json()["data"] == []


def test_an_interactive_request_runs_beside_a_batch_and_a_cancel_keeps_its_answers_once(model_dir, defaults, tmp_path):
    data, _ = batch_lines(30, max_tokens=40, bad=False)
    two = LLM(str(model_dir), backend="cpu", max_model_len=CONTEXT, batch_size=2)  # 15 rounds of 40 steps
    want = two.generate("Hello", SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0].text
    with serving(two, defaults, state_dir=tmp_path) as (server, client):
        step = server.engine_thread.engine.step
        server.engine_thread.engine.step = lambda: (time.sleep(0.002), step())[1]  # a slower machine's steps
        file_id = client.post("/v1/files", files={"file": ("b.jsonl", data)}, data={"purpose": "batch"}).json()["id"]
        batch = client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions",
                                                 "completion_window": "24h", "metadata": {"run": "cancel"}}).json()
        assert batch["status"] in ("validating", "in_progress") and batch["metadata"] == {"run": "cancel"}
        log = tmp_path / "batches" / batch["id"] / "log.jsonl"
        deadline = time.monotonic() + 60
        while not (log.exists() and log.read_bytes().count(b"\n") >= 2):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        # an interactive request shares the batch's steps: it is answered while the batch still runs
        answer = client.post("/v1/completions", json={"prompt": "Hello", "ignore_eos": True}).json()
        assert answer["choices"][0]["text"] == want
        assert client.get(f"/v1/batches/{batch['id']}").json()["status"] == "in_progress"
        assert client.post(f"/v1/batches/{batch['id']}/cancel").json()["status"] in ("cancelling", "cancelled")
        done = wait_for(client, batch["id"])
        assert done["status"] == "cancelled" and done["cancelled_at"] and done["error_file_id"] is None
        answers = records(client.get(f"/v1/files/{done['output_file_id']}/content").text)
        ids = [r["custom_id"] for r in answers]
        assert 2 <= len(ids) < 30 and len(set(ids)) == len(ids) and done["request_counts"]["completed"] == len(ids)
        assert server.engine_thread.engine.n_waiting == 0
        deadline = time.monotonic() + 10
        while server.engine_thread.engine.n_running:  # the aborted ones leave at the next step
            assert time.monotonic() < deadline
            time.sleep(0.01)
        listed = client.get("/v1/batches").json()
        assert [b["id"] for b in listed["data"]] == [batch["id"]] and listed["has_more"] is False


def test_a_batch_whose_strings_hold_line_separators_counts_and_answers_each_line_once(llm, defaults, tmp_path):
    """Issue 44 item 1: a 6-line upload with raw U+2028, U+2029 and U+0085 in its strings (JSON allows them) was
    counted as 8 requests and two were in neither file; lines may end in CRLF."""
    bodies = [{"prompt": f"a{sep}b", "max_tokens": 2} for sep in ("\u2028", "\u2029", "\x85")]
    lines = [json.dumps({"custom_id": f"r{i}\u2028", "method": "POST", "url": "/v1/completions", "body": body},
                        ensure_ascii=False) for i, body in enumerate(bodies)]
    lines += ['{"custom_id": "broken\u2028", "url": ', json.dumps({"custom_id": "chat\x85", "method": "POST",
              "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "hi"}]}},
              ensure_ascii=False), json.dumps({"custom_id": "last", "method": "POST", "url": "/v1/completions",
                                               "body": {"prompt": "x\u2029y", "max_tokens": 2}}, ensure_ascii=False)]
    data = "".join(line + ("\r\n" if i % 2 else "\n") for i, line in enumerate(lines)).encode()
    with serving(llm, defaults, state_dir=tmp_path / "state") as (_, client):
        file_id = client.post("/v1/files", files={"file": ("b.jsonl", data)}, data={"purpose": "batch"}).json()["id"]
        batch = client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions",
                                                 "completion_window": "24h"}).json()
        done = wait_for(client, batch["id"])
        assert done["status"] == "completed" and done["request_counts"] == {"total": 6, "completed": 4, "failed": 2}
        answers = records(client.get(f"/v1/files/{done['output_file_id']}/content").text)
        errors = records(client.get(f"/v1/files/{done['error_file_id']}/content").text)
    assert sorted(r["custom_id"] for r in answers) == ["last", "r0\u2028", "r1\u2028", "r2\u2028"]
    assert sorted(((r["custom_id"], r["error"]["line"]) for r in errors), key=lambda e: e[1]) == [
        (None, 4), ("chat\x85", 5)]


class FullDisk:
    """An open file on a disk that has just filled up: every write fails as the OS says it then."""

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def flush(self):
        pass

    def close(self):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def fill_the_disk_after(monkeypatch, n_records: int) -> None:
    """The batch's log takes n_records, then the disk is full."""
    from offload.jobs.output import OutputLog

    append, written = OutputLog.append, []

    def filling(self, record):
        if len(written) >= n_records:
            self._file = FullDisk()
        written.append(record)
        append(self, record)

    monkeypatch.setattr(OutputLog, "append", filling)


def test_a_batch_whose_log_fills_the_disk_ends_failed_with_its_answers_and_each_request_once(llm, defaults,
                                                                                            tmp_path, monkeypatch):
    """Issue 44 item 2: it ended `failed` with no output file, no error file, completed 0, and a message that the
    answers were "kept in its output file ... rerun to resume". Now, as OpenAI ends a batch that cannot finish: the
    answers in the output file, the failed lines and every request not run (code batch_failed) in the error file,
    and a message that says so."""
    data, n_bad = batch_lines(14, max_tokens=2)
    fill_the_disk_after(monkeypatch, n_bad + 3)  # the two failed lines, then three answers
    with serving(llm, defaults, state_dir=tmp_path / "state") as (_, client):
        file_id = client.post("/v1/files", files={"file": ("b.jsonl", data)}, data={"purpose": "batch"}).json()["id"]
        batch = client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions",
                                                 "completion_window": "24h"}).json()
        done = wait_for(client, batch["id"])
        answers = records(client.get(f"/v1/files/{done['output_file_id']}/content").text)
        errors = records(client.get(f"/v1/files/{done['error_file_id']}/content").text)
    assert done["status"] == "failed" and done["request_counts"] == {"total": 14, "completed": 3, "failed": 11}
    message = done["errors"]["data"][0]["message"]
    assert "No space left on device" in message and "its 3 answers are in its output file" in message, message
    assert "2 failed lines and the 9 requests it did not run" in message and "rerun" not in message, message
    assert len(answers) == 3 and all(r["error"] is None for r in answers)
    not_run = [r for r in errors if r["error"]["code"] == "batch_failed"]
    assert len(not_run) == 9 and all("not run: the batch stopped" in r["error"]["message"] for r in not_run)
    ids = [r["custom_id"] or f"line:{r['error']['line']}" for r in answers + errors]
    assert len(ids) == len(set(ids)) == 14  # each request once, in one of the two files


def test_a_batch_whose_outputs_cannot_be_written_either_resumes_at_the_next_start(llm, defaults, tmp_path,
                                                                                 monkeypatch):
    """Where even the output files cannot be written, the batch is left in progress; the next server on the state
    folder resumes it and answers every request once."""
    from offload.serve.batches import Batches

    data, _ = batch_lines(6, max_tokens=2, bad=False)
    state = tmp_path / "state"
    with monkeypatch.context() as full:
        fill_the_disk_after(full, 2)
        full.setattr(Batches, "_adopt_outputs", lambda self, batch_id: FullDisk().write(b""))
        with serving(llm, defaults, state_dir=state) as (server, client):
            file_id = client.post("/v1/files", files={"file": ("b.jsonl", data)},
                                  data={"purpose": "batch"}).json()["id"]
            batch_id = client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions",
                                                         "completion_window": "24h"}).json()["id"]
            deadline = time.monotonic() + 60
            while server.batches._runners[batch_id].alive:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert client.get(f"/v1/batches/{batch_id}").json()["status"] == "in_progress"
    with serving(llm, defaults, state_dir=state) as (_, client):
        done = wait_for(client, batch_id)
        answers = records(client.get(f"/v1/files/{done['output_file_id']}/content").text)
    assert done["status"] == "completed" and done["request_counts"] == {"total": 6, "completed": 6, "failed": 0}
    assert sorted(r["custom_id"] for r in answers) == [f"r{i}" for i in range(6)]


# --- a real offload serve, driven by the official client ---------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: Path, state: Path, port: int, log_path: Path, *flags: str) -> subprocess.Popen:
    """`offload serve` on 127.0.0.1:port (its default host), once /health answers."""
    log = open(log_path, "a")
    proc = subprocess.Popen([sys.executable, "-m", "offload", "serve", "--model", str(model_dir), "--backend", "cpu",
                             "--max-model-len", str(CONTEXT), "--port", str(port), "--state-dir", str(state), *flags],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OFFLOAD_API_KEY": "sesame"})
    log.close()
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, log_path.read_text()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "offload serve did not answer /health in 180 s"
        time.sleep(0.3)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_batch(client, batch_id: str, timeout_s: float = 120):
    deadline = time.monotonic() + timeout_s
    while (batch := client.batches.retrieve(batch_id)).status not in ("completed", "failed", "cancelled"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
    return batch


def outputs(client, batch) -> tuple[list[dict], list[dict]]:
    return (records(client.files.content(batch.output_file_id).text),
            records(client.files.content(batch.error_file_id).text))


def test_a_batch_of_40_completes_through_the_official_client(llm, model_dir, tmp_path):
    openai = pytest.importorskip("openai", reason="the test extra brings openai")
    data, n_bad = batch_lines(40)
    want = {f"r{i}": llm.generate(PROMPTS[i % len(PROMPTS)] + f" {i}", SamplingParams(
        max_tokens=16, temperature=0, ignore_eos=True))[0].text for i in (0, 13, 39)}
    port = free_port()
    proc = start_server(model_dir, tmp_path / "state", port, tmp_path / "serve.log")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sesame", max_retries=0)
        uploaded = client.files.create(file=("requests.jsonl", data), purpose="batch")
        assert uploaded.bytes == len(data) and uploaded.filename == "requests.jsonl"
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
        assert batch.input_file_id == uploaded.id and batch.endpoint == "/v1/completions"
        batch = wait_batch(client, batch.id)
        assert batch.status == "completed" and batch.completed_at and batch.in_progress_at
        assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (
            40, 40 - n_bad, n_bad)
        answers, errors = outputs(client, batch)
        answered = {r["custom_id"]: r for r in answers}
        assert len(answered) == len(answers) == 40 - n_bad and all(r["error"] is None for r in answers)
        assert sorted(r["custom_id"] or f"line:{r['error']['line']}" for r in errors) == ["line:8", "r11"]
        assert "/v1/completions" in next(r for r in errors if r["custom_id"] == "r11")["error"]["message"]
        for custom_id, text in want.items():
            body = answered[custom_id]["response"]["body"]
            assert body["choices"][0]["text"] == text and body["usage"]["completion_tokens"] == 16
        assert [b.id for b in client.batches.list()] == [batch.id]
        assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"
    finally:
        stop(proc)


def test_a_server_killed_mid_batch_resumes_it_on_restart_and_answers_each_custom_id_once(model_dir, tmp_path):
    openai = pytest.importorskip("openai", reason="the test extra brings openai")
    data, n_bad = batch_lines(40, max_tokens=48)
    state, port = tmp_path / "state", free_port()
    flags = ("--batch-size", "2")  # two sequences a step: the batch takes many steps, so the kill lands mid-batch
    proc = start_server(model_dir, state, port, tmp_path / "serve.log", *flags)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sesame", max_retries=0)
        file_id = client.files.create(file=("requests.jsonl", data), purpose="batch").id
        batch = client.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
        log = state / "batches" / batch.id / "log.jsonl"
        deadline = time.monotonic() + 120
        while not (log.exists() and log.read_bytes().count(b"\n") >= n_bad + 3):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        n_before = len(records(log.read_text(errors="replace").rsplit("\n", 1)[0]))
        assert n_bad + 3 <= n_before < 40, n_before
        proc = start_server(model_dir, state, port, tmp_path / "serve.log", *flags)
        batch = wait_batch(client, batch.id)
        assert batch.status == "completed" and (batch.request_counts.completed, batch.request_counts.failed) == (
            40 - n_bad, n_bad)
        answers, errors = outputs(client, batch)
        keys = [r["custom_id"] for r in answers] + [r["custom_id"] or f"line:{r['error']['line']}" for r in errors]
        assert sorted(keys) == sorted([f"r{i}" for i in range(40) if i != 7] + ["line:8"])
    finally:
        stop(proc)


def test_the_server_listens_on_this_machine_only_unless_told_and_takes_the_upload_limit(tmp_path):
    from offload.cli.job_flags import effective_config
    from offload.cli.main import build_parser

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    plain = effective_config(build_parser().parse_args(["serve", "--model", str(model)]), need_input=False).serve
    assert plain.host == "127.0.0.1" and plain.max_upload_bytes == 200_000_000 and plain.api_key is None
    told = effective_config(build_parser().parse_args(["serve", "--model", str(model), "--host", "0.0.0.0",
                                                       "--max-upload", "1MiB"]), need_input=False).serve
    assert told.host == "0.0.0.0" and told.max_upload_bytes == 2**20

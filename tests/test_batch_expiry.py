"""The Batch API's window and file routes: completion_window takes a duration and refuses anything else in one line;
a batch still running when its window ends (on an injected clock) expires with its answers in its output file and
each request it did not answer in its error file (batch_expired), every custom_id once, also when the window ended
while the server was down; GET /v1/files lists (by purpose, paged) and DELETE /v1/files/{id} deletes, refusing the
input of a running batch, and a restart keeps what was deleted gone and sweeps half-written files."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi", reason="offload[serve] is not installed")

from serve_support import (Clock, StepGate, assert_error, records, serving, server_defaults, tiny_llm,  # noqa: E402
                           tiny_model, upload, wait_until)

N_SHORT, N_LONG = 3, 5
LONG_TOKENS = 60  # held at its 3rd token: far from its end


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("expiry") / "tiny")


@pytest.fixture(scope="module")
def llm(model_dir):
    return tiny_llm(model_dir)


@pytest.fixture(scope="module")
def defaults(model_dir):
    return server_defaults(model_dir)


def batch_file() -> bytes:
    """N_SHORT requests of 2 tokens, then N_LONG of LONG_TOKENS (greedy, ignore_eos: each runs its length)."""
    lines = [{"custom_id": f"short{i}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": f"Hi {i}", "max_tokens": 2, "ignore_eos": True}} for i in range(N_SHORT)]
    lines += [{"custom_id": f"long{i}", "method": "POST", "url": "/v1/completions",
               "body": {"prompt": f"Once upon {i}", "max_tokens": LONG_TOKENS, "ignore_eos": True}}
              for i in range(N_LONG)]
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def holding_the_long_ones(running) -> bool:
    """A step is held once a long request has 3 tokens: the short ones (2 tokens, admitted with them) are done."""
    return any(len(s.output_ids) >= 3 for s in running)


def create(client, file_id: str, window: str = "24h"):
    return client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions",
                                            "completion_window": window})


def batch_of(client, batch_id: str) -> dict:
    return client.get(f"/v1/batches/{batch_id}").json()


def outputs(client, batch: dict) -> tuple[list[dict], list[dict]]:
    def read(file_id):
        return records(client.get(f"/v1/files/{file_id}/content").text) if file_id else []
    return read(batch["output_file_id"]), read(batch["error_file_id"])


def assert_expired_with_each_custom_id_once(client, batch: dict, clock: Clock) -> None:
    assert batch["status"] == "expired" and batch["expired_at"] == int(clock.now_s), batch
    assert batch["completed_at"] is None and batch["errors"] is None
    answers, errors = outputs(client, batch)
    assert sorted(r["custom_id"] for r in answers) == [f"short{i}" for i in range(N_SHORT)]
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in answers)
    assert sorted(r["custom_id"] for r in errors) == [f"long{i}" for i in range(N_LONG)]
    assert all(r["error"]["code"] == "batch_expired" and r["response"] is None for r in errors), errors
    assert batch["request_counts"] == {"total": N_SHORT + N_LONG, "completed": N_SHORT, "failed": N_LONG}


def test_completion_window_takes_a_duration_and_refuses_anything_else_in_one_line(llm, defaults, tmp_path):
    clock = Clock()
    with serving(llm, defaults, tmp_path / "state", clock) as (_, client):
        file_id = upload(client, b'{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "Hi"}}\n')["id"]
        for window, window_s in (("24h", 86_400), ("90m", 5_400), ("7d", 604_800), ("45s", 45)):
            batch = create(client, file_id, window).json()
            assert batch["completion_window"] == window, batch
            assert (batch["created_at"], batch["expires_at"]) == (int(clock.now_s), int(clock.now_s) + window_s)
        for window in ("24", "h", "0h", "1.5h", "24 h", "24H", "1w", "", 24, None, "9999999h"):
            message = assert_error(create(client, file_id, window), 400, "completion_window")
            assert "'24h'" in message and repr(window)[:20] in message


def test_a_batch_whose_window_ends_expires_with_its_answers_and_the_rest_batch_expired(llm, defaults, tmp_path,
                                                                                      monkeypatch):
    clock, state = Clock(), tmp_path / "state"
    with serving(llm, defaults, state, clock) as (server, client), \
            StepGate(llm, monkeypatch, holding_the_long_ones) as gate:
        batch_id = create(client, upload(client, batch_file())["id"], "1h").json()["id"]
        wait_until(lambda: gate.n_held and batch_of(client, batch_id)["request_counts"]["completed"] == N_SHORT,
                   "the short requests' answers, the long ones held")
        clock.now_s += 3599  # a second before the window ends: still running
        assert batch_of(client, batch_id)["status"] == "in_progress"
        clock.now_s += 1
        batch = wait_until(lambda: (b := batch_of(client, batch_id))["status"] == "expired" and b, "the expiry")
        assert_expired_with_each_custom_id_once(client, batch, clock)
        gate.released.set()
        engine = server.engine_thread.engine
        wait_until(lambda: not engine.has_work(), "the aborted requests leaving the engine")
        assert engine.kv_slots_used == 0
    with serving(llm, defaults, state, clock) as (_, client):  # a restart leaves an expired batch as it ended
        assert batch_of(client, batch_id) == batch
        assert_expired_with_each_custom_id_once(client, batch, clock)


def test_a_window_that_ends_while_the_server_is_down_expires_the_batch_as_it_resumes(llm, defaults, tmp_path,
                                                                                  monkeypatch):
    clock, state = Clock(), tmp_path / "state"
    with serving(llm, defaults, state, clock) as (server, client), \
            StepGate(llm, monkeypatch, holding_the_long_ones) as gate:
        batch_id = create(client, upload(client, batch_file())["id"], "2h").json()["id"]
        wait_until(lambda: gate.n_held and batch_of(client, batch_id)["request_counts"]["completed"] == N_SHORT,
                   "the short requests' answers, the long ones held")
        server.batches.stop()  # the server dies here: the batch's folder holds its object and its log as they stand
    assert json.loads((state / "batches" / batch_id / "batch.json").read_text())["status"] == "in_progress"
    clock.now_s += 2 * 3600
    with serving(llm, defaults, state, clock) as (_, client), StepGate(llm, monkeypatch, lambda running: False) as gate:
        batch = wait_until(lambda: (b := batch_of(client, batch_id))["status"] == "expired" and b, "the expiry")
        assert_expired_with_each_custom_id_once(client, batch, clock)
        assert gate.n_steps == 0  # nothing ran again: the answers are the log's, the rest expired unanswered


def test_files_are_listed_by_purpose_and_deleted_unless_a_running_batch_reads_them(llm, defaults, tmp_path,
                                                                                  monkeypatch):
    clock, state = Clock(), tmp_path / "state"
    with serving(llm, defaults, state, clock) as (_, client), \
            StepGate(llm, monkeypatch, holding_the_long_ones) as gate:
        first, second, third = (upload(client, batch_file(), f"b{i}.jsonl") for i in range(3))
        batch_id = create(client, second["id"], "1h").json()["id"]
        wait_until(lambda: gate.n_held, "the batch's long requests held")
        message = assert_error(client.delete(f"/v1/files/{second['id']}"), 409, None)
        assert batch_id in message and "cancel" in message
        assert client.get(f"/v1/files/{second['id']}").status_code == 200  # refused: still there
        assert client.post(f"/v1/batches/{batch_id}/cancel").status_code == 200
        cancelled = wait_until(lambda: (b := batch_of(client, batch_id))["status"] == "cancelled" and b, "the cancel")
        output_id = cancelled["output_file_id"]
        everything = client.get("/v1/files").json()
        assert everything["object"] == "list" and everything["has_more"] is False
        assert {f["id"] for f in everything["data"]} == {first["id"], second["id"], third["id"], output_id}
        assert client.get("/v1/files", params={"purpose": "batch_output"}).json()["data"] == \
            [client.get(f"/v1/files/{output_id}").json()]
        uploads = client.get("/v1/files", params={"purpose": "batch", "order": "asc"}).json()["data"]
        assert [f["id"] for f in uploads] == [f["id"] for f in sorted([first, second, third],
                                                                      key=lambda f: (f["created_at"], f["id"]))]
        page = client.get("/v1/files", params={"purpose": "batch", "limit": 2, "order": "asc"}).json()
        rest = client.get("/v1/files", params={"purpose": "batch", "after": page["last_id"], "order": "asc"}).json()
        assert page["has_more"] and [f["id"] for f in page["data"] + rest["data"]] == [f["id"] for f in uploads]
        for file_id in (second["id"], output_id):
            assert client.delete(f"/v1/files/{file_id}").json() == {"id": file_id, "object": "file", "deleted": True}
            assert_error(client.get(f"/v1/files/{file_id}"), 404, None)
            assert_error(client.get(f"/v1/files/{file_id}/content"), 404, None)
            assert_error(client.delete(f"/v1/files/{file_id}"), 404, None)
        for bad_id in ("file-" + "0" * 24, "file-" + "0" * 23 + "G", "..%2Fbatches"):
            assert_error(client.delete(f"/v1/files/{bad_id}"), 404, None)
        assert_error(client.get("/v1/files", params={"order": "newest"}), 400, "order")
        assert_error(client.get("/v1/files", params={"limit": 0}), 400, "limit")
        kept = client.get("/v1/files").json()
    (state / "files" / ("file-" + "ab" * 12)).write_bytes(b"bytes whose object was never written")
    (state / "files" / f".{first['id']}.tmp").write_bytes(b"half an upload")
    with serving(llm, defaults, state, clock) as (_, client):
        assert client.get("/v1/files").json() == kept  # deleted stays deleted; nothing half-written appears
    assert sorted(p.name for p in (state / "files").iterdir()) == \
        sorted(name for f in (first, third) for name in (f["id"], f"{f['id']}.json"))

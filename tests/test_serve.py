"""offload serve: OpenAI's completions and chat, plain and streamed, answer what LLM.generate answers; concurrent
requests share steps; bad requests get 400/401/404/503 in OpenAI's error shape; a client that leaves frees its
sequence; a failed step fails its requests only; /metrics has its series; `offload serve` starts on a port and
answers the official openai client."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="offload[serve] is not installed")
import httpx  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from offload import LLM, SamplingParams  # noqa: E402
from offload.cli.serve import check_serve_packages, lock_state_dir  # noqa: E402
from offload.errors import ConfigError  # noqa: E402
from offload.jobs.config import load_config, sampling_defaults  # noqa: E402
from offload.serve.app import Server, make_app  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from make_llama import tiny  # noqa: E402

CONTEXT = 128
PROMPT = "The quick brown fox"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny(tmp_path_factory.mktemp("serve") / "tiny", vocab=259, tokenizer=True)  # every id a byte or special


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(str(model_dir), backend="cpu", max_model_len=CONTEXT)


@pytest.fixture(scope="module")
def defaults(model_dir) -> dict:
    """The request defaults a server started on this model gets: the job's sampling section (greedy, 16 tokens)."""
    return sampling_defaults(load_config(None, {"model.path": str(model_dir)}, need_input=False))


def greedy(**kw) -> SamplingParams:
    """The server's defaults; ignore_eos: the random model's answers run their length on any machine's kernels."""
    return SamplingParams(**{"max_tokens": 16, "temperature": 0.0, "ignore_eos": True, **kw})


GO_ON = {"ignore_eos": True}


@contextmanager
def serving(llm, defaults, **kw):
    """A server and a TestClient on its app; the engine thread runs inside the block."""
    server = Server(llm, "tiny", defaults=defaults, **kw)
    with TestClient(make_app(server)) as client:
        yield server, client


def events(text: str) -> list:
    """The data of each server-sent event, JSON-decoded except [DONE]."""
    data = [line.removeprefix("data: ") for line in text.split("\n\n") if line.startswith("data: ")]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


def assert_error(response, status: int, param: str | None, kind: str = "invalid_request_error") -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS and error["type"] == kind and error["param"] == param, error
    return error["message"]


def test_plain_completions_and_chat_are_llm_generates_greedy_answers(llm, defaults):
    ids = llm.tokenizer.encode(PROMPT)
    want = [llm.generate(PROMPT, greedy())[0], llm.generate(ids, greedy(max_tokens=9))[0],
            llm.chat(CHAT, greedy())[0]]
    assert all(len(w.token_ids) > 4 and w.text for w in want)
    with serving(llm, defaults) as (_, client):
        text = client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, **GO_ON}).json()
        by_ids = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 9, **GO_ON}).json()
        chat = client.post("/v1/chat/completions", json={"model": "tiny", "messages": CHAT, **GO_ON}).json()
        models = client.get("/v1/models").json()
    assert text["object"] == "text_completion" and text["choices"][0]["text"] == want[0].text
    assert text["choices"][0]["finish_reason"] == want[0].finish_reason
    cached = text["usage"].pop("prompt_tokens_details")["cached_tokens"]  # want's run may have left the prompt
    assert text["usage"] == {"prompt_tokens": len(want[0].prompt_token_ids), "completion_tokens":
                             len(want[0].token_ids), "total_tokens": len(want[0].prompt_token_ids) +
                             len(want[0].token_ids)}
    assert 0 <= cached < len(want[0].prompt_token_ids)
    assert by_ids["choices"][0]["text"] == want[1].text
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"] == {"role": "assistant",
                                                                                      "content": want[2].text}
    assert [m["id"] for m in models["data"]] == ["tiny"] and models["data"][0]["max_model_len"] == CONTEXT


def test_streamed_chunks_join_to_the_same_text_then_usage_then_done(llm, defaults):
    plain = llm.generate(PROMPT, greedy(max_tokens=24))[0].text
    # a stop string of two characters found as late as may be, its first one a character of its own (not a byte
    # of an unfinished one): streaming must hold that back until it knows whether the stop string follows
    stop = max((plain[i: i + 2] for i in range(len(plain) - 1) if plain[i].isascii() and plain[i].isprintable()),
               key=plain.find)
    want = {"none": plain, "stop": llm.generate(PROMPT, greedy(max_tokens=24, stop=[stop]))[0].text,
            "chat": llm.chat(CHAT, greedy())[0].text}
    assert len(want["stop"]) < len(plain)
    with serving(llm, defaults) as (_, client):
        got = {"none": client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 24, "stream": True,
                                                            "stream_options": {"include_usage": True}, **GO_ON}),
               "stop": client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 24, "stream": True,
                                                            "stop": stop, **GO_ON}),
               "chat": client.post("/v1/chat/completions", json={"messages": CHAT, "stream": True,
                                                                 "stream_options": {"include_usage": True}, **GO_ON})}
    for case, response in got.items():
        assert response.headers["content-type"].startswith("text/event-stream")
        chunks = events(response.text)
        assert chunks[-1] == "[DONE]", case
        body = chunks[:-1]
        if case != "stop":  # include_usage: a last chunk with no choices and the usage; usage null before it
            usage, body = body[-1], body[:-1]
            assert usage["choices"] == [] and usage["usage"]["completion_tokens"] > 0, case
            assert all(c["usage"] is None for c in body), case
        else:
            assert all("usage" not in c for c in body)
        assert body[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        assert all(c["choices"][0]["finish_reason"] is None for c in body[:-1]), case
        if case == "chat":
            assert body[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            text = "".join(c["choices"][0]["delta"].get("content", "") for c in body)
        else:
            text = "".join(c["choices"][0]["text"] for c in body)
        assert text == want[case] and len(body) > (1 if case == "stop" else 3), case


def test_two_concurrent_requests_share_steps_and_answer_as_alone(llm, defaults, monkeypatch):
    alone = [llm.generate(PROMPT, greedy(max_tokens=12))[0].text, llm.chat(CHAT, greedy(max_tokens=20))[0].text]
    server = Server(llm, "tiny", defaults=defaults)
    batch_sizes = []
    step = llm.generator.step
    monkeypatch.setattr(llm.generator, "step", lambda running, *a: (batch_sizes.append(len(running)),
                                                                    step(running, *a))[1])

    async def both():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(make_app(server)), base_url="http://t") as c:
            tasks = [asyncio.ensure_future(c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 12,
                                                                           **GO_ON})),
                     asyncio.ensure_future(c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 20,
                                                                                **GO_ON}))]
            while server.engine_thread.engine.n_waiting < 2:  # both queued before the engine takes a step
                await asyncio.sleep(0.01)
            server.engine_thread.start()
            try:
                return await asyncio.gather(*tasks)
            finally:
                server.engine_thread.stop()

    text, chat = asyncio.run(both())
    assert [text.json()["choices"][0]["text"], chat.json()["choices"][0]["message"]["content"]] == alone
    assert max(batch_sizes) == 2 and len(batch_sizes) < 12 + 20  # one pass over the weights served both


def test_requests_that_cannot_run_get_400_naming_the_field(llm, defaults):
    too_long = "x" * (CONTEXT + 5)  # a byte-level tokenizer: one token per byte
    cases = [  # (url, body, param)
        ("/v1/completions", {"prompt": PROMPT, "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": PROMPT, "max_completion_tokens": 0}, "max_completion_tokens"),
        ("/v1/completions", {"prompt": PROMPT, "stop": 5}, "stop"),
        ("/v1/completions", {"prompt": PROMPT, "n": 0}, "n"),
        ("/v1/completions", {"prompt": PROMPT, "n": 65}, "n"),
        ("/v1/completions", {"prompt": PROMPT, "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": [PROMPT, ""]}, "prompt"),
        ("/v1/completions", {"prompt": [[1, 2], [1, 2, 100000]]}, "prompt[1]"),
        ("/v1/completions", {"prompt": too_long}, "prompt"),
        ("/v1/completions", {"prompt": [1, 2, 100000]}, "prompt"),
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/completions", {"prompt": PROMPT, "stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/completions", {"prompt": PROMPT, "stream": "yes"}, "stream"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": too_long}]}, "messages"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ]
    with serving(llm, defaults) as (server, client):
        for url, body, param in cases:
            message = assert_error(client.post(url, json=body), 400, param)
            assert param.split("[")[0] in message or "prompt" in message, (param, message)
        assert "context" in assert_error(client.post("/v1/completions", json={"prompt": too_long}), 400, "prompt")
        assert_error(client.post("/v1/completions", content=b"{not json"), 400, None)
        assert_error(client.post("/v1/completions", json=[PROMPT]), 400, None)
        message = assert_error(client.post("/v1/completions", json={"model": "gpt-4", "prompt": PROMPT}), 404,
                               "model")
        assert "'tiny'" in message
        assert client.post("/v1/completions", json={"prompt": PROMPT}).status_code == 200  # the server goes on
        assert server.engine_thread.engine.n_waiting == server.engine_thread.engine.n_running == 0


def test_an_api_key_is_required_on_every_route_but_health(llm, defaults):
    with serving(llm, defaults, api_key="sesame") as (_, client):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
            assert_error(client.post("/v1/completions", json={"prompt": PROMPT}, headers=headers), 401, None)
            assert_error(client.get("/v1/models", headers=headers), 401, None)
            assert_error(client.get("/metrics", headers=headers), 401, None)
        assert client.get("/health").status_code == 200
        good = {"Authorization": "Bearer sesame"}
        assert client.post("/v1/completions", json={"prompt": PROMPT}, headers=good).status_code == 200
        assert client.get("/metrics", headers=good).status_code == 200


def test_a_full_queue_answers_503_with_retry_after_and_a_cancelled_wait_leaves_it(llm, defaults):
    server = Server(llm, "tiny", defaults=defaults, max_waiting=1)  # its engine thread is not started: stalled
    engine = server.engine_thread.engine

    async def fill():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(make_app(server)), base_url="http://t") as c:
            waiting = asyncio.ensure_future(c.post("/v1/completions", json={"prompt": PROMPT}))
            while engine.n_waiting < 1:
                await asyncio.sleep(0.01)
            full = await c.post("/v1/completions", json={"prompt": PROMPT})
            waiting.cancel()  # the client gives up while it waits
            await asyncio.gather(waiting, return_exceptions=True)
            return full

    full = asyncio.run(fill())
    assert "max_waiting" in assert_error(full, 503, None, kind="server_error")
    assert full.headers["retry-after"] == "1"
    assert engine.n_waiting == 0  # it left the queue at once; the next step reports it
    assert [s.finish_reason for s in engine.step().finished] == ["abort"] and not engine.has_work()


def _asgi_call(app, path: str, body: dict, leave) -> list[dict]:
    """Call the app as a server would, the client leaving once leave(sent) returns: what the app sent."""
    sent = []
    messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive():
        if messages:
            return messages.pop(0)
        while not leave(sent):
            await asyncio.sleep(0.005)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"), (b"host", b"t")],
             "client": ("127.0.0.1", 9), "server": ("t", 80)}
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 60))
    return sent


def test_a_client_that_leaves_aborts_its_request_and_frees_its_slots(llm, defaults, monkeypatch):
    server = Server(llm, "tiny", defaults=defaults)
    engine, app = server.engine_thread.engine, make_app(server)
    step, gate, calls = llm.generator.step, threading.Event(), []

    def gated(running, *a):  # a request's second step waits until its client has left
        calls.append(len(running))
        if len(calls) == 2:
            gate.wait(30)
        step(running, *a)

    monkeypatch.setattr(llm.generator, "step", gated)
    body = {"prompt": PROMPT, "max_tokens": 100, "ignore_eos": True}
    def leave(sent) -> bool:  # while its second step waits (its first token sent, if that token made text)
        return len(calls) == 2 and (not stream or any(m["type"] == "http.response.start" for m in sent))

    server.engine_thread.start()
    try:
        for stream in (True, False):
            gate.clear()
            calls.clear()
            sent = _asgi_call(app, "/v1/completions", {**body, "stream": stream}, leave)
            assert engine.n_running == 1 and engine.kv_slots_used > 0  # the step after its first one waits
            gate.set()  # that step ends; the next one drops the aborted sequence
            deadline = time.monotonic() + 10
            while engine.has_work() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert engine.n_running == 0 and engine.kv_slots_used == 0 and len(calls) < 5
            assert not any(b"[DONE]" in m.get("body", b"") for m in sent)
        aborted = server.metrics.registry.get_sample_value("offload_requests_finished_total",
                                                           {"finish_reason": "abort"})
        assert aborted == 2
    finally:
        gate.set()
        server.engine_thread.stop()


def test_a_step_that_raises_fails_its_requests_with_500_and_the_server_goes_on(llm, defaults, monkeypatch):
    want = llm.generate(PROMPT, greedy())[0].text
    step, calls = llm.generator.step, []

    def fails_once(running, *a):
        calls.append(len(running))
        if len(calls) == 1:
            raise RuntimeError("simulated kernel failure")
        return step(running, *a)

    monkeypatch.setattr(llm.generator, "step", fails_once)
    with serving(llm, defaults) as (server, client):
        failed = client.post("/v1/completions", json={"prompt": PROMPT, **GO_ON})
        assert "simulated kernel failure" in assert_error(failed, 500, None, kind="server_error")
        streamed = events(client.post("/v1/completions", json={"prompt": PROMPT, "stream": True, **GO_ON}).text)
        after = client.post("/v1/completions", json={"prompt": PROMPT, **GO_ON}).json()
        assert client.get("/health").json() == {"status": "ok"}
        assert server.engine_thread.engine.kv_slots_used == 0
    assert after["choices"][0]["text"] == want
    assert "".join(c["choices"][0]["text"] for c in streamed[:-1]) == want and streamed[-1] == "[DONE]"


def test_an_engine_thread_that_dies_fails_what_is_in_flight_and_health_says_so(llm, defaults, monkeypatch):
    def dies(running, *a):
        raise KeyboardInterrupt  # not an Exception: the thread ends

    monkeypatch.setattr(llm.generator, "step", dies)
    with serving(llm, defaults) as (server, client):
        assert_error(client.post("/v1/completions", json={"prompt": PROMPT}), 500, None, kind="server_error")
        server.engine_thread._thread.join(10)
        assert client.get("/health").status_code == 503
        message = assert_error(client.post("/v1/completions", json={"prompt": PROMPT}), 503, None, "server_error")
        assert "restart offload serve" in message
    llm.acquire("this test")  # the dead thread gave the model back
    llm.release()


def test_metrics_has_the_named_series_and_the_server_owns_the_model(llm, defaults):
    with serving(llm, defaults) as (_, client):
        client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "ignore_eos": True})
        text = client.get("/metrics").text
        with pytest.raises(ConfigError, match="offload serve's engine thread"):
            llm.generate(PROMPT, greedy())
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    for name in ("offload_requests_running", "offload_requests_waiting", "offload_kv_slots_used", "offload_kv_slots",
                 "offload_time_to_first_token_seconds_count", "offload_inter_token_latency_seconds_count"):
        assert name in samples, name
    assert float(samples["offload_generation_tokens_total"]) == 5
    assert float(samples["offload_inter_token_latency_seconds_count"]) == 4
    assert float(samples['offload_phase_seconds_total{phase="decode"}']) > 0
    share = float(samples['offload_resource_busy_share{phase="decode",resource="cpu"}'])
    assert 0 < share <= 1
    assert len(llm.timeline.spans) == 0  # drained step by step: it does not grow for the server's life


def test_the_extra_is_named_when_missing_and_a_state_folder_takes_one_server(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a))
    with pytest.raises(ConfigError, match=r"needs uvicorn, which is not installed; .*pip install 'offload\[serve\]'"):
        check_serve_packages()
    fd = lock_state_dir(tmp_path / "state")
    try:
        with pytest.raises(ConfigError, match="another offload serve uses the state folder"):
            lock_state_dir(tmp_path / "state")
    finally:
        os.close(fd)
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="cannot be used"):
        lock_state_dir(tmp_path / "file" / "state")


def test_offload_serve_starts_on_a_port_and_answers_the_official_client(llm, model_dir, tmp_path):
    openai = pytest.importorskip("openai", reason="the test extra brings openai")
    want = [llm.generate(PROMPT, greedy())[0].text, llm.chat(CHAT, greedy(max_tokens=8))[0]]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "offload", "serve", "--model", str(model_dir), "--backend", "cpu",
                             "--max-model-len", str(CONTEXT), "--port", str(port), "--state-dir",
                             str(tmp_path / "state")], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "OFFLOAD_API_KEY": "sesame"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "offload serve did not answer /health in 180 s"
            time.sleep(0.5)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="sesame", max_retries=0)
        answer = client.completions.create(model="tiny", prompt=PROMPT, extra_body=GO_ON)
        assert answer.choices[0].text == want[0]
        chunks = list(client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, stream=True,
                                                     stream_options={"include_usage": True}, extra_body=GO_ON))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want[1].text
        assert chunks[-1].usage.completion_tokens == 8 and chunks[-1].usage.prompt_tokens == len(
            want[1].prompt_token_ids)
        with pytest.raises(openai.BadRequestError, match="temperature"):
            client.completions.create(model="tiny", prompt=PROMPT, temperature=-1)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_penalties_and_logit_bias_in_a_body_are_llm_generates(llm, defaults):
    body = {"presence_penalty": 1.5, "frequency_penalty": 0.5, "repetition_penalty": 1.3, "logit_bias": {"65": 5}}
    want = llm.generate(PROMPT, greedy(**body))[0]
    with serving(llm, defaults) as (_, client):
        got = client.post("/v1/completions", json={"prompt": PROMPT, **body, **GO_ON}).json()
        bad = client.post("/v1/completions", json={"prompt": PROMPT, "presence_penalty": 3})
    assert got["choices"][0]["text"] == want.text and want.text != llm.generate(PROMPT, greedy())[0].text
    assert "presence_penalty" in assert_error(bad, 400, "presence_penalty")

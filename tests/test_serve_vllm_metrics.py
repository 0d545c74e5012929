"""offload serve speaks vLLM's observability and tokenizer routes: /metrics carries vLLM's series (names, types,
model_name and engine labels, vLLM's buckets) beside offload's own, parsed by prometheus_client's own parser; the
counters only grow, the histograms count each request served once, the KV usage is a share of the pool; /tokenize
gives the ids the completion and chat routes run and /detokenize takes them back; bad input gets one-line 400s."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("fastapi", reason="offload[serve] is not installed")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from serve_support import (CONTEXT, StepGate, assert_error, serving, server_defaults, tiny_llm,  # noqa: E402
                           tiny_model, wait_until)

CHAT = [{"role": "user", "content": "Hello!"}]
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
COUNTERS = ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries", "vllm:prompt_tokens", "vllm:generation_tokens",
            "vllm:request_success")
HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
              "vllm:e2e_request_latency_seconds", "vllm:request_prompt_tokens", "vllm:request_generation_tokens")
# vLLM's buckets (vllm/v1/metrics/loggers.py), written out here so a changed constant fails this test
VLLM_TTFT_LE = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0]
VLLM_E2E_LE = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0]
TOKENS_LE_128 = [1, 2, 5, 10, 20, 50, 100]  # 1-2-5 up to max_model_len 128


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("vllm-metrics") / "tiny")


@pytest.fixture(scope="module")
def llm(model_dir):
    return tiny_llm(model_dir)


@pytest.fixture(scope="module")
def defaults(model_dir):
    return server_defaults(model_dir)


def scrape(client) -> dict:
    """/metrics parsed by prometheus_client: {family name: family}."""
    response = client.get("/metrics")
    assert response.status_code == 200
    return {f.name: f for f in text_string_to_metric_families(response.text)}


def value(families: dict, sample_name: str, **labels) -> float:
    """The one sample of that name (and those labels, beside model_name and engine)."""
    found = [s.value for f in families.values() for s in f.samples
             if s.name == sample_name and labels.items() <= s.labels.items()]
    assert len(found) == 1, (sample_name, labels, found)
    return found[0]


def counter_values(families: dict) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() if f.type == "counter"
            for s in f.samples if s.name.endswith("_total")}


def post(client, path: str, body: dict) -> dict:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_vllm_series_have_vllms_shape_and_count_each_request_once(llm, defaults):
    with serving(llm, defaults) as (_, client):
        usages = [post(client, path, {**body, "ignore_eos": True})["usage"] for path, body in (
            ("/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 5}),
            ("/v1/completions", {"prompt": "Once", "max_tokens": 5}),
            ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 4}))]
        first = scrape(client)
        more = post(client, "/v1/completions", {"prompt": "A B C", "max_tokens": 3, "ignore_eos": True})["usage"]
        second = scrape(client)
    n_prompt = sum(u["prompt_tokens"] for u in usages)
    assert [u["completion_tokens"] for u in usages] == [5, 5, 4]
    for name, kind in [*((g, "gauge") for g in GAUGES), *((c, "counter") for c in COUNTERS),
                       *((h, "histogram") for h in HISTOGRAMS)]:
        assert first[name].type == kind, (name, first[name].type)
        for sample in first[name].samples:
            assert sample.labels["model_name"] == "tiny" and sample.labels["engine"] == "0", sample
    assert value(first, "vllm:request_success_total", finished_reason="length") == 3
    assert value(first, "vllm:request_success_total", finished_reason="stop") == 0  # vLLM's reasons, from the start
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds", "vllm:request_prompt_tokens",
                 "vllm:request_generation_tokens"):
        assert value(first, f"{name}_count") == 3, name
    assert value(first, "vllm:inter_token_latency_seconds_count") == 4 + 4 + 3  # after each first token
    assert value(first, "vllm:generation_tokens_total") == value(first, "vllm:request_generation_tokens_sum") == 14
    assert value(first, "vllm:prompt_tokens_total") == value(first, "vllm:request_prompt_tokens_sum") == n_prompt
    assert value(first, "vllm:prefix_cache_queries_total") == n_prompt
    assert value(first, "vllm:prefix_cache_hits_total") == 0
    assert value(first, "vllm:num_requests_running") == value(first, "vllm:num_requests_waiting") == 0
    assert value(first, "vllm:kv_cache_usage_perc") == 0
    assert [s.labels["le"] for s in first["vllm:time_to_first_token_seconds"].samples if s.name.endswith("_bucket")] \
        == [str(b) for b in VLLM_TTFT_LE] + ["+Inf"]
    assert [s.labels["le"] for s in first["vllm:e2e_request_latency_seconds"].samples
            if s.name.endswith("_bucket")] == [str(b) for b in VLLM_E2E_LE] + ["+Inf"]
    assert [s.labels["le"] for s in first["vllm:request_prompt_tokens"].samples if s.name.endswith("_bucket")] \
        == [f"{float(b)}" for b in TOKENS_LE_128] + ["+Inf"]
    assert value(first, "offload_generation_tokens_total") == 14  # offload's own names are still there
    before, after = counter_values(first), counter_values(second)
    assert before.keys() <= after.keys() and all(after[k] >= v for k, v in before.items())
    assert value(second, "vllm:generation_tokens_total") == 14 + more["completion_tokens"]
    assert value(second, "vllm:e2e_request_latency_seconds_count") == 4


def test_kv_cache_usage_is_the_running_requests_share_of_the_pool(llm, defaults, monkeypatch):
    with serving(llm, defaults) as (server, client), \
            StepGate(llm, monkeypatch, hold=lambda running: any(len(s.output_ids) >= 2 for s in running)) as gate:
        answer = threading.Thread(target=client.post, args=("/v1/completions",),
                                  kwargs={"json": {"prompt": "Hello there", "max_tokens": 8, "ignore_eos": True}})
        answer.start()
        wait_until(lambda: gate.n_held, "the request's third step")
        held = scrape(client)
        engine = server.engine_thread.engine
        assert value(held, "vllm:num_requests_running") == 1
        assert value(held, "vllm:kv_cache_usage_perc") == pytest.approx(engine.kv_slots_used / engine.capacity)
        assert 0 < value(held, "vllm:kv_cache_usage_perc") <= 1
        gate.released.set()
        answer.join(60)
        assert value(scrape(client), "vllm:kv_cache_usage_perc") == 0


def test_tokenize_gives_the_ids_the_routes_run_and_detokenize_takes_them_back(llm, defaults):
    text = "Hello there, général"
    with serving(llm, defaults) as (_, client):
        plain = post(client, "/tokenize", {"prompt": text, "model": "tiny"})
        bare = post(client, "/tokenize", {"prompt": text, "add_special_tokens": False, "return_token_strs": True})
        chat = post(client, "/tokenize", {"messages": CHAT})
        chat_bos = post(client, "/tokenize", {"messages": CHAT, "add_special_tokens": True})
        chat_open = post(client, "/tokenize", {"messages": CHAT, "add_generation_prompt": False})
        back = post(client, "/detokenize", {"tokens": bare["tokens"]})
        answered = post(client, "/v1/completions", {"prompt": plain["tokens"], "max_tokens": 1})
    assert set(plain) == {"count", "max_model_len", "tokens", "token_strs"}
    assert plain["tokens"] == llm.tokenizer.encode(text) and plain["count"] == len(plain["tokens"])
    assert plain["max_model_len"] == CONTEXT and plain["token_strs"] is None
    assert bare["tokens"] == llm.tokenizer.encode(text, add_special_tokens=False)
    assert bare["token_strs"] == llm.tokenizer.convert_ids_to_tokens(bare["tokens"])
    assert back == {"prompt": text}
    assert chat["tokens"] == llm.apply_chat_template(CHAT)  # what /v1/chat/completions runs
    assert chat_bos["tokens"] == [llm.tokenizer.bos_token_id, *chat["tokens"]]
    assert chat_open["count"] < chat["count"] and chat["tokens"][:chat_open["count"]] == chat_open["tokens"]
    assert answered["usage"]["prompt_tokens"] == plain["count"]


@pytest.mark.parametrize("path, body, param, says", [
    ("/detokenize", {"tokens": [72, 259]}, "tokens", "token id 259"),  # one past the vocabulary
    ("/detokenize", {"tokens": [-1]}, "tokens", "token id -1"),
    ("/detokenize", {"tokens": []}, "tokens", "non-empty"),
    ("/detokenize", {"tokens": "72"}, "tokens", "found '72'"),
    ("/detokenize", {"tokens": [72.0]}, "tokens", "integers"),
    ("/detokenize", {"tokens": [True]}, "tokens", "integers"),
    ("/detokenize", {}, "tokens", "found None"),
    ("/tokenize", {"prompt": ""}, "prompt", "non-empty text"),
    ("/tokenize", {"prompt": [72, 73]}, "prompt", "non-empty text"),
    ("/tokenize", {}, "prompt", "neither"),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, "prompt", "both"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens", "true or false"),
    ("/tokenize", {"messages": []}, "messages", "non-empty list"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", "'robot'"),
    ("/tokenize", {"messages": CHAT, "add_generation_prompt": 1}, "add_generation_prompt", "true or false"),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs",
     "'tokenize'"),
])
def test_bad_tokenize_and_detokenize_bodies_get_a_one_line_400(llm, defaults, path, body, param, says):
    with serving(llm, defaults) as (_, client):
        assert says in assert_error(client.post(path, json=body), 400, param)


def test_tokenize_refuses_another_model_a_body_not_json_and_a_missing_key(llm, defaults):
    with serving(llm, defaults, api_key="sesame") as (_, client):
        key = {"Authorization": "Bearer sesame"}
        assert_error(client.post("/tokenize", json={"prompt": "a"}), 401, None)
        assert_error(client.post("/detokenize", json={"tokens": [72]}), 401, None)
        assert_error(client.post("/tokenize", json={"prompt": "a", "model": "other"}, headers=key), 404, "model")
        assert_error(client.post("/tokenize", content=b"{", headers=key), 400, None)
        assert_error(client.post("/detokenize", json=[72], headers=key), 400, None)
        answer = client.post("/detokenize", json={"tokens": [42]}, headers=key).json()
        assert answer == {"prompt": llm.tokenizer.decode([42])}


def test_a_repeated_prefix_is_cached_in_usage_and_counted_as_hits(llm, defaults):
    """A chat resent with one more turn takes its earlier blocks from the prefix cache: usage's cached_tokens (plain
    and streamed) and vllm:prefix_cache_hits say how many, within the queries."""
    system = {"role": "system", "content": "Answer in one short sentence, kindly and plainly."}
    turns = [system, *CHAT]
    with serving(llm, defaults) as (_, client):
        first = post(client, "/v1/chat/completions", {"messages": turns, "max_tokens": 3, "ignore_eos": True})
        again = post(client, "/v1/chat/completions", {"messages": turns + [
            {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Bye!"}], "max_tokens": 3})
        lines = client.post("/v1/chat/completions", json={"messages": turns, "max_tokens": 2, "stream": True,
                                                          "stream_options": {"include_usage": True}}).text
        families = scrape(client)
    import json as json_

    streamed = json_.loads([line for line in lines.splitlines() if '"usage": {' in line][-1][len("data: "):])
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (first, again, streamed)]
    assert cached[0] == 0 and cached[1] >= 16 and cached[2] >= 16, cached
    assert all(c < r["usage"]["prompt_tokens"] for c, r in zip(cached, (first, again, streamed)))
    hits, queries = value(families, "vllm:prefix_cache_hits_total"), value(families, "vllm:prefix_cache_queries_total")
    assert hits == sum(cached) and 0 < hits <= queries

"""Structured outputs (issue 47 item 2): JSON schemas, json_object, regex, choice and GBNF grammars hold a tiny random
model with the default model's tokenizer to its constraint, greedy and sampled, with and without speculation; the
model's stop token comes only where the grammar may end, and a finished grammar ends the sequence; bad constraints
are refused in one sentence by SamplingParams, a request body, the server (400) and a batch line (an error line)."""

from __future__ import annotations

import json
import re

import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

from jobs_support import (chat_line, completion_line, make_tiny_chat_model, read_records, write_batch,  # noqa: E402
                          write_job)
from offload import LLM, SamplingParams  # noqa: E402
from offload.errors import SamplingError  # noqa: E402
from offload.jobs.batch import CHAT, COMPLETIONS, BodyError, check_body  # noqa: E402
from offload.sequence import Sequence  # noqa: E402
from offload.structured import StructuredOutputsParams  # noqa: E402

CONTEXT = 512
ROOM = 320  # tokens: every schema below ends well within it (strings are bounded)
NAME = {"type": "string", "maxLength": 8}
SCHEMAS = {
    "nested objects": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"name": NAME, "address": {"type": "object", "properties": {
            "city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"]}},
                 "required": ["name", "address"]}}, "required": ["user"]},
    "arrays of objects": {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3,
                                                                     "items": {"type": "object", "properties": {
                                                                         "sku": NAME, "qty": {"type": "integer"}},
                                                                               "required": ["sku", "qty"]}}},
                          "required": ["items"]},
    "enums and required": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                                            "size": {"enum": [1, 2, 3]}, "note": NAME},
                           "required": ["color", "size"]},
    "bounded numbers": {"type": "object", "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 99},
                                                         "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
                                                         "ok": {"type": "boolean"}},
                        "required": ["age", "score", "ok"]},
}
PROMPTS = ["Describe the order as JSON.", "x", "Once upon a time"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("structured") / "model")


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(str(model_dir), backend="cpu", max_model_len=CONTEXT, batch_size=8)


def texts(llm, constraint: dict, prompts=PROMPTS, **sampling) -> list:
    params = SamplingParams(**{"max_tokens": ROOM, "temperature": 1.0, "seed": 7, **sampling},
                            structured_outputs=constraint)
    return [c for out in llm.generate(prompts, params) for c in out.outputs]


@pytest.mark.parametrize("name", SCHEMAS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schemas_hold_greedy_and_sampled(llm, name, temperature):
    schema = SCHEMAS[name]
    for out in texts(llm, {"json": schema}, temperature=temperature):
        assert out.finish_reason == "stop", (name, out.text)  # each schema ends well within ROOM tokens
        jsonschema.validate(json.loads(out.text), schema)
        assert not _free_whitespace(out.text), out.text


def _free_whitespace(text: str) -> list[str]:
    """Whitespace outside JSON strings (one cut off at the end included) other than the one space after ',' and ':'."""
    bare = re.sub(r'"(\\.|[^"\\])*("|$)', '""', text)
    return [m.group() for m in re.finditer(r"(?<![,:]) |\s{2,}|[\t\n\r]", bare)]


def test_json_object_is_one_compact_object(llm):
    for out in texts(llm, {"json_object": True}, max_tokens=64):
        if out.finish_reason == "stop":  # an object of free keys may run past the tokens: its prefix is checked
            assert isinstance(json.loads(out.text), dict), out.text
        assert out.text.startswith("{") and not _free_whitespace(out.text), out.text


def test_regex_choice_and_a_gbnf_grammar(llm):
    for out in texts(llm, {"regex": r"\d{3}-[a-z]{2,4}"}):
        assert re.fullmatch(r"\d{3}-[a-z]{2,4}", out.text) and out.finish_reason == "stop", out
    choices = ["yes", "no", "it depends"]
    outs = texts(llm, {"choice": choices}, n=4)
    assert all(o.text in choices and o.finish_reason == "stop" for o in outs), outs
    grammar = 'root ::= greeting " " name "!"\ngreeting ::= "hi" | "hello"\nname ::= [A-Z] [a-z]{1,5}\n'
    for out in texts(llm, {"grammar": grammar}, temperature=0.0) + texts(llm, {"grammar": grammar}):
        assert re.fullmatch(r"(hi|hello) [A-Z][a-z]{1,5}!", out.text) and out.finish_reason == "stop", out


def test_the_stop_token_comes_only_where_the_grammar_may_end(llm):
    """The model is pushed to its stop token (+100 on its logit): unconstrained it stops at once; held to five
    letters, it takes exactly five, then the stop token."""
    eos = llm.tokenizer.eos_token_id
    assert texts(llm, None, prompts=["x"], temperature=0.0, logit_bias={eos: 100})[0].token_ids == [eos]
    out = texts(llm, {"regex": "[a-z]{5}"}, prompts=["x"], temperature=0.0, logit_bias={eos: 100})[0]
    assert re.fullmatch("[a-z]{5}", out.text) and out.token_ids[-1] == eos and out.finish_reason == "stop", out


def test_a_finished_grammar_ends_the_sequence_even_with_ignore_eos(llm):
    for out in texts(llm, {"choice": ["done"]}, ignore_eos=True, max_tokens=40, logprobs=3):
        assert out.text == "done" and out.finish_reason == "stop", out
        assert all(lp.logprob > float("-inf") for lp in out.logprobs), "logprobs are the model's own, unmasked"


def test_proposals_are_cut_at_the_first_token_the_grammar_rejects(llm):
    constraints, tok = llm.generator.constraints, llm.tokenizer
    seq = Sequence("s", [1], SamplingParams(structured_outputs={"regex": r"[0-9]+ apples"}))
    digits, word = tok.encode("123", add_special_tokens=False), tok.encode(" pears", add_special_tokens=False)
    assert constraints.cut(seq, digits + word) == digits
    assert constraints.cut(seq, word) == []
    eos = tok.eos_token_id
    assert constraints.cut(seq, digits + tok.encode(" apples", add_special_tokens=False) + [eos])[-1] != eos
    assert constraints.cut(seq, digits) == digits  # the matcher was left where it was each time


def test_speculation_under_a_grammar_answers_as_without_it(model_dir, llm):
    spec = LLM(str(model_dir), backend="cpu", max_model_len=CONTEXT, batch_size=8,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    schema = {"type": "object", "properties": {"rows": {"type": "array", "minItems": 4, "maxItems": 6, "items": {
        "type": "object", "properties": {"k": {"enum": ["ab", "cd"]}, "v": {"type": "integer", "minimum": 0,
                                                                              "maximum": 9}},
        "required": ["k", "v"]}}}, "required": ["rows"]}
    plain = texts(llm, {"json": schema}, temperature=0.0)
    fast = texts(spec, {"json": schema}, temperature=0.0)
    assert [o.text for o in fast] == [o.text for o in plain]
    assert spec.speculative_stats["accepted"] > 0  # the repeated rows were proposed and kept
    for out in texts(spec, {"json": schema}):  # sampled: the rejection rule draws within the mask
        jsonschema.validate(json.loads(out.text), schema)


@pytest.mark.parametrize("constraint, words", [
    ({"json": {"type": "strange"}}, "JSON schema cannot be used"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"regex": "(ab"}, "regex cannot be used"),
    ({"grammar": "root ::= missing"}, "GBNF grammar cannot be used"),
    ({"choice": []}, "non-empty list"),
    ({"regex": "a", "choice": ["b"]}, "exactly one of"),
    ({"xml": "<a/>"}, "'xml' is not supported"),
    ("json", "expected a StructuredOutputsParams or a dict")])
def test_bad_constraints_are_refused_in_one_sentence(constraint, words):
    with pytest.raises(SamplingError) as e:
        SamplingParams(structured_outputs=constraint)
    assert e.value.param == "structured_outputs" and words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "xml"}}, "response_format", "one of text, json_object, json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "'schema'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "JSON schema cannot be used"),
    ({"guided_regex": "(("}, "guided_regex", "regex cannot be used"),
    ({"structured_outputs": {"grammar": 'root ::= "a" |'}}, "structured_outputs", "GBNF grammar cannot be used"),
    ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice", "two output constraints"),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "not supported")])
def test_bad_bodies_name_their_field(body, param, words):
    with pytest.raises(BodyError) as e:
        check_body(CHAT, {"messages": [{"role": "user", "content": "hi"}], **body}, {})
    assert e.value.param == param and words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_each_body_form_states_its_constraint():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    forms = [({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema,
                                                                          "strict": True}}}, "json"),
             ({"response_format": {"type": "json_object"}}, "json_object"),
             ({"structured_outputs": {"regex": "a+"}}, "regex"), ({"guided_json": json.dumps(schema)}, "json"),
             ({"guided_choice": ["a", "b"]}, "choice"), ({"guided_grammar": 'root ::= "a"'}, "grammar")]
    for body, kind in forms:
        params, _ = check_body(COMPLETIONS, {"prompt": "p", **body}, {})
        assert params.structured_outputs.kind == kind, body
    assert check_body(COMPLETIONS, {"prompt": "p", "response_format": {"type": "text"}}, {})[0].structured_outputs \
        is None
    assert StructuredOutputsParams(json=schema).key == StructuredOutputsParams(json=json.dumps(schema)).key


def test_a_model_without_a_tokenizer_refuses_a_constraint(tiny_llama):
    _, folder = tiny_llama
    bare = LLM(str(folder), backend="cpu", max_model_len=64)
    with pytest.raises(SamplingError, match="needs the model's tokenizer"):
        bare.generate([1, 2, 3], SamplingParams(structured_outputs={"regex": "a"}))


def test_the_server_answers_openais_and_vllms_request_shapes(llm):
    pytest.importorskip("fastapi", reason="offload[serve] is not installed")
    from fastapi.testclient import TestClient

    from offload.serve.app import Server, make_app

    schema = SCHEMAS["enums and required"]
    with TestClient(make_app(Server(llm, "tiny", defaults={"max_tokens": ROOM}))) as client:
        answer = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Pick a color."}], "temperature": 0.7, "seed": 1,
            "response_format": {"type": "json_schema", "json_schema": {"name": "pick", "schema": schema,
                                                                       "strict": True}}})
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)
        answer = client.post("/v1/completions", json={"prompt": "Code:", "guided_regex": "[A-Z]{2}[0-9]{2}", "n": 2})
        assert answer.status_code == 200, answer.text
        assert all(re.fullmatch("[A-Z]{2}[0-9]{2}", c["text"]) for c in answer.json()["choices"])
        bad = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                        "response_format": {"type": "json_schema", "json_schema": {
                                                            "name": "x", "schema": {"type": "integer",
                                                                                    "minimum": 5, "maximum": 1}}}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format", bad.text
        assert "cannot be used" in bad.json()["error"]["message"]


def test_a_batch_line_with_response_format(tmp_path, model_dir, llm):
    from offload.jobs.run import run_batch

    schema = SCHEMAS["bounded numbers"]
    lines = [chat_line("schema", "Rate it.", response_format={"type": "json_schema", "json_schema": {
                 "name": "rating", "schema": schema}}),
             completion_line("object", "JSON:", response_format={"type": "json_object"}, max_tokens=64),
             chat_line("bad", "hi", response_format={"type": "yaml"})]
    write_batch(tmp_path / "in.jsonl", lines)
    config = write_job(tmp_path / "job.yaml", model={"path": str(model_dir)}, input={"path": "in.jsonl"},
                       output={"path": "o.jsonl"}, sampling={"max_tokens": ROOM, "temperature": 0.8, "seed": 3},
                       report={"print": False})
    run_batch(config, llm=llm)
    records = {r["custom_id"]: r for r in read_records(tmp_path / "o.jsonl")}
    content = records["schema"]["response"]["body"]["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(content), schema)
    assert records["object"]["response"]["body"]["choices"][0]["text"].startswith("{")
    error = records["bad"]["error"]["message"]
    assert records["bad"]["response"] is None and "response_format" in error and "'yaml'" in error, error


UNBOUNDED = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {
    "type": "string"}}, "n": {"type": "integer", "minimum": 10}}, "required": ["name", "tags", "n"]}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_an_answer_running_out_of_room_is_closed_not_cut(llm, monkeypatch, temperature):
    """Strings without a maxLength, 30 tokens of room: the random model would run on past max_tokens ('length', as
    with closing switched off); closed by the grammar's shortest end, every answer validates and says 'stop'."""
    import offload.grammar as grammar

    for out in texts(llm, {"json": UNBOUNDED}, max_tokens=30, temperature=temperature):
        assert out.finish_reason == "stop" and len(out.token_ids) <= 30, out.text
        jsonschema.validate(json.loads(out.text), UNBOUNDED)
    monkeypatch.setattr(grammar, "CLOSE_WITHIN", 0)
    assert {c.finish_reason for c in texts(llm, {"json": UNBOUNDED}, max_tokens=30, temperature=temperature)} == \
        {"length"}


def test_a_grammar_that_cannot_close_in_time_is_left_to_its_length(llm):
    """Thirty digits asked for, eight tokens of room: no plan fits, nothing is forced, the answer ends 'length'."""
    for out in texts(llm, {"regex": "[0-9]{30}"}, max_tokens=8, temperature=0.0):
        assert out.finish_reason == "length" and re.fullmatch("[0-9]{8,}", out.text), out.text

"""Bad inputs issue 44's acceptance check (scripts/hostile_check.py) found answered wrongly: a traceback, minutes, a
message of hundreds of megabytes, a silent default, or a run of a broken model. Each is now one line (exit 2), one
error line of a job that goes on, one 400 in OpenAI's shape, or one OffloadError. The fixtures and helpers are
tests/test_bad_input_corpus.py's."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from jobs_support import chat_line, completion_line, read_records, run_cli, write_batch
from offload.errors import OffloadError
from test_bad_input_corpus import (AUTH, _link_model, _llm, _model_file, assert_one_error_line,  # noqa: F401
                                   assert_refused_keeping_outputs, case, env, good_job, served, write_yaml)

DEEP = 10_000  # levels of nesting: past the parsers' recursion (YAML's and JSON's stop near 1,000)
LONG = 200_000  # characters of a prompt: far past what 64 tokens of any tokenizer hold (its longest token x 64 x 2)


def _laughs(env: dict, levels: int = 8) -> bytes:
    """A job whose stop list is a billion laughs: each alias holds nine of the one before (9^7 strings in all)."""
    lines = ['a0: &a0 ["lol"]'] + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return ("\n".join(lines) + f"\nmodel: {{path: {env['model']}}}\ninput: {{path: {env['input']}}}\n"
            f"output: {{path: o.jsonl}}\nsampling:\n  stop: *a{levels - 1}\n").encode()


# name -> (the job file's bytes, made from env; words of the message)
CONFIG_CASES = {
    "a budget past a float": (lambda e: yaml_bytes(e, memory={"cpu": "1e999GiB"}),
                              ["key 'memory.cpu'", "found '1e999GiB'"]),
    "lists nested 10,000 deep": (lambda e: b"model: " + b"[" * DEEP + b"]" * DEEP + b"\n",
                                 ["its lists and mappings nest too deep to parse"]),
    "a billion laughs": (_laughs, ["has 17 problems"]),  # each of stop's 9 items, and 8 unknown keys
    "a speculative draft that does not exist": (
        lambda e: yaml_bytes(e, speculative={"method": "draft_model", "model": "/nowhere/draft"}),
        ["key 'speculative.model'", "'/nowhere/draft', which does not exist"]),
}


def yaml_bytes(env: dict, **sections) -> bytes:
    import yaml

    return yaml.safe_dump({**good_job(env["model"], env["input"]), **sections}, sort_keys=False).encode()


@pytest.mark.parametrize("name", list(CONFIG_CASES))
def test_a_hostile_config_is_one_short_line(env, case, name):
    make, words = CONFIG_CASES[name]
    (case / "job.yaml").write_bytes(make(env))
    for command in ("validate", "run"):
        assert_refused_keeping_outputs(case, env, words, command, case / "job.yaml")
    message = run_cli("validate", case / "job.yaml")[1]
    assert len(message) < 10_000, len(message)  # a few items of a wrong value, not hundreds of megabytes of it
    assert name != "a billion laughs" or "key 'sampling.stop.0': expected a string, found [[[[...]" in message


# name -> (the profile file's bytes, words of the message)
HARDWARE_CASES = {
    "not UTF-8": (bytes(range(256)), ["is not UTF-8 text (byte 128 is b'\\x80')", "or a preset name"]),
    "nested 10,000 deep": (b"cpu: " + b"[" * DEEP + b"]" * DEEP + b"\n", ["is not valid YAML (it nests too deep"]),
}


@pytest.mark.parametrize("name", list(HARDWARE_CASES))
def test_a_hostile_hardware_profile_is_one_line(env, tmp_path, name):
    data, words = HARDWARE_CASES[name]
    (tmp_path / "hw.yaml").write_bytes(data)
    assert_one_error_line(["key 'hardware'", *words], "plan", "--model", env["model"], "--hardware",
                          tmp_path / "hw.yaml")


def _int8(env: dict, folder) -> object:
    """A copy of the model whose first q_proj is stored as int8."""
    model = _link_model(env, folder)
    tensors = load_file(str(env["model"] / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = tensors[name].to(torch.int8)
    (model / "model.safetensors").unlink()
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
    return model


SLIDING = {"full_attention": {"rope_type": "default", "rope_theta": 1e4}, "sliding_attention": "x"}

# name -> (how to break a copy of the model, words of the message, whether validate (no weights read) sees it)
MODEL_CASES = {
    "head_dim 0": (lambda e, f: _link_model(e, f, head_dim=0),
                   ["key 'head_dim' must be a whole number of 1 or more, found 0"], True),
    "no key/value heads": (lambda e, f: _link_model(e, f, num_key_value_heads=0),
                           ["key 'num_key_value_heads' must be a whole number of 1 or more, found 0"], True),
    "rope_scaling a list": (lambda e, f: _link_model(e, f, rope_scaling=[1.0]),
                            ["key 'rope_scaling' must be an object of rope settings", "found '[1.0]'"], True),
    "a sliding rope section of a word": (lambda e, f: _link_model(e, f, rope_parameters=SLIDING),
                                         ["key 'rope_parameters.sliding_attention' must be an object"], True),
    "config.json nested 10,000 deep": (
        lambda e, f: _model_file(e, f, "config.json", b'{"a": ' * DEEP + b"1" + b"}" * DEEP),
        ["config.json is not a config.json offload can read", "nest too deep to parse"], True),
    "an int8 q_proj": (_int8, ["tensor model.layers.0.self_attn.q_proj.weight is stored as I8",
                               "use the unquantized weights"], False),
}


@pytest.mark.parametrize("name", list(MODEL_CASES))
def test_a_hostile_model_folder_is_one_line(env, case, name):
    make, words, validate_sees_it = MODEL_CASES[name]
    args = ["--model", make(env, case), "--input", env["input"], "--output", case / "o.jsonl", "--max-tokens", 2]
    assert_refused_keeping_outputs(case, env, words, "run", *args, "--restart")
    if validate_sees_it:
        assert_refused_keeping_outputs(case, env, words, "validate", *args)


FAR_PAST = ["characters, more than the 64 tokens of this run's context (max_model_len) can hold", "raise max_model_len"]

# custom_id -> (the request line, words of its error line)
LINE_CASES = {
    "long-prompt": (completion_line("long-prompt", "x " * (LONG // 2)),
                    ["the prompt is 200,000 characters", *FAR_PAST]),
    "long-chat": (chat_line("long-chat", "y" * LONG), ["the messages' text is 200,000 characters", *FAR_PAST]),
}


def test_prompts_far_past_the_context_are_error_lines_and_the_job_goes_on(env, tmp_path):
    """A 20 MB line was tokenized for 50 s before the context refused it: now refused by its length first."""
    job = write_yaml(tmp_path / "job.yaml", {**good_job(env["model"], tmp_path / "in.jsonl"),
                                             "model": {"path": str(env["model"]), "max_model_len": 64}})
    write_batch(tmp_path / "in.jsonl", [completion_line("first", "hi"), *[line for line, _ in LINE_CASES.values()],
                                        chat_line("last", "hello")])
    code, message = run_cli("run", job)
    assert code == 3 and "Traceback" not in message, message
    records = {r["custom_id"]: r for r in read_records(tmp_path / "o.jsonl")}
    assert len(records) == 4 and records["first"]["error"] is None and records["last"]["error"] is None
    for custom_id, (_, words) in LINE_CASES.items():
        for word in words:
            assert word in records[custom_id]["error"]["message"], (word, records[custom_id]["error"])


# name -> (a call that must raise, words of its message)
API_CASES = {
    "a placement of a string": (lambda e: _placed(e, "all on the cpu"),
                                ["LLM(placement=...) takes a Placement", "found str"]),
    "a message without content": (lambda e: _llm(e).chat([{"role": "user"}]),
                                  ["expected messages[0].content to be text, found None"]),
    "messages of a number": (lambda e: _llm(e).chat([5]), ["expected the messages to be a list", "found int"]),
    "a prompt far past the context": (lambda e: _llm(e).generate("z" * LONG), ["the prompt is 200,000", *FAR_PAST]),
    "a chat far past the context": (lambda e: _llm(e).chat([{"role": "user", "content": "z" * LONG}]),
                                    ["the messages' text is 200,000 characters"]),
}


def _placed(env: dict, placement):
    from offload import LLM

    return LLM(str(env["model"]), placement=placement)


@pytest.mark.parametrize("name", list(API_CASES))
def test_a_hostile_api_call_raises_one_sentence(env, name):
    call, words = API_CASES[name]
    with pytest.raises(OffloadError) as raised:
        call(env)
    assert type(raised.value).__name__ == "ConfigError" and "\n" not in str(raised.value)
    for word in words:
        assert word in str(raised.value), (word, str(raised.value))


# name -> (route, body, param, words)
SERVE_CASES = {
    "a prompt far past the context": ("/v1/completions", {"prompt": "w" * LONG}, "prompt",
                                      ["the prompt is 200,000 characters", *FAR_PAST]),
    "a message far past the context": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w" * LONG}]},
                                       "messages", ["the messages' text is 200,000 characters"]),
}


@pytest.mark.parametrize("name", list(SERVE_CASES))
def test_a_prompt_far_past_the_context_is_a_400_and_the_server_stays_up(served, name):
    client, handed = served
    route, body, param, words = SERVE_CASES[name]
    before = len(handed["submit"])
    response = client.post(route, json=body, headers=AUTH)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == param and "\n" not in error["message"], response.text
    for word in words:
        assert word in error["message"], (word, error["message"])
    assert len(handed["submit"]) == before
    assert client.get("/health").json() == {"status": "ok"}


def test_the_44_corpus_holds_its_cases():
    assert sum(map(len, (CONFIG_CASES, HARDWARE_CASES, MODEL_CASES, LINE_CASES, API_CASES, SERVE_CASES))) >= 20

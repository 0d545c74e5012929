"""A corpus of bad inputs, as a new user makes them (issue 32): YAML configs, paths, model folders, request lines
and API arguments. Every CLI case exits 2 with one line naming the key or path and what to do, and leaves the
outputs of an earlier run as they were; every bad request line becomes an error line naming its custom_id (or its
line) while the job goes on; nothing prints a traceback."""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
from pathlib import Path

import pytest
import yaml

from conftest import write_config
from jobs_support import chat_line, completion_line, make_tiny_chat_model, read_records, run_cli, write_batch
from offload.errors import OffloadError

EARLIER = ("o.jsonl", "o.job.json", "o.report.json")  # what an earlier run of the job left


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A tiny chat model, an input, and the outputs of a finished run of the job every case breaks one thing of;
    the hardware profile is this machine's estimate, not the user's calibrated one."""
    with pytest.MonkeyPatch.context() as mp:
        base = tmp_path_factory.mktemp("corpus")
        mp.setenv("OFFLOAD_CACHE", str(base / "cache"))
        model = make_tiny_chat_model(base / "model")
        write_batch(base / "in.jsonl", [completion_line("a", "hi"), chat_line("b", "hello")])
        (base / "earlier").mkdir()
        job = write_yaml(base / "earlier" / "job.yaml", good_job(model, base / "in.jsonl"))
        code, message = run_cli("run", job)
        assert code == 0, message
        yield {"base": base, "model": model, "input": base / "in.jsonl"}


def good_job(model: Path, input_path: Path) -> dict:
    return {"model": {"path": str(model)}, "input": {"path": str(input_path)}, "output": {"path": "o.jsonl"},
            "sampling": {"max_tokens": 2, "temperature": 0}, "report": {"print": False}}


def write_yaml(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture
def case(env, tmp_path):
    """A folder holding the earlier run's outputs (the same job, so a rerun would resume them)."""
    for name in EARLIER:
        shutil.copy(env["base"] / "earlier" / name, tmp_path / name)
    return tmp_path


def assert_refused_keeping_outputs(folder: Path, env: dict, words: list[str], *argv) -> str:
    """The command exits 2 with one error line holding words, no traceback, and the earlier outputs intact."""
    code, message = run_cli(*argv)
    errors = [line for line in message.splitlines() if line.startswith("offload: error:")]
    assert code == 2 and "Traceback" not in message and len(errors) == 1, message
    for word in words:
        assert word in errors[0], (word, errors[0])
    for name in EARLIER:
        assert (folder / name).read_bytes() == (env["base"] / "earlier" / name).read_bytes(), name
    assert not list(folder.glob("o.jsonl.bak*"))
    return errors[0]


# name -> (changes to the job's sections: {section: {key: value}}, or raw bytes of the file; words of the message)
YAML_CASES = {
    "unknown section": ({"sampler": {"top_p": 0.9}}, ["unknown key 'sampler'", "did you mean 'sampling'?"]),
    "misspelt key": ({"sampling": {"temprature": 0.5}}, ["'sampling.temprature'", "'sampling.temperature'?"]),
    "max_tokens not a number": ({"sampling": {"max_tokens": "many"}},
                                ["key 'sampling.max_tokens'", "expected a whole number", "'many'"]),
    "negative temperature": ({"sampling": {"temperature": -1}}, ["key 'sampling.temperature'", ">= 0"]),
    "top_p zero": ({"sampling": {"top_p": 0}}, ["key 'sampling.top_p'", "> 0"]),
    "stop not a list": ({"sampling": {"stop": 5}}, ["key 'sampling.stop'", "expected a list", "found 5"]),
    "seed too large": ({"sampling": {"seed": 2**70}}, ["key 'sampling.seed'"]),
    "unknown quantization": ({"model": {"quantization": "q3"}}, ["key 'model.quantization'", "expected one of"]),
    "max_model_len one": ({"model": {"max_model_len": 1}}, ["key 'model.max_model_len'", ">= 2"]),
    "unparsable budget": ({"memory": {"cpu": "lots"}}, ["key 'memory.cpu'", "expected a size such as 22GiB"]),
    "negative budget": ({"memory": {"gpu": "-2GiB"}}, ["key 'memory.gpu'", "a size of 0 or more"]),
    "unknown on_exceed": ({"memory": {"on_exceed": "explode"}}, ["key 'memory.on_exceed'", "'warn'"]),
    "batch size zero": ({"schedule": {"batch_size": 0}}, ["key 'schedule.batch_size'", ">= 1"]),
    "section is a list": ({"sampling": [1, 2]}, ["key 'sampling': expected a section"]),
    "unknown engine": ({"engine": "spark"}, ["key 'engine'", "'local'"]),
    "unknown input format": ({"input": {"format": "csv"}}, ["key 'input.format'", "'openai'"]),
    "model section missing": ({"model": None}, ["key 'model' is missing", "expected a section with at least"]),
    "input section missing": ({"input": None}, ["key 'input' is missing", "expected a section with at least"]),
    "output is the input": ({"output": {"path": "{input}"}}, ["the same file", "would write over its input",
                                                             "give them different paths"]),
    "report is the output": ({"report": {"path": "o.jsonl", "print": False}},
                             ["'output.path' and key 'report.path' are the same file", "give them different"]),
    "output is a folder": ({"output": {"path": "{folder}"}}, ["key 'output.path'", "it is a folder",
                                                             "choose a writable location"]),
    "output is the root": ({"output": {"path": "/"}}, ["key 'output.path': '/' cannot be written (it is a folder)"]),
    "output under a file": ({"output": {"path": "{input}/o.jsonl"}}, ["key 'output.path'", "is a file, not a folder"]),
    "unknown hardware": ({"hardware": "no-such-machine"}, ["hardware", "no-such-machine"]),
    "model path missing": ({"model": {"path": "nowhere"}}, ["key 'model.path'", "'nowhere', which does not exist",
                                                            "expected a folder with config.json"]),
    "model is the input file": ({"model": {"path": "{input}"}}, ["key 'model.path'", "is a file, not a model"]),
    "input missing": ({"input": {"path": "absent.jsonl"}}, ["key 'input.path'", "absent.jsonl', which does not"]),
    "not YAML": (b"model: [unclosed\n", ["is not valid YAML", "fix the syntax"]),
    "duplicated key": (b"model: {path: default}\nmodel: {path: default}\n",
                       ["key 'model' is given twice (lines 1 and 2)", "merge them"]),
    "a list, not a mapping": (b"- model\n- input\n", ["expected a mapping of sections", "found list"]),
    "not UTF-8": (b"model:\n  path: d\xe9fault\n", ["is not UTF-8 text", "save the config as UTF-8"]),
}


def broken_job(folder: Path, env: dict, changes) -> Path:
    path = folder / "job.yaml"
    if isinstance(changes, bytes):
        path.write_bytes(changes)
        return path
    data = good_job(env["model"], env["input"])
    (folder / "a-folder").mkdir()
    for section, value in changes.items():
        if value is None:
            data.pop(section)
        elif isinstance(value, dict) and isinstance(data.get(section), dict):
            data[section] = {**data[section], **value}
        else:
            data[section] = value
    text = yaml.safe_dump(data, sort_keys=False).replace("'{input}", f"'{env['input']}").replace(
        "{input}", str(env["input"])).replace("{folder}", str(folder / "a-folder"))
    path.write_text(text)
    return path


@pytest.mark.parametrize("name", list(YAML_CASES))
def test_a_bad_config_is_one_line_and_keeps_the_earlier_outputs(env, case, name):
    changes, words = YAML_CASES[name]
    job = broken_job(case, env, changes)
    for command in ("validate", "run"):
        assert_refused_keeping_outputs(case, env, words, command, job)


def _fifo(folder: Path) -> Path:
    os.mkfifo(folder / "fifo")
    return folder / "fifo"


def _loop(folder: Path) -> Path:
    (folder / "loop").symlink_to("loop")
    return folder / "loop"


def _file(folder: Path, data: bytes | str, name: str = "x.jsonl") -> Path:
    (folder / name).write_bytes(data.encode() if isinstance(data, str) else data)
    return folder / name


def _folder(folder: Path) -> Path:
    (folder / "a-folder").mkdir()
    return folder / "a-folder"


# name -> (flag, how to make its value in the case's folder, words of the message)
PATH_CASES = {
    "input missing": ("--input", lambda f: f / "absent.jsonl", ["key 'input.path'", "which does not exist"]),
    "input a folder": ("--input", _folder, ["key 'input.path': expected a file of requests", "which is a folder"]),
    "input a FIFO": ("--input", _fifo, ["which is a named pipe (FIFO)", "save the requests to a file"]),
    "input a symlink loop": ("--input", _loop, ["is a symlink loop"]),
    "input empty": ("--input", lambda f: _file(f, b""), ["has no requests (it is empty)", "add requests"]),
    "input blank lines": ("--input", lambda f: _file(f, b"\n \n"), ["has no requests (only blank lines)"]),
    "input not UTF-8": ("--input", lambda f: _file(f, b'{"custom_id": "\xff"}\n'),
                        ["cannot read the input file", "give a UTF-8 text file"]),
    "input repeats a custom_id": ("--input", lambda f: _file(f, 2 * (json.dumps(completion_line("a", "hi")) + "\n")),
                                  ["custom_id must be unique", "'a' on lines 1 and 2", "give each request its own"]),
    "output the root": ("--output", lambda f: Path("/"), ["key 'output.path': '/' cannot be written"]),
    "output a symlink loop": ("--output", _loop, ["is a symlink loop"]),
    "model a file": ("--model", lambda f: _file(f, b"{}\n"), ["is a file, not a model", "a Hub id or 'default'"]),
    "model missing": ("--model", lambda f: f / "absent", ["key 'model.path'", "which does not exist"]),
    "model a folder without config.json": ("--model", _folder, ["is a folder without config.json, not a model"]),
    "model a FIFO": ("--model", _fifo, ["is a named pipe (FIFO), not a model"]),
}


@pytest.mark.parametrize("name", list(PATH_CASES))
def test_a_bad_path_is_one_line_and_keeps_the_earlier_outputs(env, case, name):
    flag, make, words = PATH_CASES[name]
    value = make(case)
    argv = {"--model": env["model"], "--input": env["input"], "--output": case / "o.jsonl", flag: value}
    args = [a for pair in argv.items() for a in pair] + ["--max-tokens", 2, "--temperature", 0]
    for command in ("validate", "run"):
        assert_refused_keeping_outputs(case, env, words, command, *args)


# issue 44 item 5: a hardware profile with a GPU, run on a machine without one (as this test makes every machine)
DEVICE_CASES = {
    "rtx4090 preset": (["--hardware", "rtx4090-ddr5"], ["'rtx4090-ddr5' plans on a GPU", "backend 'auto'"]),
    "rtx4090 preset, backend auto": (["--hardware", "rtx4090-ddr5", "--backend", "auto"], ["backend 'auto'"]),
    "rtx4090 preset, backend cuda": (["--hardware", "rtx4090-ddr5", "--backend", "cuda"], ["backend 'cuda'"]),
    "h200 preset": (["--hardware", "h200-server"], ["'h200-server' plans on a GPU"]),
    "t4 preset with a GPU budget": (["--hardware", "t4-server", "--gpu-memory", "4GiB", "--backend", "cuda"],
                                    ["'t4-server' plans on a GPU"]),
    "rtx3090 preset": (["--hardware", "rtx3090-ddr4"], ["'rtx3090-ddr4' plans on a GPU"]),
}


@pytest.mark.parametrize("name", list(DEVICE_CASES))
def test_a_gpu_profile_on_a_machine_without_a_gpu_is_one_line_and_keeps_the_earlier_outputs(env, case, name,
                                                                                               monkeypatch):
    import offload.runtime.backends.cuda as cuda

    monkeypatch.setattr(cuda, "cuda_available", lambda: False)
    flags, words = DEVICE_CASES[name]
    args = ["--model", env["model"], "--input", env["input"], "--output", case / "o.jsonl", "--max-tokens", 2,
            "--temperature", 0, *flags, "--restart"]  # a restart: the earlier run answered every request
    assert_refused_keeping_outputs(case, env, ["no CUDA GPU is visible", "--backend cpu", *words], "run", *args)


def _link_model(env: dict, folder: Path, **config) -> Path:
    """A copy of the tiny model (files linked, config.json copied) with config.json changed."""
    model = folder / "model"
    model.mkdir()
    for path in env["model"].iterdir():
        (model / path.name).symlink_to(path) if path.name != "config.json" else shutil.copy(path, model / path.name)
    write_config(model, **config)
    return model


def _model_file(env: dict, folder: Path, name: str, data: bytes) -> Path:
    model = _link_model(env, folder)
    (model / name).unlink()
    (model / name).write_bytes(data)
    return model


# name -> (how to break a copy of the model, words of the message, whether validate (no weights read) sees it)
MODEL_CASES = {
    "config.json not JSON": (lambda e, f: _model_file(e, f, "config.json", b"{model_type: llama"),
                             ["config.json is not valid JSON", "restore the file from the model's source"], True),
    "config.json a list": (lambda e, f: _model_file(e, f, "config.json", b"[1, 2]"),
                           ["config.json must hold a JSON object, found list", "restore the file"], True),
    "heads do not divide the width": (lambda e, f: _link_model(e, f, num_attention_heads=6, head_dim=None),
                                      ["num_attention_heads=6 does not divide hidden_size=64", "fix config.json"],
                                      True),
    "unsupported architecture": (lambda e, f: _link_model(e, f, model_type="gpt2", architectures=["GPT2LMHeadModel"]),
                                 ["architecture 'gpt2' is not supported", "llama, mistral"], True),
    "width missing": (lambda e, f: _link_model(e, f, hidden_size=None),
                      ["required key 'hidden_size' is missing", "must set it"], True),
    "no layers": (lambda e, f: _link_model(e, f, num_hidden_layers=0),
                  ["'num_hidden_layers' must be a whole number of 1 or more, found 0", "fix config.json"], True),
    "unsupported rope": (lambda e, f: _link_model(e, f, rope_parameters={"rope_type": "mrope", "factor": 4.0}),
                         ["rope scaling type 'mrope' is not supported", "yarn"], True),
    # issue 44 item 3: sizes past the caps the planner loops to (it ran for minutes on 10^6 and 10^12 layers)
    "a million layers": (lambda e, f: _link_model(e, f, num_hidden_layers=10**6),
                         ["'num_hidden_layers' is 1,000,000, above the 10,000 offload plans for", "fix config.json"],
                         True),
    "10^12 layers": (lambda e, f: _link_model(e, f, num_hidden_layers=10**12), ["is 1,000,000,000,000, above"], True),
    "one layer past the cap": (lambda e, f: _link_model(e, f, num_hidden_layers=10_001),
                               ["'num_hidden_layers' is 10,001, above the 10,000"], True),
    "width past the cap": (lambda e, f: _link_model(e, f, hidden_size=65_537),
                           ["'hidden_size' is 65,537, above the 65,536"], True),
    "heads past the cap": (lambda e, f: _link_model(e, f, num_attention_heads=1_026, num_key_value_heads=2),
                           ["'num_attention_heads' is 1,026, above the 1,024"], True),
    "a billion-token vocabulary": (lambda e, f: _link_model(e, f, vocab_size=10**9),
                                   ["'vocab_size' is 1,000,000,000, above the 4,194,304"], True),
    "context past the cap": (lambda e, f: _link_model(e, f, max_position_embeddings=10**12),
                             ["'max_position_embeddings' is 1,000,000,000,000"], True),
    # issue 44 item 4: the floats the math uses (a NaN rope_theta ran; rms_norm_eps -1 was blamed on the tokenizer)
    "rope_theta NaN": (lambda e, f: _link_model(e, f, rope_parameters={"rope_type": "default", "rope_theta": math.nan}),
                       ["key 'rope_parameters.rope_theta' must be a finite number", "found nan"], True),
    "rope_theta 0": (lambda e, f: _link_model(e, f, rope_theta=0), ["key 'rope_theta'", "found 0;"], True),
    "rope_theta negative": (lambda e, f: _link_model(e, f, rope_theta=-10000.0), ["found -10000.0"], True),
    "rope_theta infinite": (lambda e, f: _link_model(e, f, rope_theta=math.inf), ["key 'rope_theta'", "found inf"],
                            True),
    "rms_norm_eps -1": (lambda e, f: _link_model(e, f, rms_norm_eps=-1),
                        ["key 'rms_norm_eps' must be a finite number greater than 0", "found -1;"], True),
    "rms_norm_eps -1.0": (lambda e, f: _link_model(e, f, rms_norm_eps=-1.0), ["'rms_norm_eps'", "found -1.0"], True),
    "rms_norm_eps 0": (lambda e, f: _link_model(e, f, rms_norm_eps=0), ["'rms_norm_eps'", "found 0;"], True),
    "rms_norm_eps NaN": (lambda e, f: _link_model(e, f, rms_norm_eps=math.nan), ["'rms_norm_eps'", "found nan"], True),
    "rope factor 0": (lambda e, f: _link_model(e, f, rope_parameters={"rope_type": "linear", "factor": 0.0}),
                      ["key 'rope_parameters.factor' must be a finite number from 1", "found 0.0"], True),
    "llama3 band empty": (lambda e, f: _link_model(e, f, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
        "original_max_position_embeddings": 64}, rope_parameters=None),
                          ["'rope_scaling.high_freq_factor' must be above 'rope_scaling.low_freq_factor'"], True),
    "odd heads": (lambda e, f: _link_model(e, f, head_dim=15), ["the heads are 15 wide", "an odd number"], True),
    "truncated weights": (lambda e, f: _model_file(e, f, "model.safetensors",
                                                   (e["model"] / "model.safetensors").read_bytes()[:5000]),
                          ["model.safetensors is truncated", "download it again"], False),
    "git-lfs pointer": (lambda e, f: _model_file(e, f, "model.safetensors",
                                                 b"version https://git-lfs.github.com/spec/v1\noid sha256:ab\n"),
                        ["is a git-lfs pointer file, not the weights", "git lfs pull"], False),
    "damaged tokenizer": (lambda e, f: _model_file(e, f, "tokenizer.json", b'{"model": {"type": "Nonsense"}}'),
                          ["transformers cannot load the tokenizer in", "against the model's source"], True),
}


@pytest.mark.parametrize("name", list(MODEL_CASES))
def test_a_bad_model_folder_is_one_line_and_a_restart_keeps_the_earlier_outputs(env, case, name):
    """A restart onto a broken model fails while loading it, before the earlier outputs are moved aside."""
    make, words, validate_sees_it = MODEL_CASES[name]
    args = ["--model", make(env, case), "--input", env["input"], "--output", case / "o.jsonl", "--max-tokens", 2]
    assert_refused_keeping_outputs(case, env, words, "run", *args, "--restart")
    if validate_sees_it:
        assert_refused_keeping_outputs(case, env, words, "validate", *args)


def _raw(line: dict) -> str:
    """A request line as JSON.stringify and serde_json write it: characters past ASCII raw, not escaped."""
    return json.dumps(line, ensure_ascii=False)


NOT_JSON = ["is not valid JSON", "expected one JSON object per line"]

# custom_id -> (the request line, words of its error line); each becomes an error line, the job goes on
LINE_CASES = {
    "not-json": ('{"custom_id": "not-json", "body": ', ["line 2 of in.jsonl is not valid JSON"]),
    "an-array": ('["custom_id", "an-array"]', ["expected a JSON object, found list"]),
    "no-id": ({"url": "/v1/completions", "body": {"prompt": "hi"}}, ["expected a non-empty string 'custom_id'"]),
    "bad-url": ({**completion_line("bad-url", "hi"), "url": "/v1/completion"}, ["did you mean '/v1/completions'?"]),
    "get": ({**completion_line("get", "hi"), "method": "GET"}, ["expected 'method' POST, found 'GET'"]),
    "body-text": ({"custom_id": "body-text", "url": "/v1/completions", "body": "hi"},
                  ["expected 'body' to be a JSON object"]),
    "typo": (completion_line("typo", "hi", temprature=0.5), ["'temprature' is not supported; did you mean"]),
    "stop-int": (completion_line("stop-int", "hi", stop=5), ["stop: expected a list of strings", "found 5"]),
    "stop-ids": (completion_line("stop-ids", "hi", stop_token_ids=[-1]), ["stop_token_ids must be non-negative"]),
    "cold": (completion_line("cold", "hi", temperature=-1), ["temperature must be a finite number >= 0"]),
    "top-p": (completion_line("top-p", "hi", top_p=2), ["top_p must be in (0, 1]"]),
    "no-tokens": (completion_line("no-tokens", "hi", max_tokens=0), ["max_tokens must be an integer >= 1"]),
    "seed": (completion_line("seed", "hi", seed=2**70), ["seed must be an integer from -2**63 to 2**64-1"]),
    "n": (completion_line("n", "hi", n=65), ["n must be an integer from 1 to 64"]),
    "no-messages": ({**chat_line("no-messages", "hi"), "body": {"messages": []}},
                    ["expected 'messages' to be a non-empty list"]),
    "robot": ({**chat_line("robot", "hi"), "body": {"messages": [{"role": "robot", "content": "hi"}]}},
              ["messages[0].role to be one of system, user, assistant, tool, found 'robot'"]),
    "content-int": ({**chat_line("content-int", "hi"), "body": {"messages": [{"role": "user", "content": 5}]}},
                    ["expected messages[0] to have a string 'role' and text 'content'"]),
    "empty-prompt": (completion_line("empty-prompt", ""), ["expected 'prompt' to be a non-empty string"]),
    "too-long": (completion_line("too-long", list(range(80))), ["the prompt has 80 tokens", "max_model_len",
                                                                 "raise max_model_len"]),
    "vocab": (completion_line("vocab", [10**6]), ["prompt token ids must lie in [0, 49152)"]),
    # issue 44 item 6: ids past the vocabulary in the sampling fields, refused as prompt ids are
    "stop-vocab": (completion_line("stop-vocab", "hi", stop_token_ids=[49152]),
                   ["stop_token_ids token ids must lie in [0, 49152), found 49152"]),
    "stop-huge": (completion_line("stop-huge", "hi", stop_token_ids=[2, 10**12]),
                  ["stop_token_ids token ids must lie in [0, 49152), found 1000000000000"]),
    "bias-vocab": (chat_line("bias-vocab", "hi", logit_bias={"49152": 5}),
                   ["logit_bias token ids must lie in [0, 49152), found 49152"]),
    "bias-huge": (completion_line("bias-huge", "hi", logit_bias={"0": 1, str(10**18): -100}),
                  ["logit_bias token ids must lie in [0, 49152)"]),
    # issue 44 item 1: characters str.splitlines breaks at, raw where JSON refuses them or beside another mistake;
    # each is one error line, and the lines after it keep the file's numbers
    "raw-vt": (_raw(completion_line("raw-vt", "a@b")).replace("@", "\x0b"), NOT_JSON),
    "raw-ff": (_raw(completion_line("raw-ff", "a@b")).replace("@", "\x0c"), NOT_JSON),
    "raw-fs": (_raw(completion_line("raw-fs", "a@b")).replace("@", "\x1c"), NOT_JSON),
    "raw-gs": (_raw(completion_line("raw-gs", "a@b")).replace("@", "\x1d"), NOT_JSON),
    "raw-rs": (_raw(completion_line("raw-rs", "a@b")).replace("@", "\x1e"), NOT_JSON),
    "u2028-cut": ('{"custom_id": "u2028-cut", "body": "\u2028', NOT_JSON),
    "u2029-typo": (_raw(completion_line("u2029-typo", "a\u2029b", temprature=0.5)), ["'temprature' is not supported"]),
    "u0085-url": (_raw({**completion_line("u0085-url", "a\x85b"), "url": "/v1/completion\x85"}),
                  ["expected 'url' to be one of"]),
}

# issue 44 item 1: good requests whose JSON holds what str.splitlines breaks at (raw where JSON allows it, a CR as
# JSON whitespace, a CRLF line end): each is answered once, under its own custom_id
SEPARATOR_LINES = {
    "u2028-prompt": _raw(completion_line("u2028-prompt", "a\u2028b")),
    "u2029-prompt": _raw(completion_line("u2029-prompt", "a\u2029b")),
    "u0085-prompt": _raw(completion_line("u0085-prompt", "a\x85b")),
    "u2028-chat": _raw(chat_line("u2028-chat", "x\u2028y\u2029z")),
    "id\u2028sep": _raw(completion_line("id\u2028sep", "hi")),
    "u2028-stop": _raw(completion_line("u2028-stop", "hi", stop=["\u2028"])),
    "cr-inside": _raw(completion_line("cr-inside", "hi")).replace(", ", ",\r ", 1),
    "crlf-end": _raw(completion_line("crlf-end", "hi")) + "\r",
}


@pytest.fixture(scope="module")
def line_job(env):
    """One job resumed with every bad line between an answered request and a new one: (validate's message, the
    output's records by key, the answered record's line before and after)."""
    folder = env["base"] / "lines"
    folder.mkdir()
    job = write_yaml(folder / "job.yaml", {**good_job(env["model"], folder / "in.jsonl"),
                                           "model": {"path": str(env["model"]), "max_model_len": 64}})
    write_batch(folder / "in.jsonl", [completion_line("answered", "hi")])
    assert run_cli("run", job)[0] == 0
    before = (folder / "o.jsonl").read_text()
    write_batch(folder / "in.jsonl", [completion_line("answered", "hi"), *[line for line, _ in LINE_CASES.values()],
                                      completion_line("new", "hello"), *SEPARATOR_LINES.values()])
    validate_code, validate_message = run_cli("validate", job)
    assert validate_code == 2 and "Traceback" not in validate_message
    code, message = run_cli("run", job)
    assert code == 3 and "Traceback" not in message and f"{len(LINE_CASES)} request(s) are error lines" in message
    lines = read_records(folder / "o.jsonl")
    records = {r["custom_id"] or f"line:{r['error']['line']}": r for r in lines}
    assert len(records) == len(lines) == len(LINE_CASES) + 2 + len(SEPARATOR_LINES)  # each request once
    return validate_message, records, before, (folder / "o.jsonl").read_text()


@pytest.mark.parametrize("custom_id", list(LINE_CASES))
def test_a_bad_request_line_is_an_error_line_naming_it_and_the_job_goes_on(line_job, custom_id):
    validate_message, records, before, after = line_job
    _, words = LINE_CASES[custom_id]
    line_no = list(LINE_CASES).index(custom_id) + 2
    named = f"(custom_id {custom_id!r})" if custom_id in records else f"line {line_no} of in.jsonl"
    record = records.get(custom_id) or records[f"line:{line_no}"]
    message = record["error"]["message"]
    assert named in message and record["response"] is None, message
    for word in words:
        assert word in message and word in validate_message, (word, message)
    assert after.startswith(before) and records["answered"]["error"] is None and records["new"]["error"] is None


@pytest.mark.parametrize("custom_id", list(SEPARATOR_LINES))
def test_a_line_separator_inside_a_request_keeps_it_one_request(line_job, custom_id):
    validate_message, records, _, _ = line_job
    assert records[custom_id]["error"] is None and custom_id not in validate_message


@functools.lru_cache(maxsize=1)
def _loaded(model: str):
    from offload import LLM

    return LLM(model, max_model_len=64)


def _llm(env):
    return _loaded(str(env["model"]))


# name -> (a call that must raise, the error type's name, words of its message)
API_CASES = {
    "stop an int": (lambda e: _sampling(stop=5), "SamplingError", ["stop: expected a list of strings", "found 5"]),
    "stop ids a string": (lambda e: _sampling(stop_token_ids="12"), "SamplingError",
                          ["stop_token_ids: expected a list of token ids"]),
    "nan temperature": (lambda e: _sampling(temperature=math.nan), "SamplingError", ["temperature must be a finite"]),
    "too many completions": (lambda e: _sampling(n=100), "SamplingError", ["n must be an integer from 1 to 64"]),
    "seed too large": (lambda e: _sampling(seed=2**70), "SamplingError", ["seed must be an integer from -2**63"]),
    "model a file": (lambda e: _api_llm(e["input"]), "ConfigError", ["is a file, not a model"]),
    "model missing": (lambda e: _api_llm(e["base"] / "absent"), "ConfigError", ["does not exist"]),
    "prompt a number": (lambda e: _llm(e).generate(3.5), "ConfigError", ["prompts must be a string", "got float"]),
    "params per prompt": (lambda e: _llm(e).generate(["a", "b"], [_sampling()] * 3), "ConfigError",
                          ["got 3 SamplingParams for 2 prompts"]),
    "prompt too long": (lambda e: _llm(e).generate([list(range(70))]), "ConfigError",
                        ["prompts[0]: the prompt has 70 tokens", "raise max_model_len"]),
    "stop ids past the vocabulary": (lambda e: _llm(e).generate("hi", _sampling(stop_token_ids=[49152])),
                                     "SamplingError", ["prompts[0]", "stop_token_ids token ids must lie in [0, 49152)"]),
    "logit_bias past the vocabulary": (lambda e: _llm(e).chat([{"role": "user", "content": "hi"}],
                                                              _sampling(logit_bias={10**6: 1})), "SamplingError",
                                       ["logit_bias token ids must lie in [0, 49152), found 1000000"]),
    "job config a dict with a typo": (lambda e: _run_batch({**good_job(e["model"], e["input"]), "sampler": {}}),
                                      "ConfigError", ["unknown key 'sampler'", "did you mean 'sampling'?"]),
}


def _sampling(**kwargs):
    from offload import SamplingParams

    return SamplingParams(**kwargs)


def _api_llm(model):
    from offload import LLM

    return LLM(str(model))


def _run_batch(config):
    from offload.jobs.run import run_batch

    return run_batch(config)


@pytest.mark.parametrize("name", list(API_CASES))
def test_a_bad_api_argument_raises_one_sentence(env, name):
    call, kind, words = API_CASES[name]
    with pytest.raises(OffloadError) as raised:
        call(env)
    assert type(raised.value).__name__ == kind and "\n" not in str(raised.value)
    for word in words:
        assert word in str(raised.value), (word, str(raised.value))


def test_the_corpus_holds_at_least_40_bad_inputs():
    assert sum(map(len, (YAML_CASES, PATH_CASES, DEVICE_CASES, MODEL_CASES, LINE_CASES, SEPARATOR_LINES,
                         API_CASES))) >= 40


# =====================================================================================================================
# Issue 44, items 7-15 ("clear errors"): flags argparse reads, `offload serve`'s address, the server's bodies, query
# parameters and headers, request lines and API calls whose messages named the wrong culprit, and sharded indexes
# that name files outside their model folder. Each is one line (exit 2), one 4xx in OpenAI's shape, one error line
# or one OffloadError; the server queues nothing for a refused request.
# =====================================================================================================================


def _cli(*argv) -> tuple[int, str]:
    """The CLI in-process, argparse's exits (SystemExit) returned as exit codes; (code, stderr + stdout)."""
    import contextlib
    import io

    from offload.cli.main import main

    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as e:
            code = e.code
    return code, err.getvalue() + out.getvalue()


def assert_one_error_line(words: list[str], *argv) -> str:
    """Exit 2 with one `offload: error:` line holding words; no usage block, no traceback."""
    code, message = _cli(*argv)
    errors = [line for line in message.splitlines() if line.startswith("offload: error:")]
    assert code == 2 and len(errors) == 1 and "usage:" not in message and "Traceback" not in message, message
    for word in words:
        assert word in errors[0], (word, errors[0])
    return errors[0]


def _without_tokenizer(env: dict, folder: Path) -> Path:
    model = _link_model(env, folder)
    for path in model.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            path.unlink()
    return model


# name -> (argv, with "{model}" for the tiny model and "{bare}" for it without tokenizer files; words of the line)
FLAG_CASES = {
    "unknown flag": (["plan", "--model", "{model}", "--bogus"],
                     ["unrecognized arguments: --bogus", "see `offload plan --help`"]),
    "misspelt flag with a value": (["validate", "--model", "{model}", "--max-tokns", "3"],
                                   ["unrecognized arguments: --max-tokns", "`offload validate --help`"]),
    "flag without its value": (["plan", "--model", "{model}", "--cpu-memory"],
                               ["argument --cpu-memory: expected one argument"]),
    "negative size": (["plan", "--model", "{model}", "--cpu-memory", "-5GiB"],
                      ["key 'memory.cpu'", "a size of 0 or more", "found '-5GiB'"]),
    "negative size after =": (["plan", "--model", "{model}", "--gpu-memory=-1GiB"], ["key 'memory.gpu'", "'-1GiB'"]),
    "negative batch": (["plan", "--model", "{model}", "--batch-size", "-3"], ["key 'schedule.batch_size'", ">= 1"]),
    "unknown command": (["plann"], ["invalid choice: 'plann'", "see `offload --help`"]),
    "no command": ([], ["the following arguments are required: command"]),
    "not a whole number": (["generate", "--max-tokens", "x", "--prompt", "a"],
                           ["argument --max-tokens: invalid int value: 'x'", "`offload generate --help`"]),
    # item 10: the KV cache is what does not fit, and the advice says so
    "a batch of 10^8": (["plan", "--model", "{model}", "--batch-size", "100000000"],
                        ["is the largest batch that fits", "to hold this KV cache and every weight in RAM"]),
    # item 10: no HTTP route for a command line
    "generate without a tokenizer": (["generate", "--model", "{bare}", "--prompt", "hi"],
                                     ["has no tokenizer files, and offload generate reads text prompts",
                                      "tokenizer.json"]),
}


@pytest.mark.parametrize("name", list(FLAG_CASES))
def test_a_bad_flag_is_one_line_without_the_usage_block(env, tmp_path, name):
    argv, words = FLAG_CASES[name]
    values = {"{model}": str(env["model"]), "{bare}": str(_without_tokenizer(env, tmp_path))
              if "{bare}" in argv else ""}
    line = assert_one_error_line(words, *[values.get(a, a) for a in argv])
    assert "/v1/" not in line


@pytest.fixture
def busy_port():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


# name -> (--host, --port ("busy": one this test listens on), words of the line)
SERVE_ADDRESS_CASES = {
    "port in use": ("127.0.0.1", "busy", ["cannot listen at 127.0.0.1:", "Address already in use",
                                          "give another --port"]),
    "host not a name": ("no.such.host.invalid", "8000", ["serve.host 'no.such.host.invalid' is not an address",
                                                      "(--host)"]),
    "host not this machine's": ("192.0.2.1", "8000", ["cannot listen at 192.0.2.1:8000",
                                                      "address of this machine (--host)"]),
}


@pytest.mark.parametrize("name", list(SERVE_ADDRESS_CASES))
def test_serve_checks_its_address_before_it_loads_the_model(env, busy_port, monkeypatch, name):
    pytest.importorskip("uvicorn", reason="offload[serve] is not installed")
    import offload.jobs.worker

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded before the address was checked")

    monkeypatch.setattr(offload.jobs.worker, "load_llm", never)
    host, port, words = SERVE_ADDRESS_CASES[name]
    assert_one_error_line(words, "serve", "--model", env["model"], "--host", host,
                          "--port", busy_port if port == "busy" else port)


def _index(env: dict, folder: Path, weight_map) -> Path:
    """A copy of the tiny model whose sharded index maps every tensor by weight_map (a shard name, or the whole
    map when it is not a string)."""
    from safetensors import safe_open

    model = _link_model(env, folder)
    with safe_open(str(env["model"] / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    mapping = {n: weight_map for n in names} if isinstance(weight_map, str) else weight_map
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": mapping}))
    return model


# name -> (weight_map: a shard name for every tensor, or the whole map; words of the line)
INDEX_CASES = {
    "shard up two folders": ("../../etc/passwd", ["names shard '../../etc/passwd'", "has path parts",
                                                   "fix the index's weight_map"]),
    "shard an absolute path": ("/etc/passwd", ["names shard '/etc/passwd'", "has path parts"]),
    "shard in a subfolder": ("sub/model.safetensors", ["names shard 'sub/model.safetensors'", "has path parts"]),
    "shard the parent": ("..", ["names shard '..'", "not a file name beside the index"]),
    "weight_map a list": (["model.safetensors"], ["is not a valid sharded index", "download it again"]),
    "shard name a number": ({"model.embed_tokens.weight": 3}, ["is not a valid sharded index"]),
}


@pytest.mark.parametrize("name", list(INDEX_CASES))
def test_a_sharded_index_opens_nothing_outside_its_folder(env, case, name):
    weight_map, words = INDEX_CASES[name]
    model = _index(env, case, weight_map)
    args = ["--model", model, "--input", env["input"], "--output", case / "o.jsonl", "--max-tokens", 2]
    assert_refused_keeping_outputs(case, env, words, "run", *args, "--restart")


KEY = "sk-corpus"
MAX_WAITING = 4
DEEP = 100_000  # levels of nesting: past Python's parser (it stops near 1,000)


def _raw_json(text: str) -> bytes:
    """A body as written, escapes kept: a lone surrogate as JSON's \\ud800 (no encoder writes one raw)."""
    return text.encode()


@pytest.fixture(scope="module")
def served(env, tmp_path_factory):
    """A server on its own copy of the tiny model (the API cases hold the other), a TestClient on it, and what its
    engine thread was handed (submitted and aborted request ids)."""
    pytest.importorskip("fastapi", reason="offload[serve] is not installed")
    from fastapi.testclient import TestClient

    from offload import LLM
    from offload.serve.app import Server, make_app

    llm = LLM(str(env["model"]), max_model_len=64)
    server = Server(llm, "tiny", defaults={"max_tokens": 1, "temperature": 0}, api_key=KEY,
                    max_waiting=MAX_WAITING, state_dir=tmp_path_factory.mktemp("served") / "state")
    handed = {"submit": [], "abort": []}
    thread = server.engine_thread
    submit, abort = thread.submit, thread.abort
    thread.submit = lambda seq, *a, **k: (handed["submit"].append(seq.request_id), submit(seq, *a, **k))[1]
    thread.abort = lambda request_id: (handed["abort"].append(request_id), abort(request_id))[1]
    with TestClient(make_app(server)) as client:
        yield client, handed


AUTH = {"Authorization": f"Bearer {KEY}"}
USER = [{"role": "user", "content": "hi"}]

# name -> (method, route, body: a dict sent as JSON or bytes as they are, headers, status, param, words)
SERVE_CASES = {
    # item 7: nesting past the parser is a body the server cannot read, not the server's failure
    "deep arrays": ("POST", "/v1/completions", _raw_json('{"prompt": ' + "[" * DEEP + "]" * DEEP + "}"), AUTH, 400,
                    None, ["not valid JSON", "nest too deep"]),
    "deep objects": ("POST", "/v1/chat/completions", _raw_json('{"a": ' * DEEP + "1" + "}" * DEEP), AUTH, 400, None,
                     ["not valid JSON", "nest too deep"]),
    "deep batch body": ("POST", "/v1/batches", _raw_json("[" * DEEP + "]" * DEEP), AUTH, 400, None,
                        ["not valid JSON"]),
    "cut JSON": ("POST", "/v1/completions", _raw_json('{"prompt": '), AUTH, 400, None, ["not valid JSON"]),
    # item 8: more prompts than may ever wait at once: 400 before any is queued, not a 503 to retry forever
    "more prompts than may wait": ("POST", "/v1/completions", {"prompt": ["a"] * (MAX_WAITING + 1)}, AUTH, 400,
                                   "prompt", [f"has {MAX_WAITING + 1} prompts", f"at most {MAX_WAITING} requests",
                                              "serve.max_waiting", f"--max-waiting {MAX_WAITING + 1}"]),
    "many token-id prompts": ("POST", "/v1/completions", {"prompt": [[1], [2], [3], [4], [5], [6], [7]]}, AUTH, 400,
                              "prompt", ["has 7 prompts"]),
    # item 10: FastAPI's own checks answer in OpenAI's shape
    "limit not a number": ("GET", "/v1/batches?limit=abc", None, AUTH, 400, "limit",
                           ["the query parameter 'limit' is not valid", "found 'abc'"]),
    "limit a fraction": ("GET", "/v1/batches?limit=1.5", None, AUTH, 400, "limit", ["'limit'", "'1.5'"]),
    # item 10: the scheme is case-insensitive; the key is not
    "lowercase bearer": ("GET", "/v1/models", None, {"Authorization": f"bearer {KEY}"}, 200, None, []),
    "uppercase bearer": ("GET", "/v1/models", None, {"Authorization": f"BEARER  {KEY}"}, 200, None, []),
    "bearer with the key in capitals": ("GET", "/v1/models", None, {"Authorization": f"bearer {KEY.upper()}"}, 401,
                                        None, ["missing or wrong API key"]),
    "basic scheme": ("GET", "/v1/models", None, {"Authorization": f"Basic {KEY}"}, 401, None, ["wrong API key"]),
    # item 10: the endpoint is what is wrong, not the prompt
    "chat body to completions": ("POST", "/v1/completions", {"messages": USER}, AUTH, 400, "messages",
                                 ["'messages' is for /v1/chat/completions", "went to /v1/completions"]),
    "completion body to chat": ("POST", "/v1/chat/completions", {"prompt": "hi"}, AUTH, 400, "prompt",
                                ["'prompt' is for /v1/completions", "send it to /v1/completions"]),
    # item 10: a lone surrogate is the text's fault, named where it is (was the chat template's, or a 500)
    "lone surrogate in chat": ("POST", "/v1/chat/completions",
                               _raw_json('{"messages": [{"role": "user", "content": "a\\ud800b"}]}'), AUTH, 400,
                               "messages", ["messages[0].content holds a lone surrogate (U+D800 at character 1)"]),
    "lone surrogate in a prompt": ("POST", "/v1/completions", _raw_json('{"prompt": "ab\\udc00"}'), AUTH, 400,
                                   "prompt", ["the prompt holds a lone surrogate (U+DC00 at character 2)"]),
    "lone surrogate in one of two prompts": ("POST", "/v1/completions", _raw_json('{"prompt": ["ok", "\\udfff"]}'),
                                             AUTH, 400, "prompt[1]", ["prompt[1]: the prompt holds a lone"]),
    # item 11: what the server refuses, stated (no image input, one name for the token limit, text roles only)
    "image only": ("POST", "/v1/chat/completions",
                   {"messages": [{"role": "user", "content": [{"type": "image_url",
                                                               "image_url": {"url": "http://x/y.png"}}]}]},
                   AUTH, 400, "messages[0].content", ["messages[0].content[0]", "type 'image_url'", "text only"]),
    "text and an image": ("POST", "/v1/chat/completions",
                          {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                                                     {"type": "image_url", "image_url": {}}]}]},
                          AUTH, 400, "messages[0].content", ["messages[0].content[1]", "type 'image_url'"]),
    "a text part without text": ("POST", "/v1/chat/completions",
                                 {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, AUTH, 400,
                                 "messages[0].content", ["messages[0].content[0] to be a text part"]),
    "both token limits": ("POST", "/v1/chat/completions", {"messages": USER, "max_tokens": 3,
                                                           "max_completion_tokens": 5}, AUTH, 400,
                          "max_completion_tokens", ["give one of 'max_tokens' and 'max_completion_tokens'"]),
    "tool role": ("POST", "/v1/chat/completions", {"messages": [{"role": "tool", "content": "42"}]}, AUTH, 400,
                  "messages[0].tool_call_id", ["expected messages[0] (a tool message) to have the 'tool_call_id'"]),
}


@pytest.mark.parametrize("name", list(SERVE_CASES))
def test_a_bad_request_to_the_server_is_answered_in_openais_shape(served, name):
    client, handed = served
    method, route, body, headers, status, param, words = SERVE_CASES[name]
    before = {k: len(v) for k, v in handed.items()}
    sent = {"content": body, "headers": {**headers, "content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body, "headers": headers} if body is not None else {"headers": headers}
    response = client.request(method, route, **sent)
    assert response.status_code == status, response.text
    if status == 200:
        return
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    assert "\n" not in error["message"] and "Traceback" not in error["message"]
    for word in words:
        assert word in error["message"], (word, error["message"])
    assert {k: len(v) for k, v in handed.items()} == before  # nothing queued, nothing aborted


def test_a_batchs_errors_name_the_uploaded_file_not_the_servers_copy(served):
    """item 10: line errors and a batch's failure name the file as uploaded, never the state folder's copy."""
    import time

    client, _ = served

    def run_batch(name: str, data: bytes) -> dict:
        upload = client.post("/v1/files", files={"file": (name, data)}, data={"purpose": "batch"}, headers=AUTH)
        batch = client.post("/v1/batches", json={"input_file_id": upload.json()["id"], "endpoint": "/v1/completions",
                                                 "completion_window": "24h"}, headers=AUTH).json()
        for _ in range(600):
            batch = client.get(f"/v1/batches/{batch['id']}", headers=AUTH).json()
            if batch["status"] in ("completed", "failed"):
                return batch
            time.sleep(0.05)
        raise AssertionError(batch)

    good = json.dumps(completion_line("a", "hi")) + "\n"
    batch = run_batch("my requests.jsonl", (good + '{"custom_id": "b", "body": \n').encode())
    errors = client.get(f"/v1/files/{batch['error_file_id']}/content", headers=AUTH).text
    assert "line 2 of my requests.jsonl is not valid JSON" in errors and "input.jsonl" not in errors
    failed = run_batch("twice.jsonl", (good * 2).encode())
    message = failed["errors"]["data"][0]["message"]
    assert failed["status"] == "failed" and message.startswith("twice.jsonl: custom_id must be unique"), message


def _lone(line: dict, text: str, escaped: str) -> str:
    """A request line with text replaced by an escaped lone surrogate, as a client's JSON encoder may write one."""
    return json.dumps(line).replace(text, escaped)


# custom_id -> (the request line, words of its error line)
LINE_CASES_44 = {
    "deep-array": ('{"custom_id": "deep-array", "body": ' + "[" * DEEP + "]" * DEEP + "}",
                   ["is not valid JSON as offload reads it", "nest too deep"]),
    "deep-object": ('{"custom_id": "deep-object", "body": ' + '{"a": ' * DEEP + "1" + "}" * DEEP + "}",
                    ["is not valid JSON as offload reads it"]),
    "messages-to-completions": ({**chat_line("messages-to-completions", "hi"), "url": "/v1/completions"},
                                ["'messages' is for /v1/chat/completions", "went to /v1/completions"]),
    "prompt-to-chat": ({**completion_line("prompt-to-chat", "hi"), "url": "/v1/chat/completions"},
                       ["'prompt' is for /v1/completions"]),
    "image-only": ({**chat_line("image-only", "hi"),
                    "body": {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}},
                   ["messages[0].content[0] to be a text part", "type 'image_url'"]),
    "audio-part": ({**chat_line("audio-part", "hi"),
                    "body": {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                                       {"type": "input_audio"}]}]}},
                   ["messages[0].content[1]", "type 'input_audio'"]),
    "both-limits": (completion_line("both-limits", "hi", max_tokens=2, max_completion_tokens=2),
                    ["give one of 'max_tokens' and 'max_completion_tokens'"]),
    "surrogate-prompt": (_lone(completion_line("surrogate-prompt", "a@b"), "@", "\\ud800"),
                         ["the prompt holds a lone surrogate (U+D800 at character 1)"]),
    "surrogate-chat": (_lone(chat_line("surrogate-chat", "a@b"), "@", "\\udbff"),
                       ["messages[0].content holds a lone surrogate (U+DBFF"]),
    "surrogate-id": (_lone(completion_line("id@", "hi"), "@", "\\ud800"),
                     ["'custom_id' holds a lone surrogate (U+D800 at character 2)"]),
    "tool-role": ({**chat_line("tool-role", "hi"), "body": {"messages": [{"role": "tool", "content": "42"}]}},
                  ["expected messages[0] (a tool message) to have the 'tool_call_id' of the call it answers"]),
}


@pytest.fixture(scope="module")
def line_job_44(env):
    """One job of every line above between two good ones: (validate's message, the output's records by key)."""
    folder = env["base"] / "lines-44"
    folder.mkdir()
    job = write_yaml(folder / "job.yaml", {**good_job(env["model"], folder / "in.jsonl"),
                                           "model": {"path": str(env["model"]), "max_model_len": 64}})
    write_batch(folder / "in.jsonl", [completion_line("first", "hi"), *[line for line, _ in LINE_CASES_44.values()],
                                      completion_line("last", "hello")])
    validate_code, validate_message = run_cli("validate", job)
    assert validate_code == 2 and "Traceback" not in validate_message
    code, message = run_cli("run", job)
    assert code == 3 and "Traceback" not in message and f"{len(LINE_CASES_44)} request(s) are error lines" in message
    lines = read_records(folder / "o.jsonl")
    records = {r["custom_id"] or f"line:{r['error']['line']}": r for r in lines}
    assert len(records) == len(lines) == len(LINE_CASES_44) + 2
    assert records["first"]["error"] is None and records["last"]["error"] is None
    return validate_message, records


@pytest.mark.parametrize("custom_id", list(LINE_CASES_44))
def test_a_request_line_names_its_true_culprit(line_job_44, custom_id):
    validate_message, records = line_job_44
    _, words = LINE_CASES_44[custom_id]
    record = records.get(custom_id) or records[f"line:{list(LINE_CASES_44).index(custom_id) + 2}"]
    assert record["response"] is None
    for word in words:
        assert word in record["error"]["message"] and word in validate_message, (word, record["error"]["message"])


# name -> (a call that must raise, the error type's name, words of its message)
API_CASES_44 = {
    "LLM.chat with a tool role": (lambda e: _llm(e).chat([{"role": "tool", "content": "42"}]), "ToolError",
                                  ["expected messages[0] (a tool message) to have the 'tool_call_id'"]),
    "LLM.chat with a misspelt role": (lambda e: _llm(e).chat([{"role": "usr", "content": "hi"}]), "ConfigError",
                                      ["found 'usr'; did you mean 'user'?"]),
    "LLM.chat with a lone surrogate": (lambda e: _llm(e).chat([{"role": "user", "content": "x\ud800"}]),
                                       "ConfigError", ["messages[0].content holds a lone surrogate"]),
    "LLM.generate with a lone surrogate": (lambda e: _llm(e).generate("\udc80"), "ConfigError",
                                           ["the prompt holds a lone surrogate (U+DC80 at character 0)"]),
}


@pytest.mark.parametrize("name", list(API_CASES_44))
def test_a_bad_api_call_names_its_true_culprit(env, name):
    call, kind, words = API_CASES_44[name]
    with pytest.raises(OffloadError) as raised:
        call(env)
    assert type(raised.value).__name__ == kind and "\n" not in str(raised.value)
    for word in words:
        assert word in str(raised.value), (word, str(raised.value))


def test_items_7_to_15_add_at_least_40_bad_inputs():
    assert sum(map(len, (FLAG_CASES, SERVE_ADDRESS_CASES, INDEX_CASES, SERVE_CASES, LINE_CASES_44,
                         API_CASES_44))) >= 40

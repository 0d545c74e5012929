"""Job configs: every mistake named with file, key, expected and found; precedence flags > file > defaults."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import yaml

from jobs_support import chat_line, write_batch, write_job
from offload.cli.main import main
from offload.jobs.config import load_config, validate_config
from offload.errors import ConfigError

GOOD_INPUT = [chat_line("a", "hi"), chat_line("b", "hello")]


@pytest.fixture
def job(tmp_path):
    """Write a job config (model 'default', a valid input file) with changes; return its path."""
    write_batch(tmp_path / "in.jsonl", GOOD_INPUT)

    def make(text: str | None = None, **sections):
        base = {"model": {"path": "default"}, "input": {"path": "in.jsonl"}, "output": {"path": "out/o.jsonl"}}
        path = tmp_path / "job.yaml"
        if text is not None:
            path.write_text(text)
            return path
        for key, value in sections.items():
            if value is None:
                base.pop(key, None)
            else:
                base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
        return write_job(path, **base)

    return make


def validate(path, *flags) -> tuple[int, str]:
    """Run `offload validate` and return (exit code, stderr + stdout)."""
    import contextlib
    import io

    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main(["validate", str(path), *flags])
    return code, err.getvalue() + out.getvalue()


# (sections to change, batch lines or None, substrings the message must contain)
MISTAKES = {
    "unknown key": (dict(colour="red"), None, ["unknown key 'colour'", "known keys: model"]),
    "misspelt key": (dict(sampling={"max_token": 5}), None, ["unknown key 'sampling.max_token'",
                                                             "did you mean 'sampling.max_tokens'?"]),
    "misspelt section": (dict(schedul={"batch_size": 2}), None, ["did you mean 'schedule'?"]),
    "wrong type": (dict(sampling={"temperature": "hot"}), None,
                   ["key 'sampling.temperature': expected a number, found 'hot'"]),
    "negative memory": (dict(memory={"gpu": "-2GiB"}), None,
                        ["key 'memory.gpu': expected a size of 0 or more such as 22GiB, found '-2GiB'"]),
    "unparsable memory": (dict(memory={"cpu": "lots"}), None,
                          ["key 'memory.cpu': expected a size such as 22GiB, 64GB or 512MiB, found 'lots'"]),
    "missing model": (dict(model=None), None, ["key 'model' is missing; expected a section with at least 'path'"]),
    "model not a folder": (dict(model={"path": "nowhere"}), None,
                           ["key 'model.path': expected a folder with config.json", "does not exist"]),
    "missing input file": (dict(input={"path": "absent.jsonl"}), None,
                           ["key 'input.path': expected a file of requests", "absent.jsonl",
                            "does not exist"]),
    "unwritable output": (dict(output={"path": "in.jsonl/o.jsonl"}), None,
                          ["key 'output.path'", "cannot be written", "is a file, not a folder"]),
    "batch size 0": (dict(schedule={"batch_size": 0}), None,
                     ["key 'schedule.batch_size': expected a value >= 1, found 0"]),
    "unknown quantization": (dict(model={"quantization": "q5_0"}), None,
                             ["key 'model.quantization': expected one of 'none', 'q8_0' or 'q4_0', found 'q5_0'"]),
    "unknown hardware": (dict(hardware="rtx9090"), None, ["key 'hardware'", "'rtx9090' is neither a file nor"]),
    "unknown url": ({}, [chat_line("a", "hi"), {**chat_line("b", "x"), "url": "/v1/chat/completion"}],
                    ["line 2 of in.jsonl (custom_id 'b')", "expected 'url' to be one of",
                     "did you mean '/v1/chat/completions'?"]),
    "duplicate custom_id": ({}, [chat_line("a", "hi"), chat_line("b", "x"), chat_line("a", "y")],
                            ["custom_id must be unique, found 'a' on lines 1 and 3"]),
    "malformed line": ({}, [chat_line("a", "hi"), '{"custom_id": "b", "url": '],
                       ["line 2 of in.jsonl is not valid JSON", "expected one JSON object per line"]),
    "bad request parameter": ({}, [chat_line("a", "hi", temperature=-1)],
                              ["custom_id 'a'", "temperature must be a finite number >= 0"]),
    "unsupported body key": ({}, [chat_line("a", "hi", max_tokenz=3)],
                             ["body parameter 'max_tokenz' is not supported; did you mean 'max_tokens'?"]),
}


@pytest.mark.parametrize("name", list(MISTAKES))
def test_each_mistake_gives_its_message(job, tmp_path, name):
    sections, lines, expected = MISTAKES[name]
    if lines is not None:
        write_batch(tmp_path / "in.jsonl", lines)
    code, message = validate(job(**sections))
    assert code == 2, message
    assert "Traceback" not in message
    for text in expected:
        assert text in message, f"{text!r} not in {message!r}"


def test_config_errors_name_the_file(job):
    path = job(sampling={"max_tokens": 0})
    code, message = validate(path)
    assert code == 2 and message.startswith(f"offload: error: {path}: key 'sampling.max_tokens'")


def test_all_mistakes_reported_in_one_pass(job):
    code, message = validate(job(colour="red", schedule={"batch_size": 0}, input={"path": "absent.jsonl"}))
    assert code == 2
    assert "has 3 problems" in message
    assert "'colour'" in message and "schedule.batch_size" in message and "absent.jsonl" in message


def test_yaml_syntax_error(job):
    code, message = validate(job("model: [unclosed\n"))
    assert code == 2 and "is not valid YAML" in message


def test_valid_config_passes(job):
    code, message = validate(job())
    assert code == 0 and "ok; 2 requests" in message


def test_precedence_flags_over_file_over_defaults(job):
    path = job(sampling={"max_tokens": 8, "temperature": 0.5})
    config = load_config(path, {"sampling.max_tokens": 3})
    assert config.sampling.max_tokens == 3  # flag beats file
    assert config.sampling.temperature == 0.5  # file beats default
    assert config.sampling.top_p == 1.0  # default


def test_flag_errors_name_the_key(job):
    with pytest.raises(ConfigError, match="schedule.batch_size"):
        load_config(job(), {"schedule.batch_size": 0})


def test_print_config_shows_effective_values(job, capsys):
    assert main(["run", str(job(sampling={"max_tokens": 8})), "--max-tokens", "5", "--set", "sampling.top_k=7",
                 "--gpu-memory", "2GiB", "--print-config"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["sampling"]["max_tokens"] == 5 and shown["sampling"]["top_k"] == 7
    assert shown["memory"]["gpu"] == 2 * 2**30
    assert shown["report"]["path"].endswith("out/o.report.json")


def test_paths_resolve_against_the_config_folder(job, tmp_path):
    config = load_config(job())
    assert config.input.path == str(tmp_path / "in.jsonl")
    assert config.output_path == tmp_path / "out" / "o.jsonl"


def test_shorthand_sections_and_sizes(tmp_path):
    (tmp_path / "p.txt").write_text("hello\n")
    config = validate_config({"model": {"path": "default"}, "input": {"path": str(tmp_path / "p.txt")},
                              "memory": {"gpu": "22GiB", "cpu": "64GB", "disk": 0}})
    assert (config.memory.gpu, config.memory.cpu, config.memory.disk) == (22 * 2**30, 64 * 10**9, 0)
    assert config.output_path == tmp_path / "p.outputs.jsonl"


def test_shipped_configs_validate():
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "configs"
    for name in ("demo.yaml", "cpu-only.yaml"):
        code, message = validate(root / name)
        assert code == 0, message
    for name in ("llama-3.1-70b-24gb.yaml", "llama-3.1-8b-8gb.yaml", "qwen3-30b-a3b-8gb.yaml"):  # the user's models
        with pytest.raises(ConfigError) as e:
            load_config(root / name)
        assert "model.path" in str(e.value) and "hardware" not in str(e.value)


def test_a_plot_without_matplotlib_is_refused_before_anything_runs(job, monkeypatch):
    """matplotlib is the `plot` extra: without it a job asking for a plot fails validation, naming the extra."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(ConfigError, match=r"offload\[plot\]"):
        load_config(job(report={"plot": "out/t.png"}))


# engine: ray and its distributed section: each bad value is one sentence naming its key
RAY_MISTAKES = {
    "address": ({"address": "head-node"}, "key 'distributed.address': expected 'auto' (a running cluster), 'local' "
                                          "(one started for this job) or HOST:PORT such as 10.0.0.5:6379, found "
                                          "'head-node'"),
    "replicas": ({"replicas": 0}, "key 'distributed.replicas': expected a value >= 1, found 0"),
    "cpus": ({"cpus_per_replica": 0}, "key 'distributed.cpus_per_replica': expected a value > 0.0, found 0"),
    "gpus": ({"gpus_per_replica": "one"}, "key 'distributed.gpus_per_replica': expected a number, found 'one'"),
    "shard": ({"shard_size": -4}, "key 'distributed.shard_size': expected a value >= 1, found -4"),
    "unknown": ({"workers": 4}, "unknown key 'distributed.workers'; known keys: address, replicas"),
}


@pytest.mark.parametrize("name", RAY_MISTAKES)
def test_a_bad_distributed_value_names_its_key(job, name):
    section, message = RAY_MISTAKES[name]
    with pytest.raises(ConfigError) as e:
        load_config(job(engine="ray", distributed=section))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_engine_and_ray_addresses(job):
    assert load_config(job()).engine == "local"
    for address in ("auto", "local", "10.0.0.5:6379", "head.cluster:6379", "[::1]:6379"):
        config = load_config(job(engine="ray", distributed={"address": address, "replicas": 2}))
        assert (config.engine, config.distributed.address, config.distributed.replicas) == ("ray", address, 2)
    with pytest.raises(ConfigError, match="key 'engine': expected one of 'local' or 'ray', found 'spark'"):
        load_config(job(engine="spark"))
    with pytest.raises(ConfigError, match="key 'distributed.address': .* found 'ray://head:10001'"):
        load_config(job(engine="ray", distributed={"address": "ray://head:10001"}))  # Ray Client: not supported


def test_ray_flag_sets_the_engine_and_the_address(job):
    from offload.cli.job_flags import effective_config
    from offload.cli.main import build_parser

    path = job(distributed={"address": "10.0.0.5:6379"})
    plain = effective_config(build_parser().parse_args(["run", str(path), "--ray"]))
    assert (plain.engine, plain.distributed.address) == ("ray", "10.0.0.5:6379")
    given = effective_config(build_parser().parse_args(["run", str(path), "--ray", "local"]))
    assert (given.engine, given.distributed.address) == ("ray", "local")
    code, message = validate(path, "--ray", "nowhere")
    assert code == 2 and "key 'distributed.address'" in message and "found 'nowhere'" in message
    with pytest.raises(ConfigError, match=r"--ray took .*job.yaml', a file, as the Ray address; put the config file "
                                          r"first"):
        effective_config(build_parser().parse_args(["run", "--ray", str(path)]))


def test_engine_ray_without_ray_names_the_extra(job, monkeypatch):
    """Without ray installed (an import of it fails), engine: ray is refused before anything runs, naming the extra."""
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ConfigError, match=r"key 'engine': running on Ray needs the ray package, which is not "
                                          r"installed; install it with `pip install 'offload\[ray\]'`"):
        load_config(job(engine="ray"))
    code, message = validate(job(), "--ray")
    assert code == 2 and "offload[ray]" in message and "Traceback" not in message


def test_serve_prints_its_config_without_an_input(capsys):
    """A server's config has no input to name outputs after: --print-config printed an AttributeError traceback."""
    assert main(["serve", "--model", "default", "--print-config"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["model"]["path"] == "default" and shown["input"] is None and shown["output"]["path"] is None

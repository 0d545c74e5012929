"""Bad input costs one request, never the job; `offload validate` catches every config-level mistake without
running anything (issue 12, items 1, 2, 7 and 9)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import make_hf_model, save_hf_model
from jobs_support import run_cli, chat_line, completion_line, make_tiny_chat_model, read_records, write_batch, write_job
from offload.cli.main import main
from offload.errors import WeightsError
from offload.jobs.run import run_batch


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("tiny") / "model")


cli = run_cli


def job(tmp_path, model_dir, lines, **sections):
    write_batch(tmp_path / "in.jsonl", lines)
    base = {"model": {"path": str(model_dir)}, "input": {"path": "in.jsonl"}, "output": {"path": "o.jsonl"},
            "sampling": {"max_tokens": 2, "temperature": 0}, "report": {"print": False}}
    return write_job(tmp_path / "job.yaml", **{**base, **sections})


def by_id(path):
    return {r["custom_id"]: r for r in read_records(path)}


def test_prompt_longer_than_the_runs_context_is_one_error_line(tmp_path, tiny_model):
    """Item 1: checked once, against max_model_len (64 here, the model allows 512), naming the custom_id and
    the key to change; the other request is answered."""
    config = job(tmp_path, tiny_model, [completion_line("long", list(range(100))), completion_line("ok", [5, 6])],
                 model={"path": str(tiny_model), "max_model_len": 64})
    report = run_batch(config)
    records = by_id(tmp_path / "o.jsonl")
    message = records["long"]["error"]["message"]
    assert "custom_id 'long'" in message and "100 tokens" in message and "context (max_model_len) is 64" in message
    assert "model.max_model_len" in message and "at most the model's 512" in message
    assert records["ok"]["error"] is None and report["requests"]["done"] == 1


def test_seed_out_of_range_is_an_error_line_and_validate_says_so(tmp_path, tiny_model):
    """Item 2: seed 2**64 fails its request only; validate names it; a config seed is refused too."""
    config = job(tmp_path, tiny_model, [completion_line("big", "hi", seed=2**64, temperature=0.5),
                                        completion_line("ok", "hi", seed=2**64 - 1, temperature=0.5)])
    code, message = cli("validate", config)
    assert code == 2 and "custom_id 'big'" in message and "seed must be an integer from -2**63" in message
    assert "'ok'" not in message
    report = run_batch(config)
    records = by_id(tmp_path / "o.jsonl")
    assert "seed" in records["big"]["error"]["message"] and records["ok"]["error"] is None
    assert report["requests"]["done"] == 1
    code, message = cli("validate", config, "--seed", 2**70)
    assert code == 2 and "key 'sampling.seed'" in message and "Traceback" not in message


def test_generate_with_a_huge_seed_is_one_line(tiny_model, capsys):
    assert main(["generate", "--model", str(tiny_model), "--prompt", "hi", "--seed", str(2**70),
                 "--temperature", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "key 'sampling.seed'" in err  # checked as plan and validate check it


def test_a_byte_order_mark_is_not_part_of_the_first_request(tmp_path, tiny_model):
    """Item 7."""
    config = job(tmp_path, tiny_model, [completion_line("a", "hi"), completion_line("b", "ho")])
    (tmp_path / "in.jsonl").write_bytes(b"\xef\xbb\xbf" + (tmp_path / "in.jsonl").read_bytes())
    assert cli("validate", config)[0] == 0
    report = run_batch(config)
    assert report["requests"]["failed"] == 0 and report["requests"]["done"] == 2


CONFIG_MISTAKES = {  # item 9: name -> (YAML text of the job, words the message must hold)
    "duplicated section": ("model: {{path: '{model}'}}\ninput: {{path: in.jsonl}}\nsampling:\n  max_tokens: 3\n"
                           "sampling:\n  temperature: 0.5\n", ["key 'sampling' is given twice (lines 3 and 5)"]),
    "infinite temperature": ("model: {{path: '{model}'}}\ninput: {{path: in.jsonl}}\nsampling: {{temperature: "
                             "Infinity}}\n", ["key 'sampling.temperature'", "Infinity"]),
    "nan top_p": ("model: {{path: '{model}'}}\ninput: {{path: in.jsonl}}\nsampling: {{top_p: .nan}}\n",
                  ["key 'sampling.top_p'"]),
    "gpu budget without a gpu": ("model: {{path: '{model}'}}\ninput: {{path: in.jsonl}}\nhardware: cpu-desktop\n"
                                 "memory: {{gpu: 22GiB}}\n", ["GPU budget of 22.00 GiB", "'cpu-desktop' has no GPU"]),
    "input is the output": ("model: {{path: '{model}'}}\ninput: {{path: in.jsonl}}\noutput: {{path: in.jsonl}}\n",
                            ["'input.path' and key 'output.path' are the same file", "write over its input"]),
    "report is the output": ("model: {{path: '{model}'}}\ninput: {{path: in.jsonl}}\noutput: {{path: o.jsonl}}\n"
                             "report: {{path: o.jsonl}}\n", ["'output.path' and key 'report.path' are the same"]),
}


@pytest.mark.parametrize("name", list(CONFIG_MISTAKES))
def test_validate_catches_each_config_mistake_and_run_refuses_it(tmp_path, tiny_model, name):
    """Items 3 and 9: `offload validate` names the mistake; `offload run` refuses before writing anything."""
    text, words = CONFIG_MISTAKES[name]
    write_batch(tmp_path / "in.jsonl", [completion_line("a", "hi")])
    before = (tmp_path / "in.jsonl").read_bytes()
    (tmp_path / "job.yaml").write_text(text.format(model=tiny_model))
    for command in ("validate", "run"):
        code, message = cli(command, tmp_path / "job.yaml")
        assert code == 2 and "Traceback" not in message, message
        for word in words:
            assert word in message, (word, message)
    assert (tmp_path / "in.jsonl").read_bytes() == before and not (tmp_path / "o.jsonl").exists()


def test_restart_cannot_overwrite_the_input(tmp_path, tiny_model):
    """Item 3: the refusal of input == output is not undone by --restart."""
    write_batch(tmp_path / "in.jsonl", [completion_line("a", "hi")])
    before = (tmp_path / "in.jsonl").read_bytes()
    code, message = cli("run", "--model", tiny_model, "--input", tmp_path / "in.jsonl", "--output",
                        tmp_path / "in.jsonl", "--restart")
    assert code == 2 and "write over its input" in message and (tmp_path / "in.jsonl").read_bytes() == before


def test_an_unknown_role_is_an_error_line(tmp_path, tiny_model):
    """Item 9: a role the chat template does not know is refused for that request, with a suggestion."""
    robot = {**chat_line("r", "hi"), "body": {"messages": [{"role": "robot", "content": "hi"}]}}
    config = job(tmp_path, tiny_model, [robot, chat_line("u", "hi")])
    code, message = cli("validate", config)
    assert code == 2 and "messages[0].role to be one of system, user, assistant, tool, found 'robot'" in message
    run_batch(config)
    records = by_id(tmp_path / "o.jsonl")
    assert "robot" in records["r"]["error"]["message"] and records["u"]["error"] is None


def test_infinite_temperature_in_a_request_is_an_error_line(tmp_path, tiny_model):
    config = job(tmp_path, tiny_model, ['{"custom_id": "inf", "url": "/v1/completions", '
                                        '"body": {"prompt": "hi", "temperature": 1e999}}'])
    code, message = cli("validate", config)
    assert code == 2 and "temperature must be a finite number" in message


def test_nan_weights_stop_with_one_sentence(tmp_path):
    """Item 9: NaN weights used to give an empty answer and exit 0."""
    model = make_hf_model("llama")
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    folder = save_hf_model(model, tmp_path / "nan")
    write_batch(tmp_path / "in.jsonl", [completion_line("a", [1, 2, 3])])
    config = write_job(tmp_path / "job.yaml", model={"path": str(folder)}, input={"path": "in.jsonl"},
                       output={"path": "o.jsonl"}, sampling={"max_tokens": 2})
    code, message = cli("run", config)
    assert code == 2 and "NaN or infinite logits" in message and "Traceback" not in message
    from offload import LLM

    with pytest.raises(WeightsError, match="NaN"):
        LLM(str(folder)).generate([[1, 2, 3]])
    assert json.loads((tmp_path / "o.report.json").read_text())["requests"]["done"] == 0


def one_error(code: int, message: str) -> str:
    """The one error line of a command that failed as bad input (exit 2, no traceback)."""
    errors = [line for line in message.splitlines() if line.startswith("offload: error:")]
    assert code == 2 and "Traceback" not in message and len(errors) == 1, message
    return errors[0]


def test_an_input_that_is_a_symlink_loop_is_one_line(tmp_path, tiny_model):
    """Issue 32 item 6: `RuntimeError: Symlink loop` escaped from run and validate."""
    (tmp_path / "loop").symlink_to("loop")
    job(tmp_path, tiny_model, [completion_line("a", "hi")], input={"path": "loop"})
    for command in ("validate", "run"):
        for args in ([tmp_path / "job.yaml"], ["--model", tiny_model, "--input", tmp_path / "loop"]):
            line = one_error(*cli(command, *args))
            assert f"{tmp_path / 'loop'}'" in line and "is a symlink loop (a link that leads back to itself)" in line
    assert not (tmp_path / "o.jsonl").exists()


def test_an_output_that_is_the_root_folder_is_one_line(tmp_path, tiny_model):
    """Issue 32 item 7: `ValueError: PosixPath('/') has an empty name`."""
    job(tmp_path, tiny_model, [completion_line("a", "hi")], output={"path": "/"})
    for command in ("validate", "run"):
        for args in ([tmp_path / "job.yaml"], ["--model", tiny_model, "--input", tmp_path / "in.jsonl", "--output", "/"]):
            line = one_error(*cli(command, *args))
            assert "key 'output.path': '/' cannot be written (it is a folder); choose a writable location" in line


def test_a_file_that_is_not_a_model_is_called_so(tmp_path, tiny_model):
    """Issue 32 item 10: validate said the file does not exist; generate parsed it as a config.json."""
    write_batch(tmp_path / "in.jsonl", [completion_line("a", "hi")])
    expected = "is a file, not a model: expected a folder with config.json, a .gguf file, a Hub id or 'default'"
    for args in (["validate", "--input", tmp_path / "in.jsonl"], ["run", "--input", tmp_path / "in.jsonl"],
                 ["generate", "--prompt", "hi"], ["plan"]):
        line = one_error(*cli(*args, "--model", tmp_path / "in.jsonl"))
        assert "in.jsonl" in line and expected in line and "does not exist" not in line
    line = one_error(*cli("validate", "--input", tmp_path / "in.jsonl", "--model", tmp_path))
    assert "is a folder without config.json, not a model" in line


def test_inputs_and_configs_that_are_not_files_say_what_they_are(tmp_path, tiny_model):
    """Issue 32 item 11: a folder input was 'not a model folder', a FIFO 'does not exist', a config folder
    'not found'."""
    import os

    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "folder").mkdir()
    for name, what in (("folder", "which is a folder"), ("fifo", "which is a named pipe (FIFO)")):
        for command in ("validate", "run"):
            line = one_error(*cli(command, "--model", tiny_model, "--input", tmp_path / name))
            assert f"key 'input.path': expected a file of requests" in line and what in line, line
            assert "model" not in line.split("found")[1] and "does not exist" not in line
    for command in ("validate", "run", "plan"):
        line = one_error(*cli(command, tmp_path / "folder"))
        assert f"config file {tmp_path / 'folder'} is a folder; expected a YAML file" in line and "not found" not in line


def test_a_request_whose_stop_is_not_a_list_is_an_error_line_naming_it(tmp_path, tiny_model):
    """Issue 32 item 9: `"stop": 5` gave the error line `'int' object is not iterable`."""
    config = job(tmp_path, tiny_model, [completion_line("five", "hi", stop=5), completion_line("ids", "hi",
                                        stop_token_ids=7), completion_line("ok", "hi", stop=["\n"])])
    code, message = cli("validate", config)
    assert "2 bad line(s)" in one_error(code, message) and "not iterable" not in message
    assert "(custom_id 'five'): invalid sampling parameter: stop: expected a list of strings" in message
    run_batch(config)
    records = by_id(tmp_path / "o.jsonl")
    assert "(custom_id 'five'): invalid sampling parameter: stop: expected a list of strings (or one string), " \
           "found 5" in records["five"]["error"]["message"]
    assert "stop_token_ids: expected a list of token ids, found 7" in records["ids"]["error"]["message"]
    assert records["ok"]["error"] is None


@pytest.mark.parametrize("text, what", [("", "it is empty"), ("\n  \n\n", "only blank lines")])
def test_an_input_without_requests_says_so(tmp_path, tiny_model, text, what):
    """Issue 32 item 12: an empty input was 'nothing left to do: all 0 requests are answered'."""
    config = job(tmp_path, tiny_model, [])
    (tmp_path / "in.jsonl").write_text(text)
    for command in ("validate", "run"):
        code, message = cli(command, config)
        line = one_error(code, message)
        assert f"the input file {tmp_path / 'in.jsonl'} has no requests ({what}); expected one JSON request" in line
        assert "all 0 requests" not in message and not (tmp_path / "o.jsonl").exists()


def test_a_config_transformers_refuses_is_one_line_checked_first(tmp_path, tiny_model):
    """Issue 32 item 8: the tokenizer was loaded before the spec was checked, and transformers' strict config
    validation escaped as StrictDataclassClassValidationError."""
    import shutil

    from conftest import write_config

    folder = shutil.copytree(tiny_model, tmp_path / "model")
    write_config(folder, num_key_value_heads=2, num_attention_heads=6, head_dim=None)
    config = job(tmp_path, folder, [completion_line("a", "hi")])
    commands = (["validate", config], ["run", config], ["generate", "--model", folder, "--prompt", "hi"])
    for args in commands:
        line = one_error(*cli(*args))
        assert "num_attention_heads=6 does not divide hidden_size=64 and no head_dim is given; fix config.json" in line
    # with head_dim given offload's spec takes it; transformers' own check refuses it, in a sentence of offload's
    # (run and generate may reach the weights first, which do not match it either)
    write_config(folder, head_dim=16)
    line = one_error(*cli("validate", config))
    assert "transformers cannot load the tokenizer in" in line and "The hidden size (64) is not a multiple" in line
    for args in commands[1:]:
        assert "config.json" in one_error(*cli(*args))
    assert not (tmp_path / "o.jsonl").exists()


def test_a_damaged_tokenizer_is_one_line(tmp_path, tiny_model):
    """Issue 32 item 8: an error from the library offload calls gets a sentence of offload's own."""
    import shutil

    folder = shutil.copytree(tiny_model, tmp_path / "model")
    (folder / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nonsense"}}')
    line = one_error(*cli("generate", "--model", folder, "--prompt", "hi"))
    assert f"transformers cannot load the tokenizer in {folder} (" in line and "against the model's source" in line


def test_validate_counts_each_prompt_as_run_does(tmp_path, tiny_model):
    """Issue 32 item 3: validate said ok to prompts longer than max_model_len, which run then refused: it
    tokenizes (text, chat template, token ids) and counts against the same context, and says what run writes."""
    lines = [completion_line("text", "word " * 100), chat_line("chat", "hi " * 80),
             completion_line("fits", list(range(63))), completion_line("full", list(range(64))),
             completion_line("vocab", [10**6]), completion_line("ok", "hi")]
    config = job(tmp_path, tiny_model, lines, model={"path": str(tiny_model), "max_model_len": 64})
    code, message = cli("validate", config)
    assert "has 4 bad line(s)" in one_error(code, message)
    listed = [line.removeprefix("  - ") for line in message.splitlines() if line.startswith("  - ")]
    run_batch(config)
    written = [r["error"]["message"] for r in read_records(tmp_path / "o.jsonl") if r["error"]]
    assert sorted(listed) == sorted(written) and len(written) == 4
    assert {"'text'", "'chat'", "'full'", "'vocab'"} == {m.split("custom_id ")[1].split(")")[0] for m in listed}
    assert any("the prompt has 64 tokens but this run's context (max_model_len) is 64" in m for m in listed)


# issue 44 item 1: characters str.splitlines breaks at; JSON allows the first three raw in a string, the others only
# escaped (a raw one makes its line not JSON, and that one line an error line)
RAW_IN_JSON = {"U+2028": "\u2028", "U+2029": "\u2029", "U+0085": "\x85"}
NOT_RAW_IN_JSON = {"vertical tab": "\x0b", "form feed": "\x0c", "file separator": "\x1c",
                   "group separator": "\x1d", "record separator": "\x1e"}


def test_a_line_separator_inside_a_json_string_keeps_the_request_whole(tmp_path, tiny_model):
    """A JSON string holding a raw U+2028, U+2029 or U+0085 (as JSON.stringify, serde_json and ensure_ascii=False
    write them) is one request; a raw control character makes only its own line an error line, named by the file's
    line number; lines may end in CRLF; a resume reads the output back whole."""
    lines = [json.dumps(completion_line(f"r{name}{sep}", f"a{sep}b"), ensure_ascii=False)
             for name, sep in RAW_IN_JSON.items()]
    lines += [json.dumps(chat_line(f"c{sep}", f"x{sep}y"), ensure_ascii=False) for sep in RAW_IN_JSON.values()]
    bad_at = {}
    for name, sep in NOT_RAW_IN_JSON.items():
        bad_at[len(lines) + 1] = name
        lines.append(json.dumps(completion_line(name, "a")).replace('"a"', f'"a{sep}b"'))
    lines.append(json.dumps(completion_line("last", "hi")))
    config = job(tmp_path, tiny_model, [])
    (tmp_path / "in.jsonl").write_bytes("".join(line + ("\r\n" if n % 2 else "\n")
                                                for n, line in enumerate(lines)).encode())
    code, message = cli("validate", config)
    assert code == 2 and f"has {len(bad_at)} bad line(s)" in message, message
    assert all(f"line {n} of in.jsonl is not valid JSON" in message for n in bad_at), message
    report = run_batch(config)
    assert report["requests"]["total"] == len(lines) and report["requests"]["done"] == len(lines) - len(bad_at)
    records = read_records(tmp_path / "o.jsonl")
    answered = sorted(r["custom_id"] for r in records if r["error"] is None)
    want = sorted(json.loads(line)["custom_id"] for n, line in enumerate(lines, 1) if n not in bad_at)
    assert answered == want
    assert sorted(r["error"]["line"] for r in records if r["error"] is not None) == sorted(bad_at)
    again = run_batch(config)  # a resume reads every answer back (the error lines run again)
    assert again["requests"]["skipped_already_done"] == len(want) and again["requests"]["failed"] == len(bad_at)
    assert len(read_records(tmp_path / "o.jsonl")) == len(lines)


def test_jsonl_lines_split_at_newlines_only():
    from offload.jobs.batch import jsonl_lines

    assert jsonl_lines('{"a": "x\u2028y\x85z\u2029"}\r\n{"b": 1}\n\n{"c": "\r"}') == [
        '{"a": "x\u2028y\x85z\u2029"}', '{"b": 1}', "", '{"c": "\r"}']
    assert jsonl_lines("") == [] and jsonl_lines("\n") == [""] and jsonl_lines("a\r\r\n") == ["a\r"]

"""Batch files: parsing OpenAI Batch JSONL and prompt files; the resumable output log."""

from __future__ import annotations

import json

import pytest

from jobs_support import chat_line, completion_line, read_records, write_batch
from offload.jobs.batch import CHAT, COMPLETIONS, error_record, read_requests, success_record
from offload.jobs.output import OutputLog
from offload.errors import ConfigError


def test_parses_chat_completion_and_token_prompts(tmp_path):
    path = write_batch(tmp_path / "in.jsonl", [
        chat_line("c", "hi", max_tokens=5, temperature=0.5, model="whatever"),
        completion_line("p", "Once upon", max_completion_tokens=3, stop=["\n"]),
        completion_line("t", [1, 2, 3]),
        {**chat_line("parts", "x"), "body": {"messages": [{"role": "user",
                                                           "content": [{"type": "text", "text": "ab"}]}]}},
    ])
    requests, bad = read_requests(path, defaults={"max_tokens": 9, "temperature": 0.0})
    assert bad == []
    by_id = {r.custom_id: r for r in requests}
    assert by_id["c"].url == CHAT and by_id["c"].messages == [{"role": "user", "content": "hi"}]
    assert (by_id["c"].params.max_tokens, by_id["c"].params.temperature) == (5, 0.5)  # body beats defaults
    assert by_id["p"].url == COMPLETIONS and by_id["p"].prompt == "Once upon"
    assert by_id["p"].params.max_tokens == 3 and by_id["p"].params.stop == ["\n"]
    assert by_id["t"].prompt == [1, 2, 3] and by_id["t"].params.max_tokens == 9  # defaults fill the rest
    assert by_id["parts"].messages[0]["content"] == "ab"


def test_text_prompt_file(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("first prompt\n\n  second  \n")
    requests, bad = read_requests(path, "text", chat=True)
    assert [r.custom_id for r in requests] == ["line-1", "line-3"]
    assert requests[1].messages == [{"role": "user", "content": "second"}]
    plain, _ = read_requests(path, "text", chat=False)
    assert plain[0].url == COMPLETIONS and plain[0].prompt == "first prompt"


@pytest.mark.parametrize("line, message", [
    ("not json", "line 2 of in.jsonl is not valid JSON"),
    ("[1, 2]", "expected a JSON object, found list"),
    (json.dumps({"url": CHAT, "body": {}}), "expected a non-empty string 'custom_id', found None"),
    (json.dumps({**chat_line("x", "hi"), "method": "GET"}), "expected 'method' POST, found 'GET'"),
    (json.dumps({**chat_line("x", "hi"), "body": "text"}), "expected 'body' to be a JSON object"),
    (json.dumps(completion_line("x", "")), "expected 'prompt' to be a non-empty string or a list of token ids"),
    (json.dumps({**chat_line("x", "hi"), "body": {"messages": []}}), "expected 'messages' to be a non-empty list"),
    (json.dumps(chat_line("x", "hi", top_p=0)), "top_p must be in (0, 1]"),
    (json.dumps(chat_line("x", "hi", n=0)), "n must be an integer from 1 to 64"),
    (json.dumps(chat_line("x", "hi", top_logprobs=3)), "'top_logprobs' needs 'logprobs': true"),
    (json.dumps(completion_line("x", "hi", logprobs=True)), "expected 'logprobs' to be an integer from 0 to 20"),
    (json.dumps(completion_line("x", ["a", "b"])), "a batch line takes one prompt"),
])
def test_bad_lines_become_errors_not_crashes(tmp_path, line, message):
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps(chat_line("ok", "hi")) + "\n" + line + "\n")
    requests, bad = read_requests(path)
    assert [r.custom_id for r in requests] == ["ok"]
    assert len(bad) == 1 and message in bad[0].message and bad[0].line_no == 2


def test_duplicate_ids_refused_before_start(tmp_path):
    path = write_batch(tmp_path / "in.jsonl", [chat_line("a", "x"), chat_line("a", "y")])
    with pytest.raises(ConfigError, match="custom_id must be unique, found 'a' on lines 1 and 2"):
        read_requests(path)


def test_records_follow_openai_batch_format(tmp_path):
    path = write_batch(tmp_path / "in.jsonl", [chat_line("c", "hi"), completion_line("p", "x"), "oops"])
    (chat, completion), (bad,) = read_requests(path)
    chat_choice = {"index": 0, "message": {"role": "assistant", "content": "Paris."}, "logprobs": None,
                   "finish_reason": "stop"}
    rec = success_record(chat, [chat_choice], 7, 2, "m")
    assert rec["custom_id"] == "c" and rec["error"] is None and rec["id"].startswith("batch_req_")
    body = rec["response"]["body"]
    assert rec["response"]["status_code"] == 200 and body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Paris."}
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    text_choice = {"index": 0, "text": "y", "logprobs": None, "finish_reason": "length"}
    assert success_record(completion, [text_choice], 1, 1, "m")["response"]["body"]["choices"][0]["text"] == "y"
    err = error_record(bad, bad.message)
    assert err["response"] is None and err["custom_id"] is None and err["error"]["line"] == 3


def _log(tmp_path, **fingerprint) -> OutputLog:
    return OutputLog(tmp_path / "out.jsonl", {"model.path": "m", **fingerprint})


def test_resume_skips_done_and_cuts_torn_line(tmp_path):
    log = _log(tmp_path)
    assert log.open() == set()
    log.append({"custom_id": "a", "response": {}, "error": None})
    log.append({"custom_id": None, "response": None, "error": {"line": 4, "message": "x"}})
    log.close()
    with open(log.path, "a") as f:
        f.write('{"custom_id": "b", "resp')  # a write cut short by SIGKILL
    again = _log(tmp_path)
    assert again.open() == {"a"}  # the error line of line 4 is retried
    again.append({"custom_id": "b", "response": {}, "error": None})
    again.close()
    assert [r["custom_id"] for r in read_records(log.path)] == ["a", "b"]


def test_resume_with_changed_job_refused(tmp_path):
    log = _log(tmp_path, **{"model.quantization": "none"})
    log.open()
    log.append({"custom_id": "a"})
    log.close()
    with pytest.raises(ConfigError, match="started with model.quantization='none' but this run has "
                                          "model.quantization='q8_0'.*--restart"):
        _log(tmp_path, **{"model.quantization": "q8_0"}).open()
    restarted = _log(tmp_path, **{"model.quantization": "q8_0"})
    assert restarted.open(restart=True) == set()
    restarted.close()
    assert log.path.read_text() == "" and read_records(log.path.with_name("out.jsonl.bak")) == [{"custom_id": "a"}]


def test_output_without_manifest_refused(tmp_path):
    (tmp_path / "out.jsonl").write_text('{"custom_id": "a"}\n')
    with pytest.raises(ConfigError, match="has no out.job.json"):
        _log(tmp_path).open()


def test_damaged_middle_line_refused(tmp_path):
    log = _log(tmp_path)
    log.open()
    log.close()
    log.path.write_text('{"custom_id": "a"}\ngarbage\n{"custom_id": "b"}\n')
    with pytest.raises(ConfigError, match="line 2 is not a JSON record"):
        _log(tmp_path).open()

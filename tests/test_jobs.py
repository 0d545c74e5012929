"""Batch jobs end to end: outputs, error lines, resume, refusal of a changed job, report and trace."""

from __future__ import annotations

import json

import pytest

from jobs_support import chat_line, completion_line, make_tiny_chat_model, read_records, write_batch, write_job
from offload.cli.main import main
from offload.errors import ConfigError
from offload.jobs.run import _progress_on, run_batch


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def tiny_llm(tiny_model):
    from offload import LLM

    return LLM(str(tiny_model), batch_size=4)


def tiny_job(tmp_path, model, n: int = 6, **sections) -> tuple:
    lines = [chat_line(f"c{i}", f"Question {i}?") for i in range(n // 2)]
    lines += [completion_line(f"p{i}", f"Once upon a time {i}", max_tokens=3 + i) for i in range(n - n // 2)]
    lines.insert(2, '{"custom_id": "broken",')
    write_batch(tmp_path / "in.jsonl", lines)
    base = {"model": {"path": str(model)}, "input": {"path": "in.jsonl"}, "output": {"path": "out/o.jsonl"},
            "sampling": {"max_tokens": 5, "temperature": 0}, "schedule": {"batch_size": 4},
            "report": {"trace": "out/trace.json", "print": False}}
    base.update(sections)
    return write_job(tmp_path / "job.yaml", **base), tmp_path / "out"


def test_job_writes_every_answer_and_error_line(tmp_path, tiny_model, tiny_llm):
    config, out = tiny_job(tmp_path, tiny_model)
    report = run_batch(config, llm=tiny_llm)
    records = read_records(out / "o.jsonl")
    answered = {r["custom_id"]: r for r in records if r["error"] is None}
    assert set(answered) == {"c0", "c1", "c2", "p0", "p1", "p2"}
    errors = [r for r in records if r["error"] is not None]
    assert len(errors) == 1 and errors[0]["error"]["line"] == 3 and "not valid JSON" in errors[0]["error"]["message"]
    p2 = answered["p2"]["response"]["body"]
    assert p2["object"] == "text_completion" and p2["usage"]["completion_tokens"] <= 5  # body max_tokens wins
    assert answered["c0"]["response"]["body"]["choices"][0]["message"]["role"] == "assistant"
    assert report["requests"] == {"total": 7, "done": 6, "failed": 1, "skipped_already_done": 0, "interrupted": False}
    assert report["tokens"]["generated"] == sum(r["response"]["body"]["usage"]["completion_tokens"]
                                                for r in answered.values())
    saved = json.loads((out / "o.report.json").read_text())
    assert saved["requests"] == report["requests"]
    assert saved["phases"]["decode"]["tokens"] > 0 and saved["phases"]["prefill"]["busy_share"]["cpu"] > 0.5
    assert json.loads((out / "trace.json").read_text())["traceEvents"]


def test_rerun_resumes_and_changed_job_is_refused(tmp_path, tiny_model, tiny_llm):
    config, out = tiny_job(tmp_path, tiny_model)
    run_batch(config, llm=tiny_llm)
    answers = [r for r in read_records(out / "o.jsonl") if r["error"] is None]
    report = run_batch(config, llm=tiny_llm)  # the error line (a malformed input line) is retried
    assert report["requests"]["done"] == 0 and report["requests"]["skipped_already_done"] == 6
    assert report["requests"]["failed"] == 1 and report["outputs"] == {"path": str(out / "o.jsonl"),
                                                                       "answered": 6, "failed": 1}
    assert [r for r in read_records(out / "o.jsonl") if r["error"] is None] == answers
    assert len(read_records(out / "o.jsonl")) == 7
    changed, _ = tiny_job(tmp_path, tiny_model, sampling={"max_tokens": 6, "temperature": 0})
    with pytest.raises(ConfigError, match="sampling.max_tokens=5 but this run has sampling.max_tokens=6"):
        run_batch(changed, llm=tiny_llm)
    report = run_batch(changed, llm=tiny_llm, restart=True)
    assert report["requests"]["done"] == 6 and len(read_records(out / "o.jsonl")) == 7


def test_resume_answers_only_the_missing(tmp_path, tiny_model, tiny_llm):
    config, out = tiny_job(tmp_path, tiny_model)
    run_batch(config, llm=tiny_llm)
    lines = (out / "o.jsonl").read_text().splitlines(keepends=True)
    (out / "o.jsonl").write_text("".join(lines[:3]) + lines[3][:20])  # lost the tail, torn mid-line
    kept = sum(json.loads(line)["error"] is None for line in lines[:3])
    report = run_batch(config, llm=tiny_llm)
    assert report["requests"]["skipped_already_done"] == kept
    assert report["requests"]["done"] + report["requests"]["failed"] + kept == 7
    ids = [r["custom_id"] or "line" for r in read_records(out / "o.jsonl")]
    assert sorted(ids) == sorted(["c0", "c1", "c2", "p0", "p1", "p2", "line"])


def test_prompt_longer_than_context_is_an_error_line(tmp_path, tiny_model, tiny_llm):
    write_batch(tmp_path / "in.jsonl", [completion_line("long", list(range(600))), completion_line("ok", [5, 6])])
    config = write_job(tmp_path / "job.yaml", model={"path": str(tiny_model)}, input={"path": "in.jsonl"},
                       report={"print": False})
    report = run_batch(config, llm=tiny_llm)
    records = {r["custom_id"]: r for r in read_records(tmp_path / "in.outputs.jsonl")}
    assert "600 tokens but this run's context (max_model_len) is 512" in records["long"]["error"]["message"]
    assert records["ok"]["error"] is None and report["requests"]["failed"] == 1


def test_text_prompts_through_python_api(tmp_path, tiny_model, tiny_llm):
    (tmp_path / "p.txt").write_text("hello there\nhow are you\n")
    report = run_batch({"model": {"path": str(tiny_model)}, "input": {"path": str(tmp_path / "p.txt"),
                        "format": "text"}, "sampling": {"max_tokens": 2}, "report": {"print": False}}, llm=tiny_llm)
    assert report["requests"]["done"] == 2
    assert [r["custom_id"] for r in read_records(tmp_path / "p.outputs.jsonl")] in (["line-1", "line-2"],
                                                                                  ["line-2", "line-1"])


def test_progress_off_without_terminal(tmp_path, tiny_model, tiny_llm, capsys):
    config, _ = tiny_job(tmp_path, tiny_model)
    from offload.jobs.config import load_config

    assert not _progress_on(load_config(config), True)  # pytest captures stderr: not a terminal
    run_batch(config, llm=tiny_llm, progress=True)
    err = capsys.readouterr().err
    assert "req/s" not in err and "req]" not in err


def test_duplicate_ids_refused_before_anything_is_written(tmp_path, tiny_model, capsys):
    write_batch(tmp_path / "in.jsonl", [chat_line("a", "x"), chat_line("a", "y")])
    config = write_job(tmp_path / "job.yaml", model={"path": str(tiny_model)}, input={"path": "in.jsonl"})
    assert main(["run", str(config)]) == 2
    assert "custom_id must be unique" in capsys.readouterr().err
    assert not (tmp_path / "in.outputs.jsonl").exists()


@pytest.mark.slow
def test_default_model_job_from_config_file(tmp_path, capsys):
    """Acceptance: a batch job on the default model, launched from a config file by the CLI (exit code 3: one
request is an error line)."""
    write_batch(tmp_path / "in.jsonl", [chat_line("france", "What is the capital of France?"),
                                        completion_line("count", "One, two, three,", max_tokens=4),
                                        {"custom_id": "bad", "url": "/v1/embeddings", "body": {"input": "x"}}])
    config = write_job(tmp_path / "job.yaml", model={"path": "default"}, input={"path": "in.jsonl"},
                       output={"path": "out/answers.jsonl"}, sampling={"max_tokens": 10, "temperature": 0},
                       report={"plot": "out/timeline.png"})
    assert main(["run", str(config), "--trace", str(tmp_path / "out" / "trace.json"), "--no-progress"]) == 3
    printed = capsys.readouterr().out
    assert "requests: 2 done, 1 failed" in printed and "decode:" in printed
    records = {r["custom_id"]: r for r in read_records(tmp_path / "out" / "answers.jsonl")}
    assert "Paris" in records["france"]["response"]["body"]["choices"][0]["message"]["content"]
    assert records["count"]["response"]["body"]["usage"]["completion_tokens"] <= 4
    assert "expected 'url' to be one of" in records["bad"]["error"]["message"]
    report = json.loads((tmp_path / "out" / "answers.report.json").read_text())
    assert report["tokens"]["prompt"] > 0 and report["tokens"]["generated"] > 0
    for phase in ("prefill", "decode"):
        p = report["phases"][phase]
        assert p["tokens_per_s"] > 0 and set(p["busy_share"]) == {"cpu", "gpu", "pcie", "disk"}
        assert "gpu_wait_for_weights_s" in p and "predicted_s_per_token" in p and p["measured_s_per_token"] > 0
    assert report["memory"]["cpu"]["peak_bytes"] > 0
    trace = json.loads((tmp_path / "out" / "trace.json").read_text())["traceEvents"]
    tracks = {e["args"]["name"] for e in trace if e["name"] == "thread_name"}
    assert {"CPU compute", "GPU compute", "PCIe host-to-device", "disk reads"} <= tracks
    cpu_work = {e["args"]["phase"] for e in trace if e["ph"] == "X" and e["tid"] == 1}
    assert cpu_work == {"prefill", "decode"}
    assert (tmp_path / "out" / "timeline.png").read_bytes()[:4] == b"\x89PNG"

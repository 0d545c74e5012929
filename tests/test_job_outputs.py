"""Nothing lost, nothing hidden: one writer per output, a restart that keeps the old outputs until the new run
starts, failed requests retried and said in the exit code, reruns that keep the report, and file errors as one
sentence (issue 12, items 4, 5, 6, 8 and 11)."""

from __future__ import annotations

import errno
import json
import os

import pytest
import yaml

from conftest import make_hf_model, save_hf_model, write_config
from jobs_support import run_cli, completion_line, make_tiny_chat_model, read_records, write_batch, write_job
from offload.cli.exits import EXIT_ERROR, EXIT_FAILED_REQUESTS, EXIT_OK
from offload.jobs.output import OutputLog


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("tiny") / "model")


cli = run_cli


def job(tmp_path, model_dir, n: int = 3, lines=None, **sections):
    write_batch(tmp_path / "in.jsonl", lines or [completion_line(f"r{i}", f"Story {i}") for i in range(n)])
    base = {"model": {"path": str(model_dir)}, "input": {"path": "in.jsonl"}, "output": {"path": "o.jsonl"},
            "sampling": {"max_tokens": 2, "temperature": 0}, "report": {"print": False}}
    return write_job(tmp_path / "job.yaml", **{**base, **sections})


def test_a_restart_that_cannot_start_keeps_the_old_outputs(tmp_path, tiny_model):
    """Item 4: --restart used to delete the outputs before the run had started."""
    config = job(tmp_path, tiny_model)
    assert cli("run", config)[0] == EXIT_OK
    before = (tmp_path / "o.jsonl").read_bytes()
    code, message = cli("run", config, "--restart", "--cpu-memory", "1KiB")  # no plan fits
    assert code == EXIT_ERROR and "raise the budget above that" in message
    assert (tmp_path / "o.jsonl").read_bytes() == before and not (tmp_path / "o.jsonl.bak").exists()
    assert cli("run", config, "--restart")[0] == EXIT_OK
    assert (tmp_path / "o.jsonl.bak").read_bytes() == before and len(read_records(tmp_path / "o.jsonl")) == 3


def test_a_second_writer_is_refused_naming_the_first(tmp_path, tiny_model):
    """Item 5: two runs of one job used to write every answer twice."""
    config = job(tmp_path, tiny_model)
    holder = OutputLog(tmp_path / "o.jsonl", {})
    holder.lock()
    try:
        code, message = cli("run", config)
    finally:
        holder.close()
    assert code == EXIT_ERROR and f"is being written by process {os.getpid()}" in message
    assert not (tmp_path / "o.jsonl").exists()
    assert cli("run", config)[0] == EXIT_OK and not (tmp_path / "o.jsonl.lock").exists()


def test_a_finished_job_rerun_keeps_its_report_and_says_no_trace_was_made(tmp_path, tiny_model):
    """Item 6: a rerun with --trace used to overwrite the report with an empty one and say nothing."""
    config = job(tmp_path, tiny_model)
    assert cli("run", config)[0] == EXIT_OK
    report = (tmp_path / "o.report.json").read_bytes()
    code, message = cli("run", config, "--trace", tmp_path / "t.json")
    assert code == EXIT_OK and "nothing left to do" in message and "no trace was written" in message
    assert (tmp_path / "o.report.json").read_bytes() == report and not (tmp_path / "t.json").exists()


def test_trace_and_report_folders_are_made(tmp_path, tiny_model):
    """Item 6: a trace path in a folder that does not exist used to fail after every request had run."""
    config = job(tmp_path, tiny_model, report={"print": False, "trace": "new/deeper/t.json", "path": "r/r.json"})
    assert cli("run", config)[0] == EXIT_OK
    assert json.loads((tmp_path / "new" / "deeper" / "t.json").read_text())["traceEvents"]
    assert json.loads((tmp_path / "r" / "r.json").read_text())["requests"]["done"] == 3


def test_failed_requests_set_the_exit_code_and_are_retried(tmp_path, tiny_model):
    """Item 8: failures used to exit 0 and never be retried."""
    lines = [completion_line("long", list(range(100))), completion_line("ok", [5, 6])]
    config = job(tmp_path, tiny_model, lines=lines, model={"path": str(tiny_model), "max_model_len": 64})
    assert cli("run", config)[0] == EXIT_FAILED_REQUESTS
    code, message = cli("run", config, "--max-model-len", 128)  # the fix: a longer context
    assert code == EXIT_OK, message
    records = read_records(tmp_path / "o.jsonl")
    assert sorted(r["custom_id"] for r in records) == ["long", "ok"] and all(r["error"] is None for r in records)


def test_retry_failed_false_keeps_the_error_lines(tmp_path, tiny_model):
    lines = [completion_line("long", list(range(100))), completion_line("ok", [5, 6])]
    config = job(tmp_path, tiny_model, lines=lines, model={"path": str(tiny_model), "max_model_len": 64},
                 output={"path": "o.jsonl", "retry_failed": False})
    assert cli("run", config)[0] == EXIT_FAILED_REQUESTS
    code, message = cli("run", config, "--max-model-len", 128)
    assert code == EXIT_FAILED_REQUESTS and "nothing left to do" in message
    assert [r["error"] is None for r in read_records(tmp_path / "o.jsonl")].count(False) == 1


def test_a_job_where_every_request_failed_is_not_a_success(tmp_path, tiny_model):
    config = job(tmp_path, tiny_model, lines=['{"torn', "not json"])
    assert cli("run", config)[0] == EXIT_FAILED_REQUESTS


def test_disk_full_while_writing_outputs_is_one_sentence_and_keeps_the_report(tmp_path, tiny_model, monkeypatch):
    """Item 11: a full disk used to print three chained tracebacks and no report."""
    config = job(tmp_path, tiny_model, n=4, schedule={"batch_size": 1})
    real_begin = OutputLog.begin

    class FullDisk:
        def __init__(self, f):
            self.f, self.n = f, 0

        def write(self, text):
            self.n += 1
            if self.n > 2:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self.f.write(text)

        def __getattr__(self, name):
            return getattr(self.f, name)

    def begin(self, restart=False):
        real_begin(self, restart)
        self._file = FullDisk(self._file)

    monkeypatch.setattr(OutputLog, "begin", begin)
    code, message = cli("run", config)
    assert code == EXIT_ERROR and "Traceback" not in message
    assert "cannot write to" in message and "No space left on device" in message and "rerun to resume" in message
    assert len(read_records(tmp_path / "o.jsonl")) == 2
    assert json.loads((tmp_path / "o.report.json").read_text())["requests"]["done"] == 2


def test_validate_on_a_config_that_is_not_utf8(tmp_path):
    (tmp_path / "job.yaml").write_bytes(b"model:\n  path: d\xe9fault\n")
    code, message = cli("validate", tmp_path / "job.yaml")
    assert code == EXIT_ERROR and "is not UTF-8 text" in message and "Traceback" not in message


def test_calibrate_to_an_unwritable_path_fails_before_measuring(monkeypatch):
    import offload.runtime.calibrate as calibrate

    monkeypatch.setattr(calibrate, "calibrate", lambda *a: pytest.fail("measured before checking the output"))
    code, message = cli("calibrate", "--output", "/proc/nope/hw.yaml")
    assert code == EXIT_ERROR and "cannot write the hardware profile to /proc/nope/hw.yaml" in message


def test_a_config_json_with_a_non_number_names_the_key(tmp_path):
    folder = save_hf_model(make_hf_model("llama"), tmp_path / "m")
    write_config(folder, hidden_size="abc")
    code, message = cli("generate", "--model", folder, "--prompt", "hi")
    assert code == EXIT_ERROR and "key 'hidden_size' must be a whole number of 1 or more, found 'abc'" in message


def test_every_restart_keeps_the_outputs_it_replaces(tmp_path, tiny_model):
    """Issue 32 item 1: a second --restart used to overwrite the single <output>.bak, losing the first run."""
    config = job(tmp_path, tiny_model)
    runs = []
    for flags in ([], ["--restart"], ["--restart"]):
        code, message = cli("run", config, *flags)
        assert code == EXIT_OK, message
        runs.append((tmp_path / "o.jsonl").read_bytes())
    assert "the 3 earlier records of" in message and "o.jsonl.bak.1" in message
    assert (tmp_path / "o.jsonl.bak").read_bytes() == runs[0] and (tmp_path / "o.jsonl.bak.1").read_bytes() == runs[1]
    write_job(tmp_path / "job.yaml", **{**yaml.safe_load(config.read_text()), "output": {"path": "o.jsonl",
                                                                                       "overwrite": True}})
    assert cli("run", config)[0] == EXIT_OK
    assert (tmp_path / "o.jsonl.bak.2").read_bytes() == runs[2] and len(read_records(tmp_path / "o.jsonl")) == 3


def test_a_full_disk_leaves_the_earlier_report_whole(tmp_path, tiny_model, monkeypatch):
    """Issue 32 item 4: the report was written in place, so a full disk left a 0-byte <output>.report.json."""
    from offload.jobs import run

    config = job(tmp_path, tiny_model, n=2)
    assert cli("run", config)[0] == EXIT_OK
    report = (tmp_path / "o.report.json").read_bytes()

    def full_disk(report, path):  # as write_text on a full disk: the file is opened (emptied), the write fails
        with open(path, "w") as f:
            f.write("{")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(run, "write_report", full_disk)
    write_batch(tmp_path / "in.jsonl", [completion_line(f"r{i}", f"Story {i}") for i in range(3)])  # one more
    code, message = cli("run", config)
    assert code == EXIT_OK and "could not write" in message and "No space left on device" in message
    assert "the earlier o.report.json is left as it was" in message
    assert (tmp_path / "o.report.json").read_bytes() == report and len(read_records(tmp_path / "o.jsonl")) == 3
    assert sorted(p.name for p in tmp_path.iterdir() if "tmp" in p.name) == []

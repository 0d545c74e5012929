"""SIGTERM is Ctrl-C: flush, report, exit 143; spill folders go on every exit path, and a killed run's is
removed by the next run (issue 12, item 12)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import make_hf_model, save_hf_model
from jobs_support import completion_line, read_records, write_batch, write_job
from offload.runtime.disk import SPILL_PREFIX, SpillFolder, sweep_stale

ROOT = Path(__file__).resolve().parent.parent
HOLD = "import sys, time; from offload.runtime.disk import SpillFolder; f = SpillFolder(sys.argv[1]); " \
       "open(f.path / 'w.bin', 'wb').write(b'x' * 1000); print(f.name, flush=True); time.sleep(60)"


def _spill_folders(parent: Path) -> list[Path]:
    return sorted(parent.glob(SPILL_PREFIX + "*"))


def test_a_killed_runs_spill_folder_is_removed_by_the_next_and_a_live_one_is_not(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    killed = Path(proc.stdout.readline().strip())
    live = SpillFolder(tmp_path)
    proc.kill()
    proc.wait(timeout=30)
    assert killed.is_dir() and (killed / "w.bin").is_file()  # SIGKILL: nothing could clean up
    assert sweep_stale(tmp_path) == [killed]
    assert _spill_folders(tmp_path) == [live.path]
    live.close()
    assert _spill_folders(tmp_path) == []


def test_a_spill_folder_goes_at_exit_even_after_an_exception(tmp_path):
    code = "import sys; from offload.runtime.disk import SpillFolder; f = SpillFolder(sys.argv[1]); raise SystemExit(3)"
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 3 and _spill_folders(tmp_path) == []


@pytest.mark.slow
def test_sigterm_flushes_reports_cleans_the_spill_folder_and_exits_143(tmp_path):
    """A job whose weights partly live on disk, stopped by SIGTERM mid-run."""
    folder = save_hf_model(make_hf_model("llama", num_hidden_layers=6, hidden_size=128, intermediate_size=256),
                           tmp_path / "m")
    write_batch(tmp_path / "in.jsonl", [completion_line(f"r{i}", [1 + i % 50, 2, 3], ignore_eos=True)
                                        for i in range(400)])
    config = write_job(tmp_path / "job.yaml", model={"path": str(folder), "quantization": "q8_0",
                                                     "max_model_len": 40},
                       hardware="cpu-desktop", memory={"gpu": 0, "cpu": "900KiB", "disk": "1GiB", "baseline": 0},
                       input={"path": "in.jsonl"}, output={"path": "o.jsonl"}, sampling={"max_tokens": 16},
                       schedule={"batch_size": 2, "prefetch_depth": 1})
    spill = tmp_path / "tmp"
    spill.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "offload", "run", str(config), "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(spill)})
    out = tmp_path / "o.jsonl"
    deadline = time.monotonic() + 120
    while (not out.exists() or out.read_bytes().count(b"\n") < 3) and proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert _spill_folders(spill), "the job was meant to spill weights to disk"
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, stderr
    assert "terminated (SIGTERM)" in stderr and "Traceback" not in stderr
    report = json.loads((tmp_path / "o.report.json").read_text())
    assert report["requests"]["interrupted"] and report["requests"]["done"] == len(read_records(out)) >= 3
    assert _spill_folders(spill) == [] and not (tmp_path / "o.jsonl.lock").exists()

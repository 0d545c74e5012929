"""Command-line conventions: `python -m offload`, --version, logging to stderr with --quiet / --log-level."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import offload
from offload.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
MODEL = ["--model", str(ROOT / "configs/models/llama-3.1-8b"), "--quantization", "q4_0"]


def test_python_dash_m_offload_prints_the_version():
    out = subprocess.run([sys.executable, "-m", "offload", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"offload {offload.__version__}"


def test_one_version_in_the_package_metadata():
    from importlib.metadata import version

    assert version("offload") == offload.__version__


def test_messages_are_logged_to_stderr_and_quiet_silences_them(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_CACHE", str(tmp_path))
    assert main(["plan", *MODEL, "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.out.lstrip().startswith("{") and "offload: planning for the calibrated profile" in captured.err
    assert main(["plan", *MODEL, "--json", "--quiet"]) == 0
    captured = capsys.readouterr()
    assert captured.out.lstrip().startswith("{") and captured.err == ""
    assert main(["--log-level", "warning", "plan", *MODEL]) == 0
    assert capsys.readouterr().err == ""


def test_errors_stay_one_line_whatever_the_log_level(capsys):
    assert main(["plan", "--model", "/nonexistent/model", "--log-level", "debug"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("offload: error:")

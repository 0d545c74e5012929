"""`offload calibrate` on a machine without network or the default model: the process baseline is measured with a
tokenizer made here (or the recorded figure kept, said in one line), and the profile is written; on x86-64 it
refuses to measure the numba fallback unless told to. The measuring itself (minutes) is stood in for."""

from __future__ import annotations

import json
import socket

import pytest

import offload.costfit as costfit
import offload.kernels.check as check
import offload.quick_calibration as quick_calibration
import offload.runtime.calibrate as calibrate_module
import offload.runtime.host_memory as host_memory
import offload.weights.default_model as default_model
from offload.baseline import BASELINE_ROUNDING_BYTES
from offload.cli.main import main
from offload.hardware import estimate_hardware, load_hardware

REAL_QUICK_CPU_CURVES = quick_calibration.quick_cpu_curves  # the fixture stands in for it


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """An empty offload cache, no network, the default model's package absent; the minutes of measuring stood in
    for (their own tests cover them). Yields the cache folder."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("OFFLOAD_CACHE", str(cache))
    monkeypatch.setattr(default_model, "MODULE", "offload_test_no_such_package")

    def no_network(*args, **kwargs):
        raise OSError("network is unreachable (test)")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(default_model, "_download_gguf", lambda target: pytest.fail("calibrate downloaded a model"))
    monkeypatch.setattr(calibrate_module, "calibrate", lambda log: estimate_hardware())
    monkeypatch.setattr(quick_calibration, "quick_cpu_curves", lambda profile, log: profile)
    monkeypatch.setattr(check, "ACTIVE_PATH", "avx2")
    return cache


def test_calibrate_quick_measures_the_baseline_offline_and_writes_the_profile(offline, capsys):
    out = offline.parent / "hw.yaml"
    assert main(["calibrate", "--quick", "--output", str(out)]) == 0
    assert load_hardware(out).n_cores == estimate_hardware().n_cores
    recorded = json.loads((offline / "baseline.json").read_text())
    (baseline,) = recorded.values()
    assert baseline > 0 and baseline % BASELINE_ROUNDING_BYTES == 0
    err = capsys.readouterr().err
    assert f"{host_memory.STAND_IN_VOCAB}-token tokenizer made here" in err and "recorded for memory.baseline" in err


def test_without_a_tokenizer_the_recorded_figure_is_kept_in_one_line(offline, monkeypatch, capsys):
    def no_transformers(vocab_size):
        raise ImportError("No module named 'transformers'")

    monkeypatch.setattr(host_memory, "stand_in_tokenizer", no_transformers)
    out = offline.parent / "hw.yaml"
    assert main(["calibrate", "--quick", "--output", str(out)]) == 0
    assert out.is_file() and not (offline / "baseline.json").exists()
    lines = [line for line in capsys.readouterr().err.splitlines() if "baseline" in line]
    assert lines == ["offload: process baseline not measured (No module named 'transformers'); plans keep 512.00 MiB "
                     "(memory.baseline)"]


def test_the_stand_in_tokenizer_has_the_vocabulary_asked_and_round_trips():
    tokenizer = host_memory.stand_in_tokenizer(1000)
    assert len(tokenizer) == 1000
    ids = tokenizer("offload, 70B on one GPU")["input_ids"]
    assert tokenizer.decode(ids) == "offload, 70B on one GPU" and max(ids) < 1000


@pytest.mark.parametrize("active, machine, forced, problem", [
    ("avx2", "x86_64", None, None),
    ("scalar", "x86_64", None, None),
    ("numba", "aarch64", None, None),  # no C++ path is required there
    ("numba", "x86_64", None, "is not built or does not load (ImportError: boom)"),
    ("numba", "AMD64", "numba", "because OFFLOAD_KERNELS=numba is set")])
def test_the_kernel_path_problem(active, machine, forced, problem):
    found = check.path_problem(active, machine, forced, "ImportError: boom")
    assert (found is None) if problem is None else (problem in found)


def test_calibrate_refuses_the_numba_fallback_on_x86_64_in_one_line(offline, monkeypatch, capsys):
    monkeypatch.setattr(check, "ACTIVE_PATH", "numba")
    monkeypatch.setattr(check.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(check, "extension_load_error", lambda: "ImportError: undefined symbol: omp_get_num_threads")
    monkeypatch.delenv("OFFLOAD_KERNELS", raising=False)
    monkeypatch.setattr(calibrate_module, "calibrate", lambda log: pytest.fail("measured the numba kernels"))
    out = offline.parent / "hw.yaml"
    assert main(["calibrate", "--quick", "--output", str(out)]) != 0
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "undefined symbol" in line and "pip install -v -e ." in line and "OFFLOAD_KERNELS=numba" in line
    assert not out.exists()
    monkeypatch.setenv("OFFLOAD_KERNELS", "numba")  # on purpose: allowed
    monkeypatch.setattr(calibrate_module, "calibrate", lambda log: estimate_hardware())
    assert main(["calibrate", "--quick", "--output", str(out)]) == 0 and out.is_file()


def test_the_check_exits_non_zero_with_one_line(monkeypatch, capsys):
    monkeypatch.setattr(check, "ACTIVE_PATH", "numba")
    monkeypatch.setattr(check.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(check, "extension_load_error", lambda: "ImportError: No module named 'offload.kernels._C'")
    monkeypatch.delenv("OFFLOAD_KERNELS", raising=False)
    assert check.main() == 1
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1 and "_C" in captured.err
    monkeypatch.setattr(check, "ACTIVE_PATH", "avx512")
    assert check.main() == 0 and capsys.readouterr().out == "offload CPU kernels: avx512 (C++ extension, x86_64)\n"


def test_calibrate_quick_refuses_curves_that_contradict_each_other_and_keeps_the_old_profile(offline, monkeypatch,
                                                                                             capsys):
    """Issue 44 item 14: on a busy machine --quick wrote q4_0 flat at 2 GFLOP/s beside the other formats at 36-110,
    and every later plan was priced by it. Measured again and still contradicting, it is refused in one line, and
    the profile written before is left as it was."""
    from offload.runtime.speedprobe import SpeedProbe

    monkeypatch.setattr(quick_calibration, "quick_cpu_curves", REAL_QUICK_CPU_CURVES)
    monkeypatch.setattr(costfit, "probe", lambda fmt: SpeedProbe(fmt, 10e9, 100e9))
    flat, healthy = ((1, 2e9), (4, 2e9), (16, 2e9), (64, 2e9)), ((1, 36e9), (4, 60e9), (16, 90e9), (64, 110e9))
    monkeypatch.setattr(costfit, "measure_cpu_curve", lambda fmt, rows, **kw: flat if fmt == "q4_0" else healthy)
    out = offline.parent / "hw.yaml"
    out.write_text("name: calibrated before\n")
    assert main(["calibrate", "--quick", "--output", str(out)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("offload: error:")]
    assert len(errors) == 1 and "q4_0's rate does not rise with rows" in errors[0], errors
    assert "no profile was saved: run offload calibrate again when it is idle" in errors[0]
    assert out.read_text() == "name: calibrated before\n"

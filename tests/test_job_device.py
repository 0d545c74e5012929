"""A job on a hardware profile with a GPU, on a machine without one (issue 44 item 5): `offload run --hardware
rtx4090-ddr5` ran silently on the CPU and reported the GPU 100% busy, VRAM used and the preset's 51 GiB RAM budget.
On backend auto or cuda it is refused in one line; on backend cpu it runs, warns that the profile is not this
machine, and its report labels the GPU figures simulated; planning for the preset stays allowed."""

from __future__ import annotations

import json
import socket

import pytest

from jobs_support import chat_line, completion_line, make_tiny_chat_model, run_cli, write_batch
import offload.runtime.backends.cuda as cuda

GPU_PRESET = "rtx4090-ddr5"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("device") / "model")


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(cuda, "cuda_available", lambda: False)


def _args(model, folder, *flags):
    write_batch(folder / "in.jsonl", [completion_line("a", "hi"), chat_line("b", "hello")])
    return ["--model", model, "--input", folder / "in.jsonl", "--output", folder / "o.jsonl", "--max-tokens", 2,
            "--hardware", GPU_PRESET, *flags]


@pytest.mark.parametrize("flags", [(), ("--backend", "auto"), ("--backend", "cuda"),
                                   ("--backend", "cuda", "--gpu-memory", "8GiB")])
def test_a_gpu_profile_without_a_gpu_is_refused_in_one_line_on_auto_and_cuda(model, tmp_path, no_gpu, flags):
    code, message = run_cli("run", *_args(model, tmp_path, *flags))
    errors = [line for line in message.splitlines() if line.startswith("offload: error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in message, message
    for words in (f"hardware profile '{GPU_PRESET}' plans on a GPU", "no CUDA GPU is visible", "--backend cpu",
                  "`offload plan --hardware rtx4090-ddr5`"):
        assert words in errors[0], (words, errors[0])
    assert not (tmp_path / "o.jsonl").exists()


def test_on_backend_cpu_it_runs_warns_and_labels_the_gpu_figures_simulated(model, tmp_path, no_gpu):
    code, message = run_cli("run", *_args(model, tmp_path, "--backend", "cpu"))
    assert code == 0, message
    assert f"the hardware profile '{GPU_PRESET}' is not this machine" in message
    assert "device: simulated: no GPU ran this job" in message and "vram: peak n/a" in message
    report = json.loads((tmp_path / "o.report.json").read_text())
    assert report["device"]["gpu"].startswith("simulated") and report["memory"]["gpu"]["peak_bytes"] is None
    assert report["requests"]["done"] == 2


def test_on_backend_sim_it_runs_on_the_simulated_gpu_and_counts_its_host_syncs(model, tmp_path, no_gpu):
    code, message = run_cli("run", *_args(model, tmp_path, "--backend", "sim"))
    assert code == 0, message
    assert "ran on the simulated GPU" in message and "host syncs" in message
    report = json.loads((tmp_path / "o.report.json").read_text())
    assert report["phases"]["decode"]["host_syncs_per_step"] <= 2 and report["requests"]["done"] == 2


def test_without_a_gpu_budget_it_runs_on_auto_and_warns(model, tmp_path, no_gpu):
    code, message = run_cli("run", *_args(model, tmp_path, "--gpu-memory", "0"))
    assert code == 0 and "is not this machine" in message, message
    assert "device: simulated" not in message  # nothing was planned on the GPU


def test_a_cpu_profile_or_this_machines_runs_without_a_warning(model, tmp_path, no_gpu):
    args = _args(model, tmp_path)
    code, message = run_cli("run", *args[:-2], "--hardware", "cpu-desktop")
    assert code == 0 and "is not this machine" not in message and "device:" not in message, message
    assert "device" not in json.loads((tmp_path / "o.report.json").read_text())


def test_planning_for_the_preset_stays_allowed(model, no_gpu):
    code, message = run_cli("plan", "--model", model, "--hardware", GPU_PRESET)
    assert code == 0 and "resident on the GPU" in message, message


def test_the_python_api_refuses_it_too_and_runs_it_on_backend_cpu(model, no_gpu, caplog):
    """LLM(hardware=preset) planned the preset's GPU and ran its units on the CPU without a word."""
    from offload import LLM
    from offload.errors import ConfigError

    with pytest.raises(ConfigError, match=f"'{GPU_PRESET}' plans on a GPU .* no CUDA GPU is visible"):
        LLM(str(model), hardware=GPU_PRESET, max_model_len=64)
    llm = LLM(str(model), hardware=GPU_PRESET, backend="cpu", max_model_len=64)
    assert f"the hardware profile '{GPU_PRESET}' is not this machine" in caplog.text
    from offload import SamplingParams

    assert llm.generate("hi", SamplingParams(max_tokens=2))[0].outputs[0].token_ids


def test_serve_refuses_it_before_loading_the_model(model, no_gpu, monkeypatch):
    pytest.importorskip("fastapi", reason="offload[serve] is not installed")
    import offload.jobs.worker as worker

    monkeypatch.setattr(worker, "load_llm", lambda config: pytest.fail("the model was loaded"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, message = run_cli("serve", "--model", model, "--hardware", GPU_PRESET, "--port", port)
    assert code == 2 and "no CUDA GPU is visible" in message, message

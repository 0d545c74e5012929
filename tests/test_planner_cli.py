"""`offload plan` and `offload calibrate` from the command line."""

import json
from pathlib import Path

import pytest

from offload.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
PLAN_70B = ["plan", "--model", str(ROOT / "configs/models/llama-3.1-70b"),
            "--hardware", str(ROOT / "configs/hardware/rtx4090-ddr5.yaml"), "--gpu-memory", "22GiB",
            "--quantization", "q4_0"]


@pytest.fixture(autouse=True)
def empty_cache(tmp_path, monkeypatch):
    """No calibrated profile; the converted default model (made once per machine) is shared."""
    from offload.paths import cache_dir

    models = cache_dir() / "models"
    models.mkdir(parents=True, exist_ok=True)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "models").symlink_to(models)
    monkeypatch.setenv("OFFLOAD_CACHE", str(tmp_path / "cache"))


def test_plan_70b_on_4090_prints_table_and_summary(capsys):
    assert main(PLAN_70B) == 0
    out = capsys.readouterr().out
    assert "llama-3.1-70b (q4_0) on rtx4090-ddr5" in out
    assert "layer." in out and "tokens/s" in out and "compute split" in out
    summary = [line for line in out.splitlines() if line.startswith("blocks: ")]
    assert len(summary) == 1 and " of 83 resident on the GPU; decode streams " in summary[0]


def test_plan_explain_names_placements_one_way_and_summarises_once(capsys):
    """'offloaded' meant both 'to the GPU' and 'off it' on consecutive lines, and --explain repeated the summary:
    blocks are resident, streamed, computed on the CPU or read from disk, and the summary is printed once."""
    assert main(PLAN_70B + ["--explain"]) == 0
    out = capsys.readouterr().out
    assert "offloaded" not in out.lower()
    assert sum(line.startswith("blocks: ") for line in out.splitlines()) == 1
    assert "units not resident on the GPU" in out and "Weights: " in out


def test_plan_explain_counts_the_units_its_table_counts(capsys):
    """Issue 44 item 10: --explain said "of 41 units not resident on the GPU" where the table and the summary line
    counted 42 (the embedding, on the CPU, left out of the sentence); each phase's stream and CPU counts are the
    table's rows'."""
    assert main(PLAN_70B + ["--explain"]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("unit "))
    rows = [line.split() for line in lines[head + 1: lines.index("", head)]]  # unit n stored size unit tier ...
    away = {phase: [(int(r[1]), r[column]) for r in rows if r[5] != "gpu"] for phase, column in (("prefill", 6),
                                                                                              ("decode", 7))}
    n_away = sum(n for n, _ in away["decode"])
    assert n_away > sum(n for r in rows if r[0].startswith("layer") for n in [int(r[1])] if r[5] != "gpu")  # embed
    summary = next(line for line in lines if line.startswith("blocks: "))
    n_units = sum(int(r[1]) for r in rows)
    assert summary.startswith(f"blocks: {n_units - n_away} of {n_units} resident on the GPU")
    for phase, modes in away.items():
        n_stream, n_cpu = (sum(n for n, mode in modes if mode == want) for want in ("stream", "cpu"))
        sentence = f"{phase}: of {n_away} units not resident on the GPU, {n_stream} stream to it and {n_cpu} compute"
        assert any(line.startswith(sentence) for line in lines), (sentence, [x for x in lines if "resident" in x])


def test_plan_json(capsys):
    assert main(PLAN_70B + ["--json", "--batch-size", "4", "--max-tokens", "64"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["workload"]["batch_size"] == 4 and data["workload"]["gen_len"] == 64
    assert data["budget"]["gpu_bytes"] == 22 * 2**30 and data["weight_format"] == "q4_0"
    assert data["tiers"]["gpu"]["total_bytes"] <= 22 * 2**30 and len(data["units"]) == 83


@pytest.mark.slow
def test_plan_default_model_without_calibration_uses_an_estimate(capsys):
    assert main(["plan", "--model", "default", "--json"]) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert data["model"] == "SmolLM2-135M-Instruct.Q4_1.gguf" and data["weight_format"] == "gguf" and data["hardware"] == "estimated"
    assert "offload calibrate" in captured.err


@pytest.mark.slow
def test_plan_from_a_config_file_with_flags_on_top(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("model: {path: default, quantization: q8_0}\nmemory: {gpu: 0, cpu: 4GiB, disk: 0}\n"
                      "hardware: cpu-desktop\nschedule: {batch_size: 2}\nsampling: {max_tokens: 16}\n")
    assert main(["plan", str(config), "--json", "--batch-size", "3"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["weight_format"] == "q8_0" and data["hardware"] == "cpu-desktop"
    from offload.baseline import recorded_baseline_bytes

    baseline = recorded_baseline_bytes()  # a job's RAM budget counts the process's own (as calibrate recorded it)
    assert data["budget"]["cpu_bytes"] == 4 * 2**30 - baseline and data["budget"]["gpu_bytes"] == 0
    assert data["workload"]["batch_size"] == 3 and data["workload"]["gen_len"] == 16


@pytest.mark.parametrize("args, text, message", [
    (["--gpu-memory", "22 gigs"], None, "expected a size"),
    (["--quantization", "q3_k"], None, "key 'model.quantization': expected one of 'none', 'q8_0' or 'q4_0'"),
    ([], "modle: default\n", "unknown key 'modle'; did you mean 'model'?"),
    ([], "model: default\nmemory: {vram: 1GiB}\n", "unknown key 'memory.vram'; known keys: gpu, cpu, disk"),
    (["--model", "/nonexistent/model"], None, "does not exist"),
    (["--model", "llama-3.1-70b", "--hardware", "cpu-desktop", "--cpu-memory", "8GiB"], None, "short by"),
])
def test_plan_errors_are_one_line_and_exit_2(tmp_path, capsys, args, text, message):
    argv = ["plan", *args]
    if text is not None:
        config = tmp_path / "run.yaml"
        config.write_text(text)
        argv.insert(1, str(config))
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("offload: error:") and message in err and "Traceback" not in err


@pytest.mark.slow
def test_calibrate_caches_a_profile_that_plan_then_uses(tmp_path, capsys):
    assert main(["calibrate", "--quick"]) == 0  # without the CPU cost curves (test_predictions fits them small)
    captured = capsys.readouterr()
    assert "cpu memory read bandwidth" in captured.err and "GFLOP/s" in captured.err  # logged
    assert captured.out.startswith("wrote ")
    assert (tmp_path / "cache" / "hardware.yaml").is_file()
    assert main(["plan", "--model", "default", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["hardware"] == "calibrated" and data["phases"]["decode"]["tokens_per_s"] > 0

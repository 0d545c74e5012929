"""One plan contract: what `offload plan` prints is what `offload run` and LLM run, and the executor allocates
exactly the buffers the plan budgeted (staging slots, read-ahead buffers, prefill pass size)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from conftest import gpu_profile, make_hf_model, save_hf_model
from offload import LLM, SamplingParams
from offload.cli.main import main
from offload.jobs.config import load_config
from offload.jobs.run import load_llm
from offload.runtime.host_memory import process_baseline_bytes

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    hf = make_hf_model("llama", num_hidden_layers=6, hidden_size=128, intermediate_size=256)
    return save_hf_model(hf, tmp_path_factory.mktemp("contract") / "tiny6")


def _job(tmp_path: Path, **sections) -> Path:
    (tmp_path / "in.jsonl").write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                                                   "body": {"prompt": [1, 2, 3]}}) + "\n")
    job = {"input": {"path": "in.jsonl"}, **sections}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _plan_json(capsys, *argv) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _run_plan(config_path: Path) -> dict:
    """The plan `offload run` executes for a job: the LLM that run_batch loads."""
    return json.loads(load_llm(load_config(config_path)).plan.to_json())


JOBS = {  # name: job sections over the tiny model
    "gpu-streamed-q4_0": dict(model={"quantization": "q4_0", "max_model_len": 48}, hardware="rtx4090-ddr5",
                              memory={"gpu": "600KiB", "cpu": "1GiB", "baseline": 0}, sampling={"max_tokens": 12}),
    "cpu-disk-q8_0": dict(model={"quantization": "q8_0", "max_model_len": 40}, hardware="cpu-desktop",
                          memory={"gpu": 0, "cpu": "900KiB", "disk": "1GiB", "baseline": 0},
                          schedule={"batch_size": 2, "prefetch_depth": 1}),
    "planned-batch-none": dict(model={"dtype": "fp32"}, memory={"cpu": "64MiB", "baseline": 0}),
}


@pytest.mark.parametrize("name", sorted(JOBS))
def test_plan_of_a_job_is_the_plan_its_run_uses(tmp_path, capsys, tiny_dir, name):
    sections = JOBS[name]
    sections = {**sections, "model": {"path": str(tiny_dir), **sections.get("model", {})}}
    if sections.get("hardware") == "rtx4090-ddr5":  # a KiB-sized GPU budget: the preset without its reserve
        from offload.hardware import save_hardware

        # on the simulated GPU: a GPU profile's plan is refused on backend auto where no GPU is visible
        sections["hardware"] = {"profile": str(save_hardware(gpu_profile(), tmp_path / "gpu.yaml")), "backend": "sim"}
    config = _job(tmp_path, **sections)
    assert _plan_json(capsys, str(config)) == _run_plan(config)


@pytest.mark.slow
@pytest.mark.parametrize("config", ["configs/demo.yaml", "configs/cpu-only.yaml"])
def test_plan_of_a_shipped_job_is_the_plan_its_run_uses(capsys, config):
    assert _plan_json(capsys, str(ROOT / config)) == _run_plan(ROOT / config)


def test_plan_flags_and_llm_arguments_give_one_plan(capsys, tiny_dir):
    """`offload plan --flags` and LLM(...) with the same options: the same defaults, the same plan."""
    # above what this (long-running test) process already holds, so that the baseline leaves a budget
    budget = f"{process_baseline_bytes(str(tiny_dir)) // 2**20 + 2048}MiB"
    flags = ["--model", str(tiny_dir), "--quantization", "q8_0", "--cpu-memory", budget, "--hardware", "cpu-desktop"]
    llm = LLM(str(tiny_dir), quantization="q8_0", cpu_memory=budget, hardware="cpu-desktop")
    assert _plan_json(capsys, *flags) == json.loads(llm.plan.to_json())
    assert llm.request.baseline_bytes() > 0  # both count the process's own memory against the budget
    flags += ["--set", "memory.baseline=0"]
    llm = LLM(str(tiny_dir), quantization="q8_0", cpu_memory=budget, hardware="cpu-desktop", host_baseline=0)
    assert _plan_json(capsys, *flags) == json.loads(llm.plan.to_json())


def test_executor_allocates_the_read_ahead_the_plan_budgeted(tiny_dir):
    """prefetch_depth 1 plans one unit of read-ahead; the executor allocates the arena the plan sized, and its
    host memory never passes the plan's."""
    llm = LLM(str(tiny_dir), quantization="q8_0", hardware="cpu-desktop", gpu_memory=0, cpu_memory="950KiB", host_baseline=0,
              disk_memory="1GiB", batch_size=2, max_model_len=40, prefetch_depth=1, backend="cpu")
    plan = llm.plan
    assert plan.tier("disk").weights_bytes > 0 and plan.read_ahead_depth == 1
    reader = llm.model.reader
    assert reader.depth == plan.read_ahead_depth and reader.arena.numel() == plan.read_buffer_bytes
    llm.generate([[1, 2, 3, 4], [5, 6]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    cpu = plan.tier("cpu")
    assert llm.backend.memory.peak_bytes["cpu"] <= cpu.total_bytes - cpu.margin_bytes - cpu.workspace_bytes


def test_executor_allocates_the_staging_slots_the_plan_budgeted(tiny_dir):
    llm = LLM(str(tiny_dir), quantization="q4_0", hardware=gpu_profile(), gpu_memory="600KiB", cpu_memory="1GiB", host_baseline=0,
              batch_size=2, max_model_len=48, max_tokens=12, prefetch_depth=3, backend="cpu")
    plan = llm.plan
    assert any("stream" in (u.prefill, u.decode) for u in plan.units)
    ring = llm.model.ring
    assert ring.n_slots == plan.prefetch_depth and ring.slot_bytes == plan.staging_slot_bytes
    assert plan.tier("gpu").staging_bytes == ring.n_slots * ring.slot_bytes
    llm.generate([[1, 2, 3, 4], [5, 6]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    gpu = plan.tier("gpu")
    assert llm.backend.memory.peak_bytes["gpu"] <= gpu.total_bytes - gpu.margin_bytes - gpu.workspace_bytes


def test_prefill_layers_compute_in_chunks_of_the_planned_size(tiny_dir, monkeypatch):
    """A layer computes a long prefill in chunks of the plan's prefill_chunk_tokens, with the same tokens."""
    from offload.kernels import layer as fused

    ids = [(7 * j) % 150 + 1 for j in range(40)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    chunked = LLM(str(tiny_dir), quantization="q8_0", backend="cpu", prefill_chunk_tokens=16, max_model_len=64)
    whole = LLM(str(tiny_dir), quantization="q8_0", backend="cpu", max_model_len=64)
    assert chunked.plan.workload.prefill_chunk_tokens == chunked.model.placement.prefill_chunk_tokens == 16
    sizes, real = [], fused.fused_layers_forward
    monkeypatch.setattr(fused, "fused_layers_forward", lambda layers, x, *a, **k: sizes.append(x.shape[1]) or real(
        layers, x, *a, **k))
    out = chunked.generate([ids], params)[0].token_ids
    assert max(sizes) == 16 and sizes.count(16) == 2 * 6  # 40 prompt tokens: 16 + 16 + 8 in each of 6 layers
    assert out == whole.generate([ids], params)[0].token_ids


def test_a_prompt_longer_than_a_pass_is_prefilled_in_several(tiny_dir):
    from offload.engine import run_to_end
    from offload.generate import Generator
    from offload.sequence import Sequence

    llm = LLM(str(tiny_dir), quantization="q8_0", backend="cpu", max_model_len=64)
    ids = [(7 * j) % 150 + 1 for j in range(40)]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    seq = Sequence(0, ids, params)
    llm.timeline.clear()
    run_to_end(Generator(llm.model, max_batch_size=1, max_model_len=64, step_tokens=16), [seq])
    passes = [s for s in llm.timeline.spans if s.unit == "layer.0" and s.phase == "prefill"]
    assert [s.n_tokens for s in passes] == [16, 16, 8]
    assert seq.output_ids == llm.generate([ids], params)[0].token_ids


def test_a_plan_for_another_model_is_refused_by_the_executor(tiny_dir):
    from offload.errors import PlanError
    from offload.planner import Placement
    from offload.runtime.backends.cpu import CPUBackend
    from offload.runtime.executor import PlacedModel
    from offload.spec import load_spec
    from offload.weights.loader import Checkpoint
    from offload.weights.sources import CheckpointSource

    import torch

    spec = load_spec(tiny_dir)
    # units the page cache does not keep are read ahead into the plan's arena, here too small for them
    small = Placement.uniform(spec, "disk", "cpu", read_buffer_bytes=1024, page_cache=frozenset())
    source = CheckpointSource(Checkpoint(tiny_dir), spec, torch.float32, "q8_0")
    with pytest.raises(PlanError, match="plan again"):
        PlacedModel(spec, source, small, CPUBackend())

"""Both engines at once: streamed units set between the CPU units so copies run under CPU compute, the staging
depth searched, and the combined host read rate letting the link work beside the CPU at batch 1. Planned, then
run by the real executor on the timed simulated device."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from conftest import make_hf_model, save_hf_model
from offload.engine import run_to_end
from offload.generate import Generator
from offload.hardware import load_hardware
from offload.planner import Budget, Placement, PlanRequest, Workload, plan
from offload.planner.search import DEPTHS
from offload.runtime.backends.cpu import CPUBackend
from offload.runtime.backends.sim import SimBackend, TimedCosts
from offload.runtime.executor import PlacedModel
from offload.sampling import SamplingParams
from offload.sequence import Sequence
from offload.simulate import simulate
from offload.spec import load_spec
from offload.weights.loader import Checkpoint
from offload.weights.sources import CheckpointSource

ROOT = Path(__file__).resolve().parent.parent
MODEL_70B = str(ROOT / "configs" / "models" / "llama-3.1-70b")
COMBINED = str(ROOT / "tests" / "data" / "rtx4090-ddr5-combined.yaml")
GiB = 2**30


def _request(batch: int, max_tokens: int, hardware: str = "rtx4090-ddr5") -> PlanRequest:
    return PlanRequest.of(model=MODEL_70B, quantization="q4_0", hardware=hardware, gpu_memory="22GiB", cpu_memory="64GiB",
                          batch_size=batch, max_model_len=2048, max_tokens=max_tokens)


def _runs_of_cpu_layers(plan_) -> list[int]:
    """Lengths of the runs of consecutive host-RAM layers that decode on the CPU."""
    runs, n = [], 0
    for u in plan_.units:
        if u.kind == "layer" and u.weight_tier != "gpu":
            if u.decode == "cpu":
                n += 1
                continue
            runs.append(n)
            n = 0
    return [r for r in runs + [n] if r]


def test_batch_32_streams_between_cpu_layers_and_keeps_both_busy():
    """70B q4_0 at batch 32 on a 24 GB card: the streamed layers are spread among the CPU layers (no long run of CPU
    layers with the link idle), and on the simulated device the step is no longer CPU + PCIe in series: each is
    busy 30% of it or more and the step is at most 1.1x the busier one."""
    sim = simulate(_request(32, 16), decode_steps=4)
    n_streamed = sum(u.decode == "stream" for u in sim.plan.units if u.kind == "layer")
    runs = _runs_of_cpu_layers(sim.plan)
    assert n_streamed >= 10 and max(runs) <= -(-sum(runs) // n_streamed) + 1, runs
    decode = sim.phases["decode"]
    busy = decode.busy_share
    assert busy["cpu"] >= 0.3 and busy["pcie"] >= 0.3, busy
    assert 1 <= 1 / max(busy["cpu"], busy["pcie"]) <= 1.1
    assert abs(decode.predicted_over_simulated - 1) <= 0.10
    # the executor issued the plan's schedule: its copies and releases, in order, step after step
    schedule = sim.plan.schedule("decode")
    planned = [(a.op, a.unit) for a in schedule.actions if a.op in ("copy", "release") and a.issued != "ahead"]
    issued = [(event, unit) for event, unit, _ in sim.log if event in ("copy", "release")]
    assert len(planned) > 2 * n_streamed - 1 and _contains(issued, planned + planned[:6])
    slots = {}
    for event, unit, slot in sim.log[-len(planned):]:  # a slot is reused in turn, depth streamed units apart
        slots.setdefault(unit, slot)
    streamed = [a.unit for a in schedule.runs if sim.plan.unit(a.unit).decode == "stream"]
    assert all(slots[a] == slots[b] for a, b in zip(streamed, streamed[schedule.depth:]) if a in slots and b in slots)


def _contains(seq: list, part: list) -> bool:
    return any(seq[i:i + len(part)] == part for i in range(len(seq) - len(part) + 1))


def test_spread_places_each_groups_share_evenly():
    """The streamed units move to evenly spaced members of their group of units alike (where hand-overs cost more
    than the copies they would hide, the planner keeps them in one run: test_planner_moe's tiny model)."""
    from offload.planner.streams import spread

    assert spread([1, 2], [1, 2, 3, 4, 5, 6], lambda i: 0) == [2, 5]  # evenly spaced among units alike
    assert spread([1, 7], [1, 2, 3, 7, 8], lambda i: i > 5) == [2, 8]  # each group on its own


@pytest.mark.parametrize("batch, prompt_len", [(8, 512), (32, 1920)])
def test_depth_is_searched_and_never_predicts_slower_than_the_default(batch, prompt_len):
    """The searched depth's plan is the best of the fixed depths' (70B q4_0 on 22 GiB: at batch 8 one slot leaves
    room for one more resident layer and wins, 46.7 against 46.9 s for the job); its staging is what it budgets."""
    spec, hw = load_spec(MODEL_70B), load_hardware("rtx4090-ddr5")
    budget = Budget.for_hardware(hw, gpu_bytes=22 * GiB, cpu_bytes=64 * GiB)
    workload = Workload(batch_size=batch, prompt_len=prompt_len, gen_len=128)
    fixed = {depth: plan(spec, hw, budget, workload, "q4_0", depth).job_s for depth in DEPTHS}
    searched = plan(spec, hw, budget, workload, "q4_0", None)
    assert searched.prefetch_depth in DEPTHS and searched.job_s <= min(fixed.values()) * (1 + 1e-9)
    assert searched.job_s == pytest.approx(fixed[min(fixed, key=fixed.get)])
    if batch == 8:
        assert searched.prefetch_depth == 1 and searched.job_s < fixed[2]
    assert searched.tier("gpu").staging_bytes == searched.prefetch_depth * searched.staging_slot_bytes


def test_combined_host_read_rate_puts_both_engines_to_work_at_batch_1():
    """With DRAM serving the CPU (60 GB/s) and the copies (25 GB/s) 85 GB/s together, the batch-1 plan streams some
    layers while the CPU computes others: the link is busy 20% of the step or more, and decode is at least 1.2x
    the plan that keeps every offloaded layer on the CPU (41 GPU / 42 CPU units: 2.81 tok/s, the same figure this
    profile gives that plan)."""
    hw = load_hardware(COMBINED)
    assert hw.host_read_rate == 85e9 and load_hardware("rtx4090-ddr5").host_read_rate == 60e9
    sim = simulate(_request(1, 16, COMBINED), decode_steps=4)
    assert sim.phases["decode"].busy_share["pcie"] >= 0.2
    cpu_only = 1 / _cpu_only_decode_s(hw)
    assert sim.phases["decode"].tokens_per_s >= 1.2 * cpu_only
    assert sim.plan.decode.tokens_per_s >= 1.2 * cpu_only
    assert abs(sim.phases["decode"].predicted_over_simulated - 1) <= 0.10


def _cpu_only_decode_s(hw) -> float:
    """The decode step of the best plan that streams nothing in decode (the plan before both engines ran at once)."""
    from offload.planner.search import Search

    spec = load_spec(MODEL_70B)
    request = _request(1, 16, COMBINED)
    search = Search(spec, hw, request.budget(hw), request.workload(spec, hw), "q4_0", 2)
    best = None
    for k in range(len(search.order) + 1):
        cand = search._build(k, use_gpu=True, decode_kinds=())
        if cand.short:
            continue
        step = search._phase_cost("decode", cand).step_s
        best = step if best is None else min(best, step)
    return best


@pytest.mark.parametrize("batch", [1, 16])
def test_moe_plans_are_no_slower_than_whole_runs_of_cpu_units(batch):
    """Mixtral-8x7B q4_0 at 22 GiB: the searched plan's job is never predicted slower than the plan at the old
    fixed depth."""
    request = PlanRequest.of(model=str(ROOT / "configs" / "models" / "mixtral-8x7b"), quantization="q4_0", hardware="rtx4090-ddr5",
                             gpu_memory="22GiB", batch_size=batch)
    spec, hw = load_spec(request.model.path), request.profile()
    budget, workload = request.budget(hw), request.workload(spec, hw)
    assert plan(spec, hw, budget, workload, "q4_0", None).job_s <= plan(spec, hw, budget, workload, "q4_0", 2).job_s


def test_the_offline_job_keeps_kv_in_host_ram_and_grows_the_batch():
    """256 requests of 500-token prompts and 128 new tokens each (max_model_len 640, 22 GiB of VRAM, 64 GiB of RAM):
    the planner keeps the GPU layers' KV caches in host RAM, where their decode attention runs on the CPU, and picks
    a batch VRAM could not hold the cache of; the whole job, simulated, generates 58 tokens/s or more (31.8 with
    every GPU layer's cache in VRAM at batch 64)."""
    request = PlanRequest.of(model=MODEL_70B, quantization="q4_0", hardware="rtx4090-ddr5", gpu_memory="22GiB", cpu_memory="64GiB",
                             max_model_len=640, max_tokens=128)
    sim = simulate(request, decode_steps=3, prompt_len=500, requests=256)
    host_kv = [u for u in sim.plan.units if u.kind == "layer" and u.decode != "cpu" and u.kv_tier == "cpu"]
    assert host_kv and sim.plan.tier("gpu").kv_bytes == 0
    assert sim.plan.workload.batch_size >= 64
    assert sim.job["generated_tokens_per_s"] >= 58
    assert sim.phases["decode"].busy_share["cpu"] > 0.3  # the CPU attends (and computes its layers)
    for result in sim.phases.values():
        assert abs(result.predicted_over_simulated - 1) <= 0.10


def test_bench_overlap_smoke():
    """scripts/bench_overlap.py's smoke mode: the simulated device's wall mode runs both orders on a tiny model."""
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_overlap.py"), "--smoke"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "interleaved is" in out.stdout and "in-order" in out.stdout


def test_wall_mode_computes_cpu_blocks_and_sleeps_the_device():
    """The wall mode: host weights are real and CPU blocks compute them (the result equals the CPU backend's where
    every unit is on the CPU), device buffers take no memory, and a copy takes its simulated seconds of real time."""
    folder = save_hf_model(make_hf_model("llama", num_hidden_layers=2), Path(tempfile.mkdtemp()) / "tiny")
    spec = load_spec(folder)
    hw = load_hardware("rtx4090-ddr5").with_changes(h2d_pinned_bps=2e6, gpu_reserved_bytes=0)  # ~KB/ms
    source = CheckpointSource(Checkpoint(folder), spec, torch.float32, "none")

    def greedy(model):
        seqs = [Sequence(0, [5, 17, 33], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))]
        run_to_end(Generator(model, max_batch_size=1), seqs)
        return seqs[0].output_ids

    wall = SimBackend(hw, capacity_bytes=1 << 30, timed=TimedCosts(spec, hw, "none", "fp32"), wall=True)
    on_cpu = PlacedModel(spec, source, Placement.uniform(spec, "cpu", "cpu"), wall)
    assert greedy(on_cpu) == greedy(PlacedModel(spec, source, Placement.uniform(spec, "cpu", "cpu"), CPUBackend()))
    buf = wall.alloc("gpu", 4096)
    assert buf.device.type == "meta" and wall.alloc("cpu", 4096).device.type == "cpu"
    start = time.perf_counter()
    wall.host_wait(wall.copy_h2d(buf, torch.zeros(20_000, dtype=torch.uint8), "layer.0", "decode"))
    assert time.perf_counter() - start >= 0.009  # 20 kB at 2 MB/s: 10 ms


def test_recosting_a_host_kv_plan_prices_its_cpu_attention():
    """The run report re-costs the plan for the steps it ran: for a plan whose GPU layers keep their KV caches in
    host RAM, a step of the plan's own shape costs the plan's decode step (the CPU's attention and the hand-overs
    priced, not the GPU's)."""
    from offload.planner.recost import recost_steps
    from offload.profile.timeline import StepShape

    spec, hw = load_spec(MODEL_70B), load_hardware("rtx4090-ddr5")
    budget = Budget.for_hardware(hw, gpu_bytes=22 * GiB, cpu_bytes=64 * GiB)
    p = plan(spec, hw, budget, Workload(batch_size=128, prompt_len=512, gen_len=128), "q4_0", None)
    assert any(u.kind == "layer" and u.decode != "cpu" and u.kv_tier == "cpu" for u in p.units)
    mid = 512 + 128 // 2
    shape = StepShape("decode", 0.0, 0, 128, 128, 128, attended_keys=128 * mid, kv_read_tokens=128 * mid)
    assert recost_steps(spec, hw, p, [shape])["decode"] == pytest.approx(p.decode.step_s)


def test_plan_json_carries_the_schedule_and_explain_says_how_much_copy_time_hides(capsys):
    """`offload plan --json` has each phase's step as actions; `--explain` gives the copy time under compute."""
    import json

    from offload.cli.main import main

    argv = ["plan", "--model", MODEL_70B, "--hardware", "rtx4090-ddr5", "--gpu-memory", "22GiB", "--cpu-memory",
            "64GiB", "--quantization", "q4_0", "--batch-size", "32", "--max-model-len", "2048", "--max-tokens", "16"]
    assert main(argv + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    decode = data["schedule"]["decode"]
    assert any(a.startswith("copy layer.") and "is released" in a for a in decode)
    assert any(a.startswith("run layer.") and a.endswith("on cpu") for a in decode)
    assert data["phases"]["decode"]["copy_under_cpu_s"] > 0.5 * data["phases"]["decode"]["pcie_s"]
    assert main(argv + ["--explain"]) == 0
    assert "Copies under compute: prefill: " in capsys.readouterr().out

"""The CPU speed probe: the profile moved to a measured speed, the reference probes in YAML, the probe itself, and
a job's prediction scaled to the speed probed around it."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from offload.errors import ConfigError
from offload.hardware import load_hardware, profile_from_dict, profile_to_dict, save_hardware
from offload.rate_curves import speed_factor
from offload.runtime import speedprobe
from offload.runtime.speedprobe import MachineSpeed, SpeedProbe, machine_speed, probe_format

CPU = load_hardware("cpu-desktop")
CALIBRATED = replace(CPU, cpu_mem_bps=40e9, cpu_flops={"fp32": 100e9, "q8_0": 200e9},
                     cpu_flops_by_rows={"q8_0": ((1, 40e9), (8, 90e9), (64, 160e9), (256, 200e9))},
                     cpu_flops_one_thread={"q8_0": ((1, 20e9), (64, 80e9))},
                     cpu_k_factor={"q8_0": ((512, 0.5), (768, 1.0))},
                     cpu_attention={"fused": 30e9, "torch": 20e9, "kv_read": 12e9},
                     overhead_s={"step": 2e-4, "layer": 1e-5, "layer_unfused": 3e-4, "sequence": 5e-5, "logit": 1e-9},
                     cpu_probe={"q8_0": (60e9, 180e9, 30e9)})


def test_at_speed_scales_each_cpu_figure_and_leaves_the_rest():
    hw = CALIBRATED.at_speed(0.5, 2.0)
    # the factor runs from 0.5 at 1 row to 2.0 at 64 rows, linear in log(rows): 8 rows is half way (1.25)
    assert hw.cpu_flops_by_rows["q8_0"] == ((1, 20e9), (8, 112.5e9), (64, 320e9), (256, 400e9))
    assert hw.cpu_flops_one_thread["q8_0"] == ((1, 10e9), (64, 160e9))
    assert hw.cpu_flops == {"fp32": 200e9, "q8_0": 400e9}
    assert hw.cpu_mem_bps == 20e9
    assert hw.cpu_attention == {"fused": 60e9, "torch": 40e9, "kv_read": 6e9}
    assert hw.overhead_s == {"step": 1e-4, "layer": 5e-6, "layer_unfused": 1.5e-4, "sequence": 2.5e-5,
                             "logit": 5e-10}
    assert hw.cpu_k_factor == CALIBRATED.cpu_k_factor and hw.cpu_probe == CALIBRATED.cpu_probe
    attention = CALIBRATED.at_speed(0.5, 2.0, 1.5)  # attention probed apart: its rates move by its own speed
    assert attention.cpu_attention == {"fused": 45e9, "torch": 30e9, "kv_read": 6e9}
    assert attention.cpu_flops_by_rows == hw.cpu_flops_by_rows and attention.overhead_s == hw.overhead_s
    gpu = load_hardware("rtx4090-ddr5")
    moved = gpu.at_speed(0.5, 2.0)
    assert (moved.gpu_flops, moved.gpu_mem_bps, moved.h2d_pinned_bps, moved.disk_read_bps, moved.page_cache_bps) == (
        gpu.gpu_flops, gpu.gpu_mem_bps, gpu.h2d_pinned_bps, gpu.disk_read_bps, gpu.page_cache_bps)
    assert CALIBRATED.at_speed(1.0, 1.0) == CALIBRATED
    assert speed_factor(4096, 0.5, 2.0) == 2.0 and speed_factor(1, 0.5, 2.0) == 0.5


def test_cpu_probe_survives_the_yaml_round_trip_and_a_file_without_it_loads(tmp_path):
    data = profile_to_dict(CALIBRATED)
    assert data["cpu"]["probe"] == {"q8_0": {"memory": 60e9, "compute": 180e9, "attention": 30e9}}
    again = load_hardware(save_hardware(CALIBRATED, tmp_path / "hw.yaml"))
    assert again.cpu_probe == {"q8_0": (60e9, 180e9, 30e9)}
    del data["cpu"]["probe"]["q8_0"]["attention"]  # calibrated before attention was probed: 0, not probed
    assert profile_from_dict(data, "older.yaml").cpu_probe == {"q8_0": (60e9, 180e9, 0.0)}
    del data["cpu"]["probe"]
    assert profile_from_dict(data, "old.yaml").cpu_probe == {}
    assert "probe" not in profile_to_dict(CPU)["cpu"]  # presets have none, and write none
    data["cpu"]["probe"] = {"q8_0": {"memory": 60e9}}
    with pytest.raises(ConfigError, match=r"hw.yaml: cpu.probe.q8_0: expected both memory and compute rates, "
                                          r"found no compute"):
        profile_from_dict(data, "hw.yaml")
    data["cpu"]["probe"] = {"q9_0": {"memory": 60e9, "compute": 1e11}}
    with pytest.raises(ConfigError, match=r"cpu.probe: unknown weight format 'q9_0'"):
        profile_from_dict(data, "hw.yaml")


@pytest.mark.parametrize("fmt", ["fp32", "q8_0"])
def test_the_probe_measures_positive_rates_and_reuses_its_weight(monkeypatch, fmt):
    built = []
    real = speedprobe.random_weight
    monkeypatch.setattr(speedprobe, "PROBE_BYTES", 4 * 2**20)
    monkeypatch.setattr(speedprobe, "_WEIGHTS", {})
    monkeypatch.setattr(speedprobe, "random_weight", lambda *a: built.append(a) or real(*a))
    threads = torch.get_num_threads()
    first = speedprobe.probe(fmt, threads=1)
    hot = speedprobe._WEIGHTS[fmt]
    second = speedprobe.probe(fmt)
    assert len(built) == 1 and speedprobe._WEIGHTS[fmt] is hot  # packed once, then only timed
    assert torch.get_num_threads() == threads
    from offload.kernels import layer as fused

    for p in (first, second):
        assert p.fmt == fmt
        assert all(math.isfinite(r) and r > 0 for r in (p.memory, p.compute))
        assert p.attention > 0 if fused.HAS_CACHED_ATTENTION else p.attention == 0.0
        assert p.duration_s > 0


@pytest.mark.parametrize("fmt", ["fp32", "q8_0"])
def test_the_streamed_copies_are_the_weight_in_memory_of_their_own(fmt):
    linear, x_dtype = speedprobe.linear_for(fmt)
    hot = speedprobe.random_weight(fmt, 64, 256, torch.Generator().manual_seed(0))
    copies = speedprobe._copies(hot, 3)
    pointers = {w.data_ptr() if isinstance(w, torch.Tensor) else w.qs_ptr for w in copies}
    assert len(pointers) == 3 and (hot.data_ptr() if isinstance(hot, torch.Tensor) else hot.qs_ptr) not in pointers
    x = torch.randn(2, 256).to(x_dtype)
    for w in copies:
        assert torch.equal(linear(x, w), linear(x, hot))


def test_the_speed_is_the_probes_geometric_mean_over_the_reference():
    speed = machine_speed([SpeedProbe("q8_0", 30e9, 360e9, 10e9), SpeedProbe("q8_0", 120e9, 90e9, 40e9)],
                          (60e9, 180e9, 20e9))
    assert speed.fmt == "q8_0" and speed.n_probes == 2
    assert speed.memory == pytest.approx(1.0) and speed.compute == pytest.approx(1.0)
    assert speed.attention == pytest.approx(1.0) and speed.compute_range == (0.5, 2.0)
    assert machine_speed([SpeedProbe("q8_0", 30e9, 90e9)], (60e9, 180e9, 20e9)).to_dict() == {
        "format": "q8_0", "memory": 0.5, "compute": 0.5, "probes": 1, "compute_range": [0.5, 0.5]}
    # a reference from before attention was probed, or a probe without the C++ layer: no attention speed
    assert machine_speed([SpeedProbe("q8_0", 30e9, 90e9, 10e9)], (60e9, 180e9, 0.0)).attention is None
    assert machine_speed([SpeedProbe("q8_0", 30e9, 90e9, 10e9)], (60e9, 180e9, 20e9)).to_dict()["attention"] == 0.5


def test_a_steps_speed_is_the_probes_around_it_weighted_by_closeness():
    ref = (60e9, 180e9, 20e9)
    half, double = (SpeedProbe("q8_0", 60e9 * r, 180e9 * r, 20e9 * r, at_s=t) for r, t in ((0.5, 10.0), (2.0, 20.0)))
    assert speedprobe.speed_at([half, double], ref, 15.0) == pytest.approx((1.0, 1.0, 1.0))  # between: geometric mean
    assert speedprobe.speed_at([half], ref, 99.0) == pytest.approx((0.5, 0.5, 0.5))
    assert speedprobe.speed_at([replace(half, attention=0.0), double], ref, 15.0)[2] is None  # one probe without
    near, far = speedprobe.speed_at([half, double], ref, 10.0), speedprobe.speed_at([half, double], ref, 1e4)
    tau = speedprobe.SPEED_SMOOTHING_S
    w = math.exp(-10.0 / tau)  # the other probe, 10 s away, weighs e^(-10/tau) as much
    assert near == pytest.approx((2 ** ((w - 1) / (1 + w)),) * 3)
    assert 0.5 < near[0] < 1.0 and far[1] == pytest.approx(2 ** ((1 - w) / (1 + w)), rel=1e-6)
    many = [SpeedProbe("q8_0", 60e9 * (0.5 if i < 10 else 1.0), 180e9, at_s=10.0 * i) for i in range(20)]
    assert speedprobe.speed_at(many, ref, 0.0)[0] < 0.55 and speedprobe.speed_at(many, ref, 190.0)[0] > 0.95


def test_a_job_is_probed_every_few_seconds_and_never_more_than_its_share(monkeypatch):
    assert not speedprobe.probe_due([], 1e9)  # a run that is not a job's: never probed
    quick = [SpeedProbe("q8_0", 1.0, 1.0, at_s=100.0, duration_s=0.01)]
    t = 100.005  # the end of the last probe
    assert not speedprobe.probe_due(quick, t + speedprobe.MIN_PROBE_INTERVAL_S - 0.01)
    assert speedprobe.probe_due(quick, t + speedprobe.MIN_PROBE_INTERVAL_S + 1e-9)
    slow = [replace(quick[0], duration_s=1.0)]  # a probe of 1 s: at most PROBE_SHARE of the time
    interval = 1.0 / speedprobe.PROBE_SHARE
    assert interval > speedprobe.MIN_PROBE_INTERVAL_S
    assert not speedprobe.probe_due(slow, 100.5 + interval - 0.01) and speedprobe.probe_due(slow, 100.5 + interval + 1e-9)


def test_only_a_plan_with_cpu_layers_and_a_reference_probe_is_probed():
    from offload.planner.search import plan
    from offload.planner.types import Budget, Workload
    from offload.spec import spec_from_config

    spec = spec_from_config({"model_type": "llama", "hidden_size": 512, "num_attention_heads": 8,
                             "num_key_value_heads": 4, "intermediate_size": 1024, "num_hidden_layers": 4,
                             "vocab_size": 4096, "max_position_embeddings": 4096}, "test")
    cpu_plan = plan(spec, CALIBRATED, Budget(0, 64 * 2**30), Workload(4, 64, 16, compute_format="fp32"),
                    weight_format="q8_0")
    assert probe_format(spec, cpu_plan, CALIBRATED) == "q8_0"
    assert probe_format(spec, cpu_plan, replace(CALIBRATED, cpu_probe={})) is None  # a preset, an old calibration
    assert probe_format(spec, None, CALIBRATED) is None  # a placement given by hand
    cpu = cpu_plan.tier("cpu")
    room = [replace(cpu, budget_bytes=cpu.total_bytes + speedprobe.probe_bytes("q8_0") + extra) for extra in (0, -1)]
    assert [probe_format(spec, replace(cpu_plan, tiers=(t,)), CALIBRATED) for t in room] == ["q8_0", None]
    gpu = replace(load_hardware("rtx4090-ddr5"), cpu_probe={"fp16": (10e9, 100e9)})
    gpu_plan = plan(spec, gpu, Budget.for_hardware(gpu), Workload(4, 64, 16, compute_format="fp16"),
                    weight_format="fp16")
    assert all(u.weight_tier == "gpu" for u in gpu_plan.units)
    assert probe_format(spec, gpu_plan, gpu) is None


def _tiny_job(tmp_path):
    """An LLM of a tiny q8_0 model on the calibrated profile, and a job of three completions for it."""
    from conftest import make_hf_model, save_hf_model
    from offload import LLM

    folder = save_hf_model(make_hf_model("llama"), tmp_path / "tiny")
    llm = LLM(str(folder), quantization="q8_0", hardware=CALIBRATED, batch_size=2, host_baseline=0)
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": list(range(1, 4 + 3 * i)), "max_tokens": 4 + i}} for i in range(3)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    config = {"model": {"path": str(folder), "quantization": "q8_0"}, "input": {"path": str(tmp_path / "in.jsonl")},
              "output": {"path": str(tmp_path / "out.jsonl")}, "sampling": {"temperature": 0, "ignore_eos": True},
              "report": {"print": False, "progress": False}}
    return llm, config


def test_a_job_at_half_the_calibrated_speed_is_predicted_twice_as_long(tmp_path, monkeypatch):
    """A CPU-only job whose probes find half the reference rates: the report says so, and every phase's
    prediction is the plan re-costed on the calibrated profile, doubled."""
    from offload.jobs.run import run_batch
    from offload.jobs.worker import job_predicted_s

    calls = []

    def half_speed(fmt, threads=0):
        calls.append((fmt, threads))
        return SpeedProbe(fmt, 30e9, 90e9)

    monkeypatch.setattr(speedprobe, "probe", half_speed)
    llm, config = _tiny_job(tmp_path)
    report = run_batch(config, llm=llm)
    speed = report["machine_speed"]
    assert {k: speed[k] for k in ("format", "memory", "compute", "probes")} == {
        "format": "q8_0", "memory": pytest.approx(0.5), "compute": pytest.approx(0.5), "probes": 2}
    assert calls == [("q8_0", max(llm.model.threads.counts))] * 2  # before and after the generation
    calibrated = job_predicted_s(llm, llm.timeline)  # the same steps, on the profile as calibrated
    assert speed["predicted_s_at_calibration"] == pytest.approx(calibrated, rel=1e-9)  # reported beside
    for phase, p in report["phases"].items():
        assert p["predicted_s_per_token"] * p["tokens"] == pytest.approx(2 * calibrated[phase], rel=1e-9), phase
    llm.request = llm.request.with_options(hardware=replace(CALIBRATED, cpu_probe={}))  # no reference: no probe
    calls.clear()
    assert run_batch(config, llm=llm, restart=True)["machine_speed"] is None and not calls


def test_machine_speed_needs_steps(monkeypatch):
    """No generation (every request failed, or none ran): no speed and no second probe."""
    from types import SimpleNamespace

    from offload.jobs.worker import job_speed
    from offload.profile.timeline import Timeline

    llm = SimpleNamespace(speed_probes=[SpeedProbe("q8_0", 1.0, 1.0)],
                          probe_cpu_speed=lambda: pytest.fail("probed without steps"))
    assert job_speed(llm, Timeline()) is None and job_speed(llm, None) is None
    assert isinstance(machine_speed(llm.speed_probes, (1.0, 1.0)), MachineSpeed)


def test_each_step_is_priced_at_the_speed_probed_around_it(tmp_path, monkeypatch):
    """Probes between every step (the interval set to 0): the first two find half the reference rates, the rest
    the reference; each step is priced on the profile moved to the speed of the probes around its middle, so the
    phases come out between the job priced all at half speed and all at full speed."""
    from offload.jobs.run import run_batch
    from offload.planner.recost import recost_steps

    probed = []

    def slowing_then_full(fmt, threads=0):
        probed.append(fmt)
        rate = 0.5 if len(probed) <= 2 else 1.0
        return SpeedProbe(fmt, 60e9 * rate, 180e9 * rate)  # taking no time: due after every step

    monkeypatch.setattr(speedprobe, "probe", slowing_then_full)
    monkeypatch.setattr(speedprobe, "MIN_PROBE_INTERVAL_S", 0.0)
    llm, config = _tiny_job(tmp_path)
    report = run_batch(config, llm=llm)
    steps = llm.timeline.steps
    assert len(probed) == len(steps) + 2  # as the job starts, after each step, as it ends
    assert report["machine_speed"]["probes"] == len(probed)
    assert report["machine_speed"]["compute_range"] == [pytest.approx(0.5), pytest.approx(1.0)]
    probes = sorted(llm.speed_probes, key=lambda p: p.at_s)
    assert all(a.at_s < s.start_s and s.start_s + s.seconds < b.at_s  # each step between the probes beside it
               for a, s, b in zip(probes, steps, probes[1:]))
    expected = dict.fromkeys(report["phases"], 0.0)
    for s in steps:
        memory, compute, attention = speedprobe.speed_at(probes, CALIBRATED.cpu_probe["q8_0"], s.mid_s)
        assert attention is None  # these probes have no attention rate: the compute speed stands for it
        expected[s.phase] += recost_steps(llm.spec, CALIBRATED.at_speed(round(memory, 2), round(compute, 2)),
                                          llm.plan, [s])[s.phase]
    half, full = (recost_steps(llm.spec, CALIBRATED.at_speed(r, r), llm.plan, steps) for r in (0.5, 1.0))
    for phase, p in report["phases"].items():
        assert p["predicted_s_per_token"] * p["tokens"] == pytest.approx(expected[phase], rel=1e-9), phase
    decode = report["phases"]["decode"]["predicted_s_per_token"] * report["phases"]["decode"]["tokens"]
    assert full["decode"] < decode < half["decode"]

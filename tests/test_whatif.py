"""What-ifs and bottlenecks: each what-if is a fresh plan_for of the changed request; plans that do not fit say why;
`offload plan --explain` and the run report show them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from offload.cli.main import main
from offload.hardware import load_hardware, save_hardware
from offload.planner import PlanRequest, plan_for
from offload.planner.bottleneck import measured_bottleneck, predicted_bottleneck
from offload.planner.costs import PhaseCost
from offload.planner.whatif import MORE_VRAM_BYTES, next_preset, what_if_line, what_ifs
from offload.profile.report import JobCounts, build_report, format_report
from offload.profile.timeline import Span, Timeline
from offload.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent
MODEL_8B = str(ROOT / "configs/models/llama-3.1-8b")
MODEL_70B = str(ROOT / "configs/models/llama-3.1-70b")
# 8B in q8_0 on a T4 with a 6 GiB GPU budget at batch 4: every what-if fits (checked below).
REQUEST_8B = PlanRequest.of(model=MODEL_8B, quantization="q8_0", hardware="t4-server", gpu_memory="6GiB", batch_size=4,
                            host_baseline=0)
# 70B in q4_0 on a 4090 with 22 GiB and no disk: unquantized or q8_0 weights overflow the 64 GiB of RAM.
REQUEST_70B = PlanRequest.of(model=MODEL_70B, quantization="q4_0", hardware="rtx4090-ddr5", gpu_memory="22GiB",
                             host_baseline=0)


def _what_ifs(request: PlanRequest):
    spec, hw = load_spec(Path(request.model.path)), request.profile()
    plan = plan_for(spec, hw, request)
    return plan, {w.label: w for w in what_ifs(spec, hw, request, plan)}


def _independent(request: PlanRequest):
    return plan_for(load_spec(Path(request.model.path)), request.profile(), request)


def test_every_what_if_is_the_plan_of_the_changed_request():
    plan, found = _what_ifs(REQUEST_8B)
    t4 = load_hardware("t4-server")
    expected = {  # each request built here by hand, as a user would ask for it
        "none": REQUEST_8B.with_options(quantization="none"),
        "q4_0": REQUEST_8B.with_options(quantization="q4_0"),
        "+8 GiB VRAM": REQUEST_8B.with_options(hardware=t4.with_changes(vram_bytes=t4.vram_bytes + 8 * 2**30),
                               gpu_memory="14GiB"),
        "batch 2": REQUEST_8B.with_options(batch_size=2),
        "batch 8": REQUEST_8B.with_options(batch_size=8),
        "hardware rtx3090-ddr4": REQUEST_8B.with_options(hardware="rtx3090-ddr4", gpu_memory=None),
    }
    assert list(found) == list(expected)
    for label, request in expected.items():
        other, w = _independent(request), found[label]
        assert w.fits and w.reason is None
        assert w.decode_s_per_token == other.decode.s_per_token, label
        assert w.prefill_s_per_token == other.prefill.s_per_token, label
        assert w.decode_speedup == pytest.approx(plan.decode.s_per_token / other.decode.s_per_token), label
        assert w.prefill_speedup == pytest.approx(plan.prefill.s_per_token / other.prefill.s_per_token), label
        assert w.to_dict()["decode_tokens_per_s"] == pytest.approx(1 / other.decode.s_per_token)
    # not one factor for all: q4_0 speeds decode up, unquantized weights slow it down, the ratios differ
    assert found["q4_0"].decode_speedup > 1.5 and found["none"].decode_speedup < 0.8
    assert len({round(w.decode_speedup, 6) for w in found.values()}) == len(found)


def test_a_runs_what_ifs_are_priced_for_the_steps_it_took():
    """In a run's report every what-if but the batch ones is its re-planned plan priced for the steps the run took
    (as the run's own prediction is), against the current plan priced for the same steps; the batch what-ifs would
    have run other steps, so they keep the plans' workload and say so."""
    from offload.planner.recost import recost_steps
    from offload.planner.request import plan_spec
    from offload.planner.whatif import PLAN_WORKLOAD, STEPS_RUN
    from offload.profile.timeline import StepShape

    steps = [StepShape("prefill", 0.0, 300, 0, 3, 3, attended_keys=3 * 100 * 101 // 2, kv_read_tokens=0)]
    steps += [StepShape("decode", 0.0, 0, 3, 3, 3, attended_keys=3 * (100 + i), kv_read_tokens=3 * (100 + i))
              for i in range(20)]
    spec, hw = load_spec(Path(MODEL_8B)), REQUEST_8B.profile()
    plan = plan_for(spec, hw, REQUEST_8B)
    found = {w.label: w for w in what_ifs(spec, hw, REQUEST_8B, plan, steps)}
    tokens = {"prefill": 300, "decode": 60}

    def per_token(request, p):
        seconds = recost_steps(plan_spec(spec, p), request.profile(), p, steps)
        return {phase: seconds[phase] / n for phase, n in tokens.items()}

    current = per_token(REQUEST_8B, plan)
    t4 = load_hardware("t4-server")
    changed = {"none": REQUEST_8B.with_options(quantization="none"), "q4_0": REQUEST_8B.with_options(quantization="q4_0"),
               "+8 GiB VRAM": REQUEST_8B.with_options(hardware=t4.with_changes(vram_bytes=t4.vram_bytes + 8 * 2**30),
                                      gpu_memory="14GiB"),
               "hardware rtx3090-ddr4": REQUEST_8B.with_options(hardware="rtx3090-ddr4", gpu_memory=None)}
    for label, request in changed.items():
        w, new = found[label], per_token(request, _independent(request))
        assert w.predicted_for == STEPS_RUN, label
        assert (w.prefill_s_per_token, w.decode_s_per_token) == pytest.approx((new["prefill"], new["decode"]))
        assert w.decode_speedup == pytest.approx(current["decode"] / new["decode"]), label
        assert w.prefill_speedup == pytest.approx(current["prefill"] / new["prefill"]), label
    plan_level = {w.label: w for w in what_ifs(spec, hw, REQUEST_8B, plan)}
    for label in ("batch 2", "batch 8"):
        assert found[label].predicted_for == PLAN_WORKLOAD and plan_level[label].predicted_for is None
        assert found[label].decode_speedup == plan_level[label].decode_speedup
        assert found[label].line().endswith(f", for {PLAN_WORKLOAD})")
    # three short prompts are not the plan's batch of long ones: the priced speedups differ from the plan's
    assert found["q4_0"].decode_speedup != pytest.approx(plan_level["q4_0"].decode_speedup, rel=1e-3)


def test_what_ifs_keep_the_batch_the_planner_chose():
    # 8B unquantized on a 4090, batch left open: the planner picks 16; in q8_0 alone it would pick 32
    request = PlanRequest.of(model=MODEL_8B, hardware="rtx4090-ddr5")
    plan, found = _what_ifs(request)
    assert plan.workload.batch_size == 16
    assert _independent(request.with_options(quantization="q8_0")).workload.batch_size == 32
    same_batch = _independent(request.with_options(quantization="q8_0", batch_size=16))
    assert found["q8_0"].decode_s_per_token == same_batch.decode.s_per_token
    assert list(found)[3:5] == ["batch 8", "batch 32"]


def test_what_ifs_that_do_not_fit_say_why():
    plan, found = _what_ifs(REQUEST_70B)
    assert plan.workload.batch_size > 1  # the batch the planner chose is kept in the other what-ifs
    for label in ("none", "q8_0"):
        w = found[label]
        assert not w.fits and w.decode_s_per_token is None and w.decode_speedup is None
        assert w.reason.startswith("the closest placement needs") and "short by" in w.reason and ";" not in w.reason
        assert w.to_dict()["fits"] is False
        assert w.line() == f"{label}: does not fit: {w.reason}"
    assert found["+8 GiB VRAM"].fits and found["+8 GiB VRAM"].value == 22 * 2**30 + MORE_VRAM_BYTES
    assert found["+8 GiB VRAM"].decode_speedup > 1.1  # more layers resident: fewer streamed per token
    assert found["hardware h200-server"].fits


def test_a_doubled_batch_that_does_not_fit_is_listed():
    # 8B at batch 32 on a 32 GiB desktop: 16 GiB of KV cache fits in 25.6 GiB of RAM, 32 GiB at batch 64 does not
    request = PlanRequest.of(model=MODEL_8B, quantization="q4_0", hardware="cpu-desktop", batch_size=32, host_baseline=0)
    _, found = _what_ifs(request)
    assert found["batch 16"].fits and not found["batch 64"].fits
    assert "of cpu memory but the budget allows 25.60 GiB" in found["batch 64"].reason
    assert found["batch 64"].line().startswith("batch 64: does not fit: the closest placement needs")


@pytest.mark.parametrize("preset, up", [("cpu-desktop", "t4-server"), ("t4-server", "rtx3090-ddr4"),
                                        ("rtx3090-ddr4", "rtx4090-ddr5"), ("rtx4090-ddr5", "h200-server"),
                                        ("h200-server", None)])
def test_next_preset_up_is_the_next_by_vram_then_gpu_rate(preset, up):
    found = next_preset(load_hardware(preset))
    assert (found.name if found else None) == up


def test_which_what_ifs_are_asked():
    # CPU-only: no VRAM what-if; batch 1: no half; at the top preset: no hardware what-if
    _, found = _what_ifs(PlanRequest.of(model=MODEL_8B, quantization="q4_0", hardware="cpu-desktop", batch_size=1))
    assert list(found) == ["none", "q8_0", "batch 2", "hardware t4-server"]
    _, found = _what_ifs(PlanRequest.of(model=MODEL_8B, hardware="h200-server", batch_size=3))
    assert list(found) == ["q8_0", "q4_0", "+8 GiB VRAM", "batch 1", "batch 6"]


def _cost(gpu_s=0.0, cpu_s=0.0, pcie_s=0.0, disk_s=0.0, hop_s=0.0, host_mem_s=0.0, bound="compute") -> PhaseCost:
    return PhaseCost("decode", 1, gpu_s, cpu_s, pcie_s, disk_s, hop_s, host_mem_s, 1.0, bound)


def test_bottleneck_rules():
    assert predicted_bottleneck(_cost(gpu_s=0.3, cpu_s=0.5)) == "cpu"
    assert predicted_bottleneck(_cost(gpu_s=0.5, cpu_s=0.3)) == "gpu"
    assert predicted_bottleneck(_cost(gpu_s=0.1, cpu_s=0.1, hop_s=0.3)) == "overhead"
    assert predicted_bottleneck(_cost(gpu_s=0.5, pcie_s=0.9, bound="pcie")) == "pcie"
    assert predicted_bottleneck(_cost(cpu_s=0.5, host_mem_s=0.9, bound="host_memory")) == "host_memory"
    busy = {"cpu": 0.2, "gpu": 0.5, "pcie": 0.9, "disk": 0.0}
    assert measured_bottleneck(busy, idle_s=0.1) == "pcie"
    assert measured_bottleneck(busy, idle_s=1.2) == "overhead"
    assert measured_bottleneck(dict.fromkeys(busy, 0.0), idle_s=0.0) is None


def _cli_json(capsys, argv: list[str]) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_explain_prints_bottleneck_and_what_ifs(capsys, tmp_path):
    argv = ["plan", "--model", MODEL_70B, "--hardware", "rtx4090-ddr5", "--gpu-memory", "22GiB",
            "--quantization", "q4_0"]
    assert main(argv + ["--explain"]) == 0
    out = capsys.readouterr().out
    data = _cli_json(capsys, argv + ["--explain", "--json"])
    assert "what_ifs" not in _cli_json(capsys, argv + ["--json"])  # the plain JSON is the plan that runs
    names = {"gpu": "GPU compute", "cpu": "CPU compute", "pcie": "PCIe", "host_memory": "host memory"}
    assert data["bottleneck"] == {p: predicted_bottleneck(PhaseCost(**{k: v for k, v in data["phases"][p].items()
                                                                         if k in PhaseCost.__dataclass_fields__}))
                                  for p in ("prefill", "decode")}
    assert f"Bottleneck: prefill {names[data['bottleneck']['prefill']]}, decode " in out
    assert "what-ifs (the same job re-planned with one change" in out
    batch = data["workload"]["batch_size"]  # the planner's choice
    assert [w["label"] for w in data["what_ifs"]] == ["none", "q8_0", "+8 GiB VRAM", f"batch {batch // 2}",
                                                      f"batch {2 * batch}", "hardware h200-server"]
    for w in data["what_ifs"]:
        assert f"  {what_if_line(w)}\n" in out
    # what the same command says with the one change made by hand (a 32 GiB card: a profile of one's own)
    card = load_hardware("rtx4090-ddr5")
    bigger = save_hardware(card.with_changes(vram_bytes=card.vram_bytes + MORE_VRAM_BYTES), tmp_path / "big.yaml")
    for label, flags in [("+8 GiB VRAM", ["--gpu-memory", "30GiB", "--batch-size", str(batch), "--hardware",
                                          str(bigger)]),
                         (f"batch {batch // 2}", ["--batch-size", str(batch // 2)])]:
        other = _cli_json(capsys, argv + flags + ["--json"])
        w = next(w for w in data["what_ifs"] if w["label"] == label)
        assert w["decode_s_per_token"] == other["phases"]["decode"]["s_per_token"], label
        assert w["decode_speedup"] == pytest.approx(data["phases"]["decode"]["s_per_token"]
                                                    / other["phases"]["decode"]["s_per_token"])
    assert "does not fit: the closest placement needs" in out


def _timeline() -> Timeline:
    # prefill 1.0 s: cpu [0, 0.8]; decode 1.0 s: gpu [1, 1.3], pcie [1, 1.6] -> idle 0.4 s, pcie busiest
    tl = Timeline()
    tl.add(Span("cpu_block", "prefill", "layer.0", 0.0, 0.8, n_tokens=10))
    tl.add(Span("gpu_block", "decode", "layer.0", 1.0, 1.3))
    tl.add(Span("h2d_copy", "decode", "layer.0", 1.0, 1.6, n_bytes=1 << 20))
    tl.add_phase("prefill", 1.0, 10)
    tl.add_phase("decode", 1.0, 2)
    return tl


def test_report_has_bottlenecks_and_what_ifs():
    plan, found = _what_ifs(REQUEST_70B)
    changes = [w.to_dict() for w in found.values()]
    report = build_report(JobCounts(n_done=1), _timeline(), plan, what_ifs=changes)
    report = json.loads(json.dumps(report))  # as written to disk
    assert report["what_ifs"] == changes
    assert report["phases"]["prefill"]["bottleneck"] == "cpu" and report["phases"]["decode"]["bottleneck"] == "pcie"
    assert report["phases"]["decode"]["predicted_bottleneck"] == predicted_bottleneck(plan.decode)
    text = format_report(report)
    assert "bottleneck CPU compute" in text and "bottleneck PCIe" in text
    x = found["+8 GiB VRAM"].decode_speedup
    assert f"+8 GiB VRAM: predicted {x:.2f}x decode" in text
    assert f"q8_0: does not fit: {found['q8_0'].reason}" in text
    assert build_report(JobCounts())["what_ifs"] is None


def test_job_report_names_bottlenecks_and_what_ifs(tmp_path, capsys):
    from jobs_support import completion_line, make_tiny_chat_model, write_batch, write_job
    from offload.jobs.run import run_batch
    from offload.planner.bottleneck import BOTTLENECKS

    model = make_tiny_chat_model(tmp_path / "model")
    write_batch(tmp_path / "in.jsonl", [completion_line(f"p{i}", f"Once upon a time {i}") for i in range(2)])
    config = write_job(tmp_path / "job.yaml", model={"path": str(model)}, hardware="cpu-desktop",
                       input={"path": "in.jsonl"}, output={"path": "out/o.jsonl"},
                       sampling={"max_tokens": 3, "temperature": 0}, schedule={"batch_size": 2},
                       report={"print": True, "progress": False})
    run_batch(config)
    saved = json.loads((tmp_path / "out" / "o.report.json").read_text())
    labels = [w["label"] for w in saved["what_ifs"]]
    assert labels == ["q8_0", "q4_0", "batch 1", "batch 4", "hardware t4-server"]
    assert all(w["fits"] and w["decode_speedup"] > 0 for w in saved["what_ifs"])
    for phase in saved["phases"].values():
        assert phase["bottleneck"] in BOTTLENECKS and phase["predicted_bottleneck"] == "cpu"
    out = capsys.readouterr().out
    assert "what-ifs (the same job re-planned" in out and "  q4_0: predicted " in out
    assert "bottleneck " in out

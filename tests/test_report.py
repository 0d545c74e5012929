"""The report: busy shares, idle and wait time, predicted vs measured, memory; trace tracks; plot."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from offload.profile.report import (TRACK_IDS, JobCounts, build_report, format_report, trace_events, write_plot,
                            write_trace)
from offload.profile.timeline import Span, Timeline


def make_timeline() -> Timeline:
    # prefill: 2.0 s wall, 100 tokens; cpu busy [0, 1], gpu busy [0.5, 1.5] -> union 1.5 s, idle 0.5 s.
    # decode: 1.0 s wall, 10 tokens; gpu [2, 2.4] and [2.3, 2.6] merge to 0.6 s; pcie [2, 3] 1.0 s;
    #         wait [2.6, 2.8] 0.2 s; everything covers [2, 3] -> idle 0.
    tl = Timeline()
    tl.add(Span("cpu_block", "prefill", "layer.0", 0.0, 1.0, n_tokens=100))
    tl.add(Span("gpu_block", "prefill", "layer.1", 0.5, 1.5, n_tokens=100))
    tl.add(Span("gpu_block", "decode", "layer.0", 2.0, 2.4))
    tl.add(Span("gpu_block", "decode", "layer.1", 2.3, 2.6))
    tl.add(Span("h2d_copy", "decode", "layer.1", 2.0, 3.0, n_bytes=1 << 20))
    tl.add(Span("wait", "decode", "layer.1", 2.6, 2.8))
    tl.add_phase("prefill", 2.0, 100)
    tl.add_phase("decode", 1.0, 10)
    return tl


def test_phase_shares_idle_and_wait():
    report = build_report(JobCounts(n_requests=3, n_done=2, n_failed=1), make_timeline(), timeline_source="test")
    pre, dec = report["phases"]["prefill"], report["phases"]["decode"]
    assert pre["tokens_per_s"] == pytest.approx(50.0)
    assert pre["busy_share"] == pytest.approx({"cpu": 0.5, "gpu": 0.5, "pcie": 0.0, "disk": 0.0})
    assert pre["cpu_vs_gpu"] == pytest.approx({"cpu": 0.5, "gpu": 0.5})
    assert pre["idle_s"] == pytest.approx(0.5)
    assert dec["busy_s"]["gpu"] == pytest.approx(0.6) and dec["busy_share"]["pcie"] == pytest.approx(1.0)
    assert dec["cpu_vs_gpu"] == pytest.approx({"cpu": 0.0, "gpu": 1.0})
    assert dec["gpu_wait_for_weights_s"] == pytest.approx(0.2) and dec["idle_s"] == pytest.approx(0.0)
    assert dec["measured_s_per_token"] == pytest.approx(0.1) and dec["predicted_s_per_token"] is None
    assert report["requests"]["done"] == 2 and report["requests"]["failed"] == 1


def test_predicted_against_measured_and_memory():
    plan = SimpleNamespace(prefill=SimpleNamespace(s_per_token=0.01), decode=SimpleNamespace(s_per_token=0.05))
    report = build_report(JobCounts(), make_timeline(), plan, peaks={"cpu": 3 << 30, "gpu": 1 << 30},
                          budget={"cpu": 4 << 30, "gpu": None})
    dec = report["phases"]["decode"]
    assert dec["predicted_s_per_token"] == 0.05 and dec["predicted_over_measured"] == pytest.approx(0.5)
    assert report["phases"]["prefill"]["predicted_over_measured"] == pytest.approx(0.5)
    assert report["memory"]["cpu"] == {"peak_bytes": 3 << 30, "budget_bytes": 4 << 30, "peak_over_budget": 0.75}
    assert report["memory"]["gpu"]["peak_over_budget"] is None
    json.dumps(report)  # the report is JSON-ready
    text = format_report(report)
    assert "decode: 10.0 tok/s" in text and "pcie 100%" in text and "GPU waited for weights 0.20 s" in text
    assert "predicted 0.05" in text and "ram: peak 3.00 GiB of budget 4.00 GiB" in text


def test_the_cpu_speed_during_the_job_is_reported_where_it_was_probed():
    speed = {"format": "q8_0", "memory": 0.84, "compute": 0.912, "probes": 2}
    probed = build_report(JobCounts(), make_timeline(), machine_speed=speed)
    assert json.loads(json.dumps(probed))["machine_speed"] == speed
    line = "    cpu: speed during the job 0.84x memory, 0.91x compute of calibration (predictions scaled to it)"
    assert line in format_report(probed)
    plain = build_report(JobCounts(), make_timeline())
    assert plain["machine_speed"] is None and "speed during" not in format_report(plain)
    saved = {k: v for k, v in plain.items() if k != "machine_speed"}  # a report written before the field
    assert "speed during" not in format_report(saved)


def test_report_without_timeline():
    report = build_report(JobCounts(n_requests=1, n_done=1, n_generated_tokens=10, generate_s=2.0))
    assert report["phases"] is None and report["generated_tokens_per_s"] == 5.0
    assert "no timeline was recorded" in format_report(report)


def test_trace_has_a_track_per_resource(tmp_path):
    path = tmp_path / "trace.json"
    write_trace(make_timeline(), path)
    events = json.loads(path.read_text())["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == {1: "CPU compute", 2: "GPU compute", 3: "PCIe host-to-device", 4: "disk reads",
                     5: "GPU waiting for weights", 6: "host waiting for the GPU"}
    work = [e for e in events if e["ph"] == "X"]
    assert {e["tid"] for e in work} == {TRACK_IDS["cpu"], TRACK_IDS["gpu"], TRACK_IDS["pcie"], TRACK_IDS["wait"]}
    copy = next(e for e in work if e["cat"].startswith("h2d_copy"))
    assert (copy["ts"], copy["dur"], copy["args"]["n_bytes"]) == (pytest.approx(2e6), pytest.approx(1e6), 1 << 20)
    assert trace_events(Timeline())[0]["ph"] == "M"  # an empty timeline still loads
    synced = make_timeline()
    synced.add(Span("host_sync", "decode", "lm_head output (copy to host)", 1.5, 1.5))
    sync = [e for e in trace_events(synced) if e["ph"] == "X" and e["tid"] == TRACK_IDS["sync"]]
    assert [e["name"] for e in sync] == ["lm_head output (copy to host)"]


def test_plot_writes_png(tmp_path):
    tl = make_timeline()
    path = tmp_path / "t.png"
    write_plot(tl, build_report(JobCounts(), tl), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

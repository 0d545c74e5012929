"""The end-of-run report: where the time went per phase and resource; Chrome trace and matplotlib plot."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from offload.errors import ConfigError
from offload.planner.bottleneck import bottleneck_name, measured_bottleneck, predicted_bottleneck
from offload.planner.types import PHASES
from offload.planner.whatif import format_what_ifs
from offload.profile.timeline import KINDS, RESOURCES, disk_reads

TRACK_IDS = {"cpu": 1, "gpu": 2, "pcie": 3, "disk": 4, "wait": 5, "sync": 6}  # Chrome trace tid per resource
PHASE_COLORS = {"prefill": "tab:orange", "decode": "tab:blue"}
TRACK_NAMES = {"cpu": "CPU compute", "gpu": "GPU compute", "pcie": "PCIe host-to-device",
               "disk": "disk reads", "wait": "GPU waiting for weights", "sync": "host waiting for the GPU"}


@dataclass
class JobCounts:
    """What a job did, counted by the job loop."""

    n_requests: int = 0  # in the input file
    n_done: int = 0  # answered in this run
    n_failed: int = 0  # error lines written in this run
    n_skipped: int = 0  # answered by an earlier run of the same job
    n_prompt_tokens: int = 0
    n_generated_tokens: int = 0
    n_cached_tokens: int = 0  # prompt tokens the prefix cache gave
    generate_s: float = 0.0  # wall time spent generating
    interrupted: bool = False


def build_report(counts: JobCounts, timeline=None, plan=None, peaks: dict | None = None,
                 budget: dict | None = None, timeline_source: str | None = None,
                 what_ifs: list[dict] | None = None, predicted_s: dict[str, float] | None = None,
                 machine_speed: dict | None = None) -> dict:
    """The report as a JSON-ready dict; timeline, plan, what-ifs (WhatIf.to_dict()s), predicted_s (the plan
    re-costed for the steps run, seconds per phase: planner.recost) and machine_speed (the CPU's speed during the
    job that predicted_s is scaled to: speedprobe.MachineSpeed.to_dict()) are optional (fields are then None)."""
    return {
        "requests": {"total": counts.n_requests, "done": counts.n_done, "failed": counts.n_failed,
                     "skipped_already_done": counts.n_skipped, "interrupted": counts.interrupted},
        "tokens": {"prompt": counts.n_prompt_tokens, "generated": counts.n_generated_tokens,
                   "cached": counts.n_cached_tokens},
        "generate_s": counts.generate_s,
        "generated_tokens_per_s": _ratio(counts.n_generated_tokens, counts.generate_s),
        "cpu_kernels": cpu_kernel_path(),
        "timeline_source": timeline_source if timeline is not None else None,
        "phases": {p: _with_bottlenecks(phase_report(timeline, p, plan, (predicted_s or {}).get(p)),
                                        getattr(plan, p, None))
                   for p in PHASES} if timeline is not None else None,
        "memory": memory_report(peaks or {}, budget or {}),
        "disk": disk_reads(timeline) if timeline is not None else None,
        "what_ifs": what_ifs,
        "machine_speed": machine_speed,
    }


def phase_report(timeline, phase: str, plan=None, predicted_s: float | None = None) -> dict:
    """Tokens/s, busy share of each resource, idle and wait time, and predicted vs measured s/token.

    predicted: the plan re-costed for this run's steps of the phase (predicted_s) where given, else the plan's
    own figure for its workload (plan_s_per_token), which assumes the plan's batch and lengths."""
    time_s = timeline.phase_time_s.get(phase, 0.0)
    n_tokens = timeline.phase_tokens.get(phase, 0)
    busy = {r: timeline.busy_s(r, phase) for r in RESOURCES}
    compute_s = busy["cpu"] + busy["gpu"]
    measured = _ratio(time_s, n_tokens)
    plan_figure = _predicted_s_per_token(plan, phase)
    predicted = _ratio(predicted_s, n_tokens) if predicted_s is not None else plan_figure
    return {
        "time_s": time_s, "tokens": n_tokens, "tokens_per_s": _ratio(n_tokens, time_s),
        "busy_s": busy, "busy_share": {r: _ratio(b, time_s) for r, b in busy.items()},
        "cpu_vs_gpu": {"cpu": _ratio(busy["cpu"], compute_s), "gpu": _ratio(busy["gpu"], compute_s)},
        "idle_s": max(0.0, time_s - _union_s([s for s in timeline.spans if s.phase == phase and s.resource])),
        "gpu_wait_for_weights_s": sum(s.duration_s for s in timeline.spans if s.phase == phase and s.kind == "wait"),
        "predicted_s_per_token": predicted, "measured_s_per_token": measured, "plan_s_per_token": plan_figure,
        "predicted_for": "the steps run" if predicted_s is not None else "the plan's workload",
        "predicted_over_measured": _ratio(predicted, measured) if predicted is not None else None,
        **host_syncs(timeline, phase),
    }


def host_syncs(timeline, phase: str) -> dict:
    """The host's waits for the device in the phase (counted where a device counts them: the simulated GPU): per
    step, and by the unit and op that made them."""
    syncs = Counter(s.unit for s in timeline.spans if s.phase == phase and s.kind == "host_sync")
    n_steps = len(timeline.step_s.get(phase, ()))
    return {"host_syncs_per_step": _ratio(sum(syncs.values()), n_steps) if syncs else None,
            "host_syncs_by_unit": dict(syncs.most_common())}


def _with_bottlenecks(phase: dict, cost=None) -> dict:
    """A phase report with its measured bottleneck and, given the plan's PhaseCost, the predicted one (keys of
    planner.bottleneck.BOTTLENECKS; the rules are there)."""
    predicted = predicted_bottleneck(cost) if getattr(cost, "bound", None) is not None else None
    return {**phase, "bottleneck": measured_bottleneck(phase["busy_s"], phase["idle_s"]),
            "predicted_bottleneck": predicted}


def cpu_kernel_path() -> str | None:
    """The CPU kernel path this process ran (offload.kernels.ACTIVE_PATH: avx512, avx2, scalar or numba), None
    where the kernels were never loaded (not imported here for a report: that would import torch)."""
    return getattr(sys.modules.get("offload.kernels"), "ACTIVE_PATH", None)


def memory_report(peaks: dict, budget: dict) -> dict:
    """Peak bytes per tier against the budget, where either is known. The GPU's peak is the device's (what it
    had in use: Backend.memory_peaks), its allocator's allocated and reserved peaks beside it where given."""
    out = {}
    for tier in ("gpu", "cpu"):
        peak, limit = peaks.get(tier), budget.get(tier)
        out[tier] = {"peak_bytes": peak, "budget_bytes": limit,
                     "peak_over_budget": _ratio(peak, limit) if peak is not None and limit else None}
    for kind in ("allocated", "reserved"):
        if peaks.get(f"gpu_{kind}") is not None:
            out["gpu"][f"{kind}_peak_bytes"] = peaks[f"gpu_{kind}"]
    return out


def _predicted_s_per_token(plan, phase: str) -> float | None:
    cost = getattr(plan, phase, None) if plan is not None else None
    value = getattr(cost, "s_per_token", None)
    return float(value) if value is not None else None


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def _union_s(spans) -> float:
    """Seconds covered by at least one span."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted((s.start_s, s.end_s) for s in spans):
        if cur_end is None or start > cur_end:
            total += 0.0 if cur_end is None else cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    return total + (0.0 if cur_end is None else cur_end - cur_start)


def _probes_text(speed: dict) -> str:
    """', 5 probes, compute 0.80-0.95x': how many probes the speed rests on and how far they ranged."""
    low, high = speed.get("compute_range") or (None, None)
    if low is None or speed.get("probes", 1) < 2:
        return ""
    return f", {speed['probes']} probes, compute {low:.2f}-{high:.2f}x"


def format_report(report: dict) -> str:
    """The report as a few aligned lines of text for the terminal."""
    req, tok = report["requests"], report["tokens"]
    lines = [f"requests: {req['done']} done, {req['failed']} failed, {req['skipped_already_done']} done before"
             f"{' (interrupted)' if req['interrupted'] else ''} of {req['total']}",
             f"tokens: {tok['prompt']} prompt, {tok['generated']} generated in {report['generate_s']:.1f} s "
             f"({_fmt(report['generated_tokens_per_s'], '.1f')} generated tok/s)"]
    if tok.get("cached"):  # reports saved before the field lack it
        lines.append(f"prefix cache: {tok['cached']} of {tok['prompt']} prompt tokens taken from the cache "
                     f"({_pct(tok['cached'] / max(tok['prompt'], 1))}), not computed")
    if report.get("cpu_kernels"):  # reports saved before the field lack it
        path = report["cpu_kernels"]
        lines.append(f"kernels: CPU {path} ({'numba: the C++ extension is not built' if path == 'numba' else 'C++'})")
    if report["phases"] is None:
        lines.append("phases: nothing was generated in this run" if req["done"] == 0
                     else "phases: per replica, below" if report.get("replicas")
                     else "phases: no timeline was recorded by this runtime")
    for phase, p in (report["phases"] or {}).items():
        share = "  ".join(f"{r} {_pct(p['busy_share'][r])}" for r in RESOURCES)
        lines.append(f"{phase:>7}: {_fmt(p['tokens_per_s'], '.1f')} tok/s over {p['time_s']:.2f} s; busy {share}; "
                     f"idle {p['idle_s']:.2f} s; GPU waited for weights {p['gpu_wait_for_weights_s']:.2f} s")
        lines.append(f"{'':>7}  split {_pct(p['cpu_vs_gpu']['cpu'])} CPU / {_pct(p['cpu_vs_gpu']['gpu'])} GPU; "
                     f"s/token measured {_fmt(p['measured_s_per_token'], '.4g')}, "
                     f"predicted {_fmt(p['predicted_s_per_token'], '.4g')} "
                     f"({_ratio_text(p.get('predicted_over_measured'))} of measured, for "
                     f"{p.get('predicted_for', 'the plan' + chr(39) + 's workload')})")
        if p.get("host_syncs_per_step"):
            named = ", ".join(f"{u} {n}" for u, n in list(p["host_syncs_by_unit"].items())[:4])
            lines.append(f"{'':>7}  host syncs {p['host_syncs_per_step']:.1f} per step ({named})")
        if "bottleneck" in p:  # reports saved before bottlenecks were added lack it
            lines.append(f"{'':>7}  bottleneck {bottleneck_name(p['bottleneck'])} "
                         f"(predicted {bottleneck_name(p['predicted_bottleneck'])})")
    lines += speculation_lines(report.get("speculative"))
    speed = report.get("machine_speed")
    if speed:
        attention = f", {speed['attention']:.2f}x attention" if speed.get("attention") else ""
        lines.append(f"{'cpu':>7}: speed during the job {speed['memory']:.2f}x memory, {speed['compute']:.2f}x "
                     f"compute{attention} of calibration{_probes_text(speed)} (predictions scaled to it)")
    for tier, m in report["memory"].items():
        if m["peak_bytes"] is not None or m["budget_bytes"] is not None:
            lines.append(f"{'vram' if tier == 'gpu' else 'ram':>7}: peak {_gib(m['peak_bytes'])} "
                         f"of budget {_gib(m['budget_bytes'])}{_allocator_text(m)}")
    disk = report.get("disk") or {}
    if disk.get("requested_bytes"):
        lines.append(f"{'disk':>7}: {_gib(disk['requested_bytes'])} read by the disk tier, "
                     f"{_gib(disk['device_bytes'])} of it from the device "
                     f"({_pct(disk['page_cache_share'])} served by the page cache)")
    lines += format_what_ifs(report.get("what_ifs") or [])
    return "\n".join(lines)


def _allocator_text(m: dict) -> str:
    """' (the device's; allocated 9.10 GiB, reserved 9.50 GiB at peak)' where the allocator's peaks are known."""
    if "allocated_peak_bytes" not in m and "reserved_peak_bytes" not in m:
        return ""
    return (f" (the device's; allocated {_gib(m.get('allocated_peak_bytes'))}, reserved "
            f"{_gib(m.get('reserved_peak_bytes'))} at peak)")


def speculation_lines(spec: dict | None) -> list[str]:
    """The report's lines on speculative decoding: what it did and its predicted speed against the measured, or
    why it was dropped."""
    if not spec:
        return []
    if spec.get("dropped"):
        return [f"{'spec':>7}: {spec['reason']}"]
    lines = [f"{'spec':>7}: {spec['accepted']} of {spec['proposed']} proposed tokens kept "
             f"({_pct(spec['acceptance_rate'])}); {spec['tokens_per_pass']:.2f} tokens per pass that carried "
             f"proposals ({spec['verified_passes']} such passes)"
             + (f"; drafting took {_pct(spec['draft_share'])} of the time" if spec.get("draft_share") else "")]
    if spec.get("branch_tokens"):
        lines.append(f"{'':>7}  a tree's second candidates: {spec['branch_tokens']} carried, {spec['branches']} "
                     f"checked (their chain's token rejected), {spec['branches_kept']} kept")
    if spec.get("kept_though_slower"):
        lines.append(f"{'':>7}  {spec['kept_though_slower']}")
    if "predicted_for" not in spec:  # a placement given by hand, or a report saved before predictions were added
        return lines
    measured = (f"{'':>7}  decode with it {_fmt(spec['measured_tokens_per_s'], '.2f')} tok/s measured (drafting "
                f"included); predicted for {spec['predicted_for']}")
    if spec["forecast_tokens_per_s"] is None:
        return lines + [measured]
    steps = ("" if spec["predicted_tokens_per_s"] is None else
             f"{spec['predicted_tokens_per_s']:.2f} tok/s for the steps run (the measured acceptance, k = "
             f"{spec['predicted_k']} on {_pct(spec['predicted_share'])} of them): "
             f"{_ratio_text(spec['predicted_over_measured'])} of measured"
             + ("" if spec.get("predicted_tokens_per_pass") is None else
                f", {spec['predicted_tokens_per_pass']:.2f} tokens per pass "
                f"({_ratio_text(spec.get('tokens_per_pass_over_measured'))} of measured)") + "; ")
    forecast = (f"forecast {spec['forecast_tokens_per_s']:.2f} tok/s (the prior acceptance "
                f"{spec['prior_acceptance']:.2f}, the planner's k = {spec['forecast_k']}): "
                f"{_ratio_text(spec['forecast_over_measured'])}")
    return lines + [measured, f"{'':>7}  predicted {steps}{forecast}"]


def _ratio_text(x) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def _fmt(x, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


def _gib(n) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB"


def write_report(report: dict, path: Path) -> None:
    Path(path).write_text(json.dumps(report, indent=2) + "\n")


def trace_events(timeline) -> list[dict]:
    """Chrome trace events: one track (tid) per resource, times in microseconds from the first span."""
    t0 = min((s.start_s for s in timeline.spans), default=0.0)
    events = [{"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "offload"}}]
    for name, tid in TRACK_IDS.items():
        events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": TRACK_NAMES[name]}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": tid, "args": {"sort_index": tid}})
    for s in timeline.spans:
        track = "sync" if s.kind == "host_sync" else KINDS[s.kind] or "wait"
        events.append({"name": s.unit, "cat": f"{s.kind},{s.phase}", "ph": "X", "pid": 1, "tid": TRACK_IDS[track],
                       "ts": (s.start_s - t0) * 1e6, "dur": s.duration_s * 1e6,
                       "args": {"phase": s.phase, "n_bytes": s.n_bytes, "n_tokens": s.n_tokens}})
    return events


def write_trace(timeline, path: Path) -> None:
    """A Chrome/Perfetto trace JSON (open in chrome://tracing or ui.perfetto.dev)."""
    Path(path).write_text(json.dumps({"traceEvents": trace_events(timeline), "displayTimeUnit": "ms"}))


PLOT_EXTRA_HINT = "install it with `pip install 'offload[plot]'` (or matplotlib), or drop report.plot / --plot"


def plotting_available() -> bool:
    """Whether matplotlib (the `plot` extra) is installed."""
    return importlib.util.find_spec("matplotlib") is not None


def write_plot(timeline, report: dict, path: Path) -> None:
    """A PNG: the timeline per resource (top) and each phase's busy share per resource (bottom)."""
    if not plotting_available():
        raise ConfigError(f"writing the plot {path} needs matplotlib, which is not installed; {PLOT_EXTRA_HINT}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_time, ax_share) = plt.subplots(2, 1, figsize=(11, 6), gridspec_kw={"height_ratios": [3, 2]})
    _plot_timeline(ax_time, timeline)
    _plot_shares(ax_share, report)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_timeline(ax, timeline) -> None:
    tracks = list(TRACK_IDS)
    colors = PHASE_COLORS
    t0 = min((s.start_s for s in timeline.spans), default=0.0)
    for row, track in enumerate(tracks):
        for phase in PHASES:
            bars = [(s.start_s - t0, s.duration_s) for s in timeline.spans
                    if (KINDS[s.kind] or "wait") == track and s.phase == phase]
            if bars:
                ax.broken_barh(bars, (row - 0.4, 0.8), color=colors[phase], label=phase if row == 0 else None)
    ax.set_yticks(range(len(tracks)), [TRACK_NAMES[t] for t in tracks])
    ax.set_xlabel("seconds")
    ax.set_title("where the time went")
    handles = [plt_patch(colors[p], p) for p in PHASES]
    ax.legend(handles=handles, loc="upper right")


def plt_patch(color: str, label: str):
    from matplotlib.patches import Patch

    return Patch(color=color, label=label)


def _plot_shares(ax, report: dict) -> None:
    phases = report["phases"] or {}
    width = 0.8 / max(1, len(phases))
    for i, (phase, p) in enumerate(phases.items()):
        shares = [100 * (p["busy_share"][r] or 0.0) for r in RESOURCES]
        ax.bar([j + i * width for j in range(len(RESOURCES))], shares, width, label=phase,
               color=PHASE_COLORS.get(phase))
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(RESOURCES))], list(RESOURCES))
    ax.set_ylabel("busy % of phase time")
    ax.set_ylim(0, 105)
    ax.legend(loc="upper right")

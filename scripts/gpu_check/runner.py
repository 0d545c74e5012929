"""Runs the check's steps in order within one budget. Each step runs in a process of its own under its limit (cut to
what is left of the budget; a step that would get less than its min_s is not started); as it ends, one JSON line is
appended to items.jsonl and flushed, and summary.json is rewritten, so a kill mid-run leaves every finished step's
line. A rerun skips the steps an earlier run finished (their lines kept in the state folder). Standard library
only: the build runs before offload or torch can be imported."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from gpu_check.steps import ROOT, STEPS, Step

SMOKE_GOAL_S = 120  # the smoke run's target on a quiet machine (issue 43)
# the limits are H100 figures; a smoke run on CI's two busy cores gets slack (a Python start that imports torch
# took 6 s there under load, against an environment step's 10 s limit): the budget still bounds the whole
SMOKE_LIMIT_FACTOR, SMOKE_MIN_LIMIT_S = 3, 60
LOG_TAIL_LINES = 12  # of each step's log, printed as it ends (the device tool returns the output's end)


@dataclass(frozen=True)
class Run:
    """One run of the check: its mode, where its files go, and its deadline."""

    mode: str  # "cuda" or "smoke"
    out: Path  # items.jsonl, summary.json, env.txt (logs.tar.gz: the shell script)
    state: Path  # per step: its log, the item's result, its line (what a rerun skips)
    budget_s: float
    started: float  # time.time() when the check began

    def left_s(self) -> float:
        return self.budget_s - (time.time() - self.started)

    def item_argv(self, python: str, step: Step) -> list[str]:
        mode = ["--smoke"] if self.mode == "smoke" else []
        return [python, "-m", "gpu_check", "item", step.name, "--target", step.target, "--state", str(self.state),
                "--out", str(self.out), *mode]


def result_path(state: Path, name: str, kind: str) -> Path:
    """state/NAME.KIND.json: kind "result" (the item's own, at its end), "partial" (as it goes), "line" (kept
    for a rerun)."""
    return state / f"{name}.{kind}.json"


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def write_json(path: Path, data: dict) -> None:
    """Written whole or not at all (a rename), so that a kill never leaves half a file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def append_line(path: Path, line: dict) -> None:
    """One JSON line appended and flushed to the disk before the next step starts."""
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _die_with_parent() -> None:
    """In a child before exec: killed when the check's process dies, whatever killed it (Linux prctl)."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_limited(argv: list[str], limit_s: float, log: Path, env: dict | None = None) -> tuple[int, float]:
    """(exit code, seconds) of argv run with its output in log; killed at limit_s (exit code 124)."""
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                preexec_fn=_die_with_parent)
        try:
            rc = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            rc = 124
        except BaseException:  # the check itself is being stopped: its step goes with it
            proc.kill()
            raise
    return rc, time.perf_counter() - start


def _tail(path: Path, n: int) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return []


def step_line(step: Step, ok: bool, rc: int, seconds: float, limit_s: int, error: str | None,
              figures: dict | None = None) -> dict:
    return {"step": step.name, "item": step.item, "ok": ok, "rc": rc, "seconds": round(seconds, 1),
            "limit_s": limit_s, "estimate_s": step.estimate_s, "error": error, "figures": figures or {}}


def run_step(step: Step, run: Run, python: str) -> dict:
    """Run one step (unless an earlier run finished it) and return its line."""
    kept = read_json(result_path(run.state, step.name, "line"))
    if kept.get("ok"):
        return {**kept, "earlier_run": True}
    for kind in ("result", "partial", "line"):
        result_path(run.state, step.name, kind).unlink(missing_ok=True)
    left = run.left_s()
    timeout = max(step.timeout_s * SMOKE_LIMIT_FACTOR, SMOKE_MIN_LIMIT_S) if run.mode == "smoke" else step.timeout_s
    limit = int(min(timeout, left))
    if limit < step.min_s:
        return step_line(step, False, 124, 0.0, max(limit, 0), f"not started: {max(left, 0):.0f} s of the "
                         f"{run.budget_s:.0f} s budget left (GPU_CHECK_BUDGET_S)")
    print(f"== {step.name} (at most {limit} s, about {step.estimate_s} s on an H100)", flush=True)
    argv = step.argv(python) if step.command else run.item_argv(python, step)
    env = {**os.environ, "MAX_JOBS": str(os.cpu_count() or 1), "PYTHONUNBUFFERED": "1"}
    log = run.state / f"{step.name}.log"
    rc, seconds = run_limited(argv, limit, log, env)
    print("\n".join("   " + line for line in _tail(log, LOG_TAIL_LINES)), flush=True)
    result = read_json(result_path(run.state, step.name, "result"))
    if not result:  # killed, or died before its end: what it measured so far
        result = read_json(result_path(run.state, step.name, "partial"))
    result_path(run.state, step.name, "partial").unlink(missing_ok=True)
    if step.command:
        result = {"figures": {"output": _tail(log, 3)}}
    ok = rc == 0 and (result.get("ok", False) if not step.command else True)
    error = None if ok else result.get("error") or (
        f"timed out after {limit} s" if rc == 124 else f"exit code {rc}: " + " | ".join(_tail(log, 3)))
    line = step_line(step, ok, rc, seconds, limit, error, result.get("figures"))
    write_json(result_path(run.state, step.name, "line"), line)
    return line


def summary(run: Run, lines: list[dict], seconds: float) -> dict:
    """summary.json: every step's outcome and each item's headline figures."""
    return {"mode": run.mode, "ok": all(line["ok"] for line in lines), "seconds": round(seconds, 1),
            "budget_s": run.budget_s,
            "steps": [{k: line.get(k) for k in ("step", "item", "ok", "rc", "seconds", "limit_s", "estimate_s",
                                                 "error", "earlier_run")} for line in lines],
            "headlines": {line["step"]: line["figures"]["summary"] for line in lines
                          if "summary" in line.get("figures", {})}}


def run_all(run: Run, python: str, steps: tuple[Step, ...] = STEPS) -> int:
    """Every step of the run's mode in order, even after one failed; 0 where all passed, else 1."""
    run.out.mkdir(parents=True, exist_ok=True)
    run.state.mkdir(parents=True, exist_ok=True)
    (run.out / "items.jsonl").touch()
    lines: list[dict] = []
    for step in (s for s in steps if s.runs_in(run.mode)):
        line = run_step(step, run, python)
        append_line(run.out / "items.jsonl", line)
        lines.append(line)
        write_json(run.out / "summary.json", summary(run, lines, time.time() - run.started))
        verdict = "earlier run" if line.get("earlier_run") else "ok" if line["ok"] else f"FAILED: {line['error']}"
        print(f"== {step.name}: {verdict} ({line['seconds']} s)", flush=True)
    elapsed = time.time() - run.started
    print_table(lines)
    if run.mode == "smoke":
        print(f"gpu_check --smoke: {len(lines)} steps in {elapsed:.0f} s (goal: under {SMOKE_GOAL_S} s on a quiet "
              f"machine)")
    return 0 if all(line["ok"] for line in lines) else 1


def print_table(lines: list[dict]) -> None:
    """The run at a glance, last in the output."""
    print(f"\n{'step':22s} {'item':>4s} {'ok':>4s} {'s':>6s} {'limit':>6s} {'est.':>5s}  headline")
    for line in lines:
        output = line["figures"].get("output") or [""]  # a command's last lines
        headline = json.dumps(line["figures"].get("summary", line["error"] or output[-1]))[:140]
        print(f"{line['step']:22s} {line['item'] or '':>4} {'yes' if line['ok'] else 'NO':>4s} "
              f"{line['seconds']:6.1f} {line['limit_s']:6d} {line['estimate_s']:5d}  {headline}")

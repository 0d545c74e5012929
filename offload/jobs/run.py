"""The batch job loop: read requests, resume, generate (here, or on Ray replicas: ray.py) with per-request flush,
progress, report."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from pathlib import Path

from offload.errors import BudgetError
from offload.jobs.batch import BadLine, Request, error_record, file_digest, read_requests, success_record
from offload.jobs.config import JobConfig, load_config, sampling_defaults, validate_config
from offload.jobs.device import check_gpu_is_here, simulated_gpu_note
from offload.jobs.output import OutputLog
from offload.jobs.ray import Replicas, format_replicas, start_replicas
from offload.jobs.worker import Answer, budget_of, generate_answers, job_timeline, llm_report, load_llm
from offload.profile.report import JobCounts, build_report, format_report, write_plot, write_report, write_trace
from offload.profile.timeline import Timeline
from offload.runtime.host_memory import MemoryWatch

logger = logging.getLogger("offload")


def run_batch(config: JobConfig | dict | str | Path, *, restart: bool = False, progress: bool | None = None,
              llm=None) -> dict:
    """Run (or resume) a batch job described by a config; write outputs and report; return the report.

    The output is locked while the job runs; a restart moves the old outputs to a backup (output.backup_path)
    only once the model is loaded, so a restart that cannot start leaves them as they were."""
    config = as_config(config)
    restart = restart or config.output.overwrite
    requests, bad = read_requests(Path(config.input.path), config.input.format, sampling_defaults(config),
                                  config.input.chat)
    log = OutputLog(config.output_path, job_fingerprint(config), config.output.retry_failed)
    log.lock()
    engine = None  # what this call starts, and so stops (Ray replicas)
    try:
        done = log.check(restart)
        n_total = len(requests) + len(bad)
        todo, bad = [r for r in requests if r.key not in done], [b for b in bad if b.key not in done]
        counts = JobCounts(n_requests=n_total, n_skipped=n_total - len(todo) - len(bad))
        if not todo and not bad:
            return nothing_to_do(config, counts, log)
        if todo and llm is None:
            llm = engine = load_engine(config)  # a plan that cannot work stops here, before anything is written
        # on Ray, memory.cpu is each replica's budget, planned on its node, not this process's
        held_budget = None if config.engine != "local" else budget_of(config, llm)["cpu"]
        with MemoryWatch(held_budget, stop=config.memory.on_exceed == "stop") as watch:
            try:
                log.begin(restart)
                return _run(config, llm, todo, bad, log, counts, progress, watch)
            except KeyboardInterrupt:
                if watch.exceeded_bytes is not None and watch.stop_on_exceed:
                    raise BudgetError(f"stopped: {watch.message()}; the answers written are kept") from None
                raise
    finally:
        log.close()
        if isinstance(engine, Replicas):
            engine.close()


def _run(config: JobConfig, llm, todo: list[Request], bad: list[BadLine], log: OutputLog, counts: JobCounts,
         progress: bool | None, watch: MemoryWatch) -> dict:
    """Write the bad lines, generate the rest; the report is written however this ends."""
    timeline = job_timeline(llm) if todo else None
    try:
        for item in bad:
            _fail(log, counts, item, item.message)
        if todo:
            generate_all(llm, todo, log, counts, _progress_on(config, progress), config.report.echo)
    except KeyboardInterrupt:
        counts.interrupted = True
        raise
    finally:
        watch.sample()
        report = finish(config, counts, llm if todo else None, timeline, log, watch.peak_bytes)
    return report


def nothing_to_do(config: JobConfig, counts: JobCounts, log: OutputLog) -> dict:
    """A rerun of a finished job: keep its report (and any trace or plot), say so, change nothing."""
    skipped = ", ".join(k for k in ("trace", "plot") if getattr(config.report, k))
    logger.warning(f"nothing left to do: all {counts.n_requests} requests are answered in {config.output_path}"
                 + (f", so no {skipped} was written (nothing ran)" if skipped else "")
                 + "; rerun with --restart to run the job again")
    report = _saved_report(config.report_path) or build_report(counts, None, None, None, None, None)
    report["outputs"] = output_counts(log)
    if config.report.print:
        print(format_report(report), flush=True)
        print(f"outputs: {config.output_path}\nreport: {config.report_path}", flush=True)
    return report


def _saved_report(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def output_counts(log: OutputLog) -> dict:
    """What the output file holds now: answered requests and error lines (the exit code follows `failed`)."""
    return {"path": str(log.path), "answered": len(log.done - log.failed), "failed": len(log.failed)}


def as_config(config) -> JobConfig:
    if isinstance(config, JobConfig):
        return config
    if isinstance(config, dict):
        return validate_config(config, "run_batch config")
    return load_config(config)


def job_fingerprint(config: JobConfig) -> dict:
    """What decides the outputs; a resume under a different fingerprint is refused."""
    from offload.weights.default_model import resolve_model

    model_dir = resolve_model(config.model.path)
    config_json = model_dir / "config.json"
    gguf = {"model.gguf_bytes": model_dir.stat().st_size} if model_dir.suffix == ".gguf" and model_dir.is_file() else {}
    return {"model.path": config.model.path,
            "model.config_sha256": file_digest(config_json) if config_json.is_file() else None, **gguf,
            "model.quantization": config.model.quantization, "model.dtype": config.model.dtype,
            "input.path": config.input.path, "input.format": config.input.format, "input.chat": config.input.chat,
            **{f"sampling.{k}": v for k, v in sampling_defaults(config).items()}}


def _progress_on(config: JobConfig, progress: bool | None) -> bool:
    allowed = config.report.progress if progress is None else progress
    return bool(allowed) and sys.stderr.isatty()


def _fail(log: OutputLog, counts: JobCounts, item: BadLine | Request, message: str) -> None:
    log.append(error_record(item, message))
    counts.n_failed += 1


def load_engine(config: JobConfig):
    """What answers the job: an LLM on this machine, or replicas on a Ray cluster (engine: ray), each planned
    for its own node; a plan that cannot work raises here, before anything is written."""
    if config.engine == "ray":
        return start_replicas(config)
    check_gpu_is_here(config)
    return load_llm(config)


def generate_all(llm, todo: list[Request], log: OutputLog, counts: JobCounts, progress: bool,
                 echo: bool = False) -> None:
    """Answer every request (here in one continuous batch, or shard by shard on Ray replicas), appending each
    result as it finishes, with one progress bar."""
    from tqdm import tqdm

    bar = tqdm(total=len(todo), unit="req", disable=not progress, dynamic_ncols=True)
    model_name = Path(str(llm.path)).name
    start = Timeline.now()

    def on_answer(req: Request, answer: Answer) -> None:
        log.append(success_record(req, answer.choices, answer.n_prompt, answer.n_generated, model_name,
                                  answer.n_cached))
        counts.n_done += 1
        counts.n_prompt_tokens += answer.n_prompt
        counts.n_cached_tokens += answer.n_cached
        counts.n_generated_tokens += answer.n_generated
        counts.generate_s = Timeline.now() - start
        bar.set_postfix_str(f"{counts.n_generated_tokens / max(counts.generate_s, 1e-9):.1f} tok/s", refresh=False)
        bar.update(1)
        if echo:
            bar.write(f"{req.custom_id}: {answer.text.strip()}")

    def on_error(req: Request, message: str) -> None:
        _fail(log, counts, req, message)
        bar.update(1)

    try:
        if isinstance(llm, Replicas):
            llm.generate_answers(todo, on_answer, on_error)
        else:
            generate_answers(llm, todo, on_answer, on_error)
    finally:
        counts.generate_s = Timeline.now() - start
        bar.close()


def finish(config: JobConfig, counts: JobCounts, llm, timeline: tuple[Timeline, str] | None,
           log: OutputLog, peak_held_bytes: int | None = None) -> dict:
    """Build the report (with each Ray replica's own, on Ray); write it (JSON, trace, plot) beside the outputs
    and print it."""
    tl = timeline[0] if timeline is not None else None
    report = llm_report(config, counts, llm, timeline)
    report["memory"]["cpu"]["peak_held_bytes"] = peak_held_bytes  # anonymous + shared: see runtime/host_memory.py
    if isinstance(llm, Replicas):
        report["replicas"] = llm.reports()
    report["outputs"] = output_counts(log)
    note = simulated_gpu_note(llm)
    if note is not None:  # the GPU figures are this CPU's work; no device memory was used
        report["device"] = {"gpu": note}
        report["memory"]["gpu"].update(peak_bytes=None, peak_over_budget=None)
    _write(config.report_path, lambda path: write_report(report, path))
    if tl is not None and config.report.trace:
        _write(Path(config.report.trace), lambda path: write_trace(tl, path))
    if tl is not None and config.report.plot:
        _write(Path(config.report.plot), lambda path: write_plot(tl, report, path))
    if config.report.print:
        print(format_report(report), flush=True)
        if note is not None:
            print(f"{'device':>7}: {note}", flush=True)
        if report.get("replicas"):
            print(format_replicas(report["replicas"]), flush=True)
        print(f"outputs: {config.output_path}\nreport: {config.report_path}", flush=True)
    return report


def _write(path: Path, write) -> None:
    """Write one report file, making its folder, atomically: into a temporary file beside it, then renamed over it,
    so that a full disk leaves the earlier file whole rather than empty; a failure is logged, not raised (the
    outputs are safe)."""
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")  # the suffix tells matplotlib the format
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        kept = f"; the earlier {path.name} is left as it was" if path.exists() else ""
        logger.error(f"could not write {path} ({e.strerror or e}){kept}; the outputs in this run are kept")

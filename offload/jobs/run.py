"""The batch job loop: read requests, resume, generate with per-request flush, progress, report."""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

from offload.jobs.batch import CHAT, BadLine, Request, error_record, file_digest, read_requests, success_record
from offload.runtime.host_memory import MemoryWatch, peak_rss_bytes
from offload.jobs.output import OutputLog
from offload.jobs.config import JobConfig, load_config, plan_request, validate_config
from offload.errors import BudgetError, OffloadError
from offload.planner.recost import recost_steps
from offload.planner.whatif import what_ifs
from offload.profile.report import JobCounts, build_report, format_report, write_plot, write_report, write_trace
from offload.profile.timeline import Timeline

logger = logging.getLogger("offload")


@dataclass
class Prepared:
    """A request turned into prompt token ids, ready for the generator."""

    request: Request
    prompt: dict = field(default_factory=dict)  # {"prompt_token_ids": [...], "prompt": text or None}


def run_batch(config: JobConfig | dict | str | Path, *, restart: bool = False, progress: bool | None = None,
              llm=None) -> dict:
    """Run (or resume) a batch job described by a config; write outputs and report; return the report.

    The output is locked while the job runs; a restart moves the old outputs to .bak only once the model is
    loaded, so a restart that cannot start leaves them as they were."""
    config = as_config(config)
    restart = restart or config.output.overwrite
    requests, bad = read_requests(Path(config.input.path), config.input.format, sampling_defaults(config),
                                  config.input.chat)
    log = OutputLog(config.output_path, job_fingerprint(config), config.output.retry_failed)
    log.lock()
    try:
        done = log.check(restart)
        n_total = len(requests) + len(bad)
        todo, bad = [r for r in requests if r.key not in done], [b for b in bad if b.key not in done]
        counts = JobCounts(n_requests=n_total, n_skipped=n_total - len(todo) - len(bad))
        if not todo and not bad:
            return nothing_to_do(config, counts, log)
        if todo and llm is None:
            llm = load_llm(config)  # a plan that cannot work stops here, before anything is written
        with MemoryWatch(config.memory.cpu, stop=config.memory.on_exceed == "stop") as watch:
            try:
                log.begin(restart)
                return _run(config, llm, todo, bad, log, counts, progress, watch)
            except KeyboardInterrupt:
                if watch.exceeded_bytes is not None and watch.stop_on_exceed:
                    raise BudgetError(f"stopped: {watch.message()}; the answers written are kept") from None
                raise
    finally:
        log.close()


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


def sampling_defaults(config: JobConfig) -> dict:
    return config.sampling.model_dump()


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


def load_llm(config: JobConfig):
    """The LLM for a config: model, budgets, hardware; the planner picks the batch size unless it is set."""
    from offload.api import LLM

    return LLM.from_request(plan_request(config))


def _progress_on(config: JobConfig, progress: bool | None) -> bool:
    allowed = config.report.progress if progress is None else progress
    return bool(allowed) and sys.stderr.isatty()


def _fail(log: OutputLog, counts: JobCounts, item: BadLine | Request, message: str) -> None:
    log.append(error_record(item, message))
    counts.n_failed += 1


def prepare(llm, req: Request) -> Prepared:
    """Token ids of a request's prompt, checked against the model; OffloadError says what is wrong."""
    if req.url == CHAT:
        ids, text = llm.apply_chat_template(req.messages), None
    elif isinstance(req.prompt, str):
        if llm.tokenizer is None:
            raise OffloadError(f"the model in {llm.path} has no tokenizer; send 'prompt' as a list of token ids")
        ids, text = list(llm.tokenizer.encode(req.prompt)), req.prompt
    else:
        ids, text = list(req.prompt), None
    llm.generator.check_prompt(ids)  # the one check, against the context this run's cache holds
    return Prepared(req, {"prompt_token_ids": ids, "prompt": text})


def generate_all(llm, todo: list[Request], log: OutputLog, counts: JobCounts, progress: bool,
                 echo: bool = False) -> None:
    """Generate every request in one continuous batch, appending each result as it finishes."""
    ready = []
    for req in todo:
        try:
            ready.append(prepare(llm, req))
        except OffloadError as e:
            _fail(log, counts, req, f"line {req.line_no} (custom_id {req.custom_id!r}): {e}")
    if not ready:
        return
    from tqdm import tqdm

    bar = tqdm(total=len(ready), unit="req", disable=not progress, dynamic_ncols=True)
    model_name = Path(str(llm.path)).name
    start = Timeline.now()

    def on_finish(out) -> None:
        item = ready[int(out.request_id)]
        n_prompt, n_generated = len(out.prompt_token_ids), len(out.token_ids)
        log.append(success_record(item.request, out.text, out.finish_reason, n_prompt, n_generated, model_name))
        counts.n_done += 1
        counts.n_prompt_tokens += n_prompt
        counts.n_generated_tokens += n_generated
        counts.generate_s = Timeline.now() - start
        bar.set_postfix_str(f"{counts.n_generated_tokens / max(counts.generate_s, 1e-9):.1f} tok/s", refresh=False)
        bar.update(1)
        if echo:
            bar.write(f"{item.request.custom_id}: {out.text.strip()}")

    try:
        llm.generate([p.prompt for p in ready], [p.request.params for p in ready], on_finish=on_finish)
    finally:
        counts.generate_s = Timeline.now() - start
        bar.close()


def job_timeline(llm) -> tuple[Timeline, str] | None:
    """The runtime's timeline, cleared so that the report covers this job only."""
    timeline = getattr(llm, "timeline", None)
    if timeline is None:
        return None
    timeline.clear()
    return timeline, "executor"


def finish(config: JobConfig, counts: JobCounts, llm, timeline: tuple[Timeline, str] | None,
           log: OutputLog, peak_held_bytes: int | None = None) -> dict:
    """Build the report; write it (JSON, trace, plot) beside the outputs and print it."""
    tl, source = timeline if timeline is not None else (None, None)
    plan = getattr(llm, "plan", None)
    report = build_report(counts, tl, plan, peak_memory(llm), budget_of(config, llm), source, job_what_ifs(llm),
                          job_predicted_s(llm, tl))
    report["memory"]["cpu"]["peak_held_bytes"] = peak_held_bytes  # anonymous + shared: see runtime/host_memory.py
    report["outputs"] = output_counts(log)
    _write(config.report_path, lambda path: write_report(report, path))
    if tl is not None and config.report.trace:
        _write(Path(config.report.trace), lambda path: write_trace(tl, path))
    if tl is not None and config.report.plot:
        _write(Path(config.report.plot), lambda path: write_plot(tl, report, path))
    if config.report.print:
        print(format_report(report), flush=True)
        print(f"outputs: {config.output_path}\nreport: {config.report_path}", flush=True)
    return report


def job_predicted_s(llm, timeline) -> dict[str, float] | None:
    """The plan re-costed for the steps this run took, seconds per phase (None without a plan or steps)."""
    plan, request, spec = (getattr(llm, name, None) for name in ("plan", "request", "spec"))
    if plan is None or request is None or spec is None or timeline is None or not timeline.steps:
        return None
    try:
        return recost_steps(spec, request.profile(), plan, timeline.steps)
    except OffloadError as e:  # e.g. the hardware file changed during the job
        logger.warning(f"the prediction for the steps run is left out of the report: {e}")
        return None


def job_what_ifs(llm) -> list[dict] | None:
    """The planner's what-ifs for the job llm planned (None without a plan: a placement given by hand)."""
    plan, request, spec = (getattr(llm, name, None) for name in ("plan", "request", "spec"))
    if plan is None or request is None or spec is None:
        return None
    try:
        return [w.to_dict() for w in what_ifs(spec, request.profile(), request, plan)]
    except OffloadError as e:  # e.g. the hardware file changed during the job; the report is written without them
        logger.warning(f"what-ifs left out of the report: {e}")
        return None


def _write(path: Path, write) -> None:
    """Write one report file, making its folder; a failure is logged, not raised (the outputs are safe)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(path)
    except OSError as e:
        logger.error(f"could not write {path} ({e.strerror or e}); the outputs in this run are kept")


def peak_memory(llm) -> dict:
    """Peak bytes per tier: RAM as the OS counts it; device memory as the runtime's backend reports it."""
    peaks = {"cpu": peak_rss_bytes()}
    backend = getattr(llm, "backend", None)
    if backend is not None and callable(getattr(backend, "peak_device_bytes", None)):
        peaks["gpu"] = int(backend.peak_device_bytes())
    return peaks


def budget_of(config: JobConfig, llm) -> dict:
    """Budget bytes per tier: the config's where set, else the plan's (with the process's baseline, for RAM)."""
    budget = getattr(getattr(llm, "plan", None), "budget", None)
    cpu = config.memory.cpu
    if cpu is None and budget is not None:
        cpu = budget.cpu_bytes + (getattr(getattr(llm, "request", None), "host_baseline", None) or 0)
    return {"gpu": config.memory.gpu if config.memory.gpu is not None else getattr(budget, "gpu_bytes", None),
            "cpu": cpu}

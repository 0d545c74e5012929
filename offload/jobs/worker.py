"""One LLM's share of a job: load it, turn requests into prompts, answer them as each finishes, report its work.

The job loop (run.py) runs one worker in its own process; on Ray (ray.py) each replica is one, on its own node."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from offload.errors import OffloadError
from offload.jobs import responses
from offload.jobs.batch import CHAT, Request
from offload.jobs.config import JobConfig, plan_request
from offload.options import DEFAULT_REASONING_PARSER
from offload.planner.recost import recost_steps, recost_steps_at
from offload.planner.speculation import against_measured, prior_acceptance
from offload.planner.whatif import what_ifs
from offload.profile.report import JobCounts, build_report
from offload.profile.timeline import Timeline
from offload.reasoning import AnswerSplit, answer_split
from offload.runtime.host_memory import peak_rss_bytes
from offload.runtime.speedprobe import MachineSpeed, machine_speed, speed_at
from offload.spec import ModelSpec
from offload.weights.prompts import check_prompt_ids, encode_chat, encode_text

logger = logging.getLogger("offload")


@dataclass
class Prepared:
    """A request turned into prompt token ids, ready for the generator."""

    request: Request
    prompt: dict = field(default_factory=dict)  # {"prompt_token_ids": [...], "prompt": text or None}
    split: AnswerSplit | None = None  # how a chat answer splits into reasoning and content; None: not split

    @property
    def params(self):
        """The request's SamplingParams as its answer's split needs them (a harmony answer keeps special tokens)."""
        return self.request.params if self.split is None else self.split.sampling(self.request.params)


@dataclass(frozen=True)
class Answer:
    """What a finished request hands to the writer of the outputs (small: it crosses the network on Ray): its
    choices in OpenAI's shape (one per sample, logprobs where asked) and its token counts."""

    choices: list[dict]
    n_prompt: int
    n_generated: int
    n_cached: int = 0  # of the prompt tokens, those the prefix cache gave

    @property
    def text(self) -> str:
        """The first choice's text."""
        first = self.choices[0]
        return (first["message"]["content"] or "") if "message" in first else first["text"]


OnAnswer = Callable[[Request, Answer], None]
OnError = Callable[[Request, str], None]


def load_llm(config: JobConfig):
    """The LLM for a config: model, budgets, hardware; the planner picks the batch size unless it is set."""
    from offload.api import LLM

    return LLM.from_request(plan_request(config), speculative_config=config.speculative,
                            prefix_cache=config.prefix_cache)


def prompt_ids(req: Request, tokenizer, path: Path, context_len: int | None = None) -> tuple[list[int], str | None]:
    """A request's prompt as token ids (and its text, for a text prompt), by the model's tokenizer and chat
    template; OffloadError says what is wrong (text far past context_len tokens, before it is tokenized)."""
    if req.url == CHAT:
        return encode_chat(tokenizer, path, req.messages, template_kwargs=req.chat_template_kwargs,
                           context_len=context_len, tools=req.tools), None
    if isinstance(req.prompt, str):
        return encode_text(tokenizer, path, req.prompt, context_len), req.prompt
    return list(req.prompt), None


def chat_split(req: Request, llm, ids: list[int], parser: str = DEFAULT_REASONING_PARSER) -> AnswerSplit | None:
    """How llm's answer to a chat request (prompt ids) splits into reasoning_content and content by parser
    (serve.reasoning_parser's value; auto: the model family's, else <think> where the template mentions it); None for
    an answer not split."""
    if req.url != CHAT:
        return None
    return answer_split(llm.tokenizer, ids, parser, llm.spec.family.reasoning_parser)


def prepare(llm, req: Request) -> Prepared:
    """Token ids of a request's prompt, checked against the model; OffloadError says what is wrong."""
    ids, text = prompt_ids(req, llm.tokenizer, llm.path, llm.generator.context_len)
    llm.generator.check_prompt(ids, req.params)  # the one check, against the context this run's cache holds
    return Prepared(req, {"prompt_token_ids": ids, "prompt": text}, chat_split(req, llm, ids))


def check_prompts(requests: list[Request], tokenizer, path: Path, spec: ModelSpec,
                  context_len: int) -> list[tuple[int, str]]:
    """What prepare would refuse, request by request, without the weights (`offload validate`): the line and
    the message of each error line a run would write."""
    problems = []
    for req in requests:
        try:
            check_prompt_ids(prompt_ids(req, tokenizer, path, context_len)[0], context_len, spec, req.params)
        except OffloadError as e:
            problems.append((req.line_no, request_problem(req, e)))
    return problems


def request_problem(req: Request, e: Exception) -> str:
    return f"line {req.line_no} (custom_id {req.custom_id!r}): {e}"


def generate_answers(llm, requests: list[Request], on_answer: OnAnswer, on_error: OnError) -> None:
    """Generate every request in one continuous batch, handing each answer on as it finishes; a request that
    cannot run (too long, no tokenizer) goes to on_error with a message naming it."""
    ready = []
    for req in requests:
        try:
            ready.append(prepare(llm, req))
        except OffloadError as e:
            on_error(req, request_problem(req, e))
    if not ready:
        return

    def on_finish(out) -> None:
        prepared = ready[int(out.request_id)]
        req, counts = prepared.request, responses.usage_of([out])
        answer = Answer(responses.choices(req.url, out, llm.tokenizer, echo=req.echo, split=prepared.split,
                                          tools=req.tools),
                        counts["prompt_tokens"], counts["completion_tokens"],
                        counts["prompt_tokens_details"]["cached_tokens"])
        on_answer(req, answer)

    llm.generate([p.prompt for p in ready], [p.params for p in ready], on_finish=on_finish)


def job_timeline(llm) -> tuple[Timeline, str] | None:
    """The runtime's timeline, cleared so that the report covers this job only; the CPU's speed is probed as the
    job starts (see job_speed)."""
    timeline = getattr(llm, "timeline", None)
    if timeline is None:
        return None
    timeline.clear()
    llm.speed_probes.clear()
    _probe_cpu_speed(llm)
    return timeline, "executor"


def llm_report(config: JobConfig, counts: JobCounts, llm, timeline: tuple[Timeline, str] | None) -> dict:
    """The report of what llm did for the job: counts, where the time went, memory against budget, what-ifs."""
    tl, source = timeline if timeline is not None else (None, None)
    peaks = peak_memory(llm)  # the job's, before the closing speed probe
    speed = job_speed(llm, tl)
    speed_report, speeds = None, None
    if speed is not None:  # with the prediction at the calibrated speed beside the scaled one, seconds per phase
        summary, speeds = speed
        speed_report = {**summary.to_dict(), "predicted_s_at_calibration": job_predicted_s(llm, tl)}
    report = build_report(counts, tl, getattr(llm, "plan", None), peaks, budget_of(config, llm), source,
                          job_what_ifs(llm, tl), job_predicted_s(llm, tl, speeds), speed_report)
    speculative = job_speculation(llm, counts, speed[0] if speed is not None else None)
    return report if speculative is None else {**report, "speculative": speculative}


def job_speculation(llm, counts: JobCounts, speed: MachineSpeed | None = None) -> dict | None:
    """What speculative decoding did in the job, with its draft's share of the time and its batch-1 price against
    the decode speed measured (planner.speculation.against_measured; on the profile moved to the CPU's speed
    during the job where it was probed); where the draft was dropped at load as not paying, why (None: no
    speculation was asked for)."""
    stats, price = getattr(llm, "speculative_stats", None), getattr(llm, "draft_price", None)
    if stats is None:
        return None if price is None else {"dropped": True, "reason": price.verdict(kept=False),
                                           "predicted_tokens_per_s": price.tokens_per_s,
                                           "plain_tokens_per_s": price.plain_tokens_per_s}
    draft_share = stats["draft_s"] / counts.generate_s if counts.generate_s > 0 else None
    out = {**stats, "draft_share": draft_share}
    if price is not None and not price.pays:  # the user's k kept it
        out["kept_though_slower"] = price.verdict(kept=True)
    if getattr(llm, "plan", None) is None:  # a placement given by hand: nothing priced it
        return out
    try:
        hw = llm.request.profile()
        if speed is not None:
            hw = hw.at_speed(speed.memory, speed.compute, speed.attention)
        return {**out, **against_measured(llm.spec, hw, llm.whole_request, llm.speculative, stats,
                                          prior_acceptance(llm.speculative), job_draft_spec(llm))}
    except OffloadError as e:  # e.g. the hardware file changed during the job
        logger.warning(f"speculation's predicted speed is left out of the report: {e}")
        return out


def job_draft_spec(llm):
    """The spec of llm's draft model (draft_model, or a substitute's copies from a file of their own), None for the
    other methods (self and substitute draft with the model's weights)."""
    if llm.speculative.method != "draft_model" and not llm.speculative.model:
        return None
    return llm.generator.speculator.drafter.draft.spec


def job_speed(llm, timeline) -> tuple[MachineSpeed, list[tuple]] | None:
    """The CPU's speed over the job against calibration's, from the probes taken as it started, between its steps
    and one now, after its generation: their summary, and the (memory, compute, attention) speed of each step, from
    the probes around it (speedprobe.speed_at; None where it was not probed: no CPU layers, no reference in the
    profile, or nothing ran)."""
    probes = getattr(llm, "speed_probes", None)
    if not probes or timeline is None or not timeline.steps:
        return None
    _probe_cpu_speed(llm)
    try:
        reference = llm.request.profile().cpu_probe.get(probes[0].fmt)
    except OffloadError as e:  # e.g. the hardware file changed during the job
        logger.warning(f"the CPU's speed during the job is left out of the report: {e}")
        return None
    if not reference:
        return None
    probes = sorted(probes, key=lambda p: p.at_s)
    return machine_speed(probes, reference), [speed_at(probes, reference, s.mid_s) for s in timeline.steps]


def _probe_cpu_speed(llm) -> None:
    try:
        llm.probe_cpu_speed()
    except OffloadError as e:  # e.g. the hardware file changed; the report then goes without the speed
        logger.warning(f"the CPU's speed was not probed: {e}")


def job_predicted_s(llm, timeline, speeds: list[tuple] | None = None) -> dict[str, float] | None:
    """The plan re-costed for the steps this run took, seconds per phase (None without a plan or steps), each step
    on the profile moved to the CPU's speed while it ran where speeds gives it (job_speed)."""
    plan, request, spec = (getattr(llm, name, None) for name in ("plan", "request", "spec"))
    if plan is None or request is None or spec is None or timeline is None or not timeline.steps:
        return None
    try:
        hw = request.profile()
        if speeds is None:
            return recost_steps(spec, hw, plan, timeline.steps)
        return recost_steps_at(spec, hw, plan, timeline.steps, speeds)
    except OffloadError as e:  # e.g. the hardware file changed during the job
        logger.warning(f"the prediction for the steps run is left out of the report: {e}")
        return None


def job_what_ifs(llm, timeline=None) -> list[dict] | None:
    """The planner's what-ifs for the job llm planned, priced for the steps it ran where the timeline has them
    (None without a plan: a placement given by hand)."""
    plan, request, spec = (getattr(llm, name, None) for name in ("plan", "request", "spec"))
    if plan is None or request is None or spec is None:
        return None
    steps = timeline.steps if timeline is not None else None
    try:
        return [w.to_dict() for w in what_ifs(spec, request.profile(), request, plan, steps)]
    except OffloadError as e:  # e.g. the hardware file changed during the job; the report is written without them
        logger.warning(f"what-ifs left out of the report: {e}")
        return None


def peak_memory(llm) -> dict:
    """Peak bytes per tier: RAM as the OS counts it; device memory as the runtime's backend reports it."""
    peaks = {"cpu": peak_rss_bytes()}
    backend = getattr(llm, "backend", None)
    if backend is not None and callable(getattr(backend, "memory_peaks", None)):
        peaks.update({tier: int(n) for tier, n in backend.memory_peaks().items()})
    return peaks


def budget_of(config: JobConfig, llm) -> dict:
    """Budget bytes per tier as the plan holds them (the CPU budget: the whole process, as memory.cpu means it);
    the config's where there is no plan (a placement given by hand)."""
    budget = getattr(getattr(llm, "plan", None), "budget", None)
    if budget is None:
        return {"gpu": config.memory.gpu, "cpu": config.memory.cpu}
    draft = getattr(llm, "draft_bytes", {})  # a speculative draft's share, planned first: the process holds both
    return {"gpu": budget.gpu_bytes + draft.get("gpu", 0), "cpu": budget.process_cpu_bytes + draft.get("cpu", 0)}
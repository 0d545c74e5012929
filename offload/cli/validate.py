"""`offload validate`: check a job config and its input file without running anything."""

from __future__ import annotations

import logging
from pathlib import Path

from offload.cli.job_flags import add_job_flags, effective_config
from offload.errors import ConfigError

log = logging.getLogger("offload")


def add_parser(sub) -> None:
    p = sub.add_parser("validate", help="check a job config and its input file without running it")
    add_job_flags(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from offload.jobs.batch import read_requests
    from offload.jobs.config import sampling_defaults

    config = effective_config(args)
    requests, bad = read_requests(Path(config.input.path), config.input.format, sampling_defaults(config),
                                  config.input.chat)
    name = args.config or "the command line"
    spec, context_len = check_plan(config)
    warn_max_tokens_beyond_context(config, requests, spec, context_len)
    problems = sorted([(b.line_no, b.message) for b in bad] + check_prompts(config, requests, spec, context_len))
    if problems:
        lines = "\n".join(f"  - {message}" for _, message in problems)
        raise ConfigError(f"{config.input.path} has {len(problems)} bad line(s) that would become error lines in "
                          f"the output; fix them:\n{lines}")
    print(f"{name}: ok; {len(requests)} requests from {config.input.path}; outputs to {config.output_path}")
    return 0


def check_plan(config):
    """Plan the job (arithmetic over config.json and the hardware profile, no weights): budgets that cannot
    work, such as a GPU budget without a GPU or one too small for the model, are refused here. Returns the
    model's spec and the context (tokens per sequence) the run's KV cache will hold."""
    from offload.jobs.config import plan_request
    from offload.planner import plan_for
    from offload.weights.model_files import model_spec
    from offload.weights.default_model import resolve_model

    request = plan_request(config)
    spec, hw = model_spec(resolve_model(request.model.path)), request.profile()
    if config.engine == "local":  # on Ray each replica plans for the node it lands on, when the job starts
        plan_for(spec, hw, request)
    return spec, request.workload(spec, hw).seq_len


def warn_max_tokens_beyond_context(config, requests, spec, context_len: int) -> None:
    """One warning line where sampling.max_tokens, or a request body's max_tokens (after sampling.max_tokens_cap),
    asks for more tokens than the context holds: such a request ends where the context is full."""
    default = min(config.sampling.max_tokens, config.sampling.max_tokens_cap or config.sampling.max_tokens)
    over = [r for r in requests if r.params.max_tokens >= context_len and r.params.max_tokens != default]
    parts = [f"sampling.max_tokens (--max-tokens) is {default}"] if default >= context_len else []
    if over:
        named = ", ".join(f"custom_id {r.custom_id!r} asks {r.params.max_tokens}" for r in over[:3])
        parts.append(f"{len(over)} request(s) set more in their body ({named}{', ...' if len(over) > 3 else ''})")
    if parts:
        log.warning(f"max_tokens beyond the context of {context_len} tokens (model.max_model_len): "
                    f"{'; '.join(parts)}; such a request stops when its prompt and answer fill the context "
                    f"(finish_reason 'length'): lower max_tokens, cap it with sampling.max_tokens_cap "
                    f"(--max-tokens-cap), or raise model.max_model_len (this model's context is at most "
                    f"{spec.max_position_embeddings})")


def check_prompts(config, requests, spec, context_len: int) -> list[tuple[int, str]]:
    """(line, message) of each request that run would turn into an error line: its prompt tokenized as run
    tokenizes it (the tokenizer is loaded only where a prompt is text or a conversation), counted against the
    context."""
    from offload.jobs.batch import CHAT
    from offload.jobs.worker import check_prompts as problems_of
    from offload.weights.default_model import resolve_model
    from offload.weights.model_files import load_tokenizer

    path = resolve_model(config.model.path)
    needs_tokenizer = any(r.url == CHAT or isinstance(r.prompt, str) for r in requests)
    tokenizer = load_tokenizer(path) if needs_tokenizer else None
    return problems_of(requests, tokenizer, path, spec, context_len)

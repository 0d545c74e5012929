"""The speculative section of a job priced at batch 1, as `offload plan` and `offload simulate` print it: the k the
planner would choose, tokens a pass, predicted tok/s with and without, and the draft's room."""

from __future__ import annotations

import dataclasses


def add_acceptance_flag(p) -> None:
    p.add_argument("--speculative-acceptance", type=float, metavar="RATE",
                   help="price speculative decoding (the config's speculative section, e.g. --set "
                        "speculative.method=substitute, or draft_model with --set speculative.model=llama-3.2-1b) "
                        "at batch 1 with this acceptance rate (default with a speculative method: 0.7; a copy of "
                        "the model's own weights: its format's, 0.7 for q4_0 and 0.95 for q8_0)")


def speculation_price(request, options, acceptance: float | None):
    """The priced speculation of the config's speculative section at batch 1, or None where none is asked for."""
    from offload.errors import ConfigError

    if acceptance is None and options.method is None:
        return None
    if options.method is None:
        raise ConfigError("--speculative-acceptance needs a speculative method: add --set speculative.method=ngram, "
                          "self, substitute, or draft_model (with --set speculative.model=PATH)")
    if acceptance is not None and not 0.0 <= acceptance < 1.0:
        raise ConfigError(f"--speculative-acceptance must be a rate from 0 to below 1, found {acceptance}")
    from offload.planner.speculation import price_speculation
    from offload.weights.default_model import resolve_model
    from offload.weights.model_files import model_spec

    spec = model_spec(resolve_model(request.model.path))
    draft = model_spec(resolve_model(options.model)) if options.model else None
    return price_speculation(spec, request.profile(), request, options, acceptance, draft,
                             options.max_speculative_tokens)


def speculation_json(speculation) -> dict:
    """The priced speculation as the JSON key `speculative` of plan and simulate."""
    return {**dataclasses.asdict(speculation), "speedup": speculation.speedup}

"""SamplingParams (vLLM's field names) and the sampler: penalties and logit bias, a structured output's mask
(offload/grammar.py), greedy, temperature, top-k, top-p, min-p, seed."""

from __future__ import annotations

import math

from dataclasses import dataclass, field, make_dataclass

from typing import TYPE_CHECKING

from offload.errors import SamplingError, WeightsError
from offload.option_values import bare_type, value_problem
from offload.options import MAX_LOGPROBS, MAX_N, RequestOptions, SamplingOptions  # noqa: F401 (MAX_*: re-exported)
from offload.structured import structured_params

if TYPE_CHECKING:  # torch is imported where a sampler runs, not where parameters are checked (offload validate)
    import torch

GREEDY_EPS = 1e-5  # temperatures below this mean greedy, as in vLLM
JOB_ONLY = ("max_tokens_cap",)  # the job's cap on request bodies: no request's field
# SamplingParams' fields: the job's sampling section's and RequestOptions' (offload/options.py), in that order
FIELDS = {name: info for name, info in (SamplingOptions.model_fields | RequestOptions.model_fields).items()
          if name not in JOB_ONLY}
VLLM_DEFAULTS = {"temperature": 1.0}  # vLLM's and OpenAI's; a job's sampling section is greedy unless it says so


def _field(name: str):
    info = FIELDS[name]
    if name in VLLM_DEFAULTS:
        return field(default=VLLM_DEFAULTS[name])
    if info.default_factory is not None:
        return field(default_factory=info.default_factory)
    return field(default=info.default)


_SamplingFields = make_dataclass("_SamplingFields", [(n, bare_type(FIELDS[n].annotation), _field(n)) for n in FIELDS],
                                 kw_only=True)
_SamplingFields.__module__ = __name__  # pickle and repr find it here (make_dataclass takes no module before 3.12)


@dataclass(kw_only=True)  # no fields of its own: the decorator makes __init__ call __post_init__
class SamplingParams(_SamplingFields):
    """How to sample one request, by keyword: vLLM's names and defaults (temperature 1.0, max_tokens 16); the fields,
    their types and bounds are offload/options.py's SamplingOptions' (the job's `sampling` section, but its cap) and
    RequestOptions'. stop may be one string; logit_bias keys may be strings of digits (as JSON gives them);
    structured_outputs may be a dict of StructuredOutputsParams' keywords."""

    def __post_init__(self):
        for name, kinds, what in (("stop", (str, list, tuple), "strings (or one string)"),
                                  ("stop_token_ids", (list, tuple), "token ids")):
            value = getattr(self, name)
            if value is not None and not isinstance(value, kinds):
                raise SamplingError(f"invalid sampling parameter: {name}: expected a list of {what}, found {value!r}",
                                    name)
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise SamplingError(f"invalid sampling parameter: logit_bias: expected a mapping of token ids to biases, "
                                f"found {self.logit_bias!r}", "logit_bias")
        self.logit_bias = {_token_id(k): v for k, v in (self.logit_bias or {}).items()}
        self.structured_outputs = structured_params(self.structured_outputs)
        self.validate()

    def validate(self) -> None:
        """Raise SamplingError naming the first parameter outside its option's type or bounds."""
        for name, info in FIELDS.items():
            problem = value_problem(name, info, getattr(self, name))
            if problem is not None:
                raise SamplingError(f"invalid sampling parameter: {problem}", name)

    def check_vocab(self, vocab_size: int) -> None:
        """SamplingError naming the field where stop_token_ids or logit_bias name a token past the vocabulary (as
        prompt token ids past it are refused: such an id would be silently ignored)."""
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", list(self.logit_bias))):
            outside = [t for t in ids if t >= vocab_size]
            if outside:
                raise SamplingError(f"invalid sampling parameter: {name} token ids must lie in [0, {vocab_size}), "
                                    f"found {outside[0]}; use ids of the model's own tokenizer", name)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def penalized(self) -> bool:
        """Whether the logits change with the tokens seen (penalties) or by a bias before sampling."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias)

    def make_generator(self, index: int = 0) -> torch.Generator:
        """A per-sample random generator: seeded if seed is set (sample `index` of n from seed + index, so the
        samples of one prompt differ and repeat), else seeded from the global RNG."""
        import torch

        g = torch.Generator()
        if self.seed is None:
            seed = int(torch.randint(0, 2**62, (1,)))
        else:
            seed = self.seed if index == 0 else (self.seed + index) % 2**64
        g.manual_seed(seed)
        return g


def _token_id(key):
    """logit_bias keys: token ids, as JSON gives them (strings of digits) or as ints; anything else is kept to be
    refused by validate."""
    return int(key) if isinstance(key, str) and key.strip().isdigit() else key


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids, output_ids) -> torch.Tensor:
    """One row of logits [V] with vLLM's penalties: repetition over the prompt's and output's tokens, frequency
    and presence over the output's; then logit_bias added (ids past the vocabulary ignored)."""
    import torch

    logits = logits.float().clone()
    vocab = logits.shape[-1]
    if params.repetition_penalty != 1:
        seen = torch.tensor(sorted({t for t in (*prompt_ids, *output_ids) if 0 <= t < vocab}), dtype=torch.long)
        if len(seen):
            row = logits[seen]
            logits[seen] = torch.where(row > 0, row / params.repetition_penalty, row * params.repetition_penalty)
    if (params.frequency_penalty or params.presence_penalty) and output_ids:
        counts = torch.bincount(torch.tensor([t for t in output_ids if 0 <= t < vocab], dtype=torch.long),
                                minlength=vocab).float()
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    for token, bias in params.logit_bias.items():
        if token < vocab:
            logits[token] += bias
    return logits


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p on one row of logits [V]; removed tokens get -inf."""
    import torch

    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        remove_sorted = (cumulative - sorted_logits.softmax(-1)) >= params.top_p  # keeps the token crossing top_p
        remove = torch.zeros_like(remove_sorted).scatter(0, order, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    if params.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator, prompt_ids=(),
           output_ids=(), allowed: torch.Tensor | None = None) -> int:
    """Pick the next token id from fp32 logits [V] (penalised for the request's prompt_ids and output_ids so far
    where its params ask; among the allowed ones [V] bool, a structured output's mask, where given); WeightsError if
    they are not finite (NaN or inf)."""
    import torch

    if not all_finite(logits):
        raise WeightsError("the model produced NaN or infinite logits, so no token can be chosen; its weights "
                           "likely hold NaN or inf values (or the compute dtype overflows): check the checkpoint, "
                           "or try model.dtype fp32")
    if params.greedy:
        if params.penalized:
            logits = apply_penalties(logits, params, prompt_ids, output_ids)
        best = first_argmax(logits)
        if allowed is None or bool(allowed[best]):  # the first largest is allowed: it is the masked row's argmax too
            return best
        return first_argmax(mask_logits(logits, allowed))
    return int(torch.multinomial(probabilities(logits, params, prompt_ids, output_ids, allowed), 1,
                                 generator=generator))


def all_finite(logits: torch.Tensor) -> bool:
    """Whether no logit is NaN or infinite: their sum is finite (a NaN or an inf makes it NaN or inf), else the
    whole check, where finite logits could have overflowed it. The sum took 12 us for 151,936 logits on 2 threads,
    torch.isfinite(...).all() 230 us, a step of a 20 ms decode. A CPU fp32 row is summed by numpy: just after the
    lm_head, torch's dispatch runs cold (a decode step's greedy pick took 150 us, 110 with numpy)."""
    import numpy as np
    import torch

    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        values = logits.detach().numpy()
        with np.errstate(over="ignore", invalid="ignore"):  # an overflowed sum is checked again, value by value
            return math.isfinite(float(values.sum())) or bool(np.isfinite(values).all())
    return math.isfinite(float(logits.sum())) or bool(torch.isfinite(logits).all())


def first_argmax(logits: torch.Tensor) -> int:
    """The index of the first largest logit of [V]: numpy's argmax on a CPU fp32 row (13 us for 151,936 logits, where
    torch.argmax took 168), else torch's. Both take the first of equal maxima."""
    import torch

    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 1:
        return int(logits.detach().numpy().argmax())
    return int(torch.argmax(logits))


def runner_up(logits: torch.Tensor, token: int) -> tuple[int, float, float]:
    """(the likeliest token but token, token's probability, that one's) under softmax(logits): a draft's second
    candidate where it proposed token."""
    import torch

    probs = torch.softmax(logits.float(), dim=-1)
    top = torch.topk(probs, 2)
    values, ids = top.values.tolist(), top.indices.tolist()
    other = 1 if ids[0] == token else 0
    return ids[other], float(probs[token]), values[other]


def probabilities(logits: torch.Tensor, params: SamplingParams, prompt_ids=(), output_ids=(),
                  allowed: torch.Tensor | None = None) -> torch.Tensor:
    """The distribution a sampled (not greedy) request draws its next token from, fp32 [V]: penalties and bias,
    the structured output's mask (allowed [V] bool, where given), temperature, top-k, top-p and min-p over one row
    of logits, then softmax."""
    if params.penalized:
        logits = apply_penalties(logits, params, prompt_ids, output_ids)
    if allowed is not None:
        logits = mask_logits(logits, allowed)
    return filter_logits(logits.float(), params).softmax(-1)


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """logits [V] with the tokens not allowed ([V] bool) at -inf (torch.where: twice masked_fill's speed here)."""
    import torch

    return torch.where(allowed, logits, float("-inf"))


@dataclass
class TokenLogprob:
    """A token's log-probability under the model's own distribution (raw logits: before penalties, bias and
    temperature, as vLLM returns them), and the top ones at its position, most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(logits: torch.Tensor, token_ids, n_top: int) -> list[TokenLogprob]:
    """The TokenLogprob of token_ids[i] under logits[i] ([rows, V]) with n_top top tokens each."""
    import torch

    logp = torch.log_softmax(logits.float(), dim=-1)
    picked = logp.gather(1, torch.tensor(token_ids, dtype=torch.long)[:, None])[:, 0].tolist()
    if n_top > 0:
        values, ids = torch.topk(logp, n_top, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        tops = [[] for _ in token_ids]
    return [TokenLogprob(int(t), p, top) for t, p, top in zip(token_ids, picked, tops)]

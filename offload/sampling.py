"""SamplingParams (vLLM's field names) and the sampler: greedy, temperature, top-k, top-p, min-p, seed."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from typing import TYPE_CHECKING

from offload.errors import SamplingError, WeightsError
from offload.options import SEED_MAX, SEED_MIN

if TYPE_CHECKING:  # torch is imported where a sampler runs, not where parameters are checked (offload validate)
    import torch

GREEDY_EPS = 1e-5  # temperatures below this mean greedy, as in vLLM


@dataclass
class SamplingParams:
    """How to sample one request; defaults follow vLLM (temperature 1.0, max_tokens 16)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    n: int = field(default=1)

    def __post_init__(self):
        for name, kinds, what in (("stop", (str, list, tuple), "strings (or one string)"),
                                  ("stop_token_ids", (list, tuple), "token ids")):
            value = getattr(self, name)
            if value is not None and not isinstance(value, kinds):
                raise SamplingError(f"invalid sampling parameter: {name}: expected a list of {what}, found {value!r}",
                                    name)
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        """Raise SamplingError naming the first parameter out of range."""
        checks = [
            (_is_int(self.max_tokens) and self.max_tokens >= 1,
             f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"),
            (_is_number(self.temperature) and self.temperature >= 0,
             f"temperature must be a finite number >= 0 (0 means greedy), got {self.temperature!r}"),
            (_is_number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}"),
            (_is_int(self.top_k) and (self.top_k >= 0 or self.top_k == -1),
             f"top_k must be -1, 0 (all tokens) or a positive integer, got {self.top_k!r}"),
            (_is_number(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}"),
            (self.seed is None or _is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX,
             f"seed must be a whole number from -2**63 to 2**64-1, got {self.seed!r}"),
            (all(isinstance(s, str) and s for s in self.stop), f"stop must be non-empty strings, got {self.stop!r}"),
            (all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
             f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}"),
            (self.n == 1, f"n must be 1 (one completion per prompt), got {self.n!r}"),
        ]
        for ok, message in checks:
            if not ok:  # each message starts with the field's name
                raise SamplingError(f"invalid sampling parameter: {message}", message.split(" ", 1)[0])

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def make_generator(self) -> torch.Generator:
        """A per-request random generator: seeded if seed is set, else seeded from the global RNG."""
        import torch

        g = torch.Generator()
        g.manual_seed(self.seed if self.seed is not None else int(torch.randint(0, 2**62, (1,))))
        return g


def _is_number(x) -> bool:
    """A finite int or float (not a bool, NaN or infinity)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


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


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Pick the next token id from fp32 logits [V]; WeightsError if they are not finite (NaN or inf)."""
    import torch

    if not bool(torch.isfinite(logits).all()):
        raise WeightsError("the model produced NaN or infinite logits, so no token can be chosen; its weights "
                           "likely hold NaN or inf values (or the compute dtype overflows): check the checkpoint, "
                           "or try model.dtype fp32")
    if params.greedy:
        return int(torch.argmax(logits))
    probs = filter_logits(logits.float(), params).softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))

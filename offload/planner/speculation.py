"""Speculative decoding priced with the placement: what a batch-1 token costs when a drafter proposes k tokens and
the model checks them in one (k + 1)-token pass over its weights.

- The drafter takes a tier first. A draft model (or the model's own weights in a smaller format) is planned on
  the whole budget at batch 1 (on a GPU machine it goes to VRAM when it fits); the model is then planned on what
  is left (VRAM the draft holds is VRAM the model's layers do not), so the price of the draft's room is in the
  model's own pass. Prompt lookup takes nothing.
- A pass of the model over k + 1 tokens of one sequence, and one draft step, are priced by the cost model the
  plan uses (planner.recost: the same placement, a step of that shape).
- With acceptance rate a, a pass gives (1 - a^(k+1)) / (1 - a) tokens on average; k is the one with the most
  tokens per second, (tokens per pass) / (pass + k draft steps), from 0 (no speculation) to max_k.
Pure arithmetic: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from offload.errors import ConfigError, PlanError
from offload.planner.costs import main_format
from offload.planner.recost import recost_steps
from offload.planner.substitutes import (SubstituteLayout, copy_sizes, draft_step_s, gpu_fused, layout_on,
                                         mirror_sync_s, room_candidates)
from offload.units import format_bytes

PRIOR_ACCEPTANCE = 0.7  # the acceptance rate assumed before any is measured
# A copy of the model's own weights (self, substitute) keeps proposals as often as its format keeps the model's
# numbers: the default model's fp32 and bf16 weights, drafted for by q8_0 substitutes, kept 0.97-0.99 of them depth
# by depth, by q4_0 ones 0.74-0.76 (10 chat prompts x 64 tokens, k = 3, a Zen 4, 2026-12-07). Where the draft's
# format is not set, the planner prices each of these at its own and keeps the faster.
OWN_COPY_PRIORS = {"q4_0": 0.7, "q8_0": 0.95}
OWN_COPY_METHODS = ("self", "substitute")  # drafts of the model's own weights, in a format the planner may choose
# A tree's second candidate (the draft's next likeliest token, checked where its chain's token is rejected) is the
# model's token that often: the default model's q4_0 substitute on bf16 weights kept 100 of 159 and 91 of 135 (10
# chat prompts x 64 tokens, a Zen 4, 2026-12-07). The run weighs each by the draft's own probability for it.
BRANCH_PRIOR = 0.6
MODEL_DRAFTS = ("draft_model", *OWN_COPY_METHODS)  # speculative methods that load a draft model


DROPPED = "; slower than without it: a run drops it unless speculative.num_speculative_tokens is set"


@dataclass(frozen=True)
class SpeculationPrice:
    """The chosen k and what it predicts at batch 1, beside decoding without speculation."""

    method: str
    acceptance: float
    k: int
    tokens_per_pass: float
    verify_s: float  # the model's pass over k + 1 tokens, past the drafting (its first copies and reads under it)
    draft_s: float  # k draft steps
    tokens_per_s: float
    plain_tokens_per_s: float  # the model alone, planned on the whole budget
    draft_gpu_bytes: int = 0  # VRAM the draft holds (taken from the model's layers)
    draft_cpu_bytes: int = 0
    draft_format: str | None = None  # a copy of the model's own weights: its format
    branches: int = 0  # a tree's second candidates a pass carries (after the chain's first tokens)
    draft_layout: str = ""  # a substitute draft's copies on a plan with GPU layers (SubstituteLayout.describe)

    @property
    def speedup(self) -> float:
        return self.tokens_per_s / self.plain_tokens_per_s if self.plain_tokens_per_s else 0.0

    @property
    def pays(self) -> bool:
        """Whether decoding with the draft (and the model on what it leaves) is predicted faster than without."""
        return self.tokens_per_s > self.plain_tokens_per_s

    def verdict(self, kept: bool) -> str:
        """Why speculation that does not pay was dropped, or (kept: the user set k) that it runs predicted slower."""
        held = " and ".join(f"{format_bytes(n)} of {tier}" for n, tier in ((self.draft_gpu_bytes, "VRAM"),
                                                                             (self.draft_cpu_bytes, "RAM")) if n)
        why = (f"at batch 1 and the prior acceptance {self.acceptance:.2f}, with the draft holding {held or 'nothing'} "
               f"and the model planned on what it leaves, decoding is predicted {self.tokens_per_s:.2f} tok/s (k = "
               f"{self.k}) against {self.plain_tokens_per_s:.2f} tok/s without the draft, the model on the whole "
               f"budget")
        if kept:
            return (f"speculative decoding ({self.method}) kept, as num_speculative_tokens is set, though predicted "
                    f"slower: {why}")
        return (f"speculative decoding ({self.method}) dropped: {why}; set speculative.num_speculative_tokens to "
                f"keep it, or give the draft room of its own (a larger memory budget)")

    def line(self) -> str:
        where = ""
        if self.draft_gpu_bytes or self.draft_cpu_bytes:
            where = (f"; the draft holds {_gib(self.draft_gpu_bytes)} of VRAM and {_gib(self.draft_cpu_bytes)} of "
                     f"RAM, taken from the model's budget")
        if self.draft_layout:
            where += f" ({self.draft_layout})"
        method = self.method if self.draft_format is None else f"{self.method}, {self.draft_format} copy"
        tree = (f" and {self.branches} second candidate{'s' if self.branches > 1 else ''} (kept at "
                f"{min(BRANCH_PRIOR, self.acceptance):.2f} where checked)") if self.branches else ""
        return (f"speculative decoding ({method}, acceptance {self.acceptance:.2f}): k = {self.k}{tree}, "
                f"{self.tokens_per_pass:.2f} tokens per pass; batch 1 predicted {self.tokens_per_s:.2f} tok/s against "
                f"{self.plain_tokens_per_s:.2f} without ({self.speedup:.2f}x); a pass "
                f"{(self.verify_s + self.draft_s) * 1e3:.1f} ms: drafting {self.draft_s * 1e3:.1f} ms, verifying "
                f"{self.verify_s * 1e3:.1f} ms{where}{'' if self.pays else DROPPED}")


def expected_tokens(acceptance, k: int) -> float:
    """Tokens a pass over k proposals gives on average: the kept ones and the model's own after them. acceptance:
    one rate for every proposal, or the rates by depth (the i-th proposal kept where the ones before it were; past
    the last, the last again). Proposals are kept in runs: past a kept one the next is kept more often than the
    rate over all proposals says (the default model's substitute drafts: 0.59 over all, 2.76 tokens a pass at k = 3
    where one rate gives 2.2)."""
    rates = _rates(acceptance)
    total = reach = 1.0
    for i in range(k):
        reach *= min(max(rates[min(i, len(rates) - 1)], 0.0), 1.0)
        total += reach
    return total


def _rates(acceptance) -> list[float]:
    """One rate for every depth, or the rates by depth (none: the prior), as a list."""
    return [acceptance] if isinstance(acceptance, (int, float)) else list(acceptance) or [PRIOR_ACCEPTANCE]


@dataclass(frozen=True)
class _Step:
    """A step's shape as recost prices it (profile.timeline.StepShape's fields)."""

    n_tokens: int
    attended_keys: int
    kv_read_tokens: int
    phase: str = "decode"
    n_seqs: int = 1
    threads: int = 0

    @property
    def n_logits(self) -> int:
        return self.n_tokens


def decode_pass_s(spec, hw, plan, n_tokens: int, context: int, gap_s: float = 0.0) -> float:
    """The plan's seconds for one sequence's decode step of n_tokens tokens after context cached ones; after gap_s
    of the host's own work (a draft's steps), under which its first copies and disk reads ran (not counted)."""
    shape = _Step(n_tokens, n_tokens * context + n_tokens * (n_tokens + 1) // 2, context + n_tokens - 1)
    return recost_steps(spec, hw, plan, [shape], gap_s)["decode"] - gap_s


@dataclass(frozen=True)
class SpeculationPlans:
    """What speculation is priced on, at batch 1 and one context: the model's plan on the whole budget (plain)
    and on what the draft leaves (target), and a draft step's seconds and bytes."""

    hw: object
    context: int  # cached positions a decode step reads
    plain_s: float  # a 1-token step of the plain plan
    target: object
    target_spec: object
    draft_step_s: float = 0.0
    draft_gpu_bytes: int = 0
    draft_cpu_bytes: int = 0
    layout: SubstituteLayout | None = None  # a substitute draft's copies on a plan with GPU layers
    copy_format: str = ""  # a copy of the model's weights: its format (a GGUF file's main format, as stored)
    sync_s: float = 0.0  # a drafting round's copy of the mirrored KV into VRAM (substitutes.mirror_sync_s)
    under: bool = False  # the verify pass's first copies and disk reads run under the drafting (the draft itself
    # copies and reads nothing: generate.Generator._drafts prepares the pass before it drafts)

    def draft_s(self, k: int) -> float:
        """Seconds of k draft steps, and the round's mirror copy where k > 0."""
        return k * self.draft_step_s + (self.sync_s if k else 0.0)

    def pass_s(self, k: int, after_s: float = 0.0) -> float:
        """The target plan's step over a sequence's last token and k proposals, after after_s of drafting (its first
        copies and reads under that, where under)."""
        return decode_pass_s(self.target_spec, self.hw, self.target, k + 1, self.context,
                             after_s if self.under else 0.0)

    def verify_s(self, k: int, n_tokens: int | None = None) -> float:
        """The pass over n_tokens proposals (default k) after k draft steps."""
        return self.pass_s(k if n_tokens is None else n_tokens, self.draft_s(k))


def plan_speculation(spec, hw, request, options, draft_spec=None, context: int | None = None,
                     acceptance=None) -> SpeculationPlans:
    """Plan request at batch 1 on hw with and without the draft of the speculative options
    (offload.options.SpeculativeOptions); spec is the model's, draft_spec the draft's (draft_model; self: spec).
    The draft is planned first, on the whole budget; a substitute draft on a plan with GPU layers holds copies of
    the far units only, in the VRAM the most tokens per second at acceptance (None: the prior) sets aside
    (plan_substitutes). context: cached positions a decode step reads (default: the plan's workload's, halfway
    through its answer)."""
    from offload.planner.request import plan_for, plan_spec

    one = request.with_options(batch_size=1)
    plain = plan_for(spec, hw, one)
    if context is None:
        context = plain.workload.prompt_len + plain.workload.gen_len // 2
    plain_s = decode_pass_s(plan_spec(spec, plain), hw, plain, 1, context)
    if options.method not in MODEL_DRAFTS:
        return SpeculationPlans(hw, context, plain_s, plain, plan_spec(spec, plain))
    path = options.draft_path(request.model.path)
    quantization = options.draft_quantization
    draft_spec = draft_spec or spec
    if draft_spec.vocab_size != spec.vocab_size:
        raise ConfigError(f"the draft model {path} has a vocabulary of {draft_spec.vocab_size} tokens and the "
                          f"model {spec.vocab_size}; a draft model must share the model's tokenizer")
    if options.method == "substitute":
        check_copy_of(spec, draft_spec, path)
    if options.method == "substitute" and any(u.weight_tier == "gpu" or u.decode != "cpu" for u in plain.units):
        plain_plans = SpeculationPlans(hw, context, plain_s, plain, plan_spec(spec, plain))
        return plan_substitutes(spec, draft_spec, hw, one, options, plain_plans,
                                prior_acceptance(options) if acceptance is None else acceptance)
    draft_plan = plan_for(draft_spec, hw, one.with_options(model=path, quantization=quantization))
    step_s = decode_pass_s(plan_spec(draft_spec, draft_plan), hw, draft_plan, 1, context)
    own = options.method != "substitute"  # a substitute's KV cache and embedding are the model's
    gpu_bytes, cpu_bytes = draft_held(draft_plan, kv=own, embedding=own)
    target = plan_for(spec, hw, without_draft(one, hw, gpu_bytes, cpu_bytes))
    quiet = not any(u.weight_tier == "disk" or "stream" in (u.prefill, u.decode) for u in draft_plan.units)
    return SpeculationPlans(hw, context, plain_s, target, plan_spec(spec, target), step_s, gpu_bytes, cpu_bytes,
                            copy_format=main_format(draft_spec, draft_plan.weight_format), under=quiet)


def plan_substitutes(spec, copy_spec, hw, one, options, plain: SpeculationPlans, acceptance) -> SpeculationPlans:
    """A substitute draft on a plan with GPU layers (copy_spec: the copies' own file's, or spec): for each amount of
    VRAM set aside for copies (substitutes.room_candidates), the model planned on what is left, its far units'
    copies placed (substitutes.layout_on), with the KV of the CPU layers they copy mirrored in VRAM or not, and the
    host RAM they take set aside too; the layout with the most tokens per second at acceptance kept."""
    from offload.planner.request import plan_for, plan_spec, plan_weight_format

    fmt = plan_weight_format(copy_spec, options.draft_quantization, plain.target.workload.compute_format)
    label = main_format(copy_spec, fmt)
    best, why = None, ("every unit of the model is resident on the GPU at this budget, so a pass reads no far weights "
                       "and the draft would be the model itself; leave speculative.method out")
    compute = plain.target.workload.compute_format
    rooms = room_candidates(plain.target, _sizes(copy_spec, plain.target, fmt), one.budget(hw).gpu_bytes)
    for room, mirror in ((room, mirror) for room in rooms for mirror in (True, False)):
        reserve = 0
        try:
            target = plan_for(spec, hw, without_draft(one, hw, room, 0))
            fused = gpu_fused(plan_spec(copy_spec, target), fmt, compute)
            layout = layout_on(target, _sizes(copy_spec, target, fmt), fmt, room, label, fused, mirror)
            if layout is not None and layout.cpu_bytes:  # their RAM too: the model planned on what that leaves
                reserve = layout.cpu_bytes
                target = plan_for(spec, hw, without_draft(one, hw, room, reserve))
                fused = gpu_fused(plan_spec(copy_spec, target), fmt, compute)
                again = layout_on(target, _sizes(copy_spec, target, fmt), fmt, room, label, fused, mirror)
                layout = again if again is not None and again.cpu_bytes <= reserve else None
        except (ConfigError, PlanError) as e:
            why = str(e)
            continue
        if layout is None and any(u.decode == "stream" and u.name not in fused for u in target.units):
            why = (f"the model streams units whose copies must be in VRAM (their KV cache is there), and no fused GPU "
                   f"kernel computes {label}; use copies in q4_0, q8_0 or a GGUF type with one (Q4_1, Q2_K, Q4_K, "
                   f"Q5_K, Q6_K)")
        if layout is None or not layout.on_gpu + layout.on_cpu:  # no copies: the draft would be the model itself
            continue
        target_spec = plan_spec(spec, target)
        step_s = draft_step_s(target_spec, hw, target, layout, plain.context, plan_spec(copy_spec, target))
        plans = SpeculationPlans(hw, plain.context, plain.plain_s, target, target_spec, step_s, room, reserve,
                                 replace(layout, plan_held=(room, reserve)), label, mirror_sync_s(hw, layout, target),
                                 under=True)  # its copies are in VRAM or RAM: it neither copies nor reads
        price = price_on(plans, options, acceptance, options.max_speculative_tokens)
        if best is None or price.tokens_per_s > best[0]:
            best = (price.tokens_per_s, plans)
    if best is None:
        raise PlanError(f"speculative method substitute with {label} copies: {why}")
    return best[1]


def check_copy_of(spec, copy_spec, path) -> None:
    """ConfigError where copy_spec (a substitute's copies, from path) is not the model's shape unit by unit."""
    def shapes(s):  # with each dense MLP in its layer, as either spec's plan may have split it off
        return [(u.name, [t.shape for t in u.tensors]) for u in replace(s, split_mlp=False).units()]

    if copy_spec is not spec and shapes(copy_spec) != shapes(spec):
        diff = next((a[0] for a, b in zip(shapes(spec), shapes(copy_spec)) if a != b), "its units")
        raise ConfigError(f"speculative.model {path} is not a copy of the model: its {diff} has other shapes (or "
                          f"another count of layers); a substitute's copies must be the same model in another format")


def _sizes(spec, plan, fmt: str) -> dict[str, int]:
    """Each of plan's units' bytes in fmt (substitutes.copy_sizes of the spec plan places)."""
    from offload.planner.request import plan_spec

    return copy_sizes(plan_spec(spec, plan), fmt, plan.workload.compute_format)


def prior_acceptance(options) -> float:
    """The acceptance rate assumed before any is measured: a copy of the model's own weights its format's
    (OWN_COPY_PRIORS), anything else PRIOR_ACCEPTANCE."""
    if options.method in OWN_COPY_METHODS:
        return OWN_COPY_PRIORS.get(options.draft_quantization, PRIOR_ACCEPTANCE)
    return PRIOR_ACCEPTANCE


def choose_draft(spec, hw, request, options, acceptance: float | None = None, draft_spec=None, max_k: int = 8,
                 min_k: int = 0, context: int | None = None):
    """(options with the draft's format, its SpeculationPlans, its price): a copy of the model's own weights whose
    format is not set priced in each of OWN_COPY_PRIORS' formats, the most tokens per second kept; else options as
    they are. acceptance None: each format's prior (prior_acceptance)."""
    formats = tuple(OWN_COPY_PRIORS) if (options.method in OWN_COPY_METHODS and options.quantization is None
                                         and not options.model) else (None,)
    best, refused = None, None
    for fmt in formats:
        opts = options if fmt is None else options.model_copy(update={"quantization": fmt})
        try:
            plans = plan_speculation(spec, hw, request, opts, draft_spec, context, acceptance)
        except (ConfigError, PlanError) as e:  # this format's copy leaves the model no placement: another may
            if len(formats) == 1:
                raise
            refused = e
            continue
        price = price_on(plans, opts, prior_acceptance(opts) if acceptance is None else acceptance, max_k, min_k)
        if best is None or price.tokens_per_s > best[2].tokens_per_s:
            best = (opts, plans, price)
    if best is None:
        raise refused
    return best


def price_speculation(spec, hw, request, options, acceptance: float | None, draft_spec=None,
                      max_k: int = 8, context: int | None = None) -> SpeculationPrice:
    """The k with the most tokens per second at batch 1 (options.num_speculative_tokens if set, else 0 to max_k)
    at this acceptance rate (None: the draft format's prior), on plan_speculation's plans (its arguments), in the
    draft format choose_draft keeps."""
    return choose_draft(spec, hw, request, options, acceptance, draft_spec, max_k, context=context)[2]


def price_on(plans: SpeculationPlans, options, acceptance: float, max_k: int = 8,
             min_k: int = 0) -> SpeculationPrice:
    """price_speculation on plans made already; min_k: the fewest proposals priced (1: the best that speculates).
    A draft model's passes may carry a tree's second candidates too (up to options.max_branches, at the chain's
    first depths: branch_gain), priced in the same pass."""
    fixed = options.num_speculative_tokens
    most_branches = options.max_branches if options.method in MODEL_DRAFTS else 0
    best = None
    for k in range(min_k if fixed is None else fixed, (max(max_k, min_k) if fixed is None else fixed) + 1):
        for b in range(min(most_branches, k) + 1):
            verify_s, tokens = plans.verify_s(k, k + b), expected_tokens(acceptance, k) + branch_gain(acceptance, b)
            rate = tokens / (verify_s + plans.draft_s(k))
            if best is None or rate > best.tokens_per_s:
                best = SpeculationPrice(options.method, acceptance, k, tokens, verify_s, plans.draft_s(k), rate,
                                        1.0 / plans.plain_s, plans.draft_gpu_bytes, plans.draft_cpu_bytes,
                                        (plans.copy_format or options.draft_quantization)
                                        if options.method in OWN_COPY_METHODS else None,
                                        b, plans.layout.describe() if plans.layout else "")
    return best


def branch_gain(acceptance, b: int) -> float:
    """Tokens b second candidates add to a pass on average, one at each of the chain's first b depths: each is
    checked where the chain reaches its depth and is rejected there, and kept at BRANCH_PRIOR, or at the depth's
    acceptance where that is lower (a draft whose first guesses fail is not trusted with its second)."""
    rates = _rates(acceptance)
    total, reach = 0.0, 1.0
    for i in range(b):
        rate = min(max(rates[min(i, len(rates) - 1)], 0.0), 1.0)
        total += reach * (1.0 - rate) * min(BRANCH_PRIOR, rate)
        reach *= rate
    return total


def run_tokens_per_s(plans: SpeculationPlans, acceptance: float, k: int, share: float, branches: int = 0,
                     gain: float = 0.0) -> float:
    """Predicted tokens per second of decode steps of which a share carried k proposals at this acceptance rate
    (with k draft steps each; a tree's passes also branches second candidates, which gain tokens a pass) and the
    rest none."""
    tokens = share * (expected_tokens(acceptance, k) + gain) + (1 - share)
    return tokens / (share * (plans.verify_s(k, k + branches) + plans.draft_s(k)) + (1 - share) * plans.pass_s(0))


def against_measured(spec, hw, request, options, stats: dict, prior: float, draft_spec=None) -> dict:
    """The run's decode speed with speculation (stats: offload.api.LLM.speculative_stats) against its price at
    batch 1 and the run's mean context. The prediction (predicted_*) prices the steps the run took: its measured
    acceptance (by depth), its mean proposals per pass (k) and its share of steps that carried any; that checks the
    cost model and the tokens a pass gives (predicted_tokens_per_pass against the measured). The forecast
    (forecast_*) is what the planner predicts before anything is measured: the prior acceptance and the k it would
    choose. Speeds: over_measured above 1 is a prediction
    faster than the run. Both are left out (None) where the run decoded more than one sequence a step."""
    measured = stats.get("decode_tokens_per_s")
    out = dict.fromkeys(("predicted_tokens_per_s", "predicted_k", "predicted_over_measured", "forecast_tokens_per_s",
                         "forecast_k", "forecast_over_measured"))
    out.update(measured_tokens_per_s=measured, prior_acceptance=prior)
    if not measured:
        return {**out, "predicted_for": "nothing: the run made no decode steps"}
    if stats["mean_batch"] > 1.0:
        return {**out, "predicted_for": f"nothing: the run decoded {stats['mean_batch']:.2f} sequences a step, and "
                                        f"speculation is priced for one"}
    plans = plan_speculation(spec, hw, request, options, draft_spec, round(stats["mean_context"]))
    forecast = price_on(plans, options, prior, options.max_speculative_tokens)
    out.update(forecast_tokens_per_s=forecast.tokens_per_s, forecast_k=forecast.k,
               forecast_over_measured=forecast.tokens_per_s / measured)
    if stats["verified_passes"]:
        k = max(1, round(stats["proposed"] / stats["verified_passes"]))
        share = min(stats["verified_passes"] / stats["decode_steps"], 1.0)
        rates = stats.get("acceptance_by_depth") or stats["acceptance_rate"]  # by depth where the run has them
        passes = stats["verified_passes"]  # a tree's second candidates: carried, and kept, per pass
        branches, gain = round(stats.get("branch_tokens", 0) / passes), stats.get("branches_kept", 0) / passes
        predicted = run_tokens_per_s(plans, rates, k, share, branches, gain)
        per_pass = expected_tokens(rates, k) + gain
        over = per_pass / stats["tokens_per_pass"] if stats.get("tokens_per_pass") else None
        out.update(predicted_tokens_per_s=predicted, predicted_k=k, predicted_over_measured=predicted / measured,
                   predicted_share=share, predicted_tokens_per_pass=per_pass, tokens_per_pass_over_measured=over)
    return {**out, "predicted_for": f"batch 1 and the run's mean context of {plans.context} positions"}


def draft_held(plan, kv: bool = True, embedding: bool = True) -> tuple[int, int]:
    """(GPU, CPU) bytes a draft's plan holds: what the model's plan has left (kv: its KV cache too; a substitute
    draft attends to the model's; embedding: its embedding too; a substitute looks its tokens up in the model's,
    and lets its own copy go once loaded)."""
    held = {tier: _held(plan, tier, kv) for tier in ("gpu", "cpu")}
    for unit in plan.units if not embedding else ():
        if unit.kind == "embed" and unit.weight_tier in held:
            held[unit.weight_tier] -= unit.weight_bytes
    return held["gpu"], held["cpu"]


def without_draft(request, hw, gpu_bytes: int, cpu_bytes: int):
    """request with its GPU and CPU budgets less what a draft holds (the CPU's: the whole process, as memory.cpu
    means it; the process's baseline is counted once, in the model's plan), the draft's CPU bytes held beside it."""
    budget = request.budget(hw)
    rest = request.with_options(gpu_memory=max(budget.gpu_bytes - gpu_bytes, 0),
                                cpu_memory=max(budget.process_cpu_bytes - cpu_bytes, 0))
    return replace(rest, beside_bytes=request.beside_bytes + cpu_bytes)  # the page cache's room leaves it out too


def _held(plan, tier: str, kv: bool = True) -> int:
    """Bytes a plan holds on a tier (weights, KV where kv, buffers), 0 where it has none."""
    t = next((t for t in plan.tiers if t.tier == tier), None)
    if t is None:
        return 0
    return t.weights_bytes + kv * t.kv_bytes + t.workspace_bytes + t.staging_bytes + t.pinned_bytes


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"

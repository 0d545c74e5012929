"""Speculative decoding: a drafter proposes the next tokens of a sequence, the sequence's next step carries them
all (its last token and k proposals: one pass over the weights for k + 1 tokens), and the step keeps the
proposals the model agrees with, plus one token of the model's own.

- Greedy requests keep a proposal while it is the model's argmax (after penalties and bias, as the sampler
  picks): the answer is the one decoding without speculation gives.
- Sampled requests use the rejection rule (Leviathan et al. 2023; Chen et al. 2023): a proposal d drawn from
  the drafter's distribution q is kept with probability min(1, p(d) / q(d)), p the model's final sampling
  distribution; at the first rejection the token is drawn from max(p - q, 0), renormalized; after k kept ones
  the next is drawn from p. The tokens are then distributed as p exactly. Prompt lookup proposes one token
  for sure (q is a point mass), so d is kept with probability p(d) and a rejection draws from p without d.
- Rejected proposals leave K and V in the sequence's extent past its length; the cache is read by position, and
  the next step writes those positions again, so nothing else rolls them back.
- A draft model's proposals may be a tree (offload/proposal_tree.py): a second candidate after a token where the
  draft is unsure. The walk goes from the last token through the candidates the rule keeps, each in turn a point
  mass (so sampling keeps p); the kept path's K and V move to their positions after.

How many tokens to propose (k): the user's num_speculative_tokens, or the k that maximizes the expected tokens per
pass over its cost: with a_i the rate the i-th proposal is kept at where the ones before it were (measured by depth:
proposals are kept in runs), a pass over k proposals yields 1 + a_0 + a_0 a_1 + ... tokens on average per sequence
(with one rate a for all: (1 - a^(k+1)) / (1 - a)), and a step of n sequences with k proposals each costs (s + t n
(1 + k) + n k d) / (s + t n) of a step without them, where a step of n tokens takes s + t n seconds (fitted on the
run's own decode steps; a prior before) and a draft model's pass d seconds (measured; prompt lookup costs nothing).
So where a pass grows with its tokens (a large batch, compute-bound), k falls to 0. Each rate starts at the prior
(planner.speculation.prior_acceptance: 0.7, a copy of the model's own weights its format's; a depth not yet reached:
the rate above it) and follows the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from offload.planner.speculation import PRIOR_ACCEPTANCE, expected_tokens, prior_acceptance
from offload.proposal_tree import ODDS_PRIOR_WEIGHT, branch_gains, children_of, with_branches
from offload.sampling import SamplingParams, probabilities
from offload.schedule_step import Proposal
from offload.substitute_draft import SubstituteDrafter, draft_runs

PRIOR_WEIGHT = 8  # proposals the prior counts as: the measured rate takes over within a few steps
PRIOR_TOKEN_COST = 0.05  # a sequence's proposal's cost as a share of a step, before the run's steps are fitted
FIT_DECAY = 0.98  # weight of older steps in the fit of a step's seconds on its tokens


class NgramDrafter:
    """Prompt lookup (vLLM's ngram method, llama.cpp's lookup decoding): the tokens that followed the most recent
    earlier occurrence of the sequence's last n tokens, n from prompt_lookup_max down to prompt_lookup_min."""

    def __init__(self, lookup_max: int = 4, lookup_min: int = 1):
        self.lookup_max, self.lookup_min = lookup_max, lookup_min

    def propose(self, tokens: list[int], k: int, seq=None) -> list[int]:
        if k <= 0:
            return []
        last = len(tokens)
        for n in range(min(self.lookup_max, last - 1), self.lookup_min - 1, -1):
            tail = tokens[last - n:]
            for start in range(last - n - 1, -1, -1):  # the most recent match first; it must be followed
                if tokens[start] == tail[0] and tokens[start: start + n] == tail:
                    return tokens[start + n: min(start + n + k, last)]
        return []


@dataclass
class SpeculativeStats:
    """What speculation did in a run: proposals made and kept, passes over verified sequences, tokens they gave."""

    proposed: int = 0
    accepted: int = 0
    verified_passes: int = 0  # a sequence's step that carried proposals
    verified_tokens: int = 0  # tokens those steps gave it (kept proposals and the model's own)
    decode_steps: int = 0  # decode steps (no prompt tokens), with or without proposals
    decode_seqs: int = 0  # sequences in them, summed over the steps
    decode_context: int = 0  # their cached positions before the step, summed over the steps
    decode_tokens: int = 0  # tokens the sequences gained in them
    decode_s: float = 0.0  # seconds of their passes over the weights (drafting not included)
    reached: list[int] = field(default_factory=list)  # [i]: proposals checked at depth i (the ones before kept)
    kept_at: list[int] = field(default_factory=list)  # [i]: ... and kept
    branch_tokens: int = 0  # second candidates carried by the passes (a tree's)
    branches: int = 0  # second candidates checked (a tree's: their chain's token rejected)
    branches_kept: int = 0  # ... and kept
    branch_odds: float = 0.0  # the draft's probabilities of the second candidates whose depth was reached, summed
    # (what branches_kept was expected to be)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def acceptance_by_depth(self) -> list[float]:
        """The rate the i-th proposal of a pass was kept at where the ones before it were, by depth reached."""
        return [kept / reached for reached, kept in zip(self.reached, self.kept_at)]

    def count(self, depth: int, kept: bool) -> None:
        """A proposal at this depth checked (the ones before it kept), and whether it was kept."""
        if depth == len(self.reached):
            self.reached.append(0)
            self.kept_at.append(0)
        self.reached[depth] += 1
        self.kept_at[depth] += kept

    @property
    def tokens_per_pass(self) -> float:
        """Mean tokens a sequence gained per pass that carried proposals."""
        return self.verified_tokens / self.verified_passes if self.verified_passes else 0.0

    @property
    def mean_batch(self) -> float:
        """Sequences per decode step."""
        return self.decode_seqs / self.decode_steps if self.decode_steps else 0.0

    @property
    def mean_context(self) -> float:
        """A decode step's sequence's cached positions before the step, on average."""
        return self.decode_context / self.decode_seqs if self.decode_seqs else 0.0

    def decode_tokens_per_s(self, draft_s: float) -> float | None:
        """Tokens gained per second of decode steps and drafting (draft_s: the drafter's seconds), None before any."""
        seconds = self.decode_s + draft_s
        return self.decode_tokens / seconds if self.decode_tokens and seconds > 0 else None

    def as_dict(self) -> dict:
        return {"proposed": self.proposed, "accepted": self.accepted, "acceptance_rate": self.acceptance_rate,
                "verified_passes": self.verified_passes, "tokens_per_pass": self.tokens_per_pass,
                "decode_steps": self.decode_steps, "decode_tokens": self.decode_tokens, "decode_s": self.decode_s,
                "mean_batch": self.mean_batch, "mean_context": self.mean_context,
                "acceptance_by_depth": self.acceptance_by_depth, "branch_tokens": self.branch_tokens,
                "branches": self.branches, "branches_kept": self.branches_kept}


class Speculator:
    """A drafter, the choice of k, and the verification of a sequence's proposals against the model's logits."""

    def __init__(self, drafter, num_tokens: int | None = None, max_tokens: int = 8, prior: float = PRIOR_ACCEPTANCE,
                 max_branches: int = 0):
        self.drafter, self.num_tokens, self.max_tokens = drafter, num_tokens, max_tokens
        self.max_branches = max_branches if hasattr(drafter, "alternatives") else 0  # a tree's second candidates
        self.prior = prior  # the acceptance assumed before any is measured (planner.speculation.prior_acceptance)
        self.stats = SpeculativeStats()
        self._fit = [0.0] * 5  # decayed sums: weight, x, y, xx, xy (x: tokens in a decode step, y: its seconds)

    # how many ----------------------------------------------------------------------------------------------
    @property
    def most_tokens(self) -> int:
        """The most proposals a sequence's step carries: the user's k, else the adaptive choice's bound."""
        return self.max_tokens if self.num_tokens is None else self.num_tokens

    @property
    def acceptance(self) -> float:
        s = self.stats
        return (s.accepted + self.prior * PRIOR_WEIGHT) / (s.proposed + PRIOR_WEIGHT)

    def depth_rates(self) -> list[float]:
        """The rates by depth a pass's proposals are kept at (the prior's weight on each, depth 0's the prior rate,
        each deeper one's the rate above it): what choose_k prices a chain of k proposals by."""
        rates, prior = [], self.prior
        for reached, kept in zip(self.stats.reached, self.stats.kept_at):
            prior = (kept + prior * PRIOR_WEIGHT) / (reached + PRIOR_WEIGHT)
            rates.append(prior)
        return rates or [prior]

    def observe_step(self, shape, seconds: float, n_gained: int) -> None:
        """A decode step (profile.timeline.StepShape), its seconds and the tokens its sequences gained: counted in
        the stats, and its tokens and seconds taken into the fit of a step's cost."""
        s, n_tokens = self.stats, shape.n_tokens
        s.decode_steps, s.decode_seqs, s.decode_context = (s.decode_steps + 1, s.decode_seqs + shape.n_seqs,
                                                           s.decode_context + shape.kv_read_tokens
                                                           - (n_tokens - shape.n_seqs))  # less the proposals
        s.decode_tokens, s.decode_s = s.decode_tokens + n_gained, s.decode_s + seconds
        w, x, y, xx, xy = (v * FIT_DECAY for v in self._fit)
        self._fit = [w + 1, x + n_tokens, y + seconds, xx + n_tokens * n_tokens, xy + n_tokens * seconds]

    def _line(self) -> tuple[float, float] | None:
        """(intercept, slope) of the fit of a decode step's seconds on its tokens; None before three steps."""
        w, x, y, xx, xy = self._fit
        spread = w * xx - x * x
        if w < 3 or spread <= 1e-9 * max(w * xx, 1.0):
            return None
        slope = (w * xy - x * y) / spread
        return (y - slope * x) / w, slope

    def token_cost(self, n_tokens: int, drafted: bool = True) -> float | None:
        """A proposal's cost as a share of a step of n_tokens tokens: the fit's slope over its value there, plus
        (drafted: a chain's proposal, not a tree's second candidate, which its chain's passes give) a draft model's
        pass (its measured seconds per pass) over the same; None before the fit."""
        line = self._line()
        at = line[0] + line[1] * n_tokens if line else 0.0
        if at <= 0:
            return None
        passes = getattr(self.drafter, "passes", 0) if drafted else 0
        draft = self.draft_seconds / passes if passes else 0.0
        return (max(line[1], 0.0) + draft) / at

    def choose_k(self, n_seqs: int) -> int:
        """Proposals per sequence in a decode step of n_seqs sequences: the user's, or the best expected tokens per
        cost (n_seqs x k proposals, each at token_cost; before the fit, the prior for the whole step, so that the
        first steps carry proposals and the fit sees steps of other sizes)."""
        if self.num_tokens is not None:
            return self.num_tokens
        cost = self.token_cost(n_seqs)
        rates, r = self.depth_rates(), PRIOR_TOKEN_COST if cost is None else cost * n_seqs
        gains = [expected_tokens(rates, k) / (1 + r * k) for k in range(self.max_tokens + 1)]
        return max(range(len(gains)), key=gains.__getitem__)

    def propose(self, tokens: list[int], k: int, seq=None) -> list[int]:
        return self.drafter.propose(tokens, k, seq) if k > 0 else []

    def propose_many(self, asks: list[tuple[list[int], int, object]], alternatives: bool = False) -> list[list[int]]:
        """Proposals for several sequences ((tokens, k, seq) each): a draft model drafts them together (and, asked
        for alternatives, keeps its next likeliest token at each, drafter.alternatives)."""
        many = getattr(self.drafter, "propose_many", None)
        if many is not None:
            return many(asks, alternatives) if hasattr(self.drafter, "alternatives") else many(asks)
        return [self.propose(tokens, k, seq) for tokens, k, seq in asks]

    def branch(self, drafts: list[list[int]], rooms: list[int], n_seqs: int, room: int) -> list[Proposal]:
        """The drafts as proposals, each with the second candidates (at most max_branches, within rooms[i] more
        tokens, room in all) whose expected gain pays their cost in the step: proposal_tree's branch_gains, taken
        best first while each raises the step's expected tokens per cost."""
        alternatives = getattr(self.drafter, "alternatives", None) or [[] for _ in drafts]
        chain, cost = (self.token_cost(n_seqs, drafted) for drafted in (True, False))
        r, rates = PRIOR_TOKEN_COST if cost is None else cost, self.depth_rates()
        value = sum(expected_tokens(rates, len(d)) for d in drafts)
        price = 1.0 + (PRIOR_TOKEN_COST if chain is None else chain) * sum(len(d) for d in drafts)
        gains = sorted(((g, i, depth, token, odds) for i, (draft, alts) in enumerate(zip(drafts, alternatives))
                        for g, depth, token, odds in branch_gains(alts, draft, rates, self.odds_calibration)),
                       reverse=True)
        rooms, chosen = list(rooms), [[] for _ in drafts]
        for g, i, depth, token, odds in gains:
            if room > 0 and rooms[i] > 0 and len(chosen[i]) < self.max_branches and g * price > r * value:
                chosen[i].append((depth, token, odds))
                rooms[i], room, value, price = rooms[i] - 1, room - 1, value + g, price + r
        return [with_branches(d, c) if c else Proposal.chain(d) for d, c in zip(drafts, chosen)]

    @property
    def odds_calibration(self) -> float:
        """How often a second candidate was kept against the draft's probabilities for those reached (1 before any
        is)."""
        s = self.stats
        return (s.branches_kept + ODDS_PRIOR_WEIGHT) / (s.branch_odds + ODDS_PRIOR_WEIGHT)

    def attach(self, cache, trash_slot: int) -> None:
        """The engine's KV cache and trash slot, before a step of the model asks for proposals (a drafter that
        drafts over the model's own cache takes them)."""
        attach = getattr(self.drafter, "attach", None)
        if attach is not None:
            attach(cache, trash_slot)

    def forget(self, seq) -> None:
        """A sequence left the batch: the drafter frees what it held for it."""
        forget = getattr(self.drafter, "forget", None)
        if forget is not None:
            forget(seq)

    @property
    def draft_seconds(self) -> float:
        return getattr(self.drafter, "seconds", 0.0)

    # which to keep ------------------------------------------------------------------------------------------
    def verify(self, rows: list[torch.Tensor], proposal: Proposal | list[int], params: SamplingParams, generator,
               prompt_ids: list[int], output_ids: list[int], take, allowed: torch.Tensor | None = None) -> list[int]:
        """Walk a sequence's proposals from its last token (rows: its logits after that token and after each
        proposal, in the step's order): at each token the rule picks among the candidates after it, or draws the
        model's own; take(token, row) each token kept and the one drawn after them (take returns False once the
        sequence has ended). The proposals kept, in order. allowed: a structured output's masks, one a row
        ([k + 1, V] bool; a chain's, cut to its grammar)."""
        proposal = proposal if isinstance(proposal, Proposal) else Proposal.chain(proposal)
        if allowed is not None and not proposal.is_chain:
            raise ValueError("a structured output's proposals are a chain (its masks follow one path)")
        children, node, path, n_taken = children_of(proposal), -1, [], 0
        while True:
            row, candidates = rows[node + 1], children.get(node, [])
            token = self._decide(row, [proposal.tokens[c] for c in candidates], params, generator, prompt_ids,
                                 output_ids, None if allowed is None else allowed[node + 1])
            kept = next((c for c in candidates if proposal.tokens[c] == token), None)
            self._count(proposal, candidates, len(path), kept)
            if kept is not None:
                path.append(kept)
            n_taken += 1
            if not take(token, row) or kept is None:
                break
            node = kept
        chain = {i for i in range(len(proposal)) if not proposal.odds or proposal.odds[i] == 0.0}
        self.stats.proposed += len(chain)  # its chain's; the second candidates are counted apart (_count)
        self.stats.accepted += sum(i in chain for i in path)
        self.stats.branch_tokens += len(proposal) - len(chain)
        self.stats.verified_passes += 1
        self.stats.verified_tokens += n_taken
        return path

    def _count(self, proposal: Proposal, candidates: list[int], depth: int, kept: int | None) -> None:
        """The chain's candidate at this depth checked, and kept or not; a second candidate reached (the draft's
        probability for it counted), and checked where the first was not kept."""
        if not candidates:
            return
        s = self.stats
        s.count(depth, kept == candidates[0])
        if len(candidates) > 1:
            s.branch_odds += proposal.odds[candidates[1]] if proposal.odds else 0.0
            if kept != candidates[0]:
                s.branches, s.branches_kept = s.branches + 1, s.branches_kept + (kept == candidates[1])

    def _decide(self, row, candidates: list[int], params, generator, prompt_ids, output_ids, allowed=None) -> int:
        """The token at this row: a candidate where the rule keeps it, else the model's own draw (among the allowed
        tokens, where a mask is given). Sampled, each candidate in turn is a point mass: kept with its probability
        under what is left of p, else taken out of p (max(p - q, 0), renormalized), so the token is drawn from p."""
        from offload.sampling import sample

        if params.greedy or not candidates:
            return sample(row, params, generator, prompt_ids, output_ids, allowed)
        p, total = probabilities(row, params, prompt_ids, output_ids, allowed), 1.0
        for candidate in candidates:
            if float(torch.rand((), generator=generator)) * total < float(p[candidate]):
                return candidate
            p[candidate] = 0.0
            total = float(p.sum())
            if total <= 0.0:  # p was the point mass itself: the candidate cannot be rejected (it was kept above)
                return candidate
        return int(torch.multinomial(p / total, 1, generator=generator))


class ModelDrafter:
    """A smaller model (a draft model, or the model's own weights in a smaller format) proposes k tokens greedily,
    one pass over its weights each. It keeps each sequence's K and V in a pool of its own: a proposal first runs
    the tokens the sequence gained since its last one (its earlier proposals the model rejected are overwritten by
    position, as the model's are), then decodes. A greedy proposal is a point mass, so the rejection rule keeps
    sampled requests exact. A sequence the pool has no room for gets no proposals."""

    def __init__(self, draft):
        """draft: an offload LLM (its generator and model run the proposals)."""
        from offload.kv_pool import KVPool, pool_capacity

        self.draft, self.generator = draft, draft.generator
        self.capacity = pool_capacity(self.generator.kv_tokens, self.generator.context_len)
        self.pool = KVPool(self.capacity)
        self.cache = self.generator.model.new_cache(1, self.capacity, self.generator.max_batch_size)
        # the ring layers' rings no sequence holds (a model without ring layers: one ring, 0, for every sequence)
        rings = any(kv.ring is not None for kv in self.cache)
        self._rings = list(range(self.generator.max_batch_size)) if rings else None
        self._held: dict[int, tuple[list[int], int, int, list[int]]] = {}  # by id(seq): (blocks, extent, ring,
        # tokens cached)
        self.seconds, self.passes = 0.0, 0  # time spent proposing, passes over the draft's weights
        self.alternatives: list[list] = []  # the last proposals' next likeliest tokens, where asked for (draft_runs)

    def propose(self, tokens: list[int], k: int, seq=None) -> list[int]:
        return self.propose_many([(tokens, k, seq)])[0]

    def propose_many(self, asks: list[tuple[list[int], int, object]], alternatives: bool = False) -> list[list[int]]:
        """Proposals for several sequences ((tokens, k, seq) each), drafted together: each pass over the draft's
        weights serves every sequence still drafting (each catches up on the tokens it gained, then decodes)."""
        runs = [self._run(tokens, k, seq) for tokens, k, seq in asks]
        draft_runs(self, runs, self.cache, self.capacity, alternatives)
        out = []
        for run, (tokens, _, seq) in zip(runs, asks):
            if run is None:
                out.append([])
                continue
            blocks, extent, ring, _ = self._held[id(seq)]
            self._held[id(seq)] = (blocks, extent, ring, tokens + run.output_ids[:-1])  # the last one is not cached
            out.append(run.output_ids)
        return out

    def _run(self, tokens: list[int], k: int, seq):
        """A greedy draft sequence of k tokens after tokens, in blocks of the draft's pool for seq's extent (its
        cached prefix reused); None where it gets no proposals."""
        from offload.sequence import Sequence

        if k <= 0 or seq is None or len(tokens) + k > self.generator.context_len:
            return None
        held = self._held.get(id(seq))
        if held is None:
            blocks = self.pool.alloc(seq.extent)
            if blocks is None or self._rings == []:
                if blocks is not None:
                    self.pool.release(blocks)
                return None
            held = self._held[id(seq)] = (blocks, seq.extent, self._rings.pop() if self._rings else 0, [])
        blocks, extent, ring, cached = held
        same = 0
        for a, b in zip(cached, tokens):
            if a != b:
                break
            same += 1
        run = Sequence(seq.request_id, tokens, SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True))
        run.blocks, run.extent, run.ring, run.n_cached = blocks, extent, ring, min(same, len(tokens) - 1)
        run.generator = torch.Generator()
        return run

    def forget(self, seq) -> None:
        held = self._held.pop(id(seq), None)
        if held is not None:
            self.pool.release(held[0])
            if self._rings is not None:
                self._rings.append(held[2])


def make_speculator(options, draft=None) -> Speculator | None:
    """The Speculator of a speculative options section (offload.options.SpeculativeOptions), or None; draft: the
    loaded draft LLM of methods draft_model and self (offload.api loads it for the model it drafts for)."""
    if options is None or options.method is None:
        return None
    if options.method == "ngram":
        drafter = NgramDrafter(options.prompt_lookup_max, options.prompt_lookup_min)
    else:
        if draft is None:
            from offload.errors import ConfigError

            raise ConfigError(f"speculative method {options.method!r} needs its draft model loaded")
        drafter = SubstituteDrafter(draft) if options.method == "substitute" else ModelDrafter(draft)
    return Speculator(drafter, options.num_speculative_tokens, options.max_speculative_tokens,
                      prior_acceptance(options), options.max_branches)

"""Trees of proposals: where a draft is unsure of a token, its next likeliest one joins the step as a second branch
from the same point (SpecInfer's token trees; which branches, by their expected gain over their cost, as Sequoia
sizes its trees). One verify pass checks every branch (model/step.py's tree_step: positions by depth, keys in the
tree's order); the walk keeps the path the model agrees with (Speculator.verify), and the kept path's K and V move
to the positions they stand for (move_kept).

A branch is a second candidate after a chain's token i - 1: the draft's next likeliest token at depth i. It pays
where the chain reaches depth i and the model takes the branch's token there: then the pass gains the branch and
the model's token after it. Its chance of that: the chain's measured rate of reaching depth i, times the draft's
own probability for the token (a copy of the model's weights prices the model's choices closely), scaled by how
often such probabilities came true in the run (a prior of 1 at first).
"""

from __future__ import annotations

import torch

from offload.attention_sizes import KV_BLOCK
from offload.schedule_step import Proposal

ODDS_PRIOR_WEIGHT = 4.0  # branches the prior calibration of 1 counts as


def children_of(proposal: Proposal) -> dict[int, list[int]]:
    """Each token's candidates after it (-1: the sequence's last token), in the proposal's order: a chain's first."""
    out: dict[int, list[int]] = {}
    for i, parent in enumerate(proposal.parents):
        out.setdefault(parent, []).append(i)
    return out


def branch_gains(alternatives: list[tuple[int, float, float]], chain: list[int], rates: list[float],
                 calibration: float) -> list[tuple[float, int, int, float]]:
    """(expected tokens gained, depth, token, its probability) of a second candidate at each depth of a chain:
    alternatives[i] the draft's (next likeliest token, probability of chain[i], of that token) at depth i; rates
    the chain's measured rates by depth (the last one for deeper ones)."""
    out, reach = [], 1.0
    for i, (token, _, p_alt) in enumerate(alternatives[: len(chain)]):
        if token >= 0 and token != chain[i] and p_alt > 0.0:
            out.append((reach * min(1.0, p_alt * calibration), i, token, p_alt))
        reach *= rates[min(i, len(rates) - 1)]
    return out


def with_branches(chain: list[int], branches: list[tuple[int, int, float]]) -> Proposal:
    """The chain, then each (depth, token, probability) branch as a second candidate after the chain's token at
    depth - 1 (the draft's probability for it kept for the calibration)."""
    tokens, parents = list(chain), list(range(-1, len(chain) - 1))
    odds = [0.0] * len(chain)
    for depth, token, p in sorted(branches):
        tokens.append(token)
        parents.append(depth - 1)
        odds.append(p)
    return Proposal(tuple(tokens), tuple(parents), tuple(odds))


def kept_moves(base: int, path: list[int]) -> list[tuple[int, int]]:
    """(from, to) positions of the kept proposals whose K and V are not where their positions are: proposal i
    wrote at base + 1 + i, and the one kept at depth d stands for position base + d."""
    return [(base + 1 + i, base + d) for d, i in enumerate(path, start=1) if i != d - 1]


def move_kept(cache, seq, moves: list[tuple[int, int]]) -> None:
    """Copy each (from, to) position's K and V in seq's blocks, every layer (the later 'from's lie past every
    'to' before them, so one gather reads them all before any is written)."""
    if not moves:
        return
    table = seq.table(seq.n_blocks)
    slots = [[table[p // KV_BLOCK] + p % KV_BLOCK for p in side] for side in zip(*moves)]
    for layer in cache:
        if layer.ring is not None:
            raise ValueError("a tree's kept path cannot move within a ring layer's cache; propose chains")
        src, dst = (torch.tensor(s, dtype=torch.long, device=layer.k.device) for s in slots)
        for t in (layer.k, layer.v):
            t[:, dst] = t[:, src]

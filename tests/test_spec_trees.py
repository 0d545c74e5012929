"""Trees of proposals (offload/proposal_tree.py): second candidates where the draft is unsure, checked in the same
verify pass. Greedy answers stay the model's own, a sampled token keeps the model's distribution with several
candidates after one token, and the kept path's K and V end up at their positions."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from offload import LLM
from offload.model.step import LayerKV
from offload.proposal_tree import branch_gains, children_of, kept_moves, move_kept, with_branches
from offload.sampling import SamplingParams, probabilities
from offload.schedule_step import Proposal
from offload.speculative import Speculator
from test_speculative import CHI2_999, REPEATS, Fixed, chi_square, greedy, model_dir  # noqa: F401 (a fixture)


def test_a_branch_joins_where_its_gain_pays_and_the_tree_keeps_its_chain_first():
    alts = [(9, 0.98, 0.01), (8, 0.40, 0.35), (7, 0.5, 0.3)]  # the draft sure of the first token, not the others
    gains = branch_gains(alts, [1, 2, 3], [0.8, 0.6, 0.5], calibration=1.0)
    by_depth = {depth: g for g, depth, _, _ in gains}
    assert by_depth[1] > by_depth[0] and by_depth[1] > by_depth[2]  # unsure, and often reached
    assert abs(by_depth[0] - 0.01) < 1e-9 and abs(by_depth[2] - 0.8 * 0.6 * 0.3) < 1e-9  # reached, times p
    tree = with_branches([1, 2, 3], [(1, 8, 0.58)])
    assert tree.tokens == (1, 2, 3, 8) and tree.parents == (-1, 0, 1, 0) and children_of(tree)[0] == [1, 3]
    assert branch_gains([(2, 0.5, 0.4)], [2], [0.5], 1.0) == []  # the draft's own token is no second candidate
    spec = Speculator(SimpleNamespace(alternatives=[alts]), max_branches=1)
    spec.token_cost, spec.depth_rates = (lambda n, drafted=True: 0.01), (lambda: [0.8, 0.6, 0.5])
    (one,) = spec.branch([[1, 2, 3]], [5], 1, 5)
    assert one.tokens == (1, 2, 3, 8)  # the best one only, as max_branches says
    spec.token_cost = lambda n, drafted=True: 10.0  # a token dearer than any gain: a chain
    assert spec.branch([[1, 2, 3]], [5], 1, 5)[0].is_chain


@pytest.mark.parametrize("kept", ["first", "second", "neither"])
def test_two_candidates_after_one_token_keep_the_distribution(kept):
    """Sampled: two candidates after the last token, each a point mass in turn, the token taken is distributed as
    the sampler's own distribution, and each candidate is kept at its own probability."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.2, -0.5, 0.8, -3.0, 0.0])
    params = SamplingParams(temperature=0.8, top_k=6)
    p = probabilities(logits, params)
    order = p.argsort(descending=True).tolist()
    pair = {"first": (order[0], order[1]), "second": (order[3], order[0]), "neither": (order[5], order[4])}[kept]
    tree = Proposal(pair, (-1, -1), (0.0, 0.5))
    speculator, gen, n, taken = Speculator(Fixed([])), torch.Generator().manual_seed(2), 4000, []
    for _ in range(n):
        speculator.verify([logits] * 3, tree, params, gen, [], [], lambda t, row: taken.append(t) or False)
    stat, df = chi_square(Counter(taken), dict(enumerate(p.tolist())), n)
    assert stat < CHI2_999[df], (kept, stat, Counter(taken))
    assert speculator.stats.branches == n - Counter(taken)[pair[0]]  # the second checked where the first was not
    assert speculator.stats.branches_kept == Counter(taken)[pair[1]]


def test_the_kept_path_moves_to_its_positions_in_every_layer():
    """A tree after position 20 keeps its proposal 3 (a second first token) and then 5: their K and V (written at
    keys 24 and 26) move to positions 21 and 22, through the sequence's blocks."""
    assert kept_moves(20, [3, 5]) == [(24, 21), (26, 22)] and kept_moves(20, [0, 1]) == []
    seq = SimpleNamespace(n_blocks=2, table=lambda n: [32, 0])  # positions 16-31 in slots 0-15
    layers = [LayerKV(1, 2, 48, 4, torch.float32) for _ in range(2)]
    for layer in layers:
        layer.k.copy_(torch.randn(layer.k.shape))
        layer.v.copy_(torch.randn(layer.v.shape))
    before = [(layer.k.clone(), layer.v.clone()) for layer in layers]
    move_kept(layers, seq, kept_moves(20, [3, 5]))
    for layer, (k, v) in zip(layers, before):
        for now, was in ((layer.k, k), (layer.v, v)):
            assert torch.equal(now[0, 5], was[0, 8]) and torch.equal(now[0, 6], was[0, 10])  # 24 -> 21, 26 -> 22
            untouched = [s for s in range(49) if s not in (5, 6)]
            assert torch.equal(now[0, untouched], was[0, untouched])


class Oracle:
    """A drafter that knows the greedy answers: it proposes the next token right, the second wrong with the right
    one as its second candidate, the third right (after the second's chain token, so never reached)."""

    def __init__(self, answers: list[list[int]]):
        self.answers, self.alternatives = answers, []

    def propose_many(self, asks, alternatives=False):
        drafts, self.alternatives = [], []
        for tokens, k, _ in asks:
            whole = next(a for a in self.answers if a[: len(tokens)] == tokens)
            right = whole[len(tokens): len(tokens) + 3]
            if len(right) < 3 or k < 3:
                drafts.append(right[:k])
                self.alternatives.append([])
                continue
            wrong = right[1] + 1 if right[1] == 0 else right[1] - 1
            drafts.append([right[0], wrong, right[2]])
            self.alternatives.append([(7, 0.9, 0.05), (right[1], 0.5, 0.4), (7, 0.9, 0.05)])
        return drafts


def test_trees_keep_greedy_answers_and_their_branches_are_kept(model_dir):  # noqa: F811
    """Second candidates kept at every pass (Oracle): answers are plain decoding's, one prompt at a time and in a
    batch (the kept ones' K and V moved, then read by every later token); a substitute draft with every second
    candidate taken (a token costs nothing) keeps them too."""
    plain = LLM(str(model_dir), backend="cpu", max_model_len=256, dtype="fp32")
    prompts, params = ["The quick brown fox", "Hello there", REPEATS], [greedy(24), greedy(9), greedy(20)]
    outs = plain.generate(prompts, params)
    want = [o.token_ids for o in outs]
    oracle = Oracle([list(o.prompt_token_ids) + o.token_ids for o in outs])
    plain.generator.speculator = speculator = Speculator(oracle, num_tokens=3, max_branches=2)
    speculator.token_cost = lambda n, drafted=True: 1e-6
    assert [o.token_ids for o in plain.generate(prompts, params)] == want
    assert [plain.generate(p, q)[0].token_ids for p, q in zip(prompts, params)] == want
    stats = speculator.stats
    assert stats.branches_kept == stats.branches > 10 and stats.kept_at[1] == 0
    assert stats.accepted == sum(stats.kept_at) and stats.branch_tokens >= stats.branches  # chains counted apart
    from offload.profile.report import speculation_lines

    line = speculation_lines({**stats.as_dict(), "draft_share": None})[1]
    assert f"{stats.branch_tokens} carried, {stats.branches} checked" in line
    tree = LLM(str(model_dir), backend="cpu", max_model_len=256, dtype="fp32",
               speculative_config={"method": "substitute", "num_speculative_tokens": 3, "max_branches": 3})
    tree.generator.speculator.token_cost = lambda n, drafted=True: 1e-6
    assert [o.token_ids for o in tree.generate(prompts, params)] == want


@pytest.mark.parametrize("where,compute", [("disk", "stream"), ("gpu", "gpu")])
def test_trees_keep_greedy_answers_on_streamed_and_gpu_layers(tmp_path, where, compute, monkeypatch):
    """The simulated GPU's layers (a tree's tokens read the pool in place, the paged kernel taking its mask over
    the tree's own keys) keep the greedy answers with a second candidate kept at every pass, the kept K and V
    moved on the device's caches."""
    import offload.model.attention as attention

    trees, paged = [], attention.paged_attention
    monkeypatch.setattr(attention, "paged_attention", lambda *a, **kw: (
        trees.append(kw.get("tree_mask") is not None), paged(*a, **kw))[1])
    from conftest import gpu_profile, make_hf_model, save_hf_model
    from offload.engine import run_to_end
    from offload.generate import Generator
    from offload.planner import Placement
    from offload.runtime.backends.sim import SimBackend
    from offload.runtime.executor import PlacedModel
    from offload.sequence import Sequence
    from offload.weights.loader import Checkpoint
    from offload.weights.model_files import model_spec
    from offload.weights.sources import CheckpointSource

    path = save_hf_model(make_hf_model("llama"), tmp_path / "tiny")
    spec = model_spec(path)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 3, 9, 3, 9], [11, 12, 13]]

    def run(speculator):
        model = PlacedModel(spec, CheckpointSource(Checkpoint(path), spec, torch.float32, "none"),
                            Placement.uniform(spec, where, compute, page_cache=frozenset()), SimBackend(gpu_profile()))
        generator = Generator(model, max_batch_size=4, max_model_len=64)
        generator.speculator = speculator
        seqs = [Sequence(i, p, greedy(16)) for i, p in enumerate(prompts)]
        run_to_end(generator, seqs)
        return [s.output_ids for s in seqs]

    want = run(None)
    speculator = Speculator(Oracle([p + w for p, w in zip(prompts, want)]), num_tokens=3, max_branches=2)
    speculator.token_cost = lambda n, drafted=True: 1e-6
    assert run(speculator) == want and speculator.stats.branches_kept > 3
    assert any(trees)  # the streamed layers run on the simulated GPU too


def test_trees_ride_beside_prompt_chunks_in_mixed_steps(model_dir):  # noqa: F811
    """A long prompt prefilled in chunks in the same steps that verify other sequences' trees (the fused layer's
    attention then goes token by token for the whole step): answers are plain decoding's with the same chunks."""
    long = " ".join(["alpha beta gamma delta"] * 8)
    prompts, params = ["The quick brown fox", long, "Hello there"], [greedy(30), greedy(8), greedy(30)]
    plain = LLM(str(model_dir), backend="cpu", max_model_len=256, dtype="fp32")
    plain.generator.prefix_caching, plain.generator.step_tokens = False, 24  # the whole prompt prefilled again
    outs = plain.generate(prompts, params)
    want = [o.token_ids for o in outs]
    oracle = Oracle([list(o.prompt_token_ids) + o.token_ids for o in outs])
    plain.generator.speculator = speculator = Speculator(oracle, num_tokens=3, max_branches=2)
    speculator.token_cost = lambda n, drafted=True: 1e-6
    mixed = []
    run_step = plain.generator.run_step
    plain.generator.run_step = lambda s, *a: (mixed.append(bool(s.chunks) and any(
        not p.is_chain for _, p in s.verified)), run_step(s, *a))[1]
    assert [o.token_ids for o in plain.generate(prompts, params)] == want
    assert any(mixed) and speculator.stats.branches_kept > 0

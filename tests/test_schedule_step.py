"""The step object (issue 45 item 4): what a step holds is decided before it runs, from the running sequences and
the drafter's proposals alone; built here from hand-made Sequences, no model. The engine steps the generator and
the generator builds no engine: the import graph shows the one direction."""

from __future__ import annotations

import torch

from offload.sampling import SamplingParams
from offload.schedule_step import Proposal, decoding, schedule_step
from offload.sequence import Sequence


def _seq(rid, prompt_len: int, n_cached: int, outputs=(), base: int = 0, **params) -> Sequence:
    seq = Sequence(rid, list(range(100 + 10 * len(str(rid)), 100 + 10 * len(str(rid)) + prompt_len)),
                   SamplingParams(max_tokens=8, **params), output_ids=list(outputs))
    seq.n_cached, seq.extent, seq.ring = n_cached, prompt_len + 8, base // 10 + 1
    seq.blocks = [base + 16 * i for i in range(4)]  # one run of blocks from slot base (more than it reaches)
    return seq


def _groups(step) -> list[tuple[list, list]]:
    """Each group's positions and its sequences' first slots (their block tables are contiguous extents, one entry
    per block of 16 its positions reach); its rings are each sequence's (the sliding layers' caches)."""
    out = []
    for positions, tables, rings, _ in step.groups:
        bases = tables[:, 0]
        assert rings.tolist() == [b // 10 + 1 for b in bases.tolist()]
        assert torch.equal(tables, bases[:, None] + 16 * torch.arange(int(positions.max()) // 16 + 1))
        out.append((positions.tolist(), bases.tolist()))
    return out


def test_decode_tokens_are_one_group_and_each_samples_its_own_row():
    a, b = _seq("a", 5, 5, [7], base=0), _seq("b", 3, 3, [8, 9], base=40)
    step = schedule_step([a, b], step_tokens=16)
    assert step.phase == "decode" and step.decode == (a, b) and not step.chunks and not step.verified
    assert _groups(step) == [([[5], [4]], [0, 40])]  # each sequence's last token, at its n_tokens - 1
    assert step.tokens == (7, 9)
    assert step.samples == ((a, 0), (b, 1)) and step.logit_rows == (0, 1) and step.n_logits == 2
    # keys: a sees 6, b sees 5; cached positions read: the same
    s = step.shape
    assert (s.n_prompt_tokens, s.n_decode_tokens, s.n_seqs, s.n_logits, s.attended_keys, s.kv_read_tokens) == \
        (0, 2, 2, 2, 11, 11)


def test_a_verified_sequence_carries_its_last_token_and_proposals_in_a_group_of_its_own():
    a, b = _seq("a", 5, 5, [7], base=0), _seq("b", 3, 3, [8, 9], base=40)
    step = schedule_step([a, b], step_tokens=16, proposals={id(b): Proposal.chain([21, 22])})
    assert step.decode == (a,) and step.verified == ((b, Proposal((21, 22), (-1, 0))),)
    assert _groups(step) == [([[5]], [0]), ([[4, 5, 6]], [40])]
    assert step.tokens == (7, 9, 21, 22)
    assert step.samples == ((a, 0),) and step.verify_rows == ((1, 2, 3),) and step.logit_rows == (0, 1, 2, 3)
    # keys: a 6; b's three tokens 5 + 6 + 7 = 3 * 5 + 3. Read: a 6, b 5 + 2
    s = step.shape
    assert (s.phase, s.n_decode_tokens, s.n_seqs, s.n_logits, s.attended_keys, s.kv_read_tokens) == \
        ("decode", 4, 2, 4, 24, 13)


def test_an_empty_proposal_is_a_plain_decode_token():
    a = _seq("a", 5, 5, [7])
    step = schedule_step([a], step_tokens=16, proposals={id(a): Proposal.chain([])})
    assert step.decode == (a,) and not step.verified and step.tokens == (7,)


def test_prompt_chunks_fill_the_room_left_and_only_a_chunk_ending_its_prompt_samples():
    d = _seq("d", 4, 4, [5], base=0)
    b = _seq("b", 10, 4, base=20)  # 6 prompt tokens left: this step ends its prompt
    c = _seq("c", 20, 0, base=40)  # 5 of its 20 fit the step's 1 + 6 + 5 = 12 tokens
    late = _seq("late", 3, 0, base=70)  # no room left
    step = schedule_step([d, b, c, late], step_tokens=12)
    assert step.phase == "prefill" and step.chunks == ((b, 6), (c, 5))
    assert _groups(step) == [([[4]], [0]), ([[4, 5, 6, 7, 8, 9]], [20]), ([[0, 1, 2, 3, 4]], [40])]
    assert step.tokens == (5, *b.prompt_ids[4:10], *c.prompt_ids[0:5])
    assert step.samples == ((d, 0), (b, 6)) and step.logit_rows == (0, 6)  # row 6: b's last prompt token
    # keys: d 5; b 6 * 4 + 21; c 15. Read: d 5, b 4 + 6, c 0 + 5
    s = step.shape
    assert (s.n_prompt_tokens, s.n_decode_tokens, s.n_seqs, s.n_logits, s.attended_keys, s.kv_read_tokens) == \
        (11, 1, 3, 2, 65, 20)
    assert b.n_cached == 4 and not b.output_ids  # scheduling changes no sequence


def test_a_step_of_chunks_that_end_no_prompt_computes_no_logits():
    c = _seq("c", 20, 3)
    step = schedule_step([c], step_tokens=8)
    assert step.chunks == ((c, 8),) and step.samples == () and step.n_logits == 0


def test_prompt_logprob_rows_score_the_prompt_tokens_each_chunk_predicts():
    b = _seq("b", 10, 4, prompt_logprobs=1)  # ends its prompt: rows for prompt tokens 5..9, its last row samples
    c = _seq("c", 20, 0, prompt_logprobs=0)  # rows 0..4 predict prompt tokens 1..5
    step = schedule_step([b, c], step_tokens=11)
    assert step.chunks == ((b, 6), (c, 5))
    assert step.scored == ((b, (0, 1, 2, 3, 4), tuple(b.prompt_ids[5:10])),
                           (c, (6, 7, 8, 9, 10), tuple(c.prompt_ids[1:6])))
    assert step.samples == ((b, 5),)
    assert step.logit_rows == (5, 0, 1, 2, 3, 4, 6, 7, 8, 9, 10)  # sampled, then scored: one pass


def test_n_samples_take_the_prompts_row_and_its_cache_when_the_prompt_ends():
    first = _seq("r", 6, 0, base=0, n=3, temperature=1.0)
    first.fork()
    for i, other in enumerate(first.samples[1:], 1):
        other.blocks, other.extent = [20 * i + 16 * j for j in range(4)], first.extent
    step = schedule_step(first.samples, step_tokens=16)
    assert step.chunks == ((first, 6),)  # the other samples wait for the first one's prefill
    assert step.samples == ((first, 5), (first.samples[1], 5), (first.samples[2], 5))
    assert step.shared == ((first, first.samples[1]), (first, first.samples[2]))
    assert step.logit_rows == (5,) and step.shape.n_seqs == 1


def test_proposals_count_against_the_steps_tokens():
    a, b = _seq("a", 5, 5, [7]), _seq("b", 3, 3, [9])
    c = _seq("c", 30, 0)
    step = schedule_step([a, b, c], step_tokens=10, proposals={id(a): Proposal.chain([1, 2, 3])})
    assert step.chunks == ((c, 10 - 2 - 3),)


def test_the_older_schedule_holds_decode_back_while_a_prompt_prefills():
    a, c = _seq("a", 5, 5, [7]), _seq("c", 30, 0)
    assert decoding([a, c], mixed=False) == [] and decoding([a, c]) == [a]
    step = schedule_step([a, c], step_tokens=8, mixed=False, proposals={id(a): Proposal.chain([1])})
    assert step.decode == () and step.verified == () and step.chunks == ((c, 8),)


def test_a_tree_of_proposals_takes_its_positions_by_depth_and_its_keys_by_order():
    assert Proposal.chain([4, 5, 6]).parents == (-1, 0, 1) and Proposal.chain([4, 5, 6]).depths == (1, 2, 3)
    tree = Proposal((4, 5, 6), (-1, -1, 0))  # two first tokens, a third after the first
    assert not tree.is_chain and tree.depths == (1, 1, 2)
    a = _seq("a", 5, 5, [7])  # 6 tokens: its last at position 5
    step = schedule_step([a], step_tokens=16, proposals={id(a): tree})
    (positions, tables, _, parents), = step.groups
    assert positions.tolist() == [[5, 6, 6, 7]] and parents == (-1, -1, 0)
    assert tables.shape[1] == 1 and step.tokens == (7, 4, 5, 6) and step.verify_rows == ((0, 1, 2, 3),)
    chain = schedule_step([a], step_tokens=16, proposals={id(a): Proposal.chain([4, 5])})
    assert chain.groups[0][3] is None


def test_the_engine_steps_the_generator_and_the_generator_builds_no_engine():
    from test_layout import _imports, _modules

    modules = _modules()
    graph = {m: _imports(p, modules) for m, p in modules.items()}
    seen, todo = set(), ["offload.generate"]
    while todo:
        for dep in graph[todo.pop()] - seen:
            seen.add(dep)
            todo.append(dep)
    assert "offload.engine" not in seen  # at any depth, function-level imports included
    assert "offload.generate" in graph["offload.engine"]

    from offload.generate import Generator

    assert not hasattr(Generator, "run")  # offload.engine.run_to_end is the loop over a fixed list

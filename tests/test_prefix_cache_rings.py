"""The prefix cache on models whose sliding layers keep rings (Gemma 2/3, gpt-oss): a hit takes the blocks whose
holder's ring still has the window before them, copies those ring slots, and gives the tokens an engine without the
cache gives (fp32, greedy); kept runs hold their rings and give them back when running requests need them."""

from __future__ import annotations

import pytest
import torch

from conftest import make_hf_model, save_hf_model
from offload import SamplingParams
from offload.engine import Engine
from offload.generate import Generator
from offload.model.step import LayerKV
from offload.prefix_cache import BLOCK_TOKENS
from offload.spec import load_spec
from offload.weights.loader import Checkpoint
from offload.weights.sources import load_model

FAMILIES = {"gemma2": ("gemma2", dict(num_attention_heads=4, num_key_value_heads=2)),
            "gpt-oss": ("gpt_oss", dict(num_attention_heads=4, num_key_value_heads=2))}
CONTEXT, SLOTS, BATCH = 256, 400, 2  # rings of 144 slots (window 6 and the slack), two of them in a row of 400


@pytest.fixture(scope="module", params=list(FAMILIES))
def model(request, tmp_path_factory):
    arch, overrides = FAMILIES[request.param]
    folder = save_hf_model(make_hf_model(arch, max_position_embeddings=CONTEXT, **overrides),
                           tmp_path_factory.mktemp(request.param))
    return load_model(Checkpoint(folder), load_spec(folder))


def _engine(model, on: bool) -> Engine:
    g = Generator(model, max_model_len=CONTEXT, max_batch_size=BATCH, step_tokens=96)
    g.prefix_caching, g.prefix_host_bytes = on, 1 << 20
    return Engine(g, kv_slots=SLOTS)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(1, 160, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _turns(engine: Engine, prompts: list[list[int]]) -> list:
    seqs = []
    for i, prompt in enumerate(prompts):
        seqs.append(engine.add(i, prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)))
        while engine.has_work():
            engine.step()
    return seqs


def test_hits_take_what_the_ring_still_holds_and_give_the_uncached_tokens(model):
    engine = _engine(model, True)
    rings = [layer for layer in engine.cache if isinstance(layer, LayerKV) and layer.ring is not None]
    assert rings and engine.prefix.host_bytes == 0  # the model's sliding layers are rings; no host tier for them
    first = _ids(180, 1)
    seqs = _turns(engine, [first])
    # the next turn takes the whole first one (its ring has the window before it); a prompt sharing only the first
    # 40 tokens finds them gone from the ring (180 + 6 - 1 keys written, 144 slots) and computes them
    later = [first + seqs[0].output_ids + _ids(20, 2), first[:40] + _ids(30, 3), first[:150] + _ids(10, 4)]
    seqs += _turns(engine, later)
    want = [s.output_ids for s in _turns(_engine(model, False), [first] + later)]
    assert [s.output_ids for s in seqs] == want
    written = 180 + 6 - 1
    assert seqs[1].n_prefix_hit == written // BLOCK_TOKENS * BLOCK_TOKENS
    assert seqs[2].n_prefix_hit == 0
    # two rings: the third prompt took the first run's (least recently used), so of the 150 tokens the last prompt
    # shares with the first only the third prompt's 2 blocks are left
    assert seqs[3].n_prefix_hit == 2 * BLOCK_TOKENS
    assert sorted(k.ring for k in engine.prefix.kept if k.ring is not None) == [0, 1]


def test_kept_runs_give_their_rings_back_to_new_requests(model):
    engine = _engine(model, True)
    prompts = [_ids(40, 10 + i) for i in range(3)]  # each ends holding its ring in a kept run: one more than rings
    prompts.append(prompts[-1] + [7])  # the newest run kept its ring: a hit
    seqs = _turns(engine, prompts)
    assert [s.output_ids for s in seqs] == [s.output_ids for s in _turns(_engine(model, False), prompts)]
    assert [s.n_prefix_hit for s in seqs] == [0, 0, 0, 2 * BLOCK_TOKENS]
    held = [k.ring for k in engine.prefix.kept if k.ring is not None]
    assert len(held) + len(engine._rings) == BATCH and len(set(held + engine._rings)) == BATCH

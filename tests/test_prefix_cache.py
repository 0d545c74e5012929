"""The prefix cache (offload/prefix_cache.py): prompts that begin as earlier ones did take those blocks' K and V
instead of computing them, and give the tokens they give without the cache (fp32, greedy) on the CPU, on the strict
simulated GPU and from the host tier; a request whose prefix another is prefilling waits for it; eviction frees kept
runs, least recently used first, and never loses the pool's slots; options, usage and metrics say what was reused."""

from __future__ import annotations

import threading

import pytest
import torch

from conftest import gpu_profile, make_hf_model, save_hf_model
from offload import LLM, SamplingParams
from offload.api import prefix_cache_options
from offload.engine import Engine, run_to_end
from offload.errors import ConfigError
from offload.generate import Generator
from offload.planner.placement import Placement
from offload.prefix_cache import BLOCK_TOKENS, Kept, PrefixCache, block_names
from offload.runtime.backends.sim import SimBackend
from offload.runtime.executor import PlacedModel
from offload.sequence import Sequence
from offload.spec import load_spec
from offload.weights.loader import Checkpoint
from offload.weights.sources import CheckpointSource

CONTEXT = 128


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_hf_model(make_hf_model("llama", num_hidden_layers=2, max_position_embeddings=CONTEXT), tmp_path_factory.mktemp("prefix") / "tiny")


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(str(folder), backend="cpu", max_model_len=CONTEXT)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(1, 160, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SHARED = _ids(3 * BLOCK_TOKENS + 5, 1)  # three whole blocks and a few tokens more


def _greedy(n: int = 6, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


def _generator(model, on: bool = True, host_bytes: int = 0) -> Generator:
    g = Generator(model, max_model_len=CONTEXT, max_batch_size=4, step_tokens=24)
    g.prefix_caching, g.prefix_host_bytes = on, host_bytes
    return g


def _turns(engine: Engine, prompts: list[list[int]], **kw) -> list[Sequence]:
    """Each prompt run to its end before the next one starts (a chat's turns)."""
    seqs = []
    for i, prompt in enumerate(prompts):
        seqs.append(engine.add(i, prompt, _greedy(**kw)))
        while engine.has_work():
            engine.step()
    return seqs


def _check_pool(engine: Engine) -> None:
    """Every block is free or in a kept run once nothing runs, and no block is in two places."""
    blocks = [b for k in engine.prefix.kept if k.slots is not None for b in k.slots] + engine.pool.free
    assert len(blocks) == len(set(blocks))
    assert engine.pool.n_free + engine.prefix.pool_slots == engine.capacity


def test_turns_sharing_a_prefix_take_its_blocks_and_give_the_uncached_tokens(llm):
    prompts = [SHARED + _ids(4, 2), SHARED + _ids(9, 3), SHARED[:20] + _ids(30, 4), _ids(40, 5)]
    want = [s.output_ids for s in _turns(Engine(_generator(llm.model, on=False)), prompts)]
    engine = Engine(_generator(llm.model))
    seqs = _turns(engine, prompts)
    assert [s.output_ids for s in seqs] == want
    assert [s.n_prefix_hit for s in seqs] == [0, 3 * BLOCK_TOKENS, BLOCK_TOKENS, 0]
    assert engine.prefix.hits == 4 * BLOCK_TOKENS and engine.prefix.queries == sum(map(len, prompts))
    # a prompt that is the first one's whole prompt and answer takes every block of them
    again = _turns(engine, [prompts[0] + seqs[0].output_ids + _ids(3, 6)])[0]
    assert again.n_prefix_hit == (len(prompts[0]) + len(seqs[0].output_ids) - 1) // BLOCK_TOKENS * BLOCK_TOKENS
    _check_pool(engine)


def test_the_last_prompt_token_is_always_computed_and_prompt_logprobs_take_no_blocks(llm):
    engine = Engine(_generator(llm.model))
    whole = _ids(2 * BLOCK_TOKENS, 7)  # exactly two blocks
    first, same, scored = _turns(engine, [whole, whole, whole + [3]], n=3)[:2] + \
        _turns(engine, [whole + [3]], prompt_logprobs=1, n=3)
    assert same.n_prefix_hit == BLOCK_TOKENS and same.output_ids == first.output_ids
    assert scored.n_prefix_hit == 0 and len(scored.prompt_logprobs) == len(whole) + 1


def test_requests_sharing_a_prefix_wait_for_its_prefill_instead_of_computing_it(llm):
    prompts = [SHARED + _ids(3, 10 + i) for i in range(4)]
    want = [s.output_ids for s in _turns(Engine(_generator(llm.model, on=False)), prompts)]
    seqs = [Sequence(i, p, _greedy()) for i, p in enumerate(prompts)]
    g = _generator(llm.model)
    prefilled = []
    g.update = (lambda update: lambda sched, *a, **k: (prefilled.extend(n for _, n in sched.chunks),
                                                        update(sched, *a, **k)))(g.update)
    run_to_end(g, seqs)
    assert [s.output_ids for s in seqs] == want
    assert sorted(s.n_prefix_hit for s in seqs) == [0] + [3 * BLOCK_TOKENS] * 3
    assert sum(prefilled) == sum(map(len, prompts)) - 3 * 3 * BLOCK_TOKENS  # the shared blocks computed once


def test_a_full_pool_evicts_kept_runs_least_recently_used_first_and_the_host_tier_gives_them_back(llm):
    prompts = [_ids(40, 20 + i) for i in range(5)]
    want = [s.output_ids for s in _turns(Engine(_generator(llm.model, on=False), kv_slots=96), prompts)]
    for host_bytes in (0, 1 << 20):
        engine = Engine(_generator(llm.model, host_bytes=host_bytes), kv_slots=96)  # two requests' extents
        first = _turns(engine, prompts)
        _check_pool(engine)
        assert [s.output_ids for s in first] == want
        newest = [engine.prefix.index.get(name, (None,))[0] for p in prompts[3:] for name in block_names(p, 2)]
        assert all(k is not None and k.slots is not None for k in newest)  # the two newest runs stay whole
        # the oldest prompts were evicted: without a host tier they are computed again, with one they are copied
        again = _turns(engine, prompts[:2])
        assert [s.output_ids for s in again] == want[:2]
        assert [s.n_prefix_hit for s in again] == ([0, 0] if not host_bytes else [32, 32])
        _check_pool(engine)
        assert engine.prefix.host_used <= host_bytes


def test_a_run_a_hit_copies_from_is_not_evicted_for_its_extent(llm):
    cache = PrefixCache(Engine(_generator(llm.model)).cache, pool := __import__("offload.kv_pool").kv_pool.KVPool(64))
    held = pool.alloc(64)
    kept = Kept([b"x"], 0, held, 0.0)
    cache.kept.append(kept)
    kept.pins = 1
    assert cache.alloc(10) is None and kept in cache.kept  # pinned: kept, and nothing to give
    kept.pins = 0
    assert cache.alloc(10) == [0] and not cache.kept


def test_eviction_takes_the_deepest_blocks_of_a_run_first_and_keeps_its_head(llm):
    """A pool that needs one block's room takes it from the tail of the least recently used run: the run's first
    blocks stay indexed and in place, the tail goes to the host tier (or is dropped without one)."""
    names = [b"a", b"b", b"c"]
    for host in (0, 1 << 20):
        cache = PrefixCache(Engine(_generator(llm.model)).cache, pool := __import__("offload.kv_pool").kv_pool.KVPool(64),
                            host_bytes=host)
        old, new = Kept(list(names), 0, pool.alloc(48), 0.0), Kept([b"z"], 0, pool.alloc(16), 1.0)
        cache.kept += [old, new]
        for kept in (old, new):
            for i, name in enumerate(kept.names):
                cache.index[name] = (kept, kept.first + i)
        assert cache.alloc(16) == [32]  # the old run's third block, not the newer run nor the old run's head
        assert old.names == [b"a", b"b"] and old.slots == [0, 16] and new.slots == [48]
        assert cache.index[b"a"] == (old, 0) and cache.index[b"b"] == (old, 1)
        tail = cache.index.get(b"c", (None, -1))
        assert (tail[0] is not None and tail[0].slots is None and tail[1] == 2) == bool(host)


def test_the_strict_simulated_gpu_takes_hits_in_its_own_cache(folder, llm):
    spec = load_spec(folder)
    for placement in (Placement.uniform(spec, "gpu", "gpu"), Placement.random(spec, 3)):
        model = PlacedModel(spec, CheckpointSource(Checkpoint(folder), spec, torch.float32), placement,
                            SimBackend(gpu_profile()))
        prompts = [SHARED + _ids(4, 30), SHARED + _ids(6, 31)]
        want = [s.output_ids for s in _turns(Engine(_generator(llm.model, on=False)), prompts)]
        seqs = _turns(Engine(_generator(model)), prompts)
        assert [s.output_ids for s in seqs] == want and seqs[1].n_prefix_hit == 3 * BLOCK_TOKENS


def test_options_turn_it_off_and_bound_the_host_tier(folder, llm):
    room = llm.plan.tier("cpu").budget_bytes - llm.plan.tier("cpu").total_bytes
    assert llm.generator.prefix_caching and llm.generator.prefix_host_bytes == room // 2  # half the plan's room
    off = LLM(str(folder), backend="cpu", max_model_len=CONTEXT, enable_prefix_caching=False)
    assert not off.generator.prefix_caching
    outs = off.generate([SHARED + [5], SHARED + [6]], _greedy())
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    on = llm.generate([SHARED + [5], SHARED + [6]], _greedy())
    assert sorted(o.num_cached_tokens for o in on) == [0, 3 * BLOCK_TOKENS]
    assert [o.token_ids for o in on] == [o.token_ids for o in outs]
    assert prefix_cache_options({"host_memory": "1GiB"}).host_memory == 1 << 30
    with pytest.raises(ConfigError, match=r"prefix_cache\['enabled'\]"):
        prefix_cache_options({"enabled": "sometimes"})
    with pytest.raises(ConfigError, match="plan leaves .* of memory.cpu free"):
        LLM(str(folder), backend="cpu", max_model_len=CONTEXT, cpu_memory="2GiB", prefix_cache_host_memory="3GiB")


def test_the_cost_model_prices_a_hit_by_the_tokens_left_to_compute_and_the_copy():
    from offload.planner import PlanRequest, plan_for
    from offload.planner.prefix_price import price_prefix_hit
    from offload.weights.default_model import resolve_model
    from offload.weights.model_files import model_spec

    request = PlanRequest.of(model="llama-3.1-8b", hardware="rtx4090-ddr5", gpu_memory="8GiB", cpu_memory="32GiB",
                             max_model_len=4096)
    spec, hw = model_spec(resolve_model(request.model.path)), request.profile()
    plan = plan_for(spec, hw, request)
    none, most, whole = (price_prefix_hit(plan, spec, hw, r) for r in (0.0, 0.75, 1.0))
    assert none.copy_s == 0 and none.hit_prefill_s == pytest.approx(none.prefill_s) and none.speedup == 1
    assert most.computed_s == pytest.approx(none.prefill_s * (1 - round(0.75 * most.prompt_tokens)
                                                              / most.prompt_tokens))
    assert 0 < most.copy_s < most.computed_s and 1 < most.speedup < whole.speedup  # the last token is computed
    with pytest.raises(ConfigError, match="from 0 to 1"):
        price_prefix_hit(plan, spec, hw, 1.5)


def test_llm_calls_take_what_earlier_calls_left_in_the_host_tier(folder):
    """LLM.generate runs each call in an engine of its own: the kept runs move to the host tier when it ends, and
    the next call (a chat's next turn) takes them from there; without a host tier nothing carries over."""
    prompts = [SHARED + [5], SHARED + [9, 9]]
    for host in ("8MiB", "0"):
        llm = LLM(str(folder), backend="cpu", max_model_len=CONTEXT, prefix_cache_host_memory=host)
        first = llm.generate(prompts[0], _greedy())[0]
        second = llm.generate(prompts[1], _greedy())[0]
        alone = LLM(str(folder), backend="cpu", max_model_len=CONTEXT, enable_prefix_caching=False)
        assert second.token_ids == alone.generate(prompts[1], _greedy())[0].token_ids
        assert first.num_cached_tokens == 0
        assert second.num_cached_tokens == (3 * BLOCK_TOKENS if host != "0" else 0)
        carried = llm.generator.prefix_carried
        assert all(k.slots is None for k in carried) and bool(carried) == (host != "0")


def test_a_batch_feeds_requests_that_begin_alike_side_by_side():
    """The Batch API's queue with the prefix cache on: requests sharing a system prompt or a prompt's beginning come
    next to each other whatever the file's order; with it off, the file's order."""
    from offload.jobs.batch import Request
    from offload.serve.batch_runner import prefix_order

    def chat(cid, system, user):
        return Request(cid, 1, "/v1/chat/completions", SamplingParams(),
                       messages=[{"role": "system", "content": system}, {"role": "user", "content": user}])

    def text(cid, prompt):
        return Request(cid, 1, "/v1/completions", SamplingParams(), prompt=prompt)

    reqs = [chat("a", "You are A.", "1"), chat("b", "You are B.", "2"), chat("c", "You are A.", "3"),
            chat("d", "You are B.", "4"), text("e", "few-shot X: q1"), text("f", "zzz"), text("g", "few-shot X: q2")]
    order = [r.custom_id for r in prefix_order(reqs, True)]
    assert abs(order.index("a") - order.index("c")) == 1 and abs(order.index("b") - order.index("d")) == 1
    assert abs(order.index("e") - order.index("g")) == 1 and sorted(order) == list("abcdefg")
    assert [r.custom_id for r in prefix_order(reqs, False)] == list("abcdefg")


def test_a_hit_whose_run_holds_the_blocks_its_request_needs_is_let_go(llm):
    """A pool sized for one request at a time (run_to_end's at batch 1) and a second prompt sharing the first's
    head: its hit pins the first's kept run, whose other blocks are the ones the second needs, and nothing running
    will free more. The request goes without the hit (the engine spun on it for ever, LLM.generate hung); answers as
    each prompt alone."""
    first, second = SHARED + _ids(20, 2), SHARED[:2 * BLOCK_TOKENS] + _ids(24, 3)
    alone = [_run(llm, [p])[0] for p in (first, second)]
    errors, got = [], []
    run = threading.Thread(target=lambda: _catch(errors, got, llm, [first, second]), daemon=True)
    run.start()
    run.join(timeout=60)
    assert not run.is_alive(), "the engine spun on the second request for 60 s"
    assert not errors and got[0] == alone


def _run(llm, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of prompts through run_to_end at batch 1 (its pool: the longest request's blocks)."""
    gen = Generator(llm.model, max_model_len=CONTEXT, max_batch_size=1, step_tokens=64)
    seqs = [Sequence(i, p, _greedy(8)) for i, p in enumerate(prompts)]
    run_to_end(gen, seqs)
    return [s.output_ids for s in seqs]


def _catch(errors: list, got: list, *args) -> None:
    try:
        got.append(_run(*args))
    except BaseException as e:  # noqa: BLE001 - raised again on the test's thread
        errors.append(e)

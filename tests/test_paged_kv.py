"""The paged KV pool (issue 47 item 1): a sequence's keys are found through its block table (blocks of KV_BLOCK
keys, each anywhere in the pooled row), on every attention path: the fused C++ attention (each kernel path, fp32 and
bf16 caches, the tiles and the per-query loop), the torch prefill (gathered keys) and decode (paged_attention), and
the prefix cache maps a kept run's blocks into a new request's table instead of copying them.

A table whose blocks are scattered gives what the contiguous extent gives: the same keys in a different place, so
the C++ paths agree to 1e-6 x max |out| (the first chunk of 8 keys starts at a multiple of 8 with a table, which
may change the summation order under a window) and the torch paths exactly up to summation order (1e-6)."""

from __future__ import annotations

import pytest
import torch

import offload.kernels.layer as fused
from conftest import make_hf_model, save_hf_model
from offload import LLM, SamplingParams
from offload.attention_sizes import KV_BLOCK
from offload.engine import Engine
from offload.generate import Generator
from offload.kernels import ACTIVE_PATH
from offload.model.attention import attend
from offload.model.step import LayerKV, extent_tables, make_step
from offload.rope_spec import RopeSpec
from offload.spec import ModelSpec

PATHS = ["scalar"] + [p for p in ("avx2", "avx512") if ACTIVE_PATH in ("avx2", "avx512") and
                      (p == "avx2" or ACTIVE_PATH == "avx512")]
SLOTS = 20 * KV_BLOCK  # the pooled row's slots (one more: the trash slot)


def _spec(n_heads: int, n_kv: int, head_dim: int, window: int | None = None) -> ModelSpec:
    return ModelSpec(architecture="llama", vocab_size=64, hidden_size=n_heads * head_dim, intermediate_size=96,
                     n_layers=1, n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, rms_norm_eps=1e-5,
                     rope=RopeSpec(), max_position_embeddings=SLOTS, sliding_window=window)


def _scattered(n_seqs: int, n_blocks: int, seed: int = 0) -> torch.Tensor:
    """[n_seqs, n_blocks] block tables over the pooled row: every block somewhere else, none shared."""
    order = torch.randperm(SLOTS // KV_BLOCK, generator=torch.Generator().manual_seed(seed))[: n_seqs * n_blocks]
    return (order * KV_BLOCK).view(n_seqs, n_blocks)


def _steps(spec, tables, lengths):
    """A prefill of lengths[b] tokens per sequence, then one decode token each, over tables."""
    width = max(lengths)
    positions = torch.zeros(len(lengths), width, dtype=torch.long)
    valid = torch.zeros_like(positions, dtype=torch.bool)
    for b, n in enumerate(lengths):
        positions[b, :n], valid[b, :n] = torch.arange(n), True
    rows = torch.zeros(len(lengths), dtype=torch.long)
    prefill = make_step(spec, torch.float32, positions, valid, SLOTS, rows, "prefill", tables)
    decode = make_step(spec, torch.float32, torch.tensor(lengths)[:, None], torch.ones(len(lengths), 1, dtype=torch.bool),
                       SLOTS, rows, "decode", tables)
    return prefill, decode


def _fused_outputs(spec, tables, lengths, kv_dtype, path, sinks=None):
    """cached_attention's outputs of the prefill and the decode step (the same q, k, v whatever the tables)."""
    kv = LayerKV(1, spec.n_kv_heads, SLOTS, spec.head_dim, kv_dtype)
    view, outs = fused.kv_view(kv), []
    for i, step in enumerate(_steps(spec, tables, lengths)):
        n = step.positions.numel()
        qkv = torch.randn(n, spec.q_size + 2 * spec.kv_size, generator=torch.Generator().manual_seed(i)) * 2
        outs.append(fused.cached_attention(spec, qkv, fused.step_table(spec, step, view), view, path, sinks=sinks)
                    .view(*step.positions.shape, -1)[step.valid])
    return outs, kv


@pytest.mark.skipif(ACTIVE_PATH not in ("avx2", "avx512"), reason=f"the SIMD attention paths ({ACTIVE_PATH})")
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,sinks", [(None, False), (None, True), (200, True)])
def test_a_long_decode_split_between_threads_gives_the_per_query_loops_attention(kv_dtype, window, sinks):
    """A decode step (one token per sequence) reads whole K and V rows in splits of its keys, one per thread, and
    merges the splits' softmaxes (with the sink) after: with two threads and 290 keys each query's keys are split
    in two, and the result is the scalar path's per-query loop's within 1e-5 x max |out|."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        spec = _spec(8, 2, 64, window)
        tables, sink = _scattered(1, 19, seed=5), torch.linspace(-1, 3, 8) if sinks else None
        got = _fused_outputs(spec, tables, [290], kv_dtype, ACTIVE_PATH, sink)[0][1]
        want = _fused_outputs(spec, tables, [290], kv_dtype, "scalar", sink)[0][1]
    finally:
        torch.set_num_threads(threads)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.skipif(ACTIVE_PATH not in ("avx2", "avx512"), reason=f"the SIMD attention paths ({ACTIVE_PATH})")
@pytest.mark.parametrize("path", [p for p in PATHS if p != "scalar"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_heads,n_kv,keys", [(16, 4, 60), (9, 3, 100), (8, 8, 33)])
def test_a_short_decode_is_shared_out_between_threads_by_kv_head(path, kv_dtype, n_heads, n_kv, keys):
    """A decode step of one sequence over fewer keys than a split (128) is one task of keys, so two threads take
    its KV heads in two parts (on each SIMD path; AVX2's bf16 cache in its widened order): the output is one
    thread's to the bit (each head sums in the same order) and the scalar path's per-query loop's within 1e-5 x
    max |out|."""
    spec, tables = _spec(n_heads, n_kv, 64), _scattered(1, keys // KV_BLOCK + 1, seed=3)
    threads, outs = torch.get_num_threads(), []
    try:
        for n in (2, 1):
            torch.set_num_threads(n)
            outs.append(_fused_outputs(spec, tables, [keys], kv_dtype, path)[0][1])
        want = _fused_outputs(spec, tables, [keys], kv_dtype, "scalar")[0][1]
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])
    assert (outs[0] - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.skipif(not fused.FUSABLE, reason=f"the fused layer needs the C++ extension ({ACTIVE_PATH})")
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_heads,n_kv,head_dim,window", [
    (9, 3, 64, None),  # the 64-wide tiles
    (4, 4, 32, 21),  # tiles widened into buffers, a window that starts keys off a multiple of 8
    (6, 2, 24, None),  # not a multiple of 8: the per-query loop gathers each query's keys
])
def test_fused_attention_reads_keys_through_a_scattered_block_table(path, kv_dtype, n_heads, n_kv, head_dim, window):
    spec, lengths = _spec(n_heads, n_kv, head_dim, window), [70, 37]
    n_blocks = (max(lengths) + 1) // KV_BLOCK + 1
    scattered = _scattered(len(lengths), n_blocks)
    contiguous = extent_tables([0, n_blocks * KV_BLOCK], n_blocks * KV_BLOCK)
    got, kv = _fused_outputs(spec, scattered, lengths, kv_dtype, path)
    want, kv_want = _fused_outputs(spec, contiguous, lengths, kv_dtype, path)
    for a, b in zip(got, want):
        assert (a - b).abs().max() <= 1e-6 * b.abs().max()
    for b, n in enumerate(lengths):  # each key where its table puts it
        slots = scattered[b, torch.arange(n + 1) // KV_BLOCK] + torch.arange(n + 1) % KV_BLOCK
        assert torch.equal(kv.k[0, slots], kv_want.k[0, contiguous[b, 0] + torch.arange(n + 1)])


@pytest.mark.parametrize("window", [None, 21])
def test_torch_attention_reads_keys_through_a_scattered_block_table(window):
    """The torch prefill (keys gathered through the table) and decode (paged_attention over the pool in place)."""
    spec, lengths = _spec(4, 2, 16, window), [50, 19]
    n_blocks = (max(lengths) + 1) // KV_BLOCK + 1
    tables = {"scattered": _scattered(len(lengths), n_blocks, seed=3),
              "contiguous": extent_tables([0, n_blocks * KV_BLOCK], n_blocks * KV_BLOCK)}
    outs = {}
    for name, table in tables.items():
        kv, outs[name] = LayerKV(1, spec.n_kv_heads, SLOTS, spec.head_dim, torch.float32), []
        for i, step in enumerate(_steps(spec, table, lengths)):
            g = torch.Generator().manual_seed(i)
            b, s = step.positions.shape
            q = torch.randn(b, spec.n_heads, s, spec.head_dim, generator=g)
            k, v = (torch.randn(b, spec.n_kv_heads, s, spec.head_dim, generator=g) for _ in range(2))
            outs[name].append(attend(spec, q, k, v, step, kv, window).transpose(1, 2)[step.valid])
    for a, b in zip(outs["scattered"], outs["contiguous"]):
        assert (a - b).abs().max() <= 1e-6 * b.abs().max()


CONTEXT = 160


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = save_hf_model(make_hf_model("llama", num_hidden_layers=2, max_position_embeddings=CONTEXT),
                           tmp_path_factory.mktemp("paged") / "tiny")
    return LLM(str(folder), backend="cpu", max_model_len=CONTEXT)


def _engine(model, on: bool) -> Engine:
    g = Generator(model, max_model_len=CONTEXT, max_batch_size=4, step_tokens=24)
    g.prefix_caching = on
    return Engine(g)


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(1, 160, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(engine: Engine, rid, prompt, n: int = 1):
    seq = engine.add(rid, prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, n=n, seed=5))
    while engine.has_work():
        engine.step()
    return seq


def test_a_hit_maps_a_kept_runs_blocks_into_the_table_and_pins_them(llm):
    """The second turn's table maps the first turn's kept blocks (no copy: its own blocks come after them); the
    run stays pinned while it runs though the pool then needs room, and the tokens are those without the cache."""
    shared = ids(4 * KV_BLOCK + 3, 1)
    prompts = [shared + ids(5, 2), shared + ids(7, 3)]
    plain = _engine(llm.model, on=False)
    want = [_run(plain, i, p).output_ids for i, p in enumerate(prompts)]
    engine = _engine(llm.model, on=True)
    first = _run(engine, 0, prompts[0])
    kept = next(k for k in engine.prefix.kept if k.first == 0)
    second = engine.add(1, prompts[1], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    engine.step()  # admitted: its table maps the kept blocks
    assert second.shared == kept.slots and len(kept.slots) == 4 and kept.pins == 1
    assert len(second.blocks) == -(-(second.extent - 4 * KV_BLOCK) // KV_BLOCK) and second.n_prefix_hit == 4 * KV_BLOCK
    fillers = [engine.add(10 + i, ids(60, 20 + i), SamplingParams(max_tokens=2, ignore_eos=True)) for i in range(3)]
    while engine.has_work():
        engine.step()
        assert kept in engine.prefix.kept and kept.slots == second.shared  # never evicted while mapped
    assert [first.output_ids, second.output_ids] == want and all(f.finish_reason == "length" for f in fillers)
    assert kept.pins == 0 and engine.pool.n_free + engine.prefix.pool_slots == engine.capacity


def test_samples_of_a_request_share_the_mapped_blocks(llm):
    """n = 3 samples: each table maps the same kept blocks, the first sample's prefill is copied after them."""
    prompt = torch.randint(1, 160, (3 * KV_BLOCK + 9,), generator=torch.Generator().manual_seed(9)).tolist()
    plain = _engine(llm.model, on=False)
    _run(plain, 0, prompt)
    want = [s.output_ids for s in _run(plain, 1, prompt + [7, 8], n=3).samples]
    engine = _engine(llm.model, on=True)
    _run(engine, 0, prompt)
    got = _run(engine, 1, prompt + [7, 8], n=3)
    assert [len(s.shared) for s in got.samples] == [3, 3, 3] and len({tuple(s.shared) for s in got.samples}) == 1
    assert [s.output_ids for s in got.samples] == want


@pytest.mark.parametrize("holder_ends", ["finishes", "is aborted"])
def test_requests_waiting_on_a_prefill_map_its_blocks_and_keep_them_when_it_leaves(llm, holder_ends):
    """Requests whose prefix another is prefilling wait, then map its blocks while it still runs (no copy); when it
    leaves (finished, or aborted while they run) the blocks it lent stay as a pinned kept run until they leave."""
    shared = ids(3 * KV_BLOCK + 4, 30)
    prompts = [shared + ids(40, 31)] + [shared + ids(3, 32 + i) for i in range(2)]
    plain = _engine(llm.model, on=False)
    want = [_run(plain, i, p).output_ids for i, p in enumerate(prompts)]
    engine = _engine(llm.model, on=True)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    holder, *waiters = [engine.add(i, p, greedy) for i, p in enumerate(prompts)]
    for _ in range(20):  # the holder's prefill takes a few steps of 24 tokens
        if all(w.shared for w in waiters) or not engine.has_work():
            break
        engine.step()
    assert all(w.shared == holder.table(3) for w in waiters) and holder.n_cached >= 3 * KV_BLOCK
    if holder_ends == "is aborted":
        engine.abort(0)
        engine.step()
        lent = next(k for k in engine.prefix.kept if k.first == 0)
        assert lent.pins == 2 and lent.slots == holder.blocks[: len(lent.names)] and lent.names
        assert engine.n_running == 2
    while engine.has_work():
        engine.step()
    got = [s.output_ids for s in (holder, *waiters)]
    assert got[1:] == want[1:] and (got[0] == want[0] if holder_ends == "finishes" else holder.finish_reason == "abort")
    assert all(k.pins == 0 for k in engine.prefix.kept) and engine.pool.n_free + engine.prefix.pool_slots == engine.capacity


def test_a_request_takes_blocks_freed_apart_while_the_one_between_them_runs(llm):
    """A pool of 4 blocks: two short requests of one block each end while a long one holds the two blocks between
    them; a waiting request of two blocks runs in the freed blocks at once (a contiguous extent would wait for the
    long one), and every request gives the tokens it gives alone."""
    asks = [(ids(10, 40), 3), (ids(20, 41), 12), (ids(10, 42), 3), (ids(10, 43), 15)]  # blocks: 1, 2, 1, 2
    want = []
    for i, (prompt, n) in enumerate(asks):
        alone = _engine(llm.model, on=False)
        want.append(_run_greedy(alone, i, prompt, n).output_ids)
    g = Generator(llm.model, max_model_len=CONTEXT, max_batch_size=4, step_tokens=24)
    g.prefix_caching = False
    engine = Engine(g, kv_slots=4 * KV_BLOCK)
    seqs = [engine.add(i, prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
            for i, (prompt, n) in enumerate(asks)]
    while not seqs[3].admitted:
        engine.step()
    assert seqs[3].blocks == seqs[0].blocks + seqs[2].blocks and not seqs[1].finish_reason
    assert seqs[3].blocks[1] - seqs[3].blocks[0] > KV_BLOCK  # apart: the long one's blocks lie between them
    engine.run_until_done()
    assert [s.output_ids for s in seqs] == want and engine.pool.n_free == engine.capacity


def _run_greedy(engine: Engine, rid, prompt, n: int):
    seq = engine.add(rid, prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    engine.run_until_done()
    return seq

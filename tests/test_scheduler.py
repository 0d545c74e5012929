"""The scheduler: mixed steps equal one-by-one generation, the KV pool hands slots out by need, steps stay
within the plan's token budgets, stop strings are checked without re-decoding the whole output."""

from __future__ import annotations

import pytest
import torch

from conftest import gpu_profile, make_hf_model, save_hf_model
from offload import LLM, SamplingParams
from offload.engine import run_to_end
from offload.generate import Generator
from offload.kv_pool import KVPool
from offload.sequence import Sequence

LENGTHS = [3, 17, 40, 5, 33, 9, 21]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_hf_model(make_hf_model("llama", num_hidden_layers=3), tmp_path_factory.mktemp("sched") / "tiny")


def _prompts(lengths, vocab=160):
    g = torch.Generator().manual_seed(11)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def _run(llm, prompts, max_tokens, **kw) -> tuple[list[list[int]], list]:
    seqs = [Sequence(i, ids, SamplingParams(max_tokens=m, temperature=0, ignore_eos=True))
            for i, (ids, m) in enumerate(zip(prompts, max_tokens))]
    llm.timeline.clear()
    run_to_end(Generator(llm.model, max_model_len=64, **kw), seqs)
    return [s.output_ids for s in seqs], list(llm.timeline.steps)


GPU_LAYERS = dict(backend="sim", hardware=gpu_profile(), prefill_chunk_tokens=8)  # the simulated GPU, chunks of 8


@pytest.mark.parametrize("quantization,where", [("none", "cpu"), ("q8_0", "cpu"), ("q4_0", "cpu"), ("none", "gpu"),
                                                ("q8_0", "gpu")])
def test_mixed_steps_give_the_tokens_of_one_by_one_generation(tiny_dir, quantization, where):
    """Prompt chunks of 16 tokens with decode tokens riding along (fused C++ layer for q8_0/q4_0, the reference
    block math for none; on the simulated GPU, each layer in chunks of 8 of the step's flat tokens) give the greedy
    tokens each prompt gives alone."""
    device = GPU_LAYERS if where == "gpu" else dict(backend="cpu")
    llm = LLM(str(tiny_dir), quantization=quantization, max_model_len=64, **device)
    prompts, max_tokens = _prompts(LENGTHS), [6, 3, 9, 12, 4, 7, 5]
    alone = [_run(llm, [p], [m], max_batch_size=1)[0][0] for p, m in zip(prompts, max_tokens)]
    mixed, steps = _run(llm, prompts, max_tokens, max_batch_size=4, step_tokens=16)
    assert mixed == alone
    assert any(s.n_prompt_tokens and s.n_decode_tokens for s in steps), "no step mixed prompt and decode tokens"
    assert max(s.n_tokens for s in steps) <= 16
    old, old_steps = _run(llm, prompts, max_tokens, max_batch_size=4, step_tokens=16, mixed=False)
    assert old == alone and not any(s.n_prompt_tokens and s.n_decode_tokens for s in old_steps)


def test_a_mixed_step_is_one_pass_over_the_weights(tiny_dir):
    """Each layer computes once per step: the decode tokens and prompt chunks go through it together."""
    llm = LLM(str(tiny_dir), quantization="q8_0", backend="cpu", max_model_len=64)
    _, steps = _run(llm, _prompts([30, 4]), [8, 8], max_batch_size=2, step_tokens=12)
    layer0 = [s for s in llm.timeline.spans if s.unit == "layer.0"]
    assert len(layer0) == len(steps)
    assert [s.n_tokens for s in layer0] == [s.n_tokens for s in steps]


def test_the_pool_hands_out_blocks_by_need_wherever_they_were_freed():
    """Slots are handed out in whole blocks of 16, the lowest free first; blocks freed apart serve one request."""
    pool = KVPool(160)
    a, b, c = pool.alloc(30), pool.alloc(50), pool.alloc(20)
    assert (a, b, c) == ([0, 16], [32, 48, 64, 80], [96, 112]) and pool.n_free == 32
    assert pool.alloc(33) is None and pool.n_free == 32  # a failed alloc takes nothing
    pool.release(a)
    pool.release(c)
    assert pool.alloc(80) == [0, 16, 96, 112, 128] and pool.n_free == 16
    with pytest.raises(ValueError, match="twice"):
        pool.release([144, 144])
    with pytest.raises(ValueError, match="whole blocks"):
        KVPool(100)


def test_short_sequences_share_the_pool_and_long_ones_wait(tiny_dir):
    """With room for 6 blocks of 16 KV slots, prompts needing 19 slots (2 blocks) run three at a time; a 63-slot one
    (4 blocks) runs alone in a pool of 4."""
    llm = LLM(str(tiny_dir), quantization="q8_0", backend="cpu", max_model_len=64)
    prompts = _prompts([10] * 6)
    out, steps = _run(llm, prompts, [10] * 6, max_batch_size=8, kv_tokens=97)
    assert max(s.n_seqs for s in steps) == 3 and all(len(o) == 10 for o in out)
    out, steps = _run(llm, _prompts([60, 4]), [4, 4], max_batch_size=8, kv_tokens=64)
    assert max(s.n_seqs for s in steps) == 1


def test_kv_and_step_tokens_stay_within_the_plan_up_to_max_model_len(tiny_dir, monkeypatch):
    """Prompts of max_model_len - 1 tokens: the pool's bytes are within the plan's KV budget, every step within
    the plan's tokens per pass and every layer call within its chunk of tokens."""
    from offload.kernels import layer as fused

    llm = LLM(str(tiny_dir), quantization="q8_0", backend="cpu", max_model_len=64, prefill_chunk_tokens=16)
    plan = llm.plan
    sizes, real = [], fused.fused_layers_forward
    monkeypatch.setattr(fused, "fused_layers_forward",
                        lambda layers, x, *a, **k: sizes.append(x.shape[1]) or real(layers, x, *a, **k))
    kv_bytes, real_cache = [], llm.model.new_cache

    def new_cache(batch, max_len, n_rings=None):
        cache = real_cache(batch, max_len, n_rings)
        kv_bytes.append(sum(kv.nbytes for kv in cache))
        return cache

    monkeypatch.setattr(llm.model, "new_cache", new_cache)
    n = plan.workload.batch_size + 2
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts([63] * n)],
                        SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert all(len(o.token_ids) == 1 for o in outs)  # the context is full after one token
    assert kv_bytes[0] <= plan.tier("cpu").kv_bytes
    assert max(s.n_tokens for s in llm.timeline.steps) <= plan.workload.prefill_pass_tokens
    assert max(sizes) <= plan.workload.prefill_chunk_tokens


class CountingTokenizer:
    """Decodes token id t as the letter chr(97 + t % 26) and counts the ids it was asked to decode."""

    def __init__(self):
        self.decoded = 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += len(ids)
        return "".join(chr(97 + t % 26) for t in ids)


def test_stop_strings_are_checked_incrementally(tiny_dir):
    llm = LLM(str(tiny_dir), quantization="q8_0", backend="cpu")
    tok = CountingTokenizer()
    gen = Generator(llm.model, tok)
    seq = Sequence(0, _prompts([2])[0], SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True,
                                                       stop=["never-there"]))
    run_to_end(gen, [seq])
    n = len(seq.output_ids)
    assert n == gen.context_len - 2 and seq.finish_reason == "length"
    assert tok.decoded < 5 * n  # re-decoding the whole output each token: n * n / 2
    text = gen.text_of(seq)
    stop = text[n // 2: n // 2 + 3]  # a string that occurs: the run ends at its first occurrence
    seq2 = Sequence(1, seq.prompt_ids, SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True, stop=[stop]))
    run_to_end(gen, [seq2])
    assert seq2.finish_reason == "stop" and gen.text_of(seq2) == text[: text.find(stop)]

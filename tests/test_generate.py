"""Generation: greedy equals transformers, the KV cache equals recomputation, batching equals one by one."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_logits_close, make_hf_model, offload_logits, save_hf_model
from offload import LLM, SamplingParams

CHAT_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]


@pytest.fixture
def tiny_llm(tmp_path):
    folder = save_hf_model(make_hf_model("llama", num_hidden_layers=3), tmp_path / "tiny")
    return LLM(str(folder))


def _prompts(lengths, vocab=160):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("prompt", CHAT_PROMPTS + ["Once upon a time"])
def test_greedy_equals_transformers_on_default_model(prompt, default_llm, default_hf):
    if prompt == "Once upon a time":
        ids = default_llm.tokenizer.encode(prompt)
    else:
        ids = default_llm.apply_chat_template([{"role": "user", "content": prompt}])
    ours = default_llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=32, temperature=0))[0]
    with torch.no_grad():
        ref = default_hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids):]
    assert ours.token_ids == ref.tolist()


def test_chat_answers_paris(default_llm):
    out = default_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                           SamplingParams(max_tokens=24, temperature=0))[0]
    assert "Paris" in out.text and out.finish_reason == "stop"


def test_decode_with_cache_equals_recompute(tiny_llm):
    """Each decode step's logits equal a full forward over the whole prefix."""
    model, ids = tiny_llm.model, _prompts([9])[0]
    cache = model.new_cache(1, 32)
    tokens = list(ids)
    pos = torch.arange(len(ids))[None]
    step = model.make_step(pos, torch.ones_like(pos, dtype=torch.bool), trash_slot=32)
    with torch.inference_mode():
        logits = model.logits(model.forward(torch.tensor([ids]), step, cache))[0, -1]
    for _ in range(8):
        tokens.append(int(logits.argmax()))
        pos = torch.tensor([[len(tokens) - 1]])
        step = model.make_step(pos, torch.ones_like(pos, dtype=torch.bool), trash_slot=32)
        with torch.inference_mode():
            logits = model.logits(model.forward(torch.tensor([[tokens[-1]]]), step, cache))[0, -1]
        assert_logits_close(logits, offload_logits(model, tokens)[-1])


@pytest.mark.parametrize("batch_size", [8, 2])
def test_batch_of_different_lengths_equals_one_by_one(tmp_path, batch_size):
    folder = save_hf_model(make_hf_model("llama", num_hidden_layers=3), tmp_path / "tiny")
    llm = LLM(str(folder), batch_size=batch_size)
    prompts = _prompts([3, 11, 1, 7, 20])
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (6, 12, 4, 9, 5)]
    batched = llm.generate(prompts, params)
    alone = [llm.generate([p], [sp])[0] for p, sp in zip(prompts, params)]
    assert [o.token_ids for o in batched] == [o.token_ids for o in alone]
    assert [len(o.token_ids) for o in batched] == [6, 12, 4, 9, 5]
    assert all(o.finish_reason == "length" for o in batched)


def test_seeded_sampling_is_reproducible(tiny_llm):
    prompts = _prompts([5, 8])
    params = SamplingParams(max_tokens=16, temperature=1.0, top_k=50, top_p=0.95, min_p=0.01, seed=1234,
                            ignore_eos=True)
    first = [o.token_ids for o in tiny_llm.generate(prompts, params)]
    again = [o.token_ids for o in tiny_llm.generate(prompts, params)]
    other = [o.token_ids for o in tiny_llm.generate(prompts, SamplingParams(
        max_tokens=16, temperature=1.0, seed=99, ignore_eos=True))]
    assert first == again
    assert first != other


@pytest.mark.parametrize("narrow", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)])
def test_narrow_filters_reduce_to_greedy(tiny_llm, narrow):
    prompt = _prompts([6])
    greedy = tiny_llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    sampled = tiny_llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0.8, seed=3, ignore_eos=True,
                                                       **narrow))[0]
    assert sampled.token_ids == greedy.token_ids


def test_stop_token_ids_and_eos(tiny_llm):
    prompt = _prompts([6])
    free = tiny_llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    stop_at = free.token_ids[3]
    first = free.token_ids.index(stop_at)
    stopped = tiny_llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_at]))[0]
    assert stopped.token_ids == free.token_ids[: first + 1] and stopped.finish_reason == "stop"
    tiny_llm.generator.eos_ids = {stop_at}
    try:
        by_eos = tiny_llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0))[0]
        ignored = tiny_llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    finally:
        tiny_llm.generator.eos_ids = set()
    assert by_eos.token_ids == stopped.token_ids and by_eos.finish_reason == "stop"
    assert ignored.token_ids == free.token_ids and ignored.finish_reason == "length"


def test_stop_string_cuts_the_text(default_llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    full = default_llm.chat(messages, SamplingParams(max_tokens=24, temperature=0))[0]
    cut = default_llm.chat(messages, SamplingParams(max_tokens=24, temperature=0, stop=["Paris"]))[0]
    kept = default_llm.chat(messages, SamplingParams(max_tokens=24, temperature=0, stop="Paris",
                                                     include_stop_str_in_output=True))[0]
    assert "Paris" in full.text
    assert cut.text == full.text[: full.text.index("Paris")] and cut.finish_reason == "stop"
    assert kept.text == full.text[: full.text.index("Paris") + len("Paris")]
    assert len(cut.token_ids) < len(full.token_ids)


def test_max_tokens_gives_length(default_llm):
    out = default_llm.generate("Once upon a time", SamplingParams(max_tokens=5, temperature=0))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length" and out.text

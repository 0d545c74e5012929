"""The engine loop: requests join a running batch and give the tokens they give alone, share its passes over the
weights, free their slots when aborted, may be added from another thread; the waiting queue is bounded."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from conftest import make_hf_model, save_hf_model
from offload import LLM, SamplingParams
from offload.attention_sizes import KV_BLOCK
from offload.engine import Engine, StepOutput, run_to_end
from offload.errors import ConfigError, OffloadError, QueueFull
from offload.generate import Generator
from offload.sequence import Sequence


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = save_hf_model(make_hf_model("llama", num_hidden_layers=2), tmp_path_factory.mktemp("engine") / "tiny")
    return LLM(str(folder), quantization="q8_0", backend="cpu", max_model_len=64)


def _prompts(lengths, vocab=160):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def _generator(llm, **kw) -> Generator:
    return Generator(llm.model, max_model_len=64, **{"max_batch_size": 4, "step_tokens": 16, **kw})


def _weight_passes(llm) -> int:
    return sum(1 for s in llm.timeline.spans if s.unit == "layer.0")


def _alone(llm, prompt, max_tokens) -> tuple[list[int], int]:
    """The greedy tokens of a prompt run by itself, and the passes over the weights it took."""
    llm.timeline.clear()
    seq = Sequence(0, prompt, _greedy(max_tokens))
    run_to_end(_generator(llm), [seq])
    return seq.output_ids, _weight_passes(llm)


def test_requests_that_join_mid_decode_share_its_steps_and_give_their_alone_tokens(llm):
    prompts, max_tokens = _prompts([20, 9, 30]), [14, 8, 6]
    alone = [_alone(llm, p, m) for p, m in zip(prompts, max_tokens)]
    engine = Engine(_generator(llm))
    llm.timeline.clear()
    first = engine.add("a", prompts[0], _greedy(max_tokens[0]))
    outs = []
    while len(first.output_ids) < 4:  # "a" is decoding
        outs.append(engine.step())
    second = engine.add("b", prompts[1], _greedy(max_tokens[1]))
    outs += [engine.step(), engine.step()]  # "b" is being prefilled
    third = engine.add("c", prompts[2], _greedy(max_tokens[2]))
    outs += list(engine.steps())
    assert [s.output_ids for s in (first, second, third)] == [tokens for tokens, _ in alone]
    assert all(s.finish_reason == "length" for s in (first, second, third))
    assert _weight_passes(llm) < sum(n for _, n in alone)
    assert max(len(o.tokens) for o in outs) == 3  # one step sampled for all three
    streamed = {rid: [t for o in outs for s, new in o.tokens if s.request_id == rid for t in new] for rid in "abc"}
    assert streamed == {"a": first.output_ids, "b": second.output_ids, "c": third.output_ids}
    assert sorted(s.request_id for o in outs for s in o.finished) == ["a", "b", "c"]
    assert engine.kv_slots_used == 0 and not engine.has_work()


def test_the_engine_holds_the_pool_the_plan_budgets(llm):
    engine = Engine(llm.generator)
    # every sequence at the whole context, in whole blocks of 16: 63 keys, 4 blocks each; and one slot for padding
    assert engine.capacity == llm.max_batch_size * KV_BLOCK * -(-(llm.max_model_len - 1) // KV_BLOCK)
    assert engine.cache[0].k.shape[1] == engine.capacity + 1
    assert sum(kv.nbytes for kv in engine.cache) <= llm.plan.tier("cpu").kv_bytes


def test_an_abort_frees_its_slots_for_a_waiting_request(llm):
    """A pool of 4 blocks of 16 slots holds two requests of 10 + 10 tokens (19 slots: 2 blocks each); the third runs
    once one is aborted, in the aborted one's blocks, and gives its alone tokens."""
    prompts = _prompts([10, 10, 10])
    engine = Engine(_generator(llm), kv_slots=64)
    seqs = [engine.add(f"r{i}", p, _greedy(10)) for i, p in enumerate(prompts)]
    engine.step()
    assert (engine.n_running, engine.n_waiting, engine.kv_slots_used) == (2, 1, 64)
    engine.step()
    engine.abort("r1")
    out = engine.step()
    assert [s.request_id for s in out.finished] == ["r1"] and seqs[1].finish_reason == "abort"
    assert "r1" not in {s.request_id for s, _ in out.tokens} and len(seqs[1].output_ids) == 1
    assert (engine.n_running, engine.n_waiting, seqs[2].blocks) == (2, 0, seqs[1].blocks)
    engine.run_until_done()
    assert [s.output_ids for s in (seqs[0], seqs[2])] == [_alone(llm, p, 10)[0] for p in (prompts[0], prompts[2])]
    assert engine.kv_slots_used == 0


def test_requests_added_from_another_thread_join_the_loop(llm):
    """A client thread adds each request once the one before has a token; the main thread steps."""
    prompts, max_tokens = _prompts([12, 25, 7, 18]), [20, 10, 15, 5]
    engine, handles, failed = Engine(_generator(llm)), [], []

    def client():
        try:
            for i, (p, m) in enumerate(zip(prompts, max_tokens)):
                deadline = time.monotonic() + 30
                while handles and not handles[-1].output_ids and time.monotonic() < deadline:
                    time.sleep(0.001)
                handles.append(engine.add(i, p, _greedy(m)))
        except Exception as e:  # noqa: BLE001 (shown by the assertion below)
            failed.append(e)

    thread = threading.Thread(target=client)
    thread.start()
    while thread.is_alive() or engine.has_work():
        if engine.wait_for_work(timeout_s=0.01):
            engine.step()
    thread.join()
    assert not failed, failed
    assert [h.output_ids for h in handles] == [_alone(llm, p, m)[0] for p, m in zip(prompts, max_tokens)]


def test_the_waiting_queue_is_bounded(llm):
    engine = Engine(_generator(llm), max_waiting=2)
    prompts = _prompts([5, 6, 7, 8])
    engine.add("a", prompts[0], _greedy(3))
    engine.add("b", prompts[1], _greedy(3))
    with pytest.raises(QueueFull, match="max_waiting") as e:
        engine.add("c", prompts[2], _greedy(3))
    assert isinstance(e.value, OffloadError)
    engine.abort("b")  # a waiting request leaves the queue at once
    engine.add("c", prompts[2], _greedy(3))
    with pytest.raises(QueueFull):
        engine.add("d", prompts[3], _greedy(3))
    out = engine.step()  # "a" and "c" start: the queue is empty
    assert [(s.request_id, s.finish_reason, s.output_ids) for s in out.finished] == [("b", "abort", [])]
    assert sorted(s.request_id for s, _ in out.tokens) == ["a", "c"] and engine.n_waiting == 0
    engine.add("d", prompts[3], _greedy(3))
    with pytest.raises(ConfigError, match="'a' is already in flight"):
        engine.add("a", prompts[0], _greedy(3))
    with pytest.raises(ConfigError, match="max_waiting must be 1 or more"):
        Engine(_generator(llm), max_waiting=0)


def test_aborting_an_unknown_or_finished_request_does_nothing(llm):
    engine = Engine(_generator(llm))
    prompt = _prompts([6])[0]
    done = engine.add("x", prompt, _greedy(4))
    engine.run_until_done()
    llm.timeline.clear()
    engine.abort("x")
    engine.abort("never-added")
    assert not engine.has_work() and engine.step() == StepOutput() and _weight_passes(llm) == 0
    again = engine.add("x", prompt, _greedy(4))  # the id is free again, and no stale abort stops it
    finished = []
    engine.run_until_done(finished.append)
    assert finished == [again] and again.finish_reason == "length" and again.output_ids == done.output_ids


def test_a_request_the_context_cannot_hold_is_refused_at_add(llm):
    engine = Engine(_generator(llm), kv_slots=16)  # one block
    with pytest.raises(ConfigError):
        engine.add("long", list(range(1, 65)), _greedy(1))  # not shorter than the context of 64
    with pytest.raises(ConfigError, match="needs 29 KV slots"):
        engine.add("wide", _prompts([10])[0], _greedy(20))
    assert not engine.has_work()


def test_an_interactive_request_is_admitted_before_background_ones_without_preempting(llm):
    """A batch of two runs two background requests; two more wait. An interactive request that arrives takes the
    first slot that frees, before the waiting background ones; the running ones are never stopped for it."""
    engine = Engine(_generator(llm, max_batch_size=2), max_waiting=1)
    prompts = _prompts([5, 6, 7, 8, 9])
    bg = [Sequence(f"b{i}", p, _greedy(2 if i == 0 else 6)) for i, p in enumerate(prompts[:4])]
    for seq in bg:
        engine.submit(seq, background=True)  # not counted against max_waiting's bound
    engine.step()
    assert [s.admitted for s in bg] == [True, True, False, False] and engine.n_waiting == 2
    interactive = engine.add("i", prompts[4], _greedy(3))
    assert engine.n_waiting == 3
    with pytest.raises(QueueFull):  # interactive requests alone fill max_waiting
        engine.add("j", prompts[4], _greedy(3))
    engine.step()  # b0 finishes its two tokens here; b1 and the interactive one were not preempted
    assert bg[0].finish_reason == "length" and not interactive.admitted and len(bg[1].output_ids) == 2
    engine.step()
    assert interactive.admitted and not bg[2].admitted and not bg[3].admitted
    engine.abort("b3")  # a waiting background request leaves its queue at once
    engine.run_until_done()
    assert interactive.output_ids == _alone(llm, prompts[4], 3)[0] and bg[3].finish_reason == "abort"
    assert bg[2].output_ids == _alone(llm, prompts[2], 6)[0] and engine.n_waiting == engine.kv_slots_used == 0


def test_a_large_host_pool_holds_memory_as_sequences_write_it():
    """A KV pool sized for the plan's whole batch costs nothing until written: an idle server's pool is zero
    pages, not 12 GB of touched memory (torch.zeros memsets what it allocates)."""
    import gc

    import torch

    from offload.model.step import LayerKV
    from offload.system import held_bytes

    gc.collect()
    before = held_bytes()
    kv = LayerKV(1, 4, 1 << 16, 256, torch.float32)  # 2 x 256 MiB
    largest = float(kv.k.abs().max())  # reading the zero page holds nothing either
    assert held_bytes() - before < 64 << 20 and largest == 0.0
    kv.k[0, :1024] = 1.0  # 4 MiB written (the process may free a few pages of its own meanwhile: 3 MiB at least)
    assert 3 << 20 <= held_bytes() - before < 96 << 20 and float(kv.k.sum()) == 1024 * 4 * 256

"""n samples, logprobs and echo: in LLM.generate, in a batch job, and through a real server on 127.0.0.1 driven by
the official openai client. Logprobs are checked against transformers in fp32 on the same weights (not against
offload's own path), within 1e-4; a prompt's n samples run its prefill once."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi", reason="offload[serve] is not installed")
openai = pytest.importorskip("openai", reason="the test extra brings openai")
import httpx  # noqa: E402
import uvicorn  # noqa: E402

from offload import LLM, SamplingParams  # noqa: E402
from offload.errors import ConfigError  # noqa: E402
from offload.jobs.config import load_config, sampling_defaults  # noqa: E402
from offload.serve.app import Server, make_app  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from make_llama import tiny  # noqa: E402

CONTEXT = 128
PROMPT = "The quick brown fox"
TOLERANCE = 1e-4  # logprobs against transformers fp32: the kernels sum in another order
GO_ON = {"ignore_eos": True}  # the random model's answers run their length


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny(tmp_path_factory.mktemp("sampling") / "tiny", vocab=259, tokenizer=True)


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(str(model_dir), backend="cpu", max_model_len=CONTEXT, dtype="fp32")


@pytest.fixture(scope="module")
def reference(model_dir):
    """transformers in fp32 on the same weights: log-softmax of the next-token logits at every position."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return logprobs


@pytest.fixture(scope="module")
def server(model_dir):
    """A real server (uvicorn) on a free port of 127.0.0.1 in this process, on its own LLM, and its base URL."""
    defaults = sampling_defaults(load_config(None, {"model.path": str(model_dir)}, need_input=False))
    served = Server(LLM(str(model_dir), backend="cpu", max_model_len=CONTEXT, dtype="fp32"), "tiny",
                    defaults=defaults)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    runner = uvicorn.Server(uvicorn.Config(make_app(served), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while not runner.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    yield base
    runner.should_exit = True
    thread.join(30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 8, "temperature": 0.0, "ignore_eos": True, **kw})


def metric(base: str, name: str) -> float:
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} is not in /metrics")


# LLM.generate ---------------------------------------------------------------------------------------------------
def test_n_samples_share_one_prefill_and_greedy_ones_equal_one_sample(llm):
    one = llm.generate(PROMPT, greedy())[0]
    llm.timeline.clear()
    three = llm.generate(PROMPT, greedy(n=3))[0]
    assert [o.index for o in three.outputs] == [0, 1, 2]
    assert all(o.token_ids == one.token_ids and o.text == one.text for o in three.outputs)
    # the prompt ran once (less what the prefix cache kept of the call before)
    assert llm.timeline.phase_tokens["prefill"] == len(one.prompt_token_ids) - three.num_cached_tokens


def test_seeded_samples_differ_from_each_other_and_repeat(llm):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=7, n=3, ignore_eos=True)
    first, again = (llm.generate(PROMPT, params)[0] for _ in range(2))
    ids = [o.token_ids for o in first.outputs]
    assert ids == [o.token_ids for o in again.outputs] and len({tuple(i) for i in ids}) == 3
    assert ids[0] == llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=1.0, seed=7,
                                                         ignore_eos=True))[0].token_ids  # sample 0 is n=1's


def test_logprobs_and_prompt_logprobs_equal_transformers_fp32(llm, reference):
    out = llm.generate(PROMPT, greedy(logprobs=3, prompt_logprobs=2))[0]
    ids = out.prompt_token_ids + out.token_ids
    ref = reference(ids)
    n_prompt = len(out.prompt_token_ids)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == n_prompt
    for pos, item in enumerate(out.prompt_logprobs[1:] + out.outputs[0].logprobs, start=1):
        assert item.token_id == ids[pos]
        assert abs(item.logprob - ref[pos - 1, ids[pos]].item()) < TOLERANCE
        top = ref[pos - 1].topk(len(item.top))
        assert [t for t, _ in item.top] == top.indices.tolist()
        assert max(abs(p - q) for (_, p), q in zip(item.top, top.values.tolist())) < TOLERANCE
    assert len(out.outputs[0].logprobs[0].top) == 3 and len(out.prompt_logprobs[1].top) == 2


def test_a_group_too_big_for_the_batch_is_refused_and_an_aborted_group_frees_its_slots(llm):
    from offload.engine import Engine
    from offload.sequence import Sequence

    engine = Engine(llm.generator, kv_slots=200)
    with pytest.raises(ConfigError, match="n=3 samples .* lower n"):
        small = Engine(llm.generator, kv_slots=200)
        small.generator = type("G", (), {"max_batch_size": 2, "context_len": CONTEXT})()
        small.submit(Sequence("x", [1, 2, 3], greedy(n=3)))
    with pytest.raises(ConfigError, match="needs 3 samples of .* KV slots"):
        engine.submit(Sequence("y", list(range(1, 60)), greedy(n=3, max_tokens=20)))
    seq = Sequence("z", [1, 2, 3, 4], greedy(n=3, max_tokens=30))
    engine.submit(seq)
    engine.step()  # prefill: all three admitted, each with its first token
    assert engine.n_running == 3 and all(len(s.output_ids) == 1 for s in seq.group)
    engine.abort("z")
    out = engine.step()
    assert out.finished == [seq] and engine.kv_slots_used == 0 and not engine.has_work()


# a batch job ----------------------------------------------------------------------------------------------------
def test_a_batch_job_line_with_n_logprobs_and_echo(llm, model_dir, tmp_path):
    from offload.jobs.run import run_batch

    lines = [{"custom_id": "a", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": PROMPT, "max_tokens": 4, "n": 2, "logprobs": 1, "echo": True, **GO_ON}},
             {"custom_id": "b", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True,
                       "top_logprobs": 2, **GO_ON}}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    run_batch({"model": {"path": str(model_dir)}, "input": {"path": str(tmp_path / "in.jsonl")},
               "output": {"path": str(tmp_path / "out.jsonl")}}, progress=False, llm=llm)
    records = {r["custom_id"]: r["response"]["body"]
               for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    a, b = records["a"], records["b"]
    want = llm.generate(PROMPT, greedy(max_tokens=4))[0]
    n_prompt = len(want.prompt_token_ids)
    assert [c["index"] for c in a["choices"]] == [0, 1] and a["choices"][1]["text"] == PROMPT + want.text
    details = a["usage"].pop("prompt_tokens_details")
    assert a["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 8, "total_tokens": n_prompt + 8}
    assert 0 <= details["cached_tokens"] < n_prompt
    logprobs = a["choices"][0]["logprobs"]
    assert len(logprobs["token_logprobs"]) == n_prompt + 4 and logprobs["token_logprobs"][0] is None
    content = b["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(len(c["top_logprobs"]) == 2 for c in content)


# the server, through the openai client --------------------------------------------------------------------------
def test_n_three_gives_three_choices_from_one_prefill(llm, client, server):
    want = llm.generate(PROMPT, greedy())[0]
    before = metric(server, "offload_prefill_tokens_total")
    answer = client.completions.create(model="tiny", prompt=PROMPT, n=3, max_tokens=8, temperature=0,
                                       extra_body=GO_ON)
    assert [c.index for c in answer.choices] == [0, 1, 2] and {c.text for c in answer.choices} == {want.text}
    assert answer.usage.prompt_tokens == len(want.prompt_token_ids) and answer.usage.completion_tokens == 24
    cached = answer.usage.prompt_tokens_details.cached_tokens  # what the server's prefix cache kept of PROMPT
    assert metric(server, "offload_prefill_tokens_total") - before == len(want.prompt_token_ids) - cached
    sampled = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=3,
                                             max_tokens=6, temperature=1.0, seed=3, extra_body=GO_ON)
    assert len({c.message.content for c in sampled.choices}) > 1


def test_chat_logprobs_equal_transformers_fp32(llm, client, reference):
    messages = [{"role": "user", "content": "Hello!"}]
    answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                            logprobs=True, top_logprobs=3, extra_body=GO_ON)
    want = llm.chat(messages, greedy(max_tokens=6))[0]
    ids = want.prompt_token_ids + want.token_ids
    ref = reference(ids)
    content = answer.choices[0].logprobs.content
    assert answer.choices[0].message.content == want.text and len(content) == 6
    for i, item in enumerate(content):
        pos = len(want.prompt_token_ids) + i
        assert abs(item.logprob - ref[pos - 1, ids[pos]].item()) < TOLERANCE
        top = ref[pos - 1].topk(3).values.tolist()
        assert max(abs(t.logprob - v) for t, v in zip(item.top_logprobs, top)) < TOLERANCE
        assert item.token == llm.tokenizer.decode([ids[pos]])


def test_echo_with_logprobs_scores_the_prompt(llm, client, reference):
    """lm-evaluation-harness's loglikelihood request: token ids, echo, logprobs 1, max_tokens 1."""
    ids = llm.generate(PROMPT, greedy(max_tokens=1))[0].prompt_token_ids
    answer = client.completions.create(model="tiny", prompt=[ids], echo=True, logprobs=1, max_tokens=1,
                                       temperature=0)
    logprobs = answer.choices[0].logprobs
    assert logprobs.token_logprobs[0] is None and len(logprobs.token_logprobs) == len(ids) + 1
    ref = reference(ids)
    scored = logprobs.token_logprobs[1: len(ids)]
    assert max(abs(got - ref[pos - 1, ids[pos]].item()) for pos, got in enumerate(scored, start=1)) < TOLERANCE
    assert all(len(top) >= 1 for top in logprobs.top_logprobs[1:])
    text = client.completions.create(model="tiny", prompt=PROMPT, echo=True, max_tokens=2, temperature=0,
                                     extra_body=GO_ON).choices[0].text
    assert text.startswith(PROMPT) and len(text) > len(PROMPT)


def test_several_prompts_in_one_request_answer_each_in_order(llm, client):
    prompts = [PROMPT, "Hello there"]
    answer = client.completions.create(model="tiny", prompt=prompts, n=2, max_tokens=4, temperature=0,
                                       extra_body=GO_ON)
    wants = [llm.generate(p, greedy(max_tokens=4))[0].text for p in prompts]
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    assert [c.text for c in answer.choices] == [wants[0], wants[0], wants[1], wants[1]]


def test_a_stream_of_n_samples_with_logprobs_joins_to_the_whole_answer(client):
    body = dict(model="tiny", prompt=PROMPT, n=2, max_tokens=6, temperature=1.0, seed=11, logprobs=2)
    whole = client.completions.create(**body, extra_body=GO_ON)
    chunks = list(client.completions.create(**body, stream=True, extra_body=GO_ON))
    for choice in whole.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(c.text for c in mine) == choice.text
        assert [v for c in mine if c.logprobs for v in c.logprobs.token_logprobs] == pytest.approx(
            choice.logprobs.token_logprobs, abs=TOLERANCE)
        assert mine[-1].finish_reason == "length"


def test_logprob_fields_out_of_shape_get_400_naming_them(client):
    messages = [{"role": "user", "content": "hi"}]
    for call, param in ((lambda: client.chat.completions.create(model="tiny", messages=messages, top_logprobs=2),
                         "top_logprobs"),
                        (lambda: client.chat.completions.create(model="tiny", messages=messages, logprobs=True,
                                                                top_logprobs=21), "top_logprobs"),
                        (lambda: client.completions.create(model="tiny", prompt=PROMPT, logprobs=99), "logprobs"),
                        (lambda: client.completions.create(model="tiny", prompt=PROMPT, n=0), "n"),
                        (lambda: client.completions.create(model="tiny", prompt=PROMPT, echo=True, logprobs=1,
                                                           stream=True), "echo")):
        with pytest.raises(openai.BadRequestError) as caught:
            call()
        assert caught.value.body["param"] == param, caught.value.body


def test_token_ids_past_the_vocabulary_are_refused_naming_the_field(llm, client):
    """Issue 44 item 6: stop_token_ids and logit_bias ids past the vocabulary (259 ids) were accepted and ignored;
    they are refused as prompt ids past it are, naming the field and the range; the last id is taken."""
    from offload.errors import SamplingError

    for field, value in (("stop_token_ids", [259]), ("stop_token_ids", [3, 10**12]), ("logit_bias", {259: 1.0}),
                         ("logit_bias", {"1000000": -100})):
        with pytest.raises(SamplingError) as caught:
            llm.generate(PROMPT, greedy(**{field: value}))
        assert f"prompts[0]: invalid sampling parameter: {field} token ids must lie in [0, 259)" in str(caught.value)
        body = {"logit_bias": {str(k): v for k, v in value.items()}} if field == "logit_bias" else {field: value}
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, extra_body=body)
        assert refused.value.body["param"] == field and "[0, 259)" in refused.value.body["message"]
    assert llm.generate(PROMPT, greedy(stop_token_ids=[258], logit_bias={258: 1.0}))[0].text is not None


@pytest.mark.parametrize("where,compute", [("disk", "cpu"), ("disk", "stream")])
def test_n_samples_and_logprobs_on_disk_and_streamed_placements_equal_the_cpu_run(tmp_path, where, compute):
    """The prompt's K and V copied for the other samples wherever the cache lives; streamed: the simulated
    asynchronous device."""
    from conftest import gpu_profile, make_hf_model, save_hf_model
    from offload.engine import run_to_end
    from offload.generate import Generator
    from offload.planner import Placement
    from offload.runtime.backends.cpu import CPUBackend
    from offload.runtime.backends.sim import SimBackend
    from offload.runtime.executor import PlacedModel
    from offload.sequence import Sequence
    from offload.weights.loader import Checkpoint
    from offload.weights.model_files import model_spec
    from offload.weights.sources import CheckpointSource

    path = save_hf_model(make_hf_model("llama"), tmp_path / "tiny")
    spec = model_spec(path)

    def run(placement, backend, n):
        model = PlacedModel(spec, CheckpointSource(Checkpoint(path), spec, torch.float32, "none"), placement, backend)
        seqs = [Sequence(i, [1 + i, 2, 3 + i], greedy(max_tokens=5, n=n, logprobs=2)) for i in range(3)]
        run_to_end(Generator(model, max_batch_size=8, max_model_len=64), seqs)
        model.flush()
        return [[s.output_ids for s in seq.group] for seq in seqs], [t.logprob for seq in seqs for s in seq.group
                                                                    for t in s.logprobs]

    alone = run(Placement.uniform(spec, "cpu", "cpu"), CPUBackend(), 1)
    backend = SimBackend(gpu_profile()) if compute == "stream" else CPUBackend()
    shared = run(Placement.uniform(spec, where, compute, page_cache=frozenset()), backend, 2)
    assert shared[0] == [group * 2 for group in alone[0]]
    twice = [p for i in range(3) for p in alone[1][5 * i: 5 * i + 5] * 2]  # each sequence's 5 logprobs, per sample
    assert shared[1] == pytest.approx(twice, abs=TOLERANCE)

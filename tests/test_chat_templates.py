"""Chat as users of the new families expect it. Qwen3's thinking: a request's chat_template_kwargs (enable_thinking)
reach the chat template, and the answer's <think> block comes back as reasoning_content, out of content, as vLLM's
reasoning parsers give it: whole and streamed from the server, in a batch's answers and from LLM.chat. Gemma 2's
template refuses a system message: it is folded into the first user turn. The models are tiny and scripted
(tests/chat_support.py), so every answer is known and no test needs the network."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="offload[serve] is not installed")

from chat_support import (ANSWER, CONTEXT, OPENS_THOUGHT, THOUGHT, make_gemma2_model, make_scripted_model,  # noqa: E402
                          with_template)
from jobs_support import chat_line, write_batch  # noqa: E402
from test_serve import assert_error, events, serving  # noqa: E402

from offload import LLM, SamplingParams  # noqa: E402
from offload.errors import ConfigError  # noqa: E402
from offload.jobs.batch import read_requests  # noqa: E402
from offload.jobs.config import load_config, sampling_defaults  # noqa: E402
from offload.jobs.worker import generate_answers, prompt_ids  # noqa: E402
from offload.reasoning import ThoughtSplitter, split_reasoning  # noqa: E402

USER = [{"role": "user", "content": "Hello!"}]
WITH_SYSTEM = [{"role": "system", "content": "Be brief."}, *USER]
NO_THINKING = {"enable_thinking": False}
SAID = f"<think>{THOUGHT}</think>{ANSWER}"  # what the scripted model says, whole


@pytest.fixture(scope="module")
def scripted(tmp_path_factory) -> Path:
    return make_scripted_model(tmp_path_factory.mktemp("chat") / "qwen3")


@pytest.fixture(scope="module")
def thinking(scripted) -> LLM:
    return LLM(str(scripted), backend="cpu", max_model_len=CONTEXT)


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory) -> LLM:
    return LLM(str(make_gemma2_model(tmp_path_factory.mktemp("chat") / "gemma2")), backend="cpu",
               max_model_len=CONTEXT)


@pytest.fixture(scope="module")
def defaults(scripted) -> dict:
    return sampling_defaults(load_config(None, {"model.path": str(scripted)}, need_input=False))


def llm_with(scripted: Path, tmp_path: Path, template: str) -> LLM:
    return LLM(str(with_template(scripted, tmp_path / "model", template)), backend="cpu", max_model_len=CONTEXT)


def streamed(client, body: dict) -> tuple[dict[str, str], list[dict]]:
    """The streamed answer's text per delta field (content, reasoning_content) joined, and its deltas."""
    chunks = [e for e in events(client.post("/v1/chat/completions", json={**body, "stream": True}).text)
              if e != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    joined = {key: "".join(d.get(key) or "" for d in deltas) for key in ("content", "reasoning_content")}
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    return joined, deltas


# vLLM's qwen3 cases (tests/reasoning/test_qwen3_reasoning_parser.py), and where the prompt opened the block
@pytest.mark.parametrize("text, opened, want", [
    ("<think>This is a reasoning section</think>This is the rest", False,
     ("This is a reasoning section", "This is the rest")),
    ("This is the rest", False, (None, "This is the rest")),
    ("<think>This is a reasoning section</think>", False, ("This is a reasoning section", None)),
    ("<think>This is a reasoning\nsection</think>This is the rest\nThat", False,
     ("This is a reasoning\nsection", "This is the rest\nThat")),
    ("<think>cut by max_tokens", False, ("cut by max_tokens", None)),  # as vLLM streams it
    ("This is a reasoning section</think>This is the rest", True, ("This is a reasoning section", "This is the rest")),
    ("<think>again</think>rest", True, ("again", "rest")),  # a model that repeats the prompt's <think>
    ("a </think> in an answer", False, (None, "a </think> in an answer")),  # no block open: text
    ("<think>\n\n</think>\n\nOK", False, ("\n\n", "\n\nOK")),  # whitespace kept, as vLLM keeps it
])
def test_the_split_is_vllms(text, opened, want):
    assert split_reasoning(text, opened) == want


def test_streamed_pieces_join_to_what_the_whole_answer_splits_into():
    rng = random.Random(0)
    texts = ["<think>ab</think>cd", "<think></think>x", "<thi", "<think>a</thin", "a</think>b<think>c", "</think>",
             "<thinkers>", "x<think>y</think>z", "<think>a</think></think>b"]
    for text in texts:
        for opened in (False, True):
            want = tuple(part or "" for part in split_reasoning(text, opened))
            for _ in range(30):
                cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, min(4, len(text)))))
                pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
                splitter, got = ThoughtSplitter(opened), ["", ""]
                for i, piece in enumerate(pieces):
                    reasoning, content = splitter.feed(piece, final=i == len(pieces) - 1)
                    got = [got[0] + reasoning, got[1] + content]
                assert tuple(got) == want, (text, opened, pieces)


def test_llm_chat_gives_the_thought_apart_and_passes_chat_template_kwargs(thinking):
    plain, closed = (thinking.apply_chat_template(USER, chat_template_kwargs=kw) for kw in (None, NO_THINKING))
    assert thinking.tokenizer.decode(plain).endswith("<|im_start|>assistant\n")
    assert thinking.tokenizer.decode(closed).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    for kwargs, prompt in ((None, plain), (NO_THINKING, closed)):
        out = thinking.chat(USER, SamplingParams(max_tokens=12), chat_template_kwargs=kwargs)[0]
        assert out.prompt_token_ids == prompt
        assert (out.outputs[0].reasoning_content, out.text, out.finish_reason) == (THOUGHT, ANSWER, "stop")
        assert thinking.tokenizer.decode(out.token_ids, skip_special_tokens=True) == SAID  # the tokens hold both
    with pytest.raises(ConfigError, match="expected chat_template_kwargs to be an object"):
        thinking.chat(USER, chat_template_kwargs=["enable_thinking"])


def test_the_server_answers_reasoning_content_whole_and_streamed(thinking, defaults):
    closed = thinking.apply_chat_template(USER, chat_template_kwargs=NO_THINKING)
    with serving(thinking, defaults) as (_, client):
        for kwargs in ({}, {"chat_template_kwargs": NO_THINKING}):
            body = {"messages": USER, "max_tokens": 12, **kwargs}
            whole = client.post("/v1/chat/completions", json=body).json()
            assert whole["choices"][0]["message"] == {"role": "assistant", "content": ANSWER,
                                                      "reasoning_content": THOUGHT}
            joined, deltas = streamed(client, body)
            assert joined == {"content": ANSWER, "reasoning_content": THOUGHT}
            assert deltas[0] == {"role": "assistant", "content": ""}
            assert not any("think>" in (d.get("content") or "") + (d.get("reasoning_content") or "") for d in deltas)
        assert whole["usage"]["prompt_tokens"] == len(closed)  # enable_thinking false reached the template
    with serving(thinking, defaults, reasoning_parser="none") as (_, client):
        whole = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 12}).json()
        joined, deltas = streamed(client, {"messages": USER, "max_tokens": 12})
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": SAID}
    assert joined == {"content": SAID, "reasoning_content": ""} and not any("reasoning_content" in d for d in deltas)


def test_a_prompt_that_opens_the_block_is_answered_from_inside_it(scripted, tmp_path, defaults):
    llm = llm_with(scripted, tmp_path, OPENS_THOUGHT)  # the answer holds </think> only: "hm</think>OK"
    assert llm.chat(USER, SamplingParams(max_tokens=12))[0].outputs[0].reasoning_content == THOUGHT
    with serving(llm, defaults) as (_, client):
        whole = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 12}).json()
        joined, _ = streamed(client, {"messages": USER, "max_tokens": 12})
    assert whole["choices"][0]["message"]["reasoning_content"] == THOUGHT == joined["reasoning_content"]
    assert whole["choices"][0]["message"]["content"] == ANSWER == joined["content"]


def test_a_template_without_think_is_not_split_unless_the_server_is_told(scripted, tmp_path, defaults):
    from make_llama import CHATML

    llm = llm_with(scripted, tmp_path, CHATML)
    assert llm.chat(USER, SamplingParams(max_tokens=12))[0].text == SAID
    for parser, message in (("auto", {"role": "assistant", "content": SAID}),
                            ("qwen3", {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT})):
        with serving(llm, defaults, reasoning_parser=parser) as (_, client):
            got = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 12}).json()
        assert got["choices"][0]["message"] == message, parser


def test_batch_lines_pass_chat_template_kwargs_and_get_reasoning_content(thinking, tmp_path):
    path = write_batch(tmp_path / "in.jsonl", [
        chat_line("off", "Hello!", max_tokens=12, chat_template_kwargs=NO_THINKING),
        chat_line("on", "Hello!", max_tokens=12),
        chat_line("bad", "Hello!", chat_template_kwargs="enable_thinking=false")])
    requests, bad = read_requests(path)
    assert prompt_ids(requests[0], thinking.tokenizer, thinking.path)[0] == \
        thinking.apply_chat_template(USER, chat_template_kwargs=NO_THINKING)
    assert [b.custom_id for b in bad] == ["bad"] and "expected chat_template_kwargs to be an object" in bad[0].message
    answers = {}
    generate_answers(thinking, requests, lambda req, answer: answers.update({req.custom_id: answer}),
                     lambda req, error: pytest.fail(error))
    for answer in answers.values():
        assert answer.choices[0]["message"] == {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT}
    assert set(answers) == {"off", "on"}


def test_malformed_chat_template_kwargs_are_refused_in_one_line(thinking, defaults):
    with serving(thinking, defaults) as (_, client):
        for bad in ("enable_thinking=false", ["enable_thinking"], {"tokenize": False},
                    {"add_generation_prompt": False}, {"messages": []}):
            message = assert_error(client.post("/v1/chat/completions", json={"messages": USER,
                                                                                "chat_template_kwargs": bad}),
                                   400, "chat_template_kwargs")
            assert "chat_template_kwargs" in message and "\n" not in message, message
        completion = client.post("/v1/completions", json={"prompt": "Hi", "chat_template_kwargs": NO_THINKING})
        assert "not supported" in assert_error(completion, 400, "chat_template_kwargs")


def test_gemma2s_template_gets_the_system_message_in_the_first_user_turn(gemma2, thinking, defaults):
    tokenizer = gemma2.tokenizer
    with pytest.raises(Exception, match="System role not supported"):  # the template as published
        tokenizer.apply_chat_template(WITH_SYSTEM, tokenize=False)
    folded = tokenizer.apply_chat_template([{"role": "user", "content": "Be brief.\n\nHello!"}],
                                           add_generation_prompt=True, tokenize=True)["input_ids"]
    assert gemma2.apply_chat_template(WITH_SYSTEM) == list(folded)
    assert gemma2.apply_chat_template(WITH_SYSTEM[:1]) == list(tokenizer.apply_chat_template(
        [{"role": "user", "content": "Be brief."}], add_generation_prompt=True, tokenize=True)["input_ids"])
    assert "<|im_start|>system\nBe brief." in thinking.tokenizer.decode(thinking.apply_chat_template(WITH_SYSTEM))
    with serving(gemma2, defaults) as (_, client):
        ok = client.post("/v1/chat/completions", json={"messages": WITH_SYSTEM, "max_tokens": 3})
        later = client.post("/v1/chat/completions", json={"messages": [*USER, {"role": "assistant", "content": "Hi"},
                                                                       *WITH_SYSTEM]})
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == len(folded)
    assert "refused the conversation" in assert_error(later, 400, "messages")  # only a leading one is folded


def test_offload_serve_takes_reasoning_parser_as_vllm_spells_it(scripted):
    from offload.cli.job_flags import effective_config
    from offload.cli.main import build_parser

    def parser_of(*flags) -> str:
        args = build_parser().parse_args(["serve", "--model", str(scripted), *flags])
        return effective_config(args, need_input=False).serve.reasoning_parser

    assert parser_of() == "auto" and parser_of("--reasoning-parser", "none") == "none"
    assert parser_of("--reasoning-parser", "deepseek_r1") == "deepseek_r1"
    with pytest.raises(ConfigError, match="serve.reasoning_parser': expected one of 'auto', 'qwen3', 'deepseek_r1'"):
        parser_of("--reasoning-parser", "granite")


def test_offload_generate_shows_a_thinking_models_answer_as_it_was_said(scripted, capsys):
    from offload.cli.main import main

    assert main(["generate", "--model", str(scripted), "--backend", "cpu", "--max-model-len", str(CONTEXT),
                 "--max-tokens", "12", "--prompt", "Hello!"]) == 0
    assert capsys.readouterr().out.strip().endswith(SAID)

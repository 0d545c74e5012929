"""gpt-oss's chat as users of vLLM expect it: its harmony answer split by the openai_gptoss reasoning parser (the
analysis channel's text is the reasoning_content, the final channel's the content), whole and streamed, chosen for
the gpt_oss family without being asked; reasoning_effort passed to the chat template; answers that end at <|return|>
or <|call|>. The model is tiny and scripted (tests/chat_support.py), so every answer is known."""

from __future__ import annotations

import itertools
import random

import pytest

pytest.importorskip("fastapi", reason="offload[serve] is not installed")

from chat_support import ANSWER, CONTEXT, HARMONY_SAID, THOUGHT, make_harmony_model  # noqa: E402
from jobs_support import chat_line, write_batch  # noqa: E402
from test_serve import assert_error, events, serving  # noqa: E402

from offload import LLM, SamplingParams  # noqa: E402
from offload.errors import ConfigError  # noqa: E402
from offload.families import BY_MODEL_TYPE  # noqa: E402
from offload.jobs.batch import read_requests  # noqa: E402
from offload.jobs.config import load_config, sampling_defaults  # noqa: E402
from offload.jobs.worker import generate_answers, prompt_ids  # noqa: E402
from offload.reasoning import AnswerSplit, HarmonySplitter, answer_split  # noqa: E402
from offload.weights.prompts import encode_chat, with_reasoning_effort  # noqa: E402

USER = [{"role": "user", "content": "Hello!"}]
HARMONY = AnswerSplit(harmony=True)
SPLIT = {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT}
ANALYSIS = "<|channel|>analysis<|message|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>"
TOOL = "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> LLM:
    return LLM(str(make_harmony_model(tmp_path_factory.mktemp("harmony") / "gpt-oss")), backend="cpu",
               max_model_len=CONTEXT)


@pytest.fixture(scope="module")
def defaults(gpt_oss) -> dict:
    return sampling_defaults(load_config(None, {"model.path": str(gpt_oss.path)}, need_input=False))


def streamed(client, body: dict) -> tuple[dict[str, str], list[dict], str]:
    """A streamed answer's text per delta field joined, its deltas, and its finish_reason."""
    chunks = [e for e in events(client.post("/v1/chat/completions", json={**body, "stream": True}).text)
              if e != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    joined = {key: "".join(d.get(key) or "" for d in deltas) for key in ("content", "reasoning_content")}
    return joined, deltas, chunks[-1]["choices"][0]["finish_reason"]


# vLLM's openai_gptoss cases, and where an answer is cut by max_tokens: what it has is reasoning, content None
@pytest.mark.parametrize("text, want", [
    (f"{ANALYSIS}Think.<|end|>{FINAL}Answer.<|return|>", ("Think.", "Answer.")),
    (f"{ANALYSIS}Think\nmore.<|end|>{FINAL}Line 1\nLine 2<|return|>", ("Think\nmore.", "Line 1\nLine 2")),
    (f"{ANALYSIS}cut by max_tokens", ("cut by max_tokens", None)),
    (f"{ANALYSIS}Think.<|end|>{FINAL[:20]}", ("Think.", None)),  # cut in the final message's header
    (f"{ANALYSIS}Think.<|end|>{FINAL}Half an ans", ("Think.", "Half an ans")),
    (f"{ANALYSIS}<|end|>{FINAL}Answer.<|return|>", ("", "Answer.")),
    ("<|channel|>final<|message|>Answer.<|return|>", (None, "Answer.")),
    (f"{ANALYSIS}One.<|end|><|start|>assistant{ANALYSIS}Two.<|end|>{FINAL}Answer.<|return|>",
     ("One.\nTwo.", "Answer.")),
    (f"{ANALYSIS}Call it.<|end|>{TOOL}{{\"city\": \"Oslo\"}}<|call|>", ('Call it.\n{"city": "Oslo"}', None)),
    ("An answer without harmony.", (None, "An answer without harmony.")),  # a template that is not harmony's
    (f"{ANALYSIS}a < b and <| is text<|end|>{FINAL}<b>OK</b><|return|>", ("a < b and <| is text", "<b>OK</b>")),
])
def test_the_harmony_split_is_vllms(text, want):
    assert HARMONY.split(text) == want


def test_streamed_pieces_join_to_what_the_whole_answer_splits_into():
    texts = [HARMONY_SAID, f"{ANALYSIS}One.<|end|><|start|>assistant{ANALYSIS}Two.<|end|>{FINAL}A<|return|>",
             f"{ANALYSIS}Call.<|end|>{TOOL}{{}}<|call|>", f"{ANALYSIS}cut<|en", "<|chan", "<|channel|>final<|mess",
             "plain <|end|> text", f"{ANALYSIS}x<|end|>trailing<|endoftext|>{FINAL}y"]
    rng = random.Random(0)
    for text in texts:
        want = tuple(part or "" for part in HARMONY.split(text))
        cut_sets = [c for n in (0, 1, 2) for c in itertools.combinations(range(1, len(text)), n)]
        cut_sets += [range(1, len(text))]  # a character a piece
        cut_sets += [sorted(rng.sample(range(1, len(text)), min(6, len(text) - 1))) for _ in range(50)]
        for cuts in cut_sets:
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
            splitter, got = HarmonySplitter(), ["", ""]
            for i, piece in enumerate(pieces):
                reasoning, content = splitter.feed(piece, final=i == len(pieces) - 1)
                got = [got[0] + reasoning, got[1] + content]
            assert tuple(got) == want, (text, pieces)


def test_gpt_oss_answers_are_split_by_harmony_without_being_asked(gpt_oss):
    family = BY_MODEL_TYPE["gpt_oss"]
    assert (family.reasoning_parser, family.stop_tokens) == ("openai_gptoss", ("<|return|>", "<|call|>"))
    ids = gpt_oss.apply_chat_template(USER)
    assert answer_split(gpt_oss.tokenizer, ids, "auto", family.reasoning_parser) == HARMONY
    assert answer_split(gpt_oss.tokenizer, ids, "auto") is None  # no family parser, no <think> in the template
    assert answer_split(gpt_oss.tokenizer, ids, "none", family.reasoning_parser) is None
    plain = SamplingParams(max_tokens=3)
    assert HARMONY.sampling(plain).skip_special_tokens is False and plain.skip_special_tokens is True
    assert AnswerSplit().sampling(plain) is plain  # <think> tags are not special tokens
    out = gpt_oss.chat(USER, SamplingParams(max_tokens=20))[0]
    assert (out.outputs[0].reasoning_content, out.text, out.finish_reason) == (THOUGHT, ANSWER, "stop")
    assert gpt_oss.tokenizer.decode(out.token_ids, skip_special_tokens=False) == HARMONY_SAID  # the tokens hold both


def test_an_answer_ends_at_return_or_call(gpt_oss):
    stops = gpt_oss.tokenizer.convert_tokens_to_ids(["<|return|>", "<|call|>"])
    assert set(stops) <= gpt_oss.generator.eos_ids
    assert gpt_oss.tokenizer.convert_tokens_to_ids("<|end|>") not in gpt_oss.generator.eos_ids  # a message's end
    out = gpt_oss.generate({"prompt_token_ids": gpt_oss.apply_chat_template(USER)}, SamplingParams(max_tokens=40))[0]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].token_ids[-1] == stops[0]
    assert len(out.outputs[0].token_ids) == 11  # the script's answer, and not one token after <|return|>


def test_the_server_answers_reasoning_content_whole_and_streamed(gpt_oss, defaults):
    body = {"messages": USER, "max_tokens": 20}
    with serving(gpt_oss, defaults) as (_, client):
        whole = client.post("/v1/chat/completions", json=body).json()
        joined, deltas, finish = streamed(client, body)
        cut = client.post("/v1/chat/completions", json={**body, "max_tokens": 5}).json()  # ends inside analysis
        cut_joined, _, cut_finish = streamed(client, {**body, "max_tokens": 5})
    assert whole["choices"][0]["message"] == SPLIT and whole["choices"][0]["finish_reason"] == "stop"
    assert joined == {"content": ANSWER, "reasoning_content": THOUGHT} and finish == "stop"
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert not any("<|" in (d.get("content") or "") + (d.get("reasoning_content") or "") for d in deltas)
    assert cut["choices"][0]["message"] == {"role": "assistant", "content": None, "reasoning_content": THOUGHT}
    assert cut_joined == {"content": "", "reasoning_content": THOUGHT} and cut_finish == "length"


def test_the_server_splits_as_told(gpt_oss, defaults):
    with serving(gpt_oss, defaults, reasoning_parser="none") as (_, client):
        got = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 20}).json()
    assert "reasoning_content" not in got["choices"][0]["message"]
    assert got["choices"][0]["message"]["content"].endswith(ANSWER)


def test_reasoning_effort_reaches_the_template_from_the_api_server_and_batch(gpt_oss, defaults, tmp_path):
    def prompt_of(effort: str | None) -> str:
        return gpt_oss.tokenizer.decode(gpt_oss.apply_chat_template(
            USER, chat_template_kwargs=with_reasoning_effort(None, effort)), skip_special_tokens=False)

    assert "Reasoning: medium" in prompt_of(None) and "Reasoning: high" in prompt_of("high")
    out = gpt_oss.chat(USER, SamplingParams(max_tokens=20), reasoning_effort="low")[0]
    assert "Reasoning: low<|end|>" in gpt_oss.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)
    assert (out.outputs[0].reasoning_content, out.text) == (THOUGHT, ANSWER)
    high = len(gpt_oss.apply_chat_template(USER, chat_template_kwargs={"reasoning_effort": "high"}))
    with serving(gpt_oss, defaults) as (_, client):
        got = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 20,
                                                         "reasoning_effort": "high"}).json()
    assert got["usage"]["prompt_tokens"] == high != len(gpt_oss.apply_chat_template(USER))
    assert got["choices"][0]["message"] == SPLIT
    requests, bad = read_requests(write_batch(tmp_path / "in.jsonl", [
        chat_line("low", "Hello!", max_tokens=20, reasoning_effort="low")]))
    assert not bad and "Reasoning: low" in gpt_oss.tokenizer.decode(
        prompt_ids(requests[0], gpt_oss.tokenizer, gpt_oss.path)[0], skip_special_tokens=False)
    answers = []
    generate_answers(gpt_oss, requests, lambda req, answer: answers.append(answer), lambda req, e: pytest.fail(e))
    assert [a.choices[0]["message"] for a in answers] == [SPLIT]


def test_a_reasoning_effort_other_than_low_medium_high_is_refused_in_one_sentence(gpt_oss, defaults, tmp_path):
    with pytest.raises(ConfigError, match="expected reasoning_effort to be one of 'low', 'medium', 'high', found "
                                          "'max'"):
        gpt_oss.chat(USER, reasoning_effort="max")
    with serving(gpt_oss, defaults) as (_, client):
        for bad in ("max", "HIGH", 3, ["low"]):
            message = assert_error(client.post("/v1/chat/completions", json={"messages": USER,
                                                                               "reasoning_effort": bad}),
                                   400, "reasoning_effort")
            assert message.count(". ") == 0 and "\n" not in message and "reasoning_effort" in message, message
        completion = client.post("/v1/completions", json={"prompt": "Hi", "reasoning_effort": "low"})
        assert "not supported" in assert_error(completion, 400, "reasoning_effort")
    _, bad = read_requests(write_batch(tmp_path / "in.jsonl", [chat_line("x", "Hi", reasoning_effort="extreme")]))
    assert [b.custom_id for b in bad] == ["x"] and "expected reasoning_effort to be one of" in bad[0].message


def test_reasoning_effort_is_a_plain_template_variable_elsewhere(gpt_oss):
    from make_llama import CHATML
    from transformers import AutoTokenizer

    assert with_reasoning_effort({"enable_thinking": False}, "low") == {"reasoning_effort": "low",
                                                                        "enable_thinking": False}
    assert with_reasoning_effort({"reasoning_effort": "high"}, "low") == {"reasoning_effort": "high"}  # as vLLM merges
    assert with_reasoning_effort(None, None) is None
    chatml = AutoTokenizer.from_pretrained(gpt_oss.path)
    chatml.chat_template = CHATML  # a template that does not read it renders the same prompt
    assert encode_chat(chatml, gpt_oss.path, USER, template_kwargs=with_reasoning_effort(None, "high")) == \
        encode_chat(chatml, gpt_oss.path, USER)


def test_offload_serve_takes_openai_gptoss_as_vllm_spells_it(gpt_oss):
    from offload.cli.job_flags import effective_config
    from offload.cli.main import build_parser

    args = build_parser().parse_args(["serve", "--model", str(gpt_oss.path), "--reasoning-parser", "openai_gptoss"])
    assert effective_config(args, need_input=False).serve.reasoning_parser == "openai_gptoss"

"""Tool calls in chat (issue 47 item 3): tools, tool_choice and parallel_tool_calls checked in one sentence; required
and named choices enforced by a JSON schema on a tiny random model (the default model's tokenizer and template, which
takes no tools: the generic prompt), their calls valid against the function's parameters, whole and streamed; the
hermes, llama3_json and harmony styles parsed out of fixed answers; tool messages rendered natively by a template
with a tools branch and generically by one without; auto refused where the template takes no tools; offload
serve's --tool-call-parser (vLLM's names, none, and --enable-auto-tool-choice taken)."""

from __future__ import annotations

import json
import random

import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")
pytest.importorskip("fastapi", reason="offload[serve] is not installed")

from chat_support import with_template  # noqa: E402
from jobs_support import make_tiny_chat_model  # noqa: E402
from serve_support import assert_error, server_defaults, serving  # noqa: E402
from test_serve import events  # noqa: E402

from offload import LLM, SamplingParams  # noqa: E402
from offload.errors import ConfigError  # noqa: E402
from offload.jobs.batch import CHAT, COMPLETIONS, BodyError, check_body  # noqa: E402
from offload.reasoning import AnswerSplit  # noqa: E402
from offload.tool_parsers import AnswerParser, parse_answer, tool_parser  # noqa: E402
from offload.tools import from_body, template_takes_tools  # noqa: E402
from offload.weights.prompts import encode_chat  # noqa: E402

CONTEXT = 512
ROOM = 320  # tokens: every call below ends well within it (its strings are bounded)
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"]}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 6},
                                         "hours": {"type": "integer", "minimum": 0, "maximum": 23}},
        "required": ["zone", "hours"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
PARAMETERS = {"get_weather": WEATHER, "get_time": TIME}
NAMES = ("get_weather", "get_time")
USER = [{"role": "user", "content": "What is the weather in Oslo?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# a tools branch as Qwen2.5's template has it: the tools listed in a system turn, calls in <tool_call> tags, results
# in <tool_response> tags
HERMES_STYLE = (
    "{%- if tools %}<|im_start|>system\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n"
    "Return each call as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content }}"
    "{%- for c in m.tool_calls %}<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}")
CALLED = [{"role": "user", "content": "Weather in Oslo?"},
          {"role": "assistant", "content": None, "tool_calls": [
              {"id": "call_1", "type": "function",
               "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\", \"unit\": \"C\"}"}}]},
          {"role": "tool", "tool_call_id": "call_1", "content": "12 degrees"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("tools") / "model")


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(str(model_dir), backend="cpu", max_model_len=CONTEXT, batch_size=4)


@pytest.fixture(scope="module")
def hermes_dir(model_dir, tmp_path_factory):
    return with_template(model_dir, tmp_path_factory.mktemp("hermes") / "model", HERMES_STYLE)


def chat_body(**body) -> dict:
    return {"messages": USER, "tools": TOOLS, **body}


def assert_valid_calls(calls: list[dict], names=NAMES) -> None:
    """Each call in OpenAI's shape, to one of names, its arguments JSON valid against the function's parameters."""
    assert calls
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_"), call
        assert call["function"]["name"] in names, call
        jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMETERS[call["function"]["name"]])


# the body's checks ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("body, param, words", [
    (chat_body(tools={"get_weather": WEATHER}), "tools", "expected 'tools' to be a list"),
    (chat_body(tools=[{"type": "function", "name": "f"}]), "tools[0]", "expected tools[0] to be"),
    (chat_body(tools=[{"type": "function", "function": {"name": "no spaces"}}]), "tools[0].function.name",
     "letters, digits"),
    (chat_body(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nosuch"}}}]),
     "tools[0].function.parameters", "nosuch"),
    (chat_body(tools=[TOOLS[0], TOOLS[0]]), "tools", "twice"),
    (chat_body(tool_choice={"type": "function", "function": {"name": "get_mood"}}), "tool_choice",
     "'get_mood', which is not in 'tools'"),
    (chat_body(tool_choice="sometimes"), "tool_choice", "expected 'tool_choice' to be one of"),
    ({"messages": USER, "tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    (chat_body(parallel_tool_calls="yes"), "parallel_tool_calls", "true or false"),
    (chat_body(tool_choice="required", response_format={"type": "json_object"}), "tool_choice",
     "another output constraint"),
    ({"messages": [*CALLED[:2], {"role": "tool", "content": "12"}]}, "messages[2].tool_call_id", "tool_call_id"),
    ({"messages": [{"role": "user", "content": None, "tool_calls": CALLED[1]["tool_calls"]}]},
     "messages[0].tool_calls", "only an assistant message"),
    ({"messages": [USER[0], {"role": "assistant", "content": None}]}, "messages[1]", "null only beside"),
    ({"messages": [USER[0], {"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}]},
     "messages[1].tool_calls[0]", "expected messages[1].tool_calls[0] to be"),
])
def test_bad_tool_fields_are_refused_in_one_sentence_naming_the_field(body, param, words):
    with pytest.raises(BodyError) as e:
        check_body(CHAT, body, {})
    assert e.value.param == param and words in str(e.value), str(e.value)
    assert "\n" not in str(e.value) and str(e.value).count("; ") <= 1, str(e.value)


def test_enforced_choices_hold_the_answer_to_a_call_and_auto_does_not():
    for choice, enforced in (("required", True), (NAMED, True), ("auto", False), ("none", False)):
        params, messages = check_body(CHAT, chat_body(tool_choice=choice), {})
        assert (params.structured_outputs is not None) is enforced, choice
    assert check_body(CHAT, {"messages": CALLED}, {})[1][1]["tool_calls"] == CALLED[1]["tool_calls"]
    with pytest.raises(BodyError, match="'tools' is not supported"):
        check_body(COMPLETIONS, {"prompt": "x", "tools": TOOLS}, {})


def test_the_schema_of_a_named_call_and_of_required_calls():
    named = from_body(chat_body(tool_choice=NAMED)).schema()
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}, named)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_time", "arguments": {"zone": "UTC", "hours": 1}}, named)
    several = from_body(chat_body(tool_choice="required")).schema()
    jsonschema.validate([{"name": "get_time", "arguments": {"zone": "UTC", "hours": 1}}], several)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], several)
    one = from_body(chat_body(tool_choice="required", parallel_tool_calls=False)).schema()
    jsonschema.validate({"name": "get_time", "arguments": {"zone": "UTC", "hours": 1}}, one)


# enforced calls on a tiny random model -------------------------------------------------------------------------------
@pytest.mark.parametrize("choice, parallel", [(NAMED, True), ("required", False), ("required", True)])
def test_enforced_calls_from_a_random_model_parse_and_validate(llm, choice, parallel):
    params = SamplingParams(max_tokens=ROOM, temperature=1.0, seed=3, n=2)
    out = llm.chat(USER, params, tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel)[0]
    for sample in out.outputs:
        assert sample.finish_reason == "tool_calls", sample
        assert_valid_calls(sample.tool_calls, ("get_weather",) if choice == NAMED else NAMES)
        assert sample.text == ""
        if not parallel or choice == NAMED:
            assert len(sample.tool_calls) == 1


def test_the_generic_prompt_lists_the_functions_in_the_system_message(llm):
    choice = from_body(chat_body(tool_choice=NAMED))
    text = llm.tokenizer.decode(llm.apply_chat_template(USER, tools=choice))
    assert not template_takes_tools(llm.tokenizer, llm.tokenizer.chat_template)
    assert text.startswith("<|im_start|>system\nYou can call these functions") and '"name": "get_weather"' in text
    assert '"get_time"' not in text  # the named function only


def test_the_server_answers_enforced_calls_whole_and_streamed(llm, model_dir):
    body = chat_body(tool_choice="required", parallel_tool_calls=False, max_tokens=ROOM, temperature=1.0, seed=5)
    with serving(llm, server_defaults(model_dir)) as (_, client):
        whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        stream = client.post("/v1/chat/completions", json={**body, "stream": True})
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] is None, whole
    assert_valid_calls(whole["message"]["tool_calls"])
    chunks = [e for e in events(stream.text) if e != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    assert [c["index"] for c in calls] == [0] and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert calls[0]["function"] == whole["message"]["tool_calls"][0]["function"]  # seeded: the same answer
    assert not "".join(d.get("content") or "" for d in deltas)


def test_auto_without_a_tools_branch_is_refused_in_one_line(llm, model_dir):
    with serving(llm, server_defaults(model_dir)) as (_, client):
        response = client.post("/v1/chat/completions", json=chat_body(tool_choice="auto"))
    message = assert_error(response, 400, "tool_choice")
    assert "tool_choice 'required' or a named function" in message, message
    with pytest.raises(ConfigError, match="needs a chat template that takes tools"):
        llm.chat(USER, tools=TOOLS)


# conversations with tool messages -----------------------------------------------------------------------------------
def test_tool_messages_render_generically_where_the_template_takes_no_tools(llm):
    text = llm.tokenizer.decode(llm.apply_chat_template(CALLED))
    assert '<|im_start|>assistant\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}' in text
    assert "<|im_start|>user\nTool result (call_1): 12 degrees<|im_end|>" in text
    out = llm.chat(CALLED, SamplingParams(max_tokens=4, temperature=0))[0]
    assert len(out.token_ids) == 4  # the conversation continues


def test_tool_messages_and_tools_render_natively_where_the_template_takes_them(hermes_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hermes_dir)
    assert template_takes_tools(tokenizer, tokenizer.chat_template)
    ids = encode_chat(tokenizer, hermes_dir, CALLED, tools=from_body(chat_body(tool_choice="auto")))
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\n<tools>{\"type\": \"function\", \"function\": {\"name\": "
                           "\"get_weather\"")
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}</tool_call>' in text
    assert "<tool_response>\n12 degrees\n</tool_response>" in text and "Tool result" not in text
    assert text.endswith("<|im_start|>assistant\n")
    assert tool_parser(tokenizer, from_body(chat_body()), None, "auto") == "hermes"


def test_auto_on_a_template_with_tools_renders_and_answers(hermes_dir):
    llm = LLM(str(hermes_dir), backend="cpu", max_model_len=CONTEXT)
    out = llm.chat(CALLED, SamplingParams(max_tokens=8, temperature=0), tools=TOOLS)[0].outputs[0]
    assert len(out.token_ids) == 8 and out.finish_reason == "length"  # random text: no call, content as it came


# the auto styles, parsed out of fixed answers ------------------------------------------------------------------------
WEATHER_CALL = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}'
HARMONY = AnswerSplit(harmony=True)
TO_WEATHER = "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"


@pytest.mark.parametrize("parser, split, text, content, n_calls", [
    ("hermes", None, f"<tool_call>\n{WEATHER_CALL}\n</tool_call>", None, 1),
    ("hermes", None, f"Let me look.\n<tool_call>{WEATHER_CALL}</tool_call>\n<tool_call>{WEATHER_CALL}</tool_call>",
     "Let me look.", 2),
    ("hermes", None, '<tool_call>{"name": "get_mood", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "get_mood", "arguments": {}}</tool_call>', 0),  # not a tool: text
    ("hermes", None, "<tool_call>{not json</tool_call> and a < b", "<tool_call>{not json</tool_call> and a < b", 0),
    ("hermes", None, f"<tool_call>{WEATHER_CALL}", None, 1),  # its end tag cut by the stop token
    ("llama3_json", None, '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "C"}}', None, 1),
    ("llama3_json", None, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "C"}}; '
                          '{"name": "get_time", "parameters": {"zone": "UTC", "hours": 3}}', None, 2),
    ("llama3_json", None, '{"name": "get_mood", "parameters": {}}', '{"name": "get_mood", "parameters": {}}', 0),
    ("llama3_json", None, 'It is {"name": "get_weather"}', 'It is {"name": "get_weather"}', 0),  # not whole
    ("json", None, f"[{WEATHER_CALL}, {WEATHER_CALL}]", None, 2),
    ("openai", HARMONY, f"<|channel|>analysis<|message|>Look it up.<|end|>{TO_WEATHER}"
                        '{"city": "Oslo", "unit": "C"}<|call|>', None, 1),
    ("openai", HARMONY, f"<|channel|>analysis<|message|>Look.<|end|>{TO_WEATHER}"
                        '{"city": "Oslo", "unit": "C"}', None, 1),  # <|call|> is a stop token: not in the text
])
def test_each_auto_style_is_parsed_whole_and_in_pieces(parser, split, text, content, n_calls):
    reasoning, got, calls = parse_answer(text, split, parser, NAMES)
    assert got == content if n_calls == 0 else (got or "").strip() == (content or ""), got
    assert len(calls) == n_calls
    for call in calls:
        assert_valid_calls([call])
    if split is not None:
        assert reasoning.startswith("Look")
    rng = random.Random(0)
    for _ in range(20):  # streamed in random pieces: the same content and calls
        cuts = sorted(rng.sample(range(1, len(text)), 4))
        answer, joined, streamed = AnswerParser(split, parser, NAMES), "", []
        for a, b in zip([0, *cuts], [*cuts, len(text)]):
            _, piece, new = answer.feed(text[a:b], final=b == len(text))
            joined, streamed = joined + piece, streamed + new
        assert (joined or None) == got and [c["function"] for c in streamed] == [c["function"] for c in calls]


def test_batch_lines_take_tools_and_refuse_bad_ones_line_by_line(llm, tmp_path):
    from jobs_support import chat_line, write_batch

    from offload.jobs.batch import read_requests
    from offload.jobs.worker import generate_answers

    requests, bad = read_requests(write_batch(tmp_path / "in.jsonl", [
        chat_line("named", "Weather?", tools=TOOLS, tool_choice=NAMED, max_tokens=ROOM, temperature=1.0, seed=1),
        chat_line("unknown", "Weather?", tools=TOOLS, tool_choice={"type": "function", "function": {"name": "x"}}),
        chat_line("auto", "Weather?", tools=TOOLS)]))
    assert [b.custom_id for b in bad] == ["unknown"] and "not in 'tools'" in bad[0].message
    answers, errors = {}, {}
    generate_answers(llm, requests, lambda req, a: answers.setdefault(req.custom_id, a),
                     lambda req, e: errors.setdefault(req.custom_id, e))
    choice = answers["named"].choices[0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert_valid_calls(choice["message"]["tool_calls"], ("get_weather",))
    assert list(errors) == ["auto"] and "needs a chat template that takes tools" in errors["auto"]


# auto end to end: a scripted model (tests/chat_support.py) that says some text, then a hermes call --------------------
BYTES_CONTEXT = 2048  # tokens: the byte tokenizer spells the tools' listing (~600 bytes) a token a byte
CALL_SCRIPT = ("Ċ", "Let me look.", "<tool_call>", WEATHER_CALL, "</tool_call>", "<|im_end|>")


@pytest.fixture(scope="module")
def caller(tmp_path_factory) -> LLM:
    """A 2-layer Qwen3 with HERMES_STYLE that answers any chat `Let me look.<tool_call>WEATHER_CALL</tool_call>`."""
    from chat_support import BYTE_VOCAB, script, write_byte_tokenizer
    from conftest import make_hf_model, save_hf_model
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("caller") / "model"
    folder.mkdir()
    write_byte_tokenizer(folder, BYTE_VOCAB)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_tokens(list(CALL_SCRIPT[1:5]))  # not special, as Qwen's <tool_call> is not: decoded text keeps them
    tokenizer.chat_template = HERMES_STYLE
    tokenizer.save_pretrained(folder)
    model = make_hf_model("qwen3", vocab_size=len(tokenizer), max_position_embeddings=BYTES_CONTEXT)
    save_hf_model(script(model, tokenizer.convert_tokens_to_ids(list(CALL_SCRIPT))), folder)
    return LLM(str(folder), backend="cpu", max_model_len=BYTES_CONTEXT)


def test_auto_calls_are_parsed_out_of_the_answer_whole_and_streamed(caller):
    body = chat_body(max_tokens=16)
    with serving(caller, server_defaults(caller.path)) as (_, client):
        whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        stream = client.post("/v1/chat/completions", json={**body, "stream": True})
        untouched = client.post("/v1/chat/completions", json={**body, "tool_choice": "none"}).json()["choices"][0]
    assert whole["message"]["content"] == "Let me look." and whole["finish_reason"] == "tool_calls", whole
    assert [json.loads(c["function"]["arguments"]) for c in whole["message"]["tool_calls"]] == [
        {"city": "Oslo", "unit": "C"}]
    chunks = [e for e in events(stream.text) if e != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    assert "".join(d.get("content") or "" for d in deltas) == "Let me look."
    assert [(c["index"], c["function"]) for c in calls] == [(0, whole["message"]["tool_calls"][0]["function"])]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    said = f"Let me look.<tool_call>{WEATHER_CALL}</tool_call>"
    assert untouched["message"] == {"role": "assistant", "content": said}  # tool_choice none: nothing parsed
    assert untouched["finish_reason"] == "stop"
    # enforced: held to the call (a token a byte: ~70 of them), though the script would say "Let me look."
    named = caller.chat(USER, SamplingParams(max_tokens=128, temperature=0), tools=TOOLS, tool_choice=NAMED)[0]
    assert named.outputs[0].finish_reason == "tool_calls", named.outputs[0]
    assert_valid_calls(named.outputs[0].tool_calls, ("get_weather",))


@pytest.mark.parametrize("configured, called", [("hermes", True), ("none", False)])
def test_serve_tool_call_parser_reads_or_leaves_an_auto_answer(caller, configured, called):
    body = chat_body(max_tokens=16)
    with serving(caller, server_defaults(caller.path), tool_call_parser=configured) as (_, client):
        whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        stream = client.post("/v1/chat/completions", json={**body, "stream": True})
    deltas = [e["choices"][0]["delta"] for e in events(stream.text) if e != "[DONE]"]
    streamed = [call for d in deltas for call in d.get("tool_calls", [])]
    if called:  # hermes: the same answer as auto picks for this template
        assert whole["message"]["content"] == "Let me look." and whole["finish_reason"] == "tool_calls", whole
        assert_valid_calls(whole["message"]["tool_calls"], ("get_weather",))
        assert [c["function"] for c in streamed] == [c["function"] for c in whole["message"]["tool_calls"]]
    else:  # none: the call stays text, whole and streamed
        said = f"Let me look.<tool_call>{WEATHER_CALL}</tool_call>"
        assert whole["message"] == {"role": "assistant", "content": said} and whole["finish_reason"] == "stop"
        assert not streamed and "".join(d.get("content") or "" for d in deltas) == said
    assert tool_parser(None, from_body(chat_body(tool_choice="required")), None, configured) == "json"  # enforced


def test_offload_serve_takes_tool_call_parser_as_vllm_spells_it(model_dir):
    from offload.cli.job_flags import effective_config
    from offload.cli.main import build_parser

    def serve_of(*flags):
        args = build_parser().parse_args(["serve", "--model", str(model_dir), *flags])
        return effective_config(args, need_input=False).serve

    assert serve_of().tool_call_parser == "auto" and not serve_of().enable_auto_tool_choice
    vllm = serve_of("--enable-auto-tool-choice", "--tool-call-parser", "llama3_json")
    assert vllm.tool_call_parser == "llama3_json" and vllm.enable_auto_tool_choice
    with pytest.raises(ConfigError, match="'serve.tool_call_parser': expected one of 'auto', 'hermes', "
                                          "'llama3_json', 'openai' or 'none', found 'mistral'"):
        serve_of("--tool-call-parser", "mistral")


def test_offload_serve_refuses_an_unknown_tool_call_parser_in_one_line(model_dir, capsys):
    from offload.cli.main import main

    assert main(["serve", "--model", str(model_dir), "--tool-call-parser", "mistral"]) != 0
    err = capsys.readouterr().err.strip()
    assert "serve.tool_call_parser" in err and "'mistral'" in err and "\n" not in err, err

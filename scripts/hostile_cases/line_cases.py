"""Request lines of a batch job (each between a good first and last request): custom_ids of the wrong type, huge
lines, wrong urls and methods, bodies with fields of the wrong type; and a few odd lines that are valid."""

from __future__ import annotations

import json

from hostile_cases import cases
from hostile_cases.fixtures import chat, completion


def _line(*items):
    return lambda fx, f: list(items)


def _body(custom_id: str, make=completion, **body):
    return _line(make(custom_id, **body))


def _envelope(custom_id: str, **changes):
    return _line({**completion(custom_id), **changes})


LINES = {
    "custom_id a number": _line({**completion("x"), "custom_id": 5}),
    "custom_id a list": _line({**completion("x"), "custom_id": ["a"]}),
    "custom_id true": _line({**completion("x"), "custom_id": True}),
    "custom_id of a megabyte": (_line(completion("i" * 1_000_000)), "ok"),  # OpenAI sets no length
    "custom_id repeated far apart": _line(completion("dup"), *[completion(f"n{i}") for i in range(3)],
                                          completion("dup")),
    "a line of 20 MB": _body("huge", prompt="x " * 10_000_000),
    "a NUL byte line": _line("\x00" * 100),
    "url /v1/embeddings": _envelope("embed", url="/v1/embeddings"),
    "url a number": _envelope("url-int", url=5),
    "url missing": _line({k: v for k, v in completion("no-url").items() if k != "url"}),
    "method post in lower case": _envelope("lower-post", method="post"),
    "body null": _envelope("body-null", body=None),
    "body a list": _envelope("body-list", body=[{"prompt": "hi"}]),
    "max_tokens a string": _body("mt-str", max_tokens="5"),
    "max_tokens 1.5": _body("mt-frac", max_tokens=1.5),
    "max_tokens true": _body("mt-bool", max_tokens=True),
    "max_tokens 10^12": (_body("mt-huge", max_tokens=10**12), "ok"),  # documented: answered to the context
    "temperature a word": _body("temp-word", temperature="hot"),
    "n 0": _body("n-zero", n=0),
    "logprobs 100": _body("lp-100", logprobs=100),
    "top_logprobs without logprobs": _body("tlp", make=chat, top_logprobs=3),
    "echo a string": _body("echo-str", echo="yes"),
    "stop a list of numbers": _body("stop-nums", stop=[1, 2]),
    "a thousand stop strings": (_body("stop-1000", stop=[f"s{i}" for i in range(1000)]), "ok"),  # vLLM's too
    "seed a word": _body("seed-word", seed="x"),
    "logit_bias a list": _body("lb-list", logit_bias=[1, 2]),
    "logit_bias value a word": _body("lb-word", logit_bias={"5": "x"}),
    "logit_bias key -1": _body("lb-neg", logit_bias={"-1": 1}),
    "presence_penalty 5": _body("pp-5", presence_penalty=5),
    "message content null": _line({**chat("content-null"), "body": {"messages": [{"role": "user", "content": None}]}}),
    "message without a role": _line({**chat("no-role"), "body": {"messages": [{"content": "hi"}]}}),
    "messages a string": _line({**chat("msg-str"), "body": {"messages": "hi"}}),
    "prompt ids and text mixed": _body("mixed", prompt=[1, "a"]),
    "prompt two id lists": _body("nested", prompt=[[1, 2], [3]]),
    "prompt id negative": _body("neg-id", prompt=[-1, 2]),
    "prompt id a fraction": _body("frac-id", prompt=[1.5]),
    "chat_template_kwargs a list": _body("ctk-list", make=chat, chat_template_kwargs=["enable_thinking"]),
    "chat_template_kwargs a template variable": _body("ctk-msg", make=chat,
                                                      chat_template_kwargs={"messages": []}),
    "response_format json_schema": _body("rf", make=chat, response_format={"type": "json_schema"}),
    "tools given": _body("tools", make=chat, tools=[{"type": "function", "function": {"name": "f"}}]),
    "stream true in a job": (_body("stream", stream=True), "ok"),
    "a number where the line is": _line("3.14"),
    "NaN temperature in raw JSON": _line(json.dumps(completion("nan-temp")).replace('"max_tokens": 2',
                                                                                     '"temperature": NaN')),
    "Infinity top_p in raw JSON": _line(json.dumps(completion("inf-top-p")).replace('"max_tokens": 2',
                                                                                     '"top_p": Infinity')),
}

CASES = cases("lines", LINES)

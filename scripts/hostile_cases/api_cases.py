"""Python API calls: LLM(...) keyword arguments, SamplingParams fields, and generate/chat given the wrong things.
Each runs in a child process, which loads the tiny model itself where it needs one."""

from __future__ import annotations

import math

from hostile_cases import Case

USER = [{"role": "user", "content": "hi"}]


def _llm(fx, **kwargs):
    from offload import LLM

    return LLM(str(fx.model), **{"max_model_len": 64, **kwargs})


def _sp(**kwargs):
    from offload import SamplingParams

    return SamplingParams(**kwargs)


def _generate(*args, **kwargs):
    return lambda fx, f: lambda: _llm(fx).generate(*args, **kwargs)


def _chat(*args, **kwargs):
    return lambda fx, f: lambda: _llm(fx).chat(*args, **kwargs)


def _params(**kwargs):
    return lambda fx, f: lambda: _sp(**kwargs)


def _load(**kwargs):
    return lambda fx, f: lambda: _llm(fx, **kwargs)


API = {
    "LLM of a number": lambda fx, f: lambda: __import__("offload").LLM(5),
    "LLM of None": lambda fx, f: lambda: __import__("offload").LLM(None),
    "LLM max_model_len a string": _load(max_model_len="64"),
    "LLM max_model_len 0": _load(max_model_len=0),
    "LLM cpu_memory -1": _load(cpu_memory=-1),
    "LLM an unknown option": _load(bogus=1),
    "LLM batch_size 0": _load(batch_size=0),
    "LLM dtype int4": _load(dtype="int4"),
    "LLM speculative_config a string": _load(speculative_config="ngram"),
    "LLM speculative method magic": _load(speculative_config={"method": "magic"}),
    "LLM placement a string": _load(placement="all on cpu"),
    "LLM hardware a number": _load(hardware=5),
    "LLM backend tpu": _load(backend="tpu"),
    "LLM prefill_chunk_tokens 0": _load(prefill_chunk_tokens=0),
    "SamplingParams max_tokens 0": _params(max_tokens=0),
    "SamplingParams max_tokens 1.5": _params(max_tokens=1.5),
    "SamplingParams temperature a word": _params(temperature="hot"),
    "SamplingParams top_p NaN": _params(top_p=math.nan),
    "SamplingParams top_k -5": _params(top_k=-5),
    "SamplingParams stop numbers": _params(stop=[5]),
    "SamplingParams logit_bias key a word": _params(logit_bias={"a": 1}),
    "SamplingParams logit_bias infinite": _params(logit_bias={1: math.inf}),
    "SamplingParams n 0": _params(n=0),
    "SamplingParams logprobs -1": _params(logprobs=-1),
    "SamplingParams seed a word": _params(seed="x"),
    "SamplingParams presence_penalty 3": _params(presence_penalty=3),
    "SamplingParams min_p -0.5": _params(min_p=-0.5),
    "generate None": _generate(None),
    "generate params a string": _generate("hi", "greedy"),
    "generate an empty id list": _generate([[]]),
    "generate a negative id": _generate([[-1, 2]]),
    "generate a list of lists of words": _generate([["a", "b"]]),
    "generate a dict": _generate({"prompt": "hi"}),
    "chat a string": _chat("hi"),
    "chat a message without content": _chat([{"role": "user"}]),
    "chat an empty message": _chat([{}]),
    "chat messages of a number": _chat([5]),
    "chat template kwargs a string": _chat(USER, chat_template_kwargs="enable_thinking"),
}
ACCEPT = {"LLM an unknown option": ("TypeError",)}  # Python's own one-line answer to an unknown keyword
VALID = ("LLM max_model_len a string",)  # pydantic's lax mode reads "64" as 64, as a job's YAML does

CASES = [Case("api", name, make, "ok" if name in VALID else "error", ACCEPT.get(name, ()))
         for name, make in API.items()]

"""Requests to a running `offload serve` (bodies that are not JSON or not an object, fields of the wrong type, a huge
n, bad logit_bias, stop, tools, response_format and chat_template_kwargs, another model's name, missing or wrong
auth, streams with bad parameters, the Batch API's routes given wrong ids and forms), and files through its Batch
API."""

from __future__ import annotations

import json

from hostile_cases import cases
from hostile_cases.fixtures import chat, completion
from hostile_cases.served import AUTH, BatchFile, Http

USER = [{"role": "user", "content": "hi"}]
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def _post(path: str, body, **kwargs):
    return lambda fx, f: Http("POST", path, body, **kwargs)


def _chat(**body):
    return _post(CHAT, {"messages": USER, "max_tokens": 2, **body})


def _completion(**body):
    return _post(COMPLETIONS, {"prompt": "hi", "max_tokens": 2, **body})


def _get(path: str, **kwargs):
    return lambda fx, f: Http("GET", path, **kwargs)


HTTP = {
    "empty body": _post(COMPLETIONS, b""),
    "body null": _post(COMPLETIONS, b"null"),
    "body an array": _post(CHAT, b"[]"),
    "body a string": _post(CHAT, b'"hi"'),
    "body not UTF-8": _post(COMPLETIONS, b'{"prompt": "\xff\xfe"}'),
    "body as text/plain": (_post(COMPLETIONS, json.dumps({"prompt": "hi", "max_tokens": 1}),
                                 content_type="text/plain"), "ok"),
    "NaN temperature": _post(COMPLETIONS, b'{"prompt": "hi", "temperature": NaN}'),
    "Infinity max_tokens": _post(COMPLETIONS, b'{"prompt": "hi", "max_tokens": Infinity}'),
    "prompt a number": _post(COMPLETIONS, {"prompt": 5}),
    "messages a string": _post(CHAT, {"messages": "hi"}),
    "max_tokens a string": _completion(max_tokens="10"),
    "max_tokens 10^12": (_completion(max_tokens=10**12), "ok"),  # documented: answered up to the context
    "temperature a list": _chat(temperature=[1]),
    "n 10^9": _completion(n=10**9),
    "n -1": _chat(n=-1),
    "n 64 of a 64-token context": (_completion(n=64, max_tokens=60), "ok"),
    "logit_bias key a word": _chat(logit_bias={"x": 1}),
    "logit_bias 10^9": _chat(logit_bias={"1": 1e9}),
    "logit_bias a list": _chat(logit_bias=[1, 2]),
    "stop a number": _chat(stop=5),
    "stop of numbers": _completion(stop=[1]),
    "stop an empty string": _completion(stop=""),
    "tools a string": _chat(tools="x"),
    "tools given": _chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    "tool_choice required": _chat(tool_choice="required"),
    "response_format json_schema": _chat(response_format={"type": "json_schema", "json_schema": {}}),
    "response_format a string": _chat(response_format="json"),
    "chat_template_kwargs a string": _chat(chat_template_kwargs="x"),
    "chat_template_kwargs overriding messages": _chat(chat_template_kwargs={"messages": []}),
    "model another name": _completion(model="gpt-4o"),
    "model a number": _completion(model=5),
    "no auth": lambda fx, f: Http("POST", COMPLETIONS, {"prompt": "hi"}, headers={}),
    "empty bearer": lambda fx, f: Http("POST", COMPLETIONS, {"prompt": "hi"}, headers={"Authorization": "Bearer"}),
    "auth on the health route only": lambda fx, f: Http("GET", "/v1/models", headers={"X-Api-Key": "sk-hostile"}),
    "stream a string": _chat(stream="yes"),
    "stream with n 0": _chat(stream=True, n=0),
    "stream_options without stream": _chat(stream_options={"include_usage": True}),
    "stream with logprobs 50": _completion(stream=True, logprobs=50),
    "stream of a prompt past the context": _completion(stream=True, prompt="word " * 200),
    "stream_options a list": _chat(stream=True, stream_options=["include_usage"]),
    "GET on completions": _get(COMPLETIONS),
    "unknown route": _get("/v1/embeddings"),
    "a 5 MB prompt": _completion(prompt="x" * 5_000_000),
    "a prompt of 100,000 token ids": _completion(prompt=list(range(500)) * 200),
    "batch of a missing file": _post("/v1/batches", {"input_file_id": "file-nope", "endpoint": COMPLETIONS,
                                                     "completion_window": "24h"}),
    "batch without input_file_id": _post("/v1/batches", {"endpoint": COMPLETIONS, "completion_window": "24h"}),
    "batch input_file_id a number": _post("/v1/batches", {"input_file_id": 5, "endpoint": COMPLETIONS,
                                                          "completion_window": "24h"}),
    "batch window 1h": _post("/v1/batches", {"input_file_id": "file-x", "endpoint": COMPLETIONS,
                                             "completion_window": "1h"}),
    "batch metadata a list": _post("/v1/batches", {"input_file_id": "file-x", "endpoint": COMPLETIONS,
                                                   "completion_window": "24h", "metadata": ["a"]}),
    "get an unknown batch": _get("/v1/batches/batch_nope"),
    "cancel an unknown batch": _post("/v1/batches/batch_nope/cancel", None),
    "content of an unknown file": _get("/v1/files/file-nope/content"),
    "file id of path parts": _get("/v1/files/..%2F..%2Fserve.lock/content"),
    "batches limit -1": _get("/v1/batches?limit=-1"),
    "batches limit 10^20": _get("/v1/batches?limit=100000000000000000000"),
    "batches after an unknown id": (_get("/v1/batches?after=batch_nope"), "ok"),
    "upload as JSON": _post("/v1/files", {"file": "x", "purpose": "batch"}),
    "upload of purpose fine-tune": lambda fx, f: _Upload(b"{}\n", "fine-tune"),
    "upload without a file": lambda fx, f: _Upload(None, "batch"),
}


class _Upload(Http):
    """A multipart upload (sent by Served.send as a form)."""

    def __init__(self, data: bytes | None, purpose: str):
        boundary = "hostileboundary"
        parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n{purpose}\r\n'.encode()]
        if data is not None:
            parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
                         f"Content-Type: application/jsonl\r\n\r\n".encode() + data + b"\r\n")
        super().__init__("POST", "/v1/files", b"".join(parts) + f"--{boundary}--\r\n".encode(), dict(AUTH),
                         f"multipart/form-data; boundary={boundary}")


def _file(*items, endpoint: str = COMPLETIONS, name: str = "in.jsonl"):
    data = "".join((json.dumps(i) if isinstance(i, dict) else i) + "\n" for i in items).encode()
    return lambda fx, f: BatchFile(name, data, endpoint)


BATCH = {
    "a bad body among good ones": _file(completion("g1"), completion("b1", n="two"), completion("g2")),
    "a chat line in a completions batch": _file(completion("g1"), chat("c1"), completion("g2")),
    "custom_id repeated": _file(completion("d"), completion("d")),
    "an empty file": _file(),
    "a binary file": lambda fx, f: BatchFile("in.jsonl", bytes(range(256)) * 8),
    "a file name with path parts": _file(completion("g1"), completion("b1", max_tokens=0),
                                         name="../../escape.jsonl"),
    "every line bad": _file(completion("b1", temperature=-1), completion("b2", top_p=0)),
}

CASES = cases("http", HTTP)
BATCH_CASES = cases("batch", BATCH)

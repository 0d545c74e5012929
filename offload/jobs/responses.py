"""OpenAI's answer shapes, built once for a batch job's output line and a server's answer: the choices of a
finished request (n samples each; for completions, echo) with their logprobs, and their usage (the body around
them is jobs.batch.response_body)."""

from __future__ import annotations

from offload.jobs.batch import CHAT, response_body, usage  # noqa: F401 (the shapes of one answer)
from offload.options import DEFAULT_TOOL_CALL_PARSER
from offload.reasoning import AnswerSplit
from offload.tool_parsers import finish_reason, parse_answer, tool_parser
from offload.tools import ToolChoice


def token_text(tokenizer, token_id: int) -> str:
    """One token as text (vLLM's 'token_id:N' where the model has no tokenizer)."""
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id])


def completion_logprobs(tokenizer, token_ids: list[int], logprobs: list, offset: int = 0) -> dict:
    """The completions API's logprobs object of tokens and their TokenLogprob (None where nothing predicts the
    token: a prompt's first): tokens as text, their logprobs, the top ones as {token: logprob} (the chosen one
    among them, as OpenAI and vLLM give it), and each token's character offset from `offset`."""
    tokens, values, tops, offsets = [], [], [], []
    for token_id, item in zip(token_ids, logprobs):
        text = token_text(tokenizer, token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if item is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(item.logprob)
        top = {token_text(tokenizer, t): p for t, p in item.top}
        top.setdefault(text, item.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokenizer, logprobs: list) -> dict:
    """The chat API's logprobs object: per token its text, logprob, UTF-8 bytes and top_logprobs."""
    def entry(token_id: int, logprob: float) -> dict:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(t.token_id, t.logprob), "top_logprobs": [entry(i, p) for i, p in t.top]}
                        for t in logprobs]}


def choices(url: str, output, tokenizer, *, echo: bool = False, prompt_text: str | None = None,
            first_index: int = 0, split: AnswerSplit | None = None, tools: ToolChoice | None = None,
            tool_call_parser: str = DEFAULT_TOOL_CALL_PARSER) -> list[dict]:
    """The choices of a finished request (an offload RequestOutput): one per sample, index first_index + its
    index; for completions with echo, the prompt's text (prompt_text, else the prompt decoded) before each; for chat
    with a split (None: not split), the message's reasoning_content and content as vLLM's reasoning parsers give
    them, and with tools its tool_calls as tool_call_parser (serve.tool_call_parser) reads them (finish_reason
    tool_calls where it made some)."""
    out = []
    parser = tool_parser(tokenizer, tools, split, tool_call_parser) if url == CHAT else None
    for sample in output.outputs:
        index = first_index + sample.index
        if url == CHAT:
            logprobs = None if sample.logprobs is None else chat_logprobs(tokenizer, sample.logprobs)
            message = chat_message(sample.text, split, parser, tools.names if tools else ())
            out.append({"index": index, "message": message, "logprobs": logprobs,
                        "finish_reason": finish_reason(sample.finish_reason, bool(message.get("tool_calls")))})
            continue
        head = _echo_text(output, tokenizer, prompt_text) if echo else ""
        logprobs = None
        if sample.logprobs is not None:
            ids, scored = list(sample.token_ids), list(sample.logprobs)
            if echo:  # the prompt's tokens first, scored where the request asked (prompt_logprobs)
                ids = list(output.prompt_token_ids) + ids
                scored = list(output.prompt_logprobs or [None] * len(output.prompt_token_ids)) + scored
            logprobs = completion_logprobs(tokenizer, ids, scored)
        out.append({"index": index, "text": head + sample.text, "logprobs": logprobs,
                    "finish_reason": sample.finish_reason})
    return out


def chat_message(text: str, split: AnswerSplit | None, parser: str | None = None, names: tuple[str, ...] = ()) -> dict:
    """An answer's chat message: split into reasoning_content and content where split is not None, its tool calls
    parsed out (offload/tool_parsers.py) into tool_calls by parser (None: not parsed), content None beside them where
    only whitespace is left."""
    if split is None and parser is None:
        return {"role": "assistant", "content": text}
    reasoning, content, calls = parse_answer(text, split, parser, names)
    message = {"role": "assistant", "content": content}
    if calls:
        message = {**message, "content": (content or "").strip() or None, "tool_calls": calls}
    return message if split is None else {**message, "reasoning_content": reasoning}


def _echo_text(output, tokenizer, prompt_text: str | None) -> str:
    if prompt_text is not None:
        return prompt_text
    if output.prompt is not None:
        return output.prompt
    return "" if tokenizer is None else tokenizer.decode(output.prompt_token_ids)


def usage_of(outputs: list) -> dict:
    """Usage of finished requests: each prompt counted once (its n samples share its prefill), every sample's
    tokens."""
    return usage(sum(len(o.prompt_token_ids) for o in outputs),
                 sum(len(s.token_ids) for o in outputs for s in o.outputs),
                 sum(o.num_cached_tokens for o in outputs))

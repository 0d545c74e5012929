"""vLLM's POST /tokenize and POST /detokenize on `offload serve`: a prompt, or a chat's messages through the chat
template, as the token ids /v1/completions and /v1/chat/completions would run, and token ids back to text. The
fields are vLLM's; what cannot be read gets a 400 naming the field."""

from __future__ import annotations

import asyncio
import functools

from fastapi import FastAPI, Request

from offload.errors import OffloadError
from offload.jobs.batch import CHAT, TEMPLATE_KWARGS, BodyError, check_body
from offload.serve.protocol import ApiError, read_json
from offload.weights.prompts import encode_chat, encode_text


def tokenize(body, llm) -> dict:
    """{"prompt"} (text) or {"messages"} (a chat), with vLLM's add_special_tokens, add_generation_prompt,
    chat_template_kwargs and return_token_strs, into {"count", "max_model_len", "tokens", "token_strs"}."""
    body = _object(body)
    if ("prompt" in body) == ("messages" in body):
        raise ApiError(400, f"expected the body to hold one of 'prompt' (text) or 'messages' (a chat), found "
                            f"{'both' if 'prompt' in body else 'neither'}", "prompt")
    chat = "messages" in body
    specials = _flag(body, "add_special_tokens", not chat)  # vLLM's defaults: a chat template places its own
    strs = _flag(body, "return_token_strs", False)
    try:
        ids = _chat_ids(body, llm, specials) if chat else _text_ids(body, llm, specials)
    except BodyError as e:
        raise ApiError(400, str(e), e.param) from None
    except OffloadError as e:
        raise ApiError(400, str(e), "messages" if chat else "prompt") from None
    return {"count": len(ids), "max_model_len": llm.generator.context_len, "tokens": ids,
            "token_strs": llm.tokenizer.convert_ids_to_tokens(ids) if strs else None}


def detokenize(body, llm) -> dict:
    """{"tokens": [ids]} into {"prompt": text}; an id the tokenizer does not know is refused, not skipped."""
    tokens = _object(body).get("tokens")
    if not isinstance(tokens, list) or not tokens or not all(_is_id(t) for t in tokens):
        raise ApiError(400, f"expected 'tokens' to be a non-empty list of token ids (integers), found "
                            f"{tokens!r:.80}", "tokens")
    tokenizer = _tokenizer(llm, "decode token ids")
    n_known = len(tokenizer)
    unknown = next((t for t in tokens if not 0 <= t < n_known), None)
    if unknown is not None:
        raise ApiError(400, f"the token id {unknown} is not in this model's tokenizer, whose ids run from 0 to "
                            f"{n_known - 1}; send ids /tokenize gave", "tokens")
    return {"prompt": tokenizer.decode(tokens)}


def _text_ids(body: dict, llm, specials: bool) -> list[int]:
    prompt = body["prompt"]
    if not isinstance(prompt, str) or not prompt:
        raise ApiError(400, f"expected 'prompt' to be non-empty text, found {prompt!r:.80}", "prompt")
    return encode_text(llm.tokenizer, llm.path, prompt, llm.generator.context_len, add_special_tokens=specials)


def _chat_ids(body: dict, llm, specials: bool) -> list[int]:
    """The messages checked as /v1/chat/completions checks them, rendered by the chat template; specials: the
    tokenizer's BOS in front as well (vLLM's add_special_tokens for a chat: on top of what the template adds)."""
    generation = _flag(body, "add_generation_prompt", True)
    _, messages = check_body(CHAT, {k: body[k] for k in ("messages", TEMPLATE_KWARGS) if k in body}, {})
    ids = encode_chat(llm.tokenizer, llm.path, messages, generation, body.get(TEMPLATE_KWARGS),
                      llm.generator.context_len)
    bos = llm.tokenizer.bos_token_id
    return [bos, *ids] if specials and bos is not None else ids


def _tokenizer(llm, what: str):
    if llm.tokenizer is None:
        raise ApiError(400, f"the model in {llm.path} has no tokenizer files, so this server cannot {what}; add the "
                            f"model's tokenizer.json and tokenizer_config.json to {llm.path}")
    return llm.tokenizer


def _object(body) -> dict:
    if not isinstance(body, dict):
        raise ApiError(400, f"expected the request body to be a JSON object, found {type(body).__name__}")
    return body


def _flag(body: dict, key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"expected {key!r} to be true or false, found {value!r:.80}", key)
    return value


def _is_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def add_token_routes(app: FastAPI, server, auth: list) -> None:
    """POST /tokenize and /detokenize (vLLM's paths, without /v1); both run in the server's preparing thread, off
    the event loop, as a request's own tokenizing does."""

    async def run(request: Request, answer) -> dict:
        body = await read_json(request)
        server.check_model(body)
        return await asyncio.get_running_loop().run_in_executor(server.preparer,
                                                                 functools.partial(answer, body, server.llm))

    @app.post("/tokenize", dependencies=auth)
    async def tokenize_route(request: Request):
        return await run(request, tokenize)

    @app.post("/detokenize", dependencies=auth)
    async def detokenize_route(request: Request):
        return await run(request, detokenize)

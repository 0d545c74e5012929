"""A prompt as the model takes it: text and conversations encoded by the model's tokenizer and chat template, and
token ids checked against its vocabulary and the run's context. `offload run` and `offload validate` both use
these, so validate refuses what run would (no torch: the tokenizer is transformers')."""

from __future__ import annotations

import difflib
import functools
from pathlib import Path

from offload.errors import ConfigError
from offload.sampling import SamplingParams
from offload.spec import ModelSpec
from offload.tools import ToolChoice, check_tool_fields, for_template, template_takes_tools
from offload.weights.model_files import library_error

ROLES = ("system", "user", "assistant", "tool")  # tool: a call's result (offload/tools.py renders it)
# a normalizer may compose characters (NFC turns e + U+0301 into one): the text a token spans may be this many
# times longer than its vocabulary entry
COMPOSED_CHARS = 2


def encode_text(tokenizer, path: Path, text: str, context_len: int | None = None,
                add_special_tokens: bool = True) -> list[int]:
    """Token ids of a text prompt (with the tokenizer's special tokens, such as BOS, unless add_special_tokens is
    false); ConfigError for a model without a tokenizer, text no tokenizer encodes, or text too long for context_len
    tokens (refused before it is tokenized)."""
    if tokenizer is None:
        raise ConfigError(f"the model in {path} has no tokenizer files, so it cannot read text; give the prompt as "
                          f"token ids, or add the model's tokenizer.json and tokenizer_config.json to {path}")
    check_text(text, "the prompt")
    check_prompt_chars(tokenizer, len(text), context_len, "the prompt")
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def check_prompt_chars(tokenizer, n_chars: int, context_len: int | None, what: str) -> None:
    """ConfigError where text of n_chars characters has more tokens than context_len for certain: no token spans
    more characters than the tokenizer's longest vocabulary entry. Tokenizing takes ~2.5 us a character (a 20 MB line
    took 50 s), so a prompt far past the context is refused before it is."""
    longest = COMPOSED_CHARS * max_token_chars(tokenizer)
    if context_len is not None and n_chars > context_len * longest:
        raise ConfigError(f"{what} is {n_chars:,} characters, more than the {context_len:,} tokens of this run's "
                          f"context (max_model_len) can hold ({longest} characters a token at most for this "
                          f"tokenizer); shorten the prompt, or raise max_model_len (model.max_model_len in a job, "
                          f"--max-model-len)")


@functools.lru_cache(maxsize=8)
def max_token_chars(tokenizer) -> int:
    """The most characters one token of the tokenizer spans (its longest vocabulary entry; a byte-level entry's
    characters are bytes, at least as many as the text's characters)."""
    return max(map(len, tokenizer.get_vocab()), default=1)


def encode_chat(tokenizer, path: Path, conversation: list[dict], add_generation_prompt: bool = True,
                template_kwargs: dict | None = None, context_len: int | None = None,
                tools: ToolChoice | None = None) -> list[int]:
    """Token ids of a conversation rendered with the model's chat template, template_kwargs (a request's
    chat_template_kwargs, such as enable_thinking) passed to it, and tools and tool messages as offload/tools.py's
    for_template gives them; ConfigError without one, for a role no template renders, or where the template refuses
    the conversation (its own checks raise, such as roles that must alternate). A template that refuses a system
    message (Gemma 2's) gets it folded into the first user turn."""
    if tokenizer is None:
        raise ConfigError(f"the model in {path} has no tokenizer files, so no chat template; give the prompt as "
                          f"token ids without chat, or add the model's tokenizer.json and tokenizer_config.json to "
                          f"{path}")
    if not tokenizer.chat_template:
        raise ConfigError(f"the tokenizer in {path} has no chat template; send plain prompts (a completion, not a "
                          f"chat)")
    check_messages(conversation)
    conversation, offered = for_template(conversation, tools, template_takes_tools(tokenizer, str(
        tokenizer.chat_template)))
    # the template renders what users and the system wrote whole (Qwen3's drops the thinking of earlier answers)
    check_prompt_chars(tokenizer, sum(len(m["content"]) for m in conversation if m["role"] != "assistant" and
                                      isinstance(m["content"], str)), context_len, "the messages' text")
    kwargs = check_template_kwargs(template_kwargs)
    if offered:
        kwargs["tools"] = offered
    if conversation and conversation[0].get("role") == "system" and refuses_system(tokenizer, kwargs):
        conversation = fold_system(conversation)
    try:
        ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=True,
                                            **kwargs)
    except Exception as e:  # jinja2 and the template's own raise_exception(): many kinds
        raise ConfigError(f"the chat template in {path} refused the conversation ({library_error(e)}); "
                          f"change the messages") from e
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


REASONING_EFFORTS = ("low", "medium", "high")  # a chat request's reasoning_effort (OpenAI's and vLLM's values)
# apply_chat_template's own parameters and the template's messages: set by offload, not by a request
RESERVED_TEMPLATE_KWARGS = ("conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                            "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation",
                            "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
                            "tokenizer_kwargs")


def check_template_kwargs(kwargs) -> dict:
    """A request's chat_template_kwargs (None: none): ConfigError for anything but a mapping of names to values, or a
    name offload sets itself."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise ConfigError(f"expected chat_template_kwargs to be an object of the chat template's variables, such as "
                          f"{{\"enable_thinking\": false}}, found {_short(kwargs)}")
    for key in kwargs:
        if not isinstance(key, str) or not key:
            raise ConfigError(f"expected chat_template_kwargs's keys to be the chat template's variable names, found "
                              f"{key!r}")
        if key in RESERVED_TEMPLATE_KWARGS:
            raise ConfigError(f"chat_template_kwargs cannot set {key!r}: offload sets it when it renders the messages; "
                              f"drop it (chat_template_kwargs is for the template's own variables, such as "
                              f"enable_thinking)")
    return dict(kwargs)


def check_reasoning_effort(effort) -> None:
    """ConfigError for a request's reasoning_effort other than low, medium or high (None: not given)."""
    if effort is not None and effort not in REASONING_EFFORTS:
        raise ConfigError(f"expected reasoning_effort to be one of {', '.join(map(repr, REASONING_EFFORTS))}, found "
                          f"{_short(effort)}; send one of them, or leave it out")


def with_reasoning_effort(kwargs: dict | None, effort) -> dict | None:
    """A request's chat template variables: its chat_template_kwargs, and its reasoning_effort as the variable
    reasoning_effort (gpt-oss's template reads it; others ignore it) unless chat_template_kwargs sets it, as vLLM
    merges them; ConfigError for an effort other than low, medium or high."""
    check_reasoning_effort(effort)
    return kwargs if effort is None else {"reasoning_effort": effort, **check_template_kwargs(kwargs)}


def refuses_system(tokenizer, kwargs: dict) -> bool:
    """Whether the chat template raises on a system message where it renders the same user turn alone (Gemma 2's
    "System role not supported")."""
    def renders(conversation: list[dict]) -> bool:
        try:
            tokenizer.apply_chat_template(conversation, tokenize=False, **kwargs)
        except Exception:  # noqa: BLE001 (the template's raise_exception() and jinja2's errors: many kinds)
            return False
        return True

    user = {"role": "user", "content": "x"}
    return not renders([{"role": "system", "content": "s"}, user]) and renders([user])


def fold_system(conversation: list[dict]) -> list[dict]:
    """The leading system message folded into the first user turn, as Gemma 3's template does itself: its text, a
    blank line, the user's text (a system message followed by no user turn becomes one)."""
    system, rest = conversation[0], conversation[1:]
    if rest and rest[0].get("role") == "user" and isinstance(rest[0].get("content"), str) \
            and isinstance(system.get("content"), str):
        return [{**rest[0], "content": f"{system['content']}\n\n{rest[0]['content']}"}, *rest[1:]]
    return [{**system, "role": "user"}, *rest]


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_messages(conversation: list[dict]) -> None:
    """ConfigError for a conversation that is not a list of messages, a message that is not a dict, a role no
    template renders, content that is not text (or a list of parts; None only beside an assistant's tool_calls),
    malformed tool fields (offload/tools.py's check_tool_fields), or text no tokenizer encodes."""
    if not isinstance(conversation, (list, tuple)):
        raise ConfigError(f"expected the messages to be a list of {{'role', 'content'}} dicts, found "
                          f"{type(conversation).__name__}")
    for i, message in enumerate(conversation):
        if not isinstance(message, dict):
            raise ConfigError(f"expected messages[{i}] to be a {{'role', 'content'}} dict, found "
                              f"{type(message).__name__}")
        problem = role_problem(i, message.get("role"))
        if problem:
            raise ConfigError(problem)
        check_tool_fields(i, message)
        content = message.get("content")
        if isinstance(content, str):
            check_text(content, f"messages[{i}].content")
        elif content is None and message.get("tool_calls") and message.get("role") == "assistant":
            continue  # a turn of tool calls only
        elif not isinstance(content, list):  # a list: parts the template renders (a request's are text by then)
            raise ConfigError(f"expected messages[{i}].content to be text, found {_short(content)}; give each message "
                              f"its text as 'content'")


def role_problem(i: int, role) -> str | None:
    """What is wrong with message i's role (None: one of ROLES), with the closest role where one is close."""
    if role in ROLES:
        return None
    close = difflib.get_close_matches(role, ROLES, n=1) if isinstance(role, str) else []
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"expected messages[{i}].role to be one of {', '.join(ROLES)}, found {role!r}{hint}"


def check_text(text: str, where: str) -> None:
    """ConfigError if text holds a lone surrogate (U+D800-U+DFFF, as JSON's "\\ud800" decodes): half of a
    character, not text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError(f"{where} holds a lone surrogate (U+{ord(text[e.start]):04X} at character {e.start}), half "
                          f"of a character, which no tokenizer encodes and no UTF-8 file holds; send valid Unicode "
                          f"(both halves of a surrogate pair, or the character itself)") from None


def check_prompt_ids(ids: list[int], context_len: int, spec: ModelSpec, params: SamplingParams | None = None) -> None:
    """ConfigError if token ids cannot run: empty, not shorter than this run's context (the KV cache holds
    context_len tokens per sequence), or outside the vocabulary; SamplingError if params name a token outside it."""
    if not ids:
        raise ConfigError("the prompt is empty after tokenization; give at least one token")
    model_len = spec.max_position_embeddings
    if len(ids) >= context_len:
        more = (f"raise max_model_len (model.max_model_len in a job, --max-model-len) to more than {len(ids)}, "
                f"at most the model's {model_len}, or shorten the prompt" if len(ids) < model_len
                else f"the model's own context is {model_len}: shorten the prompt")
        raise ConfigError(f"the prompt has {len(ids)} tokens but this run's context (max_model_len) is "
                          f"{context_len} tokens; {more}")
    if max(ids) >= spec.vocab_size or min(ids) < 0:
        raise ConfigError(f"prompt token ids must lie in [0, {spec.vocab_size}); use the model's own tokenizer")
    if params is not None:
        params.check_vocab(spec.vocab_size)

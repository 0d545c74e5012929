"""A prompt as the model takes it: text and conversations encoded by the model's tokenizer and chat template, and
token ids checked against its vocabulary and the run's context. `offload run` and `offload validate` both use
these, so validate refuses what run would (no torch: the tokenizer is transformers')."""

from __future__ import annotations

from pathlib import Path

from offload.errors import ConfigError
from offload.sampling import SamplingParams
from offload.spec import ModelSpec
from offload.weights.model_files import library_error


def encode_text(tokenizer, path: Path, text: str) -> list[int]:
    """Token ids of a text prompt; ConfigError for a model without a tokenizer."""
    if tokenizer is None:
        raise ConfigError(f"the model in {path} has no tokenizer files; send the prompt as a list of token ids")
    return list(tokenizer.encode(text))


def encode_chat(tokenizer, path: Path, conversation: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a conversation rendered with the model's chat template; ConfigError without one, or where
    the template refuses the conversation (its own checks raise, such as roles that must alternate)."""
    if tokenizer is None:
        raise ConfigError(f"the model in {path} has no tokenizer files, so no chat template; send 'prompt' as a "
                          f"list of token ids to /v1/completions")
    if not tokenizer.chat_template:
        raise ConfigError(f"the tokenizer in {path} has no chat template; send plain prompts to /v1/completions")
    try:
        ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=True)
    except Exception as e:  # jinja2 and the template's own raise_exception(): many kinds
        raise ConfigError(f"the chat template in {path} refused the conversation ({library_error(e)}); "
                          f"change the messages") from e
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


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

"""Tiny chat models whose templates behave as the new families' do, with no network: a byte-level tokenizer
(scripts/make_llama.py's) carrying a chat template given here, and for the reasoning tests <think> and </think> as
tokens of their own (added, not special, as Qwen3's are: decoded text keeps them).

A scripted model answers exactly what SCRIPT says on any machine: its layers add nothing to the residual stream (their
output projections are zero), each SCRIPT token's embedding is a basis vector of its own, and the output matrix maps
that vector to the next SCRIPT token's logit, so a prompt that ends in SCRIPT[i] is answered with SCRIPT[i + 1:]."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch

from conftest import make_hf_model, save_hf_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from make_llama import write_byte_tokenizer  # noqa: E402

# Qwen3's template as far as thinking goes: the model opens the <think> block itself, enable_thinking false writes an
# empty closed one into the prompt, and an earlier answer's thought is dropped from the history
QWEN3_STYLE = (
    "{%- for m in messages %}{%- if m['role'] == 'assistant' %}"
    "{%- set content = m['content'].split('</think>')[-1].lstrip('\\n') %}{%- else %}"
    "{%- set content = m['content'] %}{%- endif %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")
# DeepSeek-R1's and Qwen3 Thinking-2507's way: the generation prompt opens the block, the answer only closes it
OPENS_THOUGHT = QWEN3_STYLE.replace("'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think>'")
# Gemma 2's template as it is published: it refuses a system message
GEMMA2_STYLE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")

THOUGHT, ANSWER = "hm", "OK"
# byte-level symbols: Ċ is "\n", with which every generation prompt here ends (OPENS_THOUGHT's with <think>)
SCRIPT = ("Ċ", "<think>", "h", "m", "</think>", "O", "K", "<|im_end|>")
BYTE_VOCAB = 262  # 3 specials, 256 bytes, 3 unused
CONTEXT = 256


def write_tokenizer(folder: Path, template: str, think_tokens: bool) -> None:
    """The byte-level tokenizer with this chat template (and <think>, </think> after its BYTE_VOCAB ids)."""
    from transformers import AutoTokenizer

    write_byte_tokenizer(folder, BYTE_VOCAB)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if think_tokens:
        tokenizer.add_tokens(["<think>", "</think>"])  # not special: skip_special_tokens keeps them, as Qwen3's
    tokenizer.chat_template = template
    tokenizer.save_pretrained(folder)


def make_scripted_model(folder: Path, template: str = QWEN3_STYLE) -> Path:
    """A 2-layer Qwen3 that says SCRIPT's rest after a prompt ending in one of its tokens, with this template."""
    from transformers import AutoTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    write_tokenizer(folder, template, think_tokens=True)
    ids = AutoTokenizer.from_pretrained(folder).convert_tokens_to_ids(list(SCRIPT))
    model = make_hf_model("qwen3", vocab_size=BYTE_VOCAB + 2, max_position_embeddings=CONTEXT)
    return save_hf_model(script(model, ids), folder)


def script(model, ids: list[int]):
    """The model made to say ids' rest after any of them: its layers add nothing to the residual stream (every
    output projection, and its bias, zero), each token's embedding is a basis vector of its own, and the output
    matrix maps that vector to the next token's logit."""
    hidden = model.config.hidden_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".o_proj." in name or "down_proj" in name:  # attention's output; a dense MLP's or every expert's
                p.zero_()
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        for k, (token, following) in enumerate(zip(ids, ids[1:])):
            model.model.embed_tokens.weight[token] = torch.nn.functional.one_hot(torch.tensor(k), hidden).float()
            model.lm_head.weight[following, k] = 10.0  # its logit 80 (the norm scales a basis vector by 8), others 0
    return model


# gpt-oss's harmony format as far as its answers go (tests/test_harmony.py): the markers are special tokens, as
# gpt-oss's are; the template prints reasoning_effort where gpt-oss's does, in its system message
HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>")
HARMONY_STYLE = (
    "{%- if reasoning_effort is not defined %}{%- set reasoning_effort = 'medium' %}{%- endif %}"
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort }}<|end|>"
    "{%- for m in messages %}{{- '<|start|>' + m['role'] + '<|message|>' + m['content'] + '<|end|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}")
# the answer to a prompt ending `<|start|>assistant` (its last byte: t): an analysis message, then the final one. A
# scripted model says one token after each, so a token is said once: the second header is one plain token of its own
# (its text is the same) and "analysis" one too
FINAL_HEADER = "assistant<|channel|>final<|message|>"
HARMONY_SCRIPT = ("t", "<|channel|>", "analysis", "<|message|>", "h", "m", "<|end|>", "<|start|>", FINAL_HEADER, "O",
                  "K", "<|return|>")
HARMONY_SAID = f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>{FINAL_HEADER}{ANSWER}<|return|>"


def make_harmony_model(folder: Path) -> Path:
    """A 2-layer gpt-oss that says HARMONY_SCRIPT's rest after a prompt ending in one of its tokens, with the byte
    tokenizer, harmony's markers as special tokens and HARMONY_STYLE."""
    from transformers import AutoTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    write_byte_tokenizer(folder, BYTE_VOCAB)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": list(HARMONY_MARKERS)})
    tokenizer.add_tokens(["analysis", FINAL_HEADER])
    tokenizer.chat_template = HARMONY_STYLE
    tokenizer.save_pretrained(folder)
    ids = tokenizer.convert_tokens_to_ids(list(HARMONY_SCRIPT))
    model = make_hf_model("gpt_oss", vocab_size=len(tokenizer), max_position_embeddings=CONTEXT)
    return save_hf_model(script(model, ids), folder)


def with_template(source: Path, folder: Path, template: str) -> Path:
    """A copy of a scripted model's folder with another chat template."""
    shutil.copytree(source, folder)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(folder)
    return folder


def make_gemma2_model(folder: Path) -> Path:
    """A tiny random Gemma 2 with Gemma 2's chat template, which refuses a system message."""
    folder.mkdir(parents=True, exist_ok=True)
    save_hf_model(make_hf_model("gemma2", vocab_size=BYTE_VOCAB, max_position_embeddings=CONTEXT), folder)
    write_tokenizer(folder, GEMMA2_STYLE, think_tokens=False)
    return folder

"""A reasoning model's thought split off its answer, as vLLM's reasoning parsers `qwen3` and `deepseek_r1` split it:
the text of the answer's <think>...</think> block is its reasoning_content, the text after it its content.

Which side of the block an answer starts on is read from its prompt, not guessed from the answer: Qwen3's template
leaves the model to open the block (and writes an empty, closed one for enable_thinking false), while DeepSeek-R1's
and the Qwen3 Thinking-2507 templates open it in the prompt, so their answers hold only the closing tag. Knowing it
from the start, a streamed answer is split as it comes, and its pieces join to what the whole answer splits into.

Where it runs is serve.reasoning_parser's choice (offload/options.py): by default where the model's chat template
mentions <think>. Pure text: no torch, no transformers."""

from __future__ import annotations

THINK_START, THINK_END = "<think>", "</think>"


def template_thinks(tokenizer) -> bool:
    """Whether the tokenizer's chat template mentions <think> (Qwen3's, QwQ's and DeepSeek-R1's do)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one renders chats
        template = template.get("default")
    return isinstance(template, str) and THINK_START in template


def prompt_opens_thought(tokenizer, prompt_ids: list[int]) -> bool:
    """Whether the prompt leaves a <think> block open, so that its answer starts inside it."""
    text = tokenizer.decode(prompt_ids, skip_special_tokens=False)
    return text.rfind(THINK_START) > text.rfind(THINK_END)


def reasoning_start(tokenizer, prompt_ids: list[int], parser: str) -> bool | None:
    """None where the answer to a chat prompt is not split (parser none, or auto on a template without <think>);
    else whether it starts inside a <think> block. parser: serve.reasoning_parser's value."""
    if tokenizer is None or parser == "none" or (parser == "auto" and not template_thinks(tokenizer)):
        return None
    return prompt_opens_thought(tokenizer, prompt_ids)


def _partial_tail(text: str, tag: str) -> int:
    """Characters at the end of text that may be the first ones of tag (fewer than all of it)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ThoughtSplitter:
    """One answer's text, fed in pieces, split into reasoning and content pieces. A <think> that opens the answer
    opens the block and is dropped (inside a block the prompt opened too: some models repeat it); the first </think>
    closes it and is dropped; text after it is content, tags and all. A tail that may be the start of a tag is held
    until the next piece, or the last, says what it is."""

    def __init__(self, in_thought: bool):
        self.in_thought = in_thought
        self.thought = in_thought  # whether the answer had a block (else its reasoning_content is None)
        self._leading = True  # nothing handed on yet: a <think> here opens the block
        self._held = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) that the text so far adds; final: the answer ends with this piece."""
        text, self._held = self._held + text, ""
        if self._leading:
            if text.startswith(THINK_START):
                text, self.in_thought, self.thought = text[len(THINK_START):], True, True
            elif THINK_START.startswith(text) and not final:
                self._held = text
                return "", ""
            self._leading = False
        if not self.in_thought:
            return "", text
        end = text.find(THINK_END)
        if end >= 0:
            self.in_thought = False
            return text[:end], text[end + len(THINK_END):]
        keep = 0 if final else _partial_tail(text, THINK_END)
        self._held = text[len(text) - keep:]
        return text[:len(text) - keep], ""


def split_reasoning(text: str, in_thought: bool) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a whole answer, as vLLM's message has them: reasoning None where the answer
    had no <think> block, content None where nothing followed it (an answer cut by max_tokens while it thought)."""
    splitter = ThoughtSplitter(in_thought)
    reasoning, content = splitter.feed(text, final=True)
    return (reasoning if splitter.thought else None), (content or None)

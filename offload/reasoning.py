"""A reasoning model's thought split off its answer, as vLLM's reasoning parsers split it: `qwen3` and `deepseek_r1`
by the answer's <think>...</think> block (its text is the reasoning_content, the text after it the content);
`openai_gptoss` by gpt-oss's harmony channels (the final channel's text is the content, the other channels' the
reasoning_content).

Which side of a <think> block an answer starts on is read from its prompt, not guessed from the answer: Qwen3's
template leaves the model to open the block (and writes an empty, closed one for enable_thinking false), while
DeepSeek-R1's and the Qwen3 Thinking-2507 templates open it in the prompt, so their answers hold only the closing tag.
A harmony answer starts in the header of its first message (the prompt ends `<|start|>assistant`): each message is
`<|channel|>NAME<|message|>TEXT` closed by <|end|> (another message follows, after <|start|>assistant), <|return|> or
<|call|>; these markers are special tokens, so its text is decoded with them (AnswerSplit.sampling). Knowing the
answer's start, a streamed answer is split as it comes, and its pieces join to what the whole answer splits into.

Where it runs is serve.reasoning_parser's choice (offload/options.py): by default the model family's parser where
its entry names one (offload/families.py: gpt-oss's is openai_gptoss), else <think> where the chat template mentions
it. Pure text: no torch, no transformers."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

THINK_START, THINK_END = "<think>", "</think>"
THINK_PARSERS = ("qwen3", "deepseek_r1")  # vLLM's names; one parser here
HARMONY_PARSER = "openai_gptoss"
# harmony's markers: a message's header opens with START (the first one's is in the prompt), names its channel after
# CHANNEL and ends at MESSAGE; its text ends at END (another message follows), RETURN (the answer's end) or CALL
START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
FINAL_CHANNEL = "final"  # the answer the user reads (as is a message naming none); analysis, commentary: reasoning
_BODY_ENDS = (END, RETURN, CALL, START)  # START: a message that opens with no <|end|> before it ends the one before
_OPENERS = (CHANNEL, START, MESSAGE)  # how a harmony answer's text begins


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


@dataclass(frozen=True)
class AnswerSplit:
    """How one chat answer splits into reasoning_content and content: by harmony's channels, or by its <think>
    block (in_thought: whether the answer starts inside it)."""

    harmony: bool = False
    in_thought: bool = False

    def splitter(self, functions: tuple[str, ...] = ()) -> ThoughtSplitter | HarmonySplitter:
        """A splitter for the answer's text fed in pieces (a stream's); a harmony one takes the messages addressed
        to functions.NAME, NAME one of functions, as tool calls."""
        return HarmonySplitter(functions) if self.harmony else ThoughtSplitter(self.in_thought)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of the whole answer, as vLLM's message has them: reasoning None where the
        answer did not reason, content None where it said nothing after it (cut by max_tokens while it thought)."""
        splitter = self.splitter()
        reasoning, content = splitter.feed(text, final=True)
        return (reasoning if splitter.thought else None), (content or None)

    def sampling(self, params):
        """params (SamplingParams) as the answer must be decoded for this split: a harmony answer's text keeps the
        special tokens that mark its channels (the split drops them)."""
        return replace(params, skip_special_tokens=False) if self.harmony and params.skip_special_tokens else params


def answer_split(tokenizer, prompt_ids: list[int], parser: str, family_parser: str | None = None) -> AnswerSplit | None:
    """How the answer to a chat prompt splits; None where it is not split (parser none, or auto on a model whose
    family names no parser and whose template has no <think>). parser: serve.reasoning_parser's value;
    family_parser: the model family's (Family.reasoning_parser), auto's choice where it names one."""
    if tokenizer is None or parser == "none":
        return None
    if parser == "auto":
        parser = family_parser or (THINK_PARSERS[0] if template_thinks(tokenizer) else "none")
    if parser == HARMONY_PARSER:
        return AnswerSplit(harmony=True)
    if parser in THINK_PARSERS:
        return AnswerSplit(in_thought=prompt_opens_thought(tokenizer, prompt_ids))
    return None


def partial_tail(text: str, tags: tuple[str, ...]) -> int:
    """Characters at the end of text that may be the first ones of one of tags (fewer than all of it)."""
    for k in range(min(max(map(len, tags)) - 1, len(text)), 0, -1):
        if any(tag.startswith(text[len(text) - k:]) for tag in tags if len(tag) > k):
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
        keep = 0 if final else partial_tail(text, (THINK_END,))
        self._held = text[len(text) - keep:]
        return text[:len(text) - keep], ""


class HarmonySplitter:
    """One harmony answer's text, fed in pieces, split into reasoning and content pieces: a message's text is content
    on the final channel (or where its header names none), else reasoning; a later message on the same side follows a
    newline (vLLM joins an answer's reasoning messages so). Headers, markers and text between messages are dropped.
    An answer that does not open with a harmony marker is content whole (its reasoning None). A tail that may be the
    start of a marker is held until the next piece, or the last, says what it is. A message whose header addresses
    functions.NAME (`to=functions.NAME`), NAME one of functions, is a tool call: its text is its arguments, taken by
    take_calls once the message ends (it is neither reasoning nor content)."""

    def __init__(self, functions: tuple[str, ...] = ()):
        self.functions = functions
        self._call: tuple[str, list[str]] | None = None  # the open message's call: its name and text so far
        self._calls: list[tuple[str, str]] = []  # ended calls not yet taken
        self.thought = False  # whether a message off the final channel began (else reasoning_content is None)
        self._state = "leading"  # then plain (no harmony), or header, body, between (after a message's end)
        self._final = False  # the open message is content
        self._began = {False: False, True: False}  # by side (content?): whether a message of it began
        self._held = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) that the text so far adds; final: the answer ends with this piece."""
        text, self._held = self._held + text, ""
        out: dict[bool, list[str]] = {False: [], True: []}  # by side (content?): the pieces it adds
        while text:  # each state takes what it can and hands on the rest (or holds it and hands on nothing)
            text = getattr(self, f"_{self._state}")(text, final, out)
        return "".join(out[False]), "".join(out[True])

    def _leading(self, text: str, final: bool, out: dict) -> str:
        if text.startswith(_OPENERS):
            self._state = "header"
            return text[len(START):] if text.startswith(START) else text
        if not final and any(opener.startswith(text) for opener in _OPENERS):
            self._held = text
            return ""
        self._state = "plain"
        return text

    def _plain(self, text: str, final: bool, out: dict) -> str:
        out[True].append(text)
        return ""

    def _header(self, text: str, final: bool, out: dict) -> str:
        at = text.find(MESSAGE)
        if at < 0:  # the header goes on in the next piece (a last piece's is dropped: cut by max_tokens)
            self._held = text
            return ""
        channel = re.search(r"<\|channel\|>\s*([^\s<]+)", text[:at])
        recipient = re.search(r"to=functions\.([^\s<]+)", text[:at])
        if recipient is not None and recipient.group(1) in self.functions:
            self._call, self._state = (recipient.group(1), []), "body"
            return text[at + len(MESSAGE):]
        self._final = channel is None or channel.group(1) == FINAL_CHANNEL
        self.thought |= not self._final
        if self._began[self._final]:
            out[self._final].append("\n")
        self._began[self._final], self._state = True, "body"
        return text[at + len(MESSAGE):]

    def _body(self, text: str, final: bool, out: dict) -> str:
        ends = [(at, marker) for marker in _BODY_ENDS if (at := text.find(marker)) >= 0]
        sink = out[self._final] if self._call is None else self._call[1]
        if ends:
            at, marker = min(ends)
            sink.append(text[:at])
            if self._call is not None:
                self._calls.append((self._call[0], "".join(self._call[1])))
                self._call = None
            self._state = "header" if marker == START else "between"
            return text[at + len(marker):]
        keep = 0 if final else partial_tail(text, _BODY_ENDS)
        sink.append(text[:len(text) - keep])
        self._held = text[len(text) - keep:]
        if final and self._call is not None:  # the answer ends in the call (<|call|> is a stop token, not text)
            self._calls.append((self._call[0], "".join(self._call[1])))
            self._call = None
        return ""

    def take_calls(self) -> list[tuple[str, str]]:
        """The tool calls (name, arguments' text) whose messages ended since the last take."""
        calls, self._calls = self._calls, []
        return calls

    def _between(self, text: str, final: bool, out: dict) -> str:
        at = text.find(START)
        if at >= 0:
            self._state = "header"
            return text[at + len(START):]
        keep = 0 if final else partial_tail(text, (START,))
        self._held = text[len(text) - keep:]
        return ""


def split_reasoning(text: str, in_thought: bool) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a whole answer split by its <think> block (AnswerSplit.split)."""
    return AnswerSplit(in_thought=in_thought).split(text)

"""Reasoning parsers: text inside ``<think>...</think>`` goes to ``reasoning_content``.

- qwen3: reasoning only when the reply opens with ``<think>``; off with
  ``chat_template_kwargs.enable_thinking: false`` (the template then closes the block in
  the prompt and the reply is all answer).
- deepseek_r1: the template opens the block in the prompt, so the reply is reasoning up to
  ``</think>`` (an opening tag the model repeats is dropped); with
  ``chat_template_kwargs.thinking: false`` the reply is all answer.

Under a constraint, the grammar leaves the block free and constrains the answer after
``</think>`` (tokenizer_worker/grammar.py); tool calls are read from the answer only.
``split(text, final)`` follows the tool parsers' rule (base.py): the split of a prefix of
the text is a prefix of the split of the whole, so streamed ``reasoning_content`` and
``content`` deltas concatenate to the non-streamed fields, and no tag leaks into either.
"""

from __future__ import annotations

from typing import Any

from api_frontend.tool_parsers.base import held

START, END = "<think>", "</think>"


class ReasoningParser:
    name = ""
    switch = ""  # the chat_template_kwargs key that turns the template's thinking off

    def active(self, template_kwargs: dict[str, Any]) -> bool:
        return True

    def bounds(self, text: str, final: bool) -> tuple[int, int, int | None]:
        """Where the reasoning is (``text[start:end]``) and where the answer starts (None
        while the text is still reasoning, or too early to tell)."""
        raise NotImplementedError

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, answer); the answer is always the end of ``text``."""
        start, end, answer = self.bounds(text, final)
        return text[start:end], ("" if answer is None else text[answer:])

    def answer_start(self, text: str, final: bool) -> int | None:
        """Index in ``text`` where the answer begins: tool calls are read from there on
        only, so a call drafted inside the reasoning is never one."""
        return self.bounds(text, final)[2]


def _after_start(text: str, final: bool) -> tuple[int, bool] | None:
    """(where the reasoning begins, whether an opening tag was there): past the tag and
    the whitespace before it. None: too early to tell (the text may still become one)."""
    body = text.lstrip()
    at = len(text) - len(body)
    if body.startswith(START):
        return at + len(START), True
    if not final and START.startswith(body):
        return None
    return 0, False


def _until_end(text: str, at: int, final: bool) -> tuple[int, int, int | None]:
    j = text.find(END, at)
    if j >= 0:
        return at, j, j + len(END)
    end = len(text)
    if not final:
        end -= held(text[at:], (END,))
    return at, end, None


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    switch = "enable_thinking"

    def active(self, template_kwargs: dict[str, Any]) -> bool:
        return template_kwargs.get(self.switch, True) is not False

    def bounds(self, text: str, final: bool) -> tuple[int, int, int | None]:
        start = _after_start(text, final)
        if start is None:
            return 0, 0, None
        at, opened = start
        if not opened:
            return 0, 0, 0
        return _until_end(text, at, final)


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    switch = "thinking"

    def active(self, template_kwargs: dict[str, Any]) -> bool:
        return template_kwargs.get(self.switch, True) is not False

    def bounds(self, text: str, final: bool) -> tuple[int, int, int | None]:
        start = _after_start(text, final)
        if start is None:
            return 0, 0, None
        return _until_end(text, start[0], final)


PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)}


def detect(template_source: str) -> str | None:
    """qwen3 where the template reads ``enable_thinking``; deepseek_r1 where it drops
    ``</think>`` blocks and has no thinking switch; None otherwise (DeepSeek-V3.1's
    thinking is off by default: set the flag to read it)."""
    if START in template_source and "enable_thinking" in template_source:
        return "qwen3"
    if END in template_source and "thinking" not in template_source.replace(END, ""):
        return "deepseek_r1"
    return None


def get(name: str) -> ReasoningParser:
    if name not in PARSERS:
        raise KeyError(f"unknown reasoning parser {name!r}; known: {sorted(PARSERS)}")
    return PARSERS[name]()


class ReasoningStream:
    """New reasoning and answer text after each delta of one choice. Once the answer has
    begun every later delta is answer, and while the reasoning runs to the text's end
    (nothing held back) a delta without ``<`` (which begins every tag) is reasoning: the
    text is read again only where a tag may begin, so a long reply costs linear time."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.pieces: list[str] = []  # the text so far, joined when it is read again
        self.sent = (0, 0)
        self.tail = ""  # "reasoning" / "answer": what a delta without a tag extends

    def feed(self, delta: str, final: bool) -> tuple[str, str]:
        self.pieces.append(delta)
        if self.tail == "answer" or (self.tail == "reasoning" and not final
                                     and "<" not in delta):
            if self.tail == "answer":
                self.sent = (self.sent[0], self.sent[1] + len(delta))
                return "", delta
            self.sent = (self.sent[0] + len(delta), self.sent[1])
            return delta, ""
        text = "".join(self.pieces)
        self.pieces = [text]
        start, end, answer = self.parser.bounds(text, final)
        reasoning, content = text[start:end], ("" if answer is None else text[answer:])
        out = reasoning[self.sent[0]:], content[self.sent[1]:]
        self.sent = (len(reasoning), len(content))
        if answer is not None:
            self.tail = "answer"
        elif text and start < end == len(text) and not final:
            self.tail = "reasoning"
        else:
            self.tail = ""
        return out


class ReasoningCount:
    """The completion tokens one choice spent on reasoning, from its deltas in order: with
    reasoning, the tokens before the delta that began the answer (all of them when no
    answer began). Text held back as a possible tag makes the boundary exact to one delta,
    not one token."""

    def __init__(self) -> None:
        self.thought = False  # some reasoning text came out
        self.answer_at: int | None = None  # completion tokens before the answer began
        self._before = 0

    def add(self, completion_tokens: int, thought: bool, answered: bool) -> None:
        """One delta: its cumulative completion tokens, whether it gave reasoning text,
        whether it gave answer text."""
        self.thought |= thought
        if answered and self.answer_at is None:
            self.answer_at = self._before
        self._before = completion_tokens

    def tokens(self, completion_tokens: int) -> int:
        if not self.thought:
            return 0
        return completion_tokens if self.answer_at is None else self.answer_at

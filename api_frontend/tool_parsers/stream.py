"""Streaming and whole-response tool calls from one scan of the text, so both agree.

``ToolCallStream.feed`` re-scans the text so far and returns only what is new: content,
each call's first delta (id, type, name and the arguments so far) and then argument
fragments: at most one delta per call in each chunk, as OpenAI sends them (clients such as
instructor read only a chunk's first delta of a call).
``final()`` of the same text gives the same content and calls as the concatenated stream.
Content's leading whitespace is dropped, and its trailing whitespace waits until more
text follows (dropped when the reply made calls), so a reply that is only calls has
``content: null``, streamed or not.
"""

from __future__ import annotations

import msgspec

from api_frontend.tool_parsers.base import ScanView, ToolParser, parses
from protocol.openai_api import (DeltaFunction, DeltaToolCall, ResponseFunction,
                                 ResponseToolCall)


class ToolCallResult(msgspec.Struct):
    content: str | None
    calls: list[ResponseToolCall]
    complete: bool = True  # every call's arguments parse (none was cut)


def _content(view: ScanView, final: bool) -> str:
    text = view.content.lstrip()
    return text.rstrip() if view.calls or not final else text


class ToolCallStream:
    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.content_sent = 0
        self.ids: list[str] = []
        self.args_sent: list[int] = []
        self.complete = True  # after the final feed: every call's arguments parse

    @property
    def made_calls(self) -> bool:
        return bool(self.ids)

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[DeltaToolCall]]:
        """New content and call deltas after ``delta``; ``final`` on the last one."""
        self.text += delta
        view = self.parser.scan(self.text, final)
        content = _content(view, final)
        new_content = content[self.content_sent:]
        self.content_sent = len(content)
        if final:
            self.complete = all(parses(c.arguments) for c in view.calls if c.name is not None)
        out: list[DeltaToolCall] = []
        for k, call in enumerate(view.calls):
            if call.name is None:
                break
            if k == len(self.ids):  # a new call: one delta with its name and arguments so far
                self.ids.append(self.parser.make_id())
                self.args_sent.append(len(call.arguments))
                out.append(DeltaToolCall(k, self.ids[k], "function",
                                         DeltaFunction(call.name, call.arguments)))
                continue
            fragment = call.arguments[self.args_sent[k]:]
            if fragment:
                self.args_sent[k] = len(call.arguments)
                out.append(DeltaToolCall(k, function=DeltaFunction(arguments=fragment)))
        return new_content, out


def parse_whole(parser: ToolParser, text: str) -> ToolCallResult:
    """The non-streamed answer: content (None when the reply was only calls) and calls."""
    view = parser.scan(text, True)
    named = [c for c in view.calls if c.name is not None]
    calls = [ResponseToolCall(parser.make_id(), ResponseFunction(c.name, c.arguments))
             for c in named]
    content = _content(view, True)
    return ToolCallResult(content if content or not calls else None, calls,
                          all(parses(c.arguments) for c in named))

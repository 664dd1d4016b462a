"""Streaming and whole-response tool calls from one scan of the text, so both agree.

``ToolCallStream.feed`` re-scans the text so far and returns only what is new: content,
each call's first delta (id, type, name and the arguments so far) and then argument
fragments: at most one delta per call in each chunk, as OpenAI sends them (clients such as
instructor read only a chunk's first delta of a call). Text that can only extend the
last view's tail (base.py) is passed on without a scan, so a long reply costs linear time.
``final()`` of the same text gives the same content and calls as the concatenated stream.
Content's leading whitespace is dropped, and its trailing whitespace waits until more
text follows (dropped when the reply made calls), so a reply that is only calls has
``content: null``, streamed or not.

``feed_in_order`` returns the same, content and call deltas in the order the text has them
(what the Responses API's output items need): a chunk holding the end of one call, text,
and the next call (several tokens at once, or the whole reply) gives them in that order,
split exactly as a stream fed one token at a time would have sent them.
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


def _content(view: ScanView, final: bool) -> tuple[str, str]:
    """The content to send, and the trailing whitespace held back from it."""
    lead = view.content.lstrip()
    content = lead.rstrip() if view.calls or not final else lead
    return content, lead[len(content):]


class ToolCallStream:
    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.pieces: list[str] = []  # the text so far, joined when a scan needs it
        self.tail = ""  # the last view's ScanView.tail
        self.content_sent = 0
        self.unsent_space = ""  # content's trailing whitespace, sent once text follows
        self.content_begun = False  # content past its leading whitespace has begun
        self.ids: list[str] = []
        self.args_sent: list[int] = []
        self.complete = True  # after the final feed: every call's arguments parse

    @property
    def made_calls(self) -> bool:
        return bool(self.ids)

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[DeltaToolCall]]:
        """New content and call deltas after ``delta``; ``final`` on the last one."""
        pieces = self.feed_in_order(delta, final)
        return ("".join(p for p in pieces if isinstance(p, str)),
                [p for p in pieces if not isinstance(p, str)])

    def feed_in_order(self, delta: str, final: bool = False) -> list[str | DeltaToolCall]:
        """What ``feed`` returns, in the text's order: content (str) and call deltas."""
        self.pieces.append(delta)
        if self.tail and not final and not any(c in delta for c in self.parser.triggers):
            return self._extend(delta)
        text = "".join(self.pieces)
        self.pieces = [text]
        view = self.parser.scan(text, final)
        self.tail = view.tail
        content, self.unsent_space = _content(view, final)
        self.content_begun = bool(content or self.unsent_space)
        if final:
            self.complete = all(parses(c.arguments) for c in view.calls if c.name is not None)
        lead_cut = len(view.content) - len(view.content.lstrip())  # (as _content drops)
        sent = self.content_sent
        out: list[str | DeltaToolCall] = []
        for k, call in enumerate(view.calls):
            if call.name is None:
                break
            if k == len(self.ids):  # a new call: one delta with its name and arguments so far
                # first the content before it, as far as a stream fed token by token had
                # sent it when the call began (its trailing whitespace still held back)
                before = len(content[:max(0, call.content_before - lead_cut)].rstrip())
                if before > sent:
                    out.append(content[sent:before])
                    sent = before
                self.ids.append(self.parser.make_id())
                self.args_sent.append(len(call.arguments))
                out.append(DeltaToolCall(k, self.ids[k], "function",
                                         DeltaFunction(call.name, call.arguments)))
                continue
            fragment = call.arguments[self.args_sent[k]:]
            if fragment:
                self.args_sent[k] = len(call.arguments)
                out.append(DeltaToolCall(k, function=DeltaFunction(arguments=fragment)))
        if len(content) > sent:
            out.append(content[sent:])
        self.content_sent = len(content)
        return out

    def _extend(self, delta: str) -> list[str | DeltaToolCall]:
        """``delta`` grows the last view's tail as it is: no scan (as _content trims)."""
        if self.tail == "arguments":
            k = len(self.ids) - 1
            self.args_sent[k] += len(delta)
            return [DeltaToolCall(k, function=DeltaFunction(arguments=delta))] if delta else []
        grown = self.unsent_space + delta if self.content_begun else delta.lstrip()
        self.content_begun = self.content_begun or bool(grown)
        sent = grown.rstrip()
        self.unsent_space = grown[len(sent):]
        self.content_sent += len(sent)
        return [sent] if sent else []


def parse_whole(parser: ToolParser, text: str) -> ToolCallResult:
    """The non-streamed answer: content (None when the reply was only calls) and calls."""
    view = parser.scan(text, True)
    named = [c for c in view.calls if c.name is not None]
    calls = [ResponseToolCall(parser.make_id(), ResponseFunction(c.name, c.arguments))
             for c in named]
    content, _ = _content(view, True)
    return ToolCallResult(content if content or not calls else None, calls,
                          all(parses(c.arguments) for c in named))

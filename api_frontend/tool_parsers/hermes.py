"""Hermes / Qwen2.5 / Qwen3: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
one tag per call, with text allowed before, between and after them."""

from __future__ import annotations

from api_frontend.tool_parsers.base import (INVALID, PENDING, CallView, ScanView, ToolParser,
                                            held, json_call, tail_of)


class HermesParser(ToolParser):
    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"
    markers = (start,)
    triggers = "<}"

    def scan(self, text: str, final: bool) -> ScanView:
        content: list[str] = []
        calls: list[CallView] = []
        pos = 0
        open_end = ""
        while True:
            i = text.find(self.start, pos)
            if i < 0:
                rest = text[pos:]
                kept = len(rest) if final else len(rest) - held(rest, self.markers)
                content.append(rest[:kept])
                open_end = "content" if kept == len(rest) and not final else ""
                break
            content.append(text[pos:i])
            body_at = i + len(self.start)
            j = text.find(self.end, body_at)
            closed = j >= 0
            body = text[:j] if closed else text
            got = json_call(body, body_at, final or closed, self.tools, (self.end,))
            if got is PENDING:
                break
            if got is INVALID:  # not a call after all: the tagged text is content
                content.append(text[i:j + len(self.end)] if closed else text[i:])
            else:
                call, _ = got
                call.done = call.done or closed
                call.content_before = sum(map(len, content))
                if closed:
                    call.end = j + len(self.end)
                calls.append(call)
            if not closed:
                open_end = tail_of(calls) if got is not INVALID or final else "content"
                break
            pos = j + len(self.end)
        return ScanView("".join(content), calls, open_end)

"""DeepSeek-V3.1: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS
<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`` (no newline; ARGS is JSON text).

Whitespace between calls is allowed; any other text there (or after the last call when
the block is not closed) is content from where it starts, as written, like a call the
request has no tool for, or one whose name never ended."""

from __future__ import annotations

import re

from api_frontend.tool_parsers.base import CallView, ScanView, ToolParser, held

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
_SPACE = re.compile(r"\s*")


def _may_become(text: str, at: int, markers: tuple[str, ...]) -> bool:
    """``text[at:]`` (short) is a proper start of one of ``markers``."""
    return any(len(text) - at < len(m) and m.startswith(text[at:]) for m in markers)


class DeepSeekV31Parser(ToolParser):
    name = "deepseek_v31"
    markers = (CALLS_BEGIN,)
    special_markers = True
    triggers = "<"  # every tag begins with it; arguments end only at a tag

    def scan(self, text: str, final: bool) -> ScanView:
        i = text.find(CALLS_BEGIN)
        if i < 0:
            keep = len(text) if final else len(text) - held(text, self.markers)
            return ScanView(text[:keep], [], "content" if keep == len(text) and not final
                            else "")
        calls: list[CallView] = []
        head = text[:i]
        gap = i + len(CALLS_BEGIN)

        def content_from(at: int) -> ScanView:  # no more calls: the rest is content
            return ScanView(head + text[at:] if calls else text, calls)

        while True:
            pos = _SPACE.match(text, gap).end()
            if text.startswith(CALLS_END, pos):
                return ScanView(head + text[pos + len(CALLS_END):], calls)
            if pos == len(text) or _may_become(text, pos, (CALL_BEGIN, CALLS_END)):
                return content_from(gap) if final else ScanView(head, calls)
            if not text.startswith(CALL_BEGIN, pos):
                return content_from(gap)
            name_at = pos + len(CALL_BEGIN)
            sep = text.find(SEP, name_at)
            if sep < 0:  # the name has not ended
                return content_from(gap) if final else ScanView(head, calls)
            name = text[name_at:sep].strip()
            if name not in self.tools:
                return content_from(gap)
            args_at = sep + len(SEP)
            end = text.find(CALL_END, args_at)
            if end < 0:
                args = text[args_at:]
                kept = len(args) if final else len(args) - held(args, (CALL_END,))
                calls.append(CallView(name, args[:kept], final, content_before=len(head)))
                return ScanView(head, calls,
                                "arguments" if kept == len(args) and not final else "")
            calls.append(CallView(name, text[args_at:end], True, end + len(CALL_END),
                                  content_before=len(head)))
            gap = end + len(CALL_END)

"""DeepSeek-V3.1: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS
<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`` (no newline; ARGS is JSON text)."""

from __future__ import annotations

from api_frontend.tool_parsers.base import CallView, ScanView, ToolParser, held

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"


class DeepSeekV31Parser(ToolParser):
    name = "deepseek_v31"
    markers = (CALLS_BEGIN,)
    special_markers = True

    def scan(self, text: str, final: bool) -> ScanView:
        i = text.find(CALLS_BEGIN)
        if i < 0:
            keep = len(text) if final else len(text) - held(text, self.markers)
            return ScanView(text[:keep], [])
        calls: list[CallView] = []
        pos = i + len(CALLS_BEGIN)
        after = ""
        while True:
            if text.startswith(CALLS_END, pos):
                after = text[pos + len(CALLS_END):]
                break
            if not text.startswith(CALL_BEGIN, pos):
                break
            name_at = pos + len(CALL_BEGIN)
            sep = text.find(SEP, name_at)
            if sep < 0:
                break
            name = text[name_at:sep].strip()
            if name not in self.tools:  # no call: from this one on, content as written
                return ScanView(text[:i] + text[pos:] if calls else text, calls)
            args_at = sep + len(SEP)
            end = text.find(CALL_END, args_at)
            if end < 0:
                args = text[args_at:]
                if not final:
                    args = args[:len(args) - held(args, (CALL_END,))]
                calls.append(CallView(name, args, final))
                break
            calls.append(CallView(name, text[args_at:end], True, end + len(CALL_END)))
            pos = end + len(CALL_END)
        return ScanView(text[:i] + after, calls)

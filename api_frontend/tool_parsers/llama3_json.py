"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: the whole reply is ``{"name": ...,
"parameters": {...}}`` (several separated by ``;``), optionally after ``<|python_tag|>``.
A reply that does not start with ``{`` is plain content."""

from __future__ import annotations

from api_frontend.tool_parsers.base import ScanView, ToolParser, held, json_sequence, tail_of

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = (PYTHON_TAG,)
    special_markers = True
    triggers = "}"  # (a reply that is content stays content, whatever follows)

    def scan(self, text: str, final: bool) -> ScanView:
        body = text.lstrip()
        at = len(text) - len(body)
        if body.startswith(PYTHON_TAG):
            at += len(PYTHON_TAG)
            body = text[at:].lstrip()
            at = len(text) - len(body)
        elif not final and (not body or held(body, self.markers) == len(body)):
            return ScanView("", [])
        if not body.startswith("{"):
            if not body and not final:
                return ScanView("", [])
            return ScanView(text if not text.lstrip().startswith(PYTHON_TAG) else body, [],
                            "" if final else "content")
        calls, end, broken = json_sequence(text, at, final, ";", None, self.tools)
        if broken is not None:  # from there on no call: content, as written
            return ScanView(text[broken:] if calls else text, calls)
        return ScanView(text[end:] if end is not None else "", calls,
                        tail_of(calls) if end is None else "")

"""Calls as a JSON list after a marker: Mistral ``[TOOL_CALLS][{...}, ...]``, Granite 3.x
``<|tool_call|>[{...}]``; and, with no marker, the list that ``tool_choice: required``
constrains the model to write. Text before the marker is content."""

from __future__ import annotations

import re
import secrets
import string
from collections.abc import Collection

from api_frontend.tool_parsers.base import ScanView, ToolParser, held, json_sequence, tail_of

_OPEN = re.compile(r"\s*(\[)?\s*")


class JsonArrayParser(ToolParser):
    marker = ""

    def __init__(self, tools: Collection[str]) -> None:
        super().__init__(tools)
        self.markers = (self.marker,) if self.marker else ()
        self.triggers = self.marker[:1] + "}"

    def scan(self, text: str, final: bool) -> ScanView:
        i = text.find(self.marker) if self.marker else 0
        if i < 0:
            keep = len(text) if final else len(text) - held(text, self.markers)
            return ScanView(text[:keep], [], "content" if keep == len(text) and not final
                            else "")
        content = text[:i]
        m = _OPEN.match(text, i + len(self.marker))
        if m.end() == len(text) and not final:
            return ScanView(content, [])
        close = "]" if m.group(1) else None
        calls, end, broken = json_sequence(text, m.end(), final, ",", close, self.tools)
        for call in calls:
            call.content_before = len(content)
        if broken is not None:  # from there on no call: content, as written
            return ScanView(content + text[broken:] if calls else text, calls)
        if end is not None:
            content += text[end:]
        return ScanView(content, calls, tail_of(calls) if end is None else "")


class MistralParser(JsonArrayParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"
    special_markers = True

    def make_id(self) -> str:
        """Mistral's templates insist on 9 alphanumeric characters."""
        alphabet = string.ascii_letters + string.digits
        return "".join(secrets.choice(alphabet) for _ in range(9))


class GraniteParser(JsonArrayParser):
    name = "granite"
    marker = "<|tool_call|>"
    special_markers = True


class RequiredCallsParser(JsonArrayParser):
    """``tool_choice: required``: the grammar makes the whole reply a JSON list of
    ``{"name": ..., "parameters": {...}}``."""

    name = "required"

"""``tool_choice`` naming one function: the grammar makes the whole reply that function's
arguments object, so the text is the arguments, streamed as they are written."""

from __future__ import annotations

from api_frontend.tool_parsers.base import CallView, ScanView, ToolParser


class NamedCallParser(ToolParser):
    name = "named"

    def __init__(self, function: str) -> None:
        super().__init__((function,))
        self.function = function

    def scan(self, text: str, final: bool) -> ScanView:
        """No call until the arguments have begun: a reply that ends before (reasoning that
        never closed) made none."""
        if not text.strip():
            return ScanView("", [])
        return ScanView("", [CallView(self.function, text, final)], "" if final else "arguments")

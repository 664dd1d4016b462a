"""Tool-call parsers, one module per format, chosen by ``--tool-call-parser NAME`` or
detected from the chat template when exactly one format's tag appears in it."""

from __future__ import annotations

from collections.abc import Collection

from api_frontend.tool_parsers.base import CallView, ScanView, ToolParser
from api_frontend.tool_parsers.deepseek_v31 import DeepSeekV31Parser
from api_frontend.tool_parsers.hermes import HermesParser
from api_frontend.tool_parsers.json_array import (GraniteParser, MistralParser,
                                                  RequiredCallsParser)
from api_frontend.tool_parsers.llama3_json import Llama3JsonParser
from api_frontend.tool_parsers.named import NamedCallParser
from api_frontend.tool_parsers.pythonic import PythonicParser

PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, DeepSeekV31Parser,
                        GraniteParser, PythonicParser)}

# Text only one format's template writes; pythonic has none (say it with the flag).
_SIGNATURES = {
    "hermes": ("<tool_call>",),
    "mistral": ("[TOOL_CALLS]",),
    "deepseek_v31": ("<｜tool▁calls▁begin｜>",),
    "granite": ("<|tool_call|>",),
    "llama3_json": ('"parameters": dictionary of argument name', "<|python_tag|>"),
}


def detect(template_source: str) -> str | None:
    """The parser whose format the template writes, when exactly one matches."""
    found = [name for name, sigs in _SIGNATURES.items()
             if any(s in template_source for s in sigs)]
    return found[0] if len(found) == 1 else None


def get(name: str, tools: Collection[str]) -> ToolParser:
    """A parser for one choice; ``tools``: the names the request declares."""
    if name not in PARSERS:
        raise KeyError(f"unknown tool-call parser {name!r}; known: {sorted(PARSERS)}")
    return PARSERS[name](tools)


__all__ = ["PARSERS", "CallView", "NamedCallParser", "RequiredCallsParser", "ScanView",
           "ToolParser", "detect", "get"]

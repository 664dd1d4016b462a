"""Pythonic lists (Llama 3.2 / 4 style, ``--tool-call-parser pythonic``): the reply is
``[get_weather(city="Paris"), now()]``, keyword arguments with Python literal values.
Calls arrive when the reply ends (a partial Python call has no JSON form, and a
complete list may still grow into text that is no call list). A list that calls a
function the request has no tool for is content, whole."""

from __future__ import annotations

import ast
import json
from collections.abc import Collection

from api_frontend.tool_parsers.base import CallView, ScanView, ToolParser


def _calls(source: str, tools: Collection[str]) -> list[CallView] | None:
    try:
        tree = ast.parse(source, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    out = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
                and node.func.id in tools and all(k.arg is not None for k in node.keywords)):
            return None
        try:
            args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        except ValueError:
            return None
        out.append(CallView(node.func.id, json.dumps(args, ensure_ascii=False), True))
    return out


class PythonicParser(ToolParser):
    name = "pythonic"

    def scan(self, text: str, final: bool) -> ScanView:
        body = text.strip()
        if not body.startswith("["):  # content, whatever follows
            return ScanView("" if not body and not final else text, [],
                            "content" if body and not final else "")
        if not final:  # "[f()]" may still grow into text that is no call list
            return ScanView("", [])
        calls = _calls(body, self.tools)
        return ScanView("", calls) if calls is not None else ScanView(text, [])

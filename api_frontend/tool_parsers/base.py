"""What every tool-call parser shares: the view of a text it returns, and JSON helpers.

A parser's ``scan(text, final)`` reads the whole generated text so far and returns a
``ScanView``: the content outside tool calls and each call it has found (a name once the
name is complete; the arguments text known so far). Streaming re-scans the growing text
and sends only what is new, so every parser keeps one invariant: a view of a prefix of
the text is a prefix of the view of the whole text (content and each call's arguments
only grow; a name, once given, never changes). Text that might still turn out to be a
tag is held back until it is known, so tags never leak into ``content``.
"""

from __future__ import annotations

import json
import re
import secrets

import msgspec


class CallView(msgspec.Struct):
    name: str | None  # None until the whole name has arrived
    arguments: str  # JSON text: the exact text the model wrote, or the re-encoded object
    done: bool = False
    end: int | None = None  # index in the text just past the call, once it is complete


class ScanView(msgspec.Struct):
    content: str
    calls: list[CallView]


class Pending:
    """The text so far could still be a call or not (not final): say nothing yet."""


class Invalid:
    """The text is complete and is not a call in this format."""


PENDING, INVALID = Pending(), Invalid()
_DECODER = json.JSONDecoder()
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"'
                   r'\s*:\s*')
_CLOSE = re.compile(r"\s*\}")


def held(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of a marker."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best


def encode_arguments(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def json_call(text: str, start: int, final: bool, ends: tuple[str, ...] = ()
              ) -> tuple[CallView, int | None] | Pending | Invalid:
    """One ``{"name": ..., "arguments"|"parameters": {...}}`` object starting at ``start``
    (after optional whitespace). Returns the call and the index just past it (None while
    it is incomplete). When name comes first, the arguments stream as the model writes
    them; otherwise the call appears whole once the object is complete. ``ends``: markers
    that close the region, held back from incomplete arguments."""
    head = _HEAD.match(text, start)
    if head is not None:
        name = json.loads('"' + head.group(1) + '"')
        args_at = head.end()
        try:
            _, end = _DECODER.raw_decode(text, args_at)
        except ValueError:
            args = text[args_at:]
            if not final:
                args = args[:len(args) - held(args, ends)]
            return CallView(name, args, False), None
        args = text[args_at:end]
        close = _CLOSE.match(text, end)
        if close is not None:
            return CallView(name, args, True), close.end()
        try:  # more keys after the arguments (Mistral writes an "id")
            _, end = _DECODER.raw_decode(text, text.index("{", start))
        except ValueError:
            return CallView(name, args, final), len(text) if final else None
        return CallView(name, args, True), end
    body_at = len(text) - len(text[start:].lstrip())
    try:
        obj, end = _DECODER.raw_decode(text, body_at)
    except ValueError:
        return INVALID if final else PENDING
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return INVALID
    args = obj.get("arguments", obj.get("parameters", {}))
    return CallView(obj["name"], encode_arguments(args), True), end


class ToolParser:
    """Base: ``name`` (the --tool-call-parser value), ``markers`` (tags that open calls;
    they must reach the text, so requests keep special tokens when a marker is one)."""

    name = ""
    markers: tuple[str, ...] = ()
    special_markers = False  # the markers are special tokens in this model family

    def scan(self, text: str, final: bool) -> ScanView:
        raise NotImplementedError

    def make_id(self) -> str:
        return "call_" + secrets.token_hex(12)


def json_sequence(text: str, at: int, final: bool, sep: str, close: str | None,
                  ends: tuple[str, ...] = ()) -> tuple[list[CallView], int | None, bool]:
    """Calls written one after another from ``at``: ``{...}`` objects separated by
    ``sep`` and, when ``close`` is set, ended by it. Returns the calls, the index past the
    sequence (None while open) and whether the text broke the format."""
    calls: list[CallView] = []
    pos = at
    while True:
        got = json_call(text, pos, final, ends)
        if got is PENDING:
            return calls, None, False
        if got is INVALID:
            return calls, None, True
        call, end = got
        calls.append(call)
        if end is None:
            return calls, None, False
        call.end = end
        m = re.compile(r"\s*(" + re.escape(sep) + r")?\s*").match(text, end)
        pos = m.end()
        if close is not None and text.startswith(close, pos):
            return calls, pos + len(close), False
        if m.group(1) is None:
            if pos < len(text) or final:
                return calls, end, False
            return calls, None, False

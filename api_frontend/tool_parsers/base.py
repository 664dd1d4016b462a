"""What every tool-call parser shares: the view of a text it returns, and JSON helpers.

A parser's ``scan(text, final)`` reads the whole generated text so far and returns a
``ScanView``: the content outside tool calls and each call it has found (a name once the
name is complete; the arguments text known so far; how much of the content precedes it). A call has arguments (or Llama's
``parameters``) and a name one of the request's ``tools`` declares; text that only looks
like a call (``{"name": "John", "age": 30}``, a tool the request does not have) is
content, kept verbatim, never a call and never dropped. Streaming re-scans the growing text
and sends only what is new, so every parser keeps one invariant: a view of a prefix of
the text is a prefix of the view of the whole text (content and each call's arguments
only grow; a name, once given, never changes). Text that might still turn out to be a
tag is held back until it is known, so tags never leak into ``content``.

Re-scanning the whole text for every token is quadratic in the reply's length, so a view
says where its text ends (``ScanView.tail``): in content, or in the last call's
arguments, with nothing held back. Text without any of the parser's ``triggers`` (the
characters that begin its tags, ``}`` that may close arguments) only extends that part,
and the stream passes it on without a scan.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Collection

import msgspec


class CallView(msgspec.Struct):
    name: str | None  # None until the whole name has arrived
    arguments: str  # JSON text: the exact text the model wrote, or the re-encoded object
    done: bool = False
    end: int | None = None  # index in the text just past the call, once it is complete
    open: bool = False  # the arguments run to the end of the text, nothing held back
    # how much of the view's ``content`` the text has before this call (so a stream can
    # put text and calls that arrive together in their order)
    content_before: int = 0


class ScanView(msgspec.Struct):
    content: str
    calls: list[CallView]
    # where the text ends, nothing held back (not final): "content", "arguments" (the last
    # call's); "": elsewhere (a tag being read), so more text needs a scan
    tail: str = ""


def tail_of(calls: list[CallView]) -> str:
    """"arguments" where the last call's arguments are open at the text's end."""
    return "arguments" if calls and calls[-1].open else ""


class Pending:
    """The text so far could still be a call or not (not final): say nothing yet."""


class Invalid:
    """The text is complete and is not a call in this format."""


PENDING, INVALID = Pending(), Invalid()
_DECODER = json.JSONDecoder()
# name first, then an arguments object: the arguments stream as the model writes them
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"'
                   r'\s*:\s*(?=\{)')
_CLOSE = re.compile(r"\s*\}")


def parses(arguments: str) -> bool:
    """The arguments are a whole JSON object: the call was written to its end (a reply
    cut by a stop or max_tokens may end inside one; then it finishes ``stop``/``length``,
    never ``tool_calls``)."""
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False


def held(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of a marker."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best


def _arguments(obj: dict) -> str | None:
    """A whole call object's arguments as JSON text: an object, or a string holding one
    (some models encode them); None when it has none (then it is not a call)."""
    args = obj.get("arguments", obj.get("parameters"))
    if isinstance(args, str):
        try:
            return args if isinstance(json.loads(args), dict) else None
        except ValueError:
            return None
    return json.dumps(args, ensure_ascii=False) if isinstance(args, dict) else None


def json_call(text: str, start: int, final: bool, tools: Collection[str],
              ends: tuple[str, ...] = ()) -> tuple[CallView, int | None] | Pending | Invalid:
    """One ``{"name": ..., "arguments"|"parameters": {...}}`` object starting at ``start``
    (after optional whitespace), naming one of ``tools``. Returns the call and the index
    just past it (None while it is incomplete). When name comes first, the arguments stream
    as the model writes them; otherwise the call appears whole once the object is complete.
    ``ends``: markers that close the region, held back from incomplete arguments."""
    head = _HEAD.match(text, start)
    if head is not None:
        name = json.loads('"' + head.group(1) + '"')
        if name not in tools:
            return INVALID
        args_at = head.end()
        try:
            _, end = _DECODER.raw_decode(text, args_at)
        except ValueError:
            args = text[args_at:]
            kept = len(args) if final else len(args) - held(args, ends)
            return CallView(name, args[:kept], False, open=kept == len(args) and not final), None
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
    if not isinstance(obj, dict) or obj.get("name") not in tools:
        return INVALID
    args = _arguments(obj)
    return INVALID if args is None else (CallView(obj["name"], args, True), end)


class ToolParser:
    """Base: ``name`` (the --tool-call-parser value), ``markers`` (tags that open calls;
    they must reach the text, so requests keep special tokens when a marker is one),
    ``tools``: the names a call may have (the request's ``tools``)."""

    name = ""
    markers: tuple[str, ...] = ()
    special_markers = False  # the markers are special tokens in this model family
    triggers = ""  # characters after which a view's tail may not simply grow (see above)

    def __init__(self, tools: Collection[str]) -> None:
        self.tools = frozenset(tools)

    def scan(self, text: str, final: bool) -> ScanView:
        raise NotImplementedError

    def make_id(self) -> str:
        return "call_" + secrets.token_hex(12)


def json_sequence(text: str, at: int, final: bool, sep: str, close: str | None,
                  tools: Collection[str], ends: tuple[str, ...] = ()
                  ) -> tuple[list[CallView], int | None, int | None]:
    """Calls written one after another from ``at``: ``{...}`` objects separated by
    ``sep`` and, when ``close`` is set, ended by it. Returns the calls, the index past the
    sequence (None while open) and where the text stops being calls (None: it did not;
    from there on it is content)."""
    calls: list[CallView] = []
    pos = at
    while True:
        got = json_call(text, pos, final, tools, ends)
        if got is PENDING:
            return calls, None, None
        if got is INVALID:
            return calls, None, pos
        call, end = got
        calls.append(call)
        if end is None:
            return calls, None, None
        call.end = end
        m = re.compile(r"\s*(" + re.escape(sep) + r")?\s*").match(text, end)
        pos = m.end()
        if close is not None and text.startswith(close, pos):
            return calls, pos + len(close), None
        if m.group(1) is None:
            if pos < len(text) or final:
                return calls, end, None
            return calls, None, None

"""One Anthropic message built from one sequence's deltas: content blocks and the stream's
events.

The text goes through the chat pipeline's readers (the reasoning parser, then the
tool-call parser) exactly as a chat choice does; what comes out opens, grows and closes
content blocks in order: reasoning a ``thinking`` block, answer text a ``text`` block,
each call a ``tool_use`` block (its arguments streamed as ``input_json_delta``). The
stream is Anthropic's: ``message_start`` (with the prompt's usage, so it waits for the
first delta), ``ping``, each block's ``content_block_start`` / ``_delta`` / ``_stop``,
then ``message_delta`` (stop_reason, usage) and ``message_stop``. The non-streamed body
is the same run with the events not encoded, so the two cannot disagree.
"""

from __future__ import annotations

import json

import msgspec

from api_frontend import reasoning
from api_frontend.endpoints.messages.errors import error_detail
from api_frontend.errors import ApiError
from api_frontend.tool_parsers.stream import ToolCallStream
from api_frontend.tools import ToolPlan
from protocol import ipc
from protocol.anthropic_api import (ContentBlockDelta, ContentBlockStart, ContentBlockStop,
                                    ErrorEvent, InputJsonDelta, Message, MessageDelta,
                                    MessageDeltaBody, MessageStart, MessageStop,
                                    OutputTokensDetails, Ping,
                                    TextBlock, TextDelta, ThinkingBlock, ThinkingDelta,
                                    ToolUseBlock, Usage)
from protocol.openai_api import DeltaToolCall

_ENCODER = msgspec.json.Encoder()


def sse_event(event) -> bytes:
    """``event: <type>`` then the JSON, as Anthropic frames its stream."""
    body = _ENCODER.encode(event)
    return b"event: " + type(event).__struct_config__.tag.encode() + b"\ndata: " + body + b"\n\n"


def usage_of(delta: ipc.TextDelta | None, thinking_tokens: int | None = None) -> Usage:
    """Anthropic's split: ``input_tokens`` are those the prefix cache did not serve;
    ``thinking_tokens`` where a reasoning parser split the reply (None: none did)."""
    if delta is None:
        return Usage(0, 0)
    details = msgspec.UNSET if thinking_tokens is None else OutputTokensDetails(thinking_tokens)
    return Usage(delta.prompt_tokens - delta.cached_tokens, delta.completion_tokens,
                 cache_read_input_tokens=delta.cached_tokens, output_tokens_details=details)


class MessageBuilder:
    def __init__(self, message: Message, tools: ToolPlan | None,
                 reasoning_parser: str | None, streaming: bool) -> None:
        self.message = message
        self.streaming = streaming
        self.frames: list[bytes] = []
        self._open: TextBlock | ToolUseBlock | ThinkingBlock | None = None
        self._arguments = ""  # the open tool_use block's JSON text so far
        self._calls = (ToolCallStream(tools.parser())
                       if tools is not None and tools.mode != "none" else None)
        self._thinking = (reasoning.ReasoningStream(reasoning.get(reasoning_parser))
                          if reasoning_parser is not None else None)
        self._count = reasoning.ReasoningCount()
        self._last: ipc.TextDelta | None = None
        self._started = False
        self.failed = False

    def take(self) -> bytes:
        """The frames of the events since the last call (streaming only)."""
        out = b"".join(self.frames)
        self.frames.clear()
        return out

    def _emit(self, event) -> None:
        if self.streaming:  # encoded now: the blocks it shows keep changing
            self.frames.append(sse_event(event))

    def _start(self, first: ipc.TextDelta | None) -> None:
        """message_start once the prompt's usage is known (its first delta)."""
        if self._started:
            return
        self._started = True
        self.message.usage = self._usage(first)
        self._emit(MessageStart(self.message))
        self._emit(Ping())

    # ---------------------------------------------------------------- blocks

    def _index(self) -> int:
        return len(self.message.content) - 1

    def _add(self, block) -> None:
        self._close()
        self.message.content.append(block)
        self._open = block
        self._emit(ContentBlockStart(self._index(), msgspec.structs.replace(block)))

    def _close(self) -> None:
        block, self._open = self._open, None
        if block is None:
            return
        if isinstance(block, ToolUseBlock):
            block.input = _arguments_object(self._arguments)
            self._arguments = ""
        self._emit(ContentBlockStop(self._index()))

    def _text(self, text: str) -> None:
        if not isinstance(self._open, TextBlock):
            self._add(TextBlock(""))
        self._open.text += text
        self._emit(ContentBlockDelta(self._index(), TextDelta(text)))

    def _thought(self, text: str) -> None:
        if not isinstance(self._open, ThinkingBlock):
            self._add(ThinkingBlock(""))
        self._open.thinking += text
        self._emit(ContentBlockDelta(self._index(), ThinkingDelta(text)))

    def _call(self, delta: DeltaToolCall) -> None:
        fragment = delta.function.arguments if delta.function is not None else None
        if delta.id is not None:  # a new call: its first delta names it
            self._add(ToolUseBlock(delta.id, delta.function.name, {}))
        if fragment:
            self._arguments += fragment
            self._emit(ContentBlockDelta(self._index(), InputJsonDelta(fragment)))

    # ---------------------------------------------------------------- deltas

    def feed(self, delta: ipc.TextDelta) -> None:
        """One delta, whatever text it holds: reasoning first (it precedes the answer),
        then answer text and calls in the order the text has them."""
        self._start(delta)
        final = delta.finish_reason is not None
        text, thought = delta.text, ""
        if self._thinking is not None:
            thought, text = self._thinking.feed(text, final)
        if self._calls is not None:
            pieces = self._calls.feed_in_order(text, final)
        else:
            pieces = [text] if text else []
        if thought:
            self._thought(thought)
        self._count.add(delta.completion_tokens, bool(thought), bool(pieces))
        for piece in pieces:
            if isinstance(piece, str):
                if piece:
                    self._text(piece)
            else:
                self._call(piece)
        self._last = delta

    def _usage(self, delta: ipc.TextDelta | None) -> Usage:
        spent = None
        if self._thinking is not None and delta is not None:
            spent = self._count.tokens(delta.completion_tokens)
        return usage_of(delta, spent)

    @property
    def finish_reason(self) -> str:
        """As the request counter labels generations: the last delta's, or error."""
        if self.failed:
            return "error"
        return (self._last.finish_reason if self._last is not None else None) or "none"

    def _stop_reason(self) -> tuple[str, str | None]:
        last = self._last
        if last is None or last.finish_reason == "length":
            return "max_tokens", None
        if last.stop_string is not None:
            return "stop_sequence", last.stop_string
        calls = self._calls
        if calls is not None and calls.made_calls and calls.complete:
            return "tool_use", None
        return "end_turn", None

    def finish(self) -> None:
        """After the last delta: close the open block; message_delta then message_stop.
        A reply that ended inside a call (max_tokens) leaves that call's ``input`` ``{}``:
        the streamed ``partial_json`` is the text as written."""
        self._start(self._last)
        self._close()
        stop_reason, stop_sequence = self._stop_reason()
        m = self.message
        m.stop_reason, m.stop_sequence = stop_reason, stop_sequence
        m.usage = self._usage(self._last)
        self._emit(MessageDelta(MessageDeltaBody(stop_reason, stop_sequence), m.usage))
        self._emit(MessageStop())

    def fail(self, err: ApiError) -> None:
        """A failure after the stream started: the open block ends, then an ``error``
        event in Anthropic's error shape (no message_stop: the message did not end)."""
        self.failed = True
        self._start(self._last)
        self._close()
        self._emit(ErrorEvent(error_detail(err)))


def _arguments_object(text: str) -> dict:
    """A call's arguments as the ``input`` object; ``{}`` where they were cut before they
    parse (the stop_reason, max_tokens, says so)."""
    try:
        value = json.loads(text) if text else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}

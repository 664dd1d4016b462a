"""One response built from one sequence's deltas: output items and the stream's events.

The text goes through the chat pipeline's readers (the reasoning parser, then the tool-call
parser) exactly as a chat choice does; what comes out opens, grows and closes output items
in order: reasoning text a ``reasoning`` item, answer text a ``message`` item with one
``output_text`` part, each call a ``function_call`` item. Each step is an OpenAI stream
event with the next ``sequence_number``. The non-streamed body is the same run with the
events not encoded, so the two cannot disagree.
"""

from __future__ import annotations

import msgspec

from api_frontend import reasoning
from api_frontend.errors import ApiError
from api_frontend.endpoints.responses.translate import item_id
from api_frontend.tool_parsers.stream import ToolCallStream
from api_frontend.tools import ToolPlan
from protocol import ipc
from protocol.openai_api import DeltaToolCall
from protocol.responses_api import (ContentPartAdded, ContentPartDone, ErrorEvent,
                                    FunctionCallArgumentsDelta, FunctionCallArgumentsDone,
                                    FunctionCallItem, IncompleteDetails, InputTokensDetails,
                                    MessageItem, OutputItemAdded, OutputItemDone, OutputText,
                                    OutputTextDelta, OutputTextDone, OutputTokensDetails,
                                    ReasoningItem, ReasoningText, ReasoningTextDelta,
                                    ReasoningTextDone, ResponseCompleted, ResponseCreated,
                                    ResponseError, ResponseFailed, ResponseIncomplete,
                                    ResponseInProgress, ResponseObject, ResponseUsage)

_ENCODER = msgspec.json.Encoder()


def sse_event(event) -> bytes:
    """``event: <type>`` then the JSON, as OpenAI frames the Responses stream."""
    body = _ENCODER.encode(event)
    return b"event: " + type(event).__struct_config__.tag.encode() + b"\ndata: " + body + b"\n\n"


class ResponseBuilder:
    def __init__(self, response: ResponseObject, tools: ToolPlan | None,
                 reasoning_parser: str | None, streaming: bool) -> None:
        self.response = response
        self.streaming = streaming
        self.frames: list[bytes] = []
        self._seq = 0
        self._open: MessageItem | ReasoningItem | FunctionCallItem | None = None
        self._calls = (ToolCallStream(tools.parser())
                       if tools is not None and tools.mode != "none" else None)
        self._thinking = (reasoning.ReasoningStream(reasoning.get(reasoning_parser))
                          if reasoning_parser is not None else None)
        self._count = reasoning.ReasoningCount()
        self._last: ipc.TextDelta | None = None

    def take(self) -> bytes:
        """The frames of the events since the last call (streaming only)."""
        out = b"".join(self.frames)
        self.frames.clear()
        return out

    def _emit(self, event) -> None:
        event.sequence_number = self._seq
        self._seq += 1
        if self.streaming:  # encoded now: the items it shows keep changing
            self.frames.append(sse_event(event))

    def _index(self) -> int:
        return len(self.response.output) - 1

    def start(self) -> None:
        self._emit(ResponseCreated(response=self.response))
        self._emit(ResponseInProgress(response=self.response))

    # ---------------------------------------------------------------- items

    def _add(self, item) -> None:
        self._close("completed")
        self.response.output.append(item)
        self._open = item
        self._emit(OutputItemAdded(output_index=self._index(), item=item))

    def _close(self, status: str) -> None:
        item, self._open = self._open, None
        if item is None:
            return
        at = self._index()
        if isinstance(item, FunctionCallItem):
            self._emit(FunctionCallArgumentsDone(item_id=item.id, output_index=at,
                                                 name=item.name, arguments=item.arguments))
        else:
            part = item.content[0]
            done = (OutputTextDone(item_id=item.id, output_index=at, content_index=0,
                                   text=part.text) if isinstance(part, OutputText) else
                    ReasoningTextDone(item_id=item.id, output_index=at, content_index=0,
                                      text=part.text))
            self._emit(done)
            self._emit(ContentPartDone(item_id=item.id, output_index=at, content_index=0,
                                       part=part))
        item.status = status
        self._emit(OutputItemDone(output_index=at, item=item))

    def _text(self, text: str) -> None:
        if not isinstance(self._open, MessageItem):
            self._add(MessageItem(role="assistant", content=[], id=item_id("message"),
                                  status="in_progress"))
            self._part(OutputText(""))
        part = self._open.content[0]
        part.text += text
        self._emit(OutputTextDelta(item_id=self._open.id, output_index=self._index(),
                                   content_index=0, delta=text))

    def _reasoning(self, text: str) -> None:
        if not isinstance(self._open, ReasoningItem):
            self._add(ReasoningItem(id=item_id("reasoning"), status="in_progress"))
            self._part(ReasoningText(""))
        part = self._open.content[0]
        part.text += text
        self._emit(ReasoningTextDelta(item_id=self._open.id, output_index=self._index(),
                                      content_index=0, delta=text))

    def _part(self, part) -> None:
        self._emit(ContentPartAdded(item_id=self._open.id, output_index=self._index(),
                                    content_index=0, part=msgspec.structs.replace(part)))
        self._open.content.append(part)

    def _call(self, delta: DeltaToolCall) -> None:
        fragment = delta.function.arguments if delta.function is not None else None
        if delta.id is not None:  # a new call: its first delta names it
            self._add(FunctionCallItem(call_id=delta.id, name=delta.function.name,
                                       arguments="", id=item_id("function_call"),
                                       status="in_progress"))
        item = self._open
        if fragment:
            item.arguments += fragment
            self._emit(FunctionCallArgumentsDelta(item_id=item.id, output_index=self._index(),
                                                  delta=fragment))

    # ---------------------------------------------------------------- deltas

    def feed(self, delta: ipc.TextDelta) -> None:
        """One delta, whatever text it holds (one token's, several, the whole reply):
        reasoning first (it precedes the answer), then answer text and calls in the
        order the text has them, so every split of a reply builds the same items."""
        final = delta.finish_reason is not None
        text, thought = delta.text, ""
        if self._thinking is not None:
            thought, text = self._thinking.feed(text, final)
        if self._calls is not None:
            pieces = self._calls.feed_in_order(text, final)
        else:
            pieces = [text] if text else []
        if thought:
            self._reasoning(thought)
        self._count.add(delta.completion_tokens, bool(thought), bool(pieces))
        for piece in pieces:
            if isinstance(piece, str):
                self._text(piece)
            else:
                self._call(piece)
        self._last = delta

    @property
    def finish_reason(self) -> str:
        """As the request counter labels generations: the last delta's, or error."""
        if self.response.status == "failed":
            return "error"
        return (self._last.finish_reason if self._last is not None else None) or "none"

    def _usage(self) -> ResponseUsage | None:
        """``reasoning_tokens``: as ``reasoning.ReasoningCount`` counts them."""
        d = self._last
        if d is None:
            return None
        return ResponseUsage(d.prompt_tokens, InputTokensDetails(d.cached_tokens),
                             d.completion_tokens,
                             OutputTokensDetails(self._count.tokens(d.completion_tokens)),
                             d.prompt_tokens + d.completion_tokens)

    def finish(self) -> None:
        """After the last delta: close the open item and end with response.completed, or
        response.incomplete when the sequence hit its token limit. A call the reply ended
        inside (a stop, the limit) is an incomplete item: its arguments do not parse."""
        cut = self._last is not None and self._last.finish_reason == "length"
        call_cut = self._calls is not None and not self._calls.complete
        self._close("incomplete" if cut or call_cut else "completed")
        r = self.response
        r.usage = self._usage()
        if cut:
            r.status = "incomplete"
            r.incomplete_details = IncompleteDetails("max_output_tokens")
            self._emit(ResponseIncomplete(response=r))
        else:
            r.status = "completed"
            self._emit(ResponseCompleted(response=r))

    def fail(self, err: ApiError) -> None:
        """A failure after the stream started: the open item ends incomplete, an ``error``
        event carries the error shape's fields, then response.failed."""
        self._close("incomplete")
        r = self.response
        r.usage = self._usage()
        r.status = "failed"
        r.error = ResponseError(err.code or "server_error", err.message)
        self._emit(ErrorEvent(code=err.code, message=err.message, param=err.param))
        self._emit(ResponseFailed(response=r))

"""Assembling /v1/chat/completions bodies and chunks: messages, tool calls (whole or as
``tool_calls`` deltas), reasoning text, chat's logprobs shape and echo."""

from __future__ import annotations

import msgspec
from msgspec import UNSET

from api_frontend import reasoning
from api_frontend.assembly import Assembler, Collected, sum_usage, usage_of
from api_frontend.tool_parsers.stream import ToolCallStream, parse_whole
from api_frontend.tools import ToolPlan
from protocol import ipc
from protocol.openai_api import (AssistantMessage, ChatChoice, ChatChunkChoice,
                                 ChatCompletionChunk, ChatCompletionResponse, ChatDelta,
                                 ChatLogprobEntry, ChatLogprobs, TopLogprobEntry)


def _bytes(entry: ipc.DecodedLogprob | ipc.TopLogprob) -> list[int]:
    """The token's own bytes (not the UTF-8 of U+FFFD for part of a character)."""
    return list(entry.raw if entry.raw is not None else entry.token.encode("utf-8"))


def chat_logprobs(entries: list[ipc.DecodedLogprob]) -> ChatLogprobs:
    return ChatLogprobs([ChatLogprobEntry(e.token, e.logprob if e.logprob is not None else 0.0,
                                          _bytes(e),
                                          [TopLogprobEntry(t.token, t.logprob, _bytes(t))
                                           for t in e.top]) for e in entries])


def _tool_finish(reason: str | None, made_calls: bool, complete: bool) -> str | None:
    """``tool_calls`` when the choice made calls, each written to its end, and stopped
    (an end token, the grammar's end, a stop after the calls). A reply that ended inside a
    call keeps what ended it, ``stop`` or ``length``: that call was streamed as far as it
    was written, and its arguments do not parse."""
    return "tool_calls" if made_calls and complete and reason == "stop" else reason


class ChatAssembler(Assembler):
    """Builds /v1/chat/completions bodies and chunks for one request. With tools, each
    choice's text goes through the tool-call parser: whole, or streamed as OpenAI's
    ``tool_calls`` deltas (see ``tool_parsers.stream``)."""

    def __init__(self, *args, echo_text: str | None = None, tools: ToolPlan | None = None,
                 reasoning_parser: str | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.echo_text = echo_text  # the final assistant message, when echo is on
        self.tools = tools
        self.reasoning_parser = reasoning_parser
        self._streams: dict[int, ToolCallStream] = {}
        self._thinking: dict[int, reasoning.ReasoningStream] = {}
        self._counts: dict[int, reasoning.ReasoningCount] = {}

    @property
    def parses_tools(self) -> bool:
        return self.tools is not None and self.tools.mode != "none"

    def _message(self, got: Collected) -> tuple[AssistantMessage, str | None]:
        reason, text, thought = got.last.finish_reason, got.text, UNSET
        if self.reasoning_parser is not None:
            thought, text = reasoning.get(self.reasoning_parser).split(text, True)
            thought = thought or UNSET
        if not self.parses_tools:
            content = (self.echo_text or "") + text
            if thought is not UNSET and not content:
                content = None  # the whole reply was reasoning
            return AssistantMessage(content, reasoning_content=thought), reason
        result = parse_whole(self.tools.parser(), text)
        content = result.content if result.content or thought is UNSET else None
        return (AssistantMessage(content, tool_calls=result.calls or UNSET,
                                 reasoning_content=thought),
                _tool_finish(reason, bool(result.calls), result.complete))

    def _reasoning_tokens(self, got: Collected) -> int:
        """The choice's deltas read again as a stream reads them, so a whole reply and a
        streamed one count the same reasoning tokens."""
        thinking = reasoning.ReasoningStream(reasoning.get(self.reasoning_parser))
        count = reasoning.ReasoningCount()
        last = len(got.parts) - 1
        for i, (text, tokens) in enumerate(zip(got.parts, got.completion_tokens)):
            thought, answer = thinking.feed(text, i == last)
            count.add(tokens, bool(thought), bool(answer))
        return count.tokens(got.last.completion_tokens)

    def usage(self, choices: list[Collected]):
        if self.reasoning_parser is None:
            return super().usage(choices)
        spent = {id(got): self._reasoning_tokens(got) for got in choices}
        return sum_usage([c.last for c in choices], self.n,
                         sum(spent[id(got)] for got in choices))

    def _spent(self, index: int, delta: ipc.TextDelta) -> int | None:
        if self.reasoning_parser is None:
            return None
        count = self._counts.get(index)
        return count.tokens(delta.completion_tokens) if count is not None else 0

    def final(self, choices: list[Collected]) -> ChatCompletionResponse:
        out = []
        for i, got in enumerate(choices):
            message, reason = self._message(got)
            out.append(ChatChoice(i, message, reason,
                                  chat_logprobs(got.logprobs) if self.logprobs else None,
                                  token_ids=self._ids(got.token_ids)))
        return ChatCompletionResponse(self.id, self.created, self.model, out, self.usage(choices),
                                      prompt_token_ids=self._ids(choices[0].prompt_token_ids),
                                      prompt_logprobs=self._prompt_logprobs(choices[0]),
                                      candor=self._candor())

    def opening_chunks(self, num_choices: int) -> list[ChatCompletionChunk]:
        return [self.role_chunk(i) for i in range(num_choices)]

    def role_chunk(self, index: int = 0) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            self.id, self.created, self.model,
            [ChatChunkChoice(index, ChatDelta(role="assistant", content=self.echo_text or ""))],
            candor=self._candor())

    def chunk(self, index: int, delta: ipc.TextDelta,
              with_usage: bool) -> ChatCompletionChunk | None:
        """None when there is nothing to send yet (text held back as a possible tag)."""
        lp = chat_logprobs(delta.logprobs or []) if self.logprobs else None
        reason = delta.finish_reason
        if self.parses_tools or self.reasoning_parser is not None:
            text, thought = delta.text, ""
            if self.reasoning_parser is not None:
                thinking = self._thinking.get(index)
                if thinking is None:
                    thinking = self._thinking[index] = reasoning.ReasoningStream(
                        reasoning.get(self.reasoning_parser))
                thought, text = thinking.feed(text, reason is not None)
                self._counts.setdefault(index, reasoning.ReasoningCount()).add(
                    delta.completion_tokens, bool(thought), bool(text))
            content, calls = text, []
            if self.parses_tools:
                stream = self._streams.get(index)
                if stream is None:
                    stream = self._streams[index] = ToolCallStream(self.tools.parser())
                content, calls = stream.feed(text, final=reason is not None)
                reason = _tool_finish(reason, stream.made_calls, stream.complete)
            message = ChatDelta(content=content or None, reasoning_content=thought or None,
                                tool_calls=calls or None)
            if (not content and not calls and not thought and reason is None
                    and not with_usage and not (lp and lp.content)
                    and not (self.with_ids and delta.token_ids)):
                return None
        else:
            content = delta.text if delta.text or reason is None else None
            message = ChatDelta(content=content)
        return ChatCompletionChunk(
            self.id, self.created, self.model,
            [ChatChunkChoice(index, message, reason, lp, token_ids=self._ids(delta.token_ids))],
            usage_of(delta, self._spent(index, delta)) if with_usage else None,
            candor=self._candor())

    def usage_chunk(self, choices_last: list[ipc.TextDelta]) -> ChatCompletionChunk:
        spent = None
        if self.reasoning_parser is not None:
            spent = sum(self._spent(i, d) for i, d in enumerate(choices_last))
        return ChatCompletionChunk(self.id, self.created, self.model, [],
                                   sum_usage(choices_last, self.n, spent))

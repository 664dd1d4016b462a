"""Assembling OpenAI responses and SSE frames from engine deltas."""

from __future__ import annotations

import msgspec
from msgspec import UNSET

from protocol import ipc
from protocol.openai_api import (AssistantMessage, ChatChoice, ChatChunkChoice,
                                 ChatCompletionChunk, ChatCompletionResponse, ChatDelta,
                                 CompletionChoice, CompletionChunk, CompletionResponse,
                                 PromptTokensDetails, Usage)

_ENCODER = msgspec.json.Encoder()
DONE_FRAME = b"data: [DONE]\n\n"


def sse(obj: msgspec.Struct) -> bytes:
    return b"data: " + _ENCODER.encode(obj) + b"\n\n"


def usage_of(delta: ipc.TextDelta) -> Usage:
    return Usage(delta.prompt_tokens, delta.completion_tokens,
                 delta.prompt_tokens + delta.completion_tokens,
                 PromptTokensDetails(delta.cached_tokens))


class Collected:
    """A whole (non-streamed) generation: text, ids and the last delta's accounting."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.token_ids: list[int] = []
        self.prompt_token_ids: list[int] | None = None
        self.last: ipc.TextDelta | None = None

    def add(self, delta: ipc.TextDelta) -> None:
        self.parts.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        if delta.prompt_token_ids is not None:
            self.prompt_token_ids = delta.prompt_token_ids
        self.last = delta

    @property
    def text(self) -> str:
        return "".join(self.parts)


class _Assembler:
    def __init__(self, response_id: str, created: int, model: str, with_ids: bool) -> None:
        self.id, self.created, self.model = response_id, created, model
        self.with_ids = with_ids

    def _ids(self, ids: list[int] | None):
        return list(ids or []) if self.with_ids else UNSET


class CompletionAssembler(_Assembler):
    """Builds /v1/completions bodies and chunks for one request."""

    def final(self, got: Collected) -> CompletionResponse:
        last = got.last
        return CompletionResponse(
            self.id, self.created, self.model,
            [CompletionChoice(0, got.text, last.finish_reason,
                              token_ids=self._ids(got.token_ids))],
            usage_of(last), prompt_token_ids=self._ids(got.prompt_token_ids))

    def chunk(self, delta: ipc.TextDelta, with_usage: bool) -> CompletionChunk:
        return CompletionChunk(self.id, self.created, self.model,
                               [CompletionChoice(0, delta.text, delta.finish_reason,
                                                 token_ids=self._ids(delta.token_ids))],
                               usage_of(delta) if with_usage else None)

    def usage_chunk(self, last: ipc.TextDelta) -> CompletionChunk:
        return CompletionChunk(self.id, self.created, self.model, [], usage_of(last))


class ChatAssembler(_Assembler):
    """Builds /v1/chat/completions bodies and chunks for one request."""

    def final(self, got: Collected) -> ChatCompletionResponse:
        last = got.last
        return ChatCompletionResponse(
            self.id, self.created, self.model,
            [ChatChoice(0, AssistantMessage(got.text), last.finish_reason,
                        token_ids=self._ids(got.token_ids))],
            usage_of(last), prompt_token_ids=self._ids(got.prompt_token_ids))

    def role_chunk(self) -> ChatCompletionChunk:
        return ChatCompletionChunk(self.id, self.created, self.model,
                                   [ChatChunkChoice(0, ChatDelta(role="assistant", content=""))])

    def chunk(self, delta: ipc.TextDelta, with_usage: bool) -> ChatCompletionChunk:
        content = delta.text if delta.text or delta.finish_reason is None else None
        return ChatCompletionChunk(
            self.id, self.created, self.model,
            [ChatChunkChoice(0, ChatDelta(content=content), delta.finish_reason,
                             token_ids=self._ids(delta.token_ids))],
            usage_of(delta) if with_usage else None)

    def usage_chunk(self, last: ipc.TextDelta) -> ChatCompletionChunk:
        return ChatCompletionChunk(self.id, self.created, self.model, [], usage_of(last))

"""Anthropic's Messages API bodies (``/v1/messages``, ``/v1/messages/count_tokens``), as
msgspec Structs.

The request decodes straight into ``MessagesRequest``: a wrong type, a value out of
Anthropic's ranges or a missing ``max_tokens`` is a 400 naming the JSON path, as on the
other routes. Content blocks are tagged by ``type``; the blocks a text-only model cannot
take (image, document, search results) decode loosely so the frontend can refuse them
by name. The response blocks are the same structs a client sends back in the next turn.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from protocol.openai_api import CandorReport, NonNegativeInt, PositiveInt, TopK

UnitFloat = Annotated[float, Meta(ge=0.0, le=1.0)]  # Anthropic's temperature and top_p range


class CacheControl(msgspec.Struct, omit_defaults=True):
    """A prompt-cache breakpoint. Candor's prefix cache keeps every prompt prefix without
    one, so a breakpoint asks for what happens anyway; ``ttl`` is not acted on."""

    type: Literal["ephemeral"] = "ephemeral"
    ttl: str | None = None


# ---------------------------------------------------------------- content blocks


class TextBlock(msgspec.Struct, tag="text", tag_field="type", omit_defaults=True):
    text: str
    cache_control: CacheControl | None = None
    citations: list[Any] | None = None


class ToolUseBlock(msgspec.Struct, tag="tool_use", tag_field="type", omit_defaults=True):
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(msgspec.Struct, tag="tool_result", tag_field="type",
                      omit_defaults=True):
    tool_use_id: str
    content: str | list[dict[str, Any]] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None


class ThinkingBlock(msgspec.Struct, tag="thinking", tag_field="type"):
    """``signature`` is empty on Candor's blocks: nothing is signed or checked."""

    thinking: str
    signature: str = ""


class RedactedThinkingBlock(msgspec.Struct, tag="redacted_thinking", tag_field="type"):
    data: str


class _Unreadable(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """A block a text-only model cannot read: decoded only to be refused by name."""

    source: Any = None


class ImageBlock(_Unreadable, tag="image", tag_field="type"):
    """Read by a model that takes images (``source`` type base64, becoming chat's data:
    URL); refused by name by a text-only one."""


class DocumentBlock(_Unreadable, tag="document", tag_field="type"):
    pass


class SearchResultBlock(_Unreadable, tag="search_result", tag_field="type"):
    pass


InputBlock = (TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock
              | RedactedThinkingBlock | ImageBlock | DocumentBlock | SearchResultBlock)
UNREADABLE = (ImageBlock, DocumentBlock, SearchResultBlock)


class InputMessage(msgspec.Struct):
    role: Literal["user", "assistant"]
    content: str | list[InputBlock]


# ---------------------------------------------------------------- tools


class Tool(msgspec.Struct, omit_defaults=True):
    """A client tool. Anthropic's server tools (``type`` web_search_..., bash_...,
    code_execution_...) have other types and are refused by the frontend."""

    name: str
    input_schema: dict[str, Any] | None = None
    description: str | None = None
    type: str | None = None  # "custom" or absent for a client tool
    cache_control: CacheControl | None = None


class ToolChoiceAuto(msgspec.Struct, tag="auto", tag_field="type"):
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(msgspec.Struct, tag="any", tag_field="type"):
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(msgspec.Struct, tag="tool", tag_field="type"):
    name: str
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(msgspec.Struct, tag="none", tag_field="type"):
    pass


ToolChoice = ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone


class ThinkingEnabled(msgspec.Struct, tag="enabled", tag_field="type"):
    budget_tokens: NonNegativeInt | None = None
    display: Literal["summarized", "omitted"] | None = None


class ThinkingDisabled(msgspec.Struct, tag="disabled", tag_field="type"):
    pass


class ThinkingAdaptive(msgspec.Struct, tag="adaptive", tag_field="type"):
    display: Literal["summarized", "omitted"] | None = None


class ThinkingBetweenTools(msgspec.Struct, tag="between_tools", tag_field="type"):
    pass


Thinking = ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive | ThinkingBetweenTools


class JsonOutputFormat(msgspec.Struct):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(msgspec.Struct):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonOutputFormat | None = None


class Metadata(msgspec.Struct):
    user_id: str | None = None


# ---------------------------------------------------------------- requests


class CountTokensRequest(msgspec.Struct, kw_only=True):
    """``/v1/messages/count_tokens``: the prompt part of a create request."""

    model: str
    messages: list[InputMessage]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    strict: bool = False  # extension: every ignored field becomes a 400


class MessagesRequest(CountTokensRequest, kw_only=True):
    max_tokens: PositiveInt
    stop_sequences: list[str] | None = None
    temperature: UnitFloat | None = None
    top_p: UnitFloat | None = None
    top_k: TopK | None = None
    stream: bool = False
    metadata: Metadata | None = None
    cache_control: CacheControl | None = None
    output_config: OutputConfig | None = None
    service_tier: str | None = None
    speed: str | None = None
    inference_geo: str | None = None
    diagnostics: Any = None
    user_profile_id: str | None = None
    workspace_id: str | None = None


# ---------------------------------------------------------------- responses


class OutputTokensDetails(msgspec.Struct):
    thinking_tokens: int  # the output tokens the reasoning parser split off


class Usage(msgspec.Struct):
    """``input_tokens`` are the prompt tokens the prefix cache did not serve; the total
    prompt is input + cache_read (+ cache_creation, always 0: Candor writes its cache as
    it computes, at no extra cost, and reports no separate cache writes)."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    service_tier: str = "standard"
    # where a reasoning parser split the reply; absent otherwise
    output_tokens_details: OutputTokensDetails | msgspec.UnsetType = msgspec.UNSET


ContentBlock = TextBlock | ToolUseBlock | ThinkingBlock


class Message(msgspec.Struct, omit_defaults=False):
    id: str
    model: str
    content: list[ContentBlock]
    usage: Usage
    stop_reason: str | None = None
    stop_sequence: str | None = None
    type: str = "message"
    role: str = "assistant"
    candor: CandorReport | msgspec.UnsetType = msgspec.UNSET


class CountTokensResponse(msgspec.Struct):
    input_tokens: int


class ErrorDetail(msgspec.Struct):
    type: str
    message: str


class ErrorBody(msgspec.Struct):
    error: ErrorDetail
    type: str = "error"


# ---------------------------------------------------------------- stream events


class TextDelta(msgspec.Struct, tag="text_delta", tag_field="type"):
    text: str


class InputJsonDelta(msgspec.Struct, tag="input_json_delta", tag_field="type"):
    partial_json: str


class ThinkingDelta(msgspec.Struct, tag="thinking_delta", tag_field="type"):
    thinking: str


class MessageStart(msgspec.Struct, tag="message_start", tag_field="type"):
    message: Message


class Ping(msgspec.Struct, tag="ping", tag_field="type"):
    pass


class ContentBlockStart(msgspec.Struct, tag="content_block_start", tag_field="type"):
    index: int
    content_block: ContentBlock


class ContentBlockDelta(msgspec.Struct, tag="content_block_delta", tag_field="type"):
    index: int
    delta: TextDelta | InputJsonDelta | ThinkingDelta


class ContentBlockStop(msgspec.Struct, tag="content_block_stop", tag_field="type"):
    index: int


class MessageDeltaBody(msgspec.Struct):
    stop_reason: str | None
    stop_sequence: str | None = None


class MessageDelta(msgspec.Struct, tag="message_delta", tag_field="type"):
    delta: MessageDeltaBody
    usage: Usage


class MessageStop(msgspec.Struct, tag="message_stop", tag_field="type"):
    pass


class ErrorEvent(msgspec.Struct, tag="error", tag_field="type"):
    error: ErrorDetail


Event = (MessageStart | Ping | ContentBlockStart | ContentBlockDelta | ContentBlockStop
         | MessageDelta | MessageStop | ErrorEvent)

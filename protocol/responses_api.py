"""OpenAI's Responses API bodies (``/v1/responses``), as msgspec Structs.

The request decodes straight into ``ResponsesRequest`` (a wrong type or range is a 400
naming the JSON path, as on the other routes). Input items stay plain objects at decode
time and are converted one by one into the item structs below by the frontend, so a bad
item is a 400 naming ``input[i]...`` with a message about that item. Output items are the
same structs: whatever a response returns, a client can send back as input.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

from protocol.openai_api import (CandorReport, Int64, NonNegativeInt, Penalty, PositiveInt,
                                 Priority, Temperature, TokenId, TopK, TopP)

# ---------------------------------------------------------------- items


class InputText(msgspec.Struct, tag="input_text", tag_field="type"):
    text: str


class OutputText(msgspec.Struct, tag="output_text", tag_field="type"):
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class Refusal(msgspec.Struct, tag="refusal", tag_field="type"):
    refusal: str


class InputImage(msgspec.Struct, tag="input_image", tag_field="type", omit_defaults=True):
    """An image in a user message or a function call's output (a model that takes images):
    ``image_url`` a data:, http(s) or file:// URL (as chat's image_url)
    (``file_id`` names OpenAI's Files API, which Candor does not serve); ``detail`` is
    accepted and not read (the checkpoint's processor fixes the resolution)."""

    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = "auto"


TextPart = InputText | OutputText | Refusal


class MessageItem(msgspec.Struct, tag="message", tag_field="type", kw_only=True,
                  omit_defaults=True):
    """A message in the conversation. ``type`` may be omitted on input (OpenAI's "easy"
    message); ``id`` and ``status`` are set on the items a response returns."""

    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart | InputImage]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(msgspec.Struct, tag="function_call", tag_field="type", kw_only=True,
                       omit_defaults=True):
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(msgspec.Struct, tag="function_call_output", tag_field="type",
                             kw_only=True, omit_defaults=True):
    call_id: str
    output: str | list[InputText | InputImage]  # images: a model that takes them
    id: str | None = None
    status: str | None = None


class SummaryText(msgspec.Struct, tag="summary_text", tag_field="type"):
    text: str


class ReasoningText(msgspec.Struct, tag="reasoning_text", tag_field="type"):
    text: str


class ReasoningItem(msgspec.Struct, tag="reasoning", tag_field="type", kw_only=True,
                    omit_defaults=False):
    """Text the reasoning parser split off (``content``); Candor writes no summaries and
    no ``encrypted_content``."""

    id: str | None = None
    summary: list[SummaryText] = []
    content: list[ReasoningText] = []
    encrypted_content: str | None = None
    status: str | None = None


Item = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
ITEM_TYPES: dict[str, type] = {"message": MessageItem, "function_call": FunctionCallItem,
                               "function_call_output": FunctionCallOutputItem,
                               "reasoning": ReasoningItem}

# ---------------------------------------------------------------- request


class TextFormatText(msgspec.Struct, tag="text", tag_field="type"):
    pass


class TextFormatJsonObject(msgspec.Struct, tag="json_object", tag_field="type"):
    pass


class TextFormatJsonSchema(msgspec.Struct, tag="json_schema", tag_field="type", kw_only=True,
                           omit_defaults=True):
    name: str
    schema: dict[str, Any]
    description: str | None = None
    strict: bool | None = None


TextFormat = TextFormatText | TextFormatJsonObject | TextFormatJsonSchema


class TextConfig(msgspec.Struct, kw_only=True, omit_defaults=True):
    format: TextFormat = msgspec.field(default_factory=TextFormatText)
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(msgspec.Struct, kw_only=True):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesStreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_obfuscation: bool | None = None  # Candor adds no obfuscation (reported)


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """POST /v1/responses. Fields OpenAI defines that Candor does not build
    (``background``, ``conversation``, ``prompt``, ...) are not here: the field table
    rejects them by name (``field_policy.RESPONSES_UNBUILT``)."""

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    max_tool_calls: PositiveInt | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    # extensions, passed to the chat pipeline as they are (same names, same checks)
    seed: Int64 | None = None
    top_k: TopK | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=2.0)] = 1.0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    logit_bias: dict[str, Annotated[float, Meta(ge=-100.0, le=100.0)]] | None = None
    min_tokens: NonNegativeInt = 0
    cache_salt: str | None = None
    priority: Priority = 0
    strict: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None


# ---------------------------------------------------------------- response


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(msgspec.Struct):
    code: str
    message: str


class IncompleteDetails(msgspec.Struct):
    reason: str


class ResponseObject(msgspec.Struct, kw_only=True):
    """The ``response`` object: the whole body, every lifecycle event's snapshot, and
    what GET /v1/responses/{id} returns. ``temperature`` / ``top_p``: the values used."""

    id: str
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[Item] = []
    object: str = "response"
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = {}
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: ReasoningConfig = msgspec.field(default_factory=ReasoningConfig)
    store: bool = True
    temperature: float | None = None
    text: TextConfig = msgspec.field(default_factory=TextConfig)
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = []
    top_p: float | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    background: bool = False
    service_tier: str = "default"
    candor: CandorReport | UnsetType = UNSET


class StoredResponse(msgspec.Struct):
    """One store entry: the response and every input item of its conversation (those of
    the responses it continues first), as ``GET .../input_items`` lists them."""

    response: ResponseObject
    input_items: list[Item]


class InputItemList(msgspec.Struct):
    data: list[Item]
    first_id: str | None
    last_id: str | None
    has_more: bool = False
    object: str = "list"


class DeletedResponse(msgspec.Struct):
    id: str
    deleted: bool = True
    object: str = "response.deleted"


# ---------------------------------------------------------------- stream events


class _Event(msgspec.Struct, tag_field="type", kw_only=True):
    sequence_number: int = 0


class _Lifecycle(_Event):
    response: ResponseObject


class ResponseCreated(_Lifecycle, tag="response.created"):
    pass


class ResponseInProgress(_Lifecycle, tag="response.in_progress"):
    pass


class ResponseCompleted(_Lifecycle, tag="response.completed"):
    pass


class ResponseIncomplete(_Lifecycle, tag="response.incomplete"):
    pass


class ResponseFailed(_Lifecycle, tag="response.failed"):
    pass


class _ItemEvent(_Event):
    output_index: int
    item: Item


class OutputItemAdded(_ItemEvent, tag="response.output_item.added"):
    pass


class OutputItemDone(_ItemEvent, tag="response.output_item.done"):
    pass


class _InItem(_Event):
    item_id: str
    output_index: int


class _InPart(_InItem):
    content_index: int


ContentPart = OutputText | ReasoningText


class ContentPartAdded(_InPart, tag="response.content_part.added"):
    part: ContentPart


class ContentPartDone(_InPart, tag="response.content_part.done"):
    part: ContentPart


class OutputTextDelta(_InPart, tag="response.output_text.delta"):
    delta: str
    logprobs: list[Any] = []


class OutputTextDone(_InPart, tag="response.output_text.done"):
    text: str
    logprobs: list[Any] = []


class ReasoningTextDelta(_InPart, tag="response.reasoning_text.delta"):
    delta: str


class ReasoningTextDone(_InPart, tag="response.reasoning_text.done"):
    text: str


class FunctionCallArgumentsDelta(_InItem, tag="response.function_call_arguments.delta"):
    delta: str


class FunctionCallArgumentsDone(_InItem, tag="response.function_call_arguments.done"):
    name: str
    arguments: str


class ErrorEvent(_Event, tag="error"):
    """A failure after the stream started, in the error shape's terms; followed by
    ``response.failed``."""

    code: str | None
    message: str
    param: str | None


StreamEvent = (ResponseCreated | ResponseInProgress | ResponseCompleted | ResponseIncomplete
               | ResponseFailed | OutputItemAdded | OutputItemDone | ContentPartAdded
               | ContentPartDone | OutputTextDelta | OutputTextDone | ReasoningTextDelta
               | ReasoningTextDone | FunctionCallArgumentsDelta | FunctionCallArgumentsDone
               | ErrorEvent)

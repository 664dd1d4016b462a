"""OpenAI HTTP request and response bodies, as msgspec Structs.

Requests are decoded straight into these types: a wrong type, a value out of range or a
missing required field fails at decode time with a message that names the JSON path,
which the frontend turns into a 400 naming the field. Ranges follow OpenAI's docs.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
# Every integer is bounded to int64 at decode: a larger one would fail later, in the
# msgpack encoding between processes, as a 500 instead of a 400 naming the field.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
TOKEN_ID_MAX = 2**31 - 1  # token ids travel as int32
Int64 = Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)]
PositiveInt = Annotated[int, Meta(ge=1, le=INT64_MAX)]
NonNegativeInt = Annotated[int, Meta(ge=0, le=INT64_MAX)]
TopK = Annotated[int, Meta(ge=-1, le=INT64_MAX)]
TokenId = Annotated[int, Meta(ge=0, le=TOKEN_ID_MAX)]
# ``priority`` (an extension): 32 bits, as the range any client could need; a non-zero value
# needs --scheduling-policy priority (checked in the frontend)
Priority = Annotated[int, Meta(ge=-(2**31), le=2**31 - 1)]


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ContentPart(msgspec.Struct, omit_defaults=True):
    """One element of a list-valued message content. Only ``text`` parts are served by a
    text model; other types are rejected with a 400 naming the part."""

    type: str
    text: str | None = None
    image_url: Any = None
    input_audio: Any = None
    file: Any = None


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str | dict[str, Any]


class ToolCall(msgspec.Struct):
    function: FunctionCall
    id: str | None = None
    type: str = "function"


class ChatMessage(msgspec.Struct, omit_defaults=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class _SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str
    max_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: PositiveInt = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[str, Annotated[float, Meta(ge=-100.0, le=100.0)]] | None = None
    user: str | None = None
    # extensions (not OpenAI fields), as vLLM and SGLang accept them
    top_k: TopK | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=2.0)] = 1.0
    ignore_eos: bool = False
    min_tokens: NonNegativeInt = 0
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False  # extension: ids of the prompt and of each choice
    priority: Priority = 0  # extension: lower runs first when requests wait; FCFS within one
    cache_salt: str | None = None  # extension: prefix-cache sharing only within one salt
    prompt_logprobs: NonNegativeInt | None = None  # extension (vLLM): top-k per prompt token
    strict: bool = False  # extension: every ignored or clamped field becomes a 400
    # constrained decoding: OpenAI's response_format and vLLM's extensions
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    # str | list[int] | list[str] | list[list[int]]; msgspec cannot express that union,
    # so the element kinds are checked when the request is translated
    prompt: str | list[str | TokenId | list[TokenId]]
    echo: bool = False
    logprobs: NonNegativeInt | None = None  # bounded by the deployment's max_logprobs
    suffix: str | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: NonNegativeInt | None = None  # bounded by max_logprobs
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # extension, only with --allow-request-chat-template
    echo: bool = False  # extension (vLLM): prepend the final assistant message's content


# ---------------------------------------------------------------- responses


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class CompletionTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0  # the completion tokens the reasoning parser split off


class FieldNote(msgspec.Struct, omit_defaults=True):
    field: str
    reason: str = ""
    from_: Any = msgspec.field(default=None, name="from")
    to: Any = None


class TemplateRef(msgspec.Struct):
    source: str  # request | server-flag | checkpoint
    origin: str
    sha256: str


class SpeculativeReport(msgspec.Struct):
    """Speculative decoding on one response (all its choices): draft tokens the model
    verified, and those it accepted. ``exact``: the replica verified them with
    batch-invariant kernels, so each accepted draft is the token decoding without drafts
    would have produced, bitwise (greedy and seeded: the same answer as speculation off;
    unseeded: the same distribution). False: the replica's deterministic mode is off
    (``--no-deterministic``, or a device without batch-invariant kernels), a verify row
    of 1 + k positions may round differently from a one-token decode row, and the answer
    may differ from the one speculation off would give. None: the replica has not said."""

    drafted: int = 0
    accepted: int = 0
    exact: bool | None = None


class CandorReport(msgspec.Struct, omit_defaults=True):
    """What Candor did with the request (the ``candor`` extension field and the
    ``x-candor-adjustments`` header): clamps, ignored fields, extensions used, template,
    and the sampling defaults the request took from the deployment (``defaults``: fields
    it omitted, set from the checkpoint's generation_config.json)."""

    clamped: list[FieldNote] = []
    ignored: list[FieldNote] = []
    extensions: list[str] = []
    defaults: list[FieldNote] = []
    chat_template: TemplateRef | None = None
    strict: bool = False
    tool_parser: str | None = None  # which parser read tool calls out of the text
    reasoning_parser: str | None = None  # which parser split off reasoning_content
    constraint: str | None = None  # the field whose grammar constrained decoding
    # The replica that answered ran batch-invariant kernels: a greedy or seeded request's
    # tokens and logprobs are the same bits whatever else ran beside it.
    deterministic: bool | None = None
    # speculative decoding's counts, where the response drafted: on a whole body, or on
    # a stream's last frame (the usage chunk with include_usage, else the chunk that
    # finishes the last choice)
    speculative: SpeculativeReport | None = None


class TopLogprobEntry(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatLogprobEntry(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprobEntry]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatLogprobEntry] | None
    refusal: None = None


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(msgspec.Struct):
    """vLLM's per-token entry in ``prompt_logprobs`` (keyed by token id)."""

    logprob: float
    rank: int | None
    decoded_token: str


# vLLM's shape: one entry per prompt token, the first None (nothing predicts it)
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    # where a reasoning parser split the reply (chat); absent otherwise
    completion_tokens_details: CompletionTokensDetails | UnsetType = UNSET


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int] | UnsetType = UNSET
    prompt_logprobs: PromptLogprobs | UnsetType = UNSET  # extension, per choice as vLLM
    prompt_token_ids: list[int] | UnsetType = UNSET  # several prompts: this choice's prompt


class CompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | UnsetType = UNSET
    candor: CandorReport | UnsetType = UNSET


class ResponseFunction(msgspec.Struct):
    name: str
    arguments: str  # JSON text, exactly as the streamed fragments concatenate


class ResponseToolCall(msgspec.Struct):
    id: str
    function: ResponseFunction
    type: str = "function"


class AssistantMessage(msgspec.Struct):
    content: str | None
    role: str = "assistant"
    tool_calls: list[ResponseToolCall] | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | UnsetType = UNSET


class ChatCompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | UnsetType = UNSET
    prompt_logprobs: PromptLogprobs | UnsetType = UNSET  # extension, top level as vLLM
    candor: CandorReport | UnsetType = UNSET


class DeltaFunction(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, omit_defaults=True):
    """OpenAI's streamed call: ``id``, ``type`` and ``function.name`` in a call's first
    delta, then ``function.arguments`` fragments."""

    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunction | None = None


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | UnsetType = UNSET


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"
    candor: CandorReport | UnsetType = UNSET


class CompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"
    candor: CandorReport | UnsetType = UNSET


class ModelCard(msgspec.Struct):
    """A served model; a LoRA adapter's card names its base in ``parent`` and its
    directory in ``root`` (vLLM's shape)."""

    id: str
    created: int
    max_model_len: int
    object: str = "model"
    owned_by: str = "candor"
    root: str | None = None
    parent: str | None = None


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(msgspec.Struct):
    error: ErrorDetail


# ---------------------------------------------------------------- tokenize / detokenize


class LoadLoraAdapterRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """POST /v1/load_lora_adapter (vLLM's body): serve the PEFT adapter in ``lora_path``
    as ``lora_name``; ``load_inplace``: replace the adapter already served under it."""

    lora_name: Annotated[str, Meta(min_length=1, max_length=256)]
    lora_path: Annotated[str, Meta(min_length=1, max_length=4096)]
    load_inplace: bool = False


class UnloadLoraAdapterRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """POST /v1/unload_lora_adapter (vLLM's body); ``lora_int_id`` is accepted and not
    used (an adapter is named by ``lora_name``)."""

    lora_name: Annotated[str, Meta(min_length=1, max_length=256)]
    lora_int_id: int | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """POST /tokenize, vLLM's two forms in one: exactly one of ``prompt`` (special tokens
    added by default, as /v1/completions does) or ``messages`` (rendered with the chat
    template; special tokens not added by default, the template writes them)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None  # None (or absent): true
    continue_final_message: bool | None = None
    chat_template: str | None = None  # only with --allow-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool | None = None


class TokenizeResponse(msgspec.Struct, omit_defaults=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(msgspec.Struct):
    prompt: str


class TokenizerInfoResponse(msgspec.Struct, omit_defaults=True):
    """GET /tokenizer_info (vLLM's shape: tokenizer_config.json's settings, then the
    server's effective values); lm-eval's remote tokenizer reads it."""

    tokenizer_class: str
    model_max_length: int
    vocab_size: int
    eos_token_ids: list[int]
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    chat_template: str | None = None


class RenderResponse(msgspec.Struct, omit_defaults=True):
    """/v1/*/render: what the model would see, without generating."""

    prompt: str
    prompt_token_ids: list[int]
    model: str
    chat_template: TemplateRef | None = None
    candor: CandorReport | None = None


# ---------------------------------------------------------------- embeddings


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    """POST /v1/embeddings. ``input``: a string, token ids, or a list of either (checked
    when the request is split into inputs: msgspec cannot express that union)."""

    model: str
    input: str | list[str | TokenId | list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: PositiveInt | None = None
    user: str | None = None
    # extensions
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS/EOS around each string
    priority: Priority = 0
    strict: bool = False


class EmbeddingData(msgspec.Struct):
    index: int
    embedding: list[float] | str  # base64: little-endian float32 bytes
    object: str = "embedding"


class EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage
    candor: CandorReport | UnsetType = UNSET

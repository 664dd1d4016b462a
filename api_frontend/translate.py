"""OpenAI request bodies -> GenerateReq, with every field's fate decided here.

Fields Candor does not act on yet are rejected with a 400 naming them rather than
accepted and dropped; fields that are accepted but have no effect (``user``, unknown
keys) are listed back to the client in the ``x-candor-ignored-fields`` header.
"""

from __future__ import annotations

from typing import Any

import msgspec

from api_frontend.errors import ApiError
from protocol import ipc
from protocol.openai_api import ChatCompletionRequest, CompletionRequest

# accepted, validated, not acted on: reported back, never silently dropped
IGNORED_FIELDS = ("user",)


def ignored_fields(raw_keys: list[str], request: msgspec.Struct) -> list[str]:
    known = set(request.__struct_fields__)
    unknown = [k for k in raw_keys if k not in known]
    return [f for f in IGNORED_FIELDS if getattr(request, f) is not None] + unknown


def _reject_unsupported(req: CompletionRequest | ChatCompletionRequest) -> None:
    """Fields whose semantics Candor does not implement yet: a 400, never a silent no-op."""
    checks: list[tuple[str, bool]] = [
        ("n", req.n != 1),
        ("presence_penalty", req.presence_penalty != 0.0),
        ("frequency_penalty", req.frequency_penalty != 0.0),
        ("repetition_penalty", req.repetition_penalty != 1.0),
        ("min_p", req.min_p != 0.0),
        ("logit_bias", bool(req.logit_bias)),
    ]
    if isinstance(req, ChatCompletionRequest):
        checks += [
            ("logprobs", req.logprobs),
            ("top_logprobs", req.top_logprobs is not None),
            ("tools", req.tools is not None),
            ("tool_choice", req.tool_choice not in (None, "none")),
            ("parallel_tool_calls", req.parallel_tool_calls is not None),
            ("response_format", req.response_format not in (None, {"type": "text"})),
        ]
    else:
        checks += [
            ("logprobs", req.logprobs is not None),
            ("echo", req.echo),
            ("suffix", req.suffix is not None),
            ("best_of", req.best_of not in (None, 1)),
        ]
    for field, used in checks:
        if used:
            raise ApiError(400, f"`{field}` is not supported by this Candor deployment "
                           "yet; remove it or use its default", field, "unsupported_field")


def _check_stream_options(req: CompletionRequest | ChatCompletionRequest) -> None:
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "`stream_options` is only allowed when `stream` is true",
                       "stream_options", "invalid_value")


def _sampling(req: CompletionRequest | ChatCompletionRequest) -> ipc.SamplingParams:
    return ipc.SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k in (None, 0) else req.top_k,
        seed=req.seed)


def _detok(req: CompletionRequest | ChatCompletionRequest) -> ipc.DetokParams:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return ipc.DetokParams(stop=stop, include_stop_str_in_output=req.include_stop_str_in_output,
                           skip_special_tokens=req.skip_special_tokens,
                           return_token_ids=req.return_token_ids)


def _common(req: CompletionRequest | ChatCompletionRequest, rid: str, reply_to: str,
            arrival: float) -> dict[str, Any]:
    _check_stream_options(req)
    _reject_unsupported(req)
    return dict(rid=rid, reply_to=reply_to, sampling=_sampling(req), detok=_detok(req),
                stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
                min_tokens=req.min_tokens, arrival_time=arrival, priority=req.priority,
                cache_salt=req.cache_salt)


# The legacy completions contract documents a default of 16 tokens; chat's default is
# "until the context is full", which is what None means downstream.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def completion_to_generate(req: CompletionRequest, rid: str, reply_to: str,
                           arrival: float) -> ipc.GenerateReq:
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and not all(isinstance(p, int) for p in prompt):
        kinds = {type(p) for p in prompt}
        if len(kinds) != 1:
            raise ApiError(400, "`prompt` must be a string, a list of token ids, a list of "
                           "strings or a list of token-id lists, not a mix", "prompt",
                           "invalid_value")
        if len(prompt) != 1:
            raise ApiError(400, "a list of several prompts is not supported yet; send one "
                           "prompt per request", "prompt", "unsupported_field")
        prompt = prompt[0]
    if not prompt:
        raise ApiError(400, "`prompt` must not be empty", "prompt", "invalid_value")
    max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    return ipc.GenerateReq(prompt=prompt, max_tokens=max_tokens,
                           **_common(req, rid, reply_to, arrival))


def chat_to_generate(req: ChatCompletionRequest, rid: str, reply_to: str,
                     arrival: float) -> ipc.GenerateReq:
    if not req.messages:
        raise ApiError(400, "`messages` must contain at least one message", "messages",
                       "invalid_value")
    if req.add_generation_prompt and req.continue_final_message:
        raise ApiError(400, "`add_generation_prompt` and `continue_final_message` cannot "
                       "both be true", "continue_final_message", "invalid_value")
    for i, message in enumerate(req.messages):
        if isinstance(message.content, list):
            for j, part in enumerate(message.content):
                if part.type != "text" or part.text is None:
                    raise ApiError(400, f"content part type {part.type!r} is not supported "
                                   "by this text-only model (only 'text' parts are)",
                                   f"messages[{i}].content[{j}].type", "unsupported_content")
    if req.max_completion_tokens is not None:
        max_tokens, field = req.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, field = req.max_tokens, "max_tokens"
    messages = [msgspec.to_builtins(m) for m in req.messages]
    return ipc.GenerateReq(
        messages=messages, add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        chat_template_kwargs=dict(req.chat_template_kwargs or {}),
        max_tokens=max_tokens, max_tokens_field=field,
        **_common(req, rid, reply_to, arrival))

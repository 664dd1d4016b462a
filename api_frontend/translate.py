"""OpenAI request bodies -> GenerateReq, with every field's fate decided here.

Each field lands in one tier: honoured (maps onto the sampler / detokenizer), extension
(not an OpenAI field, honoured), ignored (accepted, not acted on: reported back), or
rejected (a 400 naming it: what this deployment cannot do). ``FIELD_TIERS`` is the one
table; GET /v1/capabilities publishes it and the response's ``candor`` report lists
the ignored and extension fields the client actually sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from api_frontend.errors import ApiError
from protocol import ipc
from protocol.openai_api import (CandorReport, ChatCompletionRequest, CompletionRequest,
                                 FieldNote)
from protocol.topology import ApiSpec

_COMMON_HONOURED = ("model", "max_tokens", "temperature", "top_p", "n", "stream",
                    "stream_options", "stop", "seed", "presence_penalty", "frequency_penalty",
                    "logit_bias")
_COMMON_EXTENSIONS = ("top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens",
                      "stop_token_ids", "skip_special_tokens", "include_stop_str_in_output",
                      "return_token_ids", "strict", "prompt_logprobs")
_REASONS = {
    "user": "accepted for compatibility; Candor does not use it (no per-user policy)",
    "suffix": "accepted for compatibility; insertion (fill-in-the-middle) is not implemented",
}


def field_tiers(kind: str, api: ApiSpec) -> dict[str, str]:
    """The tier of every request field of ``kind`` ("chat" | "completions") under ``api``.

    ``strict`` deployments turn the ignored tier into rejected."""
    ignored = "rejected" if api.strict else "ignored"
    tiers = {f: "honoured" for f in _COMMON_HONOURED}
    tiers.update({f: "extension" for f in _COMMON_EXTENSIONS})
    tiers["user"] = ignored
    if api.max_tokens_policy == "clamp":
        tiers["max_tokens"] = "rejected" if api.strict else "clamped"
    if kind == "chat":
        tiers.update(messages="honoured", max_completion_tokens=tiers["max_tokens"],
                     logprobs="honoured", top_logprobs="honoured", tools="rejected",
                     tool_choice="rejected", parallel_tool_calls="rejected",
                     response_format="rejected")
        tiers.update({f: "extension" for f in ("add_generation_prompt", "continue_final_message",
                                                "chat_template_kwargs", "echo")})
        tiers["chat_template"] = "extension" if api.allow_request_chat_template else "rejected"
    else:
        tiers.update(prompt="honoured", echo="honoured", logprobs="honoured",
                     suffix=ignored, best_of="rejected")
    tiers["<unknown field>"] = ignored
    return tiers


@dataclass
class Translated:
    """A request ready to submit: the GenerateReq of choice 0, how many choices, whether
    one computation serves all of them (n > 1 at temperature 0), and the report so far."""

    gen: ipc.GenerateReq
    n: int
    compute_once: bool
    report: CandorReport
    echo: bool = False  # chat echo / completions echo

    def choice_reqs(self) -> list[ipc.GenerateReq]:
        """One GenerateReq per computed choice; seeded choices get seed + index so the n
        samples differ yet stay reproducible."""
        if self.n == 1 or self.compute_once:
            return [self.gen]
        out = []
        for i in range(self.n):
            sampling = self.gen.sampling
            if sampling.seed is not None:
                sampling = msgspec.structs.replace(sampling, seed=sampling.seed + i)
            out.append(msgspec.structs.replace(self.gen, rid=f"{self.gen.rid}-{i}",
                                               sampling=sampling))
        return out


def _report(raw_keys: list[str], req: CompletionRequest | ChatCompletionRequest,
            api: ApiSpec) -> CandorReport:
    known = set(req.__struct_fields__)
    ignored = [FieldNote(f, _REASONS[f]) for f in ("user", "suffix")
               if f in known and getattr(req, f) is not None]
    ignored += [FieldNote(k, "not a field Candor knows") for k in raw_keys if k not in known]
    kind = "chat" if isinstance(req, ChatCompletionRequest) else "completions"
    tiers = field_tiers(kind, ApiSpec())
    extensions = [k for k in raw_keys if tiers.get(k) == "extension"]
    strict = api.strict or req.strict
    if strict and ignored:
        note = ignored[0]
        raise ApiError(400, f"`{note.field}` would be ignored ({note.reason}); strict mode "
                       "turns ignored fields into errors", note.field, "ignored_field")
    return CandorReport(ignored=ignored, extensions=extensions, strict=strict)


def _reject_unsupported(req: CompletionRequest | ChatCompletionRequest) -> None:
    """Fields whose semantics Candor does not implement yet: a 400, never a silent no-op."""
    checks: list[tuple[str, bool]] = []
    if isinstance(req, ChatCompletionRequest):
        checks += [
            ("tools", req.tools is not None),
            ("tool_choice", req.tool_choice not in (None, "none")),
            ("parallel_tool_calls", req.parallel_tool_calls is not None),
            ("response_format", req.response_format not in (None, {"type": "text"})),
        ]
    else:
        checks += [("best_of", req.best_of not in (None, 1))]
    for field, used in checks:
        if used:
            raise ApiError(400, f"`{field}` is not supported by this Candor deployment "
                           "yet; remove it or use its default", field, "unsupported_field")


def _check_stream_options(req: CompletionRequest | ChatCompletionRequest) -> None:
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "`stream_options` is only allowed when `stream` is true",
                       "stream_options", "invalid_value")


def _logit_bias(req: CompletionRequest | ChatCompletionRequest) -> list[tuple[int, float]]:
    out = []
    for key, bias in (req.logit_bias or {}).items():
        try:
            token_id = int(key)
        except ValueError:
            raise ApiError(400, f"`logit_bias` keys must be token ids, got {key!r}",
                           "logit_bias", "invalid_value") from None
        if bias != 0.0:
            out.append((token_id, float(bias)))
    return out


def _logprobs(req: CompletionRequest | ChatCompletionRequest) -> tuple[int, int]:
    """(logprobs, prompt_logprobs) for the sampler: -1 = none, k = top-k alternatives.
    Completions' echo + logprobs and ``prompt_logprobs`` share one prompt computation
    at the larger k; the response trims each to its own."""
    prompt_k = -1 if req.prompt_logprobs is None else req.prompt_logprobs
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "`top_logprobs` requires `logprobs: true`", "top_logprobs",
                           "invalid_value")
        return (req.top_logprobs or 0) if req.logprobs else -1, prompt_k
    k = -1 if req.logprobs is None else req.logprobs
    return k, max(prompt_k, k if req.echo and k >= 0 else -1)


def _check_prompt_logprobs(req: CompletionRequest | ChatCompletionRequest,
                           api: ApiSpec) -> None:
    """vLLM's ``prompt_logprobs``: bounded like logprobs, and only in a whole response."""
    k, limit = req.prompt_logprobs, api.limits.max_logprobs
    if k is None:
        return
    if k > limit:
        raise ApiError(400, f"`prompt_logprobs` is {k}; this deployment allows at most "
                       f"{limit} (limits.max_logprobs)", "prompt_logprobs", "limit_exceeded")
    if req.stream:
        raise ApiError(400, "`prompt_logprobs` is not available with `stream: true`",
                       "prompt_logprobs", "invalid_value")


def _sampling(req: CompletionRequest | ChatCompletionRequest) -> ipc.SamplingParams:
    logprobs, prompt_logprobs = _logprobs(req)
    return ipc.SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k in (None, 0) else req.top_k,
        seed=req.seed, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
        min_p=req.min_p, logit_bias=_logit_bias(req), logprobs=logprobs,
        prompt_logprobs=prompt_logprobs)


def _detok(req: CompletionRequest | ChatCompletionRequest) -> ipc.DetokParams:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return ipc.DetokParams(stop=stop, include_stop_str_in_output=req.include_stop_str_in_output,
                           skip_special_tokens=req.skip_special_tokens,
                           return_token_ids=req.return_token_ids)


def _common(req: CompletionRequest | ChatCompletionRequest, rid: str, reply_to: str,
            arrival: float, strict: bool) -> dict[str, Any]:
    _check_stream_options(req)
    _reject_unsupported(req)
    return dict(rid=rid, reply_to=reply_to, sampling=_sampling(req), detok=_detok(req),
                stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
                min_tokens=req.min_tokens, arrival_time=arrival, priority=req.priority,
                cache_salt=req.cache_salt, strict=strict)


def _translated(gen: ipc.GenerateReq, req, report: CandorReport, echo: bool) -> Translated:
    return Translated(gen, req.n, req.n > 1 and gen.sampling.temperature == 0, report, echo)


# The legacy completions contract documents a default of 16 tokens; chat's default is
# "until the context is full", which is what None means downstream.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def completion_to_generate(req: CompletionRequest, rid: str, reply_to: str, arrival: float,
                           raw_keys: list[str] = (), api: ApiSpec | None = None) -> Translated:
    api = api or ApiSpec()
    report = _report(list(raw_keys), req, api)
    _check_prompt_logprobs(req, api)
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
    gen = ipc.GenerateReq(prompt=prompt, max_tokens=max_tokens, echo_prompt=req.echo,
                          **_common(req, rid, reply_to, arrival, report.strict))
    return _translated(gen, req, report, req.echo)


def chat_to_generate(req: ChatCompletionRequest, rid: str, reply_to: str, arrival: float,
                     raw_keys: list[str] = (), api: ApiSpec | None = None) -> Translated:
    api = api or ApiSpec()
    report = _report(list(raw_keys), req, api)
    _check_prompt_logprobs(req, api)
    if req.chat_template is not None and not api.allow_request_chat_template:
        raise ApiError(400, "`chat_template` in a request is disabled on this deployment "
                       "(start the server with --allow-request-chat-template)",
                       "chat_template", "unsupported_field")
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
    gen = ipc.GenerateReq(
        messages=messages, add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        chat_template_kwargs=dict(req.chat_template_kwargs or {}),
        max_tokens=max_tokens, max_tokens_field=field, chat_template=req.chat_template,
        **_common(req, rid, reply_to, arrival, report.strict))
    return _translated(gen, req, report, req.echo)

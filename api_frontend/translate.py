"""OpenAI request bodies -> GenerateReq, with every field's fate decided here.

Each field lands in one tier: honoured (maps onto the sampler / detokenizer), extension
(not an OpenAI field, honoured), ignored (accepted, not acted on: reported back), or
rejected (a 400 naming it: what this deployment cannot do). ``FIELD_TIERS`` is the one
table; GET /v1/capabilities publishes it and the response's ``candor`` report lists
the ignored and extension fields the client actually sent.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgspec

from api_frontend import limits, reasoning
from api_frontend.constraints import guided_spec
from api_frontend.errors import ApiError
from api_frontend.tools import ToolPlan, tool_plan
from cluster.topology import ApiSpec
from protocol import ipc
from protocol.openai_api import (INT64_MAX, INT64_MIN, TOKEN_ID_MAX, CandorReport,
                                 ChatCompletionRequest, CompletionRequest, FieldNote)

_COMMON_HONOURED = ("model", "max_tokens", "temperature", "top_p", "n", "stream",
                    "stream_options", "stop", "seed", "presence_penalty", "frequency_penalty",
                    "logit_bias")
_COMMON_EXTENSIONS = ("top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens",
                      "stop_token_ids", "skip_special_tokens", "include_stop_str_in_output",
                      "return_token_ids", "strict", "prompt_logprobs", "guided_json",
                      "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")
_REASONS = {
    "user": "accepted for compatibility; Candor does not use it (no per-user policy)",
    "suffix": "accepted for compatibility; insertion (fill-in-the-middle) is not implemented",
}


class Foreign(NamedTuple):
    """A vLLM or SGLang extension field Candor does not implement. ``tier`` rejected: a
    400 ``unsupported_field`` unless the value is one of ``harmless`` (values that ask for
    what Candor does anyway, reported as ignored); ignored: it cannot change the output."""

    tier: str
    reason: str
    harmless: tuple[Any, ...] = ()


_NO_GUIDED = "use guided_json / guided_regex / guided_grammar or response_format"
_NO_BEAM = "beam search is not implemented"
FOREIGN_FIELDS: dict[str, Foreign] = {
    "regex": Foreign("rejected", _NO_GUIDED + " (SGLang `regex`)"),
    "ebnf": Foreign("rejected", _NO_GUIDED + " (SGLang `ebnf`)"),
    "json_schema": Foreign("rejected", _NO_GUIDED + " (SGLang `json_schema`)"),
    "guided_decoding_backend": Foreign("ignored", "Candor has one grammar engine "
                                       "(llguidance); the constraint itself is honoured"),
    "guided_whitespace_pattern": Foreign("rejected", "JSON output is always compact (no "
                                         "whitespace between tokens)"),
    "use_beam_search": Foreign("rejected", _NO_BEAM, (False,)),
    "best_of": Foreign("rejected", "best_of > 1 (sample several, return the best) is not "
                       "implemented", (1,)),
    "length_penalty": Foreign("ignored", "only applies to beam search, which Candor rejects"),
    "early_stopping": Foreign("ignored", "only applies to beam search, which Candor rejects"),
    "lora_request": Foreign("rejected", "LoRA adapters are not served"),
    "lora_path": Foreign("rejected", "LoRA adapters are not served"),
    "spaces_between_special_tokens": Foreign(
        "rejected", "only the default (true) detokenization is implemented", (True,)),
    "truncate_prompt_tokens": Foreign("rejected", "prompt truncation is not implemented"),
    "logits_processors": Foreign("rejected", "custom logits processors are not implemented"),
    "custom_logit_processor": Foreign("rejected", "custom logits processors are not "
                                      "implemented"),
    "bad_words": Foreign("rejected", "bad_words is not implemented", ([],)),
    "allowed_token_ids": Foreign("rejected", "allowed_token_ids is not implemented"),
    "vllm_xargs": Foreign("rejected", "vLLM's extra sampling arguments are not implemented"),
    "return_hidden_states": Foreign("rejected", "hidden states are not returned", (False,)),
    "return_tokens_as_token_ids": Foreign("rejected", "logprob tokens are always returned "
                                          "as text", (False,)),
    "min_new_tokens": Foreign("rejected", "SGLang's name; Candor's field is `min_tokens`"),
    "no_stop_trim": Foreign("rejected", "SGLang's name; Candor's field is "
                            "`include_stop_str_in_output`", (False,)),
    "stop_regex": Foreign("rejected", "regular-expression stops are not implemented"),
    "typical_p": Foreign("rejected", "typical sampling is not implemented", (1, 1.0)),
    "documents": Foreign("rejected", "chat documents (RAG templates) are not implemented"),
    "request_id": Foreign("ignored", "send the X-Request-Id header instead; it is echoed"),
    "kv_transfer_params": Foreign("ignored", "disaggregated prefill is not part of Candor"),
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
                     logprobs="honoured", top_logprobs="honoured", tools="honoured",
                     tool_choice="honoured", parallel_tool_calls="honoured",
                     response_format="honoured")
        tiers.update({f: "extension" for f in ("add_generation_prompt", "continue_final_message",
                                                "chat_template_kwargs", "echo")})
        tiers["chat_template"] = "extension" if api.allow_request_chat_template else "rejected"
    else:
        tiers.update(prompt="honoured", echo="honoured", logprobs="honoured", suffix=ignored,
                     response_format="extension")
    tiers.update({f: "rejected" if spec.tier == "rejected" else ignored
                  for f, spec in FOREIGN_FIELDS.items() if f not in tiers})
    tiers["<unknown field>"] = ignored
    return tiers


def _choice_seed(seed: int, i: int) -> int:
    """seed + i, wrapped into int64 so the sum still crosses the process boundary."""
    return (seed + i - INT64_MIN) % 2**64 + INT64_MIN


@dataclass
class Translated:
    """A request ready to submit: one GenerateReq per prompt, ``n`` choices per prompt,
    whether one computation serves a prompt's n choices (n > 1 at temperature 0), and the
    report so far. Choice ``p * n + i`` is the i-th sample of prompt p."""

    gens: list[ipc.GenerateReq]
    n: int
    compute_once: bool
    report: CandorReport
    echo: bool = False  # chat echo / completions echo
    choices: dict[str, list[int]] = field(default_factory=dict)  # rid -> its choice indexes
    tools: ToolPlan | None = None  # chat: how tool calls are read from the text
    reasoning: str | None = None  # chat: the reasoning parser that splits the text

    @property
    def gen(self) -> ipc.GenerateReq:
        return self.gens[0]

    @property
    def num_choices(self) -> int:
        return len(self.gens) * self.n

    def choice_reqs(self) -> list[ipc.GenerateReq]:
        """One GenerateReq per computed sequence (fills ``choices``); seeded choices get
        seed + index so the n samples differ yet stay reproducible."""
        self.choices = {}
        if self.num_choices == 1:
            self.choices[self.gen.rid] = [0]
            return [self.gen]
        out = []
        for p, gen in enumerate(self.gens):
            first = p * self.n
            if self.compute_once:
                req = msgspec.structs.replace(gen, rid=f"{gen.rid}-{first}")
                self.choices[req.rid] = list(range(first, first + self.n))
                out.append(req)
                continue
            for i in range(self.n):
                sampling = gen.sampling
                if sampling.seed is not None:
                    sampling = msgspec.structs.replace(sampling,
                                                       seed=_choice_seed(sampling.seed, i))
                req = msgspec.structs.replace(gen, rid=f"{gen.rid}-{first + i}",
                                              sampling=sampling)
                self.choices[req.rid] = [first + i]
                out.append(req)
        return out


_VALUE = msgspec.json.Decoder()


def _foreign_notes(raw: Mapping[str, Any], known: set[str]) -> list[FieldNote]:
    """400 for a foreign field that would change the output; notes for the harmless ones."""
    notes = []
    for key in raw:
        spec = FOREIGN_FIELDS.get(key)
        if spec is None or key in known:
            continue
        if spec.tier == "rejected":
            value = _VALUE.decode(raw[key]) if isinstance(raw, dict) else None
            if not any(value == h and type(value) is type(h) for h in spec.harmless):
                raise ApiError(400, f"`{key}` is not supported by Candor ({spec.reason}); "
                               "remove it rather than have it ignored", key,
                               "unsupported_field")
            notes.append(FieldNote(key, f"the value asks for Candor's own behaviour "
                                   f"({spec.reason})"))
        else:
            notes.append(FieldNote(key, spec.reason))
    return notes


def _report(raw_keys: Mapping[str, Any] | list[str],
            req: CompletionRequest | ChatCompletionRequest, api: ApiSpec) -> CandorReport:
    known = set(req.__struct_fields__)
    ignored = [FieldNote(f, _REASONS[f]) for f in ("user", "suffix")
               if f in known and getattr(req, f) is not None]
    ignored += _foreign_notes(raw_keys, known)
    ignored += [FieldNote(k, "not a field Candor knows") for k in raw_keys
                if k not in known and k not in FOREIGN_FIELDS]
    kind = "chat" if isinstance(req, ChatCompletionRequest) else "completions"
    tiers = field_tiers(kind, ApiSpec())
    extensions = [k for k in raw_keys if tiers.get(k) == "extension"]
    strict = api.strict or req.strict
    if strict and ignored:
        note = ignored[0]
        raise ApiError(400, f"`{note.field}` would be ignored ({note.reason}); strict mode "
                       "turns ignored fields into errors", note.field, "ignored_field")
    defaults = [FieldNote(k, f"omitted; default from {api.sampling_defaults.source}", to=v)
                for k, v in api.sampling_defaults.items().items() if k not in raw_keys]
    return CandorReport(ignored=ignored, extensions=extensions, defaults=defaults,
                        strict=strict)


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
            token_id = -1
        if not 0 <= token_id <= TOKEN_ID_MAX:
            raise ApiError(400, f"`logit_bias` keys must be token ids (0..{TOKEN_ID_MAX}), "
                           f"got {key[:40]!r}", "logit_bias", "invalid_value")
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


def _check_prompt_logprobs(req: CompletionRequest | ChatCompletionRequest) -> None:
    """vLLM's ``prompt_logprobs`` comes only in a whole response (its bound is checked
    with the other fan-out limits)."""
    if req.prompt_logprobs is not None and req.stream:
        raise ApiError(400, "`prompt_logprobs` is not available with `stream: true`",
                       "prompt_logprobs", "invalid_value")


def _sampling(req: CompletionRequest | ChatCompletionRequest,
              report: CandorReport) -> ipc.SamplingParams:
    """The request's sampling fields; one it omitted takes the deployment's default
    (``report.defaults``, from the checkpoint's generation_config.json) where there is
    one, else the API's."""
    logprobs, prompt_logprobs = _logprobs(req)
    d = {note.field: note.to for note in report.defaults}
    top_k = req.top_k if "top_k" not in d else d["top_k"]
    return ipc.SamplingParams(
        temperature=d.get("temperature", 1.0 if req.temperature is None else req.temperature),
        top_p=d.get("top_p", 1.0 if req.top_p is None else req.top_p),
        top_k=-1 if top_k in (None, 0) else top_k,
        seed=req.seed, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=d.get("repetition_penalty", req.repetition_penalty),
        min_p=d.get("min_p", req.min_p), logit_bias=_logit_bias(req), logprobs=logprobs,
        prompt_logprobs=prompt_logprobs)


def _detok(req: CompletionRequest | ChatCompletionRequest) -> ipc.DetokParams:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return ipc.DetokParams(stop=stop, include_stop_str_in_output=req.include_stop_str_in_output,
                           skip_special_tokens=req.skip_special_tokens,
                           return_token_ids=req.return_token_ids)


def _common(req: CompletionRequest | ChatCompletionRequest, rid: str, reply_to: str,
            arrival: float, report: CandorReport) -> dict[str, Any]:
    _check_stream_options(req)
    strict = report.strict
    return dict(rid=rid, reply_to=reply_to, sampling=_sampling(req, report),
                detok=_detok(req),
                stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
                min_tokens=req.min_tokens, arrival_time=arrival, priority=req.priority,
                cache_salt=req.cache_salt, strict=strict)


def _translated(gens: list[ipc.GenerateReq], req, report: CandorReport,
                echo: bool) -> Translated:
    return Translated(gens, req.n, req.n > 1 and gens[0].sampling.temperature == 0, report,
                      echo)


def prompt_list(req: CompletionRequest) -> list[str | list[int]]:
    """``prompt`` as a list of prompts: a string, a list of token ids, a list of strings
    or a list of token-id lists (one kind, every prompt non-empty)."""
    prompt = req.prompt
    if isinstance(prompt, str) or not prompt or all(isinstance(p, int) for p in prompt):
        prompts = [prompt]
    else:
        if len({type(p) for p in prompt}) != 1:
            raise ApiError(400, "`prompt` must be a string, a list of token ids, a list of "
                           "strings or a list of token-id lists, not a mix", "prompt",
                           "invalid_value")
        prompts = list(prompt)
    for i, p in enumerate(prompts):
        if not p:
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            raise ApiError(400, f"`{where}` must not be empty", where, "invalid_value")
    return prompts


# The legacy completions contract documents a default of 16 tokens; chat's default is
# "until the context is full", which is what None means downstream.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def completion_to_generate(req: CompletionRequest, rid: str, reply_to: str, arrival: float,
                           raw_keys: list[str] = (), api: ApiSpec | None = None) -> Translated:
    api = api or ApiSpec()
    limits.check_fields(req, api.limits)
    report = _report(raw_keys, req, api)
    _check_prompt_logprobs(req)
    prompts = prompt_list(req)
    max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    common = _common(req, rid, reply_to, arrival, report)
    guided = _constraint(req, None, report)
    gens = [ipc.GenerateReq(prompt=p, max_tokens=max_tokens, echo_prompt=req.echo,
                            guided=guided, **common) for p in prompts]
    return _translated(gens, req, report, req.echo)


def chat_to_generate(req: ChatCompletionRequest, rid: str, reply_to: str, arrival: float,
                     raw_keys: list[str] = (), api: ApiSpec | None = None) -> Translated:
    api = api or ApiSpec()
    limits.check_fields(req, api.limits)
    report = _report(raw_keys, req, api)
    _check_prompt_logprobs(req)
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
        if message.role in ("system", "developer", "user") and not (
                message.content or message.content == ""):
            raise ApiError(400, f"a {message.role} message needs `content` (a string or a "
                           "list of text parts)", f"messages[{i}].content", "invalid_value")
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
    plan = tool_plan(req, api)
    guided = _constraint(req, plan, report)
    common = _common(req, rid, reply_to, arrival, report)
    parser = plan.parser()
    if parser is not None:
        report.tool_parser = parser.name
        if parser.special_markers and "skip_special_tokens" not in raw_keys:
            # the parser's tags are special tokens: they must reach the text to be read
            common["detok"] = msgspec.structs.replace(common["detok"], skip_special_tokens=False)
    gen = ipc.GenerateReq(
        messages=messages, tools=plan.tools, add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        chat_template_kwargs=dict(req.chat_template_kwargs or {}),
        max_tokens=max_tokens, max_tokens_field=field, chat_template=req.chat_template,
        guided=guided, **common)
    out = _translated([gen], req, report, req.echo)
    out.tools = plan
    if api.reasoning_parser is not None and reasoning.get(api.reasoning_parser).active(
            gen.chat_template_kwargs):
        out.reasoning = report.reasoning_parser = api.reasoning_parser
        if gen.guided is not None:  # the constraint applies to the answer after <think>
            gen.guided = msgspec.structs.replace(gen.guided, reasoning=api.reasoning_parser)
    return out


def _constraint(req: CompletionRequest | ChatCompletionRequest, plan: ToolPlan | None,
                report: CandorReport) -> ipc.GuidedSpec | None:
    """The one grammar this request decodes under (tool_choice required/named or an
    output format), recorded in the report."""
    guided = guided_spec(req)
    if plan is not None and plan.guided is not None:
        if guided is not None:
            raise ApiError(400, f"`{guided.field}` cannot be combined with tool_choice "
                           f"{plan.mode!r}, which already constrains the output", guided.field,
                           "invalid_value")
        guided = plan.guided
    if guided is not None and req.ignore_eos:
        raise ApiError(400, "`ignore_eos` cannot be combined with a constraint: a finished "
                       "grammar allows only the end-of-sequence token", "ignore_eos",
                       "invalid_value")
    if guided is not None:
        report.constraint = guided.field
    return guided
